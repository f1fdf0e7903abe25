"""``ditforge bench``: the single-GPU ablation, one row per cumulative speed-up (as OpenDiT's ablation).

Each row trains the chosen model for a few steps on synthetic data of the right shape through the trainer's
own ``train_step`` (diffusion loss, AdamW, clipping, EMA), so what is timed is what ``ditforge train`` runs:

    a  the original DiT recipe: fp32, PyTorch LayerNorm and modulate, unfused (math) attention
    b  + bf16 autocast
    c  + fastest exact attention (``--enable_flashattn``: SDPA cuDNN, then Flash, where PyTorch prefers cuDNN)
    d  + fused adaLN Triton kernels (``--enable_modulate_kernel``)
    e  + ``torch.compile`` of the blocks (``--compile``)
    f  + the one-pass Triton optimizer step: clipping, AdamW and EMA (``--fused_optimizer auto``, the trainer's
       default on GPUs; rows a-e use torch's fused AdamW and a separate EMA pass)
    g  + FP8 matrix products in the blocks' linear layers (``--mixed_precision fp8``)

``--anchor SCRIPT`` runs a plain training script first, in the same job (the shared anchors, unchanged), and
adds a column: each row's samples/s over the anchor's (``run_anchor``).

``--memory`` runs the memory table instead, cumulative too, each row with row f's speed settings (bf16, fast
attention, compile, one-pass optimizer) and a ratio to the first (``plain``):

    plain        fp32 master weights, AdamW, EMA (what row f runs)
    noema        + no EMA (``--ema_decay 0``)
    8bit         + bitsandbytes' 8-bit AdamW moments (``--optimizer adamw8bit``)
    bf16         + Kahan-compensated bf16 weights (``--master_weights bf16``)
    sr           stochastically rounded bf16 weights instead (``--master_weights bf16_sr``)
    fused        + the optimizer step fused into the backward (``--fused_backward_pass``)
    offload      + the optimizer's states in pinned host memory, streamed (``--cpu_offload optimizer``)
    capped       the same under ``--gpu_memory_budget`` (``torch.cuda.set_per_process_memory_fraction``)
    capped_ckpt  + activation checkpointing of every block
    capped_op    selective checkpointing instead (``op``: matmul and attention outputs kept)

Rows are cumulative over the rows chosen with ``--rows`` (``abce``: compile without the fused kernels). A row
whose feature cannot run here (no GPU for Triton or FP8, torchao missing) is reported as skipped with the
reason, and the rows after it go on without that feature.  A row whose training state alone (weights,
gradients, optimizer states, EMA; ``optim.placement.state_bytes``) exceeds the GPU, or a capped row's budget, is
skipped before its model is built; its settings still carry to the rows after it.

Models are built on the meta device and materialised on the GPU one block at a time (``create_model(device=)``),
cast to bf16 block by block for the bf16-weight rows, so a model near the GPU's size (``vDiT-7B/222``) never is whole
in fp32 or in host memory.

MFU = 3 x forward FLOPs per sample x samples/sec / peak dense bf16 FLOP/s of the GPU (3x: the backward
costs two forwards; recomputation under activation checkpointing is not counted, the usual convention).
The forward FLOPs are the model's ``flops_per_sample()`` (matrix products, a multiply-add counts 2).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path

import torch

from ditforge.atomic import atomic_path
from ditforge.config.sections import BenchConfig
from ditforge.config.values import parse_bytes, parse_checkpoint_policy, resolve_device, resolve_precision
from ditforge.diffusion import create_diffusion
from ditforge.errors import UserError
from ditforge.models import create_model, is_video_model
from ditforge.ops.attention import set_attention_backend
from ditforge.ops.modulate import set_kernels
from ditforge.ops.triton import check_triton
from ditforge.parallel import fp8_unavailable, parallelize
from ditforge.parallel.ema import EMA
from ditforge.parallel.mesh import Dist
from ditforge.ops.fused_adamw import on_gpu_with_triton
from ditforge.optim import build_optimizer
from ditforge.optim.backward import StepInBackward
from ditforge.optim.placement import cap_gpu_memory, state_bytes
from ditforge.train.step import step_randomness, train_step

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peak (no sparsity), FLOP/s, from the vendors' datasheets; matched on the device name.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                   "B200": 2250e12}


@dataclass(frozen=True)
class Settings:
    """What one row turns on (cumulative over the rows before it)."""

    precision: str = "fp32"  # fp32 | bf16 | fp8
    attention: str = "math"  # ops.attention backend: math | fast
    kernels: bool = False
    compile: bool = False  # in cfg.compile_mode
    optimizer: str = "adamw"  # --optimizer
    master_weights: str = "fp32"  # --master_weights
    fused_backward_pass: bool = False  # --fused_backward_pass
    fused_optimizer: bool = False  # --fused_optimizer auto (the trainer's default on GPUs)
    cpu_offload: bool = False  # --cpu_offload optimizer
    ema: bool = True  # False: --ema_decay 0
    budget: bool = False  # under cfg.gpu_memory_budget
    grad_checkpoint: str | None = None  # None: cfg.grad_checkpoint


ROWS: list[tuple[str, str, dict]] = [
    ("a", "original DiT recipe: fp32, PyTorch adaLN, math attention", {}),
    ("b", "+ bf16 autocast", {"precision": "bf16"}),
    ("c", "+ fast attention (cuDNN/Flash SDPA)", {"attention": "fast"}),
    ("d", "+ fused adaLN Triton kernels", {"kernels": True}),
    ("e", "+ torch.compile", {"compile": True}),
    ("f", "+ one-pass optimizer step (clipping, AdamW, EMA: --fused_optimizer)", {"fused_optimizer": True}),
    ("g", "+ FP8 linears (torchao)", {"precision": "fp8"}),
]


MEMORY_ROWS: list[tuple[str, str, dict]] = [
    ("plain", "bf16, fast attention, compile; fp32 master, one-pass AdamW + EMA", {}),
    ("noema", "+ no EMA (--ema_decay 0)", {"ema": False}),
    ("8bit", "+ 8-bit AdamW moments (--optimizer adamw8bit)", {"optimizer": "adamw8bit"}),
    ("bf16", "+ Kahan bf16 weights (--master_weights bf16)", {"master_weights": "bf16"}),
    ("sr", "stochastically rounded bf16 weights instead (--master_weights bf16_sr)", {"master_weights": "bf16_sr"}),
    ("fused", "+ optimizer step in the backward (--fused_backward_pass)", {"fused_backward_pass": True}),
    ("fp8", "+ FP8 linears (--mixed_precision fp8)", {"precision": "fp8"}),
    ("offload", "+ optimizer states in host memory (--cpu_offload optimizer)", {"cpu_offload": True}),
    ("capped", "+ --gpu_memory_budget", {"budget": True}),
    ("capped_ckpt", "+ activation checkpointing (full)", {"grad_checkpoint": "full"}),
    ("capped_op", "activation checkpointing op instead (recompute the element-wise ops)", {"grad_checkpoint": "op"}),
]
MEMORY_BASE = Settings(precision="bf16", attention="fast", compile=True, fused_optimizer=True)  # row f


def why_not(change: dict, device: torch.device) -> str | None:
    """The reason a row's change cannot run on ``device``, or None (the checks the trainer makes at start)."""
    if change.get("kernels"):
        try:
            check_triton(device)
        except RuntimeError as e:
            return str(e)
    if (change.get("fused_optimizer") or change.get("cpu_offload")) and not on_gpu_with_triton(device):
        return "the one-pass optimizer step runs on CUDA GPUs with Triton"
    if change.get("precision") == "fp8":
        reason = fp8_unavailable(device)
        return reason and f"FP8 {reason}"
    return None


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Dense bf16 peak of the device in FLOP/s (``PEAK_BF16_FLOPS`` by name), or None when unknown (CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def _sample_shape(cfg: BenchConfig) -> tuple[int, ...]:
    side = cfg.image_size // cfg.vae_downsample
    if is_video_model(cfg.model):
        return (cfg.in_channels, cfg.num_frames or 16, side, side)
    return (cfg.in_channels, side, side)


def _build(cfg: BenchConfig, s: Settings, device: torch.device):
    shape = _sample_shape(cfg)
    torch.manual_seed(cfg.seed)
    frames = {"num_frames": shape[1]} if len(shape) == 4 else {}

    def cast(module: torch.nn.Module) -> None:  # the weights, as the trainer casts them
        for p in module.parameters():
            p.data = p.data.to(torch.bfloat16)

    # built on the meta device, materialised on the GPU a block at a time (cast at once: never whole in fp32)
    model = create_model(cfg.model, shape[-1], cfg.in_channels, cfg.num_classes, text_dim=cfg.text_dim or None,
                         device=device, block_ready=cast if s.master_weights != "fp32" else None, **frames).train()
    if s.master_weights != "fp32":
        cast(model)
    flops = model.flops_per_sample(cfg.text_tokens if cfg.text_dim else 0)
    tokens = model.x_embedder.num_patches
    amp = resolve_precision(s.precision, device)
    model = parallelize(model, Dist(device=device), "none", s.grad_checkpoint or cfg.grad_checkpoint,
                        cfg.compile_mode if s.compile else "none", s.attention,
                        enable_modulate_kernel=s.kernels, fp8=cfg.fp8_recipe if s.precision == "fp8" else None,
                        fp8_min_width=cfg.fp8_min_width,
                        fused_backward_pass=s.fused_backward_pass)
    return model, amp, flops, tokens, shape


def synthetic_condition(cfg: BenchConfig, batch: int, device: torch.device, g: torch.Generator) -> dict:
    """The model's condition keywords for ``batch`` synthetic samples: labels (B,) int64, or with ``text_dim``
    caption states (B, text_tokens, text_dim) float32 of random real lengths, zero-padded as the trainer pads."""
    if not cfg.text_dim:
        return {"y": torch.randint(0, cfg.num_classes, (batch,), generator=g, device=device)}
    lengths = torch.randint(1, cfg.text_tokens + 1, (batch, 1), generator=g, device=device)
    mask = torch.arange(cfg.text_tokens, device=device) < lengths
    states = torch.randn((batch, cfg.text_tokens, cfg.text_dim), generator=g, device=device) * mask[..., None]
    return {"y": states, "y_mask": mask}


def run_steps(cfg: BenchConfig, s: Settings, device: torch.device, batch: int, steps: int, warmup: int,
              timed: contextlib.AbstractContextManager | None = None) -> dict:
    """Train ``warmup + steps`` steps at ``batch``; returns the median step time (s) of the timed steps, the
    peak allocated memory (GiB), FLOPs per sample, tokens per sample and the loss of every step. ``timed`` (e.g.
    a profiler, ``benchmarks/profile_step.py``) is entered before the first timed step and left once the last
    has ended on the device. Raises torch.OutOfMemoryError."""
    if s.budget and device.type == "cuda":
        cap_gpu_memory(parse_bytes(cfg.gpu_memory_budget, "--gpu_memory_budget"), device)
    model, amp, flops, tokens, shape = _build(cfg, s, device)
    ema = EMA(model, alias=not s.ema)
    opt = build_optimizer(list(model.parameters()), s.optimizer, 1e-4, 0.0, device, s.master_weights,
                          in_backward=s.fused_backward_pass, fused=s.fused_optimizer,
                          offload="optimizer" if s.cpu_offload else "none")
    stepper = StepInBackward(model, opt, 1.0) if s.fused_backward_pass else None
    decay = 0.9999
    if stepper is None and ema.fuse_into(model, opt):  # the one-pass step updates the EMA (update: a no-op)
        opt.ema_decay = decay
    diffusion = create_diffusion(None).to(device)  # tables on the device: no host copy (a sync) per step
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    x = torch.randn((batch, *shape), generator=g, device=device)
    cond = synthetic_condition(cfg, batch, device, g)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    # One mark per step boundary, read after the last step: the CPU runs ahead as in training (no sync per
    # step), and step i takes marks[i + 1] - marks[i]. CUDA events on a GPU, the host clock on a CPU.
    marks, losses = [], []
    with contextlib.ExitStack() as stack:
        for step in range(warmup + steps):
            if step == warmup and timed is not None:
                stack.enter_context(timed)
            if step >= warmup:
                marks.append(_mark(cuda))
            rnd = step_randomness(cfg.seed, step, batch, shape, diffusion, 0.1, device)
            terms = train_step(model, diffusion, opt, None, [(x, cond, rnd)], amp, 1.0, Dist(device=device),
                               stepper=stepper)
            ema.update(model, decay)
            losses.append(terms["loss"])
        marks.append(_mark(cuda))
        if cuda:
            marks[-1].synchronize()
    if cuda:
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    else:
        times = [b - a for a, b in zip(marks, marks[1:])]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    del model, ema, opt, stepper
    # Every row sees the same weights, data, noise and timesteps: the losses show whether a speed-up changed
    # what is computed (e.g. FP8 against bf16), not only how fast.
    return dict(step_time_s=statistics.median(times), peak_memory_gib=peak, flops=flops, tokens=tokens,
                losses=torch.stack(losses).double().tolist())


def _mark(cuda: bool):
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def find_max_batch(fits: Callable[[int], bool], start: int, limit: int = 1 << 16) -> int:
    """The largest batch ``b <= limit`` with ``fits(b)``, assuming fitting is monotone in ``b``: doubling
    from ``start`` until a batch fails (or bisecting below ``start`` if it fails), then bisection between the
    last fit and the first failure. Returns 0 if not even 1 fits."""
    lo, hi = 0, max(1, min(start, limit))  # invariant once bracketed: fits(lo) or lo == 0; not fits(hi)
    if fits(hi):
        lo, hi = hi, limit + 1
        while lo * 2 <= limit:
            if not fits(lo * 2):
                hi = lo * 2
                break
            lo *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


ANCHOR_MODE = "bf16_compile_ema"  # the shared anchors' strongest plain loop: compiled, fused AdamW, EMA


def run_anchor(script: str, batch: int) -> float:
    """Samples/s of a plain training script run in a subprocess (``python SCRIPT BATCH bf16_compile_ema``, ``$OUT`` a
    temporary folder where it writes ``{mode: {"img_s" | "samples_s": ...}}`` as JSON), before the rows, so that
    the ratio is between measurements of one job.

    Raises:
        UserError: the script is missing, fails, or writes no such JSON (the line names it).
    """
    if not Path(script).is_file():
        raise UserError(f"--anchor {script}: no such file")
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, script, str(batch), ANCHOR_MODE], env={**os.environ, "OUT": out},
                              capture_output=True, text=True)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"--anchor {script}: exited with {proc.returncode}: {last}")
        for path in Path(out).glob("*.json"):
            result = json.loads(path.read_text()).get(ANCHOR_MODE, {})
            value = result.get("img_s", result.get("samples_s"))
            if value:
                return float(value)
    raise UserError(f"--anchor {script}: wrote no JSON with {ANCHOR_MODE} img_s or samples_s into $OUT")


