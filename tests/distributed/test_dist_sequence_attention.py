"""Sequence-parallel attention (ditforge.parallel.sequence): ulysses, ring and fastseq_kv on 2 and 4 gloo
ranks, usp on 4 (2 x 2), spawned from this test (no torchrun); and FastSeq's input gather (``fastseq_attention``)
inside an Attention layer's projection, whose qkv weight and bias gradients, summed over the ranks, must equal
the whole sequence's.

Reference: the single-process float64 attention of the whole (padded) sequence with its key padding mask,
computed in each worker from the same random global q, k, v and upstream gradient, sliced to the rank's
contiguous shard (rank r holds positions [r * N_local, (r + 1) * N_local)). Each case pads a global length
that does not divide by the world size; one case leaves whole ranks holding only padding, one adds
per-sample key holes (text-style padding inside the sequence).

Tolerance (float32): max |got - ref| / max |ref| < 1e-5 on the output (valid query rows; padded rows must
only be finite) and on dq, dk, dv of the whole shard. The upstream gradient is zero on padded query rows, as
a masked loss makes it. float32 rounding of these sizes (Dh = 8, N <= 17) is ~1e-7 relative; a wrong block,
a lost mask or a missing gradient hop is O(1). bfloat16 runs are checked at 3e-2 (bf16 eps 7.8e-3).
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from dist_helpers import free_port, spawn

RTOL = 1e-5
RTOL_BF16 = 3e-2
B, H, DH = 2, 4, 8


def _cases(world: int) -> list[tuple[str, int, int, bool]]:
    """(name, global N, N_local, key holes) per world size; every N is padded to world * N_local."""
    pad_ranks = (3, 3) if world == 2 else (5, 3)  # rank 1 of 2 / ranks 2 and 3 of 4 hold only padding
    return [("uneven", 3 * world + 1, 4, False), ("pad-ranks", *pad_ranks, False),
            ("holes", 4 * world - 1, 4, True), ("no-mask", 3 * world, 3, False)]


def _attend(q, k, v, valid):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if valid is not None:
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _reference(q, k, v, valid, g):
    """float64 full-sequence attention with key mask; returns (out, dq, dk, dv)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = _attend(q, k, v, valid)
    out.backward(g.double())
    return out.detach(), q.grad, k.grad, v.grad


def _valid(case, world, gen) -> torch.Tensor:
    """(B, world * N_local) key mask of a case."""
    name, n, nl, holes = case
    total = world * nl
    valid = torch.arange(total)[None, :].expand(B, total) < n
    if holes:  # per-sample padding: sample 0 shorter (the last shard is padding for it alone, so blocks
        # without a valid key meet rows that have had none yet: lse -inf on both sides of a merge);
        # sample 1 has random padding keys inside the sequence too (first key kept)
        valid = valid.clone()
        valid[0, n - nl - 1 :] = False
        valid[1] &= torch.rand(total, generator=gen) > 0.4
        valid[1, 0] = True
    return valid


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _check(rank, world, seed, variant, group, case, dtype=torch.float32, heads=H, device="cpu", **kw) -> None:
    from ditforge.parallel.sequence import sequence_parallel_attention

    name, _, nl, _ = case
    total = world * nl
    gen = torch.Generator().manual_seed(seed)  # identical global tensors on every rank
    q, k, v, g = (torch.randn(B, heads, total, DH, generator=gen) for _ in range(4))
    valid = _valid(case, world, gen)
    g = g * valid[:, None, :, None]  # a masked loss sends no gradient into padded query rows
    use_mask = name != "no-mask"
    ref = _reference(q, k, v, valid if use_mask else None, g)

    sl = slice(rank * nl, (rank + 1) * nl)
    ql, kl, vl = (t[:, :, sl].to(device, dtype).requires_grad_() for t in (q, k, v))
    vloc = valid[:, sl].to(device) if use_mask else None
    out = sequence_parallel_attention(ql, kl, vl, vloc, group, variant, **kw)
    out.backward(g[:, :, sl].to(device, dtype))
    tag = f"{variant} world={world} case={name} dtype={dtype} seed={seed} rank={rank} {kw}"
    assert out.shape == ql.shape and out.dtype == dtype, tag
    assert torch.isfinite(out).all(), f"{tag}: non-finite output"
    rows = valid[:, sl][:, None, :, None]
    tol = RTOL if dtype == torch.float32 else RTOL_BF16
    errs = {"out": _rel(out.detach().cpu() * rows, ref[0][:, :, sl] * rows)}
    for key, got, want in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), ref[1:]):
        errs[key] = _rel(got.cpu(), want[:, :, sl])
    assert all(e < tol for e in errs.values()), f"{tag}: relative errors {errs} (tolerance {tol})"


