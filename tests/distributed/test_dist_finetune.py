"""Fine-tuning a diffusers pipeline (``--init_from``) under torchrun equals one process: FSDP and ZeRO-2 (full
fine-tuning) and FSDP with LoRA on 2 gloo processes, a tiny SD pipeline on captioned images (the adapter's
repeated blocks are what ``fully_shard`` wraps); the tiny pipeline of every text-to-video row of the fine-tuning
suite (``tests/finetune/families.VIDEO``: Wan 2.1, CogVideoX, LTX-Video, HunyuanVideo) on the built-in clips with
their tokens split over the 2 processes (``--sequence_parallel_size 2``: context parallelism, Ulysses over their
heads, ``parallel.context``); a tiny Wan 2.2 A14B pipeline's two experts in one run under DDP, FSDP2 and with their
tokens split, the FSDP2 run's checkpoint resumed in two processes and in one. Tolerances: ``dist_helpers``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_helpers import WEIGHT_ATOL, assert_same_losses, finetune_module
from ditforge.train.logging import read_metrics

pytestmark = pytest.mark.slow

ROWS = finetune_module("families").VIDEO  # one row a family: each family's tokens split below
FAMILIES = list(ROWS)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from PIL import Image

    tiny = finetune_module("tiny_pipelines")
    root = tmp_path_factory.mktemp("dist_finetune")
    pipe = tiny.make_sd(root / "sd")
    data = root / "images"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(tiny.CAPTIONS[i])
    return pipe, data


@pytest.fixture(scope="module")
def references(setup, tmp_path_factory):
    """``references(lora)``: the one-process run of ``_args`` (with LoRA or not), made on first use; the plain one
    is the reference of every full fine-tuning case (--cpu_offload all too: the offloaded run must equal it)."""
    from dist_helpers import run_single

    pipe, data = setup
    runs = {}

    def get(lora: bool) -> Path:
        if lora not in runs:
            runs[lora] = run_single(tmp_path_factory.mktemp("ref") / "run",
                                    *_args(pipe, data, *(("--lora_rank", "4") if lora else ())))
        return runs[lora]

    return get


def _args(pipe: Path, data: Path, *extra: str) -> list[str]:
    # COMMON of dist_helpers names --data digits; a later --data wins (argparse keeps the last)
    return ["--init_from", str(pipe), "--data", str(data), "--image_size", "32", "--batch_size", "4",
            "--max_steps", "5", "--ckpt_every", "1000", "--class_dropout_prob", "0.25", "--lr", "1e-4", *extra]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    state, config = load_weights(run, use_ema=False)
    _, denoiser, _ = load_finetuned(state, config, torch.device("cpu"), use_ema=False)
    return {k: v for k, v in denoiser.state_dict().items() if not k.startswith("null_")}


CASES = [("fsdp", ()), ("zero2", ()), ("fsdp", ("--lora_rank", "4")), ("fsdp", ("--cpu_offload", "all"))]
# Wan 2.2 A14B's two experts in one run (--expert both): data parallel, both sharded, their tokens split (zero2)
BOTH = {"wan22_both": ("--plugin", "ddp"), "wan22_both_fsdp": ("--plugin", "fsdp", "--ckpt_every", "2"),
        "wan22_both_sp": ("--sequence_parallel_size", "2")}
# Their weights' tolerance: Adam's first steps move an element of gradient g by lr g / (|g| + eps), so where g is
# near 0 a float32 rounding of it (the order of the processes' sums) moves the element by a fraction of lr (1e-3
# here): 6.5e-6 under DDP, 1.6e-5 under FSDP2, both largest in the low-noise expert's blocks.0.attn2.to_q. A wrong
# side or a stepped idle expert would be off by lr itself.
BOTH_ATOL = 4 * WEIGHT_ATOL
# 2 latent frames of 4 x 4 latents in 2 x 2 patches: 8 tokens, 4 a process; lr 1e-3 moves the weights visibly
VIDEO = ("--data", "clips", "--frame_interval", "2", "--image_size", "32", "--batch_size", "2", "--max_steps", "3",
         "--ckpt_every", "1000", "--class_dropout_prob", "0", "--lr", "1e-3")


def _video_args(family: str, folder: Path) -> list[str]:
    """The one-process run of ``family``'s tiny pipeline on the clips at 32 px: its row's frame count
    (``families.VIDEO``: 5, CogVideoX's VAE 8k + 1 = 9)."""
    return ["--init_from", str(folder), *VIDEO, "--num_frames", str(ROWS[family].frames)]


@pytest.fixture(scope="module")
def wan22(tmp_path_factory) -> Path:
    return finetune_module("tiny_pipelines").make_wan22(tmp_path_factory.mktemp("wan22") / "pipe")


@pytest.fixture(scope="module")
def two_process_runs(setup, video_folders, wan22, tmp_path_factory):
    """The run folder of every case of ``CASES``, then of every family's run with its tokens split (keyed by the
    family, ``FAMILIES``), of the runs of Wan 2.2 A14B's two experts (``BOTH``; ``"wan22_both_resumed"``: the
    FSDP2 one's step-2 checkpoint resumed to step 3), and the stderr of a Wan run whose token count 2 processes
    cannot halve (``"odd"``), all made by one launch of 2 processes that runs the command lines in turn
    (``torchrun_cli_many``)."""
    from dist_helpers import COMMON, torchrun_cli_many

    pipe, data = setup
    root = tmp_path_factory.mktemp("two")
    argvs = [(root / f"case{i}", _args(pipe, data, *extra, "--plugin", plugin)) for i, (plugin, extra) in
             enumerate(CASES)]
    argvs += [(root / family, [*_video_args(family, video_folders[family]), "--sequence_parallel_size", "2"])
              for family in FAMILIES]
    both = ["--init_from", str(wan22), *VIDEO, "--num_frames", "5"]
    argvs += [(root / name, [*both, *extra]) for name, extra in BOTH.items()]
    argvs.append((root / "wan22_both_resumed", [*both, "--plugin", "fsdp", "--resume",
                                                 str(root / "wan22_both_fsdp" / "checkpoints" / "step-0000002")]))
    # one latent frame of 3 x 3 tokens at 48 px: 9 tokens, which 2 processes cannot halve
    argvs.append((root / "odd", [*_video_args("wan", video_folders["wan"]), "--num_frames", "1", "--image_size",
                                 "48", "--sequence_parallel_size", "2"]))
    err = torchrun_cli_many(2, root, [["train", *COMMON, "--outputs", str(out), *args] for out, args in argvs],
                            fails=(len(argvs) - 1,))
    names = [*CASES, *FAMILIES, *BOTH, "wan22_both_resumed"]
    return dict(zip(names, [out for out, _ in argvs])) | {"odd": err[-1]}


def _assert_equal_runs(run: Path, ref: Path, steps: list[int], atol: float = WEIGHT_ATOL) -> dict[str, torch.Tensor]:
    """``run``'s losses and gradient norms of ``steps`` and its final weights equal the one-process run ``ref``'s
    (``dist_helpers``' tolerances; the weights' within ``atol``); returns ``ref``'s weights."""
    assert_same_losses([{**r, "vb": 0} for r in read_metrics(run / "metrics.jsonl")],
                       [{**r, "vb": 0} for r in read_metrics(ref / "metrics.jsonl")], steps=steps)
    got, want = _weights(run), _weights(ref)
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= atol, worst
    return want


def _moved(weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], component: str) -> float:
    """The largest change of a trained weight (named ``component.<diffusers key>``) from the folder's ``base``."""
    prefix = f"{component}."
    return max((weights[k] - base[k.removeprefix(prefix)]).abs().max().item() for k in weights
               if k.removeprefix(prefix) in base)


