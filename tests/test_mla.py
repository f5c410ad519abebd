"""Latent (MLA) caches in the pure modules: spec, topology, descriptors, compatibility.

An MLA cache holds one latent vector per token (the compressed KV, then the RoPE
key) in a single "head" that every TP rank keeps whole. Through the general
machinery that is a cache with ``total_kv_heads == 1``: each decode rank reads the
whole latent from one prefill rank, and the prefill ranks nobody reads from are
only told to free. The descriptors are proven by executing them as byte copies
(the reference executor of ``test_descriptors``).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_descriptors import (
    LAYOUTS,
    TP_PAIRS,
    execute,
    make_rank,
    make_views_like,
    minimal_count,
    token_rows,
)

from kvxfer.plan.descriptors import IncompatibleLayoutError, build_read_descriptors
from kvxfer.plan.layout import CacheSpec, KVCacheLayout, allocate_kv_cache
from kvxfer.plan.regions import RegionPlan
from kvxfer.plan.topology import notify_plan, read_plan, readers_per_remote_rank
from kvxfer.wire.compat import CompatInfo, compat_hash
from kvxfer.wire.envelope import decode_envelope, encode_message
from kvxfer.wire.messages import MetadataRequest
from kvxfer.wire.protocol_errors import HashMismatch

# DeepSeek-V3's latent: kv_lora_rank 512 + 64 RoPE dims; small ones below.
LATENT = 512 + 64


def latent_spec(block_size: int = 16, latent: int = LATENT, dtype: torch.dtype = torch.bfloat16,
                padded: int | None = None) -> CacheSpec:
    return CacheSpec(block_size, 1, latent, dtype, padded, latent=True)


# -- the spec -------------------------------------------------------------------------------

def test_a_latent_page_is_one_vector_per_token_in_one_head() -> None:
    spec = latent_spec()
    assert (spec.num_heads, spec.content_size) == (1, LATENT)
    assert spec.real_page_size_bytes == 16 * LATENT * 2  # no separate V: half a K/V page
    assert CacheSpec(16, 1, LATENT, torch.bfloat16).content_size == 2 * LATENT
    _, views = allocate_kv_cache(spec, 4, 2, "BLHNC")
    assert [tuple(v.shape) for v in views] == [(4, 1, 16, LATENT)] * 2


@pytest.mark.parametrize(("heads", "groups"), [(2, False), (1, True)])
def test_a_latent_spec_refuses_several_heads_or_kv_groups(heads: int, groups: bool) -> None:
    with pytest.raises(ValueError, match=r"latent \(MLA\) cache holds one latent vector per token"):
        CacheSpec(16, heads, LATENT, torch.bfloat16, separate_kv_head_groups=groups,
                  latent=True)


# -- topology: one head on every rank ----------------------------------------------------------

@pytest.mark.parametrize(("decode_tp", "prefill_tp"), [*TP_PAIRS, (3, 2), (8, 1), (1, 8)])
def test_each_decode_rank_reads_the_latent_once_and_every_prefill_rank_is_freed(
        decode_tp: int, prefill_tp: int) -> None:
    told: dict[int, list[int]] = {}
    for rank in range(decode_tp):
        (piece,) = read_plan(rank, decode_tp, prefill_tp, 1)
        assert (piece.remote_rank, piece.remote_head_offset, piece.local_head_offset,
                piece.count) == (rank % prefill_tp, 0, 0, 1)
        for remote, expected in notify_plan(rank, decode_tp, prefill_tp, 1).items():
            told.setdefault(remote, []).append(expected)
    readers = readers_per_remote_rank(decode_tp, prefill_tp, 1)
    assert set(readers) == set(range(min(decode_tp, prefill_tp)))
    # every prefill rank hears from as many decode ranks as it waits for
    assert sorted(told) == list(range(prefill_tp))
    for remote, counts in told.items():
        assert counts == [len(counts)] * len(counts)
        assert len(counts) == readers.get(remote, 1)


# -- descriptors: byte-exact across the layout table and the TP pairs --------------------------

@st.composite
def latent_scenarios(draw: st.DrawFn) -> dict:
    decode_tp, prefill_tp = draw(st.sampled_from(TP_PAIRS))
    return {
        "decode_tp": decode_tp, "prefill_tp": prefill_tp,
        "decode_rank": draw(st.integers(0, decode_tp - 1)),
        "decode_layout": draw(st.sampled_from(LAYOUTS)),
        "prefill_layout": draw(st.sampled_from(LAYOUTS)),
        "dtype": draw(st.sampled_from([torch.float16, torch.float32])),
        "latent": draw(st.sampled_from([1, 3, 5])),
        "block_size": draw(st.sampled_from([1, 2, 4])),
        "ratio": draw(st.sampled_from([1, 1, 2, -2])),  # decode blocks larger when positive
        "pad": draw(st.sampled_from([0, 0, 8])),
        "layers": draw(st.integers(1, 3)),
        "decode_blocks": draw(st.integers(2, 8)),
        "prefill_blocks": draw(st.integers(2, 8)),
        "separate_storage": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }


def scenario_spec(s: dict, block_size: int) -> CacheSpec:
    real = latent_spec(block_size, s["latent"], s["dtype"]).real_page_size_bytes
    return latent_spec(block_size, s["latent"], s["dtype"], real + s["pad"] if s["pad"] else None)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(latent_scenarios())
def test_a_decode_rank_copies_the_whole_latent_from_one_prefill_rank(s: dict) -> None:
    """Every layout pair works (one head makes head-vs-token order invisible): the decode
    rank gets exactly the prefill rank's latents of the request's tokens, from the one
    rank the read plan names, in as few descriptors as runs contiguous on both sides."""
    rng = np.random.default_rng(s["seed"])
    small, ratio = s["block_size"], abs(s["ratio"])
    decode_bs, prefill_bs = (small * ratio, small) if s["ratio"] > 0 else (small, small * ratio)
    storage = s["separate_storage"] and s["decode_layout"].is_layer_compact
    decode = make_rank(scenario_spec(s, decode_bs), s["decode_layout"], s["decode_blocks"],
                       s["layers"], storage, rng)
    plan = read_plan(s["decode_rank"], s["decode_tp"], s["prefill_tp"], 1)
    assert [p.remote_rank for p in plan] == [s["decode_rank"] % s["prefill_tp"]]
    prefill = make_rank(scenario_spec(s, prefill_bs), s["prefill_layout"], s["prefill_blocks"],
                        s["layers"], False, rng)
    dr, pr = decode_bs // small, prefill_bs // small  # small blocks per block: one is 1
    fine = int(rng.integers(1, min(s["decode_blocks"] * dr, s["prefill_blocks"] * pr) + 1))
    decode_ids = rng.choice(s["decode_blocks"], size=-(-fine // dr), replace=False)
    prefill_ids = rng.choice(s["prefill_blocks"], size=-(-fine // pr), replace=False)
    expected = [raw.clone() for raw in decode.buffers]
    (descs,) = build_read_descriptors(decode.geometry, {plan[0].remote_rank: prefill.geometry},
                                      plan, decode_ids, prefill_ids,
                                      local_tp=s["decode_tp"], remote_tp=s["prefill_tp"])
    assert descs.remote_rank == plan[0].remote_rank
    position = np.arange(fine * small)  # every token, as (block, token) on each side
    mine = [token_rows(decode, layer, decode_ids[position // decode_bs],
                       position % decode_bs, 0) for layer in range(s["layers"])]
    theirs = [token_rows(prefill, layer, prefill_ids[position // prefill_bs],
                         position % prefill_bs, 0) for layer in range(s["layers"])]
    row = s["latent"] * s["dtype"].itemsize
    assert descs.num_bytes == fine * small * s["layers"] * row
    assert len(descs) == minimal_count(decode, prefill, np.concatenate(mine),
                                       np.concatenate(theirs), row)
    shadow = make_views_like(decode, expected)
    for layer in range(s["layers"]):
        for p in range(fine):
            lb, lt = int(decode_ids[p // dr]), (p % dr) * small
            rb, rt = int(prefill_ids[p // pr]), (p % pr) * small
            shadow[layer][lb, :, lt:lt + small] = prefill.views[layer][rb, :, rt:rt + small]
    execute(decode, prefill, descs.local, descs.remote)
    for got, want in zip(decode.buffers, expected, strict=True):
        assert torch.equal(got, want), "decode buffer differs from the view-level expectation"


@pytest.mark.parametrize(("layout", "expected"), [
    (KVCacheLayout.LBHNC, 61 * 40), (KVCacheLayout.LBNHC, 61 * 40),
    (KVCacheLayout.BLHNC, 40), (KVCacheLayout.BLNHC, 40), (KVCacheLayout.BHLNC, 40)])
def test_a_deepseek_like_latent_moves_one_descriptor_per_block_and_layer(
        layout: KVCacheLayout, expected: int) -> None:
    """61 layers, 40 blocks of 16 tokens, ids never adjacent: per layer a block's latents
    are one run, and cross-layer layouts make all layers of a block one run."""
    spec = latent_spec()
    decode = make_rank(spec, layout, 80, 61, False, np.random.default_rng(0))
    prefill = make_rank(spec, layout, 80, 61, False, np.random.default_rng(1))
    ids = np.arange(0, 80, 2)
    for rank in range(2):  # TP 2 decode from TP 1 prefill: both ranks read all of it
        plan = read_plan(rank, 2, 1, 1)
        (descs,) = build_read_descriptors(decode.geometry, {0: prefill.geometry}, plan, ids,
                                          ids, local_tp=2, remote_tp=1)
        assert len(descs) == expected
        assert descs.num_bytes == 40 * 16 * 61 * LATENT * 2


# -- compatibility: an MLA peer and a K/V peer never pair ---------------------------------------

@pytest.mark.parametrize("decode_latent", [True, False])
def test_a_latent_and_a_kv_cache_of_equal_bytes_per_token_are_refused(
        decode_latent: bool) -> None:
    """A 64-element latent and one K/V head of 32 are 64 elements per token alike: only
    the plan's ``latent`` (sent in the handshake) tells them apart."""
    latent = make_rank(latent_spec(16, 64), KVCacheLayout.LBHNC, 4, 2, False,
                       np.random.default_rng(0))
    kv = make_rank(CacheSpec(16, 1, 32, torch.bfloat16), KVCacheLayout.LBHNC, 4, 2, False,
                   np.random.default_rng(1))
    assert latent.plan.latent and not kv.plan.latent
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(latent.plan),
                                  type=RegionPlan) == latent.plan
    decode, prefill = (latent, kv) if decode_latent else (kv, latent)
    kinds = ("an MLA latent cache", "K and V heads")
    with pytest.raises(IncompatibleLayoutError,
                       match=f"decode keeps {kinds[not decode_latent]} but prefill keeps "
                             f"{kinds[decode_latent]}"):
        build_read_descriptors(decode.geometry, {0: prefill.geometry}, read_plan(0, 1, 1, 1),
                               [0], [0])


