#!/usr/bin/env bash
# Build the kvxfer image on a machine that reaches a Debian archive and a package index
# but no image registry, then smoke-test it. With a registry, a plain
# `docker build -t kvxfer .` does the same (see deploy/README.md).
#
#   deploy/build-image.sh              # base image, build, smoke tests
#   SMOKE=0 deploy/build-image.sh      # build only
#   COMPOSE_UP=0 deploy/build-image.sh # validate compose.yaml, do not run it
#
# Steps:
#   1. tools: docker (Debian's docker.io) and debootstrap, installed with apt when
#      missing (as root); dockerd started when it does not answer.
#   2. base: `debootstrap --variant=minbase` + `docker import` -> $BASE_IMAGE, unless
#      that image exists already (or BASE_IMAGE names one you have).
#   3. build: `docker build` with BuildKit. This machine's pip settings are read with
#      `pip config list` now and passed in: an http(s) index as a build argument, a
#      local index or wheel directory served read-only on 127.0.0.1 for the build (which
#      runs on the host network), pip's CA bundle as the build secret `pip_cert`.
#      Nothing of it is written into the repository or the image.
#   4. smoke (SMOKE=1): a `both` sidecar answers a completion; then a prefill, a decode
#      and the proxy on a user-defined network, with HTTP and side-channel keys as the
#      Kubernetes manifests pass them, answer one request end to end, with the KV read
#      over the network (UCX over TCP) and the same text as the `both`; the
#      compose file is validated and run (COMPOSE_UP=1, the default), with docker-compose
#      from Debian when no compose tool is there.
# Every container, network and helper process it starts is removed on exit, also on
# failure or Ctrl-C.
#
# Environment: IMAGE (kvxfer:dev), BASE_IMAGE (kvxfer-base:bookworm), DEBIAN_SUITE
# (bookworm), DEBIAN_MIRROR (default: the first Debian archive this machine's apt sources
# name; required where they name none), SMOKE (1), COMPOSE_UP (1), SMOKE_TIMEOUT (180 s
# per wait), DOCKER (a docker CLI that builds with BuildKit).
set -euo pipefail

cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-kvxfer:dev}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
BASE_IMAGE=${BASE_IMAGE:-kvxfer-base:${DEBIAN_SUITE}}
SMOKE=${SMOKE:-1}
COMPOSE_UP=${COMPOSE_UP:-1}
SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-180}
RUN_ID="kvxfer-smoke-$$"
WORK=$(mktemp -d)
HELPER_PIDS=()

say() { printf '== %s\n' "$*" >&2; }
die() { printf 'build-image: error: %s\n' "$*" >&2; exit 1; }

