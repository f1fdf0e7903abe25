"""Frozen encoders around the denoiser: the image/video autoencoder (diffusers ``AutoencoderKL`` or the identity
for pixel space) and the caption encoder (Hugging Face transformers; all-MiniLM-L6-v2 by default).

Both load from local folders only and import diffusers / transformers lazily, when first loaded.
"""

from ditforge.encoders.text import TextEncoder, load_text_encoder, pad_states
from ditforge.encoders.vae import VAE, IdentityVAE, load_vae

__all__ = ["TextEncoder", "load_text_encoder", "pad_states", "VAE", "IdentityVAE", "load_vae"]
