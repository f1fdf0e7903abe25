"""DreamBooth over images and clips for a video pipeline (``--instance_data FOLDER --instance_prompt``, issue 64
item 4): a folder of 4 png images and 2 mp4 clips at two aspect ratios, each medium captioned with the instance
prompt, read in buckets made from the data (``instance_rows`` + ``BucketDataset``, the folder-of-clips bucketer).
Wan 2.1's tiny pipeline trains a LoRA whose first-step loss is diffusers' arithmetic (``references.wan_loss``) on
that step's bucket, and whose ``--format lora`` and ``--format comfyui`` exports load through ``load_lora_weights``; CogVideoX's runs a
step on the same mixed folder."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import references
from ditforge import cli
from ditforge.data.buckets import BucketBatchSampler, BucketDataset, data_buckets
from ditforge.data.folders import instance_rows
from ditforge.train.logging import read_metrics
from families import KINDS, VIDEO, assert_one_line_error, video_train_argv
from tiny_pipelines import smooth_pixels, write_mp4

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, SIZE, BATCH, SEED = "a video of sks man", 32, 2, 3
SHAPES = {"square": (32, 32), "wide": (32, 64)}  # (height, width): one image pair and one clip per aspect ratio


@pytest.fixture(scope="module")
def instance_folder(tmp_path_factory) -> Path:
    """ROOT/<square|wide>/: 2 png images and one 9-frame mp4 clip each (``smooth_pixels``); no caption files (the
    instance prompt captions all)."""
    root = tmp_path_factory.mktemp("instance")
    pixels = functools.partial(smooth_pixels, np.random.default_rng(0))

    for kind, (h, w) in SHAPES.items():
        (root / kind).mkdir()
        for j in range(2):
            Image.fromarray(pixels(1, h, w)[0]).save(root / kind / f"still_{j}.png")
        write_mp4(root / kind / "clip.mp4", pixels(9, h, w))
    return root


def _argv(pipe: Path, folder: Path, out: Path, *extra: str) -> list[str]:
    """``train`` of ``pipe`` with DreamBooth on ``folder`` (no ``--data``, no ``--num_frames``: each medium's own
    count by the frame rule), a rank-4 LoRA."""
    argv = video_train_argv(pipe, out, SIZE, 1, 1, BATCH, "--instance_data", str(folder), "--instance_prompt", PROMPT,
                            *KINDS["lora"], *extra)
    i = argv.index("--num_frames")
    del argv[i:i + 2]
    i = argv.index("--data")
    del argv[i:i + 2]
    return argv


def test_wan_character_lora_trains_like_diffusers_and_loads(wan_pipeline, instance_folder, tmp_path):
    """2 steps of a Wan LoRA (B initialised to zero, so step 0 sees the base model) with a ``--validation_prompts``
    sample of the identifier rendered at step 2 (as an mp4): the first step's loss equals
    diffusers' arithmetic on that step's global batch, read at its bucket's shape and captioned ``PROMPT``, within
    1e-5 relative (fp32); the ``--format lora`` export, read by ``WanPipeline.load_lora_weights``, gives ditforge's
    LoRA model's output on fresh inputs within 1e-5 of its largest magnitude, the base model over 100 times that; the
    ``--format comfyui`` file loaded by ``load_lora_weights`` and fused gives the ``--format diffusers`` export's
    (ditforge's merged LoRA) transformer weights within 1e-6."""
    import diffusers

    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    out, prompts = tmp_path / "run", tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT} walking --w 32 --h 32 --f 5 --s 2\n")
    argv = _argv(wan_pipeline, instance_folder, out, "--max_steps", "2", "--seed", str(SEED), "--sample_every", "2",
                 "--validation_prompts", str(prompts))
    assert cli.main(argv) == 0
    assert [p.name for p in (out / "samples" / "step-0000002").iterdir()] == ["001-a-video-of-sks-man-walking.mp4"]
    first = read_metrics(out / "metrics.jsonl")[0]
    ds = BucketDataset(instance_rows(str(instance_folder), PROMPT),
                       lambda sizes: data_buckets(sizes, SIZE, 16, 4, None, 1, BATCH, 1), seed=SEED)
    assert len(ds) == 6 and set(ds.texts) == {PROMPT} and sorted(ds.sizes[:, 2].tolist()) == [1, 1, 1, 1, 9, 9]
    b, ids = BucketBatchSampler(ds.buckets, ds.sizes, seed=SEED).global_batch(0)
    pixels = torch.stack([ds[(int(i), b)]["x"] for i in ids])
    pipe = diffusers.WanPipeline.from_pretrained(str(wan_pipeline), local_files_only=True)
    assert first["loss"] == pytest.approx(references.wan_loss(pipe, pixels, [PROMPT] * len(ids), 0, SEED), rel=1e-5)

    lora = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(out), "--format", "lora", "--out", str(lora)]) == 0
    _, ours, _ = load_finetuned(*load_weights(out, use_ema=True), torch.device("cpu"))
    base, theirs, mine = VIDEO["wan"].lora_outputs(pipe, ours, lambda: pipe.load_lora_weights(str(lora)))
    tol = 1e-5 * mine.abs().max()
    assert (theirs - mine).abs().max() <= tol
    assert (base - mine).abs().max() > 100 * tol

    # --format comfyui (original names), read by diffusers' converter and fused: ditforge's merged LoRA
    comfy, merged = tmp_path / "sks.safetensors", tmp_path / "merged"
    assert cli.main(["export", "--ckpt", str(out), "--format", "comfyui", "--out", str(comfy)]) == 0
    assert cli.main(["export", "--ckpt", str(out), "--format", "diffusers", "--out", str(merged)]) == 0
    pipe = diffusers.WanPipeline.from_pretrained(str(wan_pipeline), local_files_only=True)
    pipe.load_lora_weights(str(comfy))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    fused = pipe.transformer.state_dict()
    want = diffusers.WanTransformer3DModel.from_pretrained(str(merged), subfolder="transformer",
                                                           local_files_only=True).state_dict()
    assert fused.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(fused[key], value, rtol=0, atol=1e-6)


