"""What the connector tells the engine loop: one poll's changes and what an abort did.

Pure data, shared by :mod:`kvxfer.sidecar.connector` (which re-exports both) and
:mod:`kvxfer.sidecar.kv_loads`; the engine loop reads them on its thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class AbortOutcome(enum.Enum):
    """What :meth:`KVConnector.abort` did with a request."""

    DROPPED = "dropped"    # it was waiting for blocks and never reached the engine
    DEFERRED = "deferred"  # a READ is in flight; the engine aborts it when all ranks end
    LEASED = "leased"      # prefill: its lease, whose params the client never got, ended
    NOT_MINE = "not_mine"  # the connector does not own it: the caller aborts the engine request


@dataclass
class ConnectorEvents:
    """What one :meth:`KVConnector.poll` changed, for the engine loop."""

    released: list[str] = field(default_factory=list)  # prefill: leases ended, blocks freed
    rejected: dict[str, str] = field(default_factory=dict)  # decode: refused at admission
    failed: dict[str, str] = field(default_factory=dict)  # decode: admission raised (a bug)
