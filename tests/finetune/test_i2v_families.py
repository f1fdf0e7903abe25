"""The fine-tuning suite every image-to-video family shares (``ditforge train --init_from FOLDER --data clips``, each
clip its own first frame; ``ditforge export``; ``ditforge sample --image``), end to end on the CPU with the tiny
random pipelines of ``tiny_pipelines`` (``families.I2V``: Wan 2.1 I2V, Wan 2.2 TI2V-5B, CogVideoX 1.0 I2V, LTX-Video
I2V, HunyuanVideo-I2V's two transformers), on the runs of ``i2v_runs`` (one a row): the first step's loss against
diffusers' arithmetic with the pipeline's conditioning written out (``references.image_to_video_first_loss``), and
the exported folder read back by the family's pipeline class, whose own call on an image draws what ``ditforge
sample --image`` draws. What is one family's own is in its module (test_wan.py, test_cogvideox.py,
test_hunyuan_video.py)."""

from __future__ import annotations

import pytest
import torch
import yaml

import references
from ditforge import cli
from ditforge.train.logging import read_metrics
from families import I2V, assert_frames_match, assert_one_line_error, config_entry  # tests/finetune is on sys.path

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = list(I2V)


@pytest.mark.slow  # the first call of i2v_runs(name) trains the row's run
@pytest.mark.parametrize("name", NAMES)
def test_i2v_first_step_loss_matches_diffusers(name, request, i2v_runs):
    """The run's first loss equals diffusers' (``references.image_to_video_first_loss``: the noisy latents, the
    first frame's conditioning checked against the pipeline's own ``prepare_latents`` where it has one, the given
    first latent frame left out of the loss) within 1e-5 relative (fp32); every step is logged; the config records
    the row's entries (``I2V[name].config``); a LoRA run moved its adapters (B != 0)."""
    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    spec, run = I2V[name], i2v_runs(name)
    ref = references.image_to_video_first_loss(name, request.getfixturevalue(f"{name}_pipeline"))
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, spec.steps + 1))
    assert records[0]["loss"] == pytest.approx(ref, rel=1e-5)
    config = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in spec.config.items():
        assert config_entry(config, key) == value, key
    if spec.kind == "lora":
        _, lora, _ = load_finetuned(*load_weights(run, use_ema=False), torch.device("cpu"))
        lora_b = [p for n, p in lora.named_parameters() if "lora_B" in n]
        assert lora_b and any(p.abs().max() > 0 for p in lora_b)


@pytest.mark.parametrize("name", NAMES)
def test_i2v_sample_like_the_exported_pipeline(name, i2v_runs, tmp_path, monkeypatch, capsys):
    """``--format diffusers`` of the run loads in the family's pipeline class (its weights checked exactly for every
    text-to-video family's full run in test_video_families.py, and Wan 2.1 I2V's in test_wan.py); ``ditforge sample
    --image first.png --out clip.mp4`` (a random 24-bit first frame) writes that one file, and its frames (the .npz)
    equal the exported pipeline's own call's from the same seed, prompt, image, 3 steps and guidance
    (``I2V[name].cfg``; a guidance-distilled model embeds it) to one uint8 level; the call returns
    ``I2V[name].returned`` frames. An adapter whose prompt encoder reads the image (``prompt_sees_image``) encodes
    the sampled prompt with the given image, once. ``--image`` left out is one line, nothing written."""
    import diffusers
    import numpy as np
    from PIL import Image

    from ditforge.data.sampler import derive_seed
    from ditforge.models.adapters import family_of_pipeline

    spec, run = I2V[name], i2v_runs(name)
    size, exported = spec.size, tmp_path / "exported"
    assert cli.main(["export", "--ckpt", str(run), "--out", str(exported), "--format", "diffusers"]) == 0
    pipe = getattr(diffusers, spec.pipeline).from_pretrained(str(exported), local_files_only=True)

    seen, adapter = [], family_of_pipeline(spec.pipeline)
    if adapter.prompt_sees_image:
        encode = adapter.encode_prompt
        monkeypatch.setattr(adapter, "encode_prompt", staticmethod(
            lambda p, texts, device, images=None: seen.append(images) or encode(p, texts, device, images=images)))
    png = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(png)
    prompt, npz, clip = "a rabbit on a green hill", tmp_path / "s.npz", tmp_path / "out" / "clip.mp4"
    common = ["sample", "--ckpt", str(run), "--prompt", prompt, "--num_sampling_steps", "3", "--cfg_scale",
              str(spec.cfg), "--device", "cpu"]
    assert cli.main([*common, "--image", str(png), "--out", str(clip), "--save_npz", str(npz)]) == 0
    assert sorted(p.name for p in clip.parent.iterdir()) == ["clip.mp4"] and clip.stat().st_size > 0
    video = pipe(image=Image.open(png).convert("RGB"), prompt=[prompt], num_inference_steps=3, guidance_scale=spec.cfg,
                 height=size, width=size, num_frames=spec.frames,
                 generator=torch.Generator("cpu").manual_seed(derive_seed(0, 0)), output_type="np").frames
    assert_frames_match(npz, video, (1, spec.returned or spec.frames, size, size, 3))
    if adapter.prompt_sees_image:
        given = [images for images in seen if images is not None]
        assert len(given) == 1 and np.array_equal(np.asarray(given[0][0]), np.asarray(Image.open(png).convert("RGB")))

    capsys.readouterr()  # the progress bars of the calls above
    assert_one_line_error(capsys, [*common, "--out", str(tmp_path / "x.mp4")], "--image", spec.pipeline)
    assert not (tmp_path / "x.mp4").exists()
