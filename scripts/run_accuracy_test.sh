#!/usr/bin/env bash
# P/D accuracy test: launches prefill and decode sidecars behind the proxy, plus a
# single "both" reference instance, all on free loopback ports, then checks that
# every prompt of scripts/accuracy_prompts.json gives identical greedy tokens and
# log-probabilities within tolerance through the proxy and on the reference.
#
# Usage: scripts/run_accuracy_test.sh [--kv_buffer_device cpu|cuda] [--enable-cross-layers]
#
# Environment:
#   KVXFER_KV_CACHE_LAYOUT  prefill KV layout (LBHNC, LBNHC, BLHNC, BLNHC, BHLNC; default LBHNC)
#   DECODER_KV_LAYOUT       decode KV layout (default: the prefill's)
#   PREFILLER_TP_SIZE       prefill tensor-parallel size (default 1)
#   DECODER_TP_SIZE         decode tensor-parallel size (default 1)
#   NUM_PREFILL_INSTANCES   prefill sidecars (default 1)
#   NUM_DECODE_INSTANCES    decode sidecars (default 1)
#   MODEL                   kvxfer-tiny (default) or a checkpoint directory
#   LOGPROB_TOL             allowed |logprob difference| (default 1e-4)
#   STARTUP_TIMEOUT         seconds to wait for every /health (default 180)
#   PYTHON                  interpreter with kvxfer installed (default: .venv/bin/python,
#                           else python3)
#   KEEP_LOGS=1             keep the per-process logs even when the test passes
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KV_BUFFER_DEVICE=cpu
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kv_buffer_device|--kv-buffer-device) KV_BUFFER_DEVICE="${2:?--kv_buffer_device needs cpu or cuda}"; shift 2 ;;
    --kv_buffer_device=*|--kv-buffer-device=*) KV_BUFFER_DEVICE="${1#*=}"; shift ;;
    --enable-cross-layers) export KVXFER_KV_CACHE_LAYOUT=BLHNC; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$KV_BUFFER_DEVICE" in cpu|cuda) ;; *) echo "--kv_buffer_device must be cpu or cuda, got '$KV_BUFFER_DEVICE'" >&2; exit 2 ;; esac

PREFILL_LAYOUT="${KVXFER_KV_CACHE_LAYOUT:-LBHNC}"
DECODE_LAYOUT="${DECODER_KV_LAYOUT:-$PREFILL_LAYOUT}"
PREFILLER_TP_SIZE="${PREFILLER_TP_SIZE:-1}"
DECODER_TP_SIZE="${DECODER_TP_SIZE:-1}"
NUM_PREFILL_INSTANCES="${NUM_PREFILL_INSTANCES:-1}"
NUM_DECODE_INSTANCES="${NUM_DECODE_INSTANCES:-1}"
MODEL="${MODEL:-kvxfer-tiny}"
LOGPROB_TOL="${LOGPROB_TOL:-1e-4}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-180}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# The KV layout flag below is explicit per instance; the environment must not override it.
unset KVXFER_KV_CACHE_LAYOUT

LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kvxfer-accuracy.XXXXXX")"
PIDS=()
STATUS=1

cleanup() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [[ "$STATUS" -eq 0 && -z "${KEEP_LOGS:-}" ]]; then
    rm -rf "$LOG_DIR"
  else
    echo "logs kept in $LOG_DIR" >&2
  fi
}
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT TERM

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

launch() {  # launch NAME ARGS... : start a sidecar in the background, log to LOG_DIR/NAME.log
  local name="$1"; shift
  "$PYTHON" -m kvxfer.cli --log-level WARNING serve "$@" >"$LOG_DIR/$name.log" 2>&1 &
  PIDS+=("$!")
}

common=(--model "$MODEL" --device "$KV_BUFFER_DEVICE" --host 127.0.0.1 --side-channel-port 0)
# A failed transfer must fail the test, not be hidden by a local recompute.
decode_policy=(--kv-load-failure-policy fail)
prefill_ports=(); decode_ports=()
for i in $(seq "$NUM_PREFILL_INSTANCES"); do
  port="$(free_port)"; prefill_ports+=("$port")
  launch "prefill-$i" --role prefill --port "$port" --tp "$PREFILLER_TP_SIZE" \
    --kv-cache-layout "$PREFILL_LAYOUT" "${common[@]}"
done
for i in $(seq "$NUM_DECODE_INSTANCES"); do
  port="$(free_port)"; decode_ports+=("$port")
  launch "decode-$i" --role decode --port "$port" --tp "$DECODER_TP_SIZE" \
    --kv-cache-layout "$DECODE_LAYOUT" "${decode_policy[@]}" "${common[@]}"
done
ref_port="$(free_port)"
launch reference --role both --port "$ref_port" --tp 1 --kv-cache-layout LBHNC "${common[@]}"
proxy_port="$(free_port)"
"$PYTHON" -m proxy --host 127.0.0.1 --port "$proxy_port" \
  --prefiller-hosts 127.0.0.1 --prefiller-ports "${prefill_ports[@]}" \
  --decoder-hosts 127.0.0.1 --decoder-ports "${decode_ports[@]}" >"$LOG_DIR/proxy.log" 2>&1 &
PIDS+=("$!")

echo "accuracy: prefill ${PREFILL_LAYOUT} TP${PREFILLER_TP_SIZE} x${NUM_PREFILL_INSTANCES}," \
     "decode ${DECODE_LAYOUT} TP${DECODER_TP_SIZE} x${NUM_DECODE_INSTANCES}, model ${MODEL}," \
     "KV on ${KV_BUFFER_DEVICE}"
urls=()
for port in "${prefill_ports[@]}" "${decode_ports[@]}" "$ref_port" "$proxy_port"; do
  urls+=("http://127.0.0.1:$port")
done
if ! "$PYTHON" - "$STARTUP_TIMEOUT" "${urls[@]}" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[1])
for url in sys.argv[2:]:
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{url} not healthy after {sys.argv[1]} s")
        time.sleep(0.2)
PY
then
  echo "accuracy: instances did not come up; see the logs" >&2
  for log in "$LOG_DIR"/*.log; do echo "--- $log"; tail -n 20 "$log"; done >&2
  exit 1
fi

set +e
"$PYTHON" -m kvxfer.cli accuracy --target "http://127.0.0.1:$proxy_port" \
  --reference "http://127.0.0.1:$ref_port" --logprob-tol "$LOGPROB_TOL"
STATUS=$?
set -e
if [[ "$STATUS" -eq 0 ]]; then echo "accuracy: PASS"; else echo "accuracy: FAIL" >&2; fi
exit "$STATUS"
