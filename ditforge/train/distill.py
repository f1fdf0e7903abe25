"""``ditforge distill``: a few-step student of a ditforge DiT run by DMD2 (``diffusion/dmd.py`` holds the math).

The run folder is a training run's: ``RUN/checkpoints/step-*/`` (DCP, checksummed, atomic, rotated by
``checkpoint.Checkpointer``), ``RUN/metrics.jsonl`` (``logging.MetricsLog``) and one log line per ``--log_every``.
A checkpoint holds the student (``model``, and the weights ``ditforge sample`` reads as ``ema``: a LoRA student's
merged into its base), the critic (``critic``), both optimizers (``optimizer``, ``critic_optimizer``); the
randomness of iteration k derives from (seed, k) alone, so a resumed run continues exactly. ``meta.json``'s
config is the teacher's, with ``distill`` added: the student's timesteps (``student_times``), ``cfg_scale`` 1 (the
guidance is baked in), the sampler ``student``; ``ditforge sample --ckpt RUN`` reads it and samples the student in
its K steps without guidance by default (a text teacher's student: ``--prompt``).

Iteration k trains the critic; every ``--critic_steps``-th iteration trains the generator first (DMD2's
``dfake_gen_update_ratio``: the critic takes that many steps per generator step, sec. 4.2). Data-free: the labels
are drawn uniformly from the classes, a text teacher's prompts uniformly from ``--prompt_file`` (encoded once by its
text encoder, ``distill_data.TextPrompts``); the teacher is guided as ``ditforge sample`` guides it
(``samplers.GuidedModel``: u + s (c - u), u the null label's or the learned null caption's pass). With ``--data``
(``distill_data.RealData``) and ``--gen_cls_loss_weight`` the critic carries DMD2's GAN head (``dmd.GANHead``, the
critic's submodule ``gan_head``, in its checkpoint entry and optimizer) on its features after the first half of its
blocks (``classifier``), trained on real against the student's samples (``dmd_step.GANTerms``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ditforge.config.sections import DISTILL_PLUGINS, DistillConfig
from ditforge.config.values import resolve_device
from ditforge.data.sampler import derive_seed
from ditforge.diffusion.dmd import DMD2, GANHead, Net, student_times
from ditforge.diffusion.objective import create_objective
from ditforge.diffusion.samplers import STUDENT_SAMPLER, GuidedModel
from ditforge.errors import UserError
from ditforge.models import create_model_from_spec, is_video_model
from ditforge.parallel.mesh import Dist
from ditforge.train.checkpoint import Checkpointer, find_resume
from ditforge.train.distill_data import RealData, TextPrompts
from ditforge.train.dmd_step import GANTerms, dmd2_iteration
from ditforge.train.logging import MetricsLog, mean_records, progress_line, read_metrics, rewrite_metrics
from ditforge.weights.lora import add_lora, check_lora_targets, merge_lora
from ditforge.weights.read import SafeFileSystemReader, _SafeLoadPlanner, load_weights, read_checkpoint_weights

log = logging.getLogger(__name__)


def load_teacher(cfg: DistillConfig) -> tuple[torch.nn.Module, dict]:
    """The teacher run's model (EMA weights, eval mode, CPU) and its saved config.

    Raises:
        UserError: not a ditforge run (no saved config), a teacher with no null label or caption (trained without
            label or caption dropout: no unconditional prediction to guide with) unless ``--cfg_scale 1``.
    """
    state, config = load_weights(cfg.teacher, use_ema=True)
    if config is None:
        raise UserError(f"--teacher {cfg.teacher}: no saved run config (expected a ditforge run or checkpoint folder)")
    spec = dict(config["model"])
    if cfg.cfg_scale != 1.0 and not spec.get("class_dropout_prob"):
        null = "caption" if spec.get("text_dim") is not None else "label"
        raise UserError(f"--teacher {cfg.teacher}: no guidance information (trained without {null} dropout, "
                        f"class_dropout_prob 0: no null {null} to guide with); give --cfg_scale 1")
    model = create_model_from_spec(spec)
    if isinstance(state, Path):
        state = read_checkpoint_weights(state, model.state_dict(), use_ema=True)
    model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False), config


def check(cfg: DistillConfig) -> None:
    """The flags' own checks. Raises UserError, one line naming the flag."""
    for name in ("student_steps", "critic_steps", "max_steps", "batch_size", "log_every", "ckpt_every", "keep_last",
                 "sequence_parallel_size"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name}: expected a positive integer, got {getattr(cfg, name)}")
    for name in ("height", "width", "num_frames"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise UserError(f"--{name}: expected a positive integer, got {getattr(cfg, name)}")
    for name in ("lora_rank", "critic_lora_rank", "eval_every", "blocks_to_swap"):
        if (getattr(cfg, name) or 0) < 0:
            raise UserError(f"--{name}: expected >= 0, got {getattr(cfg, name)}")
    if cfg.plugin not in DISTILL_PLUGINS:
        raise UserError(f"--plugin {cfg.plugin}: distill takes {' | '.join(DISTILL_PLUGINS)} (zero2 and hsdp are "
                        "`ditforge train`'s)")
    if cfg.gen_cls_loss_weight < 0 or cfg.guidance_cls_loss_weight < 0:
        raise UserError("--gen_cls_loss_weight / --guidance_cls_loss_weight: expected >= 0")
    if (cfg.data is None) != (cfg.gen_cls_loss_weight == 0):
        raise UserError("--data: real samples train the GAN head; give --data and --gen_cls_loss_weight > 0 together"
                        if cfg.data is None else "--gen_cls_loss_weight: --data's real samples train the GAN head; "
                        "give a weight > 0 (DMD2's: 3e-3) or leave --data out")


def distill(cfg: DistillConfig, draw_student: Callable | None = None) -> Path:
    """Run the distillation; returns the run folder. A diffusers pipeline teacher (a folder, or a run that fine-tuned
    one) goes to ``distill_pipeline.distill_pipeline``, with ``draw_student`` (``sample.student.student_videos``,
    which ``cli`` passes: its ``--eval_every`` draws the student as ``ditforge sample`` does). Raises UserError on
    bad flags or a bad teacher."""
    from ditforge.train.distill_pipeline import distill_pipeline, is_pipeline_teacher

    check(cfg)
    if is_pipeline_teacher(cfg.teacher):
        return distill_pipeline(cfg, draw_student)
    if cfg.image is not None:
        raise UserError(f"--image {cfg.image}: for an image-to-video pipeline teacher; {cfg.teacher} is a DiT")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError(f"--teacher {cfg.teacher}: a DiT teacher distils in one process (a pipeline teacher's run is "
                        "data, FSDP or sequence parallel under torchrun); run it without torchrun")
    placed = [flag for flag, given in {"--critic_lora_rank": cfg.critic_lora_rank is not None,
                                       "--fp8_base": cfg.fp8_base, "--blocks_to_swap": cfg.blocks_to_swap,
                                       "--optimizer": cfg.optimizer != "adamw", "--plugin": cfg.plugin != "auto",
                                       "--sequence_parallel_size": cfg.sequence_parallel_size > 1,
                                       "--cfg_scale_2": cfg.cfg_scale_2 is not None,
                                       "--validation_prompts": cfg.validation_prompts is not None,
                                       "--clip": cfg.clip is not None,
                                       "--driving_csv": cfg.driving_csv is not None}.items() if given]
    if placed:
        raise UserError(f"{placed[0]}: for a pipeline teacher; {cfg.teacher} is a DiT (one process, its critic a "
                        "full copy, fp32 AdamW; --eval_every scores its digits)")
    if cfg.cfg_scale is None:  # DMD2's real score guided at 3: at 4 (what `ditforge sample` guides a DiT with) the
        # digits student's FID was 1.37x the teacher's at 250 steps, at 3 0.83x, at 2 0.54x but 98.6% class accuracy
        # (docs/distillation.md, benchmarks/results/digits_distill.json)
        cfg = dataclasses.replace(cfg, cfg_scale=3.0)
    teacher, config = load_teacher(cfg)
    m = config["model"]
    device = resolve_device(cfg.device)
    prompts, real = _inputs(cfg, config, device)
    objective = create_objective(m.get("objective") or "ddpm", m["learn_sigma"], flow_shift=m.get("flow_shift"),
                                 device=device)
    try:
        times = student_times(objective, cfg.student_steps, device)
    except ValueError as e:
        raise UserError(f"--student_steps: {e}") from None
    # eval mode for all three: a DiT in training mode drops labels at random (its label dropout, from the global
    # RNG); the student must always see its label, and the critic scores the conditional distribution
    student = copy.deepcopy(teacher).requires_grad_(True)
    if cfg.lora_rank:
        targets = (cfg.lora_target_modules or "qkv,proj").split(",")
        check_lora_targets(student, targets)
        add_lora(student, cfg.lora_rank, None, targets)
    critic = copy.deepcopy(teacher).requires_grad_(True)
    if real is not None:  # DMD2's cls_pred_branch: part of the critic (its optimizer, its checkpoint entry)
        torch.manual_seed(cfg.seed)
        critic.gan_head = GANHead(critic.final_layer.linear.in_features)
    if prompts is not None:  # never used (their captions are never dropped): an Adam state that is never made
        # would be missing from the checkpoint, which resume expects complete
        for model in (student, critic):
            model.y_embedder.null_caption.requires_grad_(False)
    teacher, student, critic = teacher.to(device), student.to(device), critic.to(device)
    params = [p for p in student.parameters() if p.requires_grad]
    # DMD2 trains both with Adam at beta1 = 0 (``main/train_sd.py``: betas (0.0, 0.999)): the critic's target moves
    opt_g = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.0, 0.999), weight_decay=0.0, foreach=True)
    opt_c = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=cfg.critic_lr or cfg.lr,
                              betas=(0.0, 0.999), weight_decay=0.0, foreach=True)

    ckpt, outputs = find_resume(cfg.resume, cfg.outputs)
    run_dir = Path(outputs)
    run_dir.mkdir(parents=True, exist_ok=True)
    start = 0
    if ckpt is not None:
        start = _resume(ckpt, student, critic, opt_g, opt_c)
        log.info("resumed from %s (step %d)", ckpt, start)
    metrics_path = run_dir / "metrics.jsonl"
    kept = [r for r in read_metrics(metrics_path) if r["step"] <= start] if metrics_path.exists() else []
    rewrite_metrics(metrics_path, kept)
    metrics = MetricsLog(metrics_path)
    saved_config = {**config, "distill": {**asdict(cfg), "timesteps": times.tolist(), "sampler": STUDENT_SAMPLER,
                                          "teacher_cfg_scale": cfg.cfg_scale}}
    checkpointer = Checkpointer(run_dir, cfg.keep_last, False, Dist(device=device), last_step=start or None)
    dmd = DMD2(objective, times)
    log.info("distilling %s into a %d-step student (%s), guidance %.2g, %d critic steps per generator step, "
             "run folder %s", cfg.teacher, cfg.student_steps, f"LoRA rank {cfg.lora_rank}" if cfg.lora_rank
             else "full copy", cfg.cfg_scale, cfg.critic_steps, run_dir)
    window, tic = [], time.perf_counter()
    for step in range(start + 1, cfg.max_steps + 1):
        record = _iteration(dmd, step, cfg, (teacher, student, critic), opt_g, opt_c, m, device, prompts, real)
        window.append(record)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            rate = len(window) / (time.perf_counter() - tic)
            line = mean_records(window) | {"step": step, "steps_per_sec": rate}
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                line |= evaluate(student, times, objective, m, cfg, device)
            metrics.write(line)
            # progress_line's loss is the generator's; a window without a generator step shows the critic's alone
            if "generator_loss" in line:
                log.info("%s | critic %.4f | dmd grad %.3g", progress_line(
                    step, cfg.max_steps, line["generator_loss"], rate, None), line["critic_loss"],
                    line["dmd_grad_norm"])
            else:
                log.info("step %d/%d | critic %.4f | %.2f steps/s", step, cfg.max_steps, line["critic_loss"], rate)
            window, tic = [], time.perf_counter()
        if step % cfg.ckpt_every == 0 or step == cfg.max_steps:
            checkpointer.save(step, _state(student, critic, opt_g, opt_c, cfg.lora_rank),
                              {"config": saved_config})
    metrics.close()
    return run_dir


