"""``Claimers``: the prefills that claimed a push-mode decode's reservations, and whether
each still runs.

A prefill claims a reservation before its first WRITE, naming its own side channel; the
decode's listener hands that over (:meth:`Claimers.heard`, its thread). A reservation
whose writers have not said their WRITEs ended by its deadline plus the grace keeps its
blocks out of use (:class:`~kvxfer.sidecar.kv_pushes.KVPushes`): over TCP, what a cut
link held back lands once it is back, and only the writer can tell when its WRITEs
ended. A writer that no longer runs will never tell; its WRITEs ended with its process.
:meth:`Claimers.gone` says so, from probes of the claimer's side channel run on a pool
thread (at most one per claimer every :data:`PROBE_EVERY_S`): gone when it refuses
connections (its host answers, nothing listens) or another engine answers there (it
restarted). No answer at all (the link may be cut) proves nothing: the blocks wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvxfer.transfer.side_channel.errors import PeerUnreachable

if TYPE_CHECKING:
    from kvxfer.transfer.side_channel.client import HandshakeClient

log = logging.getLogger(__name__)

PROBE_EVERY_S = 2.0  # a claimer is asked at most this often whether it still runs
PROBE_TIMEOUT_S = 2.0  # an answer later than this counts as none
KEPT = 1024  # claimers remembered (the oldest is forgotten first)


@dataclass
class _Probe:
    """What is known of one claimer: the probe on its way, when the next is due, and
    since when and why it is gone (monotonic time)."""

    running: Future[str | None] | None = None
    next_at: float = 0.0
    gone: tuple[str, float] | None = None


class Claimers:
    """See the module docstring; ``client`` is used by the pool thread alone."""

    def __init__(self, client: HandshakeClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._at: OrderedDict[str, tuple[str, int]] = OrderedDict()  # engine -> side channel
        self._probes: OrderedDict[str, _Probe] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvxfer-claimers")

    def heard(self, engine_id: str, side_channel: tuple[str, int]) -> None:
        """Listener thread: prefill ``engine_id`` claimed a reservation, answering at
        ``side_channel``."""
        with self._lock:
            self._at[engine_id] = side_channel
            self._at.move_to_end(engine_id)
            while len(self._at) > KEPT:
                self._at.popitem(last=False)

    def gone(self, engine_id: str) -> tuple[str, float] | None:
        """Engine loop: why claimer ``engine_id`` is known gone, and since when (monotonic);
        None while that is not known (a probe is started when one is due)."""
        probe = self._probes.setdefault(engine_id, _Probe())
        self._probes.move_to_end(engine_id)
        while len(self._probes) > KEPT:
            self._probes.popitem(last=False)
        now = time.monotonic()
        if probe.running is not None and probe.running.done():
            why = probe.running.result()
            probe.running = None
            if why is not None:
                log.warning("prefill %s, which claimed reservations here, %s", engine_id, why)
                probe.gone = (why, now)
        if probe.gone is not None or probe.running is not None or now < probe.next_at:
            return probe.gone
        with self._lock:
            at = self._at.get(engine_id)
        if at is not None:
            probe.next_at = now + PROBE_EVERY_S
            probe.running = self._pool.submit(self._probe, engine_id, at)
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def _probe(self, engine_id: str, at: tuple[str, int]) -> str | None:
        """Pool thread: why ``engine_id`` no longer runs at ``at``, or None (it answered
        as itself, or nothing answered)."""
        host, port = at
        try:
            answer = self._client.fetch(host, port, [0], timeout=PROBE_TIMEOUT_S, retries=0)
        except PeerUnreachable as exc:
            return f"no longer runs: {exc}"
        except Exception as exc:  # no answer (a cut link?), or a refusal: proves nothing
            log.debug("probing prefill %s at %s:%d: %s", engine_id, host, port, exc)
            return None
        if answer.engine_id != engine_id:
            return (f"no longer runs: engine {answer.engine_id} answers at its side channel "
                    f"{host}:{port} now")
        return None
