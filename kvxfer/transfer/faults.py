"""``MessageLoss``: "done" messages (and other side-channel messages) a process loses on
purpose, to prove they are repaired.

For fault tests and ``kvxfer bench soak`` only; off unless ``KVXFER_DROP_MESSAGES`` asks
(e.g. ``notification=0.5,done=0.3``, kinds :data:`KINDS`), drawn at random
(``KVXFER_DROP_SEED`` seeds it). A bad value stops the process with a message that says what
is allowed.

Design: docs/design/leases.md#proving-that-a-lost-done-is-repaired
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Mapping
from typing import Final

log = logging.getLogger(__name__)

ENV: Final = "KVXFER_DROP_MESSAGES"
SEED_ENV: Final = "KVXFER_DROP_SEED"
KINDS: Final = ("notification", "done", "release", "renew", "heartbeat")


class MessageLoss:
    """Per kind (:data:`KINDS`), the share of received messages to lose (0: none)."""

    def __init__(self, shares: Mapping[str, float] | None = None, seed: int | None = None
                 ) -> None:
        self.shares = dict(shares or {})
        for kind, share in self.shares.items():
            if kind not in KINDS:
                raise ValueError(f"{ENV}: unknown message kind {kind!r}; one of "
                                 f"{', '.join(KINDS)}")
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{ENV}: the share of {kind!r} to drop must be within 0..1, "
                                 f"got {share}")
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # the worker and listener threads draw

    @classmethod
    def parse(cls, text: str, seed: int | None = None) -> MessageLoss:
        """From ``kind=share,...`` (an empty text: no loss)."""
        shares: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            kind, sep, value = part.partition("=")
            try:
                if not sep:
                    raise ValueError
                shares[kind.strip()] = float(value)
            except ValueError:
                raise ValueError(f"{ENV}: expected kind=share (e.g. notification=0.5), got "
                                 f"{part!r}") from None
        return cls(shares, seed)

    def drop(self, kind: str) -> bool:
        """Whether to lose this received message of ``kind``."""
        share = self.shares.get(kind, 0.0)
        if share <= 0.0 or share >= 1.0:  # no draw: the other kinds' sequence stays seeded
            return share >= 1.0
        with self._lock:
            return self._random.random() < share


def from_environment() -> MessageLoss:
    """The loss the environment asks for (none when :data:`ENV` is unset), logged once."""
    text = os.environ.get(ENV, "")
    seed = os.environ.get(SEED_ENV)
    loss = MessageLoss.parse(text, int(seed) if seed else None)
    if loss.shares:
        log.warning("fault injection: this process loses %s of the messages it receives (%s)",
                    ", ".join(f"{share:.0%} of {kind}" for kind, share in loss.shares.items()),
                    ENV)
    return loss


LOSS: Final = from_environment()
"""This process's loss, read once at import."""
