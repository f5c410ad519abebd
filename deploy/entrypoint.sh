#!/bin/sh
# The image's entrypoint: run the given command, and tell a sidecar which address to
# advertise for its side channel.
#
# `kvxfer serve` advertises its --side-channel-host to decode instances. Inside a
# container 127.0.0.1 reaches nobody, so unless the command names one, the entrypoint
# adds `--side-channel-host ADDR` where ADDR is $KVXFER_SIDE_CHANNEL_HOST, or, when that
# is "auto" (the image's default), the container's own address (what its hostname
# resolves to: Docker and Kubernetes both write it into /etc/hosts).
set -eu

self_address() {
    python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))'
}

if [ "${1:-}" = "kvxfer" ] && [ "${2:-}" = "serve" ]; then
    case " $* " in
        *" --side-channel-host "* | *" --side-channel-host="*) ;;
        *)
            host="${KVXFER_SIDE_CHANNEL_HOST:-auto}"
            if [ "$host" = "auto" ]; then
                host="$(self_address)"
            fi
            if [ -n "$host" ]; then
                set -- "$@" --side-channel-host "$host"
            fi
            ;;
    esac
fi
exec "$@"
