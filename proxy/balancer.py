"""Which instance of a role takes the next request.

Instance state (health, ``outstanding`` calls, prompt tokens in flight, last error) lives
here only; everything runs on the app's one event loop, so no locks. Policies order the
healthy instances: ``round_robin``, ``least_outstanding`` and ``kv_aware`` (by the work an
instance would do for the request: the prompt tokens its cache lacks, weighed against its
load; what it caches comes from :mod:`proxy.event_streams`).

Design: docs/design/proxy.md#choosing-an-instance
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxy.config import ROLES, ProxyConfig

if TYPE_CHECKING:
    from proxy.event_streams import KVEvents

log = logging.getLogger(__name__)

# kv_aware's costs, in prompt tokens computed: a decode reads what its cache lacks (moving a
# token's KV costs far less than computing it), and each request it runs slows every step.
READ_COST = 0.1
DECODE_REQUEST_COST = 32.0


@dataclass
class Instance:
    """One upstream sidecar. Unhealthy until the first health check answers 200.

    ``last_error`` is the most recent failure seen, kept after the instance
    recovers so that /health still shows what went wrong. ``retired``: its name
    no longer resolves to it; it takes no new request and is forgotten once its
    calls in flight are done (:meth:`Balancer.set_members`).
    """

    url: str
    role: str
    healthy: bool = False
    outstanding: int = 0
    last_error: str | None = None
    retired: bool = False
    missed_checks: int = 0  # health checks in a row that got no answer in time
    tokens_in_flight: int = 0  # prompt tokens of the calls in flight (a prefill's work)

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.retired

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "outstanding": self.outstanding, "tokens_in_flight": self.tokens_in_flight,
                "last_error": self.last_error, "retired": self.retired}


@dataclass(frozen=True)
class Split:
    """When a request skips P/D and a decode alone computes its prompt: fewer than
    ``min_tokens`` tokens left for the best decode to compute (its cached prefix
    subtracted: P/D's two hops would cost more than they save), or every prefill with
    ``saturated_tokens`` or more in flight while a decode runs fewer than ``decode_room``
    requests."""

    min_tokens: int = 0
    saturated_tokens: int = 0  # 0: never saturated
    decode_room: int = 8


@dataclass
class Prompt:
    """A request's prompt tokens, as the instances will see them, for kv_aware's scores;
    ``keys`` caches their block keys by block size (:mod:`proxy.kv_index`)."""

    token_ids: Sequence[int]
    keys: dict[int, list[bytes]] = field(default_factory=dict)


class Balancer:
    """The instances of every role and the policy that orders them."""

    def __init__(self, config: ProxyConfig, kv: KVEvents | None = None) -> None:
        self.policy = config.policy
        self.kv = kv  # what each instance caches (kv_aware)
        self._instances = {role: [Instance(url, role) for url in config.urls(role)]
                           for role in ROLES}
        self._turn = dict.fromkeys(ROLES, 0)

    def instances(self, role: str | None = None) -> list[Instance]:
        """All instances of ``role``, or of every role, in configuration order."""
        if role is not None:
            return list(self._instances[role])
        return [i for r in ROLES for i in self._instances[r]]

    def candidates(self, role: str, avoid: Collection[str] = (),
                   prompt: Prompt | None = None) -> list[Instance]:
        """The healthy instances of ``role`` in the order this request should try them,
        those whose URL is in ``avoid`` (a try of the request failed there) last.

        Each call advances the rotation by one, which breaks ties. Empty when none is
        healthy. kv_aware without the prompt's tokens, or without a believed KV index for
        any of them, keeps the rotation's order (round robin).
        """
        healthy = [i for i in self._instances[role] if i.in_rotation]
        if not healthy:
            return []
        start = self._turn[role] % len(healthy)
        self._turn[role] += 1
        ordered = healthy[start:] + healthy[:start]
        if self.policy == "kv_aware" and prompt is not None:
            self._by_cost(ordered, prompt)
        elif self.policy == "least_outstanding":
            ordered.sort(key=lambda i: i.outstanding)  # stable: the rotation breaks ties
        if avoid:
            ordered.sort(key=lambda i: i.url in avoid)
        return ordered

    def _by_cost(self, ordered: list[Instance], prompt: Prompt) -> None:
        """Sort ``ordered`` by :func:`cost`, when any of them has a believed KV index;
        else leave the rotation's order (no events arrive: round robin)."""
        if self.kv is None:
            return
        cached = [self.kv.cached_tokens(i.url, prompt.token_ids, prompt.keys)
                  for i in ordered]
        if all(c is None for c in cached):
            return
        costs = {i.url: cost(i, len(prompt.token_ids) - (c or 0))
                 for i, c in zip(ordered, cached, strict=True)}
        ordered.sort(key=lambda i: costs[i.url])  # stable: the rotation breaks ties

    def decode_alone(self, prompt: Prompt | None, split: Split) -> str | None:
        """Why a decode alone should answer ``prompt`` (a reason for the metrics), or None
        for P/D; None too when its tokens are unknown or no decode is healthy."""
        prefills = [i for i in self._instances["prefill"] if i.in_rotation]
        decodes = [i for i in self._instances["decode"] if i.in_rotation]
        if prompt is None or not decodes:
            return None
        if not prefills:
            return "no_prefill"
        if split.min_tokens:
            known = [self.kv.cached_tokens(i.url, prompt.token_ids, prompt.keys)
                     if self.kv is not None else None for i in decodes]
            left = len(prompt.token_ids) - max((c or 0) for c in known)
            if left < split.min_tokens:
                return "short"
        if split.saturated_tokens and \
                all(i.tokens_in_flight >= split.saturated_tokens for i in prefills) and \
                any(i.outstanding < split.decode_room for i in decodes):
            return "prefills_saturated"
        return None

    def has_healthy(self, role: str, avoid: Collection[str] = ()) -> bool:
        """Whether an instance of ``role`` whose URL is not in ``avoid`` is in rotation."""
        return any(i.in_rotation and i.url not in avoid for i in self._instances[role])

    def set_members(self, role: str, urls: list[str]) -> list[Instance]:
        """Make ``urls`` the members of ``role``: add the new ones (unhealthy until
        checked; returned), retire the others, forget retired ones with no call in
        flight. Order: the current members first, then new ones as given."""
        wanted = set(urls)
        kept: list[Instance] = []
        for instance in self._instances[role]:
            if instance.url in wanted:
                instance.retired = False
            elif not instance.retired:
                instance.retired = True
                log.info("%s instance %s left (its name no longer resolves to it): no new "
                         "requests, %d in flight finish", role, instance.url,
                         instance.outstanding)
            if not instance.retired or instance.outstanding:
                kept.append(instance)
        known = {i.url for i in kept}
        joined = [Instance(url, role) for url in urls if url not in known]
        for instance in joined:
            log.info("%s instance %s joined", role, instance.url)
        self._instances[role] = kept + joined
        return joined

    @staticmethod
    def acquire(instance: Instance) -> None:
        """Count one more call in flight; every acquire is paired with one :meth:`release`."""
        instance.outstanding += 1

    @staticmethod
    def release(instance: Instance) -> None:
        instance.outstanding -= 1

    @contextmanager
    def busy(self, instance: Instance, tokens: int = 0) -> Iterator[Instance]:
        """Count one in-flight call to ``instance``, with ``tokens`` prompt tokens to
        compute, for as long as the block runs."""
        self.acquire(instance)
        instance.tokens_in_flight += tokens
        try:
            yield instance
        finally:
            instance.tokens_in_flight -= tokens
            self.release(instance)

    @staticmethod
    def mark_down(instance: Instance, reason: str) -> None:
        """The instance cannot be reached: no request goes to it until a health check passes."""
        instance.healthy = False
        instance.last_error = reason
        instance.missed_checks = 0

    @staticmethod
    def mark_up(instance: Instance) -> None:
        instance.healthy = True
        instance.missed_checks = 0


def cost(instance: Instance, uncached: int) -> float:
    """kv_aware's cost of ``instance`` taking a prompt of which it lacks ``uncached``
    tokens, in tokens computed: a prefill computes them after the tokens in flight there; a
    decode reads them and shares its steps with the requests it runs."""
    if instance.role == "prefill":
        return uncached + instance.tokens_in_flight
    return READ_COST * uncached + DECODE_REQUEST_COST * instance.outstanding
