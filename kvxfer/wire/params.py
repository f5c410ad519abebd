"""``RemoteParams``: the ``kv_transfer_params`` a decode request carries, decoded strictly.

Pure: msgspec and the standard library, no I/O. :meth:`RemoteParams.parse` is the one way in
from a client's JSON; unknown keys are ignored, and a bad value raises
:class:`RemoteParamsError` (a ``ValueError`` whose message starts ``kv_transfer_params.<key>``).

Design: docs/design/leases.md#the-params-a-decode-request-carries
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvxfer.net.hosts import endpoint
from kvxfer.wire.tickets import TICKET_KEY, LeaseClaims

MAX_BLOCK_ID = 2**63  # exclusive: block ids are int64 on the wire and in descriptors

_Name = Annotated[str, Meta(min_length=1)]
_Port = Annotated[int, Meta(ge=1, le=65535)]
_Positive = Annotated[int, Meta(ge=1)]
_BlockId = Annotated[int, Meta(ge=0, le=MAX_BLOCK_ID - 1)]
_MAX_TOP = 20  # the most alternatives a request may ask for (the sampler's MAX_LOGPROBS)


class RemoteParamsError(ValueError):
    """``kv_transfer_params`` that do not decode; ``key`` names the offending one ("" when
    the params are not an object at all)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class FirstToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The first output token the prefill sampled, as ``kv_transfer_params.first_token``:
    its ``id``, its ``logprob`` and, when the request asked for log-probabilities, its
    ``top`` alternatives as ``[id, logprob]`` pairs, most likely first (what the prefill's
    sampler reported). A decode that takes it answers it at once and continues from it,
    instead of computing the last prompt token again to sample it.

    Not signed with the lease: it can only change the answer of whoever holds the params,
    never which KV is read. The decode checks the ids against its vocabulary and the
    number of alternatives against the request (:mod:`kvxfer.sidecar.openai_api.kv_params`).
    """

    id: Annotated[int, Meta(ge=0)]
    logprob: Annotated[float, Meta(le=0.0)]
    top: Annotated[tuple[tuple[Annotated[int, Meta(ge=0)], Annotated[float, Meta(le=0.0)]],
                         ...], Meta(max_length=_MAX_TOP)] = ()


class RemoteParams(msgspec.Struct, frozen=True):
    """The vLLM-compatible ``kv_transfer_params`` a decode request carries: which prefill
    engine leased which of its blocks, and where its side channel listens."""

    remote_engine_id: _Name
    remote_host: _Name
    remote_port: _Port
    remote_block_ids: tuple[_BlockId, ...]  # logical blocks at the prefill's block size
    remote_request_id: _Name  # the lease id
    tp_size: _Positive
    # Optional for vLLM compatibility; a kvxfer decode refuses a lease without an expiry.
    remote_num_tokens: int | None = None
    lease_expires_at: float | None = None  # seconds since the epoch, the prefill's clock
    lease_ticket: str | None = None
    # The prefill's block size; absent (vLLM's params): the decode's own.
    remote_block_size: _Positive | None = None
    # Each prefill rank's side-channel port, where its ranks listen apart (a vLLM instance
    # runs a process per rank); absent: every rank answers at remote_port.
    remote_rank_ports: tuple[_Port, ...] | None = None
    # The prefill's sampled first token; absent (vLLM's params, or n > 1): recomputed.
    first_token: FirstToken | None = None

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> RemoteParams:
        """Decode a client's ``kv_transfer_params``; :class:`RemoteParamsError` names the
        offending key."""
        if not isinstance(params, Mapping):
            raise RemoteParamsError("", f"kv_transfer_params must be an object, got "
                                        f"{type(params).__name__}")
        try:
            remote = msgspec.convert(params, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise _refusal(params, str(exc)) from None
        ports = remote.remote_rank_ports
        if ports is not None and (len(ports) != remote.tp_size or ports[0] != remote.remote_port):
            raise RemoteParamsError("remote_rank_ports", f"kv_transfer_params.remote_rank_ports "
                                    f"must name one port per prefill rank ({remote.tp_size}), "
                                    f"rank 0's being remote_port ({remote.remote_port}); got "
                                    f"{list(ports)}")
        ids = remote.remote_block_ids
        if len(set(ids)) != len(ids):
            raise RemoteParamsError("remote_block_ids", "kv_transfer_params.remote_block_ids "
                                    "repeats a block id; each block of a prompt is a "
                                    "different block")
        return remote

    def claims(self) -> LeaseClaims:
        """What the lease ticket must bind; ValueError when the params lack an expiry."""
        if self.lease_expires_at is None:
            raise ValueError("kv_transfer_params.lease_expires_at is missing: a decode only "
                             "reads a lease whose end it knows")
        return LeaseClaims(self.remote_engine_id, self.remote_host, self.remote_port,
                           self.remote_request_id, self.remote_block_ids,
                           -1 if self.remote_num_tokens is None else self.remote_num_tokens,
                           self.tp_size, self.lease_expires_at, self.remote_rank_ports or ())

    @property
    def address(self) -> str:
        """The prefill's side channel (rank 0's), ``tcp://host:port``."""
        return endpoint(self.remote_host, self.remote_port)

    def side_channels(self, ranks: Sequence[int] | None = None) -> dict[int, tuple[int, ...]]:
        """The side-channel ports that serve prefill ``ranks`` (all: None), each with the
        ranks it serves, in rank order: a lease is claimed and released at every one."""
        ranks = range(self.tp_size) if ranks is None else sorted(ranks)
        served: dict[int, tuple[int, ...]] = {}
        for rank in ranks:
            port = self.remote_port if self.remote_rank_ports is None \
                else self.remote_rank_ports[rank]
            served[port] = (*served.get(port, ()), rank)
        return served

    def tokens(self, start: int, end: int, local_block_size: int) -> RemoteParams:
        """These params narrowed to the prefill blocks that hold the prompt's tokens
        ``[start, end)`` (a decode's prefix-cache hit skips the first ``start``; the
        prefill's block size may differ from the decode's ``local_block_size``); ValueError
        when ``start`` falls inside a prefill block or the lease holds too few blocks."""
        size = self.remote_block_size or local_block_size
        if start % size:
            raise ValueError(f"the decode holds the first {start} tokens, which end inside "
                             f"a {size}-token block of the prefill; a READ starts at a "
                             f"prefill block")
        first, last = start // size, -(-end // size)
        if last > len(self.remote_block_ids):
            raise ValueError(f"the prefill leased {len(self.remote_block_ids)} blocks of "
                             f"{size} tokens, but the prompt's first {end} tokens need {last}: "
                             f"the two instances disagree on the prompt or the block size")
        return msgspec.structs.replace(self, remote_block_ids=self.remote_block_ids[first:last])


