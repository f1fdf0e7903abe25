"""Wan's own fine-tuning tests (``ditforge train --init_from WAN_FOLDER --data clips``), end to end on the CPU with
the tiny random ``WanPipeline`` and ``WanImageToVideoPipeline`` of ``tiny_pipelines.make_wan`` / ``make_wan_i2v``
(16 px, 5 frames: latents 16 x 2 x 2 x 2): Wan 2.2 TI2V's text to video, ``ditforge sample --lora``, ``--fp8_base``
and ``--blocks_to_swap``, the one-line errors, and Wan 2.1 image to video (a CSV's image column in the first step's
loss, caption dropout, export and two prompts sampled, features). What every video family shares (first loss,
resume, export, LoRA file, features) is in test_video_families.py, what every image-to-video family shares (first
loss, sampling like the pipeline; Wan 2.1 I2V and Wan 2.2 TI2V's image to video) in test_i2v_families.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ditforge import cli
from ditforge.data import build_dataset
from ditforge.data.sampler import GlobalBatchSampler, derive_seed
from ditforge.train.logging import read_metrics
from families import VIDEO, assert_frames_match, assert_one_line_error, video_train_argv  # on sys.path
from references import wan_first_loss, wan_i2v_first_loss
from tiny_pipelines import BUILDERS

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES, INTERVAL, BATCH = (getattr(VIDEO["wan"], k) for k in ("size", "frames", "interval", "batch"))
# 16 px, 5 = 4 x 1 + 1 frames: 2 latent frames


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return VIDEO["wan"].argv(folder, out, *extra)  # flips: off by default for Wan


def test_wan22_ti2v_text_to_video_first_loss_export_and_sample(tmp_path):
    """Wan 2.2 TI2V-5B's text-to-video (``WanPipeline`` with ``expand_timesteps``: 48 latent channels from a VAE
    that patchifies 2 x 2 pixels, spatial factor 16, and a timestep per token): at 32 px the first loss of a full
    run equals the diffusers reference (per-token timesteps, 1e-5 relative), and the exported folder's own call
    samples what ``ditforge sample`` of the run samples (frames within one uint8 level)."""
    import diffusers

    folder = BUILDERS["wan22_ti2v"](tmp_path / "pipe")
    run = tmp_path / "run"
    argv = video_train_argv(folder, run, 32, FRAMES, INTERVAL, BATCH, "--max_steps", "1", "--lr", "1e-3")
    assert cli.main(argv) == 0
    assert read_metrics(run / "metrics.jsonl")[0]["loss"] == pytest.approx(wan_first_loss(folder, 32),
                                                                           rel=1e-5)
    assert cli.main(["export", "--ckpt", str(run), "--out", str(tmp_path / "exported"), "--format", "diffusers"]) == 0
    pipe = diffusers.WanPipeline.from_pretrained(str(tmp_path / "exported"), local_files_only=True)
    assert pipe.config.expand_timesteps
    prompt, npz = "a rabbit on a green hill", tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", prompt, "--num_sampling_steps", "3", "--cfg_scale", "4",
                     "--out", str(tmp_path / "clip.mp4"), "--save_npz", str(npz), "--device", "cpu"]) == 0
    g = torch.Generator("cpu").manual_seed(derive_seed(0, 0))
    video = pipe(prompt=[prompt], num_inference_steps=3, guidance_scale=4.0, height=32, width=32, num_frames=FRAMES,
                 generator=[g], output_type="np").frames
    assert_frames_match(npz, video, (1, FRAMES, 32, 32, 3))


def test_sample_base_with_lora_file_equals_the_lora_run(wan_pipeline, video_runs, tmp_path, capsys):
    """``ditforge sample --ckpt WAN_FOLDER --lora EXPORTED`` (the LoRA merged by diffusers' ``fuse_lora``) draws the
    video ``ditforge sample --ckpt LORA_RUN`` draws (peft's unmerged adapters), to one uint8 level, and not the base
    folder's; a file that is no LoRA of this pipeline is one line."""
    runs = video_runs("wan")
    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(runs["lora"]), "--format", "lora", "--out", str(out)]) == 0
    common = ["--prompt", "a rabbit on a green hill", "--num_sampling_steps", "3", "--height", str(SIZE), "--width",
              str(SIZE), "--num_frames", str(FRAMES), "--device", "cpu"]
    videos = {}
    for name, ckpt in (("run", [str(runs["lora"])]), ("file", [str(wan_pipeline), "--lora", str(out)]),
                       ("base", [str(wan_pipeline)])):
        npz = tmp_path / f"{name}.npz"
        assert cli.main(["sample", "--ckpt", *ckpt, *common, "--out", str(tmp_path / f"{name}.mp4"),
                         "--save_npz", str(npz)]) == 0
        videos[name] = np.load(npz)["samples"].astype(np.int16)
    assert np.abs(videos["file"] - videos["run"]).max() <= 1
    assert np.abs(videos["base"] - videos["run"]).max() > 1
    bad = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    save_file({"unrelated.lora_A.weight": torch.randn(4, 4)}, str(bad))
    capsys.readouterr()
    assert cli.main(["sample", "--ckpt", str(wan_pipeline), "--lora", str(bad), *common, "--out",
                     str(tmp_path / "x.mp4")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: --lora {bad}: holds no LoRA weights" in err[0], err


def _lora_denoiser(folder: Path, seed: int):
    """The tiny Wan's denoiser with rank-4 LoRA on the attention projections, B random (so A's gradients are not
    zero); and the generator that drew them, for the inputs."""
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.weights.lora import add_lora

    den = load_pretrained(folder, torch.device("cpu")).denoiser
    add_lora(den.inner, 4, None, ["to_q", "to_k", "to_v", "to_out.0"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in den.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return den, g


def _outputs_and_grads(models, x, t, states):
    """Each model's output and trainable gradients (names without compile's ``._orig_mod``) of mean(out^2)."""
    outs, grads = [], []
    for model in models:
        out = model.denoise(x, t, states)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append({n.replace("._orig_mod", ""): p.grad for n, p in model.named_parameters() if p.requires_grad})
    return outs, grads


def test_fp8_base_gives_the_gradients_of_fp8_rounded_weights(wan_pipeline):
    """--fp8_base (``store_base_in_fp8``): the frozen attention and FFN layers of the transformer are stored in
    float8 e4m3 (one byte each: the memory), while the adapters, norms and embedders keep float32. Independent
    reference: a second copy in float32 whose frozen parameters are replaced by their e4m3 roundings, run plainly.
    The adapters' gradients (random B, so A's are not zero) and the output agree within 1e-5 relative: the layers
    compute in float32 with exactly the stored values, and every layer is restored after its forward."""
    import copy

    from ditforge.train.finetune import store_base_in_fp8

    den, g = _lora_denoiser(wan_pipeline, 3)
    ref = copy.deepcopy(den)
    store_base_in_fp8(den, torch.float32, "none")
    stored = {n: p.dtype for n, p in den.named_parameters()}
    fp8 = {n for n, dt in stored.items() if dt == torch.float8_e4m3fn}
    assert all(stored[n] == torch.float32 for n in stored if "lora_" in n or "norm" in n or "embedding" in n)
    for kind in ("to_q.base_layer.weight", "to_out.0.base_layer.weight", "ffn.net.0.proj.weight", "ffn.net.2.weight"):
        assert sum(n.endswith(kind) for n in fp8) == len(den.inner.blocks) * (2 if "to_" in kind else 1), kind
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n in fp8:
                p.copy_(p.to(torch.float8_e4m3fn).float())
    x = torch.randn(2, 16, 2, 2, 2, generator=g)
    t = torch.rand(2, generator=g) * 1000
    states = torch.randn(2, 7, den.inner.config.text_dim, generator=g)
    outs, grads = _outputs_and_grads((den, ref), x, t, states)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 16 * len(den.inner.blocks)  # 8 layers, A and B
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for n in grads[1]:
        assert grads[1][n].abs().max() > 0, n
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7 * grads[1][n].abs().max().item())
    assert all(stored[n] == p.dtype for n, p in den.named_parameters())  # stored back after the forward


def test_fp8_base_trains_from_the_cli(wan_pipeline, video_runs, tmp_path, capsys):
    """``ditforge train --lora_rank 4 --fp8_base`` runs; its first loss is the plain LoRA run's moved by the e4m3
    rounding of the base (not equal, within 5%); a full fine-tune asked for it gets one line."""
    runs = video_runs("wan")
    from ditforge.train.finetune import fp8_base_pays

    out = tmp_path / "fp8"
    assert cli.main(_argv(wan_pipeline, out, "--max_steps", "2", "--lora_rank", "4", "--lr", "1e-2", "--fp8_base")) == 0
    first, plain = (read_metrics(r / "metrics.jsonl")[0]["loss"] for r in (out, runs["lora"]))
    assert first != plain and first == pytest.approx(plain, rel=0.05)
    assert __import__("yaml").safe_load((out / "config.yaml").read_text())["model"]["fp8_base"] is True
    # under --gpu_memory_budget: on where the bf16 base takes over a quarter (Wan-1.3B's 1.42B parameters at
    # 8 GiB; Wan-14B's 14.3B at 24 GiB), off where it does not (Wan-1.3B at 24 GiB)
    assert [fp8_base_pays(n, b * 2**30) for n, b in ((1.42e9, 8), (14.3e9, 24), (1.42e9, 24))] == [True, True, False]
    assert_one_line_error(capsys, _argv(wan_pipeline, tmp_path / "full", "--max_steps", "1", "--fp8_base"),
                          "--fp8_base: stores the frozen base of a LoRA run; give --lora_rank")


def test_budget_decides_on_a_meta_twin_with_the_real_models_counts(wan_pipeline, tmp_path, counted_budget):
    """``--gpu_memory_budget`` is decided in the resolution, before the model is built, from a meta-device twin of
    the denoiser (``resolve.model_on_meta``): its trainable count and stored frozen bytes (fp8 base, LoRA rank 4)
    equal the built model's, and the trainable count is LoRA's r * (in + out) summed over the adapted linear layers
    of the built model (peft's ``base_layer``)."""
    from peft.tuners.lora import LoraLayer

    counted, model = counted_budget(_argv(wan_pipeline, tmp_path / "run", "--lora_rank", "4", "--fp8_base",
                                          "--gpu_memory_budget", "1GiB"))
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    lora = sum(4 * (m.base_layer.in_features + m.base_layer.out_features) for m in layers)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    assert len(layers) == 8 * len(model.inner.blocks) and counted == [(lora, frozen)]


def test_opening_a_pipeline_run_writes_no_setting(wan_pipeline, tmp_path):
    """``open_run``, ``load_init`` and ``build_data`` of a Wan LoRA run work on a frozen config (a write would raise):
    the pipeline and the clips only report what they decide (``Run.found``: the family, the latent and pixel frames,
    the pipeline's VAE folder, no text encoder of ditforge's), which the run records (``VIDEO["wan"].config``)."""
    import contextlib

    from ditforge.config.load import build_config
    from ditforge.config.sections import freeze
    from ditforge.parallel.mesh import init_distributed
    from ditforge.train import build

    args = vars(cli.build_parser().parse_args(_argv(wan_pipeline, tmp_path / "run", "--lora_rank", "4")))
    args.pop("command"), args.pop("config", None)
    with contextlib.ExitStack() as held:
        run = build.open_run(freeze(build_config(None, args)), init_distributed("cpu"), held)
        build.load_init(run)
        build.build_data(run)
    records = VIDEO["wan"].config
    assert {k: run.found[k] for k in records if k in run.found} == {k: v for k, v in records.items() if k in run.found}
    assert {"model.family", "model.num_frames", "data.num_frames"} <= run.found.keys()
    assert run.found["model.vae"] == str(wan_pipeline / "vae") and run.found["model.text_encoder"] is None


def test_blocks_to_swap_trains_as_the_resident_base(wan_pipeline, tmp_path, capsys, caplog):
    """``--blocks_to_swap 2`` (both blocks' frozen fp8 weights in host memory, copied in for each forward and each
    recomputation) logs the losses of the same LoRA run with the base resident, bit for bit (on the CPU the copies
    are exact; the hooks and the recomputation are what is tested), and its log names the host bytes; without
    --grad_checkpoint it is one line."""
    common = ["--max_steps", "3", "--lora_rank", "4", "--lr", "1e-2", "--fp8_base", "--grad_checkpoint"]
    assert cli.main(_argv(wan_pipeline, tmp_path / "resident", *common)) == 0
    with caplog.at_level("INFO"):
        assert cli.main(_argv(wan_pipeline, tmp_path / "swapped", *common, "--blocks_to_swap", "2")) == 0
    assert "--blocks_to_swap 2: 0.00 GiB of frozen weights in host memory" in caplog.text
    losses = [[r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl")] for run in ("resident", "swapped")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert_one_line_error(capsys, _argv(wan_pipeline, tmp_path / "r", "--max_steps", "1", "--lora_rank", "4",
                                        "--blocks_to_swap", "1"), "--blocks_to_swap", "--grad_checkpoint")


def test_block_swap_runs_each_block_on_fresh_copies(wan_pipeline):
    """``BlockSwap`` on the tiny Wan's two blocks: outside a forward the frozen weights are the host tensors; inside
    one (and inside the checkpointed recomputation of the backward) they are copies made for it; the LoRA
    gradients equal those of the resident model bit for bit."""
    import copy

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel.offload import BlockSwap
    from ditforge.weights.lora import add_lora

    den = load_pretrained(wan_pipeline, torch.device("cpu")).denoiser
    add_lora(den.inner, 4, None, ["to_q", "to_k", "to_v", "to_out.0"])
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in den.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ref = copy.deepcopy(den)
    blocks = list(den.inner.blocks)
    swap = BlockSwap(blocks, torch.device("cpu"))
    weight = blocks[1].attn1.to_q.base_layer.weight
    host_ptr, seen = weight.data_ptr(), []
    blocks[1].attn1.to_q.register_forward_pre_hook(lambda m, a: seen.append(m.base_layer.weight.data_ptr()))
    for i, block in enumerate(blocks):  # as --grad_checkpoint wraps them: the backward recomputes each block
        den.inner.blocks[i] = checkpoint_wrapper(block)
    x, t = torch.randn(2, 16, 2, 2, 2, generator=g), torch.rand(2, generator=g) * 1000
    states = torch.randn(2, 7, 32, generator=g)
    grads = []
    for model in (den, ref):
        model.denoise(x, t, states).square().mean().backward()
        grads.append({n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()
                      if p.requires_grad})
    assert len(seen) == 2 and host_ptr not in seen  # the forward and the recomputation, each on a copy
    assert swap.resident <= {0} and weight.data_ptr() == host_ptr and swap.host_bytes > 0  # block 0 recomputed last
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_unsupported_video_family_lists_the_supported(wan_pipeline, tmp_path, capsys):
    """A pipeline folder of a family ditforge does not fine-tune (Mochi): one line naming it and listing the
    supported pipeline classes, Wan's, CogVideoX's, LTX-Video's and HunyuanVideo's among them; no checkpoint
    written."""
    folder = tmp_path / "mochi"
    shutil.copytree(wan_pipeline, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "MochiPipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    assert_one_line_error(capsys, _argv(folder, tmp_path / "r", "--max_steps", "1"), "--init_from",
                          "MochiPipeline", "WanPipeline", "CogVideoXPipeline", "LTXPipeline", "HunyuanVideoPipeline",
                          "StableDiffusionPipeline", "StableDiffusion3Pipeline")
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.parametrize("setting, needle", [({"boundary_ratio": 0.875}, "boundary_ratio")])
def test_wan22_variants_are_refused(setting, needle, wan_pipeline, tmp_path, capsys):
    """A Wan 2.2 folder with two-stage denoising by boundary_ratio and no second expert: one line naming it, not a
    run that trains the wrong thing; no checkpoint written."""
    folder = tmp_path / "wan22"
    shutil.copytree(wan_pipeline, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, **setting}))
    assert_one_line_error(capsys, _argv(folder, tmp_path / "r", "--max_steps", "1"), "--init_from", "Wan 2.2", needle)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_frame_size_past_the_rotary_table(wan_pipeline, tmp_path, capsys):
    """A transformer whose rotary table holds 2 positions an axis (``rope_max_seq_len``) and frames of 3 patches a
    side (48 px): one line naming the flags, the patches and the config's key, before any training step or sampling
    (``ditforge sample --width 48``); diffusers' own forward would fail at the first step on the table's shape."""
    folder = tmp_path / "short_rope"
    shutil.copytree(wan_pipeline, folder)
    path = folder / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "rope_max_seq_len": 2}))
    argv = _argv(folder, tmp_path / "r", "--max_steps", "1")
    argv[argv.index("--image_size") + 1] = "48"
    assert_one_line_error(capsys, argv, "--image_size 48 --num_frames 5", "at most 2 patches an axis",
                          "rope_max_seq_len", "not 3 patches of rows")
    assert not (tmp_path / "r" / "checkpoints").exists()
    assert_one_line_error(capsys, ["sample", "--ckpt", str(folder), "--prompt", "a cat", "--height", "16", "--width",
                                   "48", "--num_frames", "5", "--device", "cpu", "--out", str(tmp_path / "v.mp4")],
                          "--height 16 --width 48 --num_frames 5", "not 3 patches of columns")
    assert not (tmp_path / "v.mp4").exists()


