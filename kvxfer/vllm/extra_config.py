"""``KvxferConnector``'s settings, read from vLLM's ``kv_connector_extra_config`` (pure).

Every key is optional::

    {"side_channel_host": "127.0.0.1",  # where the prefill's handshake listener binds
     "side_channel_port": 0,            # TP rank r listens on this + r; 0: free ports, told
                                        # to the scheduler at start-up
     "advertise_host": null,            # what decodes are told to dial (default: the bind host)
     "lease_ttl": 120, "lease_max_age": null,   # seconds; max age defaults to 4 x ttl
     "kv_read_timeout": 10, "handshake_timeout": 5,
     "read_wait": 0.05,                 # a step waits this long for a claim or READ in flight
     "read_lanes": 1,                   # copy threads of a decode's READ (host memory)
     "host_reads": true,                # a prefill on this host may be copied from, not
                                        # READ (the probe at connect chooses): from its
                                        # mapped cache (this instance's own is
                                        # allocated shared for its readers:
                                        # kvxfer.vllm.allocation), or converted reads by
                                        # kvxfer.transfer.converted.host_reads
     "kv_key_file": null,               # the shared KV key: signs side channel and tickets
     "model_id": null,                  # what peers must share (default: the served name)
     "span_probe": false}            # benchmarks only: see SPAN_PROBE_KEY

A bad value raises :class:`SettingsError` naming the key, at vLLM's start-up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# A decode load whose kv_transfer_params carry ``"kvxfer_span_probe": true`` is a benchmark's
# probe: the same bytes as one READ of whole memory spans (kvxfer.plan.span_probe), from the
# load's first block on over whatever blocks follow, other requests' included. Only a
# decode started with ``span_probe: true`` takes it; any other fails it as a bad load.
SPAN_PROBE_KEY = "kvxfer_span_probe"


class SettingsError(ValueError):
    """A ``kv_connector_extra_config`` value KvxferConnector cannot use; names the key."""


@dataclass(frozen=True)
class ConnectorSettings:
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    advertise_host: str | None = None
    lease_ttl: float = 120.0
    lease_max_age: float | None = None
    kv_read_timeout: float = 10.0
    handshake_timeout: float = 5.0
    # vLLM steps a decode in a busy loop while a request waits for its KV; a step that
    # polled and returned at once would take the core from the thread copying it (NIXL's
    # cma copies on the reader's CPU). A step with a claim or READ in flight instead
    # waits for it up to this long (0: never), as a synchronous READ would block it.
    read_wait: float = 0.05
    # Copy threads of a READ. vLLM binds a CPU worker to its cores (one, here): lanes on
    # one core only take turns, so 1 unless the worker may use more cores.
    read_lanes: int = 1
    host_reads: bool = True
    kv_key_file: str | None = None
    model_id: str | None = None
    span_probe: bool = False  # benchmarks only (SPAN_PROBE_KEY)

    @property
    def max_age(self) -> float:
        return 4 * self.lease_ttl if self.lease_max_age is None else self.lease_max_age

    @property
    def host_for_peers(self) -> str:
        return self.advertise_host or self.side_channel_host

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Validate the kvxfer keys of ``extra`` (other connectors' keys are left alone)."""
        extra = dict(extra or {})
        values = {f.name: extra[f.name] for f in fields(cls) if f.name in extra}
        for name in ("side_channel_host", "advertise_host", "kv_key_file", "model_id"):
            if name not in values or (values[name] is None and name != "side_channel_host"):
                continue  # absent, or null for an optional key
            value = values[name]
            if not isinstance(value, str) or not value:
                raise SettingsError(f"kv_connector_extra_config.{name} must be a non-empty "
                                    f"string, got {value!r}")
        for name in ("side_channel_port", "read_lanes"):
            value = values.get(name, getattr(cls, name))
            if isinstance(value, bool) or not isinstance(value, int):
                raise SettingsError(f"kv_connector_extra_config.{name} must be an integer, "
                                    f"got {value!r}")
        if not 0 <= values.get("side_channel_port", 0) < 65536:
            raise SettingsError(f"kv_connector_extra_config.side_channel_port must be a TCP "
                                f"port (0 for any free one), got {values['side_channel_port']}")
        if values.get("read_lanes", 1) < 1:
            raise SettingsError(f"kv_connector_extra_config.read_lanes must be at least 1, got "
                                f"{values['read_lanes']}")
        for name in ("host_reads", "span_probe"):
            if not isinstance(values.get(name, False), bool):
                raise SettingsError(f"kv_connector_extra_config.{name} must be true or "
                                    f"false, got {values[name]!r}")
        for name in ("lease_ttl", "lease_max_age", "kv_read_timeout", "handshake_timeout",
                     "read_wait"):
            if name not in values or (values[name] is None and name == "lease_max_age"):
                continue  # absent, or null for the optional max age
            seconds = _finite(values[name])
            if seconds is None or seconds < 0 or (seconds == 0 and name != "read_wait"):
                least = "zero or more" if name == "read_wait" else "a positive number of"
                raise SettingsError(f"kv_connector_extra_config.{name} must be {least} "
                                    f"seconds, got {values[name]!r}")
            values[name] = seconds
        settings = cls(**values)
        if settings.max_age < settings.lease_ttl:
            raise SettingsError(f"kv_connector_extra_config.lease_max_age ({settings.max_age:g} "
                                f"s) must be at least lease_ttl ({settings.lease_ttl:g} s)")
        return settings


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, a bool, inf, nan, too large)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        return None
    return number if math.isfinite(number) else None
