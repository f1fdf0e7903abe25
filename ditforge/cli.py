"""The ``ditforge`` command: the only place that parses argv.

User errors (``UserError``) print one line on stderr and exit with code 2, a run stopped by an accident
(``RunError``: divergence, a full disk) one line and code 1; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing

from ditforge.config.load import build_config
from ditforge.config.sections import (COMPILE_MODES, SAMPLING_PRECISIONS, SEQUENCE_PARALLEL_TYPES, VAE_DTYPES,
                                      BenchConfig, DataConfig, DistillConfig, ModelConfig, ParallelConfig, TrainConfig)
from ditforge.errors import RunError, UserError


def _add_config_flags(parser: argparse.ArgumentParser, classes: tuple = (ModelConfig, DataConfig, TrainConfig,
                                                                        ParallelConfig),
                      only: tuple[str, ...] | None = None) -> None:
    """One flag per config field (flat names, as OpenDiT's), help text from the field's metadata; with ``only``,
    just the fields of those names.

    Defaults are suppressed so that only flags given on the command line override the config file.
    """
    for cls in classes:
        group = parser.add_argument_group(cls.__name__.removesuffix("Config").lower())
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True) or (only is not None and f.name not in only):
                continue
            kind = hints[f.name]
            if isinstance(kind, types.UnionType):  # X | None
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            default = f.default
            help_text = f"{f.metadata['help']}" + ("" if default is None else f" (default: {default})")
            kwargs = dict(default=argparse.SUPPRESS, help=help_text)
            if kind is bool:
                group.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kwargs)
            elif "const" in f.metadata:  # a bare flag means `const`, e.g. --grad_checkpoint = full
                group.add_argument(f"--{f.name}", nargs="?", const=f.metadata["const"],
                                   choices=f.metadata.get("choices"), **kwargs)
            else:
                group.add_argument(f"--{f.name}", type=kind, choices=f.metadata.get("choices"), **kwargs)


def _labels(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 0,1,2, got {text!r}") from None


def _add_train(sub: argparse._SubParsersAction) -> None:
    """``ditforge train``: a flag per model, data, train and parallel config field, and --config."""
    train = sub.add_parser("train", help="train a DiT (default: a small DiT on the built-in digits, on the CPU)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    train.add_argument("--config", default=argparse.SUPPRESS, help="YAML file of settings (flags override it)")
    _add_config_flags(train)


def _add_sample(sub: argparse._SubParsersAction) -> None:
    """``ditforge sample``: checkpoint, conditioning, sampler and output flags."""
    s = sub.add_parser("sample", help="draw samples from a checkpoint: a PNG grid (image models) or an MP4 and a "
                       "GIF per prompt or label (video models)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--ckpt", required=True, help="run folder (newest checkpoint), checkpoint folder, "
                   ".safetensors file, an official DiT .pt state dict, or a local diffusers pipeline folder of a "
                   "family ditforge adapts (the pipelines of ditforge.models.adapters; an unknown one is refused "
                   "with their list)")
    s.add_argument("--model", help="model name, overriding the checkpoint's (e.g. DiT-XL/2)")
    s.add_argument("--image_size", type=int, help="image (frame) side in pixels, overriding the checkpoint's (the "
                   "model's input is this / the VAE's downsample factor)")
    s.add_argument("--num_frames", type=int, help="video models: frames to generate (latent frames; the VAE "
                   "decodes frame by frame), overriding the checkpoint's")
    s.add_argument("--prompt", action="append", help="text-conditioned models: a prompt; repeat the flag for "
                   "more (one sample each)")
    s.add_argument("--prompt_file", help="text-conditioned models: a UTF-8 file of prompts, one per non-empty "
                   "line (after any --prompt); streams them in batches into the --out folder (default samples), one "
                   "NNN-<prompt>.png (or .mp4 + .gif) per prompt written as soon as done, skipping those that exist "
                   "(re-run to resume); --out FILE.png instead writes one grid (image models)")
    s.add_argument("--image", help="image-to-video pipelines: the first frame to animate (any "
                   "image Pillow reads; resized to the frame size); refused by other models")
    s.add_argument("--reference_image", action="append", help="reference-image pipelines: an image "
                   "of the subject to keep through the video (repeatable; scaled to fit the frame on a white canvas, "
                   "as the pipeline's reference_images); refused by other models")
    s.add_argument("--video", help="reference-image pipelines: a control clip, its first --num_frames frames (the "
                   "pipeline's video; with --mask: masked video-to-video, first/last-frame control)")
    s.add_argument("--mask", help="reference-image pipelines: the mask of --video (a clip of its size, or one image "
                   "for every frame; white = generate, black = keep; default: generate everything)")
    for name, what in (("pose_video", "the pose frames driving the character"),
                       ("face_video", "the face crops driving its expressions"),
                       ("background_video", "--mode replace: the scene whose person is replaced"),
                       ("mask_video", "--mode replace: where the person is (white)")):
        s.add_argument(f"--{name}", help=f"character pipelines driven by videos (--image the character): {what}, "
                       "a video file as the pipeline takes it (preprocessed); refused by other models")
    s.add_argument("--mode", help="character pipelines driven by videos: the pipeline's mode (animate: the "
                   "character moves as the pose video; replace: it takes the place of the person of "
                   "--background_video inside --mask_video)")
    s.add_argument("--segment_frame_length", type=int, help="character pipelines driven by videos: frames drawn "
                   "a segment (4k + 1; default the pipeline's), segments following each other to the pose video's "
                   "length")
    who = s.add_mutually_exclusive_group()
    who.add_argument("--class_labels", type=_labels, help="class-conditional models: labels to draw, e.g. 0,1,2")
    who.add_argument("--num_samples", type=int, default=argparse.SUPPRESS, help="class-conditional models: draw "
                     "N samples, labels cycling over the classes (default: one per class)")
    s.add_argument("--cfg_scale", type=float, help="classifier-free guidance scale (1: no guidance; default 4.0, "
                   "a diffusers pipeline's own; a guidance-distilled model embeds it in one pass, at its pipeline's "
                   "default)")
    s.add_argument("--cfg_scale_2", type=float, help="a pipeline of two experts: the guidance scale of the "
                   "low-noise expert (transformer_2; default: --cfg_scale)")
    s.add_argument("--num_sampling_steps", type=int, help="respaced diffusion steps (2..1000; default 250, a "
                   "diffusers pipeline's own)")
    s.add_argument("--height", type=int, help="video pipelines: frame height in pixels "
                   "(default: the run's --image_size, else the pipeline's)")
    s.add_argument("--width", type=int, help="video pipelines: frame width in pixels "
                   "(default: the run's --image_size, else the pipeline's)")
    s.add_argument("--negative_prompt", help="video pipelines: the prompt guidance steers "
                   "away from (default: the empty prompt, as the pipeline)")
    s.add_argument("--gif", action="store_true", help="video pipelines: also write a GIF beside "
                   "each MP4")
    s.add_argument("--lora", help="with a diffusers pipeline folder as --ckpt: a LoRA file or folder (`ditforge "
                   "export --format lora`, or any LoRA the pipeline's load_lora_weights reads), merged into the "
                   "weights before sampling")
    _add_vae_decode_flags(s)
    s.add_argument("--sampler", default=None, choices=("ddpm", "ddim", "dpm++", "euler", "student"),
                   help="reverse process: "
                   "ddpm (ancestral, learned variance) and ddim are ditforge's, respaced to --num_sampling_steps; "
                   "dpm++ (DPM-Solver++ 2M) and euler are diffusers' schedulers on DiT's schedule (needs diffusers; "
                   "~20 steps suffice); a rectified-flow model (--objective flow) takes euler, ditforge's Euler on "
                   "the velocity; student: a distilled student's steps (x_0 predicted, re-noised afresh; "
                   "docs/distillation.md) (default: ddpm; euler for flow models; a `ditforge distill` run: student, "
                   "its --student_steps, --cfg_scale 1 (a guidance-distilled pipeline's: the scale it embeds); a "
                   "diffusers video pipeline uses its own scheduler, or student: 4 steps (its shifted flow sigmas, "
                   "or a DDPM pipeline's timesteps 999, 749, 499, 249), --cfg_scale 1 (a guidance-distilled one: "
                   "its pipeline's scale, embedded))")
    s.add_argument("--eta", type=float, default=0.0, help="DDIM eta (0: deterministic)")
    s.add_argument("--seed", type=int, default=0, help="seed of the noise")
    s.add_argument("--batch_size", type=int, default=256, help="samples per model batch")
    s.add_argument("--out", default=argparse.SUPPRESS, help="image models: the PNG grid to write (default "
                   "samples.png); video models: the folder for NNN-<prompt or class-K>.mp4 and a .gif preview of "
                   "each (default samples); a video pipeline (MP4s, GIFs with --gif) with one prompt also takes "
                   "a file name, clip.mp4 (or .gif), and writes that file alone")
    s.add_argument("--fps", type=int, help="video models: frames per second of the MP4 and GIF (default 8; a "
                   "diffusers video pipeline: its family's training rate)")
    s.add_argument("--vae", help="local diffusers AutoencoderKL folder to decode latents, overriding the run's "
                   "(needed for an official DiT .pt: e.g. sd-vae-ft-ema); with a diffusers pipeline folder as "
                   "--ckpt: a single file in place of its vae (diffusers' keys, or the original release's: its "
                   ".pth torch pickle, the vae. tensors of a whole checkpoint, ComfyUI's .safetensors)")
    s.add_argument("--transformer", help="with a diffusers pipeline folder as --ckpt: a single-file checkpoint in "
                   "place of its transformer, the folder giving its config (diffusers' keys, the original "
                   "release's shards by their index .json, or ComfyUI's: bf16, fp16, fp8 e4m3, scaled fp8)")
    s.add_argument("--transformer_2", help="with a two-expert pipeline folder as --ckpt: a single file in place of "
                   "its transformer_2 (the low-noise expert), as --transformer")
    s.add_argument("--text_encoder", help="with a diffusers pipeline folder as --ckpt: a single file in place of "
                   "its text_encoder (transformers' keys, as ComfyUI's text encoder files; fp8 and scaled fp8 "
                   "included; or the original release's .pth torch pickle)")
    s.add_argument("--save_npz", help="with --out (or for text models): also write samples (N,H,W,C or "
                   "N,T,H,W,C uint8) and labels (N,) or prompts (N,) to this .npz; without --out (class models): "
                   "evaluation-scale sampling into this .npz only, in the ADM evaluator's layout (arr_0: N,H,W,3 "
                   "uint8; arr_1: labels), split over the torchrun processes, sample i seeded by (--seed, i); "
                   "finished batches are kept in NPZ.parts/ until the end, so a re-run resumes")
    s.add_argument("--no_ema", dest="use_ema", action="store_false", help="use the raw weights, not the EMA")
    s.add_argument("--device", default="auto", help="cuda | cpu | auto")
    s.add_argument("--sequence_parallel_size", type=int, default=1, help="under torchrun: split every sample's "
                   "tokens over this many processes (all of them; half of them with --cfg_parallel)")
    s.add_argument("--sequence_parallel_type", default="auto", choices=SEQUENCE_PARALLEL_TYPES,
                   help="how the split sequence attends (see `ditforge train --help`)")
    s.add_argument("--plugin", choices=("fsdp",), help="video pipelines under torchrun: fsdp shards the "
                   "transformer's weights over all processes (FSDP2, gathered block by block), for a model that does "
                   "not fit one GPU; composes with --cfg_parallel and --sequence_parallel_size")
    _add_sample_speed_flags(s)
    s.add_argument("--guidance_channels", type=int, help="guide only the first K latent channels (the official DiT "
                   "sampler guides 3 of 4); default: all")
    s.add_argument("--cfg_interval", type=int, nargs=2, metavar=("LOW", "HIGH"), help="apply guidance only at "
                   "timesteps LOW..HIGH (of 0..999; Kynkaanniemi et al. 2024), the conditional model alone "
                   "elsewhere (half the compute there)")


def _add_vae_decode_flags(s: argparse.ArgumentParser) -> None:
    """``ditforge sample``'s flags of a video pipeline's VAE decode: tiles, the split over processes, the dtype."""
    s.add_argument("--vae_tile", type=int, metavar="PX", help="video pipelines: decode in "
                   "spatial tiles of PX pixels (a multiple of 32) overlapping by a quarter, diffusers' tiled decode "
                   "(less memory; default: whole frames); the same frames on one process or many")
    s.add_argument("--vae_parallel", choices=("patch", "strips"), help="video pipelines under torchrun: how the "
                   "processes share the VAE decode: patch (default: each decoder call cut into bands of rows, the "
                   "convolutions exchanging their border rows; the frames of one process's decode) or strips (one "
                   "column strip a process, no exchange, blended over 64 pixels: approximate)")
    s.add_argument("--vae_dtype", choices=VAE_DTYPES, help="video pipelines: the dtype of the VAE's weights and "
                   "its decode (bfloat16 halves the bytes every convolution moves; docs/sampling.md gives its speed "
                   "and PSNR against float32; default: the VAE as loaded, float32)")


def _add_sample_speed_flags(parser: argparse.ArgumentParser) -> None:
    """``ditforge sample``'s speed group: precision, compile, attention and adaLN kernels, caching, CFG
    parallelism."""
    fast = parser.add_argument_group("speed", "the fastest measured setting on GPUs: --compile --enable_flashattn "
                                     "(bf16 is the default there); under --compile the fused adaLN kernels gained "
                                     "nothing (inductor fuses the same operations)")
    fast.add_argument("--mixed_precision", default="auto", choices=SAMPLING_PRECISIONS,
                      help="dtype of the model and VAE weights (auto: bf16 on CUDA, fp32 on CPU; a video pipeline's "
                      "VAE: --vae_dtype); fp8: bf16 with the blocks' linear layers as row-wise scaled float8 GEMMs "
                      "(H100-class GPU, Triton; see docs/sampling.md for its speed and quality)")
    fast.add_argument("--compile", nargs="?", const="reduce-overhead", default="none", choices=COMPILE_MODES,
                      help="torch.compile the model with static shapes, and the VAE decoder; the bare flag is "
                      "reduce-overhead: CUDA graphs, the whole loop as one graph for --sampler ddpm / ddim and a flow "
                      "model's euler (without --cfg_interval / --cfg_parallel), else one per model call; the first "
                      "batch and the first decode are slow while they compile; a video pipeline: each "
                      "transformer block and the VAE's decoder compiled, without CUDA graphs")
    fast.add_argument("--enable_flashattn", action="store_true", help="attention through the fastest exact kernel: "
                      "FlashAttention-4 where installed (the fa4 extra) and measured faster at the shape (a video "
                      "pipeline's self-attention too), else SDPA's cuDNN, then Flash, on Hopper/Blackwell with cuDNN > "
                      "9.15; Flash first elsewhere")
    fast.add_argument("--enable_modulate_kernel", action="store_true", help="fused Triton LayerNorm + adaLN "
                      "modulate and gated-residual kernels")
    fast.add_argument("--enable_layernorm_kernel", action="store_true", help="LayerNorm as a Triton kernel")
    fast.add_argument("--pab", action="store_true", help="Pyramid Attention Broadcast (video models): recompute "
                      "spatial / temporal / cross-attention only every 2 / 3 / 5 steps in the middle of the "
                      "schedule (timesteps 100-800, 100-900 for cross); changes the samples (see docs/sampling.md)")
    fast.add_argument("--fora", type=int, metavar="N", help="FORA static caching: recompute every block's attention "
                      "and MLP outputs only every N steps, reusing them in between; changes the samples (see "
                      "docs/sampling.md); not with --pab")
    fast.add_argument("--first_block_cache", type=float, metavar="THRESHOLD", help="video pipelines: "
                      "diffusers' First Block Cache: reuse the other blocks' residual while the first block's "
                      "output changed by less than THRESHOLD (mean relative L1, e.g. 0.05) since the last full "
                      "pass; changes the samples (see docs/sampling.md)")
    fast.add_argument("--taylorseer_cache", type=int, metavar="N", help="video pipelines: diffusers' TaylorSeer cache "
                      "(lite): after 3 full steps a full pass every N steps, the transformer's output forecast to "
                      "first order from the last two in between (N = 2 skips 24 of 50 steps); changes the samples "
                      "(see docs/sampling.md); not with --first_block_cache")
    fast.add_argument("--quantized_attention", action="store_true", default=None, help="video pipelines: "
                      "self-attention with int8 Q K^T and float8 P V (ditforge's Triton kernel, SageAttention's "
                      "scaling; FP8 GPU); cross-attention stays exact; changes the samples (see docs/sampling.md)")
    fast.add_argument("--cfg_parallel", action="store_true", help="under torchrun with 2 x --sequence_parallel_size "
                      "processes: the conditional and unconditional passes run on different GPUs (with --compile when "
                      "--sequence_parallel_size is 1)")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    """``ditforge bench``: a flag per bench config field."""
    b = sub.add_parser("bench", help="time training step by step of the speed-ups (fp32 -> bf16 -> fast attention "
                       "-> fused kernels -> compile -> FP8) on synthetic data; prints a table, writes JSON",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_config_flags(b, (BenchConfig,))


def _add_distill(sub: argparse._SubParsersAction) -> None:
    """``ditforge distill``: a flag per distill config field."""
    d = sub.add_parser("distill", help="distil a few-step student of a DiT run or a video pipeline by DMD2 (samples "
                       "in --student_steps steps without guidance; docs/distillation.md)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_config_flags(d, (DistillConfig,))


def _add_export(sub: argparse._SubParsersAction) -> None:
    """``ditforge export``: checkpoint, output and format."""
    e = sub.add_parser("export", help="consolidate a (sharded) checkpoint into one safetensors file, or write a "
                       "diffusers pipeline folder, a LoRA file, or ComfyUI's single file",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("--ckpt", required=True, help="run folder (newest checkpoint) or checkpoint folder")
    e.add_argument("--out", required=True, help="the .safetensors file to write (the run config goes in its "
                   "metadata), or the folder for --format diffusers")
    e.add_argument("--no_ema", dest="use_ema", action="store_false", help="export the raw weights, not the EMA")
    e.add_argument("--format", choices=("safetensors", "diffusers", "lora", "comfyui"), default="safetensors",
                   help="diffusers: a pipeline folder diffusers loads offline with from_pretrained (a fine-tuned "
                   "--init_from pipeline: the fine-tuned denoiser, LoRA merged, beside the untouched components; an "
                   "image class-conditional DiT: a DiTPipeline with transformer/, DDIM scheduler/, vae/); lora: a LoRA "
                   "run's adapters as OUT/pytorch_lora_weights.safetensors for pipe.load_lora_weights(OUT); comfyui: "
                   "a fine-tuned pipeline run as the one file OUT in the original release's names, which ComfyUI "
                   "loads (a LoRA: diffusion_model.<key>.lora_A/lora_B/alpha, float32; a full fine-tune: the whole "
                   "denoiser, bfloat16; one expert of two: OUT's name gets _high_noise or _low_noise)")
    e.add_argument("--vae", default=None, help="--format diffusers: the local diffusers AutoencoderKL folder to put in "
                   "the pipeline (default: the run's VAE)")


def _add_eval(sub: argparse._SubParsersAction) -> None:
    """``ditforge eval``: samples, reference, feature extractors and metrics."""
    ev = sub.add_parser("eval", help="FID, sFID, Inception Score, precision / recall (and digits accuracy), CLIP score "
                        "or FVD of samples against a reference set; prints a table and a JSON line",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ev.add_argument("--samples", required=True, help="an .npz of images (N,H,W,C) uint8 under 'arr_0' (as the ADM "
                    "evaluator reads) or 'samples' (as sample --save_npz writes), labels under 'labels' or 'arr_1'; "
                    "or a folder of images of one size; or 'digits'; with --i3d: videos (N,T,H,W,C), as sample "
                    "--save_npz writes them for video models, or a folder of videos of one size")
    ev.add_argument("--ref", help="the reference: 'digits', a folder of images, an .npz of images, or an .npz of "
                    "statistics (from --save_ref, or an ADM reference batch); every metric but clip needs it; with "
                    "--i3d: videos as --samples, or 'clips' or a video CSV (resized and centre-cropped to the "
                    "samples' size, as training reads them)")
    ev.add_argument("--inception", help="local Inception-v3 weights of torch-fidelity "
                    "(weights-inception-2015-12-05-6726825d.pth); without it the built-in digits extractor (8x8 "
                    "images only)")
    ev.add_argument("--metrics", type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
                    help="comma-separated, of fid, sfid, is, pr, accuracy, clip, identity, fvd (default: fvd with --i3d; "
                    "fid,sfid,is,pr with --inception; fid,pr,accuracy with the digits extractor, accuracy where the "
                    "samples carry labels)")
    ev.add_argument("--clip", help="--metrics clip: a local CLIP folder (CLIPModel + CLIPProcessor, e.g. a copy of "
                    "openai/clip-vit-large-patch14); the CLIP score of the samples against the npz's 'prompts'")
    ev.add_argument("--reference_image", action="append", help="--metrics identity: a reference image of the "
                    "subject (repeat the flag for several); the identity score is the mean cosine of every sample "
                    "frame's embedding to every reference's (DreamBooth's CLIP-I / DINO)")
    ev.add_argument("--image_encoder", help="--metrics identity: a local CLIP (CLIPVisionModelWithProjection) or "
                    "DINOv2 (Dinov2Model) folder with its image processor")
    ev.add_argument("--i3d", help="--metrics fvd: FVD's Kinetics-400 I3D as the local TorchScript file "
                    "i3d_torchscript.pt (StyleGAN-V's); frames are resized to 224x224 inside it")
    ev.add_argument("--num_frames", type=int, default=16, help="--metrics fvd, identity: the first N frames of each video "
                    "(16: the standard FVD)")
    ev.add_argument("--frame_interval", type=int, default=1, help="--metrics fvd with --ref clips or a CSV: the "
                    "stride of the reference clips (as ditforge train --frame_interval)")
    ev.add_argument("--batch_size", type=int, help="images per feature-extractor batch (default 100; videos with "
                    "--i3d, default 8)")
    ev.add_argument("--device", default="auto", help="cuda | cpu | auto")
    ev.add_argument("--save_ref", help="also write the reference statistics to this .npz (pass it as --ref later)")


def _add_preprocess(sub: argparse._SubParsersAction) -> None:
    """``ditforge preprocess``: a folder of videos to a video CSV."""
    pre = sub.add_parser("preprocess", help="write the video CSV (path,text,num_frames,fps,height,width) of a "
                         "folder of videos, for --data", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pre.add_argument("kind", choices=("ucf101", "folder"), help="ucf101: ROOT/<ActionClass>/<video>, caption from "
                     "the class name; folder: any tree of videos, caption from <stem>.txt beside each or its name")
    pre.add_argument("root", help="the folder of videos")
    pre.add_argument("--out", required=True, help="the CSV to write (paths in it relative to its folder)")


def _add_extract_features(sub: argparse._SubParsersAction) -> None:
    """``ditforge extract-features``: output, sharding, and the data, model and train fields that decide the
    encoding."""
    fx = sub.add_parser("extract-features", help="encode a data set once (VAE latent posterior, caption states; with "
                        "--init_from, the pipeline's own VAE and prompt encoding) into safetensors shards; train on "
                        "them with --data DIR",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fx.add_argument("--out", required=True, help="the folder to write (features.json + shard-NNNNN.safetensors); "
                    "must not hold features already")
    fx.add_argument("--batch_size", type=int, default=32, help="samples per encoder batch")
    fx.add_argument("--shard_size", type=int, default=1024, help="samples per shard file")
    fx.add_argument("--format", choices=("safetensors", "wds"), default="safetensors", help="safetensors: a "
                    "features folder (features.json); wds: WebDataset tar shards + shards.json, streamed by --data "
                    "(blends, exact resume at any world size; not with --init_from)")
    _add_config_flags(fx, (DataConfig, ModelConfig, TrainConfig),
                      only=("data", "image_size", "num_frames", "frame_interval", "num_workers", "resize_mode",
                            "buckets", "caption_missing", "condition", "vae", "text_encoder", "text_max_length",
                            "init_from", "transformer", "transformer_2", "device", "seed"))


def _add_shard(sub: argparse._SubParsersAction) -> None:
    """``ditforge shard``: source data, output folder and shard size."""
    sh = sub.add_parser("shard", help="store an image folder, captioned images or a video CSV as WebDataset tar "
                        "shards of the files' bytes (not re-encoded) with their captions and labels, for --data",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sh.add_argument("--data", required=True, help="an image folder ROOT/<class>/<image>, captioned images (a folder "
                    "with <stem>.txt captions, a CSV or JSONL of path,text) or a video CSV")
    sh.add_argument("--out", required=True, help="the folder to write (shard-NNNNN.tar + shards.json)")
    sh.add_argument("--shard_size", type=int, default=1000, help="samples per shard file")


def build_parser() -> argparse.ArgumentParser:
    """The ``ditforge`` parser: one subcommand per builder above, in the order ``--help`` lists them."""
    parser = argparse.ArgumentParser(prog="ditforge", description="Train and sample Diffusion Transformers (DiT).")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_sample, _add_bench, _add_distill, _add_export, _add_eval, _add_preprocess,
                _add_extract_features, _add_shard):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    command = args.pop("command")
    try:
        if command == "train":
            config_file = args.pop("config", None)
            # Resuming continues the saved run: its settings are the base; a file and flags still override.
            base = None
            if args.get("resume") is not None:
                from ditforge.train.checkpoint import find_resume
                from ditforge.weights.read import read_meta

                ckpt, _ = find_resume(args["resume"], args.get("outputs"))
                base = read_meta(ckpt).get("config") if ckpt is not None else None
            if base is not None:
                base["train"] = {k: v for k, v in base["train"].items() if k not in ("resume", "outputs")}
                saved = base.get("parallel", {})
                if args.get("plugin", saved.get("plugin")) != saved.get("plugin"):
                    # resumed under another plugin: the saved one's HSDP layout is not this one's
                    base["parallel"] = {k: v for k, v in saved.items() if k not in ("dp_shard", "dp_replicate")}
            cfg = build_config(config_file, args, base)
            # the trainer (torch, its distributed stack) after the settings are checked: a bad flag is one line
            # at once, not after seconds of imports
            from ditforge.train.trainer import train

            draw = None
            if cfg.data.class_data is not None and cfg.data.instance_data is not None:
                from ditforge.sample.class_clips import draw_class_clips as draw  # a video pipeline's class clips
            train(cfg, class_clips=draw)
        elif command == "sample":
            from ditforge.sample import SampleConfig, sample

            sample(SampleConfig(**args))
        elif command == "bench":
            from ditforge.bench import bench

            bench(BenchConfig(**args))
        elif command == "distill":
            for flag in ("teacher", "outputs"):
                if args.get(flag) is None:
                    raise UserError(f"--{flag}: required")
            from ditforge.export import pipeline_teacher
            from ditforge.sample.student import student_videos  # a pipeline teacher's --eval_every draws
            from ditforge.train.distill import distill

            distill(DistillConfig(**{**args, "teacher": pipeline_teacher(args["teacher"], args.get("outputs"))}),
                    draw_student=student_videos)
        elif command == "export":
            from ditforge.export import export

            export(args["ckpt"], args["out"], args["format"], args["use_ema"], args["vae"])
        elif command == "eval":
            import json

            from ditforge.eval.evaluate import evaluate

            result = evaluate(**args)
            for key, value in result.items():
                print(f"{key:<12} {value:.6g}" if isinstance(value, float) else f"{key:<12} {value}")
            print(json.dumps(result))
        elif command == "preprocess":
            from ditforge.data.preprocess import preprocess_folder, preprocess_ucf101

            run = preprocess_ucf101 if args["kind"] == "ucf101" else preprocess_folder
            print(run(args["root"], args["out"]))
        elif command == "extract-features":
            from ditforge.data.features import read_manifest
            from ditforge.data.store import extract_features

            out, batch_size, shard_size = args.pop("out"), args.pop("batch_size"), args.pop("shard_size")
            fmt = args.pop("format")
            cfg = build_config(None, args)
            folder = extract_features(cfg, out, batch_size, shard_size, device=cfg.train.device, fmt=fmt)
            if fmt == "safetensors":
                print(f"wrote {read_manifest(folder)['num_samples']} samples to {folder}")
        elif command == "shard":
            from ditforge.data.store import write_raw_shards

            written = write_raw_shards(args["data"], args["out"], args["shard_size"])
            print(f"wrote {written['num_samples']} samples in {len(written['shards'])} shards to {args['out']}")
    except UserError as e:
        print(f"ditforge {command}: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"ditforge {command}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ditforge {command}: interrupted", file=sys.stderr)
        return 130
    return 0
