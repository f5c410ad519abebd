"""Sampling parameters and the per-token sampler.

Greedy when ``temperature`` is below :data:`GREEDY_BELOW` (dividing float32 logits
by a smaller one could overflow to inf); otherwise temperature, then nucleus (top-p)
filtering, then a draw from the request's own ``torch.Generator`` seeded from
``seed``, so a request's draws do not depend on what else is in the batch.
Log-probabilities are always ``log_softmax`` of the raw float32 logits, before
temperature or top-p.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
# Temperatures below this sample greedily (vLLM uses the same cut-off): logits / 1e-38
# overflow float32 and would turn the distribution into NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature`` 0 (the default) is greedy.

    ``stop`` strings end the output before the first occurrence of any of them;
    ``logprobs`` asks for that many top alternatives per token (the chosen token's
    logprob is always reported).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.logprobs is not None and (
                isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


@dataclass(frozen=True)
class Logprob:
    """The chosen token's log-probability and, if asked, the top alternatives
    as ``(token_id, logprob)`` pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's CPU generator (None when greedy); unseeded requests get a random seed."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed)


def skip_draw(generator: torch.Generator | None, vocab_size: int) -> None:
    """Advance ``generator`` past one :func:`sample` draw over ``vocab_size`` tokens
    without the logits: a decode that continues from a token the prefill drew keeps the
    request's random stream where one instance would have it. A draw consumes the same
    whatever the probabilities are, only their number counts (a test checks it for this
    torch)."""
    if generator is not None:
        torch.multinomial(torch.ones(vocab_size), 1, generator=generator)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest most-likely set whose mass reaches ``top_p``.

    The most likely token always stays, however small ``top_p`` is (a ``top_p``
    that rounds to 0 in float32 would otherwise zero every token)."""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    drop = mass_before >= top_p
    drop[0] = False
    sorted_probs[drop] = 0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> Logprob:
    """Pick one token from float32 CPU ``logits [vocab]``."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        probs = top_p_filter(torch.softmax(logits / params.temperature, dim=-1), params.top_p)
        token = int(torch.multinomial(probs, 1, generator=generator))
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs:
        values, ids = logprobs.topk(min(params.logprobs, logprobs.numel()))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return Logprob(token, float(logprobs[token]), top)
