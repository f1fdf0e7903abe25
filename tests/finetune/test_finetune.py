"""Fine-tuning pretrained pipelines through ``ditforge train --init_from`` (tiny random pipelines of each family,
``tiny_pipelines``): the first step's loss against a plain loss written from the diffusers model and scheduler,
20 steps of full and of LoRA fine-tuning, export to a pipeline folder that the family's class loads and that
samples as ``ditforge sample`` does, LoRA files that ``load_lora_weights`` reads, DreamBooth, DiT weights in the
official layout with a new class count, and the one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli
from ditforge.data import build_dataset
from ditforge.data.sampler import GlobalBatchSampler, derive_seed
from ditforge.diffusion.objective import create_objective
from ditforge.train.logging import read_metrics
from ditforge.train.step import step_randomness
from families import assert_one_line_error  # tests/finetune is on sys.path
from tiny_pipelines import CAPTIONS, IMAGE_SIZE, make_dit

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["sd", "sd_v", "pixart", "pixart_sigma", "sd3", "sdxl"]
PIPELINE_CLASS = {"sd": "StableDiffusionPipeline", "sd_v": "StableDiffusionPipeline", "pixart": "PixArtAlphaPipeline",
                  "pixart_sigma": "PixArtSigmaPipeline", "sd3": "StableDiffusion3Pipeline",
                  "sdxl": "StableDiffusionXLPipeline"}
EXTRA_CALL = {"pixart": {"use_resolution_binning": False}, "pixart_sigma": {"use_resolution_binning": False}}
STEPS = 20
SIZE = 32  # every tiny pipeline makes 32 px images (8 x 8 latents)


@pytest.fixture(scope="module")
def captioned(tmp_path_factory) -> Path:
    """Six random RGB images of another aspect (40 x 48, so the centre crop runs) with sidecar captions."""
    root = tmp_path_factory.mktemp("captioned")
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(CAPTIONS[i])
    return root


def _pipeline(request, family: str) -> Path:
    return request.getfixturevalue(f"{family}_pipeline")


def _train(folder: Path, data: Path, out: Path, *extra: str) -> Path:
    argv = ["train", "--init_from", str(folder), "--data", str(data), "--image_size", str(SIZE), "--batch_size", "2",
            "--max_steps", str(STEPS), "--log_every", "1", "--sample_every", "0", "--ckpt_every", "1000",
            "--mixed_precision", "fp32", "--device", "cpu", "--num_workers", "0", "--class_dropout_prob", "0",
            "--no-random_flip", "--outputs", str(out), *extra]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def runs(request, captioned, tmp_path_factory):
    """``runs(family)`` -> {"full": run folder, "lora": run folder}: 20 steps each, built once per module."""
    cache: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family not in cache:
            folder = _pipeline(request, family)
            root = tmp_path_factory.mktemp(f"runs_{family}")
            cache[family] = {"full": _train(folder, captioned, root / "full"),
                             "lora": _train(folder, captioned, root / "lora", "--lora_rank", "4", "--lr", "1e-3")}
        return cache[family]

    return get


def _reference_first_loss(family: str, folder: Path, data: Path) -> float:
    """The loss of step 0 written from diffusers' own pieces: the pipeline's VAE posterior and prompt encoding,
    ``DDPMScheduler.add_noise`` and its ``prediction_type`` target (epsilon or ``get_velocity``), or flow matching's
    straight path and velocity (SD3: x_t = (1 - s) x_0 + s eps, target eps - x_0, timestep 1000 s), the
    denoiser called directly (SDXL: with the time ids of the pipeline's ``_get_add_time_ids`` for an uncropped
    image of the training size), MSE in float32. The noise, timesteps and latent noise are the run's (step 0 of
    seed 0, the data order of ``GlobalBatchSampler``). PixArt's output also holds the learned variance: only its
    first 4 channels enter the MSE (the variational-bound term has its own float64 tests)."""
    import diffusers

    pipe = getattr(diffusers, PIPELINE_CLASS[family]).from_pretrained(str(folder), local_files_only=True)
    ds = build_dataset(str(data), SIZE)
    idx = GlobalBatchSampler(len(ds), 2, 0, 0, 1, 0).global_batch_indices(0).tolist()
    pixels = torch.stack([ds[i]["x"] for i in idx])
    texts = [ds[i]["text"] for i in idx]
    vae = pipe.vae
    with torch.no_grad():
        post = vae.encode(pixels).latent_dist
    shape = tuple(post.mean.shape[1:])
    sched_cfg = dict(pipe.scheduler.config)
    rnd = step_randomness(0, 0, 2, shape, create_objective("auto", False, sched_cfg), 0.0, torch.device("cpu"),
                          latent_noise=True)
    shift = vae.config.shift_factor or 0.0
    z = (post.mean + post.std * rnd.eps - shift) * vae.config.scaling_factor
    with torch.no_grad():
        if family == "sd3":
            embeds, _, pooled, _ = pipe.encode_prompt(texts, None, None, device="cpu",
                                                      do_classifier_free_guidance=False)
            s = rnd.t.view(-1, 1, 1, 1)
            noisy = (1 - s) * z + s * rnd.noise
            pred = pipe.transformer(noisy, encoder_hidden_states=embeds, pooled_projections=pooled,
                                    timestep=rnd.t * 1000).sample
            target = rnd.noise - z
        else:
            ddpm = diffusers.DDPMScheduler.from_config(sched_cfg)
            noisy = ddpm.add_noise(z, rnd.noise, rnd.t)
            target = rnd.noise if sched_cfg["prediction_type"] == "epsilon" else ddpm.get_velocity(z, rnd.noise, rnd.t)
            if family == "sdxl":
                embeds, _, pooled, _ = pipe.encode_prompt(texts, device="cpu", do_classifier_free_guidance=False)
                time_ids = pipe._get_add_time_ids((SIZE, SIZE), (0, 0), (SIZE, SIZE), dtype=embeds.dtype,
                                                  text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
                pred = pipe.unet(noisy, rnd.t, encoder_hidden_states=embeds,
                                 added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids.repeat(2, 1)}).sample
            elif family.startswith("pixart"):
                length = 300 if family == "pixart_sigma" else 120
                embeds, mask, _, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device="cpu",
                                                        clean_caption=False, max_sequence_length=length)
                pred = pipe.transformer(noisy, encoder_hidden_states=embeds, encoder_attention_mask=mask,
                                        timestep=rnd.t, added_cond_kwargs={"resolution": None, "aspect_ratio": None}
                                        ).sample[:, :4]
            else:
                embeds = pipe.encode_prompt(texts, "cpu", 1, False)[0]
                pred = pipe.unet(noisy, rnd.t, encoder_hidden_states=embeds).sample
    return float(torch.nn.functional.mse_loss(pred.float(), target.float()))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_loss_matches_diffusers(family, request, captioned, runs):
    """20 steps of full and of LoRA fine-tuning run; the first step's loss of both (LoRA starts with B = 0, so the
    same model) equals the plain diffusers loss within 1e-5 relative (fp32)."""
    ref = _reference_first_loss(family, _pipeline(request, family), captioned)
    term = "mse" if family.startswith("pixart") else "loss"
    for kind, run in runs(family).items():
        records = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), kind
        assert all(np.isfinite(r["loss"]) for r in records), kind
        assert records[0][term] == pytest.approx(ref, rel=1e-5), kind
    config = json.loads(json.dumps(__import__("yaml").safe_load((runs(family)["full"] / "config.yaml").read_text())))
    expected_objective = {"sd": "ddpm", "sd_v": "v", "pixart": "ddpm", "pixart_sigma": "ddpm", "sd3": "flow",
                          "sdxl": "ddpm"}[family]
    assert config["model"]["objective"] == expected_objective
    assert config["model"]["learn_sigma"] == family.startswith("pixart")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trains_adapters_only(family, request, runs):
    """A LoRA run's checkpoint holds the adapters alone; loaded back, the base weights equal the pipeline's and
    the adapters' B matrices moved away from their zero start."""
    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    state, config = load_weights(runs(family)["lora"], use_ema=False)
    pre, denoiser, cfg = load_finetuned(state, config, torch.device("cpu"), use_ema=False)
    import diffusers

    original = getattr(diffusers, PIPELINE_CLASS[family]).from_pretrained(str(_pipeline(request, family)),
                                                                          local_files_only=True)
    base = getattr(original, denoiser.component).state_dict()
    tuned = {k.removeprefix(f"{denoiser.component}."): v for k, v in denoiser.state_dict().items()}
    lora_b = [v for k, v in tuned.items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b)
    for key, value in base.items():
        peft_key = key.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        got = tuned.get(key, tuned.get(peft_key))
        assert got is not None, key
        assert torch.equal(got, value), key


