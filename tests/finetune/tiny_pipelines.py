"""Tiny random diffusers pipelines of fourteen families, built offline for the fine-tuning, export and sampling tests.

Every builder writes a complete pipeline folder (``model_index.json`` and one subfolder per component) with
diffusers' and transformers' own classes and ``save_pretrained``, and returns its ``Path``. Nothing is downloaded:
the tokenizers are trained here on ``CAPTIONS`` (CLIP: a byte-level BPE learned over the ``tokenizers`` library's
CLIP normaliser and pre-tokenizer, in CLIP's vocabulary layout; T5: a unigram model trained with
``sentencepiece``, with T5's special ids), the weights are random (``torch.manual_seed``): the same files, byte for
byte, every time.

================  =====  ==========  ==================================================  =========================
family            image  latent      text encoders (sequence length x width)             scheduler
================  =====  ==========  ==================================================  =========================
sd                32 px  4 x 8 x 8   CLIP 77 x 32                                        PNDM (SD-1.5), epsilon
sd_v              32 px  4 x 8 x 8   CLIP 77 x 32                                        DDIM (SD-2.1), v_prediction
pixart            32 px  4 x 8 x 8   T5 120 x 48                                         DPM-Solver++ (PixArt)
pixart_sigma      32 px  4 x 8 x 8   T5 300 x 48                                         DPM-Solver++ (PixArt)
sd3               32 px  16 x 8 x 8  CLIP 77 x 32 + CLIP 77 x 48 (pooled 32 + 48), T5     flow-match Euler, shift 3
                                     256 x 96
sdxl              32 px  4 x 8 x 8   CLIP 77 x 32 + CLIP 77 x 48 (pooled 48)              Euler (SDXL), epsilon
dit               32 px  4 x 8 x 8   none (class labels 0..2; null label 1000)           DDIM (DiT's betas)
wan               16 px  16 x T' x   UMT5 512 x 32                                       UniPC on flow sigmas,
                  4k+1   2 x 2                                                           flow_shift 3
                  frames
wan_i2v           16 px  as wan      as wan, + CLIP vision 1025 x 4 (32 px, patch 1)     as wan
cogvideox         32 px  4 x T' x    T5 226 x 32                                         CogVideoX DPM, v, zero
                  8k+1   4 x 4                                                           terminal SNR, SNR shift 3
                  frames
cogvideox_i2v     32 px  as          as cogvideox                                        as cogvideox
                         cogvideox
ltx               32 px  8 x T' x    T5 128 x 32 (+ attention mask)                      flow-match Euler, dynamic
                  4k+1   8 x 8                                                           shift (exp(mu))
                  frames
hunyuan_video     16 px  4 x T' x    Llama 256 x 16 (+ mask; template cropped) + CLIP     flow-match Euler, shift 7
                  4k+1   2 x 2       pooled 8
                  frames
hunyuan_video_i2v 16 px  as          Llava (Llama as hunyuan_video, CLIP vision 576 x 8   as hunyuan_video
                         hunyuan_    at 48 px) 144 image + 252 text x 16 (+ mask) +
                         video       CLIP pooled 8; token_replace (_33ch: latent_concat,
                                     288 image states)
================  =====  ==========  ==================================================  =========================

All image VAEs are ``AutoencoderKL`` with 3 blocks (8, 16, 16 channels): they downsample by 4 (the real ones by 8),
so 32-pixel images have 8 x 8 latents; all image transformers use 2 x 2 patches (16 tokens at 32 px). Wan's
``AutoencoderKLWan`` downsamples by 8 in space and 4 in time (T' = (T - 1) / 4 + 1), as the real one; its
transformer's 1 x 2 x 2 patches give one token per latent frame at 16 px. ``SPECS`` has these numbers per image
family (``IMAGE_SIZE`` the image side alone). Each folder holds 0.7-1.8 MB of float32
safetensors and takes well under a second to build (after the imports).

Quirks the callers need to know:

* PixArt pipelines bin resolutions only for the real sample sizes (32/64/128 latents): call them with
  ``use_resolution_binning=False``; and with ``clean_caption=False`` unless bs4 and ftfy are installed (else
  they log a warning and go on without cleaning).
* ``DiTPipeline`` hard-codes the null class 1000 for guidance, so the DiT's label table has 1001 rows
  (``num_embeds_ada_norm=1000``, as facebook/DiT-XL-2-256 and ``ditforge export``), of which only
  ``num_classes`` (default 3) are named in ``id2label`` (saved in ``model_index.json``, as the real DiT's;
  loading logs "Expected types for id2label: ... got typing.Dict[str, str]": JSON keys are strings).
* SD-2.x and SD3's second CLIP pad with ``"!"`` (id 0), the others with ``<|endoftext|>``, as the real tokenizers.
* The T5 tokenizers are ``T5Tokenizer`` (transformers 5: a ``tokenizers``-backed class) saved as
  ``tokenizer.json``; ``spiece.model`` is saved beside it. The T5 models' ``vocab_size`` is the tokenizer's length
  rounded up to a multiple of 8 (like T5's 32128 for 32100 tokens).
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import numpy as np
import torch

# Training text of every tokenizer (and a source of prompts for the tests).
CAPTIONS = [
    "a dog runs on the grass",
    "a puppy running across a green lawn",
    "a red bicycle leaning against a brick wall",
    "a black cat sleeping on a sofa",
    "two birds sitting on a wire at sunset",
    "a bowl of fruit on a wooden table",
    "a small boat on a calm lake",
    "a snowy mountain under a blue sky",
    "a cup of coffee next to an open book",
    "an old car parked in front of a house",
    "a child flying a kite on the beach",
    "a bowl of soup with bread on the side",
    "a city street at night with bright lights",
    "a horse standing in a foggy field",
    "three apples and a pear on a plate",
    "a yellow flower in a glass vase",
    "a white cloud over a dark forest",
    "a train crossing a stone bridge",
    "a painting of a lighthouse by the sea",
    "a man riding a bike down the road",
    "a woman reading a newspaper in a park",
    "a plate of pasta with tomato sauce",
    "an orange fish swimming in a pond",
    "the moon rising over quiet hills",
    "a wooden chair in an empty room",
    "a group of people walking in the rain",
    "a close up photo of a green leaf",
    "a brown bear catching a fish in a river",
    "colorful balloons floating in the sky",
    "a red apple, a green pear and a yellow banana",
]

_FAMILIES = ("sd", "sd_v", "pixart", "pixart_sigma", "sd3", "sdxl", "dit")
IMAGE_SIZE = dict.fromkeys(_FAMILIES, 32)  # pixels (square); latents are IMAGE_SIZE // 4
LATENT_SIZE = dict.fromkeys(_FAMILIES, 8)
SPECS = {
    "sd": dict(image_size=32, latent_shape=(4, 8, 8), vae_scale_factor=4, text_lengths=(77,), text_widths=(32,)),
    "sd_v": dict(image_size=32, latent_shape=(4, 8, 8), vae_scale_factor=4, text_lengths=(77,), text_widths=(32,)),
    "pixart": dict(image_size=32, latent_shape=(4, 8, 8), vae_scale_factor=4, text_lengths=(120,),
                   text_widths=(48,)),
    "pixart_sigma": dict(image_size=32, latent_shape=(4, 8, 8), vae_scale_factor=4, text_lengths=(300,),
                         text_widths=(48,)),
    # CLIP-L-like, CLIP-G-like (penultimate states 32 + 48 wide, pooled 32 + 48), T5 (96 wide): SD3 concatenates
    # the CLIP states (80), pads them to the T5 width and appends the T5 states: 77 + 256 tokens x 96.
    "sd3": dict(image_size=32, latent_shape=(16, 8, 8), vae_scale_factor=4, text_lengths=(77, 77, 256),
                text_widths=(32, 48, 96), pooled_width=80, joint_attention_dim=96),
    # CLIP-L-like and OpenCLIP-G-like penultimate states concatenated (32 + 48 = 80), the second's pooled output
    "sdxl": dict(image_size=32, latent_shape=(4, 8, 8), vae_scale_factor=4, text_lengths=(77, 77),
                 text_widths=(32, 48), pooled_width=48, cross_attention_dim=80),
    "dit": dict(image_size=32, latent_shape=(4, 8, 8), vae_scale_factor=4, text_lengths=(), text_widths=(),
                num_classes=3, null_class=1000),
}

CLIP_MAX_LENGTH = 77
T5_EXTRA_IDS = 100
# CLIP's pre-tokenizer pattern (as transformers' CLIPTokenizer).
_CLIP_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


# ----------------------------------------------------------------------------------------------------------
# Tokenizers


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP's byte -> printable character table, in CLIP's vocabulary order (printable bytes first)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(symbols):
        if symbols[i:i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


@functools.lru_cache(maxsize=None)
def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE learned on ``CAPTIONS`` after CLIP's normaliser and pre-tokenizer (``tokenizers``'
    objects), in CLIP's vocabulary layout: the 256 byte characters, the same with ``</w>``, one token per merge,
    ``<|startoftext|>``, ``<|endoftext|>`` (last, so the highest id: CLIP's pooling finds eos by argmax too).

    The merges are learned here (the most frequent adjacent pair, at least twice, ties to the smallest pair)
    rather than with ``tokenizers.trainers.BpeTrainer``, which breaks ties between equally frequent pairs in hash
    order and so learns different merges in different processes."""
    from collections import Counter

    from tokenizers import Regex, normalizers, pre_tokenizers

    normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                       normalizers.Lowercase()])
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    counts = Counter(word for caption in CAPTIONS
                     for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(caption)))
    words = {w: (*w[:-1], w[-1] + "</w>") for w in counts}
    merges: list[tuple[str, str]] = []
    while True:
        pairs: Counter = Counter()
        for w, symbols in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += counts[w]
        best = min(pairs, key=lambda p: (-pairs[p], p), default=None)
        if best is None or pairs[best] < 2:
            break
        merges.append(best)
        words = {w: _merge(symbols, best) for w, symbols in words.items()}
    chars = _bytes_to_unicode()
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + [BOS, EOS]
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}, merges  # a merge may rebuild a token: once


