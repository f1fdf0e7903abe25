"""Video sampling (issue 43): ``ditforge sample``'s loop (``sample.video.VideoSampler``) on Wan2.1-T2V-1.3B against the
unchanged anchor ``../shared/anchors/wan_sampling.py`` (diffusers' ``WanPipeline``, eager and with
``compile_repeated_blocks``), run first in the same job; with ``--model cog5b`` on CogVideoX-5B (``hv13b``:
HunyuanVideo) against diffusers' ``CogVideoXPipeline`` (``HunyuanVideoPipeline``) timed in this script the anchor's
way (rows ``diffusers`` and ``diffusers_compiled``: ``compile_repeated_blocks(fullgraph=True)``), for want of an
anchor of its own; ``vace13``: Wan2.1-VACE-1.3B with one reference image against ``WanVACEPipeline`` the same way.

    PYTHONPATH=. python benchmarks/sample_wan.py --rows eager,compiled,fp8 --steps 10 \
        --anchor .anchors/wan_sampling.py --out r.json                                   # one GPU
    PYTHONPATH=. torchrun --nproc_per_node 4 benchmarks/sample_wan.py --rows cfg2_ulysses2,ulysses4 --out r4.json

Workload (the anchor's): Wan2.1-T2V-1.3B's transformer config (30 layers, 12 heads of 128, FFN 8960) with random
weights, ``AutoencoderKLWan``'s default config in float32, UniPC with flow shift 3, guidance 5, 480 x 832, 81 frames
(latents 16 x 21 x 60 x 104: 32,760 tokens), random 512 x 4096 caption states for the prompt and the negative
prompt (the text encoder is outside the timed call in every system compared), the VAE decode and the conversion to
uint8 frames included. ``cog5b``: CogVideoX-5B's transformer config (``finetune.COG5B``: 42 layers, 48 heads of 64,
3-D rotary positions), ``AutoencoderKLCogVideoX``'s default config (``scaling_factor`` 0.7) in bf16, its
``CogVideoXDPMScheduler``, guidance 6, 480 x 720, 49 frames (latents 16 x 13 x 60 x 90: 17,550 video tokens beside 226
text tokens), random 226 x 4096 caption states. ``hv13b``: HunyuanVideo's transformer config (the class default, 12.8B),
``AutoencoderKLHunyuanVideo``'s default config in bf16 with diffusers' tiled decode, flow Euler at shift 7, its
guidance 6 embedded (one pass a step), 480 x 848, 61 frames (latents 16 x 16 x 60 x 106: 25,440 video tokens beside
256 text tokens, a prompt of 40 of them). ``vace13``: ``wan13``'s with Wan2.1-VACE-1.3B's transformer (``vace_layers``
0, 2, ..., 28) and one 240 x 416 random reference image (22 latent frames, one of them the reference's: 34,320
tokens), its control latents encoded inside each timed call as the pipeline's call does. One call = ``denoise`` + ``decode`` + ``to_uint8``; the median of
``--repeat`` timed calls after one warm-up call (which compiles), wall clock between synchronisations; ``loop_s`` /
``decode_s``: the same call's two parts. Rows (``ROWS``): eager and compiled bf16 (exact), fp8 linears, 8-bit
self-attention (``qattn``: ``--quantized_attention``; and with fp8 linears), First Block Cache, TaylorSeer
(``ts2``: ``--taylorseer_cache 2``; and with fp8 and 8-bit attention, interval 2 or 3), fp32 (the reference
for PSNR / SSIM of the uint8 frames), and under torchrun CFG-parallel and context parallelism (Ulysses), and
CFG-parallel with the weights sharded (``cfg2_fsdp``: ``--plugin fsdp``; the peak memory shows the saving). Every row
rebuilds the transformer from the same seed on its GPU, so every row draws the same video up to its arithmetic.
``student`` / ``student_fp8_qattn``: a 4-step (``--student_steps``) student's clip without guidance
(``--sampler student``; random weights, so the timing, not the picture, is the point): against the anchor at
``--steps 50`` its ``x_compiled_anchor`` is issue 65's end-to-end ratio (target >= 12x), ``decode_s`` / ``s_per_call``
the VAE's share (the caption states are given, so text encoding is outside every timed call, the anchor's too).
``--steps`` sets our rows' denoising steps and the anchor's; TINY=1: the anchor's tiny config on the CPU (a check of
the script).

``--model animate14 --rows pipeline``: character animation sampling (issue 64, item 3), ``WanAnimatePipeline``'s call,
which is what ``ditforge sample`` runs for a Wan2.2-Animate folder (``models/adapters/wan_animate.py`` says why), on
one GPU with random weights. Workload: ``WanAnimateTransformer3DModel``'s default config (diffusers' class defaults,
the 14B shape: 40 layers, 40 heads of 128, FFN 13,824, CLIP states 1,280 wide, motion encoder at 512 px) in bf16;
``AutoencoderKLWan``'s default config in float32; a ``CLIPVisionModel`` of ViT-H/14's shape (32 layers, 1,280 wide,
224 px) in bf16; UniPC with flow shift 5 (diffusers' model card's); the pipeline's defaults: 20 steps (pass ``--steps
20``), guidance 1 (no unconditional pass), ``segment_frame_length`` 77 with 1 conditioning frame; 480 x 832, a pose
and a face video of 77 frames (one segment), random 512 x 4096 caption states (the text encoder is outside the timed
call). One call includes the image encoder, the VAE encodes and the decode; the median of ``--repeat`` timed calls
after one warm-up call of ``--warmup_steps`` 2 (one 20-step call of 14B at 32,760 tokens is minutes),
CUDA-synchronised wall clock; the peak memory of the timed calls; the row keeps its own fields (``call_s``,
``step_s``, ``peak_gib``). No anchor: ditforge's path is this call itself. Its LoRA rows: ``finetune.py --model
animate14``.

    PYTHONPATH=. python benchmarks/sample_wan.py --model animate14 --rows pipeline --steps 20 --repeat 1 \
        --out animate.json                                                               # one H200
    TINY=1 PYTHONPATH=. python benchmarks/sample_wan.py --model animate14 --rows pipeline --steps 2 --repeat 1 \
        --out /tmp/a.json                                                                # the tiny config on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from ditforge.data.images import to_uint8
from ditforge.models import is_block
from ditforge.models.adapters.pipeline import Pretrained
from ditforge.models.adapters.wan import WanDenoiser
from ditforge.parallel.mesh import init_distributed
from ditforge.sample.load import SampleConfig
from ditforge.sample.loops import use_sampling_gemm_settings
from ditforge.sample.video import VideoSampler
from timing import psnr, ssim

TINY = os.environ.get("TINY") == "1"
# row -> SampleConfig settings (and the processes it needs: sequence_parallel_size x (2 with cfg_parallel))
ROWS = {
    "eager": dict(),
    "compiled": dict(compile="default"),
    "fp8": dict(compile="default", mixed_precision="fp8"),
    "qattn": dict(compile="default", quantized_attention=True),
    "fp8_qattn": dict(compile="default", mixed_precision="fp8", quantized_attention=True),
    "fbc05": dict(compile="default", first_block_cache=0.05),
    "fbc10": dict(compile="default", first_block_cache=0.10),
    "fp8_fbc05": dict(compile="default", mixed_precision="fp8", first_block_cache=0.05),
    "fp8_fbc10": dict(compile="default", mixed_precision="fp8", first_block_cache=0.10),
    "ts2": dict(compile="default", taylorseer_cache=2),
    "fp8_qattn_ts2": dict(compile="default", mixed_precision="fp8", quantized_attention=True, taylorseer_cache=2),
    "fp8_qattn_ts3": dict(compile="default", mixed_precision="fp8", quantized_attention=True, taylorseer_cache=3),
    "fp8_ts2": dict(compile="default", mixed_precision="fp8", taylorseer_cache=2),  # CogVideoX: no 8-bit attention
    # exact, FlashAttention-4 where faster (--enable_flashattn) and the VAE decode in bf16, compiled
    "fa4": dict(compile="default", enable_flashattn=True),
    "fa4_vae16": dict(compile="default", enable_flashattn=True, vae_dtype="bfloat16"),
    "fp8_qattn_vae16": dict(compile="default", mixed_precision="fp8", quantized_attention=True, vae_dtype="bfloat16"),
    "fp8_qattn_ts3_vae16": dict(compile="default", mixed_precision="fp8", quantized_attention=True, taylorseer_cache=3,
                                vae_dtype="bfloat16"),
    "fp32": dict(mixed_precision="fp32"),
    # a distilled student's clip (--sampler student: --student_steps steps, no guidance), every speed-up on
    "student": dict(compile="default", sampler="student"),
    "student_fp8_qattn": dict(compile="default", mixed_precision="fp8", quantized_attention=True, sampler="student"),
    "student_fastest": dict(compile="default", mixed_precision="fp8", quantized_attention=True, vae_dtype="bfloat16",
                            sampler="student"),
    "cfg2": dict(compile="default", cfg_parallel=True),
    "ulysses2": dict(compile="default", sequence_parallel_size=2),
    "ulysses4": dict(compile="default", sequence_parallel_size=4),
    "cfg2_ulysses2": dict(compile="default", cfg_parallel=True, sequence_parallel_size=2),
    "cfg2_fp8": dict(compile="default", cfg_parallel=True, mixed_precision="fp8"),
    "cfg2_fsdp": dict(compile="default", cfg_parallel=True, plugin="fsdp"),
    "diffusers": dict(),  # the pipeline's own call (bf16 transformer), eager
    "diffusers_compiled": dict(),  # ... each repeated block compiled (fullgraph), as the Wan anchor
    "pipeline": dict(),  # --model animate14's one row: WanAnimatePipeline's call, ditforge's path for that family
}
# the model's workload: frame size and count, guidance, caption states (tokens x width)
MODELS = {"wan13": dict(height=480, width=832, frames=81, guidance=5.0, text=(512, 4096)),
          "cog5b": dict(height=480, width=720, frames=49, guidance=6.0, text=(226, 4096)),
          "hv13b": dict(height=480, width=848, frames=61, guidance=6.0, text=(256, 4096), pooled=768, prompt=40),
          "vace13": dict(height=480, width=832, frames=81, guidance=5.0, text=(512, 4096), references=1),
          "animate14": dict(height=480, width=832, frames=77, guidance=1.0, text=(512, 4096))}
if TINY:
    MODELS = {"wan13": dict(height=32, width=32, frames=5, guidance=5.0, text=(512, 64)),
              "cog5b": dict(height=32, width=32, frames=9, guidance=6.0, text=(226, 32)),
              "hv13b": dict(height=32, width=32, frames=5, guidance=6.0, text=(256, 16), pooled=8, prompt=7),
              "vace13": dict(height=32, width=32, frames=5, guidance=5.0, text=(512, 64), references=1),
              "animate14": dict(height=16, width=16, frames=5, guidance=1.0, text=(512, 4096))}


def build_cog_pipe(device: torch.device, transformer_device: torch.device):
    """CogVideoX-5B's parts (``finetune.COG5B``; TINY: the tests' tiny CogVideoX), random weights drawn as
    ``build_pipe`` draws Wan's, the default ``AutoencoderKLCogVideoX`` (``scaling_factor`` 0.7, bf16 on a GPU) and the
    5B's ``CogVideoXDPMScheduler``; no text encoder."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel
    from finetune import COG5B, COG5B_SCHEDULER

    from ditforge.models.adapters.cogvideox import CogVideoXDenoiser

    torch.manual_seed(0)
    with torch.device(device):
        tr = CogVideoXTransformer3DModel(**(dict(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                                 out_channels=4, time_embed_dim=8, text_embed_dim=32, num_layers=2,
                                                 sample_width=4, sample_height=4, sample_frames=9, patch_size=2,
                                                 max_text_seq_length=226, use_rotary_positional_embeddings=True)
                                            if TINY else COG5B))
    tr.to(transformer_device)
    with torch.device(device):
        vae = (AutoencoderKLCogVideoX(down_block_types=("CogVideoXDownBlock3D",) * 4, block_out_channels=(8,) * 4,
                                      up_block_types=("CogVideoXUpBlock3D",) * 4, latent_channels=4, layers_per_block=1,
                                      norm_num_groups=2) if TINY else AutoencoderKLCogVideoX(scaling_factor=0.7))
    if device.type == "cuda":  # bf16, as CogVideoX's pipelines run whole (its pipeline decodes in the latents' dtype)
        vae.to(torch.bfloat16)
    sched = CogVideoXDPMScheduler(**COG5B_SCHEDULER)
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=vae.eval(), scheduler=sched, transformer=tr.eval())
    return Pretrained(Path("-"), "CogVideoXPipeline", pipe, CogVideoXDenoiser(tr, 8), dict(sched.config))


