"""Fine-tuning a diffusers pipeline (``--init_from``) under torchrun equals one process: FSDP and ZeRO-2 (full
fine-tuning) and FSDP with LoRA on 2 gloo processes, a tiny SD pipeline on captioned images (the adapter's
repeated blocks are what ``fully_shard`` wraps); tiny Wan 2.1, HunyuanVideo and LTX-Video pipelines on the built-in
clips with their tokens split over the 2 processes (``--sequence_parallel_size 2``: context parallelism, Ulysses
over their heads, ``parallel.context``); a tiny Wan 2.2 A14B pipeline's two experts in one run under DDP.
Tolerances: ``dist_helpers``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_helpers import WEIGHT_ATOL, assert_same_losses
from ditforge.train.logging import read_metrics

pytestmark = pytest.mark.slow


def _tiny_pipelines():
    spec = importlib.util.spec_from_file_location("tiny_pipelines",
                                                  Path(__file__).parents[1] / "finetune" / "tiny_pipelines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from PIL import Image

    tiny = _tiny_pipelines()
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
# 2 latent frames of 4 x 4 latents in 2 x 2 patches: 8 tokens, 4 a process; lr 1e-3 moves the weights visibly
VIDEO = ("--data", "clips", "--num_frames", "5", "--frame_interval", "2", "--image_size", "32", "--batch_size",
         "2", "--max_steps", "3", "--ckpt_every", "1000", "--class_dropout_prob", "0", "--lr", "1e-3")


COG_FRAMES = ("--num_frames", "9")  # CogVideoX's VAE takes 8k + 1 frames: 3 latent frames of 2 x 2 patches


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    return _tiny_pipelines().make_wan(tmp_path_factory.mktemp("wan") / "pipe")


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory) -> Path:
    return _tiny_pipelines().make_hunyuan_video(tmp_path_factory.mktemp("hunyuan") / "pipe")


@pytest.fixture(scope="module")
def ltx(tmp_path_factory) -> Path:
    return _tiny_pipelines().make_ltx(tmp_path_factory.mktemp("ltx") / "pipe")


@pytest.fixture(scope="module")
def cogvideox(tmp_path_factory) -> Path:
    return _tiny_pipelines().make_cogvideox(tmp_path_factory.mktemp("cogvideox") / "pipe")


@pytest.fixture(scope="module")
def wan22(tmp_path_factory) -> Path:
    return _tiny_pipelines().make_wan22(tmp_path_factory.mktemp("wan22") / "pipe")


@pytest.fixture(scope="module")
def two_process_runs(setup, wan, hunyuan, ltx, cogvideox, wan22, tmp_path_factory):
    """The run folder of every case of ``CASES``, then of the Wan, HunyuanVideo, LTX-Video and CogVideoX runs with
    their tokens split (keys ``"wan_sp"``, ``"hunyuan_sp"``, ``"ltx_sp"``, ``"cogvideox_sp"``), of a DDP run of
    Wan 2.2 A14B's two experts (``"wan22_both"``), and the stderr of a
    Wan run whose token count 2 processes cannot halve (``"odd"``), all made by one launch of 2 processes that runs
    the command lines in turn (``torchrun_cli_many``)."""
    from dist_helpers import COMMON, torchrun_cli_many

    pipe, data = setup
    root = tmp_path_factory.mktemp("two")
    argvs = [(root / f"case{i}", _args(pipe, data, *extra, "--plugin", plugin)) for i, (plugin, extra) in
             enumerate(CASES)]
    argvs.append((root / "wan_sp", ["--init_from", str(wan), *VIDEO, "--sequence_parallel_size", "2"]))
    argvs.append((root / "hunyuan_sp", ["--init_from", str(hunyuan), *VIDEO, "--sequence_parallel_size", "2"]))
    argvs.append((root / "ltx_sp", ["--init_from", str(ltx), *VIDEO, "--sequence_parallel_size", "2"]))
    argvs.append((root / "cogvideox_sp", ["--init_from", str(cogvideox), *VIDEO, *COG_FRAMES,
                                          "--sequence_parallel_size", "2"]))
    argvs.append((root / "wan22_both", ["--init_from", str(wan22), *VIDEO, "--plugin", "ddp"]))
    # one latent frame of 3 x 3 tokens at 48 px: 9 tokens, which 2 processes cannot halve
    argvs.append((root / "odd", ["--init_from", str(wan), *VIDEO, "--num_frames", "1", "--image_size", "48",
                                 "--sequence_parallel_size", "2"]))
    err = torchrun_cli_many(2, root, [["train", *COMMON, "--outputs", str(out), *args] for out, args in argvs],
                            fails=(len(argvs) - 1,))
    names = [*CASES, "wan_sp", "hunyuan_sp", "ltx_sp", "cogvideox_sp", "wan22_both"]
    return dict(zip(names, [out for out, _ in argvs])) | {"odd": err[-1]}


def _assert_equal_runs(run: Path, ref: Path, steps: list[int]) -> dict[str, torch.Tensor]:
    """``run``'s losses and gradient norms of ``steps`` and its final weights equal the one-process run ``ref``'s
    (``dist_helpers``' tolerances); returns ``ref``'s weights."""
    assert_same_losses([{**r, "vb": 0} for r in read_metrics(run / "metrics.jsonl")],
                       [{**r, "vb": 0} for r in read_metrics(ref / "metrics.jsonl")], steps=steps)
    got, want = _weights(run), _weights(ref)
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= WEIGHT_ATOL, worst
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


def test_wan_with_its_tokens_split_equals_single_process(wan, two_process_runs, tmp_path):
    """Wan 2.1 full fine-tuning with ``--sequence_parallel_size 2`` (each process holds half of every clip's tokens;
    Ulysses attention; the gathered output's gradient scaled by 2 before ZeRO-2's average over both processes)
    equals one plain process: the losses and gradient norms of 3 steps and the weights after them (without the
    scaling the gradient norms differ). A clip of 9 tokens stops with one line naming the flag."""
    from dist_helpers import run_single

    ref = run_single(tmp_path / "ref", "--init_from", str(wan), *VIDEO)
    want = _assert_equal_runs(two_process_runs["wan_sp"], ref, [1, 2, 3])
    from diffusers import WanTransformer3DModel

    base = WanTransformer3DModel.from_pretrained(str(wan), subfolder="transformer").state_dict()
    moved = _moved(want, base, "transformer")
    assert moved > 20 * WEIGHT_ATOL, moved  # not vacuous: 3 Adam steps at lr 1e-3
    odd = [line for line in two_process_runs["odd"].splitlines() if "error:" in line]
    assert odd and "--sequence_parallel_size 2: a video of 9 tokens" in odd[0], two_process_runs["odd"][-2000:]


@pytest.mark.parametrize("family", ["hunyuan", "ltx", "cogvideox"])
def test_video_tokens_split_by_ditforges_plans_equal_single_process(family, hunyuan, ltx, cogvideox,
                                                                     two_process_runs, tmp_path):
    """Full fine-tuning with ``--sequence_parallel_size 2`` by ditforge's plans (``parallel.context``) equals one
    plain process: the losses and gradient norms of 3 steps and the weights after them.

    - HunyuanVideo: the 32 video tokens of each clip split, 16 a process, the 256 padded caption tokens on both; the
      joint attention's text gathered over the heads, its backward a reduce-scatter; the text padding masked.
    - LTX-Video (2 latent frames of 8 x 8: 128 packed tokens, 64 a process; Ulysses over its 4 heads): the masked
      caption whole on both processes, each cross-attention local.
    - CogVideoX (v-prediction DDPM; 9 frames: 3 latent frames of 2 x 2 patches, 12 tokens, 6 a process): the 226 caption
      tokens whole on both, first in each joint attention, whose SDPA call is caught (``intercept_sdpa``)."""
    import diffusers

    from dist_helpers import run_single

    folder = {"hunyuan": hunyuan, "ltx": ltx, "cogvideox": cogvideox}[family]
    frames = COG_FRAMES if family == "cogvideox" else ()
    ref = run_single(tmp_path / "ref", "--init_from", str(folder), *VIDEO, *frames)
    want = _assert_equal_runs(two_process_runs[f"{family}_sp"], ref, [1, 2, 3])
    model = {"hunyuan": diffusers.HunyuanVideoTransformer3DModel, "ltx": diffusers.LTXVideoTransformer3DModel,
             "cogvideox": diffusers.CogVideoXTransformer3DModel}[family]
    base = model.from_pretrained(str(folder), subfolder="transformer").state_dict()
    assert _moved(want, base, "transformer") > 20 * WEIGHT_ATOL


def test_two_experts_under_ddp_equal_single_process(wan22, two_process_runs, tmp_path):
    """Both experts of Wan 2.2 A14B in one run under DDP (one sample a process; each step's expert drawn from
    (seed, step) alike on both, the idle expert's parameters found unused, the frozen weights outside DDP) equals
    one plain process: the losses and gradient norms of 3 steps (the sides low, low, high) and both experts' weights
    after them; each expert moved."""
    import diffusers

    from dist_helpers import run_single

    ref = run_single(tmp_path / "ref", "--init_from", str(wan22), *VIDEO)
    want = _assert_equal_runs(two_process_runs["wan22_both"], ref, [1, 2, 3])
    base = diffusers.WanPipeline.from_pretrained(str(wan22), local_files_only=True)
    for name in ("transformer", "transformer_2"):
        moved = _moved({k: v for k, v in want.items() if k.startswith(f"{name}.")},
                       getattr(base, name).state_dict(), name)
        assert moved > 20 * WEIGHT_ATOL, (name, moved)
