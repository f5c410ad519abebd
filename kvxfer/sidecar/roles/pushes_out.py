"""``PushesOut``: a prefill's requests whose KV is pushed into decode reservations.

The prefill side's push half (:class:`~kvxfer.sidecar.roles.prefill.PrefillSide` owns
it), on the engine loop's thread: :meth:`PushesOut.expect` a request before it is
computed, the engine's layer hook starts its push on every rank at its first layer and
hands each layer over as it is computed (its WRITEs go out while the next layers
compute), :meth:`PushesOut.seal` when it finished (the push then ends its lease, whose
end frees the blocks as any lease's), :meth:`PushesOut.give_up` when it ended otherwise
(the decode is told; that lease's end frees nothing). Design:
docs/design/sidecar-roles.md#pushes-out
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvxfer.transfer.worker import TransferWorker
    from kvxfer.wire.reservations import Reservation

log = logging.getLogger(__name__)


class PushesOut:
    """The pushes of a prefill's requests into decode reservations, over ``workers``."""

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
