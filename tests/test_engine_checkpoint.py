"""Checkpoint directories: save a seeded model, load it back, same outputs; every broken
checkpoint gives an error naming the tensor and the file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from kvxfer.engine import (
    CheckpointError,
    HFTokenizer,
    LLMEngine,
    SamplingParams,
    init_weights,
    load_checkpoint,
    save_checkpoint,
    tiny_config,
)

CONFIG = tiny_config()
SEED = 11
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
PROMPT = [256, *b"checkpoint"]


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return init_weights(CONFIG, SEED)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, weights: dict[str, torch.Tensor]) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-11", CONFIG, weights)


def test_round_trip_gives_the_same_model(saved: Path, weights: dict[str, torch.Tensor]) -> None:
    config, loaded = load_checkpoint(saved)
    assert config == CONFIG
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    seeded = LLMEngine(CONFIG, seed=SEED, block_size=8, num_blocks=32)
    from_dir = LLMEngine.from_model_arg(str(saved), block_size=8, num_blocks=32)
    assert from_dir.model_id == seeded.model_id and from_dir.model_name == "tiny-11"
    want, got = seeded.generate([PROMPT], PARAMS)[0], from_dir.generate([PROMPT], PARAMS)[0]
    assert got.token_ids == want.token_ids
    assert [x.logprob for x in got.logprobs] == [x.logprob for x in want.logprobs]


def test_sharded_bfloat16_checkpoint_with_extras_loads(tmp_path: Path,
                                                       weights: dict[str, torch.Tensor]) -> None:
    save_checkpoint(tmp_path, CONFIG, weights)
    (tmp_path / "model.safetensors").unlink()
    names = sorted(weights)
    half = {n: weights[n].to(torch.bfloat16) for n in names}
    save_file({n: half[n] for n in names[:10]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    rest = {n: half[n] for n in names[10:]}
    rest["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old exports
    save_file(rest, str(tmp_path / "model-00002-of-00002.safetensors"))
    config, loaded = load_checkpoint(tmp_path)
    assert loaded.keys() == weights.keys() and loaded["model.norm.weight"].dtype == torch.bfloat16
    engine = LLMEngine(config, loaded, dtype="bfloat16", block_size=8, num_blocks=32)
    assert len(engine.generate([PROMPT], PARAMS)[0].token_ids) == 8


def test_tied_checkpoint_may_also_store_lm_head(tmp_path: Path) -> None:
    config = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    weights = init_weights(config, 1)
    save_checkpoint(tmp_path, config, weights)
    save_file({"lm_head.weight": weights["model.embed_tokens.weight"]},
              str(tmp_path / "extra.safetensors"))
    _, loaded = load_checkpoint(tmp_path)
    assert "lm_head.weight" not in loaded


def test_checkpoint_with_its_own_tokenizer(tmp_path: Path) -> None:
    words = ["[UNK]", "<s>", "</s>", "hello", "world", "kv", "cache"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s>", "</s>"])
    config = dataclasses.replace(CONFIG, vocab_size=64, bos_token_id=1, eos_token_id=2)
    save_checkpoint(tmp_path, config, init_weights(config, 0), tokenizer_json=raw.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    engine = LLMEngine.from_model_arg(str(tmp_path), block_size=8, num_blocks=32)
    assert isinstance(engine.tokenizer, HFTokenizer) and engine.tokenizer.eos_token_id == 2
    prompt = engine.tokenizer.encode("hello kv cache")
    out = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    # Streamed text continues the prompt's text (word-level decoding joins with spaces).
    decode = engine.tokenizer.decode
    assert out.text.strip()
    assert decode(prompt) + out.text == decode(prompt + out.token_ids)
    too_small = dataclasses.replace(config, vocab_size=5, bos_token_id=1, eos_token_id=2)
    with pytest.raises(ValueError, match="the tokenizer has 7 ids but the model's vocab_size "
                                         "is 5"):
        LLMEngine(too_small, tokenizer=engine.tokenizer)


def broken_copy(saved: Path, tmp_path: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    """A copy of the checkpoint with tensors replaced (None: removed) or added."""
    config, weights = load_checkpoint(saved)
    for name, tensor in edit.items():
        if tensor is None:
            del weights[name]
        else:
            weights[name] = tensor
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    save_file(weights, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_missing_tensor_is_named(saved: Path, tmp_path: Path) -> None:
    path = broken_copy(saved, tmp_path, {"model.layers.2.mlp.up_proj.weight": None})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.2\.mlp\.up_proj\.weight' "
                                              r"missing from .*\[model\.safetensors\]"):
        load_checkpoint(path)


def test_mis_shaped_tensor_is_named_with_its_file(saved: Path, tmp_path: Path) -> None:
    path = broken_copy(saved, tmp_path, {"model.norm.weight": torch.ones(64)})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' in "
                                              r"model\.safetensors .* has shape \[64\], "
                                              r"the config implies \[128\]"):
        load_checkpoint(path)


def test_unexpected_tensor_is_named_with_its_file(saved: Path, tmp_path: Path) -> None:
    path = broken_copy(saved, tmp_path, {"model.layers.9.mlp.up_proj.weight": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor "
                                              r"'model\.layers\.9\.mlp\.up_proj\.weight' in "
                                              r"model\.safetensors"):
        load_checkpoint(path)


def test_corrupted_file_is_named(saved: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    data = (saved / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors"):
        load_checkpoint(tmp_path)


def test_duplicate_tensor_across_shards_is_named(saved: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    (tmp_path / "a.safetensors").write_bytes((saved / "model.safetensors").read_bytes())
    save_file({"model.norm.weight": torch.ones(128)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' appears in both "
                                              r"a\.safetensors and b\.safetensors"):
        load_checkpoint(tmp_path)


def test_config_problems_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nowhere does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"config\.json does not exist"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_checkpoint(tmp_path)
    hf = CONFIG.to_hf()
    hf["num_key_value_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"config\.json: model config field "
                                              r"'num_key_value_heads': 3 does not divide"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_hf()))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files in"):
        load_checkpoint(tmp_path)


def test_save_refuses_weights_that_do_not_match(tmp_path: Path,
                                                weights: dict[str, torch.Tensor]) -> None:
    bad = {**weights, "model.norm.weight": torch.ones(3)}
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' in state_dict"):
        save_checkpoint(tmp_path / "out", CONFIG, bad)
    assert not (tmp_path / "out").exists()


def test_model_argument_must_be_a_name_a_gguf_file_or_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="model 'no-such-model' is not a model name "
                                              r"\(kvxfer-tiny, .*\), a .gguf file or a "
                                              "checkpoint directory"):
        LLMEngine.from_model_arg("no-such-model")
    assert LLMEngine.from_model_arg(None, num_blocks=8).model_name == "kvxfer-tiny"
