"""Turning a decoded body into a :class:`~kvxfer.sidecar.openai_api.prepared.Prepared`
request: every check that can answer 400 (or 404 for an unknown model), before anything
is allocated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvxfer.sidecar.openai_api.error_body import OpenAIError, bad_request
from kvxfer.sidecar.openai_api.kv_params import kv_intent
from kvxfer.sidecar.openai_api.prepared import SEED_LIMIT, ModelInfo, Prepared
from kvxfer.sidecar.openai_api.request_bodies import (
    ChatMessage,
    ChatRequest,
    CommonFields,
    CompletionRequest,
    is_int,
)

if TYPE_CHECKING:
    from kvxfer.engine import SamplingParams

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20  # the engine's top-k limit
MAX_N = 64  # samples per prompt; each is a request with its own KV blocks


def prepare_completion(req: CompletionRequest, info: ModelInfo) -> Prepared:
    model = _check_model(req.model, info)
    _check_common(req)
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs needs the prompt tokens' logprobs, which this "
                          "server does not compute; send echo or logprobs, not both", "echo")
    prompts = _prompts(req.prompt, info)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                          f"{req.logprobs}", "logprobs")
    params = _sampling(req, req.max_tokens, req.logprobs)
    _check_lengths(prompts, params.max_tokens, info, "prompt")
    echo = _echo_texts(req.prompt, prompts, info) if req.echo else None
    return _with_kv(req, prompts, params, model, info, chat=False,
                    logprobs=req.logprobs is not None, echo=echo)


def prepare_chat(req: ChatRequest, info: ModelInfo) -> Prepared:
    model = _check_model(req.model, info)
    _check_common(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                              f"{req.top_logprobs}", "top_logprobs")
    messages = _messages(req.messages)
    try:
        prompt = info.tokenizer.encode_chat(messages)
    except ValueError as exc:
        raise bad_request(f"cannot render the chat: {exc}", "messages") from None
    _check_token_ids(prompt, info, "messages")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling(req, limit, top, max_tokens_param=param)
    _check_lengths([prompt], params.max_tokens, info, "messages")
    return _with_kv(req, [prompt], params, model, info, chat=True, logprobs=bool(req.logprobs))


def _check_model(model: str | None, info: ModelInfo) -> str:
    if model is None:
        return info.served_names[0]
    if model not in info.served_names:
        raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                               f"{', '.join(info.served_names)}", "not_found_error", "model")
    return model


def _check_common(req: CommonFields) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}] (choices per prompt), got "
                          f"{req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")


def _prompts(prompt: str | list[Any], info: ModelInfo) -> list[list[int]]:
    """Token ids of each prompt: a string, token ids, strings, or token-id lists."""
    if isinstance(prompt, str):
        return [_encode(prompt, info, "prompt")]
    if not prompt:
        raise bad_request("prompt is an empty list", "prompt")
    if all(is_int(t) for t in prompt):
        return [_check_token_ids(prompt, info, "prompt")]
    if all(isinstance(p, str) for p in prompt):
        return [_encode(p, info, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if all(isinstance(p, list) for p in prompt):
        out = []
        for i, ids in enumerate(prompt):
            if not ids:
                raise bad_request(f"prompt[{i}] is an empty list of token ids", "prompt")
            if not all(is_int(t) for t in ids):
                raise bad_request(f"prompt[{i}] must be a list of integer token ids", "prompt")
            out.append(_check_token_ids(ids, info, f"prompt[{i}]"))
        return out
    raise bad_request("prompt must be a string, a list of token ids, a list of strings or a "
                      "list of token-id lists", "prompt")


def _echo_texts(prompt: str | list[Any], prompts: list[list[int]], info: ModelInfo
                ) -> list[str]:
    """Each prompt as ``echo`` shows it: the client's text, or its token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [info.tokenizer.decode(ids) for ids in prompts]


def _encode(text: str, info: ModelInfo, where: str) -> list[int]:
    if not text:
        raise bad_request(f"{where} is an empty string", "prompt")
    return _check_token_ids(info.tokenizer.encode(text), info, "prompt")


def _check_token_ids(ids: Sequence[int], info: ModelInfo, where: str) -> list[int]:
    for position, token in enumerate(ids):
        if not 0 <= token < info.vocab_size:
            raise bad_request(f"{where}: token id {token} at position {position} is not in the "
                              f"vocabulary [0, {info.vocab_size})", where.split("[")[0])
    return list(ids)


def _messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    if not messages:
        raise bad_request("messages is an empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content: only text parts are supported, "
                                      f"got type {part.type!r}", f"messages[{i}].content")
                parts.append(part.text)
            content = "".join(parts)
        out.append({"role": message.role, "content": content or ""})
    return out


def _sampling(req: CommonFields, max_tokens: int | None, logprobs: int | None, *,
              max_tokens_param: str = "max_tokens") -> SamplingParams:
    from kvxfer.engine import SamplingParams

    limit = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if limit < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {limit}",
                          max_tokens_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < 0:
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
        raise bad_request(f"seed must be in [0, 2**63), got {req.seed}", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise bad_request(f"stop strings must not be empty, got {req.stop!r}", "stop")
    try:
        return SamplingParams(max_tokens=limit, temperature=temperature, top_p=top_p,
                              seed=req.seed, stop=stop, ignore_eos=bool(req.ignore_eos),
                              logprobs=logprobs)
    except ValueError as exc:  # a check above should have caught it; still a client error
        raise bad_request(str(exc)) from None


def _check_lengths(prompts: list[list[int]], max_tokens: int, info: ModelInfo,
                   param: str) -> None:
    for i, prompt in enumerate(prompts):
        total = len(prompt) + max_tokens
        if total > info.max_model_len:
            which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            raise bad_request(f"{which} has {len(prompt)} tokens and {max_tokens} more were "
                              f"asked for: {total} tokens exceed this server's limit of "
                              f"{info.max_model_len} tokens per request", param)


def _with_kv(req: CommonFields, prompts: list[list[int]], params: SamplingParams, model: str,
             info: ModelInfo, *, chat: bool, logprobs: bool,
             echo: list[str] | None = None) -> Prepared:
    kind = kv_intent(req, prompts, params, info)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return Prepared(prompts, params, model, bool(req.stream), include_usage, chat, logprobs,
                    kind, n=req.n or 1, echo=echo)
