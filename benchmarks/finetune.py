"""Fine-tuning speed and memory through the real trainer: ``ditforge train --init_from`` a local pipeline folder
holding a real-size model's diffusers config with random weights (made with diffusers' own classes and
``save_pretrained``), on features extracted with that pipeline (``ditforge extract-features --init_from``), so the
step does what the plain anchors time: the denoiser's forward and backward, the optimizer step (and ditforge's
EMA, which the anchors lack).

Models (``--model``):
  sd15    UNet2DConditionModel with SD-1.5's config (~860M), 512px (latents 4x64x64), SD's VAE config, a CLIP-L text
          encoder (12 layers, 768 wide; tokenizer trained offline on a few captions), PNDM scheduler (epsilon)
  pixart  PixArtTransformer2DModel at PixArt-alpha size (28 layers, width 1152, ~610M), 512px, SD's VAE config,
          a one-layer T5 encoder of width 4096 (the real T5-XXL's width: the caption states have its shape),
          DPM-Solver++ scheduler (learned sigma: the hybrid loss)
  sdxl    UNet2DConditionModel with SDXL's config (~2.57B), 1024px (latents 4x128x128), batch 1, SDXL's VAE config,
          CLIP-L and OpenCLIP-G-width text encoders of 2 layers (the states and pooled output have SDXL's shapes),
          Euler scheduler
  wan13   WanPipeline with Wan2.1-T2V-1.3B's transformer config (30 layers, 12 heads of 128, FFN 8960, 1.42B: the
          anchor ``wan_finetune.py``'s ``wan1.3b``), AutoencoderKLWan's default config (the real Wan 2.1 VAE's), a
          one-layer UMT5 encoder of width 4096 (512 x 4096 caption states, as the real UMT5-XXL's), Wan 480p's UniPC
          flow scheduler (flow_shift 3); batch 1, 81 frames at 640 x 640: latents 16 x 21 x 80 x 80, 33,600 tokens.
          The anchor's 480 x 832 (16 x 21 x 60 x 104, 32,760 tokens) is not possible: ditforge trains at one
          square --image_size. The features are not extracted at that size: ``extract-features --init_from`` runs
          on the built-in clips at 16 px x 5 frames (the real UMT5 states, captions, manifest) and ``video_features``
          replaces the posterior moments by random ones of the real shape, in extract-features' own format (the
          Wan VAE on 81 float32 frames of 640 px per clip costs GPU minutes and no part of the step). Rows:
          ``lora32`` (rank 32 on to_q, to_k, to_v, to_out.0, every block checkpointed, as the anchor's ``lora``),
          ``lora32_compile``, ``lora32_budget8`` (+ --gpu_memory_budget 8GiB), ``lora32_nockpt`` (no checkpointing,
          as the anchor's ``lora_nockpt``), ``lora32_ckpt2`` (every second block), ``lora32_op`` (op-level
          selective checkpointing), ``lora32_attn`` (attention outputs kept, the rest recomputed),
          ``lora32_fp8`` (+ --fp8_base: the frozen base stored in float8), ``lora32_fp8_attn``,
          ``lora32_fp8_budget8`` (under 8 GiB), ``lora32_off_budget8``, ``lora32_fp8_off_budget8`` (+
          --offload_activations: the checkpointed blocks' inputs in host memory), ``lora32_fp8_attn_off``,
          ``lora32_fa4``, ``lora32_attn_fa4``, ``lora32_fp8_attn_fa4`` (+ --enable_flashattn),
          ``lora32_attn_fa4_compile``, ``lora32_fp8_attn_fa4_compile`` (+ --compile: each block compiled),
          ``full``, ``full_attn``, ``full_compile``, ``full_attn_fa4``, ``full_attn_fa4_compile`` (no EMA, as the
          anchor) and ``full_attn_fa4_compile_fused`` (+ --fused_backward_pass)
          (bf16 autocast, fp32 master weights, fused AdamW, EMA, every block checkpointed as the anchor's ``full``)
  wan14   the same with Wan2.1-T2V-14B's transformer config (40 layers, 40 heads of 128, FFN 13824, 14.3B: the
          anchor's ``wan14b``), saved in bf16 (28 GB). Rows ``lora32_off_budget24`` (rank 32, every block
          checkpointed, their inputs in host memory, under --gpu_memory_budget 24GiB),
          ``lora32_swap20_off_budget24`` (+ --blocks_to_swap 20) and ``lora32`` (uncapped)
  hv13b   HunyuanVideoPipeline with the released transformer config (``build_hv13b``: 20 double- and 40
          single-stream blocks, 24 heads of 128, 12.8B, saved in bf16), the real VAE config, 256 x 4096 Llama states
          and CLIP's pooled 768; batch 1, 61 frames at 544 x 544: latents 16 x 16 x 68 x 68, 18,496 tokens. Features
          as wan13's (extracted at 16 px x 5 frames). Rows ``lora32`` (uncapped) and ``lora32_off_budget24`` (rank 32
          on to_q, to_k, to_v, to_out.0, every block checkpointed and its input in host memory, under
          --gpu_memory_budget 24GiB). No anchor, as cog5b.
  wan5b   Wan 2.2 TI2V-5B's WanPipeline (``build_wan5b``: 30 layers, 24 heads of 128, 48 latent channels, 5.0B,
          saved in bf16; Wan 2.2's VAE, 16 x 16 x 4); batch 1, 121 frames at 960 x 960: latents 48 x 31 x 60 x 60,
          27,900 tokens (the released 704 x 1280's 27,280). Features extracted at 32 px x 5 frames.
  ltx2b   LTXPipeline (``build_ltx2b``: LTX-Video 0.9's 28 layers, 32 heads of 64, 1.9B, saved in bf16; its VAE, 32 x
          32 x 8); batch 1, 161 frames at 576 x 576: latents 128 x 21 x 18 x 18, 6,804 tokens (704 x 480's 6,930).
          Features extracted at 32 px x 9 frames. Both: rows ``lora32`` and ``lora32_off_budget8``,
          ``lora32_off_budget24``, no anchor.
  cog5b   CogVideoXPipeline with CogVideoX-5B's transformer config (42 layers, 48 heads of 64, rotary positions,
          5.57B), ``AutoencoderKLCogVideoX``'s default config with the 5B's scaling factor 0.7, a one-layer T5
          encoder of width 4096 (226 x 4096 caption states), the 5B's DPM scheduler (v, zero terminal SNR); batch 1,
          49 frames at 592 x 592: latents 16 x 13 x 74 x 74, 17,797 tokens (the released 480 x 720: 17,550). The
          weights are saved in bf16 (11 GB; random either way). Features as wan13's (extracted at 16 px x 9
          frames). Rows ``lora64_ckpt`` (rank 64 on to_q, to_k, to_v, to_out.0, every block checkpointed) and
          ``lora64_ckpt_budget24`` (+ --gpu_memory_budget 24GiB). No anchor: the issue asks for the step time
          and peak memory.
Rows (``--rows``, comma-separated): ``full`` (all weights, bf16 autocast, fp32 master weights, fused AdamW),
``full_compile`` (+ --compile: the whole denoiser in one graph), ``full_ro`` (+ --compile reduce-overhead: CUDA
graphs too), ``full_ckpt`` (+ --grad_checkpoint), ``lora64`` (--lora_rank 64 on the attention projections, frozen
base stored in bf16), ``lora64_compile``, ``lora64_ro``; ``full_ro_noema`` (``full_ro`` without the EMA, as the
anchors); the capped rows ``lowmem8_ro``, ``lowmem8_ckpt_ro``, ``lowmem8_ckpt`` (``--optimizer adamw8bit --master_weights
bf16 --ema_decay 0 --gpu_memory_budget 8GiB``, with CUDA graphs and/or gradient checkpointing); ``full_noema``,
``full_compile_noema``; ``sr_fused4``, ``sr_fused8``, ``sr_fused16`` (4 bytes per parameter: ``--optimizer adamw8bit
--master_weights bf16_sr --fused_backward_pass --ema_decay 0`` under a 4, 8 or 16 GiB budget) and
``sr_fused4_compile``, ``sr_fused16_compile`` (+ --compile, block by block), ``sr_fused4_ckpt2``,
``sr_fused4_ckpt`` (+ checkpointing of every second block, of every block), ``sr_fused4_ckpt2_act`` (every second
block checkpointed, ``--offload_activations`` on the others), ``sr_fused16_op``,
``sr_fused16_ckpt2`` (+ op-level selective checkpointing, every second block), ``sr_fused16_ckpt2_compile``,
``sr_fused16_ckpt3`` (every third block); ``offload4``, ``offload8``, ``offload16`` (``sr_fused`` + ``--cpu_offload
optimizer``: 2 bytes per parameter on the GPU, the moments streamed from pinned host memory; after two steps the
measured placement moves back to the GPU the states that the budget leaves room for), ``offload16_ro`` (the ordinary
backward instead, so 4 bytes per parameter, and the whole denoiser compiled with CUDA graphs) and ``offload8_ckpt``,
``offload8_ckpt2`` (+ checkpointing of every block, of every second block), ``offload8_ckpt2_act`` (+
``--offload_activations`` on the other blocks); ``adamw8bit``, ``adamw4bit``, ``adamw_fp8``, ``adafactor``
(``--optimizer``, no EMA, no cap); ``offload_all8_ckpt`` (``--cpu_offload all --ema_decay 0 --grad_checkpoint`` under
8 GiB: weights, gradients and fp32 AdamW states in host memory, FSDP2 in one process, the step on the CPU),
``offload_all8_z2_ckpt`` (``--plugin zero2``: the bf16 weights gathered once per step and kept through the backward),
and each with ``_dpu`` (+ ``--delayed_update``).

Each row is its own ``ditforge train`` process (``--max_steps`` steps, metrics every ``--log_every``): ms/step is the
median over the logged windows after the first (compilation and warm-up), from ``samples_per_sec``; peak GiB is
``torch.cuda.max_memory_allocated`` as the trainer logs it. Run the anchor in the same GPU job
(``../shared/anchors/sd_unet_finetune.py``, ``lowmem_finetune.py``) and compare ratios within one job.

vace13 (``build_vace13``): Wan2.1-VACE-1.3B, wan13's parts in a ``WanVACEPipeline`` with a
``WanVACETransformer3DModel`` of WAN13's config plus 15 VACE blocks at layers 0, 2, ..., 28 over 96 control
channels (diffusers' ``scripts/convert_wan_to_diffusers.py``, "Wan-VACE-1.3B"). VACE trains from clips, not
features (its references' latents and control are built per clip), so its rows read a CSV of 2 random smooth
clips of 33 frames at 480 x 480 with a random reference image each (``reference_clips``): the step includes the
VAE encoding the clip and the reference and the control (latents 16 x (1 + 9) x 60 x 60, 36,000 tokens in the main
and VACE blocks). Rows: ``lora32``, ``lora32_budget8``. ``--tiny``: the tests' tiny VACE pipeline at 16 px x 5.

animate14 (``build_animate14``): Wan2.2-Animate-14B, a ``WanAnimatePipeline`` with ``WanAnimateTransformer3DModel``'s
default config (the released 14B's: 40 layers of 40 heads of 128, FFN 13824, 36 input channels, the 512 px motion
encoder and a face adapter every 5 blocks), random weights saved in bf16, wan13's VAE, UMT5 and scheduler, and a
one-layer CLIP vision model of the released encoder's output shape (257 states of 1280 for a 224 px image).
Animate trains from clips (the character's latent, the pose latents and face frames are built per clip), so its rows
read a CSV of 2 random smooth clips of 77 frames (one segment, the pipeline's ``segment_frame_length``) at 640 x 640
with a character PNG, a pose video and a face video each (``driving_clips``): latents 16 x (1 + 20) x 80 x 80, 33,600
tokens, the wan14 rows' count. Rows: ``lora32_fp8_swap20_off_budget24`` (rank 32, the base in fp8, the last 20
blocks' frozen weights swapped from host memory, every block and face adapter checkpointed with its input in host
memory, under --gpu_memory_budget 24GiB; it peaks at 24.15 GiB), ``lora32_fp8_swap24_off_budget24``,
``lora32_fp8_swap28_off_budget24`` (24, 28 blocks swapped) and ``lora32`` (uncapped). ``--tiny``: the tests' tiny
Animate pipeline at 16 px x 5.

Usage (repository root, GPU machine): ``PYTHONPATH=. python benchmarks/finetune.py --model sd15 --work /tmp/ft
--rows full,full_compile,lora64,lora64_compile --json $OUT/finetune_sd15.json``; ``--tiny`` builds the tests' tiny
pipeline instead (a CPU check of the script; wan13: the tiny WanPipeline's features rewritten to 32 px x 9 frames).
Rows that set --gpu_memory_budget are skipped without CUDA. ``bash benchmarks/run.sh finetune-wan`` runs the wan13
job (the anchor between ``lora32`` and the other rows, ``--append`` into one JSON).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "finetune"))
import tiny_pipelines  # noqa: E402  (offline tokenizers; the tiny pipelines for --tiny)
from ditforge.atomic import atomic_path  # noqa: E402

CAPTIONS = tiny_pipelines.CAPTIONS
LOWMEM = ["--optimizer", "adamw8bit", "--master_weights", "bf16", "--ema_decay", "0"]
SR_FUSED = ["--optimizer", "adamw8bit", "--master_weights", "bf16_sr", "--fused_backward_pass", "--ema_decay", "0"]
OFFLOAD = [*SR_FUSED, "--cpu_offload", "optimizer"]
OFFLOAD_ALL = ["--cpu_offload", "all", "--ema_decay", "0"]
WAN_LORA = ["--lora_rank", "32", "--lora_target_modules", "to_q,to_k,to_v,to_out.0", "--grad_checkpoint"]
COG_LORA = ["--lora_rank", "64", "--lora_target_modules", "to_q,to_k,to_v,to_out.0", "--grad_checkpoint"]
ROWS = {
    "full": [],
    "full_compile": ["--compile"],
    "full_ckpt": ["--grad_checkpoint"],
    "lora64": ["--lora_rank", "64"],
    "lora64_compile": ["--lora_rank", "64", "--compile"],
    "full_ro": ["--compile", "reduce-overhead"],
    "lora64_ro": ["--lora_rank", "64", "--compile", "reduce-overhead"],
    "full_ro_noema": ["--compile", "reduce-overhead", "--ema_decay", "0"],
    # the 8 GiB rows: Kahan bf16 weights + 8-bit moments + no EMA copy, under the cap
    "lowmem8_ro": [*LOWMEM, "--compile", "reduce-overhead", "--gpu_memory_budget", "8GiB"],
    "lowmem8_ckpt_ro": [*LOWMEM, "--grad_checkpoint", "--compile", "reduce-overhead", "--gpu_memory_budget", "8GiB"],
    "lowmem8_ckpt": [*LOWMEM, "--grad_checkpoint", "--gpu_memory_budget", "8GiB"],
    "full_noema": ["--ema_decay", "0"],
    "full_compile_noema": ["--compile", "--ema_decay", "0"],
    # 4 bytes per parameter: bf16 weights rounded stochastically, 8-bit moments, the step in the backward
    "sr_fused4": [*SR_FUSED, "--gpu_memory_budget", "4GiB"],
    "sr_fused4_compile": [*SR_FUSED, "--compile", "--gpu_memory_budget", "4GiB"],
    "sr_fused4_ckpt2": [*SR_FUSED, "--grad_checkpoint", "every-2", "--gpu_memory_budget", "4GiB"],
    "sr_fused4_ckpt": [*SR_FUSED, "--grad_checkpoint", "--gpu_memory_budget", "4GiB"],
    # every second block checkpointed, the others' saved tensors in pinned host memory
    "sr_fused4_ckpt2_act": [*SR_FUSED, "--grad_checkpoint", "every-2", "--offload_activations",
                            "--gpu_memory_budget", "4GiB"],
    "sr_fused8": [*SR_FUSED, "--gpu_memory_budget", "8GiB"],
    "sr_fused16": [*SR_FUSED, "--gpu_memory_budget", "16GiB"],
    "sr_fused16_compile": [*SR_FUSED, "--compile", "--gpu_memory_budget", "16GiB"],
    "sr_fused16_op": [*SR_FUSED, "--grad_checkpoint", "op", "--gpu_memory_budget", "16GiB"],
    "sr_fused16_ckpt2": [*SR_FUSED, "--grad_checkpoint", "every-2", "--gpu_memory_budget", "16GiB"],
    "sr_fused16_ckpt3": [*SR_FUSED, "--grad_checkpoint", "every-3", "--gpu_memory_budget", "16GiB"],
    "sr_fused16_ckpt2_compile": [*SR_FUSED, "--grad_checkpoint", "every-2", "--compile", "--gpu_memory_budget",
                                 "16GiB"],
    "offload4": [*OFFLOAD, "--gpu_memory_budget", "4GiB"],
    # streamed states under a budget with room to spare: the measured placement moves them back to the GPU
    "offload8": [*OFFLOAD, "--gpu_memory_budget", "8GiB"],
    "offload16": [*OFFLOAD, "--gpu_memory_budget", "16GiB"],
    # the states streamed through the ring after an ordinary backward: the whole denoiser one CUDA-graphed compile
    "offload16_ro": ["--optimizer", "adamw8bit", "--master_weights", "bf16_sr", "--cpu_offload", "optimizer",
                     "--ema_decay", "0", "--compile", "reduce-overhead", "--gpu_memory_budget", "16GiB"],
    "offload8_ckpt": [*OFFLOAD, "--grad_checkpoint", "--gpu_memory_budget", "8GiB"],
    "offload8_ckpt2": [*OFFLOAD, "--grad_checkpoint", "every-2", "--gpu_memory_budget", "8GiB"],
    # the blocks every-2 leaves unchecked keep their saved tensors in pinned host memory
    "offload8_ckpt2_act": [*OFFLOAD, "--grad_checkpoint", "every-2", "--offload_activations", "--gpu_memory_budget",
                           "8GiB"],
    # the optimizers alone, no cap: 8-bit moments (bitsandbytes' format, our one-pass step), torchao's low-bit
    # AdamW, torch's Adafactor
    "adamw8bit": ["--optimizer", "adamw8bit", "--ema_decay", "0"],
    "adamw4bit": ["--optimizer", "adamw4bit", "--ema_decay", "0"],
    "adamw_fp8": ["--optimizer", "adamw_fp8", "--ema_decay", "0"],
    "adafactor": ["--optimizer", "adafactor", "--ema_decay", "0"],
    # everything in host memory (FSDP2's CPUOffloadPolicy, torch's fused AdamW on the CPU), with the delayed update
    "offload_all8_ckpt": [*OFFLOAD_ALL, "--grad_checkpoint", "--gpu_memory_budget", "8GiB"],
    "offload_all8_ckpt_dpu": [*OFFLOAD_ALL, "--grad_checkpoint", "--delayed_update", "--gpu_memory_budget", "8GiB"],
    "offload_all8_z2_ckpt": [*OFFLOAD_ALL, "--plugin", "zero2", "--grad_checkpoint", "--gpu_memory_budget", "8GiB"],
    "offload_all8_z2_ckpt_dpu": [*OFFLOAD_ALL, "--plugin", "zero2", "--grad_checkpoint", "--delayed_update",
                                 "--gpu_memory_budget", "8GiB"],
    # Wan 2.1 (--model wan13), as ../shared/anchors/wan_finetune.py: rank-32 LoRA on the attention projections
    # (alpha = rank: scale 1) and full fine-tunes, both with every block checkpointed
    "lora32": [*WAN_LORA],
    "lora32_compile": [*WAN_LORA, "--compile"],
    "lora32_budget8": [*WAN_LORA, "--gpu_memory_budget", "8GiB"],
    "lora32_nockpt": [*WAN_LORA[:-1]],  # the anchor's lora_nockpt: every activation kept
    "lora32_ckpt2": [*WAN_LORA[:-1], "--grad_checkpoint", "every-2"],
    "lora32_op": [*WAN_LORA[:-1], "--grad_checkpoint", "op"],  # matmul and attention outputs kept
    "lora32_attn": [*WAN_LORA[:-1], "--grad_checkpoint", "attn"],  # attention outputs kept
    "lora32_fp8_attn": [*WAN_LORA[:-1], "--grad_checkpoint", "attn", "--fp8_base"],
    "lora32_fp8": [*WAN_LORA, "--fp8_base"],
    "lora32_fp8_budget8": [*WAN_LORA, "--fp8_base", "--gpu_memory_budget", "8GiB"],
    # + --offload_activations: the checkpointed blocks' inputs in pinned host memory
    "lora32_off_budget8": [*WAN_LORA, "--offload_activations", "--gpu_memory_budget", "8GiB"],
    "lora32_fp8_off_budget8": [*WAN_LORA, "--fp8_base", "--offload_activations", "--gpu_memory_budget", "8GiB"],
    "lora32_fp8_attn_off": [*WAN_LORA[:-1], "--grad_checkpoint", "attn", "--fp8_base", "--offload_activations"],
    # + --enable_flashattn: FlashAttention-4's forward and backward where faster (ops.flash4)
    "lora32_fa4": [*WAN_LORA, "--enable_flashattn"],
    "lora32_attn_fa4": [*WAN_LORA[:-1], "--grad_checkpoint", "attn", "--enable_flashattn"],
    "lora32_fp8_attn_fa4": [*WAN_LORA[:-1], "--grad_checkpoint", "attn", "--fp8_base", "--enable_flashattn"],
    # + --compile: each block compiled (a video transformer's compile_whole is False), its copies and element-wise
    # kernels fused
    "lora32_attn_fa4_compile": [*WAN_LORA[:-1], "--grad_checkpoint", "attn", "--enable_flashattn", "--compile"],
    "lora32_fp8_attn_fa4_compile": [*WAN_LORA[:-1], "--grad_checkpoint", "attn", "--fp8_base", "--enable_flashattn",
                                    "--compile"],
    # Wan-14B (--model wan14) on a 24 GB card: the budget stores the base in fp8, the checkpointed inputs go to host
    "lora32_off_budget24": [*WAN_LORA, "--offload_activations", "--gpu_memory_budget", "24GiB"],
    # + the frozen weights of the last 20 of the 40 blocks in pinned host memory, a block at a time on the GPU
    "lora32_swap20_off_budget24": [*WAN_LORA, "--offload_activations", "--blocks_to_swap", "20",
                                   "--gpu_memory_budget", "24GiB"],
    # Wan2.2-Animate-14B (--model animate14) on a 24 GB card: + the base stored in fp8
    "lora32_fp8_swap20_off_budget24": [*WAN_LORA, "--fp8_base", "--offload_activations", "--blocks_to_swap", "20",
                                       "--gpu_memory_budget", "24GiB"],
    # its peak was 24.15 GiB once AdamW's moments exist (H200, 2026-12-03): 4 or 8 more blocks swapped, 0.33 GiB each
    "lora32_fp8_swap24_off_budget24": [*WAN_LORA, "--fp8_base", "--offload_activations", "--blocks_to_swap", "24",
                                       "--gpu_memory_budget", "24GiB"],
    "lora32_fp8_swap28_off_budget24": [*WAN_LORA, "--fp8_base", "--offload_activations", "--blocks_to_swap", "28",
                                       "--gpu_memory_budget", "24GiB"],
    # + --validation_prompts (VALIDATION, written into --work): its samples with the weights being trained, every 10
    # steps and at the end; issue 63's row: the peak no higher than lora32's, and a sample's time (validation_s)
    "lora32_val": [*WAN_LORA, "--validation_prompts", "{work}/validation.txt", "--sample_every", "10"],
    # CogVideoX-5B (--model cog5b): rank-64 LoRA on the attention projections, every block checkpointed
    "lora64_ckpt": [*COG_LORA],
    "lora64_ckpt_budget24": [*COG_LORA, "--gpu_memory_budget", "24GiB"],
}
# rows of one name for every model whose flags differ for wan13: the anchor checkpoints every block of its full row
WAN_ROWS = {"full": ["--grad_checkpoint"], "full_compile": ["--grad_checkpoint", "--compile"],
            "full_attn": ["--grad_checkpoint", "attn"],
            "full_attn_fa4": ["--grad_checkpoint", "attn", "--enable_flashattn"],
            # no EMA, as the anchor's full row; + the step in the backward: no whole-model gradient (the peak)
            "full_attn_fa4_compile": ["--grad_checkpoint", "attn", "--enable_flashattn", "--compile",
                                      "--ema_decay", "0"],
            "full_attn_fa4_compile_fused": ["--grad_checkpoint", "attn", "--enable_flashattn", "--compile",
                                            "--ema_decay", "0", "--fused_backward_pass"]}
CUDA_ONLY = ("--gpu_memory_budget",)  # rows with these flags skip on a machine without CUDA
# lora32_val's file: one 480 x 832 x 33-frame sample, 20 steps, guidance 5 (musubi-tuner's line syntax); --tiny:
# 16 x 32 x 5 (the tiny transformer's rotary table is 32 positions long)
ROWS_DEFAULT = "full,full_compile,lora64,lora64_compile"
VALIDATION = "a corgi runs along a beach at sunset, waves behind it --w {} --h {} --f {} --s 20 --g 5 --seed 7\n"


def sd_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, layers_per_block=2,
                         sample_size=512, scaling_factor=0.18215)


def build_sd15(path: Path) -> Path:
    from diffusers import PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8,
                                block_out_channels=(320, 640, 1280, 1280), layers_per_block=2)
    tokenizer = tiny_pipelines.make_clip_tokenizer()
    text = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                                        num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77))
    sched = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True,
                          steps_offset=1, set_alpha_to_one=False)
    pipe = StableDiffusionPipeline(vae=sd_vae(), text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=sched,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(str(path))
    return path


def build_pixart(path: Path) -> Path:
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(num_attention_heads=16, attention_head_dim=72, in_channels=4,
                                           out_channels=8, num_layers=28, cross_attention_dim=1152,
                                           caption_channels=4096, sample_size=64, patch_size=2,
                                           norm_type="ada_norm_single", use_additional_conditions=False)
    tokenizer = tiny_pipelines.make_t5_tokenizer()
    vocab = -(-len(tokenizer) // 8) * 8
    text = T5EncoderModel(T5Config(vocab_size=vocab, d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=2,
                                   dropout_rate=0.0, is_encoder_decoder=False))
    sched = DPMSolverMultistepScheduler(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02,
                                        beta_schedule="linear", prediction_type="epsilon")
    PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=text, vae=sd_vae(), transformer=transformer,
                        scheduler=sched).save_pretrained(str(path))
    return path


def build_sdxl(path: Path) -> Path:
    """SDXL's UNet config (as the anchor's ``sdxl``, 2.57B), SDXL's VAE config and scheduler; the two CLIP text
    encoders at SDXL's widths (768 and 1280, projection 1280) but 2 layers each: they only encode the prompts
    once, in extract-features."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=128, cross_attention_dim=2048, block_out_channels=(320, 640, 1280),
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                                transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
                                use_linear_projection=True, addition_embed_type="text_time",
                                addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
                                layers_per_block=2)
    tokenizer, tokenizer_2 = tiny_pipelines.make_clip_tokenizer(), tiny_pipelines.make_clip_tokenizer("!")
    clip = dict(vocab_size=49408, num_hidden_layers=2, max_position_embeddings=77)
    text = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12, **clip))
    text_2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120,
                                                        num_attention_heads=20, projection_dim=1280,
                                                        hidden_act="gelu", **clip))
    vae = sd_vae()
    vae.register_to_config(scaling_factor=0.13025)
    sched = EulerDiscreteScheduler(**tiny_pipelines.SDXL_SCHEDULER)
    StableDiffusionXLPipeline(vae=vae, text_encoder=text, text_encoder_2=text_2, tokenizer=tokenizer,
                              tokenizer_2=tokenizer_2, unet=unet, scheduler=sched).save_pretrained(str(path))
    return path


