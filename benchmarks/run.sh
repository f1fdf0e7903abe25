#!/usr/bin/env bash
# The GPU benchmark jobs, each sized to one device call of under 10 minutes. benchmarks/README.md lists which job
# (or direct command) reproduces each figure of the README and docs/.
#
# Usage, from the repository root on the GPU machine:  bash benchmarks/run.sh JOB [ARGS]
#   anchor-image        DiT-XL/2 256px batch 64: `ditforge bench` rows b-f beside the unchanged plain_dit_train.py
#                       (run first, same job), rows b, c, e, f (compile without the fused kernels), then
#                       profile_step.py of row f (kernel time by kind, GPU idle, host syncs)
#   anchor-video        the same for vDiT-XL/222 at 16 frames x 256px, batch 8, against plain_vdit_train.py
#   ablation-image      the kernel tests on the GPU, kernel_speed.py adaln, `ditforge bench` DiT-XL/2 rows a-g, rows b, c,
#                       e with CUDA graphs (reduce-overhead) and with op-level activation checkpointing
#   ablation-video      `ditforge bench` vDiT-XL/222 rows b-e, g and row c alone (fp32 + fast attention); DiT-XL/2
#                       rows b, c, e, g (compile without the fused kernels, + FP8); DiT-XL/2 --find_max_batch
#   profile             profile_step.py of the compiled rows (b, c, e) of DiT-XL/2 and vDiT-XL/222
#   fp8-step [RECIPE]   DiT-XL/2 rows b-g with --fp8_recipe RECIPE (default rowwise) beside the anchor
#   t2v MODEL           text-to-video training rows b-e at 16 frames x 256px, 120 caption tokens of width 4096
#   optimizer           the one-pass optimizer step's CUDA tests, kernel_speed.py optimizer-step, the anchor, bench rows
#                       b, c, e, f
#   sampling [BATCHES] [ROWS] [STEPS]  the float8 tests (a failure stops the job: no timing of wrong code), then
#                       sampling.py --images beside the compiled-diffusers anchor (run first, same job) at batch
#                       BATCHES (default 8; one batch a call: on a cold machine batch 8 alone takes ~8 minutes),
#                       rows ROWS (default fp32,compiled-no-kernels,fp8), STEPS sampling steps of our rows (default
#                       50; the anchor always runs 50), the 15 largest kernels of each loop
#   fp8-kernels         the float8 tests, then kernel_speed.py fp8 (launch configurations of the quantization passes)
#   speed-quality       quality_curves.py speed: 2,000-step DiT-S/2 loss curves of the speed modes against bf16
#   fp8-train           issue 45's FP8 rows: kernel_speed.py fp8-train (a DiT block's step in bf16 and float8 by width,
#                       the --fp8_min_width policy), then `ditforge bench --memory` vDiT-7B/222 at 8,192 tokens on one
#                       GPU (8-bit AdamW, bf16 weights), bf16 then --mixed_precision fp8 (needs bitsandbytes, torchao)
#   fp8-quality         quality_curves.py speed at width 4096 (DiT-7B/2 with 2 blocks, 16 px digits): 2,000-step
#                       curves of bf16, its second seed and fp8
#   video-quality [STEPS]  quality_curves.py video: LoRA r32 on the Wan2.1-T2V-1.3B config (random weights) on the
#                       built-in clips at 128 px x 9 frames, STEPS steps (default 1,000; the last 200 judged), bf16
#                       base, its second seed and --fp8_base, 3 at once (issue 42; needs peft, ftfy, scikit-video)
#   finetune MODEL "ANCHOR_ROWS" ROWS  one model's fine-tuning rows in one job: the lowmem_finetune.py anchor rows
#                       (e.g. "sd15/adamw_nockpt sd15/ao_offload"), then ditforge's rows through finetune.py (MODEL
#                       sd15 | pixart | sdxl; ROWS as finetune.py names them); STEPS, LOG_EVERY and ROW_TIMEOUT
#                       (default 30, 10, 240 s) set the rows' length
#   finetune-wan [FIRST] [ANCHOR_ROWS] [REST]  Wan2.1-T2V-1.3B (random weights, 640 x 640 x 81 frames: latents
#                       16 x 21 x 80 x 80, 512 x 4096 caption states, batch 1; issue 42): finetune.py --model wan13
#                       builds the folder and features and times rows FIRST (default lora32), then the unchanged
#                       wan_finetune.py anchor rows (default "wan1.3b/lora wan1.3b/full", at 480 x 832; "" skips it),
#                       then rows REST (default full,lora32_budget8,lora32_compile,full_compile; --append: one
#                       wan13.json). The job stops itself after JOB_LIMIT s (default 530), keeping the rows it
#                       finished; STEPS, LOG_EVERY, ROW_TIMEOUT default 6, 2, 240 s. TINY=1: the tests' tiny Wan and
#                       the anchor's tiny config (a CPU check of the job)
#   finetune-wan14 [FIRST] [ANCHOR_ROWS] [REST]  the same for Wan2.1-T2V-14B (finetune.py --model wan14, saved in
#                       bf16): FIRST default lora32_swap20_off_budget24, the anchor's wan14b/lora, REST default lora32
#   finetune-cog5b [ROWS]  CogVideoX-5B (random weights, 592 x 592 x 49 frames: latents 16 x 13 x 74 x 74, 226 x 4096
#                       caption states, batch 1; issue 42): finetune.py --model cog5b, rows ROWS (default
#                       lora64_ckpt,lora64_ckpt_budget24), the same STEPS / LOG_EVERY / ROW_TIMEOUT / JOB_LIMIT / TINY
#   finetune-hv13b [ROWS]  HunyuanVideo (random weights of the released config, 544 x 544 x 61 frames: latents 16 x 16
#                       x 68 x 68, 256 x 4096 caption states, batch 1; issue 42): finetune.py --model hv13b, rows ROWS
#                       (default lora32_off_budget24,lora32), the same STEPS / LOG_EVERY / ROW_TIMEOUT / JOB_LIMIT /
#                       TINY
#   finetune-wan5b [ROWS], finetune-ltx2b [ROWS]  the same for Wan 2.2 TI2V-5B at 960 x 960 x 121 and LTX-Video at
#                       576 x 576 x 161 (finetune.py --model wan5b | ltx2b)
#   sample-wan [ROWS] [STEPS] [ANCHOR]  Wan2.1-T2V-1.3B sampling at 480 x 832 x 81 frames, guidance 5 (issue 43):
#                       the unchanged wan_sampling.py anchor at STEPS steps (default 10; ANCHOR "none" skips it),
#                       then sample_wan.py's ROWS (default eager,compiled,fp8,fp32) under torchrun with NPROC
#                       processes (default 1); REPEAT, WARMUP_STEPS (default 2, 2), PROFILE (N > 0: the N largest
#                       kernels of 2 profiled steps a row, GPU time by kind) and TAG (the result file's suffix,
#                       default 1gpu) set the rest
#   exact-attention     kernel_speed.py exact-attention at Wan-1.3B's self-attention (2 x 32,760 tokens x 12 heads of
#                       128) and CogVideoX-5B's (2 x 17,776 x 48 of 64): cuDNN, FlashAttention-4 and what the per-shape
#                       choice took, into exact_attention_<shape>.json (needs ditforge[fa4]'s wheels)
#   vae-decode [ROWS]   vae_decode.py's ROWS (default all) of the Wan VAE's 81-frame decode into vae_decode.json
#                       (TORCH_LOGS=graph_breaks in the environment says where the decoder breaks, if it does)
#   sample-cog [ROWS] [STEPS]  CogVideoX-5B sampling at 480 x 720 x 49 frames, guidance 6 (issue 43): sample_wan.py
#                       --model cog5b, rows ROWS (default diffusers_compiled,compiled: diffusers' CogVideoXPipeline
#                       with compile_repeated_blocks, then ditforge --compile) of STEPS DPM steps (default 10), one
#                       median of REPEAT (default 2) timed calls each after a 1-step warm-up; PSNR / SSIM against REFERENCE (default the
#                       diffusers row: the same seed draws the same video)
#   sample-hv [ROWS] [STEPS]  the same for HunyuanVideo (12.8B) at 480 x 848 x 61 frames, its guidance 6 embedded
#                       (sample_wan.py --model hv13b)
#   memory-dit [CKPT] [ROWS]  `ditforge bench --memory` on DiT-XL/2 256px batch 32: the plain row, the memory rows
#                       ROWS (default noema,8bit,sr,capped) with --grad_checkpoint CKPT (default every-2) under
#                       8 GiB, the plain row again
#   multi-gpu           multi_gpu.py on 1 GPU, then on every GPU of the host, then the table
#   scale [ROWS]        issue 45's large-DiT rows on every GPU of the host through multi_gpu.py, one torchrun a row,
#                       into scale_<GPUs>gpu.json: ROWS (default "7b8k 7b8k_b2 7b64k") of 7b8k (vDiT-7B/222, 512 px x 16
#                       latent frames: 8,192 tokens; zero2, batch 1), 7b8k_b2 (zero2, batch 2, op checkpointing),
#                       7b64k (1,024 px x 32 frames: 65,536 tokens; fsdp, Ulysses over all GPUs, full checkpointing),
#                       7b8k_tp2 (zero2 over 2 x --tensor_parallel 2, batch 2 per data-parallel group), 7b64k_ring
#                       (7b64k with ring attention); all with fast attention, compile, EMA, 5 steps after 3;
#                       PROFILE=1 adds rank 0's GPU kernel time per step by kind (communication, matrix products,
#                       attention, ...)
#   single-file [MODEL] [bf16|fp8]  host RAM and time to load a single-file Wan transformer, bf16 and fp8 (issue 63):
#                       single_file.py --model MODEL (default 14b: about 28 GB of bf16 file, written first under
#                       /tmp) beside diffusers' from_single_file
#
# Row g (FP8) at width 1152 or 2048 runs with --fp8_min_width 16: every block linear in float8, as those rows were
# measured before the width policy (which keeps them bf16).
#
# Results land in $OUT (default benchmarks/results). Wheels the machine lacks (diffusers, bitsandbytes, torchao;
# peft, ftfy and its wcwidth for finetune-wan:
# `pip download --no-deps -d .whl PACKAGE==VERSION`) are carried in .whl/ and installed into /tmp/site. The anchors
# are read from .anchors/, a copy of ../shared/anchors (which does not travel to the GPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${OUT:-benchmarks/results}"
out=$(realpath "${OUT:-benchmarks/results}")
export OUT=$out  # absolute: some jobs run from benchmarks/ or .anchors/, and the anchors write their JSON there
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    # flash-attn-4's CuTe DSL: its wheel puts cutlass on the path by a .pth file, which --target installs do not run
    dsl=/tmp/site/nvidia_cutlass_dsl/dsl_packages
    [ -d $dsl ] && export PYTHONPATH=$PYTHONPATH:$dsl
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
bench="python3 -m ditforge bench --outputs $out"
rows_only() { grep --line-buffered -v gemm_4bit | grep --line-buffered -E "^\||[Ee]rror"; }
fp8_tests() {  # a failing test stops the job; the first line of each failure is shown
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant.py tests/test_sample_fast.py -k "fp8 or quant" \
        > "$out/fp8_tests.log" 2>&1 || { grep -E "^E  |FAILED" "$out/fp8_tests.log" | cut -c1-300; exit 1; }
    tail -1 "$out/fp8_tests.log"
}
job=${1:?job: see the top of benchmarks/run.sh}
case $job in
anchor-image)
    python3 -m pytest -q -x -p no:cacheprovider tests/kernels 2>&1 | tail -1
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcdef --steps 15 --warmup 5 \
        --anchor .anchors/plain_dit_train.py 2>&1 | rows_only
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcef --steps 15 --warmup 5 2>&1 | rows_only
    python3 benchmarks/profile_step.py --model DiT-XL/2 --rows bcdef --steps 5 --out "$out/profile_dit_xl2_row_f.json"
    ;;
