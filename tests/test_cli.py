"""The ``ditforge`` command: subprocess smoke runs, help, user errors (one line, exit 2), config files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from ditforge import cli
from ditforge.weights.read import SafeFileSystemReader, list_checkpoints
from ditforge.train.logging import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(args, env, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "ditforge", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


# ----------------------------------------------------------------------------------------------------------
# Real subprocesses


def test_subprocess_train_then_sample(tmp_path, subprocess_env, monkeypatch):
    # DiT-T/8 on 8x8 digits is one token per image, so the real end-of-run sample grid (80 images, 100 DDPM
    # steps with guidance) takes seconds; num_workers 2 exercises the worker processes. The sample half runs
    # in-process (the train half is the real-process smoke test; a second interpreter would only import torch again).
    run = tmp_path / "run"
    p = _run(["train", "--model", "DiT-T/8", "--batch_size", "16", "--max_steps", "2", "--num_workers", "2",
              "--sample_every", "2", "--log_every", "1", "--outputs", str(run)], subprocess_env, tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert (run / "config.yaml").is_file()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert [c.name for c in list_checkpoints(run)] == ["step-0000002"]
    assert (run / "samples" / "step-0000002.png").is_file()
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["num_workers"] == 2

    monkeypatch.chdir(tmp_path)  # as the subprocess's cwd: a default output folder would land here
    assert cli.main(["sample", "--ckpt", str(run), "--num_samples", "4", "--num_sampling_steps", "3",
                     "--out", str(tmp_path / "s.png"), "--save_npz", str(tmp_path / "s.npz")]) == 0
    with np.load(tmp_path / "s.npz") as f:
        assert f["samples"].shape == (4, 8, 8, 1) and f["labels"].tolist() == [0, 1, 2, 3]
    assert not (tmp_path / "outputs").exists()  # nothing written outside --outputs / --out


def test_subprocess_user_error_is_one_line(tmp_path, subprocess_env):
    p = _run(["train", "--model", "DiT-Q/2", "--outputs", str(tmp_path / "run")], subprocess_env, tmp_path)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ditforge train: error: --model"), p.stderr
    assert "DiT-Q/2" in lines[0] and "DiT-XL/2" in lines[0]  # names the bad value and the known ones


TRAIN_FLAGS = ["--model", "--batch_size", "--mixed_precision", "--grad_checkpoint", "--ckpt_every", "--resume",
               "--max_steps", "--epochs", "--lr", "--data", "--image_size", "--outputs", "--config", "--keep_last",
               "--ema_decay", "--seed", "--num_workers", "--sample_every", "--log_every", "--plugin",
               "--grad_accum_steps", "--grad_reduce_dtype", "--async_checkpoint"]
SAMPLE_FLAGS = ["--ckpt", "--model", "--cfg_scale", "--num_sampling_steps", "--sampler", "--class_labels",
                "--num_samples", "--seed", "--save_npz", "--no_ema"]
EXPORT_FLAGS = ["--ckpt", "--out", "--no_ema"]


@pytest.mark.parametrize("args,flags", [([], ["train", "sample", "export"]), (["train"], TRAIN_FLAGS),
                                        (["sample"], SAMPLE_FLAGS), (["export"], EXPORT_FLAGS)])
def test_help(tmp_path, subprocess_env, args, flags):
    exe = shutil.which("ditforge")  # the console script of the installed package, when on PATH
    cmd = [exe] if exe else [sys.executable, "-m", "ditforge"]
    p = subprocess.run([*cmd, *args, "--help"], env=subprocess_env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    for flag in flags:
        assert flag in p.stdout, flag


# ----------------------------------------------------------------------------------------------------------
# User errors, in-process


def _image_folder(root):
    from PIL import Image

    (root / "cls").mkdir(parents=True)
    Image.new("RGB", (20, 20), (10, 200, 30)).save(root / "cls" / "a.png")
    return root


def _existing_run(tmp_path, steps=(5,)):
    import torch

    from ditforge.parallel.mesh import Dist
    from ditforge.train.checkpoint import Checkpointer

    checkpointer = Checkpointer(tmp_path / "run", keep_last=5, async_save=False, d=Dist())
    for step in steps:
        checkpointer.save(step, {"x": torch.zeros(2)}, {})
    return []


CASES = {
    "unknown_model": (lambda tmp: ["--model", "DiT-Q/2"], ["--model", "DiT-Q/2"]),
    "missing_data": (lambda tmp: ["--data", str(tmp / "nowhere"), "--image_size", "16"], ["nowhere"]),
    "folder_without_image_size": (lambda tmp: ["--data", str(_image_folder(tmp / "imgs"))], ["--image_size"]),
    "digits_size": (lambda tmp: ["--image_size", "16"], ["--image_size", "16"]),
    "batch_size_0": (lambda tmp: ["--batch_size", "0"], ["--batch_size"]),
    "batch_larger_than_data": (lambda tmp: ["--batch_size", "4096"], ["--batch_size 4096", "1797"]),
    "negative_lr": (lambda tmp: ["--lr", "-1"], ["--lr"]),
    "steps_and_epochs": (lambda tmp: ["--max_steps", "2", "--epochs", "1"], ["--max_steps", "--epochs"]),
    "ema_decay_1": (lambda tmp: ["--ema_decay", "1.0"], ["--ema_decay"]),
    "too_few_classes": (lambda tmp: ["--num_classes", "5"], ["--num_classes"]),
    "cuda_without_gpu": (lambda tmp: ["--device", "cuda"], ["--device"]),
    "unknown_config_key": (
        lambda tmp: ["--config", str(_write(tmp / "c.yaml", "train:\n  batch_size: 16\n  bogus_key: 3\n"))],
        ["bogus_key", "c.yaml"]),
    "missing_config": (lambda tmp: ["--config", str(tmp / "absent.yaml")], ["absent.yaml"]),
    "yaml_not_a_mapping": (lambda tmp: ["--config", str(_write(tmp / "list.yaml", "- 1\n- 2\n"))], ["list.yaml"]),
    "yaml_wrong_type": (lambda tmp: ["--config", str(_write(tmp / "t.yaml", "keep_last: '2'\n"))],
                        ["--keep_last"]),
    "resume_empty_folder": (lambda tmp: ["--resume", str(_mkdir(tmp / "empty"))], ["empty"]),
    "batch_not_divisible_by_accumulation": (lambda tmp: ["--grad_accum_steps", "3"],
                                            ["--batch_size 16", "--grad_accum_steps 3"]),
    "grad_accum_steps_0": (lambda tmp: ["--grad_accum_steps", "0"], ["--grad_accum_steps"]),
    "dp_shard_without_hsdp": (lambda tmp: ["--dp_shard", "2"], ["--dp_shard", "--plugin hsdp", "--plugin auto"]),
    "collective_timeout_0": (lambda tmp: ["--collective_timeout", "0"], ["--collective_timeout", "> 0"]),
    "reuse_outputs": (lambda tmp: _existing_run(tmp), ["--resume auto", "run"]),
    # resuming step 2 into the folder that already holds step 3 would mix two histories
    "resume_older_checkpoint_into_its_run": (
        lambda tmp: [*_existing_run(tmp, (2, 3)), "--resume", str(tmp / "run" / "checkpoints" / "step-0000002")],
        ["--resume", "step-0000002", "step-0000003"]),
}


def _write(path, text):
    path.write_text(text)
    return path


def _mkdir(path):
    path.mkdir()
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_user_errors(tiny_argv, tmp_path, capsys, monkeypatch, case):
    if case == "cuda_without_gpu":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    monkeypatch.chdir(tmp_path)  # a default --outputs would land here, not in the checkout
    make_args, expected = CASES[case]
    extra = make_args(tmp_path)
    before = list_checkpoints(tmp_path / "run")
    rc = cli.main(tiny_argv(tmp_path / "run", "--max_steps", "1", *extra))
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ditforge train: error:") and "Traceback" not in err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert list_checkpoints(tmp_path / "run") == before  # nothing trained or saved


@pytest.mark.parametrize("layout,expected", [
    (["--dp_shard", "3"], "--plugin hsdp: --dp_replicate 1 x --dp_shard 3 x --sequence_parallel_size 1 x "
                          "--tensor_parallel 1 is 3, not the 4 processes"),
    (["--dp_replicate", "3"], "--plugin hsdp: --dp_replicate 3 x --dp_shard 2 x --sequence_parallel_size 1 x "
                              "--tensor_parallel 1 is 6, not the 4 processes"),
    (["--dp_shard", "-1"], "--dp_shard -1 --dp_replicate 0: expected integers >= 0 (0: default)")])
def test_hsdp_layout_that_does_not_fit_the_world(tiny_argv, tmp_path, capsys, monkeypatch, layout, expected):
    # torchrun's view of 2 nodes of 2; refused before any process group is joined
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rc = cli.main(tiny_argv(tmp_path / "run", "--max_steps", "1", "--plugin", "hsdp", *layout))
    assert (rc, capsys.readouterr().err.strip()) == (2, f"ditforge train: error: {expected}")
    assert not (tmp_path / "run").exists()


def test_resume_checkpoint_of_another_model(tiny_run, tiny_argv, tmp_path, capsys):
    # DCP reports a mismatch as CheckpointException, a BaseException wrapping the rank's error: still one line
    rc = cli.main(tiny_argv(tmp_path / "run", "--model", "DiT-T/4", "--max_steps", "4", "--resume", str(tiny_run)))
    assert rc == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("ditforge train: error: --resume") and "step-0000003" in line
    assert "\n" not in line


def test_resume_continues_the_saved_settings(tiny_run, tmp_path, one_thread):
    """Resuming with no other flags keeps the saved run's settings (batch 16, no grids, ...); flags override."""
    ckpt = tiny_run / "checkpoints" / "step-0000002"
    out = tmp_path / "resumed"
    assert cli.main(["train", "--resume", str(ckpt), "--outputs", str(out), "--max_steps", "3",
                     "--ckpt_every", "5"]) == 0
    saved = yaml.safe_load((tiny_run / "config.yaml").read_text())
    now = yaml.safe_load((out / "config.yaml").read_text())
    for section in saved:
        for key, value in saved[section].items():
            if key not in ("resume", "outputs", "ckpt_every"):
                assert now[section][key] == value, (section, key)
    assert now["train"]["ckpt_every"] == 5 and now["train"]["batch_size"] == 16
    # and the resumed step 3 is the original run's step 3
    assert read_metrics(out / "metrics.jsonl")[-1]["loss"] == pytest.approx(
        read_metrics(tiny_run / "metrics.jsonl")[2]["loss"], rel=1e-6)
    assert list((out / "samples").iterdir()) == []


