"""The settings a training run decides from what it reads rather than from its flags: the default run folder and
model, the pipeline family a run fine-tunes, ``--random_flip``'s and ``--num_workers``' defaults."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import torch.distributed as dist

from ditforge.config.sections import RunConfig
from ditforge.data import BUILTIN_DATASETS, source_of
from ditforge.data.features import read_manifest
from ditforge.data.prefetch import default_num_workers
from ditforge.data.shards import LatentDecoder, ShardData
from ditforge.data.sources import FEATURES
from ditforge.errors import UserError
from ditforge.models.adapters import family_of_pipeline
from ditforge.models.adapters.pipeline import is_adapted_pipeline, read_model_index
from ditforge.parallel.mesh import Dist


DEFAULT_MODELS = {False: "DiT-T/2", True: "vDiT-T/244"}  # by video data


def default_outputs(cfg: RunConfig, d: Dist) -> str:
    data = Path(cfg.data.instance_data or cfg.data.data).name or "data"
    model = f"{cfg.model.model.replace('/', '-')}-" if cfg.model.model else ""
    name = [str(Path("outputs") / f"{data}-{model}{datetime.now():%Y%m%d-%H%M%S}")]
    if d.mesh is not None:  # every rank must write into the folder rank 0 named
        dist.broadcast_object_list(name, src=0)
    return name[0]


def pipeline_family(cfg: RunConfig):
    """The adapter class of the diffusers pipeline the run fine-tunes (``--init_from``, or the one a features folder
    was made from), or None."""
    init = cfg.model.init_from
    if init is None and source_of(cfg.data.data) is FEATURES:
        init = read_manifest(cfg.data.data).get("init_from")
    if init is None or not is_adapted_pipeline(init):
        return None
    return family_of_pipeline(read_model_index(init)["_class_name"])


def settle_flips(cfg: RunConfig, dataset, pre) -> None:
    """``--random_flip``'s default: the data set's, but off for a video pipeline (Wan), whose flips would act on
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
