#!/usr/bin/env bash
# One GPU (the baseline), then every GPU of the host, then the table. Usage: bash benchmarks/multi_gpu.sh OUT_DIR
set -euo pipefail
out=${1:?output folder}
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1
torchrun --standalone --nproc_per_node 1 benchmarks/multi_gpu.py --plugins none --save_plugin "" --json "$out/multi_gpu_1.json"
torchrun --standalone --nproc_per_node "$n" benchmarks/multi_gpu.py --json "$out/multi_gpu_$n.json" --save_dir /tmp/ditforge-bench-ckpt
python3 benchmarks/multi_gpu_table.py "$out/multi_gpu_1.json" "$out/multi_gpu_$n.json"