def bench(cfg: BenchConfig) -> dict:
    """Run the ablation rows and print the table; writes ``OUTPUTS/bench-<model>-<time>.json`` (atomically).

    Returns:
        dict(env=..., config=..., rows=[dict(row, label, status, reason, images_per_sec, tokens_per_sec,
        step_time_ms, mfu, peak_memory_gib, speedup)], max_batch=...).

    Raises:
        UserError: bad settings (unknown model or rows, sizes that do not divide, a bad checkpoint policy).
    """
    device = resolve_device(cfg.device)
    peak = peak_flops(device, cfg.peak_tflops)
    settings = MEMORY_BASE if cfg.memory else Settings()
    params = validate(cfg)
    anchor = run_anchor(cfg.anchor, cfg.batch_size) if cfg.anchor else None
    results = []
    for key, label, change in MEMORY_ROWS if cfg.memory else ROWS:
        if key not in (cfg.memory_rows.split(",") if cfg.memory else cfg.rows):
            continue  # rows are cumulative over the chosen ones: --rows abce is compile without kernels
        reason = why_not(change, device)
        if key == "e" and cfg.compile_mode != "default":
            label += f" (mode {cfg.compile_mode})"
        if change.get("budget"):
            label = label.replace("--gpu_memory_budget", f"--gpu_memory_budget {cfg.gpu_memory_budget}")
        row = dict(row=key, label=label, status="skipped", reason=reason)
        if reason is None:
            settings = replace(settings, **change)
            reason = row["reason"] = state_too_big(cfg, settings, device, params)
        if reason is None:
            log.info("row %s: %s", key, label)
            try:
                m = run_steps(cfg, settings, device, cfg.batch_size, cfg.steps, cfg.warmup)
            except torch.OutOfMemoryError:
                row["reason"] = f"out of memory at batch {cfg.batch_size}"
            else:
                per_sec = cfg.batch_size / m["step_time_s"]
                row.update(status="ok", reason=None, images_per_sec=per_sec, tokens_per_sec=per_sec * m["tokens"],
                           step_time_ms=m["step_time_s"] * 1e3, peak_memory_gib=m["peak_memory_gib"],
                           mfu=3 * m["flops"] * per_sec / peak if peak else None, losses=m["losses"],
                           final_loss=sum(m["losses"][-3:]) / len(m["losses"][-3:]))
            finally:
                _reset(device)
        results.append(row)
    base = next((r for r in results if r["row"] == ("plain" if cfg.memory else "a") and r["status"] == "ok"), None)
    for r in results:
        r["speedup"] = r["images_per_sec"] / base["images_per_sec"] if base and r["status"] == "ok" else None
        r["vs_anchor"] = r["images_per_sec"] / anchor if anchor and r["status"] == "ok" else None
    out = dict(env=environment(device, peak), config=asdict(cfg), rows=results, anchor_images_per_sec=anchor)
    if cfg.find_max_batch:
        if device.type != "cuda":
            raise UserError("--find_max_batch: needs a CUDA device (on the CPU there is no memory limit to find)")
        out["max_batch"] = dict(settings=asdict(settings), batch=find_max_batch(
            lambda b: _fits(cfg, settings, device, b), cfg.batch_size))
    print(format_table(out))
    path = Path(cfg.outputs) / f"bench-{cfg.model.replace('/', '-')}-{datetime.now():%Y%m%d-%H%M%S}.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(out, indent=1))
    log.info("wrote %s", path)
    return out


