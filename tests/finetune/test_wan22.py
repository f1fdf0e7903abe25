"""Wan 2.2 A14B fine-tuning, one expert at a time (``ditforge train --init_from WAN22_FOLDER --expert high_noise |
low_noise``), end to end on the CPU with the tiny random two-expert ``WanPipeline`` of ``tiny_pipelines.make_wan22``
(16 px, 5 frames; ``boundary_ratio`` 0.875): each run's first loss against its expert called directly at a time drawn
from the shifted logit-normal restricted to the expert's side of the boundary (written out here with
``torch.distributions.Normal``); the full low-noise run exported into ``transformer_2`` (``transformer`` untouched) and
sampled by ditforge as the exported pipeline's own call samples it; the LoRA file of the high-noise run through
``load_lora_weights``; the one-line errors; a low-noise run's ``--validation_prompts`` samples, drawn with the
high-noise expert brought in from host memory."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from ditforge import cli
from ditforge.data import build_dataset
from ditforge.data.sampler import GlobalBatchSampler, derive_seed
from ditforge.train.logging import read_metrics
from families import assert_frames_match, assert_one_line_error  # on sys.path
from test_wan import _argv
from tiny_pipelines import make_wan22

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES, INTERVAL, BATCH = 16, 5, 2, 2
RUNS = {"low_noise": ["--lr", "1e-3"], "high_noise": ["--lora_rank", "4", "--lr", "1e-2"]}


@pytest.fixture(scope="module")
def wan22(tmp_path_factory, one_thread_module) -> Path:
    """The tiny two-expert ``WanPipeline`` folder (``boundary_ratio`` 0.875), built once for this module."""
    return make_wan22(tmp_path_factory.mktemp("wan22") / "pipe")


@pytest.fixture(scope="module")
def runs(wan22, tmp_path_factory, one_thread_module) -> dict[str, Path]:
    """2 steps of the low-noise expert fully fine-tuned and of the high-noise one with LoRA (rank 4)."""
    root = tmp_path_factory.mktemp("wan22_runs")
    for expert, extra in RUNS.items():
        assert cli.main(_argv(wan22, root / expert, "--max_steps", "2", "--expert", expert, *extra)) == 0
    return {expert: root / expert for expert in RUNS}


def _reference_first_loss(folder: Path, expert: str, position: int = 0) -> float:
    """Step 0's loss of ``expert`` (of data position ``position``: its batch, and the draws of ``derive_seed(0,
    position)``): the clips and captions of the first batch as ``test_wan._reference_first_loss``
    encodes them; the draws in ditforge's order (noise, then one uniform v per sample for
    the time, drop, flip, posterior eps); the time sigma = shift u / (1 + (shift - 1) u) with u = sigmoid(n), n the
    standard normal's quantile at the v-th fraction between the probabilities of the expert's bounds (sigma from
    boundary_ratio to 1 for high_noise, 0 to boundary_ratio for low_noise), so sigma follows the shifted
    logit-normal restricted to that range; the expert (``transformer`` or ``transformer_2``) at 1000 sigma."""
    import diffusers

    pipe = diffusers.WanPipeline.from_pretrained(str(folder), local_files_only=True)
    shift, boundary = float(pipe.scheduler.config.flow_shift), float(pipe.config.boundary_ratio)
    ds = build_dataset("clips", SIZE, None, FRAMES, INTERVAL, 0)
    idx = GlobalBatchSampler(len(ds), BATCH, 0, 0, 1, 0).global_batch_indices(position).tolist()
    pixels = torch.stack([ds[i]["video"] for i in idx])
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        g = torch.Generator().manual_seed(derive_seed(0, position))
        shape = tuple(post.mean.shape[1:])
        noise = torch.randn((BATCH, *shape), generator=g)
        v = torch.rand(BATCH, generator=g, dtype=torch.float64)
        torch.rand(BATCH, generator=g), torch.rand(BATCH, generator=g)
        eps = torch.randn((BATCH, *shape), generator=g)
        lo, hi = (boundary, 1.0) if expert == "high_noise" else (0.0, boundary)
        bounds = [torch.tensor(s / (shift - (shift - 1) * s), dtype=torch.float64) for s in (lo, hi)]  # unshifted
        p_lo, p_hi = (normal.cdf(torch.logit(u)) for u in bounds)
        u = torch.sigmoid(normal.icdf(p_lo + (p_hi - p_lo) * v))
        sigma = (shift * u / (1 + (shift - 1) * u)).float()
        assert bool(((sigma >= lo) & (sigma <= hi)).all())
        view = (1, pipe.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(pipe.vae.config.latents_mean).view(view)
        inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(view)
        x0 = (post.mean + post.std * eps - mean) * inv_std
        embeds, _ = pipe.encode_prompt([ds[i]["text"] for i in idx], do_classifier_free_guidance=False,
                                       device="cpu", max_sequence_length=512)
        s = sigma.view(-1, 1, 1, 1, 1)
        model = pipe.transformer if expert == "high_noise" else pipe.transformer_2
        pred = model(hidden_states=(1 - s) * x0 + s * noise, timestep=sigma * 1000, encoder_hidden_states=embeds,
                     return_dict=False)[0]
    return float(torch.nn.functional.mse_loss(pred, noise - x0))


@pytest.mark.parametrize("expert", list(RUNS))
def test_first_step_loss_is_the_experts_on_its_side_of_the_boundary(expert, wan22, runs):
    """Each run's first loss (LoRA: B = 0, the base expert) equals the reference within 1e-5 relative (fp32)."""
    records = read_metrics(runs[expert] / "metrics.jsonl")
    assert records[0]["loss"] == pytest.approx(_reference_first_loss(wan22, expert), rel=1e-5)
    config = __import__("yaml").safe_load((runs[expert] / "config.yaml").read_text())
    assert (config["model"]["expert"], config["train"]["sample_every"]) == (expert, 0)


