"""Work split between the calling thread and a pool of copy threads.

A copy (a READ on a lane's agent, a host read, a mapped read) is cut into shares; the
calling thread takes the first, the pool the others (:func:`run_all`), or every thread
takes the next share not yet taken until none is left (:func:`run_pulled`). Every share
must have ended before the caller moves on, also when one failed: a share still running
may still be writing into blocks the caller is about to free or report.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


def run_all(calls: Sequence[Callable[[], T]], pool: Executor | None) -> list[T]:
    """Run ``calls[0]`` here and the others on ``pool`` (all here, in order, without one);
    their results once every one ended, or the first error raised once every one ended."""
    if pool is None:
        return [call() for call in calls]
    futures = [pool.submit(call) for call in calls[1:]]
    results: list[T] = []
    errors: list[BaseException] = []
    for call in calls[:1]:
        try:
            results.append(call())
        except Exception as exc:
            errors.append(exc)
    for future in futures:  # wait for every share: none may still write on failure
        try:
            results.append(future.result())
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return results


def run_pulled(calls: Sequence[Callable[[], object]], pool: Executor | None, threads: int
               ) -> None:
    """Run ``calls`` on ``threads`` threads (this one and ``threads - 1`` of ``pool``; this
    one alone without a pool), each taking the next call not yet taken until none is left,
    so that a thread slowed down (descheduled on a busy machine, a share of slower memory)
    takes fewer and all end about together: with one fixed share each, the copy lasts as
    long as its slowest thread's (measured on 2 cores: a mapped copy's two halves took 28
    and 20 ms). Returns once every call ended; raises the first error once every thread
    ended (a thread stops at its call's error, the others take what it left)."""
    taken = itertools.count()  # next() of a count is atomic: no two threads get one call

    def drain() -> None:
        while (i := next(taken)) < len(calls):
            calls[i]()

    run_all([drain] * max(1, min(threads if pool else 1, len(calls))), pool)
