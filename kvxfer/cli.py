"""The ``kvxfer`` command line: one sub-command per job.

Each sub-command lives in ``kvxfer/commands/<name>.py`` and exposes
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``. Those
modules import only the standard library at module level, so ``kvxfer --help``
stays fast; heavy imports (torch, NIXL) happen inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvxfer import __version__

COMMANDS: tuple[str, ...] = ("serve", "demo", "plan", "generate", "models", "accuracy",
                             "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxfer",
        description="Disaggregated KV-cache transfer: prefill/decode sidecars, "
                    "a transfer planner, benchmarks and a demo.")
    parser.add_argument("--version", action="version", version=f"kvxfer {__version__}")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity (default: INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"kvxfer.commands.{name}")
        child = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(child)
        child.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "DEBUG":  # one line per HTTP call drowns everything else
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
