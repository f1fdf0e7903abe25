"""Shared fixtures for the trainer, data, CLI and sampling tests.

Nothing here is autouse: the model and diffusion tests are unaffected. Modules opt in with
``pytestmark = pytest.mark.usefixtures("one_thread")``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import pytest
import torch

# Triton decides when a kernel module is imported whether its kernels are compiled or interpreted: without a
# GPU the kernel tests (tests/kernels) run them under Triton's CPU interpreter, set before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny, fast settings shared by every training run in the tests (2 CPU cores, whole suite must stay fast).
TINY = ["--model", "DiT-T/2", "--data", "digits", "--batch_size", "16", "--num_workers", "0",
        "--sample_every", "0", "--log_every", "1", "--mixed_precision", "fp32", "--device", "cpu"]


def tiny_train_argv(outputs: Path | str, *extra: str) -> list[str]:
    """argv for ``ditforge train`` with the tiny settings; later flags override earlier ones."""
    return ["train", *TINY, "--outputs", str(outputs), *extra]


def pytest_configure(config):
    # DCP warns whenever it saves or loads without a process group, which is how one process does it on purpose;
    # ditforge.weights.read silences it, but pytest re-installs the warning filters for every test.
    config.addinivalue_line("filterwarnings", "ignore:torch.distributed is disabled:UserWarning")
    # A pytest-xdist worker (the README's `-n 2`) shares the cores with the other worker: one intra-op thread, so
    # that the two do not spin OpenMP threads against each other (see _single_thread).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


# The files that take longest on the 2-core CI machine, longest first: they go to the two pytest-xdist workers before
# any other file, so that the end of the run is many short files, which even the two workers out. Estimated from a
# fresh-clone CI run of 2026-12-08 (692 s; its --durations=80, each other test taken at 0.34 s, the mean that fills
# the two workers' 2 x 677 s): test_dist_nodes.py 103 s, test_chaos.py 101 s, test_text_to_video.py 94 s, the
# tensor-parallel test ~41 s (its references now trained once), test_dist_distill.py 48 s, test_sample.py and
# test_cli.py ~35 s each, then 20-35 s each. A simulation of xdist's loadgroup hand-out (a worker takes the next file
# when 2 of its tests are left) over those estimates ends the two workers within 2 s of each other in the old order
# and this one alike, but the old order handed test_sample.py (37 s, one test 17 s) out 48 s before the end, where
# an underestimate of the files after it idles a worker; now the last file over 15 s ends 41 s before it.
LONGEST = ("train/test_chaos.py", "test_text_to_video.py", "distributed/test_dist_nodes.py",
           "distributed/test_dist_tensor_parallel.py", "distributed/test_dist_distill.py", "test_sample.py",
           "test_cli.py", "distributed/test_dist_equality.py", "distributed/test_dist_finetune.py",
           "optim/test_optim.py", "train/test_trainer.py", "parallel/test_offload.py", "test_sample_fast.py",
           "train/test_guard.py")
# The files that read the fine-tuning runs of the session fixtures ``video_runs`` and ``i2v_runs``
# (tests/finetune/conftest.py): one pytest-xdist work unit, so that the runs are trained once, not once a worker.
SHARED_RUNS = ("finetune/test_video_families.py", "finetune/test_i2v_families.py", "finetune/test_wan.py",
               "finetune/test_hunyuan_video.py", "finetune/test_cogvideox.py", "finetune/test_export_comfyui.py",
               "finetune/test_distill_video.py")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(items):
    """``LONGEST`` first (in that order), then ``SHARED_RUNS``, then the other files holding a test marked
    ``slow``, in their collected order, the rest after them. Under pytest-xdist (``-n auto --dist loadgroup``,
    pyproject's addopts) a work unit is an ``xdist_group``, which is the test's file (its module fixtures made
    once), all of ``SHARED_RUNS`` one group; a worker takes one unit at a time, handed out in this order, so the
    long files overlap the many short ones instead of one of them running alone at the end
    (tests/test_text_to_video.py, then ~4 minutes, once did: 1,128 s for the suite, the last 286 s on one worker)."""
    here = Path(__file__).parent
    lead = {here / name: rank for rank, name in enumerate(LONGEST)}
    shared = {here / name for name in SHARED_RUNS}
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    for item in items:
        group = "shared_runs" if item.path in shared else item.path.relative_to(here).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
    # stable: the collected order within each group
    items.sort(key=lambda item: lead.get(item.path, len(LONGEST) + (item.path not in shared) +
                                         (item.path not in shared and item.path not in slow)))


@contextlib.contextmanager
def _single_thread():
    """One intra-op thread: on 2 shared cores, 2 OpenMP threads spin against other processes and are many
    times slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """One intra-op thread for a test (``_single_thread``)."""
    with _single_thread():
        yield


@pytest.fixture(scope="module")
def one_thread_module():
    """One intra-op thread for a whole module, its module-scoped fixtures included (``_single_thread``)."""
    with _single_thread():
        yield


@pytest.fixture
def fast_grid(monkeypatch):
    """An EMA sample grid (80 images, 100 DDPM steps with guidance) takes ~30 s for DiT-T/2 on one CPU core;
    in-process runs that ask for grids (``--sample_every N``) draw them with 2 steps instead (1 step cannot be
    respaced: see test_sample.py). Everything else about them (labels, file, size) is unchanged. The
    subprocess smoke test in test_cli.py draws a real one. Runs with ``--sample_every 0`` draw none."""
    from ditforge.train import previews

    monkeypatch.setattr(previews, "sample_grid", functools.partial(previews.sample_grid, num_steps=2))


@pytest.fixture
def train_run(one_thread):
    """Call ``ditforge.cli.main(['train', ...])`` in-process with the tiny settings; returns the run folder."""
    from ditforge import cli

    def run(outputs: Path, *extra: str) -> Path:
        rc = cli.main(tiny_train_argv(outputs, *extra))
        assert rc == 0
        return Path(outputs)

    return run


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """One finished 3-step DiT-T/2 run on digits (checkpoints at steps 2 and 3, no sample grids), shared
    read-only by tests that only inspect a run. Tests that change a run copy it first."""
    from ditforge import cli

    out = tmp_path_factory.mktemp("tiny_run") / "run"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = cli.main(tiny_train_argv(out, "--max_steps", "3", "--ckpt_every", "2", "--keep_last", "2",
                                      "--lr", "1e-3"))
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    return out


@pytest.fixture
def subprocess_env() -> dict:
    """Environment for ``python -m ditforge`` subprocesses: one thread, this checkout importable."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def plain_weights(ckpt: Path, use_ema: bool = True, model: str = "DiT-T/2", input_size: int = 8) -> dict:
    """A checkpoint's full EMA (or raw) weights in create_model's state-dict layout (digits: 1 channel, 10
    classes)."""
    from ditforge.models import create_model
    from ditforge.weights.read import read_checkpoint_weights

    return read_checkpoint_weights(ckpt, create_model(model, input_size, 1, 10).state_dict(), use_ema)


@pytest.fixture(scope="session")
def ckpt_weights():
    """The function ``plain_weights``."""
    return plain_weights


class _Built(Exception):
    pass


def budget_counts(monkeypatch, argv: list[str]) -> tuple[list, object]:
    """``ditforge train ARGV`` built up to its model: (the ``(trainable, frozen bytes)`` the resolution counted on
    the meta-device twin for ``--gpu_memory_budget``, one entry per count; the built run's model)."""
    from ditforge import cli
    from ditforge.train import resolve, trainer

    counted, seen, real = [], {}, resolve.state_counts

    def state_counts(model, half_base):
        counted.append(real(model, half_base))
        return counted[-1]

    def built(run):
        seen["model"] = run.model
        raise _Built

    monkeypatch.setattr(resolve, "state_counts", state_counts)
    monkeypatch.setattr(trainer, "build_ema_and_optimizer", built)
    with pytest.raises(_Built):
        cli.main(argv)
    return counted, seen["model"]


@pytest.fixture
def counted_budget(monkeypatch):
    """The function ``budget_counts``, with this test's ``monkeypatch``."""
    return functools.partial(budget_counts, monkeypatch)


@pytest.fixture(scope="session")
def tiny_argv():
    """The function ``tiny_train_argv`` (fixtures, not imports, so no module name can clash)."""
    return tiny_train_argv


def write_latent_shards(folder: Path, counts: list[int], seed: int = 0, prefix: str = "") -> list[str]:
    """A shard set as `ditforge extract-features --format wds` writes it for pixel-space digits (1 x 8 x 8 float16
    "latents", class labels), one shard per entry of ``counts``, random values; returns the sample keys in order."""
    import numpy as np

    from ditforge.data.shards.write import ShardWriter

    g = np.random.default_rng(seed)
    keys = []
    writer = ShardWriter(folder, shard_size=10**9)
    for shard, n in enumerate(counts):
        for i in range(n):
            keys.append(f"{prefix}s{shard}i{i}")
            writer.write({"__key__": keys[-1], "latent.npy": g.standard_normal((1, 8, 8)).astype(np.float16),
                          "cls": int(g.integers(10))})
        writer.finish_shard()
    writer.close({"kind": "latent", "condition": "class", "vae": "none", "text_encoder": None,
                  "text_max_length": None, "text_dim": None, "in_channels": 1, "input_size": 8, "num_frames": None,
                  "image_size": 8, "stochastic": False, "num_classes": 10, "class_captions": None,
                  "random_flip": False, "texts": None})
    return keys


@pytest.fixture
def latent_shards():
    """``write_latent_shards``, for tests in any folder."""
    return write_latent_shards
