"""KvxferConnector's pure parts (no vLLM): its settings, its scheduler side, and the
contracts around them (the proxy relaying vLLM's ``kv_transfer_params``, the handshake
refusing peers whose K/V packing differs)."""

from __future__ import annotations

import importlib
import math
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_handshake import ANSWER_S, COMPAT, HOST, RANKS

from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.listener import SideChannelListener
from kvxfer.transfer.transfer_config import TransferConfig
from kvxfer.vllm.extra_config import ConnectorSettings, SettingsError
from kvxfer.vllm.scheduler_side import BlockRef, SchedulerSide
from kvxfer.vllm.step_plan import Hold, Load, StepPlan
from kvxfer.wire.tickets import TICKET_KEY, LeaseClaims, TicketError, verify_ticket
from proxy.contract import parse_prefill_answer
from proxy.errors import ProxyError

URL = "http://127.0.0.1:9"
ENGINE = "prefill-engine"
BLOCK = 16
TTL = 30.0
NOW = 1_000.0
KEY = b"k" * 32
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}  # what the proxy sends


# -- the package ------------------------------------------------------------------------------

def test_the_package_loads_the_connector_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's loader does ``getattr(import_module("kvxfer.vllm"), "KvxferConnector")``; the
    pure submodules above imported without vLLM (it is not installed here)."""
    fake = types.ModuleType("kvxfer.vllm.connector")
    fake.KvxferConnector = type("KvxferConnector", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvxfer.vllm.connector", fake)
    package = importlib.import_module("kvxfer.vllm")
    assert getattr(package, "KvxferConnector") is fake.KvxferConnector  # noqa: B009
    with pytest.raises(AttributeError, match="has no attribute 'Connector'"):
        getattr(package, "Connector")  # noqa: B009


# -- settings ---------------------------------------------------------------------------------

KEY_FILE = "<a key file the test writes>"  # kv_key_file's good value (the file is read)
GOOD: dict[str, Any] = {
    "side_channel_host": "0.0.0.0", "side_channel_port": 5600, "advertise_host": "10.0.0.2",
    "lease_ttl": 30, "lease_max_age": 600.5, "kv_read_timeout": 2.5, "handshake_timeout": 1,
    "read_wait": 0.2, "read_lanes": 4, "host_reads": False,
    "kv_key_file": KEY_FILE, "model_id": "llama-3-8b", "span_probe": True}
SECONDS = ("lease_ttl", "lease_max_age", "kv_read_timeout", "handshake_timeout", "read_wait")
OWN = ("read_wait", "model_id", "span_probe")  # KvxferConnector's keys; the rest: the config's


@pytest.fixture
def good(tmp_path: Path) -> dict[str, Any]:
    """GOOD, its ``kv_key_file`` a real key file (mode 600) holding ``KEY``."""
    path = tmp_path / "kv.key"
    path.write_bytes(KEY)
    path.chmod(0o600)
    return {**GOOD, "kv_key_file": str(path)}


def setting(settings: ConnectorSettings, key: str) -> Any:
    """What ``settings`` say for extra-config key ``key`` (the key file: the key it holds)."""
    if key in OWN:
        return getattr(settings, key)
    return settings.transfer.kv_key if key == "kv_key_file" else getattr(settings.transfer, key)


def given(extra: dict[str, Any], key: str) -> Any:
    """What extra-config key ``key`` says (the key file: the key written there)."""
    return KEY if key == "kv_key_file" else extra[key]


def test_settings_defaults() -> None:
    settings = ConnectorSettings.from_extra_config(None)
    assert settings == ConnectorSettings.from_extra_config({}) == ConnectorSettings(
        TransferConfig(side_channel_host="127.0.0.1", side_channel_port=0, advertise_host=None,
                       lease_ttl=120.0, lease_max_age=None, kv_read_timeout=10.0,
                       handshake_timeout=None, read_lanes=None, host_reads=True, kv_key=None),
        read_wait=0.05, model_id=None, span_probe=False)
    # a handshake attempt of 5 s and one copy thread unless set, as before the unset values
    assert settings.transfer.handshake_attempt_s == 5.0 and settings.lanes == 1
    assert settings.transfer.max_age == 480.0
    assert settings.transfer.advertised == "127.0.0.1"


@pytest.mark.parametrize("key", list(GOOD))
def test_settings_accept_each_key(good: dict[str, Any], key: str) -> None:
    settings = ConnectorSettings.from_extra_config({key: good[key]})
    assert setting(settings, key) == given(good, key)
    if key in SECONDS:
        assert type(setting(settings, key)) is float
    others = {name: setting(settings, name) for name in GOOD if name != key}
    assert others == {name: setting(ConnectorSettings(), name) for name in GOOD if name != key}


def test_settings_accept_every_key_together(good: dict[str, Any]) -> None:
    settings = ConnectorSettings.from_extra_config(good)
    assert {name: setting(settings, name) for name in GOOD} == \
        {name: given(good, name) for name in GOOD}
    assert settings.transfer.max_age == 600.5
    assert settings.transfer.advertised == "10.0.0.2"


@pytest.mark.parametrize(("extra", "max_age"), [
    ({"read_wait": 0}, 480.0),  # 0: a step never waits
    ({"lease_max_age": None}, 480.0),
    ({"lease_ttl": 10, "lease_max_age": 10}, 10.0),  # equal to the ttl is enough
    ({"lease_ttl": 10}, 40.0),
])
def test_settings_edge_values(extra: dict[str, Any], max_age: float) -> None:
    settings = ConnectorSettings.from_extra_config(extra)
    assert settings.transfer.max_age == max_age
    if "read_wait" in extra:
        assert settings.read_wait == 0.0


def test_settings_take_null_as_the_default_of_an_optional_key() -> None:
    """The config's optional fields: null is what leaving the key out says."""
    extra = {"lease_max_age": None, "handshake_timeout": None, "read_lanes": None,
             "advertise_host": None, "kv_key_file": None, "model_id": None}
    assert ConnectorSettings.from_extra_config(extra) == ConnectorSettings()
    settings = ConnectorSettings.from_extra_config(extra)
    assert settings.transfer.handshake_attempt_s == 5.0 and settings.lanes == 1


