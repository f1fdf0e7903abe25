"""Typed run configuration: defaults, then an optional YAML file, then command-line flags; validated once.

Each field's ``help`` is also its command-line help, so ``ditforge train --help`` and this file cannot drift.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ditforge.errors import UserError

if typing.TYPE_CHECKING:
    import torch

MIXED_PRECISION = ("auto", "fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName
# --mixed_precision fp8 in training: float8 only in layers at least this wide on both sides, where it was measured
# to pay (a DiT block's compiled forward + backward, bf16 against torchao's tensorwise float8, 8,192 tokens:
# benchmarks/kernels.py fp8-train; docs/speed.md#fp8-training-by-width).
FP8_MIN_WIDTH = 2048
SAMPLING_PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8")  # weights are cast for sampling
PLUGINS = ("auto", "none", "ddp", "zero2", "fsdp")
OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adamw_fp8", "adafactor")
LIBRARY_OPTIMIZERS = ("adamw4bit", "adamw_fp8", "adafactor")  # the libraries' own, stepped after the backward
MASTER_WEIGHTS = ("fp32", "bf16", "bf16_sr")
CPU_OFFLOAD = ("none", "optimizer", "all")
CONDITIONS = ("auto", "class", "text")
SEQUENCE_PARALLEL_TYPES = ("auto", "ulysses", "ring", "fastseq", "fastseq_kv", "usp")
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OBJECTIVES = ("auto", "ddpm", "v", "flow")
WEIGHTING_SCHEMES = ("logit_normal", "uniform")
EXPERTS = ("high_noise", "low_noise")  # Wan 2.2 A14B's transformer and transformer_2
RESIZE_MODES = ("center_crop", "letterbox")
REPORT_TO = ("auto", "tensorboard", "wandb", "all", "none")


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class ModelConfig:
    model: str | None = _f(None, "model name: DiT-{T,S,B,L,XL,7B}/{1,2,4,8} (e.g. DiT-XL/2) for images; for "
                                 "videos vDiT-{T,S,B,L,XL,7B}/{t}{h}{w} (3-D patches, full attention, e.g. "
                                 "vDiT-XL/222) or STDiT-{T,S,B,L,XL,7B}/{p} (spatial and temporal attention, e.g. STDiT-XL/2) "
                                 "(default: DiT-T/2 for images, vDiT-T/244 for videos)")
    depth: int | None = _f(None, "transformer blocks, in place of the --model size's (its width and heads stay): "
                                 "e.g. --model DiT-7B/2 --depth 2 for a quick run at width 4096")
    condition: str = _f("auto", "conditioning: class (labels) | text (cross-attention to caption states) | auto "
                                "(text for video data, class for images)", choices=CONDITIONS)
    text_encoder: str | None = _f(None, "local Hugging Face folder of the caption encoder (T5, CLIP or BERT-like; "
                                        "default: the shipped all-MiniLM-L6-v2)")
    text_max_length: int | None = _f(None, "caption tokens kept, special tokens included (default: the "
                                           "encoder's: T5 120, CLIP 77, MiniLM 256)")
    vae: str = _f("none", "local diffusers AutoencoderKL folder (e.g. sd-vae-ft-ema) to train on its latents "
                          "(video: frame by frame), or none for pixel space")
    qk_norm: bool = _f(False, "LayerNorm on the queries and keys of every attention (stability of large models)")
    num_classes: int | None = _f(None, "number of class labels (default: from the data)")
    learn_sigma: bool = _f(True, "predict the variance too (hybrid loss of Improved DDPM)")
    class_dropout_prob: float = _f(0.1, "label (or caption) dropout probability for classifier-free guidance")
    init_from: str | None = _f(None, "start from pretrained weights: a local diffusers pipeline folder "
                                     "(model_index.json) of Stable Diffusion 1.x/2.x/XL, PixArt-alpha/sigma, SD3, "
                                     "Wan 2.1 (T2V, I2V), Wan 2.2 A14B, CogVideoX 1.0 (T2V, I2V), LTX-Video, "
                                     "HunyuanVideo or DiT, "
                                     "an official DiT .pt, or a ditforge run, checkpoint or export; the folder decides "
                                     "the denoiser, text encoders, VAE and objective")
    objective: str = _f("auto", "training objective: ddpm (epsilon) | v (v-prediction) | flow (rectified flow) | "
                                "auto (the --init_from pipeline's scheduler; else ddpm)", choices=OBJECTIVES)
    flow_shift: float | None = _f(None, "flow: timestep shift t' = s t / (1 + (s - 1) t) (default: the scheduler's "
                                        "shift, else 1)")
    weighting_scheme: str = _f("logit_normal", "flow: density of the training times: logit_normal (SD3) | uniform",
                               choices=WEIGHTING_SCHEMES)
    logit_mean: float = _f(0.0, "flow: mean of the logit-normal time density")
    logit_std: float = _f(1.0, "flow: standard deviation of the logit-normal time density")
    lora_rank: int = _f(0, "train LoRA adapters of this rank instead of all weights (0: full fine-tuning)")
    lora_alpha: float | None = _f(None, "LoRA scale numerator: updates are scaled by alpha / rank (default: rank)")
    lora_target_modules: str | None = _f(None, "comma-separated module names LoRA adapts (default: to_q,to_k,to_v,"
                                               "to_out.0 for diffusers models; qkv,proj for ditforge's DiT)")
    fp8_base: bool = _f(False, "LoRA on a diffusers pipeline: store the frozen transformer's layers in float8 "
                               "e4m3, each upcast to the compute dtype while it runs (diffusers' "
                               "enable_layerwise_casting, as finetrainers' layerwise upcasting and musubi-tuner's "
                               "--fp8_base): half the bf16 base's memory; adapters, norms and embedders stay as "
                               "they are. --gpu_memory_budget turns it on where the bf16 base would take over a "
                               "quarter of the budget")
    noised_image_input: bool = _f(True, "CogVideoX image-to-video fine-tuning: each clip's first frame gets "
                                        "Gaussian pixel noise of sigma = exp(N(-3, 0.5)) before the VAE, and its "
                                        "latents are a posterior draw (CogVideoX's own I2V recipe); "
                                        "--no-noised_image_input conditions on the clean frame. Stored features "
                                        "hold the clean frame's latents")
    expert: str | None = _f(None, "Wan 2.2 A14B (two experts): the one to fine-tune, high_noise (transformer: "
                                  "timesteps at and above boundary_ratio x 1000) or low_noise (transformer_2: those "
                                  "below); its training times are drawn from its range alone. The other expert stays "
                                  "frozen in host memory and joins it for ditforge sample and export",
                            choices=EXPERTS)
    train_text_encoder: bool = _f(False, "train the --init_from pipeline's text encoder too (Stable Diffusion 1.x / "
                                         "2.x; with --lora_rank, LoRA on its attention projections)")
    family: str | None = _f(None, "the --init_from pipeline's family (sd | pixart | sd3), or None", cli=False)
    in_channels: int | None = _f(None, "input channels (default: from the data)", cli=False)
    input_size: int | None = _f(None, "spatial input size of the model (default: --image_size)", cli=False)
    num_frames: int | None = _f(None, "frames of the model's input (video models: --num_frames)", cli=False)
    text_dim: int | None = _f(None, "width of the caption states (text conditioning; from the encoder)", cli=False)


@dataclass
class DataConfig:
    data: str = _f("digits", "digits (built-in 8x8 images) | clips (built-in captioned videos) | a video CSV "
                             "(path,text[,num_frames,fps,height,width]; see `ditforge preprocess`) | an image "
                             "folder ROOT/<class>/<image> | captioned images (a folder of images with <stem>.txt "
                             "captions, or a CSV / JSONL of path,text) | a features folder of `ditforge "
                             "extract-features` | WebDataset shards (a folder of .tar with or without shards.json, a glob, a "
                             "brace list shard-{000..009}.tar, an fsspec URL) or a YAML blend of them "
                             "(- {path: ..., weight: 0.7})")
    image_size: int | None = _f(None, "image (frame) side in pixels (digits: 8; clips: 32; required otherwise)")
    num_frames: int | None = _f(None, "frames per video clip (video data; default 16)")
    frame_interval: int = _f(3, "temporal stride between the frames of a clip; shorter videos use the largest "
                                "stride that fits")
    random_flip: bool | None = _f(None, "random horizontal flips of the latents (default: on for image folders, off "
                                     "for digits and for video pipelines such as Wan, whose 3-D VAE latents are not "
                                     "mirror-symmetric; refused for image-to-video pipelines)")
    resize_mode: str = _f("center_crop", "captioned images: center_crop (short side to --image_size, centre square) "
                                         "| letterbox (long side to --image_size, padded with mid grey)",
                          choices=RESIZE_MODES)
    instance_data: str | None = _f(None, "DreamBooth: a folder of images of the subject (replaces --data)")
    instance_prompt: str | None = _f(None, "DreamBooth: the caption of every instance image, e.g. 'a photo of sks "
                                           "dog'")
    class_data: str | None = _f(None, "DreamBooth prior preservation: a folder of class images; the base model "
                                      "generates the missing ones up to --num_class_images")
    class_prompt: str | None = _f(None, "DreamBooth prior preservation: the class images' caption, e.g. 'a photo "
                                        "of dog'")
    num_class_images: int = _f(100, "DreamBooth prior preservation: class images wanted in --class_data")
    prior_loss_weight: float = _f(1.0, "DreamBooth prior preservation: weight of the class images' loss")
    buckets: str | None = _f(None, "multi-resolution buckets (Open-Sora's bucket_config): a YAML or JSON file "
                                   "{resolution: {frames: [keep probability, global batch size]}}, e.g. {256px: {1: "
                                   "[1.0, 64], 16: [0.5, 8]}}; --data is then a CSV / JSONL of path,text naming images "
                                   "and videos (--batch_size is not used: each bucket has its own), or with "
                                   "--pack_tokens also raw shards (steps of --batch_size samples of several buckets; "
                                   "see docs/buckets.md)")
    num_workers: int | None = _f(None, "data loader worker processes per training process (default: 0 for "
                                       "digits, clips and features, which live in memory or are memory-mapped; "
                                       "for files, this host's CPU cores per process less one, 1 to 8; latent "
                                       "shards: 1; raw shards: as files, lowered to split the process's streams "
                                       "evenly)")
    data_streams: int | None = _f(None, "shard data: virtual streams K the order is built of, fixed for a run "
                                        "(it must divide --batch_size, and processes x --num_workers must divide "
                                        "it; default: gcd(--batch_size, lcm(16, data-parallel processes)))")
    shuffle_shards: int = _f(4, "shard data: each stream shuffles its samples uniformly within windows of this "
                                "many shards")
    shard_retries: int = _f(3, "shard data: tries again to read an unreadable or truncated shard this many times "
                               "(0.1 s backoff, doubling) before skipping what cannot be read")


@dataclass
class TrainConfig:
    batch_size: int = _f(64, "global batch size (all processes together)")
    max_steps: int | None = _f(None, "optimizer steps to run (default: 1000, or --epochs)")
    epochs: int | None = _f(None, "epochs to run instead of --max_steps")
    lr: float | None = _f(None, "learning rate (default: 1e-4 as DiT's paper; 1e-3 for the tiny DiT-T and vDiT-T; "
                                "with --init_from 1e-5, LoRA 1e-4; --optimizer adafactor 1e-2)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    optimizer: str = _f("adamw", "adamw (fp32 moments; torch's fused kernel) | adamw8bit (bitsandbytes' 8-bit "
                                 "blockwise moments: 2 bytes per parameter instead of 8) | adamw4bit (torchao's 4-bit "
                                 "moments: 1 byte) | adamw_fp8 (torchao's float8 moments: 2 bytes) | adafactor "
                                 "(torch's: factored second moments, no first; --lr is its maximum relative step "
                                 "size, default 1e-2). The last three step after the backward, over fp32 weights",
                     choices=OPTIMIZERS)
    master_weights: str = _f("fp32", "fp32 | bf16 (trainable weights and their gradients in bf16, with a bf16 Kahan "
                                     "compensation that keeps the fp32 master to 2^-17 per step: 6 bytes per "
                                     "parameter instead of 8) | bf16_sr (bf16 weights and gradients, updates "
                                     "rounded stochastically: 4 bytes); the bf16 modes need --mixed_precision bf16",
                             choices=MASTER_WEIGHTS)
    fused_backward_pass: bool = _f(False, "run the optimizer step inside the backward, a block at a time, and free "
                                          "each block's gradients at once (kohya's flag; one process, not with "
                                          "fp16; --max_grad_norm then clips by the previous step's norm)")
    fused_optimizer: str = _f("auto", "auto: on CUDA GPUs one Triton pass per step applies the clipping, the AdamW "
                                      "update (any --optimizer / --master_weights) and the EMA, reading and "
                                      "writing each tensor once | off: the libraries' kernels (torch's fused "
                                      "AdamW, bitsandbytes) and a separate EMA pass", choices=("auto", "off"))
    cpu_offload: str = _f("none", "none | optimizer: the optimizer's states (moments, Kahan compensation) live in "
                                  "pinned host memory and stream to the GPU for each step, through a 256 MiB "
                                  "ring, overlapped with the backward under --fused_backward_pass (needs the "
                                  "one-pass step: a CUDA GPU with Triton, --fused_optimizer auto, --plugin none "
                                  "or ddp) | all: the fp32 weights, gradients and AdamW states live in pinned "
                                  "host memory, sharded by FSDP2 (torch's CPUOffloadPolicy, --plugin fsdp, or "
                                  "zero2, also in one process); each block's weights visit the GPU in the compute "
                                  "dtype for its forward and backward, and torch's fused AdamW steps on the CPU "
                                  "(--optimizer adamw --master_weights fp32)", choices=CPU_OFFLOAD)
    delayed_update: bool = _f(False, "with --cpu_offload all: ZeRO-Offload's one-step delayed parameter update "
                                     "(Ren et al. 2021, sec. 5.2): the CPU step of step t's gradients runs in "
                                     "a thread during step t+1, whose forward uses the weights before it")
    gpu_memory_budget: str | None = _f(None, "GPU memory for this process, e.g. 8GiB: with --optimizer, "
                                             "--master_weights and --fused_backward_pass left at their defaults, "
                                             "the fastest placement (fp32 AdamW; adamw8bit; + bf16 weights; "
                                             "+ bf16_sr; + fused backward pass) whose state leaves 0.5 GiB for "
                                             "activations; a cap as on a GPU of that size "
                                             "(torch.cuda.set_per_process_memory_fraction)")
    warmup_steps: int = _f(0, "linear learning-rate warm-up steps")
    max_grad_norm: float = _f(1.0, "clip the gradient norm to this (0: no clipping)")
    mixed_precision: str = _f("auto", "compute precision: fp32 | bf16 | fp16 | fp8 (bf16, with float8 matrix "
                                      "products in the blocks' linear layers at least --fp8_min_width wide; "
                                      "torchao, H100-class GPU) | auto (bf16 on GPU, fp32 on CPU)",
                              choices=MIXED_PRECISION)
    fp8_min_width: int = _f(FP8_MIN_WIDTH, "--mixed_precision fp8: float8 only in the blocks' linear layers whose "
                                           "input and output widths are both at least this; narrower ones stay "
                                           "bf16 (float8 pays from width 2048 on H100 / H200: docs/speed.md; "
                                           "DiT-XL/2's 1152 is not)")
    fp8_recipe: str = _f("tensorwise", "scaling of --mixed_precision fp8 (torchao's float8 training recipes): "
                                       "tensorwise (one scale per tensor) | rowwise (per row of each operand, e4m3 "
                                       "everywhere) | rowwise_with_gw_hp (rowwise, the weight gradient in bf16; "
                                       "needs --compile)", choices=FP8_RECIPES)
    grad_checkpoint: str = _f("none", "activation checkpointing: none | full (every block; the bare flag) | "
                                      "every-K (every K-th block) | op (keep matmul and attention outputs, "
                                      "recompute the element-wise ops) | attn (keep the attention outputs alone: "
                                      "long video sequences)", const="full")
    offload_activations: bool = _f(False, "the transformer blocks keep the tensors saved for their backward, "
                                          "parameters excepted, in pinned host memory (copied out in the forward, "
                                          "back in the backward, on the compute stream): a block --grad_checkpoint "
                                          "checkpoints saves its inputs alone, the others all their activations")
    blocks_to_swap: int = _f(0, "LoRA on a diffusers pipeline: the frozen weights of the last N transformer blocks "
                                "live in pinned host memory and visit the GPU one block at a time, copied a block "
                                "ahead on a side stream (diffusion-pipe's blocks_to_swap; for a base that does not "
                                "fit, Wan-14B on 24 GB). Needs --grad_checkpoint (else the backward holds every "
                                "block's copy) and no --compile")
    enable_flashattn: bool = _f(False, "attention through the fastest exact kernel on GPUs (cuDNN, then Flash, on "
                                       "Hopper/Blackwell with cuDNN > 9.15; Flash first elsewhere)")
    enable_modulate_kernel: bool = _f(False, "fused Triton kernels: LayerNorm + adaLN modulate in one pass, "
                                             "and the gated residual")
    enable_layernorm_kernel: bool = _f(False, "LayerNorm as a Triton kernel (modulate stays in PyTorch)")
    pack_tokens: int = _f(0, "pack each micro-batch's samples (any sizes and frame counts) into rows of N tokens, "
                             "attention within each sample (on GPUs flash variable-length attention, else "
                             "FlexAttention), the loss as unpacked; DiT "
                             "and vDiT (0: no packing)")
    compile: str = _f("none", "torch.compile every transformer block (the first steps are slow while it "
                              "compiles): none | default (the bare flag) | max-autotune-no-cudagraphs | "
                              "reduce-overhead or max-autotune (with CUDA graphs: static shapes, one process)",
                      const="default", choices=COMPILE_MODES)
    ema_decay: float = _f(0.9999, "EMA decay; the effective decay is min(decay, (1+k)/(10+k)) at step k; 0: no "
                                  "EMA (sampling and export use the weights; no memory for a copy)")
    ckpt_every: int = _f(1000, "save a checkpoint every N steps (and always at the end or on Ctrl-C)")
    keep_last: int = _f(2, "keep the newest K checkpoints")
    on_nonfinite: str = _f("skip", "a step whose loss or gradient norm is NaN or inf: skip (its optimizer and EMA "
                                   "updates are skipped and counted; stop after --max_nonfinite_steps in a row) | "
                                   "stop (at the first)", choices=("skip", "stop"))
    max_nonfinite_steps: int = _f(20, "with --on_nonfinite skip: stop the run after this many non-finite steps "
                                      "in a row")
    loss_spike_factor: float | None = _f(None, "roll back on a loss spike (PaLM, Chowdhery et al. 2022, sec. 5.1): at "
                                               "each metrics record (--log_every), when the mean loss over the last "
                                               "--loss_spike_window steps (all processes, skipped steps left out) is "
                                               "more than F times the median of the latest 100 such means that were "
                                               "not spikes, reload the newest checkpoint saved before that window, "
                                               "skip the batches from it up to the spike, and go on; F > 1 (default: "
                                               "off)")
    loss_spike_window: int = _f(100, "with --loss_spike_factor: the steps whose mean loss is checked")
    max_loss_spike_rollbacks: int = _f(3, "with --loss_spike_factor: stop the run at a spike that follows this many "
                                          "rollbacks with no spike-free check between them (0: at the first spike)")
    continue_on_save_error: bool = _f(False, "go on when a checkpoint, sample grid or metrics line cannot be "
                                             "written (a full disk), warning each time, instead of stopping")
    log_every: int = _f(50, "write metrics every N steps")
    sample_every: int = _f(500, "write a grid of EMA samples every N steps and at the end (0: none)")
    eval_every: int = _f(0, "every N steps and at the end, the digits-FID, precision, recall and class accuracy "
                            "of --eval_samples EMA samples (DDIM 25 steps, guidance 4; the built-in digits "
                            "extractor, --data digits only) into metrics.jsonl and TensorBoard (0: never)")
    eval_samples: int = _f(1000, "samples per --eval_every evaluation (labels cycle through the classes)")
    seed: int = _f(0, "seed of all randomness (initialisation, data order, noise)")
    outputs: str | None = _f(None, "run folder (default: outputs/<data>-<model>-<time>)")
    resume: str | None = _f(None, "'auto' (continue the run in --outputs if it has a checkpoint) or a run or "
                                  "checkpoint folder to continue from")
    device: str = _f("auto", "cuda | cpu | auto")
    report_to: str = _f("auto", "experiment tracking beside metrics.jsonl: tensorboard (RUN/tensorboard/; "
                                "ditforge[tensorboard]) | wandb (needs wandb) | all | none | auto (tensorboard "
                                "when installed, else none)", choices=REPORT_TO)


@dataclass
class ParallelConfig:
    plugin: str = _f("auto", "data parallelism: ddp | zero2 (sharded gradients and optimizer states) | fsdp "
                             "(ZeRO-3, parameters sharded too) | auto (zero2 with several processes)",
                     choices=PLUGINS)
    grad_accum_steps: int = _f(1, "micro-batches per optimizer step on each process (the global batch stays "
                                  "--batch_size)")
    grad_reduce_dtype: str = _f("fp32", "dtype of the gradient reduction across processes: fp32 | bf16",
                                choices=("fp32", "bf16"))
    async_checkpoint: bool = _f(False, "write checkpoints in the background while training goes on")
    sequence_parallel_size: int = _f(1, "split every sample's token sequence over this many processes (long "
                                        "videos); the other factor of the world size is data parallelism")
    tensor_parallel: int = _f(1, "split every block's attention heads and MLP over this many processes "
                                 "(Megatron-LM's tensor parallelism, on DTensor; ditforge's DiTs); the world size is "
                                 "data x sequence x tensor parallel, FSDP2 shards over the data- and "
                                 "sequence-parallel part; with --sequence_parallel_size the sequence attends by "
                                 "ring attention")
    sequence_parallel_type: str = _f("auto", "how split sequences attend: ulysses (all-to-all to split heads) | "
                                             "ring (K/V passed around a ring) | fastseq (OpenDiT's: all-gathered "
                                             "attention input, heads split; fastseq_kv when they do not divide) | "
                                             "fastseq_kv (all-gathered K/V) | usp (Ulysses inside groups, ring "
                                             "across) | auto (the fastest of those that apply, timed on one "
                                             "attention layer at the run's shape at start; under "
                                             "--tensor_parallel ulysses over the heads each process holds where "
                                             "they divide, else ring; a diffusers video transformer: ulysses, "
                                             "ring, or auto / usp)",
                                     choices=SEQUENCE_PARALLEL_TYPES)


@dataclass
class BenchConfig:
    """Settings of ``ditforge bench`` (flags of the same names; see ``ditforge bench --help``)."""

    model: str = _f("DiT-XL/2", "model name, e.g. DiT-XL/2 or vDiT-XL/222")
    image_size: int = _f(256, "image side in pixels; the latent side is image_size / vae_downsample")
    num_frames: int | None = _f(None, "frames per video (video models; default 16)")
    in_channels: int = _f(4, "latent channels (4: Stable Diffusion's VAE)")
    vae_downsample: int = _f(8, "spatial VAE factor (1: pixel space)")
    num_classes: int = _f(1000, "class labels of the synthetic data")
    text_dim: int = _f(0, "caption-state width for text conditioning (cross-attention) on synthetic states, e.g. "
                          "4096 as T5-XXL's; 0: class labels")
    text_tokens: int = _f(120, "caption tokens per sample with --text_dim (120: PixArt-alpha's and Open-Sora's "
                               "T5 length); each sample's real length is drawn in [1, text_tokens]")
    batch_size: int = _f(64, "samples per step")
    steps: int = _f(20, "timed steps per row (the median is reported)")
    warmup: int = _f(5, "untimed steps first (compilation, autotuning)")
    rows: str = _f("abcdefg", "which rows to run, cumulative over the chosen ones (abce: compile without the "
                             "fused kernels)")
    fp8_recipe: str = _f("tensorwise", "row g's float8 scaling (as train's --fp8_recipe; rowwise_with_gw_hp needs "
                                       "row e, compile)", choices=FP8_RECIPES)
    fp8_min_width: int = _f(FP8_MIN_WIDTH, "float8 only in layers at least this wide (as train's --fp8_min_width)")
    compile_mode: str = _f("default", "torch.compile mode of the compile rows", choices=COMPILE_MODES[1:])
    grad_checkpoint: str = _f("none", "activation checkpointing in every row: none | full | every-K | op | attn",
                              const="full")
    find_max_batch: bool = _f(False, "also search the largest batch that fits with the last row's "
                                      "settings (CUDA only)")
    anchor: str | None = _f(None, "a plain training script to run first in the same job, e.g. "
                                  "../shared/anchors/plain_dit_train.py: run as `python ANCHOR BATCH "
                                  "bf16_compile_ema` with $OUT set, it writes {mode: {img_s or samples_s}} as JSON "
                                  "there; the table gains a column, each row's samples/s over the anchor's")
    memory: bool = _f(False, "the memory table instead of the speed ablation: row e's speed settings with fp32 or "
                             "bf16 master weights, AdamW or 8-bit moments, EMA or none, under --gpu_memory_budget")
    memory_rows: str = _f("plain,noema,8bit,bf16,capped,capped_ckpt,capped_op",
                          "which rows of --memory to run, cumulative")
    gpu_memory_budget: str = _f("8GiB", "the cap of --memory's capped rows")
    peak_tflops: float | None = _f(None, "peak dense bf16 TFLOP/s for MFU (default: from the GPU's "
                                           "name)")
    outputs: str = _f("outputs", "folder for the JSON result")
    device: str = _f("auto", "cuda | cpu | auto")
    seed: int = _f(0, "seed of the weights and the synthetic data")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "parallel": ParallelConfig}


def field_section() -> dict[str, str]:
    """Map every field name to its section; names are unique across sections so flags can be flat."""
    return {f.name: sec for sec, cls in _SECTION_CLASSES.items() for f in dataclasses.fields(cls)}


def build_config(
    file: str | Path | None = None, overrides: dict[str, Any] | None = None, base: dict | None = None
) -> RunConfig:
    """Defaults, then ``base`` (a saved ``RunConfig.to_dict()``, e.g. of the run being resumed), then ``file``
    (YAML, flat or with sections), then ``overrides`` (flat).

    Raises:
        UserError: unreadable file, unknown keys, or invalid values (see ``validate``).
    """
    where = field_section()
    values: dict[str, Any] = {k: v for section in (base or {}).values() for k, v in section.items() if k in where}
    if file is not None:
        try:
            loaded = yaml.safe_load(Path(file).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"--config: cannot read {file}: {' '.join(str(e).split())}") from None
        if not isinstance(loaded, dict):
            raise UserError(f"--config: {file} must hold a mapping of settings")
        for key, value in loaded.items():
            if key in _SECTION_CLASSES and isinstance(value, dict):
                values.update(value)
            else:
                values[key] = value
        unknown = sorted(set(loaded_keys(loaded)) - set(where))
        if unknown:
            raise UserError(f"--config: unknown settings in {file}: {', '.join(unknown)}")
    values.update(overrides or {})
    sections: dict[str, dict] = {s: {} for s in _SECTION_CLASSES}
    types_ = {name: hint for cls in _SECTION_CLASSES.values() for name, hint in typing.get_type_hints(cls).items()}
    consts = {f.name: f.metadata["const"] for cls in _SECTION_CLASSES.values() for f in dataclasses.fields(cls)
              if "const" in f.metadata}
    for key, value in values.items():
        if key not in where:
            raise UserError(f"unknown setting {key!r}")
        if key in consts and isinstance(value, bool):  # `grad_checkpoint: true` (and older saved configs)
            value = consts[key] if value else "none"
        sections[where[key]][key] = _coerce(key, value, types_[key])
    cfg = RunConfig(**{s: _SECTION_CLASSES[s](**v) for s, v in sections.items()})
    validate(cfg)
    return cfg


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Check a value from a file or flag against the field's type; numbers written as strings (YAML 1.1
    reads ``1e-4`` as a string) are converted. Raises UserError naming the setting."""
    allowed = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_args(hint) else [hint]
    if value is None and type(None) in typing.get_args(hint):
        return None
    kind = allowed[0]
    try:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    except ValueError:
        pass
    raise UserError(f"--{name}: expected {kind.__name__}, got {value!r}")