def _fits(cfg: BenchConfig, s: Settings, device: torch.device, batch: int) -> bool:
    try:
        run_steps(cfg, s, device, batch, steps=1, warmup=1)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        _reset(device)


def _reset(device: torch.device) -> None:
    set_attention_backend()
    set_kernels()
    torch._dynamo.reset()
    gc.collect()  # compiled blocks hold reference cycles: the last row's model would stay on the GPU
    if device.type == "cuda":
        cap_gpu_memory(None, device)
        torch.cuda.empty_cache()


def state_too_big(cfg: BenchConfig, s: Settings, device: torch.device, params: int) -> str | None:
    """Why a row cannot fit on a CUDA ``device`` before any step (its weights, gradients, optimizer states and
    EMA alone exceed the GPU's memory, or the budget of a capped row; ``optim.placement.state_bytes``), or None. Such
    a row is skipped at once instead of building (and, with a big model, compiling) it only to run out of memory."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    cap = min(total, parse_bytes(cfg.gpu_memory_budget, "--gpu_memory_budget")) if s.budget else total
    placement = (s.optimizer, s.master_weights, s.fused_backward_pass, "optimizer" if s.cpu_offload else "none")
    need = state_bytes(params, 0, placement, s.ema)
    if need <= cap:
        return None
    return (f"out of memory: {params / 1e9:.2f}B parameters' training state needs {need / 2**30:.1f} GiB > "
            f"{cap / 2**30:.1f} GiB")


def validate(cfg: BenchConfig) -> int:
    """The model's parameter count. Raises UserError naming the flag for unknown rows, non-positive sizes or a bad
    checkpoint policy."""
    for name in ("image_size", "in_channels", "vae_downsample", "num_classes", "batch_size", "steps", "text_tokens"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name}: expected a positive integer, got {getattr(cfg, name)}")
    if cfg.warmup < 0:
        raise UserError(f"--warmup: expected an integer >= 0, got {cfg.warmup}")
    if cfg.text_dim < 0:
        raise UserError(f"--text_dim: expected an integer >= 0, got {cfg.text_dim}")
    known = "".join(k for k, _, _ in ROWS)
    if not cfg.rows or set(cfg.rows) - set(known):
        raise UserError(f"--rows: expected letters of {known!r}, got {cfg.rows!r}")
    names = [k for k, _, _ in MEMORY_ROWS]
    if cfg.memory and (not cfg.memory_rows or set(cfg.memory_rows.split(",")) - set(names)):
        raise UserError(f"--memory_rows: expected names of {','.join(names)}, got {cfg.memory_rows!r}")
    parse_bytes(cfg.gpu_memory_budget, "--gpu_memory_budget")
    if cfg.image_size % cfg.vae_downsample:
        raise UserError(f"--image_size {cfg.image_size} is not divisible by --vae_downsample {cfg.vae_downsample}")
    parse_checkpoint_policy(cfg.grad_checkpoint)
    if cfg.fp8_recipe != "tensorwise" and "g" not in cfg.rows:
        raise UserError(f"--fp8_recipe {cfg.fp8_recipe}: needs row g (FP8) in --rows, got {cfg.rows!r}")
    if cfg.fp8_recipe == "rowwise_with_gw_hp" and "g" in cfg.rows and "e" not in cfg.rows:
        raise UserError("--fp8_recipe rowwise_with_gw_hp: needs row e (compile) before row g (eager it fails in "
                        "torchao)")
    shape = _sample_shape(cfg)
    with torch.device("meta"):  # checks the model name and that the patch sizes divide, allocating nothing
        model = create_model(cfg.model, shape[-1], cfg.in_channels, cfg.num_classes, text_dim=cfg.text_dim or None,
                             **({"num_frames": shape[1]} if len(shape) == 4 else {}))
    return sum(p.numel() for p in model.parameters())


def environment(device: torch.device, peak: float | None) -> dict:
    """Date, device and software versions for the record."""
    env = dict(date=datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
               python=platform.python_version(), device=device.type, peak_bf16_tflops=peak / 1e12 if peak else None)
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def format_table(result: dict) -> str:
    """The rows as a Markdown table (skipped rows say why)."""
    cfg, env = result["config"], result["env"]
    video = is_video_model(cfg["model"])
    head = (f"{cfg['model']} at {cfg['image_size']}px" + (f" x {cfg['num_frames'] or 16} frames" if video else "")
            + (f", text {cfg['text_tokens']} x {cfg['text_dim']}" if cfg.get("text_dim") else "")
            + f", batch {cfg['batch_size']}, {env.get('gpu', env['device'])}, torch {env['torch']}")
    anchor = result.get("anchor_images_per_sec")
    if anchor:
        head += f"; anchor {Path(cfg['anchor']).name} ({ANCHOR_MODE}): {anchor:.1f} samples/s in this run"
    lines = [head, "",
             f"| row | configuration | samples/s | tokens/s | step (ms) | MFU | peak mem (GiB) | "
             f"{'vs plain' if cfg.get('memory') else 'speed-up'} | loss |" + (" vs anchor |" if anchor else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if anchor else "")]

    def fmt(v, spec, unit=""):
        return "-" if v is None else format(v, spec) + unit

    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['row']} | {r['label']} | skipped: {r['reason']} | | | | | | |")
            continue
        lines.append(f"| {r['row']} | {r['label']} | {r['images_per_sec']:.1f} | {r['tokens_per_sec']:,.0f} | "
                     f"{r['step_time_ms']:.1f} | {fmt(r['mfu'] and 100 * r['mfu'], '.1f', '%')} | "
                     f"{fmt(r['peak_memory_gib'], '.1f')} | {fmt(r['speedup'], '.2f', 'x')} | "
                     f"{fmt(r.get('final_loss'), '.4f')} |"
                     + (f" {fmt(r['vs_anchor'], '.2f', 'x')} |" if anchor else ""))
    if "max_batch" in result:
        lines.append(f"\nlargest batch that fits with the last row's settings: {result['max_batch']['batch']}")
    return "\n".join(lines)