anchor-video)
    $bench --model vDiT-XL/222 --num_frames 16 --image_size 256 --batch_size 8 --rows bcdef --steps 10 --warmup 3 \
        --anchor .anchors/plain_vdit_train.py 2>&1 | rows_only
    $bench --model vDiT-XL/222 --num_frames 16 --image_size 256 --batch_size 8 --rows bcef --steps 10 --warmup 3 \
        2>&1 | rows_only
    ;;
ablation-image)
    python3 -m pytest -q -x -p no:cacheprovider tests/kernels 2>&1 | tail -1
    python3 benchmarks/kernel_speed.py adaln --out "$out/adaln_kernels.json"
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --fp8_min_width 16
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bce --compile_mode reduce-overhead --steps 10
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bce --grad_checkpoint op --steps 10 --warmup 3
    ;;
ablation-video)
    $bench --model vDiT-XL/222 --num_frames 16 --image_size 256 --batch_size 8 --rows bcdeg --steps 10 --warmup 3 \
        --fp8_min_width 16
    $bench --model vDiT-XL/222 --num_frames 16 --image_size 256 --batch_size 8 --rows c --steps 10 --warmup 3
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bceg --steps 10 --warmup 3 --fp8_min_width 16
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcd --steps 2 --warmup 1 --find_max_batch
    ;;