def _assert_samples_like_the_pipeline(run: Path, pipe, tmp_path: Path) -> None:
    """``ditforge sample --ckpt run`` (4 steps, guidance 4) draws the video ``pipe``'s own call draws from the same
    seed, to one uint8 level."""
    prompt, npz = "a rabbit on a green hill", tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", prompt, "--num_sampling_steps", "4",
                     "--cfg_scale", "4", "--out", str(tmp_path / "clip.mp4"), "--save_npz", str(npz),
                     "--device", "cpu"]) == 0
    video = pipe(prompt=[prompt], num_inference_steps=4, guidance_scale=4.0, height=SIZE, width=SIZE,
                 num_frames=FRAMES, generator=torch.Generator("cpu").manual_seed(derive_seed(0, 0)),
                 output_type="np").frames
    assert_frames_match(npz, video, (1, FRAMES, SIZE, SIZE, 3))


def test_low_noise_export_and_sample_like_the_pipeline(wan22, runs, tmp_path):
    """``--format diffusers`` of the low-noise run writes its weights into ``transformer_2`` and copies
    ``transformer`` untouched (bit for bit the base's); the exported ``WanPipeline``'s own call (both experts,
    switching at t = 875) draws the video ``ditforge sample --ckpt RUN`` draws, to one uint8 level. Both experts
    fine-tuned, one run each: a high-noise run from that export, exported, holds its trained ``transformer`` beside
    the first run's ``transformer_2``."""
    import diffusers

    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    out = tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(runs["low_noise"]), "--format", "diffusers", "--out", str(out)]) == 0
    pipe = diffusers.WanPipeline.from_pretrained(str(out), local_files_only=True)
    base = diffusers.WanPipeline.from_pretrained(str(wan22), local_files_only=True)
    _, trained, _ = load_finetuned(*load_weights(runs["low_noise"], use_ema=True), torch.device("cpu"))
    low, high, trained = pipe.transformer_2.state_dict(), pipe.transformer.state_dict(), trained.inner.state_dict()
    assert all(torch.equal(low[k], trained[k]) for k in trained)
    assert any(not torch.equal(base.transformer_2.state_dict()[k], trained[k]) for k in trained)
    assert all(torch.equal(high[k], v) for k, v in base.transformer.state_dict().items())

    _assert_samples_like_the_pipeline(runs["low_noise"], pipe, tmp_path)

    # both experts, one run each: the high-noise one trained from this export, exported again, keeps its low one
    second, both = tmp_path / "second", tmp_path / "both"
    assert cli.main(_argv(out, second, "--max_steps", "1", "--expert", "high_noise", "--lr", "1e-3")) == 0
    assert cli.main(["export", "--ckpt", str(second), "--format", "diffusers", "--out", str(both)]) == 0
    pipe = diffusers.WanPipeline.from_pretrained(str(both), local_files_only=True)
    _, high, _ = load_finetuned(*load_weights(second, use_ema=True), torch.device("cpu"))
    high = high.inner.state_dict()
    assert all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in high.items())
    assert any(not torch.equal(base.transformer.state_dict()[k], v) for k, v in high.items())
    assert all(torch.equal(pipe.transformer_2.state_dict()[k], v) for k, v in trained.items())


