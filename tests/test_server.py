"""Disaggregated serving over real HTTP, NIXL and ZMQ: prefill and decode sidecars in
separate processes must answer exactly what one plain (``both``) instance answers.

For every layout and the TP pairs 1->1, 1->2, 2->1, 2->2 (and one mixed-layout
pair), a request goes to the prefill (one token, ``do_remote_decode``), then to
the decode with the prefill's ``kv_transfer_params``, as the proxy sends them.
Decodes run with ``--kv-load-failure-policy fail``, so a read that silently
failed cannot hide behind a recompute; their metrics must also show the reads.

Layouts whose heads sit inside the token dimension (LBNHC, BLNHC) cannot be
head-split by byte copies: there a TP change goes through a staged, converted read
(:mod:`kvxfer.plan.staging`), and must answer the same.

Process budget: the run's shared ``both`` reference, and per layout group one
prefill and one decode for each TP, started once (while the previous group's cases
run) and stopped when the group's cases are done (:class:`LayoutGroups`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sidecars import Sidecar, SidecarGroup, Spec, disaggregated

LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC", "LHBNC")
TP_PAIRS = ((1, 1), (1, 2), (2, 1), (2, 2))
MIXED = ("BLHNC", "LBHNC")  # prefill layout, decode layout; started with the BLHNC group
TOLERANCE = 1e-4

# A 1-block prompt (its KV is one token short of a block: only the last token is
# recomputed) and a 5-block prompt given as token ids, ending mid-block.
PROMPTS: tuple[str | list[int], ...] = (
    "Hi there",
    [256, *[(7 * i + 3) % 256 for i in range(69)]],
)
BODY = {"max_tokens": 8, "temperature": 0, "logprobs": 2, "ignore_eos": True}

# (group, prefill layout, decode layout, prefill TP, decode TP), grouped by group.
CASES = [case for layout in LAYOUTS for case in (
    [(layout, layout, layout, p, d) for p, d in TP_PAIRS]
    + ([(layout, *MIXED, 1, 1)] if layout == MIXED[0] else []))]


def group_specs(layout: str) -> list[Spec]:
    specs = [Spec(role, layout, tp, policy="fail" if role == "decode" else "recompute")
             for role in ("prefill", "decode") for tp in (1, 2)]
    if layout == MIXED[0]:
        specs.append(Spec("decode", MIXED[1], 1, policy="fail"))
    return specs


@pytest.fixture(scope="module")
def reference(plain: Sidecar) -> dict[int, dict[str, Any]]:
    """The ``both`` instance's answer for every prompt (the run's shared one, queried
    once)."""
    answers = {}
    for i, prompt in enumerate(PROMPTS):
        response = plain.post("/v1/completions", {**BODY, "prompt": prompt})
        assert response.status_code == 200, response.text
        answers[i] = response.json()["choices"][0]
    return answers


class LayoutGroups:
    """Starts the sidecars of one layout group at a time, stopping the previous group; the
    next group's sidecars start while a group's cases run.

    The cases are ordered by group, so each group starts once per module (a
    parametrised fixture cannot do this: pytest keys its instances by case).
    """

    def __init__(self, log_dir: Path, order: list[str]) -> None:
        self.log_dir = log_dir
        self.order = order
        self.layout: str | None = None
        self.group: SidecarGroup | None = None
        self.sidecars: dict[tuple[str, str, int], Sidecar] = {}
        self.launched: dict[str, tuple[SidecarGroup, list[Sidecar]]] = {}

    def get(self, layout: str) -> dict[tuple[str, str, int], Sidecar]:
        if layout != self.layout:
            self.close_current()
            self.launch(layout)
            group, started = self.launched.pop(layout)
            self.group, self.layout = group, layout
            self.sidecars = {(s.spec.role, s.spec.layout, s.spec.tp): s
                             for s in group.wait_ready(started)}
            later = self.order[self.order.index(layout) + 1:]
            if later:
                self.launch(later[0])
        return self.sidecars

    def launch(self, layout: str) -> None:
        if layout not in self.launched:
            log_dir = self.log_dir / f"{layout}-{time.monotonic_ns()}"
            log_dir.mkdir()
            group = SidecarGroup(log_dir)
            self.launched[layout] = (group, group.launch(group_specs(layout)))

    def close_current(self) -> None:
        if self.group is not None:
            self.group.close()
        self.layout, self.group, self.sidecars = None, None, {}

    def close(self) -> None:
        self.close_current()
        for group, _ in self.launched.values():
            group.close()
        self.launched.clear()


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LayoutGroups]:
    pool = LayoutGroups(tmp_path_factory.mktemp("groups"), list(LAYOUTS))
    try:
        yield pool
    finally:
        pool.close()


def assert_same_choice(got: dict[str, Any], want: dict[str, Any], label: str) -> None:
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"], \
        f"{label}: tokens differ:\n got  {got['logprobs']}\n want {want['logprobs']}"
    assert got["text"] == want["text"], f"{label}: text differs"
    for i, (a, b) in enumerate(zip(got["logprobs"]["token_logprobs"],
                                   want["logprobs"]["token_logprobs"], strict=True)):
        assert math.isclose(a, b, abs_tol=TOLERANCE), \
            f"{label}: token {i} logprob {a} != reference {b}"
    assert got["finish_reason"] == want["finish_reason"] == "length"


@pytest.mark.parametrize(("group", "prefill_layout", "decode_layout", "prefill_tp", "decode_tp"),
                         CASES)
def test_disaggregated_answer_matches_single_instance(
        groups: LayoutGroups, reference: dict[int, dict[str, Any]], group: str,
        prefill_layout: str, decode_layout: str, prefill_tp: int, decode_tp: int) -> None:
    sidecars = groups.get(group)
    prefill = sidecars[("prefill", prefill_layout, prefill_tp)]
    decode = sidecars[("decode", decode_layout, decode_tp)]
    reads_before = decode.metric("kvxfer_kv_transfers_total", outcome="ok")
    for i, prompt in enumerate(PROMPTS):
        label = f"{prefill_layout} TP{prefill_tp} -> {decode_layout} TP{decode_tp}, prompt {i}"
        first, second = disaggregated(prefill, decode, "/v1/completions",
                                      {**BODY, "prompt": prompt}, request_id=f"case-{i}")
        params = first.json()["kv_transfer_params"]
        assert params["tp_size"] == prefill_tp
        assert params["remote_engine_id"] == prefill.health()["engine_id"]
        assert second.status_code == 200, f"{label}: {second.status_code} {second.text}"
        answer = second.json()
        assert answer["kv_transfer_params"] is None
        assert_same_choice(answer["choices"][0], reference[i], f"{label} (lease {params})")
    reads = decode.metric("kvxfer_kv_transfers_total", outcome="ok") - reads_before
    assert reads == len(PROMPTS), "the decode did not read the KV over NIXL"
    assert decode.metric("kvxfer_kv_recomputes_total") == 0
    decode.wait_for("every decode block free", lambda h: h["used_blocks"] == 0)
