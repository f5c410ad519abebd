"""``kvxfer models``: the model names ``--model`` accepts, what each resolves to, and
whether it can be loaded here."""

from __future__ import annotations

import argparse
import json

HELP = "list the model names --model accepts (a .gguf file or checkpoint directory also works)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from kvxfer.engine.model_cache import cache_dir
    from kvxfer.engine.model_names import model_statuses

    statuses = model_statuses()
    if args.json:
        print(json.dumps({"cache_dir": str(cache_dir()),
                          "models": [vars(s) for s in statuses]}, indent=2))
        return 0
    width = max(len(s.name) for s in statuses)
    for s in statuses:
        state = "available" if s.available else "NOT AVAILABLE"
        if s.cached is not None:
            state += ", converted" if s.cached else ", not converted yet (first load converts)"
        print(f"{s.name:<{width}}  {s.description} [{state}]")
        print(f"{'':<{width}}  -> {s.source}")
    print(f"GGUF conversion cache: {cache_dir()} (set KVXFER_CACHE_DIR to move it)")
    return 0
