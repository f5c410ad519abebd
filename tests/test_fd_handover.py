"""A shared cache buffer's descriptor handed over (:mod:`kvxfer.transfer.converted.fd_handover`),
between real processes over the real socket: a prefill process leaves no descriptor of its
cache where /proc shows it, hands one to a reader that proves it may read the prefill's
memory, and to nobody else, while it keeps serving."""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from stub_upstream import wait_until
from test_mapped_reads import cache_memfds

from kvxfer.harness.loopback import CacheConfig, PrefillProcess
from kvxfer.harness.preloaded import PreloadedProcess
from kvxfer.transfer.converted import fd_handover
from kvxfer.transfer.converted.fd_handover import (
    CHALLENGE_BYTES,
    GIVEN,
    MAX_PENDING,
    PROOF_BYTES,
    REFUSED,
    UNKNOWN,
    _mac,
    take,
)
from kvxfer.transfer.converted.host_reads import HostReadError, copy_vectors
from kvxfer.transfer.converted.mapped_reads import CACHE_MEMFD_NAME, _Mapping
from kvxfer.wire.metadata import HostReads

ROOT = Path(__file__).resolve().parent.parent

# A prefill in a process of its own: one shared buffer holding bytes 0..255 at its start,
# its offer on stdout; it runs until told to end (SIGTERM), then exits normally, having
# logged to stderr.
PREFILL = """
import logging, signal, sys
import msgspec, torch
from kvxfer.plan.regions import MemoryRegion
from kvxfer.transfer.converted.host_reads import Canary
from kvxfer.transfer.converted.mapped_reads import shared_offer, shared_zeros

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
buffer = shared_zeros(1 << 16)
buffer[:256] = torch.arange(256, dtype=torch.uint8)
canary = Canary()
offer = shared_offer(canary, [MemoryRegion(buffer.data_ptr(), 1 << 16, 0)])
sys.stdout.buffer.write(msgspec.json.encode(offer) + b"\\n")
sys.stdout.flush()
signal.sigwait({signal.SIGTERM})
"""


class Prefill:
    """``python -c PREFILL`` in a process of its own, forked from the preloaded server
    (:mod:`kvxfer.harness.preloaded`); its output goes to files in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.out, self.err = folder / "stdout", folder / "stderr"
        self.process = PreloadedProcess("-c", [PREFILL], os.environ, ROOT, self.out, self.err)
        wait_until(lambda: (self.out.exists() and self.out.read_bytes().endswith(b"\n"))
                   or self.process.poll() is not None, 60.0, "the prefill's offer")
        line = self.out.read_bytes()
        assert line, f"the prefill process printed no offer:\n{self.err.read_text()}"
        self.offer = msgspec.json.decode(line, type=HostReads)
        self.buffer_id = self.offer.memory[0].id

    def close(self) -> str:
        """End it; what it logged."""
        self.process.terminate()
        assert self.process.wait(30) == 0
        return self.err.read_text()


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Prefill]:
    made = Prefill(tmp_path)
    try:
        yield made
    finally:
        if made.process.poll() is None:
            made.process.kill()
            made.process.wait()


def read_proof(offer: HostReads) -> bytes:
    """The prefill's secret, as a reader that may read its memory reads it."""
    proof = np.zeros(PROOF_BYTES, dtype=np.uint8)
    copy_vectors(offer.pid, np.array([[proof.ctypes.data, PROOF_BYTES]], dtype=np.uint64),
                 np.array([[offer.proof_addr, PROOF_BYTES]], dtype=np.uint64))
    return proof.tobytes()