profile)
    python3 benchmarks/profile_step.py --model DiT-XL/2 --rows bce --out "$out/profile_dit_xl2_compile.json"
    python3 benchmarks/profile_step.py --model vDiT-XL/222 --num_frames 16 --batch_size 8 --rows bce \
        --out "$out/profile_vdit_xl222_compile.json"
    ;;
fp8-step)
    echo "row g: --fp8_recipe ${2:-rowwise}"
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcdefg --fp8_recipe "${2:-rowwise}" --steps 10 \
        --warmup 3 --fp8_min_width 16 --anchor .anchors/plain_dit_train.py 2>&1 | rows_only
    ;;
t2v)
    $bench --model "${2:?model}" --batch_size 8 --num_frames 16 --image_size 256 --text_dim 4096 --text_tokens 120 \
        --rows bcde --steps 10 --warmup 3
    ;;
optimizer)
    python3 -m pytest -q -p no:cacheprovider --tb=line tests/optim/test_fused_adamw.py tests/optim/test_optim.py \
        -k "not slow" 2>&1 | grep -v gemm_4bit | tail -8
    python3 benchmarks/kernel_speed.py optimizer-step --out "$out/optimizer_step.json" 2>&1 | grep -v gemm_4bit
    (cd .anchors && python3 plain_dit_train.py 64 bf16_compile_ema) 2>&1 | tail -1
    $bench --model DiT-XL/2 --image_size 256 --batch_size 64 --rows bcef --steps 15 --warmup 5 2>&1 | rows_only
    ;;
