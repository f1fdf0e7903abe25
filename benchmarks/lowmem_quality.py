"""Quality of the memory modes: a 2,000-step fine-tune of a real image set in each mode, against fp32-master AdamW.

The base is ``ditforge train`` of DiT-T/2 on the built-in digits (scikit-learn's 1,797 real 8x8 handwritten digits,
``--base_steps`` steps at lr 1e-3). Each mode then fine-tunes it (``--init_from`` the base run) for ``--steps``
steps at lr 1e-4 (where bf16 weights without compensation would lose most updates: 1e-4 is 1/40 of a bf16 ulp at
weights of size 1), bf16 compute, no EMA, the same data order and noise:

    fp32        --optimizer adamw --master_weights fp32 (the reference)
    fp32_seed1  the same with another --seed (data order, noise, dropout): the run-to-run noise
    adamw8bit   --optimizer adamw8bit
    bf16        --master_weights bf16 (Kahan-compensated bf16 weights)
    bf16_8bit   both (the 8 GiB rows of the README)
    sr_8bit_fused  --optimizer adamw8bit --master_weights bf16_sr --fused_backward_pass (4 bytes per parameter:
                the 4 GiB SD-1.5 and 16 GiB SDXL rows; clipping by the previous step's norm)
    sr_8bit     --optimizer adamw8bit --master_weights bf16_sr (the 8 GiB DiT-XL/2 row)
    fp32_library  the reference with the libraries' kernels (--fused_optimizer off): on a GPU every other mode
                runs the one-pass Triton step
    delayed     --cpu_offload all --delayed_update (ZeRO-Offload's one-step delayed update; --cpu_offload all
                alone equals fp32 to fp32 rounding, tested)
    adamw4bit, adamw_fp8  --optimizer adamw4bit | adamw_fp8 (torchao's 4-bit and float8 moments)
    adafactor   --optimizer adafactor --lr 1e-2 (torch's Adafactor at its documented default: lr is its maximum
                relative step size, so the reference's 1e-4 does not carry over)

``--modes`` picks some (fp32 and fp32_seed1 always run: they are the reference and the noise).

The verdict (``quality_curves``): a mode is "within run-to-run noise" when the mean loss of its last ``--window``
steps is within 2 standard errors of the difference between two runs' window means (batch means of fp32 and
fp32_seed1), and its "shift" is the paired per-step difference to fp32 with its standard error. Writes ``--json``
(curves every step, window means) and ``--plot`` (the curves, smoothed over 100 steps, in one figure; matplotlib).

Usage: ``PYTHONPATH=. python benchmarks/lowmem_quality.py --work /tmp/q --json $OUT/lowmem_quality.json
--plot $OUT/lowmem_quality.png`` (GPU: a few minutes; CPU with --steps 20 --base_steps 20 checks the script).
"""

from __future__ import annotations

from pathlib import Path

from quality_curves import parser, report, run_modes

MODES = {
    "fp32": [],
    "fp32_seed1": ["--seed", "1"],
    "adamw8bit": ["--optimizer", "adamw8bit"],
    "bf16": ["--master_weights", "bf16"],
    "bf16_8bit": ["--optimizer", "adamw8bit", "--master_weights", "bf16"],
    "sr_8bit_fused": ["--optimizer", "adamw8bit", "--master_weights", "bf16_sr", "--fused_backward_pass"],
    "sr_8bit": ["--optimizer", "adamw8bit", "--master_weights", "bf16_sr"],
    "fp32_library": ["--fused_optimizer", "off"],
    "delayed": ["--cpu_offload", "all", "--delayed_update"],
    "adamw4bit": ["--optimizer", "adamw4bit"],
    "adamw_fp8": ["--optimizer", "adamw_fp8"],
    "adafactor": ["--optimizer", "adafactor", "--lr", "1e-2"],
}


def main() -> None:
    ap = parser(__doc__, "/tmp/ditforge-lowmem-quality", MODES)
    ap.add_argument("--base_steps", type=int, default=1000)
    args = ap.parse_args()
    work = Path(args.work)
    common = ["--data", "digits", "--model", "DiT-T/2", "--batch_size", "64", "--sample_every", "0",
              "--log_every", "1", "--device", args.device]
    base = work / "base"  # trained once, like a mode
    run_modes({"base": ["--max_steps", str(args.base_steps), "--lr", "1e-3"]}, {"base"}, work, args.window,
              args.base_steps, *common)
    curves = run_modes(MODES, {"fp32", "fp32_seed1", *args.modes.split(",")}, work, args.window, args.steps, *common,
                       "--init_from", str(base), "--max_steps", str(args.steps), "--lr", "1e-4",
                       "--mixed_precision", "bf16", "--ema_decay", "0", jobs=args.jobs)
    report(curves, "fp32", "fp32_seed1", args.window, "DiT-T/2 digits fine-tune, lr 1e-4, bf16 compute", args.json,
           args.plot, base_steps=args.base_steps, steps=args.steps)


if __name__ == "__main__":
    main()
