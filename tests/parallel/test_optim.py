"""Optimizer modes (``ditforge.parallel.optim``) against independent references, after 5 steps of fresh random
gradients with weight decay:

  * fp32 moments over fp32 weights: ``torch.optim.AdamW`` (bit-exact: the same kernel);
  * 8-bit moments over fp32 weights: ``bitsandbytes.optim.AdamW8bit`` (bit-exact: the same kernel), and plain AdamW
    within the 8-bit codes' error;
  * Kahan-compensated bf16 weights: the fp32-master run of the same moments. Each step's split errs by at most
    2^-17 |w|: with 2^k <= |w| < 2^(k+1), p = bf16(w) leaves |w - p| <= 2^(k-8), and c = bf16(w - p) rounds that
    residual to within 2^(k-17); after 5 steps |p + c - w_ref| <= 6 * 2^-17 |w_ref|. bf16 weights without the
    compensation miss that bound by orders of magnitude (checked too, so the bound can fail);
  * a resumed optimizer (state dict round trip) equals an uninterrupted one, bit for bit, states in their dtypes;
  * through ``ditforge train``: resume equals an uninterrupted run in each mode; ``--ema_decay 0`` stores the
    weights as the EMA; one-line errors.
"""

from __future__ import annotations

import pytest
import torch

from ditforge.errors import UserError
from ditforge.parallel.optim import CompensatedAdamW, plan_placement

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [(300, 64), (10,), (128, 130), (7, 5)]  # two above bitsandbytes' 4,096-element 8-bit threshold, two below
LR, WD = 1e-5, 0.1
SPLIT = 2.0 ** -17


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def _params(dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16().to(device, dtype)) for s in SHAPES]


def _run(params, opt, seed, steps=5):
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:  # the same bf16-representable gradients for every dtype
            p.grad = torch.randn(p.shape, generator=g).bfloat16().to(p.device, p.dtype)
        opt.step()
    return params


