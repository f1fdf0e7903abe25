"""``ditforge distill --data`` of a pipeline teacher (``distill_pipeline.py``): real clips for DMD2's GAN head (Yin et
al. 2024 secs. 4.3-4.4), read and encoded as ``ditforge train --init_from PIPE --data`` reads and encodes them.

The data: a folder of clips with ``<stem>.txt`` captions (or a blend of such folders), or a CSV / JSONL of path,text
rows (``data.sources.bucket_source``), read by fine-tuning's ``data.buckets.BucketDataset`` at one bucket of exactly the
student's size (``Buckets.exact``: each clip scaled to cover the frame and centre-cropped, its frames at the stride of
the source's ``--frame_interval`` default in ``ditforge train``: consecutive for a folder) and encoded by fine-tuning's
``encoders.batch.pipeline_encoder`` (the pipeline's VAE, a posterior sample; its prompt encoding of the captions; an
image-to-video teacher's first-frame conditioning from the clip). The captions condition the real branch only, as DMD2's
(``main/train_sd.py``: the real images' own text embeddings); the student's prompts stay ``--prompt_file``'s.

The critic's features are its denoiser's ``features`` (the middle repeated block's hidden states, ``models/
adapters``), into ``dmd.GANHead``, the critic's submodule ``gan_head`` (its optimizer's, its checkpoint entry's;
under ``--plugin fsdp`` an FSDP2 unit of its own, ``distill_nets.build_networks``). Under ``--sequence_parallel_size``
its token logits are gathered over the group, and with two experts each row's features are its expert's
(``classifier``).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.data import default_collate

from ditforge.diffusion.dmd import Net
from ditforge.errors import UserError


def refuse_real_data(cfg, den) -> None:
    """Raise UserError (one line, naming ``--data``) where real clips do not run yet: a driven teacher ``den`` (its
    latents lead with the character's frame, its conditioning the driving videos')."""
    if den.trained_videos:
        raise UserError(f"--data {cfg.data}: real clips and the GAN head run with text-, image-to-video and "
                        "reference-image teachers (one expert or two), so far; not with a driven teacher")


class RealClips:
    """``--data``'s real clips at the student's size (module docstring), drawn uniformly.

    Args:
        cfg: the ``DistillConfig``; pre: the teacher's ``Pretrained``; shape: the student's latents (B, C, T', h, w);
        size: (height, width, frames) of its clips; bad_samples_path: where unreadable clips are recorded.

    Raises:
        UserError (one line, naming ``--data``): data of another kind (features, shards, image folders); a clip of
            fewer frames than the student's at the stride, or under ``AREA_FRACTION`` of its frame's pixels;
            latents of another shape than the student's (a reference-image teacher's: its references' frames and
            the clip's); and ``BucketDataset``'s (no usable row).

    A reference-image teacher (``takes_references``): each clip's references as fine-tuning reads them (a folder's
    ``<stem>.ref*.png``, a CSV's ``reference_image`` column, else ``data.video.default_reference`` of the clip,
    one), their latent frames before the clip's in x_0 and the control they build in its conditioning
    (``BatchEncoder.conditioning``'s ``PREFIX``, fine-tuning's step); the student's latents lead with one
    reference's frame only with ``--image``, so its clips then name one reference each (or none).
    """

    def __init__(self, cfg, pre, shape: tuple[int, ...], size: tuple[int, int, int], bad_samples_path):
        from ditforge.data.buckets import AREA_FRACTION, BucketDataset, Buckets
        from ditforge.data.sources import CLIP_FOLDER, bucket_source, source_of
        from ditforge.encoders.batch import pipeline_encoder

        spec, (height, width, frames) = cfg.data, size
        source = source_of(spec)
        if source is not CLIP_FOLDER and not spec.lower().endswith((".csv", ".jsonl")):
            raise UserError(f"--data {spec}: a pipeline teacher's real clips are a folder of clips with <stem>.txt "
                            f"captions or a .csv / .jsonl of path,text rows, not {source.name}")
        interval = source.frame_interval
        self.dataset = BucketDataset(bucket_source(spec, "skip", bad_samples_path),
                                     Buckets.exact(height, width, frames, interval), bad_samples_path, cfg.seed)
        h, w, t = self.dataset.sizes.T
        short = (t - 1) < (frames - 1) * interval
        small = h * w < AREA_FRACTION * height * width
        if (short | small).any():
            i = int((short | small).argmax())
            raise UserError(f"--data {spec}: {int((short | small).sum())} of {len(t)} clips do not fit the student's "
                            f"{width} x {height} x {frames} frames (read at a stride of {interval}, at least "
                            f"{AREA_FRACTION:g} of its pixels), e.g. {self.dataset.paths[i]}: {int(w[i])} x "
                            f"{int(h[i])} x {int(t[i])}; give --width / --height / --num_frames that fit, or other "
                            "clips")
        self.encoder, self.device = pipeline_encoder(pre), pre.device
        self.references, self.seed = pre.denoiser.takes_references, cfg.seed
        mean, _, _ = self._latents(self._batch([0]))
        if tuple(mean.shape[1:]) != tuple(shape[1:]):
            hint = (" (a reference-image teacher's clips lead with their references' latent frames, its student's "
                    "with --image's one)") if self.references else ""
            raise UserError(f"--data {spec}: its clips' latents are {tuple(mean.shape[1:])}, the student's "
                            f"{tuple(shape[1:])}{hint}")

    def _batch(self, rows: list[int]) -> dict:
        from ditforge.data.video import default_references
        from ditforge.encoders.batch import as_batch

        batch = as_batch(default_collate([self.dataset[(i, 0)] for i in rows]))
        if self.references and "references" not in batch:  # fine-tuning's default (train.step)
            batch["references"] = default_references(batch["x"], batch["index"], self.seed)
        return batch

    def _latents(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """(the posterior's mean and std (B, C, R + T', h, w), the conditioning) of ``batch``: a reference-image
        teacher's R reference frames (``PREFIX``) lead, clean (std 0), as fine-tuning's step puts them."""
        cond = self.encoder.conditioning(batch, self.device)
        mean, std, _ = self.encoder.lead_with_prefix(*self.encoder.moments(batch, self.device), cond)
        return mean, std, cond

    @torch.no_grad()
    def draw(self, n: int, generator: torch.Generator, shard: tuple[int, int] = (0, 1)
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rows ``shard`` (this process's index r, the processes k: rows r n / k .. (r + 1) n / k - 1) of ``n``
        real clips drawn uniformly (``generator``: the n indices, then the posterior's noise for the n clips' latents):
        (x_0 (n / k, C, T', h, w) float32 on the device, their conditioning: the captions' and, for an image-to-video
        teacher, the clips' first frames', for a reference-image one its references' control (``_latents``)))."""
        from ditforge.encoders.batch import BatchEncoder

        rows = torch.randint(len(self.dataset), (n,), generator=generator, device=generator.device).tolist()
        b = n // shard[1]
        mine = slice(shard[0] * b, (shard[0] + 1) * b)
        mean, std, cond = self._latents(self._batch(rows[mine]))
        eps = torch.randn((n, *mean.shape[1:]), generator=generator, device=generator.device)[mine].to(self.device)
        return BatchEncoder.draw(mean, std, eps), cond


