"""How talking to a peer over the side channel fails, beyond the protocol's own errors
(:mod:`kvxfer.wire.protocol_errors`), and :func:`failure_reason`, the one word metrics count."""

from __future__ import annotations

from kvxfer.wire.messages import ErrorReply
from kvxfer.wire.protocol_errors import (
    BadSignature,
    ErrorCode,
    HashMismatch,
    ProtocolError,
    SideChannelError,
    VersionMismatch,
)


class SideChannelTimeout(SideChannelError):
    """No answer from the peer within the deadline on any attempt."""


class PeerUnreachable(SideChannelError):
    """Nothing listens at the peer's address (the TCP connect was refused)."""


class PeerRefused(SideChannelError):
    """The peer answered with an :class:`ErrorReply`; ``code`` says why."""

    def __init__(self, reply: ErrorReply, *, peer: str, what: str = "the handshake") -> None:
        super().__init__(f"peer {peer} refused {what} ({reply.code.value}): "
                         f"{reply.message}", peer=peer, found=reply.code)
        self.code = reply.code
        self.reason = reply.message


FAILURE_REASONS = ("timeout", "unreachable", "refused", "mismatch", "auth", "malformed",
                   "error")
"""What :func:`failure_reason` answers (the ``reason`` label of failed handshakes)."""

_MISMATCH_CODES = (ErrorCode.HASH_MISMATCH, ErrorCode.VERSION_MISMATCH)


def failure_reason(exc: SideChannelError) -> str:
    """Why talking to a peer failed, in one word of :data:`FAILURE_REASONS`: no answer
    (timeout), nothing listening (unreachable), another model or protocol on either side
    (mismatch), a key that differs (auth), bytes that broke the protocol (malformed), an
    error reply for anything else (refused), or a local error sending (error)."""
    if isinstance(exc, SideChannelTimeout):
        return "timeout"
    if isinstance(exc, PeerUnreachable):
        return "unreachable"
    if isinstance(exc, PeerRefused):
        if exc.code in _MISMATCH_CODES:
            return "mismatch"
        return "auth" if exc.code is ErrorCode.BAD_SIGNATURE else "refused"
    if isinstance(exc, HashMismatch | VersionMismatch):
        return "mismatch"
    if isinstance(exc, BadSignature):
        return "auth"
    return "malformed" if isinstance(exc, ProtocolError) else "error"