def build_hv_pipe(device: torch.device, transformer_device: torch.device):
    """HunyuanVideo's parts: ``HunyuanVideoTransformer3DModel``'s default config (the released model's: 20 double- and
    40 single-stream blocks, 24 heads of 128, 12.8B; TINY: the tests' tiny one), random weights drawn as
    ``build_pipe`` draws Wan's, the default ``AutoencoderKLHunyuanVideo`` (bf16 on a GPU, tiled as diffusers'
    HunyuanVideo docs run it: ``enable_tiling``) and ``FlowMatchEulerDiscreteScheduler(shift=7.0)``; no text
    encoders."""
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
                           HunyuanVideoTransformer3DModel)

    from ditforge.models.adapters.hunyuan import HunyuanVideoDenoiser

    torch.manual_seed(0)
    with torch.device(device):
        tr = HunyuanVideoTransformer3DModel(**(dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16,
            pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)) if TINY else {}))
    tr.to(transformer_device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with torch.device(device):
        vae = (AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                         norm_num_groups=4) if TINY else AutoencoderKLHunyuanVideo())
    if device.type == "cuda":
        vae.to(torch.bfloat16).enable_tiling()
    sched = FlowMatchEulerDiscreteScheduler(shift=7.0)
    pipe = HunyuanVideoPipeline(tokenizer=None, text_encoder=None, tokenizer_2=None, text_encoder_2=None,
                                vae=vae.eval(), scheduler=sched, transformer=tr.eval())
    return Pretrained(Path("-"), "HunyuanVideoPipeline", pipe, HunyuanVideoDenoiser(tr, 8), dict(sched.config))


