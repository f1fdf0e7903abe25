"""``VAE.compile`` in ``ditforge sample``'s setting (``sample.video.VideoSampler`` with ``--compile`` and
``--vae_dtype bfloat16``, as ``benchmarks/sample_wan.py``'s rows run it): a tiny ``AutoencoderKLWan`` whose decoder
meets three channel counts (16 latent, 8, 4), compiled with dynamo's ``eager`` backend (inductor's CPU compile takes
minutes; graph breaks, frames and recompiles are dynamo's, whatever the backend)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

pytestmark = pytest.mark.usefixtures("one_thread")

LATENTS = (1, 16, 3, 2, 2)  # 3 latent frames: the first, the second and a later one (three decoder graphs)


def _vae():
    """A tiny Wan VAE (diffusers 0.42.1's ``AutoencoderKLWan``): decoder widths 8 and 4 (``dim_mult`` 1, 2), one
    temporal upsampling; weights after ``torch.manual_seed(0)``."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 2], num_res_blocks=0,
                            temperal_downsample=[True]).eval()


@pytest.fixture
def eager_backend(monkeypatch):
    """``torch.compile`` with dynamo's ``eager`` backend (inductor's options dropped); dynamo's caches reset after."""
    compile_ = torch.compile

    def compile_eager(fn=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("options", "mode")}
        return compile_(fn, **kwargs, backend="eager")

    monkeypatch.setattr(torch, "compile", compile_eager)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decode_counted(decode, latents):
    """(frames, the graphs dynamo compiled during it, its graph breaks)."""
    counters.clear()
    with torch.no_grad():
        frames = decode(latents)
    return frames, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_sampler_decode_compiles_three_graphs_once(eager_backend, caplog):
    """Two calls as ``sample_wan.py``'s ``run_row`` makes them (a warm-up and a timed one: each the guided loop,
    whose compiled blocks trace first, one step here, then the decode of the bf16, channels-last VAE): the first
    decode compiles the decoder's three graphs and nothing else (no graph break, no submodule compiled as a frame
    of its own), the second none; both equal the eager decode of the same latents exactly (the ``eager`` backend
    runs the same operations). (On the CPU this held before ``fullgraph`` too: the H200's break is not
    reproduced here.)"""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    from ditforge.models.adapters.pipeline import Pretrained
    from ditforge.models.adapters.wan import WanDenoiser
    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler

    torch.manual_seed(0)
    tr = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
                               text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32).eval()
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=_vae(), scheduler=sched, transformer=tr)
    pre = Pretrained(Path("-"), "WanPipeline", pipe, WanDenoiser(tr, 8), dict(sched.config))
    sampler = VideoSampler(pre, pre.denoiser, Dist(), SampleConfig(ckpt="-", compile="default",
                                                                   vae_dtype="bfloat16"))
    g = torch.Generator().manual_seed(1)
    cond, uncond = ({"encoder_hidden_states": torch.randn(1, 8, 32, generator=g)} for _ in range(2))
    graphs_compiled = []
    with caplog.at_level(logging.WARNING, logger="ditforge.encoders.vae"):
        for steps in (1, 1):
            latents = sampler.denoise(cond, uncond, LATENTS, 1, steps, 5.0)
            got, graphs, breaks = _decode_counted(sampler.decode, latents)
            assert breaks == 0
            graphs_compiled.append(graphs)
            with torch.compiler.set_stance("force_eager"):
                want = sampler.decode(latents)
            assert got.shape == (1, 3, 5, 4, 4) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert graphs_compiled == [3, 0]
    assert not [r for r in caplog.records if r.name == "ditforge.encoders.vae"]


def test_a_graph_break_runs_the_decoder_eagerly_not_in_pieces(eager_backend, caplog):
    """A graph break in the decoder's own frame (injected in its first convolution's call) would have dynamo
    compile the rest piece by piece (nine graphs and four graph breaks here, before ``fullgraph``; on the H200,
    each up block and causal convolution as a frame of its own, per channel count, until the recompile limit).
    Compiled whole, the first decode's trace fails before anything runs: one warning naming the break, the decoder
    eager from then on (no graph compiled, in this decode or the next), its frames those of the eager decode
    exactly."""
    from ditforge.encoders.vae import VAE
    from ditforge.sample.video_vae import cast_vae

    vae = _vae()
    cast_vae(vae, "bfloat16")
    z = torch.randn(LATENTS, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        want = vae.decode(z).sample
    conv_in = vae.decoder.conv_in

    def breaking(x, cache_x=None, forward=conv_in.forward):
        torch._dynamo.graph_break()
        return forward(x, cache_x)

    conv_in.forward = functools.partial(breaking)
    VAE(vae, frame_factor=1).compile()
    with caplog.at_level(logging.WARNING, logger="ditforge.encoders.vae"):
        for _ in range(2):
            got, graphs, breaks = _decode_counted(lambda x: vae.decode(x).sample, z)
            assert graphs == breaks == 0
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    messages = [r.getMessage() for r in caplog.records if r.name == "ditforge.encoders.vae"]
    assert len(messages) == 1, messages  # the break's reason, and where in the user code it is (this file)
    assert messages[0].startswith("VAE.compile: WanDecoder3d does not compile whole (Call to "
                                  "`torch._dynamo.graph_break()`, at File ") and "test_vae_compile.py" in messages[0]
    assert messages[0].endswith("); it runs eagerly")
