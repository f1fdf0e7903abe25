"""Wan2.2-Animate (``models/adapters/wan_animate.py``): ``ditforge sample`` of a tiny random ``WanAnimatePipeline``
built here from diffusers' classes against the pipeline's own call from the same seed, and its bad input; a LoRA
step on a CSV of (character image, pose video, face video, target clip) rows: its first loss against the pipeline's
arithmetic, its export through ``WanAnimatePipeline.load_lora_weights``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditforge.cli import main
from ditforge.data.video import write_video, write_video_csv
from families import assert_lora_file_loads, assert_one_line_error, video_train_argv  # on sys.path
from references import _first_batch, as_pil, flow_draws
from tiny_pipelines import make_animate

FRAMES = 5  # one segment of 4k + 1 frames (segment_frame_length 5, one conditioning frame)


@pytest.fixture(scope="module")
def animate(tmp_path_factory):
    """A tiny ``WanAnimatePipeline`` folder (``tiny_pipelines.make_animate``) and random 16 px inputs: character
    PNG, pose and face MP4s of ``FRAMES`` frames."""
    from PIL import Image

    root = tmp_path_factory.mktemp("animate")
    make_animate(root / "pipe")
    rng = np.random.default_rng()
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "character.png")
    for name in ("pose", "face"):
        write_video(rng.integers(0, 256, (FRAMES, 16, 16, 3), dtype=np.uint8), root / f"{name}.mp4")
    write_video(rng.integers(0, 256, (FRAMES + 4, 16, 16, 3), dtype=np.uint8), root / "long.mp4")
    return root


def _args(root, *more):
    return ["sample", "--ckpt", str(root / "pipe"), "--prompt", "a cat dancing", "--image",
            str(root / "character.png"), "--pose_video", str(root / "pose.mp4"), "--face_video",
            str(root / "face.mp4"), "--height", "16", "--width", "16", "--num_sampling_steps", "2",
            "--segment_frame_length", str(FRAMES), *more]


def test_sample_returns_the_pipeline_frames(animate, tmp_path):
    """``sample()``'s returned frames against the pipeline's call from the same seed, to 1e-5 before rounding
    (both uint8 from the same float frames: equal)."""
    from diffusers import WanAnimatePipeline
    from PIL import Image

    from ditforge.cli import build_parser
    from ditforge.data.sampler import derive_seed
    from ditforge.data.video import read_clip
    from ditforge.sample.command import sample
    from ditforge.sample.load import SampleConfig

    args = vars(build_parser().parse_args(_args(animate, "--seed", "3", "--out", str(tmp_path / "out"))))
    args.pop("command", None)
    ours = sample(SampleConfig(**args))
    pipe = WanAnimatePipeline.from_pretrained(str(animate / "pipe"))
    video = {n: [Image.fromarray(f) for f in read_clip(str(animate / f"{n}.mp4"), FRAMES, 1, lambda _: 0)[0]]
             for n in ("pose", "face")}
    want = pipe(image=Image.open(animate / "character.png").convert("RGB"), pose_video=video["pose"],
                face_video=video["face"], prompt="a cat dancing", height=16, width=16,
                segment_frame_length=FRAMES, num_inference_steps=2, output_type="pt",
                generator=[torch.Generator().manual_seed(derive_seed(3, 0))]).frames
    want = ((want.transpose(1, 2).float() * 2 - 1).clamp(-1, 1) + 1) * 127.5
    want = want.round().to(torch.uint8).movedim(1, -1).numpy()
    assert ours.shape == (1, FRAMES, 16, 16, 3)
    np.testing.assert_array_equal(ours, want)


@pytest.mark.parametrize("more, says", [
    (("--face_video", "missing.mp4"), "--face_video missing.mp4: no such file"),
    (("--face_video", "long.mp4"), "--face_video: 9 frames, the --pose_video has 5"),
    (("--mode", "replace"), "--background_video: WanAnimatePipeline in mode replace needs it"),
    (("--mode", "dance"), "--mode dance: WanAnimatePipeline takes animate or replace"),
])
def test_bad_input_is_one_line_exit_2(animate, capsys, monkeypatch, more, says):
    monkeypatch.chdir(animate)
    assert main(_args(animate, *more)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


BATCH, COLUMNS = 2, ("path", "text", "image", "pose_video", "face_video")


def _train_argv(root, data, out, *extra):
    argv = video_train_argv(root / "pipe", out, 16, FRAMES, 1, BATCH, "--lora_rank", "4", *extra)
    argv[argv.index("clips")] = str(data)
    return argv


@pytest.fixture(scope="module")
def animate_run(animate, one_thread_module):
    """A CSV of 2 rows of random 16 px clips of ``FRAMES`` frames (target, pose and face videos, a 24 x 40 character
    PNG: centre-cropped to 16 x 16 by the data set) and a 1-step LoRA run on it, with the default --sample_every
    (no grid: the run ends without one)."""
    rng = np.random.default_rng(5)
    rows = []
    for i in range(2):
        row = {"text": f"a dancer {i}", "path": f"clip{i}.mp4", "image": f"char{i}.png",
               "pose_video": f"pose{i}.mp4", "face_video": f"face{i}.mp4"}
        for key in ("path", "pose_video", "face_video"):
            write_video(rng.integers(0, 256, (FRAMES, 16, 16, 3), dtype=np.uint8), animate / row[key])
        from PIL import Image
        Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(animate / row["image"])
        rows.append(row)
    csv = write_video_csv(rows, animate / "train.csv", COLUMNS)
    run = animate / "lora"
    argv = _train_argv(animate, csv, run, "--max_steps", "1", "--ckpt_every", "1")
    i = argv.index("--sample_every")
    del argv[i:i + 2]  # the default grid: resolve turns it off (the pipeline's call needs driving videos)
    assert main(argv) == 0
    assert not any((run / "samples").rglob("*.*"))
    return {"csv": csv, "run": run}


def animate_first_loss(folder, data) -> float:
    """Step 0's loss from diffusers' pieces: the run's first batch of ``data``; each row's conditioning as
    ``WanAnimatePipeline.__call__`` builds its first segment (mode animate) from the row's images as uint8 PIL
    (``encode_image``, ``vae_image_processor.preprocess`` + ``prepare_reference_image_latents``,
    ``prepare_prev_segment_cond_latents`` of no previous segment, ``preprocess_video`` + ``prepare_pose_latents``, the
    face frames at ``motion_encoder_size``); x0 = the character's normalised VAE mode (the reference latents' last 16
    channels) before the clip's normalised posterior sample; the draws in ditforge's order over the 1 + T' latent
    frames from ``derive_seed(0, 0)``; sigma = shift u / (1 + (shift - 1) u); the transformer called as the
    pipeline's loop calls it (``cat([latents, reference_latents], 1)``); MSE in float32 over all 1 + T' frames."""
    from diffusers import WanAnimatePipeline

    pipe = WanAnimatePipeline.from_pretrained(str(folder), local_files_only=True)
    items = _first_batch(str(data), 16, FRAMES, 1, BATCH)
    cfg = pipe.vae.config
    view = (1, cfg.z_dim, 1, 1, 1)
    mean, inv_std = torch.tensor(cfg.latents_mean).view(view), 1.0 / torch.tensor(cfg.latents_std).view(view)
    shift = float(pipe.scheduler.config["flow_shift"])
    with torch.no_grad():
        conds = {"encoder_hidden_states_image": [], "reference_latents": [], "pose_hidden_states": [],
                 "face_pixel_values": []}
        for it in items:
            char = as_pil(it["image"][None])[0]
            pose, face = (as_pil(it[k].transpose(0, 1)) for k in ("pose_video", "face_video"))
            ref = pipe.prepare_reference_image_latents(
                pipe.vae_image_processor.preprocess(char, height=16, width=16, resize_mode="fill"), 1, device="cpu")
            prev = pipe.prepare_prev_segment_cond_latents(None, None, None, 1, FRAMES, 0, 16, 16, 1, "animate",
                                                          device="cpu")
            conds["reference_latents"].append(torch.cat([ref, prev], 2))
            conds["encoder_hidden_states_image"].append(pipe.encode_image(char, "cpu"))
            conds["pose_hidden_states"].append(pipe.prepare_pose_latents(
                pipe.video_processor.preprocess_video(pose, height=16, width=16), 1, device="cpu"))
            conds["face_pixel_values"].append(pipe.video_processor.preprocess_video(face, height=16, width=16))
        conds = {k: torch.cat(v) for k, v in conds.items()}
        lead = conds["reference_latents"][:, -cfg.z_dim:, :1]
        post = pipe.vae.encode(torch.stack([it["video"] for it in items])).latent_dist
        noise, u, eps = flow_draws(type("Post", (), {"mean": torch.cat([lead, post.mean], 2)}))
        x0 = torch.cat([lead, (post.mean + post.std * eps[:, :, 1:] - mean) * inv_std], 2)
        sigma = (shift * u / (1 + (shift - 1) * u)).view(-1, 1, 1, 1, 1)
        embeds, _ = pipe.encode_prompt([it["text"] for it in items], do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=512)
        xt = torch.cat([(1 - sigma) * x0 + sigma * noise, conds.pop("reference_latents")], 1)
        pred = pipe.transformer(hidden_states=xt, timestep=sigma.flatten() * 1000, encoder_hidden_states=embeds,
                                **conds, return_dict=False)[0]
    return float(torch.nn.functional.mse_loss(pred.float(), (noise - x0).float()))


def test_lora_first_loss_equals_the_pipeline_arithmetic(animate, animate_run):
    """The 1-step LoRA run's logged loss equals ``animate_first_loss`` within 1e-5 relative (float32 sums in
    another order)."""
    from ditforge.train.logging import read_metrics

    loss = read_metrics(animate_run["run"] / "metrics.jsonl")[0]["loss"]
    assert loss == pytest.approx(animate_first_loss(animate / "pipe", animate_run["csv"]), rel=1e-5)


def test_lora_export_loads_in_the_pipeline(animate, animate_run, tmp_path):
    """``--format lora`` of the run through ``WanAnimatePipeline.load_lora_weights`` gives ditforge's LoRA model's
    output on fresh random inputs within 1e-5 of its largest magnitude; the base differs (the step moved the
    adapters' B matrices off zero)."""
    from diffusers import WanAnimatePipeline

    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    lora = tmp_path / "lora"
    assert main(["export", "--ckpt", str(animate_run["run"]), "--format", "lora", "--out", str(lora)]) == 0
    pipe = WanAnimatePipeline.from_pretrained(str(animate / "pipe"), local_files_only=True)
    ours = load_finetuned(*load_weights(animate_run["run"], use_ema=True), torch.device("cpu"))[1]
    g = torch.Generator().manual_seed(1234)
    inputs = {"hidden_states": torch.randn(2, 36, 3, 8, 8, generator=g), "timestep": torch.rand(2, generator=g) * 1e3,
              "encoder_hidden_states": torch.randn(2, 512, 32, generator=g),
              "encoder_hidden_states_image": torch.randn(2, 9, 4, generator=g),
              "pose_hidden_states": torch.randn(2, 16, 2, 8, 8, generator=g),
              "face_pixel_values": torch.rand(2, 3, FRAMES, 16, 16, generator=g) * 2 - 1, "return_dict": False}
    assert_lora_file_loads(pipe, ours, lora, inputs, 10)


def test_training_bad_input_is_one_line(animate, animate_run, capsys, tmp_path):
    """The built-in clips (no pose_video / face_video columns), and --validation_prompts (its lines carry no driving
    videos): exit 2 and one line naming the columns, the flag."""
    assert_one_line_error(capsys, _train_argv(animate, "clips", tmp_path / "run", "--max_steps", "1"),
                          "trains on a video CSV with the columns pose_video, face_video")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a dancer --w 16 --h 16 --f 5 --s 2\n")
    assert_one_line_error(capsys, _train_argv(animate, animate_run["csv"], tmp_path / "val", "--max_steps", "1",
                                              "--validation_prompts", str(prompts), "--sample_every", "1"),
                          "--validation_prompts: a WanAnimatePipeline samples from driving videos")


def test_face_adapters_are_checkpointed_and_not_swapped(animate, animate_run, capsys, tmp_path):
    """The face adapters, which run between the blocks over every video token, are units of --grad_checkpoint as
    the blocks are (``block_paths``): under full checkpointing the forward saves no tensor from inside one for the
    backward (the unwrapped model saves some: the check can fail), and the LoRA gradients on fresh random inputs
    equal the unwrapped model's bit for bit (the CPU recomputes exactly). ``--blocks_to_swap`` counts the 2 blocks
    alone: 3 is refused with one line naming 2."""
    import copy

    from ditforge.models import block_paths
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel import apply_grad_checkpoint
    from ditforge.weights.lora import add_lora

    den = load_pretrained(animate / "pipe", torch.device("cpu")).denoiser
    add_lora(den.inner, 4, None, ["to_q", "to_k", "to_v", "to_out.0"])
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    with torch.no_grad():
        for name, p in den.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ref = copy.deepcopy(den)
    faces = [f"transformer.face_adapter.{i}" for i in range(len(den.inner.face_adapter))]
    assert faces and set(faces) <= set(block_paths(den))
    apply_grad_checkpoint(den, "full")
    x = torch.randn(2, 16, 3, 8, 8, generator=g)
    cond = {"encoder_hidden_states": torch.randn(2, 512, 32, generator=g),
            "encoder_hidden_states_image": torch.randn(2, 9, 4, generator=g),
            "reference_latents": torch.randn(2, 20, 3, 8, 8, generator=g),
            "pose_hidden_states": torch.randn(2, 16, 2, 8, 8, generator=g),
            "face_pixel_values": torch.rand(2, 3, FRAMES, 16, 16, generator=g) * 2 - 1}
    t = torch.rand(2, generator=g) * 1000
    saved_inside, grads = [], []
    for model in (den, ref):
        inside, count = [False], [0]
        for face in model.inner.modules():
            if type(face).__name__ == "WanAnimateFaceBlockCrossAttention":
                face.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
                face.register_forward_hook(lambda m, a, out: inside.__setitem__(0, False))

        def pack(tensor, inside=inside, count=count):
            count[0] += inside[0]
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model.denoise(x, t, **cond).square().mean()
        saved_inside.append(count[0])
        loss.backward()
        grads.append({n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()
                      if p.requires_grad})
    assert saved_inside[0] == 0 and saved_inside[1] > 0
    assert grads[0].keys() == grads[1].keys() and any("face_adapter" in n for n in grads[0])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert_one_line_error(capsys, _train_argv(animate, animate_run["csv"], tmp_path / "swap", "--max_steps", "1",
                                              "--grad_checkpoint", "--blocks_to_swap", "3"),
                          "--blocks_to_swap 3", "has 2 blocks")
