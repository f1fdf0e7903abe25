"""The fine-tuning suite every text-to-video family shares (``ditforge train --init_from FOLDER --data clips``,
``ditforge export``, ``ditforge sample``), end to end on the CPU with the tiny random pipelines of ``tiny_pipelines``
(``families.VIDEO``: Wan 2.1, CogVideoX 1.0, LTX-Video, HunyuanVideo), on the runs of ``video_runs`` (4 steps of full
and of LoRA fine-tuning): the first step's loss against diffusers' arithmetic (``references.py``), resumed runs bit
for bit, the exported folder read back by the family's pipeline class, whose own call draws what ``ditforge sample``
draws, the LoRA file read by ``load_lora_weights``, and features that train like the clips. What is one family's
own is in its module (test_wan.py, test_cogvideox.py, test_ltx.py, test_hunyuan_video.py)."""

from __future__ import annotations

import pytest
import torch
import yaml

import references
from ditforge import cli
from ditforge.data.sampler import derive_seed
from ditforge.train.logging import read_metrics
from families import KINDS, VIDEO, assert_frames_match, config_entry  # tests/finetune is on sys.path

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = list(VIDEO)


@pytest.mark.slow  # the first call of video_runs(family) trains its two runs
@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_loss_matches_diffusers(family, request, video_runs):
    """Both runs' first loss (LoRA starts with B = 0: the same model) equals diffusers' within 1e-5 relative
    (fp32), over the 4 logged steps; the full run's config records the family, its objective read from the
    scheduler, its shift and latent frames (``VIDEO[family].config``; LTX-Video: the dynamic shift at its latent
    size)."""
    ref, more = references.first_loss(family, request.getfixturevalue(f"{family}_pipeline"))
    for kind, run in video_runs(family).items():
        records = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3, 4], kind
        assert records[0]["loss"] == pytest.approx(ref, rel=1e-5), kind
    config = yaml.safe_load((video_runs(family)["full"] / "config.yaml").read_text())
    for key, value in {**VIDEO[family].config, **more}.items():
        assert config_entry(config, key) == value, key


