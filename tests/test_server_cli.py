"""``kvxfer serve`` as a command: help, start-up lines, one-line errors, clean shutdown.

Every case runs the real command in its own process: help, SIGTERM and the start-up
ones in a new interpreter, the others forked from the preloaded server
(:mod:`kvxfer.harness.preloaded`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecars import ROOT, Sidecar, SidecarGroup, Spec, free_port

from kvxfer.harness import preloaded

SERVE = [sys.executable, "-m", "kvxfer.cli", "serve"]


def run_serve(*args: str, timeout: float = 60.0, fresh: bool = False,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if fresh:
        return subprocess.run([*SERVE, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, check=False, env=env)
    return preloaded.run("kvxfer.cli", ["serve", *args], ROOT, env, timeout)


def assert_one_line_error(done: subprocess.CompletedProcess[str], *names: str) -> None:
    assert done.returncode == 2, f"exit {done.returncode}:\n{done.stderr}"
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("kvxfer serve: error: ")
    assert "Traceback" not in done.stderr
    for name in names:
        assert name in errors[0], f"{name!r} not named in {errors[0]!r}"


def test_help_lists_roles_and_flags() -> None:
    done = run_serve("--help", fresh=True)
    assert done.returncode == 0
    for text in ("prefill", "decode", "both", "--side-channel-port", "--tp",
                 "--kv-cache-layout", "KVXFER_KV_CACHE_LAYOUT", "--block-size", "--num-blocks",
                 "--kv-load-failure-policy", "--lease-ttl", "--served-model-name", "ready",
                 "--api-key", "--api-key-file", "KVXFER_API_KEY", "--kv-read-timeout",
                 "--kv-heartbeat-timeout", "--no-host-reads", "--kv-events-port"):
        assert text in done.stdout, f"{text!r} missing from --help"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on for the duration of the test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def test_http_port_in_use_is_a_one_line_error(taken_port: int) -> None:
    assert_one_line_error(run_serve("--port", str(taken_port)), f"HTTP port {taken_port}")


def test_kv_events_port_in_use_is_a_one_line_error(taken_port: int) -> None:
    done = run_serve("--port", str(free_port()), "--enable-prefix-caching",
                     "--kv-events-port", str(taken_port))
    assert_one_line_error(done, f"127.0.0.1:{taken_port}")


def test_side_channel_port_in_use_is_a_one_line_error(taken_port: int) -> None:
    done = run_serve("--role", "prefill", "--port", str(free_port()),
                     "--side-channel-port", str(taken_port))
    assert_one_line_error(done, f"127.0.0.1:{taken_port}")


@pytest.mark.parametrize(("args", "named"), [
    (("--tp", "3"), "3"),
    (("--model", "no/such/checkpoint"), "no/such/checkpoint"),
    (("--kv-cache-layout", "XYZ"), "XYZ"),
    (("--port", "70000"), "70000"),
    (("--lease-ttl", "0"), "--lease-ttl"),
    (("--read-lanes", "0"), "--read-lanes"),
    (("--kv-read-timeout", "0"), "--kv-read-timeout"),
    (("--kv-heartbeat-timeout", "-1"), "--kv-heartbeat-timeout"),
    (("--kv-heartbeat-timeout", "0.05"), "at least 0.2 seconds"),
    (("--kv-heartbeat-timeout", "inf"), "--kv-heartbeat-timeout"),
    (("--api-key", " "), "--api-key"),
    (("--api-key-file", "no/such/key-file"), "no/such/key-file"),
    (("--api-key", "k", "--api-key-file", "f"), "not both"),
    (("--kv-events-port", "0"), "add --enable-prefix-caching"),
    (("--kv-events-port", "70000", "--enable-prefix-caching"), "--kv-events-port 70000"),
], ids=["tp", "model", "layout", "port", "lease-ttl", "read-lanes", "kv-read-timeout",
        "heartbeat-negative", "heartbeat-too-short", "heartbeat-inf", "empty-api-key",
        "missing-key-file", "key-and-file", "kv-events-without-prefix-cache",
        "kv-events-port"])
def test_bad_settings_are_one_line_errors(args: tuple[str, ...], named: str) -> None:
    assert_one_line_error(run_serve("--port", str(free_port()), *args), named)


@pytest.mark.parametrize(("case", "reason"), [
    ("wrong magic", "not a GGUF file"),
    ("not llama", "architecture 'qwen2' is not supported"),
    ("unsupported quantization", "has type Q8_1"),
    ("truncated data", "corrupt or truncated"),
])
def test_a_broken_gguf_fails_at_start_up_naming_the_file_and_reason(
        tmp_path: Path, case: str, reason: str) -> None:
    from gguf_files import write_broken_gguf

    from kvxfer.engine import init_weights, tiny_config

    path = write_broken_gguf(tmp_path, tiny_config(), init_weights(tiny_config(), 0), case)
    done = run_serve("--port", str(free_port()), "--model", str(path),
                     env={**os.environ, "KVXFER_CACHE_DIR": str(tmp_path / "cache")})
    assert_one_line_error(done, str(path), reason)


@pytest.fixture
def group(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
          ) -> Iterator[SidecarGroup]:
    """Sidecars in a new interpreter for SIGTERM (what a deployment sends), forked
    preloaded for SIGINT."""
    fresh = request.node.callspec.params["sig"] == signal.SIGTERM
    with SidecarGroup(tmp_path_factory.mktemp("cli"), fresh=fresh) as started:
        yield started


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_the_sidecar_cleanly(group: SidecarGroup, sig: int) -> None:
    prefill: Sidecar = group.start_one(Spec("prefill", tp=2))
    health = prefill.health()
    answer = prefill.post("/v1/completions", {"prompt": "bye", "max_tokens": 2})
    assert answer.status_code == 200
    log = prefill.log_tail(200)
    ready = [line for line in log.splitlines() if line.startswith("kvxfer serve ready: ")]
    assert ready and f"http://127.0.0.1:{prefill.port}" in ready[0]
    started = next(line for line in log.splitlines() if "kvxfer serve: role=prefill" in line)
    for text in ("model=kvxfer-tiny", "layout=LBHNC", "tp=2", f"http=127.0.0.1:{prefill.port}",
                 f"side_channel=127.0.0.1:{health['side_channel_port']}",
                 f"engine_id={health['engine_id']}"):
        assert text in started, f"{text!r} missing from the start-up line {started!r}"
    assert prefill.stop(sig) == 0
    log = prefill.log_tail(400)
    assert "Traceback" not in log and "Application shutdown complete" in log
    with socket.socket() as sock:  # the side channel was closed too
        sock.bind(("127.0.0.1", health["side_channel_port"]))


def test_signal_during_start_up_stops_it_quietly(tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    log_path = tmp_path_factory.mktemp("early") / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*SERVE, "--role", "prefill", "--port", str(free_port())],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(1.0)  # inside imports or engine construction
        process.send_signal(signal.SIGTERM)
        code = process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    output = log_path.read_text(errors="replace")
    assert code in (0, -signal.SIGTERM), f"exit {code}:\n{output}"
    assert "Traceback" not in output, output


@pytest.mark.parametrize("source", ["file", "env"])
def test_the_api_key_comes_from_a_file_or_the_environment(
        tmp_path: Path, source: str) -> None:
    key = "sk-from-" + source
    if source == "file":
        (tmp_path / "key").write_text(key + "\n")
        (tmp_path / "key").chmod(0o600)
        spec, env = Spec(extra=("--api-key-file", str(tmp_path / "key"))), None
    else:
        spec, env = Spec(), {"KVXFER_API_KEY": key}
    with SidecarGroup(tmp_path, env) as group:
        sidecar = group.start_one(spec)
        refused = sidecar.get("/v1/models")
        assert refused.status_code == 401, refused.text
        served = sidecar.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        assert served.status_code == 200, served.text
        assert sidecar.get("/health").json() == {"status": "ok"}
        assert "no --api-key" not in sidecar.log_tail()
