"""``ditforge export --format comfyui`` on the shared runs of ``video_runs`` (4 steps of LoRA and of full fine-tuning
of the tiny Wan, LTX-Video and HunyuanVideo pipelines): the LoRA file in the original names against the diffusers-key
``--format lora`` file, both read by diffusers' ``load_lora_weights`` (its non-diffusers converters for the first)
and fused, and against peft's own merge; the full fine-tune read back by diffusers' ``from_single_file``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ditforge import cli
from ditforge.errors import UserError
from ditforge.export import export_comfyui
from ditforge.models.adapters import families
from ditforge.weights.original import original_name, to_original
from families import VIDEO  # tests/finetune is on sys.path

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUT_FAMILIES = ("wan", "ltx", "hunyuan_video")


def _export(run, out, fmt: str):
    assert cli.main(["export", "--ckpt", str(run), "--out", str(out), "--format", fmt]) == 0
    return out


def _pipeline(folder, family: str):
    import diffusers

    return getattr(diffusers, VIDEO[family].pipeline).from_pretrained(str(folder), local_files_only=True)


@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_comfyui_lora_is_the_runs_lora_in_the_original_names(family, video_runs, request, tmp_path):
    """Every key is ``diffusion_model.<original module>.lora_A.weight`` / ``.lora_B.weight`` / ``.alpha`` of a weight
    ``to_original`` writes; the update B A alpha / rank of each original weight equals, to 1e-6, what peft's merge
    (the ``--format diffusers`` export's transformer minus the base's, in the original layout) added to it; and
    where diffusers' converter reads the file (Wan; LTX-Video without the alphas, which its loader refuses; its
    HunyuanVideo one splits the single blocks at 3072 rows, test_original_layouts.py checks it there) the pipeline
    fused with it equals the pipeline fused with the ``--format lora`` file, to 1e-6."""
    folder = request.getfixturevalue(f"{family}_pipeline")
    run = video_runs(family)["lora"]
    lora = load_file(str(_export(run, tmp_path / "comfy.safetensors", "comfyui")))
    layout = families()[family].original_layouts["transformer"]
    base = _pipeline(folder, family).transformer
    original_base = to_original(base.state_dict(), layout)
    assert lora and all(k.startswith("diffusion_model.") for k in lora)
    modules = {k.removeprefix("diffusion_model.").rsplit(".", 2 if "lora_" in k else 1)[0] for k in lora}
    assert all(f"{m}.weight" in original_base for m in modules)
    assert set(lora) == {f"diffusion_model.{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight",
                                                                                  "alpha")}
    assert all(v.dtype == torch.float32 for v in lora.values())

    merged = _pipeline(_export(run, tmp_path / "merged", "diffusers"), family).transformer
    merged = to_original(merged.state_dict(), layout)
    for m in modules:
        a, b = lora[f"diffusion_model.{m}.lora_A.weight"], lora[f"diffusion_model.{m}.lora_B.weight"]
        scale = lora[f"diffusion_model.{m}.alpha"].item() / a.shape[0]
        torch.testing.assert_close(b @ a * scale, merged[f"{m}.weight"] - original_base[f"{m}.weight"],
                                   rtol=0, atol=1e-6)
    changed = {original_name(k, layout)[0] for k in base.state_dict()
               if not torch.equal(merged[original_name(k, layout)[0]], original_base[original_name(k, layout)[0]])}
    assert changed == {f"{m}.weight" for m in modules}

    if family == "hunyuan_video":
        return
    # the alphas stay in the file for ComfyUI (comfy/lora.py reads <key>.alpha); diffusers' LTX-Video converter
    # (loaders/lora_conversion_utils.py::_convert_non_diffusers_ltxv_lora_to_diffusers, 0.42.1) only renames the
    # keys, reading no alpha, and its loader then refuses names without "lora": diffusers gets the rest, which with
    # the runs' alpha = rank (scale 1) is the same update
    comfy = {k: v for k, v in lora.items() if family == "wan" or not k.endswith(".alpha")}
    fused = []
    for source in (comfy, str(_export(run, tmp_path / "diffusers_lora", "lora"))):
        pipe = _pipeline(folder, family)
        pipe.load_lora_weights(source)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
        fused.append(pipe.transformer.state_dict())
    assert fused[0].keys() == fused[1].keys()
    for key, value in fused[1].items():
        torch.testing.assert_close(fused[0][key], value, rtol=0, atol=1e-6)


def test_comfyui_full_fine_tune_reads_back_with_from_single_file(wan_pipeline, video_runs, tmp_path):
    """A full fine-tune's file (bf16, bare original names) read by diffusers' ``from_single_file`` with the run's
    ``--init_from`` config is the run's transformer (its ``--format diffusers`` export) in bf16, bit for bit."""
    import diffusers

    run = video_runs("wan")["full"]
    path = _export(run, tmp_path / "wan.safetensors", "comfyui")
    assert {v.dtype for v in load_file(str(path)).values()} == {torch.bfloat16}
    loaded = diffusers.WanTransformer3DModel.from_single_file(
        str(path), config=str(wan_pipeline), subfolder="transformer", torch_dtype=torch.bfloat16).state_dict()
    expected = _pipeline(_export(run, tmp_path / "exported", "diffusers"), "wan").transformer.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v.to(torch.bfloat16)) for k, v in expected.items())


def test_comfyui_refuses_a_family_without_a_layout(tmp_path):
    """A family whose adapter declares no original layout: one line naming the families that have one."""
    with pytest.raises(UserError) as error:
        export_comfyui(tmp_path, {"model": {"family": "cogvideox"}}, tmp_path / "x.safetensors")
    message = str(error.value)
    assert "\n" not in message and "cogvideox" in message
    assert all(family in message for family in ("wan", "ltx", "hunyuan_video"))
