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
from proxy.config import POLICIES, ConfigError, ProxyConfig
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
    parser.add_argument("--policy", choices=POLICIES, default="round_robin",
                        help="how to pick an instance per role (default round_robin)")
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
    except ApiKeyError as exc:
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
        access_log=args.access_log)


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

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