def ask(handover: str, answer: Callable[[bytes], bytes]) -> tuple[bytes, list[int]]:
    """Connect to socket ``handover``, send ``answer(challenge)``: (the reply byte, b""
    when closed; the descriptors received, closed here)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(10)
        conn.connect(handover)
        challenge = conn.recv(64)
        assert len(challenge) == CHALLENGE_BYTES
        conn.send(answer(challenge))
        reply, ancillary, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(4))
    fds = [fd for _, _, data in ancillary for fd in np.frombuffer(data, np.int32).tolist()]
    for fd in fds:
        os.close(fd)
    return reply, fds


def answer(buffer_id: int, proof: bytes, pid: int | None = None) -> Callable[[bytes], bytes]:
    return lambda challenge: struct.pack("<Q", buffer_id) + _mac(
        proof, challenge, os.getpid() if pid is None else pid, buffer_id)


def check_maps(offer: HostReads) -> None:
    """A reader that proves it may read the prefill maps its buffer, read-only."""
    mapping = _Mapping(offer, offer.memory[0], 0, 1 << 16)
    assert mapping.bytes[:256].tolist() == list(range(256))
    assert cache_memfds() == []  # mapped, its descriptor closed


def test_a_reader_that_may_read_the_prefill_maps_its_cache(child: Prefill) -> None:
    check_maps(child.offer)
    fd = take(child.offer, child.buffer_id)
    try:
        with pytest.raises(PermissionError):  # sealed: the prefill's own mapping alone writes
            os.pwrite(fd, b"x", 0)
        assert os.pread(fd, 4, 252) == bytes([252, 253, 254, 255])
    finally:
        os.close(fd)
    assert child.close() == ""  # nothing refused, nothing logged


def test_a_prefill_process_leaves_no_descriptor_of_its_cache_in_its_fd_table(
        child: Prefill) -> None:
    pid = child.process.pid
    with open(f"/proc/{pid}/maps") as maps:
        assert f"/memfd:{CACHE_MEMFD_NAME}" in maps.read()  # its cache is a shared buffer
    assert cache_memfds(pid) == []
    check_maps(child.offer)  # handing it over leaves none behind either
    assert cache_memfds(pid) == []


def test_a_prefill_sidecar_leaves_no_descriptor_of_its_cache_in_its_fd_table() -> None:
    """The loopback prefill (what test_transfer reads mapped caches from), TP 2."""
    process = PrefillProcess()
    try:
        process.create(CacheConfig(tp=2, shared_memory=True))
        pid = process.process.pid
        assert pid is not None
        with open(f"/proc/{pid}/maps") as maps:
            assert f"/memfd:{CACHE_MEMFD_NAME}" in maps.read()
        assert cache_memfds(pid) == []
    finally:
        process.close()


def test_no_descriptor_without_the_proof_and_the_listener_keeps_serving(
        child: Prefill) -> None:
    offer, buffer_id = child.offer, child.buffer_id
    proof = read_proof(offer)
    refused = [
        answer(buffer_id, secrets.token_bytes(PROOF_BYTES)),  # a guess
        answer(buffer_id, offer.canary.ljust(PROOF_BYTES, b"\0")),  # what the wire says
        # the right proof, answered for another process: what a reader tricked into
        # answering on someone else's socket would give that someone
        answer(buffer_id, proof, pid=os.getpid() + 1),
    ]
    for wrong in refused:
        assert ask(offer.handover, wrong) == (REFUSED, [])
        check_maps(offer)
    # proven, no such id
    assert ask(offer.handover, answer(buffer_id + 1000, proof)) == (UNKNOWN, [])
    for garbage in (b"", b"\x01", secrets.token_bytes(40 - 1), secrets.token_bytes(40 + 1),
                    secrets.token_bytes(4096)):
        assert ask(offer.handover, lambda _, g=garbage: g) == (b"", [])  # closed, nothing said
        check_maps(offer)
    reply, fds = ask(offer.handover, answer(buffer_id, proof))
    assert reply == GIVEN and len(fds) == 1
    logged = child.close()
    # one line for the lot (at most one per LOG_EVERY_S)
    assert logged.count("fd handover: refused a connection") == 1, logged


def test_silent_clients_block_no_one(child: Prefill) -> None:
    """More connections that say nothing than may wait at once: each is closed after
    ANSWER_WITHIN_S or when it is the oldest of too many, and a reader that answers is
    served meanwhile (were they served one after the other, the reader would wait 80
    times ANSWER_WITHIN_S, far beyond its own limit, TAKE_TIMEOUT_S)."""
    silent = []
    try:
        for _ in range(MAX_PENDING + 16):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.connect(child.offer.handover)
            silent.append(conn)
        fd = take(child.offer, child.buffer_id)
        os.close(fd)
        for conn in silent:  # the challenge, then the prefill closes the connection
            conn.settimeout(10 * fd_handover.ANSWER_WITHIN_S)
            assert len(conn.recv(64)) == CHALLENGE_BYTES
            assert conn.recv(64) == b""
    finally:
        for conn in silent:
            conn.close()
    check_maps(child.offer)


class _SlowSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The listener's selector, each wait begun late, as in a busy prefill: what happened
    meanwhile comes back from one wait together."""

    def select(self, timeout: float | None = None) -> list[Any]:
        time.sleep(0.2)
        return super().select(timeout)


