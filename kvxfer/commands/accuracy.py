"""``kvxfer accuracy``: does a deployment answer exactly like a reference instance?

Sends a fixed prompt set (greedy, with log-probabilities) to a target (usually
the proxy in front of prefill/decode sidecars) and to a reference (a single
``both`` instance), then compares generated tokens exactly and
log-probabilities within a tolerance. Used by ``scripts/run_accuracy_test.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HELP = "compare greedy completions and logprobs of a target against a reference instance"

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "scripts" / "accuracy_prompts.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="base URL under test (e.g. the proxy)")
    parser.add_argument("--reference", required=True, help="base URL of a single instance")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                        help="prompt set JSON (default: scripts/accuracy_prompts.json)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens per prompt (default: the prompt set's max_tokens)")
    parser.add_argument("--logprob-tol", type=float, default=1e-4,
                        help="largest allowed |logprob difference| (default 1e-4)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="first wait up to this many seconds for both /health to answer 200")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--target-api-key", default=os.environ.get("KVXFER_PROXY_API_KEY"),
                        help="HTTP key of the target (default $KVXFER_PROXY_API_KEY, else none)")
    parser.add_argument("--reference-api-key", default=os.environ.get("KVXFER_API_KEY"),
                        help="HTTP key of the reference (default $KVXFER_API_KEY, else none)")


def wait_healthy(urls: list[str], deadline_s: float) -> str | None:
    """Poll ``/health`` of every URL until all answer 200; returns an error or None."""
    import httpx

    deadline = time.monotonic() + deadline_s
    pending = list(urls)
    last = ""
    while pending:
        try:
            if httpx.get(f"{pending[0]}/health", timeout=2.0).status_code == 200:
                pending.pop(0)
                continue
            last = "not ready"
        except httpx.HTTPError as exc:
            last = str(exc) or type(exc).__name__
        if time.monotonic() > deadline:
            return f"{pending[0]} not healthy after {deadline_s:.0f} s ({last})"
        time.sleep(0.2)
    return None


def _bearer(key: str | None) -> dict[str, str]:
    return {} if not key else {"authorization": f"Bearer {key}"}


def _completion(client: Any, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    answer = client.post(f"{url}/v1/completions", json=body)
    answer.raise_for_status()
    data = answer.json()
    choice = data["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
            "logprobs": choice["logprobs"]["token_logprobs"],
            "prompt_tokens": data["usage"]["prompt_tokens"]}


def _chat(client: Any, url: str, messages: list[dict[str, str]], max_tokens: int
          ) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
            "ignore_eos": True}
    answer = client.post(f"{url}/v1/chat/completions", json=body)
    answer.raise_for_status()
    data = answer.json()
    choice = data["choices"][0]
    content = choice["logprobs"]["content"]
    return {"text": choice["message"]["content"], "tokens": [c["token"] for c in content],
            "logprobs": [c["logprob"] for c in content],
            "prompt_tokens": data["usage"]["prompt_tokens"]}


def compare(target: dict[str, Any], reference: dict[str, Any], tol: float) -> dict[str, Any]:
    """Tokens must be identical; logprobs within ``tol`` position by position.
    ``prompt_tokens`` is the target's count of the prompt's tokens."""
    same_tokens = target["tokens"] == reference["tokens"]
    diffs = [abs(a - b) for a, b in zip(target["logprobs"], reference["logprobs"], strict=False)]
    worst = max(diffs, default=0.0)
    return {"tokens": len(reference["tokens"]), "same_tokens": same_tokens,
            "max_logprob_diff": worst, "ok": same_tokens and worst <= tol,
            "prompt_tokens": target.get("prompt_tokens"),
            "target_text": target["text"], "reference_text": reference["text"]}


def run(args: argparse.Namespace) -> int:
    import httpx

    spec = json.loads(args.prompts.read_text())
    max_tokens = args.max_tokens or int(spec.get("max_tokens", 16))
    target, reference = args.target.rstrip("/"), args.reference.rstrip("/")
    if args.wait:
        error = wait_healthy([target, reference], args.wait)
        if error:
            print(f"accuracy: {error}", file=sys.stderr)
            return 2
    cases: list[tuple[str, Any]] = [("completion", p) for p in spec.get("prompts", [])]
    cases += [("chat", m) for m in spec.get("chat", [])]
    rows = []
    with httpx.Client(timeout=args.timeout, headers=_bearer(args.target_api_key)) as client, \
            httpx.Client(timeout=args.timeout, headers=_bearer(args.reference_api_key)) as ref:
        for kind, prompt in cases:
            call = _completion if kind == "completion" else _chat
            try:
                result = compare(call(client, target, prompt, max_tokens),
                                 call(ref, reference, prompt, max_tokens), args.logprob_tol)
            except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
                detail = exc.response.text[:300] if isinstance(exc, httpx.HTTPStatusError) else ""
                result = {"tokens": 0, "same_tokens": False, "max_logprob_diff": None,
                          "ok": False, "error": f"{type(exc).__name__}: {exc} {detail}".strip()}
            label = prompt if kind == "completion" else prompt[-1]["content"]
            rows.append({"kind": kind, "prompt": label, **result})
    passed = all(r["ok"] for r in rows)
    if args.json:
        print(json.dumps({"passed": passed, "tolerance": args.logprob_tol, "rows": rows},
                         indent=2))
    else:
        print_table(rows, args.logprob_tol)
    return 0 if passed else 1


def print_table(rows: list[dict[str, Any]], tol: float) -> None:
    """The rows of a run as ``kvxfer accuracy`` prints them (also for ``--json`` output
    read back by scripts/run_accuracy_test.sh)."""
    print(f"{'kind':10} {'prompt':34} {'tokens':>6} {'same':>5} {'max|dlogp|':>11}  result")
    for r in rows:
        prompt = r["prompt"].replace("\n", " ")
        prompt = prompt if len(prompt) <= 32 else prompt[:31] + "~"
        diff = "-" if r["max_logprob_diff"] is None else f"{r['max_logprob_diff']:.2e}"
        same = "yes" if r["same_tokens"] else "NO"
        print(f"{r['kind']:10} {prompt:34} {r['tokens']:>6} {same:>5} {diff:>11}  "
              f"{'ok' if r['ok'] else 'FAIL'}")
        if "error" in r:
            print(f"    error: {r['error']}")
        elif not r["ok"]:
            print(f"    target:    {r['target_text']!r}\n    reference: {r['reference_text']!r}")
    bad = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - bad}/{len(rows)} match (logprob tolerance {tol:g})")
