"""Optimizer states in host memory streamed through a device ring (``CompensatedAdamW(offload=True)``,
``ditforge.parallel.offload``) against the same fused step with the states resident on the device: the same
weights and states bit for bit, in every placement, after 5 steps of fresh random gradients, with a ring far
smaller than the state (so chunks reuse its regions), through ``step`` and through ``StepInBackward`` (whose
chunk order is learned after the first step and uploaded ahead), and across a state_dict round trip. On a
machine without CUDA the kernel runs under TRITON_INTERPRET=1 and the copies are synchronous; on a GPU the
same tests run the three streams."""

from __future__ import annotations

import pytest
import torch

from ditforge.parallel.optim import CompensatedAdamW, StepInBackward

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
    if MODES[mode][0] == "8bit":
        pytest.importorskip("bitsandbytes")
    seed, dtype = _seed(), MODES[mode][1]
    a, b = _params(dtype, seed), _params(dtype, seed)
    opt_a, opt_b = _optimizer(a, mode, False), _optimizer(b, mode, True)
    _steps(a, opt_a, seed, 0, 5)
    _steps(b, opt_b, seed, 0, 5)
    _assert_same(a, opt_a, b, opt_b)
    stream = opt_b._stream
    assert sum(opt_b._state_bytes(p) for p in b) > len(stream.ring)
    assert len(stream.previous) >= 4  # chunks
    host = [t for p in b for key, t in opt_b.state[p].items() if key != "step"]
    assert all(t.device.type == "cpu" and (DEV == "cpu" or t.is_pinned()) for t in host)


def test_offloaded_state_dict_resumes_exactly():
    pytest.importorskip("bitsandbytes")
    seed, mode = _seed(), "8bit_sr"
    a = _params(torch.bfloat16, seed)
    opt_a = _optimizer(a, mode, True)
    _steps(a, opt_a, seed, 0, 5)
    b = _params(torch.bfloat16, seed)
    opt_b = _optimizer(b, mode, True)
    _steps(b, opt_b, seed, 0, 3)
    saved = [p.detach().clone() for p in b], opt_b.state_dict()
    c = [torch.nn.Parameter(w) for w in saved[0]]
    opt_c = _optimizer(c, mode, True)
    opt_c.load_state_dict(saved[1])
    assert opt_c.state[c[0]]["state1"].device.type == "cpu"
    _steps(c, opt_c, seed, 3, 5)
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
