"""The original files of the layouts diffusers has no single-file converter of, read by ditforge itself
(``OriginalLayout.diffusers_converts`` False, ``layouts.from_original``): Wan 2.2's VAE (``Wan2.2_VAE.pth``, ComfyUI's
``wan2.2_vae.safetensors``) and Wan's own UMT5 text encoder (``models_t5_umt5-xxl-enc-bf16.pth``).

The files are written by this test's own maps, built from the original modules' structure and not from ditforge's
layouts: each diffusers / transformers module is taken by attribute and named as its counterpart in Wan's
``wan/modules/vae2_2.py`` / ``wan/modules/t5.py``. Two checks keep those maps honest: the VAE file's names and
shapes equal those the original ``WanVAE_`` builds for the same config (``_wan22_structure``, from its
constructors), and the text encoder file run through a float64 forward of Wan's ``T5Encoder`` written here from
``t5.py`` gives transformers' states."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ditforge import cli

pytestmark = pytest.mark.usefixtures("one_thread")

# a Wan 2.2 VAE with every kind of tensor: widening stages (residual shortcuts), a decoder of its own width, 2
# residual blocks a stage, temporal down- and upsampling in two stages of three
RICH_VAE = dict(base_dim=4, decoder_base_dim=6, z_dim=8, in_channels=12, out_channels=12, is_residual=True,
                patch_size=2, latents_mean=[0.0] * 8, latents_std=[1.0] * 8, dim_mult=[1, 2, 2, 2], num_res_blocks=2,
                scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True])


def _tensors(prefix: str, modules: dict, out: dict) -> None:
    for name, module in modules.items():
        for p, t in module.named_parameters(recurse=False):
            out[f"{prefix}{name}.{p}"] = t.detach()


def _residual(prefix: str, block, out: dict) -> None:
    """``vae2_2.ResidualBlock``: ``residual`` = Sequential(RMS_norm, SiLU, conv, RMS_norm, SiLU, Dropout, conv),
    ``shortcut`` a 1 x 1 x 1 conv where the width changes."""
    parts = {"residual.0": block.norm1, "residual.2": block.conv1, "residual.3": block.norm2,
             "residual.6": block.conv2}
    if isinstance(block.conv_shortcut, torch.nn.Conv3d):
        parts["shortcut"] = block.conv_shortcut
    _tensors(prefix, parts, out)


def _coder_ends(coder: str, model, out: dict) -> None:
    """``Encoder3d`` / ``Decoder3d``: ``conv1``, ``middle`` = (ResidualBlock, AttentionBlock, ResidualBlock), ``head`` =
    (RMS_norm, SiLU, conv)."""
    mid = model.mid_block
    _tensors(f"{coder}.", {"conv1": model.conv_in, "middle.1.norm": mid.attentions[0].norm,
                           "middle.1.to_qkv": mid.attentions[0].to_qkv, "middle.1.proj": mid.attentions[0].proj,
                           "head.0": model.norm_out, "head.2": model.conv_out}, out)
    _residual(f"{coder}.middle.0.", mid.resnets[0], out)
    _residual(f"{coder}.middle.2.", mid.resnets[1], out)


def _wan22_original(vae) -> dict[str, torch.Tensor]:
    """A diffusers Wan 2.2 ``AutoencoderKLWan``'s tensors under ``WanVAE_``'s names: the stages
    (``Down_ResidualBlock`` / ``Up_ResidualBlock``) hold their residual blocks and then their ``Resample``
    (``resample`` = Sequential(pad or upsample, Conv2d), ``time_conv``) in one ``downsamples`` / ``upsamples`` list;
    the quant convs are ``conv1`` / ``conv2``."""
    out: dict[str, torch.Tensor] = {}
    for coder, blocks, kind in (("encoder", vae.encoder.down_blocks, "downsamples"),
                                ("decoder", vae.decoder.up_blocks, "upsamples")):
        for i, block in enumerate(blocks):
            for j, resnet in enumerate(block.resnets):
                _residual(f"{coder}.{kind}.{i}.{kind}.{j}.", resnet, out)
            resample = block.downsampler if coder == "encoder" else block.upsampler
            if resample is not None:
                assert isinstance(resample.resample[1], torch.nn.Conv2d)
                parts = {"resample.1": resample.resample[1]}
                if hasattr(resample, "time_conv"):
                    parts["time_conv"] = resample.time_conv
                _tensors(f"{coder}.{kind}.{i}.{kind}.{len(block.resnets)}.", parts, out)
        _coder_ends(coder, getattr(vae, coder), out)
    _tensors("", {"conv1": vae.quant_conv, "conv2": vae.post_quant_conv}, out)
    return out


def _wan22_structure(dim: int, dec_dim: int, z: int, mult: list[int], n: int, down: list[bool]) -> dict:
    """The names and shapes of ``vae2_2.WanVAE_(dim, dec_dim, z, mult, n, temperal_downsample=down)``'s tensors,
    from its constructors: 12 = 3 x 2 x 2 patchified channels in and out; encoder widths ``dim x [1] + mult``,
    stage i of n residual blocks, then a ``Resample`` unless last (its ``time_conv`` (b, b, 3, 1, 1) where
    ``down[i]``); decoder widths ``dec_dim x [mult[-1]] + mult[::-1]``, stages of n + 1 blocks, its upsampling
    ``time_conv`` (2b, b, 3, 1, 1) where ``down[::-1][i]``."""
    s: dict[str, tuple] = {}

    def conv(name, cout, cin, *kernel):
        s[f"{name}.weight"], s[f"{name}.bias"] = (cout, cin, *kernel), (cout,)

    def res(p, cin, cout):
        s[p + "residual.0.gamma"], s[p + "residual.3.gamma"] = (cin, 1, 1, 1), (cout, 1, 1, 1)
        conv(p + "residual.2", cout, cin, 3, 3, 3)
        conv(p + "residual.6", cout, cout, 3, 3, 3)
        if cin != cout:
            conv(p + "shortcut", cout, cin, 1, 1, 1)

    def ends(coder, width, outer, outer_in):
        res(f"{coder}.middle.0.", width, width)
        s[f"{coder}.middle.1.norm.gamma"] = (width, 1, 1)
        conv(f"{coder}.middle.1.to_qkv", 3 * width, width, 1, 1)
        conv(f"{coder}.middle.1.proj", width, width, 1, 1)
        res(f"{coder}.middle.2.", width, width)
        s[f"{coder}.head.0.gamma"] = (outer_in, 1, 1, 1)
        conv(f"{coder}.head.2", outer, outer_in, 3, 3, 3)

    for coder, widths, blocks, kind, time in (
            ("encoder", [dim * u for u in [1, *mult]], n, "downsamples", down),
            ("decoder", [dec_dim * u for u in [mult[-1], *mult[::-1]]], n + 1, "upsamples", down[::-1])):
        conv(f"{coder}.conv1", widths[0], 12 if coder == "encoder" else z, 3, 3, 3)
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            for j in range(blocks):
                res(f"{coder}.{kind}.{i}.{kind}.{j}.", a if j == 0 else b, b)
            if i != len(mult) - 1:
                conv(f"{coder}.{kind}.{i}.{kind}.{blocks}.resample.1", b, b, 3, 3)
                if i < len(time) and time[i]:
                    conv(f"{coder}.{kind}.{i}.{kind}.{blocks}.time_conv", b if coder == "encoder" else 2 * b, b,
                         3, 1, 1)
        ends(coder, widths[-1] if coder == "encoder" else widths[0], 2 * z if coder == "encoder" else 12,
             widths[-1])
    conv("conv1", 2 * z, 2 * z, 1, 1, 1)
    conv("conv2", z, z, 1, 1, 1)
    return s


def _load(folder, name: str, kind: tuple[str, str], path, dtype=torch.float32):
    from ditforge.models.adapters.single_file import load_component
    from ditforge.models.adapters.wan import WanDenoiser

    return load_component(folder, name, kind, str(path), WanDenoiser, dtype)


def _assert_equal(ours: dict, ref: dict) -> None:
    assert ours.keys() == ref.keys()
    assert all(ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]) for k in ref)


def test_wan22_vae_files_read_exactly(tmp_path):
    """A Wan 2.2 VAE (``RICH_VAE``, every tensor drawn N(0, 1)) written in the original names as ``Wan2.2_VAE.pth``
    (a torch pickle) and as ComfyUI's ``wan2.2_vae.safetensors`` (the same names; float32, and bf16 read into bf16):
    the file's names and shapes are the original ``WanVAE_``'s, and ``--vae``'s reader gives the diffusers model's
    state dict exactly, from each."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(7)
    vae = AutoencoderKLWan(**RICH_VAE)
    with torch.no_grad():
        for t in vae.state_dict().values():
            t.normal_()
    vae.save_pretrained(str(tmp_path / "pipe" / "vae"))
    original = _wan22_original(vae)
    c = RICH_VAE
    assert {k: tuple(v.shape) for k, v in original.items()} == _wan22_structure(
        c["base_dim"], c["decoder_base_dim"], c["z_dim"], c["dim_mult"], c["num_res_blocks"], c["temperal_downsample"])
    assert len(original) == len(vae.state_dict())
    pth, comfy, half = tmp_path / "Wan2.2_VAE.pth", tmp_path / "wan2.2_vae.safetensors", tmp_path / "bf16.safetensors"
    torch.save(original, pth)
    save_file({k: v.contiguous() for k, v in original.items()}, str(comfy))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in original.items()}, str(half))
    kind = ("diffusers", "AutoencoderKLWan")
    ref = vae.state_dict()
    for path in (pth, comfy):
        _assert_equal(_load(tmp_path / "pipe", "vae", kind, path).state_dict(), ref)
    _assert_equal(_load(tmp_path / "pipe", "vae", kind, half, torch.bfloat16).state_dict(),
                  {k: v.to(torch.bfloat16) for k, v in ref.items()})


