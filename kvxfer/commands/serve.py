"""``kvxfer serve``: run a prefill, decode or plain sidecar (HTTP API + KV transfer)."""

from __future__ import annotations

import argparse
import math
import os
import sys

HELP = "run a sidecar: an OpenAI-compatible server that prefills, decodes or both"

DESCRIPTION = """\
Run one sidecar instance of the built-in engine behind an OpenAI-compatible HTTP
API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).

roles:
  prefill  computes prompts; a request whose kv_transfer_params say
           do_remote_decode leases its KV blocks and answers with the params a
           decode instance reads them with (over NIXL, after a handshake on the
           side channel)
  decode   a request whose kv_transfer_params say do_remote_prefill reads the
           prompt's KV from that prefill instance, then generates the rest
  both     a plain single instance (the reference for accuracy checks)

With --api-key (or --api-key-file, or $KVXFER_API_KEY) every route requires
"Authorization: Bearer KEY"; /health without it says only ok / not ok.

Addresses: --host and --side-channel-host are where the listeners bind; they may
be 0.0.0.0 or :: (every address). --advertise-host is the address peers are told
(the prefill's remote_host and lease tickets, /health, the ready line); it
defaults to the bind host, and a prefill whose side channel binds a wildcard
refuses to start without it ("auto": what this host's name resolves to, e.g. a
container's or pod's IP). IPv6 literals work everywhere (--host ::1).

Prints "kvxfer serve ready: ..." on stdout once it accepts requests. SIGTERM
drains: new requests get 503 (health says draining), requests in flight and
leases finish, then it exits (within --drain-timeout, plus a few seconds); a
second SIGTERM or SIGINT stops at once."""

