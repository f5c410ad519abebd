"""``LLMEngine``: model + paged KV caches + scheduler + sampler behind one lock.

Threading: one stepping thread calls :meth:`step` while :meth:`has_work`; handlers add
requests (one method per kind of arrival: :meth:`add_request`, :meth:`add_held_request`,
:meth:`add_awaiting_kv`, :meth:`add_awaiting_kv_in`) and :meth:`abort` them; the sidecar's
roles read the caches and call :meth:`finish_kv_load` (decode) and :meth:`release`
(prefill). Every public method takes the engine lock, and a step holds it for its whole
forward. A held request keeps its blocks until :meth:`release`; one awaiting KV gets them
up front; a cached block is never written.

Design: docs/design/engine.md#llmengine-who-calls-what
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvxfer.engine.block_allocator import BlockAllocator, NoFreeBlocks
from kvxfer.engine.model_config import ModelConfig
from kvxfer.engine.model_names import TINY_MODEL, load_model
from kvxfer.engine.prefix_cache import PrefixCache
from kvxfer.engine.sampler import Logprob, SamplingParams, make_generator, sample, skip_draw
from kvxfer.engine.scheduler import Scheduler
from kvxfer.engine.sequence import Request, RequestOutput, RequestState
from kvxfer.engine.tokenizer import ByteTokenizer, Tokenizer
from kvxfer.engine.transformer import Segment, Transformer, check_tp
from kvxfer.engine.weights import fingerprint, init_weights
from kvxfer.net.kv_events import BlockRemoved, BlockStored
from kvxfer.plan.layout import (
    CacheSpec,
    KVCacheLayout,
    allocate_kv_cache,
    default_layout,
)
from kvxfer.plan.packing import TOKEN_PACKING, check_packing
from kvxfer.plan.topology import rank_heads

logger = logging.getLogger(__name__)


def layer_name(layer: int) -> str:
    """The name a layer's KV cache view is registered under."""
    return f"model.layers.{layer}.self_attn"


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or its name; only float16/bfloat16/float32 are model dtypes."""
    allowed = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if isinstance(dtype, torch.dtype) and dtype in allowed.values():
        return dtype
    if isinstance(dtype, str) and dtype in allowed:
        return allowed[dtype]
    raise ValueError(f"dtype must be one of {', '.join(allowed)}, got {dtype!r}")


class LLMEngine:
    """A paged-KV inference engine for one model instance of ``tp`` in-process ranks."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor] | None = None, *,
                 seed: int = 0, tp: int = 1, layout: str | KVCacheLayout | None = None,
                 block_size: int = 16, num_blocks: int = 256,
                 dtype: torch.dtype | str = torch.float32, device: str = "cpu",
                 tokenizer: Tokenizer | None = None, model_name: str = TINY_MODEL,
                 kv_packing: str = TOKEN_PACKING, enable_prefix_caching: bool = False,
                 cache_zeros: Callable[[int], torch.Tensor] | None = None) -> None:
        check_tp(config, tp)
        self.config, self.tp, self.model_name = config, tp, model_name
        self.dtype = parse_dtype(dtype)
        self.layout = default_layout(layout)
        check_packing(kv_packing, self.layout)
        self.kv_packing = kv_packing
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        if self.tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} ids but the model's "
                             f"vocab_size is {config.vocab_size}")
        weights = state_dict if state_dict is not None else init_weights(config, seed)
        self.model_id = fingerprint(config, weights)
        self.model = Transformer(config, weights, tp=tp, dtype=self.dtype, device=device,
                                 kv_packing=kv_packing)
        self.prefix_cache = PrefixCache(num_blocks, block_size) if enable_prefix_caching \
            else None
        self.allocator = self.prefix_cache or BlockAllocator(num_blocks)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_buffers: list[torch.Tensor] = []
        self.kv_caches: list[dict[str, torch.Tensor]] = []
        for rank in range(tp):
            # cache_zeros(nbytes): where the cache's bytes come from (default: torch.zeros)
            raw, views = allocate_kv_cache(self.cache_spec(rank), num_blocks,
                                           config.num_hidden_layers, self.layout, device,
                                           zeros=cache_zeros)
            self.kv_buffers.append(raw)
            self.kv_caches.append({layer_name(i): v for i, v in enumerate(views)})
        self.max_model_len = min(config.max_position_embeddings, num_blocks * block_size)
        self.scheduler = Scheduler(self.allocator, block_size, self.prefix_cache)
        eos = set(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self._eos_ids = frozenset(eos)
        self._requests: dict[str, Request] = {}
        self._ended: list[Request] = []  # ended outside a step; reported by the next step
        self._lock = threading.RLock()
        # called as hook([(request id, block ids) of the batch], layer) once a forward's
        # layer wrote its K/V (a push mode prefill WRITEs it meanwhile); the engine's thread
        self.layer_hook: Callable[[list[tuple[str, list[int]]], int], None] | None = None
        self._ids = itertools.count()

    @classmethod
    def from_model_arg(cls, model: str | None, **kw: Any) -> LLMEngine:
        """A model name (``None`` is ``kvxfer-tiny``, seeded by ``seed``), a ``.gguf`` file
        or a checkpoint directory; see ``models.py``. Raises CheckpointError."""
        loaded = load_model(TINY_MODEL if model is None else model)
        if loaded.tokenizer is not None:
            kw.setdefault("tokenizer", loaded.tokenizer)
        kw.setdefault("model_name", loaded.name)
        return cls(loaded.config, loaded.state_dict, **kw)

    # -- introspection

    def cache_spec(self, rank: int) -> CacheSpec:
        """Rank ``rank``'s KV page shape: its share of the KV heads (for MLA, the one
        latent head that every rank holds)."""
        heads = rank_heads(rank, self.tp, self.config.num_key_value_heads)
        return CacheSpec(self.block_size, len(heads), self.config.cache_head_size, self.dtype,
                         latent=self.config.is_mla)

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        with self._lock:
            return self.allocator.num_used

    def prefix_cache_stats(self) -> tuple[int, int, int]:
        """Prefix cache totals: (tokens looked up, tokens found cached, blocks cached now,
        held or idle); zeros without a cache. Idle cached blocks count as free."""
        with self._lock:
            cache = self.prefix_cache
            return (0, 0, 0) if cache is None else (cache.queries, cache.hits, cache.num_cached)

    def take_cache_events(self) -> list[BlockStored | BlockRemoved]:
        """The prefix cache's changes since the last call (:meth:`PrefixCache.take_events`:
        the first call starts recording them); ``[]`` without a cache."""
        with self._lock:
            return [] if self.prefix_cache is None else self.prefix_cache.take_events()

    # -- requests

    def reserve_blocks(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Decode side, push mode: the blocks of a prompt's KV before its request comes,
        ``(cached, fresh)`` (:meth:`Scheduler.reserve`: the cached ones are never written);
        a request adopts both later (:meth:`add_awaiting_kv_in`), or
        :meth:`free_blocks` gives them back. NoFreeBlocks, and nothing held, when the
        fresh ones are not free."""
        with self._lock:
            return self.scheduler.reserve(list(prompt_token_ids))

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Return reserved blocks no request adopted, or blocks set aside
        (:meth:`set_aside_blocks`)."""
        with self._lock:
            self.allocator.free(block_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, first: Logprob | None = None) -> None:
        """Queue a request computed here. ``first``: its first output token, sampled
        elsewhere and answered already (:meth:`first_output`). ValueError for invalid
        input (a ``first`` that would end the request included: nothing is left to do)."""
        self._queue(request_id, prompt_token_ids, params, first, hold=False)

    def add_held_request(self, request_id: str, prompt_token_ids: list[int],
                         params: SamplingParams) -> None:
        """Prefill side: queue a request whose blocks stay held once it finished (HELD),
        to be read or pushed, until :meth:`release`."""
        self._queue(request_id, prompt_token_ids, params, None, hold=True)

    def _queue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               first: Logprob | None, *, hold: bool) -> None:
        with self._lock:
            request = self._new_request(request_id, prompt_token_ids, params, first)
            request.hold_blocks = hold
            self.scheduler.add(request)
            self._requests[request_id] = request

    def add_awaiting_kv(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams, *, first: Logprob | None = None,
                        remote_block_size: int | None = None) -> None:
        """Decode side: take blocks for the whole prompt now and park the request until
        its KV is in them (:meth:`finish_kv_load`); its cached prefix ends on a multiple of
        ``remote_block_size`` (the prefill's; default this engine's). NoFreeBlocks, with
        nothing allocated, when its blocks are not free."""
        with self._lock:
            request = self._new_request(request_id, prompt_token_ids, params, first)
            if not self.scheduler.take_blocks(request, remote_block_size):
                raise NoFreeBlocks(self.scheduler.blocks_for(len(request.prompt_token_ids)),
                                   self.allocator.num_free)
            request.state = RequestState.WAITING_FOR_KV
            self._requests[request_id] = request

    def add_awaiting_kv_in(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, blocks: Sequence[int], num_cached: int,
                           *, first: Logprob | None = None) -> None:
        """Decode side, push mode: park the request in ``blocks`` (:meth:`reserve_blocks`,
        one per prompt block, those of its first ``num_cached`` tokens cached), which it
        owns from here, until its KV was written into them (:meth:`finish_kv_load`)."""
        with self._lock:
            request = self._new_request(request_id, prompt_token_ids, params, first)
            self.scheduler.adopt(request, blocks, num_cached)
            request.state = RequestState.WAITING_FOR_KV
            self._requests[request_id] = request

    def _new_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, first: Logprob | None) -> Request:
        """A checked request (caller holds the lock); ValueError when it is invalid."""
        prompt = self._check_request(request_id, prompt_token_ids, params)
        request = Request(request_id, prompt, params,
                          detokenizer=self.tokenizer.detokenizer(prompt),
                          generator=make_generator(params))
        if first is not None:
            request.start_with(first, self._eos_ids, self.config.vocab_size)  # answered
            skip_draw(request.generator, self.config.vocab_size)
            if request.finished:
                raise ValueError(f"request {request_id!r}: its first token ends it "
                                 f"({request.finish_reason}); nothing is left to compute")
        return request

    def first_output(self, request_id: str, prompt_token_ids: Sequence[int],
                     params: SamplingParams, first: Logprob) -> RequestOutput:
        """What a request given its ``first`` token answers at once, before any KV is read:
        what :meth:`step` would report after sampling it (:meth:`Request.start_with`, whose
        ValueError it raises). Touches no engine state: any thread may call it."""
        prompt = list(prompt_token_ids)
        request = Request(request_id, prompt, params,
                          detokenizer=self.tokenizer.detokenizer(prompt), generator=None)
        return request.start_with(first, self._eos_ids, self.config.vocab_size)

    def check_request(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams) -> None:
        """Raise ValueError as :meth:`add_request` would for invalid input; changes nothing."""
        with self._lock:
            self._check_request(request_id, prompt_token_ids, params)

    def _check_request(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> list[int]:
        if isinstance(request_id, str) and request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return checked_prompt(request_id, prompt_token_ids, params, self.config,
                              self.max_model_len)

    def _get(self, request_id: str) -> Request:
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return request

    def block_ids(self, request_id: str) -> list[int]:
        """The blocks ``request_id`` holds now (position ``p`` in ``[p // block_size]``)."""
        with self._lock:
            return list(self._get(request_id).block_ids)

    def num_cached_tokens(self, request_id: str) -> int:
        """Leading tokens of ``request_id`` whose KV came from the prefix cache (0
        without one): its first ``num_cached // block_size`` blocks hold it already."""
        with self._lock:
            return self._get(request_id).num_cached

    def kv_tokens_needed(self, request_id: str) -> int:
        """How many leading prompt tokens' KV an awaiting-KV request needs to run: all but
        the last (its logits sample the first token), all when it was given that token."""
        with self._lock:
            return _kv_needed(self._get(request_id))

    def finish_kv_load(self, request_id: str, ok: bool, *, recompute: bool = True,
                       reason: str = "") -> None:
        """Decode side: the KV READ for an awaiting-KV request ended.

        ``ok``: the KV of its first :meth:`kv_tokens_needed` tokens is in its blocks.
        Otherwise recompute the prompt past its cached prefix in the same blocks, or
        (``recompute`` False) finish with ``finish_reason="error"`` and ``reason``,
        freeing the blocks.
        """
        with self._lock:
            request = self._get(request_id)
            if request.state is not RequestState.WAITING_FOR_KV:
                raise ValueError(f"request {request_id!r} is {request.state.value}, "
                                 f"not waiting for KV")
            if ok or recompute:
                request.num_computed = _kv_needed(request) if ok else request.num_cached
                self.scheduler.start_running(request)
                return
            self._end(request, "error", reason or "KV transfer failed")

    def set_aside_blocks(self, request_id: str) -> list[int]:
        """Decode side, before ``finish_kv_load(ok=False)`` or :meth:`abort`: a READ given
        up in flight may still write into the blocks of ``request_id`` past its cached
        prefix. They leave the request (it grows fresh ones if it is recomputed) and are
        returned still allocated: the caller gives them back with :meth:`free_blocks` once
        nothing can write into them."""
        with self._lock:
            request = self._get(request_id)
            if request.state is not RequestState.WAITING_FOR_KV:
                raise ValueError(f"request {request_id!r} is {request.state.value}, "
                                 f"not waiting for KV")
            keep = request.num_cached // self.block_size
            aside, request.block_ids = request.block_ids[keep:], request.block_ids[:keep]
            return aside

    def start_siblings(self, source_id: str, sibling_ids: Sequence[str]) -> None:
        """Decode side, ``n > 1``: start parked requests from ``source_id``'s loaded KV.

        One READ fills the source's blocks; each sibling (parked awaiting KV,
        the same prompt, blocks of its own) gets a local copy of the blocks holding the
        source's ``num_computed`` tokens on every rank, and runs from there exactly as
        if its own READ had ended (``finish_kv_load(ok=True)``), except for the blocks of
        its cached prefix (the source's own, shared). The copy goes through each
        layer's logical ``[B, H, N, C]`` view, so it is the same for every layout.
        The source must be running with nothing sampled yet (right after its
        ``finish_kv_load``). Raises ValueError, before copying anything, otherwise.
        """
        with self._lock:
            source = self._get(source_id)
            siblings = [self._get(i) for i in sibling_ids]
            _check_siblings(source, siblings)
            count = self.scheduler.blocks_for(source.num_computed)
            first = [s.num_cached // self.block_size for s in siblings]
            if count and siblings:
                _copy_blocks(self.kv_caches, [source.block_ids[k:count] for k in first],
                             [s.block_ids[k:count] for s, k in zip(siblings, first, strict=True)])
            for sibling in siblings:
                sibling.num_computed = source.num_computed
                self.scheduler.start_running(sibling)

    def release(self, request_id: str) -> None:
        """Prefill side: free a HELD request's blocks (every reader is done)."""
        with self._lock:
            request = self._get(request_id)
            if request.state is not RequestState.HELD:
                raise ValueError(f"request {request_id!r} is {request.state.value}, not held")
            self.allocator.free(request.block_ids)
            request.block_ids = []
            del self._requests[request_id]

    def abort(self, request_id: str) -> bool:
        """End a request in any state and free its blocks; False if the id is unknown
        (it may have finished already). A request that had not finished reports
        ``finish_reason="abort"`` from the next step."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return False
            if request.state is RequestState.HELD:
                self.release(request_id)
            elif not request.finished:
                self.scheduler.remove(request)
                self._end(request, "abort", None)
            return True

    def _end(self, request: Request, reason: str, error: str | None) -> None:
        """Finish a request outside a step: free its blocks, report it next step."""
        request.finish_reason, request.error = reason, error
        request.state = RequestState.FINISHED
        self.allocator.free(request.block_ids)
        request.block_ids = []
        self._ended.append(request)

    # -- stepping

    def has_work(self) -> bool:
        """Something to compute or report (parked and held requests do not count)."""
        with self._lock:
            return bool(self._ended or self.scheduler.waiting or self.scheduler.running)

    def step(self) -> list[RequestOutput]:
        """One batched forward over every scheduled request; outputs of this step.

        Returns ``[]`` when nothing could be scheduled (idle, or waiting for blocks
        that held or parked requests own).
        """
        with self._lock:
            outputs = [self._report(r) for r in self._ended]
            self._ended.clear()
            batch = self.scheduler.schedule()
            if not batch:
                return outputs
            try:
                logits = self._forward(batch).cpu()
            except Exception as exc:  # a failed forward fails its requests, not the engine
                logger.exception("forward pass failed for %d requests", len(batch))
                for request in batch:
                    self.scheduler.remove(request)
                    self._end(request, "error", f"forward pass failed: {exc}")
                outputs += [self._report(r) for r in self._ended]
                self._ended.clear()
                return outputs
            for request, row in zip(batch, logits, strict=True):
                request.num_computed = request.num_tokens
                self.scheduler.offer_final_blocks(request)
                try:
                    request.append_token(sample(row, request.params, request.generator),
                                         self._eos_ids)
                except Exception as exc:  # one request's bad draw fails only that request
                    logger.exception("sampling failed for request %s", request.request_id)
                    self.scheduler.remove(request)
                    self._end(request, "error", f"sampling failed: {exc}")
                    continue  # reported by the next step, with the other ended requests
                if request.finished:
                    self._finish(request)
                outputs.append(self._report(request))
            return outputs

    def _forward(self, batch: list[Request]) -> torch.Tensor:
        on_layer = None if self.layer_hook is None else functools.partial(
            self.layer_hook, [(r.request_id, r.block_ids) for r in batch])
        tokens: list[int] = []
        segments = []
        for request in batch:
            new = request.token_ids[request.num_computed:]
            tokens += new
            table = torch.tensor(request.block_ids, dtype=torch.int64,
                                 device=self.model.device)
            segments.append(Segment(request.num_computed, len(new), (table,) * self.tp))
        caches = [list(rank.values()) for rank in self.kv_caches]
        return self.model.forward(torch.tensor(tokens, dtype=torch.int64), segments, caches,
                                  on_layer)

    def _finish(self, request: Request) -> None:
        """A request sampled its last token: hold its blocks or free them."""
        self.scheduler.remove(request)
        if request.hold_blocks:
            request.state = RequestState.HELD
            return
        request.state = RequestState.FINISHED
        self.allocator.free(request.block_ids)
        request.block_ids = []

    def _report(self, request: Request) -> RequestOutput:
        output = request.take_output()
        if request.state is RequestState.FINISHED:
            self._requests.pop(request.request_id, None)
        return output

    # -- offline helper

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; one cumulative output per prompt, in order
        (its ``new_*`` fields and ``logprobs`` cover the whole completion)."""
        return _generate(self, prompts, params)


def _generate(engine: LLMEngine, prompts: Sequence[Sequence[int]],
              params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
    """:meth:`LLMEngine.generate` (its own requests, stepped until they all finished)."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) \
        else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
    ids = [f"generate-{next(engine._ids)}" for _ in prompts]
    added: list[str] = []
    try:
        for request_id, prompt, p in zip(ids, prompts, per_prompt, strict=True):
            engine.add_request(request_id, list(prompt), p)
            added.append(request_id)
    except Exception:
        for request_id in added:
            engine.abort(request_id)
        raise
    requests = {i: engine._requests[i] for i in ids}
    work = sum(len(p) + q.max_tokens for p, q in zip(prompts, per_prompt, strict=True))
    # Every step computes at least one token unless preemptions recompute; this
    # bound is far above any real schedule and only guards against a hang.
    for _ in range(10 * work + 100):
        if all(r.finished for r in requests.values()):
            break
        if not engine.step():
            break  # nothing schedulable: only a release or abort could change that
    stuck = [i for i, r in requests.items() if not r.finished]
    if stuck:
        raise RuntimeError(f"requests {stuck} cannot be scheduled: held or parked "
                           f"requests own the KV blocks they need")
    return [requests[i].cumulative() for i in ids]


def checked_prompt(request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                   config: ModelConfig, max_model_len: int) -> list[int]:
    """The prompt as a list; ValueError for a bad id, params or token id, or a request
    longer than ``max_model_len`` tokens."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"request {request_id!r}: params must be SamplingParams, "
                         f"got {type(params).__name__}")
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    vocab = config.vocab_size
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"request {request_id!r}: token id {token!r} is not in "
                             f"[0, {vocab})")
    total = len(prompt) + params.max_tokens
    if total > max_model_len:
        limit = ("max_position_embeddings" if max_model_len ==
                 config.max_position_embeddings else "KV cache capacity")
        raise ValueError(f"request {request_id!r}: {len(prompt)} prompt tokens + max_tokens "
                         f"{params.max_tokens} = {total} exceeds the {limit} of "
                         f"{max_model_len} tokens")
    return prompt


def _kv_needed(request: Request) -> int:
    """See :meth:`LLMEngine.kv_tokens_needed`."""
    return len(request.prompt_token_ids) - (0 if request.output_token_ids else 1)


def _copy_blocks(kv_caches: list[dict[str, torch.Tensor]], src: list[list[int]],
                 dst: list[list[int]]) -> None:
    """Copy KV blocks ``src[i][k]`` -> ``dst[i][k]`` in every layer of every rank (see
    :meth:`LLMEngine.start_siblings`)."""
    src_ids = torch.tensor([b for blocks in src for b in blocks], dtype=torch.int64)
    dst_ids = torch.tensor([b for blocks in dst for b in blocks], dtype=torch.int64)
    for rank in kv_caches:
        for view in rank.values():
            at_src, at_dst = src_ids.to(view.device), dst_ids.to(view.device)
            view[at_dst] = view[at_src]  # in place through the (strided) view


def _check_siblings(source: Request, siblings: list[Request]) -> None:
    """ValueError unless ``siblings`` may start from ``source``'s KV (see
    :meth:`LLMEngine.start_siblings`)."""
    if source.state is not RequestState.RUNNING or source.output_token_ids:
        raise ValueError(f"request {source.request_id!r} is {source.state.value} with "
                         f"{len(source.output_token_ids)} tokens sampled: siblings start "
                         f"only from a request whose KV load just ended")
    for sibling in siblings:
        if sibling.state is not RequestState.WAITING_FOR_KV:
            raise ValueError(f"sibling {sibling.request_id!r} is {sibling.state.value}, "
                             f"not waiting for KV")
        if sibling.prompt_token_ids != source.prompt_token_ids:
            raise ValueError(f"sibling {sibling.request_id!r} has another prompt than "
                             f"{source.request_id!r}")
