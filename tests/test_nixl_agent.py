"""``kvxfer.transfer.nixl_agent`` against real NIXL agents in separate OS processes.

A target process (spawned, as a prefill rank would be) registers a buffer
filled with a seeded pattern and progresses its agent every ~0.5 ms; it obeys
commands sent over a ``multiprocessing`` pipe, which also carries the agent
metadata (the ZMQ handshake belongs to another module). The test process reads
from it and checks bytes. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvxfer.harness import preloaded
from kvxfer.transfer import nixl_agent
from kvxfer.transfer.nixl_agent import (
    AgentClosedError,
    NixlAgent,
    NixlTransferError,
    NixlUnavailableError,
    Transfer,
)

TARGET_BYTES = 16 << 20
LOCAL_BYTES = 16 << 20
SEED = 7
REPLY_TIMEOUT_S = 20.0      # covers the child's start-up (interpreter, numpy, NIXL)
TARGET_LIFETIME_S = 120.0   # a child outliving a crashed test exits by itself
DEADLINE_S = 10.0


@dataclass(frozen=True)
class _Memory:
    """Same fields as ``kvxfer.plan.regions.MemoryRegion``; children use it to skip importing
    torch."""

    addr: int
    nbytes: int
    device_id: int = 0
    is_cuda: bool = False


def pattern(size: int = TARGET_BYTES, seed: int = SEED) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


def run_target(conn: Connection, name: str, pause_at_start: bool) -> None:
    """Child process: serve a patterned buffer and obey (command, *args) tuples."""
    agent = NixlAgent(name)
    data = pattern().copy()
    agent.register([_Memory(data.ctypes.data, data.nbytes)])
    conn.send((agent.metadata(), data.ctypes.data))
    received: list[tuple[str, bytes]] = []
    progressing = not pause_at_start
    deadline = time.monotonic() + TARGET_LIFETIME_S
    while time.monotonic() < deadline:
        if progressing:
            received += [(s, m) for s, ms in agent.get_notifs().items() for m in ms]
        if not conn.poll(0.0005):  # the wait doubles as the 0.5 ms progress cadence
            continue
        command, *args = conn.recv()
        if command == "stop":
            break
        try:
            if command == "add":
                conn.send(agent.add_remote(args[0]))
            elif command == "send":
                agent.send_notif(args[0], args[1])
                conn.send("sent")
            elif command == "notifs":
                conn.send(received)
                received = []
        except Exception as exc:
            conn.send(f"error: {exc}")
    agent.close()


@dataclass
class Target:
    name: str
    process: Any
    conn: Connection
    metadata: bytes
    addr: int

    def ask(self, *message: Any) -> Any:
        self.conn.send(message)
        assert self.conn.poll(REPLY_TIMEOUT_S), f"target {self.name} did not answer {message[0]}"
        return self.conn.recv()

    def notifs_until(self, count: int) -> list[tuple[str, bytes]]:
        """Notifications the target received, polled until ``count`` or the deadline."""
        got: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < count and time.monotonic() < deadline:
            got += self.ask("notifs")
            time.sleep(0.002)
        return got

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # the child may already be gone
                self.conn.send(("stop",))
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def start_target(name: str, pause_at_start: bool = False) -> Target:
    ctx = preloaded.context()  # a process of its own, forked preloaded
    parent, child = ctx.Pipe()
    process = ctx.Process(target=run_target, args=(child, name, pause_at_start), daemon=True)
    process.start()
    target = Target(name, process, parent, b"", 0)
    if not parent.poll(REPLY_TIMEOUT_S):
        target.stop()
        raise AssertionError(f"target {name} did not start within {REPLY_TIMEOUT_S} s")
    target.metadata, target.addr = parent.recv()
    return target


def target_memory(target: Target) -> Any:
    from kvxfer.plan.regions import MemoryRegion

    return MemoryRegion(addr=target.addr, nbytes=TARGET_BYTES, device_id=0)


def wait_done(transfer: Transfer, timeout_s: float = DEADLINE_S) -> str:
    deadline = time.monotonic() + timeout_s
    state = transfer.state()
    while state != "DONE" and time.monotonic() < deadline:
        time.sleep(0.0002)
        state = transfer.state()
    return state


def with_deadline(call: Callable[[], Any], timeout_s: float = DEADLINE_S) -> Any:
    """Run ``call`` in a thread; return its result or exception, fail the test if it hangs."""
    outcome: list[Any] = []

    def body() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the call did not return within {timeout_s} s"
    return outcome[0]


def rows(pairs: list[tuple[int, int]], base: int) -> np.ndarray:
    """``(offset, length)`` pairs as an N x 3 descriptor array at ``base``."""
    out = np.zeros((len(pairs), 3), dtype=np.uint64)
    for i, (offset, length) in enumerate(pairs):
        out[i] = (base + offset, length, 0)
    return out


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    started = start_target("target")
    try:
        yield started
    finally:
        started.stop()


@dataclass
class Reader:
    agent: NixlAgent
    buffer: np.ndarray
    remote: str
    remote_addr: int  # the target's patterned buffer

    @property
    def addr(self) -> int:
        return int(self.buffer.ctypes.data)


def new_reader(name: str) -> tuple[NixlAgent, np.ndarray]:
    from kvxfer.plan.regions import MemoryRegion

    buffer = np.zeros(LOCAL_BYTES, dtype=np.uint8)
    agent = NixlAgent(name)
    agent.register([MemoryRegion(addr=buffer.ctypes.data, nbytes=buffer.nbytes, device_id=0)])
    return agent, buffer


@pytest.fixture(scope="module")
def reader(target: Target) -> Iterator[Reader]:
    agent, buffer = new_reader("reader")
    try:
        remote = agent.add_remote(target.metadata)
        assert target.ask("add", agent.metadata()) == "reader"
        agent.connect(remote, probe=target_memory(target))
        yield Reader(agent, buffer, remote, target.addr)
    finally:
        agent.close()


# -- reads ------------------------------------------------------------------------------
def test_add_remote_returns_the_name_as_str(reader: Reader) -> None:
    assert reader.remote == "target"
    assert isinstance(reader.remote, str)


def test_random_non_adjacent_ranges_arrive_intact(reader: Reader) -> None:
    rng = np.random.default_rng(1)
    count, slot = 300, TARGET_BYTES // 300
    lengths = rng.integers(1, slot // 2, count)
    remote = [(i * slot + int(rng.integers(1, slot // 4)), int(n)) for i, n in enumerate(lengths)]
    slots = rng.permutation(count)  # local order differs from remote order
    local = [(int(s) * slot + 3, n) for s, (_, n) in zip(slots, remote, strict=True)]
    reader.buffer[:] = 0
    transfer = reader.agent.read(reader.remote, rows(local, reader.addr),
                                 rows(remote, reader.remote_addr))
    assert wait_done(transfer) == "DONE"
    transfer.release()
    expected, written = pattern(), np.zeros(LOCAL_BYTES, dtype=bool)
    for (lo, n), (ro, _) in zip(local, remote, strict=True):
        assert np.array_equal(reader.buffer[lo:lo + n], expected[ro:ro + n]), f"range at {ro}"
        written[lo:lo + n] = True
    assert not reader.buffer[~written].any(), "bytes outside the ranges were written"
    assert (transfer.num_bytes, transfer.num_descriptors) == (int(lengths.sum()), count)


def test_large_contiguous_range_arrives_intact(reader: Reader) -> None:
    size, remote_offset, local_offset = 12 << 20, 12345, 777
    reader.buffer[:] = 0
    transfer = reader.agent.read(reader.remote, rows([(local_offset, size)], reader.addr),
                                 rows([(remote_offset, size)], reader.remote_addr))
    assert wait_done(transfer) == "DONE"
    transfer.release()
    got = reader.buffer[local_offset:local_offset + size]
    assert np.array_equal(got, pattern()[remote_offset:remote_offset + size])
    assert transfer.num_bytes == size


def test_read_notification_reaches_the_target_exactly(reader: Reader, target: Target) -> None:
    target.ask("notifs")  # drain
    payload = b"req-42\x00\xffdone"
    transfer = reader.agent.read(reader.remote, rows([(0, 4096)], reader.addr),
                                 rows([(8192, 4096)], reader.remote_addr), notif=payload)
    assert wait_done(transfer) == "DONE"
    transfer.release()
    assert target.notifs_until(1) == [("reader", payload)]


def test_send_notif_works_both_ways(reader: Reader, target: Target) -> None:
    target.ask("notifs")
    reader.agent.send_notif(reader.remote, b"decode->prefill")
    assert target.notifs_until(1) == [("reader", b"decode->prefill")]

    assert target.ask("send", "reader", b"prefill->decode \x01") == "sent"
    # progress() must keep what it receives for get_notifs()
    for _ in range(100):
        reader.agent.progress()
        time.sleep(0.001)
    got: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + DEADLINE_S
    while not got and time.monotonic() < deadline:
        got = reader.agent.get_notifs()
        time.sleep(0.001)
    assert got == {"target": [b"prefill->decode \x01"]}


# -- validation -------------------------------------------------------------------------
GOOD = np.array([[0, 100, 0], [200, 50, 0], [400, 8, 0]], dtype=np.uint64)


def _with(row: int, col: int, value: int) -> np.ndarray:
    out = GOOD.copy()
    out[row, col] = value
    return out


@pytest.mark.parametrize(("local", "remote", "error", "message"), [
    (GOOD[:, :2], GOOD, ValueError, "shape (N, 3) (addr, len, device_id), got (3, 2)"),
    (GOOD, GOOD.astype(np.int64), ValueError, "remote_descs must have dtype uint64, got int64"),
    (GOOD.tolist(), GOOD, TypeError, "local_descs must be a numpy array, got list"),
    (GOOD, GOOD[:2], ValueError, "local_descs has 3 rows but remote_descs has 2"),
    (GOOD, _with(2, 1, 9), ValueError, "descriptor row 2: local length 8 != remote length 9"),
    (_with(1, 1, 0), _with(1, 1, 0), ValueError, "descriptor row 1 has length 0"),
    (GOOD[:0], GOOD[:0], ValueError, "at least one descriptor, got 0 rows"),
], ids=["shape", "dtype", "not-array", "row-count", "length-mismatch", "zero-length", "empty"])
def test_descriptor_validation_names_the_bad_value(reader: Reader, local: Any, remote: Any,
                                                   error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        reader.agent.read(reader.remote, local, remote)


def test_read_from_an_unknown_remote_names_it(reader: Reader) -> None:
    with pytest.raises(ValueError, match="no remote agent 'ghost'; known: \\['target'\\]"):
        reader.agent.read("ghost", GOOD, GOOD)
    with pytest.raises(ValueError, match="no remote agent 'ghost'"):
        reader.agent.connect("ghost")


def test_notif_must_be_bytes(reader: Reader) -> None:
    with pytest.raises(TypeError, match="notif must be bytes, got str"):
        reader.agent.read(reader.remote, rows([(0, 8)], reader.addr),
                          rows([(0, 8)], reader.remote_addr), notif="done")  # type: ignore[arg-type]


def test_read_outside_registered_remote_memory_names_the_remote(reader: Reader) -> None:
    beyond = rows([(TARGET_BYTES - 4, 8)], reader.remote_addr)  # straddles the end
    with pytest.raises(NixlTransferError, match=r"remote agent 'target'.*NIXL_ERR_NOT_FOUND"):
        reader.agent.read(reader.remote, rows([(0, 8)], reader.addr), beyond)


def test_register_rejects_a_bad_entry() -> None:
    from kvxfer.plan.regions import MemoryRegion

    with NixlAgent("bad-register") as agent, pytest.raises(ValueError, match="memory entry 1 "):
        agent.register([MemoryRegion(addr=4096, nbytes=64, device_id=0),
                        MemoryRegion(addr=8192, nbytes=0, device_id=0)])


# -- failures ---------------------------------------------------------------------------
def read_until_done(agent: NixlAgent, remote: str, local: np.ndarray, target: np.ndarray
                    ) -> str:
    transfer = agent.read(remote, local, target)
    try:
        return wait_done(transfer)
    finally:
        transfer.release()


def test_read_after_the_target_was_killed_raises_naming_it() -> None:
    victim = start_target("victim")
    agent, buffer = new_reader("reader-of-victim")
    try:
        remote = agent.add_remote(victim.metadata)
        agent.connect(remote, probe=target_memory(victim))
        local, far = rows([(0, 1 << 20)], buffer.ctypes.data), rows([(0, 1 << 20)], victim.addr)
        assert read_until_done(agent, remote, local, far) == "DONE"
        victim.process.kill()
        victim.process.join(5)
        outcome = with_deadline(lambda: read_until_done(agent, remote, local, far))
        assert isinstance(outcome, NixlTransferError), f"expected an error, got {outcome!r}"
        assert outcome.remote == "victim" and "'victim'" in str(outcome)
        assert outcome.state == "NIXL_ERR_REMOTE_DISCONNECT"
    finally:
        agent.close()
        victim.stop()


def test_read_in_flight_when_the_target_dies_fails_instead_of_hanging() -> None:
    # The target never progresses, so connect's warm-up READ and the first
    # READ stay in flight (the connection cannot wire up) until it is killed.
    victim = start_target("silent", pause_at_start=True)
    agent, buffer = new_reader("reader-of-silent")
    try:
        remote = agent.add_remote(victim.metadata)
        timeout = r"'silent' failed in state TIMEOUT: not done after 0\.3 s"
        with pytest.raises(NixlTransferError, match=timeout):
            agent.connect(remote, probe=target_memory(victim), timeout_s=0.3)
        transfer = agent.read(remote, rows([(0, 4096)], buffer.ctypes.data),
                              rows([(0, 4096)], victim.addr), notif=b"never")
        assert transfer.state() == "PROC"
        victim.process.kill()
        victim.process.join(5)
        outcome = with_deadline(lambda: wait_done(transfer))
        assert isinstance(outcome, NixlTransferError), f"expected an error, got {outcome!r}"
        assert outcome.remote == "silent" and outcome.state == "NIXL_ERR_REMOTE_DISCONNECT"
        with pytest.raises(NixlTransferError, match="'silent'"):  # the error sticks
            transfer.state()
        transfer.release()
        transfer.release()
    finally:
        agent.close()
        victim.stop()


# -- import shim and lifecycle ----------------------------------------------------------
def test_import_shim_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in nixl_agent.NIXL_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail
    with pytest.raises(NixlUnavailableError) as caught:
        nixl_agent.import_nixl()
    message = str(caught.value)
    assert "pip install nixl-cu12" in message and "pip install nixl-cu13" in message
    for name in nixl_agent.NIXL_MODULES:
        assert f"{name}: ModuleNotFoundError: import of {name} halted" in message


def test_close_is_idempotent_and_later_calls_name_the_agent(target: Target) -> None:
    agent, _ = new_reader("short-lived")
    remote = agent.add_remote(target.metadata)
    agent.connect(remote, probe=target_memory(target))
    agent.close()
    agent.close()
    with pytest.raises(AgentClosedError, match="'short-lived' is closed"):
        agent.metadata()
    with pytest.raises(AgentClosedError, match="'short-lived' is closed"):
        agent.get_notifs()


def test_close_releases_open_transfers_and_the_context_manager_closes(target: Target) -> None:
    with NixlAgent("scoped") as agent:
        from kvxfer.plan.regions import MemoryRegion

        buffer = np.zeros(4096, dtype=np.uint8)
        agent.register([MemoryRegion(addr=buffer.ctypes.data, nbytes=4096, device_id=0)])
        remote = agent.add_remote(target.metadata)
        transfer = agent.read(remote, rows([(0, 4096)], buffer.ctypes.data),
                              rows([(0, 4096)], target.addr))
        assert wait_done(transfer) == "DONE"
    assert np.array_equal(buffer, pattern()[:4096])
    with pytest.raises(AgentClosedError, match="'scoped'"):
        agent.send_notif(remote, b"x")
    transfer.release()  # already released by close(); still harmless


# -- both memory kinds, two agents in one process ----------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_read_between_two_agents_in_one_process(device: str) -> None:
    """The same path for host (DRAM) and device (VRAM) memory; both agents live in this thread."""
    import torch

    from kvxfer.plan.regions import MemoryRegion

    ordinal = torch.cuda.current_device() if device == "cuda" else 0
    source = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device=device)
    sink = torch.zeros_like(source)

    def region(tensor: torch.Tensor) -> MemoryRegion:
        return MemoryRegion(addr=tensor.data_ptr(), nbytes=tensor.numel(), device_id=ordinal,
                            is_cuda=tensor.is_cuda)

    with NixlAgent(f"{device}-target") as target, NixlAgent(f"{device}-reader") as reader:
        target.register([region(source)])
        reader.register([region(sink)])
        remote = reader.add_remote(target.metadata())
        pairs = [(64, 128, 4096), (1 << 20, 8192, 1 << 19)]  # (local, remote offset, length)
        local = np.array([[sink.data_ptr() + lo, n, ordinal] for lo, _, n in pairs], np.uint64)
        far = np.array([[source.data_ptr() + ro, n, ordinal] for _, ro, n in pairs], np.uint64)
        posted = time.monotonic()
        transfer = reader.read(remote, local, far, notif=f"{device} done".encode())
        deadline, state = time.monotonic() + DEADLINE_S, transfer.state()
        while state != "DONE" and time.monotonic() < deadline:
            target.progress()
            state = transfer.state()
        assert state == "DONE"
        # NIXL's telemetry of it, on the monotonic clock: posted after we called, done by now
        assert transfer.span is not None
        assert posted <= transfer.span[0] <= transfer.span[1] <= time.monotonic()
        transfer.release()
        if device == "cuda":
            torch.cuda.synchronize()
        for lo, ro, n in pairs:
            assert torch.equal(sink[lo:lo + n], source[ro:ro + n]), f"range at {ro}"
        assert not sink[:64].any() and not sink[64 + 4096:1 << 20].any()
        got: dict[str, list[bytes]] = {}
        while not got and time.monotonic() < deadline:
            got = target.get_notifs()
        assert got == {f"{device}-reader": [f"{device} done".encode()]}