def loaded_keys(loaded: dict) -> list[str]:
    """Setting names in a config file, flat or inside sections."""
    return [k for key, value in loaded.items()
            for k in (value if key in _SECTION_CLASSES and isinstance(value, dict) else [key])]


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str, flag: str) -> int:
    """``"8GiB"`` -> 8 * 2**30 bytes (units B, KiB, MiB, GiB, TiB and their powers of ten KB, MB, GB, TB; case
    does not matter; a bare number is bytes).

    Raises:
        UserError: not a positive size, naming ``flag``.
    """
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        value = float(number) * _UNITS[s[len(number):]]
    except (KeyError, ValueError):
        value = -1
    if not value > 0:
        raise UserError(f"{flag}: expected a size such as 8GiB, got {text!r}")
    return int(value)


CHECKPOINT_POLICIES = "none | full | every-K | op | attn"
_EVERY = re.compile(r"^every-([1-9][0-9]*)$")


def parse_checkpoint_policy(policy: str) -> tuple[str, int]:
    """``--grad_checkpoint`` value -> (kind, k): ``none``, ``full`` (every block), ``every-K`` (blocks
    0, K, 2K, ...: 1/K of the recomputation for 1/K of the saving), ``op`` (every block, but the outputs of
    matrix products and attention are kept and only the cheap element-wise ops are recomputed; torchtitan's
    op-level selective checkpointing), ``attn`` (every block, keeping the attention outputs alone: long video
    sequences, where attention's quadratic cost dominates and the matrix products' outputs are the memory).

    Raises:
        UserError: any other value (names the flag and the choices).
    """
    if policy in ("none", "full", "op", "attn"):
        return policy, 1
    m = _EVERY.match(policy)
    if not m:
        raise UserError(f"--grad_checkpoint: expected one of {CHECKPOINT_POLICIES}, got {policy!r}")
    return "every", int(m.group(1))


