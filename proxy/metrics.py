"""Prometheus metrics of one proxy app, in a registry of its own.

Each app owns a :class:`ProxyMetrics` (tests run several apps in one process,
so nothing goes to the global default registry). Per-instance health and load
are read from the balancer when scraped rather than mirrored on every change.
All durations are seconds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.balancer import Balancer

# LLM answers span milliseconds (one prefill token) to minutes (long decodes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class InstanceCollector(Collector):
    """``kvxfer_proxy_instance_healthy``, ``..._outstanding`` and ``..._indexed_blocks``
    read from the balancer."""

    def __init__(self, balancer: Balancer) -> None:
        self._balancer = balancer

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily("kvxfer_proxy_instance_healthy",
                                    "1 if the instance takes requests, else 0",
                                    labels=["role", "instance"])
        outstanding = GaugeMetricFamily("kvxfer_proxy_instance_outstanding",
                                        "calls to the instance in flight",
                                        labels=["role", "instance"])
        indexed = GaugeMetricFamily("kvxfer_proxy_instance_indexed_blocks",
                                    "blocks the instance caches, as its KV events tell",
                                    labels=["role", "instance"])
        blocks = self._balancer.kv.blocks() if self._balancer.kv is not None else {}
        for instance in self._balancer.instances():
            labels = [instance.role, instance.url]
            healthy.add_metric(labels, 1.0 if instance.healthy else 0.0)
            outstanding.add_metric(labels, float(instance.outstanding))
            if instance.url in blocks:
                indexed.add_metric(labels, float(blocks[instance.url]))
        yield healthy
        yield outstanding
        yield indexed


class ProxyMetrics:
    """The metrics one app records; ``route`` labels are paths of known routes or "other"."""

    def __init__(self, balancer: Balancer, routes: tuple[str, ...]) -> None:
        self.routes = frozenset(routes)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvxfer_proxy_requests", "client requests answered",
                                ["route", "status"], registry=r)
        self.in_flight = Gauge("kvxfer_proxy_in_flight_requests",
                               "client requests being answered", ["route"], registry=r)
        self.time_to_first_byte = Histogram(
            "kvxfer_proxy_time_to_first_byte_seconds",
            "from a client request's arrival to the first byte of its answer's body",
            ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_latency = Histogram(
            "kvxfer_proxy_upstream_latency_seconds",
            "from sending a call to an instance to the last byte of its answer",
            ["role", "instance"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter(
            "kvxfer_proxy_upstream_errors", "failed calls to an instance, by kind",
            ["role", "instance", "kind"], registry=r)
        self.retries = Counter(
            "kvxfer_proxy_retries",
            "requests run again after a failed call, by the role of the instance that failed",
            ["role"], registry=r)
        self.client_disconnects = Counter(
            "kvxfer_proxy_client_disconnects",
            "requests whose client left before the answer ended (upstream call cancelled)",
            ["route"], registry=r)
        self.kv_events = Counter(
            "kvxfer_proxy_kv_event_messages",
            "KV event messages from an instance, by outcome: applied, replayed gaps "
            "(gap_replayed), gaps that could not be (gap_unfilled: index emptied), and "
            "refused ones (unsigned, bad_mac, malformed)", ["instance", "outcome"], registry=r)
        self.routed = Counter(
            "kvxfer_proxy_routed",
            "completion requests by path: pd (prefill then decode) or decode (a decode "
            "alone computes the prompt), and why: pays, short (few tokens left to compute "
            "on the best prefill), prefills_saturated, no_prefill", ["path", "reason"],
            registry=r)
        self.pd_unread = Counter(
            "kvxfer_proxy_pd_unread",
            "requests sent prefill then decode (of those the prefill was asked about) whose "
            "decode read no KV, computing the prompt itself: P/D is not happening between "
            "that pair", ["prefill", "decode"],
            registry=r)
        r.register(InstanceCollector(balancer))

    def route_label(self, path: str) -> str:
        """The path itself for a known route; "other" keeps unknown paths from adding series."""
        return path if path in self.routes else "other"

    def render(self) -> bytes:
        """The Prometheus text exposition of this app's registry."""
        return generate_latest(self.registry)
