"""A decode's reservation: decoded strictly, signed over every field, bounded in time."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvxfer.wire.reservations import Reservation, ReservationError, parse_reservation

KEY = b"k" * 32


def reservation(**over: object) -> Reservation:
    fields: dict = {"reservation_id": "resv-1", "engine_id": "decode-1", "host": "10.0.0.2",
                    "port": 5600, "tp_size": 2, "block_ids": (4, 9, 1), "block_size": 16,
                    "num_tokens": 40, "expires_at": time.time() + 30}
    return Reservation(**{**fields, **over})  # type: ignore[arg-type]


def test_a_signed_reservation_verifies_and_survives_json() -> None:
    signed = reservation().signed(KEY)
    again = parse_reservation(msgspec.json.decode(msgspec.json.encode(signed)))
    assert again == signed
    again.check(KEY)
    reservation().check(None)  # no key: nothing to verify, only the deadline


@pytest.mark.parametrize("field", ["reservation_id", "engine_id", "host", "port", "tp_size",
                                   "block_ids", "block_size", "num_tokens", "expires_at"])
def test_every_field_is_signed(field: str) -> None:
    signed = reservation().signed(KEY)
    changed = {"reservation_id": "resv-2", "engine_id": "decode-2", "host": "10.0.0.3",
               "port": 5601, "tp_size": 1, "block_ids": (4, 9, 2), "block_size": 14,
               "num_tokens": 33, "expires_at": signed.expires_at + 1}[field]
    with pytest.raises(ReservationError, match="does not verify"):
        msgspec.structs.replace(signed, **{field: changed}).check(KEY)


def test_unsigned_wrongly_signed_and_expired_reservations_are_refused() -> None:
    with pytest.raises(ReservationError, match="ticket is missing"):
        reservation().check(KEY)
    with pytest.raises(ReservationError, match="does not verify"):
        reservation().signed(b"guess" * 8).check(KEY)
    with pytest.raises(ReservationError, match="expired"):
        reservation(expires_at=time.time() - 1).signed(KEY).check(KEY)


@pytest.mark.parametrize(("value", "says"), [
    ("not a mapping", "Expected `object`"),
    ({"reservation_id": "r"}, "missing required field"),
    ({**msgspec.to_builtins(reservation()), "block_ids": [1, 1, 2]}, "names a block twice"),
    ({**msgspec.to_builtins(reservation()), "block_ids": [1]}, "need 3"),
    ({**msgspec.to_builtins(reservation()), "port": 0}, "port"),
    ({**msgspec.to_builtins(reservation()), "block_ids": [-1, 2, 3]}, "block_ids"),
    ({**msgspec.to_builtins(reservation()), "tp_size": True}, "tp_size"),
    ({**msgspec.to_builtins(reservation()), "extra": 1}, "unknown field"),
    ({**msgspec.to_builtins(reservation()), "cached_tokens": 8}, "not a whole number"),
    ({**msgspec.to_builtins(reservation()), "cached_tokens": 48}, "short of the 40"),
    ({**msgspec.to_builtins(reservation()), "cached_tokens": 16}, "16 of them cached, need 2"),
    ({**msgspec.to_builtins(reservation()), "cached_tokens": -16}, "cached_tokens"),
])
def test_malformed_reservations_name_what_is_wrong(value: object, says: str) -> None:
    with pytest.raises(ReservationError, match=says):
        parse_reservation(value)


def test_a_reservation_past_a_cached_prefix_names_only_the_blocks_after_it() -> None:
    """The decode's prefix cache holds the first block: the reservation holds the other two,
    and its signature covers how many tokens are cached."""
    signed = reservation(block_ids=(9, 1), cached_tokens=16).signed(KEY)
    again = parse_reservation(msgspec.json.decode(msgspec.json.encode(signed)))
    assert again == signed and again.cached_tokens == 16
    again.check(KEY)
    moved = msgspec.structs.replace(signed, block_ids=(9,), cached_tokens=32)
    with pytest.raises(ReservationError, match="does not verify"):
        moved.check(KEY)
