"""Calls the tier's tests make: through kvxfer-proxy or straight to one vLLM instance."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import httpx
from sidecars import Launched

from kvxfer.bench.vllm import SERVED_NAME, VllmServer
from kvxfer.transfer.converted.mapped_reads import CACHE_MEMFD_NAME

TIMEOUT = httpx.Timeout(120.0)
PAIR_LEASE_TTL = 20.0  # kvxfer_pair's lease (conftest.pair_extra): a refused one ends by then


def kv_events_args(ports: tuple[int, int]) -> tuple[str, ...]:
    """vLLM's flags to publish its KV events on ``ports`` (PUB, replay), every interface
    (vLLM binds only a wildcard endpoint; any other it connects to)."""
    pub, replay = ports
    return ("--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}"}))


def kv_events_flag(server: Served, ports: tuple[int, int]) -> str:
    """kvxfer-proxy's ``--kv-events`` value for ``server`` publishing on ``ports``."""
    return f"http://127.0.0.1:{server.port}=tcp://127.0.0.1:{ports[0]}," \
           f"tcp://127.0.0.1:{ports[1]}"


class Served(Protocol):
    """A server the proxy can front: a vLLM instance or a kvxfer sidecar."""

    @property
    def port(self) -> int: ...


@functools.cache
def smollm2_id() -> str:
    """kvxfer's reference-engine id (config and weights fingerprint) of SmolLM2: what a
    vLLM instance must call the model (``model_id``) to be a sidecar's compatible peer."""
    from kvxfer.engine.model_names import load_model
    from kvxfer.engine.weights import fingerprint

    loaded = load_model("smollm2-135m-instruct")
    assert loaded.state_dict is not None
    return fingerprint(loaded.config, loaded.state_dict)


def proxy_for(prefill: Served, decode: Served, log_dir: Path,
              extra: Sequence[str] = ()) -> contextlib.AbstractContextManager[str]:
    """A real kvxfer-proxy process in front of one prefill and one decode; its URL."""
    return proxy_over([prefill], [decode], log_dir, extra)


@contextmanager
def proxy_over(prefills: Sequence[Served], decodes: Sequence[Served], log_dir: Path,
               extra: Sequence[str] = ()) -> Iterator[str]:
    """A real kvxfer-proxy process in front of ``prefills`` and ``decodes``; its URL."""
    proxy = Launched("proxy", [
        sys.executable, "-m", "proxy", "--port", "0",
        # a vLLM instance bound to one core answers /health late while it steps (once
        # past 5 s in CI, which took the decode out for a request)
        "--health-timeout", "15",
        "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", *(str(p.port) for p in prefills),
        "--decoder-hosts", "127.0.0.1", "--decoder-ports", *(str(d.port) for d in decodes),
        *extra], log_dir)
    try:
        proxy.wait_ready(time.monotonic() + 60)
        deadline = time.monotonic() + 30  # its first health round marks both up
        while httpx.get(f"{proxy.url}/health").status_code != 200:
            assert time.monotonic() < deadline, f"proxy not healthy:\n{proxy.log_tail()}"
            time.sleep(0.2)
        yield proxy.url
    finally:
        proxy.stop()


def completion(url: str, body: dict[str, Any], path: str = "/v1/completions"
               ) -> dict[str, Any]:
    """A non-streamed call; the JSON answer (200 required)."""
    answer = httpx.post(f"{url}{path}", json={"model": SERVED_NAME, **body}, timeout=TIMEOUT)
    assert answer.status_code == 200, f"{url}{path}: {answer.status_code} {answer.text}"
    return dict(answer.json())


def streamed(url: str, body: dict[str, Any], path: str = "/v1/completions") -> list[Any]:
    """A streamed call's data events, in order (200 and a final [DONE] required)."""
    events: list[Any] = []
    with httpx.stream("POST", f"{url}{path}", timeout=TIMEOUT,
                      json={"model": SERVED_NAME, **body, "stream": True}) as answer:
        assert answer.status_code == 200, f"{url}{path}: {answer.status_code} {answer.read()!r}"
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    assert events and events[-1] == "[DONE]", "stream did not end with [DONE]"
    return events[:-1]


def streamed_text(events: list[Any], chat: bool) -> str:
    parts = []
    for event in events:
        for choice in event.get("choices", []):
            parts.append((choice.get("delta", {}).get("content") or "") if chat
                         else choice.get("text", ""))
    return "".join(parts)


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples at ``url`` (0 when absent)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(server: VllmServer, timeout: float = 30.0) -> None:
    """Every block back in the free pool and no request left: nothing leaked."""
    deadline = time.monotonic() + timeout
    while True:
        usage = metric(server.url, "vllm:kv_cache_usage_perc")
        running = metric(server.url, "vllm:num_requests_running") + \
            metric(server.url, "vllm:num_requests_waiting")
        if usage == 0 and running == 0:
            return
        assert time.monotonic() < deadline, (f"{server.name} still holds KV blocks "
                                             f"(usage {usage}) or requests ({running})")
        time.sleep(0.5)


CACHE_MEMFD = f"/memfd:{CACHE_MEMFD_NAME}"  # how kvxfer's shared caches show in maps


def cache_mappings(server: VllmServer) -> list[str]:
    """The permissions (``rw-s``, ``r--s``) of every mapping of a kvxfer shared cache in
    ``server``'s processes (its process group: API server, engine core, workers): its own
    cache, allocated shared, is writable; a peer's, mapped to be copied from, read-only."""
    assert server.process is not None
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:  # pgrp: the 3rd field after "(comm)"
                if int(stat.read().rsplit(")", 1)[1].split()[2]) != server.process.pid:
                    continue
            with open(f"/proc/{pid}/maps") as maps:
                found += [line.split()[1] for line in maps if CACHE_MEMFD in line]
        except (FileNotFoundError, ProcessLookupError):  # the process ended meanwhile
            continue
    return found
