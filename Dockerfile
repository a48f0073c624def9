# syntax=docker/dockerfile:1
#
# hicached container image.
#
#   docker build -t hicached:0.1.0 .                         # CUDA (GPU nodes), the default
#   docker build -t hicached:0.1.0-cpu \
#     --build-arg BASE_IMAGE=ubuntu:24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .   # CPU-only nodes
#
# Runtime base: NVIDIA's CUDA *runtime* image (libcudart, no compiler: the daemon only
# copies memory, it compiles nothing), Ubuntu 24.04, whose Python 3.12 satisfies
# requires-python >= 3.11.  torch comes from the PyTorch index matching the CUDA version;
# the host's NVIDIA driver must be >= what that CUDA version needs (12.8: driver >= 570,
# or >= 525 with forward compatibility).  The CPU variant swaps both for plain Ubuntu and
# the CPU torch wheel; shared memory is then the only data plane.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- builder: generate the wire code from proto/ and build the two wheels ----
FROM python:3.11-slim-bookworm AS builder
WORKDIR /src
RUN pip install --no-cache-dir grpcio-tools==1.85.1 setuptools==80.9.0 wheel==0.45.1
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY tools/ tools/
COPY clients/python/ clients/python/
COPY hicached/ hicached/
# The image's wire code is generated here from proto/, not trusted from the checkout.
RUN python tools/gen_proto.py \
    && pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels ./clients/python .

# ---- runtime ----
FROM ${BASE_IMAGE} AS runtime
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/hicached \
    PATH=/opt/hicached/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Python comes from the base image's distribution (its security updates, not a pin to
# one patch release that the next base image no longer carries).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}"
COPY --from=builder /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir /tmp/wheels/hicached_client-0.1.0-py3-none-any.whl \
        /tmp/wheels/hicached-0.1.0-py3-none-any.whl \
    && rm -rf /tmp/wheels \
    && groupadd --system --gid 10001 hicached \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin hicached \
    && install -d -o 10001 -g 10001 -m 0750 /run/hicached \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/hicached \
    && install -d -m 0755 /etc/hicached

LABEL org.opencontainers.image.title="hicached" \
      org.opencontainers.image.description="Standalone HiCache tiering daemon for LLM inference" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.1.0"

# Where the daemon's defaults point, for ANY uid (Kubernetes may run the image as a uid
# that /etc/passwd does not know, and the image's own user has HOME=/nonexistent): the
# defaults are derived from the XDG variables, so set them here rather than relying on a
# home directory.  XDG_CACHE_HOME=/var/lib puts the L3 file backend at /var/lib/hicached/l3
# and the warm-restart journals at /var/lib/hicached/l2, on the VOLUME below (the same paths
# deploy/base/hicached.toml names); XDG_RUNTIME_DIR=/run puts the socket at
# /run/hicached/hicached.sock, so `hicached status` inside the container needs no flag.
# These are defaults only: a config file, HICACHED_* variables and flags still win.  The
# startup line names the L3 path and where it came from (l3_target, l3_source).
# /metrics listens on every interface, as EXPOSE 9400 promises (the daemon's default is
# loopback only: outside a container that is the safe choice).  Inside a pod that is what
# Prometheus needs, and anyone who can reach the pod's IP can reach it too: restrict who
# with a NetworkPolicy (deploy/base/networkpolicy.yaml admits one namespace), or run with
# `docker run -p 127.0.0.1:9400:9400`; the server itself is bounded (docs/limits.md).
ENV XDG_CACHE_HOME=/var/lib \
    XDG_RUNTIME_DIR=/run \
    HICACHED_SERVER_METRICS_HOST=0.0.0.0

# Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /var/lib/hicached
VOLUME ["/run/hicached", "/var/lib/hicached"]
EXPOSE 50051 9400

# grpc.health.v1 over the daemon's own Unix socket (no TCP listener needed for it).
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["hicached", "status", "--health-only", "--socket", "/run/hicached/hicached.sock"]

# Embedded defaults unless a config is mounted and passed: the DaemonSet replaces CMD
# with --config=/etc/hicached/hicached.toml (which names the TCP token file) and adds
# --listen=0.0.0.0:50051. TCP fails closed (no token, no listener), so the default is
# the Unix socket only.
ENTRYPOINT ["hicached", "serve"]
CMD ["--socket", "/run/hicached/hicached.sock", "--metrics-port", "9400", "--log-format", "json"]