def test_high_noise_lora_file_loads_into_transformer(wan22, runs, tmp_path):
    """``--format lora`` of the high-noise run: ``load_lora_weights`` puts it into ``transformer``, which then gives
    ditforge's LoRA expert's output within 1e-5 of its largest magnitude; ``transformer_2`` is untouched."""
    import diffusers

    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(runs["high_noise"]), "--format", "lora", "--out", str(out)]) == 0
    pipe = diffusers.WanPipeline.from_pretrained(str(wan22), local_files_only=True)
    low_before = {k: v.clone() for k, v in pipe.transformer_2.state_dict().items()}
    g = torch.Generator().manual_seed(99)
    x, t, states = torch.randn(2, 16, 2, 2, 2, generator=g), torch.rand(2, generator=g) * 1000, torch.randn(
        2, 512, 32, generator=g)
    _, ours, _ = load_finetuned(*load_weights(runs["high_noise"], use_ema=True), torch.device("cpu"))
    pipe.load_lora_weights(str(out))
    with torch.no_grad():
        theirs = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=states, return_dict=False)[0]
        mine = ours.denoise(x, t, states)
    assert (theirs - mine).abs().max() <= 1e-5 * mine.abs().max()
    assert all(torch.equal(pipe.transformer_2.state_dict()[k], v) for k, v in low_before.items())


def test_comfyui_export_names_each_expert(wan22, runs, tmp_path):
    """``--format comfyui --out wan22.safetensors`` of each expert's run writes ``wan22_<expert>.safetensors``: the
    high-noise LoRA in ``diffusion_model.`` names; the low-noise full fine-tune, which diffusers' ``from_single_file``
    reads with the folder's ``transformer_2`` config as the run's expert in bf16, bit for bit."""
    import diffusers
    from safetensors.torch import load_file

    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    for expert in RUNS:
        assert cli.main(["export", "--ckpt", str(runs[expert]), "--format", "comfyui", "--out",
                         str(tmp_path / "wan22.safetensors")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wan22_high_noise.safetensors",
                                                          "wan22_low_noise.safetensors"]
    lora = load_file(str(tmp_path / "wan22_high_noise.safetensors"))
    assert all(k.startswith("diffusion_model.blocks.") and ".lora_" in k or k.endswith(".alpha") for k in lora)
    loaded = diffusers.WanTransformer3DModel.from_single_file(
        str(tmp_path / "wan22_low_noise.safetensors"), config=str(wan22), subfolder="transformer_2",
        torch_dtype=torch.bfloat16).state_dict()
    _, ours, _ = load_finetuned(*load_weights(runs["low_noise"], use_ema=True), torch.device("cpu"))
    expected = ours.inner.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v.to(torch.bfloat16)) for k, v in expected.items())


def test_expert_errors(wan22, tmp_path, capsys):
    """One line, exit 2: --expert both (the default of a two-expert folder) with a setting it does not run with yet
    (--cpu_offload optimizer), naming the one-expert way; --expert for a Wan 2.1 folder (one transformer)."""
    assert_one_line_error(capsys, _argv(wan22, tmp_path / "r", "--max_steps", "1", "--cpu_offload", "optimizer"),
                          "--expert both", "--cpu_offload optimizer", "--expert high_noise")
    one = tmp_path / "wan21"
    shutil.copytree(wan22, one)
    shutil.rmtree(one / "transformer_2")
    index = __import__("json").loads((one / "model_index.json").read_text())
    index.pop("transformer_2"), index.pop("boundary_ratio")
    (one / "model_index.json").write_text(__import__("json").dumps(index))
    assert_one_line_error(capsys, _argv(one, tmp_path / "r", "--max_steps", "1", "--expert", "low_noise"),
                          "--expert low_noise", "one transformer")


