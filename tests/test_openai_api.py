"""The pure OpenAI surface of a sidecar (``kvxfer.sidecar.openai_api``): choices per prompt,
per-choice seeds, echo, usage counting, and what the transfer roles accept."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvxfer.engine import ByteTokenizer
from kvxfer.engine.sequence import RequestOutput
from kvxfer.sidecar.openai_api.answers import Choice, TokenText, completion_body, usage
from kvxfer.sidecar.openai_api.error_body import OpenAIError
from kvxfer.sidecar.openai_api.prepared import ModelInfo, Prepared, choice_seed
from kvxfer.sidecar.openai_api.request_bodies import ChatRequest, CompletionRequest
from kvxfer.sidecar.openai_api.validation import MAX_N, prepare_chat, prepare_completion
from kvxfer.sidecar.request_kinds import LeaseOut, PullIn

TOKENIZER = ByteTokenizer()


def info(role: str = "both", num_blocks: int | None = 256) -> ModelInfo:
    return ModelInfo(("kvxfer-tiny",), TOKENIZER, 258, 2048, 16, role, num_blocks)


def completion(role: str = "both", num_blocks: int | None = 256, **body: Any) -> Prepared:
    request = msgspec.convert({"prompt": "hi", **body}, CompletionRequest)
    return prepare_completion(request, info(role, num_blocks))


def refused(call: Any, param: str, says: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        call()
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    assert says in caught.value.message, caught.value.message
    return caught.value


def decode_params(prompt_len: int) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
            "remote_host": "127.0.0.1", "remote_port": 5600,
            "remote_block_ids": list(range(-(-prompt_len // 16))), "remote_request_id": "r@1",
            "remote_num_tokens": prompt_len, "tp_size": 1, "lease_expires_at": 0.0}


# -- n ------------------------------------------------------------------------------------

def test_n_choices_per_prompt_in_openai_order() -> None:
    prepared = completion(prompt=["a", "b", "c"], n=2)
    assert prepared.n == 2 and prepared.num_choices == 6
    assert [k // prepared.n for k in range(prepared.num_choices)] == [0, 0, 1, 1, 2, 2]


def test_seeded_choices_draw_from_seed_plus_j_like_vllm() -> None:
    prepared = completion(prompt=["a", "b"], n=3, seed=40, temperature=1.0)
    assert [prepared.choice_params(k).seed for k in range(6)] == [40, 41, 42, 40, 41, 42]
    assert prepared.choice_params(1).temperature == 1.0  # only the seed differs
    unseeded = completion(n=2)
    assert [unseeded.choice_params(k).seed for k in range(2)] == [None, None]
    assert choice_seed(2**63 - 1, 2) == 1, "seeds wrap below 2**63"


@pytest.mark.parametrize("n", [0, -1, MAX_N + 1])
def test_n_out_of_range_is_refused(n: int) -> None:
    refused(lambda: completion(n=n), "n", f"got {n}")


def test_a_prefill_request_computes_the_prompt_once() -> None:
    hold = {"kv_transfer_params": {"do_remote_decode": True}}
    assert isinstance(completion("prefill", **hold).kind, LeaseOut)
    refused(lambda: completion("prefill", n=2, **hold), "n", "n must be 1, got 2")


def test_a_decode_request_takes_n_when_its_samples_fit_the_cache() -> None:
    prompt = [65] * 40  # 3 blocks of 16
    kv = {"kv_transfer_params": decode_params(40)}
    prepared = completion("decode", num_blocks=9, prompt=prompt, n=3, **kv)
    assert isinstance(prepared.kind, PullIn) and prepared.num_choices == 3
    refused(lambda: completion("decode", num_blocks=8, prompt=prompt, n=3, **kv), "n",
            "need 9 KV blocks at once, but this decode instance has 8")


def test_a_decode_counts_the_prefills_blocks_at_the_prefills_block_size() -> None:
    prompt = [65] * 40  # 3 blocks of 16 here; 2 of 32, or 5 of 8, on the prefill
    for size, blocks in ((32, 2), (8, 5), (16, 3), (None, 3)):  # None: this decode's
        kv = {**decode_params(40), "remote_block_size": size,
              "remote_block_ids": list(range(blocks))}
        prepared = completion("decode", prompt=prompt, kv_transfer_params=kv)
        kind = prepared.kind
        assert isinstance(kind, PullIn) and len(kind.remote.remote_block_ids) == blocks
    wrong = {**decode_params(40), "remote_block_size": 32}  # 3 ids: 16-token blocks
    refused(lambda: completion("decode", prompt=prompt, kv_transfer_params=wrong),
            "kv_transfer_params", "has 3 ids but a 40-token prompt fills 2 blocks of 32 tokens")
    for bad, says in ((24, "remote_block_size is 24 but this decode's block size is 16: one "
                           "must be a multiple of the other"),
                      (0, "remote_block_size must be a positive integer, got 0"),
                      ("32", "must be a positive integer, got '32'")):
        kv = {**decode_params(40), "remote_block_size": bad}
        refused(lambda kv=kv: completion("decode", prompt=prompt, kv_transfer_params=kv),
                "kv_transfer_params", says)


# -- echo ---------------------------------------------------------------------------------

def test_echo_shows_each_prompt_as_the_client_sent_it() -> None:
    assert completion(prompt=["one", "two"], echo=True).echo == ["one", "two"]
    ids = [TOKENIZER.encode("token ids"), TOKENIZER.encode("more")]
    assert completion(prompt=ids, echo=True).echo == ["token ids", "more"]
    assert completion(prompt="x").echo is None
    assert completion(prompt=["a", "b"], n=2, echo=True).echo_text(3) == "b"


def test_echo_with_logprobs_is_refused() -> None:
    refused(lambda: completion(echo=True, logprobs=1), "echo", "echo or logprobs, not both")


def test_echo_goes_first_in_the_answer_text() -> None:
    prepared = completion(prompt="Hi ", echo=True)
    choice = Choice(0, 0, prepared.echo_text(0))
    choice.add(RequestOutput("r", [66], [66], "B", "B", [], True, "length", None, 3, []))
    body = completion_body("cmpl-x", 0, "kvxfer-tiny", [choice], prepared, TokenText(TOKENIZER))
    assert body["choices"][0]["text"] == "Hi B"


# -- usage --------------------------------------------------------------------------------

def test_usage_counts_a_prompt_once_however_many_choices_answer_it() -> None:
    choices = [Choice(k, k // 2, num_prompt_tokens=10 + k // 2, token_ids=[1] * 4)
               for k in range(4)]
    assert usage(choices) == {"prompt_tokens": 21, "completion_tokens": 16, "total_tokens": 37}


# -- chat ---------------------------------------------------------------------------------

def test_chat_takes_n_and_max_completion_tokens() -> None:
    request = msgspec.convert({"messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi"}],
                               "n": 2, "max_completion_tokens": 3, "max_tokens": 50}, ChatRequest)
    prepared = prepare_chat(request, info())
    assert prepared.num_choices == 2 and prepared.params.max_tokens == 3
    assert TOKENIZER.decode(prepared.prompts[0]).startswith("<|system|>\nBe brief.\n")
