"""The background health checker: ``GET /health`` on every instance, every interval.

It is the only thing that marks an instance healthy again after the request
path marked it down. A round checks all instances concurrently; the app runs
one round before it accepts requests, so /health is truthful from the start.

A check that gets no answer within the timeout is ambiguous: the instance may
be frozen, or only busy (a vLLM instance bound to one CPU core answers /health
late while its engine steps). A healthy instance therefore leaves the rotation
only after ``failures`` such checks in a row; a refused connection or an answer
other than 200 takes it out at once, since the instance said so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from kvxfer.net.hosts import DRAINING_HEADER
from proxy.balancer import Balancer, Instance
from proxy.upstream import READ_TIMEOUT, failure_name

log = logging.getLogger(__name__)

class HealthChecker:
    """Checks the balancer's instances over the app's shared client until stopped."""

    def __init__(self, balancer: Balancer, session: aiohttp.ClientSession, interval: float,
                 connect_timeout: float, headers: dict[str, str] | None = None,
                 timeout: float = 5.0, failures: int = 2,
                 on_answer: Callable[[str, bool, dict[str, Any] | None], None] | None = None
                 ) -> None:
        self.balancer = balancer
        self.headers = headers or {}  # the sidecars' API key, when they have one
        self.session = session
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=connect_timeout)
        self.failures = failures  # unanswered checks in a row that take a healthy one out
        self._stop = asyncio.Event()
        # each check's outcome and /health body, e.g. where its KV events are
        self.on_answer = on_answer

    async def check(self, instance: Instance) -> None:
        """One ``GET /health``: 200 marks the instance up, anything else (draining
        included) down."""
        was_healthy = instance.healthy
        data = b""
        try:
            async with self.session.get(f"{instance.url}/health", headers=self.headers,
                                        timeout=self.timeout) as response:
                data = await response.read()  # to the end: the connection is reused
                status = response.status
                draining = DRAINING_HEADER in response.headers
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            name = failure_name(exc)
            reason = f"health check: {name}: {exc}" if str(exc) else f"health check: {name}"
            if name == READ_TIMEOUT and instance.healthy:
                instance.missed_checks += 1
                if instance.missed_checks < self.failures:
                    instance.last_error = (f"{reason} ({instance.missed_checks} of "
                                           f"{self.failures} in a row take it out)")
                    log.info("%s instance %s: %s", instance.role, instance.url,
                             instance.last_error)
                    return
            self.balancer.mark_down(instance, reason)
        else:
            if status == 200:
                self.balancer.mark_up(instance)
            elif status == 503 and draining:
                self.balancer.mark_down(instance, "draining (GET /health: shutting down)")
            else:
                self.balancer.mark_down(
                    instance, f"health check: GET /health answered HTTP {status}")
        if self.on_answer is not None:
            self.on_answer(instance.url, instance.healthy, _object(data))
        if instance.healthy and not was_healthy:
            log.info("%s instance %s is healthy", instance.role, instance.url)
        elif was_healthy and not instance.healthy:
            log.warning("%s instance %s is unhealthy: %s", instance.role, instance.url,
                        instance.last_error)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in self.balancer.instances()))

    async def run(self) -> None:
        """Check every ``interval`` seconds until :meth:`stop`."""
        while not self._stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval)
            if not self._stop.is_set():
                await self.check_all()

    def stop(self) -> None:
        self._stop.set()


def _object(data: bytes) -> dict[str, Any] | None:
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return body if isinstance(body, dict) else None
