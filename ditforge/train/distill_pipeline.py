"""``ditforge distill`` of a diffusers pipeline of an adapted family (``models/adapters``; video first): a few-step
student by DMD2 (``diffusion/dmd.py`` holds the math), data-free from prompts (and an image-to-video teacher's
first frames, ``--image``: a folder of PNG / JPEG files, encoded as fine-tuning encodes a clip's, ``conditioning``);
with ``--data`` and ``--gen_cls_loss_weight`` also on real clips, for DMD2's GAN head on the critic's features
(``distill_real.py``).

The three networks (``distill_nets.py``): the teacher (the real score, guided at ``--cfg_scale``: a CFG pair, or for
a guidance-distilled family one pass with that scale embedded, which student and critic take too) is the pipeline's
denoiser with its peft adapters disabled; the student (the generator) and the critic (the fake score, trained with
the family's own denoising loss, flow matching or DDPM v-prediction, on the student's detached samples) are adapters
on it (``--lora_rank R``: one copy of the base weights serves the three, ``dmd.py``'s docstring) or full trainable
copies of it (``--lora_rank 0``, ``--critic_lora_rank``). The frozen teacher is placed as fine-tuning places a LoRA
run's base: float8 storage (``--fp8_base``), its last blocks in host memory (``--blocks_to_swap``); both optimizers
are fine-tuning's (``--optimizer``: 8-bit, 4-bit or float8 moments). Under torchrun the networks are whole on every
process (``--plugin ddp``) or sharded by fine-tuning's FSDP2 (``--plugin fsdp``), and each sample's video tokens may
be split over ``--sequence_parallel_size`` processes (fine-tuning's context parallelism): ``distill_nets``.

The student's K timesteps are ``dmd.pipeline_student_times``: a flow pipeline's ``dmd.flow_student_sigmas`` of its
scheduler's shift, a DDPM one's (v-prediction, zero terminal SNR) T-1 - k T / K; the ones ``ditforge
sample --sampler student`` runs (``VideoSampler._student``). Latents are (B, C, T', h, w) for every family: a
frames-first one's adapter (``frames_first``) hands them to its transformer as (B, T', C, h, w) itself.

The run folder is a fine-tuned pipeline run's (``weights.finetuned.load_finetuned`` reads it): ``checkpoints/
step-*/`` (DCP, ``checkpoint.Checkpointer``) hold both networks, both optimizers, and ``ema``: the student as a LoRA
or a full fine-tune's checkpoint holds it (``distill_nets.Networks.state``), so ``ditforge sample --ckpt RUN`` (its
K steps, no guidance) and ``ditforge export --ckpt RUN`` (``--format lora | comfyui`` of a LoRA student,
``diffusers`` of either) take it as they take that fine-tune. ``meta.json``'s config is a ``RunConfig``
(``--init_from`` the teacher's pipeline folder, ``--lora_rank`` the student's) with a ``distill`` section (the
student's steps and timesteps, the teacher's guidance, the ``--cfg_scale`` the student samples at
(``sample_cfg_scale``: 1, or a guidance-distilled family's embedded scale), sampler ``student``). A fine-tuned run as
teacher is first written as a pipeline folder, ``RUN/teacher``, by the CLI (``export.pipeline_teacher``: LoRA
merged). The randomness of iteration k derives from (seed, k) alone, so ``--resume auto`` continues exactly; the
first frames are drawn from it as the prompts are. Student, critic and teacher take the same image conditioning,
the teacher's unconditional pass too (what the image-to-video pipelines' negative branch keeps); ``ditforge sample
--ckpt RUN --image IMG`` samples the student.

A pipeline of two experts (the adapter's ``expert_boundary`` b: ``transformer`` at t >= b x 1000, ``transformer_2``
below) loads with both, each carrying its own ``student`` and ``critic`` adapters (one LoRA per expert, as
lightx2v's high- and low-noise LoRAs); the denoiser routes every row of every call to the expert that owns its
timestep (``route_experts``; ``adapters.by_expert``: the pipeline's rule), so each of the student's K steps, the
critic and the guided teacher run on the expert of the t they are evaluated at. An adapter no step has reached has
no optimizer state yet, which resume keeps (``checkpoint.keep_saved_states``). The run is then a LoRA fine-tune of
both experts' (``--expert both``): ``ema`` holds ``transformer.*`` and ``transformer_2.*`` adapters, which ``sample``
runs per step on their expert and ``export --format lora`` writes as ``high_noise/`` and ``low_noise/``.

``--eval_every N`` (with ``--validation_prompts`` and ``--clip``) scores the student's and the teacher's videos by
their CLIP score every N iterations (``distill_eval.py``; the student drawn by ``ditforge sample``'s loop, which
``cli`` hands over as ``draw_student``).

A reference-image teacher (``takes_references``) distils text-to-video with no control inputs (its call's default
control), or with ``--image`` one reference image a sample, its latent frame prepended (``reference_control``: the
adapter's ``encode_control``, ``ditforge sample``'s); student, critic and teacher (both passes) take the control.

A character teacher driven by videos (the adapter's ``trained_videos``) distils one segment of its call
(``--num_frames``, default its ``segment_frame_length``), conditioned on ``--driving_csv`` rows (``driving_rows``:
a character image and its driving videos, optionally a caption), each sample's row drawn as the prompts are and
encoded as its first segment (``driving_conditioning``: fine-tuning's ``encode_driving``); its latents carry the
pipeline's leading noise frame (the adapter's ``padding_frames``). Student, critic and both teacher passes take
that conditioning (the unconditional pass the adapter's ``drop``: the pipeline's own). ``ditforge sample --ckpt
RUN`` samples it through the pipeline's call, the student's K steps as its scheduler (``dmd.StudentScheduler``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from ditforge.config.sections import DistillConfig
from ditforge.config.values import resolve_precision
from ditforge.data.sampler import derive_seed
from ditforge.diffusion.dmd import DMD2, pipeline_student_times
from ditforge.diffusion.flow import RectifiedFlow
from ditforge.diffusion.objective import create_objective, objective_of_scheduler
from ditforge.diffusion.samplers import STUDENT_SAMPLER
from ditforge.errors import UserError
from ditforge.parallel import clip_grad_norm_
from ditforge.parallel.collectives import average_gradients, mean_over_processes
from ditforge.parallel.mesh import Dist, init_distributed, shutdown
from ditforge.train.checkpoint import Checkpointer, find_resume, list_checkpoints
from ditforge.train.distill_nets import Networks, critic_rank
from ditforge.train.distill_real import RealClips, classifier, refuse_real_data
from ditforge.train.dmd_step import GANTerms, dmd2_iteration
from ditforge.train.logging import MetricsLog, mean_records, progress_line, read_metrics, rewrite_metrics

log = logging.getLogger(__name__)

FLAG = "--teacher"
FIRST_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg")  # --image: the first frames of an image-to-video teacher


def is_pipeline_teacher(teacher: str) -> bool:
    """True for a diffusers pipeline folder of an adapted family, or a ditforge run (checkpoint) that fine-tuned one;
    False for a DiT teacher (a run of ditforge's own DiT, a ``DiTPipeline`` folder). Raises UserError for an
    incomplete or unsupported pipeline folder (``read_model_index``, naming ``--teacher``)."""
    from ditforge.models.adapters.pipeline import read_model_index
    from ditforge.weights.read import load_weights

    path = Path(teacher)
    if (path / "model_index.json").is_file():
        return read_model_index(path, FLAG)["_class_name"] != "DiTPipeline"
    try:
        _, config = load_weights(teacher)
    except UserError:
        return False  # load_teacher names what is wrong
    return bool(config and config["model"].get("family"))


def route_experts(pre, objective, times: torch.Tensor) -> None:
    """A teacher of two experts (the adapter's ``expert_boundary`` b): the denoiser's rows routed
    (``routing_boundary`` = b x the scheduler's ``num_train_timesteps``, ``adapters.by_expert``: the pipeline's rule,
    per row), so that teacher, critic and student each run, at every timestep they are evaluated at, on the expert
    that owns it, with that expert's adapters; logs which experts the student's K steps (``times``, the objective's
    timesteps) run on. Nothing for one expert."""
    den = pre.denoiser
    if len(den.expert_models()) == 1:
        return
    den.routing_boundary = float(den.expert_boundary(pre.pipe)) * int(pre.scheduler_config["num_train_timesteps"])
    steps = [f"{float(t):g} ({den.pipeline_slots[int(float(t) < den.routing_boundary)]})"
             for t in objective.model_timesteps(times)]
    log.info("two experts switched at t = %g: the student's steps at t = %s", den.routing_boundary, ", ".join(steps))


def load_teacher_pipeline(cfg: DistillConfig, folder: Path, device: torch.device, dtype: torch.dtype):
    """The teacher's pipeline (``load_pretrained``: encoders on ``device``, the denoiser in ``dtype``) after the
    checks of what the student recipe takes, and the guidance scales (s, s_2): ``--cfg_scale``, else the pipeline
    call's default ``guidance_scale`` (a guidance-distilled family's: the scale its one pass embeds); a pipeline of
    two experts' low-noise one ``--cfg_scale_2``, else the call's default ``guidance_scale_2``, else s (the
    two-expert pipeline's ``__call__``: ``if guidance_scale_2 is None: guidance_scale_2 = guidance_scale``); None
    for one expert.

    A pipeline of two experts (the adapter's ``expert_boundary``) loads with both (``load_pretrained``'s default
    outside sampling: ``add_expert``), routed by ``route_experts``.

    Raises:
        UserError (one line, naming ``--teacher`` or the flag): a pipeline that is no video one, or without guidance
            information (no ``--cfg_scale`` and no default scale in its call); ``--cfg_scale_2`` for a pipeline of
            one expert.
    """
    from ditforge.models.adapters.pipeline import encoder_dtype, load_pretrained
    from ditforge.models.adapters.pipeline import pipeline_defaults

    pre = load_pretrained(folder, device, encoder_dtype(device), flag=FLAG, denoiser_dtype=dtype)
    den = pre.denoiser
    if not den.video:
        raise UserError(f"{FLAG} {cfg.teacher}: distill takes video pipelines; {pre.pipeline_class}: it is not a "
                        "video family")
    defaults = pipeline_defaults(pre.pipe)
    scale = cfg.cfg_scale if cfg.cfg_scale is not None else defaults.get("guidance_scale")
    if scale is None:
        raise UserError(f"{FLAG} {cfg.teacher}: no guidance information ({pre.pipeline_class}'s call has no default "
                        "guidance_scale); give --cfg_scale")
    if len(den.expert_models()) == 1:
        if cfg.cfg_scale_2 is not None:
            raise UserError(f"--cfg_scale_2: for a teacher of two experts (its low-noise transformer_2); {FLAG} "
                            f"{cfg.teacher} is a {pre.pipeline_class} of one")
        return pre, float(scale), None
    scale_2 = next((s for s in (cfg.cfg_scale_2, defaults.get("guidance_scale_2")) if s is not None), scale)
    return pre, float(scale), float(scale_2)


def first_frame_files(cfg: DistillConfig, pre) -> list[Path]:
    """The ``--image`` files of an image-to-video teacher (``denoiser.image_to_video``: the first frames) or of a
    reference-image one (``takes_references``: one reference image a sample; optional): the PNG / JPEG files
    (``FIRST_FRAME_SUFFIXES``, any case) of the folder, sorted by name (names starting with ``.`` skipped), or the one
    such file given; each read once here (``open_rgb``) so that a bad one stops the run before it starts. [] for a
    text-to-video teacher, and for a reference-image one without ``--image`` (no control inputs).

    Raises:
        UserError (one line, naming ``--image``): ``--image`` missing for an image-to-video teacher or given to
            a text-to-video one; no such file or folder; a folder without PNG / JPEG files, or a file of another
            kind; an unreadable image.
    """
    from ditforge.data.images import open_rgb

    den = pre.denoiser
    if not (den.image_to_video or den.takes_references):
        if cfg.image is not None:
            raise UserError(f"--image {cfg.image}: {FLAG} {cfg.teacher} is a {pre.pipeline_class}, which takes no "
                            "image; leave --image out")
        return []
    if cfg.image is None and den.takes_references:
        return []
    if cfg.image is None:
        raise UserError(f"--image: {FLAG} {cfg.teacher} is an image-to-video {pre.pipeline_class}; give its first "
                        "frames, --image DIR (a folder of PNG / JPEG files)")
    path = Path(cfg.image)
    if not path.exists():
        raise UserError(f"--image {cfg.image}: no such folder or file")
    files = ([path] if path.is_file() else
             sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")))
    files = [p for p in files if p.suffix.lower() in FIRST_FRAME_SUFFIXES]
    if not files:
        raise UserError(f"--image {cfg.image}: expected a folder of PNG / JPEG files (.png, .jpg, .jpeg) or one such "
                        "file; found none")
    for file in files:
        open_rgb(file, f"--image {file}")
    return files


def driving_rows(cfg: DistillConfig, pre) -> list[dict[str, str]]:
    """A driven teacher's (``denoiser.trained_videos``) ``--driving_csv`` rows (``data.driving.read_driving_csv``: a
    character image, its driving videos, a caption where the CSV has a ``text`` column); [] for other teachers.

    Raises:
        UserError (one line, naming the flag): ``--driving_csv`` for another teacher, or missing for a driven one;
            neither ``--prompt_file`` nor a ``text`` column; ``--eval_every`` (its students are text-to-video ones);
            ``read_driving_csv``'s.
    """
    from ditforge.data.driving import read_driving_csv

    den = pre.denoiser
    if not den.trained_videos:
        if cfg.driving_csv is not None:
            raise UserError(f"--driving_csv {cfg.driving_csv}: {FLAG} {cfg.teacher} is a {pre.pipeline_class}, which "
                            "no videos drive; leave --driving_csv out")
        return []
    if cfg.driving_csv is None:
        raise UserError(f"--driving_csv: {FLAG} {cfg.teacher} is a {pre.pipeline_class}, driven by videos; give a CSV "
                        f"of the columns image,{','.join(den.trained_videos)}[,text]")
    if cfg.eval_every:
        raise UserError(f"--eval_every: {pre.pipeline_class}'s student samples through its pipeline's call, which "
                        "the CLIP evaluation does not draw; leave --eval_every out")
    rows = read_driving_csv(cfg.driving_csv, den.trained_videos, "--driving_csv")
    if cfg.prompt_file is None and "text" not in rows[0]:
        raise UserError(f"--prompt_file: --driving_csv {cfg.driving_csv} has no text column (the rows' prompts); "
                        "give a file of one prompt per line, or the column")
    return rows


def driving_conditioning(pre, rows: list[dict[str, str]], size: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """A driven teacher's conditioning of the B ``driving_rows`` ``rows`` for clips of ``size`` (H, W, T), (B, ...)
    float32 on the denoiser's device: each row's character image and its videos' first T frames
    (``data.driving.read_driving_row``, PIL) through the adapter's ``encode_driving`` (fine-tuning's: the pipeline's
    first segment, its own methods)."""
    from ditforge.data.driving import read_driving_row

    den, (height, width, frames) = pre.denoiser, size
    conds = [den.encode_driving(pre.pipe, *read_driving_row(row, den.trained_videos, frames, "--driving_csv"), height,
                                width, pre.device)[0] for row in rows]
    return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}


def conditioning(pre, texts: list[str], files: list, size: tuple[int, int, int],
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The B samples' conditioning (float32, batch-first, on the denoiser's device): the prompts ``texts``'
    (``Pretrained.encode_prompt``), and for an image-to-video teacher (``files``: B first-frame files) the image
    conditioning as fine-tuning builds a clip's (``encoders.batch.BatchEncoder.conditioning``): ``Pretrained.
    encode_image`` of the first frames (B, 3, H, W) in [-1, 1] for clips of T frames (``size``: (H, W, T)), the
    prompts encoded with those frames by a ``prompt_sees_image`` family. The frames are the files as PIL RGB images
    (``open_rgb``) resized and normalised by the pipeline's own ``video_processor.preprocess`` (its call's, and
    ``ditforge sample --image``'s), the PIL images themselves going to its image encoder as the pipeline's do; a
    family that draws its image latents (``image_from_generator``) draws them from ``generator``. Not dropped for
    the teacher's unconditional pass (the adapters' ``drop`` replaces the prompt's tensors alone, as the pipelines'
    negative branch keeps the image). A reference-image teacher: ``reference_control``'s control beside the
    prompts'; a driven one (``files``: B ``driving_rows``): ``driving_conditioning``'s."""
    if pre.denoiser.trained_videos:
        return pre.encode_prompt(texts) | driving_conditioning(pre, files, size)
    if pre.denoiser.takes_references:
        return pre.encode_prompt(texts) | reference_control(pre, files, len(texts), size)
    if not files:
        return pre.encode_prompt(texts)
    from ditforge.data.images import open_rgb

    den, (height, width, num_frames) = pre.denoiser, size
    images = [open_rgb(f, f"--image {f}") for f in files]
    first = pre.pipe.video_processor.preprocess(images, height=height, width=width).float()
    cond = pre.encode_prompt(texts, images=first) if den.prompt_sees_image else pre.encode_prompt(texts)
    extra = {"generator": generator} if den.image_from_generator else {}
    return cond | pre.encode_image(first, num_frames, images=images, **extra)