def _umt5_original(encoder) -> dict[str, torch.Tensor]:
    """A transformers ``UMT5EncoderModel``'s tensors under Wan's ``T5Encoder`` names (``t5.py``, ``shared_pos``
    False): ``token_embedding``; per block ``norm1``, ``attn.{q,k,v,o}``, ``pos_embedding.embedding`` (each block's
    own relative bias), ``norm2``, ``ffn.gate.0`` (the linear under the GELU), ``ffn.fc1`` (the other factor),
    ``ffn.fc2``; ``norm``."""
    out = {"token_embedding.weight": encoder.shared.weight.detach(),
           "norm.weight": encoder.encoder.final_layer_norm.weight.detach()}
    for i, block in enumerate(encoder.encoder.block):
        attention, dense = block.layer[0].SelfAttention, block.layer[1].DenseReluDense
        _tensors(f"blocks.{i}.", {"norm1": block.layer[0].layer_norm, "attn.q": attention.q, "attn.k": attention.k,
                                  "attn.v": attention.v, "attn.o": attention.o,
                                  "pos_embedding.embedding": attention.relative_attention_bias,
                                  "norm2": block.layer[1].layer_norm, "ffn.gate.0": dense.wi_0,
                                  "ffn.fc1": dense.wi_1, "ffn.fc2": dense.wo}, out)
    return out