def make_clip_tokenizer(pad_token: str = EOS):
    """``CLIPTokenizer`` (BPE above, ``model_max_length`` 77). ``pad_token``: ``<|endoftext|>`` (SD-1.x, CLIP-L)
    or ``"!"`` (SD-2.x, SD3's CLIP-G: id 0)."""
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab_and_merges()
    return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), pad_token=pad_token,
                         model_max_length=CLIP_MAX_LENGTH)


def _proto_fields(buf: bytes):
    """(field number, value) of a serialized protobuf message (enough of the wire format for a sentencepiece
    ModelProto: transformers' own reader needs the protobuf package, which is not installed)."""

    def varint(i):
        out = shift = 0
        while True:
            b = buf[i]
            i += 1
            out |= (b & 0x7F) << shift
            if b < 0x80:
                return out, i
            shift += 7

    i = 0
    while i < len(buf):
        key, i = varint(i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            val, i = varint(i)
        elif wire == 2:
            n, i = varint(i)
            val, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            val, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, val


@functools.lru_cache(maxsize=None)
def t5_spiece_model() -> bytes:
    """A sentencepiece unigram model trained on ``CAPTIONS`` with T5's ids (pad 0, eos 1, unk 2, no bos) and its
    default ``nmt_nfkc`` normalisation; the serialized ``spiece.model``."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CAPTIONS), model_writer=buf, model_type="unigram", vocab_size=160,
        hard_vocab_limit=False, character_coverage=1.0, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>", num_threads=1, minloglevel=2)
    return buf.getvalue()


def make_t5_tokenizer():
    """``T5Tokenizer`` built from ``t5_spiece_model`` as transformers converts a T5 ``spiece.model``: the pieces
    and scores, then ``<extra_id_99>`` .. ``<extra_id_0>``, the model's precompiled normaliser, eos appended."""
    import sentencepiece as spm
    from transformers import T5Tokenizer

    model = t5_spiece_model()
    sp = spm.SentencePieceProcessor(model_proto=model)
    vocab = [(sp.id_to_piece(i), 0.0 if sp.is_control(i) or sp.is_unknown(i) else float(sp.get_score(i)))
             for i in range(sp.get_piece_size())]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(T5_EXTRA_IDS - 1, -1, -1)]
    normalizer = next(v for f, v in _proto_fields(model) if f == 3)  # ModelProto.normalizer_spec
    charsmap = next((v for f, v in _proto_fields(normalizer) if f == 2), None)  # .precompiled_charsmap
    tok = T5Tokenizer(vocab=vocab, extra_ids=T5_EXTRA_IDS, _spm_precompiled_charsmap=charsmap,
                      model_max_length=512)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    return tok


