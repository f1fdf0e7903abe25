"""``ditforge distill --data`` of a pipeline teacher (``train/distill_real.py``) on the tiny Wan 2.1 folder
(``wan_pipeline``) and a folder of three captioned mp4 clips (``tiny_pipelines.captioned_clips``): the GAN head's
features are the middle block's hidden states of diffusers' own transformer (the blocks after it not run) and its
losses DMD2's, written out in float64; with the two-expert Wan 2.2 A14B folder (``make_wan22``) each row's
expert's, into one head whose loss and gradient are the float64 head's on those rows; with Wan2.1-VACE
(``make_vace``) each real row's control that of its clip's reference, as ``WanVACEPipeline`` builds it; the same
iteration with and without gradient checkpointing gives the same gradients (LoRA student and critic on one base,
and full copies); a cut-and-resumed run equals the uninterrupted one, head and its optimizer included; the
one-line refusals of bad clips. The multi-process runs (FSDP2, Ulysses, two experts) are
``tests/distributed/test_dist_distill.py``'s."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ditforge import cli
from families import assert_one_line_error
from tiny_pipelines import captioned_clips
from test_distill_video import PROMPTS, assert_resume_exact, distill_argv

pytestmark = pytest.mark.usefixtures("one_thread_module")
WEIGHT = 0.5  # --gen_cls_loss_weight: large, so that the GAN term moves the gradients measurably


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return captioned_clips(tmp_path_factory.mktemp("real") / "clips", 6, 32)  # read at the student's 16 x 16 x 5


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("real_prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def real_argv(pipe, prompts, clips, out, *extra):
    return distill_argv(pipe, prompts, out, "--data", str(clips), "--gen_cls_loss_weight", str(WEIGHT), *extra)


def recorded_run(pipe, prompts, clips, out, *extra, grads: list | None = None) -> list[dict]:
    """``real_argv``'s run of ``pipe`` to ``out``; returns its first iteration's ``features`` calls (input, timesteps,
    conditioning, tokens, the head's weights at its call, and ``ran``: the (expert, block index in module order) of
    each repeated block call the features made, counted by forward pre-hooks): the generator's fake, then the critic's
    real and fake. ``grads``: each clip's gradients appended (the student's, then the critic's, its head's last)."""
    from ditforge.diffusion.dmd import GANHead
    from ditforge.models import is_block
    from ditforge.models.adapters import DiffusersDenoiser
    from ditforge.train import distill_pipeline

    calls = []
    features, head, clip = DiffusersDenoiser.features, GANHead.forward, distill_pipeline.clip_grad_norm_

    def seen_features(self, x, t, **cond):
        ran = []
        blocks = [[m for m in model.modules() if is_block(m, self.block_classes)] for model in self.expert_models()]
        hooks = [block.register_forward_pre_hook(lambda module, args, key=(e, i): ran.append(key))
                 for e, chain in enumerate(blocks) for i, block in enumerate(chain)]
        try:
            out = features(self, x, t, **cond)
        finally:
            for hook in hooks:
                hook.remove()
        calls.append({"x": x.detach().clone(), "t": t.clone(), "cond": {k: v.clone() for k, v in cond.items()},
                      "tokens": out.detach().clone(), "ran": ran})
        return out

    def seen_head(self, tokens, **kwargs):
        calls[-1]["head"] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        return head(self, tokens, **kwargs)

    def seen_clip(params, most, d):
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in params])
        return clip(params, most, d)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DiffusersDenoiser, "features", seen_features)
        mp.setattr(GANHead, "forward", seen_head)
        if grads is not None:
            mp.setattr(distill_pipeline, "clip_grad_norm_", seen_clip)
        assert cli.main(real_argv(pipe, prompts, clips, out, *extra)) == 0
    return calls[:3]


@pytest.fixture(scope="module")
def run(wan_pipeline, prompts, clips, tmp_path_factory):
    """4 iterations with the GAN head; the first iteration's ``features`` calls and head calls recorded."""
    out = tmp_path_factory.mktemp("real_run") / "run"
    return out, recorded_run(wan_pipeline, prompts, clips, out, "--max_steps", "4")


