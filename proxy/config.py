"""The proxy's configuration: which prefill and decode instances exist and how to reach them.

Instances are addressed by base URL (``http://host:port``, no trailing slash).
All durations are seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES: tuple[str, ...] = ("kv_aware", "round_robin", "least_outstanding")
ROLES: tuple[str, ...] = ("prefill", "decode")
TRANSFER_MODES: tuple[str, ...] = ("pull", "push")
MAX_RETRIES = 5  # each attempt may wait prefill_timeout + request_timeout
# P/D's median TTFT was 1.055x one instance's at 20 tokens and at most 0.99x from 50 on
# (`kvxfer bench ttft`, SmolLM2, 2 CPUs): shorter prompts go to a decode alone
PD_MIN_TOKENS = 48


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the flag and the value."""


@dataclass(frozen=True)
class ProxyConfig:
    """Everything :func:`proxy.app.create_app` and :func:`proxy.server.serve` need.

    ``api_key`` is what clients must send; ``upstream_api_key`` what the proxy
    sends to every sidecar (their ``kvxfer serve --api-key``). They are separate
    keys on purpose: a client holding the proxy's key cannot call a sidecar
    directly (a decode call names whose KV to read).
    ``connect_timeout`` bounds establishing a TCP connection to an instance;
    ``prefill_timeout`` bounds a whole prefill call (one token: a frozen or
    overloaded prefill costs the client at most that long; never more than
    ``request_timeout``);
    ``request_timeout`` bounds a whole non-streamed decode answer, and for a
    streamed answer the wait for its headers and for each next chunk.
    ``retries`` is how many more times a request whose prefill or decode call failed
    before anything reached the client runs again, while an instance that did not fail
    it can take it (:mod:`proxy.router`).
    ``transfer_mode``: "pull" (the decode reads the prefill's KV) or "push" (the decode
    reserves blocks first and the prefill writes the KV into them; :mod:`proxy.router`).
    ``health_interval`` is the pause between two rounds of ``GET /health``;
    ``health_timeout`` bounds one check, and ``health_failures`` checks in a row
    without an answer take a healthy instance out of the rotation
    (:mod:`proxy.health`).
    ``prefill_names``/``decode_names`` are (DNS name, port) pairs resolved again
    every ``resolve_interval`` (:mod:`proxy.discovery`), through ``hosts_file``
    instead of DNS when given.
    ``kv_key``: the instances' KV key, which their KV events must be signed with
    (:mod:`proxy.event_streams`); ``kv_events``: event streams of instances whose /health
    does not announce one (vLLM's); ``tokenizer``: what tokenizes text prompts for the
    kv_aware policy (:mod:`proxy.prompts`). ``pd_min_tokens`` and
    ``prefill_saturated_tokens``: when a decode alone answers (``proxy.balancer.Split``).
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "kv_aware"
    api_key: str | None = None
    upstream_api_key: str | None = None
    connect_timeout: float = 5.0
    prefill_timeout: float = 30.0
    request_timeout: float = 600.0
    retries: int = 1
    health_interval: float = 5.0
    health_timeout: float = 5.0
    health_failures: int = 2
    log_level: str = "info"
    access_log: bool = False
    prefill_names: tuple[tuple[str, int], ...] = ()
    decode_names: tuple[tuple[str, int], ...] = ()
    resolve_interval: float = 5.0
    hosts_file: str | None = None
    transfer_mode: str = "pull"
    kv_key: bytes | None = field(default=None, repr=False)
    tokenizer: str | None = None
    kv_events: tuple[str, ...] = ()  # URL=ENDPOINT[,REPLAY]: streams /health does not announce
    pd_min_tokens: int = PD_MIN_TOKENS
    prefill_saturated_tokens: int = 0

    def __post_init__(self) -> None:
        for role, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            if not urls and not self.names(role):
                raise ConfigError(f"at least one {role} instance is needed, got none")
            if len(set(urls)) != len(urls):
                raise ConfigError(f"{role} instances repeat: {', '.join(urls)}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; use one of {', '.join(POLICIES)}")
        for name in ("connect_timeout", "prefill_timeout", "request_timeout",
                     "health_interval", "health_timeout", "resolve_interval"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value!r}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ConfigError(f"--kv-transfer-mode must be one of {', '.join(TRANSFER_MODES)}, "
                              f"got {self.transfer_mode!r}")
        for name in ("pd_min_tokens", "prefill_saturated_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more, got "
                                  f"{getattr(self, name)!r}")
        if not 0 <= self.retries <= MAX_RETRIES:
            raise ConfigError(f"--retries must be 0..{MAX_RETRIES}, got {self.retries!r}")
        if not self.health_failures >= 1:
            raise ConfigError(f"--health-failures must be at least 1, got "
                              f"{self.health_failures!r}")
        for flag, key in (("--api-key", self.api_key),
                          ("--upstream-api-key", self.upstream_api_key)):
            if key is not None and not key.strip():
                raise ConfigError(f"{flag} is empty; omit it to run without authentication")

    def urls(self, role: str) -> tuple[str, ...]:
        """Base URLs of the instances of ``role`` ("prefill" or "decode")."""
        return self.prefill_urls if role == "prefill" else self.decode_urls

    def names(self, role: str) -> tuple[tuple[str, int], ...]:
        """(DNS name, port) pairs whose addresses are instances of ``role``."""
        return self.prefill_names if role == "prefill" else self.decode_names


def base_url(host: str, port: int) -> str:
    """``http://host:port``; IPv6 literals get their brackets."""
    if not 0 < port < 65536:
        raise ConfigError(f"port {port} is outside 1..65535")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def instance_urls(hosts: Sequence[str], ports: Sequence[int], flag: str) -> tuple[str, ...]:
    """Pair ``--<flag>-hosts`` with ``--<flag>-ports``.

    One host applies to every port; otherwise the counts must match.
    """
    if not ports:
        raise ConfigError(f"--{flag}-ports needs at least one port")
    if len(hosts) == 1:
        hosts = list(hosts) * len(ports)
    if len(hosts) != len(ports):
        raise ConfigError(f"got {len(hosts)} --{flag}-hosts ({' '.join(hosts)}) for "
                          f"{len(ports)} --{flag}-ports ({' '.join(map(str, ports))}); give one "
                          f"host for all ports or one host per port")
    return tuple(base_url(h, p) for h, p in zip(hosts, ports, strict=True))