@pytest.mark.parametrize("args,flag,prog", [(["--batch_size", "abc"], "--batch_size", "ditforge train"),
                                            (["--mixed_precision", "fp4"], "--mixed_precision", "ditforge train"),
                                            (["--plugin", "zero3"], "--plugin", "ditforge train"),
                                            (["--grad_reduce_dtype", "fp8"], "--grad_reduce_dtype", "ditforge train"),
                                            (["--no_such_flag"], "--no_such_flag", "ditforge")])
def test_argparse_errors(tiny_argv, tmp_path, capsys, args, flag, prog):
    with pytest.raises(SystemExit) as e:
        cli.main(tiny_argv(tmp_path / "run", *args))
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    # argparse's own format: usage lines, then "PROG: error: ..." (unknown flags are reported by the top parser)
    assert last.startswith(f"{prog}: error:") and flag in last and "Traceback" not in err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------
# Config files


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_config_file_then_flags(tmp_path, layout):
    settings = {"model": {"model": "DiT-T/4", "learn_sigma": False, "class_dropout_prob": 0.2},
                "data": {"data": "digits", "num_workers": 0},
                "train": {"batch_size": 8, "max_steps": 5, "lr": 0.002, "seed": 3, "ema_decay": 0.99,
                          "ckpt_every": 1000},
                "parallel": {"grad_accum_steps": 2, "async_checkpoint": True}}
    if layout == "flat":
        settings = {k: v for section in settings.values() for k, v in section.items()}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(settings))
    from ditforge.config.load import build_config

    run = tmp_path / "run"  # two of the file's settings overridden by flags
    rc = cli.main(["train", "--config", str(path), "--outputs", str(run), "--sample_every", "0", "--log_every", "1",
                   "--device", "cpu", "--max_steps", "2", "--seed", "5"])
    assert rc == 0
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["model"] == "DiT-T/4" and cfg["model"]["learn_sigma"] is False
    assert cfg["model"]["class_dropout_prob"] == 0.2
    assert cfg["train"]["batch_size"] == 8 and cfg["train"]["lr"] == 0.002 and cfg["train"]["ema_decay"] == 0.99
    assert cfg["train"]["max_steps"] == 2 and cfg["train"]["seed"] == 5  # flags beat the file
    assert cfg["data"]["num_workers"] == 0 and cfg["model"]["num_classes"] == 10  # resolved from the data
    assert cfg["parallel"]["grad_accum_steps"] == 2 and cfg["parallel"]["async_checkpoint"] is True
    assert cfg["parallel"]["plugin"] == "none"  # auto in one process
    # the settings took effect, not only the saved file
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and records[0]["lr"] == 0.002
    assert "vb" not in records[0]  # no learned sigma: L_simple only
    entries = SafeFileSystemReader(str(list_checkpoints(run)[-1])).read_metadata().state_dict_metadata
    assert entries["model.final_layer.linear.weight"].size[0] == 4 * 4 * 1  # patch 4, 1 channel, no sigma channels
    meta = json.loads((list_checkpoints(run)[-1] / "meta.json").read_text())
    assert meta["config"] == cfg
    # and build_config gives the same resolution without training
    direct = build_config(path, {"max_steps": 2, "seed": 5})
    assert direct.model.model == "DiT-T/4" and direct.train.max_steps == 2 and direct.train.lr == 0.002
    assert direct.parallel.grad_accum_steps == 2