def _round8(n: int) -> int:
    return -(-n // 8) * 8


# ----------------------------------------------------------------------------------------------------------
# Models


def _vae(latent_channels: int = 4, scaling_factor: float = 0.18215, shift_factor: float | None = None,
         quant_conv: bool = True):
    """A 3-block ``AutoencoderKL`` (8, 16, 16 channels): 32-pixel images <-> latent_channels x 8 x 8."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=8, sample_size=32, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=quant_conv, use_post_quant_conv=quant_conv).eval()


def _clip_text(tokenizer, hidden: int, projection: bool, hidden_act: str = "quick_gelu"):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, projection_dim=hidden,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=CLIP_MAX_LENGTH, hidden_act=hidden_act,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _t5_encoder(tokenizer, d_model: int):
    """A T5 v1.1-style encoder (gated GELU, untied head irrelevant: encoder only), 2 layers."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=_round8(len(tokenizer)), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                      is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    return T5EncoderModel(config).eval()


def _umt5_encoder(tokenizer, d_model: int):
    """A UMT5 encoder (Wan's text encoder class: T5 v1.1 layers with a relative-position bias in every layer),
    2 layers."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=_round8(len(tokenizer)), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                        is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    return UMT5EncoderModel(config).eval()


def _save(pipe, path) -> Path:
    """``save_pretrained``, then the tokenizers' source files beside the ``tokenizer.json`` that transformers 5
    writes: ``vocab.json`` + ``merges.txt`` (CLIP; what the real SD folders ship, and all that transformers 4's
    slow ``CLIPTokenizer`` reads) and ``spiece.model`` (T5); an image processor named ``CLIPImageProcessor`` in
    ``model_index.json``."""
    from transformers import CLIPTokenizer, T5Tokenizer

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out), safe_serialization=True)
    for name, component in pipe.components.items():
        if isinstance(component, CLIPTokenizer):
            vocab, merges = clip_vocab_and_merges()
            (out / name / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
            (out / name / "merges.txt").write_text(
                "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
        elif isinstance(component, T5Tokenizer):
            (out / name / "spiece.model").write_bytes(t5_spiece_model())
    if pipe.components.get("image_processor") is not None:
        # transformers 5 without torchvision builds CLIPImageProcessorPil and saves that name; the real folders (and
        # diffusers' loader, which falls back to the Pil class by itself) name CLIPImageProcessor
        index = json.loads((out / "model_index.json").read_text())
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
        (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


# ----------------------------------------------------------------------------------------------------------
# Pipelines

# Scheduler settings of the real checkpoints (their scheduler_config.json, minus library defaults).
SD15_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                      skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1, prediction_type="epsilon")
SD21_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                      clip_sample=False, set_alpha_to_one=False, steps_offset=1, prediction_type="v_prediction")
PIXART_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                        prediction_type="epsilon", algorithm_type="dpmsolver++", solver_order=2,
                        solver_type="midpoint", lower_order_final=True, thresholding=False,
                        use_karras_sigmas=False)
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
SDXL_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                      steps_offset=1, timestep_spacing="leading", prediction_type="epsilon",
                      interpolation_type="linear", use_karras_sigmas=False)
DIT_SCHEDULER = dict(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                     clip_sample=False, set_alpha_to_one=True, steps_offset=0, prediction_type="epsilon",
                     timestep_spacing="leading")


def make_sd(path, prediction_type: str = "epsilon") -> Path:
    """A tiny Stable Diffusion ``StableDiffusionPipeline`` folder.

    Sizes: 32 x 32 RGB images <-> 4 x 8 x 8 latents (VAE downsamples by 4, ``scaling_factor`` 0.18215); the UNet
    (``UNet2DConditionModel``, block channels (16, 32), one cross-attention level plus the mid block,
    ``sample_size`` 8) cross-attends to the CLIP text states: 77 tokens x 32 (``CLIPTextModel``, 2 layers,
    ``CLIPTokenizer`` with ``model_max_length`` 77).

    Args:
        path: the folder to write.
        prediction_type: ``"epsilon"``: SD-1.5-like (``PNDMScheduler`` with SD-1.5's settings, conv ``proj_in``,
            quick-GELU CLIP, pad ``<|endoftext|>``); ``"v_prediction"``: SD-2.1-like (``DDIMScheduler`` with
            SD-2.1's settings, linear ``proj_in``/``proj_out``, per-level head counts, upcast attention, GELU
            CLIP, pad ``"!"``).

    Returns:
        ``Path(path)``.
    """
    from diffusers import DDIMScheduler, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")
    v = prediction_type == "v_prediction"
    tokenizer = make_clip_tokenizer(pad_token="!" if v else EOS)
    text_encoder = _clip_text(tokenizer, 32, projection=False, hidden_act="gelu" if v else "quick_gelu")
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=(2, 4) if v else 2, norm_num_groups=8,
        use_linear_projection=v, upcast_attention=v).eval()
    scheduler = DDIMScheduler(**SD21_SCHEDULER) if v else PNDMScheduler(**SD15_SCHEDULER)
    pipe = StableDiffusionPipeline(vae=_vae(), text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    return _save(pipe, path)


def make_pixart(path, sigma: bool = False) -> Path:
    """A tiny PixArt folder: ``PixArtAlphaPipeline`` (``sigma=False``) or ``PixArtSigmaPipeline``.

    Sizes: 32 x 32 RGB images <-> 4 x 8 x 8 latents (VAE downsamples by 4; ``scaling_factor`` 0.18215 for alpha,
    0.13025 for sigma, as sd-vae-ft-ema and the SDXL VAE); ``PixArtTransformer2DModel`` (``ada_norm_single``,
    2 layers, 2 heads x 16 = 32 wide, 2 x 2 patches: 16 tokens, learned sigma: 8 output channels,
    ``sample_size`` 8, no additional (resolution) conditions) cross-attends to T5 states 48 wide
    (``caption_channels`` 48; ``T5EncoderModel``, 2 layers, sentencepiece ``T5Tokenizer``): 120 tokens for
    alpha, 300 for sigma (the pipelines' ``max_sequence_length`` defaults). Scheduler: ``DPMSolverMultistepScheduler``
    with PixArt's settings (linear betas 1e-4..0.02, 1000 steps, epsilon, DPM-Solver++ order 2).

    Call the pipeline with ``use_resolution_binning=False``: it bins only the real sample sizes.

    Returns:
        ``Path(path)``.
    """
    from diffusers import (DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtSigmaPipeline,
                           PixArtTransformer2DModel)

    tokenizer = make_t5_tokenizer()
    text_encoder = _t5_encoder(tokenizer, 48)
    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=8, num_layers=2, num_attention_heads=2,
        attention_head_dim=16, cross_attention_dim=32, caption_channels=48, attention_bias=True,
        activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False).eval()
    cls = PixArtSigmaPipeline if sigma else PixArtAlphaPipeline
    pipe = cls(tokenizer=tokenizer, text_encoder=text_encoder, vae=_vae(scaling_factor=0.13025 if sigma else 0.18215),
               transformer=transformer, scheduler=DPMSolverMultistepScheduler(**PIXART_SCHEDULER))
    return _save(pipe, path)


def make_sd3(path) -> Path:
    """A tiny Stable Diffusion 3 ``StableDiffusion3Pipeline`` folder.

    Sizes: 32 x 32 RGB images <-> 16 x 8 x 8 latents (VAE downsamples by 4, no quant convs, SD3's
    ``scaling_factor`` 1.5305 and ``shift_factor`` 0.0609); ``SD3Transformer2DModel`` (2 joint blocks, 2 heads x
    16 = 32 wide = ``caption_projection_dim``, 2 x 2 patches: 16 tokens, ``pos_embed_max_size`` 16, i.e. up to
    128-pixel images). Text: two ``CLIPTextModelWithProjection`` (``tokenizer`` pads with ``<|endoftext|>``,
    ``tokenizer_2`` with ``"!"``, as SD3's): 77 tokens x 32 and x 48 (penultimate layer), pooled 32 + 48 =
    ``pooled_projection_dim`` 80; ``T5EncoderModel`` (``tokenizer_3``, sentencepiece): 256 tokens x 96 =
    ``joint_attention_dim``. The prompt states are 77 + 256 = 333 tokens x 96. Scheduler:
    ``FlowMatchEulerDiscreteScheduler(shift=3.0)``.

    Returns:
        ``Path(path)``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    tokenizer, tokenizer_2 = make_clip_tokenizer(EOS), make_clip_tokenizer("!")
    text_encoder = _clip_text(tokenizer, 32, projection=True)
    text_encoder_2 = _clip_text(tokenizer_2, 48, projection=True, hidden_act="gelu")
    tokenizer_3 = make_t5_tokenizer()
    text_encoder_3 = _t5_encoder(tokenizer_3, 96)
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=96, caption_projection_dim=32, pooled_projection_dim=80,
        pos_embed_max_size=16).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
        vae=_vae(16, scaling_factor=1.5305, shift_factor=0.0609, quant_conv=False),
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3)
    return _save(pipe, path)


def make_sdxl(path) -> Path:
    """A tiny Stable Diffusion XL ``StableDiffusionXLPipeline`` folder.

    Sizes: 32 x 32 RGB images <-> 4 x 8 x 8 latents (VAE downsamples by 4, SDXL's ``scaling_factor`` 0.13025);
    the UNet (``UNet2DConditionModel``, block channels (16, 32), cross-attention on the second level and the mid
    block as SDXL's, linear ``proj_in``, ``addition_embed_type`` "text_time": the pooled text (48) and six
    micro-conditioning values embedded 8 wide, ``projection_class_embeddings_input_dim`` 48 + 6 x 8 = 96)
    cross-attends to 77 tokens x 80: the penultimate states of ``CLIPTextModel`` (32 wide, pads with
    ``<|endoftext|>``) and of ``CLIPTextModelWithProjection`` (48, pads with ``"!"``), concatenated, as SDXL's
    CLIP-L and OpenCLIP-G. Scheduler: ``EulerDiscreteScheduler`` with SDXL's settings.

    Returns:
        ``Path(path)``.
    """
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    tokenizer, tokenizer_2 = make_clip_tokenizer(EOS), make_clip_tokenizer("!")
    text_encoder = _clip_text(tokenizer, 32, projection=False)
    text_encoder_2 = _clip_text(tokenizer_2, 48, projection=True, hidden_act="gelu")
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=80, attention_head_dim=(2, 4), norm_num_groups=8, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=96).eval()
    pipe = StableDiffusionXLPipeline(
        vae=_vae(scaling_factor=0.13025), text_encoder=text_encoder, text_encoder_2=text_encoder_2,
        tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet, scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER))
    return _save(pipe, path)


