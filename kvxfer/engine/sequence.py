"""A request's state: its tokens, its blocks, how much of it is computed, its text.

States: WAITING, RUNNING, FINISHED, HELD (``hold_blocks``: blocks kept until released) and
WAITING_FOR_KV (awaiting KV: blocks allocated up front). Invariant: the cache holds the KV
of the first ``num_computed`` tokens of ``token_ids`` in ``block_ids`` (position ``p`` in
block ``block_ids[p // block_size]``); the first ``num_cached`` tokens' blocks came from the
prefix cache and are never written by this request.

Design: docs/design/engine.md#a-requests-lifecycle
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvxfer.engine.sampler import Logprob, SamplingParams
from kvxfer.engine.tokenizer import IncrementalDetokenizer


class RequestState(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    HELD = "held"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one ``step()`` produced for one request.

    ``new_*`` fields cover this step only; ``token_ids``/``text`` everything so far.
    ``logprobs`` has one entry per new token. ``block_ids`` are the blocks the
    request holds after this step (kept for a HELD request, empty once freed).
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    new_text: str
    text: str
    logprobs: list[Logprob]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "error" | "abort"
    error: str | None
    num_prompt_tokens: int
    block_ids: list[int]


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    hold_blocks: bool = False
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0  # leading tokens whose KV blocks came from the prefix cache
    num_offered_blocks: int = 0  # leading blocks offered to the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # of full token blocks, so far
    text: str = ""
    num_text_sent: int = 0   # characters of ``text`` already returned as new_text
    num_tokens_sent: int = 0  # output tokens already returned as new_token_ids
    finish_reason: str | None = None
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_output(self) -> RequestOutput:
        """The output since the last call. Text that could still turn into a stop
        string is held back until the request finishes."""
        hold = 0 if self.finished else max((len(s) - 1 for s in self.params.stop), default=0)
        visible = max(len(self.text) - hold, self.num_text_sent)
        new_text = self.text[self.num_text_sent:visible]
        new_tokens = self.output_token_ids[self.num_tokens_sent:]
        new_logprobs = self.logprobs[self.num_tokens_sent:]
        self.num_text_sent = visible
        self.num_tokens_sent = len(self.output_token_ids)
        return RequestOutput(
            request_id=self.request_id, new_token_ids=new_tokens,
            token_ids=list(self.output_token_ids), new_text=new_text, text=self.text[:visible],
            logprobs=new_logprobs, finished=self.finished, finish_reason=self.finish_reason,
            error=self.error, num_prompt_tokens=len(self.prompt_token_ids),
            block_ids=list(self.block_ids))

    def start_with(self, first: Logprob, eos_ids: frozenset[int], vocab_size: int
                   ) -> RequestOutput:
        """Take ``first``, sampled elsewhere, as the first output token, and return the
        output that answers it (so it is not reported again). ValueError for ids outside
        ``[0, vocab_size)`` or another number of top log-probabilities than asked for."""
        ids = [first.token_id, *(token for token, _ in first.top)]
        if not all(0 <= token < vocab_size for token in ids):
            raise ValueError(f"request {self.request_id!r}: the first token's ids {ids} are "
                             f"not all in [0, {vocab_size})")
        wanted = min(self.params.logprobs or 0, vocab_size)
        if len(first.top) != wanted:
            raise ValueError(f"request {self.request_id!r}: the first token comes with "
                             f"{len(first.top)} top log-probabilities, the request asks "
                             f"for {wanted}")
        self.append_token(first, eos_ids)
        return self.take_output()

    def cumulative(self) -> RequestOutput:
        """The whole completion as one output (its ``new_*`` fields cover all of it)."""
        return RequestOutput(
            request_id=self.request_id, new_token_ids=list(self.output_token_ids),
            token_ids=list(self.output_token_ids), new_text=self.text, text=self.text,
            logprobs=list(self.logprobs), finished=True, finish_reason=self.finish_reason,
            error=self.error, num_prompt_tokens=len(self.prompt_token_ids),
            block_ids=list(self.block_ids))

    def append_token(self, logprob: Logprob, eos_ids: frozenset[int]) -> None:
        """Add a sampled token; set ``finish_reason`` if it ends the request."""
        self.output_token_ids.append(logprob.token_id)
        self.logprobs.append(logprob)
        before = len(self.text)
        self.text += self.detokenizer.step(logprob.token_id)
        if self._cut_at_stop_string(before):
            self.finish_reason = "stop"
            return  # the text ends before the stop string; nothing held back matters
        if logprob.token_id in eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finished:
            self.text += self.detokenizer.flush()

    def _cut_at_stop_string(self, before: int) -> bool:
        """Truncate ``text`` before the earliest stop string that the new text completed."""
        if not self.params.stop:
            return False
        longest = max(len(s) for s in self.params.stop)
        first = max(0, before - longest + 1)
        hits = [i for i in (self.text.find(s, first) for s in self.params.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True
