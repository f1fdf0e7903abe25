"""Optimizer states in host memory streamed through a device ring (``CompensatedAdamW(offload=True)``,
``ditforge.parallel.offload``) against the same fused step with the states resident on the device: the same
weights and states bit for bit, in every placement, after 3 steps of fresh random gradients (the first learns
the chunk order, the next two stream by it), with a ring far smaller than the state (so chunks reuse its regions),
through ``step`` and through ``StepInBackward`` (whose chunk order is learned after the first step and uploaded
ahead), and across a state_dict round trip. Few steps on purpose: without CUDA every step runs the kernel under
Triton's interpreter. On a
machine without CUDA the kernel runs under TRITON_INTERPRET=1 and the copies are synchronous; on a GPU the
same tests run the three streams."""

from __future__ import annotations

import pytest
import torch

from ditforge.optim.backward import StepInBackward
from ditforge.optim.compensated import CompensatedAdamW

pytestmark = pytest.mark.usefixtures("one_thread")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(64, 64), (10,), (4096,), (32, 128), (2048, 2), (16, 256), (7, 5), (4, 1024), (128, 32), (1, 4096),
          (8, 512), (4096, 1)]  # ten of 4,096 elements (8-bit codes), two small ones (fp32 moments)
MODES = {"fp32": ("fp32", torch.float32, "kahan"), "8bit_kahan": ("8bit", torch.bfloat16, "kahan"),
         "8bit_sr": ("8bit", torch.bfloat16, "stochastic"), "fp32_kahan": ("fp32", torch.bfloat16, "kahan")}
RING = 64 * 1024  # bytes (at least 4x the largest tensor's state): every mode's state is larger than the ring


def _seed():
    return int(torch.randint(0, 2**30, ()))


def _params(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEV, dtype)) for s in SHAPES]


def _optimizer(params, mode, offload):
    states, _, rounding = MODES[mode]
    return CompensatedAdamW(params, lr=1e-3, weight_decay=0.1, states=states, rounding=rounding, fused=True,
                            offload=offload, ring_bytes=RING)


def _resident_and_offloaded(mode):
    """A fresh seed and two equal parameter sets, one with a resident optimizer, one with an offloaded one."""
    if MODES[mode][0] == "8bit":
        pytest.importorskip("bitsandbytes")
    seed, dtype = _seed(), MODES[mode][1]
    a, b = _params(dtype, seed), _params(dtype, seed)
    return seed, a, _optimizer(a, mode, False), b, _optimizer(b, mode, True)


