#!/usr/bin/env bash
# P/D accuracy test: launches prefill and decode sidecars behind the proxy, plus a
# single "both" reference instance, all on free loopback ports, then checks that
# every prompt of scripts/accuracy_prompts.json gives identical greedy tokens and
# log-probabilities within tolerance through the proxy and on the reference.
#
# Usage: scripts/run_accuracy_test.sh [--kv_buffer_device cpu|cuda] [--enable-cross-layers]
#
# Environment:
#   KVXFER_KV_CACHE_LAYOUT  prefill KV layout (LBHNC, LBNHC, BLHNC, BLNHC, BHLNC, LHBNC; default LBHNC)
#   DECODER_KV_LAYOUT       decode KV layout (default: the prefill's)
#   PREFILLER_TP_SIZE       prefill tensor-parallel size (default 1)
#   DECODER_TP_SIZE         decode tensor-parallel size (default 1)
#   PREFILLER_BLOCK_SIZE    prefill KV block size in tokens (default 16)
#   DECODER_BLOCK_SIZE      decode KV block size (default: the prefill's); one of the two
#                           must be a multiple of the other
#   NUM_PREFILL_INSTANCES   prefill sidecars (default 1)
#   NUM_DECODE_INSTANCES    decode sidecars (default 1)
#   DECODER_PREFIX_CACHE=1  the decode runs with --enable-prefix-caching and the prompt set
#                           is sent twice: the second pass must find every whole block of
#                           every prompt (pull: whole blocks of both sizes; push: of the
#                           decode's, short of the last token) in the decode's cache,
#                           checked on its /metrics, move only the rest, and still match the
#                           reference (one decode instance only)
#   KVXFER_TRANSFER_MODE    pull (default: the decode reads the prefill's KV) or push (the
#                           decode reserves blocks first, the prefill writes each layer's KV
#                           into them as it computes it; the proxy and the decodes run with
#                           --kv-transfer-mode push). Where a read would convert, the
#                           prefill converts before it writes: every pair runs both ways
#   MODEL                   a model name (smollm2-135m-instruct, the default; kvxfer-tiny,
#                           seeded and fast; kvxfer-tiny-mla, the same with a latent (MLA)
#                           cache on every rank), a .gguf file or a checkpoint directory; the
#                           engine runs it in float32. SmolLM2 has 3 KV heads: TP 1 or 3.
#   LOGPROB_TOL             allowed |logprob difference| (default 1e-4)
#   STARTUP_TIMEOUT         seconds to wait for every instance to be ready (default 180)
#   REFERENCE_URL           compare with the single instance already serving there (a
#                           `kvxfer serve --role both --tp 1` of the same MODEL) instead of
#                           starting one: several runs can share one; its HTTP key, if it has
#                           one, in REFERENCE_API_KEY
#   PYTHON                  interpreter with kvxfer installed (default: .venv/bin/python,
#                           else python3)
#   KEEP_LOGS=1             keep the per-process logs even when the test passes
#
# HTTP keys are on, as in a deployment: a random one for the sidecars ($KVXFER_API_KEY,
# which the proxy also reads as its --upstream-api-key) and one for the proxy's clients
# ($KVXFER_PROXY_API_KEY); `kvxfer accuracy` sends them. The KV key is on too: a random
# one in a temporary 0600 file ($KVXFER_KV_KEY_FILE), removed on exit.
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
PREFILLER_BLOCK_SIZE="${PREFILLER_BLOCK_SIZE:-16}"
DECODER_BLOCK_SIZE="${DECODER_BLOCK_SIZE:-$PREFILLER_BLOCK_SIZE}"
NUM_PREFILL_INSTANCES="${NUM_PREFILL_INSTANCES:-1}"
NUM_DECODE_INSTANCES="${NUM_DECODE_INSTANCES:-1}"
DECODER_PREFIX_CACHE="${DECODER_PREFIX_CACHE:-}"
if [[ -n "$DECODER_PREFIX_CACHE" && "$NUM_DECODE_INSTANCES" != 1 ]]; then
  echo "DECODER_PREFIX_CACHE needs NUM_DECODE_INSTANCES=1 (the proxy spreads a second pass" \
       "over the decodes, whose caches are their own)" >&2
  exit 2
