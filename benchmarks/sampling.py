"""Sampling speed (issue 7), in one process per GPU:

    PYTHONPATH=. python benchmarks/sampling.py --images --video --out results.json        # one GPU
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/sampling.py --video --out r.json  # adds sp=2, CFG-parallel rows

images: DiT-XL/2 at 256px (latents 4x32x32) with random weights (the zero-initialised adaLN-Zero and final layers
    made random too), a random VAE of Stable Diffusion's architecture (sd-vae-ft-ema's config), DDIM 50 steps,
    classifier-free guidance 4.0 on all latent channels, VAE decode included, batch 1 and 8:
    diffusers' ``DiTPipeline`` in fp16 (the weights exported by ``ditforge export --format diffusers``, with DiT's
    timestep frequencies) against ``ditforge sample``'s own path (``prepare_model`` + ``generate`` + VAE decode +
    ``to_uint8``) in fp32, bf16, and bf16 + fast attention + fused adaLN kernels + ``--compile`` (the whole DDIM
    loop as one CUDA graph); ``--rows fp8``: the blocks' linear layers as float8 GEMMs (``--mixed_precision fp8``,
    ``ditforge.ops.fp8``); ``eager-graph``, ``fora2``, ``fora3``, ``pab``: the eager model in the loop's CUDA graph, without and
    with step-level reuse (``--fora N``, ``--pab``). ``--anchor ../shared/anchors/diffusers_dit_sampling.py`` runs
    the compiled-diffusers anchor unchanged first, in the same job, and adds each row's ratio to it. The anchor
    runs in its own process with PyTorch's defaults; this process then takes ``ditforge sample``'s GEMM settings
    (``use_sampling_gemm_settings``: cuBLASLt without a workspace), which the in-process DiTPipeline row shares.
    Times: wall clock of a whole call (synchronised), median of ``--repeat`` after one warm-up call (which
    compiles). Fidelity: every path from the same starting noise and timesteps (DDIM leading spacing
    980, 960, ..., 0 at 50 steps, as DiTPipeline), run as ``generate`` runs it (the loop's graph included), PSNR
    and SSIM of its uint8 images against ditforge fp32.
video: a text-conditioned STDiT-XL/2 and vDiT-XL/222 at 16 frames x 256px (latents 4x16x32x32), 120 caption
    states of width 4096 (T5-XXL's), DDIM 50 steps, guidance 7.0, batch 1, bf16 + fast attention + fused kernels,
    eager (``--video_rows compiled,cfg-compiled``: compiled, CUDA graphs): without and with Pyramid Attention
    Broadcast (``--pab`` defaults), PSNR and SSIM (scikit-image) of each video against the plain one; under
    torchrun with 2 processes also sequence parallelism over both GPUs and CFG parallelism (conditional and
    unconditional passes on one GPU each, as ``--cfg_parallel``).

Random weights time the same arithmetic as trained ones; PAB's quality cost on them is not that of a trained
model (the attention outputs of a random model need not be stable across steps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ditforge.data.images import to_uint8
from ditforge.diffusion import create_diffusion, generate
from ditforge.diffusion.pab import Broadcast, PABConfig, PyramidAttentionBroadcast
from ditforge.diffusion.samplers import GuidedModel, sample_loop
from ditforge.encoders.vae import load_vae
from ditforge.models import create_model
from ditforge.parallel.mesh import Dist, init_distributed, shutdown
from ditforge.sample import prepare_model, use_sampling_gemm_settings
from timing import host_syncs, print_top_kernels, psnr, ssim

STEPS, IMAGE_CFG, VIDEO_CFG = 50, 4.0, 7.0
FAST = dict(enable_flashattn=True, enable_modulate_kernel=True)
GRAPHED = dict(mixed_precision="bf16", compile="reduce-overhead", **FAST)
EVERY_STEP = PABConfig(*(Broadcast(0, 999, 1),) * 4)  # patches nothing: the eager model, in the loop's CUDA graph
IMAGE_ROWS = {  # key -> (name, prepare_model settings, PAB / FORA schedule); a compiled model goes with a compiled VAE
    "fp32": ("ditforge fp32", dict(mixed_precision="fp32"), None),
    "bf16": ("ditforge bf16", dict(mixed_precision="bf16"), None),
    "compiled": ("ditforge bf16 + fast attn + kernels + compile (CUDA graphs)", GRAPHED, None),
    "compiled-no-kernels": ("ditforge bf16 + fast attn + compile (CUDA graphs), inductor's own norm fusion",
                            dict(mixed_precision="bf16", compile="reduce-overhead", enable_flashattn=True), None),
    "eager-graph": ("ditforge bf16 + fast attn + kernels, eager model in the loop's CUDA graph", GRAPHED, EVERY_STEP),
    "fora2": ("FORA N=2 (eager model in the loop's CUDA graph)", GRAPHED, PABConfig.fora(2)),
    "fora3": ("FORA N=3 (eager model in the loop's CUDA graph)", GRAPHED, PABConfig.fora(3)),
    "pab": ("PAB defaults: attention every 2nd step at t 100-800 (eager model in the loop's CUDA graph)", GRAPHED,
            PABConfig()),
    "fp8": ("ditforge fp8 (row-wise float8 GEMMs, Triton quantization) + fast attn + compile (CUDA graphs)",
            dict(mixed_precision="fp8", compile="reduce-overhead", enable_flashattn=True), None),
    "autotune": ("ditforge bf16 + fast attn + kernels + compile max-autotune",
                 dict(mixed_precision="bf16", compile="max-autotune", **FAST), None),
    "autotune-no-kernels": ("ditforge bf16 + fast attn + compile max-autotune, inductor's own norm fusion",
                            dict(mixed_precision="bf16", compile="max-autotune", enable_flashattn=True), None),
}


def random_weights(seed: int, *args, **kwargs) -> dict[str, torch.Tensor]:
    """``create_model(*args, **kwargs)``'s state dict with random weights everywhere, the zero-initialised
    adaLN-Zero / final layers included (else every block is the identity and the output zero); seeded before the
    model is built, so every process has the same weights."""
    torch.manual_seed(seed)
    model = create_model(*args, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)
    return model.state_dict()


def sd_vae(folder: Path) -> Path:
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                  layers_per_block=2, latent_channels=4, norm_num_groups=32, sample_size=256,
                  scaling_factor=0.18215).save_pretrained(str(folder))
    return folder


def wall(fn, repeat: int) -> tuple[float, float, object]:
    """(first call s, median of ``repeat`` further calls s, last result); synchronised around each call."""
    times, out = [], None
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:]), out


def fidelity_latents(m, y: torch.Tensor, x_T: torch.Tensor, cache: PABConfig | None) -> torch.Tensor:
    """DDIM with DiTPipeline's timesteps (980, 960, ..., 0) from ``x_T``, run as ``generate`` runs ``m``: its loop
    graph when it has one (the compiled model inside, or the eager one with a PAB / FORA schedule), else per step."""
    graphs = getattr(m, "loop_graphs", None)
    net = getattr(m, "eager", m) if cache is not None else graphs.model if graphs is not None else m
    diffusion = create_diffusion(",".join(["1"] * STEPS))

    def loop(x, labels, _):
        fn = GuidedModel(net, labels, IMAGE_CFG)
        with PyramidAttentionBroadcast(net, cache) if cache is not None else contextlib.nullcontext() as pab:
            on_step = (lambda t: (fn.step(t), pab.step(t))) if pab is not None else None
            return sample_loop(diffusion, fn, x, "ddim", clip_denoised=False, on_step=on_step)

    return graphs.run(("fidelity", cache, x_T.shape), loop, x_T, y, None) if graphs is not None else loop(x_T, y, None)


def images(args, work: Path, anchor: dict | None) -> list[dict]:
    from diffusers import DiTPipeline
    from diffusers.utils.torch_utils import randn_tensor

    from ditforge.export import export_diffusers
    from ditforge.interop import use_official_timestep_frequencies

    dev = torch.device("cuda")
    spec = dict(model="DiT-XL/2", input_size=32, in_channels=4, num_classes=1000, learn_sigma=True,
                class_dropout_prob=0.1, condition="class", num_frames=None, text_dim=None, qk_norm=False, vae="none")
    weights = random_weights(0, "DiT-XL/2", 32, 4, 1000, True, 0.1)
    vae_dir = sd_vae(work / "vae")
    model = create_model("DiT-XL/2", 32, 4, 1000, True, 0.1)
    model.load_state_dict(weights)
    export_diffusers(model, spec, work / "pipe", vae_dir)
    pipe = DiTPipeline.from_pretrained(str(work / "pipe"), torch_dtype=torch.float16, local_files_only=True).to(dev)
    use_official_timestep_frequencies(pipe.transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler.set_timesteps(STEPS)
    leading = pipe.scheduler.timesteps.tolist()
    stride = 1000 // STEPS
    assert leading == list(range(1000 - stride, -1, -stride)), leading[:3]

    def noise(batch: int) -> torch.Tensor:  # DiTPipeline's own starting latents for seed 0
        g = torch.Generator(dev).manual_seed(0)
        return randn_tensor((batch, 4, 32, 32), generator=g, device=dev, dtype=torch.float16).float()

    rows, refs = [], {}
    for batch in map(int, args.batches.split(",")):
        labels = list(range(0, 1000, 1000 // batch))[:batch]
        y = torch.tensor(labels, device=dev)

        def run_diffusers():
            out = pipe(class_labels=labels, guidance_scale=IMAGE_CFG, num_inference_steps=STEPS,
                       generator=torch.Generator(dev).manual_seed(0), output_type="np").images
            return (out * 255).round().astype(np.uint8)

        first, median, theirs = wall(run_diffusers, args.repeat)
        rows.append(dict(section="images", path="diffusers DiTPipeline fp16", batch=batch, first_s=first,
                         median_s=median, images_per_s=batch / median, fidelity_image=theirs))
        for name, settings, cache in (IMAGE_ROWS[key] for key in args.rows.split(",")):
            m = create_model("DiT-XL/2", 32, 4, 1000, True, 0.1)
            m.load_state_dict(weights)
            m = prepare_model(m, Dist(device=dev), **settings)
            vae = load_vae(str(vae_dir), dev, torch.float32 if settings["mixed_precision"] == "fp32" else torch.bfloat16)
            if settings.get("compile"):
                vae.compile()

            def latents(steps: int, m=m, cache=cache) -> torch.Tensor:
                return generate(m, y, (4, 32, 32), cfg_scale=IMAGE_CFG, num_steps=steps, sampler="ddim",
                                generator=torch.Generator(dev).manual_seed(0), clip_denoised=False, pab=cache)

            def run(vae=vae):  # exactly what `ditforge sample` runs per batch
                return to_uint8(vae.decode(latents(STEPS)).float())

            first, median, _ = wall(run, args.repeat)
            syncs = {}
            for n in (10, STEPS):
                latents(n)  # a first call at this step count captures its graphs: count the syncs of a later one
                with host_syncs() as found:
                    latents(n)
                syncs[f"host_syncs_{n}_steps"] = len(found)
            z = latents(STEPS)
            split = dict(generate_s=wall(lambda: latents(STEPS), args.repeat)[1],
                         decode_s=wall(lambda: to_uint8(vae.decode(z).float()), args.repeat)[1])
            with torch.no_grad():  # fidelity: DiTPipeline's noise and timesteps, through the same (graphed) loop
                img = to_uint8(vae.decode(fidelity_latents(m, y, noise(batch), cache)).float())
            rows.append(dict(section="images", path=name, batch=batch, first_s=first, median_s=median,
                             images_per_s=batch / median, fidelity_image=img, **syncs, **split))
            print(f"{name} batch {batch}: first {first:.1f} s, median {median:.3f} s, {split}", flush=True)
            if args.top:  # where one whole sampling loop's GPU time went
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    latents(STEPS)
                    torch.cuda.synchronize()
                print_top_kernels(prof, args.top, f"{name} batch {batch}, {STEPS} steps")
            del m, vae
            torch.cuda.empty_cache()
        refs[batch] = next((r["fidelity_image"] for r in rows if r["path"] == "ditforge fp32" and r["batch"] == batch),
                           None)
    for r in rows:
        base = next(b for b in rows if b["batch"] == r["batch"] and b["path"].startswith("diffusers"))
        r["speedup_vs_diffusers"] = base["median_s"] / r["median_s"]
        image, ref = r.pop("fidelity_image"), refs[r["batch"]]
        r["psnr_vs_fp32_db"] = psnr(ref, image) if ref is not None else float("nan")
        r["ssim_vs_fp32"] = ssim(ref, image) if ref is not None else float("nan")
        if anchor:  # the shared anchor, run unchanged in this job: diffusers' DiTPipeline, transformer compiled
            r["vs_anchor"] = anchor[f"fp16_compiled_b{r['batch']}"] / r["median_s"]
    return rows


def run_anchor(script: str) -> dict:
    """Run ``script`` (``../shared/anchors/diffusers_dit_sampling.py``) unchanged in a subprocess first, in this
    job; returns its JSON (seconds per call, e.g. ``fp16_compiled_b1``)."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, script], check=True, env={**os.environ, "OUT": out})
        return json.loads((Path(out) / "diffusers_anchor.json").read_text())


