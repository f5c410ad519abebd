"""``KvxferConnector``'s settings, read from vLLM's ``kv_connector_extra_config`` (pure).

Every key is optional. The transfer keys are the fields of
:class:`~kvxfer.transfer.transfer_config.TransferConfig` (what ``kvxfer serve`` takes as
flags, with the same defaults and checks; ``kv_key_file`` names the key), but
``read_lanes`` defaults to 1 here (vLLM binds each worker to its own cores). Two are
refused with the reason (:data:`REFUSED`). Three keys are vLLM's own::

    {"read_wait": 0.05,        # a step waits this long for a claim or READ in flight
     "model_id": null,         # what peers must share (default: the served name)
     "span_probe": false}      # benchmarks only: see SPAN_PROBE_KEY

A bad value raises :class:`SettingsError` naming the key, at vLLM's start-up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvxfer.transfer.transfer_config import ConfigError, TransferConfig, from_mapping

# A decode load whose kv_transfer_params carry ``"kvxfer_span_probe": true`` is a benchmark's
# probe: the same bytes as one READ of whole memory spans (kvxfer.plan.span_probe), from the
# load's first block on over whatever blocks follow, other requests' included. Only a
# decode started with ``span_probe: true`` takes it; any other fails it as a bad load.
SPAN_PROBE_KEY = "kvxfer_span_probe"
WHERE = "kv_connector_extra_config"
VLLM_LANES = 1  # copy threads of a vLLM worker by default: one process per rank and core
# transfer settings KvxferConnector cannot honour, and why
REFUSED = {
    "kv_transfer_mode": "KvxferConnector reads by pull only for now: leave it out (or "
                        "\"pull\")",
    "kv_load_failure_policy": "vLLM decides what a failed load becomes: set "
                              "kv_load_failure_policy in --kv-transfer-config instead",
}


class SettingsError(ValueError):
    """A ``kv_connector_extra_config`` value KvxferConnector cannot use; names the key."""


@dataclass(frozen=True)
class ConnectorSettings:
    """The transfers' config and the three keys only KvxferConnector takes."""

    transfer: TransferConfig = field(default_factory=TransferConfig)
    # vLLM steps a decode in a busy loop while a request waits for its KV; a step that
    # polled and returned at once would take the core from the thread copying it (NIXL's
    # cma copies on the reader's CPU). A step with a claim or READ in flight instead
    # waits for it up to this long (0: never), as a synchronous READ would block it.
    read_wait: float = 0.05
    model_id: str | None = None
    span_probe: bool = False  # benchmarks only (SPAN_PROBE_KEY)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Validate the kvxfer keys of ``extra`` (other connectors' keys are left alone)."""
        extra = dict(extra or {})
        try:
            transfer = from_mapping(extra, where=WHERE, refused=REFUSED)
        except (ConfigError, ValueError) as exc:  # a key file that cannot be used too
            raise SettingsError(str(exc)) from None
        values: dict[str, Any] = {}
        if "read_wait" in extra:
            wait = extra["read_wait"]
            if isinstance(wait, bool) or not isinstance(wait, int | float) or \
                    not 0 <= wait < math.inf:
                raise SettingsError(f"{WHERE}.read_wait: must be zero or more seconds, got "
                                    f"{wait!r}")
            values["read_wait"] = float(wait)
        if extra.get("model_id") is not None:
            if not isinstance(extra["model_id"], str) or not extra["model_id"]:
                raise SettingsError(f"{WHERE}.model_id: must be a non-empty string, got "
                                    f"{extra['model_id']!r}")
            values["model_id"] = extra["model_id"]
        if "span_probe" in extra:
            if not isinstance(extra["span_probe"], bool):
                raise SettingsError(f"{WHERE}.span_probe: must be true or false, got "
                                    f"{extra['span_probe']!r}")
            values["span_probe"] = extra["span_probe"]
        return cls(transfer=transfer, **values)

    @property
    def lanes(self) -> int:
        """This worker's copy threads (``read_lanes``, else :data:`VLLM_LANES`)."""
        return self.transfer.lanes_per_rank(1, VLLM_LANES)
