#!/usr/bin/env bash
# The one-pass optimizer step on a GPU, in one job: its tests on CUDA, the step alone over DiT-XL/2's parameters
# (benchmarks/optimizer_step.py), then DiT-XL/2 training at batch 64 beside the unchanged anchor
# (../shared/anchors/plain_dit_train.py, copied into .anchors/): `ditforge bench` rows b, c (bf16, fast attention), e (compile) and f
# (+ --fused_optimizer).
# Usage (repository root, GPU machine, bitsandbytes' wheel in .whl/): bash benchmarks/fused_optimizer.sh
set -uo pipefail
out=${OUT:-benchmarks/results/single_gpu}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/bitsandbytes*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, 'bitsandbytes', bitsandbytes.__version__)" 2>&1 | grep -v gemm_4bit
python3 -m pytest -q -p no:cacheprovider --tb=line tests/parallel/test_fused_adamw.py tests/parallel/test_optim.py -k "not slow" 2>&1 | grep -v gemm_4bit | tail -8
python3 benchmarks/optimizer_step.py --out "$out/optimizer_step_h100.json" 2>&1 | grep -v gemm_4bit
(cd .anchors && python3 plain_dit_train.py 64 bf16_compile_ema) 2>&1 | tail -1
python3 -m ditforge bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcef --steps 15 --warmup 5 \
    --outputs "$out" 2>&1 | grep -v gemm_4bit | grep "^|"
