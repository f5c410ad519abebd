"""Model-free prefill and decode instances on loopback, for tests and benchmarks.

A :class:`LoopbackInstance` is everything of a sidecar except the model: per TP
rank a KV cache in one layout and a real :class:`~kvxfer.transfer.worker.TransferWorker`
(real NIXL agent), plus, on the prefill side, a real handshake listener. Prefill
caches hold a pattern that names every element's (layer, block, global head,
token, content) position, so a decode can verify byte-exactly what it received.

:class:`PrefillProcess` runs such instances in a separate OS process driven over
a pipe, so that tests and ``kvxfer bench transfer`` exercise real cross-process
transfers (and can kill the process mid-flight).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvxfer.harness import preloaded
from kvxfer.plan.layout import CacheSpec, allocate_kv_cache, logical_view, parse_layout
from kvxfer.plan.topology import heads_per_rank, rank_heads
from kvxfer.wire.reservations import PUSH_GRACE_S


@dataclass(frozen=True)
class CacheConfig:
    """Shape of one instance's KV caches (all ranks).

    ``kv_lora_rank > 0`` makes it an MLA latent cache: one head (``total_kv_heads``
    1) of ``head_size`` latent elements per token, the first ``kv_lora_rank`` of
    them the compressed KV, on every rank. ``separate_kv_head_groups``: K and V are
    head slots of their own (the K heads, then the V heads; vLLM's ``num_head_slots``).
    ``kernel_block_size`` (a divisor of ``block_size``) keeps the views at that kernel
    block size; block ids stay logical.
    """

    layout: str = "LBHNC"
    tp: int = 1
    total_kv_heads: int = 4
    num_layers: int = 3
    block_size: int = 4
    head_size: int = 8
    num_blocks: int = 32
    dtype: str = "float32"
    read_lanes: int = 1
    kv_lora_rank: int = 0
    kernel_block_size: int | None = None
    host_reads: bool = True  # offer and use host reads (kvxfer.transfer.converted.host_reads)
    # a prefill's cache in mappable memory (kvxfer.transfer.converted.mapped_reads)
    shared_memory: bool = True
    separate_kv_head_groups: bool = False
    key: str = ""  # the instances' shared key, hex ("": none): signs side channel and notes

    @property
    def hmac_key(self) -> bytes | None:
        return bytes.fromhex(self.key) if self.key else None

    @property
    def kernel_ratio(self) -> int:
        """Kernel blocks per logical block."""
        return self.block_size // (self.kernel_block_size or self.block_size)

    def logical(self, view: torch.Tensor) -> torch.Tensor:
        """One of this config's views as ``[B, H, N, C]`` logical blocks (a copy where the
        view is at a kernel block size)."""
        return logical_view(view, self.kernel_ratio).flatten(2, 3)

    def spec(self) -> CacheSpec:
        return CacheSpec(self.block_size, heads_per_rank(self.tp, self.total_kv_heads),
                         self.head_size, getattr(torch, self.dtype),
                         separate_kv_head_groups=self.separate_kv_head_groups,
                         latent=self.kv_lora_rank > 0)

    @property
    def lanes_per_rank(self) -> int:
        """``read_lanes`` is per instance; its in-process TP ranks share them."""
        return max(1, self.read_lanes // self.tp)

    def transfer(self) -> Any:
        """The transfer config of this cache's instances (a READ may take 30 s here: the
        tests run on a loaded machine)."""
        from kvxfer.transfer.transfer_config import TransferConfig

        return TransferConfig(host_reads=self.host_reads, kv_key=self.hmac_key,
                              read_lanes=self.read_lanes, kv_read_timeout=30.0)

    def compat(self) -> Any:
        from kvxfer.wire.compat import CompatInfo

        return CompatInfo(model="loopback-synthetic", dtype=self.dtype, cache_dtype=self.dtype,
                          head_size=self.head_size, total_kv_heads=self.total_kv_heads,
                          num_layers=self.num_layers, kv_lora_rank=self.kv_lora_rank)


def pattern(cfg: CacheConfig, rank: int, layer: int) -> torch.Tensor:
    """The prefill content of one rank's layer view, ``[B, H, N, C]`` in float32.

    Each element encodes (layer, block, global head, token, content) as an integer
    below 2**24, exact in float32; heads are global so that ranks with different
    TP agree on what a head holds.
    """
    b, n, c = cfg.num_blocks, cfg.block_size, cfg.spec().content_size
    own = list(rank_heads(rank, cfg.tp, cfg.total_kv_heads))
    total = cfg.total_kv_heads
    if cfg.separate_kv_head_groups:  # V head h is global slot total + h
        own, total = own + [total + h for h in own], 2 * total
    heads = torch.tensor(own)
    index = (torch.arange(b)[:, None, None, None] * total + heads[None, :, None, None])
    index = (index * n + torch.arange(n)[None, None, :, None]) * c + torch.arange(c)
    return ((index + layer * b * total * n * c) % (1 << 24)).to(torch.float32)


@dataclass
class LoopbackInstance:
    """TP ranks with caches and workers; prefill instances also listen for handshakes."""

    role: str
    cfg: CacheConfig
    engine_id: str
    workers: list[Any]
    caches: list[dict[str, torch.Tensor]]
    raws: list[torch.Tensor]
    listener: Any = None
    pending: dict[str, set[int]] = field(default_factory=dict)

    @classmethod
    def create(cls, role: str, cfg: CacheConfig, *, fill: str = "pattern",
               host: str = "127.0.0.1", engine_id: str | None = None,
               listen: bool | None = None) -> LoopbackInstance:
        """An instance of ``role``; a prefill, or any with ``listen``, serves handshakes
        (a decode that prefills push into does)."""
        from kvxfer.transfer.converted.mapped_reads import shared_zeros
        from kvxfer.transfer.converted.process_shares import ProcessShares
        from kvxfer.transfer.leases import ReservationAnswers
        from kvxfer.transfer.side_channel.listener import SideChannelListener
        from kvxfer.transfer.worker import TransferWorker

        engine_id = engine_id or f"{role}-{uuid.uuid4().hex[:10]}"
        layout = parse_layout(cfg.layout)
        spec = cfg.spec()
        inst = cls(role, cfg, engine_id, [], [], [])
        shares = ProcessShares()  # the instance's ranks are threads of this process
        # a prefill's cache in memory that a decode on this host may map (mapped_reads)
        shared = role == "prefill" and cfg.host_reads and cfg.shared_memory
        for rank in range(cfg.tp):
            raw, views = allocate_kv_cache(spec, cfg.num_blocks, cfg.num_layers, layout,
                                           block_size=cfg.kernel_block_size,
                                           zeros=shared_zeros if shared else None)
            for layer, view in enumerate(views):
                if fill == "pattern":  # the pattern of each logical block's tokens
                    logical_view(view, cfg.kernel_ratio).copy_(
                        pattern(cfg, rank, layer).unflatten(2, (cfg.kernel_ratio, -1)))
                elif fill == "sentinel":
                    view.fill_(-1)
            caches = {f"model.layers.{i}.self_attn": v for i, v in enumerate(views)}
            worker = TransferWorker(engine_id, rank, cfg.tp, cfg.compat(), cfg.transfer(),
                                    total_kv_heads=cfg.total_kv_heads,
                                    read_lanes=cfg.lanes_per_rank if role == "decode" else 1,
                                    shares=shares)
            worker.register_kv_caches(caches, spec, cfg.num_blocks, layout)
            inst.workers.append(worker)
            inst.caches.append(caches)
            inst.raws.append(raw)
        if listen or (listen is None and role == "prefill"):  # a decode's answers claims
            claims = ReservationAnswers(inst.workers, 60.0) if role == "decode" else None
            inst.listener = SideChannelListener(
                host, 0, engine_id=engine_id, compat=cfg.compat(), hmac_key=cfg.hmac_key,
                metadata=lambda: [w.metadata() for w in inst.workers],
                on_request=lambda _peer: [w.peer_connecting() for w in inst.workers],
                on_renew=claims.on_renew if claims is not None else None,
                on_done=claims.on_done if claims is not None else None).start()
        return inst

    @property
    def port(self) -> int:
        return int(self.listener.port) if self.listener is not None else 0

    def params(self, request_id: str, block_ids: list[int]) -> dict[str, Any]:
        """The ``kv_transfer_params`` a prefill sidecar would return for these blocks."""
        return {"remote_engine_id": self.engine_id, "remote_host": "127.0.0.1",
                "remote_port": self.port, "remote_block_ids": list(block_ids),
                "remote_request_id": request_id, "tp_size": self.cfg.tp}

    # -- prefill side ---------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: list[int], ttl: float) -> None:
        for worker in self.workers:
            worker.hold(request_id, block_ids, ttl=ttl)
        self.pending[request_id] = set(range(self.cfg.tp))

    def released(self) -> dict[str, str]:
        """Requests whose blocks every rank has released, with the (last) reason."""
        done: dict[str, str] = {}
        for rank, worker in enumerate(self.workers):
            for item in worker.poll_released():
                ranks = self.pending.get(item.request_id)
                if ranks is not None:
                    ranks.discard(rank)
                    if not ranks:
                        del self.pending[item.request_id]
                        done[item.request_id] = item.reason
        return done

    def push(self, request_id: str, reservation: Any, block_ids: list[int],
             groups: list[range] | None = None, seal: bool = True) -> None:
        """Push ``block_ids`` (leased as ``request_id``) into ``reservation``: each of
        ``groups`` handed as the engine would hand finished layers, the rest at the seal
        (none without ``seal``: the push waits for more layers)."""
        for worker in self.workers:
            worker.start_push(request_id, reservation, block_ids, ("127.0.0.1", self.port))
            for layers in groups or ():
                worker.push_layers(request_id, layers)
            if seal:
                worker.seal_push(request_id)
        self.pending[request_id] = set(range(self.cfg.tp))

    def give_up(self, request_id: str) -> None:
        """The request is aborted: end its pushes (their decodes are told it failed)."""
        for worker in self.workers:
            worker.seal_push(request_id, ok=False)

    # -- decode side ----------------------------------------------------------------------
    def reserve(self, reservation_id: str, block_ids: list[int], num_tokens: int,
                ttl: float, grace: float = PUSH_GRACE_S, cached_tokens: int = 0) -> Any:
        """Hold ``block_ids`` for a push of ``num_tokens`` tokens (past the first
        ``cached_tokens``, which this side holds already) until every writer said
        "done" or ``ttl + grace`` seconds (a sidecar's grace is
        :data:`~kvxfer.wire.reservations.PUSH_GRACE_S`); the signed reservation, valid
        ``ttl`` seconds, a prefill writes into (:meth:`released` reports its end: "done"
        once it landed)."""
        from kvxfer.wire.reservations import Reservation

        for worker in self.workers:
            worker.hold(reservation_id, block_ids, readers=None, ttl=ttl + grace)
        self.pending[reservation_id] = set(range(self.cfg.tp))
        return Reservation(reservation_id, self.engine_id, "127.0.0.1", self.port, self.cfg.tp,
                           tuple(block_ids), self.cfg.block_size, num_tokens,
                           time.time() + ttl, cached_tokens).signed(self.cfg.hmac_key)

    def read(self, request_id: str, params: dict[str, Any], local_ids: list[int]) -> None:
        for worker in self.workers:
            worker.start_read(request_id, params, local_ids)

    def wait(self, request_ids: list[str], timeout: float = 30.0
             ) -> tuple[dict[str, Any], dict[str, str]]:
        """Wait until every rank finished or one failed for each request.

        Returns (stats per finished request: list per rank, reason per failed request).
        """
        left = {rid: set(range(self.cfg.tp)) for rid in request_ids}
        stats: dict[str, list[Any]] = {rid: [] for rid in request_ids}
        failed: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            for rank, worker in enumerate(self.workers):
                result = worker.poll()
                for rid in result.finished:
                    if rid in left:
                        left[rid].discard(rank)
                        stats[rid].append(result.stats[rid])
                for rid, reason in result.failed.items():
                    failed.setdefault(rid, reason)
                    left.get(rid, set()).discard(rank)
            left = {rid: ranks for rid, ranks in left.items() if ranks}
            time.sleep(0.0005)
        for rid in left:
            failed.setdefault(rid, f"no answer within {timeout} s")
        return {rid: s for rid, s in stats.items() if rid not in failed}, failed

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        for worker in self.workers:
            worker.close()


# -- a prefill process driven over a pipe ---------------------------------------------------

def _serve(conn: Connection, netns: str | None = None, host: str = "127.0.0.1",
           ucx_devices: str | None = None, env: dict[str, str] | None = None) -> None:
    """Child process: run prefill instances on command until told to exit (inside
    network namespace ``netns`` when given, listening on ``host``; its NIXL agents on
    ``ucx_devices``, ``UCX_NET_DEVICES``, when given; with the driver's environment
    ``env``, as a process it spawned would have)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if netns is not None:
        from kvxfer.harness.netns import enter

        enter(netns)  # the main thread, before any socket or NIXL agent exists
    if ucx_devices is not None:
        os.environ["UCX_NET_DEVICES"] = ucx_devices
    instances: dict[str, LoopbackInstance] = {}
    try:
        while True:
            op, args = conn.recv()
            try:
                if op == "exit":
                    conn.send(("ok", None))
                    return
                if op == "create":
                    inst = LoopbackInstance.create(args.get("role", "prefill"),
                                                   CacheConfig(**args["cfg"]),
                                                   fill=args.get("fill", "pattern"), host=host,
                                                   listen=True)
                    instances[inst.engine_id] = inst
                    conn.send(("ok", {"engine_id": inst.engine_id, "port": inst.port}))
                elif op == "drop":
                    instances.pop(args["engine_id"]).close()
                    conn.send(("ok", None))
                elif op == "hold":
                    instances[args["engine_id"]].hold(args["request_id"], args["block_ids"],
                                                      args["ttl"])
                    conn.send(("ok", None))
                elif op == "reserve":
                    import msgspec

                    conn.send(("ok", msgspec.to_builtins(instances[args["engine_id"]].reserve(
                        args["reservation_id"], args["block_ids"], args["num_tokens"],
                        args["ttl"], args["grace"]))))
                elif op == "push":
                    from kvxfer.wire.reservations import parse_reservation

                    instances[args["engine_id"]].push(
                        args["request_id"], parse_reservation(args["reservation"]),
                        args["block_ids"],
                        [range(a, b) for a, b in args.get("groups") or ()], args["seal"])
                    conn.send(("ok", None))
                elif op == "give_up":
                    instances[args["engine_id"]].give_up(args["request_id"])
                    conn.send(("ok", None))
                elif op == "released":
                    conn.send(("ok", instances[args["engine_id"]].released()))
                elif op == "leases":
                    inst = instances[args["engine_id"]]
                    conn.send(("ok", [w.num_leases for w in inst.workers]))
                else:
                    conn.send(("error", f"unknown op {op!r}"))
            except Exception as exc:  # report to the driver, keep serving
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for inst in instances.values():
            inst.close()


