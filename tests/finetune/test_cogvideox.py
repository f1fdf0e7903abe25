"""CogVideoX's own fine-tuning tests (``ditforge train --init_from COGVIDEOX_FOLDER --data clips``, ``ditforge
sample``), end to end on the CPU with the tiny random pipelines of ``tiny_pipelines.make_cogvideox`` (32 px, 9 frames:
latents 4 x 3 x 4 x 4): the one-line errors (the 8k + 1 frame rule, frame sizes), and image to video
(``CogVideoXImageToVideoPipeline``) with the clean first frame (``--no-noised_image_input``), and a transformer of
another caption length (``max_text_seq_length`` 16: training, sampling, export). What every video family
shares (first loss, resume, export, LoRA file, features) is in test_video_families.py, what every image-to-video
family shares (first loss, sampling like the pipeline) in test_i2v_families.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ditforge import cli
from ditforge.data.sampler import derive_seed
from ditforge.train.logging import read_metrics
from families import KINDS, VIDEO, assert_frames_match, assert_one_line_error  # tests/finetune is on sys.path
from references import _first_batch, cogvideox_first_loss, cogvideox_i2v_first_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return VIDEO["cogvideox"].argv(folder, out, *extra)


def test_bad_input_lines(cogvideox_pipeline, tmp_path, capsys):
    """One line, exit 2, nothing written: a frame count CogVideoX's VAE does not decode back (8k + 1: 5 frames
    give 2 latent frames, which decode to 8), naming the nearest valid counts; frames larger than a CogVideoX 1.5
    transformer's rotary grid (``patch_size_t``: its config's ``sample_height`` x ``sample_width``); a frame size other
    than a transformer's learned positions take (the same sizes)."""
    assert_one_line_error(capsys, _argv(cogvideox_pipeline, tmp_path / "r", "--max_steps", "1", "--num_frames", "5"),
                          "--num_frames 5", "8k + 1", "1 and 9")
    assert not (tmp_path / "r").exists()
    from diffusers import CogVideoXTransformer3DModel

    folder = tmp_path / "cog15"
    shutil.copytree(cogvideox_pipeline, folder)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    shutil.rmtree(folder / "transformer")
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    CogVideoXTransformer3DModel(**{**config, "patch_size_t": 2}).save_pretrained(folder / "transformer")
    assert_one_line_error(capsys, _argv(folder, tmp_path / "r", "--max_steps", "1", "--image_size", "64"),
                          "--image_size 64 --num_frames 9", "takes frames of at most 32 x 32", "rotary",
                          "sample_height x sample_width")
    assert not (tmp_path / "r").exists() or not (tmp_path / "r" / "checkpoints").exists()
    shutil.rmtree(folder / "transformer")  # learned positions (the 5B I2V model's) take the config's size alone
    CogVideoXTransformer3DModel(**{**config, "use_learned_positional_embeddings": True}).save_pretrained(
        folder / "transformer")
    assert_one_line_error(capsys, _argv(folder, tmp_path / "r", "--max_steps", "1", "--image_size", "64"),
                          "--image_size 64 --num_frames 9", "takes 32 x 32 frames only",
                          "learned positional embeddings", "sample_height")
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_i2v_clean_image_input_first_loss(cogvideox_i2v_pipeline, i2v_runs, tmp_path):
    """Image-to-video with ``--no-noised_image_input`` (the clean first frame's posterior mode): the first loss
    equals ``references.cogvideox_i2v_first_loss``'s clean form within 1e-5 relative, and differs from the default
    run's (``i2v_runs``: CogVideoX's training noise on the frame, its first loss held to the noised form in
    test_i2v_families.py): the noise reaches the loss."""
    clean = tmp_path / "clean"
    assert cli.main(_argv(cogvideox_i2v_pipeline, clean, "--max_steps", "1", "--no-noised_image_input")) == 0
    plain = cogvideox_i2v_first_loss(cogvideox_i2v_pipeline, noised_image_input=False)
    assert read_metrics(clean / "metrics.jsonl")[0]["loss"] == pytest.approx(plain, rel=1e-5)
    noised = read_metrics(i2v_runs("cogvideox_i2v") / "metrics.jsonl")[0]["loss"]
    assert abs(noised - plain) > 1e-3 * plain