def _steps(params, opt, seed, first, last):
    for k in range(first, last):
        g = torch.Generator().manual_seed(seed + 1 + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(DEV, p.dtype)
        opt.clip_coef = torch.tensor(0.5 + 0.1 * k, device=DEV)
        opt.step()


def _assert_same(a, opt_a, b, opt_b):
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    assert state_a.keys() == state_b.keys() and state_a
    for i in state_a:
        assert state_a[i].keys() == state_b[i].keys()
        for key in state_a[i]:
            torch.testing.assert_close(state_b[i][key].to(DEV), state_a[i][key].to(DEV), rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("mode", list(MODES))
def test_offloaded_step_equals_the_resident_one(mode):
    seed, a, opt_a, b, opt_b = _resident_and_offloaded(mode)
    _steps(a, opt_a, seed, 0, 3)
    _steps(b, opt_b, seed, 0, 3)
    _assert_same(a, opt_a, b, opt_b)
    stream = opt_b._stream
    assert sum(opt_b._state_bytes(p) for p in b) > len(stream.ring)
    assert len(stream.previous) >= 4  # chunks
    host = [t for p in b for key, t in opt_b.state[p].items() if key != "step"]
    assert all(t.device.type == "cpu" and (DEV == "cpu" or t.is_pinned()) for t in host)


@pytest.mark.parametrize("mode", ["fp32_kahan", "8bit_sr"])
def test_keeping_part_of_the_states_on_the_device_changes_nothing(mode):
    """Measured placement (``keep_on_device``) after 1 offloaded step: the first parameters' states, up to the
    bytes given, move to the device and step in place, the rest keep streaming (fewer chunks); 2 more steps equal
    the resident run bit for bit, and so does a state_dict round trip of the mixed placement (1 step), and then
    moving every state (the ring is freed; 1 step)."""
    seed, a, opt_a, b, opt_b = _resident_and_offloaded(mode)
    _steps(a, opt_a, seed, 0, 3)
    _steps(b, opt_b, seed, 0, 1)
    chunks = len(opt_b._stream.previous or opt_b._stream.order)
    budget = sum(opt_b._state_bytes(p) for p in b[:5]) + 100  # the first five, not the sixth
    assert opt_b.keep_on_device(budget) == budget - 100
    _steps(b, opt_b, seed, 1, 3)
    _assert_same(a, opt_a, b, opt_b)
    assert [p in opt_b._resident for p in b] == [True] * 5 + [False] * (len(b) - 5)
    for i, p in enumerate(b):  # (on a GPU: the device, else pinned host memory)
        devices = {t.device.type for key, t in opt_b.state[p].items() if key != "step"}
        assert devices == {DEV if i < 5 else "cpu"}, (i, devices)
    assert len(opt_b._stream.order) < chunks  # fewer chunks pass through the ring
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    opt_c = _optimizer(c, mode, True)
    opt_c.load_state_dict(opt_b.state_dict())  # a resume: all states on the host again, streamed
    _steps(a, opt_a, seed, 3, 4)
    _steps(c, opt_c, seed, 3, 4)
    _assert_same(a, opt_a, c, opt_c)
    assert opt_c.keep_on_device(sum(opt_c._state_bytes(p) for p in c)) > 0  # room for all: the ring goes
    assert opt_c._stream is None and all(p in opt_c._resident for p in c)
    _steps(a, opt_a, seed, 4, 5)
    _steps(c, opt_c, seed, 4, 5)
    _assert_same(a, opt_a, c, opt_c)


def test_offloaded_state_dict_resumes_exactly():
    pytest.importorskip("bitsandbytes")
    seed, mode = _seed(), "8bit_sr"
    a = _params(torch.bfloat16, seed)
    opt_a = _optimizer(a, mode, True)
    _steps(a, opt_a, seed, 0, 3)
    b = _params(torch.bfloat16, seed)
    opt_b = _optimizer(b, mode, True)
    _steps(b, opt_b, seed, 0, 2)
    saved = [p.detach().clone() for p in b], opt_b.state_dict()
    c = [torch.nn.Parameter(w) for w in saved[0]]
    opt_c = _optimizer(c, mode, True)
    opt_c.load_state_dict(saved[1])
    assert opt_c.state[c[0]]["state1"].device.type == "cpu"
    _steps(c, opt_c, seed, 2, 3)
    _assert_same(a, opt_a, c, opt_c)


class _Blocks(torch.nn.Module):
    """A stack of residual MLP blocks (``blocks``, as ``block_paths`` finds them) and a head outside them."""

    def __init__(self, width=64, depth=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width))
            for _ in range(depth))
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_step_in_backward_offloaded_equals_resident():
    """The blocks step during the backward (bf16 weights, stochastic rounding, fp32 moments, clipping by the
    previous norm): step 0's chunk order is learned, and steps 1-2 upload the next chunks while one is stepped."""
    seed = _seed()
    runs = []
    for offload in (False, True):
        torch.manual_seed(seed)
        model = _Blocks().to(DEV, torch.bfloat16)
        opt = CompensatedAdamW(list(model.parameters()), lr=1e-3, rounding="stochastic", fused=True,
                               offload=offload, ring_bytes=RING)
        stepper = StepInBackward(model, opt, max_grad_norm=0.5)
        for step in range(3):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed + step)).to(DEV, torch.bfloat16)
            stepper.arm()
            model(x).float().square().mean().backward()
            stepper.finish()
        runs.append((list(model.parameters()), opt))
    stream = runs[1][1]._stream
    assert len(stream.order) >= 8 and stream.previous == stream.order  # chunks; the order held: uploads went ahead
    _assert_same(*runs[0], *runs[1])


# ---- --cpu_offload all --delayed_update: DelayedAdamW ----