@pytest.mark.parametrize(("key", "value"), [
    *[(key, bad) for key in ("side_channel_host", "advertise_host", "kv_key_file", "model_id")
      for bad in ("", 5, ["h"])],
    ("kv_key_file", "/no/such/key/file"),  # a path, but no key there
    ("side_channel_host", None),  # not optional
    *[("side_channel_port", bad) for bad in (-1, 65536, "5600", 5600.0, True, None)],
    *[("read_lanes", bad) for bad in (0, -2, 1.5, "2", True)],
    *[(key, bad) for key in ("host_reads", "span_probe") for bad in (0, 1, "true", None)],
    *[(key, bad) for key in SECONDS
      for bad in (-1, -0.5, math.inf, -math.inf, math.nan, "10", [1], True, False)],
    *[(key, 0) for key in SECONDS if key != "read_wait"],
    # null means "the default" for the optional ones: the max age, one handshake attempt
    *[(key, None) for key in SECONDS if key not in ("lease_max_age", "handshake_timeout")],
])
def test_settings_refuse_bad_values_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(SettingsError, match=re.escape(f"kv_connector_extra_config.{key}: ")):
        ConnectorSettings.from_extra_config({key: value})


@pytest.mark.parametrize("extra", [
    {"lease_ttl": 60, "lease_max_age": 59.9},
    {"lease_max_age": 100},  # below the default ttl (120 s)
])
def test_settings_refuse_a_max_age_below_the_ttl(extra: dict[str, Any]) -> None:
    with pytest.raises(SettingsError, match=re.escape(
            "kv_connector_extra_config.lease_max_age: must be at least lease_ttl")):
        ConnectorSettings.from_extra_config(extra)


