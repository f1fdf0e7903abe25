"""Activation checkpointing policies, and --compile, which compiles each block in place: same losses as eager (inductor's fused kernels reorder float32
arithmetic, hence a tolerance), same state-dict keys."""

import json

import pytest
import torch

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, OffloadWrapper

from ditforge import cli
from ditforge.models import create_model
from ditforge.parallel import parallelize
from ditforge.parallel.mesh import Dist


def test_compile_keeps_state_dict_keys():
    model = create_model("DiT-T/2", 8, 1, 10)
    keys = list(model.state_dict())
    assert list(parallelize(model, Dist(), "none", grad_checkpoint="full", compile="default").state_dict()) == keys


@pytest.mark.slow
def test_compile_matches_eager(tmp_path):
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        argv = ["train", "--model", "DiT-T/2", "--max_steps", "3", "--log_every", "1", "--batch_size", "16",
                "--sample_every", "0", "--device", "cpu", "--mixed_precision", "fp32", "--outputs",
                str(tmp_path / name), *extra]
        assert cli.main(argv) == 0
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()]
    # float32 with different fusion/order: observed agreement ~1e-10 relative; 1e-5 allows for other CPUs.
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
    assert torch.isfinite(torch.tensor(losses["compiled"])).all()


@pytest.mark.parametrize("policy,wrapped", [("none", []), ("full", [0, 1, 2, 3, 4, 5]), ("every-2", [0, 2, 4]),
                                            ("every-4", [0, 4]), ("op", [0, 1, 2, 3, 4, 5])])
def test_grad_checkpoint_policies_wrap_the_right_blocks(policy, wrapped):
    model = parallelize(create_model("DiT-T/2", 8, 1, 10), Dist(), "none", grad_checkpoint=policy)
    assert [i for i, b in enumerate(model.blocks) if isinstance(b, CheckpointWrapper)] == wrapped


