"""``ditforge sample`` and ``ditforge export``: PNG grid and NPZ from a run, consolidated safetensors files,
official DiT checkpoints, and bad or malicious checkpoints."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from ditforge import cli
from ditforge.errors import UserError
from ditforge.models import create_model
from ditforge.sample import load_model
from ditforge.weights.read import SafeFileSystemReader, read_checkpoint_weights

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


def test_sample_speed_flags_reach_the_sampler(tiny_run, tmp_path):
    """The command's speed and guidance flags change what is drawn as they should: a guidance window covering
    every step and --compile (inductor, CPU) give the plain samples (compile: uint8 within 1), a narrow window
    and bf16 weights change them (bf16 only slightly: mean |difference| under 3 of 255 levels, measured 0.11)."""
    args = ("--sampler", "ddim", "--num_samples", "4", "--seed", "2")
    _, plain, _ = _sample(tiny_run, tmp_path, *args, name="plain")
    _, wide, _ = _sample(tiny_run, tmp_path, *args, "--cfg_interval", "0", "999", name="wide")
    _, narrow, _ = _sample(tiny_run, tmp_path, *args, "--cfg_interval", "400", "600", name="narrow")
    _, bf16, _ = _sample(tiny_run, tmp_path, *args, "--mixed_precision", "bf16", name="bf16")
    _, compiled, _ = _sample(tiny_run, tmp_path, *args, "--compile", "default", name="compiled")
    assert np.array_equal(plain, wide)
    assert not np.array_equal(plain, narrow)
    assert not np.array_equal(plain, bf16)
    assert np.abs(plain.astype(int) - bf16.astype(int)).mean() < 3
    assert np.abs(plain.astype(int) - compiled.astype(int)).max() <= 1


def _ckpt_weights(ckpt, use_ema=True):
    return read_checkpoint_weights(ckpt, create_model("DiT-T/2", 8, 1, 10).state_dict(), use_ema)


def test_load_model_from_run(tiny_run):
    ckpt = tiny_run / "checkpoints" / "step-0000003"
    for use_ema in (True, False):
        model, spec = load_model(str(tiny_run), use_ema=use_ema)
        assert not model.training
        assert (spec["model"], spec["input_size"], spec["in_channels"], spec["num_classes"]) == ("DiT-T/2", 8, 1, 10)
        ref = _ckpt_weights(ckpt, use_ema)
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    # a checkpoint folder (not the newest) works too
    model, _ = load_model(str(tiny_run / "checkpoints" / "step-0000002"))
    ref = _ckpt_weights(tiny_run / "checkpoints" / "step-0000002")
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------------------------------------
# ditforge export


@pytest.mark.parametrize("use_ema", [True, False], ids=["ema", "raw"])
def test_export_equals_checkpoint(tiny_run, tmp_path, use_ema):
    out = tmp_path / "sub" / "dit.safetensors"
    rc = cli.main(["export", "--ckpt", str(tiny_run), "--out", str(out), *([] if use_ema else ["--no_ema"])])
    assert rc == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["dit.safetensors"]  # no temporary file left
    got = load_file(out)
    ref = _ckpt_weights(tiny_run / "checkpoints" / "step-0000003", use_ema)  # the newest checkpoint
    assert got.keys() == ref.keys()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], ref[k]) for k in ref)
    with safe_open(str(out), framework="pt") as f:
        config = json.loads(f.metadata()["config"])
    meta = json.loads((tiny_run / "checkpoints" / "step-0000003" / "meta.json").read_text())
    assert config == meta["config"]  # the run config travels in the file


def test_sample_from_exported_file(tiny_run, tmp_path):
    out = tmp_path / "dit.safetensors"
    assert cli.main(["export", "--ckpt", str(tiny_run), "--out", str(out)]) == 0
    # the file alone (no run folder) gives the same model, hence the same samples for the same seed
    model, spec = load_model(str(out))
    assert (spec["model"], spec["input_size"], spec["num_classes"], spec["learn_sigma"]) == ("DiT-T/2", 8, 10, True)
    _, from_file, labels = _sample(out, tmp_path, "--num_samples", "4", "--seed", "2", name="file")
    _, from_run, _ = _sample(tiny_run, tmp_path, "--num_samples", "4", "--seed", "2", name="run")
    assert from_file.shape == (4, 8, 8, 1) and labels.tolist() == [0, 1, 2, 3]
    assert np.array_equal(from_file, from_run)


def test_export_errors(tmp_path, capsys):
    assert cli.main(["export", "--ckpt", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "nowhere" in _one_line_error(capsys, "export")
    assert not (tmp_path / "x.safetensors").exists()


# ----------------------------------------------------------------------------------------------------------
# Malicious checkpoints: loading one must run no code


class _Payload:
    """Unpickling this runs ``os.system(command)``."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _touch(marker):
    return f"touch '{marker}'"


