"""``Claimers``: the prefills that claimed a push-mode decode's reservations, and whether
each still runs.

A prefill claims a reservation before its first WRITE, naming its own side channel; the
decode's listener hands that over (:meth:`Claimers.heard`, its thread). A reservation
whose writers have not said their WRITEs ended by its deadline plus the grace keeps its
blocks out of use (:class:`~kvxfer.sidecar.roles.push_decode.PushDecode`): over TCP, what a cut
link held back lands once it is back, and only the writer can tell when its WRITEs
ended. A writer that no longer runs will never tell; its WRITEs ended with its process.
:meth:`Claimers.gone` says so, from heartbeats sent to the claimer's side channel on a
pool thread (at most one per claimer every :data:`PROBE_EVERY_S`; a heartbeat changes
nothing on the prefill). Only an address that once answered as the claimer counts (the
first one an engine named, checked when it is heard): it is gone once that address
refuses connections (its host answers, nothing listens) or another engine answers there
(it restarted). No answer, an unreachable network, a name that does not resolve: none of
them proves anything (the link may be cut), and the blocks wait.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvxfer.transfer.side_channel.client import SideChannelClient

log = logging.getLogger(__name__)

PROBE_EVERY_S = 2.0  # a claimer is asked at most this often whether it still runs
PROBE_TIMEOUT_S = 2.0  # an answer later than this counts as none
KEPT = 1024  # claimers remembered (the oldest is forgotten first)


@dataclass
class _Claimer:
    """One claimer: where it answers, whether it once answered there as itself, the
    probe on its way, when the next is due, and since when and why it is gone."""

    at: tuple[str, int]
    seen: bool = False
    running: Future[str | None] | None = None
    next_at: float = 0.0
    gone: tuple[str, float] | None = None


class Claimers:
    """See the module docstring; ``client`` is used by the pool thread alone; a claimer is
    probed at most every ``probe_every`` seconds."""

    def __init__(self, client: SideChannelClient, probe_every: float = PROBE_EVERY_S) -> None:
        self._client, self._probe_every = client, probe_every
        self._lock = threading.Lock()
        self._claimers: OrderedDict[str, _Claimer] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvxfer-claimers")

    def heard(self, engine_id: str, side_channel: tuple[str, int]) -> None:
        """Listener thread: prefill ``engine_id`` claimed a reservation, answering at
        ``side_channel``; the first address an engine named is kept, and checked."""
        with self._lock:
            if engine_id in self._claimers:
                return
            claimer = self._claimers[engine_id] = _Claimer(side_channel)
            while len(self._claimers) > KEPT:
                self._claimers.popitem(last=False)
            claimer.running = self._pool.submit(self._probe, engine_id, claimer)

    def gone(self, engine_id: str) -> tuple[str, float] | None:
        """Engine loop: why claimer ``engine_id`` is known gone, and since when (monotonic);
        None while that is not known (a probe is started when one is due)."""
        with self._lock:
            claimer = self._claimers.get(engine_id)
            if claimer is None:
                return None
            now = time.monotonic()
            if claimer.running is not None and claimer.running.done():
                why = claimer.running.result()
                claimer.running = None
                if why is not None:
                    log.warning("prefill %s, which claimed reservations here, %s",
                                engine_id, why)
                    claimer.gone = (why, now)
            if claimer.gone is None and claimer.running is None and now >= claimer.next_at:
                claimer.next_at = now + self._probe_every
                claimer.running = self._pool.submit(self._probe, engine_id, claimer)
            return claimer.gone

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def _probe(self, engine_id: str, claimer: _Claimer) -> str | None:
        """Pool thread: why ``engine_id`` no longer runs where it answered, or None."""
        host, port = claimer.at
        try:
            answering = self._client.who(host, port, timeout=PROBE_TIMEOUT_S)
        except Exception as exc:  # a refusal is checked below; the rest proves nothing
            if claimer.seen and _refused(host, port):
                return f"no longer runs: nothing listens at its side channel {host}:{port}"
            log.debug("probing prefill %s at %s:%d: %s", engine_id, host, port, exc)
            return None
        if answering == engine_id:
            claimer.seen = True
            return None
        if claimer.seen:
            return (f"no longer runs: engine {answering} answers at its side channel "
                    f"{host}:{port} now")
        return None


def _refused(host: str, port: int) -> bool:
    """Whether a TCP connect to ``host:port`` is refused: the host answers, nothing
    listens on the port."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
