"""Answering one completion request: its engine events collected into a JSON body
(:meth:`Answer.whole`) or sent as server-sent events (:meth:`Answer.stream`), and noticing
a client that leaves (:class:`ClientGone`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvxfer.sidecar.engine_loop import Event, Failure, Sink
from kvxfer.sidecar.openai_api.answers import (
    SSE_DONE,
    Choice,
    chat_body,
    chat_chunk,
    chat_logprobs,
    completion_body,
    completion_chunk,
    completion_logprobs,
    sse,
    usage_chunk,
)
from kvxfer.sidecar.openai_api.error_body import OpenAIError, error_body
from kvxfer.sidecar.openai_api.prepared import Prepared

if TYPE_CHECKING:
    from kvxfer.sidecar.instance import Sidecar

T = TypeVar("T")
JSON = "application/json"


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``body`` encoded as JSON, with ``status`` and ``headers``."""
    return Response(msgspec.json.encode(body), status, headers=headers, media_type=JSON)


def error_response(exc: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    """The OpenAI error body of ``exc``, with its status."""
    return Response(exc.body(), exc.status, headers=headers, media_type=JSON)


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    """Return once the client disconnects (call only after the body was read)."""
    for _ in range(10_000):  # each receive() waits for connection activity
        message = await receive()
        if message["type"] == "http.disconnect":
            return
    await asyncio.Event().wait()  # a client that keeps sending junk: never "gone"


async def _unless_gone(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or :class:`ClientGone` (``work`` cancelled) if the client left."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


class _EventStream(Response):
    """An SSE response that sends ``chunks`` as they come and notices a client leaving.

    ``on_disconnect`` runs when the response ends for any reason; it must abort
    only what did not finish.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], on_disconnect: Callable[[], None],
                 headers: dict[str, str]) -> None:
        self.chunks, self.on_disconnect = chunks, on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({**headers, "cache-control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            await _unless_gone(receive, self._send_all(send))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientGone, OSError):  # the client left, or the connection broke
            return
        finally:
            self.on_disconnect()  # aborts whatever did not finish; a no-op after the end

    async def _send_all(self, send: Send) -> None:
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})


class Answer:
    """Collects one HTTP request's events into a JSON answer or an SSE stream."""

    def __init__(self, side: Sidecar, prepared: Prepared, ids: list[str], sink: Sink,
                 base: str) -> None:
        self.side, self.prepared, self.ids, self.sink = side, prepared, ids, sink
        self.response_id = f"{'chatcmpl' if prepared.chat else 'cmpl'}-{base}"
        self.created = int(time.time())
        self.choices = [Choice(k, k // prepared.n, prepared.echo_text(k))
                        for k in range(len(ids))]
        self.open = set(range(len(ids)))  # choices without a final event yet

    def abort(self) -> None:
        """Abort the choices still running (the client left, or another choice failed)."""
        self.sink.closed = True
        running = [self.ids[i] for i in sorted(self.open)]
        if running:
            self.side.loop.abort(running)
        self.open.clear()

    async def _next(self) -> Event:
        event = await self.sink.queue.get()
        if event.final:
            self.open.discard(event.index)
        return event

    def _failure(self, failure: Failure, headers: dict[str, str]) -> Response:
        self.abort()
        return error_response(OpenAIError(failure.status, failure.message, failure.kind), headers)

    async def whole(self, receive: Receive, headers: dict[str, str]) -> Response:
        async def collect() -> Failure | None:
            for _ in range(self.prepared.params.max_tokens * len(self.ids) + len(self.ids)):
                if not self.open:
                    return None
                event = await self._next()
                if event.failure is not None:
                    return event.failure
                assert event.output is not None
                self.choices[event.index].add(event.output)
                self.choices[event.index].kv_transfer_params = event.kv_transfer_params
            return Failure(500, "the engine sent more outputs than tokens", "internal_error")

        failure = await _unless_gone(receive, collect())
        if failure is not None:
            return self._failure(failure, headers)
        build = chat_body if self.prepared.chat else completion_body
        return json_response(build(self.response_id, self.created, self.prepared.model,
                                   self.choices, self.prepared, self.side.token_text),
                             headers=headers)

    async def stream(self, receive: Receive, headers: dict[str, str]) -> Response:
        # Wait for the first event before answering, so that a failure before any
        # token (a refused request, a failed KV read) still gets a real HTTP status.
        first = await _unless_gone(receive, self._next())
        if first.failure is not None:
            return self._failure(first.failure, headers)
        return _EventStream(self._chunks(first), self.abort, headers)

    async def _chunks(self, first: Event) -> AsyncIterator[bytes]:
        if self.prepared.chat:
            for choice in self.choices:
                yield sse(chat_chunk(self.response_id, self.created, self.prepared.model,
                                     choice.index, {"role": "assistant", "content": ""}, None,
                                     None))
        elif self.prepared.echo is not None:  # the prompt comes first, as in the whole answer
            for choice in self.choices:
                yield sse(completion_chunk(self.response_id, self.created, self.prepared.model,
                                           choice.index, choice.echo, None, None))
        event: Event | None = first
        limit = self.prepared.params.max_tokens * len(self.ids) + len(self.ids)
        for _ in range(limit):
            if event is None:
                if not self.open:
                    break
                event = await self._next()
            if event.failure is not None:
                self.abort()
                yield sse(error_body(event.failure.status, event.failure.message,
                                     event.failure.kind))
                break
            chunk = self._chunk(event)
            if chunk is not None:
                yield sse(chunk)
            event = None
        if self.prepared.include_usage:
            yield sse(usage_chunk(self.response_id, self.created, self.prepared.model,
                                  self.prepared.chat, self.choices))
        yield SSE_DONE

    def _chunk(self, event: Event) -> dict[str, Any] | None:
        """The SSE chunk for one output (None when it has nothing to show yet)."""
        assert event.output is not None
        output, choice = event.output, self.choices[event.index]
        prior = list(choice.token_ids)
        choice.add(output)
        if not (output.new_text or output.finished or (self.prepared.logprobs
                                                       and output.logprobs)):
            return None
        names = self.side.token_text
        reason = output.finish_reason if output.finished else None
        p = self.prepared
        if p.chat:
            logprobs = chat_logprobs(output.logprobs, names) if p.logprobs else None
            delta = {"content": output.new_text} if output.new_text or not output.finished \
                else {}
            return chat_chunk(self.response_id, self.created, p.model, event.index, delta,
                              logprobs, reason)
        logprobs = completion_logprobs(output.logprobs, prior, names) if p.logprobs else None
        return completion_chunk(self.response_id, self.created, p.model, event.index,
                                output.new_text, logprobs, reason)