fi
TRANSFER_MODE="${KVXFER_TRANSFER_MODE:-pull}"
case "$TRANSFER_MODE" in pull|push) ;; *) echo "KVXFER_TRANSFER_MODE must be pull or push, got '$TRANSFER_MODE'" >&2; exit 2 ;; esac
MODEL="${MODEL:-smollm2-135m-instruct}"
LOGPROB_TOL="${LOGPROB_TOL:-1e-4}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-180}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# The KV layout flag below is explicit per instance; the environment must not override it.
unset KVXFER_KV_CACHE_LAYOUT
new_key() { "$PYTHON" -c 'import secrets; print("sk-" + secrets.token_urlsafe(24))'; }
KVXFER_API_KEY="$(new_key)"; KVXFER_PROXY_API_KEY="$(new_key)"
export KVXFER_API_KEY KVXFER_PROXY_API_KEY
KVXFER_KV_KEY_FILE="$(mktemp "${TMPDIR:-/tmp}/kvxfer-kv.XXXXXX")"  # mode 0600
"$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' >"$KVXFER_KV_KEY_FILE"
export KVXFER_KV_KEY_FILE

LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/kvxfer-accuracy.XXXXXX")"
PIDS=()
STATUS=1

running() {
  local pid
  for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

cleanup() {
  trap - EXIT INT TERM
  # SIGINT, then SIGTERM: a serving sidecar or proxy stops at the first (a sidecar taking
  # SIGTERM first drains, which takes seconds even when idle; once stopping, it only
  # stops); a process still starting up ignores SIGINT (a background job of a script)
  # and ends at SIGTERM. SIGKILL for whatever still runs after 5 s.
  local pid
  for pid in "${PIDS[@]}"; do  # || true: one that already exited must not end the cleanup
    kill -INT "$pid" 2>/dev/null || true
    kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq 50); do running || break; sleep 0.1; done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -f "$KVXFER_KV_KEY_FILE"
  if [[ "$STATUS" -eq 0 && -z "${KEEP_LOGS:-}" ]]; then
    rm -rf "$LOG_DIR"
  else
    echo "logs kept in $LOG_DIR" >&2
  fi
}
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT TERM

NAMES=()

launch() {  # launch NAME CMD... : start a process in the background, log to LOG_DIR/NAME.log
  local name="$1"; shift
  "$@" >"$LOG_DIR/$name.log" 2>&1 &
  PIDS+=("$!"); NAMES+=("$name")
}

# wait_ready NAME... : every named process binds port 0 and prints "... ready: URL" once
# it serves; print "NAME URL" per process. Fails at once if one exits, or at the deadline.
# (Port 0 lets the kernel pick: no race with other programs for a port chosen in advance.)
wait_ready() {
  local args=() name i
  for name in "$@"; do
    for i in "${!NAMES[@]}"; do
      [[ "${NAMES[$i]}" == "$name" ]] && args+=("$name" "${PIDS[$i]}" "$LOG_DIR/$name.log")
    done
  done
  "$PYTHON" - "$STARTUP_TIMEOUT" "${args[@]}" <<'PY'
import os, re, sys, time
deadline = time.monotonic() + float(sys.argv[1])
pending = [sys.argv[i:i + 3] for i in range(2, len(sys.argv), 3)]
ready = re.compile(r"ready: (http://\S+)")

def alive(pid):
    try:  # a zombie (exited, not yet reaped by the script) counts as gone
        return open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: signal 0 only tells that the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

while pending:
    name, pid, log = pending[0]
    with open(log, errors="replace") as f:
        found = ready.search(f.read())
    if found:
        print(name, found[1])
        pending.pop(0)
        continue
    if not alive(int(pid)):
        sys.exit(f"{name} exited before it was ready")
    if time.monotonic() > deadline:
        sys.exit(f"{name} not ready after {sys.argv[1]} s")
    time.sleep(0.1)
PY
}

