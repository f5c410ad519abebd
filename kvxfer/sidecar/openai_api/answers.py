"""Answers of the OpenAI surface: choices accumulated from engine outputs, logprobs, whole
bodies, stream chunks and server-sent events."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from kvxfer.engine import Logprob, RequestOutput, Tokenizer
    from kvxfer.sidecar.openai_api.prepared import Prepared


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
