"""What ``ditforge distill`` of a ditforge DiT draws besides noise: a text-conditional teacher's prompts
(``--prompt_file``, encoded once by the teacher's text encoder) and the real samples of ``--data`` for the GAN head
(DMD2 sec. 4.3), in the model's input space (through the teacher's VAE) with their conditions, as ``ditforge
train`` builds its batches (``data.build_dataset``, ``encoders.BatchEncoder``)."""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from ditforge.errors import UserError


class TextPrompts:
    """``--prompt_file``'s prompts, encoded once by the teacher run's text encoder (its saved ``text_encoder`` and
    ``text_max_length``: the one ``ditforge sample`` loads, ``sample.load.load_prompt_encoder``), each prompt alone
    (``TextEncoder.encode``: its states do not depend on the others), float32 on ``device``.

    Raises:
        UserError: no ``--prompt_file`` (naming it), the prompt file's errors (``read_prompts``), an encoder that
            does not load or gives states of another width than the model's ``text_dim`` (naming ``--teacher``).
    """

    def __init__(self, prompt_file: str | None, spec: dict, teacher: str, device: torch.device):
        from ditforge.data.captions import read_prompts
        from ditforge.encoders.text import load_text_encoder, pad_states

        if prompt_file is None:
            raise UserError(f"--prompt_file: --teacher {teacher} is a text-conditional DiT; give a file of one prompt "
                            "per line")
        self.prompts = read_prompts(None, prompt_file)
        try:
            encoder = load_text_encoder(spec.get("text_encoder"), device, torch.float32, spec.get("text_max_length"))
        except UserError as e:
            raise UserError(f"--teacher {teacher}: cannot load the run's text encoder: {e}") from None
        if encoder.hidden_size != spec["text_dim"]:
            raise UserError(f"--teacher {teacher}: the text encoder {encoder.path} gives {encoder.hidden_size}-wide "
                            f"states, the model expects {spec['text_dim']}")
        parts = [encoder.encode([p]) for p in self.prompts]
        length = max(s.shape[1] for s, _ in parts)
        padded = [pad_states(s, m, length) for s, m in parts]
        self.states = torch.cat([s for s, _ in padded]).float()  # (N, L, D_text)
        self.mask = torch.cat([m for _, m in padded])  # (N, L) bool

    def draw(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """``n`` prompts drawn uniformly (``generator``): {"y": states (n, L, D_text), "y_mask": (n, L) bool}, L the
        longest of the drawn prompts (as ``ditforge sample`` pads a batch: ``sample.load.encode_prompts``)."""
        rows = torch.randint(len(self.prompts), (n,), generator=generator, device=generator.device).to(self.mask.device)
        mask = self.mask[rows]
        length = int(mask.sum(1).max())
        return {"y": self.states[rows, :length], "y_mask": mask[:, :length]}


class RealData:
    """``--data``'s real samples for the GAN head: the data set ``ditforge train`` builds for the spec at the
    teacher's image size (``data.build_dataset``: map-style image data, items (pixels (C, S, S) in [-1, 1], label)
    or captioned images), encoded as training encodes a batch (``BatchEncoder``: the teacher's VAE, a posterior
    sample; its text encoder for captions or class captions).

    Raises:
        UserError (one line, naming ``--data``): streamed shards, video or feature data, samples whose latents are not
            the model's (channels, side), a class teacher and data of another number of classes or without labels;
            and ``build_dataset``'s, ``load_vae``'s, ``load_text_encoder``'s errors.
    """

    def __init__(self, spec: str, config: dict, device: torch.device, seed: int):
        from ditforge.data.sources import CAPTIONED_IMAGES, DIGITS, IMAGE_FOLDER, build_dataset, source_of
        from ditforge.encoders.batch import BatchEncoder
        from ditforge.encoders.text import load_text_encoder
        from ditforge.encoders.vae import load_vae

        m, image_size = config["model"], (config.get("data") or {}).get("image_size")
        if source_of(spec) not in (DIGITS, CAPTIONED_IMAGES, IMAGE_FOLDER):
            raise UserError(f"--data {spec}: distill reads map-style image data (digits, an image folder, captioned "
                            f"images), not {source_of(spec).name}")
        self.dataset = build_dataset(spec, image_size, seed=seed)
        vae = load_vae(m.get("vae"), device, torch.float32, pixel_channels=self.dataset.in_channels)
        side = self.dataset.image_size // vae.downsample
        if (vae.latent_channels, side) != (m["in_channels"], m["input_size"]):
            raise UserError(f"--data {spec}: its samples are {vae.latent_channels} x {side} x {side} in the model's "
                            f"space, the teacher takes {m['in_channels']} x {m['input_size']} x {m['input_size']}")
        text = m.get("text_dim") is not None
        if not text and self.dataset.num_classes != m["num_classes"]:
            raise UserError(f"--data {spec}: {self.dataset.num_classes} classes, the teacher has {m['num_classes']}")
        encoder = load_text_encoder(m.get("text_encoder"), device, torch.float32, m.get("text_max_length")) \
            if text else None
        self.encoder = BatchEncoder("text" if text else "class", vae, encoder,
                                    class_captions=getattr(self.dataset, "class_captions", None))
        self.device = device

    @torch.no_grad()
    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``n`` real samples drawn uniformly (``generator``): (x_0 (n, C, h, w) float32 on the device (a VAE's
        posterior sample, its noise from ``generator``), their conditions as ``BatchEncoder.conditioning``: {"y":
        labels} or {"y": states, "y_mask": mask})."""
        from ditforge.encoders.batch import BatchEncoder, as_batch

        rows = torch.randint(len(self.dataset), (n,), generator=generator, device=generator.device).tolist()
        batch = as_batch(default_collate([self.dataset[i] for i in rows]))
        mean, std = self.encoder.moments(batch, self.device)
        eps = None if std is None else torch.randn(mean.shape, generator=generator, device=self.device)
        return BatchEncoder.draw(mean, std, eps), self.encoder.conditioning(batch, self.device)
