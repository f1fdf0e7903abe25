"""The tiny pipeline folders of ``tiny_pipelines``: each loads offline with its family's pipeline class and with
``DiffusionPipeline``, holds the documented components, sizes and scheduler settings, tokenizes like its
tokenizer's source (sentencepiece for T5, the trained BPE for CLIP), encodes prompts (and Wan I2V's images) to the
documented shapes and generates finite images (Wan: videos) of the documented size in 2 steps; the builders are
deterministic."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tiny_pipelines import BUILDERS, CAPTIONS, SPECS, clip_vocab_and_merges, t5_spiece_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = list(SPECS)
WAN_FAMILIES = ["wan", "wan_i2v"]  # videos: not in SPECS (an image table)
PIPELINE_CLASS = {"wan": "WanPipeline", "wan_i2v": "WanImageToVideoPipeline","sd": "StableDiffusionPipeline", "sd_v": "StableDiffusionPipeline",
                  "pixart": "PixArtAlphaPipeline", "pixart_sigma": "PixArtSigmaPipeline",
                  "sd3": "StableDiffusion3Pipeline", "sdxl": "StableDiffusionXLPipeline", "dit": "DiTPipeline"}
SCHEDULER = {"sd": ("PNDMScheduler", "epsilon"), "sd_v": ("DDIMScheduler", "v_prediction"),
             "pixart": ("DPMSolverMultistepScheduler", "epsilon"),
             "pixart_sigma": ("DPMSolverMultistepScheduler", "epsilon"),
             "sd3": ("FlowMatchEulerDiscreteScheduler", None), "sdxl": ("EulerDiscreteScheduler", "epsilon"),
             "dit": ("DDIMScheduler", "epsilon")}
PROMPT = "a dog runs on the grass"

_loaded: dict = {}


def _folder(request, family):
    return request.getfixturevalue(f"{family}_pipeline")


def _pipe(request, family):
    """The folder loaded with its family's class (once per module), progress bars off."""
    if family not in _loaded:
        cls = getattr(diffusers, PIPELINE_CLASS[family])
        pipe = cls.from_pretrained(str(_folder(request, family)), local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        _loaded[family] = pipe
    return _loaded[family]


def _tree_digest(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_offline(request, family):
    folder = _folder(request, family)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINE_CLASS[family]
    weights = sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
    assert 0 < weights < 2 * 2**20

    pipe = _pipe(request, family)
    assert type(pipe).__name__ == PIPELINE_CLASS[family]
    generic = diffusers.DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    assert type(generic) is type(pipe) and generic.components.keys() == pipe.components.keys()

    name, prediction = SCHEDULER[family]
    assert type(pipe.scheduler).__name__ == name
    if prediction is not None:
        assert pipe.scheduler.config.prediction_type == prediction
    spec = SPECS[family]
    scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)  # as the pipelines compute vae_scale_factor
    assert scale == spec["vae_scale_factor"] == getattr(pipe, "vae_scale_factor", scale) == 4
    assert pipe.vae.config.latent_channels == spec["latent_shape"][0]
    denoiser = pipe.unet if family.startswith("sd") and family != "sd3" else pipe.transformer
    assert denoiser.config.sample_size * scale == spec["image_size"]
    assert denoiser.config.in_channels == spec["latent_shape"][0]
    if family in ("pixart", "pixart_sigma", "dit"):  # learned sigma
        assert denoiser.config.out_channels == 2 * denoiser.config.in_channels
    if family == "sd3":
        assert pipe.scheduler.config.shift == 3.0
        assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (1.5305, 0.0609)
    if family == "sdxl":  # pooled text + 6 micro-conditioning values, each embedded addition_time_embed_dim wide
        cfg = pipe.unet.config
        assert cfg.addition_embed_type == "text_time" and cfg.cross_attention_dim == spec["cross_attention_dim"]
        assert cfg.projection_class_embeddings_input_dim == spec["pooled_width"] + 6 * cfg.addition_time_embed_dim
    if family == "dit":
        assert pipe.labels == {"apple": 0, "banana": 2, "green pear": 1, "red apple": 0, "yellow banana": 2}
        assert pipe.get_label_ids(["banana", "green pear"]) == [2, 1]
        assert pipe.transformer.config.num_embeds_ada_norm == 1000  # DiTPipeline's null label exists


@pytest.mark.parametrize("family", ["sd", "sd_v", "sd3", "sdxl"])
def test_clip_tokenizers(request, family):
    pipe = _pipe(request, family)
    toks = [pipe.tokenizer] + ([pipe.tokenizer_2] if family in ("sd3", "sdxl") else [])
    pads = {"sd": ["<|endoftext|>"], "sd_v": ["!"], "sd3": ["<|endoftext|>", "!"], "sdxl": ["<|endoftext|>", "!"]}[family]
    for tok, pad in zip(toks, pads):
        assert type(tok).__name__ == "CLIPTokenizer" and tok.model_max_length == 77
        assert tok.pad_token == pad and (pad != "!" or tok.pad_token_id == 0)
        for caption in CAPTIONS[:5]:
            ids = tok(caption).input_ids
            assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id == len(tok) - 1
            assert tok.unk_token_id not in ids[1:-1]
            assert tok.decode(ids, skip_special_tokens=True) == caption
        batch = tok([PROMPT], padding="max_length", max_length=77, truncation=True, return_tensors="pt")
        assert batch.input_ids.shape == (1, 77)
    # the vocabulary files beside tokenizer.json describe the same tokenizer
    folder = _folder(request, family) / "tokenizer"
    from transformers import CLIPTokenizer

    plain = CLIPTokenizer(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    assert plain(CAPTIONS).input_ids == pipe.tokenizer(CAPTIONS).input_ids


@pytest.mark.parametrize("family", WAN_FAMILIES)
def test_wan_loads_offline(request, family):
    """The documented Wan components: ``AutoencoderKLWan`` (z_dim 16, 8x in space, 4x in time, Wan 2.1's 16
    latents_mean / latents_std), a ``WanTransformer3DModel`` with 1 x 2 x 2 patches taking 16 channels (T2V) or
    36 = 16 + 4 + 16 and 4-wide image states (I2V), UMT5 32 wide, and UniPC on flow sigmas with flow_shift 3; I2V
    also a CLIP vision model and image processor (named ``CLIPImageProcessor`` in model_index.json)."""
    folder = _folder(request, family)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINE_CLASS[family]
    assert 0 < sum(p.stat().st_size for p in folder.rglob("*.safetensors")) < 2 * 2**20
    pipe = _pipe(request, family)
    generic = diffusers.DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    assert type(generic) is type(pipe) and generic.components.keys() == pipe.components.keys()
    vae = pipe.vae.config
    assert (vae.z_dim, vae.scale_factor_spatial, vae.scale_factor_temporal) == (16, 8, 4)
    assert len(vae.latents_mean) == len(vae.latents_std) == 16
    sched = pipe.scheduler.config
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    assert (sched.prediction_type, sched.use_flow_sigmas, sched.flow_shift) == ("flow_prediction", True, 3.0)
    t = pipe.transformer.config
    assert tuple(t.patch_size) == (1, 2, 2) and t.out_channels == 16 and t.text_dim == 32
    assert pipe.text_encoder.config.d_model == 32 and type(pipe.text_encoder).__name__ == "UMT5EncoderModel"
    if family == "wan":
        assert t.in_channels == 16 and t.image_dim is None
    else:
        assert t.in_channels == 36 and t.image_dim == 4
        assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
        assert type(pipe.image_encoder).__name__ == "CLIPVisionModelWithProjection"
        assert pipe.image_processor.crop_size["height"] == pipe.image_encoder.config.image_size == 32


@pytest.mark.parametrize("family", WAN_FAMILIES)
def test_wan_states(request, family):
    """UMT5 states of ``encode_prompt`` at the call's 512 tokens, zero past the prompt's; I2V's image states
    (the CLIP vision model's second-to-last hidden states): 1 + 32 x 32 tokens, 4 wide."""
    pipe = _pipe(request, family)
    with torch.no_grad():
        states, _ = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False, max_sequence_length=512)
        n = len(pipe.tokenizer(PROMPT).input_ids)
        assert states.shape == (1, 512, 32)
        assert states[0, :n].abs().amax(-1).min() > 0 and not states[0, n:].any()
        if family == "wan_i2v":
            from PIL import Image

            image = pipe.encode_image(Image.new("RGB", (16, 16), (200, 30, 30)), "cpu")
            assert image.shape == (1, 1025, 4) and torch.isfinite(image).all()


@pytest.mark.parametrize("family", WAN_FAMILIES)
def test_wan_two_step_video(request, family):
    """2 steps give a finite 5-frame 16 px video (I2V from a 16 px image)."""
    from PIL import Image

    pipe = _pipe(request, family)
    kwargs = dict(prompt=PROMPT, num_inference_steps=2, output_type="np", height=16, width=16, num_frames=5,
                  generator=torch.Generator().manual_seed(0))
    if family == "wan_i2v":
        kwargs["image"] = Image.new("RGB", (16, 16), (200, 30, 30))
    out = pipe(**kwargs).frames
    assert isinstance(out, np.ndarray) and out.shape == (1, 5, 16, 16, 3)
    assert np.isfinite(out).all() and out.min() >= 0 and out.max() <= 1 and out.std() > 0


@pytest.mark.parametrize("family", ["pixart", "pixart_sigma", "sd3", "wan"])
def test_t5_tokenizer(request, family):
    import sentencepiece as spm

    pipe = _pipe(request, family)
    tok = pipe.tokenizer_3 if family == "sd3" else pipe.tokenizer
    assert type(tok).__name__ == "T5Tokenizer"
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    sub = "tokenizer_3" if family == "sd3" else "tokenizer"
    sp = spm.SentencePieceProcessor(model_file=str(_folder(request, family) / sub / "spiece.model"))
    assert (_folder(request, family) / sub / "spiece.model").read_bytes() == t5_spiece_model()
    assert len(tok) == sp.get_piece_size() + 100  # + <extra_id_99> .. <extra_id_0>
    assert tok.convert_tokens_to_ids("<extra_id_0>") == len(tok) - 1
    for caption in [*CAPTIONS, "Ünïcode  ＡＢＣ ½ and an unseen word: xylophone!"]:
        ids = tok(caption).input_ids
        assert ids == sp.encode(caption) + [1]
    assert tok.decode(tok(PROMPT).input_ids, skip_special_tokens=True) == PROMPT
    encoder = pipe.text_encoder_3 if family == "sd3" else pipe.text_encoder
    assert encoder.config.vocab_size >= len(tok)


@pytest.mark.parametrize("family", ["sd", "pixart", "pixart_sigma", "sd3", "sdxl"])
def test_prompt_states(request, family):
    pipe = _pipe(request, family)
    spec = SPECS[family]
    with torch.no_grad():
        if family == "sd":
            states, _ = pipe.encode_prompt(PROMPT, "cpu", 1, False)
            assert states.shape == (1, spec["text_lengths"][0], spec["text_widths"][0])
        elif family == "sd3":
            states, _, pooled, _ = pipe.encode_prompt(PROMPT, None, None, do_classifier_free_guidance=False)
            assert states.shape == (1, 77 + 256, spec["joint_attention_dim"])
            assert pooled.shape == (1, spec["pooled_width"])
        elif family == "sdxl":
            states, _, pooled, _ = pipe.encode_prompt(PROMPT, device="cpu", do_classifier_free_guidance=False)
            assert states.shape == (1, 77, spec["cross_attention_dim"]) == (1, 77, sum(spec["text_widths"]))
            assert pooled.shape == (1, spec["pooled_width"])
        else:
            states, mask, _, _ = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False, clean_caption=False)
            assert states.shape == (1, spec["text_lengths"][0], spec["text_widths"][0])
            assert mask.shape == (1, spec["text_lengths"][0]) and mask.sum() == len(pipe.tokenizer(PROMPT).input_ids)
    assert torch.isfinite(states).all() and states.abs().max() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_two_step_generation(request, family):
    pipe = _pipe(request, family)
    kwargs = dict(num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
    if family == "dit":
        out = pipe(class_labels=[0, 1], **kwargs).images  # guidance 4: uses the null label 1000
        n = 2
    else:
        if family.startswith("pixart"):  # binning knows the real sample sizes only; cleaning needs bs4 + ftfy
            kwargs.update(use_resolution_binning=False, clean_caption=False)
        out = pipe(prompt=PROMPT, **kwargs).images
        n = 1
    size = SPECS[family]["image_size"]
    assert isinstance(out, np.ndarray) and out.shape == (n, size, size, 3)
    assert np.isfinite(out).all() and out.min() >= 0 and out.max() <= 1 and out.std() > 0


@pytest.mark.parametrize("family", FAMILIES + WAN_FAMILIES)
def test_builders_deterministic(request, family, tmp_path):
    clip_vocab_and_merges.cache_clear()  # tokenizers trained again too
    t5_spiece_model.cache_clear()
    again = BUILDERS[family](tmp_path / "again")
    assert _tree_digest(again) == _tree_digest(_folder(request, family))