def resolve_device(name: str | torch.device) -> torch.device:
    """``--device`` value (or a ``torch.device``) -> ``torch.device``: ``auto`` is cuda when available, else cpu.

    Raises:
        UserError: cuda asked on a machine without a GPU.
    """
    import torch  # deferred: the command line's --help should not pay for importing torch

    name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is available")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> torch.dtype:
    """``--mixed_precision`` -> compute dtype: fp32 | bf16 | fp16; ``auto`` is bf16 on CUDA (where supported),
    fp32 on CPU; fp8 computes in bf16 around its float8 matrix products."""
    import torch

    if name == "auto":
        name = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[name]


def report_backends(report_to: str) -> tuple[str, ...]:
    """``--report_to`` -> the trackers to write to, of ``("tensorboard", "wandb")``; ``auto`` is tensorboard
    when the ``tensorboard`` package is installed, else none.

    Raises:
        UserError: an unknown value, or a tracker named (tensorboard, wandb, all) whose package is not installed.
    """
    import importlib.util

    if report_to not in REPORT_TO:
        raise UserError(f"--report_to: expected one of {', '.join(REPORT_TO)}, got {report_to}")
    wanted = {"auto": ("tensorboard",), "all": ("tensorboard", "wandb"), "none": ()}.get(report_to, (report_to,))
    installed = tuple(b for b in wanted if importlib.util.find_spec(b) is not None)
    missing = [b for b in wanted if b not in installed]
    if missing and report_to != "auto":
        hint = "pip install 'ditforge[tensorboard]'" if missing[0] == "tensorboard" else "pip install wandb"
        raise UserError(f"--report_to {report_to}: {missing[0]} is not installed ({hint}), or use --report_to none")
    return installed


