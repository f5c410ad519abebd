"""``python -m proxy`` / ``kvxfer-proxy``: serve the proxy from the command line.

The instance flags match the proxy vLLM's NIXL integration tests start, e.g.
``--prefiller-hosts 127.0.0.1 --prefiller-ports 8100 8101 --decoder-ports 8200``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvxfer.net.api_key import ApiKeyError, load_key
from kvxfer.net.kv_key import KV_KEY_ENV, KvKeyError, key_file_from, load_kv_key
from proxy.config import PD_MIN_TOKENS, POLICIES, ConfigError, ProxyConfig
from proxy.discovery import split_hosts

API_KEY_ENV = "KVXFER_PROXY_API_KEY"
UPSTREAM_API_KEY_ENV = "KVXFER_API_KEY"  # what `kvxfer serve` reads its own key from


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxfer-proxy",
        description="OpenAI-compatible proxy for prefill/decode disaggregation: each "
                    "completion goes to a prefill instance (one token, KV leased), then to a "
                    "decode instance that pulls the KV and generates the answer.",
        epilog="Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, "
               "GET /health, GET /metrics.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on "
                        "(default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    for flag, role, port in (("prefiller", "prefill", 8100), ("decoder", "decode", 8200)):
        parser.add_argument(f"--{flag}-hosts", f"--{flag}-host", nargs="+",
                            default=["127.0.0.1"], metavar="HOST",
                            help=f"{role} instance hosts: one for all ports, or one per port; "
                                 f"an IP address, or a DNS name re-resolved every "
                                 f"--resolve-interval, each of its addresses an instance "
                                 f"(e.g. a Kubernetes headless Service) (default 127.0.0.1)")
        parser.add_argument(f"--{flag}-ports", f"--{flag}-port", nargs="+", type=int,
                            default=[port], metavar="PORT",
                            help=f"{role} instance HTTP ports (default {port})")
    parser.add_argument("--policy", choices=POLICIES, default="kv_aware",
                        help="how to pick an instance per role: kv_aware by the prompt "
                             "tokens its cache lacks and its load, from the instances' KV "
                             "events (round robin while none arrive); round_robin; "
                             "least_outstanding (default kv_aware)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' from clients on every route; "
                             f"/health without it says only ok / not ok "
                             f"(default: ${API_KEY_ENV}, else no key)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read --api-key from the first line of this file")
    parser.add_argument("--upstream-api-key", default=None,
                        help=f"the key of the sidecars (their `kvxfer serve --api-key`), sent "
                             f"as 'Authorization: Bearer KEY' on every call to them; keep it "
                             f"apart from --api-key so that clients cannot call sidecars "
                             f"directly (default: ${UPSTREAM_API_KEY_ENV}, else none)")
    parser.add_argument("--upstream-api-key-file", default=None, metavar="PATH",
                        help="read --upstream-api-key from the first line of this file")
    parser.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="longest wait to connect to an instance (default 5)")
    parser.add_argument("--prefill-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="longest wait for a prefill's answer (one token); after it a "
                             "frozen or overloaded prefill's request runs on another one "
                             "(--retries), else the client gets 504 (default 30)")
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="longest wait for a whole non-streamed decode answer, or for "
                             "each next chunk of a stream (default 600)")
    parser.add_argument("--retries", type=int, default=1, metavar="N",
                        help="run a request again, on instances that did not fail it, up to "
                             "N times when its prefill or decode failed (5xx, broken "
                             "connection, a prefill timeout) before anything was sent to the "
                             "client (default 1; 0 turns retries off)")
    parser.add_argument("--kv-transfer-mode", choices=["pull", "push"],
                        default=os.environ.get("KVXFER_TRANSFER_MODE", "pull"),
                        help="pull: the decode reads each prompt's KV from the prefill; "
                             "push: the decode reserves blocks first (POST /v1/kv/reserve) "
                             "and the prefill writes the KV into them (decodes started with "
                             "--kv-transfer-mode push) (default pull, or "
                             "$KVXFER_TRANSFER_MODE)")
    parser.add_argument("--health-interval", type=float, default=5.0, metavar="SECONDS",
                        help="pause between health checks of every instance (default 5)")
    parser.add_argument("--health-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="longest wait for one instance's GET /health (default 5)")
    parser.add_argument("--health-failures", type=int, default=2, metavar="N",
                        help="health checks in a row without an answer within "
                             "--health-timeout before a healthy instance takes no more "
                             "requests (default 2; a busy instance may answer late once); "
                             "a refused connection or an answer other than 200 takes it "
                             "out at once")
    parser.add_argument("--resolve-interval", type=float, default=5.0, metavar="SECONDS",
                        help="pause between resolutions of instance names: new addresses "
                             "join, vanished ones finish their requests and leave "
                             "(default 5)")
    parser.add_argument("--hosts-file", default=None, metavar="PATH",
                        help="resolve instance names from this /etc/hosts-style file (read "
                             "again every --resolve-interval) instead of DNS; change it by "
                             "renaming a new file over it, not by writing it in place")
    parser.add_argument("--kv-key-file", default=None, metavar="PATH",
                        help="the instances' KV key file (their --kv-key-file): their KV "
                             "events must carry its signature, and unsigned or forged ones "
                             f"are refused (default: ${KV_KEY_ENV}, else none: unsigned "
                             "events, as vLLM's, are read; keep them on a trusted network)")
    parser.add_argument("--kv-events", nargs="+", default=[], metavar="URL=ENDPOINT",
                        help="the KV event stream of an instance whose /health does not "
                             "announce one (vLLM started with --kv-events-config), as "
                             "INSTANCE_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]; kvxfer "
                             "sidecars announce theirs (kvxfer serve --kv-events-port)")
    parser.add_argument("--pd-min-tokens", type=int, default=PD_MIN_TOKENS, metavar="N",
                        help="a prompt with fewer than N tokens left to compute on the best "
                             "decode (its cached prefix subtracted) goes to that decode alone, "
                             "which computes them: for so few, P/D's two hops cost more than "
                             "they save (`kvxfer bench ttft` shows where P/D starts to pay "
                             f"on your deployment; default {PD_MIN_TOKENS}; 0: always P/D); "
                             "needs the prompt's tokens (token ids, or --tokenizer)")
    parser.add_argument("--prefill-saturated-tokens", type=int, default=0, metavar="N",
                        help="when every prefill has N or more prompt tokens in flight and a "
                             "decode has room, a request goes to a decode alone (default 0: "
                             "never)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="the model's checkpoint directory (tokenizer.json, chat "
                             "template), or 'byte' for kvxfer's byte tokenizer: kv_aware "
                             "scores text prompts by their tokens (default: none; prompts "
                             "given as token ids are scored, text ones routed by load)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"], help="(default info)")
    parser.add_argument("--access-log", action="store_true", help="log every request")
    return parser


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The :class:`ProxyConfig` the flags describe; raises :class:`ConfigError`."""
    try:
        api_key = load_key(args.api_key, args.api_key_file, API_KEY_ENV, "--api-key")
        upstream_key = load_key(args.upstream_api_key, args.upstream_api_key_file,
                                UPSTREAM_API_KEY_ENV, "--upstream-api-key")
        kv_key_file = key_file_from(args.kv_key_file)
        kv_key = None if kv_key_file is None else load_kv_key(kv_key_file)
    except (ApiKeyError, KvKeyError) as exc:
        raise ConfigError(str(exc)) from None
    prefill_urls, prefill_names = split_hosts(args.prefiller_hosts, args.prefiller_ports,
                                              "prefiller")
    decode_urls, decode_names = split_hosts(args.decoder_hosts, args.decoder_ports, "decoder")
    return ProxyConfig(
        prefill_urls=prefill_urls, decode_urls=decode_urls, prefill_names=prefill_names,
        decode_names=decode_names, resolve_interval=args.resolve_interval,
        hosts_file=args.hosts_file,
        host=args.host, port=args.port, policy=args.policy, api_key=api_key,
        upstream_api_key=upstream_key, connect_timeout=args.connect_timeout,
        prefill_timeout=args.prefill_timeout, request_timeout=args.request_timeout,
        retries=args.retries, transfer_mode=args.kv_transfer_mode,
        health_interval=args.health_interval, health_timeout=args.health_timeout,
        health_failures=args.health_failures, log_level=args.log_level,
        access_log=args.access_log, kv_key=kv_key, tokenizer=args.tokenizer,
        kv_events=tuple(args.kv_events), pd_min_tokens=args.pd_min_tokens,
        prefill_saturated_tokens=args.prefill_saturated_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))  # exits with status 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from proxy.server import serve

    try:
        return serve(config)
    except ConfigError as exc:  # found at start-up (--tokenizer, --kv-events)
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
