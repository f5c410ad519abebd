"""The request bodies of the two routes, decoded strictly (msgspec) by :func:`decode_body`."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvxfer.sidecar.openai_api.error_body import bad_request


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class CommonFields(msgspec.Struct, kw_only=True):
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


class CompletionRequest(CommonFields, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(CommonFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


_PATH = re.compile(r" - at `\$\.?(.*)`$")


def decode_body(raw: bytes, kind: type[CommonFields]) -> Any:
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


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
