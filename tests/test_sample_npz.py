"""Evaluation-scale sampling: ``ditforge sample --save_npz FILE`` without ``--out``.

The model is a tiny class DiT-T/2 (8x8, 1 channel, 10 classes) with fresh random weights, exported with
``export_safetensors``. References: ``generate`` called directly on one sample with its documented seed, and the
single-process run, which a 2-process gloo run under torchrun, other batch sizes and a resumed run must match
bit for bit (uint8; one thread per process, so batched matmuls round alike).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from ditforge import cli, sample
from ditforge.data.images import to_uint8
from ditforge.data.sampler import derive_seed
from ditforge.diffusion import generate
from ditforge.sample import loops
from ditforge.models import create_model
from ditforge.export import export_safetensors

pytestmark = pytest.mark.usefixtures("one_thread")

N, SEED = 10, 5
ARGS = ["--num_samples", str(N), "--num_sampling_steps", "3", "--device", "cpu", "--seed", str(SEED)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = create_model("DiT-T/2", 8, 1, 10, True, 0.1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.05)  # DiT zero-initialises its output and adaLN layers: the model would do nothing
    path = tmp_path_factory.mktemp("npz") / "c.safetensors"
    config = {"model": dict(model="DiT-T/2", condition="class", vae="none", num_classes=10, learn_sigma=True,
                            class_dropout_prob=0.1, in_channels=1, input_size=8)}
    export_safetensors(model.state_dict(), config, path)
    return path


def _run(ckpt, npz, *extra):
    return cli.main(["sample", "--ckpt", str(ckpt), *ARGS, "--save_npz", str(npz), *extra])


def _read(npz):
    with np.load(npz) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def reference(ckpt, tmp_path_factory, one_thread_module):
    """The single-process run in batches of 4."""
    npz = tmp_path_factory.mktemp("ref") / "ref.npz"
    assert _run(ckpt, npz, "--batch_size", "4") == 0
    return npz, _read(npz)


def test_layout_and_per_sample_seeds(ckpt, reference):
    npz, ref = reference
    assert sorted(ref) == ["arr_0", "arr_1"]  # the ADM evaluator reads arr_0; guided-diffusion writes labels as arr_1
    images, labels = ref["arr_0"], ref["arr_1"]
    assert images.dtype == np.uint8 and images.shape == (N, 8, 8, 3)
    assert labels.dtype == np.int64 and labels.tolist() == [i % 10 for i in range(N)]
    assert (images == images[..., :1]).all()  # grey repeated to RGB
    assert len({im.tobytes() for im in images}) == N
    assert list(npz.parent.iterdir()) == [npz]  # the parts folder is gone, no temporary file is left
    # sample 7 alone, from generate() with its documented seed and label
    model, spec = sample.load_model(str(ckpt))
    x = generate(model, torch.tensor([7]), (1, 8, 8), cfg_scale=4.0, num_steps=3, learn_sigma=True,
                 seeds=[derive_seed(SEED, 7)], clip_denoised=True)
    assert np.array_equal(to_uint8(x)[0].repeat(3, axis=-1), images[7])


def test_two_processes_write_the_same_samples(ckpt, reference, tmp_path, subprocess_env):
    npz = tmp_path / "two.npz"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "ditforge",
           "sample", "--ckpt", str(ckpt), *ARGS, "--batch_size", "3", "--save_npz", str(npz)]
    p = subprocess.run(cmd, env=subprocess_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    got = _read(npz)
    assert np.array_equal(got["arr_0"], reference[1]["arr_0"])
    assert np.array_equal(got["arr_1"], reference[1]["arr_1"])
    assert "10 of 10 samples to draw on 2 process(es)" in p.stderr


def test_interrupted_run_resumes(ckpt, reference, tmp_path, monkeypatch, capsys):
    npz, parts = tmp_path / "s.npz", tmp_path / "s.npz.parts"
    save, calls = loops.save_npz, []

    def ctrl_c_after_one_part(path, **arrays):
        calls.append(path)
        if len(calls) > 1:
            raise KeyboardInterrupt
        save(path, **arrays)

    monkeypatch.setattr(loops, "save_npz", ctrl_c_after_one_part)
    assert _run(ckpt, npz, "--batch_size", "4") == 130
    monkeypatch.setattr(loops, "save_npz", save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz.parts"]
    assert sorted(p.name for p in parts.iterdir()) == ["part-0000000.npz", "settings.json"]

    # other settings: refused, naming the folder and what changed
    assert _run(ckpt, npz, "--batch_size", "4", "--cfg_scale", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"ditforge sample: error: --save_npz {npz}: {parts} holds") and "cfg_scale" in err

    # the re-run, in batches of 5, draws samples 4..9 only and gives the uninterrupted run's file
    drawn = []
    real = loops.generate_samples
    monkeypatch.setattr(loops, "generate_samples", lambda *a, **k: drawn.append(k["seeds"]) or real(*a, **k))
    assert _run(ckpt, npz, "--batch_size", "5") == 0
    assert drawn == [[derive_seed(SEED, i) for i in range(4, 9)], [derive_seed(SEED, 9)]]
    got = _read(npz)
    assert np.array_equal(got["arr_0"], reference[1]["arr_0"]) and np.array_equal(got["arr_1"], reference[1]["arr_1"])
    assert not parts.exists()


def test_refused_with_sample_splitting_parallelism(ckpt, tmp_path, capsys):
    assert _run(ckpt, tmp_path / "s.npz", "--cfg_parallel") == 2
    assert capsys.readouterr().err.strip().startswith("ditforge sample: error: --cfg_parallel/--sequence_parallel")
