"""HunyuanVideo's own fine-tuning tests (``ditforge train --init_from HUNYUAN_FOLDER --data clips``, ``ditforge
sample``), end to end on the CPU with the tiny random pipelines of ``tiny_pipelines.make_hunyuan_video`` (16 px,
5 frames: latents 4 x 2 x 2 x 2): the prompts reach the states; sampling crops the prompt's padding and drops full
masks; image to video (``HunyuanVideoImageToVideoPipeline``, both of its transformers): the prompt encoded with the
image, the loop's start. What every video family shares (first loss, resume, export, LoRA file) is in
test_video_families.py, what every image-to-video family shares (first loss, sampling like the pipeline, the sampled
prompt encoded with the image) in test_i2v_families.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ditforge import cli
from families import VIDEO, assert_one_line_error  # tests/finetune is on sys.path

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES = VIDEO["hunyuan_video"].size, VIDEO["hunyuan_video"].frames


def test_prompts_reach_the_states(hunyuan_video_pipeline):
    """Two captions of a batch encode differently (the template's crop leaves their tokens)."""
    import diffusers

    pipe = diffusers.HunyuanVideoPipeline.from_pretrained(str(hunyuan_video_pipeline), local_files_only=True)
    with torch.no_grad():
        embeds, _, mask = pipe.encode_prompt(["a dog runs on the grass", "a red bicycle"], device="cpu")
    assert not torch.equal(embeds[0][mask[0].bool()][-3:], embeds[1][mask[1].bool()][-3:])


@contextlib.contextmanager
def _joint_masks(length: int):
    """The ``attn_mask`` of every SDPA call over ``length`` tokens (the joint video + text attention) meanwhile."""
    import torch.nn.functional as F

    masks, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if (args[0] if args else kwargs["query"]).shape[-2] == length:
            masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield masks
    finally:
        F.scaled_dot_product_attention = sdpa


def test_sampling_crops_the_prompt_padding_and_unmasks_the_joint_attention(hunyuan_video_pipeline, video_runs,
                                                                          tmp_path, capsys):
    """``ditforge sample --cfg_scale 6`` of the full run (the pipeline's call is compared in test_video_families.py)
    crops the prompt's padding and runs the joint attention unmasked: no SDPA call over the video and the kept text
    tokens gets a mask; ``--quantized_attention`` is one line (the 8-bit kernel takes heads 32, 64 or 128 wide)."""
    import diffusers

    pipe = diffusers.HunyuanVideoPipeline.from_pretrained(str(hunyuan_video_pipeline), local_files_only=True)
    prompt, npz = "a rabbit on a green hill", tmp_path / "s.npz"
    common = ["sample", "--ckpt", str(video_runs("hunyuan_video")["full"]), "--prompt", prompt, "--num_sampling_steps",
              "4", "--cfg_scale", "6", "--out", str(tmp_path / "clip.mp4"), "--device", "cpu"]
    with torch.no_grad():
        kept = int(pipe.encode_prompt([prompt], device="cpu")[2].sum())
    with _joint_masks(8 + kept) as masks:  # 2 x 2 x 2 latent tokens + the prompt's, cropped: no mask
        assert cli.main([*common, "--save_npz", str(npz)]) == 0
    assert len(masks) == 4 * 2 and all(m is None for m in masks)  # 4 steps x (one double, one single block)
    capsys.readouterr()  # the 8-bit kernel takes heads 32, 64 or 128 wide
    assert_one_line_error(capsys, [*common, "--quantized_attention"], "--quantized_attention",
                          "HunyuanVideoTransformer3DModel's are 10")


@pytest.mark.parametrize("family, condition", [("hunyuan_video_i2v", "token_replace"),
                                               ("hunyuan_video_i2v_33ch", "latent_concat")])
def test_image_to_video_prompt_and_start(family, condition, request):
    """``HunyuanVideoImageToVideoPipeline``, both transformers (their first loss and sampling like the pipeline are in
    test_i2v_families.py): the Llava states carry the image (two first frames give two encodings of one prompt).
    The tiny videos barely depend on the image, so its two uses are checked on their own: the loop's start equals
    ``prepare_latents``' (0.999 noise + 0.001 image latents, 1e-6), and a batch of a prompt longer than the 256
    tokens and a short one encodes as each alone."""
    import diffusers
    import numpy as np
    from PIL import Image

    from ditforge.models.adapters.hunyuan import HunyuanVideoI2VDenoiser

    pipe = diffusers.HunyuanVideoImageToVideoPipeline.from_pretrained(str(request.getfixturevalue(f"{family}_pipeline")),
                                                                      local_files_only=True)
    with torch.no_grad():
        embeds = [pipe.encode_prompt(image=[Image.new("RGB", (16, 16), color)], prompt=["a red bicycle"],
                                     device="cpu")[0] for color in ((0, 0, 0), (200, 30, 90))]
    assert not torch.allclose(*embeds)
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
              for i in range(2)]
    first = pipe.video_processor.preprocess(images[0], SIZE, SIZE)
    with torch.no_grad():
        start, _ = pipe.prepare_latents(first, 1, 4, SIZE, SIZE, FRAMES, torch.float32, "cpu",
                                        torch.Generator().manual_seed(5), None, condition)
        noise = torch.randn(start.shape, generator=torch.Generator().manual_seed(5))
        ours = HunyuanVideoI2VDenoiser.start(noise, HunyuanVideoI2VDenoiser.encode_image(pipe, first, FRAMES))
        torch.testing.assert_close(ours, start, rtol=0, atol=1e-6)
        texts = [" ".join(["a dog runs on the grass"] * 60), "a red bicycle"]  # 360 words, and 3
        both = HunyuanVideoI2VDenoiser.encode_prompt(pipe, texts, "cpu", images=images)
        for i in range(2):
            alone = HunyuanVideoI2VDenoiser.encode_prompt(pipe, texts[i:i + 1], "cpu", images=images[i:i + 1])
            assert all(torch.equal(both[k][i], alone[k][0]) for k in alone)