def test_cogvideox_runs_a_step_on_images_and_clips(cogvideox_pipeline, instance_folder, tmp_path):
    """CogVideoX (frame rule 8k + 1 of its tiny VAE) trains a step on the mixed folder; the loss is finite."""
    out = tmp_path / "run"
    assert cli.main(_argv(cogvideox_pipeline, instance_folder, out, "--max_steps", "1")) == 0
    assert np.isfinite(read_metrics(out / "metrics.jsonl")[0]["loss"])


def test_bad_instance_input_is_one_line(wan_pipeline, tmp_path, capsys):
    """An empty --instance_data folder: one line, exit 2."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(capsys, _argv(wan_pipeline, empty, tmp_path / "a"), "--instance_data")


def test_prior_preservation_draws_class_clips_and_weights_their_loss(wan_pipeline, tmp_path):
    """DreamBooth with prior preservation on 2 instance clips (32 px, 9 frames) and an empty --class_data: the base
    pipeline draws the 2 class clips (``--num_class_images 2``, 2 steps each) as mp4 + txt of 5 frames (--num_frames)
    at 32 x 32 (written 2x enlarged, ``display_scale``); the first step's loss equals ``mse(instance) + prior_loss_weight * mse(class)`` (weight 0.5) computed
    here from diffusers' arithmetic on the interleaved rows [instance 0, class 0, instance 1, class 1] (instance i's
    class clip: its data index mod 2, read at the bucket's shape from ``derive_seed(seed, CLASS_STREAM, j)``), the
    step's draws over those 4 rows, per-row MSEs averaged in each half (1e-5 relative)."""
    import diffusers

    from ditforge.data.buckets import read_at_bucket
    from ditforge.data.prior import CLASS_STREAM
    from ditforge.data.sampler import derive_seed
    from ditforge.data.video import display_scale, probe_video
    from references import step0_latents

    instance, classes = tmp_path / "instance", tmp_path / "class"
    instance.mkdir()
    rng = np.random.default_rng(1)
    for j in range(2):
        write_mp4(instance / f"clip{j}.mp4", smooth_pixels(rng, 9, 32, 32))
    out, weight = tmp_path / "run", 0.5
    argv = _argv(wan_pipeline, instance, out, "--max_steps", "1", "--seed", str(SEED), "--num_frames", "5",
                 "--class_data", str(classes), "--class_prompt", "a video of a man", "--num_class_images", "2",
                 "--class_sampling_steps", "2", "--prior_loss_weight", str(weight))
    assert cli.main(argv) == 0
    clips = sorted(classes.glob("*.mp4"))
    assert [p.name for p in clips] == ["000-a-video-of-a-man.mp4", "001-a-video-of-a-man.mp4"]
    assert all(p.with_suffix(".txt").read_text() == "a video of a man" for p in clips)
    side = 32 * display_scale(32, 32)  # write_video enlarges clips under 64 px (nearest neighbour), real ones not
    assert all((m["num_frames"], m["height"], m["width"]) == (5, side, side) for m in map(probe_video, clips))

    ds = BucketDataset(instance_rows(str(instance), PROMPT),
                       lambda sizes: data_buckets(sizes, SIZE, 16, 4, 5, 1, BATCH, 1), seed=SEED)
    b, ids = BucketBatchSampler(ds.buckets, ds.sizes, seed=SEED).global_batch(0)
    bucket = ds.buckets.buckets[b]
    rows, texts = [], []
    for i in ids:
        j = int(i) % len(clips)
        rows += [ds[(int(i), b)]["x"], read_at_bucket(str(clips[j]), bucket, 1, derive_seed(SEED, CLASS_STREAM, j))]
        texts += [PROMPT, "a video of a man"]
    pipe = diffusers.WanPipeline.from_pretrained(str(wan_pipeline), local_files_only=True)
    shift = float(pipe.scheduler.config["flow_shift"])
    with torch.no_grad():
        x0, noise, sigma, *_ = step0_latents(pipe, torch.stack(rows), shift, 0, SEED)
        embeds, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device="cpu", max_sequence_length=512)
        s = sigma.view(-1, 1, 1, 1, 1)
        pred = pipe.transformer(hidden_states=(1 - s) * x0 + s * noise, timestep=sigma * 1000,
                                encoder_hidden_states=embeds, return_dict=False)[0]
    per_row = ((pred.float() - (noise - x0).float()) ** 2).flatten(1).mean(1)
    want = float(per_row[0::2].mean() + weight * per_row[1::2].mean())
    assert read_metrics(out / "metrics.jsonl")[0]["loss"] == pytest.approx(want, rel=1e-5)