def logits64(tokens: torch.Tensor, w: dict) -> torch.Tensor:
    """DMD2's head by hand in float64: LayerNorm, Linear, SiLU, Linear per token, the mean over the tokens."""
    h = F.layer_norm(tokens.double(), tokens.shape[-1:], w["net.0.weight"].double(), w["net.0.bias"].double())
    h = F.silu(h @ w["net.1.weight"].double().T + w["net.1.bias"].double())
    return (h @ w["net.3.weight"].double().T + w["net.3.bias"].double()).squeeze(-1).mean(1)


def middle_states(model, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """The hidden states diffusers' ``WanTransformer3DModel`` ``model`` (2 blocks: block 0 the middle) gives after its
    block 0 at (x, t) under the text states ``text``."""
    kept = []
    hook = model.blocks[0].register_forward_hook(lambda m, a, o: kept.append(o))
    with torch.no_grad():
        model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)
    hook.remove()
    return kept[0]


def assert_dmd2_gan_metrics(first: dict, calls: list[dict]) -> None:
    """The first iteration's GAN metrics (``first``) are DMD2's losses of the head written out in float64 on the
    recorded tokens (rel 1e-5)."""
    fake_g, real, fake = (logits64(c["tokens"], c["head"]) for c in calls)
    assert first["gen_cls_loss"] == pytest.approx(float(F.softplus(-fake_g).mean()), rel=1e-5)
    assert first["guidance_cls_loss"] == pytest.approx(float(F.softplus(-real).mean() + F.softplus(fake).mean()),
                                                       rel=1e-5)
    assert first["pred_realism_on_real"] == pytest.approx(float(real.sigmoid().mean()), rel=1e-5)
    assert first["pred_realism_on_fake"] == pytest.approx(float(fake.sigmoid().mean()), rel=1e-5)


def test_gan_losses_are_dmd2s_on_the_middle_blocks_features(run, wan_pipeline):
    from diffusers import WanTransformer3DModel

    out, calls = run
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # the critic's LoRA B is zero until its first step: diffusers' transformer itself, its block 0 of 2 the middle
    model = WanTransformer3DModel.from_pretrained(str(wan_pipeline / "transformer"), local_files_only=True).eval()
    for call in calls:
        torch.testing.assert_close(call["tokens"], middle_states(model, call["x"], call["t"], call["cond"][
            "encoder_hidden_states"]), rtol=1e-5, atol=1e-6)
        assert call["tokens"].shape[1:] == (2 * 1 * 1, model.config.num_attention_heads *
                                            model.config.attention_head_dim)  # (T' / 1) x (h / 2) x (w / 2) tokens
    assert_dmd2_gan_metrics(first, calls)
    assert all(call["ran"] == [(0, 0)] for call in calls)  # the middle block once; block 1, after it, not at all
    # the real branch is the clips' captions' conditioning, not the prompts'
    assert not torch.equal(calls[1]["cond"]["encoder_hidden_states"], calls[2]["cond"]["encoder_hidden_states"])


BOUNDARY = 875.0  # make_wan22's boundary_ratio 0.875 x 1000


@pytest.fixture(scope="module")
def experts_run(prompts, clips, tmp_path_factory):
    """One iteration (a generator step, then a critic step) of the two-expert teacher with the GAN head (seed 2: its
    GAN calls' rows on both experts, one batch straddling t = 875); its features calls and clipped gradients."""
    from tiny_pipelines import make_wan22

    root = tmp_path_factory.mktemp("real_wan22")
    pipe, grads = make_wan22(root / "pipe"), []
    calls = recorded_run(pipe, prompts, clips, root / "run", "--max_steps", "1", "--seed", "2", grads=grads)
    return pipe, root / "run", calls, grads