def _sample_with_ditforge(run: Path, prompt: str, tmp_path: Path) -> np.ndarray:
    npz = tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", prompt, "--num_sampling_steps", "3", "--cfg_scale",
                     "4", "--out", str(tmp_path / "s.png"), "--save_npz", str(npz), "--device", "cpu"]) == 0
    return np.load(npz)["samples"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_export_loads_with_the_family_pipeline_and_matches_sample(family, kind, runs, tmp_path):
    """``ditforge export --format diffusers`` writes a folder the family's pipeline class loads offline; from the
    same seed, scheduler and steps it draws the image ``ditforge sample`` draws, to one uint8 level (the LoRA is
    merged in the export and separate in ``sample``: float rounding)."""
    import diffusers

    run, out = runs(family)[kind], tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    assert not list(tmp_path.glob(".export*"))  # nothing half-written left beside it
    pipe = getattr(diffusers, PIPELINE_CLASS[family]).from_pretrained(str(out), local_files_only=True)
    prompt = CAPTIONS[1]
    g = torch.Generator("cpu").manual_seed(derive_seed(0, 0))
    image = pipe(prompt=[prompt], num_inference_steps=3, guidance_scale=4.0, height=SIZE, width=SIZE, generator=[g],
                 output_type="np", **EXTRA_CALL.get(family, {})).images
    expected = np.round(image * 255).astype(np.int16)
    got = _sample_with_ditforge(run, prompt, tmp_path).astype(np.int16)
    assert got.shape == expected.shape == (1, SIZE, SIZE, 3)
    assert np.abs(got - expected).max() <= 1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd", "sd_v", "sd3", "sdxl"])
def test_lora_file_loads_with_load_lora_weights(family, request, runs, tmp_path):
    """``ditforge export --format lora`` writes a LoRA file that ``pipe.load_lora_weights`` reads into the base
    pipeline; the denoiser then gives the merged export's output (1e-5 relative, fp32)."""
    import diffusers

    run = runs(family)["lora"]
    assert cli.main(["export", "--ckpt", str(run), "--format", "lora", "--out", str(tmp_path / "lora")]) == 0
    assert cli.main(["export", "--ckpt", str(run), "--format", "diffusers", "--out", str(tmp_path / "merged")]) == 0
    cls = getattr(diffusers, PIPELINE_CLASS[family])
    with_lora = cls.from_pretrained(str(_pipeline(request, family)), local_files_only=True)
    with_lora.load_lora_weights(str(tmp_path / "lora"))
    merged = cls.from_pretrained(str(tmp_path / "merged"), local_files_only=True)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x = torch.randn(2, 16 if family == "sd3" else 4, 8, 8, generator=g)
    if family == "sd3":
        states, pooled = torch.randn(2, 333, 96, generator=g), torch.randn(2, 80, generator=g)
        t = torch.rand(2, generator=g) * 1000

        def run(p):
            return p.transformer(x, encoder_hidden_states=states, pooled_projections=pooled, timestep=t).sample
    else:
        states, t = torch.randn(2, 77, 80 if family == "sdxl" else 32, generator=g), torch.randint(0, 1000, (2,), generator=g)
        added = ({"added_cond_kwargs": {"text_embeds": torch.randn(2, 48, generator=g),
                                        "time_ids": torch.tensor([[32.0, 32, 0, 0, 32, 32]] * 2)}}
                 if family == "sdxl" else {})

        def run(p):
            return p.unet(x, t, encoder_hidden_states=states, **added).sample
    with torch.no_grad():
        outs = [run(p) for p in (with_lora, merged)]
    base = cls.from_pretrained(str(_pipeline(request, family)), local_files_only=True)
    assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[1].abs().max()
    with torch.no_grad():  # and the adapters do change the output (the comparison above can fail)
        plain = run(base)
    assert (plain - outs[1]).abs().max() > 1e-4 * outs[1].abs().max()


def test_pixart_lora_file_is_refused(request, runs, tmp_path, capsys):
    """diffusers' PixArt pipelines have no LoRA loader: --format lora says so in one line (the merged export
    works, above)."""
    assert cli.main(["export", "--ckpt", str(runs("pixart")["lora"]), "--format", "lora",
                     "--out", str(tmp_path / "l")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--format lora" in err and "PixArtAlphaPipeline" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "l").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd", "pixart"])
def test_features_train_like_on_the_fly(family, request, runs, captioned, tmp_path):
    """``extract-features --init_from`` stores the pipeline's VAE posterior and prompt encoding; a run on them
    (the pipeline read from the features) has the on-the-fly run's losses for the same seed (1e-5 relative)."""
    folder, feats = _pipeline(request, family), tmp_path / "feats"
    assert cli.main(["extract-features", "--init_from", str(folder), "--data", str(captioned), "--image_size",
                     str(SIZE), "--device", "cpu", "--num_workers", "0", "--out", str(feats)]) == 0
    argv = ["train", "--data", str(feats), "--batch_size", "2", "--max_steps", "3", "--log_every", "1",
            "--sample_every", "0", "--mixed_precision", "fp32", "--device", "cpu", "--class_dropout_prob", "0",
            "--no-random_flip", "--outputs", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    ours = read_metrics(tmp_path / "run" / "metrics.jsonl")
    fly = read_metrics(runs(family)["full"] / "metrics.jsonl")[:3]
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in fly], rel=1e-5)


