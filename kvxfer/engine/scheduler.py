"""First-come-first-served scheduling of requests onto KV cache blocks.

Running requests first, then waiting ones in arrival order while their blocks fit; a running
request short of a block preempts the most recently admitted one, which is recomputed from
scratch.

Design: docs/design/engine.md#scheduling
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from kvxfer.engine.block_allocator import BlockAllocator, NoFreeBlocks
from kvxfer.engine.prefix_cache import PrefixCache, extend_hashes
from kvxfer.engine.sequence import Request, RequestState


class Scheduler:
    """Owns the waiting queue and the running list (in admission order)."""

    def __init__(self, allocator: BlockAllocator, block_size: int,
                 prefix_cache: PrefixCache | None = None) -> None:
        if prefix_cache is not None and prefix_cache is not allocator:
            raise ValueError("the prefix cache must be the allocator: they share one pool")
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def start_running(self, request: Request) -> None:
        """Run a request that already holds blocks for all its tokens (after a KV load)."""
        request.state = RequestState.RUNNING
        self.running.append(request)

    def remove(self, request: Request) -> None:
        """Drop a request from the queues (finished or aborted); its blocks stay as they are."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> list[Request]:
        """Requests to compute in this step; each gets blocks for all its tokens.

        A scheduled request computes ``token_ids[num_computed:]`` and samples one token.
        """
        scheduled = []
        for request in list(self.running):
            if request.state is not RequestState.RUNNING:
                continue  # preempted earlier in this loop
            if self._grow_or_preempt(request):
                scheduled.append(request)
        while self.waiting:
            request = self.waiting[0]
            if not self.take_blocks(request):
                break  # strict FCFS: later requests wait behind the head
            self.waiting.popleft()
            self.start_running(request)
            scheduled.append(request)
        return scheduled

    def take_blocks(self, request: Request, align: int | None = None) -> bool:
        """Give ``request``, which holds no blocks, blocks for all its tokens: first the
        cached blocks of its longest cached prefix (a multiple of ``align`` tokens,
        default one block), then free ones; ``num_computed`` = ``num_cached`` = the
        tokens they cover. False, and nothing taken, when they do not fit."""
        assert not request.block_ids, "take_blocks is for a request without blocks"
        hits = self._match(request, align or self.block_size)
        needed = self.blocks_for(request.num_tokens) - len(hits)
        if needed > self.allocator.num_free:
            self.allocator.free(hits)
            return False
        request.block_ids = hits + self.allocator.allocate(needed)
        request.num_computed = request.num_cached = len(hits) * self.block_size
        request.num_offered_blocks = len(hits)
        if self.prefix_cache is not None:
            self.prefix_cache.record(request.num_tokens - 1, request.num_cached)
        return True

    def reserve(self, prompt: list[int]) -> tuple[list[int], list[int]]:
        """Blocks for ``prompt``'s KV before its request comes (push mode), ``(cached,
        fresh)``: the cached blocks of its longest cached prefix short of its last token
        (its first output token is not known yet), now held, and free blocks for the rest.
        NoFreeBlocks, and nothing held, when those are not free. A lookup of every prompt
        token (a decode given the first token needs them all)."""
        cached = self.match(prompt, len(prompt) - 1)
        try:
            fresh = self.allocator.allocate(self.blocks_for(len(prompt)) - len(cached))
        except NoFreeBlocks:
            self.allocator.free(cached)
            raise
        if self.prefix_cache is not None:
            self.prefix_cache.record(len(prompt), len(cached) * self.block_size)
        return cached, fresh

    def adopt(self, request: Request, blocks: Sequence[int], num_cached: int) -> None:
        """Give ``request``, which holds no blocks, the blocks :meth:`reserve` returned for
        its prompt, the first ``num_cached`` tokens' cached; ValueError when they do not
        fit it."""
        assert not request.block_ids, "adopt is for a request without blocks"
        prompt = len(request.prompt_token_ids)
        if len(blocks) != self.blocks_for(prompt) or num_cached % self.block_size \
                or not 0 <= num_cached < prompt:
            raise ValueError(f"request {request.request_id!r}: {len(blocks)} reserved blocks "
                             f"for a {prompt}-token prompt, {num_cached} of its tokens cached")
        request.block_ids = list(blocks)
        request.num_computed = request.num_cached = num_cached
        request.num_offered_blocks = num_cached // self.block_size

    def _match(self, request: Request, align: int) -> list[int]:
        """The cached blocks of ``request``'s longest cached prefix that ends on a multiple
        of ``align`` tokens and before its last token (now held by it)."""
        return self.match(request.token_ids, request.num_tokens - 1, align,
                          request.block_hashes)

    def match(self, token_ids: list[int], within: int, align: int | None = None,
              hashes: list[bytes] | None = None) -> list[int]:
        """The cached blocks of the longest cached prefix of ``token_ids`` that ends on a
        multiple of ``align`` tokens (default one block) inside their first ``within``;
        now held by the caller (who frees them as its other blocks). ``hashes``: the
        chain hashes known so far, extended in place."""
        cache = self.prefix_cache
        if cache is None:
            return []
        unit = math.lcm(align or self.block_size, self.block_size) // self.block_size
        limit = within // self.block_size
        hashes = extend_hashes([] if hashes is None else hashes, token_ids, self.block_size,
                               limit)
        found = cache.lookup(hashes[:limit])
        return cache.match(hashes[:found - found % unit])

    def offer_final_blocks(self, request: Request) -> None:
        """Offer the prefix cache the full blocks of ``request`` whose KV is now final
        (all of their positions computed) and that were not offered yet."""
        cache = self.prefix_cache
        full = request.num_computed // self.block_size
        if cache is None or full <= request.num_offered_blocks:
            return
        tokens, first, size = request.token_ids, request.num_offered_blocks, self.block_size
        hashes = extend_hashes(request.block_hashes, tokens, size, full)
        cache.insert(hashes[first:full], request.block_ids[first:full],
                     tokens[first * size:full * size], hashes[first - 1] if first else None)
        request.num_offered_blocks = full

    def _grow_or_preempt(self, request: Request) -> bool:
        """Give ``request`` blocks for its tokens, preempting the newest running requests
        as needed. False if ``request`` itself had to be preempted."""
        needed = max(0, self.blocks_for(request.num_tokens) - len(request.block_ids))
        while needed > self.allocator.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return False
        request.block_ids += self.allocator.allocate(needed)
        return True

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and requeue it first, to recompute everything."""
        self.running.remove(request)
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.num_computed = request.num_cached = request.num_offered_blocks = 0
        request.state = RequestState.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