def _check_packing(cfg: RunConfig) -> None:
    """``--pack_tokens`` with what it does not support: one line naming the other flag."""
    if cfg.parallel.sequence_parallel_size > 1:
        raise UserError("--pack_tokens: not with --sequence_parallel_size > 1 (the sequence-parallel attentions "
                        "split one sequence per sample, not packed samples); use data parallelism")
    if (cfg.model.model or "").startswith("STDiT"):
        raise UserError(f"--pack_tokens: not with --model {cfg.model.model} (its attention across frames does not "
                        "pack); use a DiT or vDiT")
    if cfg.train.enable_modulate_kernel:
        raise UserError("--pack_tokens: not with --enable_modulate_kernel (its kernels take one modulation row per "
                        "sample, packed tokens carry one each); --enable_layernorm_kernel works")


def _check_tensor_parallel(cfg: RunConfig) -> None:
    """``--tensor_parallel`` with what it does not support: one line naming the other flag."""
    t, m, tp = cfg.train, cfg.model, cfg.parallel.tensor_parallel
    others = [("--init_from", m.init_from is not None and not (m.model or "").startswith(("DiT", "vDiT", "STDiT"))),
              ("--lora_rank", bool(m.lora_rank)), ("--mixed_precision fp8", t.mixed_precision == "fp8"),
              ("--pack_tokens", bool(t.pack_tokens)), ("--fused_backward_pass", t.fused_backward_pass),
              (f"--cpu_offload {t.cpu_offload}", t.cpu_offload != "none"),
              (f"--optimizer {t.optimizer}", t.optimizer != "adamw"),
              (f"--master_weights {t.master_weights}", t.master_weights != "fp32"),
              (f"--plugin {cfg.parallel.plugin}", cfg.parallel.plugin == "ddp")]
    sp_type = cfg.parallel.sequence_parallel_type
    if cfg.parallel.sequence_parallel_size > 1 and sp_type not in ("auto", "ring", "ulysses"):
        raise UserError(f"--tensor_parallel {tp} with --sequence_parallel_size: ulysses (over the heads each "
                        f"process holds) or ring attention (auto picks one); not --sequence_parallel_type {sp_type}")
    clash = next((flag for flag, on in others if on), None)
    if clash:
        raise UserError(f"--tensor_parallel {tp}: splits ditforge's own DiTs, trained by AdamW over fp32 weights, "
                        f"with zero2 / fsdp over the data-parallel processes; not with {clash}")