sampling)
    fp8_tests
    (cd benchmarks && python3 sampling.py --images --anchor ../.anchors/diffusers_dit_sampling.py \
        --rows "${3:-fp32,compiled-no-kernels,fp8}" --batches "${2:-8}" --steps "${4:-50}" --repeat 5 --top 15 \
        --out "$out/sampling_b${2:-8}.json")
    ;;
fp8-kernels)
    fp8_tests
    python3 benchmarks/kernel_speed.py fp8 --out "$out/quant_kernel.json"
    ;;
speed-quality)
    python3 benchmarks/quality_curves.py speed --work /tmp/speed_quality --jobs 5 --json "$out/speed_quality.json" \
        --plot "$out/speed_quality.png"
    ;;
fp8-train)
    python3 benchmarks/kernel_speed.py fp8-train --out "$out/fp8_train_widths.json"
    $bench --memory --model vDiT-7B/222 --image_size 512 --num_frames 16 --batch_size 1 \
        --memory_rows noema,8bit,bf16,fp8 --steps 5 --warmup 3 2>&1 | rows_only
    ;;
fp8-quality)
    python3 benchmarks/quality_curves.py speed --model DiT-7B/2 --depth 2 --image_size 16 --modes fp8 --jobs 3 \
        --work /tmp/fp8_quality --json "$out/fp8_quality.json" --plot "$out/fp8_quality.png"
    ;;
video-quality)
    python3 benchmarks/quality_curves.py video --steps "${2:-1000}" --window 200 --jobs 3 --work /tmp/video_quality \
        --json "$out/video_quality.json" --plot "$out/video_quality.png"
    ;;