def _short_text(folder: Path, out: Path) -> Path:
    """A copy of the tiny CogVideoX whose transformer takes 16 T5 tokens (``max_text_seq_length``) with CogVideoX-2B's
    sinusoidal positions (``use_rotary_positional_embeddings`` off): its joint positional table is built for 16 text
    tokens, so a caption of the call's default 226 fails in diffusers' own forward. The same weights (the table is
    no parameter)."""
    shutil.copytree(folder, out)
    path = out / "transformer" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "max_text_seq_length": 16, "use_rotary_positional_embeddings": False}))
    return out


def test_caption_length_from_the_transformer(cogvideox_pipeline, tmp_path, caplog):
    """A transformer of ``max_text_seq_length`` 16: LoRA and full fine-tuning (1 step each) encode the captions at 16
    tokens, their first loss equal to ``references.cogvideox_first_loss`` at ``max_sequence_length=16`` within 1e-5
    relative; the clips' captions are longer, so each run warns once, one line naming the first long caption's token
    count (the tokenizer's, special tokens included) and the 16 with its source, and diffusers' own truncation lines
    (one an encoding) are not logged. ``extract-features`` stores the states diffusers' own ``encode_prompt(...,
    max_sequence_length=16)`` gives (1e-6). The full run exports a folder ``CogVideoXPipeline.from_pretrained``
    loads, whose own call with ``max_sequence_length=16`` draws the video ``ditforge sample`` draws, to one uint8
    level."""
    import logging

    import diffusers

    folder, spec = _short_text(cogvideox_pipeline, tmp_path / "pipe"), VIDEO["cogvideox"]
    reference = cogvideox_first_loss(folder, max_sequence_length=16)
    pipe = diffusers.CogVideoXPipeline.from_pretrained(str(folder), local_files_only=True)
    texts = [item["text"] for item in _first_batch("clips", spec.size, spec.frames, spec.interval, spec.batch)]
    first_long = next(n for n in (len(pipe.tokenizer(t).input_ids) for t in texts) if n > 16)  # the one warned of
    library = logging.getLogger("diffusers")  # diffusers' loggers do not propagate to the root's caplog
    library.addHandler(caplog.handler)
    try:
        for kind in ("lora", "full"):
            caplog.clear()
            run = tmp_path / kind
            assert cli.main(_argv(folder, run, "--max_steps", "1", *KINDS[kind])) == 0
            assert read_metrics(run / "metrics.jsonl")[0]["loss"] == pytest.approx(reference, rel=1e-5), kind
            warned = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
            assert len(warned) == 1 and "\n" not in warned[0], warned
            assert f"{first_long} tokens to 16 (transformer.config.max_text_seq_length)" in warned[0]
    finally:
        library.removeHandler(caplog.handler)
    from ditforge.data.features import FeatureDataset

    feats = tmp_path / "feats"
    assert cli.main(["extract-features", "--init_from", str(folder), "--data", "clips", "--num_frames",
                     str(spec.frames), "--frame_interval", str(spec.interval), "--image_size", str(spec.size),
                     "--device", "cpu", "--num_workers", "0", "--out", str(feats)]) == 0
    item = FeatureDataset(feats)[0]
    with torch.no_grad():
        states, _ = pipe.encode_prompt([item["text"]], do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=16)
    assert torch.allclose(item["cond"]["encoder_hidden_states"], states[0], atol=1e-6)
    out, prompt, npz = tmp_path / "export", "a rabbit on a green hill", tmp_path / "s.npz"
    assert cli.main(["export", "--ckpt", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    exported = diffusers.CogVideoXPipeline.from_pretrained(str(out), local_files_only=True)
    assert exported.transformer.config.max_text_seq_length == 16
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", prompt, "--num_sampling_steps", "2", "--cfg_scale",
                     str(spec.cfg), "--out", str(tmp_path / "clip.mp4"), "--save_npz", str(npz), "--device",
                     "cpu"]) == 0
    g = torch.Generator("cpu").manual_seed(derive_seed(0, 0))
    video = exported(prompt=[prompt], num_inference_steps=2, guidance_scale=spec.cfg, height=spec.size,
                     width=spec.size, num_frames=spec.frames, generator=g, max_sequence_length=16,
                     output_type="np").frames
    assert_frames_match(npz, video, (1, spec.frames, spec.size, spec.size, 3))
