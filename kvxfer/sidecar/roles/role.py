"""``Role``: one part of an instance's KV transfers, as the engine loop drives it.

Every method runs on the engine loop's thread (the one that steps the engine), unless
it says otherwise. :class:`RoleEvents` is what a poll changed, :class:`AbortOutcome`
what an abort did.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvxfer.engine import RequestOutput
    from kvxfer.sidecar.request_kinds import Kind, Submission
    from kvxfer.transfer.ranks import Answering
    from kvxfer.transfer.results import Released
    from kvxfer.wire.messages import ReleaseOutcome


class AbortOutcome(enum.Enum):
    """What :meth:`Role.abort` did with a request."""

    DROPPED = "dropped"    # it was waiting for blocks and never reached the engine
    DEFERRED = "deferred"  # a transfer is in flight; the engine aborts it when it ended
    LEASED = "leased"      # prefill: its lease, whose params the client never got, ended
    NOT_MINE = "not_mine"  # the role does not own it: the caller aborts the engine request


@dataclass
class RoleEvents:
    """What one poll of the roles changed, for the engine loop."""

    released: list[str] = field(default_factory=list)  # prefill: leases ended, blocks freed
    rejected: dict[str, str] = field(default_factory=dict)  # decode: refused at admission
    failed: dict[str, str] = field(default_factory=dict)  # decode: admission raised (a bug)


class Role(abc.ABC):
    """A role: it admits the request :attr:`kinds` it serves, follows their transfers on
    each :meth:`poll`, and says how each ends. The defaults do nothing; a role overrides
    what it takes part in; :meth:`admit` every role must have."""

    kinds: ClassVar[tuple[type[Kind], ...]] = ()

    @abc.abstractmethod
    def admit(self, submission: Submission) -> None:
        """Take a request of one of :attr:`kinds` (ValueError: refused, a 400)."""

    def not_admitted(self, kind: Kind, reason: str, outcome: ReleaseOutcome) -> None:
        """Any thread: a request of one of :attr:`kinds` will never be admitted (refused
        before it reached the loop, answered at once, the instance closing): let go of
        what it names."""
        return None

    def finished(self, output: RequestOutput, kind: Kind) -> dict[str, Any] | None:
        """A request of this role's ended in the engine (``output.finish_reason``): the
        ``kv_transfer_params`` of its answer, if any."""
        return None

    def transfer_error(self, request_id: str) -> str | None:
        """Why ``request_id`` failed, if its transfer was why (the answer is a 502)."""
        return None

    def abort(self, request_id: str) -> AbortOutcome | None:
        """The client left: drop or defer ``request_id``; None when it is not this role's."""
        return None

    def lease_ended(self, rank: int, item: Released, events: RoleEvents) -> bool:
        """Rank ``rank`` ended a lease; whether it was this role's."""
        return False

    def in_use(self, request_id: str) -> bool:
        """Whether ``request_id`` still names something of this role's (a held lease)."""
        return False

    def poll(self, events: RoleEvents) -> None:
        """Follow transfers, admit what waited, report what changed."""
        return None

    @property
    def answering(self) -> Answering | None:
        """What this role answers on the side channel (claims, renewals, releases, reports
        of the leases it owns); None: peers ask it nothing."""
        return None

    def serving_at(self, host: str, port: int) -> None:
        """The side channel serves this role's answers at ``host:port`` (as peers dial it)."""
        return None

    def claimed_by(self, engine_id: str, side_channel: tuple[str, int]) -> None:
        """Listener thread: peer ``engine_id`` claimed a lease here, naming the side
        channel it answers at."""
        return None

    def gauges(self) -> dict[str, int]:
        """What ``/health`` and ``/metrics`` show of this role (counts, by name)."""
        return {}

    @property
    def busy(self) -> bool:
        """Transfers in flight: poll every millisecond or so."""
        return False

    @property
    def claiming(self) -> bool:
        """Questions on their way to a peer whose answers requests wait on: poll as
        often as when :attr:`busy`."""
        return False

    @property
    def waiting(self) -> bool:
        """Something held or waiting: poll now and then."""
        return False

    def close(self) -> None:
        """After the loop stopped and the ranks closed: let go of what is still held."""
        return None
