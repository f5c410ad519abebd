"""``kvxfer serve``: run a prefill, decode or both sidecar (HTTP API + KV transfers)."""

from __future__ import annotations

import argparse
import os
import sys

from kvxfer.transfer.transfer_config import add_arguments as add_transfer_arguments

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
  both     prefill and decode at once: each request's kv_transfer_params say
           which side it is; a request without them is answered as a plain
           single instance would (the reference for accuracy checks)

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--role", choices=["prefill", "decode", "both"], default="both",
                        help="what this instance does (default both)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help="HTTP port (default 8000; 0 picks a free one)")
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
    parser.add_argument("--kv-events-port", type=int, default=None, metavar="PORT",
                        help="publish what the prefix cache holds (blocks stored and evicted, "
                             "named by a hash chain over their token ids) as vLLM's KV events "
                             "(msgpack KVEventBatch) on a ZMQ PUB socket at "
                             "--side-channel-host:PORT (0: a free port), with a replay "
                             "socket on another free port, so that a router that reads "
                             "vLLM's --kv-events-config streams sends each prompt where its "
                             "prefix is cached; /health says where (kv_events). Signed with "
                             "--kv-key-file when given. Needs --enable-prefix-caching "
                             "(default: off)")
    parser.add_argument("--model", default="kvxfer-tiny",
                        help="a model name from `kvxfer models` (kvxfer-tiny, the seeded "
                             "tiny model, is the default; smollm2-135m-instruct is a real "
                             "one), a .gguf file or a checkpoint directory (config.json + "
                             "*.safetensors)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed of kvxfer-tiny (0)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        default="float32", help="model and cache dtype (default float32)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every HTTP route; "
                             f"/health without it says only ok / not ok (default: "
                             f"${API_KEY_ENV}, else no key: anyone who reaches the port may "
                             f"use it)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read --api-key from the first line of this file")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="after SIGTERM: longest wait for requests in flight and leased "
                             "blocks before exiting anyway (default 30)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) clients may ask for (default: the model's name)")
    add_transfer_arguments(parser.add_argument_group(
        "KV transfers", "how this instance moves KV to and from its peers (the same settings "
                        "KvxferConnector takes in vLLM's kv_connector_extra_config)"))


def _fail(message: str) -> int:
    print(f"kvxfer serve: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from kvxfer.net.api_key import ApiKeyError, load_key
    from kvxfer.net.kv_key import KvKeyError
    from kvxfer.transfer.transfer_config import ConfigError, from_arguments

    if not 0 <= args.port < 65536:
        return _fail(f"--port {args.port} is not a TCP port")
    if not args.drain_timeout > 0:
        return _fail(f"--drain-timeout must be a positive number of seconds, got "
                     f"{args.drain_timeout}")
    try:
        api_key = load_key(args.api_key, args.api_key_file, API_KEY_ENV, "--api-key")
        transfer = from_arguments(args)
    except (ApiKeyError, ConfigError, KvKeyError) as exc:
        return _fail(str(exc))
    from kvxfer.sidecar.settings import Settings

    try:
        settings = Settings(
            role=args.role, host=args.host, port=args.port, tp=args.tp,
            kv_cache_layout=args.kv_cache_layout, block_size=args.block_size,
            num_blocks=args.num_blocks, model=args.model, seed=args.seed, dtype=args.dtype,
            device=args.device, served_model_names=tuple(args.served_model_name or ()),
            api_key=api_key, drain_timeout=args.drain_timeout, kv_packing=args.kv_packing,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_events_port=args.kv_events_port, transfer=transfer)
        if settings.advertises:  # a listener's address, before the model loads
            settings.side_channel_advertised()
    except ValueError as exc:
        return _fail(str(exc))
    # torch: after the quick checks
    from kvxfer.sidecar.http_app import PortInUse, serve
    from kvxfer.transfer.nixl_agent import NixlUnavailableError

    try:
        serve(settings)
    except (PortInUse, NixlUnavailableError) as exc:
        return _fail(str(exc))
    except (OSError, ValueError, KeyError) as exc:  # side channel, bad flags or checkpoint
        return _fail(str(exc).strip("'\""))
    return 0
