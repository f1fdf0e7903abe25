"""``ditforge bench`` on the CPU: the table's arithmetic, skipped rows, the JSON, the max-batch search and
the FLOP count behind MFU (checked against PyTorch's own FLOP counter)."""

import itertools
import json
import math
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ditforge import cli
from ditforge.bench import find_max_batch
from ditforge.models import create_model
from ditforge.ops.attention import set_attention_backend

TINY = ["bench", "--model", "DiT-T/2", "--image_size", "64", "--batch_size", "2", "--steps", "2", "--warmup", "1",
        "--num_classes", "10", "--device", "cpu"]


def test_bench_table_and_json(tmp_path, monkeypatch, capsys):
    from ditforge.ops import triton

    monkeypatch.setattr(triton, "interpreting", lambda: False)  # no interpreter: the kernel row says why it is skipped
    assert cli.main([*TINY, "--rows", "abdfg", "--peak_tflops", "1", "--outputs", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    [path] = tmp_path.glob("bench-DiT-T-2-*.json")
    result = json.loads(path.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["a", "b", "d", "f", "g"]
    assert rows["d"]["status"] == "skipped" and "CUDA" in rows["d"]["reason"]
    assert rows["f"]["status"] == "skipped" and "one-pass optimizer" in rows["f"]["reason"]
    assert rows["g"]["status"] == "skipped" and "FP8" in rows["g"]["reason"]
    assert "skipped: Triton kernels need a CUDA GPU" in table and "| a | original DiT recipe" in table
    # 64 px / 8 = 8x8 latents, patch 2: 16 tokens; MFU against the given 1 TFLOP/s peak, 3x the forward
    flops = create_model("DiT-T/2", 8, 4, 10).flops_per_sample()
    for key in "ab":
        r = rows[key]
        assert r["status"] == "ok" and r["images_per_sec"] > 0
        assert r["tokens_per_sec"] == pytest.approx(16 * r["images_per_sec"])
        assert r["step_time_ms"] * r["images_per_sec"] == pytest.approx(2 * 1000)
        assert r["mfu"] == pytest.approx(3 * flops * r["images_per_sec"] / 1e12)
        assert r["peak_memory_gib"] is None  # not measured on the CPU
    assert rows["a"]["speedup"] == 1.0
    # same weights, data and noise in every row: fp32 and bf16 losses agree to bf16 accuracy, step by step
    assert len(rows["a"]["losses"]) == 3 and rows["b"]["losses"] == pytest.approx(rows["a"]["losses"], rel=0.05)
    assert rows["b"]["speedup"] == pytest.approx(rows["b"]["images_per_sec"] / rows["a"]["images_per_sec"])
    assert result["env"]["torch"] == torch.__version__ and result["config"]["batch_size"] == 2


@pytest.mark.slow
def test_bench_memory_rows(tmp_path, capsys, monkeypatch):
    """``--memory``: the same data and noise in every row, so the losses show what each mode changes: none for
    dropping the EMA (it never feeds back), none at the first step (before any update), little after. Cheaper
    here than as shipped, not otherwise: DiT-T is cut to 2 blocks of width 64 (the one-pass optimizer runs under
    Triton's interpreter, whose cost goes with the parameter count, 4.2M -> 0.2M), and the rows run eager
    (inductor compiled each row's model anew on the CPU, two thirds of the cost; that compiled training equals
    eager is ``test_compile.py``'s check)."""
    from ditforge import bench, models

    monkeypatch.setitem(models.DIT_SIZES, "T", (2, 64, 2))
    monkeypatch.setattr(bench, "MEMORY_BASE", replace(bench.MEMORY_BASE, compile=False))
    rows = "plain,noema,8bit,bf16,sr,fused"
    assert cli.main([*TINY, "--memory", "--memory_rows", rows, "--outputs", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    result = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    got = {r["row"]: r for r in result["rows"]}
    assert list(got) == rows.split(",") and all(r["status"] == "ok" for r in got.values())
    assert "| vs plain |" in table and got["plain"]["speedup"] == 1.0
    assert got["noema"]["losses"] == got["plain"]["losses"]
    for key in ("8bit", "bf16", "sr", "fused"):
        assert got[key]["losses"][0] == got["plain"]["losses"][0]
        assert got[key]["losses"] == pytest.approx(got["plain"]["losses"], rel=0.02)


@pytest.mark.parametrize("model,size,frames", [("DiT-T/2", 8, None), ("DiT-S/4", 16, None), ("vDiT-T/222", 8, 4),
                                               ("vDiT-T/124", 8, 3)])
def test_flops_per_sample_equals_pytorch_flop_counter(model, size, frames):
    """The forward FLOPs behind MFU equal what PyTorch's FlopCounterMode counts (matrix products,
    convolution and attention; a multiply-add is 2). The math attention backend runs attention as two
    batched matrix products, which the counter sees (it has no formula for the fused CPU kernel)."""
    net = create_model(model, size, 4, 10, num_frames=frames)
    x = torch.randn(3, 4, *([frames] if frames else []), size, size)
    t, y = torch.randint(0, 1000, (3,)), torch.randint(0, 10, (3,))
    try:
        set_attention_backend("math")
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            net(x, t, y)
    finally:
        set_attention_backend()
    assert counter.get_total_flops() == 3 * net.flops_per_sample()


def test_find_max_batch_equals_brute_force():
    for true_max, start, limit in itertools.product(range(0, 41), (1, 3, 8, 64), (40, 50)):
        calls = []

        def fits(b):
            calls.append(b)
            assert 1 <= b <= limit
            return b <= true_max

        assert find_max_batch(fits, start, limit) == min(true_max, limit)
        assert len(calls) <= 2 * limit.bit_length() + 2  # doubling then bisection, not a linear scan


@pytest.mark.parametrize("args,message", [
    (["--rows", "abz"], "--rows: expected letters of 'abcdefg'"),
    (["--image_size", "60"], "--image_size 60 is not divisible by --vae_downsample 8"),
    (["--model", "DiT-Q/2"], "--model: unknown model"),
    (["--grad_checkpoint", "sometimes"], "--grad_checkpoint: expected one of"),
    (["--steps", "0"], "--steps: expected a positive integer"),
    (["--find_max_batch", "--rows", "a"], "--find_max_batch: needs a CUDA device"),
    (["--memory", "--memory_rows", "plain,bogus"], "--memory_rows: expected names of plain,noema"),
    (["--memory", "--gpu_memory_budget", "lots"], "--gpu_memory_budget: expected a size such as 8GiB"),
    (["--rows", "bg", "--fp8_recipe", "rowwise_with_gw_hp"], "--fp8_recipe rowwise_with_gw_hp: needs row e"),
    (["--rows", "bce", "--fp8_recipe", "rowwise"], "--fp8_recipe rowwise: needs row g (FP8) in --rows"),
])
def test_bench_bad_settings_are_one_line_errors(tmp_path, capsys, args, message):
    assert cli.main([*TINY, "--outputs", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ditforge bench: error: ") and message in err[-1]


def test_fp8_training_on_cpu_says_what_it_needs(tiny_argv, tmp_path, capsys):
    assert cli.main(tiny_argv(tmp_path / "run", "--mixed_precision", "fp8")) == 2
    assert "--mixed_precision fp8: needs a CUDA GPU with FP8 tensor cores" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--fp8_recipe", "rowwise"], "--fp8_recipe rowwise: needs --mixed_precision fp8"),
    (["--mixed_precision", "fp8", "--fp8_recipe", "rowwise_with_gw_hp"],
     "--fp8_recipe rowwise_with_gw_hp: needs --compile"),
])
def test_fp8_recipe_misuse_is_a_one_line_error(tiny_argv, tmp_path, capsys, args, message):
    assert cli.main(tiny_argv(tmp_path / "run", *args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not (tmp_path / "run").exists()


def test_train_refuses_a_video_model_on_image_data(tiny_argv, tmp_path, capsys):
    assert cli.main(tiny_argv(tmp_path / "run", "--model", "vDiT-T/122")) == 2
    assert "--model vDiT-T/122 is a video model; --data digits holds images" in capsys.readouterr().err


def test_kernel_flags_without_triton_runtime_are_one_line_errors(tiny_argv, tmp_path, capsys, monkeypatch):
    """On a CPU without Triton's interpreter the kernel flags fail at start, naming the flag."""
    from ditforge.ops import triton

    monkeypatch.setattr(triton, "interpreting", lambda: False)
    assert cli.main(tiny_argv(tmp_path / "run", "--enable_modulate_kernel")) == 2
    assert "--enable_modulate_kernel: Triton kernels need a CUDA GPU" in capsys.readouterr().err


def test_bench_text_conditioning_counts_the_caption_tokens(tmp_path):
    """--text_dim trains the cross-attention model on synthetic caption states; MFU counts its FLOPs (the
    FlopCounter test of text models lives with the models' tests), and the losses are those of train_step."""
    args = [*TINY, "--rows", "a", "--text_dim", "24", "--text_tokens", "5", "--peak_tflops", "1",
            "--outputs", str(tmp_path)]
    assert cli.main(args) == 0
    [path] = tmp_path.glob("bench-DiT-T-2-*.json")
    [row] = json.loads(path.read_text())["rows"]
    flops = create_model("DiT-T/2", 8, 4, 10, text_dim=24).flops_per_sample(text_tokens=5)
    assert flops > create_model("DiT-T/2", 8, 4, 10).flops_per_sample()
    assert row["status"] == "ok" and row["mfu"] == pytest.approx(3 * flops * row["images_per_sec"] / 1e12)
    assert all(math.isfinite(v) for v in row["losses"])
    assert cli.main([*TINY, "--text_dim", "-1", "--outputs", str(tmp_path)]) == 2


def test_bench_anchor_column(tmp_path, capsys):
    """--anchor runs the script in a subprocess with $OUT set and reads its JSON: each row's ratio to it."""
    script = tmp_path / "anchor.py"
    script.write_text("import json, os, sys\n"
                      "assert sys.argv[1:] == ['2', 'bf16_compile_ema'], sys.argv\n"
                      "json.dump({'bf16_compile_ema': {'img_s': 0.5}}, "
                      "open(os.path.join(os.environ['OUT'], 'plain_anchor_bs2.json'), 'w'))\n")
    assert cli.main([*TINY, "--rows", "a", "--steps", "1", "--warmup", "0", "--anchor", str(script),
                     "--outputs", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    [path] = tmp_path.glob("bench-DiT-T-2-*.json")
    result = json.loads(path.read_text())
    row = result["rows"][0]
    assert result["anchor_images_per_sec"] == 0.5
    assert row["vs_anchor"] == pytest.approx(row["images_per_sec"] / 0.5)
    assert "vs anchor |" in table and f"{row['vs_anchor']:.2f}x |" in table
    script.write_text("import sys\nsys.exit('no GPU here')\n")
    assert cli.main([*TINY, "--rows", "a", "--anchor", str(script), "--outputs", str(tmp_path)]) == 2
    assert "--anchor" in capsys.readouterr().err


def test_rows_whose_state_alone_exceeds_the_gpu_are_skipped_before_building(monkeypatch):
    """A 4e9-parameter model on a 64 GiB GPU, hand-computed: fp32 weights + gradients + AdamW moments + EMA are
    20 bytes a parameter, 74.5 GiB (too big); bf16 weights, 8-bit moments, the step in the backward and no EMA
    are 2 + 2 = 4 bytes, 14.9 GiB (fits; over an 8 GiB budget only in a capped row)."""
    from types import SimpleNamespace

    from ditforge.bench import MEMORY_BASE, state_too_big
    from ditforge.config.sections import BenchConfig

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=64 * 2**30))
    cfg, cuda, params = BenchConfig(gpu_memory_budget="8GiB"), torch.device("cuda"), 4 * 10**9
    assert state_too_big(cfg, MEMORY_BASE, cuda, params) == (
        "out of memory: 4.00B parameters' training state needs 74.5 GiB > 64.0 GiB")
    small = replace(MEMORY_BASE, optimizer="adamw8bit", master_weights="bf16_sr", fused_backward_pass=True, ema=False)
    assert state_too_big(cfg, small, cuda, params) is None
    assert "needs 14.9 GiB > 8.0 GiB" in state_too_big(cfg, replace(small, budget=True), cuda, params)
    assert state_too_big(cfg, MEMORY_BASE, torch.device("cpu"), params) is None  # no GPU: nothing to check
