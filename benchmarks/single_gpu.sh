#!/usr/bin/env bash
# Single-GPU speed through the device tool, in two calls of under 10 minutes each:
#   image: Triton kernel tests on the GPU, the kernel micro-benchmark, `ditforge bench` for DiT-XL/2 (256px):
#          the ablation a-g, compile without the fused kernels with CUDA graphs (rows bce, reduce-overhead),
#          and with op-level activation checkpointing
#   video: `ditforge bench` for vDiT-XL/222 (16 frames x 256px; rows a and b run out of memory), FP8 (row g) on
#          compile without the fused kernels and --find_max_batch for DiT-XL/2
#   profile: benchmarks/profile_step.py for the compiled rows of both models
#   anchor-image: the same-job comparison of issue 18: the kernel tests on the GPU, then `ditforge bench --anchor`
#        (the shared plain_dit_train.py, unchanged, run first) for DiT-XL/2 rows b-f, rows b, c, e, f (compile
#        without the fused kernels), and profile_step.py of row f (kernel time by kind, GPU idle, host syncs)
#   anchor-video: the same for vDiT-XL/222 at 16 frames x 256px, batch 8, against plain_vdit_train.py: rows c-f
#        and c, e, f
#   anchor-sampling: benchmarks/sampling.py --images beside the compiled-diffusers anchor, batch 1 and 8
#   fp8-kernels: the float8 kernels' GPU tests, their launch configurations (quant_kernel.py), the GELU forms
#        (gelu_forms.py) and fp8_epilogue_probe.py (fc2's quantization in fc1's epilogue?)
#   fp8-sampling: the same tests, then benchmarks/sampling.py --images beside the compiled-diffusers anchor: fp32
#        (the PSNR reference), the fastest bf16 path and fp8, batch 1 and 8, with the 15 largest kernels of each
#        batch-8 loop (one batch a call: on a cold machine batch 8 alone takes ~8 of the 10 minutes)
#   speed-quality: benchmarks/speed_quality.py, 2,000-step DiT-S/2 loss curves of the speed modes against bf16
#   fp8: benchmarks/fp8_linear.py, whether float8 matrix products pay at DiT-XL/2's widths in training (per layer,
#        bf16 against torchao's recipes and the bare e4m3 GEMMs)
#   fp8-step: rows b-g with --fp8_recipe ${2:-rowwise} beside the anchor (a call of its own: with fp8 it could
#        exceed 10 minutes)
#   t2v: text-to-video training (cross-attention to 120 synthetic T5-XXL-width caption states, bf16) for
#        vDiT-XL/222 and STDiT-XL/2 at 16 frames x 256px (latents 4x16x32x32): rows b-e (b, bf16 with math
#        attention, is there for its precision: rows are cumulative over the chosen ones)
# Results land in $OUT (or benchmarks/results). torchao (FP8) comes as a wheel carried in .whl/ when the machine
# lacks it:  pip download --no-deps -d .whl torchao
# The anchors are read from .anchors/ (a copy of ../shared/anchors, which does not travel to the GPU machine).
# Usage: bash benchmarks/single_gpu.sh image|video|profile|anchor-image|anchor-video|anchor-sampling|fp8-kernels|fp8-sampling [BATCHES]|speed-quality|fp8|fp8-step [RECIPE]|t2v MODEL
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-benchmarks/results}
python -c "import torchao" 2>/dev/null || python -m pip install -q --no-deps .whl/torchao-*.whl 2>&1 | tail -2
python -c "import torchao.float8; print('torchao', torchao.__version__)" 2>&1 | tail -2 || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
bench="python -m ditforge bench --outputs $out"
case $1 in
image)
    python -m pytest -q -x tests/kernels 2>&1 | tail -1
    python benchmarks/adaln_kernels.py --out "$out/adaln_kernels.json"
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bce --compile_mode reduce-overhead --steps 10
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bce --grad_checkpoint op --steps 10 --warmup 3
    ;;
