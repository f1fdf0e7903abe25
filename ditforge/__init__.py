"""ditforge: train and sample Diffusion Transformers (DiT)."""

from ditforge.quiet import silence_import_noise

__version__ = "0.1.0"

silence_import_noise()  # before any module of ours imports torchao or bitsandbytes (see ditforge.quiet)
