"""Several prompts in one completions request: one prefill/decode pair per prompt.

Choice ``j`` of prompt ``i`` becomes choice ``i * n + j``; streams are interleaved, with one
usage chunk and one ``[DONE]``. No answered prefill's call is cut off: it holds a lease only
a decode call ends. Splitting, merging and SSE parsing are pure.

Design: docs/design/proxy.md#several-prompts-in-one-request
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec

from proxy.contract import COMPLETIONS
from proxy.errors import ProxyError, UpstreamRejected, bad_gateway

T = TypeVar("T")

DONE = b"[DONE]"


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.total_tokens += other.total_tokens


class _Choice(msgspec.Struct):
    index: int


class _Answer(msgspec.Struct):
    """What merging reads of a decode's answer or stream chunk; the rest passes as sent."""

    choices: list[_Choice]
    usage: Usage | None = None


class _Error(msgspec.Struct):
    message: str
    param: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _Error


# -- splitting ----------------------------------------------------------------------------

def split_prompts(route: str, body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One body per prompt for a completions request with several prompts, else None.

    Several prompts: a list of two or more strings, or of two or more lists (token
    ids). A list of token ids is one prompt; anything else goes to the sidecars
    unchanged, which answer it (or refuse it with a 400) themselves.
    """
    prompt = body.get("prompt")
    if route != COMPLETIONS or not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return None
    return [{**body, "prompt": p} for p in prompt]


def choices_per_prompt(body: dict[str, Any]) -> int:
    """The client's ``n`` (1 when absent; a bad value is the decode's to refuse)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def for_prompt(index: int, exc: BaseException) -> BaseException:
    """``exc`` as the answer to prompt ``index``: a 4xx about the prompt, or any proxy
    error, names it in the message; anything else is returned unchanged."""
    if isinstance(exc, ProxyError):
        return ProxyError(exc.status, f"prompt[{index}]: {exc.message}", exc.kind, exc.param)
    if isinstance(exc, UpstreamRejected):
        try:
            body = msgspec.json.decode(exc.content, type=_ErrorBody)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return exc
        if body.error.param != "prompt":
            return exc
        raw = msgspec.json.decode(exc.content)
        raw["error"]["message"] = f"prompt[{index}]: {body.error.message}"
        return UpstreamRejected(exc.status, msgspec.json.encode(raw), exc.content_type,
                                exc.stage, exc.url)
    return exc


# -- running the pairs --------------------------------------------------------------------

async def gather_settled(calls: Sequence[Awaitable[T]]) -> list[T | BaseException]:
    """Every call's result or exception, in order; none is cancelled because another
    failed (only the caller's own cancellation cancels them all)."""
    return list(await asyncio.gather(*calls, return_exceptions=True))


async def gather_or_cancel(calls: Sequence[Awaitable[T]],
                           discard: Callable[[T], Awaitable[None]] | None = None) -> list[T]:
    """Every call's result, in order; the first failure (lowest prompt index among
    those that failed) cancels the others, ``discard``\\s the results that already
    came, and is raised as :func:`for_prompt` names it."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        failed = [(i, t) for i, t in enumerate(tasks)
                  if t.done() and not t.cancelled() and t.exception() is not None]
        if failed or not all(t.done() for t in tasks):  # a failure, or we were cancelled
            await _cancel_all(tasks, discard)
    if failed:
        index, task = failed[0]
        error = task.exception()
        assert error is not None
        raise for_prompt(index, error) from error
    return [t.result() for t in tasks]


async def _cancel_all(tasks: Sequence[asyncio.Future[T]],
                      discard: Callable[[T], Awaitable[None]] | None) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if discard is not None:
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                await asyncio.shield(discard(task.result()))


# -- merging whole answers ----------------------------------------------------------------

def _decode_answer(content: bytes, url: str) -> tuple[dict[str, Any], _Answer]:
    try:
        raw = msgspec.json.decode(content)
        return raw, msgspec.convert(raw, _Answer)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise bad_gateway(f"decode instance {url} answered what cannot be merged: {exc}") \
            from None


def merge_answers(answers: Sequence[tuple[bytes, str]], n: int) -> bytes:
    """One completions answer from each prompt's ``(answer body, decode url)``."""
    merged: dict[str, Any] | None = None
    choices: list[dict[str, Any]] = []
    usage = Usage()
    for i, (content, url) in enumerate(answers):
        raw, shape = _decode_answer(content, url)
        merged = merged if merged is not None else raw
        for choice, seen in zip(raw["choices"], shape.choices, strict=True):
            choices.append({**choice, "index": i * n + seen.index})
        if shape.usage is not None:
            usage.add(shape.usage)
    assert merged is not None, "no answers to merge"
    return msgspec.json.encode({**merged, "choices": choices, "usage": usage})