apt_mirror() {  # the first http(s) archive of this machine's apt sources (both formats)
    local root=${APT_ROOT:-} files=()
    [ -f "$root/etc/apt/sources.list" ] && files+=("$root/etc/apt/sources.list")
    for f in "$root"/etc/apt/sources.list.d/*.list "$root"/etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && files+=("$f")
    done
    [ ${#files[@]} -gt 0 ] || return 0
    awk '/^[[:space:]]*#/ {next}
         $1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i; exit } }
         $1 == "URIs:" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\//) { print $i; exit } }' \
        "${files[@]}" | head -n 1
}

cleanup() {
    local code=$?
    set +e
    if [ -n "${DOCKER:-}" ] && "$DOCKER" info >/dev/null 2>&1; then
        if [ -n "${COMPOSE:-}" ]; then
            KVXFER_IMAGE="$IMAGE" $COMPOSE -p "$RUN_ID" -f deploy/compose.yaml down -v \
                --remove-orphans >/dev/null 2>&1
        fi
        local ids
        ids=$("$DOCKER" ps -aq --filter "label=kvxfer.smoke=$RUN_ID")
        [ -z "$ids" ] || "$DOCKER" rm -f $ids >/dev/null
        ids=$("$DOCKER" network ls -q --filter "label=kvxfer.smoke=$RUN_ID")
        [ -z "$ids" ] || "$DOCKER" network rm $ids >/dev/null
    fi
    for pid in "${HELPER_PIDS[@]}"; do
        kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    done
    rm -rf "$WORK"
    exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- 1. tools --------------------------------------------------------------------------
need_apt=()
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
[ -x /usr/bin/dockerd ] || command -v dockerd >/dev/null || need_apt+=(docker.io)
if [ "$SMOKE" = 1 ] && ! command -v docker-compose >/dev/null \
        && ! docker compose version >/dev/null 2>&1; then
    need_apt+=(docker-compose)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "install ${need_apt[*]} (as root: apt-get install ${need_apt[*]})"
    say "installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# A docker CLI whose `build` speaks BuildKit (secrets): buildx, or a CLI with the
# built-in BuildKit client (Debian's docker.io). A newer CLI without buildx has neither.
pick_docker() {
    local candidate
    for candidate in ${DOCKER:-} $(type -ap docker); do
        if "$candidate" buildx version >/dev/null 2>&1; then
            DOCKER=$candidate; BUILD=("$candidate" buildx build --load); return 0
        fi
        if DOCKER_BUILDKIT=1 "$candidate" build --help 2>&1 | grep -q -- '--secret'; then
            DOCKER=$candidate; BUILD=("$candidate" build); return 0
        fi
    done
    return 1
}
pick_docker || die "no docker CLI that builds with BuildKit; install docker.io or docker-buildx"
export DOCKER_BUILDKIT=1

if ! "$DOCKER" info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "dockerd does not answer; start it (or run this as root)"
    say "starting dockerd (log: /var/log/kvxfer-dockerd.log)"
    setsid dockerd >/var/log/kvxfer-dockerd.log 2>&1 < /dev/null &
    for _ in $(seq 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 1; done
    "$DOCKER" info >/dev/null 2>&1 || die "dockerd did not start; see /var/log/kvxfer-dockerd.log"
fi

# -- 2. base image ---------------------------------------------------------------------
if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "debootstrap needs root (or set BASE_IMAGE to an image you have)"
    say "base image $BASE_IMAGE: debootstrap --variant=minbase $DEBIAN_SUITE"
    started=$SECONDS
    DEBIAN_MIRROR=${DEBIAN_MIRROR:-$(apt_mirror)}
    [ -n "$DEBIAN_MIRROR" ] || die "this machine's apt sources name no http(s) Debian \
archive to build the base image from: set DEBIAN_MIRROR to one (or BASE_IMAGE to an image \
you have)"
    say "base image from $DEBIAN_MIRROR ($DEBIAN_SUITE)"
    debootstrap --variant=minbase "$DEBIAN_SUITE" "$WORK/rootfs" "$DEBIAN_MIRROR" \
        >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; die "debootstrap failed"; }
    tar -C "$WORK/rootfs" -c . | "$DOCKER" import - "$BASE_IMAGE" >/dev/null
    rm -rf "$WORK/rootfs"
    say "base image built in $((SECONDS - started)) s"
fi

# -- 3. build --------------------------------------------------------------------------
# pip's settings as `pip config list` prints them: key='value', later sources win.
pip_setting() {
    python3 -m pip config list 2>/dev/null \
        | sed -n "s/^[^.]*\.$1='\(.*\)'\$/\1/p" | tail -1
}

# Serve a local directory read-only on 127.0.0.1 for the build; its URL in $URL.
# (Not in a $(...) subshell: the server's PID must reach HELPER_PIDS for the cleanup.)
serve_dir() {
    local dir=$1 port_file="$WORK/port.${#HELPER_PIDS[@]}"
    python3 - "$dir" "$port_file" <<'PY' >>"$WORK/http.log" 2>&1 &
import functools, http.server, os, sys
directory, port_file = sys.argv[1], sys.argv[2]
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=directory)
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
with open(port_file + ".tmp", "w") as out:
    out.write(str(server.server_address[1]))
os.rename(port_file + ".tmp", port_file)
server.serve_forever()
PY
    HELPER_PIDS+=($!)
    for _ in $(seq 100); do [ -s "$port_file" ] && break; sleep 0.1; done
    [ -s "$port_file" ] || die "could not serve $dir for the build"
    URL="http://127.0.0.1:$(cat "$port_file")"
}

# An index (KIND index) or find-links entry as the build can reach it, in $URL (empty:
# skipped): http(s) as it is, a local directory served.
reachable() {
    local entry=$1 kind=$2 path
    URL=""
    case "$entry" in
        http://*|https://*) URL=$entry; return ;;
        file://*) path=${entry#file://} ;;
        *) path=$entry ;;
    esac
    [ -d "$path" ] || { say "skipping pip setting $entry: not a directory"; return; }
    if [ "$kind" = index ]; then
        # serve the index's parent, so that its relative links (../../files/...) resolve
        serve_dir "$(dirname "$path")"
        URL="$URL/$(basename "$path")"
    else
        serve_dir "$path"
    fi
}

build_args=()
index_url=$(pip_setting index-url)
if [ -n "$index_url" ]; then
    reachable "$index_url" index
    [ -z "$URL" ] || build_args+=(--build-arg "PIP_INDEX_URL=$URL")
fi
extra=()
for entry in $(pip_setting extra-index-url); do
    reachable "$entry" index; [ -z "$URL" ] || extra+=("$URL")
done
[ ${#extra[@]} -eq 0 ] || build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=${extra[*]}")
links=()
for entry in $(pip_setting find-links); do
    reachable "$entry" links; [ -z "$URL" ] || links+=("$URL")
done
[ ${#links[@]} -eq 0 ] || build_args+=(--build-arg "PIP_FIND_LINKS=${links[*]}")
trusted=$(pip_setting trusted-host)
[ -z "$trusted" ] || build_args+=(--build-arg "PIP_TRUSTED_HOST=$trusted")
# With an index of its own, this machine's pip finds torch there (the public CPU
# index may not be reachable from here).
if [ -n "$index_url" ] || [ ${#extra[@]} -gt 0 ] || [ ${#links[@]} -gt 0 ]; then
    build_args+=(--build-arg "TORCH_INDEX_URL=")
fi
cert=$(pip_setting cert)
cert=${cert:-${PIP_CERT:-}}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    build_args+=(--secret "id=pip_cert,src=$cert")
fi

say "building $IMAGE on $BASE_IMAGE"
started=$SECONDS
"${BUILD[@]}" --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" "${build_args[@]}" \
    --progress plain -t "$IMAGE" . >"$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log"; die "docker build failed"; }
build_s=$((SECONDS - started))
size=$("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE")
say "built $IMAGE in ${build_s} s: $((size / 1000000)) MB"
grep -o 'torch [0-9][^ ]*' "$WORK/build.log" | tail -1 >&2 || true
[ "$SMOKE" = 1 ] || exit 0

# -- 4. smoke tests --------------------------------------------------------------------
started=$SECONDS
"$DOCKER" network create --label "kvxfer.smoke=$RUN_ID" "$RUN_ID" >/dev/null
# UCX between containers: TCP on the container's interface (cma and shared memory need
# one host's process and IPC namespaces).
ucx=(-e UCX_TLS=tcp -e UCX_NET_DEVICES=eth0)

run() {  # run NAME [DOCKER-OPTIONS... --] [COMMAND...]: a detached container of $IMAGE
    local name=$1 options=()
    shift
    if [[ " $* " == *" -- "* ]]; then
        while [ "$1" != "--" ]; do options+=("$1"); shift; done
        shift
    fi
    "$DOCKER" run -d --label "kvxfer.smoke=$RUN_ID" --name "$RUN_ID-$name" \
        --network "$RUN_ID" "${ucx[@]}" "${options[@]}" "$IMAGE" "$@" >/dev/null
}

# In a container: GET or POST (JSON) a URL, print the body; fail on a non-2xx answer.
http() {  # http CONTAINER URL [BODY [KEY]]: the bearer KEY, when given, is sent
    local container=$1 url=$2 body=${3:-} key=${4:-}
    "$DOCKER" exec -e "SMOKE_KEY=$key" "$container" python3 -c '
import os, sys, urllib.request
url, body, key = sys.argv[1], sys.argv[2], os.environ["SMOKE_KEY"]
headers = {"content-type": "application/json"}
if key:
    headers["authorization"] = "Bearer " + key
request = urllib.request.Request(url, data=body.encode() if body else None, headers=headers)
print(urllib.request.urlopen(request, timeout=60).read().decode())' "$url" "$body"
}

wait_healthy() {  # the image's HEALTHCHECK reports healthy
    local container=$1 status=""
    for _ in $(seq "$SMOKE_TIMEOUT"); do
        status=$("$DOCKER" inspect -f '{{.State.Health.Status}}' "$container" 2>/dev/null || echo gone)
        [ "$status" = healthy ] && return 0
        [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$container")" = true ] || break
        sleep 1
    done
    "$DOCKER" logs --tail 30 "$container" >&2
    die "$container is not healthy ($status)"
}

text_of() {
    python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["text"])'
}

REQUEST='{"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}'

say "smoke: a both sidecar"
run both
wait_healthy "$RUN_ID-both"
want=$(http "$RUN_ID-both" http://127.0.0.1:8000/v1/completions "$REQUEST" | text_of)
say "both answered: ${want@Q}"

say "smoke: prefill, decode and proxy on network $RUN_ID, with keys as deployed"
# The keys the Kubernetes manifests pass: the sidecars' HTTP key ($KVXFER_API_KEY, which
# the proxy also sends them), the clients' key ($KVXFER_PROXY_API_KEY) and the side-channel
# key file ($KVXFER_KV_KEY_FILE: mode 600, owned by the image's user).
new_key() { python3 -c 'import secrets; print(secrets.token_hex(32))'; }
api_key=$(new_key); proxy_key=$(new_key)
new_key > "$WORK/kv.key"
uid=$("$DOCKER" run --rm --entrypoint id "$IMAGE" -u)
chown "$uid" "$WORK/kv.key" && chmod 600 "$WORK/kv.key" \
    || die "cannot hand the kv key file to uid $uid (run as root)"
keys=(-e "KVXFER_API_KEY=$api_key" -e KVXFER_KV_KEY_FILE=/run/kvxfer/kv.key
      -v "$WORK/kv.key:/run/kvxfer/kv.key:ro")
run prefill "${keys[@]}" -- kvxfer serve --role prefill --host 0.0.0.0 --port 8000 \
    --side-channel-port 5600
run decode "${keys[@]}" -- kvxfer serve --role decode --host 0.0.0.0 --port 8000 \
    --kv-load-failure-policy fail
run proxy -e "KVXFER_API_KEY=$api_key" -e "KVXFER_PROXY_API_KEY=$proxy_key" -- \
    kvxfer-proxy --host 0.0.0.0 --port 8000 \
    --prefiller-hosts "$RUN_ID-prefill" --prefiller-ports 8000 \
    --decoder-hosts "$RUN_ID-decode" --decoder-ports 8000 --health-interval 1
for name in prefill decode proxy; do wait_healthy "$RUN_ID-$name"; done
if http "$RUN_ID-proxy" http://127.0.0.1:8000/v1/completions "$REQUEST" >/dev/null 2>&1; then
    die "the proxy answered a request without its key"
fi
got=$(http "$RUN_ID-proxy" http://127.0.0.1:8000/v1/completions "$REQUEST" "$proxy_key" \
    | text_of)
say "proxy answered: ${got@Q}"
[ "$got" = "$want" ] || die "the disaggregated answer differs from the both sidecar's"
reads=$(http "$RUN_ID-decode" http://127.0.0.1:8000/metrics "" "$api_key" \
    | sed -n 's/^kvxfer_kv_transfers_total{outcome="ok"} //p')
[ "${reads%.*}" -ge 1 ] 2>/dev/null || die "the decode read no KV (kvxfer_kv_transfers_total ok=$reads)"
say "decode read the KV over the network, side channel signed ($reads reads)"

COMPOSE=""
if command -v docker-compose >/dev/null; then COMPOSE=docker-compose
elif "$DOCKER" compose version >/dev/null 2>&1; then COMPOSE="$DOCKER compose"
fi
if [ -n "$COMPOSE" ]; then
    KVXFER_IMAGE="$IMAGE" $COMPOSE -p "$RUN_ID" -f deploy/compose.yaml config -q \
        || die "deploy/compose.yaml does not validate"
    say "deploy/compose.yaml validates ($COMPOSE)"
    if [ "$COMPOSE_UP" = 1 ]; then
        say "smoke: deploy/compose.yaml up"
        KVXFER_MODEL=kvxfer-tiny KVXFER_IMAGE="$IMAGE" $COMPOSE -p "$RUN_ID" -f deploy/compose.yaml up -d >/dev/null
        proxy=$($COMPOSE -p "$RUN_ID" -f deploy/compose.yaml ps -q proxy)
        wait_healthy "$proxy"
        got=$(http "$proxy" http://127.0.0.1:8000/v1/completions "$REQUEST" | text_of)
        [ "$got" = "$want" ] || die "compose: the answer differs from the both sidecar's"
        say "compose answered: ${got@Q}"
    fi
else
    say "no docker-compose: deploy/compose.yaml not validated here"
fi
say "smoke tests passed in $((SECONDS - started)) s; $IMAGE is $((size / 1000000)) MB"