class PrefillProcess:
    """A separate OS process hosting loopback prefill instances (in network namespace
    ``netns``, its listeners on ``host``, when given: see :mod:`kvxfer.harness.netns`),
    forked from the preloaded server (:mod:`kvxfer.harness.preloaded`)."""

    def __init__(self, netns: str | None = None, host: str = "127.0.0.1",
                 ucx_devices: str | None = None) -> None:
        ctx = preloaded.context()
        self.host = host
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, netns, host, ucx_devices,
                                                        dict(os.environ)), daemon=True)
        self.process.start()
        child.close()

    def _call(self, op: str, timeout: float = 60.0, **args: Any) -> Any:
        self._conn.send((op, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"prefill process did not answer {op!r} within {timeout} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"prefill process: {value}")
        return value

    def create(self, cfg: CacheConfig, fill: str = "pattern", role: str = "prefill"
               ) -> dict[str, Any]:
        """An instance of ``role`` (listening for handshakes whatever its role)."""
        return dict(self._call("create", cfg=asdict(cfg), fill=fill, role=role))

    def reserve(self, engine_id: str, reservation_id: str, block_ids: list[int],
                num_tokens: int, ttl: float, grace: float = PUSH_GRACE_S) -> dict[str, Any]:
        """:meth:`LoopbackInstance.reserve` in the process: the reservation, as a mapping."""
        return dict(self._call("reserve", engine_id=engine_id, reservation_id=reservation_id,
                               block_ids=list(block_ids), num_tokens=num_tokens, ttl=ttl,
                               grace=grace))

    def drop(self, engine_id: str) -> None:
        """Close one instance (its memory goes back to the system)."""
        self._call("drop", engine_id=engine_id)

    def hold(self, engine_id: str, request_id: str, block_ids: list[int], ttl: float) -> None:
        self._call("hold", engine_id=engine_id, request_id=request_id,
                   block_ids=list(block_ids), ttl=ttl)

    def push(self, engine_id: str, request_id: str, reservation: Any, block_ids: list[int],
             groups: list[range] | None = None, seal: bool = True) -> None:
        """:meth:`LoopbackInstance.push` in the process (``reservation``: a
        :class:`~kvxfer.wire.reservations.Reservation` or its mapping)."""
        import msgspec

        self._call("push", engine_id=engine_id, request_id=request_id,
                   reservation=msgspec.to_builtins(reservation), block_ids=list(block_ids),
                   groups=[(g.start, g.stop) for g in groups or ()], seal=seal)

    def give_up(self, engine_id: str, request_id: str) -> None:
        self._call("give_up", engine_id=engine_id, request_id=request_id)

    def released(self, engine_id: str) -> dict[str, str]:
        return dict(self._call("released", engine_id=engine_id))

    def leases(self, engine_id: str) -> list[int]:
        return list(self._call("leases", engine_id=engine_id))

    def wait_released(self, engine_id: str, request_ids: set[str], timeout: float = 10.0
                      ) -> dict[str, str]:
        """Poll until every request in ``request_ids`` was released (or the timeout)."""
        got: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while not request_ids <= set(got) and time.monotonic() < deadline:
            got.update(self.released(engine_id))
            time.sleep(0.01)
        return got

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError, RuntimeError):
                self._call("exit", timeout=10)
        self.process.join(timeout=10)
        self.kill()
        self._conn.close()
