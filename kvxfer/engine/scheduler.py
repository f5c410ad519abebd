"""First-come-first-served scheduling of requests onto KV cache blocks.

Each :meth:`Scheduler.schedule` picks the requests of one batched forward: every
running request (its next token, or its prompt right after admission or a KV
load) and then waiting requests in arrival order while their blocks fit. A
running request that needs a new block when none is free takes it from the most
recently admitted running request, which is preempted: its blocks are freed and
it waits at the head of the queue to be recomputed from scratch.
"""

from __future__ import annotations

from collections import deque

from kvxfer.engine.block_allocator import BlockAllocator
from kvxfer.engine.sequence import Request, RequestState


class Scheduler:
    """Owns the waiting queue and the running list (in admission order)."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
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
            needed = max(0, self.blocks_for(request.num_tokens) - len(request.block_ids))
            if needed > self.allocator.num_free:
                break  # strict FCFS: later requests wait behind the head
            request.block_ids += self.allocator.allocate(needed)
            self.waiting.popleft()
            self.start_running(request)
            scheduled.append(request)
        return scheduled

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
        request.num_computed = 0
        request.state = RequestState.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