def test_sampling_crops_the_text_padding_and_drops_full_masks(monkeypatch):
    """``trim_padding`` crops the text states past the last kept token, and with the masks then full the joint
    attention runs without one (``unmask_full_attention``): the output of a HunyuanVideo transformer with heads 32
    wide on fresh random latents equals its output with the padded, masked states (1e-5 of its largest magnitude,
    fp32), and no joint SDPA call (over the video and text tokens; the token refiner's over the text alone calls
    PyTorch itself) gets a mask. Routed as ``--quantized_attention`` routes (here to exact attention), the two joint
    calls (one double-, one single-stream block) reach the route with the cropped token count, the output unchanged.
    With two rows of different lengths the masks stay (not full) and nothing is routed."""
    import torch.nn.functional as F
    from diffusers import HunyuanVideoTransformer3DModel

    from ditforge.models.adapters.dispatch import route_self_attention, unmask_full_attention
    from ditforge.models.adapters.hunyuan import HunyuanVideoDenoiser

    torch.manual_seed(0)
    denoiser = HunyuanVideoDenoiser(HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(8, 12, 12)).eval())
    g = torch.Generator().manual_seed(7)
    x, t = torch.randn(1, 4, 2, 2, 2, generator=g), torch.rand(1, generator=g) * 1000
    mask = torch.arange(256)[None] < 9
    cond = {"encoder_hidden_states": torch.randn(1, 256, 16, generator=g), "encoder_attention_mask": mask,
            "pooled_projections": torch.randn(1, 8, generator=g)}
    masks, routed, sdpa = [], [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if (args[0] if args else kwargs["query"]).shape[-2] in (8 + 256, 8 + 9):  # joint: 8 video + the text tokens
            masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    def exact(q, k, v, scale=None):
        routed.append(q.shape)
        return sdpa(*(a.transpose(1, 2) for a in (q, k, v)), scale=scale).transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        padded = denoiser.denoise(x, t, **cond)
        assert len(masks) == 2 and all(m is not None for m in masks)
        trimmed, full = denoiser.trim_padding(cond)
        assert full and trimmed["encoder_hidden_states"].shape[1] == 9
        markers = unmask_full_attention(denoiser.inner)
        for marker in markers:
            marker.full = full
        masks.clear()
        out = denoiser.denoise(x, t, **trimmed)
        assert len(markers) == 2 and masks == [None, None]
        assert (out - padded).abs().max() <= 1e-5 * padded.abs().max()
        # the two joint attentions, and the token refiner's (its processor calls PyTorch itself; its call carries the
        # text mask, so it stays PyTorch's: two routed calls below)
        assert route_self_attention(denoiser.inner, exact, (32,)) == 3
        masks.clear()
        out = denoiser.denoise(x, t, **trimmed)
        assert routed == [torch.Size([1, 8 + 9, 2, 32])] * 2 and masks == []
        assert (out - padded).abs().max() <= 1e-5 * padded.abs().max()
        two = {k: torch.cat([v, v]) for k, v in cond.items()}
        two["encoder_attention_mask"] = torch.cat([mask, torch.arange(256)[None] < 4])
        trimmed, full = denoiser.trim_padding(two)
        assert not full and trimmed["encoder_hidden_states"].shape[1] == 9
        for marker in markers:
            marker.full = full
        routed.clear()
        denoiser.denoise(torch.cat([x, x]), torch.cat([t, t]), **trimmed)
        assert routed == [] and len(masks) == 2 and all(m is not None for m in masks)

