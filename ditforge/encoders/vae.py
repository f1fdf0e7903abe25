"""Image/video autoencoders: a frozen diffusers ``AutoencoderKL`` (latent space) or the identity (pixel space).

Both share one interface: ``encode(x) -> latents``, ``decode(latents) -> x``, and the properties
``latent_channels``, ``downsample`` and ``scaling_factor``. Images are (B, C, H, W), videos (B, C, T, H, W), pixels
in [-1, 1]. Videos go through the 2-D autoencoder frame by frame (T folded into the batch), in chunks of
``micro_batch`` frames to bound memory, as Open-Sora and Latte do with SD's VAE.

Latents follow diffusers' convention (Stable Diffusion's "scale factor", Rombach et al. 2022, Sec. 4.3.2 / App. G):
``latents = (z - shift_factor) * scaling_factor`` on encode and ``z = latents / scaling_factor + shift_factor`` on
decode, with both factors read from the VAE's config (sd-vae-ft-ema / sd-vae-ft-mse: 0.18215 and no shift; some
image VAEs: a shift too).

A causal 3-D VAE takes whole clips of ``frame_step k + 1`` frames (temporal compression ``temporal``, e.g. 4: k + 1
latent frames, the first frame alone; the family's frame rule, told by the caller from its adapter) and, with
per-channel statistics (``latents_mean`` / ``latents_std`` in its config or as buffers), normalises each latent
channel: ``shift_factor`` = ``latents_mean`` (C,) and ``scaling_factor`` = ``scaling_factor / latents_std`` (C,)
float32 (``scaling_factor`` 1 when the config has none), the tensors the families' pipelines build to un-normalise
(``latents / (1 / latents_std) + latents_mean``; the adapters' docstrings name the files), so the two directions are
the same float32 operations as the pipeline's. Clips are encoded whole, in chunks of ``micro_batch // T`` clips.
``sample=True`` draws ``z = mean + std * eps`` from the encoder's diagonal Gaussian, as fast-DiT's
``extract_features.py`` does with ``latent_dist.sample()``; ``sample=False`` takes the mean.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ditforge.encoders.frozen import FrozenModel
from ditforge.errors import UserError

log = logging.getLogger(__name__)
FLAG = "--vae"
DEFAULT_MICRO_BATCH = 16


def _fold(x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """(B, C, H, W) -> itself, None; (B, C, T, H, W) -> (B*T, C, H, W) in (b, t) order, T."""
    if x.ndim == 4:
        return x, None
    if x.ndim == 5:
        b, c, t, h, w = x.shape
        return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w), t
    raise ValueError(f"expected images (B, C, H, W) or videos (B, C, T, H, W), got shape {tuple(x.shape)}")


def _unfold(y: torch.Tensor, t: int | None) -> torch.Tensor:
    """Inverse of ``_fold``: (B*T, C, H, W) -> (B, C, T, H, W) when t is not None."""
    if t is None:
        return y
    bt, c, h, w = y.shape
    return y.reshape(bt // t, t, c, h, w).permute(0, 2, 1, 3, 4).contiguous()


def _check_input(x: torch.Tensor, channels: int, downsample: int, what: str, source: str) -> None:
    if x.ndim not in (4, 5):
        raise ValueError(f"expected {what} (B, C, H, W) or (B, C, T, H, W), got shape {tuple(x.shape)}")
    if x.shape[1] != channels:
        raise ValueError(f"expected {channels} channels in dim 1 of the {what}, got shape {tuple(x.shape)}")
    h, w = x.shape[-2:]
    if h % downsample or w % downsample:
        raise UserError(f"--image_size: frames of {h}x{w} are not divisible by the VAE's downsample factor "
                        f"{downsample} ({FLAG} {source})")


def _whole_or_eager(module: torch.nn.Module, whole):
    """``module``'s call: ``whole`` (its ``fullgraph`` compiled call), or, from the first call dynamo cannot trace
    whole (a graph break, the recompile limit), its eager call, said in one warning (``VAE.compile``)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, Unsupported

    def call(*args, **kwargs):
        try:
            return whole(*args, **kwargs)
        except (Unsupported, FailOnRecompileLimitHit) as e:
            lines = str(e).splitlines()
            where = [line.strip() for line in lines if line.strip().startswith("File ")]  # dynamo's "from user code"
            log.warning("VAE.compile: %s does not compile whole (%s%s); it runs eagerly", type(module).__name__,
                        lines[0] if lines else type(e).__name__, f", at {where[-1]}" if where else "")
            module._compiled_call_impl = None  # nn.Module's own eager call from now on
            return module._call_impl(*args, **kwargs)

    return call