@pytest.mark.parametrize("frames, nearest", [(6, "5 and 9"), (4, "1 and 5"), (12, "9 and 13")])
def test_num_frames_the_vae_cannot_take(frames, nearest, wan_pipeline, tmp_path, capsys):
    """A frame count other than 4k + 1: one line naming ``--num_frames`` and the valid counts either side; no
    checkpoint and no metrics written."""
    argv = _argv(wan_pipeline, tmp_path / "r", "--max_steps", "1")
    argv[argv.index("--num_frames") + 1] = str(frames)
    assert_one_line_error(capsys, argv, f"--num_frames {frames}", nearest)
    assert not (tmp_path / "r" / "checkpoints").exists() and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_images_for_a_video_pipeline(wan_pipeline, tmp_path, capsys):
    """Captioned images for Wan (it makes videos): one line saying so; no checkpoint written."""
    from PIL import Image

    data = tmp_path / "images"
    data.mkdir()
    rng = np.random.default_rng(7)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text("a dog runs on the grass")
    argv = _argv(wan_pipeline, tmp_path / "r", "--max_steps", "1")
    argv[argv.index("--data") + 1] = str(data)
    del argv[argv.index("--num_frames"):argv.index("--num_frames") + 4]  # --num_frames N --frame_interval N
    assert_one_line_error(capsys, argv, f"--data {data}", "holds images", "WanPipeline", "makes videos")
    assert not (tmp_path / "r" / "checkpoints").exists()