def conditions(model: str, device: torch.device) -> tuple[dict, dict | None, dict]:
    """(the prompt's conditioning, the negative prompt's or None, the pipeline call's arguments for both): random
    caption states of the model's shape; HunyuanVideo's with a prompt of ``prompt`` of its 256 tokens (the mask), a
    CLIP pooled vector and the guidance embedded (guidance-distilled: one pass, no negative)."""
    w = MODELS[model]
    g = torch.Generator(device).manual_seed(0)
    cond = {"encoder_hidden_states": torch.randn(1, *w["text"], generator=g, device=device)}
    if model != "hv13b":
        uncond = {"encoder_hidden_states": torch.randn(1, *w["text"], generator=g, device=device)}
        return cond, uncond, dict(prompt_embeds=cond["encoder_hidden_states"],
                                  negative_prompt_embeds=uncond["encoder_hidden_states"])
    cond["encoder_attention_mask"] = (torch.arange(w["text"][0], device=device) < w["prompt"])[None]
    cond["pooled_projections"] = torch.randn(1, w["pooled"], generator=g, device=device)
    call = dict(prompt_embeds=cond["encoder_hidden_states"], prompt_attention_mask=cond["encoder_attention_mask"],
                pooled_prompt_embeds=cond["pooled_projections"])
    cond["guidance"] = torch.tensor([w["guidance"] * 1000.0], device=device)
    return cond, None, call