def _wan_t5_forward(state: dict, ids: torch.Tensor, heads: int, buckets: int, max_dist: int) -> torch.Tensor:
    """Wan's ``T5Encoder.forward`` (``t5.py``) in float64 on the original-named ``state``, no mask: T5LayerNorm
    x / rms(x) w (eps 1e-6); attention without scaling, plus each block's bidirectional relative position bias
    (``T5RelativeEmbedding._relative_position_bucket``); feed-forward fc2(fc1(x) * gelu_tanh(gate(x)))."""
    w = {k: v.double() for k, v in state.items()}

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    length = ids.shape[1]
    rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    half = buckets // 2
    exact = half // 2
    far = rel.abs().clamp(min=1).double()
    large = (exact + (torch.log(far / exact) / math.log(max_dist / exact) * (half - exact)).long()).clamp(max=half - 1)
    bucket = (rel > 0).long() * half + torch.where(rel.abs() < exact, rel.abs(), large)
    x = w["token_embedding.weight"][ids]
    b = ids.shape[0]
    for i in range(sum(k.endswith(".norm1.weight") for k in w)):
        p = f"blocks.{i}."
        h = norm(x, w[p + "norm1.weight"])
        q, k, v = (h @ w[p + f"attn.{n}.weight"].T for n in "qkv")
        q, k, v = (t.view(b, length, heads, -1) for t in (q, k, v))
        bias = w[p + "pos_embedding.embedding.weight"][bucket].permute(2, 0, 1)[None]
        attn = torch.softmax(torch.einsum("binc,bjnc->bnij", q, k) + bias, dim=-1)
        x = x + torch.einsum("bnij,bjnc->binc", attn, v).reshape(b, length, -1) @ w[p + "attn.o.weight"].T
        h = norm(x, w[p + "norm2.weight"])
        gate = h @ w[p + "ffn.gate.0.weight"].T
        gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate.pow(3))))
        x = x + ((h @ w[p + "ffn.fc1.weight"].T) * gelu) @ w[p + "ffn.fc2.weight"].T
    return norm(x, w["norm.weight"])