# -------------------------------------------------------------------------------------------------------------
# DreamBooth


def _images(folder: Path, n: int, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.mark.slow
def test_dreambooth_prior_preservation_end_to_end(sd_pipeline, tmp_path):
    """DreamBooth with prior preservation on the CPU: the base pipeline fills the class folder up to
    --num_class_images (1 there, 3 asked), then LoRA trains on instance + class pairs."""
    instance, classes = _images(tmp_path / "sks", 2, 1), _images(tmp_path / "dogs", 1, 2)
    argv = ["train", "--init_from", str(sd_pipeline), "--instance_data", str(instance), "--instance_prompt",
            "a photo of sks dog", "--class_data", str(classes), "--class_prompt", "a photo of dog",
            "--num_class_images", "3", "--prior_loss_weight", "0.5", "--image_size", str(SIZE), "--batch_size", "2",
            "--max_steps", "3", "--log_every", "1", "--sample_every", "3", "--lora_rank", "4", "--device", "cpu",
            "--mixed_precision", "fp32", "--num_workers", "0", "--outputs", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    assert len(list(classes.glob("*.png"))) == 3
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    assert (tmp_path / "run" / "samples" / "step-0000003.png").is_file()


def test_dreambooth_loss_is_weighted_sum():
    """With class rows, ``train_step``'s loss is mean(instance losses) + prior_loss_weight * mean(class losses)
    (Ruiz et al. 2023 eq. 2; diffusers' train_dreambooth.py), against the two halves computed separately."""
    from ditforge.diffusion import create_diffusion
    from ditforge.models import create_model
    from ditforge.parallel.mesh import Dist
    from ditforge.train.finetune import interleave_prior
    from ditforge.train.randomness import StepRandomness
    from ditforge.train.step import train_step

    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    model = create_model("DiT-T/2", 8, 3, 4, learn_sigma=False, class_dropout_prob=0.0)
    diffusion = create_diffusion(None, learn_sigma=False)
    b = 3
    batch = {"x": torch.randn(b, 3, 8, 8), "text": ["i"] * b, "class_x": torch.randn(b, 3, 8, 8), "class_text": ["c"] * b}
    merged, weights = interleave_prior(batch, 0.7)
    assert torch.equal(merged["x"][0::2], batch["x"]) and torch.equal(merged["x"][1::2], batch["class_x"])
    assert merged["text"] == ["i", "c"] * b
    assert torch.equal(weights, torch.tensor([1.0, 0.7] * b)) and weights.device == batch["x"].device
    y = torch.randint(0, 4, (2 * b,))
    rnd = StepRandomness(torch.randn(2 * b, 3, 8, 8), torch.randint(0, 1000, (2 * b,)), torch.zeros(2 * b, dtype=torch.bool),
                         torch.zeros(2 * b, dtype=torch.bool))
    with torch.no_grad():
        terms = diffusion.training_losses(lambda xt, tt: model(xt, tt, y), merged["x"], rnd.t, rnd.noise)["loss"]
    expected = terms[0::2].mean() + 0.7 * terms[1::2].mean()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = train_step(model, diffusion, opt, None, [(merged["x"], {"y": y}, rnd, weights)], torch.float32, 0.0,
                     Dist(device=torch.device("cpu")), rows_per_sample=2)
    assert float(out["loss"]) == pytest.approx(float(expected), rel=1e-6)


# -------------------------------------------------------------------------------------------------------------
# DiT weights


def _labelled(root: Path, classes: int, size: int) -> Path:
    for c in range(classes):
        _images(root / f"class{c}", 2, 10 + c)
    return root


def test_official_dit_layout_with_new_class_count(tmp_path):
    """A state dict in the official DiT layout (built by the independent rebuild of facebookresearch/DiT, 1000
    classes) fine-tunes through --init_from on a 2-class image folder: rows 0, 1 of the label table keep their
    embeddings, the null row (1000 there) becomes row 2, every other tensor is loaded unchanged."""
    import importlib.util

    from ditforge.weights.read import read_tensors

    spec = importlib.util.spec_from_file_location("official_reference",
                                                  Path(__file__).parents[1] / "models" / "official_reference.py")
    official_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(official_reference)
    OfficialDiT = official_reference.DiT

    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    official = OfficialDiT(input_size=8, patch_size=2, in_channels=3, hidden_size=192, depth=6, num_heads=3,
                           num_classes=1000)
    for p in official.parameters():  # the official init zeroes adaLN and the output; make every tensor tell
        p.data.normal_(0, 0.02)
    state = {k: v.clone() for k, v in official.state_dict().items()}
    torch.save(state, tmp_path / "dit.pt")
    data = _labelled(tmp_path / "data", 2, 8)
    run = tmp_path / "run"
    assert cli.main(["train", "--init_from", str(tmp_path / "dit.pt"), "--data", str(data), "--image_size", "8",
                     "--batch_size", "2", "--max_steps", "1", "--lr", "1e-30", "--sample_every", "0",
                     "--log_every", "1", "--device", "cpu", "--mixed_precision", "fp32", "--num_workers", "0",
                     "--outputs", str(run)]) == 0
    assert cli.main(["export", "--ckpt", str(run), "--no_ema", "--out", str(tmp_path / "w.safetensors")]) == 0
    tuned = read_tensors(tmp_path / "w.safetensors")
    table = "y_embedder.embedding_table.weight"
    assert tuned[table].shape == (3, 192)
    assert torch.equal(tuned[table][:2], state[table][:2]) and torch.equal(tuned[table][2], state[table][1000])
    assert set(tuned) == set(state)
    for key in state:
        if key != table:
            assert torch.equal(tuned[key], state[key]), key


@pytest.fixture(scope="module")
def dit_runs(tmp_path_factory):
    """A diffusers DiTPipeline folder of DiT-T's size (1000-class table), a 3-class image folder, and 20 steps of
    full and of LoRA fine-tuning from it."""
    root = tmp_path_factory.mktemp("dit_runs")
    folder = make_dit(root / "dit", num_layers=6, num_heads=3, head_dim=64)
    data = _labelled(root / "data", 3, SIZE)
    runs = {}
    for kind, extra in (("full", []), ("lora", ["--lora_rank", "4", "--lr", "1e-3"])):
        runs[kind] = root / kind
        assert cli.main(["train", "--init_from", str(folder), "--data", str(data), "--image_size", str(SIZE),
                         "--batch_size", "2", "--max_steps", str(STEPS), "--sample_every", "0", "--log_every", "1",
                         "--device", "cpu", "--mixed_precision", "fp32", "--num_workers", "0",
                         "--class_dropout_prob", "0", "--no-random_flip", "--outputs", str(runs[kind]), *extra]) == 0
    return folder, data, runs


@pytest.mark.slow
def test_diffusers_dit_pipeline_into_ditforge_dit(dit_runs, tmp_path):
    """A diffusers DiT folder fine-tunes as ditforge's own DiT on 3 new classes (table rows 0..2 kept), full and
    LoRA, 20 steps each. The first step's MSE equals the plain loss of diffusers' DiTTransformer2DModel (with the
    official timestep frequencies, which ditforge's DiT has: see ditforge.interop) and DDPMScheduler.add_noise,
    within 1e-5; both runs export to DiTPipeline folders that diffusers loads and samples, the LoRA one merged."""
    import diffusers

    from ditforge.interop import use_official_timestep_frequencies

    folder, data, runs = dit_runs
    pipe = diffusers.DiTPipeline.from_pretrained(str(folder), local_files_only=True)
    use_official_timestep_frequencies(pipe.transformer)
    ds = build_dataset(str(data), SIZE)
    idx = GlobalBatchSampler(len(ds), 2, 0, 0, 1, 0).global_batch_indices(0).tolist()
    pixels, labels = torch.stack([ds[i][0] for i in idx]), torch.tensor([ds[i][1] for i in idx])
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
    rnd = step_randomness(0, 0, 2, tuple(post.mean.shape[1:]), create_objective("ddpm", True), 0.0,
                          torch.device("cpu"), latent_noise=True)
    z = (post.mean + post.std * rnd.eps) * pipe.vae.config.scaling_factor
    ddpm = diffusers.DDPMScheduler.from_config(pipe.scheduler.config)
    with torch.no_grad():
        pred = pipe.transformer(ddpm.add_noise(z, rnd.noise, rnd.t), timestep=rnd.t, class_labels=labels).sample[:, :4]
    ref = float(torch.nn.functional.mse_loss(pred, rnd.noise))
    for kind, run in runs.items():
        records = read_metrics(run / "metrics.jsonl")
        assert len(records) == STEPS and records[0]["mse"] == pytest.approx(ref, rel=1e-5), kind
        config = __import__("yaml").safe_load((run / "config.yaml").read_text())
        assert config["model"]["model"] == "DiT-T/2" and config["model"]["num_classes"] == 3
        out = tmp_path / kind
        assert cli.main(["export", "--ckpt", str(run), "--format", "diffusers", "--out", str(out)]) == 0
        tuned = diffusers.DiTPipeline.from_pretrained(str(out), local_files_only=True)
        image = tuned(class_labels=[2], num_inference_steps=2, output_type="np").images
        assert image.shape == (1, SIZE, SIZE, 3) and np.isfinite(image).all()
        moved = [(a - b).abs().max() for a, b in zip(tuned.transformer.parameters(), pipe.transformer.parameters())
                 if a.shape == b.shape]
        assert max(moved) > 1e-4, kind  # the fine-tuned (LoRA: merged) weights are in the export


# -------------------------------------------------------------------------------------------------------------
# Bad input: one line naming the flag or file, exit code 2, nothing half-written


def _train_argv(folder, data, out, *extra) -> list[str]:
    return ["train", "--init_from", str(folder), "--data", str(data), "--image_size", str(SIZE), "--max_steps", "1",
            "--batch_size", "2", "--device", "cpu", "--num_workers", "0", "--sample_every", "0", "--outputs",
            str(out), *extra]


def test_unsupported_family_folder(sd_pipeline, captioned, tmp_path, capsys):
    folder = tmp_path / "other"
    shutil.copytree(sd_pipeline, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "KandinskyV22Pipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    assert_one_line_error(capsys, _train_argv(folder, captioned, tmp_path / "r"), "--init_from", "KandinskyV22Pipeline",
           "StableDiffusionPipeline")
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_incomplete_folder_names_the_missing_file(sd_pipeline, captioned, tmp_path, capsys):
    folder = tmp_path / "sd"
    shutil.copytree(sd_pipeline, folder)
    (folder / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    assert_one_line_error(capsys, _train_argv(folder, captioned, tmp_path / "r"), "--init_from",
           "unet/diffusion_pytorch_model.safetensors")


def test_lora_target_that_matches_nothing(sd_pipeline, captioned, tmp_path, capsys):
    assert_one_line_error(capsys, _train_argv(sd_pipeline, captioned, tmp_path / "r", "--lora_rank", "4", "--lora_target_modules",
                               "to_q,qkv_nope"), "--lora_target_modules", "qkv_nope")


def test_image_family_refuses_a_token_split(sd_pipeline, captioned, tmp_path, capsys):
    """The image families have no context-parallel plan: ``--sequence_parallel_size 2`` is one line, before any
    process group or run folder (the video families split their tokens: tests/distributed)."""
    argv = _train_argv(sd_pipeline, captioned, tmp_path / "r", "--sequence_parallel_size", "2")
    assert_one_line_error(capsys, argv, "--sequence_parallel_size 2: StableDiffusionPipeline does not split its tokens",
                          "--plugin fsdp")
    assert not (tmp_path / "r").exists()


def test_resolution_the_vae_cannot_take(sd_pipeline, captioned, tmp_path, capsys):
    argv = _train_argv(sd_pipeline, captioned, tmp_path / "r")
    argv[argv.index("--image_size") + 1] = "36"
    assert_one_line_error(capsys, argv, "--image_size 36", "multiples of 8")


def test_dreambooth_folder_without_images(sd_pipeline, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    argv = ["train", "--init_from", str(sd_pipeline), "--instance_data", str(tmp_path / "empty"), "--instance_prompt",
            "a photo of sks dog", "--image_size", str(SIZE), "--max_steps", "1", "--device", "cpu",
            "--outputs", str(tmp_path / "r")]
    assert_one_line_error(capsys, argv, "--instance_data", str(tmp_path / "empty"))


def test_checkpoint_of_another_family(runs, captioned, tmp_path, capsys):
    """--init_from a fine-tuned SD run where DiT weights (or a pipeline folder) are expected."""
    data = _labelled(tmp_path / "data", 2, SIZE)
    assert_one_line_error(capsys, ["train", "--init_from", str(runs("sd")["full"]), "--data", str(data), "--image_size", str(SIZE),
                    "--max_steps", "1", "--device", "cpu", "--outputs", str(tmp_path / "r")],
           "--init_from", "fine-tuned sd pipeline")


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_train_text_encoder(lora, sd_pipeline, captioned, tmp_path):
    """--train_text_encoder (SD): the first step's loss is the plain diffusers loss (the model is unchanged at step
    0); afterwards the text encoder has moved; the export holds it and samples as ``ditforge sample``; with LoRA the
    LoRA file carries the text encoder's adapters, which ``load_lora_weights`` reads (its CLIP output equals the
    merged export's within 1e-5)."""
    import diffusers

    extra = ["--train_text_encoder", "--max_steps", "3", *(["--lora_rank", "4", "--lr", "1e-2"] if lora else ["--lr", "1e-3"])]
    run = _train(sd_pipeline, captioned, tmp_path / "run", *extra)
    first = read_metrics(run / "metrics.jsonl")[0]["loss"]
    assert first == pytest.approx(_reference_first_loss("sd", sd_pipeline, captioned), rel=1e-5)
    out = tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    base = diffusers.StableDiffusionPipeline.from_pretrained(str(sd_pipeline), local_files_only=True)
    tuned = diffusers.StableDiffusionPipeline.from_pretrained(str(out), local_files_only=True)
    ids = base.tokenizer([CAPTIONS[0]], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        before, after = base.text_encoder(ids)[0], tuned.text_encoder(ids)[0]
    assert (before - after).abs().max() > 1e-4
    g = torch.Generator("cpu").manual_seed(derive_seed(0, 0))
    image = tuned(prompt=[CAPTIONS[1]], num_inference_steps=3, guidance_scale=4.0, height=SIZE, width=SIZE,
                  generator=[g], output_type="np").images
    got = _sample_with_ditforge(run, CAPTIONS[1], tmp_path).astype(np.int16)
    assert np.abs(got - np.round(image * 255).astype(np.int16)).max() <= 1
    if lora:
        assert cli.main(["export", "--ckpt", str(run), "--format", "lora", "--out", str(tmp_path / "lora")]) == 0
        base.load_lora_weights(str(tmp_path / "lora"))
        with torch.no_grad():
            loaded = base.text_encoder(ids)[0]
        assert (loaded - after).abs().max() <= 1e-5 * after.abs().max()


def test_dit_pipeline_with_unshared_embedders(tmp_path, capsys):
    """diffusers gives each DiT block its own timestep/label embedder; one whose blocks differ (not converted from
    an official DiT) has no official form: one line, not a silently different model."""
    from diffusers import DiTTransformer2DModel

    folder = make_dit(tmp_path / "dit", num_layers=6, num_heads=3, head_dim=64)
    transformer = DiTTransformer2DModel.from_pretrained(str(folder), subfolder="transformer")
    with torch.no_grad():
        transformer.transformer_blocks[3].norm1.emb.timestep_embedder.linear_1.bias.add_(0.1)
    transformer.save_pretrained(str(folder / "transformer"))
    data = _labelled(tmp_path / "data", 2, SIZE)
    assert_one_line_error(capsys, ["train", "--init_from", str(folder), "--data", str(data), "--image_size", str(SIZE),
                    "--max_steps", "1", "--device", "cpu", "--outputs", str(tmp_path / "r")],
           "--init_from", "different timestep/label embedders")



@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--lora_rank", "4")])
def test_resume_equals_uninterrupted(extra, sd_pipeline, captioned, tmp_path):
    """A fine-tune stopped after 2 steps and resumed to 4 (``--resume auto``; the LoRA run's checkpoint holds the
    adapters alone) logs the same losses and ends with the same weights as 4 steps in one go."""
    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    common = ["--ckpt_every", "2", "--lr", "1e-3", *extra]
    whole = _train(sd_pipeline, captioned, tmp_path / "whole", "--max_steps", "4", *common)
    part = _train(sd_pipeline, captioned, tmp_path / "part", "--max_steps", "2", *common)
    assert cli.main(["train", "--outputs", str(part), "--resume", "auto", "--max_steps", "4"]) == 0
    assert [r["loss"] for r in read_metrics(part / "metrics.jsonl")] == pytest.approx(
        [r["loss"] for r in read_metrics(whole / "metrics.jsonl")], rel=1e-7)
    weights = []
    for run in (whole, part):
        state, config = load_weights(run, use_ema=True)
        weights.append(load_finetuned(state, config, torch.device("cpu"))[1].state_dict())
    assert all(torch.allclose(weights[0][k], weights[1][k], rtol=0, atol=1e-7) for k in weights[0])