def build_pipe(device: torch.device, transformer_device: torch.device):
    """The anchor's ``WanPipeline`` parts: a fresh transformer (seed 0, drawn on ``device``, so every row has the same
    weights; fp32, then on ``transformer_device``: the host for ``--plugin fsdp``, which shards it from there, as
    the CLI loads it), the default VAE (fp32 on ``device``), UniPC with flow shift 3."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        if TINY:
            tr = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
                                       text_dim=64, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32)
        else:
            tr = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, in_channels=16,
                                       out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                                       cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    tr.to(transformer_device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with torch.device(device):
        vae = (AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True]) if TINY else AutoencoderKLWan())
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                    flow_shift=3.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae.eval(), scheduler=sched, transformer=tr.eval())
    return Pretrained(Path("-"), "WanPipeline", pipe, WanDenoiser(tr, 8), dict(sched.config))


def build_vace_pipe(device: torch.device, transformer_device: torch.device):
    """Wan2.1-VACE-1.3B's parts: ``build_pipe``'s with a ``WanVACETransformer3DModel`` of the released config
    (Wan-1.3B's dims, ``vace_layers`` 0, 2, ..., 28, ``vace_in_channels`` 96; TINY: 2 layers, VACE layer 0) drawn
    the same way, in a ``WanVACEPipeline``."""
    from diffusers import WanVACEPipeline, WanVACETransformer3DModel

    from ditforge.models.adapters.wan_vace import WanVACEDenoiser

    wan = build_pipe(device, transformer_device).pipe
    config = {k: v for k, v in wan.transformer.config.items() if not k.startswith("_") and k not in (
        "image_dim", "added_kv_proj_dim", "pos_embed_seq_len")}
    del wan.transformer
    torch.manual_seed(0)
    with torch.device(device):
        tr = WanVACETransformer3DModel(**config, vace_layers=[0] if TINY else list(range(0, 30, 2)),
                                       vace_in_channels=96)
    tr.to(transformer_device).eval()
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=wan.vae, scheduler=wan.scheduler, transformer=tr)
    return Pretrained(Path("-"), "WanVACEPipeline", pipe, WanVACEDenoiser(tr, 8), dict(wan.scheduler.config))


def reference_images(model: str) -> list:
    """The workload's reference images (``references`` of them; none for a model without): random RGB images of
    half the frame's sides, seed 0 (the pipeline scales each to fit the frame on a white canvas)."""
    from PIL import Image

    w = MODELS[model]
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (w["height"] // 2, w["width"] // 2, 3), dtype=np.uint8))
            for _ in range(w.get("references", 0))]


def build_animate_pipe(device: torch.device):
    """Wan2.2-Animate-14B's ``WanAnimatePipeline`` with random weights drawn after ``torch.manual_seed(0)``: the
    transformer's class defaults (the 14B shape) in bf16, ``AutoencoderKLWan``'s default config in float32, a
    ``CLIPVisionModel`` of ViT-H/14's shape in bf16, UniPC at flow shift 5 (TINY: a 2-layer, 24-wide model)."""
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


def animate_row(steps: int, repeat: int, warmup_steps: int, device_arg: str) -> dict:
    """``--model animate14``'s row: ``repeat`` timed ``WanAnimatePipeline`` calls of ``steps`` steps (one segment:
    ``segment_frame_length`` = the workload's frames, random pose and face videos and reference image, seed 0)
    after a warm-up call of ``warmup_steps``; call_s / step_s: the median call, wall clock between
    synchronisations; peak_gib: the timed calls' peak (reset after the warm-up)."""
    from PIL import Image

    device = torch.device(device_arg)
    pipe = build_animate_pipe(device)
    w = MODELS["animate14"]
    rng = np.random.default_rng(0)
    face = pipe.transformer.config.motion_encoder_size

    def frames(n, h, w):
        return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]

    inputs = dict(image=frames(1, w["height"], w["width"])[0], pose_video=frames(w["frames"], w["height"], w["width"]),
                  face_video=frames(w["frames"], face, face),
                  prompt_embeds=torch.randn(1, *w["text"], device=device, dtype=pipe.transformer.dtype),
                  height=w["height"], width=w["width"], segment_frame_length=w["frames"], guidance_scale=w["guidance"],
                  output_type="pt")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call(n: int) -> float:
        sync(); start = time.perf_counter()
        with torch.no_grad():
            pipe(**inputs, num_inference_steps=n, generator=torch.Generator(device).manual_seed(0))
        sync()
        return time.perf_counter() - start

    call(warmup_steps)  # kernels chosen, memory pools filled
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [call(steps) for _ in range(max(repeat, 1))]
    row = {"row": "pipeline", "height": w["height"], "width": w["width"], "frames": w["frames"], "steps": steps,
           "call_s": statistics.median(times), "step_s": statistics.median(times) / steps,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    print(json.dumps(row), flush=True)
    return row


BUILDERS = {"wan13": build_pipe, "cog5b": build_cog_pipe, "hv13b": build_hv_pipe, "vace13": build_vace_pipe}


def run_row(model: str, name: str, steps: int, repeat: int, warmup_steps: int, device_arg: str, profile: int = 0,
            student_steps: int = 4) -> tuple[dict, np.ndarray | None]:
    """One row: ``repeat`` timed calls of ``steps`` steps after a warm-up call of ``warmup_steps`` (compiling happens
    there whatever the step count); ``repeat`` 0: one call, untimed (a reference's frames). ``profile`` > 0: then
    one 2-step loop under torch.profiler: its ``profile`` largest kernels, GPU time by kind, and the self-attention
    kernels' rate (4 L^2 D FLOPs a layer and row)."""
    settings = ROWS[name]
    d = init_distributed(device_arg, settings.get("sequence_parallel_size", 1))
    device = d.device
    need = settings.get("sequence_parallel_size", 1) * (2 if settings.get("cfg_parallel") else 1)
    if need != d.world_size:
        raise SystemExit(f"row {name} needs {need} processes, this run has {d.world_size}")
    w = MODELS[model]
    pre = BUILDERS[model](device, torch.device("cpu") if settings.get("plugin") else device)
    cond, uncond, call_args = conditions(model, device)
    if settings.get("sampler") == "student":  # its own few steps, no unconditional pass
        uncond, steps, warmup_steps = None, student_steps, student_steps
    channels = pre.denoiser.in_channels
    shape = (1, channels, (w["frames"] - 1) // 4 + 1, w["height"] // 8, w["width"] // 8)
    refs = reference_images(model)
    if refs:  # the pipeline's call takes them; ours encodes them in the timed call too (encode_control)
        call_args["reference_images"] = refs
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if name.startswith("diffusers"):  # the pipeline's own call: no loop / decode split
        pipe = pre.pipe
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        pipe.transformer.to(dtype)
        call_args = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                     for k, v in call_args.items()}  # the encoder's
        if name == "diffusers_compiled" and pipe.transformer._repeated_blocks:
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
        elif name == "diffusers_compiled":  # CogVideoX's class names no repeated blocks (diffusers 0.42.1): each
            for block in pipe.transformer.modules():  # block compiled, as compile_repeated_blocks compiles them
                if is_block(block, pre.denoiser.block_classes):
                    block.compile(fullgraph=True)
        sampler = None

        def call(n=steps):
            sync(); t0 = time.perf_counter()
            video = pipe(**call_args, height=w["height"], width=w["width"], num_frames=w["frames"],
                num_inference_steps=n, guidance_scale=w["guidance"], generator=torch.Generator(device).manual_seed(1),
                output_type="pt").frames  # (1, T, 3, H, W) in [0, 1] on the GPU
            frames = to_uint8(video.permute(0, 2, 1, 3, 4) * 2 - 1)[0]  # the conversion ditforge's rows time too
            sync()
            return frames, None, None, time.perf_counter() - t0
    else:
        sampler = VideoSampler(pre, pre.denoiser, d, SampleConfig(ckpt="-", **settings))

        def call(n=steps):
            sync(); t0 = time.perf_counter()
            control, r = None, 0
            if refs:  # the R reference latent frames lead the latents, dropped before decoding
                control, r = pre.denoiser.encode_control(pre.pipe, refs, None, None, w["height"], w["width"],
                                                         w["frames"], device)
            latents = sampler.denoise(cond, uncond, (*shape[:2], shape[2] + r, *shape[3:]), 1, n, w["guidance"],
                                      control)[:, :, r:]
            sync(); t1 = time.perf_counter()
            pixels = sampler.decode(latents)  # under torchrun every process decodes its share of the tiles
            frames = to_uint8(pixels)[0] if d.is_main else None
            sync(); t2 = time.perf_counter()
            d.barrier()
            return frames, t1 - t0, t2 - t1, time.perf_counter() - t0
    resident = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None  # weights held, VAE included

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if repeat:
        call(warmup_steps)  # warm-up: compiles
    times = [call() for _ in range(max(repeat, 1))]
    frames = times[-1][0]
    total = statistics.median(t[3] for t in times)
    split = sampler is not None  # the pipeline's own call has no loop / decode split
    row = dict(row=name, model=model, settings=settings, processes=d.world_size, steps=steps,
               s_per_call=round(total, 3), s_per_step=round(total / steps, 4),
               loop_s=round(statistics.median(t[1] for t in times), 3) if split else None,
               decode_s=round(statistics.median(t[2] for t in times), 3) if split else None)
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["resident_gib"] = round(resident, 2)
    if settings.get("enable_flashattn"):  # which exact kernel each attention shape took, and both times
        from ditforge.ops.flash4 import measured_choices

        row["exact_attention"] = measured_choices()
    if profile and device.type == "cuda" and split:
        row["profile"] = profile_loop(sampler, lambda: sampler.denoise(cond, uncond, shape, 1, 2, w["guidance"]),
                                      shape, profile, name)
    del sampler, pre
    torch._dynamo.reset()  # compiled code holds the row's weights: the next row's memory would count them
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, frames


def profile_loop(sampler: VideoSampler, loop, shape: tuple[int, ...], top: int, name: str) -> dict:
    """GPU kernel time of ``loop`` (2 steps) by kind (``timing.kernel_kind``), and the attention kernels' TFLOPS
    counting self-attention alone (cross-attention over 512 text tokens is under 2% of it)."""
    from timing import cuda_kernels, kernel_kind, print_top_kernels

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        loop()
        torch.cuda.synchronize()
    print_top_kernels(prof, top, f"{name}: 2 steps")
    by_kind: dict[str, float] = {}
    for ms, kernel in cuda_kernels(prof):
        by_kind[kernel_kind(kernel)] = by_kind.get(kernel_kind(kernel), 0.0) + ms
    config = sampler.transformer.config
    tokens = shape[2] * (shape[3] // 2) * (shape[4] // 2)
    rows = 2 if sampler.cfg_group is None else 1  # the guided batch on this process
    flops = 2 * rows * config.num_layers * 4 * tokens**2 * config.num_attention_heads * config.attention_head_dim
    total = sum(by_kind.values())
    out = {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    out["total_ms"] = round(total, 1)
    out["attention_tflops"] = round(flops / (by_kind.get("attention", 0) / 1e3) / 1e12, 1) if "attention" in by_kind \
        else None
    print(f"{name}: GPU ms by kind {out}", flush=True)
    return out


def run_anchor(anchor: str, steps: int, out: Path) -> dict:
    """The anchor in its own process (its own defaults), its JSON read back."""
    env = dict(os.environ, OUT=str(out.parent))
    w = MODELS["wan13"]
    subprocess.run([sys.executable, anchor, str(steps), str(w["frames"]), str(w["height"]), str(w["width"])],
                   check=True, env=env)
    return json.loads((out.parent / "wan_sampling.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="eager,compiled,fp8", help=f"which of {', '.join(ROWS)}")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeat", type=int, default=2, help="timed calls a row (0: one untimed call, for frames only)")
    p.add_argument("--untimed", default="fp32", help="rows drawn once, untimed (references for PSNR / SSIM)")
    p.add_argument("--warmup_steps", type=int, default=2, help="steps of the warm-up call (it compiles)")
    p.add_argument("--reference", default=None, help="the row whose frames the others' PSNR / SSIM are against "
                   "(default: fp32 where run, else the first row)")
    p.add_argument("--model", default="wan13", choices=tuple(MODELS),
                   help="wan13: Wan2.1-T2V-1.3B; cog5b: CogVideoX-5B; hv13b: HunyuanVideo; vace13: "
                   "Wan2.1-VACE-1.3B with one reference image; animate14: Wan2.2-Animate-14B (--rows pipeline)")
    p.add_argument("--anchor", help="../shared/anchors/wan_sampling.py, run first with --steps (wan13)")
    p.add_argument("--student_steps", type=int, default=4, help="the student rows' steps (their warm-up too)")
    p.add_argument("--device", default="cpu" if TINY else "cuda")
    p.add_argument("--profile", type=int, default=0, help="profile 2 steps of each row after its timing; print its N "
                   "largest kernels")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    names = args.rows.split(",")
    if (args.model == "animate14") != (names == ["pipeline"]):
        raise SystemExit("--rows pipeline (WanAnimatePipeline's call) is the one row of --model animate14")
    import diffusers

    result = dict(date=datetime.now().isoformat(timespec="minutes"), torch=torch.__version__,
                  diffusers=diffusers.__version__, model=args.model, workload=MODELS[args.model],
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", rows=[])
    if args.model == "animate14":  # diffusers' own call at torch's default GEMM settings; no anchor, no PSNR
        result["rows"].append(animate_row(args.steps, args.repeat, args.warmup_steps, args.device))
        out.write_text(json.dumps(result, indent=1) + "\n")
        return
    if args.device == "cuda":
        use_sampling_gemm_settings(torch.device("cuda"))
    if args.anchor and rank == 0:
        result["anchor"] = run_anchor(args.anchor, args.steps, out)
    frames = {}
    for name in names:
        repeat = 0 if name in args.untimed.split(",") else args.repeat
        row, f = run_row(args.model, name, args.steps, repeat, args.warmup_steps, args.device, args.profile,
                         args.student_steps)
        if rank == 0:
            frames[name] = f
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    if rank == 0:
        # the compiled baseline: the anchor's (Wan), else diffusers' pipeline compiled in this job (CogVideoX)
        anchor = result.get("anchor", {}).get("compiled") or next(
            (r for r in result["rows"] if r["row"] == "diffusers_compiled"), None)
        ref = args.reference or ("fp32" if "fp32" in frames else names[0])
        for row in result["rows"]:
            if anchor:
                row["x_compiled_anchor"] = round(anchor["s_per_call"] / row["s_per_call"], 3)
            if row["row"] != ref and ROWS[row["row"]].get("sampler") == ROWS[ref].get("sampler"):  # same recipe
                row[f"psnr_vs_{ref}"] = round(psnr(frames[ref], frames[row["row"]]), 2)
                row[f"ssim_vs_{ref}"] = round(ssim(frames[ref], frames[row["row"]]), 4)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print("| row | processes | s/call | s/step | loop s | decode s | resident / peak GiB | x compiled anchor | "
              f"PSNR / SSIM vs {ref} |")
        for r in result["rows"]:
            print(f"| {r['row']} | {r['processes']} | {r['s_per_call']} | {r['s_per_step']} | {r['loop_s']} | "
                  f"{r['decode_s']} | {r.get('resident_gib', '-')} / {r.get('peak_gib', '-')} | "
                  f"{r.get('x_compiled_anchor', '-')} | "
                  f"{r.get(f'psnr_vs_{ref}', '-')} / {r.get(f'ssim_vs_{ref}', '-')} |")
        if "anchor" in result:
            a = result["anchor"]
            print(f"anchor: eager {a['eager']['s_per_call']} s/call, compiled {a['compiled']['s_per_call']} s/call "
                  f"({args.steps} steps)")
    if torch.distributed.is_initialized():  # the group stays from row to row (init_distributed joins it once)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
