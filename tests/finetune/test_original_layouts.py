"""The original-checkpoint layouts the adapters declare (``original_layouts``, read by ``ditforge.weights.original``),
checked against an independent reader, diffusers' own single-file loaders (``from_single_file`` and the converters of
``loaders/single_file_utils.py`` / ``lora_conversion_utils.py``): a tiny model of each class with every parameter
drawn at random, written in its original layout, reads back bit for bit; and the layouts are told apart by their
keys."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ditforge.errors import UserError
from ditforge.models.adapters.hunyuan import HunyuanVideoDenoiser
from ditforge.models.adapters.ltx import LTXDenoiser
from ditforge.models.adapters.wan import WanDenoiser
from ditforge.models.adapters.layouts import declared, find_layout
from ditforge.weights.original import known_layouts, lora_to_original, to_original
from tiny_pipelines import LTX_VAE_090  # tests/finetune is on sys.path

pytestmark = pytest.mark.usefixtures("one_thread")

# The Wan transformer with Wan 2.1 I2V's image embedder and added k / v (the T2V and 2.2 layouts are subsets);
# HunyuanVideo without single-stream blocks, which diffusers' converter splits at a hidden size of 3072 whatever the
# model's (test_hunyuan_single_blocks_at_their_real_width checks them); Wan 2.1's VAE layout (4 stages of 2
# residual blocks, which the converter's flat decoder indices assume); LTX-Video 0.9.0's VAE (likewise its stages).
MODELS = {
    "wan": ("WanTransformer3DModel", WanDenoiser, "transformer", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32, image_dim=4)),
    "wan_vae": ("AutoencoderKLWan", WanDenoiser, "vae", dict(
        base_dim=4, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])),
    "hunyuan_video": ("HunyuanVideoTransformer3DModel", HunyuanVideoDenoiser, "transformer", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=2,
        num_single_layers=0, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4))),
    "ltx": ("LTXVideoTransformer3DModel", LTXDenoiser, "transformer", dict(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=2, caption_channels=32)),
    "ltx_vae": ("AutoencoderKLLTXVideo", LTXDenoiser, "vae", LTX_VAE_090),
}
# diffusers' converters that strip ComfyUI's full-checkpoint prefix (HunyuanVideo's does not; a VAE file has none)
PREFIXED = ("wan", "ltx")


def _layout(name: str):
    """The layout ``MODELS[name]`` is written in: its adapter's for the component (Wan's VAE: 2.1's, the last; 2.2's
    diffusers has no converter of, test_single_file_originals.py reads it)."""
    _, adapter, component, _ = MODELS[name]
    return declared(adapter.original_layouts, component)[-1]


def _random_model(name: str, folder):
    """The tiny model ``MODELS[name]``, every parameter and stored buffer (LTX-Video's ``latents_mean`` /
    ``latents_std``) drawn N(0, 1) (no default init left to hide a wrong map), saved to ``folder`` for its config."""
    import diffusers

    cls, _, _, config = MODELS[name]
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(diffusers, cls)(**config)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.normal_()
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_original_layout_reads_back_through_diffusers(name, tmp_path):
    """``to_original`` -> ``save_file`` -> diffusers' ``Class.from_single_file(file, config=folder)`` equals the model
    exactly (with and without ComfyUI's ``model.diffusion_model.`` prefix where diffusers strips it); and diffusers'
    converter makes of it exactly the model's names: every original key it expects is written, none else."""
    import diffusers
    from diffusers.loaders import single_file_utils as sfu

    cls, adapter, component, _ = MODELS[name]
    model = _random_model(name, tmp_path / "model")
    state = model.state_dict()
    original = to_original(state, _layout(name))
    convert = {"wan": sfu.convert_wan_transformer_to_diffusers, "wan_vae": sfu.convert_wan_vae_to_diffusers,
               "hunyuan_video": sfu.convert_hunyuan_video_transformer_to_diffusers,
               "ltx": sfu.convert_ltx_transformer_checkpoint_to_diffusers,
               "ltx_vae": sfu.convert_ltx_vae_checkpoint_to_diffusers}[name]
    assert set(convert(dict(original))) == set(state)
    for prefix in ("", "model.diffusion_model.") if name in PREFIXED else ("",):
        path = tmp_path / f"single{len(prefix)}.safetensors"
        save_file({prefix + k: v.contiguous() for k, v in original.items()}, str(path))
        loaded = getattr(diffusers, cls).from_single_file(str(path), config=str(tmp_path / "model")).state_dict()
        assert loaded.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(loaded[key], value), (prefix, key)


@pytest.mark.parametrize("name", ["wan", "hunyuan_video", "ltx"])
def test_lora_in_the_original_layout_is_the_update_of_the_original_weights(name, tmp_path):
    """A LoRA (rank 2, alpha 3) with random A and B on every other linear layer of the tiny transformer (so that
    fused weights have parts with and without an adapter, and HunyuanVideo's swapped final norm has one): for each
    original weight, B A alpha / rank of ``lora_to_original`` equals ``to_original`` of the weights with the
    updates added, minus ``to_original`` of the weights (to 1e-6); the weights without an update get no entry."""
    _, adapter, component, _ = MODELS[name]
    layout = _layout(name)
    model = _random_model(name, tmp_path / "model")
    state = model.state_dict()
    g = torch.Generator().manual_seed(11)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    adapted = linears[::2] + (["norm_out.linear"] if name == "hunyuan_video" else [])
    rank, alpha = 2, 3.0
    lora = {}
    for module in adapted:
        out, width = state[f"{module}.weight"].shape
        lora[f"{module}.lora_A.weight"] = torch.randn(rank, width, generator=g)
        lora[f"{module}.lora_B.weight"] = torch.randn(out, rank, generator=g)
    updated = dict(state)
    for module in adapted:
        updated[f"{module}.weight"] = state[f"{module}.weight"] + alpha / rank * (
            lora[f"{module}.lora_B.weight"] @ lora[f"{module}.lora_A.weight"])
    before, after = to_original(state, layout), to_original(updated, layout)
    theirs = lora_to_original(lora, layout, alpha, rows={k: v.shape[0] for k, v in state.items() if v.ndim})
    modules = {k.rsplit(".", 2)[0] for k in theirs if ".lora_" in k}
    assert {k for k in before if not torch.equal(before[k], after[k])} == {f"{m}.weight" for m in modules}
    for m in modules:
        a, b = theirs[f"{m}.lora_A.weight"], theirs[f"{m}.lora_B.weight"]
        torch.testing.assert_close(b @ a * (theirs[f"{m}.alpha"].item() / a.shape[0]),
                                   after[f"{m}.weight"] - before[f"{m}.weight"], rtol=1e-6, atol=1e-5)

def test_hunyuan_single_blocks_at_their_real_width():
    """A single-stream block's q, k, v and MLP input fused into ``linear1`` (and its LoRA in the block form), at
    HunyuanVideo's hidden size 3072 that diffusers' converters split at, on tensors 2 columns wide: the converter
    gives back the block's tensors exactly; the LoRA converter gives each part B_i A_i (rank 3 x 2, its MLP part
    without an adapter zero)."""
    from diffusers.loaders.lora_conversion_utils import _convert_hunyuan_video_lora_to_diffusers
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    layout = HunyuanVideoDenoiser.original_layouts["transformer"]
    g = torch.Generator().manual_seed(5)
    block = "single_transformer_blocks.0."
    rows = {"attn.to_q": 3072, "attn.to_k": 3072, "attn.to_v": 3072, "proj_mlp": 7, "proj_out": 4}
    state = {f"{block}{m}.{p}": torch.randn(n, 2, generator=g) if p == "weight" else torch.randn(n, generator=g)
             for m, n in rows.items() for p in ("weight", "bias")}
    converted = convert_hunyuan_video_transformer_to_diffusers(to_original(state, layout))
    assert converted.keys() == state.keys()
    assert all(torch.equal(converted[k], v) for k, v in state.items())

    rank = 2
    lora = {f"{block}{m}.lora_{ab}.weight": torch.randn(*((rank, 2) if ab == "A" else (rows[m], rank)), generator=g)
            for m in ("attn.to_q", "attn.to_k", "attn.to_v") for ab in "AB"}
    theirs = lora_to_original(lora, layout, alpha=rank, rows={f"{block}{m}.weight": n for m, n in rows.items()})
    assert theirs["single_blocks.0.linear1.alpha"].item() == 3 * rank  # the fused rank 3 r, scale alpha / r kept
    back = _convert_hunyuan_video_lora_to_diffusers({"diffusion_model." + k: v for k, v in theirs.items()
                                                     if not k.endswith(".alpha")})
    for m in rows:
        if m == "proj_out":
            continue
        delta = back[f"transformer.{block}{m}.lora_B.weight"] @ back[f"transformer.{block}{m}.lora_A.weight"]
        expected = (lora[f"{block}{m}.lora_B.weight"] @ lora[f"{block}{m}.lora_A.weight"] if m != "proj_mlp"
                    else torch.zeros(rows[m], 2))
        torch.testing.assert_close(delta, expected, rtol=1e-6, atol=1e-6)


def test_layouts_are_told_apart_by_their_keys(tmp_path):
    """``known_layouts`` holds each declared layout once (the transformers of Wan, HunyuanVideo and LTX-Video;
    the VAEs of Wan 2.2, Wan 2.1 and LTX-Video, Wan 2.2's first; Wan's UMT5 encoder); ``find_layout`` names each one
    from a file's keys, with or without a prefix (LTX-Video's VAE: its release's ``vae.`` too, or none, as ComfyUI's
    VAE files), and refuses diffusers' own names in one line that lists the known layouts."""
    from ditforge.models.adapters.hunyuan import HUNYUAN_VIDEO_TRANSFORMER
    from ditforge.models.adapters.ltx import LTX_VIDEO_TRANSFORMER, LTX_VIDEO_VAE
    from ditforge.models.adapters.wan import WAN22_VAE, WAN_TRANSFORMER, WAN_UMT5, WAN_VAE

    expected = {"transformer": (WAN_TRANSFORMER, LTX_VIDEO_TRANSFORMER, HUNYUAN_VIDEO_TRANSFORMER),
                "vae": (WAN22_VAE, WAN_VAE, LTX_VIDEO_VAE), "text_encoder": (WAN_UMT5,)}
    for component, layouts in expected.items():
        assert known_layouts(component) == {layout.name: layout for layout in layouts}
    for name, (_, _, component, _) in MODELS.items():
        layouts, mine = known_layouts(component), _layout(name)
        model = _random_model(name, tmp_path / name)
        original = [k.removeprefix(mine.prefix) for k in to_original(model.state_dict(), mine)]
        for prefix in ("", "model.diffusion_model.", *([mine.prefix] if mine.prefix else [])):
            key, layout, found = find_layout([prefix + k for k in original], layouts, "--transformer F")
            assert (key, layout, found) == (mine.name, mine, prefix)
        with pytest.raises(UserError) as error:
            find_layout(model.state_dict(), layouts, "--transformer F")
        message = str(error.value)
        assert "--transformer F" in message and "\n" not in message
        assert all(layout.name in message for layout in layouts.values())
