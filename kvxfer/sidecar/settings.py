"""Everything ``kvxfer serve`` configures a sidecar with: :class:`Settings`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.net.hosts import advertised_host, bare_host, unreachable_advertised


@dataclass(frozen=True)
class Settings:
    """Everything ``kvxfer serve`` is configured with (see its ``--help``)."""

    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8000
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    tp: int = 1
    kv_cache_layout: str | None = None
    block_size: int = 16
    num_blocks: int = 256
    model: str = "kvxfer-tiny"
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    kv_load_failure_policy: str = "recompute"
    lease_ttl: float = 120.0
    lease_max_age: float | None = None  # None: 4 * lease_ttl
    read_lanes: int = 2
    nixl_backends: tuple[str, ...] = ("UCX",)  # what each rank's NIXL agent runs
    # offer and use host reads of converted reads (kvxfer.transfer.converted.host_reads)
    host_reads: bool = True
    served_model_names: tuple[str, ...] = ()
    # the side channel's shared key (kvxfer.net.kv_key); None: unauthenticated, loopback only
    kv_key: bytes | None = field(default=None, repr=False)
    api_key: str | None = None  # HTTP: required as "Authorization: Bearer KEY" when set
    kv_read_timeout: float = 10.0  # decode: bound on a KV load's handshake and on its READ
    # decode: a READ in flight from a prefill whose side channel answered no heartbeat for
    # this long fails (0: no heartbeats); see --kv-heartbeat-timeout
    kv_heartbeat_timeout: float = 2.0
    # decode: "push" also takes reservations that prefills WRITE into (kv_pushes.py), and
    # serves its metadata on the side channel for them
    kv_transfer_mode: str = "pull"
    # the address peers reach this instance at; None: the bind host (never a wildcard)
    advertise_host: str | None = None
    drain_timeout: float = 30.0  # after SIGTERM: longest wait for in-flight work and leases
    kv_packing: str = "token"  # how K and V share a head's block (plan/packing.py)
    enable_prefix_caching: bool = False  # the engine's prefix cache (engine/prefix_cache.py)

    def side_channel_advertised(self) -> str:
        """The host decodes are told for this prefill's side channel (ValueError: a
        wildcard bind without ``advertise_host``, or a loopback bind advertised as an
        address peers elsewhere would dial)."""
        advertised = advertised_host(self.side_channel_host, self.advertise_host,
                                     "--side-channel-host")
        problem = unreachable_advertised(self.side_channel_host, advertised,
                                         "--side-channel-host")
        if problem is not None:
            raise ValueError(problem)
        return advertised

    def http_advertised(self) -> str:
        """The HTTP host for the ready line and /health (the bind host, a wildcard
        included, when nothing else is known: nobody dials it from there)."""
        if self.advertise_host:
            return advertised_host(self.host, self.advertise_host, "--host")
        return bare_host(self.host)