@pytest.mark.parametrize("expert", ["low_noise", "both"])
def test_validation_samples_with_both_experts(expert, wan22, tmp_path, monkeypatch):
    """``--validation_prompts`` of a LoRA run (1 step) of the low-noise expert and of both: inside the pipeline's
    call ``transformer`` is the high-noise expert and ``transformer_2`` the low-noise one (told apart by their
    ``boundary``-side objects: a one-expert run's high-noise expert has no LoRA, is in host memory in bf16 for
    training and in the compute dtype (fp32 here) during the call; a run of both has LoRA in two distinct
    experts); the sample equals ``ditforge sample`` of the run (both experts, ``sample.video``'s switch) from the
    same seed, prompt, steps and guidance to one uint8 level, 32 x 16 for one frame; the run keeps
    --sample_every."""
    import diffusers
    import numpy as np
    from PIL import Image

    def has_lora(model) -> bool:
        return any("lora_A" in name for name, _ in model.named_modules())

    seen, call = [], diffusers.WanPipeline.__call__

    @functools.wraps(call)  # the pipeline's defaults are read off its call's signature
    def spy(self, *args, **kwargs):
        seen.append((has_lora(self.transformer), has_lora(self.transformer_2), self.transformer.dtype,
                     self.transformer is self.transformer_2))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(diffusers.WanPipeline, "__call__", spy)
    prompts, run, npz = tmp_path / "v.txt", tmp_path / "run", tmp_path / "s.npz"
    prompts.write_text("a rabbit on a green hill --w 32 --h 16 --f 1 --s 4 --g 4\n")
    assert cli.main(_argv(wan22, run, "--max_steps", "1", "--expert", expert, "--lora_rank", "4", "--lr", "1e-2",
                          "--ema_decay", "0", "--sample_every", "1", "--validation_prompts", str(prompts))) == 0
    assert __import__("yaml").safe_load((run / "config.yaml").read_text())["train"]["sample_every"] == 1
    assert seen == [(expert == "both", True, torch.float32, False)]
    monkeypatch.setattr(diffusers.WanPipeline, "__call__", call)
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", "a rabbit on a green hill", "--height", "16",
                     "--width", "32", "--num_frames", "1", "--num_sampling_steps", "4", "--cfg_scale", "4", "--out",
                     str(tmp_path / "s"), "--save_npz", str(npz), "--device", "cpu"]) == 0
    mine = np.asarray(Image.open(run / "samples" / "step-0000001" / "001-a-rabbit-on-a-green-hill.png"))
    assert mine.shape == (16, 32, 3)
    assert np.abs(np.load(npz)["samples"][0, 0].astype(np.int16) - mine.astype(np.int16)).max() <= 1


# Both experts in one run (--expert both, the default for a two-expert folder): seed 0's side draws at positions 0-2
SIDES = ["low_noise", "low_noise", "high_noise"]


def _sides(folder: Path, steps: int) -> list[str]:
    """Each position's expert, written out: one time sigma = shift u / (1 + (shift - 1) u), u = sigmoid(n), n the
    first normal draw of ``torch.Generator().manual_seed(derive_seed(0, EXPERT_STREAM, k))``; high_noise where
    sigma >= boundary_ratio."""
    import diffusers

    from ditforge.train.experts import EXPERT_STREAM

    pipe = diffusers.WanPipeline.from_pretrained(str(folder), local_files_only=True)
    shift, boundary = float(pipe.scheduler.config.flow_shift), float(pipe.config.boundary_ratio)
    sides = []
    for k in range(steps):
        u = torch.sigmoid(torch.randn(1, generator=torch.Generator().manual_seed(derive_seed(0, EXPERT_STREAM, k))))
        sides.append("high_noise" if float(shift * u / (1 + (shift - 1) * u)) >= boundary else "low_noise")
    return sides


