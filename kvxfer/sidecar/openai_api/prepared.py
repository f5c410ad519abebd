"""A validated request (:class:`Prepared`) and what validation knows of the instance
(:class:`ModelInfo`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvxfer.sidecar.request_kinds import PLAIN, Kind

if TYPE_CHECKING:
    from kvxfer.engine import SamplingParams, Tokenizer

SEED_LIMIT = 2**63


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model and instance."""

    served_names: tuple[str, ...]
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    block_size: int
    role: str
    num_blocks: int | None = None  # the KV cache's size; None: not checked


@dataclass(frozen=True)
class Prepared:
    """A validated request: token ids per prompt and everything to answer it.

    ``n`` choices per prompt: choice ``k`` answers prompt ``k // n`` (OpenAI's and
    vLLM's order). ``echo``: the text each prompt's choices start with (completions
    with ``echo: true``), else None. ``kind``: what the request asks of the transfers.
    """

    prompts: list[list[int]]
    params: SamplingParams
    model: str
    stream: bool
    include_usage: bool
    chat: bool
    logprobs: bool
    kind: Kind = PLAIN
    n: int = 1
    echo: list[str] | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choice_params(self, index: int) -> SamplingParams:
        """Sampling of choice ``index``: sample ``j = index % n`` of its prompt draws
        from seed ``seed + j`` (as vLLM seeds its ``n`` child requests), so seeded
        choices repeat across runs and differ from each other."""
        j = index % self.n
        if j == 0 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=choice_seed(self.params.seed, j))

    def echo_text(self, index: int) -> str:
        """What choice ``index``'s text starts with: its prompt under ``echo``, else ""."""
        return self.echo[index // self.n] if self.echo is not None else ""


def choice_seed(seed: int, j: int) -> int:
    """The seed of the ``j``-th sample of a request seeded ``seed`` (wraps below 2**63)."""
    return (seed + j) % SEED_LIMIT
