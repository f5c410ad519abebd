"""Which threads of a process group left the CPU cores the group was bound to.

``kvxfer bench vllm`` binds each vLLM instance, every process and thread of it, to one
core, so that the prefill and the decode never take turns on a core. Something inside
may rebind a thread later: vLLM 0.32's NixlConnector, on a CPU, moves the thread that
creates it (the worker's main thread, which also runs the model) to the last core of
each NUMA node, "reserved" for KV transfers; on a 2-core machine that is core 1, the
decode's, for the prefill too. :func:`strayed_threads` finds such threads and
:func:`rebind` binds them back, so that a run compares instances that each keep their
own core, and says which threads it moved back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


def _group_pids(pgid: int) -> list[int]:
    """The processes whose process group is ``pgid``."""
    pids = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # after "(comm)": state, ppid, pgrp, ... (comm may hold spaces and parentheses)
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
            pids.append(int(entry.name))
    return sorted(pids)


@dataclass(frozen=True)
class Strayed:
    """A thread (``tid`` of process ``pid``, named ``name``) allowed on ``cores``."""

    tid: int
    pid: int
    name: str
    cores: str  # the cores it may run on, e.g. "1" or "0,1"

    def __str__(self) -> str:
        return f"{self.name} (thread {self.tid} of {self.pid}): cores {self.cores}"


def strayed_threads(pgid: int, cores: set[int]) -> list[Strayed]:
    """Every thread of process group ``pgid`` that may run on other cores than ``cores``;
    empty when all stayed."""
    strayed = []
    for pid in _group_pids(pgid):
        for task in sorted((PROC / str(pid) / "task").glob("[0-9]*"),
                           key=lambda t: int(t.name)):
            try:
                tid = int(task.name)
                allowed = os.sched_getaffinity(tid)
                name = (task / "comm").read_text().strip()
            except OSError:  # the thread ended meanwhile
                continue
            if allowed != cores:
                cores_now = ",".join(str(core) for core in sorted(allowed))
                strayed.append(Strayed(tid, pid, name, cores_now))
    return strayed


def rebind(strayed: list[Strayed], cores: set[int]) -> list[Strayed]:
    """Bind each of ``strayed`` to ``cores`` again; those that ended meanwhile are left
    out of what it returns (the threads bound back)."""
    bound = []
    for thread in strayed:
        try:
            os.sched_setaffinity(thread.tid, cores)
        except (ProcessLookupError, PermissionError):
            continue
        bound.append(thread)
    return bound
