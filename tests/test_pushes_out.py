"""A push mode prefill hands each layer to its ranks as the engine finishes it.

The engine is the real reference engine; the transfer workers are stand-ins that record
the calls :class:`~kvxfer.sidecar.roles.pushes_out.PushesOut` makes (the WRITEs themselves
are proven in ``test_push.py``, the whole path between real sidecars in
``test_push_sidecars.py``).
"""

from __future__ import annotations

import time

import torch

from kvxfer.engine import LLMEngine, SamplingParams
from kvxfer.engine.model_config import tiny_config
from kvxfer.sidecar.roles.pushes_out import PushesOut
from kvxfer.wire.reservations import Reservation


class Recorder:
    """A rank's push calls, in order, and a copy of each handed layer's KV as it was when
    it was handed (what its WRITE would read)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[str, object]] = []
        self.blocks: list[int] = []
        self.handed: dict[int, torch.Tensor] = {}

    def start_push(self, lease_id: str, reservation: Reservation, block_ids: list[int],
                   _answers_at: tuple[str, int] = ("", 0)) -> None:
        self.calls.append(("start", list(block_ids)))
        self.blocks = list(block_ids)

    def push_layers(self, lease_id: str, layers: range) -> None:
        self.calls.append(("layers", layers))
        views = list(self.engine.kv_caches[0].values())
        for layer in layers:
            self.handed[layer] = views[layer][self.blocks].clone()

    def seal_push(self, lease_id: str, ok: bool = True) -> None:
        self.calls.append(("seal", ok))


def reservation(tokens: int) -> Reservation:
    return Reservation("resv", "decode-x", "127.0.0.1", 9, 1, tuple(range(-(-tokens // 4))), 4,
                       tokens, time.time() + 30)


def test_each_layer_is_handed_once_it_is_computed_then_the_push_is_sealed() -> None:
    engine = LLMEngine(tiny_config(), None, seed=1, block_size=4, num_blocks=32)
    worker = Recorder(engine)
    pushes = PushesOut([worker], None)  # type: ignore[list-item]
    engine.layer_hook = pushes.on_layer
    prompt = list(range(1, 11))
    engine.add_held_request("p", prompt, SamplingParams(max_tokens=1))
    pushes.expect("p", reservation(len(prompt)))
    (out,) = engine.step()
    layers = engine.config.num_hidden_layers
    assert worker.calls == [("start", out.block_ids),
                            *[("layers", range(i, i + 1)) for i in range(layers)]]
    lease = pushes.seal("p", out.block_ids)
    assert worker.calls[-1] == ("seal", True) and lease
    # each layer was final when handed: the rest of the forward changed none of its KV
    views = list(engine.kv_caches[0].values())
    for layer, seen in worker.handed.items():
        assert torch.equal(seen, views[layer][out.block_ids]), f"layer {layer} changed"
    # a request not expected to push hands nothing
    engine.add_held_request("q", prompt, SamplingParams(max_tokens=1))
    engine.step()
    assert len(worker.calls) == layers + 2


def test_a_request_that_ends_unheld_gives_its_push_up_and_its_lease_frees_nothing() -> None:
    engine = LLMEngine(tiny_config(), None, seed=1, block_size=4, num_blocks=32)
    worker = Recorder(engine)
    pushes = PushesOut([worker, Recorder(engine)], None)  # type: ignore[list-item]
    engine.layer_hook = pushes.on_layer
    engine.add_held_request("p", [1, 2, 3], SamplingParams(max_tokens=1))
    pushes.expect("p", reservation(3))
    engine.step()
    pushes.give_up("p")
    assert worker.calls[-1] == ("seal", False)
    lease = next(iter(pushes._orphans))
    assert pushes.ended_unheld(lease) and pushes.ended_unheld(lease)  # once per rank
    assert not pushes.ended_unheld(lease)
