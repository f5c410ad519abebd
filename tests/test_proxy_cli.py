"""``python -m proxy`` and ``kvxfer bench proxy`` as a user runs them: real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from stub_upstream import Stub, bind_loopback, wait_until

from kvxfer.harness import preloaded

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 30.0


def run(*args: str, env: dict[str, str] | None = None, fresh: bool = False
        ) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` (``-m MODULE ...``) in a process of its own: forked from the preloaded
    server (:mod:`kvxfer.harness.preloaded`), or with ``fresh`` a new interpreter."""
    if fresh:
        return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env=env)
    assert args[0] == "-m", args
    return preloaded.run(args[1], args[2:], ROOT, env, timeout=120)


def free_port() -> int:
    sock = bind_loopback()
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.close()


def our_children() -> set[int]:
    """PIDs of stub, proxy and hop processes (``-m proxy.stub`` / ``-m proxy`` /
    ``-m kvxfer.bench.hop``) now running."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(argv[i] == b"-m" and argv[i + 1] in (b"proxy", b"proxy.stub", b"kvxfer.bench.hop")
               for i in range(len(argv) - 1)):
            found.add(int(entry.name))
    return found


def test_help_lists_the_flags() -> None:
    done = run("-m", "proxy", "--help", fresh=True)
    assert done.returncode == 0, done.stderr
    for flag in ("--host", "--port", "--prefiller-hosts", "--prefiller-ports", "--decoder-hosts",
                 "--decoder-ports", "--policy", "least_outstanding", "--api-key",
                 "KVXFER_PROXY_API_KEY", "--connect-timeout", "--request-timeout",
                 "--health-interval", "--api-key-file", "--upstream-api-key",
                 "--upstream-api-key-file", "KVXFER_API_KEY", "--prefill-timeout", "--retries"):
        assert flag in done.stdout


@pytest.mark.parametrize(("args", "says"), [
    (["--decoder-hosts", "a", "b", "--decoder-ports", "1", "2", "3"],
     "got 2 --decoder-hosts (a b) for 3 --decoder-ports (1 2 3)"),
    (["--prefiller-hosts", "a", "b", "c", "--prefiller-ports", "7"],
     "got 3 --prefiller-hosts (a b c) for 1 --prefiller-ports (7)"),
    (["--request-timeout", "0"], "--request-timeout must be positive, got 0.0"),
    (["--prefill-timeout", "-1"], "--prefill-timeout must be positive, got -1.0"),
    (["--health-failures", "0"], "--health-failures must be at least 1, got 0"),
    (["--retries", "-1"], "--retries must be 0..5, got -1"),
    (["--retries", "6"], "--retries must be 0..5, got 6"),
    (["--upstream-api-key", " "], "--upstream-api-key is empty"),
    (["--api-key-file", "no/such/key"], "cannot read --api-key-file no/such/key"),
    (["--policy", "random"], "invalid choice: 'random'")])
def test_bad_flags_exit_2_naming_the_value(args: list[str], says: str) -> None:
    done = run("-m", "proxy", *args)
    assert done.returncode == 2
    assert says in done.stderr


@pytest.fixture
def proxy_process() -> Iterator[tuple[subprocess.Popen[str], str, list[Stub]]]:
    """``python -m proxy`` (API key from the environment) in front of two stub threads."""
    stubs = [Stub("prefill"), Stub("decode")]
    process: subprocess.Popen[str] | None = None
    try:
        for stub in stubs:
            stub.server.start()
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "--port", str(port),
             "--prefiller-ports", str(stubs[0].server.port),
             "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(stubs[1].server.port)],
            cwd=ROOT, env=dict(os.environ, KVXFER_PROXY_API_KEY="k3y"), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        yield process, f"http://127.0.0.1:{port}", stubs
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.communicate(timeout=WAIT_S)
        for stub in stubs:
            stub.server.stop()


def test_serves_and_stops_cleanly_on_sigterm(
        proxy_process: tuple[subprocess.Popen[str], str, list[Stub]]) -> None:
    process, url, stubs = proxy_process
    client = httpx.Client(timeout=WAIT_S, trust_env=False)

    def up() -> bool:
        assert process.poll() is None, process.communicate()[1]
        try:
            return client.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, WAIT_S, "the proxy process to answer /health", step_s=0.05)
    assert client.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    answer = client.post(url + "/v1/completions", json={"prompt": "x"},
                         headers={"Authorization": "Bearer k3y"})
    assert answer.status_code == 200, answer.text
    assert [len(s.record.calls()) for s in stubs] == [1, 1]
    client.close()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=WAIT_S)
    assert process.returncode == 0, stderr
    assert "stopped by SIGTERM" in stderr


def test_bench_proxy_reports_every_target() -> None:
    before = our_children()
    done = run("-m", "kvxfer.cli", "bench", "proxy", "--requests", "6", "--concurrency", "1",
               "3", "--warmup", "1", "--chunks", "3", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    rows = {(r["mode"], r["target"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {(m, t, c) for m in ("json", "stream")
                         for t in ("decode", "prefill+decode", "proxy") for c in (1, 3)}
    for row in rows.values():
        assert (row["requests"], row["errors"]) == (6, 0), row
        assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"] and row["rps"] > 0
        assert (row["ttfb_p50_ms"] is None) == (row["mode"] == "json")
    assert len(result["added_p50_ms"]) == 4
    assert result["rounds"] == 5  # the default; 6 requests per cell, split over the rounds
    floor = {(r["mode"], r["target"], r["concurrency"]): r for r in result["floor"]}
    assert set(floor) == {("json", "hop", 1), ("json", "hop", 3)}
    assert all((r["requests"], r["errors"]) == (6, 0) for r in floor.values()), floor
    for added in result["added_p50_ms"]:
        assert added["under_target"] == (added["vs_prefill+decode"] < 1.0), added
        assert added["hop_p50_ms"] == floor[("json", "hop", added["concurrency"])]["p50_ms"]
    assert our_children() <= before  # every stub, proxy and hop process is gone


@pytest.mark.parametrize(("args", "says"), [
    (["--requests", "0"], "--requests must be at least 1, got 0"),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--concurrency", "4", "0"], "--concurrency values must be at least 1, got [4, 0]")])
def test_bench_proxy_refuses_bad_counts(args: list[str], says: str) -> None:
    done = run("-m", "kvxfer.cli", "bench", "proxy", *args)
    assert done.returncode == 2 and says in done.stderr


def test_bench_names_a_child_that_died_at_startup(tmp_path: Path) -> None:
    from kvxfer.bench.proxy import wait_healthy

    log = (tmp_path / "stderr").open("w+b")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('no port for me')"],
                             stderr=log)
    try:
        with pytest.raises(RuntimeError, match="decode process exited with status 1:\nno port "
                                               "for me"):
            wait_healthy("decode", child, log, f"http://127.0.0.1:{free_port()}/health")
    finally:
        child.wait(timeout=WAIT_S)
        log.close()


def test_bench_proxy_stops_its_processes_on_ctrl_c() -> None:
    before = our_children()
    bench = subprocess.Popen([sys.executable, "-m", "kvxfer.cli", "bench", "proxy",
                              "--requests", "100000", "--max-seconds", "60"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(our_children() - before) == 4 or bench.poll() is not None,
                   WAIT_S, "the bench to start its four processes", step_s=0.05)
        started = our_children() - before
        assert len(started) == 4, bench.communicate()
        bench.send_signal(signal.SIGINT)
        _, stderr = bench.communicate(timeout=WAIT_S)
        assert bench.returncode == 130, stderr
        assert "interrupted" in stderr
        assert not started & our_children()
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate(timeout=WAIT_S)


def test_port_0_picks_a_free_port_and_prints_the_ready_line() -> None:
    process = subprocess.Popen([sys.executable, "-m", "proxy", "--port", "0", "--log-level",
                                "warning", "--prefiller-ports", "9", "--decoder-ports", "9"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed at every log level
        assert line.startswith("kvxfer-proxy ready: http://127.0.0.1:"), line
        url = line.split()[-1]
        assert int(url.rsplit(":", 1)[1]) > 0
        health = httpx.get(url + "/health", timeout=WAIT_S, trust_env=False)
        assert health.status_code == 503, health.text  # it serves; port 9 has no instance
        assert "prefill" in health.text
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=WAIT_S)
    assert process.returncode == 0


def test_busy_port_is_a_one_line_error_naming_it() -> None:
    with bind_loopback() as busy:
        busy.listen()
        port = busy.getsockname()[1]
        done = run("-m", "proxy", "--port", str(port))
    assert done.returncode == 2
    assert f"127.0.0.1:{port}" in done.stderr and "--port" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_api_key_file_others_may_read_is_refused_with_the_fix(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-readable\n")
    key.chmod(0o644)
    done = run("-m", "proxy", "--api-key-file", str(key))
    assert done.returncode == 2
    assert f"--api-key-file {key} is accessible by others (mode 0644); run chmod 600" \
        in done.stderr


def test_a_key_on_the_command_line_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    from kvxfer.net.api_key import load_key

    with caplog.at_level("WARNING", logger="kvxfer.net.api_key"):
        assert load_key("sk-typed", None, "KVXFER_API_KEY", "--api-key") == "sk-typed"
        assert load_key(None, None, "KVXFER_NO_SUCH_VARIABLE", "--api-key") is None
    [warning] = caplog.records
    assert "--api-key on the command line shows in the process list" in warning.getMessage()
    assert "--api-key-file" in warning.getMessage() and "$KVXFER_API_KEY" in warning.getMessage()
