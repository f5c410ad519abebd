"""``kvxfer bench <what>``: benchmarks that print a table and, with --json, JSON.

Each benchmark lives in a module of ``kvxfer/bench/`` (:data:`BENCHMARKS`) with ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``, imported lazily like the
top-level commands.
"""

from __future__ import annotations

import argparse
import importlib

HELP = "run a benchmark and print numbers (table, or JSON with --json)"

# `kvxfer bench NAME` -> its module in kvxfer/bench/ (a module's name is unique in the tree)
BENCHMARKS: dict[str, str] = {
    "descriptors": "descriptor_cost", "proxy": "proxy", "nixl": "nixl", "transfer": "transfer",
    "serve": "serving", "trust": "trust", "vllm": "vllm", "prefix": "prefix", "soak": "soak",
    "ttft": "ttft", "load": "load", "push": "push", "fleet": "fleet", "index": "index_cost"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(f"kvxfer.bench.{module_name}")
        child = sub.add_parser(name, help=module.HELP, description=module.HELP)
        child.add_argument("--json", action="store_true", help="print JSON instead of a table")
        module.add_arguments(child)
        child.set_defaults(bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_run(args))