@pytest.fixture(scope="module")
def both(wan22, tmp_path_factory, one_thread_module) -> Path:
    """3 steps (``SIDES``) of both experts fully fine-tuned in one run (no --expert), as the low-noise run (lr 1e-3),
    a checkpoint after each."""
    run = tmp_path_factory.mktemp("wan22_both") / "run"
    assert cli.main(_argv(wan22, run, "--max_steps", "3", "--lr", "1e-3", "--ckpt_every", "1", "--keep_last", "3")) == 0
    return run


@pytest.fixture(scope="module")
def base(wan22) -> dict[str, torch.Tensor]:
    """The folder's two experts' weights, named as a run of both names them: transformer.*, transformer_2.*."""
    import diffusers

    pipe = diffusers.WanPipeline.from_pretrained(str(wan22), local_files_only=True)
    return {f"{name}.{k}": v for name in ("transformer", "transformer_2") for k, v in
            getattr(pipe, name).state_dict().items()}


def _weights(path: Path, like: dict[str, torch.Tensor], use_ema: bool = False) -> dict[str, torch.Tensor]:
    """The weights (or EMA) of a checkpoint, or of a run's last one, read into copies of ``like``'s tensors."""
    from ditforge.weights.read import load_weights, read_checkpoint_weights

    ckpt, _ = load_weights(path, use_ema)
    return read_checkpoint_weights(ckpt, {k: v.clone() for k, v in like.items()}, use_ema)


def _changed(before: dict, after: dict, prefix: str) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in after if k.startswith(prefix))


def test_both_experts_each_change_only_on_their_side(wan22, both, base):
    """The side draws are the written-out ones (both sides drawn), the run records ``--expert both``, and from the
    folder's weights through each step's checkpoint, the high-noise expert (``transformer``) changes exactly on
    the steps drawn above the boundary and the low-noise one (``transformer_2``) exactly on the others."""
    assert _sides(wan22, 3) == SIDES
    config = __import__("yaml").safe_load((both / "config.yaml").read_text())
    assert config["model"]["expert"] == "both"
    before = base
    for step, side in enumerate(SIDES, 1):
        after = _weights(both / "checkpoints" / f"step-{step:07d}", base)
        assert (_changed(before, after, "transformer."), _changed(before, after, "transformer_2.")) == (
            side == "high_noise", side == "low_noise"), step
        before = after


def test_both_experts_losses_are_the_one_expert_runs(wan22, runs, both, base):
    """Each step's loss is the one-expert path's on the same batch and times: steps 0 and 1 (low side) the
    low-noise run's steps 0 and 1 (1e-6 relative; same lr, so the same weights at step 1); step 2 (high side, its
    expert untouched so far) the high-noise expert's reference loss at position 2 (``_reference_first_loss``, 1e-5
    relative); and after step 2 the low-noise expert's weights equal the low-noise run's after its two steps
    (1e-6): the high-noise step left it alone."""
    ours = [r["loss"] for r in read_metrics(both / "metrics.jsonl")]
    reference = [r["loss"] for r in read_metrics(runs["low_noise"] / "metrics.jsonl")]
    assert ours[:2] == pytest.approx(reference[:2], rel=1e-6)
    assert ours[2] == pytest.approx(_reference_first_loss(wan22, "high_noise", position=2), rel=1e-5)
    low = {k: v for k, v in _weights(both / "checkpoints" / "step-0000003", base).items()
           if k.startswith("transformer_2.")}
    alone = _weights(runs["low_noise"], {k.replace("transformer_2.", "transformer.", 1): v for k, v in low.items()})
    for k, v in alone.items():
        torch.testing.assert_close(low[k.replace("transformer.", "transformer_2.", 1)], v, rtol=1e-6, atol=1e-7)


def test_both_experts_export_and_sample_like_the_pipeline(both, base, tmp_path):
    """``--format diffusers`` writes both trained experts (the run's EMA weights, bit for bit, each unlike the
    folder's); the exported ``WanPipeline``'s own call draws the video ``ditforge sample --ckpt RUN`` draws, to
    one uint8 level."""
    import diffusers

    out = tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(both), "--format", "diffusers", "--out", str(out)]) == 0
    pipe = diffusers.WanPipeline.from_pretrained(str(out), local_files_only=True)
    trained = _weights(both, base, use_ema=True)
    for name in ("transformer", "transformer_2"):
        exported = {f"{name}.{k}": v for k, v in getattr(pipe, name).state_dict().items()}
        assert all(torch.equal(v, trained[k]) for k, v in exported.items())
        assert any(not torch.equal(v, base[k]) for k, v in exported.items())
    _assert_samples_like_the_pipeline(both, pipe, tmp_path)


