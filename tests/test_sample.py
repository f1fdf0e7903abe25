"""``ditforge sample``: PNG grid and NPZ from a run, official DiT checkpoints, and bad checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli
from ditforge.models import create_model
from ditforge.sample import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _sample(tiny_run, tmp_path, *extra, name="s"):
    out, npz = tmp_path / f"{name}.png", tmp_path / f"{name}.npz"
    rc = cli.main(["sample", "--ckpt", str(tiny_run), "--num_sampling_steps", "4", "--out", str(out),
                   "--save_npz", str(npz), "--device", "cpu", *extra])
    assert rc == 0
    with np.load(npz) as f:
        return out, f["samples"], f["labels"]


def _grid_cells(png, n, nrow, h=8, upscale=8, pad=1):
    """Undo save_grid independently: (n, h, h) uint8 from the PNG, after checking the nearest-neighbour upscale."""
    with Image.open(png) as img:
        big = np.array(img)
    grid = big[::upscale, ::upscale]
    assert np.array_equal(big, np.kron(grid, np.ones((upscale, upscale), dtype=np.uint8)))
    return np.stack([grid[pad + (i // nrow) * (h + pad):][:h, pad + (i % nrow) * (h + pad):][:, :h] for i in range(n)])


def test_sample_class_labels(tiny_run, tmp_path):
    png, samples, labels = _sample(tiny_run, tmp_path, "--class_labels", "0,1,2")
    assert samples.dtype == np.uint8 and samples.shape == (3, 8, 8, 1)
    assert labels.dtype == np.int64 and labels.tolist() == [0, 1, 2]
    with Image.open(png) as img:
        assert img.format == "PNG" and img.mode == "L"
        # one row of 3 cells of 8 px with 1 px padding, enlarged 64 // 8 = 8 times
        assert img.size == (8 * (3 * 9 + 1), 8 * (1 * 9 + 1))
    assert np.array_equal(_grid_cells(png, 3, 3), samples[..., 0])
    assert samples.std() > 0  # not a blank grid


def test_sample_num_samples_and_seed(tiny_run, tmp_path):
    png, a, labels = _sample(tiny_run, tmp_path, "--num_samples", "12", "--seed", "3", name="a")
    assert a.shape == (12, 8, 8, 1) and labels.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    with Image.open(png) as img:
        assert img.size == (8 * (10 * 9 + 1), 8 * (2 * 9 + 1))  # a row per 10 classes
    assert np.array_equal(_grid_cells(png, 12, 10), a[..., 0])
    _, b, _ = _sample(tiny_run, tmp_path, "--num_samples", "12", "--seed", "3", name="b")
    _, c, _ = _sample(tiny_run, tmp_path, "--num_samples", "12", "--seed", "4", name="c")
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_sample_ddim(tiny_run, tmp_path):
    _, a, labels = _sample(tiny_run, tmp_path, "--sampler", "ddim", "--num_samples", "4", "--seed", "1", name="a")
    _, b, _ = _sample(tiny_run, tmp_path, "--sampler", "ddim", "--num_samples", "4", "--seed", "1", name="b")
    _, c, _ = _sample(tiny_run, tmp_path, "--sampler", "ddpm", "--num_samples", "4", "--seed", "1", name="c")
    assert a.shape == (4, 8, 8, 1) and labels.tolist() == [0, 1, 2, 3]
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)  # DDIM (eta 0) and ancestral DDPM are different reverse processes


def test_load_model_from_run(tiny_run):
    from safetensors.torch import load_file

    ckpt = tiny_run / "checkpoints" / "step-0000003"
    for use_ema, file in ((True, "ema"), (False, "model")):
        model, spec = load_model(str(tiny_run), use_ema=use_ema)
        assert not model.training
        assert (spec["model"], spec["input_size"], spec["in_channels"], spec["num_classes"]) == ("DiT-T/2", 8, 1, 10)
        ref = load_file(ckpt / f"{file}.safetensors")
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------------------------------------
# Official-layout checkpoints (plain state dicts saved with torch.save)


def _randomised(name, size, channels, classes, learn_sigma=True):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    model = create_model(name, size, channels, classes, learn_sigma)
    with torch.no_grad():  # the adaLN and final layers start at zero: make every tensor informative
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


@pytest.mark.parametrize("name,channels,learn_sigma", [
    ("DiT-S/2", 4, True), ("DiT-S/4", 3, True), ("DiT-B/8", 4, True), ("DiT-T/2", 3, True), ("DiT-T/4", 4, False),
])
def test_official_state_dict(tmp_path, name, channels, learn_sigma):
    size, classes = 16, 10
    model = _randomised(name, size, channels, classes, learn_sigma)
    torch.save(model.state_dict(), tmp_path / "x.pt")
    loaded, spec = load_model(str(tmp_path / "x.pt"))
    assert spec["model"] == name and spec["input_size"] == size and spec["in_channels"] == channels
    assert spec["num_classes"] == classes and spec["learn_sigma"] == learn_sigma
    ref = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    x = torch.randn(3, channels, size, size)
    t = torch.randint(0, 1000, (3,))
    y = torch.tensor([0, classes - 1, classes])  # the last is the null label
    with torch.no_grad():
        assert torch.equal(loaded(x, t, y), model(x, t, y))


def test_official_train_checkpoint_gives_ema(tmp_path):
    model = _randomised("DiT-T/2", 16, 4, 10)
    ema = _randomised("DiT-T/2", 16, 4, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 4, 16, 16), torch.tensor([1, 2]), torch.tensor([3, 4])).sum().backward()
    opt.step()
    # DiT's train.py saves {"model", "ema", "opt", "args"}; args is an argparse.Namespace, which needs pickle
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict()}, tmp_path / "c.pt")
    for use_ema, ref in ((True, ema), (False, model)):
        loaded, _ = load_model(str(tmp_path / "c.pt"), use_ema=use_ema)
        assert all(torch.equal(v, ref.state_dict()[k]) for k, v in loaded.state_dict().items())


def _one_line_error(capsys, command="sample"):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ditforge {command}: error:") and "Traceback" not in err
    return lines[0]


def test_latent_checkpoint_needs_vae(tmp_path, capsys):
    model = _randomised("DiT-T/2", 16, 4, 10)
    torch.save(model.state_dict(), tmp_path / "latent.pt")
    rc = cli.main(["sample", "--ckpt", str(tmp_path / "latent.pt"), "--num_sampling_steps", "2",
                   "--out", str(tmp_path / "x.png"), "--device", "cpu"])
    assert rc == 2
    assert "VAE" in _one_line_error(capsys)
    assert not (tmp_path / "x.png").exists()


# ----------------------------------------------------------------------------------------------------------
# Bad checkpoints and settings


def _sample_rc(ckpt, tmp_path, *extra):
    return cli.main(["sample", "--ckpt", str(ckpt), "--num_sampling_steps", "2", "--out", str(tmp_path / "x.png"),
                     "--device", "cpu", *extra])


def test_wrong_model_for_checkpoint(tiny_run, tmp_path, capsys):
    assert _sample_rc(tiny_run, tmp_path, "--model", "DiT-S/2") == 2
    line = _one_line_error(capsys)
    assert str(tiny_run) in line and "DiT-S/2" in line
    assert _sample_rc(tiny_run, tmp_path, "--image_size", "16") == 2  # pos_embed has 16 tokens, not 64
    _one_line_error(capsys)
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".pth"])
def test_random_bytes_checkpoint(tmp_path, capsys, suffix):
    bad = tmp_path / f"junk{suffix}"
    bad.write_bytes(np.random.default_rng().bytes(2048))
    assert _sample_rc(bad, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("ditforge sample: error:") and str(bad) in err.splitlines()[0]
    assert "Traceback" not in err


def test_random_bytes_pt_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "junk.pt"
    bad.write_bytes(np.random.default_rng().bytes(2048))
    assert _sample_rc(bad, tmp_path) == 2
    _one_line_error(capsys)


def test_not_a_dit_state_dict(tmp_path, capsys):
    torch.save({"weight": torch.randn(3, 3)}, tmp_path / "other.pt")
    assert _sample_rc(tmp_path / "other.pt", tmp_path) == 2
    _one_line_error(capsys)
    torch.save([1, 2, 3], tmp_path / "list.pt")
    assert _sample_rc(tmp_path / "list.pt", tmp_path) == 2
    _one_line_error(capsys)


def test_missing_checkpoint(tmp_path, capsys):
    assert _sample_rc(tmp_path / "nope.pt", tmp_path) == 2
    assert "nope.pt" in _one_line_error(capsys)
    (tmp_path / "empty_run").mkdir()
    assert _sample_rc(tmp_path / "empty_run", tmp_path) == 2
    assert "empty_run" in _one_line_error(capsys)


@pytest.mark.parametrize("labels", ["10", "0,1,99", "-1"])
def test_labels_out_of_range(tiny_run, tmp_path, capsys, labels):
    assert _sample_rc(tiny_run, tmp_path, "--class_labels", labels) == 2
    assert "--class_labels" in _one_line_error(capsys)


def test_bad_sampling_steps(tiny_run, tmp_path, capsys):
    assert _sample_rc(tiny_run, tmp_path, "--num_sampling_steps", "0") == 2
    assert "--num_sampling_steps" in _one_line_error(capsys)


def test_bad_sampler_is_an_argparse_error(tiny_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _sample_rc(tiny_run, tmp_path, "--sampler", "euler")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("ditforge sample: error:") and "Traceback" not in err


def test_one_sampling_step(tiny_run, tmp_path, capsys):
    assert _sample_rc(tiny_run, tmp_path, "--num_sampling_steps", "1") == 2  # one step cannot be respaced (the posterior needs t = 1)


def test_num_samples_zero_is_a_user_error(tiny_run, tmp_path, capsys):
    assert _sample_rc(tiny_run, tmp_path, "--num_samples", "0") == 2


def test_batch_size_zero_is_a_user_error(tiny_run, tmp_path, capsys):
    assert _sample_rc(tiny_run, tmp_path, "--batch_size", "0") == 2