@pytest.mark.parametrize("family, kind", [(f, k) for f in FAMILIES for k in VIDEO[f].resume])
def test_resume_equals_uninterrupted(family, kind, request, video_runs, tmp_path):
    """Stopped after 2 steps and resumed to 4 (``--resume auto``, the run's settings read back from its config):
    the same 4 losses, bit for bit, and the same final (EMA) weights, bit for bit, as the run of 4 steps in one
    go."""
    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    runs, part = video_runs(family), tmp_path / "part"
    folder = request.getfixturevalue(f"{family}_pipeline")
    assert cli.main(VIDEO[family].argv(folder, part, "--max_steps", "2", "--ckpt_every", "2", *KINDS[kind])) == 0
    assert cli.main(["train", "--outputs", str(part), "--resume", "auto", "--max_steps", "4"]) == 0
    assert [r["loss"] for r in read_metrics(part / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(runs[kind] / "metrics.jsonl")]
    weights = [load_finetuned(*load_weights(run, use_ema=True), torch.device("cpu"))[1].state_dict()
               for run in (runs[kind], part)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_export_folder_samples_like_the_pipeline(family, video_runs, tmp_path):
    """``--format diffusers`` of the full run: the family's pipeline class loads it with
    ``from_pretrained(local_files_only=True)``, its transformer holding the trained (EMA) weights exactly, which
    moved away from the base; from the same seed, prompt, steps and guidance the pipeline's own call draws the video
    ``ditforge sample`` draws (frames in the .npz), to one uint8 level; the .mp4 holds the frames (Wan: into a
    folder with ``--gif``, an mp4 and a gif named after the prompt)."""
    import diffusers

    from ditforge.data.video import probe_video
    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    spec, run = VIDEO[family], video_runs(family)["full"]
    out = tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    pipe = getattr(diffusers, spec.pipeline).from_pretrained(str(out), local_files_only=True)
    pre, trained, _ = load_finetuned(*load_weights(run, use_ema=True), torch.device("cpu"))
    exported, trained = pipe.transformer.state_dict(), trained.inner.state_dict()
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    base = type(pipe.transformer).from_pretrained(str(pre.folder), subfolder="transformer",
                                                  local_files_only=True).state_dict()
    assert any(not torch.equal(base[k], trained[k]) for k in trained)

    prompt, npz = "a rabbit on a green hill", tmp_path / "s.npz"
    clip = tmp_path / ("videos" if spec.gif else "clip.mp4")
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", prompt, "--num_sampling_steps", str(spec.sample_steps),
                     "--cfg_scale", str(spec.cfg), "--out", str(clip), "--save_npz", str(npz), "--device", "cpu",
                     *(["--gif"] if spec.gif else [])]) == 0
    if spec.gif:
        assert sorted(p.name for p in clip.iterdir()) == ["000-a-rabbit-on-a-green-hill.gif",
                                                          "000-a-rabbit-on-a-green-hill.mp4"]
        clip = clip / "000-a-rabbit-on-a-green-hill.mp4"
    assert probe_video(clip)["num_frames"] == spec.frames
    g = torch.Generator("cpu").manual_seed(derive_seed(0, 0))
    video = pipe(prompt=[prompt], num_inference_steps=spec.sample_steps, guidance_scale=spec.cfg, height=spec.size,
                 width=spec.size, num_frames=spec.frames, generator=[g] if spec.generator_list else g,
                 output_type="np").frames
    assert_frames_match(npz, video, (1, spec.frames, spec.size, spec.size, 3))


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_file_loads_with_load_lora_weights(family, request, video_runs, tmp_path):
    """``--format lora``: the family pipeline's ``load_lora_weights`` reads the file, and its transformer then gives
    ditforge's LoRA model's output on fresh random inputs (``VIDEO[family].lora_outputs``: latents, times, text
    states, and the family's mask and pooled states) within 1e-5 of the output's largest magnitude (float32 sums of
    the adapters in another order), while the base model is off by over 100 times that."""
    import diffusers

    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    spec, run = VIDEO[family], video_runs(family)["lora"]
    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(run), "--format", "lora", "--out", str(out)]) == 0
    pipe = getattr(diffusers, spec.pipeline).from_pretrained(str(request.getfixturevalue(f"{family}_pipeline")),
                                                             local_files_only=True)
    _, ours, _ = load_finetuned(*load_weights(run, use_ema=True), torch.device("cpu"))
    base, theirs, mine = spec.lora_outputs(pipe, ours, lambda: pipe.load_lora_weights(str(out)))
    tol = 1e-5 * mine.abs().max()
    assert (theirs - mine).abs().max() <= tol
    assert (base - mine).abs().max() > 100 * tol


@pytest.mark.parametrize("family", ["wan", "cogvideox"])
def test_features_train_like_on_the_fly(family, request, video_runs, tmp_path):
    """``extract-features --init_from`` stores the VAE posterior of whole clips and the text states; a run on them
    (the pipeline read from the features) records the latent frame count and logs the on-the-fly full run's losses
    for the same seed within 1e-5 relative (stored float32 moments, summed in another order)."""
    spec, feats = VIDEO[family], tmp_path / "feats"
    assert cli.main(["extract-features", "--init_from", str(request.getfixturevalue(f"{family}_pipeline")), "--data",
                     "clips", "--num_frames", str(spec.frames), "--frame_interval", str(spec.interval),
                     "--image_size", str(spec.size), "--device", "cpu", "--num_workers", "0", "--out",
                     str(feats)]) == 0
    argv = ["train", "--data", str(feats), "--batch_size", str(spec.batch), "--max_steps", "2", "--log_every", "1",
            "--sample_every", "0", "--mixed_precision", "fp32", "--device", "cpu", "--class_dropout_prob", "0",
            "--lr", "1e-3", "--outputs", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (config["model"]["num_frames"], config["data"]["num_frames"]) == (spec.config["model.num_frames"],
                                                                           spec.frames)
    ours = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    fly = [r["loss"] for r in read_metrics(video_runs(family)["full"] / "metrics.jsonl")][:2]
    assert ours == pytest.approx(fly, rel=1e-5)
