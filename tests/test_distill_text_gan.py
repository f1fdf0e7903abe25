"""``ditforge distill`` of text-conditional DiT teachers and DMD2's GAN head on real data (``--data``,
``--gen_cls_loss_weight``; Yin et al. 2024 secs. 4.3-4.4).

The GAN losses against their closed form on given logits (float64); the critic's GAN loss reaches the head and the
critic only. A tiny text DiT (DiT-T/4, one block, 8x8 pixels, the shipped MiniLM encoder) initialised here: the teacher
inside the first iteration equals its guided prediction u + s (c - u) computed from the model ``ditforge sample``
loads (``sample.load.load_model``) in float64 on the prompts' states of ``sample.load.encode_prompts`` (the run
computes in float32: tolerance 1e-5); resume is exact; ``ditforge sample --ckpt RUN --prompt ...`` draws the student
in its steps. A tiny class DiT of the digits' 10 classes distils with ``--data digits`` and the head: deterministic,
and resume is exact (the head and its optimizer included). Run checkpoints are written directly (``Checkpointer``).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from ditforge.cli import main
from ditforge.diffusion.dmd import DMD2, GANHead, gan_critic_loss, gan_generator_loss, student_times
from ditforge.diffusion.gaussian import create_diffusion

pytestmark = pytest.mark.usefixtures("one_thread")

DT = torch.float64
TEXT_DIM = 384  # all-MiniLM-L6-v2
PROMPTS = ["a red car at night", "two dogs on a beach", "the sea", "a bowl of ripe fruit on a table"]
SCALE = 3.0


def test_gan_losses_are_their_closed_form():
    """mean -log sigmoid(real) - mean log(1 - sigmoid(fake)) for the critic, mean -log sigmoid(fake) for the
    generator, and their gradients -(1 - sigmoid(real)) / B, sigmoid(fake) / B, -(1 - sigmoid(fake)) / B, on fresh
    random float64 logits of unequal batches (1e-12)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    real = (3 * torch.randn(7, generator=g, dtype=DT)).requires_grad_(True)
    fake = (3 * torch.randn(5, generator=g, dtype=DT)).requires_grad_(True)
    loss = gan_critic_loss(real, fake)
    expected = -torch.log(torch.sigmoid(real.detach())).mean() - torch.log(1 - torch.sigmoid(fake.detach())).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    loss.backward()
    torch.testing.assert_close(real.grad, -(1 - torch.sigmoid(real.detach())) / 7, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fake.grad, torch.sigmoid(fake.detach()) / 5, rtol=1e-12, atol=1e-12)
    fake.grad = None
    gen = gan_generator_loss(fake)
    torch.testing.assert_close(gen, -torch.log(torch.sigmoid(fake.detach())).mean(), rtol=1e-12, atol=1e-12)
    gen.backward()
    torch.testing.assert_close(fake.grad, -(1 - torch.sigmoid(fake.detach())) / 5, rtol=1e-12, atol=1e-12)


def _dit(depth=2, **extra):
    from ditforge.models import create_model_from_spec

    spec = dict(model="DiT-T/4", input_size=8, in_channels=1, num_classes=10, learn_sigma=True, class_dropout_prob=0.1,
                depth=depth, num_frames=None, text_dim=None, condition="class") | extra
    torch.manual_seed(0)
    model = create_model_from_spec(spec)
    for p in model.parameters():  # DiT zero-initialises its output layers: give the teacher something to say
        p.data.add_(0.02 * torch.randn_like(p))
    return model, spec


def test_critic_gan_loss_reaches_only_the_head_and_the_critic():
    """The critic's GAN loss of a student sample (made with gradients) and real samples: gradients on the head and
    on the critic's blocks up to its feature depth (1 of 2), none on the critic's later block and output layer, the
    student or the teacher."""
    from ditforge.train.distill import classifier

    teacher, _ = _dit()
    student, critic = copy.deepcopy(teacher), copy.deepcopy(teacher)
    critic.gan_head = GANHead(critic.final_layer.linear.in_features)
    student.requires_grad_(True)
    critic.requires_grad_(True)
    teacher.requires_grad_(False)
    objective = create_diffusion(None, learn_sigma=True)
    dmd = DMD2(objective, student_times(objective, 2))
    g = torch.Generator().manual_seed(1)
    y = torch.randint(10, (4,), generator=g)
    x = dmd.generate(lambda x_t, t: student(x_t, t, y), torch.randn(4, 1, 8, 8, generator=g), g)
    real = torch.rand(4, 1, 8, 8, generator=g) * 2 - 1
    real_logits = dmd.gan_logits(classifier(critic, {"y": y}), real, g)
    fake_logits = dmd.gan_logits(classifier(critic, {"y": y}), x.detach(), g)
    gan_critic_loss(real_logits, fake_logits).backward()
    assert all(p.grad is None for p in student.parameters()) and all(p.grad is None for p in teacher.parameters())
    assert not real.requires_grad
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.gan_head.parameters())
    assert critic.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert all(p.grad is None for m in (critic.blocks[1], critic.final_layer) for p in m.parameters())