@pytest.mark.parametrize(("key", "value", "why"), [
    ("kv_transfer_mode", "push", "KvxferConnector reads by pull only"),
    ("kv_load_failure_policy", "fail", "set kv_load_failure_policy in --kv-transfer-config"),
])
def test_settings_refuse_what_the_connector_does_not_honour(key: str, value: str,
                                                            why: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(
            f"kv_connector_extra_config.{key}: ") + ".*" + re.escape(why)):
        ConnectorSettings.from_extra_config({key: value})


def test_settings_ignore_other_connectors_keys() -> None:
    extra = {"backends": ["UCX"], "enforce_handshake_compat": "yes", "lease_ttl": 7,
             "side_channel_prt": object()}
    assert ConnectorSettings.from_extra_config(extra) == ConnectorSettings(
        TransferConfig(lease_ttl=7.0))


# -- scheduler: helpers -----------------------------------------------------------------------

def scheduler(key: bytes | None = None, port: int | None = 7100, tp_size: int = 2,
              **extra: Any) -> SchedulerSide:
    settings = ConnectorSettings.from_extra_config(
        {"side_channel_host": "10.0.0.1", "lease_ttl": TTL, **extra})
    side = SchedulerSide(settings.transfer.with_changes(kv_key=key), ENGINE, BLOCK, tp_size)
    if port is not None:
        side.set_side_channel_ports({rank: port + rank for rank in range(tp_size)})
    return side


def blocks_of(allocations: dict[str, list[int]]) -> Any:
    return lambda request_id: allocations[request_id]


def refs(ids: list[int], cached: int) -> list[BlockRef]:
    return [BlockRef(block_id, i < cached) for i, block_id in enumerate(ids)]


def prefill(side: SchedulerSide, request_id: str = "p1", prompt: int = 40,
            block_ids: list[int] | None = None) -> tuple[Hold, dict[str, Any]]:
    """A prefill request computed in one step: its Hold and its (mutable) params."""
    params = dict(PREFILL)
    ids = [7, 3, 9, 11, 12] if block_ids is None else block_ids
    side.after_alloc(request_id, params, prompt, refs(ids, 0), 0)
    plan = side.build_plan({request_id: (0, prompt)}, blocks_of({request_id: ids}), now=NOW)
    assert len(plan.holds) == 1
    return plan.holds[0], params


def claims_of(params: dict[str, Any]) -> LeaseClaims:
    return LeaseClaims(params["remote_engine_id"], params["remote_host"],
                       params["remote_port"], params["remote_request_id"],
                       tuple(params["remote_block_ids"]), params["remote_num_tokens"],
                       params["tp_size"], params["lease_expires_at"],
                       tuple(params.get("remote_rank_ports", ())))


def answer(params: dict[str, Any]) -> bytes:
    """A prefill's HTTP answer carrying ``params`` (as the OpenAI server encodes it)."""
    return msgspec.json.encode({"choices": [{"text": "x"}], "kv_transfer_params": params})


# -- scheduler: matched tokens (decode) -------------------------------------------------------

