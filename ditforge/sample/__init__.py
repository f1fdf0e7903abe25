"""``ditforge sample``: load a checkpoint (``load``), draw guided samples for class labels or text prompts
(``loops``), decode them with the run's VAE, and write a PNG grid, an MP4 + GIF per video sample, or an .npz
(``write``); ``command`` checks the settings and picks the way to run."""

from ditforge.sample.command import sample
from ditforge.sample.load import SampleConfig, load_model
from ditforge.sample.loops import CompiledModel, prepare_model, use_sampling_gemm_settings

__all__ = ["sample", "SampleConfig", "load_model", "prepare_model", "use_sampling_gemm_settings", "CompiledModel"]