finetune)
    model=${2:?model} anchors=${3-} rows=${4-}
    python3 -c "import torch, diffusers, bitsandbytes, peft, transformers; print('diffusers', diffusers.__version__, \
'bitsandbytes', bitsandbytes.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__)" \
        2>&1 | grep -v gemm_4bit
    if [ -n "$anchors" ]; then
        (cd .anchors && python3 lowmem_finetune.py $anchors) 2>&1 | grep --line-buffered -v gemm_4bit \
            | tee "$out/${model}_anchor.log"
        mv "$out/lowmem_anchor.json" "$out/${model}_anchor.json"
    fi
    if [ -n "$rows" ]; then
        python3 benchmarks/finetune.py --model "$model" --rows "$rows" --steps "${STEPS:-30}" \
            --log_every "${LOG_EVERY:-10}" --row_timeout "${ROW_TIMEOUT:-240}" --json "$out/${model}.json" 2>&1 \
            | grep --line-buffered -v gemm_4bit | tee "$out/${model}.log"
    fi
    ;;
finetune-wan|finetune-wan14|finetune-cog5b|finetune-hv13b|finetune-wan5b|finetune-ltx2b)
    model=wan13; [ "$1" = finetune-cog5b ] && model=cog5b; [ "$1" = finetune-wan14 ] && model=wan14
    [ "$1" = finetune-hv13b ] && model=hv13b; [ "$1" = finetune-wan5b ] && model=wan5b
    [ "$1" = finetune-ltx2b ] && model=ltx2b
    python3 -c "import torch, diffusers, peft, ftfy, transformers; print('diffusers', diffusers.__version__, \
'peft', peft.__version__, 'ftfy', ftfy.__version__, 'transformers', transformers.__version__)"
    left() { local n=$(( ${JOB_LIMIT:-530} - SECONDS )); echo $(( n > 1 ? n : 1 )); }  # (timeout 0: no limit)
    ft() {  # the rows named by $1; each row cut at ROW_TIMEOUT, the whole job at JOB_LIMIT (finished rows stay)
        timeout "$(left)" python3 benchmarks/finetune.py --model $model --work /tmp/ft-$model \
            --rows "$1" --steps "${STEPS:-6}" --log_every "${LOG_EVERY:-2}" --row_timeout "${ROW_TIMEOUT:-240}" \
            --json "$out/$model.json" ${TINY:+--tiny} "${@:2}" 2>&1 | grep --line-buffered -v gemm_4bit \
            | tee -a "$out/$model.log"
    }
    [ -n "${TINY-}" ] && export TINY=1  # the anchor's own switch
    if [ $model = cog5b ]; then  # no anchor: the step time and peak memory of the rows
        ft "${2:-lora64_ckpt,lora64_ckpt_budget24}"
        exit
    fi
    if [ $model = hv13b ] || [ $model = wan5b ] || [ $model = ltx2b ]; then  # no anchor either
        ft "${2:-lora32_off_budget24,lora32}"
        exit
    fi
    if [ $model = wan14 ]; then  # the 24 GiB row first, the anchor's LoRA row, then ditforge's uncapped row
        ft "${2:-lora32_swap20_off_budget24}"
        anchors=${3-wan14b/lora}
    else
        ft "${2:-lora32}"  # first: builds the pipeline folder and the features (~2 minutes with the row)
        anchors=${3-wan1.3b/lora wan1.3b/full}
    fi
    if [ -n "$anchors" ]; then
        (cd .anchors && timeout "$(left)" python3 wan_finetune.py $anchors) \
            2>&1 | grep --line-buffered -v gemm_4bit | tee "$out/${model}_anchor.log"
        [ -f "$out/wan_finetune.json" ] && mv "$out/wan_finetune.json" "$out/${model}_anchor.json"
    fi
    rest=${4-full,lora32_budget8,lora32_compile,full_compile}  # the compile rows last: the slowest to start
    [ $model = wan14 ] && rest=${4-lora32}
    [ -n "$rest" ] && ft "$rest" --append
    ;;
sample-wan)
    python3 -c "import diffusers; print('diffusers', diffusers.__version__)"
    anchor=(); [ "${4:-anchor}" = none ] || anchor=(--anchor ../.anchors/wan_sampling.py)
    (cd benchmarks && torchrun --standalone --nproc_per_node "${NPROC:-1}" sample_wan.py \
        --rows "${2:-eager,compiled,fp8,fp32}" --steps "${3:-10}" --repeat "${REPEAT:-2}" \
        --warmup_steps "${WARMUP_STEPS:-2}" --profile "${PROFILE:-0}" "${anchor[@]}" --out "$out/sample_wan_${TAG:-1gpu}.json") 2>&1 \
        | grep --line-buffered -v -E "gemm_4bit|enable_parallelism. is an experimental" \
        | tee "$out/sample_wan_${TAG:-1gpu}.log"
    ;;
