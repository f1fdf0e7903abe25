"""Sequence packing (``--pack_tokens``) against per-sample references.

* ``plan_packing``: first-fit decreasing worked by hand; every sample once, no row over capacity.
* ``patchify``: the patch embedding's convolution equals a matrix product on its rows; ``unpatchify`` inverts it.
* Packed attention equals each sample's own SDPA in float64 to 1e-10: dense, outputs and gradients; FlexAttention,
  outputs (its CPU path has no backward). On a GPU also the CUDA kernels (compiled FlexAttention, flash varlen)
  in bf16, outputs and gradients, against float32 SDPA to bf16 accuracy (skipped without CUDA).
* Packed DiT / vDiT (images and videos together) / text DiT forward equals each sample's own forward (float64).
* A packed training step's loss and gradients equal the unpacked step's (fp32, 1e-6), same samples, noise and
  timesteps, with learned sigma (the VLB term) and with rectified flow.
* Bad flag combinations: one-line UserErrors naming the flag.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ditforge.config.load import build_config
from ditforge.data.packing import pack, packed_training_losses, packing_setup, patchify, plan_packing
from ditforge.diffusion.flow import RectifiedFlow
from ditforge.diffusion.gaussian import create_diffusion
from ditforge.errors import UserError
from ditforge.models import DiT, STDiT, VideoDiT
from ditforge.models.layers import unpatchify
from ditforge.ops.attention import packed_attention, set_packed_attention_backend

pytestmark = pytest.mark.usefixtures("one_thread_module")

TINY = dict(in_channels=4, hidden_size=64, depth=2, num_heads=4, num_classes=10)


def _randomise_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights ~ N(0, 1/fan_in), vectors N(0, 0.1^2) (adaLN-Zero would make outputs trivial); sin-cos kept."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("pos_embed"):
                std = 1.0 / math.sqrt(p[0].numel()) if p.dim() >= 2 else 0.1
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
    return model


def _pack(shapes, patch, capacity, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    pieces = [patchify(x, patch) for x in xs]
    plan = plan_packing([len(p[0]) for p in pieces], capacity)
    return xs, torch.cat([p[0] for p in pieces]), pack([p[1] for p in pieces], capacity, plan, [p[2] for p in pieces])


def test_first_fit_decreasing_by_hand():
    assert plan_packing([5, 4, 3, 3, 2, 2, 1], 10) == [[0, 1, 6], [2, 3, 4, 5]]
    assert plan_packing([2, 7, 7, 3], 10) == [[1, 3], [2, 0]]  # ties: lower index first
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 50, (200,), generator=gen).tolist()
    plan = plan_packing(lengths, 64)
    assert sorted(i for row in plan for i in row) == list(range(200))
    assert all(sum(lengths[i] for i in row) <= 64 for row in plan) and plan == plan_packing(lengths, 64)
    assert len(plan) <= math.ceil(11 / 9 * sum(lengths) / 64) + 1  # FFD's bound against the optimum (Johnson 1973)
    with pytest.raises(ValueError, match="70 tokens does not fit a packed row of 64"):
        plan_packing([3, 70], 64)


@pytest.mark.parametrize("shape,patch", [((3, 6, 10), (2, 2)), ((3, 4, 6, 8), (2, 2, 2)), ((3, 3, 4, 4), (1, 2, 2)),
                                         ((3, 1, 4, 6), (2, 2, 2))])
def test_patchify_is_the_patch_embedding_and_unpatchify_inverts_it(shape, patch):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    rows, grid, repeated = patchify(x, patch)
    assert repeated == (shape[1] == 1 and len(patch) == 3)
    full = x.expand(-1, 2, -1, -1) if repeated else x
    conv = (F.conv2d if len(patch) == 2 else F.conv3d)
    w = torch.randn(5, shape[0], *patch, generator=gen, dtype=torch.float64)
    expected = conv(full[None], w, stride=patch).flatten(2)[0].T  # (n, 5), row-major grid
    torch.testing.assert_close(rows.flatten(1) @ w.flatten(1).T, expected, rtol=1e-12, atol=1e-12)
    back = unpatchify(rows.transpose(1, 2).reshape(1, len(rows), -1), grid, patch, shape[0])[0]
    assert torch.equal(back, full)


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_packed_attention_equals_per_sample_attention(backend):
    lengths, capacity, heads, dh = [5, 17, 3, 9, 12, 1], 24, 2, 8
    plan = plan_packing(lengths, capacity)
    packed = pack([(n,) for n in lengths], capacity, plan)  # 1-D "grids": the layout only needs token counts
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lengths), heads, dh, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))

    def to_rows(a):  # (M, H, Dh) sample by sample -> (R, H, L, Dh), padding random (it must not leak)
        out = torch.randn(packed.rows * capacity, heads, dh, generator=gen, dtype=torch.float64)
        return out.index_copy(0, packed.index, a).view(packed.rows, capacity, heads, dh).transpose(1, 2)

    grad_out = torch.randn(sum(lengths), heads, dh, generator=gen, dtype=torch.float64)
    set_packed_attention_backend(backend)
    try:
        with torch.set_grad_enabled(backend == "dense"):  # FlexAttention on the CPU: forward only
            out = packed_attention(to_rows(q), to_rows(k), to_rows(v), packed)
    finally:
        set_packed_attention_backend("auto")
    out = out.transpose(1, 2).reshape(-1, heads, dh)[packed.index]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ref = torch.cat([F.scaled_dot_product_attention(*(a[s:e].transpose(0, 1)[None] for a in (q, k, v)))[0]
                     .transpose(0, 1) for s, e in zip(starts, starts[1:])])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    if backend == "dense":
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        refs = torch.autograd.grad(ref, (q, k, v), grad_out)
        for g, r in zip(grads, refs):
            assert r.abs().max() > 1e-3
            torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash varlen and compiled FlexAttention kernels need CUDA")
@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_cuda_packed_attention_equals_per_sample_attention(backend):
    """The GPU kernels in bf16 against each sample's own SDPA in float32 from the same bf16 inputs, outputs and
    gradients, to bf16 accuracy: twice the largest errors measured on an H100 (outputs 3.9e-3 where they average
    0.13; gradients 7.8e-3, one bf16 step at their largest values), so a query that saw another sample's keys
    fails."""
    lengths, capacity, heads, dh = [50, 170, 30, 90, 120, 10], 256, 4, 64
    plan = plan_packing(lengths, capacity)
    packed = pack([(n,) for n in lengths], capacity, plan, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(sum(lengths), heads, dh, generator=gen, device="cuda").bfloat16().requires_grad_()
               for _ in range(3))
    grad_out = torch.randn(sum(lengths), heads, dh, generator=gen, device="cuda").bfloat16()

    def to_rows(a):
        out = torch.randn(packed.rows * capacity, heads, dh, generator=gen, device="cuda").bfloat16()
        return out.index_copy(0, packed.index, a).view(packed.rows, capacity, heads, dh).transpose(1, 2)

    set_packed_attention_backend(backend)
    try:
        out = packed_attention(to_rows(q), to_rows(k), to_rows(v), packed)
    finally:
        set_packed_attention_backend("auto")
    out = out.transpose(1, 2).reshape(-1, heads, dh)[packed.index]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ref = torch.cat([F.scaled_dot_product_attention(*(a[s:e].float().transpose(0, 1)[None] for a in (q, k, v)))[0]
                     .transpose(0, 1) for s, e in zip(starts, starts[1:])])
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=8e-3)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    refs = torch.autograd.grad(ref, (q, k, v), grad_out.float())
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g.float(), r.float(), rtol=0, atol=1.6e-2)


@pytest.mark.parametrize("kind", ["dit", "vdit", "text"])
def test_packed_forward_equals_per_sample_forward(kind):
    if kind == "vdit":
        model = VideoDiT(input_size=8, num_frames=4, patch_size=(2, 2, 2), **TINY)
        shapes = [(4, 1, 8, 8), (4, 4, 8, 8), (4, 2, 6, 4), (4, 1, 4, 4), (4, 6, 4, 8)]
    else:
        model = DiT(input_size=8, patch_size=2, text_dim=12 if kind == "text" else None, **TINY)
        shapes = [(4, 8, 8), (4, 6, 10), (4, 4, 4), (4, 12, 8), (4, 2, 2)]
    model = _randomise_(model.double().eval(), 3)
    xs, rows, packed = _pack(shapes, model.x_embedder.patch_shape, 56, 4)
    gen = torch.Generator().manual_seed(5)
    t = torch.randint(0, 1000, (len(xs),), generator=gen)
    if kind == "text":
        y = torch.randn(len(xs), 7, 12, generator=gen, dtype=torch.float64)
        cond = dict(y=y, y_mask=torch.arange(7) < torch.tensor([7, 3, 5, 1, 6])[:, None])
    else:
        cond = dict(y=torch.randint(0, 11, (len(xs),), generator=gen))
    with torch.no_grad():
        out = model(rows, t, packed=packed, **cond)
        ref = [model(x[None], t[i:i + 1], **{k: v[i:i + 1] for k, v in cond.items()})[0] for i, x in enumerate(xs)]
    expected = torch.cat([patchify(r, model.x_embedder.patch_shape)[0] for r in ref])
    assert out.shape == expected.shape and expected.abs().max() > 0.1
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("objective", ["ddpm_learned_sigma", "flow"])
def test_packed_loss_and_gradients_equal_unpacked(objective):
    model = _randomise_(VideoDiT(input_size=8, num_frames=4, patch_size=(2, 2, 2), learn_sigma=objective != "flow",
                                 **TINY), 6)
    diffusion = create_diffusion(None, True) if objective != "flow" else RectifiedFlow(1.0, "logit_normal", 0, 1, False)
    shapes = [(4, 4, 8, 8), (4, 1, 8, 8), (4, 2, 4, 8), (4, 1, 6, 6), (4, 4, 8, 8)]
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(s, generator=gen) for s in shapes]
    noise = [torch.randn(s, generator=gen) for s in shapes]
    t = diffusion.sample_timesteps(len(xs), gen, torch.device("cpu"))
    t[0] = 0  # DDPM's decoder likelihood term at t = 0
    y = torch.randint(0, 11, (len(xs),), generator=gen)
    drop = torch.tensor([False, True, False, False, True])

    def unpacked():
        terms = [diffusion.training_losses(lambda xt, tt: model(xt, tt, y[i:i + 1], force_drop_ids=drop[i:i + 1]),
                                           x[None], t[i:i + 1], noise[i][None]) for i, x in enumerate(xs)]
        return {k: torch.cat([term[k] for term in terms]) for k in terms[0]}

    def packed():
        return packed_training_losses(diffusion, lambda xt, tt, **p: model(xt, tt, y, force_drop_ids=drop, **p),
                                      xs, t, noise, 128, model.x_embedder.patch_shape)

    results = []
    for fn in (unpacked, packed):
        model.zero_grad()
        terms = fn()
        terms["loss"].float().mean().backward()
        results.append((terms, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (ref, ref_grads), (got, grads) = results
    assert set(got) == set(ref) and ("vb" in got) == (objective != "flow")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6 * max(1.0, r.abs().max().item()))


def test_bad_combinations_are_one_line_errors():
    base = dict(model="DiT-T/2", pack_tokens=64, device="cpu")
    for extra, flag in [(dict(sequence_parallel_size=2), "--sequence_parallel_size"),
                        (dict(model="STDiT-T/2", num_frames=4), "--model STDiT-T/2"),
                        (dict(enable_modulate_kernel=True), "--enable_modulate_kernel")]:
        with pytest.raises(UserError, match=flag) as e:
            build_config(None, base | extra)
        assert "--pack_tokens" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="--pack_tokens: expected an integer >= 0"):
        build_config(None, base | dict(pack_tokens=-1))
    dit = DiT(input_size=8, patch_size=2, **TINY)
    assert packing_setup(dit, 16, (4, 8, 8)) == (16, (2, 2))
    with pytest.raises(UserError, match="--pack_tokens 15: a sample of shape .4, 8, 8. has 16 tokens"):
        packing_setup(dit, 15, (4, 8, 8))
    with pytest.raises(UserError, match="STDiT does not take packed sequences"):
        packing_setup(STDiT(input_size=8, num_frames=2, patch_size=2, **TINY), 64, (4, 2, 8, 8))


def test_packed_train_step_equals_unpacked_step():
    """``train_step`` with ``packing`` (the trainer's --pack_tokens path) against without: the same loss (fp32,
    1e-6) and the same weights after one SGD step (lr 1: the weights move by the clipped gradient; Adam's
    normalised update would magnify float noise in near-zero gradients), on DDPM with learned sigma."""
    from ditforge.parallel.mesh import Dist
    from ditforge.train.randomness import StepRandomness
    from ditforge.train.step import train_step

    gen = torch.Generator().manual_seed(8)
    micro = [(torch.randn(6, 4, 8, 8, generator=gen), {"y": torch.randint(0, 10, (6,), generator=gen)},
              StepRandomness(torch.randn(6, 4, 8, 8, generator=gen), torch.randint(0, 1000, (6,), generator=gen),
                             torch.rand(6, generator=gen) < 0.3, torch.zeros(6, dtype=torch.bool)))]
    runs = []
    for packing in (None, (40, (2, 2))):
        model = _randomise_(DiT(input_size=8, patch_size=2, **TINY), 9)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        out = train_step(model, create_diffusion(None, True), opt, None, micro, torch.float32, 1.0, Dist(),
                         packing=packing)
        runs.append((out, model.state_dict()))
    (ref, ref_state), (got, state) = runs
    for k in ("loss", "mse", "vb", "grad_norm"):
        torch.testing.assert_close(got[k].double(), ref[k].double(), rtol=1e-6, atol=0)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_pack_tokens_trains(tmp_path):
    """``ditforge train --pack_tokens``: a short run on the digits trains and checkpoints (the wiring)."""
    from ditforge import cli
    from tests.conftest import tiny_train_argv

    assert cli.main(tiny_train_argv(tmp_path / "run", "--max_steps", "2", "--pack_tokens", "64",
                                    "--batch_size", "4")) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("loss") == 2
