"""The sidecar's routes (:class:`Handlers`), the handlers of its errors, and the middleware
that counts its requests (:class:`CountRequests`).

Handlers never touch the engine: they validate (:mod:`kvxfer.sidecar.openai_api`), submit
to the :class:`~kvxfer.sidecar.engine_loop.EngineLoop` and await its events
(:class:`~kvxfer.sidecar.answer.Answer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvxfer.net.api_key import authenticated
from kvxfer.net.hosts import DRAINING_HEADER
from kvxfer.sidecar.answer import Answer, ClientGone, error_response, json_response
from kvxfer.sidecar.engine_loop import EngineStopped, Sink
from kvxfer.sidecar.openai_api.error_body import OpenAIError
from kvxfer.sidecar.openai_api.kv_params import check_samples_fit, unread_lease
from kvxfer.sidecar.openai_api.prepared import Prepared
from kvxfer.sidecar.openai_api.request_bodies import ChatRequest, CompletionRequest, decode_body
from kvxfer.sidecar.openai_api.validation import prepare_chat, prepare_completion
from kvxfer.sidecar.request_kinds import PullIn, PushIn, Sample, Submission
from kvxfer.sidecar.roles.prefill import PrefillSide
from kvxfer.sidecar.roles.push_decode import PushDecode
from kvxfer.sidecar.sidecar_metrics import CONTENT_TYPE
from kvxfer.wire.messages import ReleaseOutcome
from kvxfer.wire.params import RemoteParams
from kvxfer.wire.reservations import RESERVATION_KEY, parse_reservation

if TYPE_CHECKING:
    from kvxfer.sidecar.instance import Sidecar

log = logging.getLogger(__name__)
NO_PUSHES = "this instance takes no pushes: start a decode with --kv-transfer-mode push"

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
RELEASE, RESERVE = "/v1/kv/release", "/v1/kv/reserve"
ROUTES = (COMPLETIONS, CHAT, RELEASE, RESERVE, "/v1/models", "/health", "/metrics")
MAX_REQUEST_ID_CHARS = 200


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error as OpenAI does: an :class:`OpenAIError` body with its status."""
    async def openai_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return error_response(exc)

    async def validation_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(OpenAIError(400, f"invalid request: {first.get('msg', exc)}",
                                          param=param))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            return error_response(OpenAIError(404, message, "not_found_error"))
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(OpenAIError(exc.status_code, message, kind))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                          "internal_error"))

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)


class CountRequests:
    """ASGI middleware: count requests by route (known routes, else "other") and status,
    and the completion requests in flight (what a drain waits for).

    Pure ASGI (no BaseHTTPMiddleware) so that handlers still see the client's
    disconnect through ``receive``.
    """

    def __init__(self, app: ASGIApp, side: Sidecar) -> None:
        self.app, self.side, self.metrics = app, side, side.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        completion = scope["path"] in (COMPLETIONS, CHAT)
        if completion:
            self.side.http_in_flight += 1
            self.side.last_request = time.monotonic()
        try:
            await self.app(scope, receive, counting_send)
        finally:
            if completion:
                self.side.http_in_flight -= 1
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.http_requests.labels(route, str(status)).inc()