def _inputs(cfg: DistillConfig, config: dict, device) -> tuple[TextPrompts | None, RealData | None]:
    """(a text teacher's ``--prompt_file`` prompts, ``--data``'s real samples), None where not given. Raises
    UserError: a text teacher without ``--prompt_file`` or with ``--eval_every`` (digits metrics need labels), a class
    teacher with ``--prompt_file``, ``--data`` for a video DiT, and ``TextPrompts``' / ``RealData``'s errors."""
    m = config["model"]
    if m.get("text_dim") is None and cfg.prompt_file is not None:
        raise UserError(f"--prompt_file {cfg.prompt_file}: --teacher {cfg.teacher} is class-conditional (its labels "
                        "are drawn); leave --prompt_file out")
    if m.get("text_dim") is not None and cfg.eval_every:
        raise UserError(f"--eval_every: the digits metrics score a class-conditional student; --teacher {cfg.teacher} "
                        "is text-conditional; give --eval_every 0")
    if cfg.data is not None and is_video_model(m["model"]):
        raise UserError(f"--data {cfg.data}: real samples are for image DiTs so far; {m['model']} is a video model")
    prompts = TextPrompts(cfg.prompt_file, m, cfg.teacher, device) if m.get("text_dim") is not None else None
    return prompts, RealData(cfg.data, config, device, cfg.seed) if cfg.data is not None else None


