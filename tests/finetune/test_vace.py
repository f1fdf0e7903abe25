"""Wan2.1-VACE fine-tuning (``ditforge train --init_from VACE_FOLDER``, ``models/adapters/wan_vace.py``,
``Pretrained.encode_references``, ``encoders/batch.py``'s ``PREFIX``): on the built-in clips with one reference image
each (a CSV's ``reference_image`` column, or the default crop of a frame), with the tiny random pipeline of
``tiny_pipelines.make_vace`` (16 px, 5 frames: 1 reference + 2 clip latent frames of 16 x 2 x 2): the first loss of
LoRA and full runs against diffusers' arithmetic, resume, the export in ``WanVACEPipeline`` and the LoRA file
through ``WanVACEPipeline.load_lora_weights``; features refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli
from ditforge.data.clips import clips_rows
from ditforge.data.video import default_reference, write_video_csv
from ditforge.train.logging import read_metrics
from families import assert_lora_file_loads, assert_one_line_error, video_train_argv  # on sys.path
from references import _first_batch, as_pil, flow_draws
from tiny_pipelines import make_vace

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES, INTERVAL, BATCH = 16, 5, 2, 2


def _argv(folder: Path, data: str, out: Path, *extra: str) -> list[str]:
    argv = video_train_argv(folder, out, SIZE, FRAMES, INTERVAL, BATCH, "--lr", "1e-2", *extra)
    argv[argv.index("clips")] = data
    return argv


@pytest.fixture(scope="module")
def vace(tmp_path_factory, one_thread_module):
    """The pipeline folder, a CSV of the built-in clips with a random reference PNG each (24 x 40: centre-cropped
    to 16 x 16 by the data set), and the LoRA run of 4 steps and the full run of 2 on it."""
    root = tmp_path_factory.mktemp("vace")
    folder = make_vace(root / "vace")
    rng = np.random.default_rng(11)
    rows = []
    for i, row in enumerate(clips_rows()):
        ref = root / f"ref{i}.png"
        Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(ref)
        rows.append({**row, "reference_image": ref.name})
    csv = write_video_csv(rows, root / "refs.csv", ("path", "text", "reference_image"))
    runs = {}
    for kind, steps, extra in (("lora", "4", ("--lora_rank", "4")), ("full", "2", ())):
        runs[kind] = root / kind
        assert cli.main(_argv(folder, str(csv), runs[kind], "--max_steps", steps, "--ckpt_every", steps, *extra)) == 0
    return {"folder": folder, "csv": str(csv), "runs": runs, "root": root}


def pipeline_control(pipe, refs: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The control (1, 96, R + T', h, w) ``WanVACEPipeline.__call__`` builds from the references ``refs`` (R, 3, H, W)
    in [-1, 1] alone, for a ``SIZE`` x ``SIZE`` x ``FRAMES`` video (``preprocess_conditions``,
    ``prepare_video_latents``, ``prepare_masks``), and the preprocessed references."""
    video, mask, ref = pipe.preprocess_conditions(None, None, [as_pil(refs)], 1, SIZE, SIZE, FRAMES, torch.float32,
                                                  "cpu")
    latents = pipe.prepare_video_latents(video, mask, ref, None, "cpu")
    return torch.cat([latents, pipe.prepare_masks(mask, ref, None)], dim=1), ref


