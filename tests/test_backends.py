"""NIXL backends (``kvxfer serve --nixl-backends``): each rank's agent runs the chosen
ones and says so in the handshake; a decode reads only from a prefill it shares one
with, and otherwise fails the read naming both lists. Real roles over kvxfer-tiny,
real NIXL agents and ZMQ side channels."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from sidecars import ROOT
from test_release import prompt, pulled
from test_transfer_metrics import PARAMS, TOKENS, Make, held, pump, value

from kvxfer.transfer.nixl_agent import NixlAgent, NixlUnavailableError
from kvxfer.wire.params import RemoteParams


def test_a_shared_backend_is_enough_and_every_backend_is_advertised(make: Make) -> None:
    prefill = make("prefill", nixl_backends=("UCX", "POSIX"))
    decode = make("decode", kv_load_failure_policy="fail")
    assert prefill.ranks.workers[0].metadata().backends == ("UCX", "POSIX")
    params = held(prefill, "p")
    decode.admit(pulled("d", prompt(TOKENS), PARAMS, RemoteParams.parse(params)))
    pump(prefill, decode, until=lambda: value(decode, "kvxfer_kv_transfers_total",
                                              outcome="ok") == 1)


def test_no_backend_in_common_fails_the_read_naming_both(make: Make,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The prefill's answer says it runs LIBFABRIC only (as one started with
    ``--nixl-backends LIBFABRIC`` would; that plugin has no provider on this machine)."""
    prefill = make("prefill")
    decode = make("decode", kv_load_failure_policy="fail")
    worker = prefill.ranks.workers[0]
    real = worker.metadata
    monkeypatch.setattr(worker, "metadata",
                        lambda: msgspec.structs.replace(real(), backends=("LIBFABRIC",)))
    params = held(prefill, "p")
    sub = pulled("d", prompt(TOKENS), PARAMS, RemoteParams.parse(params))
    decode.admit(sub)
    errors: list[str | None] = []
    pump(prefill, decode, until=lambda: bool(errors.append(decode.transfer_error("d", sub.kind))
                                             or errors[-1]))
    assert "prefill rank 0 runs NIXL backends LIBFABRIC and this decode UCX: no backend in " \
           "common; start both with a shared --nixl-backends" in (errors[-1] or "")
    pump(prefill, decode, until=lambda: prefill.gauges()["leases"] == 0)  # released, freed


def test_a_missing_backend_plugin_names_what_is_there() -> None:
    with pytest.raises(NixlUnavailableError, match=r"the NOPE backend plugin is missing .*"
                                                   r"plugins found: .*UCX"):
        NixlAgent("probe", ("NOPE",))


def test_serve_refuses_a_bad_backend_list_before_loading_anything() -> None:
    done = subprocess.run([sys.executable, "-m", "kvxfer.cli", "serve", "--role", "prefill",
                           "--nixl-backends", "UCX,,UCX"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "--nixl-backends: must name one or more different backends" in done.stderr
