"""kvxfer-proxy as a fleet router over real vLLM instances: two vLLM prefills and one vLLM
decode (KvxferConnector, vLLM's own KV events from ``--kv-events-config``) behind it, and a
vLLM instance started without a KV connector.

Checked: a prompt whose prefix one prefill holds goes to that prefill, turn after turn (its
prefix cache hits show it, the other prefill sees none of them), and the answers are one
instance's; a decode without a connector, which answers 200 while it computes every prompt
itself, raises the proxy's alarm for its pair."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import (
    completion,
    kv_events_args,
    kv_events_flag,
    metric,
    proxy_over,
)
from sidecars import Spec, sidecars

from kvxfer.bench.vllm import (
    SERVED_NAME,
    VllmServer,
    free_port,
    kv_transfer_config,
    model_directory,
    prompt_ids,
    started,
)

BLOCK = 128  # vLLM's CPU block size: its events' blocks
SHARED = 600  # tokens every turn starts with: 4 whole blocks


@pytest.fixture(scope="module")
def others(kvxfer_pair: tuple[VllmServer, VllmServer], vllm_python: str, log_dir: Path,
           pair_extra: dict[str, object]) -> Iterator[dict[str, Any]]:
    """A second KvxferConnector prefill with KV events, and an instance without a
    connector; both eager (compiling for them alone took a minute or two)."""
    ports = (free_port(), free_port())
    second = VllmServer("kvxfer-prefill-2", vllm_python, model_directory(),
                        kv_transfer_config("kvxfer", pair_extra), 0, log_dir,
                        args=("--enforce-eager", *kv_events_args(ports)))
    plain = VllmServer("no-connector", vllm_python, model_directory(), {}, 1, log_dir,
                       args=("--enforce-eager",))
    with started(second, plain):
        yield {"second": second, "ports": ports, "plain": plain}


def queries(server: VllmServer) -> float:
    return metric(server.url, "vllm:prefix_cache_queries_total")


def hits(server: VllmServer) -> float:
    return metric(server.url, "vllm:prefix_cache_hits_total")


def proxy_state(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/health", timeout=30).json())


def wait_until(what: str, check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_prompt_goes_to_the_vllm_prefill_that_holds_its_prefix(
        kvxfer_pair: tuple[VllmServer, VllmServer], others: dict[str, Any],
        pair_events: dict[str, tuple[int, int]], log_dir: Path) -> None:
    first, decode = kvxfer_pair
    second, plain = others["second"], others["plain"]
    prefills = [first, second]
    streams = ("--kv-events", kv_events_flag(first, pair_events["prefill"]),
               kv_events_flag(second, others["ports"]),
               kv_events_flag(decode, pair_events["decode"]))
    with proxy_over(prefills, [decode], log_dir, streams) as proxy:
        shared = prompt_ids(SHARED, 91)
        before = [queries(p) for p in prefills]
        body = {"max_tokens": 4, "temperature": 0, "logprobs": 1}
        completion(proxy, {"prompt": shared, **body})
        holder = next(i for i, p in enumerate(prefills) if queries(p) > before[i])
        other = prefills[1 - holder]
        held = prefills[holder].url

        def indexed() -> int:
            state = next(i for i in proxy_state(proxy)["instances"] if i["url"] == held)
            return int((state.get("kv_events") or {}).get("blocks", 0))

        wait_until("the holder's blocks in the proxy's index", lambda: indexed() >= 4)
        other_before, hits_before = queries(other), hits(prefills[holder])
        for turn in range(3):  # round robin would send one or two to the other prefill
            prompt = [*shared, *prompt_ids(40, 200 + turn)]
            got = completion(proxy, {"prompt": prompt, **body})["choices"][0]
            want = completion(plain.url, {"prompt": prompt, **body})["choices"][0]
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            worst = max(abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"],
                                                   want["logprobs"]["token_logprobs"],
                                                   strict=True))
            assert worst <= 1e-3, f"log-probabilities differ by up to {worst}"
        assert queries(other) == other_before, "a turn went to the prefill without its prefix"
        assert hits(prefills[holder]) - hits_before >= 3 * (SHARED // BLOCK) * BLOCK


def test_a_vllm_decode_without_a_connector_raises_the_alarm(
        others: dict[str, Any], log_dir: Path) -> None:
    """A kvxfer sidecar prefill leases the KV; the vLLM instance without a connector
    answers 200 from its own prefill, never claiming the lease: the proxy says so."""
    plain = others["plain"]
    spec = Spec(role="prefill", block_size=BLOCK, num_blocks=16,
                extra=("--model", "smollm2-135m-instruct", "--dtype", "float32",
                       "--kv-packing", "vllm-cpu-vec", "--served-model-name", SERVED_NAME))
    sidecar_logs = log_dir / "sidecar-alarm"
    sidecar_logs.mkdir(exist_ok=True)
    with sidecars(sidecar_logs, [spec]) as (prefill,), \
            proxy_over([prefill], [plain], log_dir) as proxy:
        answer = completion(proxy, {"prompt": prompt_ids(300, 5), "max_tokens": 4,
                                    "temperature": 0})
        assert answer["choices"][0]["finish_reason"] == "length"
        wait_until("the alarm", lambda: "pd_not_happening" in proxy_state(proxy), 15)
        (alarm,) = proxy_state(proxy)["pd_not_happening"]
        assert (alarm["prefill"], alarm["decode"]) == (prefill.url, plain.url)
        prefill.wait_for("the unread lease released", lambda h: h["leases"] == 0, timeout=5)
