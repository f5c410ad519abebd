"""The OpenAI-compatible surface of a sidecar: request types, validation, answers.

Pure except for the tokenizer: no I/O, no engine. The server decodes a body
with :func:`decode_body` into :class:`CompletionRequest` / :class:`ChatRequest`
(msgspec, strict types), turns it into a :class:`Prepared` request with
:func:`prepare_completion` / :func:`prepare_chat` (every check that can answer
400 happens here, before anything is allocated), and formats engine outputs
with :class:`Choice` and the ``*_body`` / ``*_chunk`` functions.

Errors are :class:`OpenAIError`; their body is ``{"error": {"message", "type",
"param", "code"}}`` with ``code`` the HTTP status, as the proxy answers too.

``kv_transfer_params`` (vLLM's keys):

* prefill role, ``do_remote_decode: true``: the prompt is computed and its blocks
  leased (``Prepared.hold``); the answer carries the params a decode reads with.
  Streaming such a request is refused.
* decode role, ``do_remote_prefill: true``: the prompt's KV is read from the
  prefill named in the params (``Prepared.remote``), which must describe exactly
  this prompt (``remote_num_tokens``, one block id per ``remote_block_size``
  tokens: the prefill's block size, this decode's when absent).
* anything else: a plain request (the params are ignored).

Both transfer paths take exactly one prompt. A prefill request takes ``n`` 1 (the
prompt is computed once whatever the client asked for); a decode request may ask
for ``n`` samples, which share one KV read. A decode request refused here
(any 400/404) still names a prefill lease that nobody will read;
:func:`unread_lease` finds it in the raw body, so that the server can release
it at once instead of leaving it to the lease TTL.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from kvxfer.engine import Logprob, RequestOutput, SamplingParams, Tokenizer
    from kvxfer.wire.params import RemoteParams

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20  # the engine's top-k limit
MAX_N = 64  # samples per prompt; each is a request with its own KV blocks
SEED_LIMIT = 2**63


class OpenAIError(Exception):
    """A request the server answers with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.kind, self.param)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": kind, "param": param,
                                          "code": status}})


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


# -- request bodies ----------------------------------------------------------------------

class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields both routes share; unknown fields (``user``, penalties...) are ignored."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool | None = False
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


_PATH = re.compile(r" - at `\$\.?(.*)`$")


def decode_body(raw: bytes, kind: type[_Common]) -> Any:
    """The body as ``kind``; a 400 naming the offending field otherwise."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        param = match.group(1) if match and match.group(1) else None
        raise bad_request(f"invalid request: {exc}", param) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's answer to JSON nested too deep
        raise bad_request("the request body is nested too deeply") from None


# -- validation --------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model and instance."""

    served_names: tuple[str, ...]
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    block_size: int
    role: str
    num_blocks: int | None = None  # the KV cache's size; None: not checked


