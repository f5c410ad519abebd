"""A stand-in sidecar that speaks the prefill/decode HTTP contract, and checks it.

For the proxy's tests and ``kvxfer bench proxy``, until (and besides) the real
sidecars. A prefill stub answers one token with ``kv_transfer_params`` naming
fake leased blocks; a decode stub answers (JSON, or ``chunks`` SSE events and
``[DONE]``) only when given such params. Either refuses, with a 400 naming the
field, a call that breaks the contract. Answers are cheap and fixed.

In-process, a test keeps the :class:`StubBehaviour` and :class:`StubRecord` it
passed to :func:`create_stub_app` and changes/reads them between requests. As
a process: ``python -m proxy.stub --role decode --port 8200 --chunks 16``.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from proxy.errors import error_body
from proxy.relay import RelayResponse

MODEL = "stub-model"
BLOCK_SIZE = 16  # tokens per fake block; one prompt "token" per whitespace-separated word
POLL_S = 0.01


@dataclass
class StubBehaviour:
    """How the stub answers; read on every request, so a test may change it in between.

    ``hold``, when given, pauses the answer until the event is set (at most
    ``max_wait_s``): a JSON answer before it is sent, a stream after its first
    chunk. ``delay_s`` pauses before answering. ``break_after`` drops the
    connection after that many stream chunks. ``answer``, when given, is sent
    as the body of a 200 JSON answer instead of the contract's.
    ``health_delay_s`` pauses before ``GET /health`` answers.
    """

    fail_status: int | None = None
    delay_s: float = 0.0
    hold: threading.Event | None = None
    chunks: int = 4
    break_after: int | None = None
    answer: bytes | None = None
    healthy: bool = True
    health_delay_s: float = 0.0
    max_wait_s: float = 30.0


@dataclass
class Call:
    """One call the stub received and what it did with it."""

    path: str
    request_id: str | None
    body: Any
    sent: bytearray = field(default_factory=bytearray)  # the answer's body bytes, as sent
    finished: bool = False  # the whole answer was handed to the server
    disconnected: bool = False  # the caller went away before the answer ended


class StubRecord:
    """Calls received, in arrival order; safe to read from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Call] = []

    def add(self, call: Call) -> Call:
        with self._lock:
            self._calls.append(call)
        return call

    def calls(self, path: str | None = None) -> list[Call]:
        with self._lock:
            return [c for c in self._calls if path is None or c.path == path]

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()