WAN13 = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
             text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)
# Wan2.1-T2V-14B: the same with 40 layers of 40 heads (width 5120) and FFN 13824 (the anchor's wan14b)
WAN14 = {**WAN13, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
# The anchor's workload is 480 x 832 x 81 frames (latents 16 x 21 x 60 x 104, 32,760 tokens); ditforge trains at one
# square --image_size (its features and sample shapes are C x T x s x s), so the rows run at the nearest square with
# at least the anchor's tokens: 640 px (latents 16 x 21 x 80 x 80, 33,600 tokens = 1.026x; attention 1.052x).
WAN_SIDE, WAN_FRAMES = 640, 81
VACE13_LAYERS = list(range(0, 30, 2))  # Wan-VACE-1.3B's (diffusers' scripts/convert_wan_to_diffusers.py)
VACE_SIDE, VACE_FRAMES = 480, 33  # vace13's clips, read and encoded in the step (no features)
ANIMATE_SIDE, ANIMATE_FRAMES = 640, 77  # animate14's clips: one segment (segment_frame_length 77), wan14's tokens
# CogVideoX-5B's released size is 480 x 720 x 49 (latents 16 x 13 x 60 x 90: 17,550 tokens in 2 x 2 patches); the
# nearest square with at least as many: 592 px (13 x 37 x 37 = 17,797 tokens, 1.014x)
COG_SIDE, COG_FRAMES = 592, 49
# HunyuanVideo at 544 x 544 x 61 frames (latents 16 x 16 x 68 x 68: 18,496 tokens in 2 x 2 patches), about the
# tokens of 960 x 544 x 33, the size musubi-tuner quotes for 12 GB cards
HV_SIDE, HV_FRAMES = 544, 61
# Wan 2.2 TI2V-5B's 704 x 1280 x 121 is 27,280 tokens (latents 48 x 31 x 44 x 80, 2 x 2 patches); 960 x 960 x 121 is
# 27,900 (1.02x). LTX-Video's 704 x 480 x 161 is 6,930 (latents 128 x 21 x 15 x 22, 1 x 1 patches); 576 x 576 x 161
# is 6,804 (0.98x).
TI2V_SIDE, TI2V_FRAMES = 960, 121
LTX_SIDE, LTX_FRAMES = 576, 161
# the video models: (side, frames, and the frames and side of the small extraction whose captions and text states
# the features keep: the VAE's smallest input)
VIDEO = {"wan13": (WAN_SIDE, WAN_FRAMES, 5, 16), "wan14": (WAN_SIDE, WAN_FRAMES, 5, 16),
         "cog5b": (COG_SIDE, COG_FRAMES, 9, 16), "hv13b": (HV_SIDE, HV_FRAMES, 5, 16),
         "wan5b": (TI2V_SIDE, TI2V_FRAMES, 5, 32), "ltx2b": (LTX_SIDE, LTX_FRAMES, 9, 32)}
# Wan2.2-TI2V-5B's transformer/config.json
WAN5B = {**WAN13, "num_attention_heads": 24, "in_channels": 48, "out_channels": 48, "ffn_dim": 14336}
# CogVideoX-5B's transformer/config.json (THUDM/CogVideoX-5b)
COG5B = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, flip_sin_to_cos=True,
             freq_shift=0, time_embed_dim=512, text_embed_dim=4096, num_layers=42, dropout=0.0, attention_bias=True,
             sample_width=90, sample_height=60, sample_frames=49, patch_size=2, temporal_compression_ratio=4,
             max_text_seq_length=226, activation_fn="gelu-approximate", timestep_activation_fn="silu",
             norm_elementwise_affine=True, norm_eps=1e-5, spatial_interpolation_scale=1.875,
             temporal_interpolation_scale=1.0, use_rotary_positional_embeddings=True,
             use_learned_positional_embeddings=False)
