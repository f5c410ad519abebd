"""Handing a shared cache buffer's descriptor to a reader on this host that proves it may
read the prefill's memory.

Prefill side: :class:`Handover` (one per process) keeps each buffer's memfd in flight, out of
its fd table, and hands it over an abstract Unix socket only to a reader that answers a
challenge with a proof that only a process allowed to ``process_vm_readv`` the prefill can
read. Decode side: :func:`take`; every failure is a :class:`HostReadError`.

Design: docs/design/host-reads.md#handing-over-a-buffers-descriptor
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time

import numpy as np

from kvxfer.transfer.converted.host_reads import HostReadError, copy_vectors
from kvxfer.transfer.threads import DeferringLock
from kvxfer.wire.metadata import HostReads

log = logging.getLogger(__name__)

PROOF_BYTES = 32
CHALLENGE_BYTES = 16
ANSWER_BYTES = 8 + 32  # buffer id (little-endian), HMAC-SHA256
GIVEN, REFUSED, UNKNOWN = b"\x00", b"\x01", b"\x02"  # the prefill's one-byte replies
ANSWER_WITHIN_S = 1.0  # a connection that has not answered by then is closed
MAX_PENDING = 64  # connections waiting for an answer; beyond, the oldest is closed
TAKE_TIMEOUT_S = 5.0  # the reader's limit on each step
LOG_EVERY_S = 10.0
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def _peer_pid(conn: socket.socket) -> int:
    """The pid of the process at the other end of ``conn``, as the kernel reports it (the
    connecting one, or the one that listened)."""
    pid: int = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _PEERCRED.size))[0]
    return pid


def _mac(proof: bytes | bytearray, challenge: bytes, pid: int, buffer_id: int) -> bytes:
    message = b"kvxfer fd handover" + challenge + struct.pack("<QQ", pid, buffer_id)
    return hmac.new(proof, message, hashlib.sha256).digest()


class Handover:
    """This process's shared buffers, kept in flight by id, and the listener that hands
    them to readers that prove they may read this process. Thread-safe."""

    def __init__(self) -> None:
        # drop() is called by buffers' finalizers, inside any allocation of any thread,
        # this class's own locked sections included: it defers, never waits
        self._guard = DeferringLock(self._release)
        self._kept: dict[int, socket.socket] = {}
        self._ids = itertools.count(1)  # never reused: an id names one buffer for good
        self._proof = np.frombuffer(bytearray(secrets.token_bytes(PROOF_BYTES)), np.uint8)
        self._name = ""
        self._refused = 0
        self._logged = 0.0
        # a child forked from this process (not kvxfer's way: it spawns) keeps the buffers
        # but not the listener thread: it starts its own, with a proof of its own
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._guard.after_fork()
        self._proof = np.frombuffer(bytearray(secrets.token_bytes(PROOF_BYTES)), np.uint8)
        self._name = ""

    def keep(self, fd: int) -> int:
        """Keep descriptor ``fd`` in flight and close it (in every case); its buffer id."""
        try:
            sender, queue = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            os.close(fd)
            raise
        try:
            with sender:
                socket.send_fds(sender, [b"k"], [fd])
        except OSError:
            queue.close()
            raise
        finally:
            os.close(fd)
        with self._guard.held():
            buffer_id = next(self._ids)
            self._kept[buffer_id] = queue
        return buffer_id

    def drop(self, buffer_id: int) -> None:
        """Close buffer ``buffer_id``'s in-flight descriptor (a buffer freed): now, or
        when whoever holds the lock leaves it (never waits: see ``_guard``)."""
        self._guard.defer(buffer_id)

    def _release(self, buffer_id: int) -> None:
        queue = self._kept.pop(buffer_id, None)
        if queue is not None:
            queue.close()

    def __contains__(self, buffer_id: int) -> bool:
        with self._guard.held():
            return buffer_id in self._kept

    def address(self) -> tuple[str, int]:
        """(the listener's abstract socket name, the proof's address); the listener is
        started on the first call."""
        with self._guard.held():
            if not self._name:
                server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                name = f"\0kvxfer-handover-{os.getpid()}-{secrets.token_hex(12)}"
                server.bind(name)
                server.listen(MAX_PENDING)
                threading.Thread(target=self._serve, args=(server,), daemon=True,
                                 name="kvxfer-fd-handover").start()
                self._name = name
            return self._name, self._proof.ctypes.data

    # -- the listener thread ------------------------------------------------------------

    def _serve(self, server: socket.socket) -> None:
        """Accept and answer connections, each within ANSWER_WITHIN_S, for good: nothing a
        connection does ends the thread (a pass that failed is logged, the next one runs)."""
        chosen = selectors.DefaultSelector()
        chosen.register(server, selectors.EVENT_READ)
        waiting: dict[socket.socket, tuple[bytes, float]] = {}  # (challenge, deadline)
        while True:
            try:
                self._serve_once(server, chosen, waiting)
            except Exception:  # a bug: log it, keep serving
                log.exception("fd handover: the listener's pass failed")
                time.sleep(0.01)

    def _serve_once(self, server: socket.socket, chosen: selectors.BaseSelector,
                    waiting: dict[socket.socket, tuple[bytes, float]]) -> None:
        now = time.monotonic()
        for late in [c for c, (_, end) in waiting.items() if end <= now]:
            self._close(chosen, waiting, late, "it did not answer in time")
        timeout = min((end for _, end in waiting.values()), default=now + 60) - now
        for key, _ in chosen.select(max(timeout, 0.001)):
            if key.fileobj is server:
                self._accept(server, chosen, waiting)
                continue
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            if conn not in waiting:  # closed by this pass already (the oldest of too many)
                continue
            try:
                self._answer(conn, waiting[conn][0])
            except Exception:  # one connection's trouble, never the listener's end
                log.exception("fd handover: answering a connection failed")
            finally:
                self._close(chosen, waiting, conn)

    def _accept(self, server: socket.socket, chosen: selectors.BaseSelector,
                waiting: dict[socket.socket, tuple[bytes, float]]) -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        if len(waiting) >= MAX_PENDING:
            self._close(chosen, waiting, next(iter(waiting)), "too many were waiting")
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        try:
            conn.setblocking(False)
            conn.send(challenge)
        except OSError:
            conn.close()
            return
        waiting[conn] = (challenge, time.monotonic() + ANSWER_WITHIN_S)
        chosen.register(conn, selectors.EVENT_READ)

    def _close(self, chosen: selectors.BaseSelector,
               waiting: dict[socket.socket, tuple[bytes, float]], conn: socket.socket,
               why: str = "") -> None:
        if waiting.pop(conn, None) is None:
            return  # closed already
        if why:
            self._refuse(conn, why)
        chosen.unregister(conn)
        conn.close()

    def _answer(self, conn: socket.socket, challenge: bytes) -> None:
        """Hand the descriptor asked for to a connection that proved it may read this
        process; anything else gets at most an error byte."""
        try:
            answer = conn.recv(ANSWER_BYTES + 1)
            pid = _peer_pid(conn)
        except OSError:
            return
        if len(answer) != ANSWER_BYTES:
            self._refuse(conn, f"it sent {len(answer)} bytes, not an answer")
            return
        buffer_id = int.from_bytes(answer[:8], "little")
        if not hmac.compare_digest(answer[8:], _mac(self._proof.tobytes(), challenge, pid,
                                                    buffer_id)):
            self._refuse(conn, "its answer does not prove it may read this process", REFUSED)
            return
        with self._guard.held():  # drop() must not close the queue meanwhile
            queue = self._kept.get(buffer_id)
            if queue is None:
                self._reply(conn, UNKNOWN)
                return
            try:
                fd = _peek_fd(queue)
            except OSError as exc:
                log.warning("fd handover: buffer %d could not be taken out: %s", buffer_id, exc)
                return
            # the descriptor is in this process's table from here to the close below
            try:
                with contextlib.suppress(OSError):
                    socket.send_fds(conn, [GIVEN], [fd])
            finally:
                os.close(fd)

    def _refuse(self, conn: socket.socket, why: str, reply: bytes = b"") -> None:
        """Count a refused connection; one log line per LOG_EVERY_S at most."""
        if reply:
            self._reply(conn, reply)
        self._refused += 1
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            log.warning("fd handover: refused a connection (%s); %d refused so far", why,
                        self._refused)
            self._logged = now

    @staticmethod
    def _reply(conn: socket.socket, reply: bytes) -> None:
        with contextlib.suppress(OSError):
            conn.send(reply)


def _peek_fd(queue: socket.socket) -> int:
    """A copy of the descriptor in flight in ``queue``, which stays queued."""
    flags = socket.MSG_PEEK | socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
    _, ancillary, _, _ = queue.recvmsg(1, socket.CMSG_SPACE(4), flags)
    fds = _received(ancillary)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError(f"{len(fds)} descriptors queued, not one")
    return fds[0]


def _received(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)


HANDOVER = Handover()
"""This process's handover: its buffers (:func:`~kvxfer.transfer.converted.mapped_reads.
shared_zeros`) and its listener."""


# -- the decode side ----------------------------------------------------------------------

def take(offer: HostReads, buffer_id: int, timeout: float = TAKE_TIMEOUT_S) -> int:
    """The descriptor of buffer ``buffer_id`` of the offering process, taken over its
    handover socket with the proof read from its memory (so only a process that may
    read that memory gets it; the caller closes it), once the prefill closed its own
    copy. Raises :class:`HostReadError`."""
    proof = np.zeros(PROOF_BYTES, dtype=np.uint8)
    copy_vectors(offer.pid, np.array([[proof.ctypes.data, PROOF_BYTES]], dtype=np.uint64),
                 np.array([[offer.proof_addr, PROOF_BYTES]], dtype=np.uint64))
    where = f"buffer {buffer_id} of process {offer.pid}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(timeout)
        try:
            conn.connect(offer.handover)
            listener = _peer_pid(conn)
            if listener != offer.pid:  # a descriptor from it would be another's memory
                raise HostReadError(f"taking {where}: its handover socket is served by "
                                    f"process {listener}, not by {offer.pid}")
            challenge = conn.recv(CHALLENGE_BYTES + 1)
            if len(challenge) != CHALLENGE_BYTES:
                raise HostReadError(f"taking {where}: its handover socket sent no challenge")
            conn.send(struct.pack("<Q", buffer_id) +
                      _mac(proof.tobytes(), challenge, os.getpid(), buffer_id))
            reply, ancillary, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(4),
                                                  socket.MSG_CMSG_CLOEXEC)
            with contextlib.suppress(OSError):  # the prefill closes its copy, then this
                conn.recv(1)
        except OSError as exc:
            raise HostReadError(f"taking {where} over its handover socket: {exc}") from exc
        finally:
            proof[:] = 0
    fds = _received(ancillary)
    if reply == GIVEN and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    why = {REFUSED: "it refused the proof that this process may read it",
           UNKNOWN: "it holds no such buffer"}.get(reply, "it closed the connection")
    raise HostReadError(f"taking {where}: {why}")