LORA_BOTH = ("--max_steps", "4", "--lora_rank", "4", "--lr", "1e-2")
LORA_SIDES = [*SIDES, "low_noise"]  # seed 0's side draws at positions 0-3


@pytest.fixture(scope="module")
def both_lora(wan22, tmp_path_factory, one_thread_module) -> Path:
    """4 steps (``LORA_SIDES``: a switch each way) of both experts with LoRA (rank 4, lr 1e-2), a checkpoint after
    steps 2 and 4."""
    run = tmp_path_factory.mktemp("wan22_both_lora") / "run"
    assert cli.main(_argv(wan22, run, *LORA_BOTH, "--ckpt_every", "2", "--keep_last", "2")) == 0
    return run


def _adapters(run: Path, use_ema: bool) -> dict[str, torch.Tensor]:
    """The LoRA adapters of both experts (their names' first part ``transformer`` or ``transformer_2``) of the
    run's last checkpoint, or their EMA."""
    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    _, denoiser, _ = load_finetuned(*load_weights(run), torch.device("cpu"))
    like = {n: p.detach() for n, p in denoiser.named_parameters() if p.requires_grad}
    assert {n.split(".")[0] for n in like} == {"transformer", "transformer_2"}
    return _weights(run, like, use_ema)


def test_both_experts_resume_equals_the_uninterrupted_run(wan22, both_lora, tmp_path):
    """Resumed from the LoRA run's step-2 checkpoint (the high-noise expert not yet stepped: no optimizer state of
    it there) into a new folder, to step 4 (high, then low): its losses and the last adapters and their EMA equal
    the uninterrupted run's, exactly."""
    run = tmp_path / "run"
    assert cli.main(_argv(wan22, run, *LORA_BOTH, "--resume", str(both_lora / "checkpoints" / "step-0000002"))) == 0
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(both_lora / "metrics.jsonl")][2:]
    for use_ema in (False, True):
        resumed, whole = _adapters(run, use_ema), _adapters(both_lora, use_ema)
        assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_both_experts_blocks_to_swap_is_the_unswapped_run(wan22, both_lora, tmp_path, monkeypatch):
    """``--blocks_to_swap 1 --grad_checkpoint`` on both experts (each expert's last block's frozen weights in host
    memory, a ``BlockSwap`` of its own; the sides of ``LORA_SIDES``, a switch each way) logs the losses and saves
    the adapters and their EMA of the unswapped run (``both_lora``), exactly (on the CPU the copies and the
    recomputation are exact); and the experts' switch leaves the swapped weights, and those alone, to BlockSwap:
    none is among what it parks and brings (``TwoExperts._frozen``), every other frozen weight is."""
    from ditforge.parallel import offload
    from ditforge.train.experts import TwoExperts

    assert _sides(wan22, 4) == LORA_SIDES
    seen = {}
    swap_blocks = offload.swap_blocks

    def swap(model, n, pre, d):
        seen["swaps"] = swap_blocks(model, n, pre, d)
        return seen["swaps"]

    def keep_out(experts, params):
        seen["experts"] = experts
        keep(experts, params)

    keep = TwoExperts.keep_out
    monkeypatch.setattr("ditforge.train.build.swap_blocks", swap)
    monkeypatch.setattr(TwoExperts, "keep_out", keep_out)
    run = tmp_path / "swapped"
    assert cli.main(_argv(wan22, run, *LORA_BOTH, "--grad_checkpoint", "--blocks_to_swap", "1")) == 0
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(both_lora / "metrics.jsonl")]
    for use_ema in (False, True):
        swapped, whole = _adapters(run, use_ema), _adapters(both_lora, use_ema)
        assert all(torch.equal(swapped[k], whole[k]) for k in whole)
    experts, swaps = seen["experts"], seen["swaps"]
    for index, (model, swap) in enumerate(zip(experts.denoiser.expert_models(), swaps)):
        held = {p for block in swap.params for p in block}
        frozen = {p for p in model.parameters() if not p.requires_grad}
        assert held and held < frozen and set(experts._frozen(index)) == frozen - held


