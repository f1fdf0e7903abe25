"""What the forkserver of the multi-process tests imports once (``dist_helpers.spawn``), so that each process
forked from it starts with them: torch's distributed stack, ditforge's trainer and samplers, and diffusers'
pipelines of the families the tests build (their transformers and text encoders, with transformers and peft)."""

import diffusers
import peft  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401

import ditforge.cli  # noqa: F401
import ditforge.sample.video  # noqa: F401
import ditforge.train.trainer  # noqa: F401

for name in ("WanPipeline", "WanImageToVideoPipeline", "CogVideoXPipeline", "HunyuanVideoPipeline", "LTXPipeline",
             "StableDiffusionPipeline"):
    getattr(diffusers, name)  # diffusers imports lazily: this imports the pipeline's module
