"""Typed run configuration: the sections (model, data, train, parallel) and ``ditforge bench``'s settings, their
defaults and the choices each field takes. Filled by ``load.build_config``, checked by ``checks.validate``.

Each field's ``help`` is also its command-line help, so ``ditforge train --help`` and this file cannot drift.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MIXED_PRECISION = ("auto", "fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName
# --mixed_precision fp8 in training: float8 only in layers at least this wide on both sides, where it was measured
# to pay (a DiT block's compiled forward + backward, bf16 against torchao's tensorwise float8, 8,192 tokens:
# benchmarks/kernel_speed.py fp8-train; docs/speed.md#fp8-training-by-width).
FP8_MIN_WIDTH = 2048
SAMPLING_PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8")  # weights are cast for sampling
VAE_DTYPES = ("float32", "bfloat16", "float16")  # sample --vae_dtype (musubi-tuner's name and values)
PLUGINS = ("auto", "none", "ddp", "zero2", "fsdp", "hsdp")
SHARDED_PLUGINS = ("zero2", "fsdp", "hsdp")  # FSDP2 fully_shard: DTensor parameters
DISTILL_PLUGINS = ("auto", "ddp", "fsdp")  # a pipeline teacher's: each process whole networks, or FSDP2's shards
OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adamw_fp8", "adafactor")
DISTILL_OPTIMIZERS = OPTIMIZERS[:4]  # DMD2's Adam at beta1 = 0; adafactor keeps no first moment to set
LIBRARY_OPTIMIZERS = ("adamw4bit", "adamw_fp8", "adafactor")  # the libraries' own, stepped after the backward
MASTER_WEIGHTS = ("fp32", "bf16", "bf16_sr")
CPU_OFFLOAD = ("none", "optimizer", "all")
CONDITIONS = ("auto", "class", "text")
SEQUENCE_PARALLEL_TYPES = ("auto", "ulysses", "ring", "fastseq", "fastseq_kv", "usp")
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OBJECTIVES = ("auto", "ddpm", "v", "flow")
WEIGHTING_SCHEMES = ("logit_normal", "uniform")
EXPERTS = ("high_noise", "low_noise", "both")  # a two-expert pipeline's transformer, transformer_2, or both
RESIZE_MODES = ("center_crop", "letterbox")
CAPTION_MISSING = ("skip", "filename")  # a folder of clips' media without a <stem>.txt
REPORT_TO = ("auto", "tensorboard", "wandb", "all", "none")


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


class _Freezable:
    """A run's settings, written while they are filled and resolved, then frozen (``freeze``): a write after it
    raises ``dataclasses.FrozenInstanceError``, so every setting has one place where it is decided."""

    _frozen = False  # a class attribute, not a field: to_dict and the saved config.yaml do not hold it

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise dataclasses.FrozenInstanceError(f"cannot assign to {type(self).__name__}.{name}: the run's "
                                                  "config is frozen once resolved")
        super().__setattr__(name, value)


def freeze(cfg: RunConfig) -> RunConfig:
    """Freeze ``cfg`` and its sections in place (writes raise ``dataclasses.FrozenInstanceError``); returns it."""
    for part in (cfg.model, cfg.data, cfg.train, cfg.parallel, cfg):
        object.__setattr__(part, "_frozen", True)
    return cfg


@dataclass
class ModelConfig(_Freezable):
    model: str | None = _f(None, "model name: DiT-{T,S,B,L,XL,7B}/{1,2,4,8} (e.g. DiT-XL/2) for images; for "
                                 "videos vDiT-{T,S,B,L,XL,7B}/{t}{h}{w} (3-D patches, full attention, e.g. "
                                 "vDiT-XL/222) or STDiT-{T,S,B,L,XL,7B}/{p} (spatial and temporal attention, e.g. STDiT-XL/2) "
                                 "(default: DiT-T/2 for images, vDiT-T/244 for videos)")
    depth: int | None = _f(None, "transformer blocks, in place of the --model size's (its width and heads stay): "
                                 "e.g. --model DiT-7B/2 --depth 2 for a quick run at width 4096")
    condition: str = _f("auto", "conditioning: class (labels) | text (cross-attention to caption states) | auto "
                                "(text for video data, class for images)", choices=CONDITIONS)
    text_encoder: str | None = _f(None, "local Hugging Face folder of the caption encoder (T5, CLIP or BERT-like; "
                                        "default: the shipped all-MiniLM-L6-v2); with a pipeline --init_from: a "
                                        "single file (.safetensors, transformers' keys; ComfyUI's, fp8 and scaled "
                                        "fp8 included; or the original release's .pth torch pickle) in place of "
                                        "the pipeline's text_encoder")
    text_max_length: int | None = _f(None, "caption tokens kept, special tokens included (default: the "
                                           "encoder's: T5 120, CLIP 77, MiniLM 256)")
    vae: str = _f("none", "local diffusers AutoencoderKL folder (e.g. sd-vae-ft-ema) to train on its latents "
                          "(video: frame by frame), or none for pixel space; with a pipeline --init_from: a single "
                          "file in place of the pipeline's vae (diffusers' keys, or the original release's: its .pth "
                          "torch pickle, the vae. tensors of a whole checkpoint, ComfyUI's .safetensors)")
    qk_norm: bool = _f(False, "LayerNorm on the queries and keys of every attention (stability of large models)")
    num_classes: int | None = _f(None, "number of class labels (default: from the data)")
    learn_sigma: bool = _f(True, "predict the variance too (hybrid loss of Improved DDPM)")
    class_dropout_prob: float = _f(0.1, "label (or caption) dropout probability for classifier-free guidance")
    init_from: str | None = _f(None, "start from pretrained weights: a local diffusers pipeline folder "
                                     "(model_index.json) of a family ditforge adapts (another pipeline's refusal lists "
                                     "them) or of DiT, an official DiT .pt, or a ditforge run, checkpoint or "
                                     "export; the folder decides the denoiser, text encoders, VAE and objective")
    transformer: str | None = _f(None, "with a pipeline --init_from: a single-file checkpoint in place of its "
                                       "transformer, the folder giving its config: diffusers' keys, the original "
                                       "release's (diffusion_pytorch_model*.safetensors shards: give a shard or "
                                       "their index .json) or ComfyUI's (with or without model.diffusion_model.; bf16, "
                                       "fp16, fp8 e4m3, scaled fp8 (weight x scale_weight)); an fp8 file stays fp8 "
                                       "under --fp8_base, a scaled one with its scale")
    transformer_2: str | None = _f(None, "with a two-expert pipeline --init_from: a single file in place of its "
                                         "transformer_2 (the low-noise expert), as --transformer")
    objective: str = _f("auto", "training objective: ddpm (epsilon) | v (v-prediction) | flow (rectified flow) | "
                                "auto (the --init_from pipeline's scheduler; else ddpm)", choices=OBJECTIVES)
    flow_shift: float | None = _f(None, "flow: timestep shift t' = s t / (1 + (s - 1) t) (default: the scheduler's "
                                        "shift, else 1)")
    weighting_scheme: str = _f("logit_normal", "flow: density of the training times: logit_normal (Esser et al. "
                                               "2024) | uniform",
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
    noised_image_input: bool = _f(True, "image-to-video fine-tuning of a family that declares image noise: each "
                                        "clip's first frame gets Gaussian pixel noise of sigma = exp(N(-3, 0.5)) "
                                        "before the VAE, and its latents are a posterior draw (the family's own I2V "
                                        "recipe); "
                                        "--no-noised_image_input conditions on the clean frame. Stored features "
                                        "hold the clean frame's latents")
    expert: str | None = _f(None, "a pipeline of two experts: the one to fine-tune, high_noise (transformer: "
                                  "timesteps at and above its boundary ratio x 1000) or low_noise (transformer_2: "
                                  "those below), its training times drawn from its range alone, the other frozen in "
                                  "host memory; or both (the default for such a pipeline): each step draws one "
                                  "timestep, whose side picks the expert that trains on the whole global batch, with "
                                  "times drawn from that side; the idle expert's frozen weights wait in host memory "
                                  "under --gpu_memory_budget or where both do not fit on the GPU (plugin none or "
                                  "ddp; zero2 / fsdp shard both instead)",
                            choices=EXPERTS)
    train_text_encoder: bool = _f(False, "train the --init_from pipeline's text encoder too (Stable Diffusion 1.x / "
                                         "2.x; with --lora_rank, LoRA on its attention projections)")
    family: str | None = _f(None, "the --init_from pipeline's family (its adapter's short name), or None", cli=False)
    in_channels: int | None = _f(None, "input channels (default: from the data)", cli=False)
    input_size: int | None = _f(None, "spatial input size of the model (default: --image_size)", cli=False)
    num_frames: int | None = _f(None, "frames of the model's input (video models: --num_frames)", cli=False)
    text_dim: int | None = _f(None, "width of the caption states (text conditioning; from the encoder)", cli=False)


@dataclass
class DataConfig(_Freezable):
    data: str = _f("digits", "digits (built-in 8x8 images) | clips (built-in captioned videos) | a video CSV "
                             "(path,text[,num_frames,fps,height,width]; see `ditforge preprocess`) | an image "
                             "folder ROOT/<class>/<image> | captioned images (a folder of images with <stem>.txt "
                             "captions, or a CSV / JSONL of path,text) | a features folder of `ditforge "
                             "extract-features` | WebDataset shards (a folder of .tar with or without shards.json, a glob, a "
                             "brace list shard-{000..009}.tar, an fsspec URL) or a YAML blend of them "
                             "(- {path: ..., weight: 0.7}) | a folder of clips (videos and images, each with a "
                             "<stem>.txt caption, recursive; read in buckets) or a YAML blend of such folders, "
                             "weight its whole repeats per epoch (- {path: FOLDER, weight: 3})")
    image_size: int | None = _f(None, "image (frame) side in pixels (digits: 8; clips: 32; required otherwise; a "
                                      "folder of clips: its buckets hold about --image_size squared pixels)")
    num_frames: int | None = _f(None, "frames per video clip (video data; default 16; a folder of clips: the most "
                                      "frames of a bucket, default each clip's own, by the family's frame rule)")
    frame_interval: int | None = _f(None, "temporal stride between the frames of a clip (default: 1 for a folder "
                                          "of clips, the user's clips at their own frame rate, consecutive frames as "
                                          "musubi-tuner and diffusion-pipe read them; 3 for clips and video CSVs, "
                                          "OpenDiT's stride); shorter videos use the largest stride that fits")
    random_flip: bool | None = _f(None, "random horizontal flips of the latents (default: on for image folders, off "
                                     "for digits and for video pipelines, whose 3-D VAE latents are not "
                                     "mirror-symmetric; refused for image-to-video pipelines)")
    resize_mode: str = _f("center_crop", "captioned images: center_crop (short side to --image_size, centre square) "
                                         "| letterbox (long side to --image_size, padded with mid grey)",
                          choices=RESIZE_MODES)
    caption_missing: str = _f("skip", "a folder of clips: a video or image without its <stem>.txt caption is "
                                      "listed (log and the run's bad_samples.jsonl) and skipped | filename: "
                                      "captioned by its file name in words (red_car.mp4 -> red car)",
                              choices=CAPTION_MISSING)
    instance_data: str | None = _f(None, "DreamBooth: a folder of images of the subject, and for a video "
                                         "pipeline clips too, in buckets (replaces --data)")
    instance_prompt: str | None = _f(None, "DreamBooth: the caption of every instance image or clip, e.g. 'a "
                                           "photo of sks dog', 'a video of sks man'")
    class_data: str | None = _f(None, "DreamBooth prior preservation: a folder of class images (for a video "
                                      "pipeline, clips); the base model generates the missing ones up to "
                                      "--num_class_images")
    class_prompt: str | None = _f(None, "DreamBooth prior preservation: the class images' caption, e.g. 'a photo "
                                        "of dog'")
    num_class_images: int = _f(100, "DreamBooth prior preservation: class images wanted in --class_data")
    prior_loss_weight: float = _f(1.0, "DreamBooth prior preservation: weight of the class images' loss")
    class_sampling_steps: int = _f(25, "DreamBooth prior preservation of a video pipeline: sampling steps of each "
                                       "class clip the base model draws into --class_data")
    buckets: str | None = _f(None, "multi-resolution buckets (Open-Sora's bucket_config): a YAML or JSON file "
                                   "{resolution: {frames: [keep probability, global batch size]}}, e.g. {256px: {1: "
                                   "[1.0, 64], 16: [0.5, 8]}}; --data is then a CSV / JSONL of path,text naming images "
                                   "and videos or a folder of clips (--batch_size is not used: each bucket has its "
                                   "own; fine-tuning a video pipeline on a folder of clips without --buckets, the "
                                   "buckets come from the data at --image_size), or with "
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
class TrainConfig(_Freezable):
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
                                "fit, a 14B video transformer's on 24 GB; of two experts, each one's last N). Needs "
                                "--grad_checkpoint (else the backward holds every block's copy) and no --compile")
    enable_flashattn: bool = _f(False, "attention through the fastest exact kernel on GPUs: FlashAttention-4 where "
                                       "installed (the fa4 extra) and measured faster at the shape (a diffusers "
                                       "transformer's self-attention too), else SDPA's cuDNN, then Flash, on "
                                       "Hopper/Blackwell with cuDNN > 9.15; Flash first elsewhere")
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
    sample_every: int = _f(500, "write a grid of EMA samples every N steps and at the end (0: none); with "
                                "--validation_prompts, that file's samples instead")
    validation_prompts: str | None = _f(None, "a text file of samples to render every --sample_every steps and "
                                              "at the end into RUN/samples/step-N/ (a diffusers pipeline's or a "
                                              "text DiT's run, with the weights being trained): one per line in "
                                              "musubi-tuner's sample-prompt syntax, the prompt then --w W --h H "
                                              "--f FRAMES --s STEPS --g GUIDANCE --seed N (or --d N) --n NEGATIVE "
                                              "--i IMAGE; # comments and blank lines skipped (docs/finetuning.md)")
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
class ParallelConfig(_Freezable):
    plugin: str = _f("auto", "data parallelism: ddp | zero2 (sharded gradients and optimizer states) | fsdp "
                             "(ZeRO-3, parameters sharded too) | hsdp (fsdp within --dp_shard processes, one node, "
                             "replicated --dp_replicate times across nodes: only the gradient all-reduce crosses "
                             "them) | auto (zero2 with several processes)",
                     choices=PLUGINS)
    dp_shard: int = _f(0, "--plugin hsdp: processes that shard one copy of the weights (0: those of one node, "
                          "LOCAL_WORLD_SIZE / (sequence x tensor parallel))")
    dp_replicate: int = _f(0, "--plugin hsdp: copies of the weights, one per group of --dp_shard processes (0: the "
                              "rest of the world size)")
    collective_timeout: float = _f(1800.0, "seconds without a finished step after which a peer whose heartbeat "
                                           "stopped counts as lost: the others stop with one line naming it "
                                           "(restart with --resume auto); the NCCL / gloo timeouts are a little "
                                           "longer (parallel.heartbeat.group_timeout). Keep it above the longest "
                                           "wait of a healthy run: rank 0's validation samples, a compile, a save")
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
    text_tokens: int = _f(120, "caption tokens per sample with --text_dim (120: the T5 length of Chen et al. "
                               "2023 and Open-Sora); each sample's real length is drawn in [1, text_tokens]")
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
class DistillConfig:
    """Settings of ``ditforge distill`` (flags of the same names; see ``ditforge distill --help``)."""

    teacher: str = _f(None, "the teacher: a ditforge run or checkpoint folder (a class- or text-conditional DiT), "
                            "a local diffusers pipeline folder of an adapted video family (of two experts: a student "
                            "and a critic LoRA on each, every call on the expert of its timestep), or a run that "
                            "fine-tuned one")
    outputs: str = _f(None, "the student's run folder")
    student_steps: int = _f(4, "the student's sampling steps K (DMD2's 4: timesteps 999, 749, 499, 249 of a DDPM "
                               "teacher; fractions 1, 0.75, 0.5, 0.25 of a flow teacher's, shifted)")
    critic_steps: int = _f(5, "critic (fake score) updates per generator update (DMD2's dfake_gen_update_ratio)")
    cfg_scale: float | None = _f(None, "the teacher's classifier-free guidance scale, baked into the student (1: none; "
                                       "default: 3 for a DiT, a pipeline's own call default; a guidance-distilled "
                                       "pipeline: the scale its one pass embeds, for teacher, critic and student)")
    cfg_scale_2: float | None = _f(None, "a pipeline teacher of two experts: the guidance scale of its low-noise "
                                         "expert (transformer_2, the timesteps below the boundary; the pipeline "
                                         "call's guidance_scale_2, `ditforge sample --cfg_scale_2`'s); --cfg_scale "
                                         "then guides the high-noise one (default: the call's own default, "
                                         "--cfg_scale's value where it leaves it None)")
    lora_rank: int = _f(0, "train the student as LoRA adapters of this rank on the teacher (0: a full copy of the "
                           "teacher's denoiser, initialised from it; a pipeline teacher's LoRA student and critic are "
                           "peft adapters on its one base)")
    critic_lora_rank: int | None = _f(None, "a pipeline teacher: the critic (fake score) as LoRA adapters of this "
                                            "rank on the frozen teacher (0: a full copy, DMD2's; default: a LoRA "
                                            "student's --lora_rank, a full student's full copy)")
    lora_target_modules: str | None = _f(None, "with --lora_rank: comma-separated module names (default: qkv,proj; "
                                              "a pipeline's family's LoRA targets)")
    prompt_file: str | None = _f(None, "a text-conditional DiT or a pipeline teacher: the prompts, one per line, "
                                       "drawn uniformly (data-free), encoded by the teacher's text encoder")
    data: str | None = _f(None, "real samples for the GAN head (DMD2 sec. 4.3), needs --gen_cls_loss_weight: a DiT "
                                "teacher's a --data spec as `ditforge train` takes it (digits, an image folder "
                                "ROOT/<class>/<image>, captioned images), at the teacher's image size, encoded by its "
                                "VAE; a pipeline teacher's the clips `ditforge train --init_from PIPE --data` takes (a "
                                "folder of clips with <stem>.txt captions, a CSV / JSONL of path,text rows), each "
                                "read at the student's --width x --height x --num_frames, its caption conditioning "
                                "the real branch (default: none, data-free)")
    gen_cls_loss_weight: float = _f(0.0, "with --data: the GAN weight, the generator's GAN loss against its DMD "
                                         "loss (DMD2's name, gen_cls_loss_weight: 3e-3 on ImageNet 64, 5e-3 on "
                                         "its 1024 px text-to-image runs); > 0 adds the GAN head on the critic's "
                                         "features (0: none)")
    guidance_cls_loss_weight: float = _f(1e-2, "with the GAN head: weight of the critic's GAN (classification) loss "
                                               "against its denoising loss (DMD2's name and value)")
    image: str | None = _f(None, "an image-to-video pipeline teacher: the first frames, a folder of PNG / JPEG files "
                                 "(or one such file), drawn uniformly as the prompts are and resized to the frame "
                                 "size (`ditforge sample --image`'s flag); a reference-image teacher (optional): "
                                 "one reference image a sample, drawn so (`ditforge sample --reference_image`'s); "
                                 "refused for other teachers")
    driving_csv: str | None = _f(None, "a character pipeline teacher driven by videos: a CSV of the columns image, "
                                       "pose_video, face_video (the pipeline call's arguments; optionally text, each "
                                       "row's prompt in place of --prompt_file's; a fine-tuning video CSV serves, its "
                                       "clips unread), a row drawn for each sample as the prompts are; the student "
                                       "learns one segment of the call, its first, of --num_frames frames (default "
                                       "the call's segment_frame_length), from the videos' first frames")
    height: int | None = _f(None, "a pipeline teacher: the frame height in pixels (default: its call's)")
    width: int | None = _f(None, "a pipeline teacher: the frame width in pixels (default: its call's)")
    num_frames: int | None = _f(None, "a video pipeline teacher: frames per clip (default: its call's)")
    mixed_precision: str = _f("auto", "a pipeline teacher: fp32 | bf16 (auto: bf16 on CUDA, fp32 on the CPU)")
    grad_checkpoint: bool = _f(True, "a pipeline teacher: recompute the transformer's blocks in the backward "
                                     "(diffusers' gradient checkpointing)")
    max_steps: int = _f(1000, "iterations: each trains the critic, every --critic_steps-th the generator too")
    batch_size: int = _f(64, "samples per iteration (a pipeline teacher under torchrun: all processes together, "
                              "each sequence-parallel group its share)")
    lr: float = _f(1e-4, "the student's learning rate (AdamW, betas 0, 0.999 as DMD2)")
    critic_lr: float | None = _f(None, "the critic's learning rate (default: --lr)")
    max_grad_norm: float = _f(1.0, "clip each network's gradient norm to this")
    optimizer: str = _f("adamw", "a pipeline teacher: the student's and critic's optimizer, as `ditforge train "
                                 "--optimizer` (betas 0, 0.999): adamw | adamw8bit | adamw4bit | adamw_fp8",
                        choices=DISTILL_OPTIMIZERS)
    fp8_base: bool = _f(False, "a pipeline teacher: store the frozen teacher's transformer layers in float8 e4m3, "
                               "each upcast to the compute dtype while it runs (`ditforge train --fp8_base`); "
                               "adapters, norms, embedders and a full student or critic stay as they are")
    blocks_to_swap: int = _f(0, "a pipeline teacher: the frozen teacher's weights of its last N transformer blocks "
                                "(of each expert of two) "
                                "live in pinned host memory and visit the GPU a block at a time (`ditforge train "
                                "--blocks_to_swap`); needs --grad_checkpoint")
    plugin: str = _f("auto", "a pipeline teacher under torchrun, as `ditforge train --plugin`: ddp (each process "
                             "whole networks, gradients averaged) | fsdp (FSDP2 per transformer block: the frozen "
                             "teacher, full-copy student and critic and the adapters sharded over the processes, "
                             "parameters gathered for each block's forward and backward) | auto (ddp); zero2 and "
                             "hsdp are training's only")
    sequence_parallel_size: int = _f(1, "a pipeline teacher: split every sample's video tokens over this many "
                                        "processes, for teacher, critic and student (`ditforge train "
                                        "--sequence_parallel_size`: long clips); the other factor of the world "
                                        "size is data parallelism")
    sequence_parallel_type: str = _f("auto", "how split tokens attend (`ditforge train --sequence_parallel_type` of "
                                             "a diffusers video transformer): ulysses (all-to-all over the heads) | "
                                             "ring (K/V passed around a ring; CUDA) | usp or auto (Ulysses over as "
                                             "many processes as the heads allow, ring across)",
                                     choices=SEQUENCE_PARALLEL_TYPES)
    seed: int = _f(0, "seed of all randomness (labels, noise, timesteps)")
    log_every: int = _f(50, "write metrics every N iterations")
    ckpt_every: int = _f(500, "save a checkpoint every N iterations (and at the end)")
    keep_last: int = _f(2, "keep the newest K checkpoints")
    eval_every: int = _f(0, "every N iterations and at the end: a class DiT teacher's student, the digits-FID, "
                            "precision, recall and class accuracy of --eval_samples samples; a pipeline teacher's, "
                            "the CLIP score (--clip) of its videos of --validation_prompts and the teacher's "
                            "(0: never)")
    eval_samples: int = _f(1000, "a DiT teacher: samples per --eval_every evaluation")
    validation_prompts: str | None = _f(None, "a text-to-video pipeline teacher with --eval_every: the prompts the "
                                              "student and the teacher draw, musubi-tuner's sample-prompt lines as "
                                              "`ditforge train --validation_prompts` reads them (the options: --seed "
                                              "alone; both draw at the run's frame size)")
    clip: str | None = _f(None, "with --validation_prompts: a local CLIP folder (CLIPModel and CLIPProcessor, "
                                "`ditforge eval --clip`'s) scoring every frame against its prompt")
    resume: str | None = _f(None, "'auto' (continue the run in --outputs if it has a checkpoint) or a checkpoint")
    device: str = _f("auto", "cuda | cpu | auto")


@dataclass
class RunConfig(_Freezable):
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


def assign(cfg: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """Write ``settings`` (``"section.field"`` -> value, e.g. ``{"model.num_frames": 2, "data.num_frames": 5}``)
    into ``cfg``, in place; returns ``cfg``.

    Raises:
        dataclasses.FrozenInstanceError: ``cfg`` is frozen (``freeze``).
        KeyError: a key that names no field of its section.
    """
    for key, value in settings.items():
        section, name = key.split(".")
        part = getattr(cfg, section)
        if name not in {f.name for f in dataclasses.fields(part)}:
            raise KeyError(f"{key}: no such setting")
        setattr(part, name, value)
    return cfg