def _check_input_gather(rank, world, seed, case, chunks=2, qk_norm=False, autocast=False) -> None:
    """``fastseq_attention`` with an Attention layer's projection: this rank's output and dx against the
    float64 whole sequence, and the qkv weight and bias gradients summed over the ranks against the whole's
    (``autocast``: float32 input and layer under bfloat16 autocast, the training set-up; x is gathered in
    bfloat16)."""
    import copy

    import torch.distributed as dist

    from ditforge.models.layers import Attention
    from ditforge.parallel.sequence import fastseq_attention

    name, _, nl, _ = case
    total = world * nl
    gen = torch.Generator().manual_seed(seed)
    layer = Attention(H * DH, H, qk_norm=qk_norm)
    with torch.no_grad():  # every parameter random (LayerNorm's ones and zeros would hide a mixed-up head)
        for prm in layer.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen) * (prm.shape[-1] ** -0.5 if prm.dim() > 1 else 0.5))
    x = torch.randn(B, total, H * DH, generator=gen)
    valid = _valid(case, world, gen)
    g = torch.randn(B, H, total, DH, generator=gen) * valid[:, None, :, None]
    use_mask = name != "no-mask"

    whole = copy.deepcopy(layer).double()
    xw = x.double().requires_grad_()
    ref = _attend(*whole.project(xw), valid if use_mask else None)
    ref.backward(g.double())

    sl = slice(rank * nl, (rank + 1) * nl)
    xl = x[:, sl].clone().requires_grad_()
    import ditforge.parallel.sequence.fastseq as fastseq_module

    gathered = []  # dtypes of the x all-gathers: under autocast the compute dtype (half the bytes of float32)
    real_gather = fastseq_module.all_gather_single

    def recording_gather(out, x, *args, **kwargs):
        gathered.append(x.dtype)
        return real_gather(out, x, *args, **kwargs)

    fastseq_module.all_gather_single = recording_gather
    try:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = fastseq_attention(xl, layer.project, H, valid[:, sl] if use_mask else None, None, chunks)
    finally:
        fastseq_module.all_gather_single = real_gather
    assert gathered == [torch.bfloat16 if autocast else torch.float32] * min(chunks, nl), gathered
    out.float().backward(g[:, :, sl])
    tag = f"fastseq world={world} case={name} chunks={chunks} qk_norm={qk_norm} {autocast=} seed={seed} rank={rank}"
    assert out.shape == (B, H, nl, DH) and torch.isfinite(out).all(), tag
    rows = valid[:, sl][:, None, :, None]
    errs = {"out": _rel(out.detach().float() * rows, ref.detach()[:, :, sl] * rows),
            "dx": _rel(xl.grad, xw.grad[:, sl])}
    want = {pname: prm.grad for pname, prm in whole.named_parameters()}
    for pname, prm in layer.named_parameters():
        if pname.startswith("proj."):  # the output projection is the caller's, after the attention
            continue
        grad = prm.grad.clone()
        dist.all_reduce(grad)  # each rank holds its head group's rows, from the whole sequence
        # k_norm's bias adds q.b to every key of a row alike, which softmax ignores: its gradient is 0 up to
        # rounding, so it is measured on the scale of k_norm's weight gradient
        scale = want["k_norm.weight"] if pname == "k_norm.bias" else want[pname]
        errs[pname] = ((grad.double() - want[pname]).abs().max() / scale.abs().max()).item()
    tol = RTOL_BF16 if autocast else RTOL
    assert all(e < tol for e in errs.values()), f"{tag}: relative errors {errs} (tolerance {tol})"