def test_two_experts_features_are_each_rows_experts(experts_run):
    """A two-expert teacher's GAN head: each row's features are the middle block's of diffusers' transformer that
    owns its t (``transformer`` at t >= 875, else ``transformer_2``; the critic's LoRA B zero before its first step),
    a batch straddling the boundary put back in its rows' order; one head on both, its losses DMD2's in float64
    (rel 1e-5), and its gradient in the critic step the float64 gradient of ``--guidance_cls_loss_weight`` x the
    critic's GAN loss of those rows' features, rows of both experts in it (rtol 1e-4)."""
    from diffusers import WanPipeline

    pipe, out, calls, grads = experts_run
    loaded = WanPipeline.from_pretrained(str(pipe), local_files_only=True)
    experts = (loaded.transformer.eval(), loaded.transformer_2.eval())
    sides = torch.cat([c["t"] >= BOUNDARY for c in calls])
    assert sides.any() and not sides.all()
    assert any((c["t"] >= BOUNDARY).any() and (c["t"] < BOUNDARY).any() for c in calls)
    for call in calls:
        for i, t in enumerate(call["t"]):
            want = middle_states(experts[int(t < BOUNDARY)], call["x"][i:i + 1], t.view(1),
                                 call["cond"]["encoder_hidden_states"][i:i + 1])
            torch.testing.assert_close(call["tokens"][i:i + 1], want, rtol=1e-5, atol=1e-6)
        # each expert with rows runs its middle block (0 of 2) once, in by_expert's order, and not its block 1
        assert call["ran"] == [(e, 0) for e in (0, 1) if (call["t"] < BOUNDARY).eq(bool(e)).any()]
    assert_dmd2_gan_metrics(json.loads((out / "metrics.jsonl").read_text().splitlines()[0]), calls)
    w = {k: v.double().requires_grad_(True) for k, v in calls[1]["head"].items()}
    loss = 1e-2 * (F.softplus(-logits64(calls[1]["tokens"], w)).mean() +
                   F.softplus(logits64(calls[2]["tokens"], w)).mean())  # the default --guidance_cls_loss_weight
    want = torch.autograd.grad(loss, list(w.values()))
    got = grads[1][-len(want):]  # the critic's clip: its adapters', then its head's, in named_parameters' order
    assert len(grads) == 2 and [g.shape for g in got] == [g.shape for g in want]
    for g, ref in zip(got, want):
        torch.testing.assert_close(g.double(), ref, rtol=1e-4, atol=1e-9)


def test_reference_image_teacher_reads_each_clips_reference(prompts, tmp_path_factory, capsys):
    """A reference-image teacher (Wan2.1-VACE, ``make_vace``) with ``--image`` (one reference a sample) and clips
    each with a random 16 x 16 ``<stem>.ref.png``: the real branch's rows lead with one reference latent frame, as
    the student's (1 + T' frames), each row's control that of one clip's reference as ``WanVACEPipeline.__call__``
    builds it (``test_vace.pipeline_control``: not ``--image``'s, nor a frame's default crop); the GAN losses DMD2's
    in float64 on the recorded features (rel 1e-5). Without ``--image`` the student's latents have no reference
    frame: refused in one line."""
    from diffusers import WanVACEPipeline
    from PIL import Image

    from test_vace import pipeline_control
    from tiny_pipelines import make_vace

    root = tmp_path_factory.mktemp("real_vace")
    clips, images = captioned_clips(root / "clips", 6, 32), root / "images"
    images.mkdir()
    g = torch.Generator().manual_seed(4)
    refs = [torch.randint(0, 256, (16, 16, 3), generator=g, dtype=torch.uint8) for _ in range(4)]
    for i, ref in enumerate(refs[:3]):
        Image.fromarray(ref.numpy()).save(clips / f"clip{i}.ref.png")
    Image.fromarray(refs[3].numpy()).save(images / "student.png")
    folder = make_vace(root / "pipe")
    calls = recorded_run(folder, prompts, clips, root / "run", "--max_steps", "1", "--image", str(images))
    pipe = WanVACEPipeline.from_pretrained(str(folder), local_files_only=True)
    with torch.no_grad():
        want = [pipeline_control(pipe, (ref.permute(2, 0, 1)[None].float() / 127.5 - 1))[0] for ref in refs]
    real = calls[1]
    assert real["x"].shape[2] == calls[0]["x"].shape[2] == 1 + 2  # the reference's frame, then T' = 2
    for row in real["cond"]["control_hidden_states"]:
        assert [torch.allclose(row[None], w, rtol=1e-5, atol=1e-6) for w in want].count(True) == 1
        assert not torch.allclose(row[None], want[3], rtol=1e-5, atol=1e-6)
    assert_dmd2_gan_metrics(json.loads((root / "run" / "metrics.jsonl").read_text().splitlines()[0]), calls)
    assert_one_line_error(capsys, real_argv(folder, prompts, clips, root / "plain"), f"--data {clips}",
                          "with --image's one")