@dataclass(frozen=True)
class Prepared:
    """A validated request: token ids per prompt and everything to answer it.

    ``n`` choices per prompt: choice ``k`` answers prompt ``k // n`` (OpenAI's and
    vLLM's order). ``echo``: the text each prompt's choices start with (completions
    with ``echo: true``), else None.
    """

    prompts: list[list[int]]
    params: SamplingParams
    model: str
    stream: bool
    include_usage: bool
    chat: bool
    logprobs: bool
    hold: bool = False
    remote: RemoteParams | None = None
    n: int = 1
    echo: list[str] | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choice_params(self, index: int) -> SamplingParams:
        """Sampling of choice ``index``: sample ``j = index % n`` of its prompt draws
        from seed ``seed + j`` (as vLLM seeds its ``n`` child requests), so seeded
        choices repeat across runs and differ from each other."""
        j = index % self.n
        if j == 0 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=choice_seed(self.params.seed, j))

    def echo_text(self, index: int) -> str:
        """What choice ``index``'s text starts with: its prompt under ``echo``, else ""."""
        return self.echo[index // self.n] if self.echo is not None else ""


def choice_seed(seed: int, j: int) -> int:
    """The seed of the ``j``-th sample of a request seeded ``seed`` (wraps below 2**63)."""
    return (seed + j) % SEED_LIMIT


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


def _check_common(req: _Common) -> None:
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
    if all(_is_int(t) for t in prompt):
        return [_check_token_ids(prompt, info, "prompt")]
    if all(isinstance(p, str) for p in prompt):
        return [_encode(p, info, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if all(isinstance(p, list) for p in prompt):
        out = []
        for i, ids in enumerate(prompt):
            if not ids:
                raise bad_request(f"prompt[{i}] is an empty list of token ids", "prompt")
            if not all(_is_int(t) for t in ids):
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def _sampling(req: _Common, max_tokens: int | None, logprobs: int | None, *,
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


def _with_kv(req: _Common, prompts: list[list[int]], params: SamplingParams, model: str,
             info: ModelInfo, *, chat: bool, logprobs: bool,
             echo: list[str] | None = None) -> Prepared:
    hold, remote = _kv_intent(req, prompts, info)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return Prepared(prompts, params, model, bool(req.stream), include_usage, chat, logprobs,
                    hold, remote, n=req.n or 1, echo=echo)


def _kv_intent(req: _Common, prompts: list[list[int]],
               info: ModelInfo) -> tuple[bool, RemoteParams | None]:
    """(hold the blocks, read the KV from) for this request on this role."""
    kv = req.kv_transfer_params
    if kv is None:
        return False, None
    for key in ("do_remote_decode", "do_remote_prefill"):
        if kv.get(key) is not None and not isinstance(kv[key], bool):
            raise bad_request(f"kv_transfer_params.{key} must be true or false, got "
                              f"{kv[key]!r}", "kv_transfer_params")
    if info.role == "prefill" and kv.get("do_remote_decode") is True:
        if req.stream:
            raise bad_request("a prefill request (kv_transfer_params.do_remote_decode) cannot "
                              "be streamed", "stream")
        _one_prompt(prompts)
        if req.n is not None and req.n != 1:
            raise bad_request(f"a prefill request (kv_transfer_params.do_remote_decode) "
                              f"computes the prompt once: n must be 1, got {req.n}; the "
                              f"decode samples the n choices", "n")
        return True, None
    if info.role == "decode" and kv.get("do_remote_prefill") is True:
        _one_prompt(prompts)
        _check_siblings_fit(req.n or 1, len(prompts[0]), info)
        return False, _remote_params(kv, len(prompts[0]), info.block_size)
    return False, None


def _check_siblings_fit(n: int, num_tokens: int, info: ModelInfo) -> None:
    """A decode admits its ``n`` samples of one read together: their prompt blocks
    must fit in the cache at once, or the request would wait forever."""
    needed = n * -(-num_tokens // info.block_size)
    if info.num_blocks is not None and needed > info.num_blocks:
        raise bad_request(f"n={n} samples of a {num_tokens}-token prompt need {needed} KV "
                          f"blocks at once, but this decode instance has {info.num_blocks}",
                          "n")


def _one_prompt(prompts: list[list[int]]) -> None:
    if len(prompts) != 1:
        raise bad_request(f"kv_transfer_params needs exactly one prompt, got {len(prompts)}",
                          "prompt")


def _remote_params(kv: dict[str, Any], num_tokens: int, block_size: int) -> RemoteParams:
    from kvxfer.wire.params import RemoteParams

    try:
        remote = RemoteParams.parse(kv)
    except ValueError as exc:
        raise bad_request(str(exc), "kv_transfer_params") from None
    claimed = kv.get("remote_num_tokens")
    if not _is_int(claimed):
        raise bad_request(f"kv_transfer_params.remote_num_tokens must be an integer, got "
                          f"{claimed!r}", "kv_transfer_params")
    if claimed != num_tokens:
        raise bad_request(f"kv_transfer_params.remote_num_tokens is {claimed} but this "
                          f"request's prompt has {num_tokens} tokens", "kv_transfer_params")
    remote_size = kv.get("remote_block_size")
    if remote_size is None:  # absent (vLLM's params): the same as this decode's
        remote_size = block_size
    if not _is_int(remote_size) or remote_size <= 0:
        raise bad_request(f"kv_transfer_params.remote_block_size must be a positive integer, "
                          f"got {remote_size!r}", "kv_transfer_params")
    if max(remote_size, block_size) % min(remote_size, block_size):
        raise bad_request(f"kv_transfer_params.remote_block_size is {remote_size} but this "
                          f"decode's block size is {block_size}: one must be a multiple of "
                          f"the other", "kv_transfer_params")
    needed = -(-num_tokens // remote_size)
    if len(remote.remote_block_ids) != needed:
        raise bad_request(f"kv_transfer_params.remote_block_ids has "
                          f"{len(remote.remote_block_ids)} ids but a {num_tokens}-token prompt "
                          f"fills {needed} blocks of {remote_size} tokens", "kv_transfer_params")
    return remote


class _KvOnly(msgspec.Struct):
    """Just the ``kv_transfer_params`` of a body; every other field is ignored."""

    kv_transfer_params: dict[str, Any] | None = None


def unread_lease(raw: bytes, role: str) -> RemoteParams | None:
    """The prefill lease a refused decode request names, if its params are readable.

    For the decode role only, and only when the body is a JSON object whose
    ``kv_transfer_params`` say ``do_remote_prefill: true`` and parse as
    :class:`~kvxfer.wire.params.RemoteParams`; None otherwise (nothing to release,
    or no side channel to release it over). The rest of the body is not
    looked at: it may be the very reason the request was refused.
    """
    from kvxfer.wire.params import RemoteParams

    if role != "decode":
        return None
    try:
        kv = msgspec.json.decode(raw, type=_KvOnly).kv_transfer_params
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if kv is None or kv.get("do_remote_prefill") is not True:
        return None
    try:
        return RemoteParams.parse(kv)
    except ValueError:
        return None


# -- answers -----------------------------------------------------------------------------

class TokenText:
    """Token id -> the text logprobs show for it (``token_id:<id>`` when it has none).

    A token that decodes to nothing (a special token) or to part of a UTF-8
    character cannot be shown as text; vLLM's ``token_id:`` form keeps it unique.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self.tokenizer.decode([token_id])
            except (ValueError, IndexError, TypeError):
                text = ""
            if not text or "\ufffd" in text:
                text = f"token_id:{token_id}"
            self._cache[token_id] = text
        return text

    def decoded_length(self, ids: Sequence[int]) -> int:
        return len(self.tokenizer.decode(list(ids))) if ids else 0


@dataclass
class Choice:
    """One choice's answer, accumulated from engine outputs (whole or streamed).

    ``prompt_index``: the prompt it answers (several choices share one when n > 1);
    ``echo``: the prompt text its answer starts with (``echo: true``), else "".
    """

    index: int
    prompt_index: int = 0
    echo: str = ""
    num_prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, output: RequestOutput) -> None:
        self.num_prompt_tokens = output.num_prompt_tokens
        self.token_ids = list(output.token_ids)
        self.text = output.text
        self.logprobs += output.logprobs
        if output.finished:
            self.finish_reason = output.finish_reason


def usage(choices: Sequence[Choice]) -> dict[str, int]:
    """Token counts; a prompt's tokens count once however many choices answer it
    (vLLM and OpenAI count them so for n > 1)."""
    per_prompt = {c.prompt_index: c.num_prompt_tokens for c in choices}
    prompt = sum(per_prompt.values())
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_logprobs(entries: Sequence[Logprob], prior_ids: Sequence[int],
                        names: TokenText) -> dict[str, Any]:
    """OpenAI completions logprobs for ``entries``, the tokens after ``prior_ids``.

    ``text_offset`` is each token's character offset in the completion text.
    """
    ids = list(prior_ids)
    offsets = []
    for entry in entries:
        offsets.append(names.decoded_length(ids))
        ids.append(entry.token_id)
    return {
        "tokens": [names(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{names(e.token_id): e.logprob,
                          **{names(t): v for t, v in e.top}} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[Logprob], names: TokenText) -> dict[str, Any]:
    """OpenAI chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = names(token_id)
        raw = None if text.startswith("token_id:") else list(text.encode("utf-8"))
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, v) for t, v in e.top]} for e in entries]}


def completion_body(request_id: str, created: int, model: str, choices: Sequence[Choice],
                    prepared: Prepared, names: TokenText) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": c.index, "text": c.echo + c.text,
                     "logprobs": completion_logprobs(c.logprobs, [], names)
                     if prepared.logprobs else None,
                     "finish_reason": c.finish_reason} for c in choices],
        "usage": usage(choices),
        "kv_transfer_params": choices[0].kv_transfer_params if choices else None,
    }


def chat_body(request_id: str, created: int, model: str, choices: Sequence[Choice],
              prepared: Prepared, names: TokenText) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": c.index,
                     "message": {"role": "assistant", "content": c.text},
                     "logprobs": chat_logprobs(c.logprobs, names) if prepared.logprobs else None,
                     "finish_reason": c.finish_reason} for c in choices],
        "usage": usage(choices),
        "kv_transfer_params": choices[0].kv_transfer_params if choices else None,
    }


def completion_chunk(request_id: str, created: int, model: str, index: int, text: str,
                     logprobs: dict[str, Any] | None, finish_reason: str | None
                     ) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: dict[str, str],
               logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, created: int, model: str, chat: bool,
                choices: Sequence[Choice]) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model,
            "choices": [], "usage": usage(choices)}


def sse(data: dict[str, Any] | bytes) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``."""
    payload = data if isinstance(data, bytes) else msgspec.json.encode(data)
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
