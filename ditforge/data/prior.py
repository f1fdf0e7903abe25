"""DreamBooth's prior preservation for a video pipeline (``--instance_data`` with ``--class_data``): the class clips
of a folder, and the instance buckets paired with them.

Ruiz et al. 2023 (sec. 4.2) train on the model's own samples of the class beside the subject, so that it keeps what
it knew of the class; diffusers' ``examples/dreambooth/train_dreambooth.py`` (``--with_prior_preservation``) puts an
instance and a class sample in each batch and takes ``mse(instance) + prior_loss_weight * mse(class)``. Here the
class samples are clips (``ditforge.sample.class_clips`` draws the missing ones with the base pipeline), read at
the shape of the instance batch's bucket, so that both halves of a step are one batch of one shape
(``train.finetune.interleave_prior``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from ditforge.data.buckets import BucketDataset, read_at_bucket
from ditforge.data.images import load_or_substitute
from ditforge.data.sampler import derive_seed
from ditforge.data.video import DECODE_ERRORS, VIDEO_EXTENSIONS
from ditforge.errors import UserError

CLASS_STREAM = 4099  # the key that sets the class clips' start frames apart from every other draw


def list_class_clips(folder: str | Path) -> list[Path]:
    """The videos directly in ``folder`` (``VIDEO_EXTENSIONS``, hidden names skipped), sorted by name; [] for a
    folder that does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if p.suffix.lower() in VIDEO_EXTENSIONS and not p.name.startswith(".") and p.is_file())


class PriorPairs(Dataset):
    """The instance ``BucketDataset`` with a class clip beside each item: ``dataset[(index, bucket id)]`` is the
    instance item plus ``class_x`` (3, F, h, w) float32 in [-1, 1], class clip ``index mod C`` of ``class_paths``
    (C clips; diffusers' DreamBoothDataset pairs instance i with class image i mod C likewise) read at the same
    bucket (``read_at_bucket``: F frames at the buckets' stride from a start drawn by ``derive_seed(seed,
    CLASS_STREAM, j)``, each frame centre-cropped to (h, w); a 1-frame bucket takes one frame), and ``class_text``
    (``class_prompt``). A class clip that cannot be read at that shape (unreadable, or shorter than F frames) is
    replaced by the next one. Every other attribute is the instance data set's (its buckets, sizes, captions).

    Raises:
        UserError: ``class_paths`` empty (naming ``--class_data``).
    """

    def __init__(self, instances: BucketDataset, class_paths: list[Path], class_prompt: str, folder: str,
                 seed: int = 0):
        if not class_paths:
            raise UserError(f"--class_data {folder}: holds no class clips ({', '.join(VIDEO_EXTENSIONS)})")
        self.instances, self.class_paths, self.class_prompt, self.seed = instances, class_paths, class_prompt, seed

    def __getattr__(self, name: str):
        if name == "instances":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.instances, name)

    def __len__(self) -> int:
        return len(self.instances)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        item = self.instances[key]
        bucket = self.instances.buckets.buckets[key[1]]
        interval = self.instances.buckets.frame_interval

        def load(j: int) -> torch.Tensor:
            x = read_at_bucket(str(self.class_paths[j]), bucket, interval, derive_seed(self.seed, CLASS_STREAM, j))
            return x if self.instances.num_frames is not None else x[:, 0]

        _, x = load_or_substitute(int(item["index"]) % len(self.class_paths), len(self.class_paths), load,
                                  lambda j, e: None, DECODE_ERRORS, len(self.class_paths), "unreadable class clips")
        return item | {"class_x": x, "class_text": self.class_prompt}


def with_class_clips(cfg, instances: BucketDataset, pre, d, draw) -> PriorPairs:
    """The instance buckets paired with ``--class_data``'s clips (``PriorPairs``; ``cfg`` a ``RunConfig``), the
    missing ones drawn first by ``draw`` (``sample.class_clips.draw_class_clips``, on every process of ``d``) with
    the base pipeline ``pre``: up to ``--num_class_images``, at ``--image_size`` squared x ``--num_frames`` (else
    the buckets' most frames), ``--class_sampling_steps`` steps, from ``--seed``.

    Raises:
        UserError: too few clips and no ``draw`` (one line naming ``--class_data``)."""
    data = cfg.data
    if len(list_class_clips(data.class_data)) < data.num_class_images:
        if draw is None:
            raise UserError(f"--class_data {data.class_data}: fewer than --num_class_images {data.num_class_images} "
                            "clips; ditforge train draws the rest (from the command line)")
        draw(pre, data.class_prompt, data.class_data, data.num_class_images, data.image_size,
             data.num_frames or instances.num_frames, data.class_sampling_steps, cfg.train.seed, d)
    return PriorPairs(instances, list_class_clips(data.class_data), data.class_prompt, data.class_data,
                      cfg.train.seed)