def vace_first_loss(folder: Path, data: str) -> float:
    """Step 0's loss from diffusers' pieces: the run's first batch (``GlobalBatchSampler``, seed 0) of ``data``,
    each clip's reference its ``references`` (else ``default_reference``); the control of each clip as
    ``WanVACEPipeline.__call__`` builds it (``preprocess_conditions``, ``prepare_video_latents``, ``prepare_masks``)
    from the reference alone; x0 = the reference's normalised VAE mode (of the preprocessed reference) before the
    clip's normalised posterior sample (DiffSynth-Studio's ``WanVideoUnit_InputVideoEmbedder``); the draws in
    ditforge's order over all R + T' latent frames from ``derive_seed(0, 0)`` (the posterior eps of the reference
    frames unused: std 0); sigma = shift u / (1 + (shift - 1) u); the transformer called directly with
    ``control_hidden_states``; MSE in float32 over all R + T' frames."""
    import diffusers

    pipe = diffusers.WanVACEPipeline.from_pretrained(str(folder), local_files_only=True)
    items = _first_batch(data, SIZE, FRAMES, INTERVAL, BATCH)
    cfg = pipe.vae.config
    view = (1, cfg.z_dim, 1, 1, 1)
    mean, inv_std = torch.tensor(cfg.latents_mean).view(view), 1.0 / torch.tensor(cfg.latents_std).view(view)
    shift = float(pipe.scheduler.config["flow_shift"])
    with torch.no_grad():
        controls, leads = [], []
        for it in items:
            refs = it["references"] if "references" in it else default_reference(it["video"], 0, it["index"])[None]
            control, ref = pipeline_control(pipe, refs)
            controls.append(control)
            mode = pipe.vae.encode(ref[0][0][None, :, None]).latent_dist.mode()  # (3, H, W) -> (1, 16, 1, h, w)
            leads.append((mode - mean) * inv_std)
        post = pipe.vae.encode(torch.stack([it["video"] for it in items])).latent_dist
        lead = torch.cat(leads)
        full = type("Post", (), {"mean": torch.cat([lead, post.mean], 2)})
        noise, u, eps = flow_draws(full)
        R = lead.shape[2]
        x0 = torch.cat([lead, (post.mean + post.std * eps[:, :, R:] - mean) * inv_std], 2)
        sigma = (shift * u / (1 + (shift - 1) * u)).view(-1, 1, 1, 1, 1)
        embeds, _ = pipe.encode_prompt([it["text"] for it in items], do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=512)
        pred = pipe.transformer(hidden_states=(1 - sigma) * x0 + sigma * noise, timestep=sigma.flatten() * 1000,
                                encoder_hidden_states=embeds, control_hidden_states=torch.cat(controls),
                                return_dict=False)[0]
    return float(torch.nn.functional.mse_loss(pred.float(), (noise - x0).float()))


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_first_loss_equals_diffusers_arithmetic(kind, vace):
    """The first logged loss of the LoRA and full runs (a CSV's ``reference_image`` column) equals
    ``vace_first_loss`` within 1e-5 relative (float32 sums in another order); the loss falls (lr 1e-2)."""
    losses = [r["loss"] for r in read_metrics(vace["runs"][kind] / "metrics.jsonl")]
    assert losses[0] == pytest.approx(vace_first_loss(vace["folder"], vace["csv"]), rel=1e-5)
    assert losses[-1] < losses[0]


