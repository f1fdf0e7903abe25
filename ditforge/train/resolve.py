"""The one resolution of a training run's settings: every default the run decides from what it opened (the
pretrained pipeline, the data set) rather than from its flags, computed once before the model and optimizer are
built (``resolve``); the pipeline family a run fine-tunes, ``--random_flip``'s and ``--num_workers``' defaults."""

from __future__ import annotations

import logging
import math
import os

from ditforge.config.sections import RunConfig
from ditforge.data import BUILTIN_DATASETS, source_of
from ditforge.data.features import read_manifest
from ditforge.data.prefetch import default_num_workers
from ditforge.data.shards.decode import LatentDecoder
from ditforge.data.shards.loader import ShardData
from ditforge.data.sources import FEATURES
from ditforge.diffusion.objective import create_objective
from ditforge.errors import UserError
from ditforge.models.adapters import family_of_pipeline
from ditforge.models.adapters.pipeline import is_adapted_pipeline, read_model_index
from ditforge.models.adapters.single_file import component_files
from ditforge.weights.lora import lora_targets
from ditforge.train.build import Run

log = logging.getLogger(__name__)


def resolve(run: Run) -> RunConfig:
    """The run's settings resolved, once the run folder, the pretrained pipeline and the data set are open
    (``build.open_run``, ``load_init``, ``build_data``) and before the model and optimizer are built: no periodic
    samples for one expert of two, the flips, the shard streams and loader workers, the class count, the
    learning rate's default (by the model and the optimizer asked, before a memory budget may change the
    optimizer), the objective (which a diffusers family's scheduler config decides; the config records its kind
    and shift, ``run.diffusion`` holds it) and the LoRA targets. Returns ``run.cfg``.

    Raises:
        UserError: ``--random_flip`` for an image-to-video pipeline, class conditioning on data without labels,
            ``--num_classes`` below the data's, or an objective the pipeline's scheduler does not give.
    """
    cfg, d, pre, dataset = run.cfg, run.d, run.pre, run.dataset
    t, m = cfg.train, cfg.model
    if pre is not None and m.expert is not None and t.sample_every:  # the pipeline's grid would need both experts
        log.info("--expert %s: no periodic samples (the other expert stays in host memory); draw them "
                 "with ditforge sample --ckpt RUN", m.expert)
        t.sample_every = 0
    settle_flips(cfg, dataset, pre)
    if isinstance(dataset, ShardData) and cfg.data.data_streams is None:
        cfg.data.data_streams = math.gcd(t.batch_size, math.lcm(16, d.dp_size))  # >= 16 and every rank its streams
    if cfg.data.num_workers is None:
        cfg.data.num_workers = default_workers(dataset, cfg.data, d.dp_size)
    if not dataset.num_classes and m.condition == "class":  # captioned images have no labels
        raise UserError(f"--data {cfg.data.data} holds captioned images, no class labels; use --condition text")
    if m.num_classes is None:
        m.num_classes = dataset.num_classes or None
    elif m.num_classes < dataset.num_classes and m.condition == "class":
        raise UserError(f"--num_classes {m.num_classes}: the data has {dataset.num_classes} classes")
    if t.lr is None and t.optimizer == "adafactor":  # its lr is a relative step size: the paper's 1e-2
        t.lr = 1e-2
    if t.lr is None:  # the tiny model trains well (and fast enough for a CPU) at 1e-3; see benchmarks/digits_quality.py --sweep
        t.lr = (1e-4 if m.lora_rank else 1e-5) if pre is not None else 1e-3 if "-T/" in m.model else 1e-4
    # the family's part (an expert's side of the schedule, given frames, the sequence a dynamic shift follows)
    family = pre.denoiser.objective_args(pre.pipe, m.expert, m.num_frames, m.input_size) if pre is not None else {}
    diffusion = create_objective(m.objective, m.learn_sigma, pre.scheduler_config if pre is not None else None,
                                 m.flow_shift, m.weighting_scheme, m.logit_mean, m.logit_std,
                                 where=f"--init_from {m.init_from}", device=run.d.device, **family)
    m.objective = {"flow": "flow", "v_prediction": "v", "epsilon": "ddpm"}[diffusion.prediction_type]
    if m.objective == "flow":
        m.flow_shift = diffusion.shift
    run.diffusion = diffusion
    if m.lora_rank:  # a diffusers family's default targets, else a DiT's
        m.lora_target_modules = lora_targets(pre.denoiser if pre is not None else None, cfg)
    return cfg


def pipeline_family(cfg: RunConfig):
    """The adapter class of the diffusers pipeline the run fine-tunes (``--init_from``, or the one a features folder
    was made from), or None."""
    init = cfg.model.init_from
    if init is None and source_of(cfg.data.data) is FEATURES:
        init = read_manifest(cfg.data.data).get("init_from")
    replaced = tuple(component_files(cfg.model))
    if init is None or not is_adapted_pipeline(init, replaced):
        return None
    return family_of_pipeline(read_model_index(init, replaced=replaced)["_class_name"])


def settle_flips(cfg: RunConfig, dataset, pre) -> None:
    """``--random_flip``'s default: the data set's, but off for a video pipeline, whose flips would act on
    the latents of a 3-D VAE (not mirror-symmetric: the flipped clip's latents are not the flipped latents); on
    asked explicitly it flips those latents (text-to-video), and an image-to-video pipeline refuses it: its
    conditioning (the first frame's latents and CLIP states) is not flipped with them.

    Raises:
        UserError: ``--random_flip`` for an image-to-video pipeline.
    """
    video_pipeline = pre is not None and pre.denoiser.video
    if cfg.data.random_flip is None:
        cfg.data.random_flip = False if video_pipeline else getattr(dataset, "random_flip", True)
    elif cfg.data.random_flip and video_pipeline and pre.denoiser.image_to_video:
        raise UserError(f"--random_flip: {pre.pipeline_class} conditions on the unflipped first frame, and flips "
                        "act on the latents; leave --random_flip off")


def default_workers(dataset, data, dp_size: int) -> int:
    """``--num_workers`` when not given. Built-in sets (decoded once, kept) and features folders (memory-mapped
    slices): 0. Latent shards: 1, off the training process, where reading them in-process cost 3.5 ms a step
    (14 ms at the 90th percentile, when a window of shards is opened) and each worker's batch costs about
    1.7 ms to receive (8 workers: 13.8 ms a step) on an H100 host, DiT-XL/2 batch 64 (benchmarks/data_loading.py).
    Image files and raw shards: ``default_num_workers``; for shards the largest count up to it that splits this
    process's streams evenly."""
    if not isinstance(dataset, ShardData):
        in_memory = data.data in BUILTIN_DATASETS or getattr(dataset, "manifest", None) is not None
        return 0 if in_memory else default_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if isinstance(dataset.decoder, LatentDecoder):
        return 1
    most, streams = default_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", 1))), max(data.data_streams // dp_size, 1)
    return max(w for w in range(1, most + 1) if streams % w == 0)