def _save(folder, model, spec, data=None):
    from ditforge.parallel.mesh import Dist
    from ditforge.train.checkpoint import Checkpointer

    sd = model.state_dict()
    Checkpointer(folder, 1, False, Dist()).save(1, {"model": sd, "ema": sd},
                                               {"config": {"model": spec, "data": data or {"image_size": 8}}})
    return folder


@pytest.fixture(scope="module")
def text_teacher(tmp_path_factory):
    """A tiny text-conditional DiT-T/4 run (depth 1, 8x8 pixels, caption dropout 0.1, the shipped MiniLM)."""
    model, spec = _dit(depth=1, text_encoder=None, text_max_length=16, vae="none", qk_norm=False,
                       condition="text", text_dim=TEXT_DIM)
    return _save(tmp_path_factory.mktemp("text_teacher") / "run", model, spec)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def _distill(teacher, outputs, *extra):
    return main(["distill", "--teacher", str(teacher), "--outputs", str(outputs), "--batch_size", "3",
                 "--critic_steps", "2", "--log_every", "1", "--device", "cpu", "--student_steps", "2", *extra])


def _spied_run(monkeypatch, teacher, outputs, *extra) -> list:
    """A 4-iteration run recording each teacher call: (x_t, t, the teacher's conditions, its output)."""
    import ditforge.train.distill as distill

    seen, nets = [], distill.nets

    def spy(teacher_model, student, critic, cond, scale):
        gen, fake, guided = nets(teacher_model, student, critic, cond, scale)

        def watched(x, t):
            out = guided(x, t)
            seen.append((x.clone(), t.clone(), {k: v.clone() for k, v in cond.items()}, out.detach().clone()))
            return out

        return gen, fake, watched

    monkeypatch.setattr(distill, "nets", spy)
    assert _distill(teacher, outputs, "--max_steps", "4", *extra) == 0
    monkeypatch.undo()
    return seen


def test_text_teacher_is_samples_guided_prediction(text_teacher, prompt_file, tmp_path, monkeypatch):
    """The teacher of iteration 1 equals u + 3 (c - u) on the epsilon channels (the conditional pass's variance
    channels), c and u the float64 model ``ditforge sample`` loads called on the caption states and with every
    caption dropped (its learned null caption), at the same x_t, t; the states equal ``encode_prompts``' of the
    prompts drawn (uniform indices from the iteration's generator), 1e-5."""
    from ditforge.data.sampler import derive_seed
    from ditforge.sample.load import SampleConfig, encode_prompts, load_model

    seen = _spied_run(monkeypatch, text_teacher, tmp_path / "run", "--prompt_file", str(prompt_file),
                      "--cfg_scale", str(SCALE))
    x, t, cond, got = seen[0]
    rows = torch.randint(len(PROMPTS), (3,), generator=torch.Generator().manual_seed(derive_seed(0, 1)))
    model, spec = load_model(str(text_teacher))
    states, mask = encode_prompts(SampleConfig(ckpt=str(text_teacher), batch_size=3), spec,
                                  [PROMPTS[i] for i in rows], torch.device("cpu"))
    assert torch.equal(cond["y_mask"], mask)
    torch.testing.assert_close(cond["y"], states, rtol=0, atol=1e-5)
    model = model.double()
    y = cond["y"].double()
    c = model(x.double(), t, y, y_mask=cond["y_mask"])
    u = model(x.double(), t, y, force_drop_ids=torch.ones(3, dtype=torch.bool), y_mask=cond["y_mask"])
    torch.testing.assert_close(got[:, :1].double(), (u + SCALE * (c - u))[:, :1], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[:, 1:].double(), c[:, 1:], rtol=0, atol=1e-5)
    assert not torch.allclose(c, u)  # the null caption changes the prediction
    assert len(seen) == 2  # iterations 1 and 3 take generator steps


