# Operator image: `pdfleet operator` with kopf and the operator's extras only;
# no torch, triton or transformers (the operator imports the engine's config
# module alone). Build from the repository root:
#
#   docker build -f docker/operator.Dockerfile -t pdfleet-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

WORKDIR /src
COPY pyproject.toml setup.py ./
COPY engine engine
COPY kernels kernels
COPY operator operator
RUN pip install ".[operator]" && cd / && rm -rf /src

RUN useradd --uid 10001 --user-group --no-create-home pdfleet
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090
CMD ["pdfleet", "operator"]
