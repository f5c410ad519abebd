"""What a request's ``kv_transfer_params`` ask of this role: hold the prompt's blocks for a
decode (prefill), or read them from a prefill (decode); :func:`unread_lease` finds the
lease a refused decode request names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from kvxfer.sidecar.openai_api.error_body import bad_request
from kvxfer.sidecar.openai_api.prepared import ModelInfo
from kvxfer.sidecar.openai_api.request_bodies import CommonFields, is_int
from kvxfer.sidecar.request_kinds import PLAIN, Kind, LeaseOut, PullIn, PushIn, PushOut
from kvxfer.wire.reservations import RESERVATION_ID_KEY, RESERVATION_KEY

if TYPE_CHECKING:
    from kvxfer.engine import SamplingParams
    from kvxfer.wire.params import RemoteParams
    from kvxfer.wire.reservations import PushedParams, Reservation


def kv_intent(req: CommonFields, prompts: list[list[int]], params: SamplingParams,
              info: ModelInfo) -> Kind:
    """What this request asks of this role's transfers: a prefill's lease out (or push
    into the reservation its params bring), a decode's read of a prefill's lease (or,
    push mode, KV written into a reservation of this decode), else nothing."""
    kv = req.kv_transfer_params
    if kv is None:
        return PLAIN
    for key in ("do_remote_decode", "do_remote_prefill"):
        if kv.get(key) is not None and not isinstance(kv[key], bool):
            raise bad_request(f"kv_transfer_params.{key} must be true or false, got "
                              f"{kv[key]!r}", "kv_transfer_params")
    if info.role in ("prefill", "both") and kv.get("do_remote_decode") is True:
        if req.stream:
            raise bad_request("a prefill request (kv_transfer_params.do_remote_decode) cannot "
                              "be streamed", "stream")
        _one_prompt(prompts)
        if req.n is not None and req.n != 1:
            raise bad_request(f"a prefill request (kv_transfer_params.do_remote_decode) "
                              f"computes the prompt once: n must be 1, got {req.n}; the "
                              f"decode samples the n choices", "n")
        reservation = _reservation(kv)
        return LeaseOut() if reservation is None else PushOut(reservation)
    if info.role in ("decode", "both") and kv.get("do_remote_prefill") is True:
        _one_prompt(prompts)
        check_samples_fit(req.n or 1, len(prompts[0]), info)
        if RESERVATION_ID_KEY in kv:
            return PushIn(_first_token(_pushed(kv), req.n or 1, params, info))
        remote = _remote_params(kv, len(prompts[0]), info.block_size)
        return PullIn(_first_token(remote, req.n or 1, params, info))
    return PLAIN


def _reservation(kv: dict[str, Any]) -> Reservation | None:
    """The decode reservation a prefill request's KV is pushed into, if it names one."""
    from kvxfer.wire.reservations import ReservationError, parse_reservation

    if kv.get(RESERVATION_KEY) is None:
        return None
    try:
        return parse_reservation(kv[RESERVATION_KEY])
    except ReservationError as exc:
        raise bad_request(str(exc), "kv_transfer_params") from None


def _pushed(kv: dict[str, Any]) -> PushedParams:
    from kvxfer.wire.reservations import PushedParams, ReservationError

    try:
        return PushedParams.parse(kv)
    except ReservationError as exc:
        raise bad_request(str(exc), "kv_transfer_params") from None


P = TypeVar("P", "RemoteParams", "PushedParams")


def _first_token(remote: P, n: int, params: SamplingParams, info: ModelInfo) -> P:
    """``remote`` with the prefill's first token when this decode continues from it:
    dropped for ``n > 1`` (the prefill sampled one choice; the decode samples all ``n``,
    each from the last prompt token); a 400 for ids outside the vocabulary, or a number
    of top log-probabilities other than the request asks for (one instance would
    answer another number)."""
    first = remote.first_token
    if first is None:
        return remote
    if n > 1:
        return msgspec.structs.replace(remote, first_token=None)
    ids = [first.id, *(token for token, _ in first.top)]
    if not all(token < info.vocab_size for token in ids):
        raise bad_request(f"kv_transfer_params.first_token names token ids {ids}, not all in "
                          f"this model's vocabulary [0, {info.vocab_size})",
                          "kv_transfer_params")
    wanted = min(params.logprobs or 0, info.vocab_size)
    if len(first.top) != wanted:
        raise bad_request(f"kv_transfer_params.first_token has {len(first.top)} top "
                          f"log-probabilities but the request asks for {wanted}",
                          "kv_transfer_params")
    return remote


