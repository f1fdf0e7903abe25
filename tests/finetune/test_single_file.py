"""Single files in place of a pipeline folder's components (``--transformer`` / ``--vae`` / ``--text_encoder FILE``,
``models/adapters/single_file.py``): files written in the original release's and ComfyUI's layouts with the
adapters' key maps (``weights.original.to_original``, checked against diffusers' converters in
test_original_layouts.py), read back by ``train`` and ``sample`` against the same pipeline from its folder, by
diffusers' ``from_single_file`` (the independent reader), and in float8 (plain and ComfyUI's scaled)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import references
from ditforge import cli
from ditforge.train.logging import read_metrics
from families import VIDEO, assert_one_line_error  # tests/finetune is on sys.path
from tiny_pipelines import LTX_VAE_090

pytestmark = pytest.mark.usefixtures("one_thread")

COMFY = "model.diffusion_model."


def _adapter(family: str):
    from ditforge.models.adapters.hunyuan import HunyuanVideoDenoiser
    from ditforge.models.adapters.ltx import LTXDenoiser
    from ditforge.models.adapters.wan import WanDenoiser

    return {"wan": WanDenoiser, "ltx": LTXDenoiser, "hunyuan_video": HunyuanVideoDenoiser}[family]


def _original(model, family: str, component: str) -> dict[str, torch.Tensor]:
    from ditforge.models.adapters.layouts import declared
    from ditforge.weights.original import to_original

    layout = declared(_adapter(family).original_layouts, component)[-1]  # Wan's VAE: 2.1's (2.2's is read only)
    return {k: v.contiguous() for k, v in to_original(model.state_dict(), layout).items()}


def _folder_with(folder, tmp_path, name: str, **models):
    """A copy of pipeline ``folder`` whose components ``models`` (name -> diffusers model) are replaced (their
    config and weights saved), and a second copy of it without those components' weights (what a user who holds
    the single files keeps)."""
    full, bare = tmp_path / f"{name}_full", tmp_path / f"{name}_bare"
    shutil.copytree(folder, full)
    for component, model in models.items():
        shutil.rmtree(full / component)
        model.save_pretrained(str(full / component))
    shutil.copytree(full, bare)
    return full, bare


def _strip_weights(folder, *components: str) -> None:
    for component in components:
        for f in (folder / component).glob("*.safetensors"):
            f.unlink()


def _wan_files(folder, tmp_path):
    """Wan: the transformer as Wan-AI's two shards and their ``.index.json`` (no prefix), and a VAE of Wan 2.1's real
    structure (4 stages of 2 residual blocks, which diffusers' converter assumes) as a torch pickle
    ``Wan2.1_VAE.pth``."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    torch.manual_seed(1)
    vae = AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                           temperal_downsample=[False, True, True]).eval()
    full, bare = _folder_with(folder, tmp_path, "wan", vae=vae)
    state = _original(WanTransformer3DModel.from_pretrained(str(full), subfolder="transformer"), "wan",
                      "transformer")
    keys = sorted(state)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": keys[::2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": keys[1::2]}
    for shard, names in shards.items():
        save_file({k: state[k] for k in names}, str(tmp_path / shard))
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: s for s, names in shards.items() for k in names}}))
    torch.save(_original(vae, "wan", "vae"), tmp_path / "Wan2.1_VAE.pth")
    _strip_weights(bare, "transformer", "vae")
    # a shard given: its index is read beside it
    return full, bare, ["--transformer", str(tmp_path / next(iter(shards))), "--vae", str(tmp_path / "Wan2.1_VAE.pth")]


def _comfy_transformer(folder, tmp_path, family: str, **config):
    """The transformer in ComfyUI's layout (``model.diffusion_model.`` + the original keys, float32); ``config``:
    settings the folder's transformer is rebuilt with first (HunyuanVideo: no single-stream blocks, which
    diffusers' converter splits at its real width only)."""
    import diffusers

    cls = getattr(diffusers, json.loads((folder / "transformer" / "config.json").read_text())["_class_name"])
    model = cls.from_pretrained(str(folder), subfolder="transformer")
    if config:
        torch.manual_seed(2)
        model = cls(**{**model.config, **config}).eval()
    full, bare = _folder_with(folder, tmp_path, family, **({"transformer": model} if config else {}))
    path = tmp_path / f"{family}_comfyui.safetensors"
    save_file({COMFY + k: v for k, v in _original(model, family, "transformer").items()}, str(path))
    _strip_weights(bare, "transformer")
    return full, bare, ["--transformer", str(path)]


