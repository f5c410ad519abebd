"""An alarm when P/D is not happening: a decode that answered without reading the KV its
prefill leased for it, which means it computed the prompt itself (no KV connector, a
misconfigured one, a refused lease, a recompute policy). Such a deployment answers 200 and
costs every prompt twice, which no status code shows.

After a pull-mode request's decode answered, the proxy asks the prefill to release the
lease (``POST /v1/kv/release``, after :data:`SETTLE_S`): a lease a decode claimed or read is
not released; one still unclaimed is, which frees its blocks at once and is counted here per
prefill/decode pair, logged once per pair with the reason, and shown on the proxy's
``/health``. A pair is asked about every request until :data:`PROVEN` in a row were read,
then about one in :data:`SAMPLE` (a call per request costs the prefill CPU); an unread one
puts it back to every request. A prefill without that route (vLLM's) cannot be asked: its
pairs go unwatched.

Design: docs/design/kv-events.md#when-pd-is-not-happening
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SETTLE_S = 1.0  # after the answer: a decode reading the KV has claimed its lease long before
PROVEN = 8      # reads in a row after which a pair is asked about one request in SAMPLE
SAMPLE = 16
REASON = ("the decode answered without claiming the prefill's lease: it computed the prompt "
          "itself (no KV connector, a misconfigured one, a refused lease or a recompute "
          "policy), so every prompt costs twice")


@dataclass
class Unread:
    """Requests of one prefill/decode pair whose decode read no KV."""

    prefill: str
    decode: str
    requests: int = 0
    last_request: str = ""


class PDWatch:
    """Unread leases per prefill/decode pair (the app's event loop only)."""

    def __init__(self, count: Any = None) -> None:
        self._pairs: dict[tuple[str, str], Unread] = {}
        self._count = count  # (prefill, decode) -> a metric, or None
        self._read: dict[tuple[str, str], int] = {}  # reads in a row, per pair
        self._turn = 0
        self._unasked: set[str] = set()  # prefills that cannot be asked (no release route)

    def ask(self, prefill: str, decode: str) -> bool:
        """Whether to ask about this request of the pair (see the module docstring)."""
        if prefill in self._unasked:
            return False
        if self._read.get((prefill, decode), 0) < PROVEN:
            return True
        self._turn += 1
        return self._turn % SAMPLE == 0

    def cannot_ask(self, prefill: str) -> None:
        """``prefill`` has no release route (it answered 404): its pairs go unwatched."""
        if prefill not in self._unasked:
            self._unasked.add(prefill)
            log.info("prefill %s cannot say whether a lease was read (no release route): "
                     "its pairs are not watched for P/D not happening", prefill)

    def read(self, prefill: str, decode: str) -> None:
        """A request of the pair whose lease its decode claimed or read."""
        self._read[prefill, decode] = self._read.get((prefill, decode), 0) + 1

    def unread(self, prefill: str, decode: str, request_id: str) -> None:
        self._read[prefill, decode] = 0
        pair = self._pairs.get((prefill, decode))
        if pair is None:
            pair = self._pairs[prefill, decode] = Unread(prefill, decode)
            log.warning("P/D is not happening between prefill %s and decode %s (request %s): "
                        "%s", prefill, decode, request_id, REASON)
        pair.requests += 1
        pair.last_request = request_id
        if self._count is not None:
            self._count(prefill, decode)

    def state(self) -> list[dict[str, Any]]:
        """What /health shows: every pair with unread leases so far."""
        return [{"prefill": p.prefill, "decode": p.decode, "requests": p.requests,
                 "last_request": p.last_request, "reason": REASON}
                for p in self._pairs.values()]