def test_resume_with_the_head_equals_uninterrupted(run, wan_pipeline, prompts, clips, tmp_path):
    import torch.distributed.checkpoint as dcp

    out, _ = run
    meta = dcp.FileSystemReader(str(out / "checkpoints" / "step-0000004")).read_metadata().state_dict_metadata
    assert any(k.startswith("critic.gan_head.") for k in meta)
    assert any(k.startswith("critic_optimizer.state.gan_head.") for k in meta)
    assert_resume_exact(out, wan_pipeline, prompts, tmp_path, "--data", str(clips), "--gen_cls_loss_weight",
                        str(WEIGHT))


@pytest.mark.parametrize("rank", [4, 0])  # LoRA student and critic on one base; full copies of both
def test_checkpointed_gradients_equal_unchecked(rank, wan_pipeline, prompts, clips, tmp_path, monkeypatch):
    """Two iterations, each a generator step with the GAN loss, then a critic step (the second's with both
    adapters moved off the base: at the first both LoRA B are zero, and a recompute under the wrong adapter would
    go unseen): the gradients each network's clip sees, with ``--grad_checkpoint`` and without, equal to float32
    rounding (rtol 1e-5, atol 1e-7)."""
    from ditforge.train import distill_pipeline

    clip = distill_pipeline.clip_grad_norm_
    grads = {}

    def seen(params, most, d):
        grads[flag].append([p.grad.detach().clone() for p in params])
        return clip(params, most, d)

    monkeypatch.setattr(distill_pipeline, "clip_grad_norm_", seen)
    for flag in ("--grad_checkpoint", "--no-grad_checkpoint"):
        grads[flag] = []
        assert cli.main(real_argv(wan_pipeline, prompts, clips, tmp_path / flag, "--max_steps", "2", "--critic_steps",
                                  "1", "--lora_rank", str(rank), flag)) == 0
    on, off = grads.values()
    assert len(on) == len(off) == 4  # the student's, then the critic's (its head's included), twice
    for a, b in zip(on, off):
        assert len(a) == len(b) and any(g.abs().max() > 0 for g in a)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_bad_real_data_one_line(wan_pipeline, prompts, clips, tmp_path, capsys):
    short = captioned_clips(tmp_path / "short", 3, 16)  # 3 frames, the student takes 5
    small = captioned_clips(tmp_path / "small", 6, 8)  # 8 x 8 pixels, the student's frames are 16 x 16
    for folder, needle in ((short, "3 of 3 clips do not fit the student's 16 x 16 x 5"),
                           (small, "8 x 8 x 6")):
        assert_one_line_error(capsys, real_argv(wan_pipeline, prompts, folder, tmp_path / "out"), f"--data {folder}",
                              needle)
    argv = distill_argv(wan_pipeline, prompts, tmp_path / "out", "--data", str(clips))
    assert_one_line_error(capsys, argv, "--data", "--gen_cls_loss_weight")