def reference_control(pre, files: list[Path], batch: int, size: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """A reference-image teacher's control for ``batch`` samples of ``size`` (H, W, T) frames, as its pipeline's call
    builds it (the adapter's ``encode_control``, ``ditforge sample``'s too): with ``files`` (one PNG / JPEG per
    sample, read by ``open_rgb``) each sample's one reference image, its latent frame prepended (R = 1); without,
    no control inputs: the call's defaults (a zero control video, an all-ones mask), the same for every sample.
    No control video or mask is drawn (``--video`` / ``--mask`` are ``ditforge sample``'s only). Returns the
    adapter's tensors, (B, ...) float32 on the denoiser's device."""
    from ditforge.data.images import open_rgb

    den, (height, width, frames) = pre.denoiser, size
    refs = [[open_rgb(f, f"--image {f}")] for f in files] or [[]]
    rows = [den.encode_control(pre.pipe, r, None, None, height, width, frames, pre.device)[0] for r in refs]
    return {k: torch.cat([r[k] for r in rows]).expand(batch, *rows[0][k].shape[1:]) for k in rows[0]}


def latent_shape(pre, cfg: DistillConfig) -> tuple[tuple[int, ...], int, int, int, int]:
    """((B, C, T', h, w) of the student's latents, height, width, frames, the frames an image-to-video teacher's
    image conditioning covers (the clip's and the padding's, as its pipeline encodes them)): the flags, else the
    pipeline call's defaults (or the adapter's ``call_defaults``, from its transformer's config). Channels before frames for every
    family, as fine-tuning encodes them (a frames-first adapter transposes for its transformer); a reference-image
    teacher's ``--image`` prepends a latent frame (the reference's, ``reference_control``), as its pipeline does,
    and a family that patches frames in groups the frames its pipeline puts in front of the clip's (the adapter's
    ``padding_frames``), so the student learns the latents the pipeline's own call draws, and samples them.
    Raises UserError: a frame count the VAE cannot take, a side the VAE and patches do not divide, a size the model
    cannot take (``refuse_size``: learned positional tables)."""
    from ditforge.encoders import VAE
    from ditforge.models.adapters.pipeline import pipeline_defaults

    den, defaults = pre.denoiser, pipeline_defaults(pre.pipe)
    height, width = cfg.height or defaults["height"], cfg.width or defaults["width"]
    frames = cfg.num_frames or defaults["num_frames"]
    vae = VAE(pre.pipe.vae, frame_factor=den.vae_frame_factor, folds_pixels=den.vae_folds_pixels)
    vae.check_frames(frames, f"the VAE of {pre.pipeline_class} (--num_frames)")
    for flag, value in (("--height", height), ("--width", width)):
        if value % pre.side_multiple:
            raise UserError(f"{flag} {value}: {pre.pipeline_class} takes frame sides that are multiples of "
                            f"{pre.side_multiple}")
    pre.refuse_size(height, width, frames, f"--height {height} --width {width} --num_frames {frames}")
    padding = den.padding_frames(vae.latent_frames(frames))
    prepended = int(den.takes_references and cfg.image is not None) + padding
    shape = (cfg.batch_size, den.in_channels, vae.latent_frames(frames) + prepended, height // vae.downsample,
             width // vae.downsample)
    # a driven pipeline's videos cover the clip alone (its padding frame is the character's place, no frames')
    return shape, height, width, frames, frames + (0 if den.trained_videos else padding * vae.temporal)


def nets(networks: Networks, cond: dict[str, torch.Tensor], scale: float, amp: torch.dtype,
         scale_2: float | None = None):
    """(student, critic, teacher) callables (x_t, model timesteps) -> the model's output (a flow family's velocity,
    a DDPM family's v-prediction), float32, for ``dmd.DMD2``: ``networks``' student and critic (an adapter on the
    teacher's denoiser, or a full copy: ``distill_nets``), and the teacher's denoiser with adapters disabled,
    guided: u + scale (c - u) (Ho & Salimans 2022; c, u the conditional and unconditional, empty-prompt passes: the
    pipelines' ``noise_uncond + guidance_scale * (noise_pred - noise_uncond)``; a pipeline of two experts: row i at
    ``scale`` where t_i >= the routing boundary, on the high-noise expert, else at ``scale_2``, as its pipeline's
    ``current_guidance_scale``, by ``adapters.by_expert``'s rule), or for a guidance-distilled family
    (``embedded_guidance``) c alone, one pass with ``scale`` embedded (``model.guidance_inputs``, its pipeline's
    call), the embedding the student and critic take too. ``cond``: the B prompts' conditioning (B, ...). Computed
    under autocast in ``amp`` (none in float32)."""
    first, model = next(iter(cond.values())), networks.base
    device = first.device
    cond = {**cond, **model.guidance_inputs(scale, len(first), device)}  # {} unless guidance-distilled

    def call(name: str | None, x, t, drop=None, c=cond):
        networks.use(name)
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
            return networks.module(name)(x, t, force_drop_ids=drop, **c).float()

    def teacher(x, t):
        c = call(None, x, t)
        if model.embedded_guidance:
            return c
        u = call(None, x, t, torch.ones(len(x), dtype=torch.bool, device=x.device))
        if scale_2 is None or scale_2 == scale:
            return u + scale * (c - u)
        s = torch.where(t >= model.routing_boundary, scale, scale_2).view(-1, *[1] * (c.ndim - 1))  # (B, 1, ...)
        return u + s * (c - u)

    return (lambda x, t: call("student", x, t)), (lambda x, t: call("critic", x, t)), teacher


def distill_pipeline(cfg: DistillConfig, draw_student: Callable | None = None) -> Path:
    """Distil a few-step student of a pipeline teacher (module docstring); returns the run folder. ``draw_student``:
    ``sample.student.student_videos`` for ``--eval_every`` (``distill_eval``; ``cli`` hands it over).

    Raises:
        UserError: no ``--prompt_file`` (nor ``--driving_csv``); a fine-tuned run's folder as ``--teacher``;
            ``--sequence_parallel_size`` for a family without a token split (``refuse_unsplittable``) or one that does
            not divide the processes (``init_distributed``); a ``--batch_size`` the data-parallel groups do not
            divide; and ``check_eval_flags``' / ``load_teacher_pipeline``'s / ``first_frame_files``' /
            ``driving_rows``' / ``latent_shape``'s / ``distill_nets.build_networks``' / ``distill_eval``'s errors.
    """
    from ditforge.data.captions import read_prompts
    from ditforge.train.distill_eval import ClipEval, check_eval_flags, eval_prompts
    from ditforge.train.distill_nets import build_networks

    check_eval_flags(cfg)
    if cfg.prompt_file is None and cfg.driving_csv is None:  # a driven teacher's CSV may caption its rows
        raise UserError("--prompt_file: a pipeline teacher distils from prompts; give a file of one prompt per line")
    prompts = read_prompts(None, cfg.prompt_file) if cfg.prompt_file is not None else None
    folder = Path(cfg.teacher)
    if not (folder / "model_index.json").is_file():  # the CLI writes a fine-tuned run as one (export)
        raise UserError(f"{FLAG} {cfg.teacher}: a fine-tuned run distils from its pipeline folder; write it with "
                        "`ditforge export --format diffusers` and pass that folder")
    if cfg.sequence_parallel_size > 1:
        from ditforge.models.adapters import family_of_pipeline
        from ditforge.models.adapters.pipeline import read_model_index
        from ditforge.parallel.context import refuse_unsplittable

        family = family_of_pipeline(read_model_index(folder, FLAG)["_class_name"])
        refuse_unsplittable(family, cfg.sequence_parallel_size, "leave --sequence_parallel_size out", use="train")
    # under torchrun: each sequence-parallel group (one process without --sequence_parallel_size) B / n of the batch
    d = init_distributed(cfg.device, cfg.sequence_parallel_size)
    plugin = "none" if d.world_size == 1 else "fsdp" if cfg.plugin == "fsdp" else "ddp"
    if cfg.batch_size % d.dp_size:
        raise UserError(f"--batch_size {cfg.batch_size}: not divisible by the {d.dp_size} data-parallel groups")
    device = d.device
    amp = resolve_precision(cfg.mixed_precision, device)
    ckpt, outputs = find_resume(cfg.resume, cfg.outputs)
    run_dir = Path(outputs)
    if ckpt is None and list_checkpoints(run_dir):
        raise UserError(f"--outputs {run_dir} already holds a run; pass --resume auto to continue it, or choose "
                        "another folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    pre, scale, scale_2 = load_teacher_pipeline(cfg, folder, device, amp)
    model = pre.denoiser
    files = first_frame_files(cfg, pre) + driving_rows(cfg, pre)  # at most one of them
    prompts = prompts or [row["text"] for row in files]  # no --prompt_file: the driving rows' captions
    samples = eval_prompts(cfg, pre) if cfg.eval_every else None
    shape, height, width, frames, image_frames = latent_shape(pre, cfg)
    real = None
    if cfg.data is not None:
        refuse_real_data(cfg, model)
        real = RealClips(cfg, pre, shape, (height, width, frames), run_dir / "bad_samples.jsonl")
    targets = [t.strip() for t in (cfg.lora_target_modules or ",".join(model.default_lora_targets)).split(",")]
    networks = build_networks(cfg, pre, targets, amp, d, plugin)
    objective = create_objective("auto", model.learn_sigma, pre.scheduler_config, where=f"{FLAG} {cfg.teacher}",
                                 device=device, **model.objective_args(pre.pipe, None, *shape[2:]))
    try:  # flow: x0 = x - sigma v; DDPM v-prediction: x0 = sqrt(abar) x - sqrt(1 - abar) v (dmd.predicted_x0)
        times = pipeline_student_times(objective, pre.scheduler_config, cfg.student_steps, device)
    except ValueError as e:
        raise UserError(f"--student_steps: {e}") from None
    route_experts(pre, objective, times)
    opts = networks.optimizers(cfg.optimizer, (cfg.lr, cfg.critic_lr or cfg.lr), device)
    start = 0
    if ckpt is not None:
        start = networks.resume(ckpt, opts)
        log.info("resumed from %s (step %d)", ckpt, start)
    metrics_path, metrics = run_dir / "metrics.jsonl", None
    if d.is_main:
        kept = [r for r in read_metrics(metrics_path) if r["step"] <= start] if metrics_path.exists() else []
        rewrite_metrics(metrics_path, kept)
        metrics = MetricsLog(metrics_path)
    config = run_config(cfg, pre, folder, targets, objective, times, (scale, scale_2), height, width, frames, plugin,
                        d.sp_size)
    checkpointer = Checkpointer(run_dir, cfg.keep_last, False, d, last_step=start or None)
    clip_eval = None
    if samples is not None and d.is_main:  # the teacher drawn and scored once, here
        clip_eval = ClipEval(cfg, pre, samples, lambda cond: nets(networks, cond, scale, amp)[0], (scale, scale_2),
                             (shape, height, width, frames), amp, draw_student, networks.use)
    # an I2V family's given first frame: not learned; the draws of the global batch, this process's group's rows
    dmd = DMD2(objective, times, given_frames=model.given_frames, shard=(d.dp_rank, d.dp_size))
    log.info("distilling %s into a %d-step student (%s), guidance %.2g%s, %d critic steps per generator step, %d "
             "prompts, latents %s, %d processes (plugin %s, %d per sample), run folder %s", cfg.teacher,
             cfg.student_steps, networks.describe(), scale,
             "" if scale_2 is None else f" (low-noise expert {scale_2:.2g})", cfg.critic_steps, len(prompts),
             tuple(shape), d.world_size, plugin, d.sp_size, run_dir)
    window, tic = [], time.perf_counter()
    for step in range(start + 1, cfg.max_steps + 1):
        window.append(iteration(dmd, step, cfg, pre, prompts, files, (shape, height, width, image_frames),
                                (scale, scale_2), amp, networks, opts, d, plugin, real))
        scores = {}
        if clip_eval is not None and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            began = time.perf_counter()
            scores = clip_eval(step)
            tic += time.perf_counter() - began  # steps_per_sec counts the iterations alone
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            rate = len(window) / (time.perf_counter() - tic)
            line = mean_records(window) | {"step": step, "steps_per_sec": rate} | scores
            if device.type == "cuda":
                line["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if metrics is not None:  # process 0 writes and logs
                report(metrics, line, cfg.max_steps)
            window, tic = [], time.perf_counter()
        elif scores:  # an evaluation between two log lines: a record of its own
            metrics.write({"step": step, **scores})
        if step % cfg.ckpt_every == 0 or step == cfg.max_steps:
            checkpointer.save(step, networks.state(opts), {"config": config})
    checkpointer.wait()
    if metrics is not None:
        metrics.close()
    shutdown(d)
    return run_dir


def report(metrics: MetricsLog, line: dict, max_steps: int) -> None:
    """Write a metrics record (the mean of a window of iterations, ``line``) and its log line."""
    metrics.write(line)
    step, rate = line["step"], line["steps_per_sec"]
    clip = (f" | CLIP student {line['clip_score_student']:.4f} teacher {line['clip_score_teacher']:.4f}"
            if "clip_score_student" in line else "")
    if "generator_loss" in line:
        log.info("%s | critic %.4f | dmd grad %.3g%s", progress_line(
            step, max_steps, line["generator_loss"], rate, line.get("peak_memory_gib")),
            line["critic_loss"], line["dmd_grad_norm"], clip)
    else:
        log.info("step %d/%d | critic %.4f | %.2f steps/s%s", step, max_steps, line["critic_loss"], rate, clip)


def iteration(dmd: DMD2, step: int, cfg: DistillConfig, pre, prompts: list[str], files: list[Path], sizes,
              scales: tuple[float, float | None], amp: torch.dtype, networks: Networks, opts: list, d: Dist,
              plugin: str, real: RealClips | None = None) -> dict[str, float]:
    """One iteration (DMD2's two time scales, as ``distill._iteration``): every ``critic_steps``-th a generator step,
    then a critic step. ``sizes``: (the latents' shape (B, C, T', h, w), height, width, the frames the image
    conditioning covers: the clip's and the pipeline's padding); ``scales``: the teacher's guidance (``nets``'
    scale, scale_2). Its randomness from
    ``torch.Generator(device).manual_seed(derive_seed(seed, step))``, in this order: the B prompts' indices
    (uniform), an image-to-video teacher's B first frames' (a driven one's B driving rows') indices in ``files``
    (uniform; a driven teacher's without ``--prompt_file``: the prompts' own, each row its caption) and its image
    latents' draws (``image_from_generator``), the noise (B, C, T', h, w) (then the adapter's ``start``: the latents the
    pipeline starts from), ``--data``'s B real clips (``RealClips.draw``), then ``DMD2``'s draws. Under torchrun
    (``d``) every process makes the global batch's draws and conditioning and keeps the B / n rows of its
    data-parallel rank (``DMD2.shard``'s; n = ``d.dp_size``), the same on the processes of one sequence-parallel
    group, which split each row's tokens (``parallel.context``); the gradients are averaged over all processes before
    clipping: by ``average_gradients`` (``plugin`` ddp), or by FSDP2's reduce-scatter into each process's shards
    (fsdp), clipped to the global norm of the shards (``parallel.clip_grad_norm_``). The returned losses and gradient
    norms are all processes' means: n groups take the steps of one process with the global batch."""
    model, device = pre.denoiser, pre.device
    shape, height, width, frames = sizes
    g = torch.Generator(device).manual_seed(derive_seed(cfg.seed, step))
    rows = torch.randint(len(prompts), (shape[0],), generator=g, device=device).tolist()
    # driving rows without --prompt_file: each its own caption, the prompt's draw picks it
    picks = (rows if cfg.prompt_file is None else torch.randint(len(files), (shape[0],), generator=g,
                                                                device=device).tolist()) if files else []
    cond = conditioning(pre, [prompts[i] for i in rows], [files[i] for i in picks], (height, width, frames), g)
    noise = model.start(torch.randn(shape, generator=g, device=device), cond)  # as the pipeline's first latents
    b = shape[0] // d.dp_size
    mine = slice(d.dp_rank * b, (d.dp_rank + 1) * b)
    cond = {k: v[mine] for k, v in cond.items()}
    student, critic, teacher = nets(networks, cond, scales[0], amp, scales[1])
    gan = None
    if real is not None:  # the real clips' own captions condition the real branch (DMD2's)
        x_real, real_cond = real.draw(shape[0], g, (d.dp_rank, d.dp_size))  # as the generated rows: split alike
        group = None if d.sp_mesh is None else d.sp_mesh["sp"].get_group()  # each row's tokens split over it
        gan = GANTerms(x_real, classifier(networks, real_cond, scales[0], amp, group),
                       classifier(networks, cond, scales[0], amp, group), cfg.gen_cls_loss_weight,
                       cfg.guidance_cls_loss_weight)
    reduce = (lambda params: None) if plugin == "fsdp" else (lambda params: average_gradients(params, d))
    # each backward (and its recomputed blocks under gradient checkpointing) runs under its forward's adapter
    record = dmd2_iteration(dmd, step, cfg.critic_steps, student, teacher, critic, noise[mine], g, *opts,
                            *(list(networks.params(n).values()) for n in ("student", "critic")), cfg.max_grad_norm,
                            networks.use, reduce, gan, clip=lambda params, most: clip_grad_norm_(params, most, d))
    return mean_over_processes(record, d)


def run_config(cfg: DistillConfig, pre, folder: Path, targets: list[str], objective, times,
               scales: tuple[float, float | None], height: int, width: int, frames: int, plugin: str,
               sp_size: int) -> dict:
    """The student run's saved config: a LoRA fine-tune's ``RunConfig`` of the teacher's pipeline (a full
    fine-tune's for a full student, ``--lora_rank 0``: what
    ``load_finetuned`` rebuilds the student from) with the ``distill`` section ``ditforge sample`` reads (its keys
    are no ``RunConfig`` field, so ``build_config`` leaves them alone)."""
    from ditforge.config.load import build_config

    den = pre.denoiser
    overrides = {"init_from": str(folder), "family": den.family, "condition": "text", "lora_rank": cfg.lora_rank,
                 "lora_target_modules": ",".join(targets) if cfg.lora_rank else None,
                 "objective": objective_of_scheduler(pre.scheduler_config),
                 "flow_shift": objective.shift if isinstance(objective, RectifiedFlow) else None,
                 "in_channels": den.in_channels, "learn_sigma": den.learn_sigma, "vae": str(folder / "vae"),
                 "image_size": height if height == width else None, "num_frames": frames, "seed": cfg.seed,
                 "batch_size": cfg.batch_size, "lr": cfg.lr, "max_steps": cfg.max_steps,
                 "mixed_precision": cfg.mixed_precision, "outputs": cfg.outputs,
                 "expert": "both" if len(den.expert_models()) == 2 else None}  # a two-expert fine-tune's layout
    config = build_config(overrides=overrides).to_dict()
    config["model"]["num_frames"] = None  # the denoiser's own frames: the flags' are data.num_frames
    settings = asdict(cfg)
    scale = scales[0]
    config["distill"] = {"teacher": cfg.teacher, "student_steps": cfg.student_steps,
                         "critic_steps": cfg.critic_steps, "timesteps": times.tolist(), "sampler": STUDENT_SAMPLER,
                         "teacher_cfg_scale": scale, "teacher_cfg_scale_2": scales[1],
                         "sample_cfg_scale": scale if den.embedded_guidance else 1.0,
                         "height": height, "width": width, "image": cfg.image, "driving_csv": cfg.driving_csv,
                         # a driven student samples in segments of the frames it learnt (the pipeline's call)
                         "segment_frame_length": frames if den.trained_videos else None,
                         "student_lora_rank": settings["lora_rank"], "critic_lora_rank": critic_rank(cfg),
                         "optimizer": cfg.optimizer, "fp8_base": cfg.fp8_base, "blocks_to_swap": cfg.blocks_to_swap,
                         "plugin": plugin, "sequence_parallel_size": sp_size}
    return config
