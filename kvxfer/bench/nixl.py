"""``kvxfer bench nixl``: what :mod:`kvxfer.transfer.nixl_agent` costs against a real peer
process: idle CPU, first READ latency, request building and bandwidth.

Design: docs/design/bench.md#kvxfer-bench-nixl
"""

from __future__ import annotations

import argparse
import json
import time
from multiprocessing.connection import Connection
from typing import Any

HELP = "measure NIXL agent idle CPU, first-READ latency, request building and bandwidth"

IDLE_CADENCES_S = (0.05, 0.01, 0.0005)
BUILD_COUNTS = (128, 512, 2048, 8192, 32768)
BANDWIDTH_CASES = ((128, 2 << 20), (4096, 64 << 10))
_REPLY_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--idle-seconds", type=float, default=3.0,
                        help="seconds per idle-CPU measurement (default 3)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per timed case")
    parser.add_argument("--buffer-mib", type=int, default=256,
                        help="size of the target and local buffers in MiB (default 256)")


def _serve_target(conn: Connection, nbytes: int, lifetime_s: float) -> None:
    """Child process: register ``nbytes``, progress every 0.5 ms until told to stop."""
    import numpy as np

    from kvxfer.plan.regions import MemoryRegion
    from kvxfer.transfer.nixl_agent import NixlAgent

    data = np.ones(nbytes, dtype=np.uint8)  # touched, so no page faults inside reads
    with NixlAgent("bench-target") as agent:
        agent.register([MemoryRegion(addr=data.ctypes.data, nbytes=nbytes, device_id=0)])
        conn.send((agent.metadata(), data.ctypes.data))
        deadline = time.monotonic() + lifetime_s
        while time.monotonic() < deadline and not conn.poll(0.0005):
            agent.progress()


class _Bench:
    """The measuring side: a local buffer, and a fresh agent per connection case."""

    def __init__(self, args: argparse.Namespace) -> None:
        import multiprocessing

        import numpy as np

        self.np = np
        self.nbytes = args.buffer_mib << 20
        self.repeats = args.repeats
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve_target, args=(child, self.nbytes, 3600.0),
                                   daemon=True)
        self.process.start()
        if not self.conn.poll(_REPLY_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"bench target did not start within {_REPLY_TIMEOUT_S} s")
        self.metadata, self.remote_addr = self.conn.recv()
        self.local = np.ones(self.nbytes, dtype=np.uint8)

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)

    def agent(self, name: str) -> Any:
        from kvxfer.plan.regions import MemoryRegion
        from kvxfer.transfer.nixl_agent import NixlAgent

        agent = NixlAgent(name)
        agent.register([MemoryRegion(addr=self.local.ctypes.data, nbytes=self.nbytes,
                                     device_id=0)])
        return agent

    def probe(self) -> Any:
        from kvxfer.plan.regions import MemoryRegion

        return MemoryRegion(addr=self.remote_addr, nbytes=self.nbytes, device_id=0)

    def descs(self, base: int, offsets: Any, lengths: Any) -> Any:
        out = self.np.zeros((len(offsets), 3), dtype=self.np.uint64)
        out[:, 0] = self.np.uint64(base) + offsets.astype(self.np.uint64)
        out[:, 1] = lengths
        return out