def _master(params, opt):
    return [p.float() + opt.state[p]["compensation"].float() if p.dtype == torch.bfloat16 else p.detach()
            for p in params]


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()))


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_states_equal_torch_adamw(device):
    seed = _seed()
    a = _params(torch.float32, seed, device)
    b = _params(torch.float32, seed, device)
    _run(a, torch.optim.AdamW(a, lr=LR, weight_decay=WD, fused=device == "cuda"), seed)
    _run(b, CompensatedAdamW(b, lr=LR, weight_decay=WD), seed)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_8bit_states_equal_bitsandbytes_and_approximate_adamw(device):
    bnb = pytest.importorskip("bitsandbytes")
    seed = _seed()
    a, b, c = (_params(torch.float32, seed, device) for _ in range(3))
    lr = 1e-3  # large enough that the moments' codes, not the weights, dominate the difference
    _run(a, bnb.optim.AdamW8bit(a, lr=lr, weight_decay=WD), seed)
    opt = CompensatedAdamW(b, lr=lr, weight_decay=WD, states="8bit")
    _run(b, opt, seed)
    _run(c, torch.optim.AdamW(c, lr=lr, weight_decay=WD, fused=device == "cuda"), seed)
    assert opt.state[b[0]]["state1"].dtype == torch.uint8 and "exp_avg" in opt.state[b[1]]
    for x, y, z, before in zip(a, b, c, _params(torch.float32, seed, device)):
        if y.numel() >= 4096:  # 8-bit codes: bitsandbytes' own kernel, the same bits
            torch.testing.assert_close(y, x, rtol=0, atol=0)
            # the codes' error (a few % on each moment) moves 5 steps of AdamW by a fraction of their length
            assert torch.linalg.vector_norm(y - z) / torch.linalg.vector_norm(z - before) < 0.05, seed  # ~0.01
        else:  # fp32 moments below the threshold: torch's AdamW itself (bitsandbytes' 32-bit kernel rounds apart)
            torch.testing.assert_close(y, z, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("states", ["fp32", "8bit"])
def test_kahan_bf16_weights_track_the_fp32_master(states, device):
    if states == "8bit":
        pytest.importorskip("bitsandbytes")
    seed = _seed()
    ref = _params(torch.float32, seed, device)
    _run(ref, CompensatedAdamW(ref, lr=LR, weight_decay=WD, states=states), seed)
    half = _params(torch.bfloat16, seed, device)
    opt = CompensatedAdamW(half, lr=LR, weight_decay=WD, states=states, chunk_numel=20_000)  # several chunks
    _run(half, opt, seed)
    plain = _params(torch.bfloat16, seed, device)
    _run(plain, torch.optim.AdamW(plain, lr=LR, weight_decay=WD), seed)
    for w, r, p, start in zip(_master(half, opt), ref, plain, _params(torch.float32, seed, device)):
        assert w.dtype == torch.float32 and opt.state[half[0]]["compensation"].dtype == torch.bfloat16
        bound = 6 * SPLIT * r.abs() + 1e-30
        assert ((w - r).abs() <= bound).all(), (seed, ((w - r).abs() / r.abs()).max().item())
        assert not ((p.float() - r).abs() <= bound).all()  # no compensation: lr 1e-5 updates round away
        assert (r - start).abs().max() > 0  # the reference moved


@pytest.mark.parametrize("states", ["fp32", "8bit"])
def test_chunking_does_not_change_the_step(states):
    if states == "8bit":
        pytest.importorskip("bitsandbytes")
    seed = _seed()
    a, b = _params(torch.bfloat16, seed), _params(torch.bfloat16, seed)
    _run(a, CompensatedAdamW(a, lr=LR, weight_decay=WD, states=states, chunk_numel=1), seed)
    _run(b, CompensatedAdamW(b, lr=LR, weight_decay=WD, states=states, chunk_numel=10**9), seed)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


@pytest.mark.parametrize("states", ["fp32", "8bit"])
def test_state_dict_round_trip_resumes_exactly(states):
    if states == "8bit":
        pytest.importorskip("bitsandbytes")
    seed = _seed()
    a = _params(torch.bfloat16, seed)
    opt_a = CompensatedAdamW(a, lr=LR, weight_decay=WD, states=states)
    _run(a, opt_a, seed, steps=5)
    b = _params(torch.bfloat16, seed)
    opt_b = CompensatedAdamW(b, lr=LR, weight_decay=WD, states=states)
    _run(b, opt_b, seed, steps=3)
    saved = {k: v.clone() for k, v in zip(range(len(b)), b)}, opt_b.state_dict()
    c = [torch.nn.Parameter(saved[0][i].clone()) for i in range(len(b))]
    opt_c = CompensatedAdamW(c, lr=LR, weight_decay=WD, states=states)
    opt_c.load_state_dict(saved[1])
    for p, q in zip(b, c):
        for key, value in opt_b.state[p].items():
            if torch.is_tensor(value):
                assert opt_c.state[q][key].dtype == value.dtype, key  # torch would cast the moments to bf16
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(3):  # replay the first 3 steps' draws, then 2 more
        for p in c:
            torch.randn(p.shape, generator=g)
    for _ in range(2):
        for p in c:
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
        opt_c.step()
    for x, y in zip(a, c):
        torch.testing.assert_close(y, x, rtol=0, atol=0)
    for x, y in zip(_master(a, opt_a), _master(c, opt_c)):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("--optimizer", "adamw8bit"), ("--master_weights", "bf16", "--ema_decay", "0"),
                                  ("--optimizer", "adamw8bit", "--master_weights", "bf16")])
def test_train_resume_equals_uninterrupted(mode, train_run, ckpt_weights, tmp_path):
    """``ditforge train`` in each mode: 4 steps straight, and 2 + resume + 2, give the same weights and EMA."""
    if "adamw8bit" in mode:
        pytest.importorskip("bitsandbytes")
    from ditforge.train import checkpoint as ckpt_io
    from ditforge.train.logging import read_metrics

    extra = ("--mixed_precision", "bf16", *mode)
    a = train_run(tmp_path / "a", "--max_steps", "4", *extra)
    b = train_run(tmp_path / "b", "--max_steps", "2", *extra)
    train_run(b, "--max_steps", "4", "--resume", "auto", *extra)
    ra, rb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    for use_ema in (False, True):
        wa = ckpt_weights(ckpt_io.list_checkpoints(a)[-1], use_ema=use_ema)
        wb = ckpt_weights(ckpt_io.list_checkpoints(b)[-1], use_ema=use_ema)
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=0, msg=k)
    if "--ema_decay" in mode:  # no EMA: the weights are stored as the EMA
        w, e = (ckpt_weights(ckpt_io.list_checkpoints(a)[-1], use_ema=u) for u in (False, True))
        for k in w:
            torch.testing.assert_close(e[k], w[k], rtol=0, atol=0)