def test_both_experts_lora_files_load_into_both_transformers(wan22, both_lora, tmp_path):
    """The LoRA run of both, exported twice: ``--format lora`` (``OUT/high_noise`` loaded into ``transformer``,
    ``OUT/low_noise`` into ``transformer_2`` with ``load_into_transformer_2``) and ``--format comfyui`` (``wan22_
    high_noise.safetensors`` and ``wan22_low_noise.safetensors``, through diffusers' non-diffusers converter). Each
    pipeline's transformers then give the ditforge LoRA experts' outputs within 1e-5 of the largest magnitude, and
    differ from the folder's experts (both trained)."""
    import diffusers

    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(both_lora), "--format", "lora", "--out", str(out)]) == 0
    assert cli.main(["export", "--ckpt", str(both_lora), "--format", "comfyui", "--out",
                     str(tmp_path / "wan22.safetensors")]) == 0
    _, ours, _ = load_finetuned(*load_weights(both_lora, use_ema=True), torch.device("cpu"))
    g = torch.Generator().manual_seed(99)
    x, t, states = torch.randn(2, 16, 2, 2, 2, generator=g), torch.rand(2, generator=g) * 1000, torch.randn(
        2, 512, 32, generator=g)
    files = {"lora": (out / "high_noise", out / "low_noise"),
             "comfyui": (tmp_path / "wan22_high_noise.safetensors", tmp_path / "wan22_low_noise.safetensors")}
    for high, low in files.values():
        pipe = diffusers.WanPipeline.from_pretrained(str(wan22), local_files_only=True)
        with torch.no_grad():
            before = [m(hidden_states=x, timestep=t, encoder_hidden_states=states, return_dict=False)[0]
                      for m in (pipe.transformer, pipe.transformer_2)]
        pipe.load_lora_weights(str(high))
        pipe.load_lora_weights(str(low), load_into_transformer_2=True)
        with torch.no_grad():
            for expert, (model, base) in enumerate(zip((pipe.transformer, pipe.transformer_2), before)):
                ours.expert = expert
                mine = ours.denoise(x, t, states)
                theirs = model(hidden_states=x, timestep=t, encoder_hidden_states=states, return_dict=False)[0]
                assert (theirs - mine).abs().max() <= 1e-5 * mine.abs().max()
                assert (base - mine).abs().max() > 1e-3 * mine.abs().max()