def test_wan_umt5_file_reads_exactly(wan22_ti2v_pipeline, tmp_path):
    """Wan's UMT5 encoder file (the tiny pipeline's ``UMT5EncoderModel`` under ``t5.py``'s names, a torch pickle
    as Wan-AI's ``models_t5_umt5-xxl-enc-bf16.pth``; float32, and bf16 read into bf16): ``--text_encoder``'s reader
    gives transformers' state dict exactly (the tied ``encoder.embed_tokens`` filled from ``shared``); and Wan's own
    forward on the file's tensors (float64, ``_wan_t5_forward``) equals transformers' states to 1e-5 of their
    magnitude, which checks the test's map (the GELU'd gate is ``wi_0``) against the original code."""
    from transformers import UMT5EncoderModel

    encoder = UMT5EncoderModel.from_pretrained(str(wan22_ti2v_pipeline), subfolder="text_encoder").eval()
    original = _umt5_original(encoder)
    assert len(original) == len(encoder.state_dict()) - 1  # the tied embedding stored once
    plain, half = tmp_path / "umt5.pth", tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save(original, plain)
    torch.save({k: v.to(torch.bfloat16) for k, v in original.items()}, half)
    kind = ("transformers", "UMT5EncoderModel")
    ref = encoder.state_dict()
    ours = _load(wan22_ti2v_pipeline, "text_encoder", kind, plain)
    _assert_equal(ours.state_dict(), ref)
    _assert_equal(_load(wan22_ti2v_pipeline, "text_encoder", kind, half, torch.bfloat16).state_dict(),
                  {k: v.to(torch.bfloat16) for k, v in ref.items()})
    config = encoder.config
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        states = ours(input_ids=ids).last_hidden_state.double()
    wan = _wan_t5_forward(original, ids, config.num_heads, config.relative_attention_num_buckets,
                          config.relative_attention_max_distance)
    assert (wan - states).abs().max() <= 1e-5 * states.abs().max()


def test_ti2v_samples_from_the_original_files_like_the_folder(wan22_ti2v_pipeline, tmp_path):
    """``ditforge sample`` of the tiny Wan 2.2 TI2V-5B pipeline from a folder without its VAE's and text encoder's
    weights plus ``--vae Wan2.2_VAE.pth --text_encoder models_t5_umt5-xxl-enc-bf16.pth`` (both in the original names,
    float32) draws the complete folder's video to one uint8 level (the same float32 weights; CPU kernels round by
    the tensors' memory alignment)."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5EncoderModel

    bare = tmp_path / "bare"
    shutil.copytree(wan22_ti2v_pipeline, bare)
    vae = AutoencoderKLWan.from_pretrained(str(wan22_ti2v_pipeline), subfolder="vae")
    encoder = UMT5EncoderModel.from_pretrained(str(wan22_ti2v_pipeline), subfolder="text_encoder")
    files = {"vae": (tmp_path / "Wan2.2_VAE.pth", _wan22_original(vae)),
             "text_encoder": (tmp_path / "models_t5_umt5-xxl-enc-bf16.pth", _umt5_original(encoder))}
    argv = []
    for component, (path, state) in files.items():
        torch.save(state, path)
        for f in (bare / component).glob("*.safetensors"):
            f.unlink()
        argv += [f"--{component}", str(path)]
    samples = []
    for folder, extra in ((bare, argv), (wan22_ti2v_pipeline, [])):
        out = tmp_path / f"out_{len(samples)}"
        out.mkdir()
        assert cli.main(["sample", "--ckpt", str(folder), "--prompt", "a red bicycle", "--num_sampling_steps", "2",
                         "--height", "32", "--width", "32", "--num_frames", "5", "--out", str(out / "clip.mp4"),
                         "--save_npz", str(out / "s.npz"), "--device", "cpu", *extra]) == 0
        samples.append(np.load(out / "s.npz")["samples"].astype(np.int16))
    assert np.abs(samples[0] - samples[1]).max() <= 1