def _check_optimizer(cfg: RunConfig) -> None:
    """``--optimizer``, ``--master_weights``, ``--cpu_offload`` and ``--delayed_update`` against each other and the
    precision: one line naming the flags."""
    t = cfg.train
    if t.optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {t.optimizer}")
    if t.master_weights not in MASTER_WEIGHTS:
        raise UserError(f"--master_weights: expected one of {', '.join(MASTER_WEIGHTS)}, got {t.master_weights}")
    if t.optimizer in LIBRARY_OPTIMIZERS:
        # torchao's bf16 stochastic rounding draws from the global generator (a resume would not be exact) and
        # keeps the moments of its unquantized small tensors in bf16, where the second moment stalls
        if t.master_weights != "fp32":
            raise UserError(f"--optimizer {t.optimizer}: takes --master_weights fp32, got {t.master_weights} (bf16 "
                            "weights: --optimizer adamw8bit)")
        if t.fused_backward_pass or t.cpu_offload != "none":
            raise UserError(f"--optimizer {t.optimizer}: the library's optimizer steps after the backward, on the "
                            "GPU; not with --fused_backward_pass or --cpu_offload (use adamw or adamw8bit)")
        if cfg.parallel.async_checkpoint and t.optimizer != "adafactor":
            # torch's staging copy of a state dict calls zeros_like, which torchao's state tensors do not implement
            raise UserError(f"--optimizer {t.optimizer}: its torchao states are saved synchronously; not with "
                            "--async_checkpoint")
    if t.master_weights != "fp32" and t.mixed_precision not in ("bf16", "auto"):
        raise UserError(f"--master_weights {t.master_weights}: needs --mixed_precision bf16, got {t.mixed_precision}")
    if t.fused_backward_pass and t.mixed_precision == "fp16":
        raise UserError("--fused_backward_pass: not with --mixed_precision fp16 (the loss scaler must see every "
                        "gradient before any step); use bf16")
    if t.gpu_memory_budget is not None:
        parse_bytes(t.gpu_memory_budget, "--gpu_memory_budget")
    if t.cpu_offload not in CPU_OFFLOAD:
        raise UserError(f"--cpu_offload: expected one of {', '.join(CPU_OFFLOAD)}, got {t.cpu_offload}")
    if t.cpu_offload == "optimizer" and t.fused_optimizer == "off":
        raise UserError("--cpu_offload optimizer: needs the one-pass optimizer step, not --fused_optimizer off")
    if t.cpu_offload == "all" and (t.optimizer, t.master_weights, t.fused_backward_pass) != ("adamw", "fp32", False):
        raise UserError("--cpu_offload all: steps torch's AdamW over fp32 weights on the CPU; not with --optimizer "
                        f"{t.optimizer}, --master_weights {t.master_weights} or --fused_backward_pass")
    if t.cpu_offload == "all" and t.mixed_precision == "fp16":  # the scaler's found-inf would stay on the GPU
        raise UserError("--cpu_offload all: not with --mixed_precision fp16 (the CPU step takes no loss scaler); "
                        "use bf16")
    if t.delayed_update and t.cpu_offload != "all":
        raise UserError(f"--delayed_update: needs --cpu_offload all, got --cpu_offload {t.cpu_offload}")