def test_default_reference_first_loss_and_resume(vace, tmp_path):
    """Stopped after 2 steps and resumed to 4, the LoRA run logs the uninterrupted run's losses bit for bit; with no
    reference given (the built-in clips), the first loss takes the default crop (``default_reference``) and equals
    ``vace_first_loss`` (1e-5 relative)."""
    part, crop = tmp_path / "part", tmp_path / "crop"
    assert cli.main(_argv(vace["folder"], vace["csv"], part, "--max_steps", "2", "--ckpt_every", "2",
                          "--lora_rank", "4")) == 0
    assert cli.main(["train", "--outputs", str(part), "--resume", "auto", "--max_steps", "4"]) == 0
    assert [r["loss"] for r in read_metrics(part / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(vace["runs"]["lora"] / "metrics.jsonl")]
    assert cli.main(_argv(vace["folder"], "clips", crop, "--max_steps", "1", "--lora_rank", "4")) == 0
    assert read_metrics(crop / "metrics.jsonl")[0]["loss"] == pytest.approx(vace_first_loss(vace["folder"], "clips"),
                                                                           rel=1e-5)


def test_exports_load_in_the_vace_pipeline(vace, tmp_path):
    """``--format diffusers`` of the full run loads in ``WanVACEPipeline`` with the trained (EMA) transformer
    weights exactly (moved from the base); ``--format lora`` of the LoRA run through ``load_lora_weights`` gives
    ditforge's LoRA model's output on fresh random inputs (latents of 1 + 2 frames, times, UMT5 states, control)
    within 1e-5 of its largest magnitude, the base off by over 100 times that."""
    import diffusers

    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    out = tmp_path / "full"
    assert cli.main(["export", "--ckpt", str(vace["runs"]["full"]), "--format", "diffusers", "--out", str(out)]) == 0
    exported = diffusers.WanVACEPipeline.from_pretrained(str(out), local_files_only=True).transformer.state_dict()
    trained = load_finetuned(*load_weights(vace["runs"]["full"], use_ema=True),
                             torch.device("cpu"))[1].inner.state_dict()
    base = diffusers.WanVACETransformer3DModel.from_pretrained(str(vace["folder"]), subfolder="transformer",
                                                                local_files_only=True).state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    assert any(not torch.equal(base[k], trained[k]) for k in trained)

    lora = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(vace["runs"]["lora"]), "--format", "lora", "--out", str(lora)]) == 0
    pipe = diffusers.WanVACEPipeline.from_pretrained(str(vace["folder"]), local_files_only=True)
    ours = load_finetuned(*load_weights(vace["runs"]["lora"], use_ema=True), torch.device("cpu"))[1]
    g = torch.Generator().manual_seed(1234)
    inputs = {"hidden_states": torch.randn(2, 16, 3, 2, 2, generator=g), "timestep": torch.rand(2, generator=g) * 1000,
              "encoder_hidden_states": torch.randn(2, 512, 32, generator=g),
              "control_hidden_states": torch.randn(2, 96, 3, 2, 2, generator=g), "return_dict": False}
    assert_lora_file_loads(pipe, ours, lora, inputs, 100)


def test_features_are_refused_in_one_line(vace, tmp_path, capsys):
    """``extract-features --init_from VACE_FOLDER``: exit 2 and one line (stored features carry no references)."""
    assert_one_line_error(capsys, ["extract-features", "--init_from", str(vace["folder"]), "--data", "clips",
                                   "--num_frames", str(FRAMES), "--frame_interval", str(INTERVAL), "--image_size",
                                   str(SIZE), "--device", "cpu", "--out", str(tmp_path / "feats")],
                          "which stored features do not carry")


def test_a_folder_of_clips_reads_its_ref_pngs(vace, tmp_path):
    """A folder of clips: ``clip.ref.png`` beside ``clip.mp4`` is the clip's reference (no sample of its own), read
    centre-cropped at the bucket's shape (against ``center_crop_arr`` of the file); a LoRA step trains on it."""
    from ditforge.data.buckets import BucketDataset, data_buckets
    from ditforge.data.folders import folder_rows
    from ditforge.data.images import center_crop_arr
    from tiny_pipelines import smooth_pixels, write_mp4

    rng = np.random.default_rng(3)
    for j in range(2):
        write_mp4(tmp_path / f"clip{j}.mp4", smooth_pixels(rng, FRAMES, SIZE, SIZE))
        (tmp_path / f"clip{j}.txt").write_text(f"clip {j}")
        Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(tmp_path / f"clip{j}.ref.png")
    rows = folder_rows(str(tmp_path))
    assert [(Path(r["path"]).name, [Path(p).name for p in r["reference_image"]]) for r in rows] == [
        ("clip0.mp4", ["clip0.ref.png"]), ("clip1.mp4", ["clip1.ref.png"])]
    ds = BucketDataset(rows, lambda sizes: data_buckets(sizes, SIZE, 16, 4, None, 1, BATCH, 1))
    item = ds[(1, 0)]
    with Image.open(tmp_path / "clip1.ref.png") as img:
        want = center_crop_arr(img.convert("RGB"), tuple(item["x"].shape[-2:]))
    got = ((item["references"][0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(got, want)
    argv = video_train_argv(vace["folder"], tmp_path / "run", SIZE, 1, 1, BATCH, "--max_steps", "1", "--lora_rank", "4")
    i = argv.index("--num_frames")
    del argv[i:i + 4]
    argv[argv.index("--data") + 1] = str(tmp_path)
    assert cli.main(argv) == 0
