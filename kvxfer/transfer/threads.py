"""Work split between the calling thread and a pool of copy threads.

A copy (a READ on a lane's agent, a host read, a mapped read) is cut into shares; the
calling thread takes the first, the pool the others. Every share must have ended before
the caller moves on, also when one failed: a share still running may still be writing
into blocks the caller is about to free or report.
"""

from __future__ import annotations

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