# Wan 2.1 T2V 480p's scheduler_config.json (UniPC on flow sigmas; the 720p model ships flow_shift 5.0).
WAN_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                     flow_shift=3.0, solver_order=2, solver_type="bh2", lower_order_final=True,
                     timestep_spacing="linspace", final_sigmas_type="zero")


def _wan_parts(**transformer: int) -> dict:
    """The components ``make_wan`` and ``make_wan_i2v`` share, as keyword arguments of their pipelines: the T5
    tokenizer, a UMT5 encoder 32 wide, the tiny ``AutoencoderKLWan``, Wan 2.1 480p's scheduler, and a
    ``WanTransformer3DModel`` of 2 layers and 2 heads x 12 with ``transformer`` (``in_channels``, ``image_dim``)
    on top of its config; each model's weights drawn after ``torch.manual_seed(0)``."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    tokenizer = make_t5_tokenizer()
    text_encoder = _umt5_encoder(tokenizer, 32)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    torch.manual_seed(0)
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                  out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                transformer=WanTransformer3DModel(**{**config, **transformer}).eval(),
                scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER))


def make_wan(path, **transformer: int) -> Path:
    """A tiny Wan 2.1 text-to-video ``WanPipeline`` folder, with the configs of diffusers' own
    ``tests/pipelines/wan/test_wan.py``.

    Sizes: videos of 4k + 1 frames x 16 x 16 RGB <-> 16 x (k + 1) x 2 x 2 latents (``AutoencoderKLWan``, base
    width 3, ``dim_mult`` (1, 1, 1, 1), temporal downsampling by 4, spatial by 8; Wan 2.1's 16 ``latents_mean`` /
    ``latents_std``, the class defaults); ``WanTransformer3DModel`` (2 layers, 2 heads x 12 = 24 wide, patches
    1 x 2 x 2: one token per latent frame at 16 px, ``rope_max_seq_len`` 32) cross-attends to UMT5 states 32 wide
    (``UMT5EncoderModel``, 2 layers, the sentencepiece ``T5Tokenizer`` of ``make_t5_tokenizer``), 512 tokens (the
    pipeline's ``max_sequence_length`` default; padded with zeros past each prompt). Scheduler:
    ``UniPCMultistepScheduler`` with Wan 2.1 480p's settings (``WAN_SCHEDULER``: flow prediction, flow sigmas,
    ``flow_shift`` 3). ``transformer``: settings of the transformer's config to change (e.g. heads 16 wide).

    Returns:
        ``Path(path)``.
    """
    from diffusers import WanPipeline

    pipe = WanPipeline(**_wan_parts(**transformer))
    return _save(pipe, path)


def make_wan_i2v(path) -> Path:
    """A tiny Wan 2.1 image-to-video ``WanImageToVideoPipeline`` folder, with the configs of diffusers' own
    ``tests/pipelines/wan/test_wan_image_to_video.py``: ``make_wan``'s tokenizer, UMT5, VAE and scheduler; a
    ``WanTransformer3DModel`` of ``make_wan``'s shape taking 36 = 16 + 4 + 16 input channels (noisy latents, the 4
    mask channels, the first frame's latents) and CLIP image states 4 wide (``image_dim`` 4: ``added_kv_proj_dim``
    cross-attention); ``image_encoder`` a ``CLIPVisionModelWithProjection`` (2 layers, 4 wide, 32 px images in
    1 x 1 patches: 1025 states; the pipeline takes ``hidden_states[-2]``), ``image_processor`` a
    ``CLIPImageProcessor`` (resize and centre crop to 32 px, CLIP's mean / std).

    Returns:
        ``Path(path)``.
    """
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    parts = _wan_parts(in_channels=36, image_dim=4)
    torch.manual_seed(0)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=1)).eval()
    image_processor = CLIPImageProcessor(crop_size=32, size=32)
    pipe = WanImageToVideoPipeline(**parts, image_encoder=image_encoder, image_processor=image_processor)
    return _save(pipe, path)


def make_vace(path) -> Path:
    """A tiny Wan2.1-VACE ``WanVACEPipeline`` folder: ``make_wan``'s tokenizer, UMT5, VAE and scheduler, and a
    ``WanVACETransformer3DModel`` of ``make_wan``'s shape with one VACE block (``vace_layers`` [0]) over the 96
    control channels (16 inactive + 16 reactive latent channels + the 8 x 8 = 64 folded mask pixels, the released
    models' ``vace_in_channels``), its weights drawn after ``torch.manual_seed(0)``.

    Returns:
        ``Path(path)``.
    """
    from diffusers import WanVACEPipeline, WanVACETransformer3DModel

    parts = _wan_parts()
    config = dict(parts["transformer"].config)
    torch.manual_seed(0)
    parts["transformer"] = WanVACETransformer3DModel(
        **{k: config[k] for k in ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels",
                                  "out_channels", "text_dim", "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm",
                                  "qk_norm", "rope_max_seq_len")}, vace_layers=[0], vace_in_channels=96).eval()
    return _save(WanVACEPipeline(**parts), path)


def make_animate(path) -> Path:
    """A tiny Wan2.2-Animate ``WanAnimatePipeline`` folder: ``make_wan``'s tokenizer, UMT5, VAE and scheduler; a
    2-layer ``WanAnimateTransformer3DModel`` 24 wide (36 input channels) with a 16 px motion encoder and a face
    adapter at every second block, and a 2-layer CLIP vision model 4 wide on 32 px images (the pipeline's image
    encoder, 1025 states of 4), the weights of each drawn after ``torch.manual_seed(0)``.

    Returns:
        ``Path(path)``.
    """
    from diffusers import WanAnimatePipeline, WanAnimateTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    parts = {k: v for k, v in _wan_parts().items() if k != "transformer"}
    torch.manual_seed(0)
    parts["transformer"] = WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, latent_channels=16, text_dim=32,
        ffn_dim=32, num_layers=2, image_dim=4, rope_max_seq_len=32, motion_encoder_size=16,
        motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16}, motion_style_dim=8, motion_dim=4,
        motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2, inject_face_latents_blocks=2,
        motion_encoder_batch_size=4).eval()
    torch.manual_seed(0)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                                               image_size=32, intermediate_size=16, patch_size=1)).eval()
    return _save(WanAnimatePipeline(**parts, image_encoder=encoder,
                                    image_processor=CLIPImageProcessor(crop_size=32, size=32)), path)


def make_wan22(path, image_to_video: bool = False) -> Path:
    """A tiny Wan 2.2 A14B folder: ``make_wan``'s parts with two experts, ``transformer`` (high noise) and
    ``transformer_2`` (low noise, its weights drawn after ``torch.manual_seed(1)``), and ``boundary_ratio`` 0.875 (the
    T2V model's; the experts switch at t = 875). ``image_to_video``: a ``WanImageToVideoPipeline`` as Wan 2.2 I2V
    A14B's: transformers of 36 input channels without CLIP image states (``image_dim`` None), no image encoder,
    ``boundary_ratio`` 0.9.

    Returns:
        ``Path(path)``.
    """
    from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

    extra = dict(in_channels=36) if image_to_video else {}
    parts = _wan_parts(**extra)
    torch.manual_seed(1)
    second = WanTransformer3DModel(**{**dict(parts["transformer"].config), **extra}).eval()
    if image_to_video:
        pipe = WanImageToVideoPipeline(**parts, transformer_2=second, boundary_ratio=0.9, image_encoder=None,
                                       image_processor=None)
    else:
        pipe = WanPipeline(**parts, transformer_2=second, boundary_ratio=0.875)
    return _save(pipe, path)


def make_wan22_ti2v(path, image_to_video: bool = False) -> Path:
    """A tiny Wan 2.2 TI2V-5B ``WanPipeline`` folder (``expand_timesteps``: a timestep per token), with the configs of
    diffusers' own ``tests/pipelines/wan/test_wan_22.py`` (``Wan225BPipelineFastTests``): ``make_wan``'s parts with
    Wan 2.2's VAE (``AutoencoderKLWan`` with 48 latent channels, 2 x 2-pixel patches, residual blocks, spatial
    factor 16; ``latents_mean`` 0 and ``latents_std`` 1) and a transformer of 48 input and output channels.
    Videos of 4k + 1 frames x 32 x 32 RGB <-> 48 x (k + 1) x 2 x 2 latents. ``image_to_video``: the same parts as
    a ``WanImageToVideoPipeline`` (TI2V's image-to-video: no image encoder, the first frame's latents given).

    Returns:
        ``Path(path)``.
    """
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline

    parts = _wan_parts(in_channels=48, out_channels=48)
    torch.manual_seed(0)
    parts["vae"] = AutoencoderKLWan(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True,
                                    patch_size=2, latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
                                    dim_mult=[1, 1, 1, 1], num_res_blocks=1, scale_factor_spatial=16,
                                    scale_factor_temporal=4, temperal_downsample=[False, True, True]).eval()
    if image_to_video:
        return _save(WanImageToVideoPipeline(**parts, expand_timesteps=True, image_encoder=None, image_processor=None),
                     path)
    return _save(WanPipeline(**parts, expand_timesteps=True), path)


# CogVideoX-5B's scheduler_config.json (v-prediction DDPM on scaled-linear betas with zero terminal SNR), but with
# CogVideoX-2B's SNR shift (3.0; the 5B's is 1.0), so that the tiny pipeline exercises both of the scheduler's changes
# to the betas' alphas_cumprod.
COGVIDEOX_SCHEDULER = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                           prediction_type="v_prediction", rescale_betas_zero_snr=True, snr_shift_scale=3.0,
                           timestep_spacing="trailing", set_alpha_to_one=True, clip_sample=False, steps_offset=0)


def make_cogvideox(path, image_to_video: bool = False, patch_size_t: int | None = None) -> Path:
    """A tiny CogVideoX 1.0 text-to-video ``CogVideoXPipeline`` folder, with the shapes of diffusers' own
    ``tests/pipelines/cogvideo/test_cogvideox.py`` and the 5B model's rotary positions.

    Sizes: videos of 8k + 1 frames x 32 x 32 RGB <-> 4 x (2k + 1) x 4 x 4 latents (``AutoencoderKLCogVideoX``, 4
    blocks of 8 channels, ``norm_num_groups`` 2, temporal compression 4, spatial 8, ``scaling_factor`` 1.15258426,
    the class default); ``CogVideoXTransformer3DModel`` (2 layers, 2 heads x 16 = 32 wide, ``time_embed_dim`` 8,
    2 x 2 patches: 4 tokens a latent frame, 3-D rotary positions (``use_rotary_positional_embeddings``) on a
    ``sample_height`` x ``sample_width`` = 4 x 4 latent grid, ``sample_frames`` 9) cross-attends (joint attention)
    to T5 states 32 wide (``T5EncoderModel``, 2 layers, the sentencepiece ``T5Tokenizer`` of ``make_t5_tokenizer``),
    226 tokens (the pipeline's ``max_sequence_length`` and the transformer's ``max_text_seq_length``). Scheduler:
    ``CogVideoXDPMScheduler`` with ``COGVIDEOX_SCHEDULER`` (stochastic: each step draws noise from the call's
    generator). ``image_to_video``: a ``CogVideoXImageToVideoPipeline`` as the 5B I2V model's: the transformer takes
    8 = 4 + 4 input channels (the noisy latents, then the first frame's latents padded with zero frames).
    ``patch_size_t`` (2): a CogVideoX 1.5 folder, its transformer configured as THUDM/CogVideoX1.5-5B's (latent frames
    patched in pairs, ``patch_bias`` off; image-to-video: the ``ofs`` embedding, ``ofs_embed_dim`` the
    ``time_embed_dim``, 8, which it is added to), 9 frames' 3 latent frames padded to 4 by its pipeline.

    Returns:
        ``Path(path)``.
    """
    from diffusers import (AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXImageToVideoPipeline,
                           CogVideoXPipeline, CogVideoXTransformer3DModel)

    tokenizer = make_t5_tokenizer()
    text_encoder = _t5_encoder(tokenizer, 32)
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4).eval()
    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=8 if image_to_video else 4, out_channels=4,
        time_embed_dim=8,
        text_embed_dim=32, num_layers=2, sample_width=4, sample_height=4, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=226, use_rotary_positional_embeddings=True,
        **({} if patch_size_t is None else dict(patch_size_t=patch_size_t, patch_bias=False,
                                                 ofs_embed_dim=8 if image_to_video else None))).eval()
    cls = CogVideoXImageToVideoPipeline if image_to_video else CogVideoXPipeline
    pipe = cls(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
               scheduler=CogVideoXDPMScheduler(**COGVIDEOX_SCHEDULER))
    return _save(pipe, path)


# LTX-Video 0.9's scheduler_config.json: Euler on flow sigmas shifted by exp(mu), mu growing with the video's latent
# size (dynamic shifting), the last sigma stretched to 0.1
LTX_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                     base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)


def make_ltx(path, image_to_video: bool = False) -> Path:
    """A tiny LTX-Video ``LTXPipeline`` folder, with the shapes of diffusers' own ``tests/pipelines/ltx/test_ltx.py``;
    with ``image_to_video`` the same parts as an ``LTXImageToVideoPipeline``.

    Sizes: videos of 4k + 1 frames x 32 x 32 RGB <-> 8 x (k + 1) x 8 x 8 latents (``AutoencoderKLLTXVideo``, 4 blocks
    of 8 channels, the first two scaling space and time by 2: 4 x 4 x 4 pixels a latent; the real one 32 x 32 x 8;
    its ``latents_mean`` / ``latents_std`` buffers drawn at random, the real ones are not 0 and 1 either);
    ``LTXVideoTransformer3DModel`` (1 layer, 4 heads x 8 = 32 wide, 1 x 1 x 1 patches: 64 tokens a latent frame)
    cross-attends to T5 states 32 wide (``T5EncoderModel``, 2 layers, the sentencepiece ``T5Tokenizer``), 128
    tokens with their attention mask (the call's ``max_sequence_length``). Scheduler:
    ``FlowMatchEulerDiscreteScheduler`` with ``LTX_SCHEDULER`` (dynamic shifting).

    Returns:
        ``Path(path)``.
    """
    from diffusers import (AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXImageToVideoPipeline, LTXPipeline,
                           LTXVideoTransformer3DModel)

    tokenizer = make_t5_tokenizer()
    text_encoder = _t5_encoder(tokenizer, 32)
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False).eval()
    with torch.no_grad():
        vae.latents_mean.copy_(torch.randn(8) * 0.3)
        vae.latents_std.copy_(0.5 + torch.rand(8))
    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=1, caption_channels=32).eval()
    pipe = (LTXImageToVideoPipeline if image_to_video else LTXPipeline)(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER))
    return _save(pipe, path)


# AutoencoderKLLTXVideo of LTX-Video 0.9.0's structure at 8 to 32 channels (the release's 128 to 512): the stages
# diffusers' converter (``convert_ltx_vae_checkpoint_to_diffusers``) numbers in one flat list a coder, which
# assumes three stages that scale space and time and a width change into the second and third decoder stages
# (encoder: out of the first two); 8 x 8 x 8 pixels a latent. The tiny pipeline's VAE has not that structure.
LTX_VAE_090 = dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 16, 32, 32),
                   decoder_block_out_channels=(8, 16, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
                   decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
                   decoder_spatio_temporal_scaling=(True, True, True, False), decoder_inject_noise=(False,) * 5,
                   upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False,
                   patch_size=1, patch_size_t=1)


# The special tokens of the Llama 3 chat template (and Llava's image token) in HunyuanVideo I2V's prompt template
LLAVA_SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<image>", "\n\n"]


def make_llama_tokenizer(image_to_video: bool = False):
    """A ``PreTrainedTokenizerFast`` standing in for HunyuanVideo's Llama tokenizer: word-level over the words and
    punctuation (``tokenizers``' ``Whitespace`` pre-tokenizer) of ``CAPTIONS`` and of the pipeline's prompt
    template, ``<s>`` prepended as Llama's, ``<pad>`` (id 0) for padding, ``<unk>`` for other words. The template's
    system part comes to 99 of its tokens, so the pipeline's crop of the first 95 (the real tokenizer's count)
    leaves each prompt's tokens in the states, as the real one does.

    ``image_to_video``: for ``HunyuanVideoImageToVideoPipeline``'s template, whose code finds tokens by position and
    by id: ``LLAVA_SPECIALS`` are added tokens, so ``<image>`` is token 5 (the template's ``image_emb_start``, after
    ``<s> <|start_header_id|> system <|end_header_id|> \\n\\n``) and each prompt holds three ``<|end_header_id|>``
    (the pipeline crops the assistant header after the last); and a WordPiece model that splits the template's two
    "relationships" as a subword tokenizer would, so its system part comes to the real tokenizer's 103 tokens
    (``crop_start``). The pipeline's crop then starts at the prompt, as its arithmetic needs: with fewer, an empty
    prompt would keep more states than the others and the two could not be batched."""
    from diffusers.pipelines.hunyuan_video import pipeline_hunyuan_video, pipeline_hunyuan_video_image2video
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    module = pipeline_hunyuan_video_image2video if image_to_video else pipeline_hunyuan_video
    template, added = module.DEFAULT_PROMPT_TEMPLATE["template"], LLAVA_SPECIALS if image_to_video else []
    for token in added:
        template = template.replace(token, " ")
    split = pre_tokenizers.Whitespace()
    words = sorted({w for text in [*CAPTIONS, template] for w, _ in split.pre_tokenize_str(text)})
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    if image_to_video:  # "relationships" (twice in the template) in two pieces: a WordPiece vocabulary
        words = [w for w in words if w != "relationships"] + ["relation", "##ships"]
        model = models.WordPiece({w: i for i, w in enumerate([*specials, *words])}, unk_token="<unk>")
    else:
        model = models.WordLevel({w: i for i, w in enumerate([*specials, *words])}, unk_token="<unk>")
    backend = Tokenizer(model)
    backend.pre_tokenizer = split
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.add_special_tokens([AddedToken(token, normalized=False) for token in added])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=1024)


def _hunyuan_parts(**transformer) -> dict:
    """The components ``make_hunyuan_video`` describes but the Llama encoder: VAE, transformer (``transformer``
    overrides its config), scheduler, CLIP."""
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel

    tokenizer_2 = make_clip_tokenizer()
    text_encoder_2 = _clip_text(tokenizer_2, 8, projection=False)
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
        temporal_compression_ratio=4, mid_block_add_attention=True).eval()
    torch.manual_seed(0)
    transformer = HunyuanVideoTransformer3DModel(**{
        **dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
               num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
               text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)), **transformer}).eval()
    return dict(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)


def _llama_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=_round8(len(tokenizer)), hidden_size=16, intermediate_size=37, num_attention_heads=4,
        num_key_value_heads=4, num_hidden_layers=3, hidden_act="silu", max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)


def make_hunyuan_video(path) -> Path:
    """A tiny HunyuanVideo ``HunyuanVideoPipeline`` folder, with the configs of diffusers' own
    ``tests/pipelines/hunyuan_video/test_hunyuan_video.py``.

    Sizes: videos of 4k + 1 frames x 16 x 16 RGB <-> 4 x (k + 1) x 2 x 2 latents (``AutoencoderKLHunyuanVideo``, 4
    blocks of 8 channels, compression 8 in space and 4 in time, ``scaling_factor`` 0.476986);
    ``HunyuanVideoTransformer3DModel`` (1 double-stream and 1 single-stream block, 1 token-refiner layer, 2 heads x
    10, 1 x 1 x 1 patches, guidance embedding on) reads the states of a 3-layer ``LlamaModel`` 16 wide
    (``make_llama_tokenizer``; the pipeline takes the third-to-last hidden states, crops the prompt template's 95
    first tokens and keeps 256) and the pooled output of a ``CLIPTextModel`` 8 wide (``make_clip_tokenizer``, 77
    tokens). Scheduler: ``FlowMatchEulerDiscreteScheduler(shift=7.0)``, HunyuanVideo's.

    Returns:
        ``Path(path)``.
    """
    from diffusers import HunyuanVideoPipeline
    from transformers import LlamaModel

    tokenizer = make_llama_tokenizer()
    torch.manual_seed(0)
    text_encoder = LlamaModel(_llama_config(tokenizer)).eval()
    pipe = HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, **_hunyuan_parts())
    return _save(pipe, path)


def make_hunyuan_video_i2v(path, condition: str = "token_replace") -> Path:
    """A tiny ``HunyuanVideoImageToVideoPipeline`` folder: ``make_hunyuan_video``'s VAE, CLIP and scheduler; its text
    encoder a ``LlavaForConditionalGeneration`` (``make_llama_tokenizer(image_to_video=True)``; ``make_hunyuan_video``'s
    Llama; a ``CLIPVisionModel`` 8 wide, 2 layers, 48 px images in 2 x 2 patches: 576 patch states, the count the
    pipeline's template reserves, as the real 336 px / 14) with a ``CLIPImageProcessor`` (resize and centre crop to
    48 px). The transformer as ``make_hunyuan_video``'s with ``image_condition_type`` ``condition``: token_replace
    (HunyuanVideo-I2V: 4 input channels, guidance embedding, token-replace blocks) or latent_concat
    (HunyuanVideo-I2V-33ch: 2 x 4 + 1 input channels, no guidance embedding), as diffusers'
    ``tests/pipelines/hunyuan_video/test_hunyuan_image2video.py`` (which uses a shorter template of its own).

    Returns:
        ``Path(path)``.
    """
    from diffusers import HunyuanVideoImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = make_llama_tokenizer(image_to_video=True)
    torch.manual_seed(0)
    text_encoder = LlavaForConditionalGeneration(LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=48, patch_size=2),
        text_config=_llama_config(tokenizer), image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id)).eval()
    replace = condition == "token_replace"
    parts = _hunyuan_parts(in_channels=4 if replace else 9, guidance_embeds=replace, image_condition_type=condition)
    pipe = HunyuanVideoImageToVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer,
                                            image_processor=CLIPImageProcessor(crop_size=48, size=48), **parts)
    return _save(pipe, path)


DIT_LABELS = {0: "red apple, apple", 1: "green pear", 2: "yellow banana, banana"}


def make_dit(path, num_classes: int = 3, num_layers: int = 2, num_heads: int = 2, head_dim: int = 16) -> Path:
    """A tiny class-conditional ``DiTPipeline`` folder.

    Sizes: 32 x 32 RGB images <-> 4 x 8 x 8 latents (VAE downsamples by 4, ``scaling_factor`` 0.18215);
    ``DiTTransformer2DModel`` (``ada_norm_zero``, 2 layers, 2 heads x 16 = 32 wide, 2 x 2 patches: 16 tokens,
    learned sigma: 8 output channels, ``sample_size`` 8; ``num_layers`` x ``num_heads`` x ``head_dim`` may be set, e.g.
    6 x 3 x 64 for ditforge's DiT-T; every block holds block 0's timestep/label embedder, as a DiT converted from
    the official checkpoint does). Its label table has 1001 rows
    (``num_embeds_ada_norm`` 1000 + the dropout row) because ``DiTPipeline`` uses the hard-coded null label
    1000 under guidance; ``id2label`` in ``model_index.json`` names classes ``0 .. num_classes - 1`` (the first
    3 are ``DIT_LABELS``; ``pipe.get_label_ids("banana") == [2]``). Scheduler: ``DDIMScheduler`` with DiT's
    betas (linear 1e-4..0.02, 1000 steps, epsilon). The default size is no registered ditforge size (DiT-T is 6 x 192).

    Returns:
        ``Path(path)``.
    """
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    if not 1 <= num_classes <= 1000:
        raise ValueError(f"num_classes must be in 1..1000 (DiTPipeline's null label is 1000), got {num_classes}")
    torch.manual_seed(0)
    transformer = DiTTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=8, num_layers=num_layers,
        num_attention_heads=num_heads, attention_head_dim=head_dim, num_embeds_ada_norm=1000,
        norm_type="ada_norm_zero").eval()
    for block in transformer.transformer_blocks[1:]:  # one shared embedder, as in every DiT converted from the
        block.norm1.emb.load_state_dict(transformer.transformer_blocks[0].norm1.emb.state_dict())  # official one
    id2label = {i: DIT_LABELS.get(i, f"class {i}") for i in range(num_classes)}
    pipe = DiTPipeline(transformer=transformer, vae=_vae(), scheduler=DDIMScheduler(**DIT_SCHEDULER),
                       id2label=id2label)
    pipe.register_to_config(id2label={str(k): v for k, v in id2label.items()})  # __init__ does not record it
    return _save(pipe, path)


BUILDERS = {
    "sd": make_sd,
    "sd_v": functools.partial(make_sd, prediction_type="v_prediction"),
    "pixart": make_pixart,
    "pixart_sigma": functools.partial(make_pixart, sigma=True),
    "sd3": make_sd3,
    "sdxl": make_sdxl,
    "dit": make_dit,
    "wan": make_wan,
    "wan_i2v": make_wan_i2v,
    "wan22_ti2v": make_wan22_ti2v,
    "wan22_ti2v_i2v": functools.partial(make_wan22_ti2v, image_to_video=True),
    "cogvideox": make_cogvideox,
    "cogvideox_i2v": functools.partial(make_cogvideox, image_to_video=True),
    "cogvideox15": functools.partial(make_cogvideox, patch_size_t=2),
    "cogvideox15_i2v": functools.partial(make_cogvideox, image_to_video=True, patch_size_t=2),
    "ltx": make_ltx,
    "ltx_i2v": functools.partial(make_ltx, image_to_video=True),
    "hunyuan_video": make_hunyuan_video,
    "hunyuan_video_i2v": make_hunyuan_video_i2v,
    "hunyuan_video_i2v_33ch": functools.partial(make_hunyuan_video_i2v, condition="latent_concat"),
}


def write_mp4(path: Path, frames: np.ndarray) -> None:
    """(T, H, W, 3) uint8 frames as an MPEG-4 part 2 video (in every FFmpeg build), 8 fps."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt, stream.bit_rate = frames.shape[2], frames.shape[1], "yuv420p", 4e6
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def smooth_pixels(rng: np.random.Generator, frames: int, h: int, w: int) -> np.ndarray:
    """(frames, h, w, 3) uint8 smooth random frames (noise at 1/8 the size, upsampled bilinearly), which the
    codec keeps."""
    coarse = torch.from_numpy(rng.random((frames, 3, h // 8, w // 8), dtype=np.float32))
    fine = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear")
    return (fine * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def captioned_clips(root, frames: int, side: int):
    """ROOT/: three mp4 clips of ``frames`` frames of ``side`` x ``side`` pixels (smooth random), captioned."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for i in range(3):
        write_mp4(root / f"clip{i}.mp4", smooth_pixels(rng, frames, side, side))
        (root / f"clip{i}.txt").write_text(f"real clip {i}")
    return root
