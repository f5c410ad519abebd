"""Refusing replays of signed messages: :class:`ReplayGuard` and :class:`ReplayedMessage`.

With a shared key every envelope is signed (:mod:`kvxfer.wire.envelope`) and also
carries a timestamp and a random nonce; a receiver refuses stale or repeated ones
(:class:`ReplayGuard`) as :class:`ReplayedMessage`, a
:class:`~kvxfer.wire.protocol_errors.BadSignature`.
"""

from __future__ import annotations

import threading
import time

from kvxfer.wire.protocol_errors import BadSignature, ProtocolError

MAX_MESSAGE_AGE_S = 30.0
"""A signed message whose timestamp is further than this from the receiver's clock
is refused (so a captured message cannot be replayed later); nonces are remembered
for as long. Clocks of the two sides must agree to well within this."""

NONCE_BYTES = 16
"""The size of a signed envelope's random nonce."""


class ReplayedMessage(BadSignature):
    """A correctly signed message that is stale (timestamp outside the window) or
    whose nonce was seen already: a replay."""

    def __init__(self, why: str, *, peer: str) -> None:
        ProtocolError.__init__(self, f"peer {peer} sent a signed message that is refused as a "
                                     f"replay: {why}", peer=peer,
                               expected=f"a fresh message (within {MAX_MESSAGE_AGE_S:g} s, "
                                        f"new nonce)", found=why)


class ReplayGuard:
    """Refuses signed messages that are stale or whose nonce was seen (thread-safe).

    Nonces are remembered for ``2 * max_age`` seconds (a message is accepted up to
    ``max_age`` early or late), at most ``max_nonces`` of them; only messages whose
    signature verified are recorded, so only key holders can fill it.
    """

    def __init__(self, max_age: float = MAX_MESSAGE_AGE_S, *, remember: bool = True,
                 max_nonces: int = 1_000_000) -> None:
        self.max_age, self._remember, self._max = max_age, remember, max_nonces
        self._seen: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._next_purge = 0.0

    def check(self, nonce: bytes, timestamp: float, *, peer: str,
              now: float | None = None) -> None:
        """Raise :class:`ReplayedMessage` unless the message is fresh; record its nonce."""
        now = time.time() if now is None else now
        if not abs(now - timestamp) <= self.max_age:
            raise ReplayedMessage(f"its timestamp is {now - timestamp:+.1f} s from this side's "
                                  f"clock, more than {self.max_age:g} s", peer=peer)
        if not self._remember:
            return
        if len(nonce) != NONCE_BYTES:
            raise ReplayedMessage(f"its nonce has {len(nonce)} bytes, not {NONCE_BYTES}",
                                  peer=peer)
        with self._lock:
            if now >= self._next_purge or len(self._seen) >= self._max:
                self._purge(now)
            if nonce in self._seen:
                raise ReplayedMessage("its nonce was seen already", peer=peer)
            if len(self._seen) >= self._max:
                raise ReplayedMessage("too many recent messages to remember", peer=peer)
            self._seen[nonce] = now + 2 * self.max_age

    def _purge(self, now: float) -> None:
        self._seen = {n: until for n, until in self._seen.items() if until > now}
        self._next_purge = now + self.max_age

