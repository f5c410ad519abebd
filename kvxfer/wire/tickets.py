"""Lease tickets: the signature a prefill puts on the ``kv_transfer_params`` it hands out.

Pure: the standard library and msgspec, no I/O. An HMAC-SHA256 with the shared key over the
:class:`LeaseClaims` the params state (``lease_expires_at``: seconds since the epoch on the
prefill's clock). A ticket stops forgery and alteration, not replay (the decode's lease book
does).

Design: docs/design/leases.md#lease-tickets
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

import msgspec

TICKET_KEY = "lease_ticket"
"""The ``kv_transfer_params`` key that carries the ticket (not one of vLLM's keys)."""

TICKET_PREFIX = "kvxt1."
"""Ticket format version: the prefix, then the URL-safe base64 of the 32-byte HMAC."""

_DOMAIN = b"kvxfer lease ticket v1"  # keeps a ticket MAC apart from side-channel MACs


class TicketError(ValueError):
    """A ticket is missing, malformed or does not verify; the message says which."""


@dataclass(frozen=True)
class LeaseClaims:
    """What a ticket binds: the lease a decode may read, and until when."""

    engine_id: str
    host: str
    port: int
    lease_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    tp_size: int
    expires_at: float
    rank_ports: tuple[int, ...] = ()  # each rank's side channel, where ranks listen apart

    def signed_bytes(self) -> bytes:
        return _DOMAIN + msgspec.msgpack.encode(
            (self.engine_id, self.host, self.port, self.lease_id, list(self.block_ids),
             self.num_tokens, self.tp_size, float(self.expires_at), list(self.rank_ports)))


def mac_text(key: bytes, signed: bytes) -> str:
    """A ticket over ``signed`` bytes: the prefix, then the URL-safe base64 of their
    HMAC-SHA256 with ``key`` (each kind of ticket puts its own domain first)."""
    mac = hmac.new(key, signed, hashlib.sha256).digest()
    return TICKET_PREFIX + base64.urlsafe_b64encode(mac).decode("ascii").rstrip("=")


def verify_mac(key: bytes, signed: bytes, ticket: object) -> None:
    """Raise :class:`TicketError` unless ``ticket`` is ``mac_text(key, signed)``
    (compared in constant time)."""
    if not isinstance(ticket, str) or not ticket.startswith(TICKET_PREFIX):
        raise TicketError(f"not a kvxfer ticket (expected a string starting with "
                          f"{TICKET_PREFIX!r})")
    want = mac_text(key, signed)
    if not hmac.compare_digest(want.encode("ascii"), ticket.encode("utf-8", "replace")):
        raise TicketError("the HMAC does not match")


def sign_ticket(key: bytes, claims: LeaseClaims) -> str:
    """The ``lease_ticket`` value for ``claims``."""
    return mac_text(key, claims.signed_bytes())


def verify_ticket(key: bytes, claims: LeaseClaims, ticket: object) -> None:
    """Raise :class:`TicketError` unless ``ticket`` is ``sign_ticket(key, claims)``
    (compared in constant time)."""
    if ticket is None:
        raise TicketError(f"kv_transfer_params.{TICKET_KEY} is missing: this instance "
                          f"only reads leases whose params a prefill with its key signed")
    if not isinstance(ticket, str) or not ticket.startswith(TICKET_PREFIX):
        raise TicketError(f"kv_transfer_params.{TICKET_KEY} is not a kvxfer lease ticket "
                          f"(expected a string starting with {TICKET_PREFIX!r})")
    try:
        verify_mac(key, claims.signed_bytes(), ticket)
    except TicketError:
        raise TicketError(f"kv_transfer_params.{TICKET_KEY} does not verify: the params were "
                          f"altered, or not issued by a prefill that shares this instance's "
                          f"key") from None