API_KEY_ENV = "KVXFER_API_KEY"
ADVERTISE_HOST_ENV = "KVXFER_ADVERTISE_HOST"
SIDE_CHANNEL_HOST_ENV = "KVXFER_SIDE_CHANNEL_HOST"
MIN_HEARTBEAT_TIMEOUT_S = 0.2  # heartbeats every 50 ms at most


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--role", choices=["prefill", "decode", "both"], default="both",
                        help="what this instance does (default both)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help="HTTP port (default 8000; 0 picks a free one)")
    parser.add_argument("--side-channel-host",
                        default=os.environ.get(SIDE_CHANNEL_HOST_ENV) or "127.0.0.1",
                        help=f"prefill: address the handshake listener binds (0.0.0.0 or "
                             f":: for every address, then --advertise-host is needed) "
                             f"(default ${SIDE_CHANNEL_HOST_ENV}, else 127.0.0.1)")
    parser.add_argument("--advertise-host", default=os.environ.get(ADVERTISE_HOST_ENV),
                        metavar="HOST",
                        help=f"the address peers reach this instance at: the remote_host "
                             f"decodes are told, and what /health reports; 'auto' is the "
                             f"address this host's name resolves to (default "
                             f"${ADVERTISE_HOST_ENV}, else the bind host; required when the "
                             f"prefill's side channel binds a wildcard). A prefill reached "
                             f"on loopback keeps UCX on lo (UCX_NET_DEVICES, unless set)")
    parser.add_argument("--side-channel-port", type=int, default=0,
                        help="prefill: handshake listener port (default 0: a free port)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--kv-cache-layout", default=os.environ.get("KVXFER_KV_CACHE_LAYOUT"),
                        help="KV cache layout: LBHNC, LBNHC, BLHNC, BLNHC, BHLNC, LHBNC "
                             "(aliases HND, NHD) (default $KVXFER_KV_CACHE_LAYOUT, else LBHNC)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument("--kv-packing", choices=["token", "vllm-cpu-vec"], default="token",
                        help="how K and V share a head's block: token (each token's K then its "
                             "V) or vllm-cpu-vec (K transposed, then V, as vLLM's CPU backend "
                             "stores float32 caches: a vLLM decode with KvxferConnector can "
                             "read such a prefill) (default token)")
    parser.add_argument("--num-blocks", type=int, default=256, help="KV cache blocks (256)")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="keep full KV blocks cached after their request ends and reuse "
                             "them for later prompts that start with the same tokens "
                             "(evicting the least recently used when blocks run short); a "
                             "decode then reads from the prefill only the blocks it does "
                             "not hold, and nothing when it holds the whole prompt. Off by "
                             "default: every request then computes or reads its whole "
                             "prompt, which is what transfer benchmarks and accuracy "
                             "references measure")
    parser.add_argument("--model", default="kvxfer-tiny",
                        help="a model name from `kvxfer models` (kvxfer-tiny, the seeded "
                             "tiny model, is the default; smollm2-135m-instruct is a real "
                             "one), a .gguf file or a checkpoint directory (config.json + "
                             "*.safetensors)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed of kvxfer-tiny (0)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        default="float32", help="model and cache dtype (default float32)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"],
                        default="recompute",
                        help="decode: when a KV read fails, recompute the prompt locally or "
                             "fail the request with HTTP 502 (default recompute)")
    parser.add_argument("--lease-ttl", type=float, default=120.0,
                        help="prefill: seconds leased blocks wait for their decode reader "
                             "before they are freed; a decode that claimed the lease and "
                             "still waits or reads renews it for as long again, up to "
                             "--lease-max-age (default 120)")
    parser.add_argument("--lease-max-age", type=float, default=None, metavar="SECONDS",
                        help="prefill: no lease is renewed past this age, so its blocks are "
                             "freed at the latest this long after the prefill; decode: "
                             "params whose lease_expires_at is further ahead are refused "
                             "(default 4 x --lease-ttl)")
    parser.add_argument("--read-lanes", type=int, default=2, metavar="N",
                        help="decode, KV in host memory: copy threads for large reads, each "
                             "with its own NIXL agent, shared by this instance's TP ranks "
                             "(each rank gets max(1, N // tp)); NIXL's cma transport copies in "
                             "the posting thread (default 2)")
    parser.add_argument("--no-host-reads", dest="host_reads", action="store_false",
                        help="KV in host memory: neither offer nor use reads on this host; "
                             "a prefill keeps its cache in private memory. By default a "
                             "prefill keeps it in a sealed memfd, and a decode on the same "
                             "host (the same user or ptrace rights needed, as for NIXL's cma "
                             "transport) whose read needs a conversion, or is cut at every "
                             "block by two block sizes, copies it from the prefill's mapped "
                             "cache (or with process_vm_readv from a prefill without one) "
                             "instead of READing it into staging and copying it again")
    parser.add_argument("--nixl-backends", default="UCX", metavar="NAMES",
                        help="comma-separated NIXL backends each rank's agent runs (default "
                             "UCX); a decode reads only from a prefill that runs one of them, "
                             "and says so when none is shared")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every HTTP route; "
                             f"/health without it says only ok / not ok (default: "
                             f"${API_KEY_ENV}, else no key: anyone who reaches the port may "
                             f"use it)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read --api-key from the first line of this file")
    parser.add_argument("--kv-read-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="decode: longest handshake with a prefill (all attempts "
                             "together), and longest READ of one request's KV; then the "
                             "read fails (recompute or 502, by policy) (default 10)")
    parser.add_argument("--kv-transfer-mode", choices=["pull", "push"],
                        default=os.environ.get("KVXFER_TRANSFER_MODE", "pull"),
                        help="decode: pull (the decode READs each prompt's KV from the "
                             "prefill) or push: also reserve blocks on POST /v1/kv/reserve, "
                             "which a prefill WRITEs the prompt's KV into as it computes it; "
                             "the side channel (--side-channel-port) then serves this "
                             "decode's metadata to prefills (default pull, or "
                             "$KVXFER_TRANSFER_MODE)")
    parser.add_argument("--kv-heartbeat-timeout", type=float, default=2.0, metavar="SECONDS",
                        help="decode: while a READ from a prefill is in flight, ask the "
                             "prefill's side channel every SECONDS/4 whether it answers; a "
                             "READ still in flight once a question went unanswered for "
                             "SECONDS fails as at --kv-read-timeout (and the prefill counts "
                             "as failed for a moment), so a cut link or a frozen prefill "
                             "host is noticed within 1.25 x SECONDS of going silent (2.5 s "
                             "by default) instead of at --kv-read-timeout. A READ that "
                             "completes is never failed "
                             "for it. Keep it above the worst delay of the side channel's "
                             "answers; 0 turns heartbeats off (default 2)")
    parser.add_argument("--kv-key-file", default=None, metavar="PATH",
                        help="prefill and decode: the key shared by every instance that "
                             "exchanges KV (at least 16 bytes; mode 600, or 440 owned by "
                             "root); it signs the side channel, NIXL notifications and "
                             "lease tickets (default $KVXFER_KV_KEY_FILE, else none: "
                             "unauthenticated, for loopback)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="after SIGTERM: longest wait for requests in flight and leased "
                             "blocks before exiting anyway (default 30)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) clients may ask for (default: the model's name)")


def _fail(message: str) -> int:
    print(f"kvxfer serve: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from kvxfer.net.api_key import ApiKeyError, load_key

    if not 0 <= args.port < 65536:
        return _fail(f"--port {args.port} is not a TCP port")
    if not 0 <= args.side_channel_port < 65536:
        return _fail(f"--side-channel-port {args.side_channel_port} is not a TCP port")
    if not args.lease_ttl > 0:
        return _fail(f"--lease-ttl must be a positive number of seconds, got {args.lease_ttl}")
    if args.lease_max_age is not None and not args.lease_max_age >= args.lease_ttl:
        return _fail(f"--lease-max-age must be at least --lease-ttl ({args.lease_ttl} s), got "
                     f"{args.lease_max_age}")
    if args.read_lanes < 1:
        return _fail(f"--read-lanes must be at least 1, got {args.read_lanes}")
    backends = tuple(b.strip() for b in args.nixl_backends.split(",") if b.strip())
    if not backends or len(set(backends)) != len(backends):
        return _fail(f"--nixl-backends must name one or more different backends, e.g. UCX or "
                     f"UCX,LIBFABRIC; got {args.nixl_backends!r}")
    if not args.drain_timeout > 0:
        return _fail(f"--drain-timeout must be a positive number of seconds, got "
                     f"{args.drain_timeout}")
    if not args.kv_read_timeout > 0:
        return _fail(f"--kv-read-timeout must be a positive number of seconds, got "
                     f"{args.kv_read_timeout}")
    if not (args.kv_heartbeat_timeout == 0 or
            MIN_HEARTBEAT_TIMEOUT_S <= args.kv_heartbeat_timeout < math.inf):
        return _fail(f"--kv-heartbeat-timeout must be 0 (off) or at least "
                     f"{MIN_HEARTBEAT_TIMEOUT_S} seconds, got {args.kv_heartbeat_timeout}")
    try:
        api_key = load_key(args.api_key, args.api_key_file, API_KEY_ENV, "--api-key")
    except ApiKeyError as exc:
        return _fail(str(exc))
    from kvxfer.net.kv_key import KvKeyError, key_file_from, load_kv_key

    key_file = key_file_from(args.kv_key_file)
    try:
        kv_key = None if key_file is None else load_kv_key(key_file)
    except KvKeyError as exc:
        return _fail(str(exc))
    # torch: after the quick checks
    from kvxfer.sidecar.http_app import PortInUse, serve
    from kvxfer.sidecar.settings import Settings

    settings = Settings(
        role=args.role, host=args.host, port=args.port, side_channel_host=args.side_channel_host,
        side_channel_port=args.side_channel_port, tp=args.tp,
        kv_cache_layout=args.kv_cache_layout, block_size=args.block_size,
        num_blocks=args.num_blocks, model=args.model, seed=args.seed, dtype=args.dtype,
        device=args.device, kv_load_failure_policy=args.kv_load_failure_policy,
        lease_ttl=args.lease_ttl, lease_max_age=args.lease_max_age,
        read_lanes=args.read_lanes, nixl_backends=backends, kv_key=kv_key,
        host_reads=args.host_reads,
        served_model_names=tuple(args.served_model_name or ()), api_key=api_key,
        kv_read_timeout=args.kv_read_timeout,
        kv_heartbeat_timeout=args.kv_heartbeat_timeout, advertise_host=args.advertise_host,
        kv_transfer_mode=args.kv_transfer_mode,
        drain_timeout=args.drain_timeout, kv_packing=args.kv_packing,
        enable_prefix_caching=args.enable_prefix_caching)
    if args.role == "prefill" or args.kv_transfer_mode == "push":  # a listener's address
        try:
            settings.side_channel_advertised()  # before the model loads
        except ValueError as exc:
            return _fail(str(exc))
    from kvxfer.transfer.nixl_agent import NixlUnavailableError

    try:
        serve(settings)
    except (PortInUse, NixlUnavailableError) as exc:
        return _fail(str(exc))
    except (OSError, ValueError, KeyError) as exc:  # side channel, bad flags or checkpoint
        return _fail(str(exc).strip("'\""))
    return 0
