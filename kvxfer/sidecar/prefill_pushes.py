"""``PrefillPushes``: a prefill's requests whose KV is pushed into decode reservations.

Push mode, the prefill's side. Owned by the prefill's
:class:`~kvxfer.sidecar.connector.KVConnector`; every method runs on the engine loop's
thread (the layer hook inside the engine's step). Who calls what:

* the loop, for a request whose ``kv_transfer_params`` bring a reservation:
  :meth:`PrefillPushes.expect`;
* the engine, after each layer of a forward wrote its K/V: :meth:`PrefillPushes.on_layer`
  (:attr:`LLMEngine.layer_hook`). The first layer of an expected request starts its push
  on every rank (:meth:`~kvxfer.transfer.worker.TransferWorker.start_push`: a lease of
  its blocks, under a fresh lease id), and every layer is handed to it
  (``push_layers``): its WRITEs go out while the next layers compute;
* the connector, when the request finished and its blocks are held:
  :meth:`PrefillPushes.seal` (a push that never started starts now; every layer not
  handed is written then); the push ends the lease, and the connector frees the blocks
  as for any lease;
* the loop, when the request ended otherwise (aborted, failed): :meth:`PrefillPushes.give_up`:
  the push tells the decode it failed; its lease's end frees nothing (the engine freed
  the blocks with the request), :meth:`PrefillPushes.ended_unheld` says so.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvxfer.transfer.worker import TransferWorker
    from kvxfer.wire.reservations import Reservation

log = logging.getLogger(__name__)


class PrefillPushes:
    """See the module docstring."""

    def __init__(self, workers: list[TransferWorker], key: bytes | None) -> None:
        self._workers, self._key = workers, key
        self.answers_at: tuple[str, int] = ("", 0)  # the side channel claims name (once up)
        self._expected: dict[str, Reservation] = {}  # request id -> reservation, not started
        self._started: dict[str, str] = {}  # request id -> lease id
        self._orphans: dict[str, int] = {}  # a given-up push's lease -> ranks to report it

    def check(self, reservation: Reservation) -> None:
        """Before the request is computed: a reservation this instance would not write
        into (forged, signed with another key, expired) fails it with a 400 that says
        why (:class:`~kvxfer.wire.reservations.ReservationError`), instead of a prompt
        computed for nothing and a decode told the push failed."""
        reservation.check(self._key)

    def expect(self, request_id: str, reservation: Reservation) -> None:
        self._expected[request_id] = reservation

    def on_layer(self, batch: list[tuple[str, list[int]]], layer: int) -> None:
        """Engine hook: ``layer`` of the requests in ``batch`` (ids, blocks) is computed."""
        for request_id, block_ids in batch:
            reservation = self._expected.pop(request_id, None)
            if reservation is not None:
                self._start(request_id, reservation, block_ids)
            lease_id = self._started.get(request_id)
            if lease_id is not None:
                for worker in self._workers:
                    worker.push_layers(lease_id, range(layer, layer + 1))

    def seal(self, request_id: str, block_ids: list[int]) -> str:
        """The request finished, its blocks held: finish its push; the push's lease id."""
        reservation = self._expected.pop(request_id, None)
        if reservation is not None:  # no layer was computed for it (never happens today)
            self._start(request_id, reservation, block_ids)
        lease_id = self._started.pop(request_id)
        for worker in self._workers:
            worker.seal_push(lease_id)
        return lease_id

    def give_up(self, request_id: str) -> None:
        """The request ended without its blocks held: its push fails (if it started)."""
        self._expected.pop(request_id, None)
        lease_id = self._started.pop(request_id, None)
        if lease_id is None:
            return
        self._orphans[lease_id] = len(self._workers)
        for worker in self._workers:
            worker.seal_push(lease_id, ok=False)

    def ended_unheld(self, lease_id: str) -> bool:
        """A rank ended lease ``lease_id``: whether it is a given-up push's (its end frees
        nothing; forgotten once every rank reported it)."""
        left = self._orphans.get(lease_id)
        if left is None:
            return False
        if left <= 1:
            del self._orphans[lease_id]
        else:
            self._orphans[lease_id] = left - 1
        return True

    def _start(self, request_id: str, reservation: Reservation, block_ids: list[int]) -> None:
        lease_id = secrets.token_urlsafe(16)
        for worker in self._workers:
            worker.start_push(lease_id, reservation, block_ids, self.answers_at)
        self._started[request_id] = lease_id
        log.debug("request %s: pushing into reservation %s (lease %s)", request_id,
                  reservation.reservation_id, lease_id)