profile)
    python benchmarks/profile_step.py --model DiT-XL/2 --rows bce --out "$out/profile_dit_xl2_compile.json"
    python benchmarks/profile_step.py --model vDiT-XL/222 --num_frames 16 --batch_size 8 --rows bce \
        --out "$out/profile_vdit_xl222_compile.json"
    ;;
video)
    $bench --model vDiT-XL/222 --num_frames 16 --image_size 256 --batch_size 8 --rows cdeg --steps 10 --warmup 3
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bceg --steps 10 --warmup 3
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcd --steps 2 --warmup 1 --find_max_batch
    ;;
anchor-image)
    python -m pytest -q -x -p no:cacheprovider tests/kernels 2>&1 | tail -1
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcdef --steps 15 --warmup 5 \
        --anchor .anchors/plain_dit_train.py 2>&1 | grep --line-buffered -E "^\||[Ee]rror"
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcef --steps 15 --warmup 5 2>&1 \
        | grep --line-buffered -E "^\||[Ee]rror"
    python benchmarks/profile_step.py --model DiT-XL/2 --rows bcdef --steps 5 --out "$out/profile_dit_xl2_row_f.json"
    ;;
anchor-video)
    $bench --model vDiT-XL/222 --num_frames 16 --image_size 256 --batch_size 8 --rows bcdef --steps 10 --warmup 3 \
        --anchor .anchors/plain_vdit_train.py 2>&1 | grep --line-buffered -E "^\||[Ee]rror"
    $bench --model vDiT-XL/222 --num_frames 16 --image_size 256 --batch_size 8 --rows bcef --steps 10 --warmup 3 \
        2>&1 | grep --line-buffered -E "^\||[Ee]rror"
    ;;
anchor-sampling)
    python -c "import diffusers" 2>/dev/null || python -m pip install -q --no-deps .whl/diffusers-*.whl
    (cd benchmarks && python sampling.py --images --anchor ../.anchors/diffusers_dit_sampling.py \
        --rows fp32,compiled,compiled-no-kernels,eager-graph --repeat 3 --out "$out/sampling.json")
    ;;
fp8-kernels|fp8-sampling)
    python -c "import diffusers" 2>/dev/null || python -m pip install -q --no-deps .whl/diffusers-*.whl
    # a failing test stops the job: no timing of code that is wrong (the first line of each failure is shown)
    python -m pytest -q -p no:cacheprovider tests/kernels/test_quant.py tests/test_sample_fast.py -k "fp8 or quant" \
        > "$out/fp8_tests.log" 2>&1 || { grep -E "^E  |FAILED" "$out/fp8_tests.log" | cut -c1-300; exit 1; }
    tail -1 "$out/fp8_tests.log"
    if [ "$1" = fp8-kernels ]; then
        python benchmarks/quant_kernel.py --out "$out/quant_kernel.json"
        (cd benchmarks && python gelu_forms.py --out "$out/gelu_forms.json")
        python benchmarks/fp8_epilogue_probe.py --out "$out/fp8_epilogue_probe.json"
    else
        (cd benchmarks && python sampling.py --images --anchor ../.anchors/diffusers_dit_sampling.py \
            --rows fp32,compiled-no-kernels,fp8 --batches "${2:-8}" --repeat 5 --top 15 --out "$out/sampling_fp8.json")
    fi
    ;;
speed-quality)
    python benchmarks/speed_quality.py --work /tmp/speed_quality --jobs 5 --json "$out/speed_quality.json" \
        --plot "$out/speed_quality.png"
    ;;
fp8)
    python benchmarks/fp8_linear.py --out "$out/fp8_linear.json"
    ;;
fp8-step)
    echo "row g: --fp8_recipe ${2:-rowwise}"
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcdefg --fp8_recipe "${2:-rowwise}" --steps 10 \
        --warmup 3 --anchor .anchors/plain_dit_train.py 2>&1 | grep --line-buffered -E "^\||[Ee]rror"
    ;;
t2v)
    $bench --model "$2" --batch_size 8 --num_frames 16 --image_size 256 --text_dim 4096 --text_tokens 120 \
        --rows bcde --steps 10 --warmup 3
    ;;
esac
