"""Latent (MLA) caches moving for real: a prefill OS process, this process as decode.

Every rank of both sides holds the whole latent (one head). Each decode rank must end
with exactly the prefill's latents of the request's blocks, read from one prefill rank,
and every prefill rank must free the lease on "done" (the ranks nobody reads from are
only told to), long before its expiry. An MLA instance and a K/V one refuse each other
at the handshake, naming the difference.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_transfer import check_blocks, decode_instance, params_for, pick

from kvxfer.harness.loopback import CacheConfig, PrefillProcess

# 8 compressed dims + 2 RoPE dims per token: a 10-element latent
LATENT = CacheConfig(total_kv_heads=1, head_size=10, kv_lora_rank=8, num_layers=3,
                     block_size=4, num_blocks=16)
HINT = "kv_lora_rank (0: a cache of K and V heads, > 0: an MLA latent cache)"


@pytest.mark.parametrize(("prefill_layout", "decode_layout", "prefill_tp", "decode_tp"), [
    ("LBHNC", "BHLNC", 1, 2),
    ("BLHNC", "LBNHC", 2, 1),
    ("BHLNC", "BLNHC", 4, 2),
])
def test_every_decode_rank_gets_the_latents_and_every_prefill_rank_frees(
        prefill: PrefillProcess, prefill_layout: str, decode_layout: str, prefill_tp: int,
        decode_tp: int) -> None:
    pcfg = replace(LATENT, layout=prefill_layout, tp=prefill_tp)
    decode = decode_instance(replace(LATENT, layout=decode_layout, tp=decode_tp, num_blocks=12))
    remote = prefill.create(pcfg)
    try:
        rng = np.random.default_rng(prefill_tp * 10 + decode_tp)
        remote_ids, local_ids = pick(rng, "random", 5, 16), pick(rng, "random", 5, 12)
        prefill.hold(remote["engine_id"], "mla", remote_ids, ttl=30)
        decode.read("m", params_for(remote, "mla", remote_ids, tp_size=prefill_tp), local_ids)
        stats, failed = decode.wait(["m"])
        assert failed == {}
        check_blocks(decode, pcfg, local_ids, remote_ids)
        per_rank = 5 * 4 * 3 * 10 * 4  # blocks x tokens x layers x latent x float32
        assert [s.num_bytes for s in stats["m"]] == [per_rank] * decode_tp
        # a 30 s lease freed within the wait: by "done" from readers and notify-only ranks
        assert prefill.wait_released(remote["engine_id"], {"mla"}) == {"mla": "done"}
        assert prefill.leases(remote["engine_id"]) == [0] * prefill_tp
    finally:
        decode.close()


@pytest.mark.parametrize("prefill_is_mla", [True, False], ids=["mla-prefill", "kv-prefill"])
def test_an_mla_and_a_kv_instance_refuse_each_other(prefill: PrefillProcess,
                                                   prefill_is_mla: bool) -> None:
    kv = replace(LATENT, kv_lora_rank=0)  # one K/V head of 10: only the latent flag differs
    pcfg, dcfg = (LATENT, kv) if prefill_is_mla else (kv, LATENT)
    remote = prefill.create(pcfg)
    decode = decode_instance(dcfg)
    try:
        prefill.hold(remote["engine_id"], "x", [0], ttl=1.0)
        decode.read("x", params_for(remote, "x", [0]), [0])
        _, failed = decode.wait(["x"])
        # the decode names the prefill's value as the peer's
        assert f"{HINT}: peer {pcfg.kv_lora_rank}, here {dcfg.kv_lora_rank}" in failed["x"], \
            failed["x"]
        assert remote["engine_id"] in failed["x"] and "not compatible" in failed["x"]
        assert prefill.wait_released(remote["engine_id"], {"x"}) == {"x": "expired"}
    finally:
        decode.close()