@pytest.mark.parametrize(("params", "prompt", "computed", "expected"), [
    (None, 100, 0, (0, False)),
    ({}, 100, 0, (0, False)),
    (PREFILL, 100, 0, (0, False)),
    ({"do_remote_prefill": False, "remote_num_tokens": 100}, 100, 0, (0, False)),
    ({"do_remote_prefill": True}, 100, 0, (100, True)),
    ({"do_remote_prefill": True}, 100, 32, (68, True)),
    ({"do_remote_prefill": True, "remote_num_tokens": 100}, 100, 16, (84, True)),
    ({"do_remote_prefill": True, "remote_num_tokens": 40}, 100, 16, (24, True)),  # capped
    ({"do_remote_prefill": True, "remote_num_tokens": 500}, 100, 16, (84, True)),
    *[({"do_remote_prefill": True, "remote_num_tokens": bad}, 100, 16, (84, True))
      for bad in (True, False, "40", 40.0, None, [40], 0, -5)],  # ignored
    ({"do_remote_prefill": True, "remote_num_tokens": 16}, 100, 16, (0, False)),
    ({"do_remote_prefill": True, "remote_num_tokens": 10}, 100, 16, (0, False)),
    ({"do_remote_prefill": True}, 100, 100, (0, False)),
])
def test_matched_tokens(params: dict[str, Any] | None, prompt: int, computed: int,
                        expected: tuple[int, bool]) -> None:
    assert SchedulerSide.matched_tokens(params, prompt, computed) == expected


# -- scheduler: prefill -----------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [
    [(0, 40)],
    [(0, 16), (16, 16), (32, 8)],
    [(0, 39), (39, 1)],
    [(0, 32), None, (32, 8)],  # None: a step that does not schedule the request
])
def test_prefill_holds_once_the_chunk_reaching_the_prompt_end_is_scheduled(
        chunks: list[tuple[int, int] | None]) -> None:
    side = scheduler()
    ids = {"p1": [7, 3, 9, 11, 12], "other": [1]}  # more blocks than the prompt's 3
    side.after_alloc("p1", dict(PREFILL), 40, refs(ids["p1"], 0), 0)
    for step, chunk in enumerate(chunks[:-1]):
        scheduled = {"other": (step, 1)} if chunk is None else {"p1": chunk, "other": (step, 1)}
        assert side.build_plan(scheduled, blocks_of(ids), now=NOW) == StepPlan()
    last = chunks[-1]
    assert last is not None
    plan = side.build_plan({"p1": last}, blocks_of(ids), now=NOW + 1)
    assert plan.loads == [] and plan.drop_leases == []
    [hold] = plan.holds
    assert hold == Hold("p1", hold.lease_id, (7, 3, 9), 40, NOW + 1 + TTL)
    assert len(hold.lease_id) >= 16
    # Later steps (the request's own decode token, and after) hold nothing more.
    assert not side.build_plan({"p1": (40, 1)}, blocks_of(ids), now=NOW + 2)
    assert not side.build_plan({"p1": (41, 1)}, blocks_of(ids), now=NOW + 3)


@pytest.mark.parametrize(("prompt", "kept"), [(1, 1), (16, 1), (17, 2), (48, 3), (49, 4)])
def test_prefill_hold_covers_ceil_prompt_over_block_size(prompt: int, kept: int) -> None:
    hold, _ = prefill(scheduler(), prompt=prompt, block_ids=[20, 21, 22, 23, 24, 25])
    assert hold.block_ids == (20, 21, 22, 23, 24, 25)[:kept]
    assert hold.num_tokens == prompt


def test_two_prefills_get_different_lease_ids() -> None:
    side = scheduler()
    ids = {"a": [1, 2, 3], "b": [4, 5, 6]}
    for request_id in ids:
        side.after_alloc(request_id, dict(PREFILL), 40, refs(ids[request_id], 0), 0)
    plan = side.build_plan({"a": (0, 40), "b": (0, 40)}, blocks_of(ids), now=NOW)
    assert {hold.request_id: hold.block_ids for hold in plan.holds} == {
        "a": (1, 2, 3), "b": (4, 5, 6)}
    assert plan.holds[0].lease_id != plan.holds[1].lease_id
    assert all(len(hold.lease_id) >= 16 for hold in plan.holds)


