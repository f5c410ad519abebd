"""``TransferConfig``: every setting of an instance's KV transfers, in one typed place.

Built once, from ``kvxfer serve``'s flags (:func:`add_arguments`, :func:`from_arguments`)
or from vLLM's ``kv_connector_extra_config`` (:func:`from_mapping`), and handed whole to
whatever needs it: the sidecar's roles, each rank's
:class:`~kvxfer.transfer.worker.TransferWorker`, ``KvxferConnector``. Each field's
default, meaning and check are written here once (:data:`OPTIONS` documents them for
``--help`` and the docs). Pure: no torch, NIXL or ZMQ import.
"""

from __future__ import annotations

import argparse
import math
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import msgspec

TransferMode = Literal["pull", "push"]
FailurePolicy = Literal["recompute", "fail"]
TRANSFER_MODES: tuple[TransferMode, ...] = ("pull", "push")
FAILURE_POLICIES: tuple[FailurePolicy, ...] = ("recompute", "fail")
MIN_HEARTBEAT_TIMEOUT_S = 0.2  # heartbeats go out every timeout / 4: 50 ms at most
MAX_AGE_TTLS = 4  # a lease is renewed up to this many TTLs after it was handed out
HANDSHAKE_RETRIES = 1  # a handshake is tried twice, each attempt half the read timeout
DEFAULT_BACKENDS = ("UCX",)
# Copy threads per instance by default: a sidecar's TP ranks share them; a vLLM worker (a
# process per rank, which vLLM binds to its own cores, where lanes only take turns) one.
SIDECAR_LANES = 2


