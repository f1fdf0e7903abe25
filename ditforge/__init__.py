"""ditforge: train and sample Diffusion Transformers (DiT)."""

__version__ = "0.1.0"
