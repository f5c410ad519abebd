"""Which instance of a role takes the next request.

Instance state (health, ``outstanding`` calls, last error) lives here only; everything runs
on the app's one event loop, so no locks. Policies order the healthy instances:
``round_robin`` and ``least_outstanding``.

Design: docs/design/proxy.md#choosing-an-instance
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from proxy.config import ROLES, ProxyConfig

log = logging.getLogger(__name__)


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

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.retired

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "outstanding": self.outstanding, "last_error": self.last_error,
                "retired": self.retired}


class Balancer:
    """The instances of every role and the policy that orders them."""

    def __init__(self, config: ProxyConfig) -> None:
        self.policy = config.policy
        self._instances = {role: [Instance(url, role) for url in config.urls(role)]
                           for role in ROLES}
        self._turn = dict.fromkeys(ROLES, 0)

    def instances(self, role: str | None = None) -> list[Instance]:
        """All instances of ``role``, or of every role, in configuration order."""
        if role is not None:
            return list(self._instances[role])
        return [i for r in ROLES for i in self._instances[r]]

    def candidates(self, role: str, avoid: Collection[str] = ()) -> list[Instance]:
        """The healthy instances of ``role`` in the order this request should try them,
        those whose URL is in ``avoid`` (a try of the request failed there) last.

        Each call advances the rotation by one. Empty when none is healthy.
        """
        healthy = [i for i in self._instances[role] if i.in_rotation]
        if not healthy:
            return []
        start = self._turn[role] % len(healthy)
        self._turn[role] += 1
        ordered = healthy[start:] + healthy[:start]
        if self.policy == "least_outstanding":
            ordered.sort(key=lambda i: i.outstanding)  # stable: the rotation breaks ties
        if avoid:
            ordered.sort(key=lambda i: i.url in avoid)
        return ordered

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
    def busy(self, instance: Instance) -> Iterator[Instance]:
        """Count one in-flight call to ``instance`` for as long as the block runs."""
        self.acquire(instance)
        try:
            yield instance
        finally:
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