def test_invalid_yaml_error_is_one_line(tiny_argv, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert cli.main(tiny_argv(tmp_path / "run", "--config", str(bad))) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and len(err.strip().splitlines()) == 1, err


def test_config_file_lr_in_exponent_notation(tmp_path):
    from ditforge.config.load import build_config
    from ditforge.errors import UserError

    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\n")
    try:
        cfg = build_config(path, {})
    except UserError:
        return  # a clear error is acceptable too
    assert cfg.train.lr == pytest.approx(1e-4)


def test_data_error_leaves_no_run_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["train", "--data", str(tmp_path / "nowhere"), "--image_size", "16", "--max_steps", "1"])
    assert rc == 2
    assert not (tmp_path / "outputs").exists()


def test_sigterm_saves_and_exits_130(tmp_path, subprocess_env):
    """A scheduler's SIGTERM is handled like Ctrl-C: the step in flight finishes, a checkpoint of exactly the
    completed steps is written, and the process exits with 130. The child runs with one thread
    (``subprocess_env``), like the other subprocess tests: with every core it oversubscribes a loaded CI machine."""
    import signal
    import time

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ditforge", "train", "--model", "DiT-T/8", "--max_steps", "100000", "--batch_size",
         "16", "--log_every", "1", "--sample_every", "0", "--device", "cpu", "--outputs", str(run)],
        env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    assert len(ckpts) == 1
    step = json.loads((ckpts[0] / "meta.json").read_text())["step"]
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert step >= logged[-1] >= 2  # every logged step is in the checkpoint; nothing half-done


def test_depth_trains_resumes_and_samples_the_cut_model(tiny_argv, tmp_path, one_thread):
    """``--depth 2`` builds the size's width and heads with 2 blocks; the checkpoint carries it, so the run
    resumes and samples from it without the flag, and a different ``--depth`` on its ``--init_from`` is one line."""
    from ditforge.sample.load import build_model, read_spec

    run = tmp_path / "run"
    assert cli.main(tiny_argv(run, "--model", "DiT-S/2", "--depth", "2", "--max_steps", "2")) == 0
    state, spec = read_spec(str(run), use_ema=True)
    model = build_model(str(run), state, spec, use_ema=True)
    assert len(model.blocks) == 2 and model.blocks[0].attn.qkv.in_features == 384  # DiT-S: width 384
    assert cli.main(["train", "--resume", str(run), "--max_steps", "3", "--outputs", str(tmp_path / "more")]) == 0
    assert cli.main(["sample", "--ckpt", str(tmp_path / "more"), "--num_samples", "2", "--num_sampling_steps", "2",
                     "--out", str(tmp_path / "grid.png")]) == 0
    assert cli.main(tiny_argv(tmp_path / "ft", "--init_from", str(run), "--depth", "3")) == 2