@pytest.fixture
def planted_metadata(tiny_run, tmp_path):
    """A copy of the tiny run whose newest checkpoint's DCP ``.metadata`` is a pickle that runs a command
    creating ``marker`` when unpickled without restrictions. Returns (run, checkpoint, marker)."""
    run, marker = tmp_path / "evil_run", tmp_path / "PWNED"  # 5 letters: see the positive control
    shutil.copytree(tiny_run, run)
    ckpt = run / "checkpoints" / "step-0000003"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(_touch(marker))))
    return run, ckpt, marker


def test_planted_metadata_pickle_is_live(planted_metadata):
    """Positive control: the planted file does run its command when unpickled plainly."""
    _, ckpt, marker = planted_metadata
    control = marker.with_name("CTRL_")  # as long as the marker's name, so the pickle stays valid
    pickle.loads((ckpt / ".metadata").read_bytes().replace(str(marker).encode(), str(control).encode()))
    assert control.exists() and not marker.exists()


def test_planted_metadata_pickle_is_refused(planted_metadata, tmp_path, capsys, tiny_argv, one_thread):
    run, ckpt, marker = planted_metadata
    with pytest.raises(UserError, match="not allowed"):
        SafeFileSystemReader(str(ckpt)).read_metadata()
    with pytest.raises(UserError):
        read_checkpoint_weights(ckpt, create_model("DiT-T/2", 8, 1, 10).state_dict())
    # through every command that reads checkpoints; however they fail, the command never runs
    for argv in (["sample", "--ckpt", str(run), "--num_sampling_steps", "2", "--out", str(tmp_path / "x.png"),
                  "--device", "cpu"],
                 ["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "x.safetensors")],
                 tiny_argv(tmp_path / "resumed", "--max_steps", "4", "--resume", str(ckpt))):
        try:
            cli.main(argv)
        except BaseException:  # noqa: BLE001 - see test_planted_metadata_pickle_exit_code
            pass
        assert not marker.exists(), argv[0]
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("command", ["sample", "export"])
def test_planted_metadata_pickle_exit_code(planted_metadata, tmp_path, capsys, command):
    run, ckpt, marker = planted_metadata
    extra = (["--num_sampling_steps", "2", "--out", str(tmp_path / "x.png"), "--device", "cpu"]
             if command == "sample" else ["--out", str(tmp_path / "x.safetensors")])
    rc = cli.main([command, "--ckpt", str(run), *extra])
    assert not marker.exists()
    assert rc == 2
    line = _one_line_error(capsys, command)
    assert "step-0000003" in line and "metadata" in line


# DCP stores non-tensor entries (e.g. the optimizer's param_groups) as torch.save pickles, and its
# DefaultLoadPlanner.load_bytes reads them with torch.load(weights_only=False); so would any key whose metadata
# entry says "bytes", even where the model expects a tensor. The restricted .metadata unpickler does not cover
# these, so ditforge must read them another way: a crafted __0_0.distcp must not run code on
# `ditforge sample/export` or `train --resume`.


def _plant_in_data(tiny_run, dst, marker, where):
    """A valid DCP checkpoint, written by DCP itself, whose entry ``where`` is a pickled payload instead of
    its value; its .metadata is clean (only DCP classes)."""
    import torch.distributed.checkpoint as dcp

    from ditforge.parallel.ema import EMA
    from ditforge.train.checkpoint import load_training_state, training_state

    src = tiny_run / "checkpoints" / "step-0000003"
    model = create_model("DiT-T/2", 8, 1, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = EMA(model)
    load_training_state(src, model, opt, ema)
    state = training_state(model, opt, ema)
    if where == "ema":
        state["ema"] = dict(state["ema"], pos_embed=_Payload(_touch(marker)))
    else:
        state["optimizer"]["param_groups"][0]["lr"] = _Payload(_touch(marker))
    dcp.save(state, checkpoint_id=str(dst), no_dist=True)
    shutil.copy(src / "meta.json", dst / "meta.json")
    SafeFileSystemReader(str(dst)).read_metadata()  # passes the metadata allow-list
    assert not marker.exists()
    return dst


@pytest.mark.parametrize("command", ["sample", "export"])
def test_planted_data_pickle_does_not_run_on_sample_or_export(tiny_run, tmp_path, capsys, command):
    marker = tmp_path / "PWNED"
    ckpt = _plant_in_data(tiny_run, tmp_path / "evil", marker, "ema")
    extra = (["--num_sampling_steps", "2", "--out", str(tmp_path / "x.png"), "--device", "cpu"]
             if command == "sample" else ["--out", str(tmp_path / "x.safetensors")])
    rc = cli.main([command, "--ckpt", str(ckpt), *extra])
    assert not marker.exists()
    assert rc == 2 and str(ckpt) in _one_line_error(capsys, command)
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.safetensors").exists()


def test_planted_data_pickle_does_not_run_on_resume(tiny_run, tiny_argv, tmp_path, capsys, one_thread):
    marker = tmp_path / "PWNED"
    ckpt = _plant_in_data(tiny_run, tmp_path / "evil", marker, "optimizer")
    rc = cli.main(tiny_argv(tmp_path / "resumed", "--max_steps", "4", "--resume", str(ckpt)))
    assert not marker.exists()
    assert rc == 2 and "--resume" in _one_line_error(capsys, "train")
    assert not (tmp_path / "resumed" / "checkpoints").exists()


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
    assert "--vae" in _one_line_error(capsys)  # pass --vae FOLDER
    assert not (tmp_path / "x.png").exists()


# ----------------------------------------------------------------------------------------------------------
# Bad checkpoints and settings


def _sample_rc(ckpt, tmp_path, *extra):
    return cli.main(["sample", "--ckpt", str(ckpt), "--num_sampling_steps", "2", "--out", str(tmp_path / "x.png"),
                     "--device", "cpu", *extra])


def test_wrong_model_for_checkpoint(tiny_run, tmp_path, capsys):
    # DCP reports a mismatch as CheckpointException, a BaseException wrapping the rank's error: still one line,
    # naming the checkpoint and what does not fit
    assert _sample_rc(tiny_run, tmp_path, "--model", "DiT-S/2") == 2
    line = _one_line_error(capsys)
    assert str(tiny_run) in line and ("DiT-S/2" in line or "384" in line)  # DiT-S is 384 wide, DiT-T 192
    assert not (tmp_path / "x.png").exists()


def test_another_image_size_samples(tiny_run, tmp_path):
    """The models take any size the patch divides: --image_size 16 (64 tokens at training, 16 here) rebuilds
    only the fixed sin-cos table for its grid."""
    assert _sample_rc(tiny_run, tmp_path, "--image_size", "16", "--save_npz", str(tmp_path / "x.npz")) == 0
    with np.load(tmp_path / "x.npz") as f:
        assert f["samples"].shape[1:3] == (16, 16)


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
        _sample_rc(tiny_run, tmp_path, "--sampler", "heun")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("ditforge sample: error:") and "Traceback" not in err


def test_one_sampling_step(tiny_run, tmp_path, capsys):
    assert _sample_rc(tiny_run, tmp_path, "--num_sampling_steps", "1") == 2  # one step cannot be respaced (the posterior needs t = 1)


def test_num_samples_zero_is_a_user_error(tiny_run, tmp_path, capsys):
    assert _sample_rc(tiny_run, tmp_path, "--num_samples", "0") == 2


def test_batch_size_zero_is_a_user_error(tiny_run, tmp_path, capsys):
    assert _sample_rc(tiny_run, tmp_path, "--batch_size", "0") == 2
