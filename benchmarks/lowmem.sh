#!/usr/bin/env bash
# Memory rows of one model in one GPU job: the shared anchors (../shared/anchors/lowmem_finetune.py, unchanged,
# copied into .anchors/) and ditforge's rows through `ditforge train --init_from` (benchmarks/finetune.py).
# Usage (repository root, GPU machine, wheels of diffusers and bitsandbytes in .whl/):
#   bash benchmarks/lowmem.sh sd15 "sd15/adamw_nockpt sd15/bnb8_paged" full_ro_noema,lowmem8_ro
#   bash benchmarks/lowmem.sh dit "" ""     # ditforge bench --memory, DiT-XL/2 256px batch 32, 8 GiB cap
# STEPS, LOG_EVERY and ROW_TIMEOUT (default 30, 10, 240 s) set the rows' length.
# Writes $OUT/<model>_anchor.json, $OUT/<model>.json (or $OUT/bench-*.json) and the logs.
set -uo pipefail
model=$1 anchors=$2 rows=$3
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, diffusers, bitsandbytes, peft, transformers, triton; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, 'bitsandbytes', bitsandbytes.__version__, 'peft', \
peft.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
if [ -n "$anchors" ]; then
    (cd .anchors && python3 lowmem_finetune.py $anchors) 2>&1 | grep --line-buffered -v "gemm_4bit" | tee "$OUT/${model}_anchor.log"
    mv "$OUT/lowmem_anchor.json" "$OUT/${model}_anchor.json"
fi
if [ "$model" = dit ]; then
    python3 -m ditforge bench --memory --model DiT-XL/2 --image_size 256 --batch_size 32 --steps 10 --warmup 5 \
        --gpu_memory_budget 8GiB --outputs "$OUT" 2>&1 | grep --line-buffered -v "gemm_4bit" | tee "$OUT/dit_memory.log"
elif [ -n "$rows" ]; then
    python3 benchmarks/finetune.py --model "$model" --rows "$rows" --steps "${STEPS:-30}" --log_every "${LOG_EVERY:-10}" \
        --row_timeout "${ROW_TIMEOUT:-240}" \
        --json "$OUT/${model}.json" 2>&1 | grep --line-buffered -v "gemm_4bit" | tee "$OUT/${model}.log"
fi
