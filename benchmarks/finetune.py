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

Usage (repository root, GPU machine): ``PYTHONPATH=. python benchmarks/finetune.py --model sd15 --work /tmp/ft
--rows full,full_compile,lora64,lora64_compile --json $OUT/finetune_sd15.json``; ``--tiny`` builds the tests' tiny
pipeline instead (a CPU check of the script).
"""

from __future__ import annotations

import argparse
import datetime
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
}


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


def run_row(name: str, pipe: Path, feats: Path, work: Path, batch: int, steps: int, log_every: int,
            device: str, timeout: float | None = None) -> dict:
    out = work / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    try:
        log = ditforge("train", "--init_from", str(pipe), "--data", str(feats), "--batch_size", str(batch),
                       "--max_steps", str(steps), "--log_every", str(log_every), "--sample_every", "0",
                       "--ckpt_every", str(10 * steps), "--keep_last", "1", "--device", device, "--num_workers", "0",
                       "--outputs", str(out), *ROWS[name], timeout=timeout)
    except RuntimeError as e:
        return {"error": str(e)[-600:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)  # full fine-tunes write ~14 GB of checkpoint
    windows = [batch / r["samples_per_sec"] * 1000 for r in records[1:]]  # ms per step after the warm-up window
    # the placement lines of --gpu_memory_budget (the measured residency of streamed states among them)
    placement = [line.split(" INFO ", 1)[-1] for line in log.splitlines() if "--gpu_memory_budget" in line]
    return {"ms_per_step": round(statistics.median(windows), 1), "windows_ms": [round(w, 1) for w in windows],
            "peak_gib": round(max(r.get("peak_memory_gib", 0.0) for r in records), 2),
            "final_loss": round(records[-1]["loss"], 4), **({"placement": placement} if placement else {})}


def profile_row(name: str, pipe: Path, feats: Path, batch: int, steps: int = 3) -> None:
    """Where a row's step goes, in this process (the trainer's pieces, not its loop): wall ms per step against the
    GPU kernel time of the same steps (torch.profiler), and the largest kernels. Wall far above kernel time: the
    step waits on the host (launches, Python)."""
    from torch.profiler import ProfilerActivity, profile

    from timing import print_top_kernels
    from ditforge.config import build_config
    from ditforge.data import build_dataset
    from ditforge.diffusion.objective import create_objective
    from ditforge.encoders.batch import BatchEncoder
    from ditforge.parallel.ema import EMA
    from ditforge.parallel.mesh import Dist
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.train import finetune
    from ditforge.train.trainer import step_randomness, train_step

    flags = dict(zip(ROWS[name][::2], ROWS[name][1::2])) if name.startswith("lora") else {}
    cfg = build_config(overrides={"init_from": str(pipe), "data": str(feats),
                                  "lora_rank": int(flags.get("--lora_rank", 0))})
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    pre = load_pretrained(pipe, dev, text_device=torch.device("cpu"))
    ds = build_dataset(str(feats), None)
    model = pre.denoiser.train()
    if cfg.model.lora_rank:
        finetune.add_lora_to_denoiser(model, cfg)
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    if "--compile" in ROWS[name]:
        from ditforge.parallel import parallelize

        i = ROWS[name].index("--compile")
        mode = ROWS[name][i + 1] if i + 1 < len(ROWS[name]) and not ROWS[name][i + 1].startswith("--") else "default"
        model = parallelize(model, Dist(device=dev), compile=mode)
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
    ap.add_argument("--model", choices=("sd15", "pixart", "sdxl"), required=True)
    ap.add_argument("--rows", default="full,full_compile,lora64,lora64_compile")
    ap.add_argument("--work", default="/tmp/ditforge-finetune")
    ap.add_argument("--batch_size", type=int, default=None, help="default: 1 (sd15, sdxl), 8 (pixart), as the anchors")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log_every", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny pipeline at 32 px (checks the script on CPU)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--row_timeout", type=float, default=None, help="seconds a row may take (then it is an error)")
    ap.add_argument("--profile", action="store_true", help="profile the rows in this process instead of timing them "
                    "through `ditforge train` (profile_row)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    batch = args.batch_size or (8 if args.model == "pixart" else 1)
    size = 32 if args.tiny else 1024 if args.model == "sdxl" else 512
    pipe = work / f"{args.model}{'-tiny' if args.tiny else ''}"
    if not (pipe / "model_index.json").is_file():
        builders = ({"sd15": tiny_pipelines.make_sd, "pixart": tiny_pipelines.make_pixart, "sdxl": tiny_pipelines.make_sdxl}
                    if args.tiny else {"sd15": build_sd15, "pixart": build_pixart, "sdxl": build_sdxl})
        builders[args.model](pipe)
    feats = work / f"feats-{pipe.name}"
    if not (feats / "features.json").is_file():
        shutil.rmtree(feats, ignore_errors=True)
        data = images(work / f"images-{size}", 16, size)
        ditforge("extract-features", "--init_from", str(pipe), "--data", str(data), "--image_size", str(size),
                 "--device", args.device, "--num_workers", "0", "--batch_size", "8", "--out", str(feats))
    if args.profile:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        for name in args.rows.split(","):
            profile_row(name, pipe, feats, batch)
        return
    import diffusers

    meta = {"date": datetime.date.today().isoformat(), "model": args.model, "batch_size": batch, "image_size": size,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__, "diffusers": diffusers.__version__, "steps": args.steps,
            "log_every": args.log_every, **library_versions()}
    results = {}
    for name in args.rows.split(","):
        results[name] = run_row(name, pipe, feats, work, batch, args.steps, args.log_every, args.device,
                                args.row_timeout)
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
