"""diffusers interop: the official DiT state dict (ditforge's own layout) <-> diffusers' ``DiTTransformer2DModel``,
and reading a ``DiTPipeline`` folder (one that ``ditforge export --format diffusers`` writes: ``ditforge.export``).

Key mapping (our own, worked out from the parameter names and shapes of ``DiTTransformer2DModel`` in diffusers
0.42 and from the forward passes of both models; diffusers' ``scripts/convert_dit_to_diffusers.py`` does the same
job for the official .pt):

==========================================  ===========================================================
official DiT (ditforge)                     diffusers DiTTransformer2DModel
==========================================  ===========================================================
x_embedder.proj.{weight,bias}               pos_embed.proj.{weight,bias}
pos_embed (fixed 2-D sin-cos, frozen)       not stored (diffusers recomputes the same table)
t_embedder.mlp.{0,2}                        transformer_blocks.{i}.norm1.emb.timestep_embedder.linear_{1,2}
y_embedder.embedding_table (K+1 rows)       transformer_blocks.{i}.norm1.emb.class_embedder.embedding_table
                                            (always 1001 rows: DiTPipeline's null label is 1000)
blocks.{i}.adaLN_modulation.1               transformer_blocks.{i}.norm1.linear (same 6-way chunk order)
blocks.{i}.attn.qkv (3D, D)                 transformer_blocks.{i}.attn1.to_{q,k,v} (rows split in 3)
blocks.{i}.attn.proj                        transformer_blocks.{i}.attn1.to_out.0
blocks.{i}.mlp.fc{1,2}                      transformer_blocks.{i}.ff.net.{0.proj,2}
final_layer.adaLN_modulation.1              proj_out_1 (shift, scale order as ours)
final_layer.linear                          proj_out_2
==========================================  ===========================================================

diffusers keeps one copy of the timestep / label embedders per block (its final layer uses block 0's); the
export writes the same tensors into every block, the import reads block 0's.

One numerical difference remains, in diffusers and not in the weights: its DiT timestep embedding uses
frequencies ``10000^(-k / (128 - 1))`` (``Timesteps(downscale_freq_shift=1)``) where the official DiT uses
``10000^(-k / 128)``. The same weights therefore give slightly different outputs in the two libraries (the
official diffusers DiT-XL-2 conversion has the same difference). ``use_official_timestep_frequencies`` sets a
loaded diffusers transformer to the official frequencies, after which both compute the same function (test:
tests/test_interop_diffusers.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ditforge.errors import UserError

PIPELINE_NULL_LABEL = 1000  # DiTPipeline.__call__ hard-codes the null label 1000 (ImageNet's 1000 classes)
SPEC_FILE = "ditforge.json"  # our model settings beside model_index.json (diffusers ignores it)


def _num_blocks(state: dict, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in state if k.startswith(prefix)})


def official_to_diffusers(state: dict[str, torch.Tensor], num_classes: int) -> dict[str, torch.Tensor]:
    """Official-layout DiT state dict -> ``DiTTransformer2DModel`` state dict (mapping in the module docstring).

    Args:
        state: ditforge / official DiT tensors (any float dtype; kept as is). ``pos_embed`` is dropped.
        num_classes: the model's class count K <= 1000. Label rows 0..K-1 keep their index; our null row K
            (present when the model was trained with label dropout) moves to row 1000, the pipeline's null
            label; rows K..999 are zero (labels the model never saw).

    Returns:
        A new dict of diffusers keys (tensors are shared or copied, never modified).

    Raises:
        UserError: more than 1000 classes (``--format diffusers``), or not a DiT state dict.
    """
    if num_classes > PIPELINE_NULL_LABEL:
        raise UserError(f"--format diffusers: the model has {num_classes} classes; DiTPipeline's null label is "
                        f"{PIPELINE_NULL_LABEL}, so at most {PIPELINE_NULL_LABEL} classes can be exported")
    try:
        table = state["y_embedder.embedding_table.weight"]
        new_table = table.new_zeros(PIPELINE_NULL_LABEL + 1, table.shape[1])
        new_table[:num_classes] = table[:num_classes]
        if table.shape[0] > num_classes:
            new_table[PIPELINE_NULL_LABEL] = table[num_classes]
        shared = {
            "norm1.emb.timestep_embedder.linear_1.weight": state["t_embedder.mlp.0.weight"],
            "norm1.emb.timestep_embedder.linear_1.bias": state["t_embedder.mlp.0.bias"],
            "norm1.emb.timestep_embedder.linear_2.weight": state["t_embedder.mlp.2.weight"],
            "norm1.emb.timestep_embedder.linear_2.bias": state["t_embedder.mlp.2.bias"],
            "norm1.emb.class_embedder.embedding_table.weight": new_table,
        }
        out = {
            "pos_embed.proj.weight": state["x_embedder.proj.weight"],
            "pos_embed.proj.bias": state["x_embedder.proj.bias"],
            "proj_out_1.weight": state["final_layer.adaLN_modulation.1.weight"],
            "proj_out_1.bias": state["final_layer.adaLN_modulation.1.bias"],
            "proj_out_2.weight": state["final_layer.linear.weight"],
            "proj_out_2.bias": state["final_layer.linear.bias"],
        }
        for i in range(_num_blocks(state, "blocks.")):
            src, dst = f"blocks.{i}.", f"transformer_blocks.{i}."
            for k, v in shared.items():
                out[dst + k] = v.clone()
            for kind in ("weight", "bias"):
                q, k_, v_ = state[f"{src}attn.qkv.{kind}"].chunk(3, dim=0)
                out[f"{dst}attn1.to_q.{kind}"] = q.clone()
                out[f"{dst}attn1.to_k.{kind}"] = k_.clone()
                out[f"{dst}attn1.to_v.{kind}"] = v_.clone()
                out[f"{dst}attn1.to_out.0.{kind}"] = state[f"{src}attn.proj.{kind}"]
                out[f"{dst}norm1.linear.{kind}"] = state[f"{src}adaLN_modulation.1.{kind}"]
                out[f"{dst}ff.net.0.proj.{kind}"] = state[f"{src}mlp.fc1.{kind}"]
                out[f"{dst}ff.net.2.{kind}"] = state[f"{src}mlp.fc2.{kind}"]
    except KeyError as e:
        raise UserError(f"--format diffusers: not a class-conditional DiT state dict (missing {e})") from None
    return out


def diffusers_to_official(state: dict[str, torch.Tensor], num_classes: int, grid_size: int) -> dict[str, torch.Tensor]:
    """``DiTTransformer2DModel`` state dict -> official-layout DiT state dict (inverse of ``official_to_diffusers``).

    Args:
        state: diffusers tensors.
        num_classes: K; the label table keeps rows 0..K-1 and row 1000 (the null label) becomes row K.
        grid_size: tokens per side (input size / patch); ``pos_embed`` is rebuilt as the fixed 2-D sin-cos table
            (``ditforge.models.layers.sincos_2d``, float32 (1, grid^2, D)), as the model itself computes it.

    Returns:
        A new dict with the official key names (``DiT.load_state_dict(strict=True)`` accepts it).

    Raises:
        UserError: a key is missing (not a DiTTransformer2DModel state dict), or the blocks' timestep / label
            embedders differ (diffusers gives each block its own; the official DiT has one, so a converted checkpoint
            holds the same tensors in every block, and another one has no official form).
    """
    from ditforge.models.layers import sincos_2d

    shared = "transformer_blocks.0.norm1.emb."
    for key, value in state.items():
        if ".norm1.emb." in key and not torch.equal(value, state.get(shared + key.split(".norm1.emb.", 1)[1], value)):
            raise UserError(f"--ckpt: the diffusers DiT's blocks have different timestep/label embedders ({key}); "
                            "an official DiT shares one (a model converted from it holds the same in every block)")
    try:
        emb = shared
        table = state[emb + "class_embedder.embedding_table.weight"]
        rows = [table[:num_classes]]
        if table.shape[0] > PIPELINE_NULL_LABEL:
            rows.append(table[PIPELINE_NULL_LABEL:PIPELINE_NULL_LABEL + 1])
        hidden = state["pos_embed.proj.weight"].shape[0]
        out = {
            "x_embedder.proj.weight": state["pos_embed.proj.weight"],
            "x_embedder.proj.bias": state["pos_embed.proj.bias"],
            "pos_embed": sincos_2d(hidden, grid_size).unsqueeze(0),
            "t_embedder.mlp.0.weight": state[emb + "timestep_embedder.linear_1.weight"],
            "t_embedder.mlp.0.bias": state[emb + "timestep_embedder.linear_1.bias"],
            "t_embedder.mlp.2.weight": state[emb + "timestep_embedder.linear_2.weight"],
            "t_embedder.mlp.2.bias": state[emb + "timestep_embedder.linear_2.bias"],
            "y_embedder.embedding_table.weight": torch.cat(rows).clone(),
        }
        for i in range(_num_blocks(state, "transformer_blocks.")):
            src, dst = f"transformer_blocks.{i}.", f"blocks.{i}."
            for kind in ("weight", "bias"):
                out[f"{dst}attn.qkv.{kind}"] = torch.cat([state[f"{src}attn1.to_{n}.{kind}"] for n in "qkv"])
                out[f"{dst}attn.proj.{kind}"] = state[f"{src}attn1.to_out.0.{kind}"]
                out[f"{dst}mlp.fc1.{kind}"] = state[f"{src}ff.net.0.proj.{kind}"]
                out[f"{dst}mlp.fc2.{kind}"] = state[f"{src}ff.net.2.{kind}"]
                out[f"{dst}adaLN_modulation.1.{kind}"] = state[f"{src}norm1.linear.{kind}"]
        for kind in ("weight", "bias"):
            out[f"final_layer.linear.{kind}"] = state[f"proj_out_2.{kind}"]
            out[f"final_layer.adaLN_modulation.1.{kind}"] = state[f"proj_out_1.{kind}"]
    except KeyError as e:
        raise UserError(f"--ckpt: not a diffusers DiTTransformer2DModel state dict (missing {e})") from None
    return out


def ddim_scheduler_config() -> dict:
    """DDIMScheduler settings equal to DiT's diffusion: 1000 linear betas 1e-4..0.02 (``linear_betas``), epsilon
    prediction, no clipping of x_0 (DiT samples VAE latents), alpha_bar = 1 after the last step, and timesteps
    ``leading`` with offset 0, i.e. t = 0, 1000/n, 2*1000/n, ... -- the steps ``create_diffusion`` keeps for the
    section counts ``"1,1,...,1"`` (n ones), with the same previous-step alpha_bar (see the test)."""
    return dict(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                clip_sample=False, set_alpha_to_one=True, steps_offset=0, prediction_type="epsilon",
                timestep_spacing="leading")


def is_diffusers_folder(path: str | os.PathLike) -> bool:
    """True for a diffusers pipeline folder (``model_index.json`` with a ``transformer/``) or a
    ``DiTTransformer2DModel`` folder (``config.json`` whose ``_class_name`` names it)."""
    p = Path(path)
    if (p / "model_index.json").is_file() and (p / "transformer" / "config.json").is_file():
        return True
    try:
        cls = json.loads((p / "config.json").read_text()).get("_class_name", "")
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    return cls in ("DiTTransformer2DModel", "Transformer2DModel")


def load_diffusers(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a diffusers DiT (a ``DiTPipeline`` folder, e.g. one written by ``ditforge.export.export_diffusers`` or
    facebook/DiT-XL-2-256 downloaded beforehand, or its ``transformer/`` folder) as ditforge weights.

    Returns:
        (state dict in the official layout, float32 as stored; config dict ``{"model": spec}`` as
        ``ditforge.sample.load_model`` reads it: spec has model, input_size, in_channels, num_classes,
        learn_sigma, class_dropout_prob and, for a pipeline folder with ``vae/``, ``vae`` = that folder).
        The class count comes from ``ditforge.json`` when the folder has one, else 1000 (DiTPipeline's).

    Raises:
        UserError: unreadable folder, a transformer that is not a DiT, or a width/depth/head count that no
            registered DiT size has.
    """
    from diffusers import DiTTransformer2DModel

    from ditforge.models import infer_dit_config, model_spec

    p = Path(folder)
    sub = "transformer" if (p / "transformer" / "config.json").is_file() else None
    try:
        transformer = DiTTransformer2DModel.from_pretrained(str(p), subfolder=sub, local_files_only=True)
    except (OSError, ValueError, EnvironmentError) as e:
        raise UserError(f"--ckpt {folder}: not a readable diffusers DiT ({' '.join(str(e).split())[:200]})") from None
    cfg = transformer.config
    if cfg.norm_type != "ada_norm_zero" or cfg.num_embeds_ada_norm is None:
        raise UserError(f"--ckpt {folder}: a {cfg.norm_type} transformer, not a class-conditional DiT")
    saved: dict = {}
    if (p / SPEC_FILE).is_file():
        try:
            saved = json.loads((p / SPEC_FILE).read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"--ckpt {folder}: unreadable {SPEC_FILE} ({e})") from None
    num_classes = int(saved.get("num_classes", cfg.num_embeds_ada_norm))
    state = diffusers_to_official(transformer.state_dict(), num_classes, cfg.sample_size // cfg.patch_size)
    spec = infer_dit_config(state)
    heads = model_spec(spec["model"])["num_heads"]
    if heads != cfg.num_attention_heads:
        raise UserError(f"--ckpt {folder}: {cfg.num_attention_heads} attention heads; the registered "
                        f"{spec['model']} has {heads}")
    for key in ("class_dropout_prob",):
        if key in saved:
            spec[key] = saved[key]
    if (p / "vae" / "config.json").is_file():
        spec["vae"] = str(p / "vae")
    return state, {"model": spec}


def use_official_timestep_frequencies(transformer: torch.nn.Module) -> torch.nn.Module:
    """Make a diffusers ``DiTTransformer2DModel`` embed timesteps with the official DiT frequencies
    ``10000^(-k/128)`` (``downscale_freq_shift = 0``) instead of diffusers' ``10000^(-k/127)``; in place, returned.
    Source of the difference: ``CombinedTimestepLabelEmbeddings`` in diffusers' embeddings.py vs
    ``TimestepEmbedder.timestep_embedding`` in facebookresearch/DiT models.py."""
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    return transformer