def classifier(networks, cond: dict[str, torch.Tensor], scale: float, amp: torch.dtype, group=None) -> Net:
    """(x_t, model timesteps) -> realism logits (B,) float32: the critic (``networks.use("critic")``, its module's
    ``features`` under autocast in ``amp``) under the conditions ``cond`` (the B rows' conditioning; a
    guidance-distilled family's embedded ``scale`` added, as ``distill_pipeline.nets`` adds it), into its
    ``gan_head``.

    ``group``: the sequence-parallel group (``--sequence_parallel_size``) whose processes hold the same rows and
    each a slice of their tokens (``parallel.context``): the head's per-token logits are gathered over it
    (``gather_dim1``, whose backward is a reduce-scatter) before their mean, which is then the one process's mean over
    all tokens, on every process. Each process's gradients are then the group's P losses' through its slice: its
    parameters' shares sum over the group to P times one process's gradient, as ``parallel.context``'s
    ``scale_gradient`` makes the prediction's (the average over all processes divides by P again); ``x``, which the
    group's processes hold alike, gets its gradient's mean over the group (``mean_gradient``: one process's).

    A teacher of two experts: ``features`` are each row's expert's (the critic adapter on the expert owning its t,
    ``adapters.by_expert``, with ``forward``'s ``agree`` under torchrun), into one head for both. DMD2 has one
    discriminator, and the realism it learns is the clips', the same at every t; the head's LayerNorm takes each
    token's scale out of either expert's features, and the experts (of one architecture and width, trained from one
    model) are nearer than two heads' separate halves of the real rows, each head then learning from the rows on
    its own side only."""
    module, first = networks.module("critic"), next(iter(cond.values()))
    cond = {**cond, **module.guidance_inputs(scale, len(first), first.device)}  # {} unless guidance-distilled
    from torch.distributed.fsdp import FSDPModule

    from ditforge.parallel.collectives import gather_dim1, mean_gradient

    gather = None if group is None else functools.partial(gather_dim1, group=group)
    # two experts under FSDP2: each one's own unit (its embedders, parallel._apply_fsdp; one expert has none) is
    # resharded after its forward and gathered again by its pre-backward hook, which sits on its output; the backward
    # of the features reaches its embedders through the middle block's output instead, so the unit stays gathered
    # from the forward to its post-backward (the input's gradient's, or FSDP2's final callback's)
    experts = [m for m in module.expert_models() if isinstance(m, FSDPModule)]

    def classify(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        networks.use("critic")
        if group is not None:
            x = mean_gradient(x, group)
        for unit in experts:
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            with torch.autocast(x.device.type, dtype=amp, enabled=amp != torch.float32):
                tokens = module.features(x, t, **cond)
        finally:
            for unit in experts:
                unit.set_reshard_after_forward(True, recurse=False)
        return module.gan_head(tokens, gather=gather)

    return classify
