"""The divergence guard's skip, taken on the device by every optimizer path (``found_inf``, torch's fused
optimizers' protocol), on the CPU:

  * through ``train_step``: a batch with a NaN changes nothing (weights, optimizer states and step counters, the
    EMA, the fused backward pass's clipping norm), and the step after it equals, bit for bit, the run that never
    saw that batch; for ``CompensatedAdamW``'s libraries' path (fp32 and 8-bit moments, Kahan and
    stochastically rounded bf16 weights), and the optimizer step fused into the backward. torch's fused AdamW
    is tested so in tests/train/test_guard.py, and the one-pass step takes the same ``found_inf``
    (tests/optim/test_fused_adamw.py::test_skipped_step_changes_nothing; a DiT under Triton's interpreter
    would take minutes here). Stochastic rounding's stream counts the skipped
    step (``rounding_step``, a host int advanced before the flag is known), so its reference run advances that
    counter too;
  * on the libraries' path directly: NaN gradients with ``found_inf`` = 1 change nothing, parameters cut into
    several chunks included, and ``found_inf`` = 0 gives the unguarded step bit for bit; GradScaler's
    ``grad_scale`` (now that the path declares ``_step_supports_amp_scaling``) divides the gradients;
  * the libraries' own optimizers (torchao's AdamW4bit / AdamWFp8, torch's Adafactor), which take no flag, through
    ``step_skipping_on_device``: the same two checks.

Step counters kept on the host are put back when the flag is read, one step late (``SkipUndo``), so the states
are compared after ``settle_skip``.

That a guarded step makes no host sync cannot be seen on the CPU (a read of a CPU tensor is no sync);
``benchmarks/profile_step.py --guarded`` counts them per optimizer path on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from ditforge.optim.backward import StepInBackward
from ditforge.optim.compensated import CompensatedAdamW
from compiled_shapes import DIT_T2_SHAPES, WEIGHT_DECAY

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
LR, WD, DECAY, MAX_NORM = 1e-3, WEIGHT_DECAY, 0.9, 0.05  # MAX_NORM small enough to clip every step

# name -> (weights' dtype, optimizer factory over a parameter list, the fused backward pass)
PATHS = {
    "fp32": (torch.float32, lambda ps: CompensatedAdamW(ps, lr=LR, weight_decay=WD, fused=False), False),
    "8bit": (torch.float32, lambda ps: CompensatedAdamW(ps, lr=LR, weight_decay=WD, states="8bit", fused=False), False),
    "kahan bf16": (torch.bfloat16, lambda ps: CompensatedAdamW(ps, lr=LR, weight_decay=WD, fused=False), False),
    "kahan bf16 8bit": (torch.bfloat16,
                        lambda ps: CompensatedAdamW(ps, lr=LR, weight_decay=WD, states="8bit", fused=False), False),
    "sr bf16": (torch.bfloat16,
                lambda ps: CompensatedAdamW(ps, lr=LR, weight_decay=WD, rounding="stochastic", fused=False), False),
    "fused backward fp32": (torch.float32, lambda ps: CompensatedAdamW(ps, lr=LR, weight_decay=WD, fused=False), True),
    "fused backward sr bf16 8bit": (torch.bfloat16, lambda ps: CompensatedAdamW(
        ps, lr=LR, weight_decay=WD, states="8bit", rounding="stochastic", fused=False), True),
}


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()))


def _model(seed, dtype):
    """DiT-T/2 with every weight random (adaLN-Zero's zero init would leave most blocks without gradients)."""
    from ditforge.models import create_model

    torch.manual_seed(seed)
    model = create_model("DiT-T/2", 8, 4, 10)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model.to(dtype)


def _state(model, opt, ema, stepper):
    """Everything a step may change: weights, the optimizer's tensors, the EMA, the carried clipping norm (the
    host step counters as they are once the step's flag is read, ``settle_skip``)."""
    from ditforge.optim.skip import settle_skip

    settle_skip(opt)
    out = [p.detach().clone() for p in model.parameters()]
    out += [v.clone() for p in model.parameters() for v in opt.state[p].values() if torch.is_tensor(v)]
    out += [v.clone() for v in ema.shadow.values()]
    if stepper is not None and stepper.prev_norm is not None:
        out.append(stepper.prev_norm.clone())
    return out


def _run(path, seed, batches, advance_after=None):
    """``train_step`` over ``batches`` (data indices; negative: that batch with a NaN in its first latent);
    returns the state after each step. ``advance_after``: after that step count one more optimizer step
    without taking it (stochastic rounding's reference)."""
    from ditforge.diffusion import create_diffusion
    from ditforge.parallel.ema import EMA
    from ditforge.parallel.mesh import Dist
    from ditforge.train.step import step_randomness, train_step

    dtype, make, in_backward = PATHS[path]
    if "8bit" in path:
        pytest.importorskip("bitsandbytes")
    diffusion = create_diffusion(None)
    model = _model(seed, dtype)
    opt = make(list(model.parameters()))
    stepper = StepInBackward(model, opt, MAX_NORM) if in_backward else None
    ema = EMA(model)
    states = []
    for k, i in enumerate(batches):
        g = torch.Generator().manual_seed(seed + abs(i))
        x, y = torch.randn(4, 4, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        if i < 0:
            x[0, 0, 0, 0] = float("nan")
        rnd = step_randomness(seed, abs(i), 4, (4, 8, 8), diffusion, 0.1, CPU)
        amp = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        out = train_step(model, diffusion, opt, None, [(x, {"y": y}, rnd)], amp, MAX_NORM, Dist(device=CPU),
                         stepper=stepper)
        assert bool(out["skipped"]) == (i < 0)
        ema.update(model, DECAY, skip=out["skipped"])
        states.append(_state(model, opt, ema, stepper))
        if advance_after == k + 1:
            opt.advance()
    return states


@pytest.mark.parametrize("path", list(PATHS))
def test_nan_batch_changes_nothing_and_the_next_step_is_the_run_without_it(path):
    """Steps on batches 1, NaN, 2 against 1, 2: the NaN step leaves every tensor as step 1 left it, and the last
    step equals the reference's bit for bit."""
    seed = _seed()
    guarded = _run(path, seed, [1, -5, 2])
    reference = _run(path, seed, [1, 2], advance_after=1 if "sr" in path else None)
    for name, states in (("after the NaN batch", (guarded[1], guarded[0])), ("the next step", (guarded[2], reference[1]))):
        assert len(states[0]) == len(states[1])
        for k, (a, b) in enumerate(zip(*states)):
            assert torch.equal(a, b), f"{path}, {name}: tensor {k} differs"
    assert not all(torch.equal(a, b) for a, b in zip(guarded[2], guarded[0]))  # the step after it moved them


def _params(dtype, seed, shapes=((300, 64), (10,), (5000,), (7, 5))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


@pytest.mark.parametrize("states", ["fp32", "8bit"])
@pytest.mark.parametrize("dtype,rounding", [(torch.float32, "kahan"), (torch.bfloat16, "kahan"),
                                            (torch.bfloat16, "stochastic")])
def test_libraries_path_skips_on_the_flag_and_is_unchanged_without_it(states, dtype, rounding):
    """Chunks of 4,096 elements cut the (300, 64) and (5000,) parameters at 256-element blocks. Two optimizers
    step alike; then NaN gradients with found_inf = 1 leave one unchanged, and found_inf = 0 against no flag
    (and grad_scale 1024 on gradients scaled by 1024, exact in binary) gives the same steps bit for bit."""
    if states == "8bit":
        pytest.importorskip("bitsandbytes")
    seed = _seed()
    a, b = _params(dtype, seed), _params(dtype, seed)
    kw = dict(lr=LR, weight_decay=WD, states=states, rounding=rounding, chunk_numel=4096, fused=False)
    opt_a, opt_b = CompensatedAdamW(a, **kw), CompensatedAdamW(b, **kw)
    for step in range(2):
        for ps in (a, b):
            for p, grad in zip(ps, _grads(ps, seed + step)):
                p.grad = grad
        opt_a.step()
        opt_b.step()
    before = [t.clone() for p in a for t in (p.detach(), *opt_a.state[p].values())]
    for p in a:
        p.grad = torch.full_like(p, float("nan"))
    opt_a.found_inf = torch.ones(())
    opt_a.step()
    opt_a.state_dict()  # reads the flag: the host step counters are put back
    assert all(torch.equal(x, y) for x, y in zip([t for p in a for t in (p.detach(), *opt_a.state[p].values())],
                                                 before))
    for p, grad in zip(a, _grads(a, seed + 9)):
        p.grad = grad * 1024
    opt_a.found_inf, opt_a.grad_scale = torch.zeros(()), torch.tensor(1024.0)
    for p, grad in zip(b, _grads(b, seed + 9)):
        p.grad = grad
    opt_b.advance()  # opt_a counted the skipped step: the same stochastic rounding stream
    opt_a.step()
    opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), key


def _tensors(params, opt):
    """Every plain tensor a step may write: the weights and the inner tensors of their states (torchao's
    quantized states hold codes and scales)."""
    from ditforge.optim.skip import _held

    return [x for p in params for t in (p, *opt.state[p].values()) if torch.is_tensor(t) for x in _held(t)]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("optimizer", ["adafactor", "adamw4bit", "adamw_fp8"])
def test_library_optimizers_skip_on_the_flag_and_are_unchanged_without_it(optimizer, device, monkeypatch):
    """torchao's AdamW4bit / AdamWFp8 and torch's Adafactor take no ``found_inf``; ``step_skipping_on_device``
    steps them a parameter at a time and selects each back on the device. A first step with the flag set creates
    no state (the one host read). After two steps alike, NaN gradients with the flag set leave every tensor as it
    was, their host step counters once the flag is read (``settle_skip``; until then they count the skipped
    step); found_inf = 0 then gives the optimizer's own step bit for bit. On a GPU too, where there is one. Chunks
    of 5,000 elements over DiT-T/2's shapes (compiled_shapes.py: torchao's compiled steps shared with test_optim.py):
    the (576, 192) weight alone, then (192,) and (192, 192) together (fp32 and quantized states in one chunk), then
    (8, 192)."""
    from ditforge.optim import skip
    from ditforge.optim.library import library_optimizer
    from ditforge.optim.skip import settle_skip, step_skipping_on_device

    monkeypatch.setattr(skip, "SKIP_CHUNK_NUMEL", 5000)

    if optimizer != "adafactor":
        pytest.importorskip("torchao")
    seed = _seed()
    a, b = ([torch.nn.Parameter(p.detach().to(device)) for p in _params(torch.float32, seed, DIT_T2_SHAPES)]
            for _ in range(2))
    opt_a, opt_b = library_optimizer(a, optimizer, LR, WD), library_optimizer(b, optimizer, LR, WD)
    flag = {k: torch.tensor(float(k), device=device) for k in (0, 1)}
    for p in a:
        p.grad = torch.full_like(p, float("nan"))
    step_skipping_on_device(opt_a, flag[1])
    assert not opt_a.state and all(torch.equal(p, q) for p, q in zip(a, b))
    for step in range(2):
        for ps in (a, b):
            for p, grad in zip(ps, _grads(ps, seed + step)):
                p.grad = grad.to(device)
        step_skipping_on_device(opt_a, flag[0])
        opt_b.step()
    before = [t.clone() for t in _tensors(a, opt_a)]
    for p in a:
        p.grad = torch.full_like(p, float("nan"))
    step_skipping_on_device(opt_a, flag[1])
    counters = [opt_a.state[p]["step"] for p in a]
    assert all(c.device.type == "cpu" and float(c) == 3 for c in counters)  # counted until the flag is read
    settle_skip(opt_a)
    after = _tensors(a, opt_a)
    assert len(after) == len(before) and all(torch.equal(x, y) for x, y in zip(after, before))
    for ps in (a, b):
        for p, grad in zip(ps, _grads(ps, seed + 9)):
            p.grad = grad.to(device)
    step_skipping_on_device(opt_a, flag[0])
    opt_b.step()
    settle_skip(opt_a)
    got, want = _tensors(a, opt_a), _tensors(b, opt_b)
    assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
    assert not all(torch.equal(x, y) for x, y in zip(got, before))
