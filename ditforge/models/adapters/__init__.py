"""Denoisers of diffusers pipelines behind ditforge's denoiser call, without copying their code.

An adapter (``DiffusersDenoiser``) holds the diffusers model under the pipeline's component name (``unet`` or
``transformer``, so parameter names are ``unet.<diffusers key>``, the prefix diffusers' LoRA files use), and
gives it ditforge's call ``forward(x, t, force_drop_ids=None, **cond) -> (B, C_out, ...)``; ``cond`` holds the
tensors the family's text encoders produce (``encode_prompt`` of its pipeline), each batch-first. Caption dropout
for classifier-free guidance replaces dropped rows with the encoding of the empty prompt, which is what the
pipelines feed as the unconditional input (their default negative prompt).

Each family declares its repeated blocks (``block_classes``, as diffusers' ``_no_split_modules`` /
``_repeated_blocks``): ``parallel.parallelize`` wraps them for activation checkpointing, compiles them and
shards them, as it does the blocks of ditforge's own models (``ditforge.models.block_paths``). A new family
(a video pipeline such as Wan or CogVideoX) is one more subclass registered in ``FAMILIES``: the trainer does not
change.

Families: ``sd`` (Stable Diffusion 1.x / 2.x) and ``sdxl`` (Stable Diffusion XL), both in ``sd_unet.py``;
``pixart`` (PixArt-alpha / sigma, ``pixart.py``); ``sd3`` (Stable Diffusion 3 / 3.5, ``sd3.py``); ``wan`` and
``wan_i2v`` (Wan 2.1 text-to-video and image-to-video, ``wan.py``: videos (B, C, T, H, W), ``video = True``;
image-to-video also ``image_to_video = True``: conditioning from the first frame, ``encode_image``);
``cogvideox`` and ``cogvideox_i2v`` (CogVideoX 1.0 and 1.5 text- and image-to-video, ``cogvideox.py``: a video
family whose pipeline puts frames before channels, ``frames_first = True``; 1.5's pipelines pad the latent frames,
``padding_frames``); ``ltx`` and ``ltx_i2v`` (LTX-Video text- and
image-to-video, ``ltx.py``: latents packed into tokens inside the adapter, a dynamically shifted flow objective;
image-to-video gives the first latent frame, ``given_frames``);
``hunyuan_video`` and ``hunyuan_video_i2v`` (HunyuanVideo text- and image-to-video, ``hunyuan.py``: guidance-distilled,
``embedded_guidance = True``; image-to-video's Llava text encoder sees the image with the prompt,
``prompt_sees_image``); ``vace`` (Wan2.1-VACE, ``wan_vace.py``: reference images, a control video and mask,
``takes_references``).
Official and diffusers DiT weights load into ditforge's own ``DiT`` (``ditforge.interop``), which is the same
network.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ditforge.models import is_block
from ditforge.models.adapters.limits import TextLimit


def by_expert(t: torch.Tensor, boundary: float, call: Callable[[int, torch.Tensor | slice], torch.Tensor],
              agree: Callable[[list[int]], list[int]] | None = None) -> torch.Tensor:
    """A two-expert pipeline's rule, row by row: row i of a batch at model timesteps ``t`` (B,) runs on the first
    expert (0: ``transformer``, high noise) where t_i >= ``boundary``, else on the second (1: ``transformer_2``);
    ``boundary`` is in model timesteps, the pipeline's ``boundary_ratio`` x the scheduler's ``num_train_timesteps``
    (diffusers' ``WanPipeline.__call__``: ``if boundary_timestep is None or t >= boundary_timestep:
    current_model = self.transformer``, else ``transformer_2``). ``call(expert, rows)``: that expert's output
    (rows first) for the rows ``rows`` (int64 indices), or ``slice(None)``: the whole batch, all on one side (one
    call; indexing with it is a view, no copy). Returns (B, ...) in the batch's order: a batch that straddles the
    boundary is two calls, their rows put back in place (differentiable). Reads the sides on the host (one sync).

    ``agree`` (set from outside where processes of one data-parallel run hold different rows and each expert's
    call holds collectives, FSDP2's gathers or the gradients' all-reduce: ``train.distill_nets``): maps this batch's
    row counts per expert [n_0, n_1] to every process's sums; an expert that another process's rows need but none of
    this batch's runs on one stand-in row (the first) whose output enters the result times 0, so that every process
    calls the same experts in the same order and holds gradients (zero) for the same parameters."""
    first = t >= boundary
    n_first = int(first.sum())
    mine = [n_first, len(t) - n_first]
    runs = mine if agree is None else agree(mine)
    if mine[0] == len(t) and not runs[1]:
        return call(0, slice(None))
    if mine[1] == len(t) and not runs[0]:
        return call(1, slice(None))
    rows = [first.nonzero().flatten(), (~first).nonzero().flatten()]
    parts, stand_in = [], None
    for expert in (0, 1):
        if mine[expert]:
            parts.append((rows[expert], call(expert, slice(None) if mine[expert] == len(t) else rows[expert])))
        elif runs[expert]:  # another process's rows need it: one row of this batch's, weighted 0
            stand_in = 0 * call(expert, rows[1 - expert][:1]).sum()
    out = parts[0][1] if len(parts) == 1 else torch.cat([o for _, o in parts])[
        torch.argsort(torch.cat([r for r, _ in parts]))]
    return out if stand_in is None else out + stand_in


class _Stop(Exception):
    """Ends a forward at ``features``' middle block: ``hook`` raises it with its output, ``forward`` returns that."""

    @staticmethod
    def hook(module: nn.Module, args, out) -> None:  # a block's (hidden states, text states): the first
        raise _Stop(out[0] if isinstance(out, tuple) else out)