exact-attention)
    python3 benchmarks/kernel_speed.py exact-attention --out "$out/exact_attention_wan.json"
    python3 benchmarks/kernel_speed.py exact-attention --tokens 17776 --heads 48 --head_dim 64 \
        --out "$out/exact_attention_cog.json"
    ;;
vae-decode)
    python3 benchmarks/vae_decode.py ${2:+--rows "$2"} 2>&1 | grep --line-buffered -v gemm_4bit | tail -60
    ;;
sample-cog|sample-hv)
    model=cog5b; [ "$job" = sample-hv ] && model=hv13b
    (cd benchmarks && python3 sample_wan.py --model "$model" --rows "${2:-diffusers_compiled,compiled}" \
        --steps "${3:-10}" --repeat "${REPEAT:-2}" --warmup_steps 1 --reference "${REFERENCE:-diffusers_compiled}" \
        --untimed none --out "$out/sample_$model.json") 2>&1 | grep --line-buffered -v -E "gemm_4bit|kept in float32" \
        | tee "$out/sample_$model.log"
    ;;
memory-dit)
    for rows in plain "${3:-noema,8bit,sr,capped}" plain; do
        ckpt=none; [ "$rows" = plain ] || ckpt=${2:-every-2}
        $bench --memory --model DiT-XL/2 --image_size 256 --batch_size 32 --steps 20 --warmup 6 --memory_rows "$rows" \
            --grad_checkpoint "$ckpt" --gpu_memory_budget 8GiB 2>&1 | grep --line-buffered -v gemm_4bit
    done
    ;;
multi-gpu)
    n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    torchrun --standalone --nproc_per_node 1 benchmarks/multi_gpu.py --plugins none --save_plugin "" \
        --json "$out/multi_gpu_1.json"
    torchrun --standalone --nproc_per_node "$n" benchmarks/multi_gpu.py --json "$out/multi_gpu_$n.json" \
        --save_dir /tmp/ditforge-bench-ckpt
    python3 benchmarks/multi_gpu.py --table "$out/multi_gpu_1.json" "$out/multi_gpu_$n.json"
    ;;
scale)
    n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    run_row() { torchrun --standalone --nproc_per_node "$n" benchmarks/multi_gpu.py --json "$out/scale_${n}gpu.json" \
        --model vDiT-7B/222 --image_size 512 --num_frames 16 --enable_flashattn --compile default --save_plugin "" \
        --steps 5 --warmup 3 ${PROFILE:+--profile} "$@" 2>&1 | grep -E "^\{|Error" | cut -c1-900; }
    for row in ${2:-7b8k 7b8k_b2 7b64k}; do
        case $row in
        7b8k) run_row --plugins zero2 --batch_per_gpu 1 ;;
        7b8k_b2) run_row --plugins zero2 --batch_per_gpu 2 --grad_checkpoint op ;;
        7b64k) run_row --image_size 1024 --num_frames 32 --plugins fsdp --batch_per_gpu 1 \
            --sequence_parallel_size "$n" --grad_checkpoint full ;;
        7b64k_ring) run_row --image_size 1024 --num_frames 32 --plugins fsdp --batch_per_gpu 1 \
            --sequence_parallel_size "$n" --sequence_parallel_type ring --grad_checkpoint full ;;
        7b8k_tp2) run_row --plugins zero2 --tensor_parallel 2 --batch_per_gpu 2 ;;
        *) echo "unknown scale row $row" ;;
        esac
    done
    ;;
single-file)
    python3 benchmarks/single_file.py --model "${2:-14b}" --dir /tmp/ditforge_single_file ${3:+--files $3} \
        --out "$out/single_file_${2:-14b}.json"
    ;;
*)
    echo "unknown job '$job': see the top of benchmarks/run.sh" >&2
    exit 2
    ;;
esac