# ----------------------------------------------------------------------------------------------------------
# Image-to-video (WanImageToVideoPipeline)


def _first_batch(ds) -> list[int]:
    return GlobalBatchSampler(len(ds), BATCH, 0, 0, 1, 0).global_batch_indices(0).tolist()


@pytest.fixture(scope="module")
def i2v_data(tmp_path_factory, one_thread_module) -> Path:
    """The ``clips`` rows as a video CSV with an ``image`` column: the first batch's first clip names a random
    16 px PNG, the other rows are empty (their clip's first frame)."""
    from PIL import Image

    from ditforge.data.clips import clips_rows
    from ditforge.data.video import write_video_csv

    root = tmp_path_factory.mktemp("i2v_data")
    rows = clips_rows()
    png = root / "first.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(png)
    first = _first_batch(build_dataset("clips", SIZE, None, FRAMES, INTERVAL, 0))[0]
    for i, row in enumerate(rows):
        row["image"] = png.name if i == first else ""
    return write_video_csv(rows, root / "clips.csv", columns=("path", "text", "image"))


@pytest.fixture(scope="module")
def csv_run(wan_i2v_pipeline, i2v_data, tmp_path_factory, one_thread_module) -> Path:
    """2 steps of full fine-tuning (lr 1e-3) on ``i2v_data`` (the LoRA run on ``clips`` is ``i2v_runs("wan_i2v")``)."""
    out = tmp_path_factory.mktemp("wan_i2v_csv") / "full"
    argv = _argv(wan_i2v_pipeline, out, "--ckpt_every", "100", "--max_steps", "2", "--lr", "1e-3")
    argv[argv.index("--data") + 1] = str(i2v_data)
    assert cli.main(argv) == 0
    return out


