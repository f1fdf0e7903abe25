"""The Wan VAE decode of an 81-frame 480 x 832 clip (issue 66, item 4: at most 1.4 s at 40 dB or better against the
float32 decode, from 2.84 s), one claim: how much faster each way of running the same decoder is.

    python benchmarks/vae_decode.py                 # one GPU; writes $OUT/vae_decode.json (default benchmarks/results)
    TINY=1 python benchmarks/vae_decode.py          # a tiny AutoencoderKLWan on the CPU: a check of the script

Workload: ``AutoencoderKLWan()`` (diffusers' default config, Wan2.1's VAE: 73M decoder weights) with random weights
(seed 0, drawn on the device, the same for every row), random latents (1, 16, 21, 60, 104) (seed 1, float32, on
the device): 81 frames of 480 x 832. A decode is 275 TFLOP (``torch.utils.flop_counter`` on the meta device,
printed by the run), so at 2.84 s the float32 decode (TF32 convolutions, PyTorch's default for cuDNN) runs at
about 97 TFLOPS.

Rows (``ROWS``), each a fresh VAE:

- ``fp32``: the anchor's way (``wan_sampling.py``: float32, as the Wan model card recommends): ``vae.decode(z)``, as
  ``WanPipeline`` calls it; the reference of every PSNR;
- ``bf16`` / ``fp16``: the VAE cast (``nn.Module.to``), the latents too;
- ``bf16_channels_last``: bf16 with the Conv3d weights and the latents in ``torch.channels_last_3d`` (the Conv2d
  weights ``channels_last``; ``sample.video_vae.to_channels_last``, which ``--vae_dtype bfloat16`` applies);
  ``out_channels_last`` says whether the layout survived to the output;
- ``*_cudnn_benchmark``: ``torch.backends.cudnn.benchmark`` on for the row (cuDNN times its algorithms per shape in
  the warm-up call), off again after it;
- ``*_compile``: the decoder compiled (``ditforge.encoders.vae.VAE.compile``: ``module.compile()``, inductor; three
  graphs, compiled in the warm-up call, whose time is ``first_s``; TINY: dynamo's ``eager`` backend);
- ``ditforge_bf16`` / ``ditforge_bf16_compile``: the decode through ``ditforge sample``'s own path
  (``sample.video.VideoSampler`` with ``--vae_dtype bfloat16``, and ``--compile``; ``VideoSampler.decode``:
  ``VAE.unscale`` of the normalised latents ``(z - latents_mean) / latents_std`` in the VAE's dtype, then
  ``vae.decode``), around a 2-layer Wan transformer that it does not call.

Times: CUDA events around each decode, the median of ``--repeat`` (at least 3) after one warm-up call (TINY: the
host clock); peak GiB: ``torch.cuda.max_memory_allocated`` over the timed calls (weights included); PSNR: of the
output (clamped to [-1, 1], as diffusers' decode clamps) against ``fp32``'s, ``10 log10(2^2 / MSE)`` in float64, in
dB. Also measured once: the host syncs of one float32 decode (``timing.host_syncs``), and what diffusers' growing
``torch.cat`` of the decoded frames (``AutoencoderKLWan._decode``: one cat a latent frame, so the 81 frames are
copied about 11 times over) costs against one cat at the end, on random tensors of the output's shapes. Rows guessed to
end after ``--budget_s`` seconds are skipped (listed in the JSON), so the run stays inside five minutes; the JSON is
rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ditforge from this checkout, whatever PYTHONPATH

TINY = os.environ.get("TINY") == "1"
CONFIG = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
              temperal_downsample=[False, True, True]) if TINY else {}  # the anchor's tiny VAE, else the default
LATENTS = (1, 16, 3, 4, 4) if TINY else (1, 16, 21, 60, 104)
ROWS = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "fp16": dict(dtype="float16"),
    "bf16_channels_last": dict(dtype="bfloat16", channels_last=True),
    "bf16_cudnn_benchmark": dict(dtype="bfloat16", cudnn_benchmark=True),
    "fp32_cudnn_benchmark": dict(dtype="float32", cudnn_benchmark=True),
    "ditforge_bf16": dict(ditforge=dict(vae_dtype="bfloat16")),
    "bf16_compile": dict(dtype="bfloat16", compile=True),
    "ditforge_bf16_compile": dict(ditforge=dict(vae_dtype="bfloat16", compile="default")),
    "fp32_compile": dict(dtype="float32", compile=True),
}
COMPILE_GUESS_S = 120.0  # a first compiled decode on the GPU, before one is measured (3 graphs; a guess)
# on the CPU inductor's C++ compile of the decoder takes minutes: TINY leaves ditforge's compiled row out by default
DEFAULT_ROWS = [r for r in ROWS if not (TINY and r == "ditforge_bf16_compile")]


def build_vae(device: torch.device):
    """A fresh ``AutoencoderKLWan(**CONFIG)``, seed 0, drawn on ``device``, eval, float32."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    with torch.device(device):
        return AutoencoderKLWan(**CONFIG).eval().requires_grad_(False)


