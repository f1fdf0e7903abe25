"""Wan 2.2 A14B fine-tuning, one expert at a time (``ditforge train --init_from WAN22_FOLDER --expert high_noise |
low_noise``), end to end on the CPU with the tiny random two-expert ``WanPipeline`` of ``tiny_pipelines.make_wan22``
(16 px, 5 frames; ``boundary_ratio`` 0.875): each run's first loss against its expert called directly at a time drawn
from the shifted logit-normal restricted to the expert's side of the boundary (written out here with
``torch.distributions.Normal``); the full low-noise run exported into ``transformer_2`` (``transformer`` untouched) and
sampled by ditforge as the exported pipeline's own call samples it; the LoRA file of the high-noise run through
``load_lora_weights``; the one-line errors."""

from __future__ import annotations

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


def _reference_first_loss(folder: Path, expert: str) -> float:
    """Step 0's loss of ``expert``: the clips and captions of the first batch as ``test_wan._reference_first_loss``
    encodes them; the draws from ``derive_seed(0, 0)`` in ditforge's order (noise, then one uniform v per sample for
    the time, drop, flip, posterior eps); the time sigma = shift u / (1 + (shift - 1) u) with u = sigmoid(n), n the
    standard normal's quantile at the v-th fraction between the probabilities of the expert's bounds (sigma from
    boundary_ratio to 1 for high_noise, 0 to boundary_ratio for low_noise), so sigma follows the shifted
    logit-normal restricted to that range; the expert (``transformer`` or ``transformer_2``) at 1000 sigma."""
    import diffusers

    pipe = diffusers.WanPipeline.from_pretrained(str(folder), local_files_only=True)
    shift, boundary = float(pipe.scheduler.config.flow_shift), float(pipe.config.boundary_ratio)
    ds = build_dataset("clips", SIZE, None, FRAMES, INTERVAL, 0)
    idx = GlobalBatchSampler(len(ds), BATCH, 0, 0, 1, 0).global_batch_indices(0).tolist()
    pixels = torch.stack([ds[i]["video"] for i in idx])
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        g = torch.Generator().manual_seed(derive_seed(0, 0))
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

    prompt, npz = "a rabbit on a green hill", tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(runs["low_noise"]), "--prompt", prompt, "--num_sampling_steps", "4",
                     "--cfg_scale", "4", "--out", str(tmp_path / "clip.mp4"), "--save_npz", str(npz),
                     "--device", "cpu"]) == 0
    video = pipe(prompt=[prompt], num_inference_steps=4, guidance_scale=4.0, height=SIZE, width=SIZE,
                 num_frames=FRAMES, generator=torch.Generator("cpu").manual_seed(derive_seed(0, 0)),
                 output_type="np").frames
    assert_frames_match(npz, video, (1, FRAMES, SIZE, SIZE, 3))

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
    """One line, exit 2: a Wan 2.2 A14B folder without --expert (naming both choices); --expert for a Wan 2.1
    folder (one transformer)."""
    assert_one_line_error(capsys, _argv(wan22, tmp_path / "r", "--max_steps", "1"), "--init_from", "--expert",
                          "high_noise", "low_noise")
    one = tmp_path / "wan21"
    shutil.copytree(wan22, one)
    shutil.rmtree(one / "transformer_2")
    index = __import__("json").loads((one / "model_index.json").read_text())
    index.pop("transformer_2"), index.pop("boundary_ratio")
    (one / "model_index.json").write_text(__import__("json").dumps(index))
    assert_one_line_error(capsys, _argv(one, tmp_path / "r", "--max_steps", "1", "--expert", "low_noise"),
                          "--expert low_noise", "one transformer")
