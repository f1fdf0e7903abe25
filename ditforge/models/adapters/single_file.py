"""Single-file checkpoints in place of a pipeline folder's components: ``--transformer`` / ``--transformer_2`` /
``--vae`` / ``--text_encoder FILE`` beside ``--init_from`` / ``--ckpt FOLDER``. The folder gives each component's
config and what no single file holds (tokenizers, scheduler, the other components).

Layouts (``load_component``; the family's facts are its adapter's declaration ``original_layouts``, whose
``detect`` keys ``layouts.find_layout`` looks for):

* diffusers': the keys of the component's own ``state_dict`` (a folder's weights file taken alone);
* the original release's: one of the layout's ``detect`` keys is there (e.g. a transformer's output modulation);
  a release's ``diffusion_pytorch_model-0000K-of-0000N.safetensors`` shards are read through their
  ``.index.json`` (either file may be given), a torch pickle (a VAE's or a text encoder's ``.pth``) through
  ``torch.load(mmap=True, weights_only=True)``; a component may have several (Wan 2.1's and 2.2's VAEs), tried in
  the adapter's order;
* ComfyUI's: the original keys, with or without a prefix (``layouts.PREFIXES``: ``model.diffusion_model.``; a
  VAE's without the ``vae.`` its release's checkpoint gives it, ``OriginalLayout.prefix``), in
  bf16, fp16 or float8 e4m3, "scaled" float8 included: a ``scaled_fp8`` marker tensor and a float32
  ``<layer>.scale_weight`` scalar per float8 weight, whose value is ``weight x scale_weight`` (ComfyUI
  ``comfy/model_detection.py`` ``model_config_from_unet`` reads the marker, ``comfy/ops.py`` ``scaled_fp8_ops``
  ``convert_weight`` multiplies);
* a text encoder: transformers' keys of its class (ComfyUI's ``umt5_xxl_*.safetensors`` are so), or its original
  release's where the adapter declares one (Wan's ``models_t5_umt5-xxl-enc-bf16.pth``).

Reading is lazy, tensor by tensor (safetensors ``safe_open``), each tensor cast on its own to the load dtype, so
host memory peaks at the loaded model plus one tensor (``benchmarks/single_file.py`` measures it). A scaled float8
weight is dequantised exactly as ComfyUI does, ``weight.float() * scale_weight`` in float32, then cast; where the
caller keeps float8 (``keep_fp8``: ``--fp8_base``) a float8 tensor stays float8, a scaled weight with its scale
beside it (the layer's ``scale_weight``), applied when the float8 base upcasts it.

The keys are converted by diffusers' own converter of the class, the one ``from_single_file`` calls
(``SINGLE_FILE_LOADABLE_CLASSES[class]["checkpoint_mapping_fn"]``), or, for a layout diffusers has no converter of
(``OriginalLayout.diffusers_converts`` False), by the layout's renames inverted (``layouts.from_original``), and the
tensors are assigned to the model built on the meta device from the folder's config (``load_state_dict(assign=True)``). ``from_single_file`` itself is not
called: it casts every floating tensor to one dtype (``load_model_dict_into_meta``, then ``model.to(torch_dtype)``),
which would upcast a float8 file's weights and, from a file, read the whole state dict before casting it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from ditforge.errors import UserError
from ditforge.models.adapters.layouts import declared, find_layout, from_original

# The components a single file may replace, each with its flag (the same name).
COMPONENTS = ("transformer", "transformer_2", "vae", "text_encoder")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SHARD = re.compile(r"-\d{5}-of-\d{5}(?=\.safetensors$)")
_PICKLES = (".pth", ".pt", ".bin", ".ckpt")


def component_files(section) -> dict[str, str]:
    """The single files a config section names (``ModelConfig`` or ``SampleConfig``: the fields of
    ``COMPONENTS``), by component. A folder is none (``--vae`` / ``--text_encoder`` of a DiT run, and the
    pipeline's own ``vae/`` a run records), nor is ``none``."""
    return {n: str(v) for n in COMPONENTS
            if (v := getattr(section, n, None)) not in (None, "none") and not Path(v).is_dir()}


def _open(file: Path, flag: str, stack: ExitStack) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """The keys of a checkpoint file and a reader of one tensor by key (lazy: nothing is read before it is asked)."""
    from safetensors import safe_open

    if file.suffix in _PICKLES:
        try:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # a legacy (non-zip) pickle cannot be memory-mapped
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise UserError(f"{flag} {file}: not a readable torch checkpoint ({type(e).__name__}: {e})") from None
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        if not isinstance(state, dict):
            raise UserError(f"{flag} {file}: a torch pickle of a {type(state).__name__}, expected a state dict")
        return list(state), state.pop
    if _SHARD.search(file.name):  # a release's shards: their index lies beside them
        file = file.with_name(_SHARD.sub("", file.name) + ".index.json")
    if file.name.endswith(".json"):
        try:
            weight_map = json.loads(file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{flag} {file}: expected a safetensors index with a weight_map ({e})") from None
        shards = {s: stack.enter_context(safe_open(str(file.parent / s), "pt"))
                  for s in sorted(set(weight_map.values()))}
        return list(weight_map), lambda k: shards[weight_map[k]].get_tensor(k)
    try:
        handle = stack.enter_context(safe_open(str(file), "pt"))
    except Exception as e:  # safetensors raises its own error types for a file that is none
        raise UserError(f"{flag} {file}: not a readable .safetensors file ({e})") from None
    return list(handle.keys()), handle.get_tensor


def _tensors(keys: list[str], get: Callable[[str], torch.Tensor], prefix: str, dtype: torch.dtype,
             keep_fp8: bool, kept: list) -> Iterator[tuple[str, torch.Tensor]]:
    """(key without ``prefix``, tensor cast to ``dtype``) one at a time; ComfyUI's scale tensors are folded into
    their weights (``weight.float() * scale_weight``), its ``scaled_fp8`` marker and the tokenizer it may store in
    a text encoder's file (``spiece_model``, read by ``comfy/sd.py``; the folder's tokenizer is used) dropped.
    Under ``keep_fp8`` a float8 tensor stays float8, and a scaled one is appended to ``kept`` with its scale
    ((tensor, float32 0-d scale))."""
    scales = {k.removesuffix(".scale_weight"): k for k in keys if k.endswith(".scale_weight")}
    for key in keys:
        name = key.removeprefix(prefix) if prefix else key
        if name.endswith((".scale_weight", ".scale_input")) or name.rsplit(".", 1)[-1] in ("scaled_fp8",
                                                                                              "spiece_model"):
            continue
        t = get(key)
        module = key.removesuffix(".weight")
        scale = get(scales[module]).float() if key.endswith(".weight") and module in scales else None
        if keep_fp8 and t.dtype in FP8:
            if scale is not None:
                kept.append((t, scale))
            yield name, t
            continue
        if scale is not None:
            t = t.float() * scale
        yield name, t.to(dtype) if t.is_floating_point() else t


def load_component(folder: Path, name: str, kind: tuple[str, str], file: str, family, dtype: torch.dtype,
                   keep_fp8: bool = False, flag: str | None = None) -> torch.nn.Module:
    """The pipeline component ``name`` (``model_index.json``'s ``kind``: library, class) built from ``folder``'s
    config and filled from the single file ``file``, its floating tensors in ``dtype`` (unscaled float8 ones kept
    under ``keep_fp8``), frozen, on the CPU. ``family``: the pipeline's adapter class (its ``original_layouts``
    tell the original and ComfyUI layouts).

    Raises:
        UserError (one line naming ``flag`` and the file): a missing or unreadable file; a layout that is none of
            the known ones (they are listed); a file whose tensors do not fill the model (missing, unexpected or
            misshapen keys).
    """
    import diffusers
    import transformers
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    flag = flag or f"--{name}"
    path = Path(file)
    if not path.is_file():
        raise UserError(f"{flag} {file}: no such file")
    library, cls_name = kind
    cls = getattr(diffusers if library == "diffusers" else transformers, cls_name)
    sub = str(folder / name)
    layouts = declared(family.original_layouts, name.removesuffix("_2"))  # the 2nd expert: the 1st's
    convert = SINGLE_FILE_LOADABLE_CLASSES.get(cls_name, {}).get("checkpoint_mapping_fn")
    # the layouts there is a reader of: diffusers' converter of the class, or the layout's own renames
    usable = {layout.name: layout for layout in layouts if convert or not layout.diffusers_converts}
    with ExitStack() as stack:
        keys, get = _open(path, flag, stack)
        with init_empty_weights():
            if library == "diffusers":
                config = cls.load_config(sub, local_files_only=True)
                model = cls.from_config(config)
            else:
                config = transformers.AutoConfig.from_pretrained(sub, local_files_only=True)
                model = cls(config)
        try:  # an original layout's mark first: some original names are diffusers' too (patch_embedding)
            _, layout, prefix = find_layout(keys, usable, f"{flag} {file}")
            original = True
        except UserError:
            original, layout, prefix = False, None, ""
            if not set(keys) & set(model.state_dict()):
                known = [f"{library}' {cls_name} keys"] + list(usable)
                raise UserError(f"{flag} {file}: an unknown layout for the folder's {cls_name} (known: "
                                f"{'; '.join(known)})") from None
        if original and layout.prefix:  # its own tensors alone: a release's checkpoint holds the transformer too
            keys = [k for k in keys if k.startswith(prefix)]
        kept: list = []
        state = dict(_tensors(keys, get, prefix, dtype, keep_fp8, kept))
    if original and layout.prefix:  # under the prefix diffusers' converter expects, which ComfyUI's files lack
        state = {layout.prefix + k: v for k, v in state.items()}
    if original and not layout.diffusers_converts:  # renamed by the layout itself, the tensors as read
        state = from_original(state, layout)
    elif original:  # a split fused tensor is a view: made contiguous, as from_single_file does
        state = {k: v.contiguous() for k, v in convert(checkpoint=state, config=config).items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # misshapen tensors: a file of another size of the model
        mismatch = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:200])
        raise UserError(f"{flag} {file}: its tensors do not fit the folder's {cls_name} ({mismatch})") from None
    if library != "diffusers":
        model.tie_weights()  # an encoder's tied embeddings: stored once (T5's shared and embed_tokens)
        missing = [k for k in missing if model.get_parameter(k).device.type == "meta"]
    if missing or unexpected:
        raise UserError(f"{flag} {file}: its tensors do not fill the folder's {cls_name} (missing "
                        f"{', '.join(sorted(missing)[:3]) or '-'}; unexpected "
                        f"{', '.join(sorted(unexpected)[:3]) or '-'})")
    if kept:
        _attach_scales(model, kept)
    return model.requires_grad_(False).eval()


def _attach_scales(model: torch.nn.Module, kept: list) -> None:
    """Each layer whose float8 weight was kept scaled gets its ``scale_weight`` (a plain float32 0-d tensor
    attribute, outside the state dict), for the float8 base's casting (``train.finetune.store_base_in_fp8``). The
    weight is found by memory: diffusers' converter renames a tensor or splits a fused one into views of it."""
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes, s) for t, s in kept]
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype in FP8:
            at = weight.data_ptr()
            module.scale_weight = next((s for low, high, s in spans if low <= at < high), None)