@pytest.mark.parametrize("argv,match", [
    (("--master_weights", "bf16", "--mixed_precision", "fp32"), "--master_weights bf16: needs --mixed_precision bf16"),
    (("--master_weights", "bf16", "--mixed_precision", "auto", "--device", "cpu"),
     "--master_weights bf16: needs bf16 compute"),
    (("--gpu_memory_budget", "8GB!"), "--gpu_memory_budget: expected a size such as 8GiB"),
    (("--gpu_memory_budget", "1MiB"), "need 1.06 GiB (state + 1 GiB for activations); give at least that"),
])
def test_bad_flags_one_line(argv, match, tiny_argv, tmp_path, capsys):
    from ditforge import cli

    assert cli.main(tiny_argv(tmp_path / "r", *argv)) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err


def test_plan_placement_bytes_and_order():
    """The fastest placement whose state fits with 1 GiB to spare: 16 / 10 / 8 bytes per trainable parameter
    (fp32 AdamW; 8-bit moments; those plus Kahan bf16 weights), +4 for an EMA, + the frozen bytes."""
    n, frozen, gib = 10**8, 3 * 10**8, 2**30

    def plan(budget, ema=True, flags=("adamw", "fp32"), bf16=True):
        return plan_placement(budget, n, frozen, ema, *flags, bf16)

    assert plan(20 * n + frozen + gib) == ("adamw", "fp32")
    assert plan(20 * n + frozen + gib - 1) == ("adamw8bit", "fp32")
    assert plan(14 * n + frozen + gib - 1) == ("adamw8bit", "bf16")
    assert plan(12 * n + frozen + gib) == ("adamw8bit", "bf16")
    assert plan(16 * n + frozen + gib, ema=False) == ("adamw", "fp32")
    with pytest.raises(UserError, match=r"need 2\.40 GiB .* give at least that; --ema_decay 0"):
        plan(12 * n + frozen + gib - 1)
    with pytest.raises(UserError, match="--master_weights fp32"):  # no bf16 weights without bf16 compute
        plan(14 * n + frozen + gib - 1, bf16=False)
    with pytest.raises(UserError, match="--optimizer adamw --master_weights fp32"):  # zero2 / fsdp: fp32 AdamW only
        plan_placement(20 * n + frozen + gib - 1, n, frozen, True, "adamw", "fp32", True, lowmem=False)
    # explicit choices are kept, or refused: never replaced
    assert plan(10**15, flags=("adamw8bit", "fp32")) == ("adamw8bit", "fp32")
    with pytest.raises(UserError, match="--optimizer adamw8bit --master_weights fp32"):
        plan(14 * n + frozen + gib - 1, flags=("adamw8bit", "fp32"))


@pytest.mark.parametrize("plugin", ["zero2", "fsdp"])
def test_sharded_plugins_refuse_compensated_adamw(plugin, tiny_argv, tmp_path, capsys, monkeypatch):
    """Under fully_shard the parameters are DTensors, which CompensatedAdamW's states and bitsandbytes' kernel do
    not take: refused in one line (the plugin several processes would resolve to, without spawning them)."""
    from ditforge import cli
    from ditforge.train import trainer

    monkeypatch.setattr(trainer, "resolve_plugin", lambda plugin_, world_size: plugin)
    assert cli.main(tiny_argv(tmp_path / "r", "--optimizer", "adamw8bit")) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"--optimizer adamw8bit --master_weights fp32: supported with --plugin none or ddp, got "
                        f"{plugin}") and len(err.splitlines()) == 1, err