# its scheduler_config.json: CogVideoXDPMScheduler, v-prediction, zero terminal SNR, no SNR shift
COG5B_SCHEDULER = {**tiny_pipelines.COGVIDEOX_SCHEDULER, "snr_shift_scale": 1.0}


def wide_t5(tokenizer, umt5: bool = False):
    """A one-layer T5 (or UMT5) encoder of width 4096 for ``tokenizer``, random weights after
    ``torch.manual_seed(0)``: the caption states have the real T5-XXL's / UMT5-XXL's width at a fraction of its
    cost."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config, model = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    torch.manual_seed(0)
    return model(config(vocab_size=-(-len(tokenizer) // 8) * 8, d_model=4096, d_kv=64, d_ff=256, num_layers=1,
                        num_heads=2, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0, is_encoder_decoder=False, use_cache=False,
                        tie_word_embeddings=False)).eval()


def random_bf16(cls, **config):
    """``cls(**config)`` with random weights after ``torch.manual_seed(0)``, initialised on the GPU when there is one
    (seconds instead of minutes of CPU), in bf16 on the CPU."""
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = cls(**config).to(torch.bfloat16)
    return model.cpu().eval()


def wan_transformer(config: dict, device: str | torch.device = "cpu"):
    """A ``WanTransformer3DModel`` of ``config`` (``WAN13``: Wan2.1-T2V-1.3B's published config, ~1.42B
    parameters; ``WAN14``: the 14B's), random weights, built on ``device`` (``meta``: shapes only)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        return WanTransformer3DModel(**config)


def build_wan(path: Path, config: dict = WAN13, dtype: torch.dtype = torch.float32, transformer=None) -> Path:
    """A ``WanPipeline`` folder: a transformer of ``config`` with random weights (initialised on the GPU when there
    is one: seconds instead of a minute of CPU; saved in ``dtype``: the 14B in bf16, 28 GB), ``AutoencoderKLWan``'s
    default config (the real Wan 2.1 VAE's: base 96, z 16, latents_mean / latents_std), a one-layer UMT5 encoder
    of width 4096 (the real UMT5-XXL's: the 512 x 4096 caption states have the real shape; the tokenizer trained
    offline as the tests'), and Wan 480p's UniPC flow scheduler (flow_shift 3.0). ``transformer``: a
    ``WanVACETransformer3DModel`` instead (``build_vace13``: a ``WanVACEPipeline``)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanVACEPipeline

    cls = WanPipeline if transformer is None else WanVACEPipeline
    if transformer is None:
        transformer = wan_transformer(config, "cuda" if torch.cuda.is_available() else "cpu").to(dtype).cpu().eval()
    tokenizer = tiny_pipelines.make_t5_tokenizer()
    text = wide_t5(tokenizer, umt5=True)
    torch.manual_seed(0)
    vae = AutoencoderKLWan().eval()
    pipe = cls(tokenizer=tokenizer, text_encoder=text, vae=vae, transformer=transformer,
                       scheduler=UniPCMultistepScheduler(**tiny_pipelines.WAN_SCHEDULER))
    return tiny_pipelines._save(pipe, path)  # save_pretrained + the T5 tokenizer's spiece.model


def build_vace13(path: Path) -> Path:
    """A ``WanVACEPipeline`` folder: ``build_wan``'s VAE, UMT5 encoder and scheduler with a
    ``WanVACETransformer3DModel`` of ``WAN13`` and ``VACE13_LAYERS`` (random weights, saved in float32)."""
    from diffusers import WanVACETransformer3DModel

    transformer = random_bf16(WanVACETransformer3DModel, **WAN13, vace_layers=VACE13_LAYERS, vace_in_channels=96)
    return build_wan(path, transformer=transformer.float())


def smooth_mp4(path: Path, rng, frames: int, side: int) -> None:
    """A random smooth clip: ``frames`` frames of (side / 8)^2 random colours upsampled bilinearly, in mpeg4."""
    import av

    coarse = torch.from_numpy(rng.random((frames, 3, max(1, side // 8), max(1, side // 8)), dtype=np.float32))
    pixels = (torch.nn.functional.interpolate(coarse, size=(side, side), mode="bilinear") * 255).round()
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        for frame in pixels.to(torch.uint8).permute(0, 2, 3, 1).numpy():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def reference_clips(folder: Path, side: int, frames: int, n: int = 2) -> Path:
    """``folder/refs.csv``: ``n`` random smooth mp4 clips of ``frames`` frames at ``side`` px with captions and a
    random ``side`` px PNG reference each (a video CSV's ``reference_image`` column); returns the CSV's path."""
    from PIL import Image

    from ditforge.data.video import write_video_csv

    folder.mkdir(parents=True, exist_ok=True)
    rng, rows = np.random.default_rng(0), []
    for i in range(n):
        smooth_mp4(folder / f"clip{i}.mp4", rng, frames, side)
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / f"ref{i}.png")
        rows.append({"path": f"clip{i}.mp4", "text": CAPTIONS[i % len(CAPTIONS)], "reference_image": f"ref{i}.png"})
    return write_video_csv(rows, folder / "refs.csv", ("path", "text", "reference_image"))


def build_animate14(path: Path) -> Path:
    """A ``WanAnimatePipeline`` folder: ``WanAnimateTransformer3DModel``'s default config (Wan2.2-Animate-14B's) with
    random weights in bf16, ``build_wan``'s VAE, UMT5 encoder, tokenizer and scheduler, and a one-layer
    ``CLIPVisionModel`` 1280 wide on 224 px images in patches of 14 (the released ViT-H/14's 257 states of 1280;
    the pipeline reads its second-to-last hidden states, here the embeddings)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanAnimatePipeline, WanAnimateTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    transformer = random_bf16(WanAnimateTransformer3DModel)
    tokenizer = tiny_pipelines.make_t5_tokenizer()
    torch.manual_seed(0)
    vae = AutoencoderKLWan().eval()
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=1280, num_hidden_layers=1, num_attention_heads=16,
                                               intermediate_size=256, image_size=224, patch_size=14)).eval()
    pipe = WanAnimatePipeline(tokenizer=tokenizer, text_encoder=wide_t5(tokenizer, umt5=True), vae=vae,
                              transformer=transformer, image_encoder=encoder, image_processor=CLIPImageProcessor(),
                              scheduler=UniPCMultistepScheduler(**tiny_pipelines.WAN_SCHEDULER))
    return tiny_pipelines._save(pipe, path)


