"""``kvxfer generate``: run the reference engine offline on one or more prompts."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "generate completions with the built-in reference engine (no server, no transfer)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text(s)")
    parser.add_argument("--model", default="kvxfer-tiny",
                        help="a model name from `kvxfer models` (kvxfer-tiny, the seeded "
                             "tiny model, is the default; smollm2-135m-instruct is a real "
                             "one), a .gguf file or a checkpoint directory (config.json + "
                             "*.safetensors)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed of kvxfer-tiny (0)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--kv-cache-layout", default=None,
                        help="KV cache layout (default: $KVXFER_KV_CACHE_LAYOUT or LBHNC)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument("--num-blocks", type=int, default=256, help="KV cache blocks (256)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        default="float32", help="model and cache dtype (default float32)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0)")
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="seed of each request's sampler (default: random)")
    parser.add_argument("--stop", action="append", default=[],
                        help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="top alternatives per token in --json output")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as one user message of a chat")
    parser.add_argument("--json", action="store_true",
                        help="print token ids, text and logprobs as JSON")


def _fail(message: str) -> int:
    print(f"kvxfer generate: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from kvxfer.engine import LLMEngine, SamplingParams

    try:
        engine = LLMEngine.from_model_arg(
            args.model, seed=args.seed, tp=args.tp, layout=args.kv_cache_layout,
            block_size=args.block_size, num_blocks=args.num_blocks, dtype=args.dtype,
            device=args.device)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.sampling_seed, stop=args.stop,
                                ignore_eos=args.ignore_eos, logprobs=args.logprobs)
        tokenizer = engine.tokenizer
        prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) if args.chat
                   else tokenizer.encode(p) for p in args.prompts]
        outputs = engine.generate(prompts, params)
    except (ValueError, KeyError) as exc:  # bad checkpoint, flags or prompt: one line
        return _fail(str(exc).strip("'\""))
    if args.json:
        print(json.dumps(_as_json(engine, args, prompts, outputs), indent=2))
        return 0
    for i, output in enumerate(outputs):
        if len(outputs) > 1:
            print(f"=== [{i}] {args.prompts[i]!r} ({output.finish_reason})")
        print(output.text)
    return 0


def _as_json(engine: Any, args: argparse.Namespace, prompts: list[list[int]],
             outputs: list[Any]) -> dict[str, Any]:
    return {
        "model": engine.model_name, "model_id": engine.model_id, "tp": engine.tp,
        "layout": engine.layout.name, "dtype": args.dtype,
        "completions": [{
            "prompt": text, "prompt_token_ids": ids, "token_ids": out.token_ids,
            "text": out.text, "finish_reason": out.finish_reason,
            "logprobs": [{"token_id": lp.token_id, "logprob": lp.logprob,
                          "top": [[t, v] for t, v in lp.top]} for lp in out.logprobs],
        } for text, ids, out in zip(args.prompts, prompts, outputs, strict=True)],
    }