def test_fsdp_gathers_the_trained_experts_units_alone(wan22, monkeypatch):
    """Both experts under FSDP2 (``parallel.parallelize``, a process group of one): a forward and backward of one
    expert gathers units of that expert (and the root) alone, none of the idle one's, either way round; a two-block
    backward prefetch over one chain of both experts' blocks would gather the high-noise expert's last blocks in a
    low-noise step. Gathers are recorded at ``FSDPParamGroup.unshard``, which FSDP2's hooks and prefetches call."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel import parallelize
    from ditforge.parallel.mesh import init_distributed, shutdown

    gathered = []
    unshard = FSDPParamGroup.unshard

    def spy(group, *args, **kwargs):
        gathered.extend(group.modules)
        return unshard(group, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", spy)
    d = init_distributed("cpu", group_of_one=True)
    try:
        model = parallelize(load_pretrained(wan22, d.device, expert="both").denoiser, d, "fsdp", "none", "none",
                            "auto")
        experts = model.expert_models()
        g = torch.Generator().manual_seed(5)
        for active in (1, 0):
            gathered.clear()
            model.expert = active
            x, t = torch.randn(2, 16, 2, 2, 2, generator=g), torch.rand(2, generator=g) * 1000
            model(x, t, encoder_hidden_states=torch.randn(2, 512, 32, generator=g)).square().mean().backward()
            owner = [[any(m is n for n in expert.modules()) for expert in experts] for m in gathered]
            assert any(inside[active] for inside in owner) and not any(inside[1 - active] for inside in owner)
    finally:
        shutdown(d)


def test_enable_flashattn_routes_both_experts(wan22, monkeypatch):
    """``--enable_flashattn`` of a fine-tuning run of both experts (``parallel.parallelize``, ``attention="fast"``):
    each expert's self-attention modules (``attn1``; not the cross-attention ``attn2``) carry the route to
    ``fastest_exact``, each expert's calls reach it, and each expert's output equals the unrouted model's (rtol 1e-5 of
    its largest entry: float32 SDPA in another kernel order). FlashAttention-4 is GPU-only: its availability is forced
    (``dispatch._fa4_runs``) and the tiny heads' width 12 allowed, so the route's kernel falls back to PyTorch's SDPA
    (``ops.flash4.exact_attention``), which is what the CPU can check: the routing, not the GPU kernel."""
    import importlib

    from ditforge.models.adapters import dispatch
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel import parallelize
    from ditforge.parallel.mesh import init_distributed

    attention = importlib.import_module("ditforge.ops.attention")  # ditforge.ops.attention is a function too

    model = load_pretrained(wan22, torch.device("cpu"), expert="both").denoiser
    g = torch.Generator().manual_seed(6)
    x, t, text = torch.randn(2, 16, 2, 2, 2, generator=g), torch.rand(2, generator=g) * 1000, torch.randn(
        2, 512, 32, generator=g)
    with torch.no_grad():
        plain = []
        for expert in (0, 1):
            model.expert = expert
            plain.append(model(x, t, encoder_hidden_states=text))
    calls, fastest = [], attention.fastest_exact

    def counted(device):
        kernel = fastest(device)
        return lambda q, k, v, scale=None: calls.append(model.expert) or kernel(q, k, v, scale=scale)

    monkeypatch.setattr(dispatch, "_fa4_runs", lambda device: True)
    monkeypatch.setattr(dispatch, "EXACT_HEAD_DIMS", (12,))  # the tiny Wan's 2 heads x 12
    monkeypatch.setattr(attention, "fastest_exact", counted)
    try:
        model = parallelize(model, init_distributed("cpu"), attention="fast")
    finally:
        attention.set_attention_backend()
    for expert in model.expert_models():
        assert all(isinstance(b.attn1.processor._attention_backend, dispatch._Route) for b in expert.blocks)
        assert not any(isinstance(b.attn2.processor._attention_backend, dispatch._Route) for b in expert.blocks)
    with torch.no_grad():
        for expert in (0, 1):
            calls.clear()
            model.expert = expert
            routed = model(x, t, encoder_hidden_states=text)
            assert calls == [expert] * 2  # one self-attention call a block, each block's routed
            torch.testing.assert_close(routed, plain[expert], rtol=0, atol=1e-5 * plain[expert].abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the idle expert is offloaded from a GPU")
def test_both_experts_offloaded_is_the_same_run(wan22, tmp_path, caplog):
    """On a GPU, a bf16 LoRA run of both under --gpu_memory_budget (the idle expert's frozen base in host memory,
    two switches over the 3 steps of ``SIDES``), and that run with --blocks_to_swap 1 too (each expert's last block
    BlockSwap's, the rest the switch's), log the losses and save the weights of the same run without a budget
    (both experts on the GPU), exactly."""
    budget = ["--gpu_memory_budget", "8GiB"]
    runs = {}
    for name, extra in (("resident", []), ("offloaded", budget), ("swapped", [*budget, "--blocks_to_swap", "1"])):
        runs[name] = tmp_path / name
        with caplog.at_level("INFO"):
            assert cli.main(_argv(wan22, runs[name], "--max_steps", "3", "--lora_rank", "4", "--lr", "1e-2",
                                  "--device", "cuda", "--mixed_precision", "bf16", "--grad_checkpoint", *extra)) == 0
        assert ("frozen weights wait in host memory" in caplog.text) == (name != "resident")
        caplog.clear()
    losses = [[r["loss"] for r in read_metrics(run / "metrics.jsonl")] for run in runs.values()]
    assert losses[1] == losses[0] and losses[2] == losses[0]
    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    a, *others = (load_finetuned(*load_weights(run, use_ema=False), torch.device("cpu"), use_ema=False)[1]
                  .state_dict() for run in runs.values())
    assert all(torch.equal(a[k], b[k]) for b in others for k in a)
