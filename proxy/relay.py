"""The client's side of a request: noticing that the client left, and relaying a stream.

A client that disconnects must cancel the upstream call, or a decode instance
keeps generating for nobody. ASGI reports a disconnect only to a pending
``receive()``; once a request's body is read, the next ``receive()`` returns
``http.disconnect`` when the connection goes away, so both helpers here race
the upstream work against one such call (:class:`DisconnectWatch`). (Starlette's
own streaming response stops watching for disconnects under ASGI spec 2.4
servers, hence our own.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.errors import ProxyError, error_body

log = logging.getLogger(__name__)
T = TypeVar("T")

SSE_MEDIA_TYPE = "text/event-stream"


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready."""


class DisconnectWatch:
    """Cancels the task that creates it when the client disconnects.

    One pending ``receive()`` per request, no second task for the work: the
    work runs in the request's own task, and the watch's done callback cancels
    that task if ``receive()`` returns first (any message: the body was already
    read, so the next one only comes when the connection goes away). Call
    :meth:`stop` when the work ends, in a ``finally``.
    """

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("DisconnectWatch needs a running task")
        self._task = task
        self.left = False  # True once the client is known to be gone
        self._watch = asyncio.ensure_future(receive())
        self._watch.add_done_callback(self._on_message)

    def _on_message(self, watch: asyncio.Future[Any]) -> None:
        if watch.cancelled():
            return
        watch.exception()  # retrieved: a failed receive() also means the client is gone
        self.left = True
        self._task.cancel()

    def stop(self) -> None:
        """Stop watching; the task is never cancelled by this watch afterwards."""
        self._watch.remove_done_callback(self._on_message)
        self._watch.cancel()

    def absorb(self) -> None:
        """Take back the cancellation this watch caused (call on its CancelledError).

        Python 3.11+ counts cancellations per task; without this the request's
        task would still look cancelled to the server.
        """
        uncancel = getattr(self._task, "uncancel", None)
        if uncancel is not None:
            uncancel()


async def unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to completion unless the client disconnects first.

    Call only after the request body has been read. If the client leaves,
    ``work`` is cancelled (closing its upstream connections) and
    :class:`ClientDisconnected` is raised.
    """
    watch = DisconnectWatch(receive)
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.left:
            raise  # cancelled by someone else (server shutdown): not ours to handle
        watch.absorb()
        raise ClientDisconnected from None
    finally:
        watch.stop()


class RelayResponse(Response):
    """An ASGI response that sends ``chunks`` as they arrive, without buffering.

    ``close`` runs exactly once when the relay ends for any reason: the last
    chunk, a :class:`ProxyError` from ``chunks`` (sent to an SSE client as an
    ``error`` event followed by ``[DONE]``, as the sidecars do), or the client
    disconnecting (``on_disconnect`` is called and ``chunks`` is cancelled).
    """

    def __init__(self, chunks: AsyncIterator[bytes], close: Callable[[], Awaitable[None]],
                 on_disconnect: Callable[[], None], status_code: int = 200,
                 media_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        self.chunks = chunks
        self.close = close
        self.on_disconnect = on_disconnect
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            watch = DisconnectWatch(receive)
            try:
                await self._relay(send)
            except asyncio.CancelledError:
                if not watch.left:
                    raise
                watch.absorb()
                self.on_disconnect()
            finally:
                watch.stop()
        finally:
            await asyncio.shield(self.close())

    async def _relay(self, send: Send) -> None:
        tail = b"\n\n"
        try:
            async for chunk in self.chunks:
                if chunk:
                    tail = (tail + chunk)[-2:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except ProxyError as exc:
            log.warning("stream relay ended early: %s", exc.message)
            if self.media_type == SSE_MEDIA_TYPE:
                await send({"type": "http.response.body", "more_body": True,
                            "body": sse_error(exc, complete_event=tail == b"\n\n")})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def sse_error(exc: ProxyError, complete_event: bool = True) -> bytes:
    """An SSE ``error`` event and ``[DONE]``; ends a cut-off event first if needed."""
    start = b"" if complete_event else b"\n\n"
    body = error_body(exc.status, exc.message, exc.kind)
    return start + b"data: " + body + b"\n\ndata: [DONE]\n\n"