assert TICKET_KEY in RemoteParams.__struct_fields__  # the ticket travels under its own key

# What a key's value must be, in the words of an error about its type.
_KINDS = {"remote_engine_id": "str", "remote_host": "str", "remote_request_id": "str",
          "remote_port": "int", "tp_size": "int", "remote_num_tokens": "int",
          TICKET_KEY: "str", "remote_block_ids": "a list of integers",
          "lease_expires_at": "a number of seconds since the epoch",
          "remote_block_size": "a positive integer",
          "remote_rank_ports": "a list of TCP ports",
          "first_token": 'an object {"id": int, "logprob": number <= 0, "top": '
                         '[[id, logprob], ...] of at most 20 pairs}'}
# What a key's value must be, in the words of an error about its bound.
_BOUNDS = {"remote_engine_id": "is empty", "remote_host": "is empty",
           "remote_request_id": "is empty", "remote_port": "{value} is not a TCP port",
           "tp_size": "must be positive, got {value}"}
# What an item of a list key must be, in the words of an error about its bound.
_ITEM_BOUNDS = {"remote_block_ids": "outside [0, 2**63)",
                "remote_rank_ports": "which is not a TCP port"}
_PATH = re.compile(r" - at `\$\.(\w+)(?:\[(\d+)\])?`$")
_NESTED = re.compile(r" - at `\$\.first_token[.\[`]")
_MISSING = re.compile(r"^Object missing required field `(\w+)`")
_TYPE = re.compile(r"^Expected `[^`]*`, got `")  # msgspec: a type error, not a bound


def _refusal(params: Mapping[str, Any], error: str) -> RemoteParamsError:
    """msgspec's validation ``error`` about ``params``, in the words of the key it names."""
    if _NESTED.search(error):  # inside first_token, the one object-valued key
        return RemoteParamsError("first_token", f"kv_transfer_params.first_token must be "
                                                f"{_KINDS['first_token']}: {error}")
    missing = _MISSING.match(error)
    if missing:
        key = missing.group(1)
        return RemoteParamsError(key, f"kv_transfer_params.{key} is missing")
    at = _PATH.search(error)
    if at is None:  # not at a key: the params themselves
        return RemoteParamsError("", f"kv_transfer_params: {error}")
    key, index = at.group(1), at.group(2)
    value, wrong_type = params[key], _TYPE.match(error) is not None
    say = f"kv_transfer_params.{key}"
    if index is not None:  # one block id or port
        item = value[int(index)]
        return RemoteParamsError(key, f"{say} must be {_KINDS[key]}, got {item!r} at "
                                      f"position {index}" if wrong_type else
                                      f"{say} holds {item}, {_ITEM_BOUNDS[key]}")
    if wrong_type or key not in _BOUNDS:
        return RemoteParamsError(key, f"{say} must be {_KINDS[key]}, got {value!r}")
    return RemoteParamsError(key, f"{say} {_BOUNDS[key].format(value=value)}")
