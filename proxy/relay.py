"""The client's side of a request: noticing that the client left, and relaying a stream.

A client that disconnects must cancel the upstream call, or a decode instance
keeps generating for nobody. ASGI reports a disconnect only to a pending
``receive()``; once a request's body is read, the next ``receive()`` returns
``http.disconnect`` when the connection goes away, so both helpers here race
the upstream work against one such call. (Starlette's own streaming response
stops watching for disconnects under ASGI spec 2.4 servers, hence our own.)
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


async def unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to completion unless the client disconnects first.

    Call only after the request body has been read. If the client leaves,
    ``work`` is cancelled (closing its upstream connections) and
    :class:`ClientDisconnected` is raised; if ``work`` finished anyway, its
    result wins.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(receive())
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        work_task.cancel()  # no-op when it already finished
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected
    return work_task.result()


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
            relay = asyncio.ensure_future(self._relay(send))
            watch = asyncio.ensure_future(receive())
            try:
                await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
                relay.cancel()
                await asyncio.gather(relay, watch, return_exceptions=True)
            if relay.cancelled():
                self.on_disconnect()
            elif relay.exception() is not None:
                raise relay.exception()  # type: ignore[misc]
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
