"""Does the compiled VAE decoder gain from channels_last or ``cudnn.benchmark``? GPU time of ``VAE.decode``
(``ditforge.encoders.vae``) for Stable Diffusion's VAE architecture (random weights, bf16) at batch 8, 32 x 32
latents (256px): compiled as ``ditforge sample --compile`` does (NCHW), the same with the decoder and its input in
channels_last, and both again with ``torch.backends.cudnn.benchmark`` (cuDNN times its convolution algorithms at
the first call of each shape). In the batch-8 sampling benchmark decoding takes 19-21 ms of the call. Median of 10
calls after 3 warm-ups, CUDA events; the largest difference of each output from the first row's is printed.
H100, 2026-11-27: 18.3, 17.9, 18.1 and 18.0 ms: neither pays (``results/sampling/vae_decode_h100.json``).

    PYTHONPATH=. python benchmarks/vae_decode.py --out benchmarks/results/sampling/vae_decode.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from datetime import datetime
from pathlib import Path

import torch

from ditforge.encoders.vae import load_vae
from sampling import sd_vae
from timing import cuda_median_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    args = p.parse_args()
    folder = sd_vae(Path(tempfile.mkdtemp()) / "vae")
    z = torch.randn(8, 4, 32, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    rows, outs = [], {}
    for layout, benchmark in (("nchw", False), ("channels_last", False), ("nchw", True), ("channels_last", True)):
        torch.backends.cudnn.benchmark = benchmark  # cuDNN times its convolution algorithms at each new shape
        torch._dynamo.reset()
        vae = load_vae(folder, "cuda", torch.bfloat16)
        latents = z
        if layout == "channels_last":
            vae.model.to(memory_format=torch.channels_last)
            latents = z.contiguous(memory_format=torch.channels_last)
        vae.compile()
        outs[layout, benchmark] = vae.decode(latents).float()
        ms = cuda_median_ms(lambda: vae.decode(latents), steps=10, warmup=3)
        rows.append(dict(layout=layout, cudnn_benchmark=benchmark, ms=ms))
        print(f"| {layout} | cudnn.benchmark={benchmark} | {ms:.2f} ms |", flush=True)
    first = outs["nchw", False]
    diff = max((o - first).abs().max().item() for o in outs.values())
    print(f"largest difference from the first row's output: {diff:.3g} (pixels in [-1, 1])")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                           torch=torch.__version__, rows=rows, max_abs_diff=diff), f, indent=1)


if __name__ == "__main__":
    main()