SETUPS = {
    "ltx": lambda p, t: _comfy_transformer(p, t, "ltx"),
    "hunyuan_video": lambda p, t: _comfy_transformer(p, t, "hunyuan_video", num_single_layers=0),
    "wan": lambda p, t: _wan_files(p, t),
}


def _sample(family: str, folder, out, *files: str, frames: int | None = None) -> np.ndarray:
    spec, npz = VIDEO[family], out / "s.npz"
    assert cli.main(["sample", "--ckpt", str(folder), "--prompt", "a red bicycle", "--num_sampling_steps", "2",
                     "--height", str(spec.size), "--width", str(spec.size), "--num_frames", str(frames or spec.frames),
                     "--out", str(out / "clip.mp4"), "--save_npz", str(npz), "--device", "cpu", *files]) == 0
    return np.load(npz)["samples"]


@pytest.mark.parametrize("family", list(SETUPS))
def test_single_files_train_and_sample_like_the_folder(family, request, tmp_path):
    """From a folder without the replaced components' weights and the single files: ``train``'s first loss equals
    diffusers' reference of the complete folder (``references.first_loss``, 1e-5 relative, as the shared suite),
    the run's ``--format diffusers`` export holds the file's VAE (Wan), and ``sample`` draws the complete folder's
    video to one uint8 level (the same float32 weights; CPU kernels round by the tensors' memory alignment:
    HunyuanVideo's transformer rebuilt with its own folder's weights moves by 2.4e-7)."""
    full, bare, files = SETUPS[family](request.getfixturevalue(f"{family}_pipeline"), tmp_path)
    spec = VIDEO[family]
    assert cli.main(spec.argv(bare, tmp_path / "run", "--max_steps", "1", *files)) == 0
    ref, _ = references.first_loss(family, full)
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["loss"] == pytest.approx(ref, rel=1e-5)
    # the run reads its files again (the folder's vae/ it records is none of them)
    assert cli.main(["export", "--ckpt", str(tmp_path / "run"), "--format", "diffusers", "--out",
                     str(tmp_path / "export")]) == 0
    if family == "wan":  # the export holds the VAE the file gave, which the bare folder has not
        import diffusers

        exported, ref_vae = (diffusers.AutoencoderKLWan.from_pretrained(str(f), subfolder="vae").state_dict()
                             for f in (tmp_path / "export", full))
        assert exported.keys() == ref_vae.keys() and all(torch.equal(exported[k], ref_vae[k]) for k in ref_vae)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours, ref = (_sample(family, f, tmp_path / d, *x).astype(np.int16) for f, d, x in ((bare, "a", files),
                                                                                       (full, "b", ())))
    assert np.abs(ours - ref).max() <= 1