show_logs() {
  for log in "$LOG_DIR"/*.log; do echo "--- $log"; tail -n 20 "$log"; done >&2
}

serve=("$PYTHON" -m kvxfer.cli --log-level WARNING serve)
common=(--model "$MODEL" --device "$KV_BUFFER_DEVICE" --host 127.0.0.1 --port 0
        --side-channel-port 0)
# A failed transfer must fail the test, not be hidden by a local recompute.
decode_policy=(--kv-load-failure-policy fail)
decode_cache=()
[[ -n "$DECODER_PREFIX_CACHE" ]] && decode_cache=(--enable-prefix-caching)
sidecars=()
for i in $(seq "$NUM_PREFILL_INSTANCES"); do
  launch "prefill-$i" "${serve[@]}" --role prefill --tp "$PREFILLER_TP_SIZE" \
    --block-size "$PREFILLER_BLOCK_SIZE" --kv-cache-layout "$PREFILL_LAYOUT" "${common[@]}"
  sidecars+=("prefill-$i")
done
for i in $(seq "$NUM_DECODE_INSTANCES"); do
  launch "decode-$i" "${serve[@]}" --role decode --tp "$DECODER_TP_SIZE" \
    --block-size "$DECODER_BLOCK_SIZE" --kv-cache-layout "$DECODE_LAYOUT" \
    --kv-transfer-mode "$TRANSFER_MODE" "${decode_policy[@]}" "${decode_cache[@]}" "${common[@]}"
  sidecars+=("decode-$i")
done
REFERENCE_URL="${REFERENCE_URL:-}"
if [[ -z "$REFERENCE_URL" ]]; then
  launch reference "${serve[@]}" --role both --tp 1 --kv-cache-layout LBHNC "${common[@]}"
  sidecars+=(reference)
fi

echo "accuracy: prefill ${PREFILL_LAYOUT} TP${PREFILLER_TP_SIZE} block ${PREFILLER_BLOCK_SIZE}" \
     "x${NUM_PREFILL_INSTANCES}, decode ${DECODE_LAYOUT} TP${DECODER_TP_SIZE} block" \
     "${DECODER_BLOCK_SIZE} x${NUM_DECODE_INSTANCES}, model ${MODEL}," \
     "KV on ${KV_BUFFER_DEVICE}, ${TRANSFER_MODE}${DECODER_PREFIX_CACHE:+, decode prefix cache cold then warm}${REFERENCE_URL:+, reference at $REFERENCE_URL}"
if ! urls="$(wait_ready "${sidecars[@]}")"; then
  echo "accuracy: instances did not come up; see the logs" >&2
  show_logs
  exit 1
fi
url_of() { awk -v n="$1" '$1 == n { print $2 }' <<<"$urls"; }
port_of() { local url; url="$(url_of "$1")"; echo "${url##*:}"; }
prefill_ports=(); decode_ports=()
for i in $(seq "$NUM_PREFILL_INSTANCES"); do prefill_ports+=("$(port_of "prefill-$i")"); done
for i in $(seq "$NUM_DECODE_INSTANCES"); do decode_ports+=("$(port_of "decode-$i")"); done
launch proxy "$PYTHON" -m proxy --host 127.0.0.1 --port 0 --kv-transfer-mode "$TRANSFER_MODE" \
  --prefiller-hosts 127.0.0.1 --prefiller-ports "${prefill_ports[@]}" \
  --decoder-hosts 127.0.0.1 --decoder-ports "${decode_ports[@]}"
if ! proxy_url="$(wait_ready proxy)"; then
  echo "accuracy: the proxy did not come up; see the logs" >&2
  show_logs
  exit 1
fi
proxy_url="${proxy_url#proxy }"

if [[ -n "$REFERENCE_URL" ]]; then
  reference=(--reference "$REFERENCE_URL" --reference-api-key "${REFERENCE_API_KEY:-}")
else
  reference=(--reference "$(url_of reference)")  # its key: $KVXFER_API_KEY, the default
fi
accuracy() {
  "$PYTHON" -m kvxfer.cli accuracy --target "$proxy_url" "${reference[@]}" \
    --logprob-tol "$LOGPROB_TOL" --wait "$STARTUP_TIMEOUT" "$@"
}

# decode_counters: the decode's KV read and prefix cache counters, as JSON
decode_counters() {
  "$PYTHON" - "$(url_of decode-1)" <<'PY'
import json, os, sys
import httpx
from prometheus_client.parser import text_string_to_metric_families
headers = {"authorization": f"Bearer {os.environ['KVXFER_API_KEY']}"}
text = httpx.get(f"{sys.argv[1]}/metrics", headers=headers, timeout=10).text
names = ("kvxfer_prefix_cache_queries_total", "kvxfer_prefix_cache_hits_total",
         "kvxfer_kv_transfer_bytes_total", "kvxfer_kv_reads_skipped_total")
print(json.dumps({s.name: s.value for f in text_string_to_metric_families(text)
                  for s in f.samples if s.name in names}))
PY
}

# check_warm COLD_BEFORE WARM_BEFORE WARM_JSON: print the warm pass's table, then check on
# the decode's counters that it found every whole block of every prompt in the cache.
check_warm() {
  "$PYTHON" - "$1" "$2" "$(decode_counters)" "$3" "$PREFILLER_BLOCK_SIZE" \
    "$DECODER_BLOCK_SIZE" "$TRANSFER_MODE" <<'PY'
import json, math, sys
from kvxfer.commands.accuracy import print_table
cold, before, after = (json.loads(a) for a in sys.argv[1:4])
run = json.load(open(sys.argv[4]))
print_table(run["rows"], run["tolerance"])
# the decode continues from the prefill's first token: it needs every prompt token's KV
# (the first output token is the one always computed)
needed = [r["prompt_tokens"] for r in run["rows"]]
if sys.argv[7] == "pull":  # a hit ends on whole blocks of both: the rest is read whole
    unit = math.lcm(int(sys.argv[5]), int(sys.argv[6]))
    hits = [n // unit * unit for n in needed]
else:  # push: reserved before the first token is known, short of the last prompt token
    unit = int(sys.argv[6])
    hits = [(n - 1) // unit * unit for n in needed]
want = {"kvxfer_prefix_cache_queries_total": sum(needed),
        "kvxfer_prefix_cache_hits_total": sum(hits),
        "kvxfer_kv_reads_skipped_total": sum(1 for n, h in zip(needed, hits) if n and n == h)}
got = {k: after[k] - before[k] for k in after}
read_cold = before["kvxfer_kv_transfer_bytes_total"] - cold["kvxfer_kv_transfer_bytes_total"]
print(f"accuracy: warm pass: {got['kvxfer_prefix_cache_hits_total']:.0f} of "
      f"{got['kvxfer_prefix_cache_queries_total']:.0f} prompt tokens found in the decode's "
      f"prefix cache (expected {want['kvxfer_prefix_cache_hits_total']}), "
      f"{got['kvxfer_kv_reads_skipped_total']:.0f} reads skipped, "
      f"{got['kvxfer_kv_transfer_bytes_total']:.0f} bytes "
      f"{'read' if sys.argv[7] == 'pull' else 'written'} (cold pass: {read_cold:.0f})")
wrong = [k for k, v in want.items() if got[k] != v]
if not got["kvxfer_kv_transfer_bytes_total"] < read_cold:
    wrong.append("kvxfer_kv_transfer_bytes_total")
if wrong:
    sys.exit(f"accuracy: the warm pass did not use the decode's prefix cache as expected: "
             f"{', '.join(wrong)}")
sys.exit(0 if run["passed"] else 1)
PY
}

set +e
if [[ -z "$DECODER_PREFIX_CACHE" ]]; then
  accuracy
  STATUS=$?
else
  cold="$(decode_counters)"
  echo "accuracy: pass 1 of 2, the decode's prefix cache cold"
  accuracy
  STATUS=$?
  if [[ "$STATUS" -eq 0 ]]; then
    warm="$(decode_counters)"
    echo "accuracy: pass 2 of 2, the same prompts again, the decode's prefix cache warm"
    accuracy --json >"$LOG_DIR/warm.json"
    STATUS=$?
    if [[ -s "$LOG_DIR/warm.json" ]]; then
      check_warm "$cold" "$warm" "$LOG_DIR/warm.json"
      STATUS=$?
    fi
  fi
fi
set -e
if [[ "$STATUS" -eq 0 ]]; then echo "accuracy: PASS"; else echo "accuracy: FAIL" >&2; fi
exit "$STATUS"
