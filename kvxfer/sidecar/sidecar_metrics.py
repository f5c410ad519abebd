"""Prometheus metrics of one sidecar, in a registry of its own (one per app).

Who writes what: the HTTP middleware counts requests by route and status; the
engine loop counts tokens and publishes KV block and lease gauges, and the
engine's prefix cache totals, after every iteration; the roles record
transfers, failures, recomputes, reads skipped and lease releases, and what their
workers counted (failed handshakes, failed and late "done" notifications, and each
prefill peer's read path with what it moved and its ceiling:
``TransferWorker.take_counts``, :meth:`SidecarMetrics.count_path`). ``GET /metrics``
renders :meth:`SidecarMetrics.render`.

Units: bytes for sizes, seconds for durations, tokens and blocks as counts.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "HANDSHAKE_FAILURE_REASONS", "SidecarMetrics"]

# A tiny-model KV read takes ~0.1-10 ms on one host; large models over a network
# take up to seconds.
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                      1.0, 2.5, 5.0, 10.0, 30.0)
# One request's read: a few KiB (a tiny model's short prompt) to GiB (long prompts of
# large models); descriptors from 1 (one cross-layer run) to ~10^5 (per layer and head).
TRANSFER_BYTES_BUCKETS = tuple(float(4**k) for k in range(5, 17))  # 1 KiB .. 4 GiB
TRANSFER_DESCRIPTORS_BUCKETS = tuple(float(4**k) for k in range(10))  # 1 .. 262144

# The label values of each counter, exported from the start (at 0) so that rates and
# alerts see them before the first event.
LEASE_END_REASONS = ("done", "failed", "abandoned", "cached", "answered", "expired")
TRANSFER_OUTCOMES = ("ok", "failed", "aborted")
# kvxfer.transfer.side_channel.failures.FAILURE_REASONS, and "connect": NIXL could not connect
# after it
HANDSHAKE_FAILURE_REASONS = ("timeout", "unreachable", "refused", "mismatch", "auth",
                             "malformed", "connect", "error")
NOTIFICATION_FAILURES = ("unsent", "bad_signature", "malformed", "dropped")
LATE_NOTIFICATION_REASONS = (*LEASE_END_REASONS, "unknown")


class SidecarMetrics:
    """Every metric the sidecar exports; all thread-safe (prometheus-client locks)."""

    def __init__(self, *, role: str, engine_id: str, model: str, layout: str, tp: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        info = Gauge("kvxfer_sidecar_info", "Constant 1, labelled with the sidecar's identity",
                     ["role", "engine_id", "model", "layout", "tp"], registry=r)
        info.labels(role, engine_id, model, layout, str(tp)).set(1)
        self.http_requests = Counter("kvxfer_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.prompt_tokens = Counter("kvxfer_prompt_tokens", "Prompt tokens of requests that "
                                     "produced their first token (transferred KV included)",
                                     registry=r)
        self.generation_tokens = Counter("kvxfer_generation_tokens", "Tokens generated",
                                         registry=r)
        self.blocks_free = Gauge("kvxfer_kv_blocks_free", "KV cache blocks free", registry=r)
        self.blocks_used = Gauge("kvxfer_kv_blocks_used", "KV cache blocks allocated "
                                 "(running, parked and leased requests)", registry=r)
        self.requests_in_flight = Gauge("kvxfer_requests_in_flight", "Requests the engine loop "
                                        "tracks (queued, running, parked or leased)", registry=r)
        self.leases_held = Gauge("kvxfer_kv_leases_held", "Prefill: requests whose blocks are "
                                 "leased to decode readers", registry=r)
        self.reservations_held = Gauge("kvxfer_kv_reservations_held", "Decode, push mode: "
                                       "reservations held (written into, waiting for their "
                                       "request, or both)", registry=r)
        self.quarantined_blocks = Gauge("kvxfer_kv_quarantined_blocks", "Decode: blocks out of "
                                        "use until a peer's transfer into them ended (a READ "
                                        "or push given up while its bytes may still land)",
                                        registry=r)
        self.leases_released = Counter("kvxfer_kv_leases_released", "Prefill: leases ended, by "
                                       "reason (done: every reader said so; failed: every "
                                       "reader said so, one that it gave up; abandoned: the "
                                       "decode released it unread over the side channel; "
                                       "cached: released unread, the decode's prefix cache "
                                       "held it all; expired: TTL)", ["reason"], registry=r)
        self.transfer_bytes = Counter("kvxfer_kv_transfer_bytes", "Decode: KV bytes read from "
                                      "prefill instances (all TP ranks); push mode: the bytes "
                                      "of the reserved blocks prefills wrote", registry=r)
        self.transfer_descriptors = Counter("kvxfer_kv_transfer_descriptors", "Decode: NIXL "
                                            "descriptors posted by finished reads", registry=r)
        self.transfer_seconds = Histogram("kvxfer_kv_transfer_duration_seconds", "Decode: one "
                                          "request's KV read, start to last rank done",
                                          buckets=TRANSFER_BUCKETS_S, registry=r)
        self.read_wait = Histogram("kvxfer_kv_read_wait_seconds", "Decode: from a request's "
                                   "arrival to its KV read's start (lease check, claim, waiting "
                                   "for blocks)", buckets=TRANSFER_BUCKETS_S, registry=r)
        self.transfer_size = Histogram("kvxfer_kv_transfer_size_bytes", "Decode: KV bytes one "
                                       "request's successful read moved (all TP ranks)",
                                       buckets=TRANSFER_BYTES_BUCKETS, registry=r)
        self.transfer_size_descriptors = Histogram(
            "kvxfer_kv_transfer_size_descriptors", "Decode: NIXL descriptors one request's "
            "successful read posted (all TP ranks)", buckets=TRANSFER_DESCRIPTORS_BUCKETS,
            registry=r)
        self.transfers = Counter("kvxfer_kv_transfers", "Decode: KV reads that ended, by "
                                 "outcome (ok, failed, aborted)", ["outcome"], registry=r)
        self.transfer_failures = Counter("kvxfer_kv_transfer_failures", "Decode: KV reads that "
                                         "failed on at least one rank", registry=r)
        self.recomputes = Counter("kvxfer_kv_recomputes", "Decode: failed reads whose prompt "
                                  "was recomputed locally (policy recompute)", registry=r)
        self.sibling_copies = Counter("kvxfer_kv_sibling_copies", "Decode: samples of an n > 1 "
                                      "request started from a local copy of the KV its first "
                                      "sample read (not read again, not recomputed)",
                                      registry=r)
        self.prefix_cache_queries = Counter(
            "kvxfer_prefix_cache_queries", "Tokens looked up in the engine's prefix cache, "
            "one lookup per admitted request (its tokens but the last, which is always "
            "computed); 0 without --enable-prefix-caching", registry=r)
        self.prefix_cache_hits = Counter(
            "kvxfer_prefix_cache_hits", "Of kvxfer_prefix_cache_queries, tokens whose KV was "
            "cached (not computed, not read)", registry=r)
        self.prefix_cache_blocks = Gauge(
            "kvxfer_prefix_cache_blocks", "KV cache blocks the prefix cache holds now, used "
            "or idle (idle ones count as free: they are evicted, least recently used first, "
            "when blocks run short)", registry=r)
        self.reads_skipped = Counter(
            "kvxfer_kv_reads_skipped", "Decode: requests whose prompt KV the prefix cache held "
            "in full: nothing read, the lease released over the side channel at once",
            registry=r)
        self.handshake_failures = Counter(
            "kvxfer_kv_handshake_failures", "Decode: handshakes with a prefill that failed, "
            "one per decode TP rank and handshake (retries included), by reason (timeout, "
            "unreachable: nothing listens, refused, mismatch: another model, protocol, layout "
            "or TP, auth: another key, malformed, connect: NIXL could not connect, error)",
            ["reason"], registry=r)
        self.notifications_failed = Counter(
            "kvxfer_kv_notifications_failed", "\"done\" notifications that failed, one per "
            "notification, by reason (unsent: the decode could not send it; bad_signature, "
            "malformed: the prefill ignored it, it did not verify or decode; dropped: lost on "
            "purpose, KVXFER_DROP_MESSAGES)", ["reason"],
            registry=r)
        path_labels = ["peer", "path"]
        self.path_bytes = Counter(
            "kvxfer_kv_path_bytes", "Decode: KV bytes finished reads placed, by prefill peer "
            "(engine id) and the path its ranks are read over (mapped: copied from its cache "
            "mapped here; host: process_vm_readv; staged: NIXL READs into staging, then a "
            "copy; nixl: NIXL READs), all TP ranks", path_labels, registry=r)
        self.path_seconds = Counter(
            "kvxfer_kv_path_seconds", "Decode: seconds the paths of kvxfer_kv_path_bytes ran, "
            "post to landed, summed over TP ranks (bytes / seconds: the achieved rate per "
            "rank)", path_labels, registry=r)
        self.path_rate = Gauge(
            "kvxfer_kv_path_bytes_per_second", "Decode: the rate a peer's path achieved, per "
            "TP rank: kvxfer_kv_path_bytes over kvxfer_kv_path_seconds since the peer was "
            "first read (1e9: 1 GB/s; a window: the ratio of the two counters' rates)",
            path_labels, registry=r)
        self.path_ceiling = Gauge(
            "kvxfer_kv_path_ceiling_bytes_per_second", "Decode: the path's ceiling, the rate "
            "a probe of it reached per TP rank when the peer connected (a peer's path is "
            "chosen from those probes); absent where not measured (GPU caches)", path_labels,
            registry=r)
        self.path_ceiling_share = Gauge(
            "kvxfer_kv_path_ceiling_share", "Decode: kvxfer_kv_path_bytes_per_second over "
            "kvxfer_kv_path_ceiling_bytes_per_second (1: reads move at the probe's rate)",
            path_labels, registry=r)
        self._ceilings: dict[tuple[str, str], float] = {}
        self._moved: dict[tuple[str, str], tuple[int, float]] = {}  # bytes, seconds
        self.notifications_late = Counter(
            "kvxfer_kv_notifications_late", "Prefill: \"done\" notifications for a lease "
            "no longer held, one per notification, by how that lease had ended (done, "
            "abandoned, cached, expired; unknown: ended too long ago to be remembered, or never "
            "held)", ["reason"], registry=r)
        for counter, labels in ((self.leases_released, LEASE_END_REASONS),
                                (self.transfers, TRANSFER_OUTCOMES),
                                (self.handshake_failures, HANDSHAKE_FAILURE_REASONS),
                                (self.notifications_failed, NOTIFICATION_FAILURES),
                                (self.notifications_late, LATE_NOTIFICATION_REASONS)):
            for label in labels:
                counter.labels(label)

    def count_path(self, peer: str, path: str, num_bytes: int, seconds: float,
                   ceiling: float | None = None) -> None:
        """What reads of prefill ``peer`` moved over ``path`` since the last call
        (``num_bytes`` in ``seconds``, both summed over TP ranks; 0 when it just connected)
        and the path's ``ceiling`` in bytes per second, when measured."""
        if ceiling is not None:
            self._ceilings[peer, path] = ceiling
            self.path_ceiling.labels(peer, path).set(ceiling)
        self.path_bytes.labels(peer, path).inc(num_bytes)
        self.path_seconds.labels(peer, path).inc(seconds)
        moved, took = self._moved.get((peer, path), (0, 0.0))
        moved, took = moved + num_bytes, took + seconds
        self._moved[peer, path] = moved, took
        if moved <= 0 or took <= 0:
            return
        rate = moved / took
        self.path_rate.labels(peer, path).set(rate)
        known = self._ceilings.get((peer, path))
        if known:
            self.path_ceiling_share.labels(peer, path).set(rate / known)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
