#!/usr/bin/env bash
# One tiny trial of each training path (TF, torch, DDP, SP, pipeline, bf16, fp16) on this node's GPUs, then a table
# of what ran on which device. Run it on a GPU node, from anywhere:
#
#     benchmarks/gpu_smoke.sh [OUTPUT] [--paths tf,torch,...]
#
# OUTPUT defaults to runs/gpu-smoke. PYTHON picks the interpreter (default: the checkout's .venv). The work is
# benchmarks/gpu_smoke.py's (its docstring says what each path is); this script refuses a node without a GPU first.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_smoke: nvidia-smi not found: this is not a GPU node (or its NVIDIA driver is not installed)" >&2
    exit 2
fi
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu_smoke: nvidia-smi -L lists no GPU: run it on a GPU node" >&2
    exit 2
fi
if [[ -n "${CUDA_VISIBLE_DEVICES+set}" && -z "${CUDA_VISIBLE_DEVICES// /}" ]]; then
    echo "gpu_smoke: CUDA_VISIBLE_DEVICES is set but empty: no GPU is visible" >&2
    exit 2
fi
if [[ ! -x "$python" ]]; then
    echo "gpu_smoke: no Python at $python (set PYTHON, or make the .venv: docs/install.md, GPU nodes)" >&2
    exit 2
fi

exec "$python" "$repo/benchmarks/gpu_smoke.py" "$@"
