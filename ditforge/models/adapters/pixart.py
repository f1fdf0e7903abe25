"""PixArt-alpha / sigma: diffusers' ``PixArtTransformer2DModel`` (adaLN-single DiT with T5 cross-attention,
learned sigma) conditioned on T5 states and their mask."""

from __future__ import annotations


from ditforge.models.adapters import DiffusersDenoiser
from ditforge.models.adapters.limits import call_default_limit


class PixArtDenoiser(DiffusersDenoiser):
    """``transformer(x, encoder_hidden_states, timestep, added_cond_kwargs, encoder_attention_mask)``: x (B, 4, H/8,
    W/8), t (B,) int64, conditions ``encoder_hidden_states`` (B, L, 4096) T5 states (L = 120 for alpha, 300 for sigma:
    the pipelines' ``max_sequence_length`` default; the transformer cross-attends to any length, and recomputes its
    positions for any size, so its config fixes neither) and ``encoder_attention_mask`` (B, L). Output (B, 8, ...):
    epsilon and the learned-range variance values (PixArt trains with the IDDPM hybrid loss). The 1024px alpha models
    (``sample_size`` 128) also take the image resolution and aspect ratio, computed here from x as the pipeline
    does."""

    family = "pixart"
    pipelines = ("PixArtAlphaPipeline", "PixArtSigmaPipeline")
    component = "transformer"
    block_classes = ("BasicTransformerBlock",)
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds", "encoder_attention_mask": "prompt_attention_mask"}
    # Sample at the trained size (no snapping to the pipeline's aspect-ratio bins); captions as trained (no
    # bs4/ftfy cleaning); the negative prompt comes as embeddings (its default "" would clash with them).
    pipeline_kwargs = {"use_resolution_binning": False, "clean_caption": False, "negative_prompt": None}

    def denoise(self, x, t, encoder_hidden_states, encoder_attention_mask):
        added = {"resolution": None, "aspect_ratio": None}
        if self.transformer.use_additional_conditions:
            h, w = x.shape[-2] * self.vae_scale, x.shape[-1] * self.vae_scale
            added = {"resolution": x.new_tensor([[h, w]]).expand(x.shape[0], 2),
                     "aspect_ratio": x.new_tensor([[h / w]]).expand(x.shape[0], 1)}
        return self.transformer(x, encoder_hidden_states=encoder_hidden_states, timestep=t, added_cond_kwargs=added,
                                encoder_attention_mask=encoder_attention_mask, return_dict=False)[0]

    @classmethod
    def text_limits(cls, pipe):
        return (call_default_limit(pipe),)

    @classmethod
    def encode_prompt(cls, pipe, texts, device):
        embeds, mask, _, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, device=device,
                                                clean_caption=False, max_sequence_length=cls.text_length(pipe))
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}