@pytest.mark.parametrize(("extra", "port", "host", "remote_port"), [
    ({}, 7100, "10.0.0.1", 7100),  # the bind host, the port the worker's listener bound
    ({"advertise_host": "prefill-0.svc"}, 7100, "prefill-0.svc", 7100),
    ({"side_channel_port": 5601}, None, "10.0.0.1", 5601),  # a fixed port: known at once
])
def test_prefill_finished_hands_out_the_lease(extra: dict[str, Any], port: int | None,
                                              host: str, remote_port: int) -> None:
    side = scheduler(port=port, **extra)
    hold, params = prefill(side)
    keep, handed = side.finished("p1", params, completed=True)
    assert keep is True
    assert handed == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": ENGINE,
        "remote_host": host, "remote_port": remote_port, "remote_block_ids": [7, 3, 9],
        "remote_request_id": hold.lease_id, "remote_num_tokens": 40,
        "remote_block_size": 16, "tp_size": 2, "lease_expires_at": NOW + TTL,
        "remote_rank_ports": [remote_port, remote_port + 1]}  # each rank listens apart
    # The proxy accepts it and forwards it unchanged: both ends of the contract agree.
    assert parse_prefill_answer(answer(handed), URL) == handed
    assert not side.build_plan({}, blocks_of({}), now=NOW)  # nothing dropped


def test_prefill_finished_with_a_key_signs_a_ticket() -> None:
    side = scheduler(key=KEY)
    hold, params = prefill(side)
    keep, handed = side.finished("p1", params, completed=True)
    assert keep is True and handed is not None
    assert handed["remote_request_id"] == hold.lease_id
    ticket = handed[TICKET_KEY]
    verify_ticket(KEY, claims_of(handed), ticket)
    with pytest.raises(TicketError, match="does not verify"):
        verify_ticket(b"another key", claims_of(handed), ticket)
    with pytest.raises(TicketError, match="does not verify"):  # an altered block list
        verify_ticket(KEY, claims_of({**handed, "remote_block_ids": [7, 3, 10]}), ticket)
    with pytest.raises(TicketError, match="does not verify"):  # a rank's port redirected
        verify_ticket(KEY, claims_of({**handed, "remote_rank_ports": [7100, 6666]}), ticket)
    relayed = parse_prefill_answer(answer(handed), URL)
    assert relayed == handed
    verify_ticket(KEY, claims_of(relayed), relayed[TICKET_KEY])  # survives the JSON trip


def test_prefill_aborted_after_its_hold_drops_the_lease_once() -> None:
    side = scheduler()
    hold, params = prefill(side)
    assert side.finished("p1", params, completed=False) == (False, None)
    assert side.build_plan({}, blocks_of({}), now=NOW) == StepPlan(drop_leases=[hold.lease_id])
    assert side.build_plan({}, blocks_of({}), now=NOW) == StepPlan()
    assert side.finished("p1", params, completed=True) == (False, None)  # nothing left


def test_prefill_without_a_side_channel_port_drops_the_lease() -> None:
    side = scheduler(port=None)
    hold, params = prefill(side)
    assert side.finished("p1", params, completed=True) == (False, None)
    assert side.build_plan({}, blocks_of({}), now=NOW).drop_leases == [hold.lease_id]


@pytest.mark.parametrize("completed", [True, False])
def test_prefill_finished_before_its_prompt_was_computed(completed: bool) -> None:
    side = scheduler()
    params = dict(PREFILL)
    ids = {"p1": [7, 3, 9]}
    side.after_alloc("p1", params, 40, refs(ids["p1"], 0), 0)
    assert side.build_plan({"p1": (0, 16)}, blocks_of(ids), now=NOW) == StepPlan()
    assert side.finished("p1", params, completed=completed) == (False, None)
    assert side.build_plan({}, blocks_of(ids), now=NOW) == StepPlan()  # nothing to drop
    # Forgotten: a stray later chunk holds nothing.
    assert side.build_plan({"p1": (16, 24)}, blocks_of(ids), now=NOW) == StepPlan()


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": False},
                                    {"do_remote_prefill": False, "do_remote_decode": False}])
