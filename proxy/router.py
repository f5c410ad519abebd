"""One client request through a prefill instance and then a decode instance.

Only an instance that could not be connected to, or that is draining, is skipped for the
next; a call that failed before any byte reached the client runs the whole request again
(``--retries``) on instances no try failed on. A lease no decode took is released at the
prefill. Several prompts: :mod:`proxy.fanout`.

Design: docs/design/proxy.md#one-request-through-prefill-and-decode
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response

from proxy.balancer import Balancer, Instance, Prompt, Split
from proxy.contract import (
    RESERVATION_KEY,
    decode_request,
    drain_request,
    one_token,
    parse_prefill_answer,
    parse_push_answer,
    parse_reservation,
    prefill_request,
    push_prefill_request,
    reserve_request,
    wants_stream,
)
from proxy.errors import NoInstance, ProxyError, UpstreamFailed
from proxy.fanout import (
    StreamMerger,
    choices_per_prompt,
    for_prompt,
    gather_or_cancel,
    gather_settled,
    merge_answers,
    merged_stream,
    split_prompts,
    wants_usage,
)
from proxy.metrics import ProxyMetrics
from proxy.pd_watch import SETTLE_S, PDWatch
from proxy.prompts import Prompts
from proxy.relay import RelayResponse
from proxy.upstream import Answer, Draining, OpenStream, Unreachable, Upstream

log = logging.getLogger(__name__)
T = TypeVar("T")
RELEASE_PATH = "/v1/kv/release"  # a kvxfer prefill's: ends a lease for its params' holder
RESERVE_PATH = "/v1/kv/reserve"  # a kvxfer decode's in push mode: blocks for a prompt


class PDRouter:
    """Routes requests over the balancer's instances; one per app."""

    def __init__(self, balancer: Balancer, upstream: Upstream, metrics: ProxyMetrics,
                 retries: int = 0, push: bool = False, prompts: Prompts | None = None,
                 split: Split | None = None, watch: PDWatch | None = None) -> None:
        self.balancer = balancer
        self.prompts = prompts or Prompts(None)  # prompt tokens, for kv_aware's scores
        self.split = split or Split()  # when a decode alone answers (no P/D)
        self.watch = watch or PDWatch()  # pairs whose decode read no KV
        self.upstream = upstream
        self.metrics = metrics
        self.retries = retries
        self.push = push  # push mode: the decode reserves first, the prefill writes
        self._background: set[asyncio.Task[None]] = set()

    async def complete(self, route: str, body: dict[str, Any], request_id: str) -> Response:
        """Answer a completion request (``route`` is its path) through prefill and decode,
        run again up to ``retries`` times when a call failed before any byte of the answer
        went to the client (:func:`worth_retrying`) and an instance that no try failed on
        could take it (:meth:`_untried`)."""
        self._need_decode()
        bodies = split_prompts(route, body)
        if bodies is not None:
            return await self._fan_out(route, body, bodies, request_id)
        failed: set[str] = set()  # instances in a failed try: the next one avoids them
        prompt = self.prompts.of(route, body)
        for attempt in itertools.count(1):
            try:
                return await self._pair(route, body, request_id, failed, prompt)
            except UpstreamFailed as exc:
                if attempt > self.retries or not worth_retrying(exc) \
                        or not self._untried(exc, failed):
                    raise
                self.metrics.retries.labels(exc.role).inc()
                log.warning("request %s: %s; running it again (retry %d of %d)", request_id,
                            exc.message, attempt, self.retries)
                self._need_decode()
        raise AssertionError("unreachable: the loop returns or raises")

    def _untried(self, exc: UpstreamFailed, failed: set[str]) -> bool:
        """Whether an instance that no try of the request failed on could take the next
        one: a prefill for a failed prefill; a prefill or a decode for a failed decode
        (its KV read may have failed because of the prefill). The same instances again
        would most likely fail again, a frozen one only after the same wait."""
        roles = ("prefill",) if exc.role == "prefill" else ("prefill", "decode")
        return any(self.balancer.has_healthy(role, failed) for role in roles)

    async def _pair(self, route: str, body: dict[str, Any], request_id: str,
                    failed: set[str], prompt: Prompt | None) -> Response:
        """One try: a prefill, then a decode with its params; the instances it used are
        added to ``failed`` when it fails. A request for one token is the prefill's alone."""
        if one_token(body):
            return await self._alone("prefill", route, body, request_id, failed, prompt)
        alone = self.balancer.decode_alone(prompt, self.split)
        self.metrics.routed.labels("decode" if alone else "pd", alone or "pays").inc()
        if alone:
            return await self._alone("decode", route, body, request_id, failed, prompt)
        if self.push:
            return await self._pair_pushed(route, body, request_id, failed, prompt)
        try:
            prefill, params = await self._prefill(route, body, request_id, failed, prompt)
        except UpstreamFailed as exc:
            failed.add(exc.url)
            raise
        content = msgspec.json.encode(decode_request(body, params))

        def answered(decode: Instance) -> None:  # was the lease read? (proxy.pd_watch)
            if self.watch.ask(prefill.url, decode.url):
                self._in_background(self._check_read(prefill, decode, params, request_id))

        try:
            if wants_stream(body):
                return await self._decode_stream(route, content, request_id, failed, prompt,
                                                 answered)
            return await self._decode_json(route, content, request_id, failed, prompt,
                                           answered)
        except NoInstance:  # no decode started anything: nobody will read the lease
            await self._release(prefill, params, request_id)
            raise
        except ProxyError as exc:
            message = (f"{exc.message} (prefill instance {prefill.url} holds the KV of request "
                       f"{params.get('remote_request_id')!r} until the decode releases it or "
                       f"its lease expires)")
            if not isinstance(exc, UpstreamFailed):
                raise ProxyError(exc.status, message, exc.kind) from exc
            # the decode may have failed before claiming the lease (then nobody reads it)
            # or because the prefill failed its read: the next try avoids both
            failed.update((exc.url, prefill.url))
            self._in_background(self._release(prefill, params, request_id))
            raise UpstreamFailed(exc.status, message, exc.kind, exc.role, exc.url) from exc

    async def _pair_pushed(self, route: str, body: dict[str, Any], request_id: str,
                           failed: set[str], prompt: Prompt | None) -> Response:
        """Push mode, one try: a decode reserves blocks for the prompt, a prefill computes
        it and writes its KV into them, then the same decode answers. When the prefill
        step fails in any way (the client leaving included), or the decode refuses the
        request (a draining decode's 503: the next try reserves elsewhere), the
        reservation is released at the decode (it frees nothing a request used); one the
        decode never used ends at its deadline there otherwise."""
        reserve = msgspec.json.encode(reserve_request(route, body))
        try:
            decode, answer = await self._with_failover(
                "decode", lambda i: self._fetch(i, "POST", RESERVE_PATH, request_id, reserve),
                failed, prompt)
            reservation = parse_reservation(answer.content, decode.url)
        except UpstreamFailed as exc:
            failed.add(exc.url)
            raise
        content = msgspec.json.encode(push_prefill_request(body, reservation))
        try:
            prefill, response = await self._with_failover(
                "prefill", lambda i: self._fetch(i, "POST", route, request_id, content,
                                                 _tokens(prompt)), failed, prompt)
            params = parse_push_answer(response.content, prefill.url,
                                       reservation["reservation_id"])
        except BaseException as exc:  # no request will use the reservation
            if isinstance(exc, UpstreamFailed):
                failed.update((exc.url, decode.url))
            self._in_background(self._release(decode, {RESERVATION_KEY: reservation},
                                              request_id))
            raise
        content = msgspec.json.encode(decode_request(body, params))
        try:
            if wants_stream(body):
                stream = await self._open(decode, route, request_id, content)
                return self._relay(route, request_id, decode, stream)
            return passthrough(await self._fetch(decode, "POST", route, request_id, content))
        except (Unreachable, UpstreamFailed) as exc:  # nothing will use the reservation
            self._in_background(self._release(decode, {RESERVATION_KEY: reservation},
                                              request_id))
            if isinstance(exc, Unreachable):  # gone, or draining (it refused the request)
                raise UpstreamFailed(502, f"decode instance {decode.url} holding the "
                                     f"reservation went away: {exc.reason}", "upstream_error",
                                     "decode", decode.url) from exc
            failed.update((exc.url, prefill.url))
            raise

    async def _alone(self, role: str, route: str, body: dict[str, Any], request_id: str,
                     failed: set[str], prompt: Prompt | None) -> Response:
        """The client's request, as sent, to one instance of ``role`` that answers it as one
        instance would, computing its prompt itself: no KV moves and no lease is made (no
        ``kv_transfer_params``). A prefill answers a request for one token; a decode one
        that P/D would not pay for (:meth:`Balancer.decode_alone`)."""
        tokens = _tokens(prompt)
        content = msgspec.json.encode({k: v for k, v in body.items()
                                       if k != "kv_transfer_params"})
        try:
            if wants_stream(body):
                instance, stream = await self._with_failover(
                    role, lambda i: self._open(i, route, request_id, content), failed,
                    prompt)
                return self._relay(route, request_id, instance, stream)
            _, answer = await self._with_failover(
                role, lambda i: self._fetch(i, "POST", route, request_id, content, tokens),
                failed, prompt)
            return passthrough(answer)
        except UpstreamFailed as exc:
            failed.add(exc.url)
            raise

    def _in_background(self, call: Coroutine[Any, Any, None]) -> None:
        """Run ``call`` without waiting for it (a release at a prefill that may be cut
        off must not delay the retry); kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _need_decode(self) -> None:
        """503 before any prefill when no decode is healthy: a prefill would only lease
        blocks that nobody reads until the lease expires."""
        if not self.balancer.has_healthy("decode"):
            raise self._unavailable("decode")

    async def _release(self, holder: Instance, params: dict[str, Any], request_id: str
                       ) -> None:
        """Ask ``holder`` to end what ``params`` name (best effort, logged): a prefill's
        lease, or (push mode) a decode's reservation (``kv_reservation``)."""
        content = msgspec.json.encode({"kv_transfer_params": params})
        what = f"reservation {params[RESERVATION_KEY].get('reservation_id')}" \
            if RESERVATION_KEY in params else f"lease {params.get('remote_request_id')}"
        try:
            answer = await self._fetch(holder, "POST", RELEASE_PATH, request_id, content)
        except Exception as exc:
            log.info("request %s: %s did not release %s (it ends at its deadline): %s",
                     request_id, holder.url, what, exc)
            return
        log.info("request %s: nobody will use %s at %s: %s", request_id, what, holder.url,
                 "released" if released(answer.content)
                 else "not released (ended, used or claimed)")

    async def _check_read(self, prefill: Instance, decode: Instance, params: dict[str, Any],
                          request_id: str) -> None:
        """After ``decode`` answered: a lease it never claimed is released at ``prefill``
        and the pair counted (:mod:`proxy.pd_watch`); best effort, quiet."""
        await asyncio.sleep(SETTLE_S)
        content = msgspec.json.encode({"kv_transfer_params": params})
        try:
            answer = await self._fetch(prefill, "POST", RELEASE_PATH, request_id, content)
        except Exception:  # gone, or a prefill that cannot be asked: unwatched
            return
        if answer.status == 404:
            self.watch.cannot_ask(prefill.url)
        if answer.status != 200:
            return
        if released(answer.content):
            self.watch.unread(prefill.url, decode.url, request_id)
        else:
            self.watch.read(prefill.url, decode.url)

    def _unavailable(self, role: str) -> NoInstance:
        return NoInstance(f"no healthy {role} instance: " + "; ".join(
            f"{i.url} ({i.last_error or 'unhealthy'})" for i in self.balancer.instances(role)))

    async def _fan_out(self, route: str, body: dict[str, Any], bodies: list[dict[str, Any]],
                       request_id: str) -> Response:
        """Several prompts: one prefill/decode pair each, answers merged in prompt order."""
        prompts = [self.prompts.of(route, b) for b in bodies]
        prefills = await gather_settled([self._prefill(route, b, request_id, (), p)
                                         for b, p in zip(bodies, prompts, strict=True)])
        failed = [(i, r) for i, r in enumerate(prefills) if isinstance(r, BaseException)]
        if failed:
            await self._drain(route, bodies, prefills, request_id)
            index, error = failed[0]
            if not isinstance(error, Exception):
                raise error  # cancellation and the like: not an answer
            raise for_prompt(index, error) from error
        held = [r for r in prefills if not isinstance(r, BaseException)]  # all of them
        contents = [msgspec.json.encode(decode_request(b, params))
                    for b, (_, params) in zip(bodies, held, strict=True)]
        n = choices_per_prompt(body)
        try:
            if wants_stream(body):
                return await self._fan_out_stream(route, contents, prompts, request_id, n,
                                                  wants_usage(body))
            answers = await gather_or_cancel([self._post_decode(route, c, request_id, (), p)
                                              for c, p in zip(contents, prompts, strict=True)])
        except NoInstance:  # a lease some decode claimed stays (the prefill refuses it)
            await gather_settled([self._release(p, params, request_id) for p, params in held])
            raise
        merged = merge_answers([(a.content, i.url) for i, a in answers], n)
        return Response(merged, 200, media_type="application/json")

    async def _fan_out_stream(self, route: str, contents: list[bytes],
                              prompts: list[Prompt | None], request_id: str, n: int,
                              include_usage: bool) -> Response:
        async def discard(opened: tuple[Instance, OpenStream]) -> None:
            self.balancer.release(opened[0])
            await opened[1].aclose()

        streams = await gather_or_cancel([self._open_decode(route, c, request_id, (), p)
                                          for c, p in zip(contents, prompts, strict=True)],
                                         discard)

        async def close() -> None:
            for opened in streams:
                await discard(opened)

        def on_disconnect() -> None:
            self.metrics.client_disconnects.labels(route).inc()
            log.info("client left request %s; closed its %d decode streams", request_id,
                     len(streams))

        merger = StreamMerger(n, lambda i: streams[i][0].url)
        chunks = merged_stream([s.chunks() for _, s in streams], merger, include_usage)
        return RelayResponse(chunks, close, on_disconnect, 200, "text/event-stream")

    async def _drain(self, route: str, bodies: list[dict[str, Any]],
                     prefills: list[tuple[Instance, dict[str, Any]] | BaseException],
                     request_id: str) -> None:
        """End the leases of the prompts whose prefill answered, when another failed."""
        calls = [self._post_decode(route, msgspec.json.encode(drain_request(b, r[1])),
                                   request_id)
                 for b, r in zip(bodies, prefills, strict=True) if not isinstance(r, BaseException)]
        for result in await gather_settled(calls):
            if isinstance(result, BaseException):
                log.warning("request %s: draining a lease failed (it ends at its TTL): %s",
                            request_id, result)

    async def models(self, request_id: str) -> Response:
        """``GET /v1/models`` from a healthy decode instance, passed through."""
        _, response = await self._with_failover(
            "decode", lambda i: self._fetch(i, "GET", "/v1/models", request_id))
        return passthrough(response)

    async def _prefill(self, route: str, body: dict[str, Any], request_id: str,
                       avoid: Collection[str] = (), prompt: Prompt | None = None
                       ) -> tuple[Instance, dict[str, Any]]:
        content = msgspec.json.encode(prefill_request(body))
        instance, response = await self._with_failover(
            "prefill", lambda i: self._fetch(i, "POST", route, request_id, content,
                                             _tokens(prompt)), avoid, prompt)
        try:
            return instance, parse_prefill_answer(response.content, instance.url)
        except ProxyError as exc:
            self.metrics.upstream_errors.labels(instance.role, instance.url, "bad_answer").inc()
            instance.last_error = exc.message
            raise

    async def _post_decode(self, route: str, content: bytes, request_id: str,
                           avoid: Collection[str] = (), prompt: Prompt | None = None
                           ) -> tuple[Instance, Answer]:
        return await self._with_failover(
            "decode", lambda i: self._fetch(i, "POST", route, request_id, content), avoid,
            prompt)

    async def _open_decode(self, route: str, content: bytes, request_id: str,
                           avoid: Collection[str] = (), prompt: Prompt | None = None
                           ) -> tuple[Instance, OpenStream]:
        return await self._with_failover(
            "decode", lambda i: self._open(i, route, request_id, content), avoid, prompt)

    async def _decode_json(self, route: str, content: bytes, request_id: str,
                           avoid: Collection[str], prompt: Prompt | None,
                           answered: Callable[[Instance], None]) -> Response:
        """``answered(decode)`` once the decode answered 200."""
        decode, response = await self._post_decode(route, content, request_id, avoid, prompt)
        if response.status == 200:
            answered(decode)
        return passthrough(response)

    async def _decode_stream(self, route: str, content: bytes, request_id: str,
                             avoid: Collection[str], prompt: Prompt | None,
                             answered: Callable[[Instance], None]) -> Response:
        """``answered(decode)`` once the decode's 200 stream ended."""
        instance, stream = await self._open_decode(route, content, request_id, avoid, prompt)
        return self._relay(route, request_id, instance, stream,
                           answered if stream.status == 200 else None)

    def _relay(self, route: str, request_id: str, instance: Instance,
               stream: OpenStream, ended: Callable[[Instance], None] | None = None
               ) -> Response:
        """The client's answer: ``stream`` from ``instance``, chunk by chunk; ``ended``
        called with ``instance`` when it is over."""
        async def close() -> None:
            self.balancer.release(instance)
            await stream.aclose()
            if ended is not None:
                ended(instance)

        def on_disconnect() -> None:
            self.metrics.client_disconnects.labels(route).inc()
            log.info("client left request %s; closed the stream from %s", request_id,
                     instance.url)

        return RelayResponse(stream.chunks(), close, on_disconnect, stream.status,
                             stream.media_type)

    async def _fetch(self, instance: Instance, method: str, path: str, request_id: str,
                     content: bytes | None = None, tokens: int = 0) -> Answer:
        """One call; ``tokens``: the prompt tokens it has ``instance`` compute (its load)."""
        with self.balancer.busy(instance, tokens):
            return await self.upstream.fetch(instance, method, path, request_id, content)

    async def _open(self, instance: Instance, path: str, request_id: str,
                    content: bytes) -> OpenStream:
        """Open a stream and keep ``instance`` counted busy; the relay releases it."""
        self.balancer.acquire(instance)
        try:
            return await self.upstream.open_stream(instance, path, request_id, content)
        except BaseException:
            self.balancer.release(instance)
            raise

    async def _with_failover(self, role: str, call: Callable[[Instance], Awaitable[T]],
                             avoid: Collection[str] = (), prompt: Prompt | None = None
                             ) -> tuple[Instance, T]:
        """``call`` on the first candidate of ``role`` for ``prompt`` that can be connected
        to (those in ``avoid`` last)."""
        for instance in self.balancer.candidates(role, avoid, prompt):
            try:
                return instance, await call(instance)
            except Unreachable as exc:  # a Draining instance too: nothing was started
                self.balancer.mark_down(instance, exc.reason)
                log.warning("%s instance %s is %s; marked down, trying the next", role,
                            instance.url, exc.reason if isinstance(exc, Draining)
                            else f"unreachable ({exc.reason})")
        raise self._unavailable(role)


def worth_retrying(exc: UpstreamFailed) -> bool:
    """Whether a request whose call failed with ``exc`` runs again: any failure but a
    decode's timeout (a decode that is slow, not broken, would only be asked twice and
    the client wait twice as long)."""
    return not (exc.role == "decode" and exc.status == 504)


def passthrough(answer: Answer) -> Response:
    """The upstream's answer, body and status unchanged."""
    return Response(answer.content, answer.status, media_type=answer.content_type)


def _tokens(prompt: Prompt | None) -> int:
    return 0 if prompt is None else len(prompt.token_ids)


def released(content: bytes) -> bool:
    """Whether a ``/v1/kv/release`` answer says the lease was released."""
    try:
        return msgspec.json.decode(content).get("released") is True
    except (msgspec.DecodeError, AttributeError):
        return False
