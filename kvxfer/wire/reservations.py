"""``Reservation``: the decode blocks a prefill may WRITE one prompt's KV into (push mode).

Pure: msgspec and the standard library, no I/O. Signed like a lease ticket. ``expires_at``
is seconds since the epoch on the decode's clock: the prefill claims the reservation before
its first WRITE and posts none at or after it; an unclaimed one is freed
:data:`PUSH_GRACE_S` after it.

Design: docs/design/push.md#reservations
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
from msgspec import Meta

from kvxfer.wire.params import FirstToken
from kvxfer.wire.tickets import TicketError, mac_text, verify_mac

RESERVATION_KEY = "kv_reservation"
"""The ``kv_transfer_params`` key that carries a reservation to the prefill."""

RESERVATION_ID_KEY = "kv_reservation_id"
"""The ``kv_transfer_params`` key that names the reservation a decode request uses."""

PUSH_GRACE_S = 10.0
"""Seconds a decode keeps an unfinished reservation's blocks past its deadline."""

_DOMAIN = b"kvxfer reservation v1"  # keeps a reservation MAC apart from lease tickets
_MAX_BLOCK_ID = 2**63 - 1

_Name = Annotated[str, Meta(min_length=1, max_length=256)]
_Port = Annotated[int, Meta(ge=1, le=65535)]
_Positive = Annotated[int, Meta(ge=1)]
_BlockId = Annotated[int, Meta(ge=0, le=_MAX_BLOCK_ID)]
_Count = Annotated[int, Meta(ge=0, le=2**62)]


class ReservationError(ValueError):
    """A reservation that does not decode, verify or still hold; the message says which."""


class Reservation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode ``engine_id`` (side channel at ``host``:``port``, ``tp_size`` ranks) holds
    ``block_ids`` (logical blocks of ``block_size`` tokens) for the first ``num_tokens``
    tokens of one prompt's KV, under id ``reservation_id``, until ``expires_at``; signed
    by ``ticket`` when the instances share a key. ``cached_tokens``: the decode's prefix
    cache holds the KV of that many leading tokens (whole blocks of its own) already:
    ``block_ids`` start after them, and a prefill writes none of them."""

    reservation_id: _Name
    engine_id: _Name
    host: _Name
    port: _Port
    tp_size: _Positive
    block_ids: tuple[_BlockId, ...]
    block_size: _Positive
    num_tokens: _Positive
    expires_at: float
    cached_tokens: _Count = 0
    ticket: str | None = None

    def __post_init__(self) -> None:
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ReservationError("block_ids names a block twice")
        if self.cached_tokens % self.block_size or self.cached_tokens >= self.num_tokens:
            raise ReservationError(
                f"cached_tokens {self.cached_tokens} is not a whole number of "
                f"{self.block_size}-token blocks short of the {self.num_tokens} tokens")
        need = -(-self.num_tokens // self.block_size) - self.cached_tokens // self.block_size
        if need != len(self.block_ids):
            raise ReservationError(
                f"block_ids has {len(self.block_ids)} blocks, but "
                f"{self.num_tokens} tokens of {self.block_size}-token blocks, "
                f"{self.cached_tokens} of them cached, need {need}")

    def signed_bytes(self) -> bytes:
        """What the ticket's HMAC covers: every field but the ticket."""
        return _DOMAIN + msgspec.msgpack.encode(
            (self.reservation_id, self.engine_id, self.host, self.port, self.tp_size,
             list(self.block_ids), self.block_size, self.num_tokens, float(self.expires_at),
             self.cached_tokens))

    def signed(self, key: bytes | None) -> Reservation:
        """This reservation with its ticket (unchanged without a key)."""
        return self if key is None else msgspec.structs.replace(
            self, ticket=mac_text(key, self.signed_bytes()))

    def check(self, key: bytes | None, now: float | None = None) -> None:
        """Raise :class:`ReservationError` unless a prefill may write into it now: its
        ticket verifies with ``key`` (:meth:`verify`) and ``now`` (the epoch, default
        the clock) is before its deadline."""
        self.verify(key)
        now = time.time() if now is None else now
        if now >= self.expires_at:
            raise ReservationError(f"kv_reservation {self.reservation_id} expired "
                                   f"{now - self.expires_at:.1f} s ago")

    def verify(self, key: bytes | None) -> None:
        """Raise :class:`ReservationError` unless its ticket verifies with ``key`` (when
        there is one): a decode with that key issued it as it is."""
        if key is not None:
            if self.ticket is None:
                raise ReservationError("kv_reservation.ticket is missing: this instance only "
                                       "writes into reservations a decode with its key signed")
            try:
                verify_mac(key, self.signed_bytes(), self.ticket)
            except TicketError as exc:
                raise ReservationError(f"kv_reservation.ticket does not verify ({exc}): it "
                                       f"was altered, or not issued by a decode that shares "
                                       f"this instance's key") from exc

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_reservation(value: object) -> Reservation:
    """A reservation from the JSON value a request carried (a mapping), strictly:
    :class:`ReservationError` names what is wrong."""
    try:
        return msgspec.convert(value, Reservation, strict=True)
    except msgspec.ValidationError as exc:
        raise ReservationError(f"kv_reservation: {exc}") from exc


class PushedParams(msgspec.Struct, frozen=True):
    """A decode request's ``kv_transfer_params`` in push mode: the reservation its
    prompt's KV is written into (``kv_reservation_id``) and the prefill's first token, as
    :class:`~kvxfer.wire.params.RemoteParams` brings it in pull mode. Other keys are
    ignored (a request carries ``do_remote_prefill`` beside them)."""

    kv_reservation_id: _Name
    first_token: FirstToken | None = None

    @classmethod
    def parse(cls, kv: object) -> PushedParams:
        try:
            return msgspec.convert(kv, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise ReservationError(f"kv_transfer_params: {exc}") from exc