def video(args, d: Dist, work: Path) -> list[dict]:
    dev = d.device
    vae_dir = work / "vae"
    if d.is_main and not vae_dir.exists():
        sd_vae(vae_dir)
    d.barrier()
    vae = load_vae(str(vae_dir), dev, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    states = torch.randn(1, 120, 4096, generator=g).to(dev)
    mask = (torch.arange(120) < 60)[None].to(dev)
    rows = []
    for name in args.video_models.split(","):
        weights = random_weights(5, name, 32, 4, 1000, True, 0.1, num_frames=16, text_dim=4096)
        # row -> (label, the model's Dist, PAB, CFG group, compile): one GPU; sequence parallelism over all; CFG
        # parallelism (the conditional and unconditional passes on two GPUs, as `ditforge sample --cfg_parallel`)
        alone, world = Dist(device=dev), dist.group.WORLD
        settings = {"plain": ("sp=1", None, False, None, "none"), "pab": ("sp=1", None, True, None, "none"),
                    "compiled": ("sp=1 compiled", None, False, None, "reduce-overhead")}
        if d.world_size > 1:
            settings |= {"sp": (f"sp={d.sp_size}", d, False, None, "none"),
                         "sp-pab": (f"sp={d.sp_size}", d, True, None, "none")}
        if d.world_size == 2:
            settings |= {"cfg": ("cfg-parallel=2", alone, False, world, "none"),
                         "cfg-compiled": ("cfg-parallel=2 compiled", alone, False, world, "reduce-overhead")}
        wanted = ["plain"] + [r for r in args.video_rows.split(",") if r != "plain" and r in settings]
        outs = {}
        for label, dd, pab, cfg_group, compile in (settings[r] for r in wanted):
            if dd is None and not d.is_main:  # a one-GPU row: the other processes wait for it
                d.barrier()
                continue
            m = create_model(name, 32, 4, 1000, True, 0.1, num_frames=16, text_dim=4096)
            m.load_state_dict(weights)
            m = prepare_model(m, dd or Dist(device=dev), "bf16", compile=compile, **FAST)
            torch.cuda.reset_peak_memory_stats()

            def run(m=m, pab=pab, cfg_group=cfg_group):
                latents = generate(m, states, (4, 16, 32, 32), y_mask=mask, cfg_scale=VIDEO_CFG, num_steps=STEPS,
                                   sampler="ddim", generator=torch.Generator(dev).manual_seed(0),
                                   clip_denoised=False, pab=PABConfig() if pab else None, cfg_group=cfg_group)
                return to_uint8(vae.decode(latents).float()) if d.is_main else None

            first, median, frames = wall(run, args.repeat)
            key = label + (" + PAB" if pab else "")
            outs[key] = frames
            if d.is_main:
                rows.append(dict(section="video", path=f"{name} bf16 fast {key}", model=name, setting=key,
                                 batch=1, first_s=first, median_s=median, videos_per_s=1 / median,
                                 peak_gib=torch.cuda.max_memory_allocated() / 2**30))
                print(f"{name} {key}: first {first:.2f} s, median {median:.3f} s", flush=True)
            del m
            torch.cuda.empty_cache()
            d.barrier()
        if d.is_main:
            base = next(b for b in rows if b["model"] == name and b["setting"] == "sp=1")
            for r in rows:
                if r["model"] == name:
                    r["speedup_vs_sp1"] = base["median_s"] / r["median_s"]
                    r["psnr_vs_no_pab_db"] = psnr(outs["sp=1"], outs[r["setting"]])
                    r["ssim_vs_no_pab"] = ssim(outs["sp=1"], outs[r["setting"]])
    return rows


def main() -> None:
    global STEPS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", action="store_true")
    p.add_argument("--video", action="store_true")
    p.add_argument("--video_models", default="STDiT-XL/2,vDiT-XL/222")
    p.add_argument("--video_rows", default="plain,pab,sp,sp-pab,cfg", help="video: which of plain, pab, compiled "
                   "(one GPU); sp, sp-pab (under torchrun); cfg, cfg-compiled (CFG parallelism, 2 processes)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rows", default="fp32,bf16,compiled", help=f"images: which of {', '.join(IMAGE_ROWS)} "
                   "(fp32 gives the fidelity reference; autotune compiles for minutes)")
    p.add_argument("--batches", default="1,8", help="images: batch sizes")
    p.add_argument("--top", type=int, default=0, help="images: print the N largest GPU kernels of one sampling loop")
    p.add_argument("--steps", type=int, default=STEPS, help="sampling steps of our rows and DiTPipeline's (the "
                   "anchor script always runs 50): fewer steps at equal quality (see quality_curves.py cache-images)")
    p.add_argument("--anchor", help="images: run this anchor script (../shared/anchors/diffusers_dit_sampling.py) "
                   "unchanged first, in the same job, and add each row's speed-up over its compiled DiTPipeline")
    p.add_argument("--out")
    args = p.parse_args()
    STEPS = args.steps
    d = init_distributed("cuda", int(os.environ.get("WORLD_SIZE", 1)))
    rows = []
    work = Path(tempfile.gettempdir()) / "ditforge-sampling-bench"  # the random VAE and the diffusers export
    anchor = run_anchor(args.anchor) if args.images and args.anchor and d.is_main else None  # PyTorch's defaults
    # then this process's GEMMs as ``ditforge sample``'s (``prepare_model`` sets the same, but PyTorch reads it at
    # the first cuBLASLt GEMM, which the DiTPipeline row would run first)
    use_sampling_gemm_settings(d.device)
    if args.images and d.is_main:
        rows += images(args, work, anchor)
    d.barrier()
    if args.video:
        rows += video(args, d, work)
    if d.is_main:
        meta = dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                    gpus=d.world_size, torch=torch.__version__, cuda=torch.version.cuda, steps=STEPS,
                    anchor=args.anchor, cublaslt_workspace_kib=os.environ.get("CUBLASLT_WORKSPACE_SIZE"))
        try:
            import diffusers
            meta["diffusers"] = diffusers.__version__
        except ImportError:
            pass
        print(json.dumps(meta))
        print("| path | batch | first call s | median s | per s | vs diffusers / sp=1 | vs anchor | PSNR dB | SSIM |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            speed = r.get("speedup_vs_diffusers", r.get("speedup_vs_sp1"))
            quality = r.get("psnr_vs_fp32_db", r.get("psnr_vs_no_pab_db"))
            similar = r.get("ssim_vs_fp32", r.get("ssim_vs_no_pab", float("nan")))
            print(f"| {r['path']} | {r['batch']} | {r['first_s']:.2f} | {r['median_s']:.3f} | "
                  f"{r['batch'] / r['median_s']:.2f} | {speed:.2f}x | {r.get('vs_anchor', float('nan')):.2f}x | "
                  f"{quality:.1f} | {similar:.4f} |")
        for r in rows:
            if "host_syncs_10_steps" in r:
                print(f"{r['path']}, batch {r['batch']}: generate {r['generate_s']:.3f} s + decode {r['decode_s']:.3f} s;"
                      f" host syncs in generate: {r['host_syncs_10_steps']} at 10 steps, "
                      f"{r[f'host_syncs_{STEPS}_steps']} at {STEPS}")
        if args.out:
            Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    shutdown(d)


if __name__ == "__main__":
    main()
