"""The sidecars' HTTP contract as the proxy speaks it (pure: no I/O).

:func:`prefill_request`, :func:`decode_request` (the prefill's ``kv_transfer_params`` added
unchanged) and :func:`drain_request` (a decode call that only ends a lease). Client bodies
stay plain JSON objects; only the fields the contract touches are read.

Design: docs/design/proxy.md#the-sidecars-contract
"""

from __future__ import annotations

from typing import Any

import msgspec

from proxy.errors import bad_gateway, bad_request

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETION_ROUTES: tuple[str, ...] = (COMPLETIONS, CHAT_COMPLETIONS)

_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}


class RemotePrefillParams(msgspec.Struct, frozen=True):
    """``kv_transfer_params`` of a prefill answer: where the decode reads the KV from.

    Decoding into this type validates the prefill's answer; the proxy forwards
    the object exactly as received (fields added later by the sidecars pass too).
    Both kvxfer's sidecars and vLLM's connectors answer it: kvxfer names the
    lease's end ``lease_expires_at``, vLLM's NixlConnector
    ``remote_blocks_expiry_time``; either, both or neither may be present, since
    the proxy only relays them (the decode checks its own kind).
    """

    do_remote_prefill: bool
    do_remote_decode: bool
    remote_engine_id: str
    remote_host: str
    remote_port: int
    # One id list, or one list per KV cache group: the proxy never reads the ids.
    remote_block_ids: list[Any]
    remote_request_id: str
    remote_num_tokens: int
    tp_size: int
    # Seconds since the epoch, the prefill's clock: kvxfer's and vLLM's names.
    lease_expires_at: float | None = None
    remote_blocks_expiry_time: float | None = None


def json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def parse_client_body(raw: bytes) -> dict[str, Any]:
    """The client's JSON object; 400 for malformed or too deeply nested JSON, a
    non-object or a bad ``stream``."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's answer to JSON nested too deep
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {json_type(body)}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"'stream' must be true or false, got {stream!r}", "stream")
    return body


def wants_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True


def one_token(body: dict[str, Any]) -> bool:
    """Whether the client asks for one token (``max_completion_tokens``, else ``max_tokens``,
    is 1): the prefill's token is then the whole answer."""
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    return type(limit) is int and limit == 1


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill call's body: the client's, computing one token, not streamed."""
    prefill = dict(body)
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    if "n" in body:  # the decode samples the n choices; the prompt's KV is computed once
        prefill["n"] = 1
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return prefill


def reserve_request(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """Push mode: the decode call that reserves blocks for the client's prompt."""
    return {"endpoint": route, "body": {k: v for k, v in body.items()
                                        if k != "kv_transfer_params"}}


def parse_reservation(content: bytes, url: str) -> dict[str, Any]:
    """The ``kv_reservation`` object of a decode's 200 answer to a reserve call, as sent;
    a 502 naming ``url`` when there is none."""
    try:
        answer = msgspec.json.decode(content)
    except msgspec.DecodeError as exc:
        raise bad_gateway(f"decode instance {url} answered invalid JSON: {exc}") from None
    reservation = answer.get("kv_reservation") if isinstance(answer, dict) else None
    if not isinstance(reservation, dict) or not isinstance(reservation.get("reservation_id"),
                                                           str):
        raise bad_gateway(f"decode instance {url} answered a reserve call without a "
                          f"kv_reservation object (found {json_type(reservation)})")
    return reservation


RESERVATION_KEY = "kv_reservation"  # the kv_transfer_params key naming a reservation


def push_prefill_request(body: dict[str, Any], reservation: dict[str, Any]) -> dict[str, Any]:
    """Push mode: the prefill call, its KV written into ``reservation``."""
    prefill = prefill_request(body)
    prefill["kv_transfer_params"] = {**prefill["kv_transfer_params"],
                                     RESERVATION_KEY: reservation}
    return prefill


def parse_push_answer(content: bytes, url: str, reservation_id: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill's 200 answer in push mode: the reservation
    it writes into (the id must be the one sent) and its first token; a 502 otherwise."""
    try:
        answer = msgspec.json.decode(content)
    except msgspec.DecodeError as exc:
        raise bad_gateway(f"prefill instance {url} answered invalid JSON: {exc}") from None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or params.get("kv_reservation_id") != reservation_id:
        raise bad_gateway(f"prefill instance {url} did not take reservation "
                          f"{reservation_id} (its kv_transfer_params: {json_type(params)}; "
                          f"is it a kvxfer prefill?)")
    return params


def decode_request(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The decode call's body: the client's original plus the prefill's params."""
    return {**body, "kv_transfer_params": params}


def drain_request(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A decode call that reads a lease and computes one token nobody waits for."""
    drain = {**prefill_request(body), "kv_transfer_params": params}
    drain.pop("max_completion_tokens", None)
    return drain


def parse_prefill_answer(content: bytes, url: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` object of a prefill's 200 answer, as sent.

    Raises a 502 :class:`~proxy.errors.ProxyError` naming ``url`` and the
    offending field when the answer does not follow the contract.
    """
    try:
        answer = msgspec.json.decode(content)
    except msgspec.DecodeError as exc:
        raise bad_gateway(f"prefill instance {url} answered invalid JSON: {exc}") from None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        raise bad_gateway(f"prefill instance {url} answered without a kv_transfer_params object "
                          f"(found {json_type(params)})")
    try:
        checked = msgspec.convert(params, RemotePrefillParams)
    except msgspec.ValidationError as exc:
        raise bad_gateway(f"prefill instance {url} answered invalid kv_transfer_params: "
                          f"{exc}") from None
    if not checked.do_remote_prefill or checked.do_remote_decode:
        raise bad_gateway(f"prefill instance {url} answered kv_transfer_params with "
                          f"do_remote_prefill={checked.do_remote_prefill}, do_remote_decode="
                          f"{checked.do_remote_decode}; expected true and false")
    return params