def _states(folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    from ditforge.weights.read import SafeFileSystemReader, list_checkpoints

    state: dict = {}
    dcp.state_dict_loader._load_state_dict(state, SafeFileSystemReader(str(list_checkpoints(folder)[-1])),
                                           planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def _rows(folder):
    return [{k: v for k, v in json.loads(line).items() if k != "steps_per_sec"}
            for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _assert_resume_exact(teacher, tmp_path, *flags):
    """4 iterations straight and 2 + resume 2: equal metrics, student, critic and optimizers, bit for bit."""
    assert _distill(teacher, tmp_path / "a", "--max_steps", "4", *flags) == 0
    assert _distill(teacher, tmp_path / "b", "--max_steps", "2", *flags) == 0
    assert _distill(teacher, tmp_path / "b", "--max_steps", "4", "--resume", "auto", *flags) == 0
    rows = [_rows(tmp_path / run) for run in "ab"]
    assert rows[0] == rows[1] and len(rows[0]) == 4
    states = [_states(tmp_path / run) for run in "ab"]
    for key in ("model", "critic", "optimizer", "critic_optimizer"):
        flat = [{k: v for k, v in _flatten(s[key])} for s in states]
        assert flat[0].keys() == flat[1].keys()
        for name, value in flat[0].items():
            assert torch.equal(value, flat[1][name]) if torch.is_tensor(value) else value == flat[1][name], (key,
                                                                                                               name)
    return rows[0], states[0]


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix, tree


def test_text_resume_is_exact_and_sample_draws_the_student(text_teacher, prompt_file, tmp_path):
    """Resume is exact; ``ditforge sample --ckpt RUN --prompt ...`` draws the student in its 2 steps without
    guidance by default (= ``--sampler student --num_sampling_steps 2 --cfg_scale 1``, != 3 steps)."""
    import numpy as np

    rows, _ = _assert_resume_exact(text_teacher, tmp_path, "--prompt_file", str(prompt_file))
    assert "generator_loss" in rows[0] and "gen_cls_loss" not in rows[0]
    sample = ["sample", "--ckpt", str(tmp_path / "a"), "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--device",
              "cpu"]
    draws = {"default": [], "explicit": ["--sampler", "student", "--num_sampling_steps", "2", "--cfg_scale", "1"],
             "three_steps": ["--num_sampling_steps", "3"]}
    for name, flags in draws.items():
        npz = tmp_path / f"{name}.npz"
        assert main([*sample, "--out", str(tmp_path / f"{name}.png"), "--save_npz", str(npz), *flags]) == 0
        draws[name] = np.load(npz)["samples"]
    assert np.array_equal(draws["default"], draws["explicit"])
    assert not np.array_equal(draws["default"], draws["three_steps"])


@pytest.fixture(scope="module")
def digits_teacher(tmp_path_factory):
    """A tiny class DiT-T/4 of the digits' 10 classes (depth 2, 8x8 pixels, label dropout 0.1)."""
    model, spec = _dit()
    return _save(tmp_path_factory.mktemp("digits_teacher") / "run", model, spec)


def test_gan_head_run_is_deterministic_and_resumes_exactly(digits_teacher, tmp_path):
    """``--data digits --gen_cls_loss_weight 0.1``: the GAN losses are logged (finite), resume is exact with the
    head in the critic's entry and its optimizer, and a second run from scratch equals the first."""
    import math

    flags = ("--data", "digits", "--gen_cls_loss_weight", "0.1")
    rows, state = _assert_resume_exact(digits_teacher, tmp_path, *flags)
    assert {"gen_cls_loss", "guidance_cls_loss", "pred_realism_on_real"} <= rows[0].keys()
    assert "gen_cls_loss" not in rows[1] and math.isfinite(rows[1]["guidance_cls_loss"])
    assert any(k.startswith("gan_head.") for k in state["critic"])
    assert _distill(digits_teacher, tmp_path / "c", "--max_steps", "2", *flags) == 0
    assert _rows(tmp_path / "c") == rows[:2]


@pytest.mark.parametrize("flags, says", [
    (("--data", "digits"), "--gen_cls_loss_weight"),
    (("--gen_cls_loss_weight", "0.1"), "--data"),
    (("--prompt_file", "PROMPTS"), "--prompt_file"),
    (("--data", "digits", "--gen_cls_loss_weight", "-1"), "--gen_cls_loss_weight"),
])
def test_bad_gan_flags_get_one_line_and_exit_2(digits_teacher, prompt_file, tmp_path, capsys, flags, says):
    flags = [str(prompt_file) if f == "PROMPTS" else f for f in flags]
    assert _distill(digits_teacher, tmp_path / "run", "--max_steps", "1", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_text_teacher_without_prompts_gets_one_line(text_teacher, tmp_path, capsys):
    assert _distill(text_teacher, tmp_path / "run", "--max_steps", "1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--prompt_file" in err