def check_samples_fit(n: int, num_tokens: int, info: ModelInfo) -> None:
    """A decode admits its ``n`` samples of one read together: their prompt blocks
    must fit in the cache at once, or the request would wait forever."""
    needed = n * -(-num_tokens // info.block_size)
    if info.num_blocks is not None and needed > info.num_blocks:
        raise bad_request(f"n={n} samples of a {num_tokens}-token prompt need {needed} KV "
                          f"blocks at once, but this decode instance has {info.num_blocks}",
                          "n")


def _one_prompt(prompts: list[list[int]]) -> None:
    if len(prompts) != 1:
        raise bad_request(f"kv_transfer_params needs exactly one prompt, got {len(prompts)}",
                          "prompt")


def _remote_params(kv: dict[str, Any], num_tokens: int, block_size: int) -> RemoteParams:
    from kvxfer.wire.params import RemoteParams

    try:
        remote = RemoteParams.parse(kv)
    except ValueError as exc:
        raise bad_request(str(exc), "kv_transfer_params") from None
    claimed = kv.get("remote_num_tokens")
    if not is_int(claimed):
        raise bad_request(f"kv_transfer_params.remote_num_tokens must be an integer, got "
                          f"{claimed!r}", "kv_transfer_params")
    if claimed != num_tokens:
        raise bad_request(f"kv_transfer_params.remote_num_tokens is {claimed} but this "
                          f"request's prompt has {num_tokens} tokens", "kv_transfer_params")
    remote_size = kv.get("remote_block_size")
    if remote_size is None:  # absent (vLLM's params): the same as this decode's
        remote_size = block_size
    if not is_int(remote_size) or remote_size <= 0:
        raise bad_request(f"kv_transfer_params.remote_block_size must be a positive integer, "
                          f"got {remote_size!r}", "kv_transfer_params")
    if max(remote_size, block_size) % min(remote_size, block_size):
        raise bad_request(f"kv_transfer_params.remote_block_size is {remote_size} but this "
                          f"decode's block size is {block_size}: one must be a multiple of "
                          f"the other", "kv_transfer_params")
    needed = -(-num_tokens // remote_size)
    if len(remote.remote_block_ids) != needed:
        raise bad_request(f"kv_transfer_params.remote_block_ids has "
                          f"{len(remote.remote_block_ids)} ids but a {num_tokens}-token prompt "
                          f"fills {needed} blocks of {remote_size} tokens", "kv_transfer_params")
    return remote


class _KvOnly(msgspec.Struct):
    """Just the ``kv_transfer_params`` of a body; every other field is ignored."""

    kv_transfer_params: dict[str, Any] | None = None


def unread_lease(raw: bytes, role: str) -> RemoteParams | None:
    """The prefill lease a refused decode request names, if its params are readable.

    For a decoding role only, and only when the body is a JSON object whose
    ``kv_transfer_params`` say ``do_remote_prefill: true`` and parse as
    :class:`~kvxfer.wire.params.RemoteParams`; None otherwise (nothing to release,
    or no side channel to release it over). The rest of the body is not
    looked at: it may be the very reason the request was refused.
    """
    from kvxfer.wire.params import RemoteParams

    if role not in ("decode", "both"):
        return None
    try:
        kv = msgspec.json.decode(raw, type=_KvOnly).kv_transfer_params
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if kv is None or kv.get("do_remote_prefill") is not True:
        return None
    try:
        return RemoteParams.parse(kv)
    except ValueError:
        return None