@pytest.mark.parametrize("plugin,extra", CASES)
def test_finetune_equals_single_process(setup, references, two_process_runs, plugin, extra):
    """The reference is one plain process (``references``)."""
    pipe, data = setup
    lora = "--lora_rank" in extra
    want = _assert_equal_runs(two_process_runs[(plugin, extra)], references(lora), [1, 2, 3, 4, 5])
    # not vacuous: 5 Adam steps at lr 1e-4 moved the trained weights ~50 times the tolerance
    from diffusers import UNet2DConditionModel

    base = UNet2DConditionModel.from_pretrained(str(pipe), subfolder="unet").state_dict()
    moved = _moved(want, base, "unet") if not lora else max(want[k].abs().max().item() for k in want
                                                             if "lora_B" in k)
    assert moved > 20 * WEIGHT_ATOL, moved


@pytest.mark.parametrize("family", FAMILIES)
def test_video_tokens_split_equals_single_process(family, video_folders, two_process_runs, tmp_path):
    """Full fine-tuning with ``--sequence_parallel_size 2`` (each process holds half of every clip's tokens; the
    gathered output's gradient scaled by 2 before ZeRO-2's average over both processes) equals one plain process:
    the losses and gradient norms of 3 steps and the weights after them (without the scaling the gradient norms
    differ), which moved over 20 times the tolerance from the folder's transformer (3 Adam steps at lr 1e-3).

    - Wan 2.1: diffusers' own plan (``_cp_plan``), Ulysses over its heads.
    - HunyuanVideo (ditforge's plans, ``parallel.context``): the 32 video tokens of each clip split, 16 a process,
      the 256 padded caption tokens on both; the joint attention's text gathered over the heads, its backward a
      reduce-scatter; the text padding masked.
    - LTX-Video (2 latent frames of 8 x 8: 128 packed tokens, 64 a process; Ulysses over its 4 heads): the masked
      caption whole on both processes, each cross-attention local.
    - CogVideoX (v-prediction DDPM; 9 frames: 3 latent frames of 2 x 2 patches, 12 tokens, 6 a process): the 226
      caption tokens whole on both, first in each joint attention, whose SDPA call is caught (``intercept_sdpa``)."""
    import diffusers

    from dist_helpers import run_single

    folder = video_folders[family]
    ref = run_single(tmp_path / "ref", *_video_args(family, folder))
    want = _assert_equal_runs(two_process_runs[family], ref, [1, 2, 3])
    model = getattr(diffusers, json.loads((folder / "model_index.json").read_text())["transformer"][1])
    base = model.from_pretrained(str(folder), subfolder="transformer").state_dict()
    moved = _moved(want, base, "transformer")
    assert moved > 20 * WEIGHT_ATOL, moved


