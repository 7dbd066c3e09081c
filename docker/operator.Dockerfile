# Operator image: `pdfleet operator` with kopf and the operator's extras only;
# no torch, triton or transformers (the operator imports the engine's config
# module alone), and no autoscaling lab (`operator/autoscaling_lab`: the
# simulator, traces, the matrix and its plots are research tools; `pdfleet
# sim` answers that it is not installed). Build from the repository root:
#
#   docker build -f docker/operator.Dockerfile -t pdfleet-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim

# The wheel is built from the sources without the lab, in a stage of its own,
# so that no layer of the final image holds the lab's files.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY engine engine
COPY kernels kernels
COPY operator operator
RUN rm -rf operator/autoscaling_lab && pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/pdfleet-*.whl)[operator]" && rm -rf /wheels

RUN useradd --uid 10001 --user-group --no-create-home pdfleet
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9090
CMD ["pdfleet", "operator"]