KV = CompatInfo(model="m", dtype="bfloat16", cache_dtype="bfloat16", head_size=64,
                total_kv_heads=1, num_layers=4)
MLA = msgspec.structs.replace(KV, kv_lora_rank=48)  # 48 + 16 RoPE dims: 64 per token


def test_mla_is_part_of_the_compatibility_hash() -> None:
    assert KV.kv_lora_rank == 0 and compat_hash(MLA) != compat_hash(KV)


@pytest.mark.parametrize(("here", "peer"), [(MLA, KV), (KV, MLA)], ids=["mla-here", "kv-here"])
def test_an_mla_and_a_kv_peer_refuse_each_other_naming_the_difference(
        here: CompatInfo, peer: CompatInfo) -> None:
    raw = encode_message(MetadataRequest("decode-x", (0,)), compat=peer)
    with pytest.raises(HashMismatch) as info:
        decode_envelope(raw, expected_hash=compat_hash(here), peer="tcp://peer:1",
                        local_compat=here)
    message = str(info.value)
    assert (f"kv_lora_rank (0: a cache of K and V heads, > 0: an MLA latent cache): peer "
            f"{peer.kv_lora_rank}, here {here.kv_lora_rank}") in message, message


@pytest.mark.parametrize(("fields", "message"), [
    ({"kv_lora_rank": -1}, "kv_lora_rank must not be negative"),
    ({"kv_lora_rank": 48, "total_kv_heads": 2}, r"needs total_kv_heads 1 \(got 2\)"),
    ({"kv_lora_rank": 64}, r"a head_size above the rank, for the RoPE part \(got 64\)"),
])
def test_mla_compat_info_must_describe_a_latent(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        msgspec.structs.replace(KV, **fields)
