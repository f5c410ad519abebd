"""Work split between the calling thread and a pool of copy threads.

A copy (a READ on a lane's agent, a host read, a mapped read) is cut into shares; the
calling thread takes the first, the pool the others (:func:`run_all`), or every thread
takes the next share not yet taken until none is left (:func:`run_pulled`). Every share
must have ended before the caller moves on, also when one failed: a share still running
may still be writing into blocks the caller is about to free or report.

And :class:`DeferringLock`, for state that finalizers change.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


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


class DeferringLock(Generic[T]):
    """A lock for state that finalizers change (``weakref.finalize`` callbacks, run by the
    garbage collector inside whatever code allocated, on any thread, locks held): a
    finalizer :meth:`defer` s its change instead of waiting for the lock, which its own
    thread may hold (a wait there never ends). The change, ``apply(item)``, runs under
    the lock at once where the lock is free, else when its holder leaves :meth:`held`:
    every item deferred while someone held the lock is applied by that holder (or a
    later one) on the way out."""

    def __init__(self, apply: Callable[[T], object]) -> None:
        self._lock = threading.Lock()
        self._deferred: queue.SimpleQueue[T] = queue.SimpleQueue()  # put() is reentrant
        self._apply = apply

    @contextmanager
    def held(self) -> Iterator[None]:
        """The lock, with every change deferred before it was taken applied (so that the
        body never sees one pending), and those deferred while it was held applied on
        the way out, whatever the body raised."""
        try:
            with self._lock:
                self._apply_deferred()
                yield
        finally:
            self.run_deferred()

    def defer(self, item: T) -> None:
        """Apply ``item`` now if the lock is free, else leave it to the lock's holder.
        Never waits: safe in a finalizer."""
        self._deferred.put(item)
        self.run_deferred()

    def run_deferred(self) -> None:
        while not self._deferred.empty():
            if not self._lock.acquire(blocking=False):
                return  # its holder runs them when it leaves held()
            try:
                self._apply_deferred()
            finally:
                self._lock.release()

    def after_fork(self) -> None:
        """In a child just forked: a new lock (the old one may be held by a thread the
        child does not have), the deferred changes kept and applied."""
        self._lock = threading.Lock()
        self.run_deferred()

    def _apply_deferred(self) -> None:
        """Apply every deferred change (the lock held)."""
        while True:
            try:
                item = self._deferred.get_nowait()
            except queue.Empty:
                return
            try:
                self._apply(item)
            except Exception:  # one change failed: the others still apply
                log.exception("a deferred change failed")