def nets(teacher, student, critic, cond: dict[str, torch.Tensor], scale: float) -> tuple[Net, Net, Net]:
    """(student, critic, teacher) as ``dmd.DMD2``'s callables (x_t, model timesteps) -> output, for the
    conditions ``cond`` ({"y": labels (B,)} or {"y": caption states (B, L, D_text), "y_mask": (B, L)}): the
    student's and the critic's conditional passes, and the teacher guided at ``scale`` as ``ditforge sample`` guides
    it (``GuidedModel``: u + scale (c - u), u its pass with every row's label or caption dropped)."""
    y, mask = cond["y"], cond.get("y_mask")
    return GuidedModel(student, y, 1.0, mask), GuidedModel(critic, y, 1.0, mask), GuidedModel(teacher, y, scale, mask)


def classifier(critic, cond: dict[str, torch.Tensor]) -> Net:
    """(x_t, model timesteps) -> realism logits (B,): ``critic.gan_head`` on the critic's tokens after the first
    half of its blocks, rounded up (``DiT.features``: the middle of the network, where DMD2 reads its UNet's
    bottleneck), under the conditions ``cond`` (as ``nets``')."""
    depth = (len(critic.blocks) + 1) // 2
    return lambda x, t: critic.gan_head(critic.features(x, t, cond["y"], depth, y_mask=cond.get("y_mask")))