def _wait(transfer: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while transfer.state() != "DONE":
        if time.monotonic() > deadline:
            raise RuntimeError(f"READ not done after {timeout_s} s")


def _idle_cpu(bench: _Bench, seconds: float) -> list[dict[str, Any]]:
    agent = bench.agent("bench-idle")
    try:
        remote = agent.add_remote(bench.metadata)
        agent.connect(remote, bench.probe())
        rows = []
        for cadence in (None, *IDLE_CADENCES_S):
            start_cpu, start = time.process_time(), time.monotonic()
            while time.monotonic() - start < seconds:
                if cadence is None:
                    time.sleep(0.05)  # baseline: agent held, never progressed
                else:
                    agent.progress()
                    time.sleep(cadence)
            share = (time.process_time() - start_cpu) / (time.monotonic() - start)
            rows.append({"progress_every_ms": None if cadence is None else cadence * 1e3,
                         "cpu_percent_of_one_core": round(100 * share, 2)})
        return rows
    finally:
        agent.close()


def _first_read(bench: _Bench) -> list[dict[str, Any]]:
    np = bench.np
    size = 2 << 20
    rows = []
    for how in ("none", "make_connection", "probe_read"):
        connects: list[float] = []
        firsts: list[float] = []
        seconds: list[float] = []
        for rep in range(bench.repeats):
            agent = bench.agent(f"bench-first-{how}-{rep}")
            try:
                remote = agent.add_remote(bench.metadata)
                start = time.perf_counter()
                if how != "none":
                    agent.connect(remote, bench.probe() if how == "probe_read" else None)
                connects.append(time.perf_counter() - start)
                for index, out in enumerate((firsts, seconds)):
                    offset = np.array([index * size])
                    local = bench.descs(bench.local.ctypes.data, offset, size)
                    far = bench.descs(bench.remote_addr, offset, size)
                    start = time.perf_counter()
                    transfer = agent.read(remote, local, far)
                    _wait(transfer)
                    out.append(time.perf_counter() - start)
                    transfer.release()
            finally:
                agent.close()
        rows.append({"warm_up": how, "connect_ms": round(float(np.median(connects)) * 1e3, 2),
                     "first_read_ms": round(float(np.median(firsts)) * 1e3, 2),
                     "second_read_ms": round(float(np.median(seconds)) * 1e3, 2)})
    return rows


def _scattered(bench: _Bench, count: int, rng: Any) -> tuple[Any, Any]:
    """Offsets and lengths of ``count`` non-adjacent ranges of arbitrary length."""
    np = bench.np
    slot = bench.nbytes // count
    lengths = rng.integers(64, max(65, min(slot // 2, 64 << 10)), count)
    offsets = np.arange(count) * slot + rng.integers(1, slot // 4, count)
    return offsets, lengths


def _build_cost(bench: _Bench) -> list[dict[str, Any]]:
    np = bench.np
    rng = np.random.default_rng(0)
    agent = bench.agent("bench-build")
    try:
        remote = agent.add_remote(bench.metadata)
        agent.connect(remote, bench.probe())
        # Below NixlAgent's API on purpose: this compares NIXL's two ways of
        # building a request, of which NixlAgent.read uses the faster.
        raw = agent._api_agent()
        rows = []
        for count in BUILD_COUNTS:
            times: dict[str, list[tuple[float, float]]] = {"oneshot": [], "prepped": []}
            for rep in range(bench.repeats):
                # fresh ranges per path and alternating order, so neither path
                # reads what the other just pulled into the cache
                for path in sorted(times, reverse=bool(rep % 2)):
                    offsets, lengths = _scattered(bench, count, rng)
                    local = bench.descs(bench.local.ctypes.data, offsets, lengths)
                    far = bench.descs(bench.remote_addr, offsets, lengths)
                    start = time.perf_counter()
                    handle, lists = _build(raw, path, remote, local, far)
                    built = time.perf_counter()
                    state = raw.transfer(handle)
                    while state == "PROC":
                        state = raw.check_xfer_state(handle)
                    times[path].append((built - start, time.perf_counter() - built))
                    handle.release()
                    for prepped in lists:
                        prepped.release()
            for path, samples in times.items():
                build_s, post_s = np.median(np.array(samples), axis=0)
                rows.append({"descriptors": count, "path": path,
                             "build_us_per_desc": round(float(build_s) / count * 1e6, 3),
                             "post_us_per_desc": round(float(post_s) / count * 1e6, 3),
                             "build_ms": round(float(build_s) * 1e3, 3)})
        return rows
    finally:
        agent.close()


def _build(raw: Any, path: str, remote: str, local: Any, far: Any) -> tuple[Any, list[Any]]:
    if path == "oneshot":
        handle = raw.initialize_xfer("READ", raw.get_xfer_descs(local, "DRAM"),
                                     raw.get_xfer_descs(far, "DRAM"), remote, b"")
        return handle, []
    import numpy as np

    mine = raw.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
    theirs = raw.prep_xfer_dlist(remote, far, "DRAM")
    index = np.arange(len(local), dtype=np.int32)
    return raw.make_prepped_xfer("READ", mine, index, theirs, index, b""), [mine, theirs]


def _bandwidth(bench: _Bench) -> list[dict[str, Any]]:
    np = bench.np
    rng = np.random.default_rng(1)
    agent = bench.agent("bench-bandwidth")
    try:
        remote = agent.add_remote(bench.metadata)
        agent.connect(remote, bench.probe())
        rows = []
        for count, size in BANDWIDTH_CASES:
            slots = bench.nbytes // size
            if count > slots:
                continue
            posts, totals = [], []
            for rep in range(bench.repeats + 1):  # the first run faults pages in; dropped
                local = rng.permutation(slots)[:count] * size
                far = rng.permutation(slots)[:count] * size
                start = time.perf_counter()
                transfer = agent.read(remote, bench.descs(bench.local.ctypes.data, local, size),
                                      bench.descs(bench.remote_addr, far, size), b"done")
                posted = time.perf_counter()
                _wait(transfer)
                if rep:
                    posts.append(posted - start)
                    totals.append(time.perf_counter() - start)
                transfer.release()
            total = float(np.median(totals))
            rows.append({"descriptors": count, "desc_bytes": size, "total_bytes": count * size,
                         "post_ms": round(float(np.median(posts)) * 1e3, 2),
                         "total_ms": round(total * 1e3, 2),
                         "gb_per_s": round(count * size / total / 1e9, 2)})
        return rows
    finally:
        agent.close()


def _print(results: dict[str, list[dict[str, Any]]]) -> None:
    for title, rows in results.items():
        print(f"\n{title}")
        if not rows:
            continue
        keys = list(rows[0])
        print("  ".join(f"{k:>14}" for k in keys))
        for row in rows:
            print("  ".join(f"{row[k]!s:>14}" for k in keys))


def run(args: argparse.Namespace) -> int:
    bench = _Bench(args)
    try:
        results = {
            "idle CPU (this process, all threads)": _idle_cpu(bench, args.idle_seconds),
            "first 2 MiB READ on a fresh connection": _first_read(bench),
            "request building: one-shot vs prepped": _build_cost(bench),
            f"bandwidth, one {args.buffer_mib} MiB READ": _bandwidth(bench),
        }
    finally:
        bench.close()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print(results)
    return 0
