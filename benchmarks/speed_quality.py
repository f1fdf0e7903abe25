"""Quality of the training speed-ups (issue 18): a 2,000-step DiT-S/2 run on a real image set in each speed mode,
against the plain bf16 run and a second seed of it.

The image set is an ImageFolder made from the built-in digits (scikit-learn's 1,797 real 8x8 handwritten digits),
upsampled to ``--image_size`` (bicubic) and written as PNGs, one folder per class; training reads it as any
ImageFolder (pixel space, 10 classes). Every mode trains from the same initialisation with the same data order,
noise and timesteps (``--seed 0``), ``--steps`` steps at batch 64, lr 1e-4, EMA on:

    bf16        --mixed_precision bf16 --fused_optimizer off (the reference: bench row b, torch's fused AdamW)
    bf16_seed1  the same with --seed 1 (initialisation, data order, noise): the run-to-run noise
    fast        + --enable_flashattn --enable_modulate_kernel --compile, the one-pass optimizer step (bench row f:
                what the README's speed table recommends)
    fast_no_kernels  + --enable_flashattn --compile (inductor's own norm fusion, the one-pass step)
    fp8         fast_no_kernels + --mixed_precision fp8 (torchao's float8 linears; bench row g without the kernels)

``--modes`` picks some (bf16 and bf16_seed1 always run). A mode is within run-to-run noise when the mean loss of its
last ``--window`` steps is within 2 standard errors of the difference between two runs' window means (batch means
of bf16 and bf16_seed1); its "shift" is the paired per-step difference to bf16 with its standard error
(``quality_curves``).

Usage: ``PYTHONPATH=. python benchmarks/speed_quality.py --work /tmp/sq --json $OUT/speed_quality.json
--plot $OUT/speed_quality.png`` (one GPU: the fast, fast_no_kernels and fp8 modes need it; a CPU with
``--steps 20 --modes bf16`` checks the script).
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from quality_curves import parser, report, run_modes

MODES = {
    "bf16": ["--fused_optimizer", "off"],
    "bf16_seed1": ["--fused_optimizer", "off", "--seed", "1"],
    "fast": ["--enable_flashattn", "--enable_modulate_kernel", "--compile"],
    "fast_no_kernels": ["--enable_flashattn", "--compile"],
    "fp8": ["--enable_flashattn", "--compile", "--mixed_precision", "fp8"],
}


def write_digits_folder(root: Path, size: int) -> Path:
    """The built-in digits as ``root/<label>/<index>.png``, (size, size) 8-bit grey, bicubic; written once (a
    finished folder holds a ``.done`` marker)."""
    from ditforge.data.digits import load_digits_arrays

    if (root / ".done").exists():
        return root
    images, labels = load_digits_arrays()
    pixels = ((images[:, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    for i, (image, label) in enumerate(zip(pixels, labels.tolist())):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, "L").resize((size, size), Image.BICUBIC).save(root / str(label) / f"{i:04d}.png")
    (root / ".done").touch()
    return root


def main() -> None:
    ap = parser(__doc__, "/tmp/ditforge-speed-quality", MODES)
    ap.add_argument("--model", default="DiT-S/2")
    ap.add_argument("--image_size", type=int, default=32)
    args = ap.parse_args()
    work = Path(args.work)
    data = write_digits_folder(work / f"digits{args.image_size}", args.image_size)
    # every mode after these: a later --mixed_precision (fp8) wins
    curves = run_modes(MODES, {"bf16", "bf16_seed1", *args.modes.split(",")}, work, args.window, args.steps,
                       "--data", str(data), "--image_size", str(args.image_size), "--model", args.model,
                       "--batch_size", "64", "--max_steps", str(args.steps), "--lr", "1e-4", "--mixed_precision",
                       "bf16", "--sample_every", "0", "--log_every", "1", "--device", args.device, jobs=args.jobs)
    report(curves, "bf16", "bf16_seed1", args.window,
           f"{args.model} on digits upsampled to {args.image_size}px, from scratch, lr 1e-4", args.json, args.plot,
           model=args.model, image_size=args.image_size, steps=args.steps)


if __name__ == "__main__":
    main()