def decode_flops(latents: tuple[int, ...]) -> float:
    """FLOPs of one decode of ``latents`` (a shape) (``FlopCounterMode``: 2 per multiply-add of every convolution and matrix
    product), run on the meta device: no memory, no arithmetic."""
    from diffusers import AutoencoderKLWan
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        vae, z = AutoencoderKLWan(**CONFIG).eval(), torch.empty(latents)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.decode(z)
    return float(counter.get_total_flops())


def plain_decoder(settings: dict, device: torch.device, z: torch.Tensor):
    """(decode function, the VAE) of a row of diffusers' own call: ``vae.decode(z).sample``."""
    vae = build_vae(device)
    dtype = getattr(torch, settings["dtype"])
    torch.nn.Module.to(vae, dtype)
    x = z.to(dtype)
    if settings.get("channels_last"):
        from ditforge.sample.video import to_channels_last

        to_channels_last(vae)
        x = x.contiguous(memory_format=torch.channels_last_3d)
    if settings.get("compile"):
        vae.decoder.compile(**(dict(backend="eager") if TINY else {}))
    return (lambda: vae.decode(x).sample), vae


def ditforge_decoder(settings: dict, device: torch.device, z: torch.Tensor):
    """(decode function, the VAE) through ``VideoSampler``: its ``__init__`` casts (``--vae_dtype``) and compiles
    (``--compile``) the pipeline's VAE; ``decode`` takes the normalised latents."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    from ditforge.models.adapters.pipeline import Pretrained
    from ditforge.models.adapters.wan import WanDenoiser
    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler

    vae = build_vae(device)
    with torch.device(device):
        tr = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
                                   text_dim=64, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32).eval()
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=sched, transformer=tr)
    pre = Pretrained(Path("-"), "WanPipeline", pipe, WanDenoiser(tr, 8), dict(sched.config))
    sampler = VideoSampler(pre, pre.denoiser, Dist(device=device), SampleConfig(ckpt="-", **settings["ditforge"]))
    view = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float64, device=device).view(view)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float64, device=device).view(view)
    latents = ((z.double() - mean) / std).float()  # what the loop hands the decode
    return (lambda: sampler.decode(latents)), vae


def time_row(fn, repeat: int, device: torch.device) -> tuple[torch.Tensor, float, list[float]]:
    """(the last output, the warm-up call's seconds, the timed calls' seconds): CUDA events around each call on a
    GPU, the host clock on the CPU."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    sync()
    first = time.perf_counter() - t0
    del out
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            with torch.no_grad():
                out = fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            with torch.no_grad():
                out = fn()
            times.append(time.perf_counter() - t0)
    return out, first, times


def psnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """PSNR in dB of ``out`` against ``ref``, both clamped to [-1, 1]: 10 log10(2^2 / MSE), float64; inf if equal."""
    mse = float(((out.double().clamp(-1, 1) - ref.double().clamp(-1, 1)) ** 2).mean())
    if not math.isfinite(mse):  # NaN frames (an overflow in fp16, say)
        return math.nan
    return math.inf if mse == 0 else 10 * math.log10(4.0 / mse)


def cat_cost(shape: tuple[int, ...], device: torch.device, repeat: int) -> dict:
    """Seconds of diffusers' growing cat (``out = torch.cat([out, out_], 2)`` once a latent frame: the first
    decodes to 1 frame, each other to 4) against one ``torch.cat`` of the same pieces, float32, random."""
    b, _, frames, h, w = shape
    g = torch.Generator(device).manual_seed(2)
    pieces = [torch.randn(b, 3, 1 if i == 0 else 4, h * 8, w * 8, generator=g, device=device) for i in range(frames)]

    def growing():
        out = pieces[0]
        for p in pieces[1:]:
            out = torch.cat([out, p], 2)
        return out

    grow = statistics.median(time_row(growing, repeat, device)[2])
    once = statistics.median(time_row(lambda: torch.cat(pieces, 2), repeat, device)[2])
    return dict(growing_s=round(grow, 4), one_cat_s=round(once, 4))