def test_requests_without_a_transfer_are_left_alone(params: dict[str, Any] | None) -> None:
    side = scheduler()
    side.after_alloc("r", params, 40, refs([1, 2, 3], 0), 40)
    assert side.build_plan({"r": (0, 40)}, blocks_of({"r": [1, 2, 3]}), now=NOW) == StepPlan()
    assert side.finished("r", params, completed=True) == (False, None)
    assert side.build_plan({}, blocks_of({}), now=NOW) == StepPlan()


# -- scheduler: decode ------------------------------------------------------------------------

def decode_params(remote_num_tokens: int = 40) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": ENGINE,
            "remote_host": "10.0.0.1", "remote_port": 7100,
            "remote_block_ids": [30, 31, 32], "remote_request_id": "lease-0123456789abcdef",
            "remote_num_tokens": remote_num_tokens, "tp_size": 2,
            "lease_expires_at": NOW + TTL}


@pytest.mark.parametrize(("cached", "remote_tokens", "local"), [
    (0, 40, (5, 6, 8)),
    (1, 40, (6, 8)),      # the first block is a local prefix-cache hit
    (2, 40, (8,)),
    (0, 20, (5, 6)),      # the prefill computed fewer tokens than the prompt holds
    (1, 33, (6, 8)),
])
def test_decode_load_skips_cached_blocks_and_trims_to_the_external_tokens(
        cached: int, remote_tokens: int, local: tuple[int, ...]) -> None:
    side = scheduler()
    params = decode_params(remote_tokens)
    external, asynchronous = SchedulerSide.matched_tokens(params, 40, cached * BLOCK)
    assert asynchronous and external == remote_tokens - cached * BLOCK
    side.after_alloc("d1", params, 40, refs([5, 6, 8, 2, 4], cached), external)
    assert params["do_remote_prefill"] is False  # handled: once per request
    plan = side.build_plan({"d1": (cached * BLOCK, 0)}, blocks_of({}), now=NOW)
    assert plan.holds == [] and plan.drop_leases == []
    [load] = plan.loads
    assert load == Load("d1", {**decode_params(remote_tokens), "do_remote_prefill": False},
                        local, cached)
    assert load.params is not params
    # vLLM calls after_alloc again (the request is rescheduled once its KV arrived).
    side.after_alloc("d1", params, 40, refs([5, 6, 8, 2, 4], cached), external)
    assert side.build_plan({"d1": (40, 1)}, blocks_of({}), now=NOW) == StepPlan()
    assert side.finished("d1", params, completed=True) == (False, None)
    assert side.build_plan({}, blocks_of({}), now=NOW) == StepPlan()


def test_decode_with_nothing_to_read_only_releases_the_lease() -> None:
    side = scheduler()
    params = decode_params()
    side.after_alloc("d1", params, 40, refs([5, 6, 8], 2), 0)
    assert params["do_remote_prefill"] is False
    assert side.build_plan({}, blocks_of({}), now=NOW) == StepPlan(loads=[
        Load("d1", {**decode_params(), "do_remote_prefill": False}, ())])


def test_decode_finished_before_its_load_releases_the_lease() -> None:
    side = scheduler()
    params = decode_params()
    assert side.finished("d1", params, completed=False) == (False, None)
    assert params["do_remote_prefill"] is False
    assert side.build_plan({}, blocks_of({}), now=NOW) == StepPlan(loads=[
        Load("d1", {**decode_params(), "do_remote_prefill": False}, ())])
    assert side.finished("d1", params, completed=False) == (False, None)
    assert side.build_plan({}, blocks_of({}), now=NOW) == StepPlan()  # released once


# -- the proxy relays vLLM NixlConnector's params -------------------------------------------