# -- merging streams ----------------------------------------------------------------------

class SSEParser:
    """Splits a byte stream into the payloads of its ``data:`` events."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [line[len(b"data:"):].strip() for event in events
                for line in event.split(b"\n") if line.startswith(b"data:")]


class StreamMerger:
    """Re-indexes the chunks of each prompt's stream into one stream.

    Feed each payload with :meth:`event` (which answers the bytes to send, if any)
    and end with :meth:`finish`. An ``error`` event is passed on and sets
    ``failed``: the caller stops reading the other streams.
    """

    def __init__(self, n: int, url_of: Callable[[int], str]) -> None:
        self.n, self.url_of = n, url_of
        self.usage = Usage()
        self.usage_template: dict[str, Any] | None = None
        self.failed = False

    def event(self, i: int, payload: bytes) -> bytes | None:
        if payload == DONE:
            return None
        raw, shape = self._decode(i, payload)
        if "error" in raw:
            self.failed = True
            return sse(payload)
        if shape.usage is not None and not shape.choices:
            self.usage.add(shape.usage)
            if self.usage_template is None:
                self.usage_template = raw
            return None
        for choice, seen in zip(raw["choices"], shape.choices, strict=True):
            choice["index"] = i * self.n + seen.index
        return sse(msgspec.json.encode(raw))

    def _decode(self, i: int, payload: bytes) -> tuple[dict[str, Any], _Answer]:
        try:
            raw = msgspec.json.decode(payload)
            if isinstance(raw, dict) and "error" in raw:
                return raw, _Answer([])
            return raw, msgspec.convert(raw, _Answer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise for_prompt(i, bad_gateway(f"decode instance {self.url_of(i)} streamed an "
                                            f"event that cannot be merged: {exc}")) from None

    def finish(self, include_usage: bool) -> bytes:
        """The end of the merged stream: the summed usage chunk if asked for, ``[DONE]``."""
        tail = b""
        if include_usage and self.usage_template is not None and not self.failed:
            tail = sse(msgspec.json.encode({**self.usage_template, "usage": self.usage}))
        return tail + sse(DONE)


async def merged_stream(sources: Sequence[AsyncIterator[bytes]], merger: StreamMerger,
                        include_usage: bool) -> AsyncIterator[bytes]:
    """The events of every source (prompt ``i``'s decode stream) as they come, merged.

    A failing source raises its error (named for its prompt) after what was sent;
    an ``error`` event ends the merged stream early. Closing the iterator (the
    client left) stops reading every source.
    """
    queue: asyncio.Queue[tuple[int, bytes | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator[bytes]) -> None:
        parser = SSEParser()
        try:
            async for chunk in source:
                for payload in parser.feed(chunk):
                    queue.put_nowait((i, payload))
            queue.put_nowait((i, None))
        except Exception as exc:
            queue.put_nowait((i, for_prompt(i, exc)))

    pumps = [asyncio.ensure_future(pump(i, source)) for i, source in enumerate(sources)]
    try:
        running = len(pumps)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                out = merger.event(i, item)
                if out is not None:
                    yield out
                if merger.failed:
                    break
        yield merger.finish(include_usage)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