def create_stub_app(role: str, behaviour: StubBehaviour | None = None,
                    record: StubRecord | None = None, engine_id: str | None = None) -> FastAPI:
    """A stub ``role`` ("prefill" or "decode") sidecar app; ``record=None`` keeps nothing."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"stub role must be 'prefill' or 'decode', got {role!r}")
    stub = _Stub(role, behaviour or StubBehaviour(), record,
                 engine_id or f"stub-{role}-{uuid.uuid4().hex[:8]}")
    app = FastAPI(title=f"kvxfer stub {role}", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stub = stub
    # Plain Starlette routes (Request in, Response out): a stub must cost far less per
    # request than the proxy it stands next to in ``kvxfer bench proxy``.
    app.add_route("/v1/completions", stub.complete, methods=["POST"])
    app.add_route("/v1/chat/completions", stub.complete, methods=["POST"])
    app.add_route("/v1/models", stub.models, methods=["GET"])
    app.add_route("/health", stub.health, methods=["GET"])
    app.add_route("/metrics", stub.metrics, methods=["GET"])
    return app


class _Stub:
    def __init__(self, role: str, behaviour: StubBehaviour, record: StubRecord | None,
                 engine_id: str) -> None:
        self.role = role
        self.behaviour = behaviour
        self.record = record
        self.engine_id = engine_id

    async def health(self, request: Request) -> Response:
        if self.behaviour.health_delay_s:
            await asyncio.sleep(self.behaviour.health_delay_s)
        ok = self.behaviour.healthy
        return _json({"status": "ok" if ok else "not ready"}, 200 if ok else 503)

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [
            {"id": MODEL, "object": "model", "owned_by": "kvxfer-stub", "root": self.role}]})

    async def metrics(self, request: Request) -> Response:
        return Response(f"stub_up{{role=\"{self.role}\"}} 1\n", media_type="text/plain")

    async def complete(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            body = raw.decode("utf-8", "replace")
        call = Call(request.url.path, request.headers.get("x-request-id"), body)
        if self.record is not None:
            self.record.add(call)
        problem = self._contract_problem(body)
        status = 400 if problem else self.behaviour.fail_status
        if status is not None:
            message = problem or f"stub {self.role} told to fail with HTTP {status}"
            return _sent(call, Response(error_body(status, message, "stub_error"), status,
                                        media_type="application/json"))
        if self.role == "decode" and body.get("stream") is True:
            # The proxy's own relay: unbuffered, and it cancels the stream (which the
            # generator records) when the caller disconnects.
            events = self._stream(request, call, body)
            return RelayResponse(events, events.aclose, lambda: None,
                                 media_type="text/event-stream")
        if not await self._wait(request, call, self.behaviour.hold, self.behaviour.delay_s):
            return Response(status_code=499)
        if self.behaviour.answer is not None:
            return _sent(call, Response(self.behaviour.answer, media_type="application/json"))
        answer = self._prefill_answer(call) if self.role == "prefill" else self._answer(call)
        return _sent(call, _json(answer))

    def _contract_problem(self, body: Any) -> str | None:
        """What in ``body`` breaks the sidecar contract for this role, or None."""
        if not isinstance(body, dict):
            return f"body must be a JSON object, got {type(body).__name__}"
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            return f"kv_transfer_params must be an object, got {params!r}"
        if self.role == "prefill":
            expected = {"max_tokens": 1, "stream": False}
            for key, value in expected.items():
                if body.get(key) != value:
                    return f"prefill call needs {key}={value!r}, got {body.get(key)!r}"
            if "stream_options" in body:
                return "prefill call must not carry stream_options"
            if params.get("do_remote_decode") is not True:
                return f"prefill call needs do_remote_decode true, got {params!r}"
        elif params.get("do_remote_prefill") is not True or "remote_block_ids" not in params:
            return f"decode call needs the prefill's kv_transfer_params, got {params!r}"
        return None

    def _prefill_answer(self, call: Call) -> dict[str, Any]:
        tokens = max(len(str(call.body.get("prompt", call.body.get("messages", ""))).split()), 1)
        rid = call.request_id or f"stub-{uuid.uuid4().hex}"
        answer = self._answer(call)
        answer["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_host": "127.0.0.1",
            "remote_port": 5600, "remote_block_ids": list(range(-(-tokens // BLOCK_SIZE))),
            "remote_request_id": rid, "remote_num_tokens": tokens, "tp_size": 1,
            "lease_expires_at": time.time() + 30.0}
        return answer

    def _answer(self, call: Call) -> dict[str, Any]:
        params = call.body.get("kv_transfer_params", {})
        text = f"decoded {params.get('remote_request_id')} from {params.get('remote_engine_id')}"
        chat = call.path.endswith("/chat/completions")
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": f"cmpl-{call.request_id}", "object":
                "chat.completion" if chat else "text_completion", "model": MODEL,
                "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    async def _stream(self, request: Request, call: Call, body: dict[str, Any]
                      ) -> AsyncGenerator[bytes, None]:
        chat = call.path.endswith("/chat/completions")
        try:
            if not await self._wait(request, call, None, self.behaviour.delay_s):
                return
            for i in range(self.behaviour.chunks):
                if self.behaviour.break_after is not None and i == self.behaviour.break_after:
                    raise ConnectionAbortedError("stub told to drop the stream")
                delta: dict[str, Any] = ({"delta": {"content": f"t{i} "}} if chat
                                         else {"text": f"t{i} "})
                yield _record(call, b"data: " + msgspec.json.encode(
                    {"id": f"cmpl-{call.request_id}", "choices": [{"index": 0, **delta}]})
                    + b"\n\n")
                if i == 0 and not await self._wait(request, call, self.behaviour.hold, 0.0):
                    return
            yield _record(call, b"data: [DONE]\n\n")
            call.finished = True
        except (asyncio.CancelledError, GeneratorExit):
            call.disconnected = True  # the server cancelled us: the caller went away
            raise

    async def _wait(self, request: Request, call: Call, hold: threading.Event | None,
                    delay_s: float) -> bool:
        """Sleep ``delay_s``, then until ``hold`` is set; False if the caller left meanwhile."""
        deadline = time.monotonic() + delay_s
        give_up = deadline + self.behaviour.max_wait_s
        while time.monotonic() < give_up:
            if time.monotonic() >= deadline and (hold is None or hold.is_set()):
                return True
            if await request.is_disconnected():
                call.disconnected = True
                return False
            await asyncio.sleep(POLL_S)
        return True


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")


def _record(call: Call, chunk: bytes) -> bytes:
    call.sent += chunk
    return chunk


def _sent(call: Call, response: Response) -> Response:
    call.sent += response.body
    call.finished = True
    return response


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from proxy.server import server_options

    parser = argparse.ArgumentParser(prog="python -m proxy.stub", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=4, help="SSE events per streamed answer")
    args = parser.parse_args(argv)
    app = create_stub_app(args.role, StubBehaviour(chunks=args.chunks), record=None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                **server_options())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