def test_ltx_vae_file_reads_and_samples_like_the_folder(ltx_pipeline, tmp_path):
    """LTX-Video's VAE (0.9.0's structure, ``LTX_VAE_090``, its ``latents_mean`` / ``latents_std`` drawn) written
    with ``to_original`` as the ``vae.`` tensors of Lightricks' release (one file, the transformer in it under
    ComfyUI's prefix) and as ComfyUI's VAE file (no prefix): the ``--vae`` reader (``load_component``) gives the
    folder's VAE bit for bit from each; from the bare folder and the release file (``--transformer F --vae F``),
    ``train``'s first loss equals that of the complete folder's run (1e-6 relative: the same float32 weights) and
    ``sample`` draws its video to one uint8 level (9 frames: the VAE compresses 8 of them)."""
    from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel

    from ditforge.models.adapters.ltx import LTXDenoiser
    from ditforge.models.adapters.single_file import load_component

    torch.manual_seed(3)
    vae = AutoencoderKLLTXVideo(**LTX_VAE_090).eval()
    with torch.no_grad():
        vae.latents_mean.normal_(0, 0.3)
        vae.latents_std.uniform_(0.5, 1.5)
    full, bare = _folder_with(ltx_pipeline, tmp_path, "ltx", vae=vae)
    transformer = LTXVideoTransformer3DModel.from_pretrained(str(full), subfolder="transformer")
    release, comfy = tmp_path / "ltx-video-2b-v0.9.safetensors", tmp_path / "ltx_vae_comfyui.safetensors"
    state = _original(vae, "ltx", "vae")
    save_file({**{COMFY + k: v for k, v in _original(transformer, "ltx", "transformer").items()}, **state},
              str(release))
    save_file({k.removeprefix("vae."): v for k, v in state.items()}, str(comfy))
    _strip_weights(bare, "transformer", "vae")
    ref = vae.state_dict()
    for path in (release, comfy):
        read = load_component(bare, "vae", ("diffusers", "AutoencoderKLLTXVideo"), str(path), LTXDenoiser,
                              torch.float32).state_dict()
        assert read.keys() == ref.keys() and all(torch.equal(read[k], ref[k]) for k in ref), path.name
    files = ("--transformer", str(release), "--vae", str(release))
    for folder, run, extra in ((bare, "run_files", files), (full, "run_folder", ())):
        assert cli.main(VIDEO["ltx"].argv(folder, tmp_path / run, "--max_steps", "1", "--num_frames", "9",
                                          "--frame_interval", "1", *extra)) == 0
    losses = [read_metrics(tmp_path / run / "metrics.jsonl")[0]["loss"] for run in ("run_files", "run_folder")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours, theirs = (_sample("ltx", f, tmp_path / d, *x, frames=9).astype(np.int16)
                    for f, d, x in ((bare, "a", files), (full, "b", ())))
    assert np.abs(ours - theirs).max() <= 1


def _fp8_file(wan_pipeline, tmp_path, scaled: bool):
    """The Wan transformer in ComfyUI's layout, its blocks' 2-D weights in float8 e4m3 (the rest float32); with
    ``scaled``, ComfyUI's scaled form: each stored as w / s with s = max|w| / 448 in ``<layer>.scale_weight`` and a
    ``scaled_fp8`` marker. Returns (path, the file's state, the weights it stands for: float32)."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(str(wan_pipeline), subfolder="transformer")
    state, meant = {}, {}
    for k, v in _original(model, "wan", "transformer").items():
        if k.startswith("blocks.") and v.ndim == 2:
            s = v.abs().max() / 448 if scaled else torch.tensor(1.0)
            state[COMFY + k] = (v / s).to(torch.float8_e4m3fn)
            meant[k] = state[COMFY + k].float() * s
            if scaled:
                state[COMFY + k.removesuffix(".weight") + ".scale_weight"] = s.reshape(())
        else:
            state[COMFY + k], meant[k] = v, v
    if scaled:
        state[COMFY + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    path = tmp_path / f"wan_fp8{'_scaled' if scaled else ''}.safetensors"
    save_file(state, str(path))
    return path, state, meant


def _lora_models(folder, path, keep: tuple[bool, ...]):
    """The Wan transformer read from ``path``, once per ``keep`` (``keep_fp8`` and then ``store_base_in_fp8``, or
    float32), each with the same LoRA (rank 4; B drawn too, so that the adapters count)."""
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.train.finetune import store_base_in_fp8
    from ditforge.weights.lora import add_lora

    models = []
    for fp8 in keep:
        model = load_pretrained(folder, torch.device("cpu"), files={"transformer": str(path)}, keep_fp8=fp8).denoiser
        torch.manual_seed(0)
        add_lora(model, 4, None, ["to_q", "to_k", "to_v", "to_out.0"])
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    torch.manual_seed(len(n))
                    p.normal_(0, 0.1)
        if fp8:
            store_base_in_fp8(model, torch.float32, "none")
        models.append(model)
    return models


def _outputs(*models):
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(2, 16, 2, 2, 2, generator=g), torch.tensor([300.0, 800.0])
    text = torch.randn(2, 7, 32, generator=g)
    with torch.no_grad():
        return [m.denoise(x, t, encoder_hidden_states=text) for m in models]


def test_fp8_file_stays_fp8_under_fp8_base(wan_pipeline, tmp_path):
    """Under ``--fp8_base`` (``keep_fp8``, then ``store_base_in_fp8``) a float8 file's block weights stay
    float8_e4m3fn, bit for bit the file's, and the LoRA model's output on fresh inputs equals (1e-6 of its
    magnitude; the casts are exact) a float32 reference: for an unscaled file, the same file read into float32
    and then stored in float8 (the folder's path); for a ComfyUI scaled file, the dequantised weights
    (weight x scale_weight) in float32 with the layers' other tensors rounded to e4m3 as the casting stores them.
    Without ``keep_fp8`` a scaled file reads as weight x scale_weight exactly, as diffusers' ``from_single_file``
    reads the dequantised weights."""
    import diffusers

    from ditforge.train.finetune import store_base_in_fp8

    path, state, _ = _fp8_file(wan_pipeline, tmp_path, scaled=False)
    kept, plain = _lora_models(wan_pipeline, path, (True, False))
    store_base_in_fp8(plain, torch.float32, "none")
    weight = kept.inner.blocks[0].attn1.to_q.base_layer.weight
    assert weight.dtype == torch.float8_e4m3fn
    assert torch.equal(weight.view(torch.uint8), state[COMFY + "blocks.0.self_attn.q.weight"].view(torch.uint8))
    ours, ref = _outputs(kept, plain)
    assert (ours - ref).abs().max() <= 1e-6 * ref.abs().max()

    scaled, state, meant = _fp8_file(wan_pipeline, tmp_path, scaled=True)
    kept, ref_model = _lora_models(wan_pipeline, scaled, (True, False))
    layer = kept.inner.blocks[0].attn1.to_q.base_layer
    assert torch.equal(layer.weight.view(torch.uint8), state[COMFY + "blocks.0.self_attn.q.weight"].view(torch.uint8))
    assert layer.scale_weight == state[COMFY + "blocks.0.self_attn.q.scale_weight"]
    theirs = dict(ref_model.named_modules())
    with torch.no_grad():  # what the casting stores in e4m3 besides the scaled weights
        for name, module in kept.named_modules():
            hooks = getattr(module, "_diffusers_hook", None)
            if hooks is not None and hooks.get_hook("layerwise_casting") is not None:
                for n, p in theirs[name].named_parameters(recurse=False):
                    if not (n == "weight" and getattr(module, "scale_weight", None) is not None):
                        p.data = p.data.to(torch.float8_e4m3fn).float()
    ours, ref = _outputs(kept, ref_model)
    assert (ours - ref).abs().max() <= 1e-6 * ref.abs().max()

    dequantised = tmp_path / "dequantised.safetensors"
    save_file({COMFY + k: v for k, v in meant.items()}, str(dequantised))
    read = _lora_models(wan_pipeline, scaled, (False,))[0].inner.state_dict()
    theirs = diffusers.WanTransformer3DModel.from_single_file(str(dequantised), config=str(wan_pipeline),
                                                              subfolder="transformer").state_dict()
    ours = {k.replace(".base_layer", ""): v for k, v in read.items() if "lora_" not in k}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_text_encoder_file(wan_pipeline, tmp_path):
    """``--text_encoder FILE`` in transformers' keys, the tied embedding stored once (as ComfyUI's umt5 files):
    the encoder's states equal the folder's exactly; ComfyUI's scaled fp8 form of it reads as weight x
    scale_weight (float32) and its states stay within 10% of the float32 encoder's."""
    from transformers import UMT5EncoderModel

    from ditforge.models.adapters.single_file import load_component

    folder = UMT5EncoderModel.from_pretrained(str(wan_pipeline), subfolder="text_encoder").eval()
    state = {k: v for k, v in folder.state_dict().items() if k != "encoder.embed_tokens.weight"}
    plain, scaled = tmp_path / "umt5.safetensors", tmp_path / "umt5_fp8_e4m3fn_scaled.safetensors"
    save_file(state, str(plain))
    # ComfyUI's marker, and the tokenizer it may keep in the file (ignored: the folder's is used)
    fp8 = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn), "spiece_model": torch.zeros(5, dtype=torch.uint8)}
    meant = {}
    for k, v in state.items():
        if ".block." in k and k.endswith(".weight") and v.ndim == 2:
            s = v.abs().max() / 448
            fp8[k], fp8[k.removesuffix(".weight") + ".scale_weight"] = (v / s).to(torch.float8_e4m3fn), s.reshape(())
            meant[k] = fp8[k].float() * s
        else:
            fp8[k] = v
    save_file(fp8, str(scaled))
    ids = torch.randint(0, folder.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    kind = ("transformers", "UMT5EncoderModel")
    ours = [load_component(wan_pipeline, "text_encoder", kind, str(f), _adapter("wan"), torch.float32)
            for f in (plain, scaled)]
    with torch.no_grad():
        ref, got, approx = (m(input_ids=ids).last_hidden_state for m in (folder, *ours))
    assert torch.equal(got, ref)
    read = ours[1].state_dict()
    assert all(torch.equal(read[k], v) for k, v in meant.items())
    assert (approx - ref).abs().max() <= 0.1 * ref.abs().max()


def test_unknown_layout_is_one_line(wan_pipeline, tmp_path, capsys):
    """A file whose keys are none of the known layouts: exit 2, one line naming the flag, the file and the layouts
    ditforge knows (from ``train`` and from ``sample``: the transformer's, both Wan VAEs', the text encoder's); a
    single file without a pipeline folder to go in, one line
    too."""
    path = tmp_path / "other.safetensors"
    save_file({"unet.conv_in.weight": torch.zeros(2, 2)}, str(path))
    argv = VIDEO["wan"].argv(wan_pipeline, tmp_path / "run", "--max_steps", "1", "--transformer", str(path))
    assert_one_line_error(capsys, argv, f"--transformer {path}", "unknown layout", "diffusers' WanTransformer3DModel",
                          "Wan 2.1 / 2.2 transformer")
    assert_one_line_error(capsys, ["sample", "--ckpt", str(wan_pipeline), "--prompt", "a", "--vae", str(path),
                                   "--device", "cpu"], f"--vae {path}", "unknown layout", "Wan 2.2 VAE", "Wan 2.1 VAE")
    assert_one_line_error(capsys, ["sample", "--ckpt", str(wan_pipeline), "--prompt", "a", "--text_encoder",
                                   str(path), "--device", "cpu"], f"--text_encoder {path}", "unknown layout",
                          "transformers' UMT5EncoderModel keys", "Wan's UMT5 encoder")
    assert_one_line_error(capsys, ["train", "--transformer", str(path), "--device", "cpu"], f"--transformer {path}",
                          "give that folder as --init_from")


def test_second_expert_file(tmp_path):
    """``--transformer_2 FILE`` of a two-expert pipeline (ComfyUI's layout, float32): under ``--expert low_noise`` the
    denoiser wraps the file's expert, exactly the folder's ``transformer_2`` (diffusers' ``from_pretrained``), and the
    other expert stays the folder's."""
    from diffusers import WanTransformer3DModel

    from ditforge.models.adapters.pipeline import load_pretrained
    from tiny_pipelines import make_wan22

    folder = make_wan22(tmp_path / "pipe")
    experts = [WanTransformer3DModel.from_pretrained(str(folder), subfolder=s)
               for s in ("transformer", "transformer_2")]
    path = tmp_path / "low_noise.safetensors"
    save_file({COMFY + k: v for k, v in _original(experts[1], "wan", "transformer").items()}, str(path))
    _strip_weights(folder, "transformer_2")
    pre = load_pretrained(folder, torch.device("cpu"), expert="low_noise", files={"transformer_2": str(path)})
    for model, ref in ((pre.denoiser.inner, experts[1]), (pre.pipe.transformer, experts[0])):
        got, want = model.state_dict(), ref.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