def driving_clips(folder: Path, side: int, frames: int, n: int = 2) -> Path:
    """``folder/driving.csv``: ``n`` rows of random smooth mp4 clips of ``frames`` frames at ``side`` px (the target,
    its pose video and its face video) with captions and a random PNG character each (the CSV columns ``image``,
    ``pose_video``, ``face_video``); returns the CSV's path."""
    from PIL import Image

    from ditforge.data.video import write_video_csv

    folder.mkdir(parents=True, exist_ok=True)
    rng, rows = np.random.default_rng(0), []
    for i in range(n):
        row = {"path": f"clip{i}.mp4", "text": CAPTIONS[i % len(CAPTIONS)], "image": f"char{i}.png",
               "pose_video": f"pose{i}.mp4", "face_video": f"face{i}.mp4"}
        for key in ("path", "pose_video", "face_video"):
            smooth_mp4(folder / row[key], rng, frames, side)
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / row["image"])
        rows.append(row)
    return write_video_csv(rows, folder / "driving.csv", tuple(rows[0]))


def build_cog5b(path: Path) -> Path:
    """A ``CogVideoXPipeline`` folder: CogVideoX-5B's transformer config with random weights (initialised on the GPU
    when there is one, saved in bf16), ``AutoencoderKLCogVideoX``'s default config with ``scaling_factor`` 0.7, a
    one-layer T5 encoder of width 4096 (the real T5-XXL's: 226 x 4096 caption states; the tokenizer trained offline
    as the tests') and the 5B's ``CogVideoXDPMScheduler``."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

    transformer = random_bf16(CogVideoXTransformer3DModel, **COG5B)
    tokenizer = tiny_pipelines.make_t5_tokenizer()
    text = wide_t5(tokenizer)
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(scaling_factor=0.7).eval()
    pipe = CogVideoXPipeline(tokenizer=tokenizer, text_encoder=text, vae=vae, transformer=transformer,
                             scheduler=CogVideoXDPMScheduler(**COG5B_SCHEDULER))
    return tiny_pipelines._save(pipe, path)


def build_hv13b(path: Path) -> Path:
    """A ``HunyuanVideoPipeline`` folder: ``HunyuanVideoTransformer3DModel``'s default config (the released
    HunyuanVideo's: 20 double- and 40 single-stream blocks, 24 heads of 128, 12.8B) with random weights (initialised
    on the GPU when there is one, saved in bf16, 26 GB), ``AutoencoderKLHunyuanVideo``'s default config (the real
    VAE's: 16 channels, 8 x 8 x 4 compression), a two-layer Llama of width 4096 (the pipeline reads the
    third-to-last hidden states: 256 x 4096 caption states, the real Llama-3-8B's width; the tests' word-level
    tokenizer), a one-layer CLIP text model of width 768 (the pooled 768 the transformer reads) and
    ``FlowMatchEulerDiscreteScheduler(shift=7.0)``."""
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
                           HunyuanVideoTransformer3DModel)
    from transformers import LlamaConfig, LlamaModel

    transformer = random_bf16(HunyuanVideoTransformer3DModel)
    tokenizer = tiny_pipelines.make_llama_tokenizer()
    torch.manual_seed(0)
    text = LlamaModel(LlamaConfig(vocab_size=-(-len(tokenizer) // 8) * 8, hidden_size=4096, intermediate_size=256,
                                  num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=2,
                                  hidden_act="silu", max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()
    tokenizer_2 = tiny_pipelines.make_clip_tokenizer()
    text_2 = tiny_pipelines._clip_text(tokenizer_2, 768, projection=False)
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo().eval()
    pipe = HunyuanVideoPipeline(text_encoder=text, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=text_2,
                                tokenizer_2=tokenizer_2)
    return tiny_pipelines._save(pipe, path)


def build_wan5b(path: Path) -> Path:
    """A Wan 2.2 TI2V-5B ``WanPipeline`` folder (``expand_timesteps``): the released transformer config (``WAN5B``:
    30 layers, 24 heads of 128, 48 latent channels, 5.0B) with random weights (initialised on the GPU when there is
    one, saved in bf16), Wan 2.2's VAE (``AutoencoderKLWan`` with 48 channels, 2 x 2-pixel patches, residual blocks,
    16 x 16 x 4 compression; ``latents_mean`` 0 and ``latents_std`` 1: random weights either way), ``build_wan``'s
    one-layer UMT5 of width 4096 and Wan's UniPC flow scheduler."""
    from diffusers import AutoencoderKLWan, WanPipeline

    wan = WanPipeline.from_pretrained(str(build_wan(path.with_name(path.name + "-parts"), config=WAN5B,
                                                    dtype=torch.bfloat16)))
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12,
                           is_residual=True, patch_size=2, latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
                           scale_factor_spatial=16, scale_factor_temporal=4).eval()
    pipe = WanPipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=vae, transformer=wan.transformer,
                       scheduler=wan.scheduler, expand_timesteps=True)
    out = tiny_pipelines._save(pipe, path)
    shutil.rmtree(path.with_name(path.name + "-parts"))
    return out


