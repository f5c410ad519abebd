"""Everything ``kvxfer serve`` configures a sidecar with: :class:`Settings` (its transfers'
part is one :class:`~kvxfer.transfer.transfer_config.TransferConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.net.hosts import advertised_host, bare_host, unreachable_advertised
from kvxfer.transfer.transfer_config import TransferConfig


@dataclass(frozen=True)
class Settings:
    """Everything ``kvxfer serve`` is configured with (see its ``--help``)."""

    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8000
    tp: int = 1
    kv_cache_layout: str | None = None
    block_size: int = 16
    num_blocks: int = 256
    model: str = "kvxfer-tiny"
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None  # HTTP: required as "Authorization: Bearer KEY" when set
    drain_timeout: float = 30.0  # after SIGTERM: longest wait for in-flight work and leases
    kv_packing: str = "token"  # how K and V share a head's block (plan/packing.py)
    enable_prefix_caching: bool = False  # the engine's prefix cache (engine/prefix_cache.py)
    kv_events_port: int | None = None  # its KV event stream's PUB port (0: any free one)
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def __post_init__(self) -> None:
        port = self.kv_events_port
        if port is None:
            return
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"--kv-events-port {port!r} is not a TCP port (0: any free one)")
        if not self.enable_prefix_caching:
            raise ValueError("--kv-events-port publishes what the prefix cache holds: add "
                             "--enable-prefix-caching")

    @property
    def advertises(self) -> bool:
        """Whether others dial this instance on its side-channel host: peers its side
        channel (:attr:`serves_peers`), subscribers its KV event stream."""
        return self.serves_peers or self.kv_events_port is not None

    @property
    def serves_peers(self) -> bool:
        """Whether peers dial this instance's side channel: a prefill's leases, a push
        decode's reservations."""
        return self.role in ("prefill", "both") or self.transfer.kv_transfer_mode == "push"

    def side_channel_advertised(self) -> str:
        """The host decodes are told for this prefill's side channel (ValueError: a
        wildcard bind without ``advertise_host``, or a loopback bind advertised as an
        address peers elsewhere would dial)."""
        transfer = self.transfer
        advertised = advertised_host(transfer.side_channel_host, transfer.advertise_host,
                                     "--side-channel-host")
        problem = unreachable_advertised(transfer.side_channel_host, advertised,
                                         "--side-channel-host")
        if problem is not None:
            raise ValueError(problem)
        return advertised

    def http_advertised(self) -> str:
        """The HTTP host for the ready line and /health (the bind host, a wildcard
        included, when nothing else is known: nobody dials it from there)."""
        if self.transfer.advertise_host:
            return advertised_host(self.host, self.transfer.advertise_host, "--host")
        return bare_host(self.host)
