"""run_pulled: every call runs once, a slowed thread takes fewer, errors wait for all."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvxfer.transfer.threads import DeferringLock, run_pulled


@pytest.fixture
def pool():
    with ThreadPoolExecutor(3) as executor:
        yield executor


def test_every_call_runs_once_across_the_threads(pool) -> None:
    ran: list[int] = []
    names: set[str] = set()
    lock = threading.Lock()

    def call(i: int) -> None:
        time.sleep(0.002)  # long enough that every thread gets some
        with lock:
            ran.append(i)
            names.add(threading.current_thread().name)

    run_pulled([lambda i=i: call(i) for i in range(40)], pool, 4)
    assert sorted(ran) == list(range(40))
    assert threading.current_thread().name in names and len(names) == 4


def test_a_slowed_thread_takes_fewer_calls(pool) -> None:
    here = threading.current_thread().name
    taken: dict[str, int] = {}
    lock = threading.Lock()

    def call() -> None:
        name = threading.current_thread().name
        time.sleep(0.05 if name == here else 0.005)  # this thread is ten times slower
        with lock:
            taken[name] = taken.get(name, 0) + 1

    run_pulled([call] * 24, pool, 2)
    # fixed halves would give each thread 12; pulled, the fast one takes most
    assert sum(taken.values()) == 24 and len(taken) == 2
    assert taken[here] < 12 < max(taken.values())


def test_without_a_pool_everything_runs_here_in_order() -> None:
    ran: list[tuple[int, str]] = []
    run_pulled([lambda i=i: ran.append((i, threading.current_thread().name))
                for i in range(5)], None, 4)
    assert ran == [(i, threading.current_thread().name) for i in range(5)]


def test_an_error_is_raised_once_every_call_ended(pool) -> None:
    ran: list[int] = []

    def call(i: int) -> None:
        if i == 3:
            raise ValueError("share 3 failed")
        time.sleep(0.005)
        ran.append(i)

    with pytest.raises(ValueError, match="share 3"):
        run_pulled([lambda i=i: call(i) for i in range(12)], pool, 2)
    # the failing thread stopped; the other took every call that was left
    assert sorted(ran) == [i for i in range(12) if i != 3]


def test_a_change_deferred_while_the_lock_is_held_applies_when_its_holder_leaves() -> None:
    """A finalizer's defer() on a thread that holds the lock returns at once (waiting
    there would never end); the holder applies the change on its way out; with the lock
    free, the change applies at once."""
    applied: list[int] = []
    guard = DeferringLock(applied.append)
    with guard.held():
        guard.defer(1)  # this thread holds the lock
        assert applied == []
    assert applied == [1]
    guard.defer(2)
    assert applied == [1, 2]
    quotients: list[int] = []
    failing = DeferringLock(lambda item: quotients.append(6 // item))
    with failing.held():
        failing.defer(0)  # fails (logged) when the holder leaves...
        failing.defer(3)
    assert quotients == [2]  # ...and the next still applies


def test_a_holder_sees_no_change_pending_and_a_failing_body_leaves_none() -> None:
    """Changes deferred before the lock is taken are applied before the body runs (a body
    must never see state a finalizer already changed, e.g. a freed buffer still listed);
    a body that raises still applies what was deferred meanwhile."""
    applied: list[int] = []
    guard = DeferringLock(applied.append)
    with guard.held():
        guard.defer(1)
    # as if another thread took the lock between a holder's release and its drain
    guard._deferred.put(2)
    with guard.held():
        assert applied == [1, 2]  # applied on the way in
    with pytest.raises(RuntimeError), guard.held():
        guard.defer(3)
        raise RuntimeError("the body failed")
    assert applied == [1, 2, 3]
