#!/usr/bin/env bash
# Single-GPU speed, in one device call: the Triton kernel tests on the GPU, the kernel micro-benchmark, then
# `ditforge bench` for DiT-XL/2 (256px) and vDiT-XL/222 (16 frames x 256px). Results land in $OUT (or
# benchmarks/results). torchao (FP8) comes as a wheel carried in .whl/ when the machine lacks it:
#   pip download --no-deps -d .whl torchao
# Usage: bash benchmarks/single_gpu.sh [image|video|all]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-benchmarks/results}
what=${1:-all}
python -c "import torchao" 2>/dev/null || pip install -q --no-deps .whl/torchao-*.whl || echo "torchao: not installed"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [[ $what == image || $what == all ]]; then
    python -m pytest -q -x tests/kernels 2>&1 | tail -3
    python benchmarks/adaln_kernels.py --out "$out/adaln_kernels.json"
    python -m ditforge bench --model DiT-XL/2 --image_size 256 --batch_size 64 --outputs "$out"
fi
if [[ $what == video || $what == all ]]; then
    python -m ditforge bench --model vDiT-XL/222 --num_frames 16 --image_size 256 --batch_size 8 --outputs "$out"
fi