def validate(cfg: RunConfig) -> None:
    """Check ranges and choices once at start. Raises UserError naming the flag and what was expected."""
    t = cfg.train
    positive = {"grad_accum_steps": cfg.parallel.grad_accum_steps, "max_nonfinite_steps": t.max_nonfinite_steps,
                "eval_samples": t.eval_samples, "loss_spike_window": t.loss_spike_window,
                "sequence_parallel_size": cfg.parallel.sequence_parallel_size,
                "tensor_parallel": cfg.parallel.tensor_parallel, "batch_size": t.batch_size, "ckpt_every": t.ckpt_every, "log_every": t.log_every,
                "keep_last": t.keep_last, "max_steps": t.max_steps, "epochs": t.epochs,
                "image_size": cfg.data.image_size, "num_classes": cfg.model.num_classes,
                "num_frames": cfg.data.num_frames, "frame_interval": cfg.data.frame_interval,
                "text_max_length": cfg.model.text_max_length, "depth": cfg.model.depth,
                "fp8_min_width": t.fp8_min_width}
    for name, value in positive.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserError(f"--{name}: expected a positive integer, got {value!r}")
    nonnegative = {"warmup_steps": t.warmup_steps, "sample_every": t.sample_every, "pack_tokens": t.pack_tokens,
                   "blocks_to_swap": t.blocks_to_swap,
                   "num_workers": cfg.data.num_workers, "max_loss_spike_rollbacks": t.max_loss_spike_rollbacks}
    for name, value in nonnegative.items():
        if value is not None and (not isinstance(value, int) or value < 0):
            raise UserError(f"--{name}: expected an integer >= 0, got {value!r}")
    if t.max_steps is not None and t.epochs is not None:
        raise UserError("--max_steps and --epochs: give one, not both")
    for name, value, low in (("lr", t.lr, 0), ("loss_spike_factor", t.loss_spike_factor, 1)):
        if value is not None and not value > low:
            raise UserError(f"--{name}: expected a number > {low}, got {value}")
    if not 0 <= t.ema_decay < 1:
        raise UserError(f"--ema_decay: expected a number in [0, 1), got {t.ema_decay}")
    if not 0 <= cfg.model.class_dropout_prob < 1:
        raise UserError(f"--class_dropout_prob: expected a number in [0, 1), got {cfg.model.class_dropout_prob}")
    if cfg.parallel.plugin not in PLUGINS:
        raise UserError(f"--plugin: expected one of {', '.join(PLUGINS)}, got {cfg.parallel.plugin}")
    if t.mixed_precision not in MIXED_PRECISION:
        raise UserError(f"--mixed_precision: expected one of {', '.join(MIXED_PRECISION)}, got {t.mixed_precision}")
    if t.fp8_recipe not in FP8_RECIPES:
        raise UserError(f"--fp8_recipe: expected one of {', '.join(FP8_RECIPES)}, got {t.fp8_recipe}")
    if t.fp8_recipe != "tensorwise" and t.mixed_precision != "fp8":
        raise UserError(f"--fp8_recipe {t.fp8_recipe}: needs --mixed_precision fp8, got {t.mixed_precision}")
    if t.fp8_recipe == "rowwise_with_gw_hp" and t.compile == "none":
        # eager, torchao's bf16 weight-gradient product meets the fp32 master weight: "expected m1 and m2 to have
        # the same dtype" (torchao 0.18); compiled, the same recipe runs
        raise UserError("--fp8_recipe rowwise_with_gw_hp: needs --compile (eager it fails in torchao)")
    _check_optimizer(cfg)
    if cfg.parallel.sequence_parallel_type not in SEQUENCE_PARALLEL_TYPES:
        raise UserError(f"--sequence_parallel_type: expected one of {', '.join(SEQUENCE_PARALLEL_TYPES)}, got "
                        f"{cfg.parallel.sequence_parallel_type}")
    if cfg.parallel.tensor_parallel > 1:
        _check_tensor_parallel(cfg)
    if cfg.model.condition not in CONDITIONS:
        raise UserError(f"--condition: expected one of {', '.join(CONDITIONS)}, got {cfg.model.condition}")
    if t.compile not in COMPILE_MODES:
        raise UserError(f"--compile: expected one of {', '.join(COMPILE_MODES)}, got {t.compile}")
    if t.device not in ("auto", "cpu", "cuda") and not t.device.startswith("cuda:"):
        raise UserError(f"--device: expected cuda, cpu or auto, got {t.device}")
    report_backends(t.report_to)
    if t.eval_every and (cfg.data.data != "digits" or cfg.data.instance_data or cfg.model.init_from):
        raise UserError(f"--eval_every: the built-in extractor measures DiT runs on --data digits, not "
                        f"{cfg.data.instance_data or cfg.data.data}; for other data draw samples with `ditforge sample "
                        "--save_npz` and measure them with `ditforge eval --inception`")
    from ditforge.models import model_spec  # raises UserError for unknown names

    parse_checkpoint_policy(t.grad_checkpoint)
    if cfg.model.model is not None:
        model_spec(cfg.model.model)
    if t.pack_tokens:
        _check_packing(cfg)
    m, data = cfg.model, cfg.data
    if m.objective not in OBJECTIVES:
        raise UserError(f"--objective: expected one of {', '.join(OBJECTIVES)}, got {m.objective}")
    if m.lora_rank < 0:
        raise UserError(f"--lora_rank: expected an integer >= 0, got {m.lora_rank}")
    if m.train_text_encoder and m.init_from is None:
        raise UserError("--train_text_encoder: trains a pretrained pipeline's text encoder; give --init_from")
    if m.lora_rank and m.init_from is None:
        raise UserError("--lora_rank: LoRA adapts pretrained weights; give --init_from")
    if t.blocks_to_swap and not (m.lora_rank and t.grad_checkpoint != "none" and t.compile == "none"
                                 and cfg.parallel.plugin in ("auto", "none", "ddp")):
        raise UserError("--blocks_to_swap: swaps a LoRA run's frozen base; needs --lora_rank, --grad_checkpoint, no "
                        "--compile and --plugin none or ddp")
    if m.fp8_base and not m.lora_rank:
        raise UserError("--fp8_base: stores the frozen base of a LoRA run; give --lora_rank")
    if data.resize_mode not in RESIZE_MODES:
        raise UserError(f"--resize_mode: expected one of {', '.join(RESIZE_MODES)}, got {data.resize_mode}")
    if (data.instance_data is None) != (data.instance_prompt is None):
        raise UserError("--instance_data and --instance_prompt: DreamBooth needs both")
    if (data.class_data is None) != (data.class_prompt is None):
        raise UserError("--class_data and --class_prompt: prior preservation needs both")
    if data.class_data is not None and data.instance_data is None:
        raise UserError("--class_data: prior preservation is part of DreamBooth; give --instance_data too")
    if data.buckets is not None and data.instance_data is not None:
        raise UserError("--buckets: not with --instance_data (DreamBooth trains at one --image_size)")
    if data.num_class_images < 1:
        raise UserError(f"--num_class_images: expected a positive integer, got {data.num_class_images}")
