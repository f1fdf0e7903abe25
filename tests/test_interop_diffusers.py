"""diffusers interop: export -> DiTPipeline.from_pretrained (offline) -> the same image as ditforge's sampler;
import of such a folder (and through ``load_weights`` / ``load_model``) round-trips the weights exactly.

References: diffusers' own DiTTransformer2DModel, DDIMScheduler and DiTPipeline (independent code), run on the
weights our mapping produced. Tolerances: weights round-trip bit-exactly; one transformer forward agrees to
2e-5 (float32 summation order); the decoded images (in [0, 1]) after 10 guided DDIM steps agree to 1e-5
(measured 4e-7), once diffusers uses the official DiT timestep frequencies (see ditforge.interop).
"""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from ditforge.diffusion import create_diffusion  # noqa: E402
from ditforge.diffusion.samplers import GuidedModel, sample_loop  # noqa: E402
from ditforge.encoders.vae import load_vae  # noqa: E402
from ditforge.errors import UserError  # noqa: E402
from ditforge.export import export_diffusers  # noqa: E402
from ditforge.interop import load_diffusers, use_official_timestep_frequencies  # noqa: E402
from ditforge.models import create_model  # noqa: E402

SPEC = dict(model="DiT-T/2", input_size=8, in_channels=4, num_classes=1000, learn_sigma=True,
            class_dropout_prob=0.1, condition="class", num_frames=None, text_dim=None, qk_norm=False, vae="none")


def _random_dit(num_classes: int = 1000, seed: int = 0) -> torch.nn.Module:
    """A DiT-T/2 on 8x8x4 latents whose zero-initialised adaLN / final layers are made random (non-trivial)."""
    torch.manual_seed(seed)
    model = create_model("DiT-T/2", 8, 4, num_classes, True, 0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                        latent_channels=4, norm_num_groups=32, sample_size=16, scaling_factor=0.18215).eval()
    folder = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory, vae_dir):
    model = _random_dit()
    out = tmp_path_factory.mktemp("export") / "pipe"
    export_diffusers(model, dict(SPEC), out, vae_dir)
    return model, out


def test_export_import_round_trip_exact(exported):
    model, out = exported
    assert {"model_index.json", "transformer", "scheduler", "vae"} <= {p.name for p in out.iterdir()}
    assert not list(out.parent.glob(".pipe.tmp*"))
    state, config = load_diffusers(out)
    own = model.state_dict()
    assert state.keys() == own.keys()
    for k in own:
        assert torch.equal(state[k], own[k]), k
    spec = config["model"]
    assert (spec["model"], spec["input_size"], spec["in_channels"], spec["num_classes"], spec["learn_sigma"]) == \
        ("DiT-T/2", 8, 4, 1000, True)
    assert spec["vae"] == str(out / "vae")


def test_load_model_reads_diffusers_folder(exported):
    """``ditforge sample --ckpt FOLDER`` path: load_weights -> load_model builds the same model."""
    from ditforge.sample import load_model

    model, out = exported
    loaded, spec = load_model(str(out))
    assert spec["model"] == "DiT-T/2" and spec["vae"] == str(out / "vae")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_fewer_classes_keep_null_label(tmp_path, vae_dir):
    """A 10-class model: the null row moves to 1000 for DiTPipeline and back to 10 on import (exact)."""
    model = _random_dit(num_classes=10, seed=3)
    out = export_diffusers(model, dict(SPEC, num_classes=10), tmp_path / "p", vae_dir)
    state, config = load_diffusers(out)
    assert config["model"]["num_classes"] == 10
    assert torch.equal(state["y_embedder.embedding_table.weight"], model.state_dict()["y_embedder.embedding_table.weight"])


def test_transformer_forward_matches(exported):
    """One forward of diffusers' transformer on our mapped weights vs ours (2B guided batch incl. null labels)."""
    from diffusers import DiTTransformer2DModel

    model, out = exported
    tr = DiTTransformer2DModel.from_pretrained(str(out), subfolder="transformer", local_files_only=True).eval()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 4, 8, 8, generator=g)
    t = torch.tensor([0, 250, 731, 999])
    y = torch.tensor([3, 999, 1000, 17])
    with torch.no_grad():
        ours = model(x, t, y)
        stock = tr(x, timestep=t, class_labels=y).sample
        official = use_official_timestep_frequencies(tr)(x, timestep=t, class_labels=y).sample
    scale = ours.abs().max().item()
    assert scale > 0.1  # non-trivial outputs
    assert (official - ours).abs().max().item() < 2e-5
    # diffusers' own timestep frequencies (10000^(-k/127), not DiT's 10000^(-k/128)) do change the output:
    assert (stock - ours).abs().max().item() > 1e-3


def test_pipeline_gives_same_image(exported):
    """DiTPipeline (DDIM 10 steps, guidance 4.0, seeded) vs ditforge's DDIM (eta 0) on the same weights, noise,
    steps (t = 900, 800, ..., 0: DDIM "leading" spacing, offset 0 == create_diffusion("1,...,1")), guidance and
    VAE. DiTPipeline 0.42 guides all latent channels (``noise_pred[:, :latent_channels]``), so guidance_channels
    is None here; it drops the variance channels, DDIM with eta 0 ignores them."""
    from diffusers import DDIMScheduler, DiTPipeline

    model, out = exported
    pipe = DiTPipeline.from_pretrained(str(out), local_files_only=True)
    assert isinstance(pipe.scheduler, DDIMScheduler)
    use_official_timestep_frequencies(pipe.transformer)
    labels, steps, seed = [7, 421], 10, 123
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(class_labels=labels, guidance_scale=4.0, num_inference_steps=steps,
                  generator=torch.Generator().manual_seed(seed), output_type="pt").images  # (B, 3, H, W) in [0, 1]
    pipe.scheduler.set_timesteps(steps)
    assert pipe.scheduler.timesteps.tolist() == list(range(900, -1, -100))

    diffusion = create_diffusion(",".join(["1"] * steps), learn_sigma=True)
    assert diffusion.timestep_map.tolist() == list(range(0, 1000, 100))
    noise = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(seed))
    y = torch.tensor(labels)
    latents = sample_loop(diffusion, GuidedModel(model, y, 4.0), noise, "ddim", eta=0.0, clip_denoised=False)
    pixels = load_vae(str(out / "vae")).decode(latents)
    ours = (pixels / 2 + 0.5).clamp(0, 1)
    assert theirs.shape == ours.shape == (2, 3, 16, 16)
    assert theirs.std().item() > 0.01  # a non-constant image
    err = (theirs - ours).abs().max().item()
    assert err < 1e-5, err  # measured 4e-7 (stock diffusers frequencies: 0.12)


def test_refuses_text_models_and_missing_vae(tmp_path, vae_dir):
    model = _random_dit()
    with pytest.raises(UserError, match="--format"):
        export_diffusers(model, dict(SPEC, condition="text"), tmp_path / "a", vae_dir)
    with pytest.raises(UserError, match="--vae"):
        export_diffusers(model, dict(SPEC), tmp_path / "b", None)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_export_diffusers(tmp_path, vae_dir):
    from ditforge.cli import main
    from ditforge.export import export_safetensors

    model = _random_dit(seed=2)
    ckpt = tmp_path / "m.safetensors"
    export_safetensors(model.state_dict(), {"model": dict(SPEC)}, ckpt)
    out = tmp_path / "pipe"
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out), "--format", "diffusers", "--vae", str(vae_dir)]) == 0
    state, _ = load_diffusers(out)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "x.safetensors"), "--vae", str(vae_dir)]) == 2