class Handlers:
    """The route handlers of one app."""

    def __init__(self, side: Sidecar) -> None:
        self.side = side
        self.created = int(time.time())

    async def health(self, request: Request) -> Response:
        """200 while the engine loop runs, else 503; details only with the API key."""
        loop = self.side.loop
        if not authenticated(request.scope):
            if self.side.draining:
                return json_response({"status": "draining"}, 503, {DRAINING_HEADER: "1"})
            return json_response({"status": "ok" if loop.running else "error"},
                                 200 if loop.running else 503)
        if not loop.running:
            return json_response({"status": "error", "role": self.side.settings.role,
                                  "error": loop.error or "the engine loop is not running"}, 503)
        if self.side.draining:
            return json_response(self.side.health(), 503, {DRAINING_HEADER: "1"})
        return json_response(self.side.health())

    async def models(self) -> Response:
        return json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "kvxfer",
             "root": self.side.engine.model_name, "max_model_len": self.side.engine.max_model_len}
            for name in self.side.served_names]})

    async def metrics(self) -> Response:
        return Response(self.side.metrics.render(), media_type=CONTENT_TYPE)

    async def release(self, request: Request) -> Response:
        """A prefill ends a lease it handed out that no decode claimed, for a caller that
        shows its ``kv_transfer_params`` (the proxy, when no decode will read them): 200
        ``{"released": bool}`` (False: ended already, or claimed by a decode, which alone
        may end it then); 400 for params that are malformed, another prefill's or, with
        a key, not signed by it. A push decode likewise ends a reservation nobody will
        use, for a caller that shows it (``kv_transfer_params.kv_reservation``): at once
        where no prefill claimed it, else once its writer's WRITEs ended."""
        raw = await request.body()
        why = "the caller holding its params says no request will use it"
        try:
            kv = msgspec.json.decode(raw, type=_ReleaseBody).kv_transfer_params
            if RESERVATION_KEY in kv:  # a push decode's reservation
                reservation = parse_reservation(kv[RESERVATION_KEY])
                released = await asyncio.wrap_future(self.side.loop.on_role(
                    PushDecode, lambda pushes: pushes.release(reservation, why), NO_PUSHES))
            else:
                prefill = self.side.roles.find(PrefillSide)
                if prefill is None:
                    raise RuntimeError(f"a {self.side.settings.role} instance hands out no "
                                       f"leases")
                released = prefill.release_handed_out(RemoteParams.parse(kv), why)
        except EngineStopped as exc:
            return error_response(OpenAIError(503, str(exc), "service_unavailable"))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError) as exc:
            raise OpenAIError(400, f"cannot release: {exc}",
                              param="kv_transfer_params") from None
        except RuntimeError as exc:  # not a prefill
            raise OpenAIError(400, str(exc)) from None
        return json_response({"released": released})

    async def reserve(self, request: Request) -> Response:
        """Push mode, decode: reserve blocks for the prompt of a completion or chat request
        (``{"endpoint": path, "body": request}``, tokenized as that route would) and answer
        ``{"kv_reservation": ...}``, the signed reservation a prefill writes its KV into;
        the generation request names it (``kv_transfer_params.kv_reservation_id``); with
        ``n > 1`` blocks for the further samples too, which copy the pushed KV. 503 when
        the blocks are not free (nothing is held then)."""
        from kvxfer.engine import NoFreeBlocks

        if self.side.draining:
            return self._refuse_draining()
        raw = await request.body()
        try:
            asked = msgspec.json.decode(raw, type=_ReserveBody)
            body = msgspec.json.encode(asked.body)
            prepared = prepare_chat(decode_body(body, ChatRequest), self.side.info) \
                if asked.endpoint == CHAT else \
                prepare_completion(decode_body(body, CompletionRequest), self.side.info)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise OpenAIError(400, f"cannot reserve: {exc}") from None
        if len(prepared.prompts) != 1:
            raise OpenAIError(400, f"a reservation holds one prompt's KV: send one prompt, "
                                   f"not {len(prepared.prompts)}", param="body")
        check_samples_fit(prepared.n, len(prepared.prompts[0]), self.side.info)
        try:
            prompt, n = prepared.prompts[0], prepared.n
            future = self.side.loop.on_role(PushDecode, lambda pushes: pushes.reserve(prompt, n),
                                            NO_PUSHES)
            reservation = await asyncio.wrap_future(future)
        except EngineStopped as exc:
            return error_response(OpenAIError(503, str(exc), "service_unavailable"))
        except NoFreeBlocks as exc:
            return error_response(OpenAIError(503, f"no free KV blocks to reserve: {exc}",
                                              "service_unavailable"))
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from None
        return json_response({"kv_reservation": msgspec.to_builtins(reservation)})

    def _refuse_draining(self) -> Response:
        """503 for a new request while draining; the header tells a proxy that nothing
        was started (a decode left the lease alone), so another instance may take it."""
        return error_response(OpenAIError(503, "this instance is draining (shutting down): send "
                                               "the request to another instance",
                                          "service_unavailable"), {DRAINING_HEADER: "1"})

    async def completions(self, request: Request) -> Response:
        if self.side.draining:
            return self._refuse_draining()
        raw = await request.body()
        prepared = self._prepare(raw, lambda: prepare_completion(
            decode_body(raw, CompletionRequest), self.side.info))
        return await self._answer(request, prepared)

    async def chat(self, request: Request) -> Response:
        if self.side.draining:
            return self._refuse_draining()
        raw = await request.body()
        prepared = self._prepare(raw, lambda: prepare_chat(decode_body(raw, ChatRequest),
                                                           self.side.info))
        return await self._answer(request, prepared)

    def _prepare(self, raw: bytes, prepare: Callable[[], Prepared]) -> Prepared:
        """``prepare()``; when it refuses the request, release the lease it names."""
        try:
            return prepare()
        except OpenAIError as exc:
            remote = unread_lease(raw, self.side.settings.role)
            if remote is not None:
                self.side.roles.not_admitted(
                    PullIn(remote), f"the decode refused the request ({exc.status}): "
                                    f"{exc.message}", ReleaseOutcome.ABANDONED)
            raise

    async def _answer(self, request: Request, prepared: Prepared) -> Response:
        base = _request_id(request)
        headers = {"x-request-id": base}
        loop = self.side.loop
        ids = loop.reserve_ids(base, prepared.num_choices)
        submissions = _submissions(prepared, ids)
        sink = Sink(asyncio.get_running_loop())
        try:
            loop.submit(submissions, sink)
        except EngineStopped as exc:
            loop.release_ids(ids)
            self.side.roles.not_admitted(prepared.kind, f"the decode is not serving: {exc}",
                                         ReleaseOutcome.ABANDONED)
            return error_response(OpenAIError(503, str(exc), "service_unavailable"), headers)
        answer = Answer(self.side, prepared, ids, sink, base)
        try:
            if prepared.stream:
                return await answer.stream(request.receive, headers)
            return await answer.whole(request.receive, headers)
        except ClientGone:
            answer.abort()
            return Response(status_code=499)  # nobody reads it; counted in metrics
        except asyncio.CancelledError:  # the server is shutting down
            answer.abort()
            raise


class _ReleaseBody(msgspec.Struct, forbid_unknown_fields=True):
    kv_transfer_params: dict[str, object]


class _ReserveBody(msgspec.Struct, forbid_unknown_fields=True):
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    body: dict[str, object]


def _submissions(prepared: Prepared, ids: list[str]) -> list[Submission]:
    """One submission per choice (``ids[k]`` is choice ``k``); a decode request's ``n``
    samples are one submission whose further samples start from its single KV transfer."""
    params, kind = prepared.choice_params, prepared.kind
    if isinstance(kind, PullIn | PushIn):
        samples = tuple(Sample(ids[k], k, params(k)) for k in range(1, len(ids)))
        return [Submission(ids[0], 0, prepared.prompts[0], params(0),
                           dataclasses.replace(kind, samples=samples))]
    return [Submission(rid, k, prepared.prompts[k // prepared.n], params(k), kind)
            for k, rid in enumerate(ids)]


def _request_id(request: Request) -> str:
    """The client's X-Request-Id when it is usable, else a fresh one."""
    given = request.headers.get("x-request-id", "").strip()
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable():
        return given
    return uuid.uuid4().hex