def test_tokens_two_processes_cannot_halve_are_one_line(two_process_runs):
    """A Wan clip of 9 tokens (one latent frame of 3 x 3 at 48 px) under ``--sequence_parallel_size 2`` stops with
    one line naming the flag."""
    odd = [line for line in two_process_runs["odd"].splitlines() if "error:" in line]
    assert odd and "--sequence_parallel_size 2: a video of 9 tokens" in odd[0], two_process_runs["odd"][-2000:]


@pytest.fixture(scope="module")
def wan22_single(wan22, tmp_path_factory) -> Path:
    """The one-process run of both experts that every two-process run of them equals (``BOTH``)."""
    from dist_helpers import run_single

    return run_single(tmp_path_factory.mktemp("wan22_single") / "run", "--init_from", str(wan22), *VIDEO,
                      "--num_frames", "5")


@pytest.mark.parametrize("name", list(BOTH))
def test_two_experts_equal_single_process(name, wan22, wan22_single, two_process_runs):
    """Both experts of Wan 2.2 A14B in one run, in two processes, equal one plain process: the losses and gradient
    norms of 3 steps (the sides low, low, high) and both experts' weights after them; each expert moved. Each step's
    expert is drawn from (seed, step) alone, the same on both processes (were it not, the processes would pair
    different experts' collectives: a hang, or other gradients).

    - DDP (one sample a process): the idle expert's parameters found unused, the frozen weights outside DDP.
    - FSDP2 (one sample a process): both experts sharded, each one's blocks and the rest of it units of their own,
      gathered for that expert's steps alone (``parallel._apply_fsdp``).
    - ``--sequence_parallel_size 2`` (both samples on both processes, each one half of every clip's tokens; ZeRO-2
      over the one data-parallel process): both experts split (``parallel.context.apply_context_parallel``)."""
    import diffusers

    want = _assert_equal_runs(two_process_runs[name], wan22_single, [1, 2, 3], BOTH_ATOL)
    base = diffusers.WanPipeline.from_pretrained(str(wan22), local_files_only=True)
    for component in ("transformer", "transformer_2"):
        moved = _moved({k: v for k, v in want.items() if k.startswith(f"{component}.")},
                       getattr(base, component).state_dict(), component)
        assert moved > 20 * WEIGHT_ATOL, (component, moved)


def test_two_experts_fsdp_resume_exact_and_in_one_process(wan22, wan22_single, two_process_runs, tmp_path):
    """The two-expert FSDP2 run's step-2 checkpoint (the high-noise expert not yet stepped: no optimizer state of it
    in the distributed checkpoint) resumed in two processes to step 3 (a high-noise step) logs and saves the
    uninterrupted run's loss and weights exactly; resumed in one process (DCP reshards it) it equals the
    one-process run (``dist_helpers``' tolerances; the weights ``BOTH_ATOL``)."""
    from dist_helpers import run_single

    resumed, whole = two_process_runs["wan22_both_resumed"], two_process_runs["wan22_both_fsdp"]
    assert [r["loss"] for r in read_metrics(resumed / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(whole / "metrics.jsonl")][2:]
    got, want = _weights(resumed), _weights(whole)
    assert all(torch.equal(got[k], want[k]) for k in want)
    down = run_single(tmp_path / "down", "--init_from", str(wan22), *VIDEO, "--num_frames", "5", "--resume",
                      str(whole / "checkpoints" / "step-0000002"))
    _assert_equal_runs(down, wan22_single, [3], BOTH_ATOL)