def run_row(name: str, device: torch.device, z: torch.Tensor, ref: torch.Tensor | None, repeat: int,
            flops: float) -> tuple[dict, torch.Tensor]:
    settings = ROWS[name]
    torch.backends.cudnn.benchmark = bool(settings.get("cudnn_benchmark"))
    try:
        fn, vae = (ditforge_decoder if "ditforge" in settings else plain_decoder)(settings, device, z)
        out, first, times = time_row(fn, repeat, device)
    finally:
        torch.backends.cudnn.benchmark = False
    s = statistics.median(times)
    row = dict(row=name, settings=settings, s=round(s, 4), times_s=[round(t, 4) for t in times],
               first_s=round(first, 2), tflops=float(f"{flops / s / 1e12:.4g}"), dtype=str(out.dtype),
               psnr_db=None if ref is None else round(psnr_db(ref, out), 2))
    if settings.get("channels_last"):
        row["out_channels_last"] = out.is_contiguous(memory_format=torch.channels_last_3d)
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del fn, vae
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"of {', '.join(ROWS)} (fp32, the PSNR "
                   "reference, always runs first)")
    p.add_argument("--repeat", type=int, default=3, help="timed calls a row, after one warm-up call (at least 3)")
    p.add_argument("--budget_s", type=float, default=270.0, help="skip the rows that would end after this many "
                   "seconds: a row is guessed to take (repeat + 1) x the fp32 decode, plus for a compiled row the "
                   "last compiled row's first call (before any: COMPILE_GUESS_S)")
    p.add_argument("--device", default="cpu" if TINY else "cuda")
    p.add_argument("--latents", default=",".join(map(str, LATENTS)), help="the latents' shape B,C,T',h,w (a smaller "
                   "clip, e.g. 1,16,3,16,16 for 9 frames of 128 x 128 on the CPU)")
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", "benchmarks/results")) / "vae_decode.json"))
    args = p.parse_args()
    if args.repeat < 3:
        raise SystemExit(f"--repeat: at least 3 (a median of 3 or more), got {args.repeat}")
    start = time.perf_counter()
    device = torch.device(args.device)
    latents = tuple(int(n) for n in args.latents.split(","))
    import diffusers

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    names = ["fp32"] + [r for r in args.rows.split(",") if r and r != "fp32"]
    unknown = [r for r in names if r not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {', '.join(unknown)}; rows are {', '.join(ROWS)}")
    flops = decode_flops(latents)
    print(f"decode of latents {latents}: {flops / 1e12:.4g} TFLOP", flush=True)
    result = dict(date=datetime.now().isoformat(timespec="minutes"), torch=torch.__version__,
                  diffusers=diffusers.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", tiny=TINY,
                  latents=list(latents), config=CONFIG or "AutoencoderKLWan() default", decode_tflop=float(
                      f"{flops / 1e12:.4g}"), tf32_cudnn=torch.backends.cudnn.allow_tf32, repeat=args.repeat, rows=[],
                  skipped=[])
    g = torch.Generator(device).manual_seed(1)
    z = torch.randn(latents, generator=g, device=device)
    ref, compile_s = None, COMPILE_GUESS_S
    for name in names:
        compiles = bool(ROWS[name].get("compile") or ROWS[name].get("ditforge", {}).get("compile"))
        guess = (args.repeat + 1) * (result["rows"][0]["s"] if result["rows"] else 0) + compiles * compile_s
        if time.perf_counter() - start + guess > args.budget_s:
            result["skipped"].append(name)
            continue
        try:
            row, out = run_row(name, device, z, ref, args.repeat, flops)
        except Exception as e:  # a row that fails (a compile, memory) is recorded; the others still run
            if name == "fp32":
                raise
            row, out = dict(row=name, settings=ROWS[name], error=f"{type(e).__name__}: {str(e)[:300]}"), None
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if name == "fp32":
            ref = out
            row["psnr_db"] = "reference"
        if compiles and "first_s" in row:
            compile_s = row["first_s"]
        del out
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
    vae = build_vae(device)
    if device.type == "cuda":
        from timing import host_syncs

        with torch.no_grad(), host_syncs() as found:
            vae.decode(z)
        result["host_syncs_fp32_decode"] = len(found)
    result["cat"] = cat_cost(latents, device, args.repeat)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    base = result["rows"][0]["s"]
    print(f"\n{result['device']}, torch {result['torch']}, diffusers {result['diffusers']}; latents {latents}, "
          f"{result['decode_tflop']} TFLOP a decode")
    print("| row | s | x fp32 | TFLOPS | first call s | peak GiB | PSNR vs fp32 dB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['row']} | failed: {r['error'][:100]} |")
            continue
        print(f"| {r['row']} | {r['s']} | {base / r['s']:.2f} | {r['tflops']} | {r['first_s']} | "
              f"{r.get('peak_gib', '-')} | {r['psnr_db']} |")
    print(f"skipped (over --budget_s {args.budget_s}): {', '.join(result['skipped']) or 'none'}; host syncs in a "
          f"fp32 decode: {result.get('host_syncs_fp32_decode', '-')}; diffusers' growing cat "
          f"{result['cat']['growing_s']} s against one cat {result['cat']['one_cat_s']} s; wall "
          f"{result['wall_s']} s; {out_path}")


if __name__ == "__main__":
    main()