def build_ltx2b(path: Path) -> Path:
    """An ``LTXPipeline`` folder: ``LTXVideoTransformer3DModel``'s default config (LTX-Video 0.9's: 28 layers, 32
    heads of 64, 128 latent channels in 1 x 1 x 1 patches, 1.9B) with random weights (saved in bf16),
    ``AutoencoderKLLTXVideo``'s default config (32 x 32 x 8 compression), a one-layer T5 of width 4096 (128 x 4096
    caption states) and LTX-Video's dynamically shifted flow scheduler."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel

    transformer = random_bf16(LTXVideoTransformer3DModel)
    tokenizer = tiny_pipelines.make_t5_tokenizer()
    text = wide_t5(tokenizer)
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo().eval()
    pipe = LTXPipeline(tokenizer=tokenizer, text_encoder=text, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(**tiny_pipelines.LTX_SCHEDULER))
    return tiny_pipelines._save(pipe, path)


def video_features(small: Path, out: Path, side: int, frames: int, small_frames: int) -> Path:
    """The features folder ``extract-features`` would write for clips of ``frames`` frames of ``side`` px, made from
    ``small``, one it wrote for the same pipeline from clips of ``small_frames`` frames at a small size: the same
    samples, captions, labels and text states (``cond``, computed by the pipeline's own encoders), the manifest with
    the size keys changed (``image_size``, ``input_size`` = side / f_s, ``num_frames`` = the latent frames
    (frames - 1) / f_t + 1, the VAE's factors f_s and f_t read off ``small``'s manifest), and random posterior
    moments of that shape (mean N(0, 1), as normalised latents; std in [0.05, 0.3]) written as
    ``ditforge.data.store`` writes its shards (the video models). Encoding 81 real frames at 640 px with the Wan VAE
    in float32 would cost minutes of the job's GPU time and says nothing about the training step."""
    from safetensors.torch import load_file

    from ditforge.data.features import FEATURES_MANIFEST, read_manifest
    from ditforge.data.store import _write_shard

    manifest = read_manifest(small)
    f_s, f_t = manifest["image_size"] // manifest["input_size"], (small_frames - 1) // (manifest["num_frames"] - 1)
    latent_frames, s = (frames - 1) // f_t + 1, side // f_s
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for spec in manifest["shards"]:
        tensors = load_file(str(small / spec["file"]))
        shape = (spec["num_samples"], manifest["in_channels"], latent_frames, s, s)
        tensors["mean"] = torch.randn(shape, generator=g)
        if manifest["stochastic"]:
            tensors["std"] = 0.05 + 0.25 * torch.rand(shape, generator=g)
        _write_shard(out / spec["file"], tensors)
    manifest |= {"image_size": side, "input_size": s, "num_frames": latent_frames}
    with atomic_path(out / FEATURES_MANIFEST) as tmp:  # last, as extract-features: the folder is complete
        tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def images(folder: Path, n: int, size: int) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(CAPTIONS[i % len(CAPTIONS)])
    return folder


def ditforge(*argv: str, timeout: float | None = None) -> str:
    """Run ``python -m ditforge *argv``; returns its stderr (the log). Raises RuntimeError on failure."""
    try:
        proc = subprocess.run([sys.executable, "-m", "ditforge", *argv], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"ditforge {argv[0]} took more than {timeout:.0f} s") from None
    if proc.returncode:
        raise RuntimeError(f"ditforge {' '.join(argv[:1])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stderr


def row_flags(model: str, name: str) -> list[str]:
    """The ``ditforge train`` flags of row ``name`` for ``model`` (``WAN_ROWS`` override ``ROWS`` for wan13)."""
    return (WAN_ROWS if model.startswith("wan") and name in WAN_ROWS else ROWS)[name]


def run_row(name: str, pipe: Path, feats: Path, work: Path, batch: int, steps: int, log_every: int,
            device: str, timeout: float | None = None, flags: list[str] | None = None) -> dict:
    out = work / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    try:
        log = ditforge("train", "--init_from", str(pipe), "--data", str(feats), "--batch_size", str(batch),
                       "--max_steps", str(steps), "--log_every", str(log_every), "--sample_every", "0",
                       "--ckpt_every", str(10 * steps), "--keep_last", "1", "--device", device, "--num_workers", "0",
                       "--outputs", str(out), *(ROWS[name] if flags is None else flags), timeout=timeout)
    except RuntimeError as e:
        shutil.rmtree(out, ignore_errors=True)  # a row cut short must not leave its checkpoint to fill the disk
        print(f"{name} failed; the log's end:\n{e}", flush=True)  # the JSON keeps 600 characters, the job's log 3,000
        return {"error": str(e)[-600:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)  # full fine-tunes write ~14 GB of checkpoint
    windows = [batch / r["samples_per_sec"] * 1000 for r in records[1:]]  # ms per step after the warm-up window
    # the placement lines of --gpu_memory_budget (the measured residency of streamed states among them) and the host
    # bytes of --blocks_to_swap
    placement = [line.split(" INFO ", 1)[-1] for line in log.splitlines()
                 if "--gpu_memory_budget" in line or "--blocks_to_swap" in line]
    # --enable_flashattn's per-shape choice (ops.flash4: the kernel taken, both medians)
    attention = [line.split(" INFO ", 1)[-1] for line in log.splitlines() if "exact attention at" in line]
    # the seconds of each --validation_prompts rendering (the trainer's "validation samples in ... (X s)" lines)
    validation = [float(line.rsplit("(", 1)[1].split(" s)")[0]) for line in log.splitlines()
                  if "validation samples in" in line]
    return {"ms_per_step": round(statistics.median(windows), 1), "windows_ms": [round(w, 1) for w in windows],
            **({"validation_s": validation} if validation else {}),
            "peak_gib": round(max(r.get("peak_memory_gib", 0.0) for r in records), 2),
            "final_loss": round(records[-1]["loss"], 4), **({"placement": placement} if placement else {}),
            **({"exact_attention": attention} if attention else {})}


# --distill (issue 65): `ditforge distill` of the pipeline folder (wan13: Wan2.1-T2V-1.3B's config, random weights) at
# 480 x 832 x 81 (--tiny: 16 x 16 x 5), a 4-step student, 5 critic steps per generator step, every block checkpointed
DISTILL_ROWS = {"lora32": ["--lora_rank", "32"], "lora64": ["--lora_rank", "64"],
                "lora32_nockpt": ["--lora_rank", "32", "--no-grad_checkpoint"],
                "lora32_fp8": ["--lora_rank", "32", "--fp8_base"], "full": ["--lora_rank", "0"],
                "full_critic_lora32": ["--lora_rank", "0", "--critic_lora_rank", "32"]}
DISTILL_CRITIC_STEPS = 5


def distill_row(name: str, pipe: Path, work: Path, size: tuple[int, int, int], batch: int, steps: int, device: str,
                timeout: float | None = None) -> dict:
    """One ``ditforge distill`` row: ``steps`` iterations (at least 2 generator ones after the first, the warm-up),
    one metrics record each. Returns the median seconds of an iteration with a generator step (and its critic step)
    and of one with a critic step alone, the peak memory, and the GPU-hours of 600 generator steps at batch 8
    (600 generator iterations + 600 x (critic_steps - 1) critic ones, the time scaled by 8 / batch)."""
    out, prompts = work / f"distill-{name}", work / "distill_prompts.txt"
    prompts.write_text("\n".join(CAPTIONS) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    height, width, frames = size
    try:
        ditforge("distill", "--teacher", str(pipe), "--prompt_file", str(prompts), "--student_steps", "4",
                 "--critic_steps", str(DISTILL_CRITIC_STEPS), "--height", str(height), "--width", str(width),
                 "--num_frames", str(frames), "--batch_size", str(batch), "--max_steps", str(steps), "--log_every", "1",
                 "--ckpt_every", str(10 * steps), "--keep_last", "1", "--device", device, "--outputs", str(out),
                 *DISTILL_ROWS[name], timeout=timeout)
    except RuntimeError as e:
        shutil.rmtree(out, ignore_errors=True)
        return {"error": str(e)[-600:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)
    gen = [1 / r["steps_per_sec"] for r in records[1:] if "generator_loss" in r]
    critic = [1 / r["steps_per_sec"] for r in records[1:] if "generator_loss" not in r]
    t_gen, t_critic = statistics.median(gen), statistics.median(critic)
    hours = 600 * (t_gen + (DISTILL_CRITIC_STEPS - 1) * t_critic) * (8 / batch) / 3600
    return {"generator_iteration_s": round(t_gen, 3), "critic_iteration_s": round(t_critic, 3),
            "peak_gib": round(max(r.get("peak_memory_gib", 0.0) for r in records), 2),
            "gpu_hours_600_generator_steps_batch8": round(hours, 2), "iterations": len(records)}


def distill_rows(args, pipe: Path, work: Path, batch: int) -> None:
    """``--distill``: the rows of ``DISTILL_ROWS`` named by ``--rows`` (default lora32), printed and written to
    ``--json`` after each."""
    import diffusers

    size = (16, 16, 5) if args.tiny else (480, 832, 81)
    steps = max(args.steps, 2 * DISTILL_CRITIC_STEPS + 1)
    meta = {"date": datetime.date.today().isoformat(), "model": args.model, "mode": "distill", "batch_size": batch,
            "height_width_frames": list(size), "student_steps": 4, "critic_steps": DISTILL_CRITIC_STEPS,
            "iterations": steps, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "diffusers": diffusers.__version__, **library_versions()}
    rows = "lora32" if args.rows == ROWS_DEFAULT else args.rows
    results = {}
    for name in rows.split(","):
        results[name] = distill_row(name, pipe, work, size, batch, steps, args.device, args.row_timeout)
        print(f"{args.model} distill {name}: {results[name]}", flush=True)
        if args.json:
            with atomic_path(args.json) as tmp:
                tmp.write_text(json.dumps({"meta": meta, "rows": results}, indent=1))


def profile_row(model_name: str, name: str, pipe: Path, feats: Path, batch: int, steps: int = 3) -> None:
    """Where a row's step goes, in this process (the trainer's pieces, not its loop): wall ms per step against the
    GPU kernel time of the same steps (torch.profiler), and the largest kernels. Wall far above kernel time: the
    step waits on the host (launches, Python)."""
    from torch.profiler import ProfilerActivity, profile

    from timing import print_top_kernels
    from ditforge.config.load import build_config
    from ditforge.data import build_dataset
    from ditforge.diffusion.objective import create_objective
    from ditforge.encoders.batch import BatchEncoder
    from ditforge.parallel.ema import EMA
    from ditforge.parallel.mesh import Dist
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.train import finetune
    from ditforge.train.step import step_randomness, train_step
    from ditforge.weights.lora import add_lora_to_denoiser

    row = row_flags(model_name, name)

    def value(flag: str, bare: str) -> str | None:  # a flag's value, ``bare`` when given without one, None if absent
        if flag not in row:
            return None
        i = row.index(flag)
        return row[i + 1] if i + 1 < len(row) and not row[i + 1].startswith("--") else bare

    cfg = build_config(overrides={"init_from": str(pipe), "data": str(feats),
                                  "lora_rank": int(value("--lora_rank", "0") or 0)})
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    pre = load_pretrained(pipe, dev, text_device=torch.device("cpu"))
    ds = build_dataset(str(feats), None)
    model = pre.denoiser.train()
    if cfg.model.lora_rank:
        add_lora_to_denoiser(model, cfg)
        if "--fp8_base" in row:
            finetune.store_base_in_fp8(model, torch.bfloat16, "none")
        for p in model.parameters():
            if not p.requires_grad and p.element_size() > 1:
                p.data = p.data.to(torch.bfloat16)
    # the row's checkpointing, activation offload and compile, as the trainer applies them
    from ditforge.parallel import parallelize

    model = parallelize(model, Dist(device=dev), grad_checkpoint=value("--grad_checkpoint", "full") or "none",
                        compile=value("--compile", "default") or "none",
                        offload_activations="--offload_activations" in row)
    objective = create_objective("auto", model.learn_sigma, pre.scheduler_config, device=dev)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ema = EMA(model, trainable_only=bool(cfg.model.lora_rank))
    items = [ds[i] for i in range(batch)]
    batch_ = {"mean": torch.stack([i["mean"] for i in items]), "std": torch.stack([i["std"] for i in items]),
              "cond": {k: torch.stack([i["cond"][k] for i in items]) for k in items[0]["cond"]}}
    enc = BatchEncoder("text", prompt_encoder=pre.encode_prompt)
    mean, std = enc.moments(batch_, dev)
    cond = enc.conditioning(batch_, dev)
    shape = tuple(mean.shape[1:])

    def step(k: int) -> None:
        rnd = step_randomness(0, k, batch, shape, objective, 0.1, dev, latent_noise=True)
        train_step(model, objective, opt, None, [(mean + std * rnd.eps, cond, rnd)], torch.bfloat16, 1.0,
                   Dist(device=dev))
        ema.update(model, 0.999)

    import time

    for k in range(8):
        step(k)
    sync()
    t0 = time.perf_counter()
    for k in range(10):
        step(k)
    sync()
    wall = (time.perf_counter() - t0) * 100  # ms per step
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(steps):
            step(k)
        sync()
    print(f"\n{name}: {wall:.1f} ms per step (events, 10 steps)", flush=True)
    print_top_kernels(prof, 12, f"{name}: {steps} steps")


def library_versions() -> dict[str, str]:
    """The installed versions of the optimizer libraries (bitsandbytes, torchao); absent ones are left out."""
    import importlib.metadata

    found = {}
    for name in ("bitsandbytes", "torchao"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("sd15", "pixart", "sdxl", "wan13", "wan14", "cog5b", "hv13b", "wan5b",
                                        "ltx2b", "vace13", "animate14"), required=True)
    ap.add_argument("--rows", default=ROWS_DEFAULT)
    ap.add_argument("--distill", action="store_true", help="time `ditforge distill` rows (DISTILL_ROWS, default "
                    "lora32) of the pipeline folder instead of fine-tuning (wan13: 480 x 832 x 81; --tiny 16 x 16 x 5)")
    ap.add_argument("--work", default="/tmp/ditforge-finetune")
    ap.add_argument("--batch_size", type=int, default=None, help="default: 1 (sd15, sdxl, video), 8 (pixart), as the "
                    "anchors")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log_every", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny pipeline at 32 px (checks the script on CPU)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--row_timeout", type=float, default=None, help="seconds a row may take (then it is an error)")
    ap.add_argument("--append", action="store_true", help="keep the rows already in --json (a job that runs the "
                    "anchor between two calls of this script)")
    ap.add_argument("--profile", action="store_true", help="profile the rows in this process instead of timing them "
                    "through `ditforge train` (profile_row)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    batch = args.batch_size or (8 if args.model == "pixart" else 1)
    wan = args.model in VIDEO  # a video model: features rewritten to the real size (video_features)
    # wan13: 640 px x 81 frames, cog5b 592 px x 49 (VIDEO); --tiny: the tiny pipeline's rewritten to 32 px x 9 frames
    size = (32 if args.tiny else 1024 if args.model == "sdxl" else VIDEO[args.model][0] if wan else 512)
    frames = (9 if args.tiny else VIDEO[args.model][1]) if wan else None
    pipe = work / f"{args.model}{'-tiny' if args.tiny else ''}"
    if not (pipe / "model_index.json").is_file():
        builders = ({"sd15": tiny_pipelines.make_sd, "pixart": tiny_pipelines.make_pixart,
                     "sdxl": tiny_pipelines.make_sdxl, "wan13": tiny_pipelines.make_wan,
                     "wan14": tiny_pipelines.make_wan,
                     "cog5b": tiny_pipelines.make_cogvideox, "hv13b": tiny_pipelines.make_hunyuan_video,
                     "wan5b": tiny_pipelines.make_wan22_ti2v, "ltx2b": tiny_pipelines.make_ltx,
                     "vace13": tiny_pipelines.make_vace, "animate14": tiny_pipelines.make_animate}
                    if args.tiny else {"sd15": build_sd15, "pixart": build_pixart, "sdxl": build_sdxl,
                                       "wan13": build_wan,
                                       "wan14": functools.partial(build_wan, config=WAN14, dtype=torch.bfloat16),
                                       "cog5b": build_cog5b, "hv13b": build_hv13b, "wan5b": build_wan5b,
                                       "ltx2b": build_ltx2b, "vace13": build_vace13,
                                       "animate14": build_animate14})
        builders[args.model](pipe)
        if torch.cuda.is_available():  # wan13 initialises its transformer on the GPU: free it for the rows
            torch.cuda.empty_cache()
    if args.distill:  # data-free: no features
        return distill_rows(args, pipe, work, batch)
    feats = work / f"feats-{pipe.name}"
    clip_flags = []  # vace13: the clips' reading flags
    if args.model == "vace13":
        side, frames = (16, 5) if args.tiny else (VACE_SIDE, VACE_FRAMES)
        size, feats = side, reference_clips(work / f"clips-{pipe.name}", side, frames)
        clip_flags = ["--num_frames", str(frames), "--frame_interval", "1", "--image_size", str(side)]
    elif args.model == "animate14":
        side, frames = (16, 5) if args.tiny else (ANIMATE_SIDE, ANIMATE_FRAMES)
        size, feats = side, driving_clips(work / f"clips-{pipe.name}", side, frames)
        clip_flags = ["--num_frames", str(frames), "--frame_interval", "1", "--image_size", str(side)]
    elif not (feats / "features.json").is_file():
        shutil.rmtree(feats, ignore_errors=True)
        if wan:  # extract at the VAE's smallest size (the built-in clips), then the real-size moments
            _, _, small_frames, small_side = VIDEO[args.model]
            if args.tiny:  # the tiny VAEs compress less; Wan 2.2's 2 x 2 patches of 16 px latents take 32 px
                small_side = 32 if args.model in ("cog5b", "wan5b") else 16
            small = work / f"feats-{pipe.name}-small"
            shutil.rmtree(small, ignore_errors=True)
            ditforge("extract-features", "--init_from", str(pipe), "--data", "clips", "--num_frames",
                     str(small_frames), "--image_size", str(small_side), "--device", args.device, "--num_workers",
                     "0", "--batch_size", "4", "--out", str(small))
            video_features(small, feats, size, frames, small_frames)
        else:
            data = images(work / f"images-{size}", 16, size)
            ditforge("extract-features", "--init_from", str(pipe), "--data", str(data), "--image_size", str(size),
                     "--device", args.device, "--num_workers", "0", "--batch_size", "8", "--out", str(feats))
    if args.profile:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        for name in args.rows.split(","):
            profile_row(args.model, name, pipe, feats, batch)
        return
    import diffusers

    meta = {"date": datetime.date.today().isoformat(), "model": args.model, "batch_size": batch, "image_size": size,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__, "diffusers": diffusers.__version__, "steps": args.steps,
            "log_every": args.log_every, **library_versions()}
    if args.model == "vace13":
        meta |= {"num_frames": frames, "note": "clips read, VAE-encoded and their reference's control built in each "
                 "step (VACE trains from clips)"}
    elif args.model == "animate14":
        meta |= {"num_frames": frames, "note": "clips read, VAE-encoded and their character, pose and face "
                 "conditioning built in each step (Animate trains from clips)"}
    elif wan:
        from ditforge.data import build_dataset

        item = build_dataset(str(feats), None)[0]  # the shapes the rows train on, as read back
        meta |= {"num_frames": frames, "latents": list(item["mean"].shape),
                 "caption_states": list(item["cond"]["encoder_hidden_states"].shape),
                 "note": ("the tests' tiny pipeline" if args.tiny else
                          "square frames: ditforge trains at one --image_size; the anchor runs 480 x 832 (latents 16 x "
                          "21 x 60 x 104, 32,760 tokens), these rows 640 x 640 (16 x 21 x 80 x 80, 33,600 tokens)"
                          if args.model.startswith("wan") else
                          "square frames: CogVideoX-5B's 480 x 720 x 49 is 17,550 tokens, these rows 592 x 592 x 49 "
                          "(16 x 13 x 74 x 74, 17,797 tokens)" if args.model == "cog5b" else
                          "HunyuanVideo at 544 x 544 x 61 (16 x 16 x 68 x 68, 18,496 tokens), about 960 x 544 x 33"
                          if args.model == "hv13b" else
                          "Wan 2.2 TI2V-5B at 960 x 960 x 121 (48 x 31 x 60 x 60, 27,900 tokens): 704 x 1280 x 121's "
                          "27,280" if args.model == "wan5b" else
                          "LTX-Video at 576 x 576 x 161 (128 x 21 x 18 x 18, 6,804 tokens): 704 x 480 x 161's 6,930")}
    results = {}
    if args.append and args.json and Path(args.json).is_file():
        results = json.loads(Path(args.json).read_text())["rows"]
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    (work / "validation.txt").write_text(VALIDATION.format(*((32, 16, 5) if args.tiny else (832, 480, 33))))
    for name in args.rows.split(","):
        flags = [f.format(work=work) for f in row_flags(args.model, name)] + clip_flags
        if not cuda and any(f in flags for f in CUDA_ONLY):
            print(f"{args.model} {name}: skipped ({' '.join(f for f in flags if f in CUDA_ONLY)} needs a CUDA GPU)",
                  flush=True)
            continue
        results[name] = run_row(name, pipe, feats, work, batch, args.steps, args.log_every, args.device,
                                args.row_timeout, flags)
        print(f"{args.model} {name}: {results[name]}", flush=True)
        if args.json:  # after every row, so that a job cut short keeps the rows it measured
            with atomic_path(args.json) as tmp:
                tmp.write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
    print(f"\n{args.model}, {size}px, batch {batch} ({meta['device']}, torch {meta['torch']}):")
    print(f"{'row':16s} {'ms/step':>9s} {'peak GiB':>9s}")
    for name, r in results.items():
        print(f"{name:16s} {r.get('ms_per_step', 'failed')!s:>9s} {r.get('peak_gib', '')!s:>9s}")


if __name__ == "__main__":
    main()
