"""Character animation sampling (issue 64, item 3): ``WanAnimatePipeline``'s call, which is what ``ditforge sample``
runs for a Wan2.2-Animate folder (``models/adapters/wan_animate.py`` says why), on one GPU with random weights.

    PYTHONPATH=. python benchmarks/sample_animate.py --out animate.json            # one H200
    TINY=1 PYTHONPATH=. python benchmarks/sample_animate.py --out /tmp/a.json      # the tiny config on the CPU

Workload: ``WanAnimateTransformer3DModel``'s default config (diffusers' class defaults, the 14B shape: 40 layers, 40
heads of 128, FFN 13,824, CLIP states 1,280 wide, motion encoder at 512 px) in bf16; ``AutoencoderKLWan``'s
default config in float32; a ``CLIPVisionModel`` of ViT-H/14's shape (32 layers, 1,280 wide, 224 px) in bf16;
UniPC with flow shift 5 (diffusers' model card's); the pipeline's defaults: 20 steps, guidance 1 (no unconditional
pass), ``segment_frame_length`` 77 with 1 conditioning frame; 480 x 832 (``--height`` / ``--width``), a pose and a
face video of 77 frames (one segment), random 512 x 4096 caption states (the text encoder is outside the timed
call). One call includes the image encoder, the VAE encodes and the decode; the median of ``--repeat`` timed calls
after one warm-up call of 2 steps (one 20-step call of 14B at 32,760 tokens is minutes), CUDA-synchronised wall clock; the peak memory of the timed calls. No anchor: ditforge's
path is this call itself. The LoRA step row is missing: ditforge does not fine-tune this family yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

TINY = os.environ.get("TINY") == "1"


def build_pipe(device: torch.device):
    """The pipeline with random weights drawn after ``torch.manual_seed(0)`` (TINY: a 2-layer, 24-wide model)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanAnimatePipeline, WanAnimateTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    if TINY:
        tr = WanAnimateTransformer3DModel(
            num_attention_heads=2, attention_head_dim=12, text_dim=4096, ffn_dim=32, num_layers=2, image_dim=4,
            rope_max_seq_len=32, motion_encoder_size=16, motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16},
            motion_style_dim=8, motion_dim=4, motion_encoder_dim=8, face_encoder_hidden_dim=8,
            face_encoder_num_heads=2, inject_face_latents_blocks=2)
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
        clip = CLIPVisionConfig(hidden_size=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                                intermediate_size=16, patch_size=1)
    else:
        with torch.device(device):
            tr = WanAnimateTransformer3DModel().to(torch.bfloat16)
        vae = AutoencoderKLWan()
        clip = CLIPVisionConfig(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, image_size=224,
                                intermediate_size=5120, patch_size=14)
    dtype = torch.float32 if TINY else torch.bfloat16
    pipe = WanAnimatePipeline(
        tokenizer=None, text_encoder=None, vae=vae.eval(),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0),
        image_processor=CLIPImageProcessor(crop_size=clip.image_size, size=clip.image_size),
        image_encoder=CLIPVisionModel(clip).eval().to(dtype), transformer=tr.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def main() -> None:
    from PIL import Image

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2 if TINY else 20)
    p.add_argument("--height", type=int, default=16 if TINY else 480)
    p.add_argument("--width", type=int, default=16 if TINY else 832)
    p.add_argument("--frames", type=int, default=5 if TINY else 77, help="pose / face video frames = segment length")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--device", default="cpu" if TINY else "cuda")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device = torch.device(a.device)
    pipe = build_pipe(device)
    rng = np.random.default_rng(0)
    face = pipe.transformer.config.motion_encoder_size

    def frames(n, h, w):
        return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]

    inputs = dict(image=frames(1, a.height, a.width)[0], pose_video=frames(a.frames, a.height, a.width),
                  face_video=frames(a.frames, face, face),
                  prompt_embeds=torch.randn(1, 512, 4096, device=device, dtype=pipe.transformer.dtype),
                  height=a.height, width=a.width, segment_frame_length=a.frames, num_inference_steps=a.steps,
                  output_type="pt")

    def call(steps: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            pipe(**{**inputs, "num_inference_steps": steps}, generator=torch.Generator(device).manual_seed(0))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    call(2)  # warm-up: kernels chosen, memory pools filled; 2 steps keep the job within the pipeline's 20
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [call(a.steps) for _ in range(a.repeat)]
    row = {"row": "pipeline", "height": a.height, "width": a.width, "frames": a.frames, "steps": a.steps,
           "call_s": statistics.median(times), "step_s": statistics.median(times) / a.steps,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    print(f"{'row':10} {'HxWxT':>12} {'steps':>5} {'call_s':>8} {'step_s':>7} {'peak_gib':>8}")
    print(f"{row['row']:10} {f'{a.height}x{a.width}x{a.frames}':>12} {a.steps:>5} {row['call_s']:8.2f} "
          f"{row['step_s']:7.3f} {row['peak_gib'] if row['peak_gib'] is None else round(row['peak_gib'], 1)!s:>8}")
    from ditforge.atomic import atomic_path

    with atomic_path(a.out) as tmp:
        with open(tmp, "w") as f:
            json.dump({"rows": [row], "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}, f)


if __name__ == "__main__":
    main()