def test_i2v_image_column_first_loss(wan_i2v_pipeline, i2v_data, csv_run):
    """The full image-to-video run's first batch takes the CSV's image for one clip and the first frame for the other:
    its first loss equals ``references.wan_i2v_first_loss`` on the CSV within 1e-5 relative (fp32); the run records
    the family, the 16 latent channels and flips off."""
    import yaml

    records = read_metrics(csv_run / "metrics.jsonl")
    assert records[0]["loss"] == pytest.approx(wan_i2v_first_loss(wan_i2v_pipeline, SIZE, str(i2v_data)), rel=1e-5)
    config = yaml.safe_load((csv_run / "config.yaml").read_text())
    assert (config["model"]["family"], config["model"]["in_channels"]) == ("wan_i2v", 16)
    assert config["data"]["random_flip"] is False


def test_i2v_caption_dropout_keeps_the_image(i2v_runs):
    """A dropped caption is the empty prompt's UMT5 states with the image conditioning kept, as the pipeline's
    unconditional pass (negative prompt embeds, same ``latent_model_input`` and ``image_embeds``): the adapter with
    ``force_drop_ids`` equals the transformer called so, and differs from the conditional output."""
    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    pre, model, _ = load_finetuned(*load_weights(i2v_runs("wan_i2v"), use_ema=True), torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(2, 16, 2, 2, 2, generator=g), torch.rand(2, generator=g) * 1000
    cond = {"encoder_hidden_states": pre.encode_prompt(["a dog runs on the grass", "a cat"])["encoder_hidden_states"],
            "image_condition": torch.randn(2, 20, 2, 2, 2, generator=g),
            "encoder_hidden_states_image": torch.randn(2, 1025, 4, generator=g)}
    empty = pre.encode_prompt(["", ""])["encoder_hidden_states"]
    with torch.no_grad():
        dropped = model(x, t, force_drop_ids=torch.tensor([True, True]), **cond)
        kept = model(x, t, force_drop_ids=torch.tensor([False, False]), **cond)
        expected = model.inner(hidden_states=torch.cat([x, cond["image_condition"]], 1), timestep=t,
                               encoder_hidden_states=empty,
                               encoder_hidden_states_image=cond["encoder_hidden_states_image"], return_dict=False)[0]
    assert torch.equal(dropped, expected)
    assert (kept - dropped).abs().max() > 1e-6 * dropped.abs().max()  # the tiny model's captions matter a little


def test_i2v_export_and_two_prompts_sample_like_the_pipeline(csv_run, tmp_path):
    """``--format diffusers`` of the full run loads in ``WanImageToVideoPipeline`` with the trained transformer
    exactly; two prompts of ``ditforge sample --image`` (drawn one pipeline call each, the pipeline taking one image a
    call) go into a folder, an mp4 and a gif each, the second prompt's video what the exported pipeline draws alone
    with its seed, to one uint8 level (one prompt into one file: test_i2v_families.py)."""
    import diffusers
    from PIL import Image

    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    out = tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(csv_run), "--format", "diffusers", "--out", str(out)]) == 0
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(str(out), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    _, trained, _ = load_finetuned(*load_weights(csv_run, use_ema=True), torch.device("cpu"))
    exported, trained = pipe.transformer.state_dict(), trained.inner.state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)

    png, prompt = tmp_path / "first.png", "a rabbit on a green hill"
    Image.fromarray(np.random.default_rng(11).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(png)
    folder, npz2 = tmp_path / "two", tmp_path / "two.npz"
    assert cli.main(["sample", "--ckpt", str(csv_run), "--prompt", "a cat", "--prompt", prompt, "--image",
                     str(png), "--num_sampling_steps", "3", "--cfg_scale", "4", "--out", str(folder), "--save_npz",
                     str(npz2), "--device", "cpu", "--gif"]) == 0
    assert len(list(folder.glob("*.mp4"))) == len(list(folder.glob("*.gif"))) == 2
    g = torch.Generator("cpu").manual_seed(derive_seed(0, 1))
    video = pipe(image=Image.open(png).convert("RGB"), prompt=[prompt], num_inference_steps=3, guidance_scale=4.0,
                 height=SIZE, width=SIZE, num_frames=FRAMES, generator=[g], output_type="np").frames
    second = np.load(npz2)["samples"][1].astype(np.int16)
    assert np.abs(second - np.round(video[0] * 255).astype(np.int16)).max() <= 1


def test_i2v_bad_input_lines(wan_i2v_pipeline, video_runs, i2v_runs, tmp_path, capsys):
    """One line, exit 2, nothing written: ``--image`` for a text-to-video run, a video file name for two prompts of
    an image-to-video run, an image file name for a video, ``--random_flip`` for an image-to-video run (no
    ``--image`` for one: test_i2v_families.py)."""
    runs = video_runs("wan")
    png = tmp_path / "first.png"
    __import__("PIL.Image").Image.new("RGB", (SIZE, SIZE)).save(png)
    out = tmp_path / "out"
    base = ["sample", "--prompt", "a dog", "--num_sampling_steps", "2", "--device", "cpu"]
    assert_one_line_error(capsys, [*base, "--ckpt", str(runs["full"]), "--image", str(png), "--out", str(out)], "--image",
           "WanPipeline", "takes no image")
    assert_one_line_error(capsys, [*base, "--ckpt", str(i2v_runs("wan_i2v")), "--image", str(png), "--prompt", "a cat", "--out",
                    str(out / "clip.mp4")], f"--out {out / 'clip.mp4'}", "2 prompts")
    assert_one_line_error(capsys, [*base, "--ckpt", str(runs["full"]), "--out", str(out / "x.png")], "--out", ".mp4")
    assert not out.exists()
    assert_one_line_error(capsys, _argv(wan_i2v_pipeline, tmp_path / "r", "--max_steps", "1", "--random_flip"), "--random_flip",
           "WanImageToVideoPipeline")
    assert not (tmp_path / "r" / "checkpoints").exists() and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_i2v_features_train_like_on_the_fly(wan_i2v_pipeline, i2v_runs, tmp_path):
    """``extract-features --init_from`` an image-to-video folder stores the image conditioning with the prompt's
    (``cond.image_condition``, ``cond.encoder_hidden_states_image``); a LoRA run on them logs the on-the-fly LoRA
    run's first 2 losses within 1e-5 relative."""
    feats = tmp_path / "feats"
    assert cli.main(["extract-features", "--init_from", str(wan_i2v_pipeline), "--data", "clips", "--num_frames", str(FRAMES),
                     "--frame_interval", str(INTERVAL), "--image_size", str(SIZE), "--device", "cpu",
                     "--num_workers", "0", "--out", str(feats)]) == 0
    manifest = json.loads((feats / "features.json").read_text())
    assert set(manifest["cond_keys"]) == {"encoder_hidden_states", "image_condition", "encoder_hidden_states_image"}
    argv = ["train", "--data", str(feats), "--batch_size", str(BATCH), "--max_steps", "2", "--log_every", "1",
            "--sample_every", "0", "--mixed_precision", "fp32", "--device", "cpu", "--class_dropout_prob", "0",
            "--init_from", str(wan_i2v_pipeline), "--lora_rank", "4", "--lr", "1e-2", "--outputs", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    ours = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    fly = [r["loss"] for r in read_metrics(i2v_runs("wan_i2v") / "metrics.jsonl")][:2]
    assert ours == pytest.approx(fly, rel=1e-5)


def test_compile_compiles_each_block_and_trains_as_eager(wan_pipeline, monkeypatch):
    """--compile on a video transformer (``compile_whole`` False): each block is compiled in place, under ``attn``
    checkpointing (attention outputs kept, the rest recomputed) with LoRA, and the output and adapter gradients equal
    the eager model's (1e-5 relative; float32, no kernel fused differently). Dynamo and AOTAutograd trace it as on
    the GPU; the ``aot_eager`` backend skips inductor's CPU code generation (25 s), not the tracing."""
    import copy

    from ditforge.parallel import parallelize
    from ditforge.parallel.mesh import Dist

    compiled, real_compile = [], torch.nn.Module.compile

    def compile_aot_eager(module, mode=None):
        compiled.append(module)
        real_compile(module, backend="aot_eager", mode=mode)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_aot_eager)
    den, g = _lora_denoiser(wan_pipeline, 11)
    ref = copy.deepcopy(den)
    parallelize(ref, Dist(), grad_checkpoint="attn")
    parallelize(den, Dist(), grad_checkpoint="attn", compile="default")
    assert not den.compile_whole and len(compiled) == len(den.inner.blocks)
    x, t = torch.randn(2, 16, 2, 2, 2, generator=g), torch.rand(2, generator=g) * 1000
    states = torch.randn(2, 7, den.inner.config.text_dim, generator=g)
    outs, grads = _outputs_and_grads((den, ref), x, t, states)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 16 * len(den.inner.blocks)
    for n in grads[1]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7 * grads[1][n].abs().max().item())