def _worker(rank: int, world: int, port: int, base_seed: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ditforge.parallel.sequence import fastseq_attention, sequence_parallel_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        seed = base_seed
        setups = [(variant, None) for variant in ("ulysses", "ring", "fastseq_kv")]
        if world == 4:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
            setups += [("usp", mesh), ("usp", (mesh.get_group("ulysses"), mesh.get_group("ring")))]
        for variant, group in setups:
            for case in _cases(world):
                seed += 1
                _check(rank, world, seed, variant, group, case)
            seed += 1
            _check(rank, world, seed, variant, group, _cases(world)[0], dtype=torch.bfloat16)
        # a 1-D DeviceMesh as the group; the K/V FastSeq gathered in 3 uneven head chunks
        mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
        for variant in ("ulysses", "ring", "fastseq_kv"):
            seed += 1
            _check(rank, world, seed, variant, mesh1, _cases(world)[2])
        _check(rank, world, seed + 1, "fastseq_kv", None, _cases(world)[0], fastseq_chunks=3)
        # ring and fastseq_kv take head counts that Ulysses cannot split
        _check(rank, world, seed + 2, "ring", None, _cases(world)[0], heads=3)
        _check(rank, world, seed + 3, "fastseq_kv", None, _cases(world)[0], heads=3)
        # FastSeq's input gather in 2 token chunks, in 1, in 3 uneven ones, with q/k norms
        for case in _cases(world):
            seed += 1
            _check_input_gather(rank, world, seed + 3, case)
        _check_input_gather(rank, world, seed + 4, _cases(world)[0], chunks=1)
        _check_input_gather(rank, world, seed + 5, _cases(world)[2], chunks=3, qk_norm=True)
        _check_input_gather(rank, world, seed + 6, _cases(world)[0], autocast=True)

        # heads not divisible by the Ulysses size: a clear error, raised before any communication
        x = torch.randn(B, 3, 4, DH)
        with pytest.raises(ValueError, match="--sequence_parallel_size"):
            sequence_parallel_attention(x, x, x, None, None, "ulysses")
        with pytest.raises(ValueError, match="--sequence_parallel_size"):
            fastseq_attention(x[:, 0], None, 3, None, None)
        if world == 4:
            with pytest.raises(ValueError, match="--sequence_parallel_size"):
                sequence_parallel_attention(x, x, x, None, mesh, "usp")
        with pytest.raises(ValueError, match="usp"):
            sequence_parallel_attention(x, x, x, None, None, "usp")  # usp needs two groups
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_attention_matches_single_process(world):
    base_seed = int.from_bytes(os.urandom(3), "little") * 1000  # fresh inputs every run (seed in messages)
    t0 = time.perf_counter()
    spawn(_worker, args=(world, free_port(), base_seed), nprocs=world)
    print(f"world {world}: {time.perf_counter() - t0:.1f} s (base seed {base_seed})")


def test_communication_formulas():
    """The byte counts of the table in docs/multi-gpu.md, against their derivations at N = 32k, D = 1152, bf16."""
    from ditforge.parallel.sequence import communication_bytes_per_layer as cb

    n, d = 32768, 1152
    nd = n * d * 2  # one full-sequence activation in bf16: 75,497,472 bytes
    assert cb("ulysses", n, d, 2) == nd * 4 // 4  # 4 all-to-alls of N D / 2, half of each leaves the rank
    assert cb("ulysses", n, d, 4) == nd * 4 * 3 // 16
    for p in (2, 4, 8):
        assert cb("ring", n, d, p) == cb("fastseq_kv", n, d, p) == 2 * nd * (p - 1) // p
        # the gather of x (1/P of it is the rank's own) and the output's all-to-all (N D / P, 1/P stays)
        assert cb("fastseq", n, d, p) == round(nd * (p - 1) / p + nd / p * (p - 1) / p)
        assert cb("usp", n, d, p, ulysses_size=p) == cb("ulysses", n, d, p)
        assert cb("usp", n, d, p, ulysses_size=1) == cb("ring", n, d, p)
    assert cb("usp", n, d, 4, ulysses_size=2) == nd // 4 * (4 * 1 // 2 + 2 * 1)
    assert cb("ring", n, d, 4, backward=True) == 2 * nd * 3 // 4 + 2 * n * d * 4
    assert cb("ulysses", n, d, 1) == cb("ring", n, d, 1) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused block kernels run on CUDA")
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_ring_blocks_match_float32_blocks(dtype, kernel):
    """The ring's fused block forward (out, lse) and backward (given the final out and lse) against the plain
    float32 block functions on the same half-precision inputs. q is a permuted view, as the projection gives it;
    the K/V block has another length. Each kernel where the ring would use it (cuDNN) or could (FlashAttention-2,
    Ampere or newer). Tolerance: 1e-2 of the largest value (outputs and gradients are rounded
    to 16 bits; bf16 eps 7.8e-3), 1e-3 absolute on the float32 lse."""
    from ditforge.ops.attention import cudnn_attention_preferred
    from ditforge.parallel.sequence.ring import block_backward, block_forward, fused_block_backward, fused_block_forward

    dev = torch.device("cuda", torch.cuda.current_device())
    if kernel == "cudnn" and not cudnn_attention_preferred(dev):
        pytest.skip("the ring uses cuDNN's attention only where PyTorch prefers it")
    if kernel == "flash" and torch.cuda.get_device_capability(dev) < (8, 0):
        pytest.skip("FlashAttention-2 needs Ampere or newer")

    g = torch.Generator("cuda").manual_seed(int.from_bytes(os.urandom(3), "little"))
    q = torch.randn(2, 300, 3, 16, 72, device="cuda", dtype=dtype, generator=g)[:, :, 0].transpose(1, 2)
    k, v = (torch.randn(2, 16, 184, 72, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn(2, 16, 300, 72, device="cuda", dtype=dtype, generator=g)
    scale = 72 ** -0.5
    out, lse, aux = fused_block_forward(kernel, q, k, v, scale)
    want_out, want_lse = block_forward(q, k, v, None, scale)
    assert lse.shape == want_lse.shape == (2, 16, 300)
    assert _rel(out, want_out) < 1e-2 and (lse - want_lse).abs().max() < 1e-3, kernel
    final = out.to(dtype)  # the ring passes its merged output, in the input dtype
    got = fused_block_backward(kernel, q, k, v, scale, final, lse, dout, aux)
    want = block_backward(q, k, v, None, scale, want_lse, dout.float(), (dout.float() * final.float()).sum(-1))
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert _rel(a, b) < 1e-2, (kernel, name, _rel(a, b))
