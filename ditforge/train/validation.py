"""``--validation_prompts FILE``: the user's own samples, rendered during training (every ``--sample_every`` steps
and at the end) with the weights being trained, into ``RUN/samples/step-NNNNNNN/``.

The file follows musubi-tuner's sample-prompt lines (kohya-ss/musubi-tuner, ``src/musubi_tuner/training/
sampling_prompts.py``: ``load_prompts`` and ``line_to_prompt_dict``): one sample per line; blank lines and lines
starting with ``#`` are skipped; a line is split at every `` --``, the first part is the prompt and each other
part one option, its letter (any case) then a space and the value:

    a corgi on a beach at dusk --w 832 --h 480 --f 81 --s 30 --g 5 --seed 7 --n blurry, low quality
    the corgi runs towards the camera --i first_frame.png --f 33

``--w`` / ``--h`` width and height in pixels, ``--f`` frames, ``--s`` sampling steps, ``--g`` guidance scale,
``--d`` (musubi's letter) or ``--seed`` the noise seed, ``--n`` the negative prompt (the rest of its part, spaces
included), ``--i`` the first frame of an image-to-video pipeline (a path as given, relative to the working folder).
Where ditforge differs from musubi: an unknown option, a bad value, a side that is no multiple of the pipeline's
(``Pretrained.side_multiple``) or a frame count off the VAE's rule is an error naming the file, line and option
(musubi logs a parse error and goes on, and rounds sides down to multiples of 8 and frames to 4k + 1); the
defaults are the run's ``--image_size`` and ``--num_frames`` (musubi: 256 x 256, 1 frame), 20 steps (musubi's),
the pipeline call's default guidance, and seed ``derive_seed(--seed, k)`` for the k-th sample (musubi: a random
one); musubi's ``--l`` (a second guidance scale), ``--fs`` (flow shift) and control options are not taken.

Rendering (``render``, process 0): a diffusers pipeline's run draws through the pipeline's own call
(``generate_with_pipeline``) around the run's own denoiser, a text DiT's through ``previews.sample_grid`` with the
run's own model; the model in eval mode, under ``torch.no_grad`` (and the run's autocast), a LoRA's adapters
active, then back in train mode; no second copy of the weights. A two-expert pipeline's other expert, kept in host
memory for training, visits the device for the validation in the compute dtype and goes back in bf16 (a bf16 ->
wider -> bf16 round trip is exact). A sample of one frame is written as ``NNN-<prompt slug>.png``, a clip as ``.mp4``
(``data.video.write_video``, at the family's ``fps``), both atomically; NNN is the file's line number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch

from ditforge.atomic import atomic_path
from ditforge.config.sections import SHARDED_PLUGINS
from ditforge.data.captions import slug
from ditforge.data.images import open_rgb, to_uint8
from ditforge.data.sampler import derive_seed
from ditforge.errors import UserError
from ditforge.models.adapters import call_default
from ditforge.models.adapters.pipeline import generate_with_pipeline

log = logging.getLogger(__name__)

FLAG = "--validation_prompts"
DEFAULT_STEPS = 20  # musubi-tuner's sample_steps default
# option letter -> (field, type); the letters of musubi-tuner's line_to_prompt_dict, and --seed beside its --d
OPTIONS = {"w": ("width", int), "h": ("height", int), "f": ("frames", int), "s": ("steps", int),
           "g": ("guidance", float), "d": ("seed", int), "seed": ("seed", int), "n": ("negative", str),
           "i": ("image", str)}


@dataclasses.dataclass(frozen=True)
class ValidationSample:
    """One line of the file: its number (from 1), the prompt, and the options given (None: the default, which
    ``fit_samples`` fills in). Pixels, frames, steps; guidance a scale; image a path, ``first_frame`` that file as
    a PIL RGB image."""

    line: int
    prompt: str
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None
    negative: str | None = None
    image: str | None = None
    # the image read at start-up (fit_samples): a file that goes away later does not stop a long run
    first_frame: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        """The file name's stem: the line number and the prompt's start, ``007-a-corgi-on-a-beach``."""
        return f"{self.line:03d}-{slug(self.prompt)}"


def read_validation_prompts(path: str) -> list[ValidationSample]:
    """The samples of ``path`` (UTF-8, the syntax of the module's docstring), in file order.

    Raises:
        UserError: the file cannot be read or holds no sample; a line with no prompt before its options, an
            option not in ``OPTIONS``, one given twice, or a value that is not a positive integer (``--w --h --f
            --s``), an integer >= 0 (``--seed``), a number >= 0 (``--g``) or a non-empty text (``--n --i``); one
            line naming ``path:line`` and the option.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{FLAG} {path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    samples = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line and not line.startswith("#"):
            samples.append(_parse_line(line, number, f"{FLAG} {path}:{number}"))
    if not samples:
        raise UserError(f"{FLAG} {path}: holds no prompt (one sample per line; blank lines and # comments are "
                        "skipped)")
    return samples


def _parse_line(line: str, number: int, where: str) -> ValidationSample:
    prompt, *parts = line.split(" --")
    if prompt.startswith("--") or not prompt.strip():
        raise UserError(f"{where}: expected the prompt first, then its options (--w W --h H ...)")
    values: dict = {}
    for part in parts:
        letter, _, value = part.strip().partition(" ")
        if letter.lower() not in OPTIONS:
            raise UserError(f"{where}: --{letter}: unknown option; expected one of "
                            f"{' '.join('--' + k for k in OPTIONS)}")
        field, kind = OPTIONS[letter.lower()]
        if field in values:
            raise UserError(f"{where}: --{letter}: given twice")
        values[field] = _value(kind, field, value.strip(), f"{where}: --{letter} {value.strip()!r}")
    return ValidationSample(number, prompt.strip(), **values)


def _value(kind: type, field: str, text: str, where: str):
    if kind is str:
        if not text:
            raise UserError(f"{where}: expected a non-empty text")
        return text
    try:
        value = kind(text)
    except ValueError:
        value = None
    if kind is int and (value is None or value < (0 if field == "seed" else 1)):
        raise UserError(f"{where}: expected {'an integer >= 0' if field == 'seed' else 'a positive integer'}")
    if kind is float and (value is None or not value >= 0):
        raise UserError(f"{where}: expected a number >= 0")
    return value


def fit_samples(samples: list[ValidationSample], run) -> list[ValidationSample]:
    """The samples with every default filled in and checked against what the run trains (``run``: a
    ``build.Run`` after ``build_data``), before any step: sides multiples of the pipeline's, frames by its VAE's
    rule, an image for each line of an image-to-video pipeline and for no other, each image readable.

    Raises:
        UserError: one line naming the file, line and option; or naming the setting when the run cannot render
            them: a class-conditional DiT, sharded weights (``--plugin zero2 / fsdp``: every process would have to
            take part), sequence or tensor parallelism (process 0 renders alone).
    """
    cfg, pre = run.cfg, run.pre
    path, data = cfg.train.validation_prompts, cfg.data
    par = cfg.parallel
    split = [f"--{name} {value}" for name, value, splits in (
        ("plugin", par.plugin, par.plugin in SHARDED_PLUGINS),
        ("sequence_parallel_size", par.sequence_parallel_size, par.sequence_parallel_size > 1),
        ("tensor_parallel", par.tensor_parallel, par.tensor_parallel > 1)) if splits]
    if split:
        raise UserError(f"{FLAG}: process 0 renders the samples alone, with the whole model, which {split[0]} "
                        "splits over the processes; use --plugin none or ddp without sequence or tensor "
                        "parallelism, or leave --validation_prompts out")
    if pre is None and cfg.model.condition != "text":
        raise UserError(f"{FLAG}: for a diffusers pipeline (--init_from) or a text-conditioned DiT; this run's "
                        "DiT is class-conditional")
    video = bool(pre.denoiser.video) if pre is not None else run.video
    multiple = pre.side_multiple if pre is not None else None
    guidance = call_default(pre.pipe, "guidance_scale") if pre is not None else 4.0  # the DiT grid's
    fitted = []
    for k, s in enumerate(samples):
        where = f"{FLAG} {path}:{s.line}"
        s = dataclasses.replace(s, width=s.width or data.image_size, height=s.height or data.image_size,
                                frames=s.frames or (data.num_frames if video else 1), steps=s.steps or DEFAULT_STEPS,
                                guidance=guidance if s.guidance is None else s.guidance,
                                seed=derive_seed(cfg.train.seed, k) if s.seed is None else s.seed)
        if pre is None:
            _fits_dit(s, where, data, video)
        else:
            s = _fits_pipeline(s, where, pre, run.inputs.vae, multiple)
        fitted.append(s)
    return fitted


def _fits_pipeline(s: ValidationSample, where: str, pre, vae, multiple: int) -> ValidationSample:
    for letter, side in (("w", s.width), ("h", s.height)):
        if side % multiple:
            raise UserError(f"{where}: --{letter} {side}: {pre.pipeline_class} takes sides that are multiples of "
                            f"{multiple}")
    if not pre.denoiser.video and s.frames != 1:
        raise UserError(f"{where}: --f {s.frames}: {pre.pipeline_class} makes images; leave --f out")
    if pre.denoiser.video and not vae.valid_frames(s.frames):
        raise UserError(f"{where}: --f {s.frames}: {pre.pipeline_class}'s VAE takes {vae.frame_step} k + 1 frames")
    pre.refuse_size(s.height, s.width, s.frames, f"{where}: --h {s.height} --w {s.width} --f {s.frames}")
    if pre.denoiser.video and not pre.denoiser.decoded_frames(pre.pipe, torch.empty(1, 0, s.frames, 0, 0)).shape[2]:
        raise UserError(f"{where}: --f {s.frames}: {pre.pipeline_class} returns none of these frames (it drops the "
                        f"first latent frame's); give {s.frames + vae.frame_step} or more")
    if not pre.denoiser.image_to_video:
        if s.image is not None:
            raise UserError(f"{where}: --i {s.image}: {pre.pipeline_class} takes no image; leave --i out")
        return s
    if s.image is None:
        raise UserError(f"{where}: --i: {pre.pipeline_class} is image-to-video; give the first frame, --i IMAGE")
    return dataclasses.replace(s, first_frame=open_rgb(s.image, f"{where}: --i {s.image}"))


def _fits_dit(s: ValidationSample, where: str, data, video: bool) -> None:
    """A DiT samples at its training size and frames only (its position table is built for them), guided against
    the dropped caption (no negative prompt), from no image."""
    for letter, value, trained in (("w", s.width, data.image_size), ("h", s.height, data.image_size),
                                   ("f", s.frames, data.num_frames if video else 1)):
        if value != trained:
            raise UserError(f"{where}: --{letter} {value}: a DiT run samples at its training size and frames "
                            f"({trained}); leave --{letter} out")
    for letter, value in (("n", s.negative), ("i", s.image)):
        if value is not None:
            raise UserError(f"{where}: --{letter}: a DiT run guides against the dropped caption and takes no image; "
                            f"leave --{letter} out")


def render(run, step: int, draw_dit) -> list[Path]:
    """Render ``run.validation`` with the weights of step ``step`` into ``RUN/samples/step-NNNNNNN/`` (process 0;
    the others return at once): a pipeline's through ``generate_with_pipeline``, a DiT's through ``draw_dit(sample)``
    -> (1, C, [T,] H, W) pixels in [-1, 1] (``previews``', which imports this module). Returns the files written."""
    if not run.d.is_main:
        return []
    folder = run.run_dir / "samples" / f"step-{step:07d}"
    device, model = run.d.device, run.model
    autocast = (torch.autocast(device.type, dtype=run.amp_dtype) if run.amp_dtype != torch.float32
                else contextlib.nullcontext())
    written, start = [], time.perf_counter()
    model.eval()
    try:
        with _other_expert_on(run), torch.no_grad(), autocast:
            for s in run.validation:
                pixels = (_draw(run.pre, s) if run.pre is not None else draw_dit(s))[0]  # (3, [T,] H, W)
                written.append(_write(pixels, folder / s.name, _fps(run)))
    finally:
        model.train()
        if device.type == "cuda":  # the pipeline's activations and the visiting expert's copy
            torch.cuda.empty_cache()
    log.info("step %d: %d validation samples in %s (%.1f s)", step, len(written), folder, time.perf_counter() - start)
    return written


def _draw(pre, s: ValidationSample) -> torch.Tensor:
    images = [s.first_frame] if s.first_frame is not None else None
    with _tiled_decode(pre.pipe.vae):
        return generate_with_pipeline(pre, pre.denoiser, [s.prompt], [s.seed], (s.height, s.width), s.steps,
                                      s.guidance, batch_size=1, num_frames=s.frames if pre.denoiser.video else None,
                                      images=images, negative=s.negative)


@contextlib.contextmanager
def _tiled_decode(vae):
    """The VAE's tiled decode (diffusers' ``enable_tiling``) for the block, then as it was: the whole frames'
    decode was the validation's peak, 1.09 GiB above the training's on a 1.3B video transformer's LoRA at 480 x
    832 x 33 (benchmarks/results/finetune/wan13_h200_validation.json). A sample smaller than a tile decodes
    whole."""
    if not hasattr(vae, "enable_tiling"):
        yield
        return
    was = vae.use_tiling
    vae.enable_tiling()
    try:
        yield
    finally:
        vae.use_tiling = was


def _fps(run) -> int:
    return run.pre.denoiser.fps if run.pre is not None else 8


def _write(pixels: torch.Tensor, stem: Path, fps: int) -> Path:
    """One sample (3, H, W) or (3, T, H, W) in [-1, 1]: one frame as ``stem.png``, more as ``stem.mp4``."""
    frames = to_uint8(pixels[None])[0]  # (H, W, 3) or (T, H, W, 3) uint8
    if frames.ndim == 4 and len(frames) == 1:
        frames = frames[0]
    if frames.ndim == 3:
        from PIL import Image

        path = stem.with_suffix(".png")
        with atomic_path(path) as tmp:
            Image.fromarray(frames).save(tmp, format="PNG")
        return path
    from ditforge.data.video import write_video  # PyAV: ditforge[video]

    return write_video(frames, stem.with_suffix(".mp4"), fps)


@contextlib.contextmanager
def _other_expert_on(run):
    """A two-expert pipeline's expert that the step in flight does not run, on the run's device for the block,
    then back: of a run of one expert (``--expert``), the other, kept in host memory in bf16, in the compute dtype;
    of a run of both (``run.experts``), the idle one's frozen weights where they wait in host memory."""
    if run.experts is not None:
        with run.experts.both_on():
            yield
        return
    pre = run.pre
    slots = (pre.denoiser.component, f"{pre.denoiser.component}_2") if pre is not None else ()
    other = next((getattr(pre.pipe, name) for name in slots if name not in pre.denoiser.pipeline_slots
                  and getattr(pre.pipe, name, None) is not None), None)
    if other is None:
        yield
        return
    dtype = run.amp_dtype if run.amp_dtype != torch.float32 else next(pre.denoiser.inner.parameters()).dtype
    other.to(run.d.device, dtype)
    try:
        yield
    finally:
        other.to("cpu", torch.bfloat16)