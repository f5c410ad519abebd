#!/usr/bin/env bash
# Runs scripts/run_accuracy_test.sh over a matrix of KV layouts and prefill/decode TP
# sizes and prints one line per configuration. Exits non-zero if any configuration fails.
#
# Usage: scripts/config_sweep_accuracy_test.sh [--kv_buffer_device cpu|cuda]
#
# Environment:
#   SWEEP_LAYOUTS   layouts to sweep (default "LBHNC LBNHC BLHNC BLNHC BHLNC LHBNC")
#   SWEEP_TP_PAIRS  prefill:decode TP pairs (default "1:1 1:3 3:1 3:3" for the default
#                   model, SmolLM2 with 3 KV heads; "1:1 1:2 2:1 2:2" for MODEL=kvxfer-tiny)
#   MODEL, PYTHON, STARTUP_TIMEOUT, LOGPROB_TOL, PREFILLER_BLOCK_SIZE, DECODER_BLOCK_SIZE:
#                   passed through to run_accuracy_test.sh
#
# Layouts that keep tokens outside heads (LBNHC, BLNHC) cannot be head-split by byte
# copies; with a TP change their reads go through staging and a conversion.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
for arg in "$@"; do case "$arg" in -h|--help) usage; exit 0 ;; esac; done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LAYOUTS="${SWEEP_LAYOUTS:-LBHNC LBNHC BLHNC BLNHC BHLNC LHBNC}"
if [[ "${MODEL:-}" == kvxfer-tiny ]]; then DEFAULT_PAIRS="1:1 1:2 2:1 2:2"; else DEFAULT_PAIRS="1:1 1:3 3:1 3:3"; fi
TP_PAIRS="${SWEEP_TP_PAIRS:-$DEFAULT_PAIRS}"

trap 'echo "interrupted" >&2; exit 130' INT TERM
failed=0; ran=0
printf '%-7s %-6s %-8s %s\n' layout 'P->D' result seconds
for layout in $LAYOUTS; do
  for pair in $TP_PAIRS; do
    p="${pair%%:*}"; d="${pair##*:}"
    start=$SECONDS
    log="$(mktemp "${TMPDIR:-/tmp}/kvxfer-sweep.XXXXXX")"
    if KVXFER_KV_CACHE_LAYOUT="$layout" DECODER_KV_LAYOUT="$layout" PREFILLER_TP_SIZE="$p" \
        DECODER_TP_SIZE="$d" "$HERE/run_accuracy_test.sh" "$@" >"$log" 2>&1; then
      result=pass
      rm -f "$log"
    else
      result=FAIL
      failed=$((failed + 1))
      echo "--- output of the failing run ($layout, TP $p->$d):" >&2
      tail -n 30 "$log" >&2
      rm -f "$log"
    fi
    ran=$((ran + 1))
    printf '%-7s %-6s %-8s %s\n' "$layout" "$p->$d" "$result" "$((SECONDS - start))"
  done
done
echo "$((ran - failed))/$ran configurations passed"
[[ "$failed" -eq 0 ]]