class ConfigError(ValueError):
    """A setting that cannot be used; ``name`` is the field's name."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message


@dataclass(frozen=True)
class Option:
    """How one field is offered to users: its flag, its environment variable, its help."""

    help: str
    flag: str = ""  # default: --field-name
    env: str | None = None  # the flag's default comes from this variable when set
    metavar: str | None = None


@dataclass(frozen=True)
class TransferConfig:
    """Everything an instance's KV transfers are configured with (see :data:`OPTIONS`)."""

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    advertise_host: str | None = None
    lease_ttl: float = 120.0
    lease_max_age: float | None = None  # None: MAX_AGE_TTLS x lease_ttl
    kv_read_timeout: float = 10.0
    handshake_timeout: float | None = None  # None: half kv_read_timeout
    kv_heartbeat_timeout: float = 2.0
    read_lanes: int | None = None  # None: SIDECAR_LANES per sidecar, 1 per vLLM worker
    host_reads: bool = True
    nixl_backends: tuple[str, ...] = DEFAULT_BACKENDS
    kv_transfer_mode: TransferMode = "pull"
    kv_load_failure_policy: FailurePolicy = "recompute"
    kv_key: bytes | None = field(default=None, repr=False)  # from a key file

    def __post_init__(self) -> None:
        _check_port("side_channel_port", self.side_channel_port)
        for name in ("side_channel_host", "advertise_host"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, f"must be a host name or address, got {value!r}")
        for name in ("lease_ttl", "lease_max_age", "kv_read_timeout", "handshake_timeout"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise ConfigError(name, f"must be a positive number of seconds, got {value!r}")
        if self.max_age < self.lease_ttl:
            raise ConfigError("lease_max_age", f"must be at least lease_ttl "
                                               f"({self.lease_ttl:g} s), got {self.max_age:g}")
        beat = self.kv_heartbeat_timeout
        if not (beat == 0 or (_positive(beat) and beat >= MIN_HEARTBEAT_TIMEOUT_S)):
            raise ConfigError("kv_heartbeat_timeout", f"must be 0 (off) or at least "
                                                      f"{MIN_HEARTBEAT_TIMEOUT_S} seconds, "
                                                      f"got {beat!r}")
        lanes = self.read_lanes
        if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int)
                                  or lanes < 1):
            raise ConfigError("read_lanes", f"must be at least 1, got {lanes!r}")
        backends = self.nixl_backends
        if not backends or len(set(backends)) != len(backends) or \
                not all(isinstance(b, str) and b for b in backends):
            raise ConfigError("nixl_backends", f"must name one or more different backends, "
                                               f"e.g. UCX or UCX,LIBFABRIC; got {backends!r}")
        if self.kv_transfer_mode not in TRANSFER_MODES:
            raise ConfigError("kv_transfer_mode", f"must be one of {', '.join(TRANSFER_MODES)}"
                                                  f", got {self.kv_transfer_mode!r}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ConfigError("kv_load_failure_policy", f"must be one of "
                                                        f"{', '.join(FAILURE_POLICIES)}, got "
                                                        f"{self.kv_load_failure_policy!r}")

    @property
    def max_age(self) -> float:
        """Seconds after it was handed out past which no lease is renewed (prefill) and
        params whose expiry is further ahead are refused (decode)."""
        return MAX_AGE_TTLS * self.lease_ttl if self.lease_max_age is None \
            else self.lease_max_age

    @property
    def handshake_attempt_s(self) -> float:
        """One handshake attempt; with its retry the two take at most ``kv_read_timeout``,
        so a frozen prefill costs no more than a READ would."""
        return self.kv_read_timeout / (1 + HANDSHAKE_RETRIES) if self.handshake_timeout \
            is None else self.handshake_timeout

    @property
    def advertised(self) -> str:
        """What peers are told to dial (the bind host unless ``advertise_host``)."""
        return self.advertise_host or self.side_channel_host

    def lanes_per_rank(self, ranks_in_process: int, default: int = SIDECAR_LANES) -> int:
        """Copy threads of each of ``ranks_in_process`` ranks that share this process's
        ``read_lanes`` (``default`` when unset)."""
        lanes = default if self.read_lanes is None else self.read_lanes
        return max(1, lanes // ranks_in_process)

    def with_changes(self, **changes: Any) -> TransferConfig:
        """A copy with ``changes``, checked as any config."""
        return replace(self, **changes)


# The help of every field (what `kvxfer serve --help` prints and the docs list); the field
# named as a flag: --side-channel-host for side_channel_host unless ``flag`` says otherwise.
OPTIONS: dict[str, Option] = {
    "side_channel_host": Option(
        "prefill, and a push decode: address the side-channel listener binds (0.0.0.0 or :: "
        "for every address, then --advertise-host is needed) (default "
        "$KVXFER_SIDE_CHANNEL_HOST, else 127.0.0.1)", env="KVXFER_SIDE_CHANNEL_HOST",
        metavar="HOST"),
    "side_channel_port": Option(
        "prefill, and a push decode: side-channel listener port (default 0: a free port; "
        "in vLLM, rank r listens on this + r)", metavar="PORT"),
    "advertise_host": Option(
        "the address peers reach this instance at: the remote_host decodes are told, and "
        "what /health reports; 'auto' is the address this host's name resolves to (default "
        "$KVXFER_ADVERTISE_HOST, else the bind host; required when the side channel binds "
        "a wildcard). A prefill reached on loopback keeps UCX on lo (UCX_NET_DEVICES, "
        "unless set)", env="KVXFER_ADVERTISE_HOST", metavar="HOST"),
    "lease_ttl": Option(
        "prefill: seconds leased blocks wait for their decode reader before they are "
        "freed; a decode that claimed the lease and still waits or reads renews it for as "
        "long again, up to --lease-max-age (default 120)", metavar="SECONDS"),
    "lease_max_age": Option(
        "prefill: no lease is renewed past this age, so its blocks are freed at the latest "
        "this long after the prefill; decode: params whose lease_expires_at is further "
        f"ahead are refused (default {MAX_AGE_TTLS} x --lease-ttl)", metavar="SECONDS"),
    "kv_read_timeout": Option(
        "decode: longest handshake with a prefill (all attempts together), and longest "
        "READ of one request's KV; then the read fails (recompute or 502, by policy) "
        "(default 10)", metavar="SECONDS"),
    "handshake_timeout": Option(
        "decode: one handshake attempt with a prefill (there are two) (default half "
        "--kv-read-timeout)", metavar="SECONDS"),
    "kv_heartbeat_timeout": Option(
        "decode: while a READ from a prefill is in flight, ask the prefill's side channel "
        "every SECONDS/4 whether it answers; a READ still in flight once a question went "
        "unanswered for SECONDS fails as at --kv-read-timeout (and the prefill counts as "
        "failed for a moment), so a cut link or a frozen prefill host is noticed within "
        "1.25 x SECONDS of going silent (2.5 s by default) instead of at --kv-read-timeout. "
        "A READ that completes is never failed for it. Keep it above the worst delay of the "
        "side channel's answers; 0 turns heartbeats off (default 2)", metavar="SECONDS"),
    "read_lanes": Option(
        "decode, KV in host memory: copy threads for large reads, each with its own NIXL "
        "agent, shared by the TP ranks of one process (each rank gets max(1, N // ranks)); "
        f"NIXL's cma transport copies in the posting thread (default {SIDECAR_LANES} for a "
        "sidecar; 1 for a vLLM worker, which vLLM binds to its own cores)", metavar="N"),
    "host_reads": Option(
        "KV in host memory: neither offer nor use reads on this host; a prefill keeps its "
        "cache in private memory. By default a prefill keeps it in a sealed memfd, and a "
        "decode on the same host (the same user or ptrace rights needed, as for NIXL's cma "
        "transport) whose read needs a conversion, or is cut at every block by two block "
        "sizes, copies it from the prefill's mapped cache (or with process_vm_readv from a "
        "prefill without one) instead of READing it into staging and copying it again",
        flag="--no-host-reads"),
    "nixl_backends": Option(
        "comma-separated NIXL backends each rank's agent runs (default UCX); a decode reads "
        "only from a prefill that runs one of them, and says so when none is shared",
        metavar="NAMES"),
    "kv_transfer_mode": Option(
        "decode: pull (the decode READs each prompt's KV from the prefill) or push: also "
        "reserve blocks on POST /v1/kv/reserve, which a prefill WRITEs the prompt's KV into "
        "as it computes it; the side channel (--side-channel-port) then serves this "
        "decode's metadata to prefills (default pull, or $KVXFER_TRANSFER_MODE)",
        env="KVXFER_TRANSFER_MODE"),
    "kv_load_failure_policy": Option(
        "decode: when a KV read fails, recompute the prompt locally or fail the request "
        "with HTTP 502 (default recompute)"),
    "kv_key": Option(
        "prefill and decode: the key shared by every instance that exchanges KV (at least "
        "16 bytes; mode 600, or 440 owned by root); it signs the side channel, NIXL "
        "notifications and lease tickets (default $KVXFER_KV_KEY_FILE, else none: "
        "unauthenticated, for loopback)", flag="--kv-key-file", env="KVXFER_KV_KEY_FILE",
        metavar="PATH"),
}
# the name a key file is given by in a mapping (vLLM's kv_connector_extra_config)
KEY_FILE = "kv_key_file"


def flag_of(name: str) -> str:
    """The command-line flag of field ``name``."""
    return OPTIONS[name].flag or "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """One flag per field of :class:`TransferConfig`, each with its help and default."""
    defaults = TransferConfig()
    for item in fields(TransferConfig):
        name, option = item.name, OPTIONS[item.name]
        flag, value = flag_of(name), getattr(defaults, name)
        env = os.environ.get(option.env) if option.env else None
        if name == "host_reads":
            parser.add_argument(flag, dest=name, action="store_false", help=option.help)
        elif name == "nixl_backends":
            parser.add_argument(flag, dest=name, default=",".join(value),
                                metavar=option.metavar, help=option.help)
        elif name in ("kv_transfer_mode", "kv_load_failure_policy"):
            choices = TRANSFER_MODES if name == "kv_transfer_mode" else FAILURE_POLICIES
            parser.add_argument(flag, dest=name, choices=choices, default=env or value,
                                help=option.help)
        elif name == "kv_key":
            parser.add_argument(flag, dest=KEY_FILE, default=None, metavar=option.metavar,
                                help=option.help)
        else:
            kind = int if name in ("side_channel_port", "read_lanes") else \
                str if name in ("side_channel_host", "advertise_host") else float
            parser.add_argument(flag, dest=name, type=kind, default=env or value,
                                metavar=option.metavar, help=option.help)


def from_arguments(args: argparse.Namespace) -> TransferConfig:
    """The config ``add_arguments``' flags say; :class:`ConfigError` names the flag (the
    key file is read: :class:`~kvxfer.net.kv_key.KvKeyError` when it cannot be used)."""
    values = {item.name: getattr(args, item.name) for item in fields(TransferConfig)
              if item.name != "kv_key"}
    values["nixl_backends"] = tuple(b.strip() for b in str(values["nixl_backends"]).split(","))
    try:
        return TransferConfig(**values, kv_key=_read_key(getattr(args, KEY_FILE)))
    except ConfigError as exc:
        raise ConfigError(flag_of(exc.name), exc.message) from None


def from_mapping(mapping: Mapping[str, Any], *, where: str,
                 refused: Mapping[str, str] | None = None,
                 defaults: TransferConfig | None = None) -> TransferConfig:
    """The config a mapping (vLLM's ``kv_connector_extra_config``) says; keys that are no
    field are left alone (another part's, or another connector's). ``refused``: fields
    this host cannot honour, with the reason (a value other than the default is a
    :class:`ConfigError`); ``where`` prefixes the key in errors."""
    defaults = defaults or TransferConfig()
    names = {item.name for item in fields(TransferConfig)} - {"kv_key"}
    values = {name: mapping[name] for name in names if name in mapping}
    for name, why in (refused or {}).items():
        if name in values and values[name] != getattr(defaults, name):
            raise ConfigError(f"{where}.{name}", why)
    types = _value_types()
    given: dict[str, Any] = {}
    for name, value in values.items():
        try:
            given[name] = msgspec.convert(value, types[name], strict=True)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{where}.{name}", _message_of(exc)) from None
    if KEY_FILE in mapping and mapping[KEY_FILE] is not None:
        if not isinstance(mapping[KEY_FILE], str) or not mapping[KEY_FILE]:
            raise ConfigError(f"{where}.{KEY_FILE}", f"must be a path, got "
                                                     f"{mapping[KEY_FILE]!r}")
        try:
            given["kv_key"] = _read_key(mapping[KEY_FILE], environment=False)
        except ValueError as exc:  # KvKeyError: missing, unreadable, unsafe, too short
            raise ConfigError(f"{where}.{KEY_FILE}", str(exc)) from None
    try:
        return replace(defaults, **given)
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc.name}", exc.message) from None


def _value_types() -> dict[str, Any]:
    """The type a mapping's value of each field must have: the field's own (a choice among
    strings as ``str``: :class:`TransferConfig` says which ones, and ranges)."""
    hints = typing.get_type_hints(TransferConfig)
    return {name: str if typing.get_origin(kind) is Literal else kind
            for name, kind in hints.items() if name != "kv_key"}


def _read_key(path: str | None, environment: bool = True) -> bytes | None:
    """The key in file ``path`` (else, with ``environment``, in $KVXFER_KV_KEY_FILE's)."""
    from kvxfer.net.kv_key import key_file_from, load_kv_key

    key_file = key_file_from(path) if environment else path
    return None if key_file is None else load_kv_key(key_file)


def _check_port(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
        raise ConfigError(name, f"must be a TCP port (0 for any free one), got {value!r}")


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and \
        0 < value < math.inf


def _message_of(exc: msgspec.ValidationError) -> str:
    return str(exc).partition(" - at `$")[0].replace("`", "").lower()
