"""``RemoteParams`` (:mod:`kvxfer.wire.params`): a client's ``kv_transfer_params``, decoded
strictly, every refusal naming its key (the HTTP layer answers it with a 400)."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from kvxfer.wire.params import RemoteParams, RemoteParamsError

PARAMS: dict[str, Any] = {
    "do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
    "remote_port": 5600, "remote_block_ids": [4, 2, 9], "remote_request_id": "r@1",
    "tp_size": 2, "remote_num_tokens": 40, "lease_expires_at": 1700000000,
    "lease_ticket": "kvxt1.abc", "remote_block_size": 16, "some_future_key": {"x": 1}}


def test_params_decode_into_the_struct_ignoring_keys_they_do_not_know() -> None:
    remote = RemoteParams.parse(PARAMS)
    assert remote == RemoteParams("p", "127.0.0.1", 5600, (4, 2, 9), "r@1", 2, 40,
                                  1700000000.0, "kvxt1.abc", 16)
    assert isinstance(remote.lease_expires_at, float) and remote.address == "tcp://127.0.0.1:5600"
    assert RemoteParams.parse(msgspec.json.decode(msgspec.json.encode(remote))) == remote
    bare = {k: PARAMS[k] for k in ("remote_engine_id", "remote_host", "remote_port",
                                   "remote_block_ids", "remote_request_id", "tp_size")}
    assert RemoteParams.parse(bare).lease_ticket is None  # vLLM's own keys suffice
    with pytest.raises(AttributeError):
        remote.tp_size = 1  # type: ignore[misc]


@pytest.mark.parametrize(("key", "value", "says"), [
    ("remote_engine_id", None, "kv_transfer_params.remote_engine_id must be str, got None"),
    ("remote_host", "", "kv_transfer_params.remote_host is empty"),
    ("remote_port", "5600", "kv_transfer_params.remote_port must be int, got '5600'"),
    ("remote_port", True, "kv_transfer_params.remote_port must be int, got True"),
    ("remote_port", 0, "kv_transfer_params.remote_port 0 is not a TCP port"),
    ("tp_size", 0, "kv_transfer_params.tp_size must be positive, got 0"),
    ("tp_size", 2.0, "kv_transfer_params.tp_size must be int, got 2.0"),
    ("remote_block_ids", "0,1", "kv_transfer_params.remote_block_ids must be a list of "
                                "integers, got '0,1'"),
    ("remote_block_ids", [0, False], "kv_transfer_params.remote_block_ids must be a list of "
                                     "integers, got False at position 1"),
    ("remote_block_ids", [0, 2**63], "kv_transfer_params.remote_block_ids holds "
                                     "9223372036854775808, outside [0, 2**63)"),
    ("remote_block_ids", [1, 0, 1], "kv_transfer_params.remote_block_ids repeats a block id"),
    ("remote_num_tokens", "40", "kv_transfer_params.remote_num_tokens must be int, got '40'"),
    ("lease_expires_at", False, "kv_transfer_params.lease_expires_at must be a number of "
                                "seconds since the epoch, got False"),
    ("lease_ticket", 7, "kv_transfer_params.lease_ticket must be str, got 7"),
    ("remote_block_size", -16, "kv_transfer_params.remote_block_size must be a positive "
                               "integer, got -16"),
    ("remote_rank_ports", 5600, "kv_transfer_params.remote_rank_ports must be a list of TCP "
                                "ports, got 5600"),
    ("remote_rank_ports", [5600, 0], "kv_transfer_params.remote_rank_ports holds 0, which is "
                                     "not a TCP port"),
    ("remote_rank_ports", [5600], "kv_transfer_params.remote_rank_ports must name one port "
                                  "per prefill rank (2), rank 0's being remote_port (5600); "
                                  "got [5600]"),
    ("remote_rank_ports", [5601, 5600], "kv_transfer_params.remote_rank_ports must name one "
                                        "port per prefill rank"),
])
def test_a_bad_value_is_refused_naming_its_key(key: str, value: Any, says: str) -> None:
    with pytest.raises(RemoteParamsError, match="^" + re.escape(says)) as caught:
        RemoteParams.parse({**PARAMS, key: value})
    assert caught.value.key == key and isinstance(caught.value, ValueError)


def test_a_missing_key_or_a_non_object_is_refused() -> None:
    with pytest.raises(RemoteParamsError, match=r"^kv_transfer_params\.tp_size is missing$"):
        RemoteParams.parse({k: v for k, v in PARAMS.items() if k != "tp_size"})
    with pytest.raises(RemoteParamsError, match="must be an object, got list"):
        RemoteParams.parse([PARAMS])  # type: ignore[arg-type]


def test_side_channels_name_each_port_with_the_ranks_it_serves() -> None:
    one = RemoteParams.parse(PARAMS)
    assert one.side_channels() == {5600: (0, 1)} and one.side_channels([1]) == {5600: (1,)}
    apart = RemoteParams.parse({**PARAMS, "remote_rank_ports": [5600, 5700]})
    assert apart.remote_rank_ports == (5600, 5700) and apart.address == "tcp://127.0.0.1:5600"
    assert apart.side_channels() == {5600: (0,), 5700: (1,)}
    assert apart.side_channels([1]) == {5700: (1,)}
    assert apart.claims().rank_ports == (5600, 5700) and one.claims().rank_ports == ()