def _adamw64(w: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, b1=0.9, b2=0.999, eps=1e-8):
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2, with Adam's bias corrections; torch.optim.AdamW's form) in
    float64 from ``w`` over ``grads`` in turn: the weights after each update."""
    m = v = torch.zeros_like(w)
    out = []
    for k, g in enumerate(grads, start=1):
        w = w * (1 - lr * wd)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1**k)) / ((v / (1 - b2**k)).sqrt() + eps)
        out.append(w)
    return out


def test_delayed_update_is_a_one_step_lag():
    """ZeRO-Offload's delayed update by hand, on loss = sum(w^2) / 2 (gradient g = w) from random w0: the forward
    of step 1 and of step 2 both see w0 (step 2's gradient is stale), step 3 sees w1 = AdamW(w0; g = w0), and the
    weights published after step 3 are AdamW(w0; g = w0, w0) -- where the ordinary step gives AdamW(w0; w0, w1).
    fp32 against the float64 closed form, to 1e-6 (a few fp32 roundings of values ~1)."""
    from ditforge.parallel.offload import DelayedAdamW

    torch.manual_seed(_seed())
    w0 = torch.randn(6, dtype=torch.float64)
    lr, wd = 0.2, 0.1
    p = torch.nn.Parameter(w0.float())
    opt = DelayedAdamW([p], lr=lr, weight_decay=wd)
    seen = []  # the weights each forward used
    for _ in range(3):
        seen.append(p.detach().double().clone())
        p.grad = p.detach().clone()  # d/dw of sum(w^2) / 2, at the weights of this forward
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.wait()
    published = p.detach().double().clone()
    w1 = _adamw64(w0, [w0], lr, wd)[0]
    delayed = _adamw64(w0, [w0, w0], lr, wd)[1]
    torch.testing.assert_close(seen[0], w0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(seen[1], w0, rtol=1e-6, atol=1e-6)  # the update of step 1 is not yet published
    torch.testing.assert_close(seen[2], w1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(published, delayed, rtol=1e-6, atol=1e-6)
    ordinary = _adamw64(w0, [w0, w1], lr, wd)[1]
    assert (delayed - ordinary).abs().max() > 100 * 1e-6  # the lag is far above the tolerance
    torch.testing.assert_close(opt.state[p]["master"].double(), _adamw64(w0, [w0, w0, w1], lr, wd)[2],
                               rtol=1e-6, atol=1e-6)  # step 3's update (of gradient w1) in flight, not published


def test_delayed_update_resumes_exactly():
    """A state_dict round trip mid-run (with a step in flight) continues bit for bit as the uninterrupted run, and
    the delayed step's arithmetic is torch.optim.AdamW(fused=True)'s (one step from the same state: equal)."""
    from ditforge.parallel.offload import DelayedAdamW

    seed = _seed()
    grads = [[torch.randn(s, generator=torch.Generator().manual_seed(seed + k)) for s in SHAPES[:4]]
             for k in range(4)]

    def run(params, opt, steps):
        for gs in steps:
            for p, g in zip(params, gs):
                p.grad = g + 0.1 * p.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def fresh():
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(seed))) for s in SHAPES[:4]]
        return params, DelayedAdamW(params, lr=1e-2, weight_decay=0.1)

    ref_p, ref_o = fresh()
    run(ref_p, ref_o, grads)
    ref_o.wait()
    a_p, a_o = fresh()
    run(a_p, a_o, grads[:2])
    saved = a_o.state_dict()
    weights = [p.detach().clone() for p in a_p]
    b_p, b_o = fresh()
    with torch.no_grad():
        for p, w in zip(b_p, weights):
            p.copy_(w)
    b_o.load_state_dict(saved)
    run(b_p, b_o, grads[2:])
    b_o.wait()
    for p, q in zip(b_p, ref_p):
        assert torch.equal(p, q)
    for p, q in zip(b_p, ref_p):
        for key in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(b_o.state[p][key], ref_o.state[q][key]), key
    # the update in the thread is torch's fused AdamW: the master after one step from a copied state
    p = [torch.nn.Parameter(ref_o.state[q]["master"].clone()) for q in ref_p]
    plain = torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True)
    for q, r in zip(p, ref_p):
        plain.state[q] = {k: ref_o.state[r][k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
        q.grad = grads[0][0].new_ones(q.shape) * 0.3
    run(ref_p, ref_o, [[g.new_ones(g.shape) * 0.3 - 0.1 * r.detach() for g, r in zip(grads[0], ref_p)]])
    ref_o.wait()
    plain.step()
    for q, r in zip(p, ref_p):
        assert torch.equal(q.detach(), ref_o.state[r]["master"])


def test_delayed_update_is_fused_adamw_one_step_late():
    """With the clip factor folded in as ``grad_scale`` (varying) and one skipped step (``found_inf``), as the trainer
    sets them: the weights the delayed update publishes at step k+1 are torch.optim.AdamW(fused=True)'s after step k
    with the same gradients (fixed, so independent of the weights), bit for bit; a weight without a gradient at a
    step still gets its pending update published."""
    from ditforge.parallel.offload import DelayedAdamW

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES[:4]]
    ref_p = [torch.nn.Parameter(w.clone()) for w in init]
    del_p = [torch.nn.Parameter(w.clone()) for w in init]
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, fused=True)
    delayed = DelayedAdamW(del_p, lr=1e-2, weight_decay=0.1)
    history = [[w.clone() for w in init]]
    for k in range(6):
        grads = [torch.randn(s, generator=g) for s in SHAPES[:4]]
        scale = torch.tensor(1.0 + 2.0 * torch.rand((), generator=g).item())
        skip = torch.tensor(float(k == 3))
        for opt, params in ((ref, ref_p), (delayed, del_p)):
            for i, (p, grad) in enumerate(zip(params, grads)):
                p.grad = None if (k == 4 and i == 0) else grad.clone()  # weight 0 has no gradient at step 4
            opt.grad_scale, opt.found_inf = scale, skip
            opt.step()
            opt.grad_scale = opt.found_inf = None
            opt.zero_grad(set_to_none=True)
        for p, want in zip(del_p, history[-1]):
            assert torch.equal(p.detach(), want)
        history.append([p.detach().clone() for p in ref_p])
    assert all(torch.equal(a, b) for a, b in zip(history[3], history[4]))  # step 4 (k = 3) was skipped
    assert not any(torch.equal(a, b) for a, b in zip(history[2], history[3]))  # the others moved every weight
    delayed.wait()
