# syntax=docker/dockerfile:1
#
# The sidecar example's worker image: SGLang with hicached-client, so that SGLang's
# `dynamic` HiCache storage backend can import hicached_client.sglang.HiCachedStorage.
# Build it from the repository root (the root .dockerignore admits clients/python):
#
#   docker build -f deploy/examples/sidecar/worker.Dockerfile \
#     -t ghcr.io/hicached/sglang-hicached:0.5.23-client0.1.0 .
#
# The SGLang version is the one hicached-client's `sglang` extra supports (0.5.23).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu129

# ---- builder: the client wheel, with its wire code generated from proto/ ----
FROM python:3.11-slim-bookworm AS builder
WORKDIR /src
RUN pip install --no-cache-dir grpcio-tools==1.85.1 setuptools==80.9.0 wheel==0.45.1
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY tools/ tools/
COPY clients/python/ clients/python/
COPY hicached/ hicached/
RUN python tools/gen_proto.py \
    && pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels ./clients/python

# ---- SGLang + the client ----
FROM ${SGLANG_IMAGE}
COPY --from=builder /wheels/ /tmp/wheels/
# The client's own dependencies (grpcio, protobuf) come with it; SGLang and torch are the
# base image's.  The import check fails the build if the backend cannot be loaded.
RUN pip install --no-cache-dir /tmp/wheels/hicached_client-0.1.0-py3-none-any.whl \
    && rm -rf /tmp/wheels \
    && python3 -c "import hicached_client.sglang as m; assert m.HiCachedStorage"