VLLM_ANSWER: dict[str, Any] = {  # captured from vLLM 0.32
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
    "remote_engine_id": "2da672d8-5f47-4c84-8a79-5cccbafbe92f",
    "remote_request_id": "cmpl-82e4771eadf3362e-0-a081f893", "remote_host": "127.0.0.1",
    "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 5,
    "remote_blocks_expiry_time": None, "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0}


@pytest.mark.parametrize("expiry", [None, 1.7e9, 1700000000])
def test_nixl_connector_answer_is_forwarded_unchanged(expiry: float | None) -> None:
    sent = {**VLLM_ANSWER, "remote_blocks_expiry_time": expiry}
    relayed = parse_prefill_answer(answer(sent), URL)
    assert relayed == sent
    assert list(relayed) == list(sent)  # every key, in its order


@pytest.mark.parametrize("field", ["remote_blocks_expiry_time", "lease_expires_at"])
@pytest.mark.parametrize("value", ["soon", [1], {"at": 1}, True])
def test_a_non_number_expiry_is_a_bad_gateway_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ProxyError) as caught:
        parse_prefill_answer(answer({**VLLM_ANSWER, field: value}), URL)
    assert caught.value.status == 502
    assert f"prefill instance {URL} answered invalid kv_transfer_params" in caught.value.message
    assert f"at `$.{field}`" in caught.value.message


# -- a peer whose K/V packing differs is answered: the decode converts -----------------------

@pytest.fixture
def listener(request: pytest.FixtureRequest) -> Iterator[SideChannelListener]:
    compat = msgspec.structs.replace(COMPAT, kv_packing=request.param)
    ranks = [msgspec.structs.replace(r, kv_packing=request.param) for r in RANKS]
    with SideChannelListener(HOST, engine_id="prefill-a", compat=compat,
                           metadata=lambda: ranks) as served:
        yield served


@pytest.mark.parametrize(("listener", "here"),
                         [("token", "vllm-cpu-vec"), ("vllm-cpu-vec", "token")],
                         indirect=["listener"])
def test_a_peer_of_another_kv_packing_answers_with_its_packing(
        listener: SideChannelListener, here: str) -> None:
    peer = "vllm-cpu-vec" if here == "token" else "token"
    compat = msgspec.structs.replace(COMPAT, kv_packing=here)
    with SideChannelClient("decode-b", compat) as client:
        answer = client.fetch(HOST, listener.port, [0], timeout=ANSWER_S, retries=0)
    assert [meta.kv_packing for meta in answer.ranks] == [peer]


def test_huge_integer_seconds_are_refused() -> None:
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\.lease_ttl"):
        ConnectorSettings.from_extra_config({"lease_ttl": 10**400})


def test_a_prefill_computed_again_drops_its_earlier_lease() -> None:
    """vLLM may preempt a prefill after its Hold and compute it again: the first lease's
    blocks were freed, so it must end at once rather than at expiry."""
    side = SchedulerSide(TransferConfig(), "engine-p", 16, 1)
    side.after_alloc("r", {"do_remote_decode": True}, 20, [], 0)
    first = side.build_plan({"r": (0, 20)}, lambda _: [1, 2], now=100.0).holds[0]
    side.after_alloc("r", {"do_remote_decode": True}, 20, [], 0)
    plan = side.build_plan({"r": (0, 20)}, lambda _: [3, 4], now=101.0)
    assert plan.drop_leases == [first.lease_id]
    assert [h.block_ids for h in plan.holds] == [(3, 4)]


def test_side_channel_ports_must_come_from_every_tp_rank() -> None:
    side = scheduler(port=None, tp_size=3)
    with pytest.raises(ValueError, match=r"from TP ranks \[0, 2\], not from each of the 3"):
        side.set_side_channel_ports({0: 7100, 2: 7102})
    side.set_side_channel_ports({2: 7300, 0: 7100, 1: 7200})
    assert side.side_channel_ports == (7100, 7200, 7300)


def test_a_tp_1_prefill_names_no_rank_ports() -> None:
    side = scheduler(tp_size=1)
    _, params = prefill(side)
    _, handed = side.finished("p1", params, completed=True)
    assert handed is not None and "remote_rank_ports" not in handed
    assert handed["remote_port"] == 7100