def test_a_new_connection_and_an_answer_from_the_one_it_displaces_keep_the_listener(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At the limit of connections waiting, a new one closes the oldest; when that oldest
    answered in the same wait, the listener once handled the closed connection and died
    (anyone on the host could end it so). It must go on handing descriptors over."""
    monkeypatch.setattr(fd_handover, "MAX_PENDING", 1)
    monkeypatch.setattr(selectors, "DefaultSelector", _SlowSelector)
    handover = fd_handover.Handover()
    fd = os.memfd_create("kvxfer-test-handover")
    os.write(fd, b"kept")
    buffer_id = handover.keep(fd)
    name, proof_addr = handover.address()
    proof = np.zeros(PROOF_BYTES, dtype=np.uint8)
    copy_vectors(os.getpid(), np.array([[proof.ctypes.data, PROOF_BYTES]], dtype=np.uint64),
                 np.array([[proof_addr, PROOF_BYTES]], dtype=np.uint64))
    oldest = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    newer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        oldest.settimeout(10)
        oldest.connect(name)
        assert len(oldest.recv(64)) == CHALLENGE_BYTES
        newer.connect(name)  # both within the listener's next wait
        oldest.send(b"x" * 40)
        time.sleep(0.5)
        reply, fds = ask(name, answer(buffer_id, proof.tobytes()))
        assert reply == GIVEN and len(fds) == 1
    finally:
        oldest.close()
        newer.close()
        handover.drop(buffer_id)


def test_a_socket_served_by_another_process_hands_over_nothing(child: Prefill) -> None:
    """An offer that names the prefill's pid and proof but a socket another process
    serves (a squatted name): that process could hand over any memory as the prefill's
    cache. The reader must see it is not the prefill's and take nothing."""
    impostor = os.memfd_create("kvxfer-test-impostor")
    os.write(impostor, b"not the prefill's KV")
    name = f"\0kvxfer-test-squatter-{secrets.token_hex(8)}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(name)
    server.listen(1)
    server.settimeout(10)
    answered: list[bytes] = []

    def squat() -> None:  # whatever it is told, it hands its own memfd over
        with contextlib.suppress(OSError), server.accept()[0] as conn:
            conn.settimeout(10)
            conn.send(secrets.token_bytes(CHALLENGE_BYTES))
            answered.append(conn.recv(64))
            conn.sendmsg([GIVEN], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                    struct.pack("i", impostor))])

    thread = threading.Thread(target=squat, daemon=True)
    thread.start()
    try:
        offer = msgspec.structs.replace(child.offer, handover=name)
        with pytest.raises(HostReadError, match=f"served by process {os.getpid()}, not by "
                                                f"{child.offer.pid}"):
            take(offer, child.buffer_id, timeout=5)
        assert answered == []  # told nothing, not even an answer made with the proof
        check_maps(child.offer)  # the prefill's own socket still serves
    finally:
        server.close()
        thread.join(timeout=10)
        os.close(impostor)