def _iteration(dmd: DMD2, step: int, cfg: DistillConfig, models, opt_g, opt_c, m: dict, device,
               prompts: TextPrompts | None, real: RealData | None) -> dict[str, float]:
    """One iteration: (every ``critic_steps``-th) a generator step, then a critic step. ``models``: (teacher,
    student, critic). Randomness from (seed, step) alone, in this order: the B labels (uniform) or prompts
    (``TextPrompts.draw``), the noise, ``--data``'s B real samples (``RealData.draw``), then ``dmd2_iteration``'s."""
    teacher, student, critic = models
    g = torch.Generator(device).manual_seed(derive_seed(cfg.seed, step))
    cond = ({"y": torch.randint(m["num_classes"], (cfg.batch_size,), generator=g, device=device)} if prompts is None
            else prompts.draw(cfg.batch_size, g))
    frames = [m["num_frames"]] if is_video_model(m["model"]) else []  # (B, C, [T,] H, W), as `ditforge sample` draws
    shape = (cfg.batch_size, m["in_channels"], *frames, m["input_size"], m["input_size"])
    noise = torch.randn(shape, generator=g, device=device)
    gan = None
    if real is not None:
        x_real, real_cond = real.draw(cfg.batch_size, g)
        gan = GANTerms(x_real, classifier(critic, real_cond), classifier(critic, cond), cfg.gen_cls_loss_weight,
                       cfg.guidance_cls_loss_weight)
    gen, fake, guided = nets(teacher, student, critic, cond, cfg.cfg_scale)
    return dmd2_iteration(dmd, step, cfg.critic_steps, gen, guided, fake, noise, g, opt_g, opt_c,
                          [p for p in student.parameters() if p.requires_grad],
                          [p for p in critic.parameters() if p.requires_grad], cfg.max_grad_norm, gan=gan)