class DiffusersDenoiser(nn.Module):
    """Base adapter: a diffusers denoiser with ditforge's call.

    Class attributes set by each family:
        family: short name (``sd``, ``pixart``, ``sd3``).
        pipelines: the diffusers pipeline class names of the family.
        pipeline_kwargs: extra arguments of the pipeline's ``__call__`` when ditforge samples with it.
        component: the pipeline component that is the denoiser (``unet`` / ``transformer``).
        block_classes: class names of the repeated blocks.
        swap_classes: class names of the blocks ``--blocks_to_swap`` counts from the end, which must run in module
            order (``parallel.offload.BlockSwap``); by default ``block_classes`` (a property a family may override).
        default_lora_targets: module names LoRA adapts by default (diffusers' training scripts' defaults).
        video: the denoiser takes videos, x (B, C, T, H, W) (Wan), not images.
        image_to_video: the conditioning includes the clip's first frame (``encode_image``; Wan, CogVideoX and
            LTX-Video I2V).
        context_parallel: where each sample's tokens may be split over processes (``parallel.context``):
            ``"sample"`` and / or ``"train"`` (every video family: both); empty: neither (the image families).
        cp_plan: the context-parallel plan that splits them (``parallel.context.split_tokens``): None, the model's
            own ``_cp_plan`` (diffusers' plan); else a function of no arguments returning ditforge's plan (a dict of
            diffusers' ``ContextParallelInput`` / ``ContextParallelOutput``), which keeps the text whole on every
            process and runs Ulysses alone.
        cp_text: how the attention of ditforge's plan treats the whole text (``parallel.context.split_tokens``):
            None (the model's own plan); ``"joint"``: one attention over [video tokens; text tokens];
            ``"joint_text_first"``: over [text tokens; video tokens]; ``"cross"``: cross-attention over the whole
            text on every process, no exchange.
        attention_calls_sdpa: the transformer's attention processors call PyTorch's SDPA directly, not diffusers'
            dispatcher: ``parallel.context`` catches the joint attention there (``dispatch.intercept_sdpa``).
        vae_frame_factor: the VAE's frame rule: a valid clip has (vae_frame_factor x the VAE's temporal factor) k + 1
            frames (``encoders.VAE``'s ``frame_factor``): 1, or 2 for a decoder that doubles the latent frames twice,
            keeping the first apart only when their count is odd.
        vae_folds_pixels: the VAE's config states its input channels after folding ``patch_size`` x ``patch_size``
            pixels into them (``encoders.VAE``'s ``folds_pixels``).
        vae_split_decode: how the VAE's decode may be split over the processes of torchrun (``sample.video``):
            ``"patch"``, each decoder call cut into bands of rows (``parallel.vae_decode.split_decoder``, exact;
            with ``vae_halo_modules`` and ``vae_whole_modules``); ``"strips"``, its ``tiled_decode`` is the one
            ``parallel.vae_decode.decode_tiles_split`` replays with one column strip a process (approximate; a VAE
            without ``patch_size``). (): process 0 decodes.
        vae_halo_modules: class names of the VAE decoder's layers that pad their own input before an unpadded
            convolution (the causal convolutions): the patch split gives each its halo rows as a whole.
        vae_whole_modules: class names of the decoder's layers that see the whole frame (attention): the patch split
            runs them on the gathered rows.
        embedded_guidance: guidance-distilled (HunyuanVideo): the guidance scale is an input of one pass
            (``denoise(..., guidance=1000 scale)``), not a second, unconditional pass.
        takes_references: the conditioning includes reference images, and optionally a control video and its mask
            (``encode_control``; Wan2.1-VACE): their latents, prepended to the video's by the pipeline, lead the
            latents sampled (``prepended_frames``), dropped before decoding.
        adds_between_blocks: the transformer's forward adds to the hidden states between its repeated blocks
            (Wan2.1-VACE's control hints): First Block Cache, whose skipped pass adds the last full pass's residual
            over the blocks (which held those additions) while the forward adds them again, is refused.
        image_from_generator: sampling draws the image conditioning from the seed's generator, before the noise
            (``encode_image(..., generator=)``; CogVideoX's and LTX-Video's I2V posterior sample), so it is encoded per
            video.
        given_frames: the first latent frames the conditioning gives clean (Wan 2.2 TI2V's and LTX-Video's I2V):
            out of the loss (the objective's ``given_frames``), put back after sampling (``finish``).
        padding_frames: a method: the latent frames the pipeline's loop puts before a clip's and drops before
            decoding (CogVideoX 1.5's, to a multiple of its temporal patch; Wan2.2-Animate's one, the character's
            place), 0 for the others.
        frames_first: the pipeline lays its video latents out (B, T', C, h, w) (CogVideoX), not (B, C, T', h, w);
            its noise is drawn, and its scheduler steps, in that layout.
        image_noise: (mean, std) of log sigma: training noises the first frame's pixels by sigma = exp(mean + std z)
            before encoding it (``encode_image(..., noise_seeds=)``; CogVideoX I2V's recipe), or None.
        prompt_sees_image: the prompt's encoding depends on the first frame (HunyuanVideo I2V: a Llava encoder reads
            the image with the prompt): ``encode_prompt(..., images=)``, without images the black image the pipeline
            pairs with its negative prompt. Such a condition is encoded per clip, never cached per caption.
        masked_self_attention: every self-attention call carries a mask (sampling crops the padding it hides,
            ``trim_padding``, and drops the then full masks, ``dispatch.unmask_full_attention``).
        fps: a video family's frame rate, what ``ditforge sample`` writes its videos at by default.
        compile_whole: ``--compile`` makes one graph for the whole model (``parallel.parallelize`` says why); a
            video family's blocks compile one by one instead.
        text_encoder_trainable: the family can train its text encoder (``--train_text_encoder``).
        pipeline_embeds: conditioning key -> the pipeline ``__call__``'s argument for it (``pipeline_inputs``).
        original_layouts: component (``transformer``, ``vae``) -> its original release's layout
            (``layouts.OriginalLayout``: the inverse of diffusers' single-file converter, as data), read by
            ``weights.original`` (``export --format comfyui``, single files in); {} for a family without one.
    """

    family: str = ""
    pipelines: tuple[str, ...] = ()
    component: str = "transformer"
    block_classes: tuple[str, ...] = ()
    default_lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_kwargs: dict[str, Any] = {}  # extra arguments of the pipeline's __call__ when ditforge samples
    video = False
    image_to_video = False
    takes_references = False
    adds_between_blocks = False
    frames_first = False
    image_from_generator = False
    embedded_guidance = False
    context_parallel: tuple[str, ...] = ()
    cp_plan: Any = None  # None, or a function of no arguments returning a plan (a staticmethod)
    cp_text: str | None = None
    attention_calls_sdpa = False
    vae_frame_factor = 1
    vae_folds_pixels = False
    vae_split_decode: tuple[str, ...] = ()  # "patch", "strips": how torchrun's processes may share the VAE decode
    vae_halo_modules: tuple[str, ...] = ()
    vae_whole_modules: tuple[str, ...] = ()
    # every self-attention call carries a mask: sampling crops the padding it hides (trim_padding) and, with the
    # masks then full, drops them (dispatch.unmask_full_attention), so the fast and 8-bit kernels take the calls
    masked_self_attention = False
    given_frames = 0
    image_noise: tuple[float, float] | None = None
    prompt_sees_image = False
    # the pipeline call's driving videos (``ditforge sample --NAME FILE``): a family sampled by its pipeline's own
    # call from a character image and these videos (``driving_inputs``); () for the others
    driving_videos: tuple[str, ...] = ()
    # those a training batch carries (video CSV columns, ``Pretrained.encode_driving``): their conditioning is the
    # adapter's ``encode_driving``; () for a family that does not train on driving videos
    trained_videos: tuple[str, ...] = ()
    fps = 8  # a video family's frame rate, what ditforge sample writes its videos at by default
    original_layouts: dict[str, Any] = {}  # component -> layouts.OriginalLayout

    def __init__(self, model: nn.Module, vae_scale: int = 8):
        super().__init__()
        setattr(self, self.component, model)
        self.vae_scale = vae_scale  # pixels per latent pixel (conditions that need the image size)
        self.cond_keys: tuple[str, ...] = ()
        self.tokenize = None  # set by attach_text_encoder
        self.expert = 0  # which expert denoises: 0 the component, 1 the second expert (add_expert)
        # with both experts held: forward runs each row on its side's expert (by_expert) at this boundary in model
        # timesteps (``expert_boundary`` x num_train_timesteps); None: ``expert`` alone (fine-tuning switches it)
        self.routing_boundary: float | None = None
        # by_expert's ``agree``: set from outside where processes hold different rows (``train.distill_nets``)
        self.routing_agree: Callable[[list[int]], list[int]] | None = None
        # the pipeline components the expert models fill, in ``expert_models``' order: the component itself, or the
        # low-noise expert's ``<component>_2`` when one expert of two is trained (``pipeline.load_pretrained``)
        self.pipeline_slots: tuple[str, ...] = (self.component,)

    @property
    def compile_whole(self) -> bool:
        """``--compile`` as one graph for the whole model (``parallel.parallelize`` says why an image denoiser's
        step wants it). A video transformer's step is bound by its kernels (seconds of attention at 30k tokens), and
        its identical blocks compile once for all, as diffusers' ``compile_repeated_blocks`` does: the whole
        Wan-1.3B, checkpointed, did not finish compiling within 240 s (H100, 2026-11-28)."""
        return not self.video

    @property
    def swap_classes(self) -> tuple[str, ...]:
        """The blocks ``--blocks_to_swap`` counts: ``block_classes`` unless the family names fewer."""
        return self.block_classes

    @property
    def inner(self) -> nn.Module:
        """The diffusers model that denoises: the component's, or the second expert's while ``expert`` is 1."""
        return getattr(self, f"{self.component}_2" if self.expert else self.component)

    def add_expert(self, model: nn.Module) -> None:
        """A pipeline of two experts trained in one run: ``model``, the pipeline's ``<component>_2`` (the expert
        below ``expert_boundary``), becomes the submodule of that name beside the first, so the adapter's parameter
        names are the pipeline's components' (``transformer.*``, ``transformer_2.*``); ``expert`` picks the one
        that ``forward`` runs (the family's ``denoise`` calls ``inner``)."""
        setattr(self, f"{self.component}_2", model)
        self.pipeline_slots = (self.component, f"{self.component}_2")

    def expert_models(self) -> list[nn.Module]:
        """The diffusers models the adapter trains: its component's, and the second expert's after ``add_expert``."""
        second = getattr(self, f"{self.component}_2", None)
        return [getattr(self, self.component)] + ([second] if second is not None else [])

    @property
    def in_channels(self) -> int:
        return int(self.inner.config.in_channels)

    @property
    def learn_sigma(self) -> bool:
        """True when the model outputs 2C channels (learned variance, as PixArt and DiT)."""
        out = getattr(self.inner.config, "out_channels", None)
        return out is not None and int(out) == 2 * self.in_channels

    text_encoder_trainable = False  # the family can train its text encoder (--train_text_encoder)

    def attach_text_encoder(self, text_encoder: nn.Module, tokenize) -> None:
        """Train ``text_encoder`` with the denoiser: it becomes the submodule ``text_encoder`` (parameter names
        ``text_encoder.<transformers key>``), the conditioning becomes the prompts' token ids (``tokenize``:
        prompts -> ``{"input_ids": (B, L) int64}``) and the forward encodes them (``embed``)."""
        self.text_encoder = text_encoder
        self.tokenize = tokenize

    def embed(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The conditioning tensors of ``cond``: token ids through the attached text encoder, else ``cond``."""
        return cond

    def guidance_inputs(self, scale: float, batch: int, device: torch.device | None = None
                        ) -> dict[str, torch.Tensor]:
        """The conditioning entries a guidance-distilled family (``embedded_guidance``) takes for guidance ``scale``:
        {"guidance": (batch,) float32 1000 x scale}, the tensor its pipeline's call passes the transformer
        (diffusers' ``HunyuanVideoPipeline.__call__``: ``torch.tensor([guidance_scale] * B) * 1000.0``); {} for the
        others, which guide with a second, unconditional pass."""
        if not self.embedded_guidance:
            return {}
        return {"guidance": torch.full((batch,), float(scale), dtype=torch.float32, device=device) * 1000.0}

    @staticmethod
    def unsupported(pipe: Any, sampling: bool = False, expert: str | None = None) -> str | None:
        """Why ditforge cannot fine-tune this pipeline of the family (a variant it does not train yet), or with
        ``sampling`` cannot sample it, or None. ``expert``: ``--expert``, for a pipeline of two experts (Wan 2.2
        A14B); a family without them refuses it."""
        return f"--expert {expert}: for Wan 2.2 A14B's two experts" if expert is not None else None

    def attach_pipeline(self, pipe: Any) -> None:
        """Reads what the family's call needs from its loaded pipeline (LTX-Video: the VAE's temporal factor and the
        call's frame rate); nothing for the others."""

    @staticmethod
    def split_hooks(transformer: nn.Module, group) -> None:
        """Context parallelism (``parallel.context.split_tokens``): the hooks the family's transformer needs once its
        video tokens are split in order over the process ``group`` (HunyuanVideo I2V's token_replace blocks,
        ``hunyuan.first_frame_tokens``); nothing for the others."""

    @staticmethod
    def expert_boundary(pipe: Any) -> float | None:
        """A pipeline of two experts (Wan 2.2 A14B): the boundary b in (0, 1) of its config; the first expert
        (``transformer``) runs sigma >= b (timesteps at and above b x 1000), the second (``transformer_2``) below.
        None for a family of one expert."""
        return None

    def objective_args(self, pipe: Any, expert: str | None, latent_frames: int, height: int, width: int) -> dict:
        """What the family gives ``diffusion.objective.create_objective`` besides the scheduler config, for latents
        of ``latent_frames`` x ``height`` x ``width`` (a bucket's; square data: height = width): ``t_range`` (one
        expert's side of ``expert_boundary``, else (0, 1)), ``given_frames`` (the first latent frames given clean)
        and ``seq_len`` (a video family's latent frames x height x width, which a dynamically shifting scheduler's
        shift follows; None for images).

        Raises:
            TypeError: ``expert`` for a family whose ``expert_boundary`` is None.
        """
        t_range = (0.0, 1.0)
        if expert not in (None, "both"):  # both experts: the whole range (each step's side is drawn from it)
            boundary = self.expert_boundary(pipe)
            if boundary is None:
                raise TypeError(f"{type(self).__name__}.expert_boundary: None, and --expert {expert} was given")
            boundary = float(boundary)
            t_range = (boundary, 1.0) if expert == "high_noise" else (0.0, boundary)
        return {"t_range": t_range, "given_frames": self.given_frames,
                "seq_len": latent_frames * height * width if self.video else None}

    @staticmethod
    def timestep_kwargs(pipe: Any, latent_shape: tuple[int, ...], steps: int) -> dict:
        """Extra arguments of ``scheduler.set_timesteps`` for a video of ``latent_shape`` (B, C, T', h, w), as the
        family's pipeline passes them (LTX-Video: sigmas and the dynamic shift's mu); {} for the others."""
        return {}

    @classmethod
    def text_limits(cls, pipe: Any) -> tuple[TextLimit, ...]:
        """The caption length each text encoder of the family's model takes (``limits.TextLimit``), the first the
        one ``encode_prompt`` passes as ``max_sequence_length`` (``text_length``): from the model's config where it
        fixes one (CogVideoX's ``max_text_seq_length``), else the pipeline's (a CLIP tokenizer's
        ``model_max_length``, the call's ``max_sequence_length`` default). () for a family that encodes no text."""
        return ()

    @classmethod
    def text_length(cls, pipe: Any) -> int:
        """Tokens of the family's main text encoder's states (the first of ``text_limits``): what its
        ``encode_prompt`` truncates and pads the captions to."""
        return cls.text_limits(pipe)[0].length

    @staticmethod
    def prompt_tokens(pipe: Any, text: str, limit: TextLimit) -> int:
        """Tokens ``text`` takes of ``limit`` as the pipeline's ``encode_prompt`` counts them (here: the limit's
        tokenizer, special tokens included, without transformers' too-long warning; HunyuanVideo counts its Llama
        prompt template's)."""
        return len(getattr(pipe, limit.tokenizer)(text, verbose=False).input_ids)

    @staticmethod
    def size_refused(pipe: Any, height: int, width: int, num_frames: int) -> str | None:
        """Why the family's model cannot take frames of ``height`` x ``width`` pixels, ``num_frames`` of them (1 for an
        image family), from its config's fixed sizes (CogVideoX's learned positions, Wan's ``rope_max_seq_len``,
        SD3's ``pos_embed_max_size``), or None. The frame rule and side multiples are checked elsewhere (the VAE's,
        ``Pretrained.side_multiple``); the callers raise UserError with the reason, naming their flags."""
        return None

    @staticmethod
    def call_defaults(pipe: Any) -> dict[str, int]:
        """Defaults of the pipeline call's ``height`` / ``width`` / ``num_frames`` that its signature leaves None
        and its body computes (CogVideoX's from the transformer's config), or that it names otherwise (a driven
        pipeline's clip: one segment, ``segment_frame_length``); {} for the others."""
        return {}

    @staticmethod
    def driving_inputs(pipe: Any, videos: dict[str, list], mode: str | None) -> dict[str, Any]:
        """A ``driving_videos`` family: the pipeline call's arguments for ``videos`` (name -> frames as PIL RGB
        images, the names given) and ``--mode`` (None: the pipeline's default). Raises UserError for a combination
        the pipeline refuses, one line naming the flag."""
        raise TypeError(f"{DiffusersDenoiser.__name__}: driving_inputs of a family without driving_videos")

    @staticmethod
    def null_condition(pipe: Any, empty: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The condition dropped captions get and guidance samples against, given ``empty``, the empty prompt's
        encoding: that encoding, unless the family's pipeline uses another unconditional input by default."""
        return empty

    def set_null_condition(self, cond: dict[str, torch.Tensor]) -> None:
        """The condition of the empty prompt, one row each (``(1, ...)``); dropped rows get it. Kept as
        non-persistent buffers: they follow the model's device and never enter a checkpoint."""
        self.cond_keys = tuple(cond)
        for key, value in cond.items():
            self.register_buffer(f"null_{key}", value[:1].detach().clone(), persistent=False)

    def drop(self, cond: dict[str, torch.Tensor], force_drop_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Replace the rows of ``cond`` where ``force_drop_ids`` (B,) bool is True by the empty prompt's."""
        if force_drop_ids is None or not self.cond_keys:
            return cond
        out = dict(cond)
        for key in self.cond_keys:
            value, null = cond[key], getattr(self, f"null_{key}")
            keep = ~force_drop_ids.view(-1, *[1] * (value.ndim - 1))
            out[key] = torch.where(keep, value, null.to(value.dtype))
        return out

    def forward(self, x: torch.Tensor, t: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                **cond: torch.Tensor) -> torch.Tensor:
        """x: (B, C, H, W) latents; t: (B,) timesteps (int64 DDPM indices, or float 1000 t for flow);
        ``cond``: the family's conditioning tensors. Returns (B, C_out, H, W) in the compute dtype. With
        ``routing_boundary`` set, row i runs on the expert of its t_i (``by_expert``: the pipeline's rule)."""
        cond = self.embed(self.drop(cond, force_drop_ids))
        if self.routing_boundary is None:
            return self._denoise(x, t, cond)

        def on(expert: int, rows: torch.Tensor | slice) -> torch.Tensor:
            self.expert = expert
            return self._denoise(x[rows], t[rows], {k: v[rows] for k, v in cond.items()})

        return by_expert(t, self.routing_boundary, on, self.routing_agree)

    def _denoise(self, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        try:  # features' _Stop, caught inside forward: the other expert's rows still run, FSDP2's root hooks see it end
            return self.denoise(x, t, **cond)
        except _Stop as stop:
            return stop.args[0]

    def denoise(self, x: torch.Tensor, t: torch.Tensor, **cond: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def feature_width(self) -> int:
        """D of ``features``' tokens: the transformer's inner width, its config's heads x head dim (diffusers'
        ``inner_dim`` of every adapted video transformer)."""
        config = self.inner.config
        return int(config.num_attention_heads) * int(config.attention_head_dim)

    def features(self, x: torch.Tensor, t: torch.Tensor, **cond: torch.Tensor) -> torch.Tensor:
        """The critic's features for DMD2's GAN head (Yin et al. 2024 sec. 4.3: its UNet's bottleneck; ditforge's
        ``DiT.features``: the tokens after the first half of its blocks): the hidden states (B, N, ``feature_width``)
        in the compute dtype that the middle one of the transformer's repeated blocks (``block_classes``, in module
        order: index (n - 1) // 2 of n, the first half's last, rounded up) outputs in ``forward(x, t, **cond)`` (a
        block that returns (hidden states, text states) gives the first). A forward hook held for this call only (a
        backward's recompute of a checkpointed block then runs it whole) ends the transformer's forward there
        (``_Stop``): the blocks after it do not run. Differentiable in ``x`` and the parameters before that block.
        With ``routing_boundary`` set (two experts), row i's are the middle block's of the expert owning t_i, put
        back in the batch's order by ``forward``'s ``by_expert``; a stand-in row's (``agree``: an expert this batch
        has no rows for) enters times 0, as in ``forward``. Under context parallelism N is this process's tokens."""
        experts = self.expert_models() if self.routing_boundary is not None else [self.inner]
        blocks = [[m for m in model.modules() if is_block(m, self.block_classes)] for model in experts]
        handles = [chain[(len(chain) - 1) // 2].register_forward_hook(_Stop.hook) for chain in blocks]
        try:
            return self(x, t, **cond)
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def encode_prompt(pipe: Any, texts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """Prompts -> the conditioning tensors, through the pipeline's own ``encode_prompt`` (no guidance); a
        ``prompt_sees_image`` family takes ``images=`` too."""
        raise NotImplementedError

    @staticmethod
    def encode_image(pipe: Any, first: torch.Tensor, num_frames: int, images: list | None = None
                     ) -> dict[str, torch.Tensor]:
        """Image-to-video families: first frames (B, 3, H, W) in [-1, 1] of clips of ``num_frames`` frames (and
        optionally the PIL images the pipeline was given, for its image encoder) -> the image conditioning
        tensors, as the pipeline builds them."""
        raise NotImplementedError

    @staticmethod
    def encode_control(pipe: Any, references: list, video: list | None, mask: list | None, height: int, width: int,
                       num_frames: int, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        """Families that take reference images (``takes_references``): R PIL reference images, a control video and
        its mask (PIL frames, or None for the pipeline's defaults) of a ``height`` x ``width`` x ``num_frames``
        video -> (the control conditioning tensors, as the pipeline builds them, R' = the latent frames they prepend
        to the latents)."""
        raise NotImplementedError

    @staticmethod
    def finish(latents: torch.Tensor, image_cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sampled latents (B, C, T', h, w) after the last step -> the latents to decode: with a given first latent
        frame (``image_cond["first_frame"]`` (1, C, 1, h, w); Wan 2.2 TI2V's and LTX-Video's image-to-video) that
        frame in place of the first, as their pipelines end (Wan's last blend; LTX-Video never steps it); else the
        latents themselves."""
        if "first_frame" not in image_cond:
            return latents
        return with_first_frame(latents, image_cond["first_frame"][:1])

    @staticmethod
    def trim_padding(cond: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
        """Sampling: the loop's conditioning (fixed over its steps) -> (the same with the padding its masks hide
        cropped away, whether every mask the transformer builds from it is then all True). Here: (``cond``, False);
        HunyuanVideo crops its text padding."""
        return cond, False

    @staticmethod
    def start(latents: torch.Tensor, image_cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The initial noise (B, C, T', h, w) float32 -> the latents the pipeline's loop starts from: the noise itself
        (HunyuanVideo I2V mixes in the image's latents)."""
        return latents

    def padding_frames(self, latent_frames: int) -> int:
        """Latent frames the pipeline's loop puts in front of a clip's ``latent_frames`` (its noise drawn with theirs)
        and drops before decoding, for its transformer's patches (CogVideoX 1.5's temporal patches) or the
        conditioning's place (Wan2.2-Animate's character frame); 0 for the others. An image-to-video family's image
        conditioning then covers them too (``ditforge sample`` encodes it for the padded clip)."""
        return 0

    @staticmethod
    def decoded_frames(pipe: Any, frames: torch.Tensor) -> torch.Tensor:
        """The decoded video (B, 3, T, H, W) -> the frames the pipeline returns: all of them (HunyuanVideo I2V's
        latent-concatenation model drops the first latent frame's)."""
        return frames

    pipeline_embeds: dict[str, str] = {}  # conditioning key -> the pipeline __call__'s argument for it

    def pipeline_inputs(self, cond: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None = None
                        ) -> dict[str, torch.Tensor]:
        """The pipeline's ``prompt_embeds``-style arguments for ``cond`` (B rows) and, as the negative prompt,
        ``negative`` (one row, the negative prompt's condition) or else the empty prompt's condition: the pipeline
        then samples without touching its text encoders, and gives what it gives for the prompts as strings (its
        default negative prompt is the empty one)."""
        cond = self.embed(cond)
        null = self.embed(negative if negative is not None
                          else {k: getattr(self, f"null_{k}") for k in self.cond_keys})
        out = {}
        for key, arg in self.pipeline_embeds.items():
            value = cond[key]
            out[arg] = value
            out[arg.replace("prompt_", "negative_prompt_", 1) if arg.startswith("prompt_") else f"negative_{arg}"] = (
                null[key].to(value.dtype).expand_as(value))
        return out


def with_first_frame(x: torch.Tensor, first_frame: torch.Tensor) -> torch.Tensor:
    """Latents x (B, C, T', h, w) with ``first_frame`` (B or 1, C, 1, h, w) in place of their first frame, in x's
    dtype: an image-to-video family's given first latent frame."""
    return torch.cat([first_frame.to(x.dtype).expand(len(x), -1, -1, -1, -1), x[:, :, 1:]], dim=2)


def give_first_frame(x: torch.Tensor, t: torch.Tensor, first_frame: torch.Tensor,
                     patch: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's input when the first latent frame is given clean (image-to-video of Wan 2.2 TI2V and
    LTX-Video): latents x (B, C, T', h, w) with ``first_frame`` (B or 1, C, 1, h, w) in place of their first frame,
    and a timestep per token, 0 for that frame's tokens and t (B,) for the others', frame by frame as the
    transformers order their tokens (``patch`` (p_t, p_h, p_w), p_t = 1): (B, T' x h / p_h x w / p_w), t's dtype.
    The pipelines' first-frame mask times t (``WanImageToVideoPipeline`` with ``expand_timesteps``: ``temp_ts``;
    ``LTXImageToVideoPipeline``: ``t (1 - conditioning_mask)``)."""
    p_t, p_h, p_w = patch
    x = with_first_frame(x, first_frame)
    mask = torch.ones(x.shape[2] // p_t, (x.shape[3] // p_h) * (x.shape[4] // p_w), device=t.device, dtype=t.dtype)
    mask[0] = 0
    return x, mask.flatten()[None] * t[:, None]


def as_images(frames) -> list:
    """Frames (B, 3, H, W) float in [-1, 1] -> B PIL RGB images (``round((x + 1) * 127.5)``, which gives back a
    decoded frame's bytes); a list (of PIL images) is returned as it is. For the image encoders of the pipelines,
    which take PIL images."""
    if isinstance(frames, list):
        return frames
    from PIL import Image

    pixels = ((frames.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(p) for p in pixels]


def call_default(pipe: Any, name: str) -> Any:
    """The default of argument ``name`` of the pipeline's ``__call__`` (``max_sequence_length``, ``frame_rate``, ...):
    what the pipeline encodes and samples with when its caller gives none."""
    import inspect

    return inspect.signature(pipe.__call__).parameters[name].default


def families() -> dict[str, type[DiffusersDenoiser]]:
    """Every adapter class, by its ``family``."""
    from ditforge.models.adapters.cogvideox import CogVideoXDenoiser, CogVideoXI2VDenoiser
    from ditforge.models.adapters.hunyuan import HunyuanVideoDenoiser, HunyuanVideoI2VDenoiser
    from ditforge.models.adapters.ltx import LTXDenoiser, LTXI2VDenoiser
    from ditforge.models.adapters.pixart import PixArtDenoiser
    from ditforge.models.adapters.sd3 import SD3Denoiser
    from ditforge.models.adapters.sd_unet import SDUNetDenoiser, SDXLUNetDenoiser
    from ditforge.models.adapters.wan import WanDenoiser, WanI2VDenoiser
    from ditforge.models.adapters.wan_animate import WanAnimateDenoiser
    from ditforge.models.adapters.wan_vace import WanVACEDenoiser

    return {cls.family: cls for cls in (SDUNetDenoiser, SDXLUNetDenoiser, PixArtDenoiser, SD3Denoiser, WanDenoiser,
                                        WanI2VDenoiser, WanVACEDenoiser, WanAnimateDenoiser, CogVideoXDenoiser,
                                        CogVideoXI2VDenoiser, LTXDenoiser, LTXI2VDenoiser, HunyuanVideoDenoiser,
                                        HunyuanVideoI2VDenoiser)}


def family_of_pipeline(pipeline_class: str) -> type[DiffusersDenoiser] | None:
    """The adapter class for a diffusers pipeline class name, or None."""
    for cls in families().values():
        if pipeline_class in cls.pipelines:
            return cls
    return None


def supported_pipelines() -> list[str]:
    """Pipeline class names ``--init_from`` accepts (DiTPipeline loads into ditforge's own DiT)."""
    return [p for cls in families().values() for p in cls.pipelines] + ["DiTPipeline"]


__all__ = ["DiffusersDenoiser", "call_default", "families", "family_of_pipeline", "supported_pipelines"]
