"""ops.flash4: FlashAttention-4 behind the attention seam.

On the CPU the library's two entry points (``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``) are
replaced by a float64 reference of their contract (out and the log-sum-exp (B, H, S); the gradients from out, dout and
lse), so what is ditforge's own is tested: the custom ops' autograd, their fake shapes under ``torch.compile``, and
that ``--grad_checkpoint attn`` keeps the forward's output instead of running the kernel again. On a Hopper or
Blackwell GPU with the wheel installed, the kernel itself against float32 attention.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from ditforge.ops import flash4


def _reference_forward(q, k, v, softmax_scale=None, return_lse=True):
    """FlashAttention's forward contract on (B, S, H, D): out in q's dtype, lse (B, H, S) float32."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * softmax_scale
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.double())
    return out.to(q.dtype), lse.float(), None, None, None


def _reference_backward(q, k, v, out, dout, lse, softmax_scale=None):
    """The backward from the saved out and lse alone (FlashAttention-2's algorithm 2: P = exp(S - L),
    D = rowsum(dO * O), dS = P (dP - D))."""
    qd, kd, vd, od, gd = (t.double() for t in (q, k, v, out, dout))
    p = torch.exp(torch.einsum("bqhd,bkhd->bhqk", qd, kd) * softmax_scale - lse.double()[..., None])
    dv = torch.einsum("bhqk,bqhd->bkhd", p, gd)
    dp = torch.einsum("bqhd,bkhd->bhqk", gd, vd)
    ds = p * (dp - (gd * od).sum(-1).transpose(1, 2)[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kd) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qd) * softmax_scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def reference_library(monkeypatch):
    """``flash_attn.cute.interface`` as the float64 reference, counting forward calls."""
    calls = {"forward": 0}

    def forward(*args, **kwargs):
        calls["forward"] += 1
        return _reference_forward(*args, **kwargs)

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = forward, _reference_backward
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    return calls


def _inputs(shape=(2, 24, 3, 16), dtype=torch.float64):
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    return [torch.randn(shape, generator=g, dtype=dtype).requires_grad_() for _ in range(4)]


def test_custom_ops_gradients_match_autograd(reference_library):
    """Out and dq, dk, dv through the ops (forward saved out + lse, backward from them) equal PyTorch's autograd of
    float64 SDPA, for a non-default scale: the output to 1e-10 (float64 throughout), the gradients to 1e-6 (they
    start from the float32 lse the contract keeps)."""
    q, k, v, dout = _inputs()
    out = flash4.flash4_attention(q, k, v, scale=0.3)
    out.backward(dout)
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in refs), scale=0.3).transpose(1, 2)
    ref.backward(dout)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for t, r in zip((q, k, v), refs):
        torch.testing.assert_close(t.grad, r.grad, atol=1e-6, rtol=1e-6)


def test_compiled_and_selectively_checkpointed(reference_library):
    """Under torch.compile (fullgraph: the ops' fake shapes) and under ``--grad_checkpoint attn`` the gradients are
    the eager ones, and the checkpointed backward does not call the kernel's forward again (its output is kept)."""
    from torch.utils.checkpoint import checkpoint

    from ditforge.parallel import _selective_context

    q, k, v, dout = _inputs(dtype=torch.float32)
    w = torch.randn(16, 16, dtype=torch.float32, requires_grad=True)

    def block(q, k, v):
        return flash4.flash4_attention(q @ w, k, v) @ w

    block(q, k, v).backward(dout)
    eager = [t.grad.clone() for t in (q, k, v, w)]
    for t in (q, k, v, w):
        t.grad = None
    torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v).backward(dout)
    for t, e in zip((q, k, v, w), eager):
        torch.testing.assert_close(t.grad, e, atol=1e-5, rtol=1e-5)
        t.grad = None
    before = reference_library["forward"]
    out = checkpoint(block, q, k, v, use_reentrant=False, context_fn=lambda: _selective_context("attn"))
    out.backward(dout)
    assert reference_library["forward"] == before + 1  # the forward's, not again in the backward
    for t, e in zip((q, k, v, w), eager):
        torch.testing.assert_close(t.grad, e, atol=1e-5, rtol=1e-5)


def test_choice_is_a_constant_of_the_compiled_graph(monkeypatch):
    """The device facts and the per-shape choice run at trace time (dynamo refuses to trace importlib and a timing
    loop), once per shape: a fullgraph compile takes them, and a second call measures nothing again."""
    measured = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flash4, "_measure", lambda *key: measured.append(key) or "fa4")
    monkeypatch.setattr(flash4, "_CHOICES", {})

    def f(x):
        major, _ = flash4._device_facts(0)
        kernel = flash4.fastest_exact_kernel(tuple(x.shape), x.dtype, 0, True, None)
        return x * major if kernel == "fa4" else x

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), 9 * x)
    assert measured == [((2, 3), torch.float32, 0, True, None)]


def test_unavailable_reasons():
    """What FlashAttention-4 cannot take is named, and the seam then runs SDPA (exact_attention equals it)."""
    q, k, v, _ = _inputs(dtype=torch.float32)
    assert flash4.fa4_unavailable(q, k, v) == "not a CUDA tensor"
    assert flash4.fa4_unavailable(q, k, v, mask=torch.ones(2, 24, dtype=torch.bool)) == "a mask"
    assert flash4.fa4_unavailable(q, k[:, :5], v[:, :5]) == "keys or values of another shape"
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(flash4.exact_attention(q, k, v, backends=("MATH",)), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)
                         and flash4.fa4_installed()),
                    reason="FlashAttention-4 runs on Hopper / Blackwell GPUs with the flash-attn-4 wheel installed")
def test_kernel_against_float32_attention():
    """The kernel's output and gradients against float32 SDPA: bf16 relative RMS error below 1e-2 (measured 2.3e-3
    at Wan's shape, ``benchmarks/kernel_speed.py exact-attention``); and the per-shape choice names a kernel."""
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash4.flash4_attention(*ins)
    out.backward(dout)
    refs = [t.float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in refs)).transpose(1, 2)
    ref.backward(dout.float())
    for a, b in zip([out, *(t.grad for t in ins)], [ref, *(t.grad for t in refs)]):
        assert ((a.float() - b).norm() / b.norm()).item() < 1e-2
    assert flash4.fastest_exact_kernel((2, 1000, 4, 128), torch.bfloat16, 0, True, None) in ("fa4", "sdpa")