def _state(student, critic, opt_g, opt_c, lora: bool) -> dict:
    sampled = student.state_dict() if not lora else merge_lora(copy.deepcopy(student)).state_dict()
    return {"model": get_model_state_dict(student), "ema": {k: v.detach() for k, v in sampled.items()},
            "optimizer": get_optimizer_state_dict(student, opt_g), "critic": get_model_state_dict(critic),
            "critic_optimizer": get_optimizer_state_dict(critic, opt_c)}


def _resume(ckpt: Path, student, critic, opt_g, opt_c) -> int:
    """Load student, critic and both optimizers from ``ckpt``; returns its step."""
    from ditforge.weights.read import read_meta

    state = _state(student, critic, opt_g, opt_c, False)
    state.pop("ema")
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=_SafeLoadPlanner(), no_dist=True)
    except Exception as e:  # DCP's mismatch errors vary
        raise UserError(f"--resume: {ckpt} does not fit this distillation ({e})") from None
    set_model_state_dict(student, state["model"])
    set_model_state_dict(critic, state["critic"])
    set_optimizer_state_dict(student, opt_g, state["optimizer"])
    set_optimizer_state_dict(critic, opt_c, state["critic_optimizer"])
    return int(read_meta(ckpt)["step"])


@torch.no_grad()
def evaluate(student, times, objective, m: dict, cfg: DistillConfig, device) -> dict[str, float]:
    """``--eval_every``: digits-FID, precision, recall and class accuracy of ``eval_samples`` student samples (its
    K steps, no guidance), labels cycling through the classes, batch k seeded by ``derive_seed(seed, k)``."""
    from ditforge.diffusion.dmd import student_loop
    from ditforge.eval.digits import evaluate_digits

    labels = torch.arange(cfg.eval_samples, device=device) % m["num_classes"]
    pixels = []
    for k, y in enumerate(labels.split(256)):
        g = torch.Generator(device).manual_seed(derive_seed(cfg.seed, k))
        noise = torch.randn((len(y), m["in_channels"], m["input_size"], m["input_size"]), generator=g, device=device)
        pixels.append(student_loop(objective, GuidedModel(student, y, 1.0), noise, times,
                                   lambda z: torch.randn(z.shape, generator=g, device=device)))
    result = evaluate_digits(torch.cat(pixels).clamp(-1, 1).cpu(), labels.cpu(), device=device)
    return {f"student_{k}": v for k, v in result.items()}