@pytest.mark.parametrize("bad", ["every-0", "every", "some", "every-2x"])
def test_bad_grad_checkpoint_policy_names_the_flag(bad):
    from ditforge.config.load import build_config
    from ditforge.errors import UserError

    with pytest.raises(UserError, match="--grad_checkpoint: expected one of none | full | every-K | op"):
        build_config(overrides={"grad_checkpoint": bad})


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def test_op_policy_recomputes_only_elementwise_ops():
    """What the backward reruns: nothing without checkpointing; the element-wise ops (GELU) but no matrix
    product under ``op``; both under ``full``; both but not attention under ``attn``. All four give the same
    gradients (float64)."""

    torch.manual_seed(0)
    base = create_model("DiT-T/2", 8, 1, 10).double()
    for block in base.blocks:  # the adaLN-Zero init zeroes these; random values make every branch matter
        torch.nn.init.normal_(block.adaLN_modulation[-1].weight, std=0.05)
    x, t, y = torch.randn(2, 1, 8, 8, dtype=torch.float64), torch.tensor([3, 700]), torch.tensor([1, 4])
    grads, reruns = {}, {}
    aten = torch.ops.aten
    for policy in ("none", "full", "op", "attn"):
        model = create_model("DiT-T/2", 8, 1, 10).double()
        model.load_state_dict(base.state_dict())
        model = parallelize(model, Dist(), "none", grad_checkpoint=policy)
        loss = model(x, t, y).square().sum()
        with _CountOps() as counter:
            loss.backward()
        reruns[policy] = (counter.calls.get(aten.gelu.default, 0),
                          counter.calls.get(aten.addmm.default, 0) + counter.calls.get(aten.mm.default, 0),
                          counter.calls.get(aten._scaled_dot_product_flash_attention_for_cpu.default, 0))
        grads[policy] = [p.grad for p in model.parameters() if p.requires_grad]
    depth = len(base.blocks)
    assert reruns["none"][0] == 0 and reruns["op"][0] == reruns["attn"][0] == reruns["full"][0] == depth
    assert reruns["none"][1] == reruns["op"][1] < reruns["attn"][1] == reruns["full"][1]
    assert reruns["none"][2] == reruns["op"][2] == reruns["attn"][2] == 0 and reruns["full"][2] == depth
    for policy in ("full", "op", "attn"):
        for a, b in zip(grads[policy], grads["none"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_offload_activations_of_every_block():
    """``--offload_activations`` wraps every block (``ActivationOffload``, torch's OffloadWrapper with parameters
    left out), checkpointed or not. Its forward copies each saved tensor but the parameters out (aten.copy_ into
    the host buffer): all of an unchecked block's, only the inputs of a checkpointed one (torch's non-reentrant
    checkpoint saves them outside its own hooks), so full checkpointing copies fewer than every-2, which copies
    fewer than none. The gradients equal the plain model's bit for bit (float64: the copies are exact)."""
    torch.manual_seed(0)
    base = create_model("DiT-T/2", 8, 1, 10).double()
    for block in base.blocks:
        torch.nn.init.normal_(block.adaLN_modulation[-1].weight, std=0.05)
    x, t, y = torch.randn(2, 1, 8, 8, dtype=torch.float64), torch.tensor([3, 700]), torch.tensor([1, 4])
    grads, copies = {}, {}
    for policy, offload in (("none", False), ("none", True), ("every-2", True), ("full", True), ("attn", True)):
        model = create_model("DiT-T/2", 8, 1, 10).double()
        model.load_state_dict(base.state_dict())
        model = parallelize(model, Dist(), "none", grad_checkpoint=policy, offload_activations=offload)
        assert all(isinstance(b, OffloadWrapper) == offload for b in model.blocks)
        with _CountOps() as counter:
            loss = model(x, t, y).square().sum()
        copies[policy, offload] = counter.calls.get(torch.ops.aten.copy_.default, 0)
        loss.backward()
        grads[policy, offload] = [p.grad for p in model.parameters() if p.requires_grad]
    assert copies["none", False] == 0 < copies["full", True] < copies["every-2", True] < copies["none", True]
    assert copies["full", True] == copies["attn", True]  # the inputs alone: the kept attention stays put
    for key in (("none", True), ("every-2", True), ("full", True), ("attn", True)):
        for a, b in zip(grads[key], grads["none", False], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_activation_offload_leaves_parameters_in_place():
    """What ``ActivationOffload`` packs, in one linear layer's forward under its hooks: the input and the
    activation go to host memory (equal values, back on their device in the unpack), the weight, which the layer
    saves as a transposed view of the parameter, and a parameter itself stay the very tensors they were."""
    from ditforge.parallel import _pack_to_host, _unpack_from_host

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    packed = []

    def pack(t):
        packed.append((t, _pack_to_host(t)))
        return packed[-1][1]

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack_from_host):
        torch.nn.functional.gelu(layer(x)).sum().backward()
    kept = [t for t, p in packed if p is t]
    moved = [(t, p) for t, p in packed if p is not t]
    assert len(kept) == 1 and kept[0]._base is layer.weight
    assert len(moved) == 2  # the input and the pre-activation
    for t, (device, host) in moved:
        assert device == t.device and host.data_ptr() != t.data_ptr()
        torch.testing.assert_close(_unpack_from_host((device, host)), t.detach(), rtol=0, atol=0)
    assert _pack_to_host(layer.bias) is layer.bias


@pytest.mark.parametrize("value,expected", [(True, "default"), (False, "none"), ("max-autotune", "max-autotune"),
                                            ("none", "none")])
def test_compile_setting_accepts_modes_and_booleans(value, expected):
    """`compile: true` in a config file (and configs saved before modes existed) means the default mode."""
    from ditforge.config.load import build_config

    assert build_config(overrides={"compile": value}).train.compile == expected


def test_unknown_compile_mode_names_the_flag():
    from ditforge.config.load import build_config
    from ditforge.errors import UserError

    with pytest.raises(UserError, match="--compile: expected one of none, default"):
        build_config(overrides={"compile": "turbo"})