class VAE(FrozenModel):
    """A frozen diffusers ``AutoencoderKL`` (eval, ``requires_grad_(False)``, run under ``torch.no_grad``).

    A plain class, not an ``nn.Module``, so it never joins a denoiser's parameters or checkpoints. Build it with
    ``load_vae``, or wrap an ``AutoencoderKL`` directly: ``VAE(model)``.

    Attributes:
        model: the ``AutoencoderKL``.
        micro_batch: frames (or images) per encoder/decoder call; the default for ``encode``/``decode``. A 3-D VAE
            takes whole clips: ``micro_batch // T`` of them (at least one) per call.
        temporal: frames per latent frame (``scale_factor_temporal``; 1 for a 2-D VAE, 4 for a typical causal 3-D one).
        frame_step: a valid clip has ``frame_step k + 1`` frames (``valid_frames``): ``frame_factor x temporal``.
        path: the folder it was loaded from ("" when wrapped directly).

    A 3-D VAE's frame rule and a VAE with ``patch_size`` are the family's to state (its adapter declares them:
    ``vae_frame_factor``, ``vae_folds_pixels``), and the caller that holds both passes them: ``frame_factor``, the
    multiple of ``temporal`` a valid clip grows by (2 for a decoder that doubles the latent frames twice); with
    ``folds_pixels`` the config's ``in_channels`` count ``patch_size`` x ``patch_size`` pixels folded into each.

    Raises:
        TypeError: a 3-D VAE without ``frame_factor``, or a config with ``patch_size`` without ``folds_pixels``.
    """

    def __init__(self, model, micro_batch: int = DEFAULT_MICRO_BATCH, path: str = "", frame_factor: int | None = None,
                 folds_pixels: bool | None = None):
        self.model = model.eval().requires_grad_(False)
        self.micro_batch = int(micro_batch)
        self.path = path
        config = model.config
        # > 1: a 3-D VAE taking whole clips (scale_factor_temporal or temporal_compression_ratio in its config, or
        # temporal_compression_ratio as an attribute computed from its blocks)
        self.temporal = int(getattr(config, "scale_factor_temporal", None)
                            or getattr(config, "temporal_compression_ratio", None)
                            or vars(model).get("temporal_compression_ratio") or 1)
        if self.temporal > 1 and frame_factor is None:
            raise TypeError(f"VAE({type(model).__name__}): a 3-D VAE (temporal factor {self.temporal}) needs "
                            "frame_factor, the family's frame rule (its adapter's vae_frame_factor)")
        if getattr(config, "patch_size", None) is not None and folds_pixels is None:
            raise TypeError(f"VAE({type(model).__name__}): a VAE with patch_size needs folds_pixels (its adapter's "
                            "vae_folds_pixels)")
        self.frame_step = self.temporal * (frame_factor or 1)  # frames a valid clip grows by
        self.folds_pixels = bool(folds_pixels)
        self._shift: float | torch.Tensor
        self._scale: float | torch.Tensor
        # per-channel statistics: in the config, or as buffers with the config's scaling factor on top
        # ((z - mean) * scaling_factor / std; the adapters' docstrings name the pipelines' source)
        stats = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if stats[0] is None and "latents_mean" in getattr(model, "_buffers", {}):
            stats = model.latents_mean, model.latents_std
        if stats[0] is not None:
            self._shift = torch.as_tensor(stats[0]).detach().float().cpu()
            self._scale = float(getattr(config, "scaling_factor", None) or 1.0) / torch.as_tensor(
                stats[1]).detach().float().cpu()
        else:
            shift = getattr(config, "shift_factor", None)
            self._shift = float(shift) if shift is not None else 0.0
            self._scale = float(getattr(config, "scaling_factor", 1.0))

    @property
    def latent_channels(self) -> int:
        """Channels of the latents (4 for SD's VAE; a 3-D VAE's ``z_dim``, e.g. 16)."""
        config = self.model.config
        return int(config.z_dim if getattr(config, "latent_channels", None) is None else config.latent_channels)

    @property
    def in_channels(self) -> int:
        """Channels of the pixels (3): the config's, divided by ``patch_size`` ** 2 for a VAE that states them after
        folding its patches of pixels into channels (``folds_pixels``: 12 for 2 x 2 patches), not before (3)."""
        config = self.model.config
        patch = getattr(config, "patch_size", None) if self.folds_pixels else None
        return int(config.in_channels) // (patch or 1) ** 2

    @property
    def downsample(self) -> int:
        """Spatial factor H / h: ``scale_factor_spatial`` where the config has one (e.g. 8), the config's or the
        model's ``spatial_compression_ratio`` (e.g. 32), else 2 ** (len(block_out_channels) - 1) (8 for SD's VAE)."""
        config = self.model.config
        # vars(): some VAEs compute it as an attribute; diffusers' __getattr__ would warn for one in the config
        spatial = (getattr(config, "scale_factor_spatial", None) or getattr(config, "spatial_compression_ratio", None)
                   or vars(self.model).get("spatial_compression_ratio"))
        return int(spatial) if spatial is not None else 2 ** (len(config.block_out_channels) - 1)

    def valid_frames(self, frames: int) -> bool:
        """Whether a clip of ``frames`` frames encodes and decodes back to as many: any count for a 2-D VAE (frame
        by frame), ``frame_step k + 1`` for a 3-D one (frame step 4: 1, 5, 9, ..., the pipelines' rule
        ``num_frames % 4 == 1``; frame step 8: 1, 9, 17, ..., 49)."""
        return frames >= 1 and (self.temporal == 1 or frames % self.frame_step == 1)

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames`` (valid) frames: ``(frames - 1) // temporal + 1``."""
        return (frames - 1) // self.temporal + 1

    def check_frames(self, frames: int, where: str) -> None:
        """Raises UserError (one line naming ``--num_frames``, ``where`` and the valid counts either side) unless
        ``valid_frames(frames)``."""
        if not self.valid_frames(frames):
            k = self.frame_step
            below = (frames - 1) // k * k + 1
            raise UserError(f"--num_frames {frames}: {where} takes {k}k + 1 frames; the nearest valid counts are "
                            f"{below} and {below + k}")

    @property
    def scaling_factor(self) -> float | torch.Tensor:
        """Multiplies latents on encode, divides them on decode (0.18215 for SD's VAE; with per-channel statistics ``1 / latents_std``,
        (C,) float32)."""
        return self._scale

    @property
    def shift_factor(self) -> float | torch.Tensor:
        """Subtracted before scaling on encode, added back on decode (0 unless the config has one; with per-channel statistics
        ``latents_mean``, (C,) float32)."""
        return self._shift

    def _factors(self, like: torch.Tensor) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """(shift, scale) broadcastable against ``like`` (channels in dim 1), on its device and in its dtype."""
        if isinstance(self._scale, float):
            return self._shift, self._scale
        view = (1, -1) + (1,) * (like.ndim - 2)
        return (self._shift.view(view).to(like.device, like.dtype), self._scale.view(view).to(like.device, like.dtype))

    @torch.no_grad()
    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None, sample: bool = True,
               micro_batch: int | None = None) -> torch.Tensor:
        """Pixels -> scaled latents.

        Args:
            x: images (B, 3, H, W) or videos (B, 3, T, H, W), pixels in [-1, 1]; any float dtype and device (cast to
                the VAE's). H and W divisible by ``downsample``.
            generator: the random source for ``sample=True`` (the device it lives on decides where the noise is
                drawn, as ``diffusers.utils.torch_utils.randn_tensor`` does).
            sample: True draws ``z ~ N(mean, std^2)`` from the posterior; False returns the mean.
            micro_batch: frames per encoder call (None: ``self.micro_batch``). The result does not depend on it:
                the noise for ``sample=True`` is drawn once for all frames, in (b, t) order, so with one image batch
                it equals diffusers' ``latent_dist.sample(generator)``.

        Returns:
            latents (B, latent_channels, h, w) or (B, latent_channels, T, h, w), h = H / downsample, in the VAE's
            dtype on its device: ``(z - shift_factor) * scaling_factor``.

        Raises:
            UserError naming ``--image_size`` when H or W is not divisible by ``downsample``; ValueError for a
            wrong rank or channel count.
        """
        z, std, t = self._posterior(x, micro_batch)
        if sample:
            from diffusers.utils.torch_utils import randn_tensor

            eps = randn_tensor(z.shape, generator=generator, device=z.device, dtype=z.dtype)
            z = z + std * eps
        shift, scale = self._factors(z)
        return _unfold((z - shift) * scale, t)

    @torch.no_grad()
    def encode_moments(self, x: torch.Tensor, micro_batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels -> the posterior of the scaled latents, N(mean, std^2), for drawing latents later (training draws
        a fresh ``mean + std * eps`` every step, whether the moments come from here or from stored features).

        Args and shapes as ``encode``. Returns (mean, std), both (B, latent_channels, [T,] h, w) in the VAE's dtype:
        ``(mean_z - shift_factor) * scaling_factor`` and ``std_z * scaling_factor``.
        """
        z, std, t = self._posterior(x, micro_batch)
        shift, scale = self._factors(z)
        return _unfold((z - shift) * scale, t), _unfold(std * scale, t)

    def _calls(self, x: torch.Tensor, micro_batch: int | None) -> tuple[torch.Tensor, int | None, int]:
        """``x`` on the VAE's device and dtype as the model takes it, with T (None for images) and the rows per
        call: a 2-D VAE's frames folded to (B*T, c, h, w), ``micro_batch`` (default ``self.micro_batch``) a call; a
        3-D VAE's whole clips (B, c, T, h, w), ``micro_batch // T`` (at least 1) a call, T None."""
        step = int(micro_batch or self.micro_batch)
        x = x.to(device=self.device, dtype=self.dtype)
        if self.temporal > 1:
            return x, None, max(1, step // x.shape[2])
        frames, t = _fold(x)
        return frames, t, step

    def _posterior(self, x: torch.Tensor, micro_batch: int | None) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Unscaled posterior mean and std of the frames (folded to (B*T, c, h, w)), and T (None for images); a 3-D
        VAE's of whole clips ((B, c, T', h, w), None).

        Raises:
            ValueError: a 3-D VAE given images or a frame count it cannot take (``valid_frames``).
        """
        _check_input(x, self.in_channels, self.downsample, "pixels", self.path)
        if self.temporal > 1 and (x.ndim != 5 or not self.valid_frames(x.shape[2])):
            raise ValueError(f"expected videos (B, C, T, H, W) with T = {self.frame_step} k + 1 frames for a 3-D "
                             f"VAE, got shape {tuple(x.shape)}")
        frames, t, step = self._calls(x, micro_batch)
        means, stds = [], []
        for i in range(0, frames.shape[0], step):
            dist = self.model.encode(frames[i:i + step]).latent_dist
            means.append(dist.mean)
            stds.append(dist.std)
        return torch.cat(means), torch.cat(stds), t

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, micro_batch: int | None = None) -> torch.Tensor:
        """Scaled latents -> pixels.

        Args:
            latents: (B, latent_channels, h, w) or (B, latent_channels, T, h, w), as ``encode`` returns them.
            micro_batch: frames per decoder call (None: ``self.micro_batch``); the result does not depend on it.

        Returns:
            pixels (B, 3, H, W) or (B, 3, T, H, W), H = h * downsample, nominally in [-1, 1] but not clamped (some
            decoders clamp), in the VAE's dtype on its device: ``decoder(latents / scaling_factor + shift_factor)``;
            a 3-D VAE gives ``temporal (T' - 1) + 1`` frames for T' latent frames.
        """
        _check_input(latents, self.latent_channels, 1, "latents", self.path)
        frames, t, step = self._calls(self.unscale(latents), micro_batch)
        out = [self.model.decode(frames[i:i + step]).sample for i in range(0, frames.shape[0], step)]
        return _unfold(torch.cat(out), t)

    def unscale(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents (B, C, ...) -> the decoder's input ``latents / scaling_factor + shift_factor``, on the VAE's
        device in its dtype (per-channel statistics: the pipelines' ``latents / (1 / latents_std) + latents_mean``)."""
        x = latents.to(device=self.device, dtype=self.dtype)
        shift, scale = self._factors(x)
        return x / scale + shift

    def compile(self) -> VAE:
        """``torch.compile`` the decoder in place, whole (``fullgraph``): one graph per decoder call, or none.

        Inductor fuses its GroupNorm + SiLU pairs; no CUDA graphs, since ``decode`` keeps the outputs of several
        micro-batch calls. Shapes are static until a second batch size appears (a shorter last micro-batch), then
        the batch dimension turns dynamic: one recompile, not one per size. A causal 3-D VAE whose decoder runs once
        per latent frame with a feature cache compiles three graphs at its first decode: the first frame (empty
        caches), the second (one-frame caches), and every later frame (its cache lengths dynamic after that second
        size; no graph breaks: measured on a tiny such VAE of diffusers 0.42.1, within 1e-6 of eager;
        benchmarks/vae_decode.py times it).

        Why whole: were dynamo to skip the decoder's own frame (a graph break in it, at or inside the loop over the
        up blocks), it would compile each submodule the decoder calls as a frame of its own, one graph per module
        instance and feature-cache state, and those frames meet dynamo's recompile limit (8) within the first
        decode. The H200 log of ``benchmarks/sample_wan.py --rows fa4_vae16`` (torch 2.11) shows that: the up
        blocks' ``forward`` and the causal convolution's (16 and 96 input channels: the two the decoder calls
        itself) at the limit, the decode at 43.8 s against 1.06 s alone in its process (what breaks it there is not
        known: on the CPU, torch 2.13, the same process state compiles whole). Under ``fullgraph`` a break, or a
        ninth graph, raises while dynamo traces, before the call has run (the feature caches untouched): the
        decoder then runs eagerly from that call on, with one warning naming the reason. Returns self."""
        decoder = self.model.decoder
        decoder.compile(fullgraph=True)
        decoder._compiled_call_impl = _whole_or_eager(decoder, decoder._compiled_call_impl)
        return self

    def __repr__(self) -> str:
        return (f"VAE(path={self.path!r}, latent_channels={self.latent_channels}, downsample={self.downsample}, "
                f"scaling_factor={self.scaling_factor}, shift_factor={self.shift_factor}, dtype={self.dtype}, "
                f"device={self.device})")


class IdentityVAE:
    """Pixel space behind the VAE interface: ``encode`` and ``decode`` return their input (moved/cast to
    ``device``/``dtype``); ``latent_channels`` = ``channels``, ``downsample`` = 1, ``scaling_factor`` = 1."""

    def __init__(self, channels: int = 3, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.channels = int(channels)
        self.device = torch.device(device)
        self.dtype = dtype
        self.micro_batch = DEFAULT_MICRO_BATCH
        self.path = "none"

    latent_channels = property(lambda self: self.channels)
    in_channels = property(lambda self: self.channels)
    downsample = property(lambda self: 1)
    temporal = 1

    def valid_frames(self, frames: int) -> bool:
        """Any positive frame count (pixels are their own latents)."""
        return frames >= 1

    def latent_frames(self, frames: int) -> int:
        """``frames``."""
        return frames

    scaling_factor = property(lambda self: 1.0)
    shift_factor = property(lambda self: 0.0)

    def to(self, device=None, dtype: torch.dtype | None = None) -> "IdentityVAE":
        self.device = torch.device(device) if device is not None else self.device
        self.dtype = dtype or self.dtype
        return self

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None, sample: bool = True,
               micro_batch: int | None = None) -> torch.Tensor:
        """x (B, C, H, W) or (B, C, T, H, W) -> x on ``device`` in ``dtype`` (generator, sample ignored)."""
        _check_input(x, self.channels, 1, "pixels", self.path)
        return x.to(device=self.device, dtype=self.dtype)

    def encode_moments(self, x: torch.Tensor, micro_batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x -> (x on ``device`` in ``dtype``, zeros like it): pixels are their own, noiseless, posterior."""
        x = self.encode(x)
        return x, torch.zeros_like(x)

    def decode(self, latents: torch.Tensor, micro_batch: int | None = None) -> torch.Tensor:
        """latents -> latents on ``device`` in ``dtype``."""
        _check_input(latents, self.channels, 1, "latents", self.path)
        return latents.to(device=self.device, dtype=self.dtype)

    def __repr__(self) -> str:
        return f"IdentityVAE(channels={self.channels}, dtype={self.dtype}, device={self.device})"


def _vae_config(path: str | Path) -> tuple[Path, dict]:
    """The AutoencoderKL folder of ``path`` (itself, or a pipeline's ``vae/``) and its config.json.

    Raises:
        UserError naming ``--vae``: no such folder, no readable config.json, or a config of another class.
    """
    shown = str(path)
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(f"{FLAG} {shown}: no such folder (expected a local diffusers AutoencoderKL folder, or "
                        "'none' for pixel space; nothing is downloaded)")
    if not (root / "config.json").is_file() and (root / "vae" / "config.json").is_file():
        root = root / "vae"
    try:
        config = json.loads((root / "config.json").read_text())
        class_name = config.get("_class_name")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{FLAG} {shown}: no readable config.json ({type(e).__name__}); expected a diffusers "
                        "AutoencoderKL folder") from None
    if class_name != "AutoencoderKL":
        raise UserError(f"{FLAG} {shown}: config.json describes {class_name!r}, expected 'AutoencoderKL'")
    return root, config


def vae_downsample(path: str | Path | None) -> int:
    """The spatial factor of ``--vae path`` without loading its weights: 1 for none (pixel space), else
    ``2 ** (len(block_out_channels) - 1)`` from its config.json (as ``VAE.downsample``).

    Raises:
        UserError: see ``_vae_config``.
    """
    if path is None or str(path).lower() == "none":
        return 1
    return 2 ** (len(_vae_config(path)[1].get("block_out_channels", [64])) - 1)  # diffusers' default: one block


def load_vae(path: str | Path | None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             micro_batch: int = DEFAULT_MICRO_BATCH, pixel_channels: int = 3) -> VAE | IdentityVAE:
    """Loads a frozen ``AutoencoderKL`` from a local folder, or the identity for pixel space.

    Args:
        path: a diffusers ``AutoencoderKL`` folder as written by ``save_pretrained`` (config.json with
            ``"_class_name": "AutoencoderKL"`` and the weights, e.g. stabilityai/sd-vae-ft-ema downloaded
            beforehand), or a diffusers pipeline folder with a ``vae/`` subfolder; loaded with
            ``AutoencoderKL.from_pretrained(path, local_files_only=True)``. None or "none": ``IdentityVAE``.
        device, dtype: where the weights go and their dtype (float32 default; SD's VAE is fine in bfloat16).
        micro_batch: frames per encoder/decoder call (memory bound).
        pixel_channels: the identity's channel count (1 for grey digits); ignored for an AutoencoderKL.

    Returns:
        VAE or IdentityVAE (same interface).

    Raises:
        UserError naming ``--vae`` and the path: missing folder, no config.json, a config of another class, or
        weights that fail to load.
    """
    if path is None or str(path).lower() == "none":
        return IdentityVAE(pixel_channels, device, dtype)
    shown = str(path)
    root, _ = _vae_config(path)

    from diffusers import AutoencoderKL  # deferred: importing diffusers takes seconds

    try:
        model = AutoencoderKL.from_pretrained(str(root), local_files_only=True, torch_dtype=dtype)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UserError(f"{FLAG} {shown}: could not load the AutoencoderKL ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return VAE(model.to(device), micro_batch=micro_batch, path=shown)
