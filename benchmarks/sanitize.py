"""Memory checks of the paths that ran when one process measured every sequence-parallel variant and died with a
CUDA illegal memory access (2x H200, 2026-11-23; issue 20), on one GPU, at the same shapes:

1. the Triton adaLN kernels (LayerNorm + modulate, gated residual), forward and backward, at 16k, 32k and 64k
   tokens of width 1152 (vDiT-XL), bf16;
2. every sequence-parallel attention variant (``SequenceShard``) over a group of one, forward and backward, at
   32k tokens, 16 heads of 72 (what the benchmark's layer rows run), and ring attention with padding keys at
   16k tokens (one rank's shard of 32k over 2 GPUs);
3. the benchmark's model rows (``sequence_parallel.run``: vDiT-XL/122 under FSDP, fused adaLN kernels, fast
   attention, fused AdamW) at 32k tokens with 4 of the 28 blocks, for each variant, one after another in this
   process, as the failing run did.

Run under compute-sanitizer with PyTorch's caching allocator off, so that every tensor is its own allocation and
an access past its end is seen (inside the cache's big segments memcheck sees nothing):

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        compute-sanitizer --tool memcheck --report-api-errors no python3 benchmarks/sanitize.py

Prints one line per check; compute-sanitizer prints its error count at exit. Under memcheck with the cache off the
model rows run out of memory (memcheck's own bookkeeping per allocation): run them with ``--parts model`` and the
cache on, where an access outside every segment is still caught, one ``--variants`` per process (under memcheck
the memory of one row is not all returned before the next).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import sequence_parallel as bench  # noqa: E402

from ditforge.ops.fused import gated_residual, layernorm_modulate  # noqa: E402
from ditforge.parallel.mesh import Dist  # noqa: E402
from ditforge.parallel.sequence.ring import ring_attention  # noqa: E402
from ditforge.parallel.sequence.shard import SequenceShard  # noqa: E402

VARIANTS = ("fastseq", "fastseq_kv", "ulysses", "ring")


def check(name: str, fn) -> None:
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    print(f"ok {name} ({time.perf_counter() - start:.1f} s)", flush=True)


def adaln(tokens: int, device: torch.device) -> None:
    g = torch.Generator(device).manual_seed(tokens)
    x, y = (torch.randn(1, tokens, 1152, generator=g, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    shift, scale, gate = (torch.randn(1, 1152, generator=g, device=device, dtype=torch.bfloat16, requires_grad=True)
                          for _ in range(3))
    out = layernorm_modulate(x, shift, scale)
    res = gated_residual(x, y, gate)
    (out.float().square().mean() + res.float().square().mean()).backward()


def attention(variant: str, tokens: int, device: torch.device) -> None:
    from ditforge.models.layers import Attention

    layer = Attention(1152, 16).to(device, torch.bfloat16)
    x = torch.randn(1, tokens, 1152, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = SequenceShard(dist.group.WORLD, variant, 16, dist.group.WORLD).attention(x, layer.project)
    out.float().square().mean().backward()


def padded_ring(tokens: int, device: torch.device) -> None:
    q, k, v = (torch.randn(1, 16, tokens, 72, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    valid = torch.ones(1, tokens, dtype=torch.bool, device=device)
    valid[:, tokens - tokens // 5:] = False
    ring_attention(q, k, v, valid, dist.group.WORLD).float().square().mean().backward()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="kernels,attention,model", help="which checks: kernels,attention,model")
    parser.add_argument("--variants", default=",".join(("none", *VARIANTS)), help="the model rows' variants")
    args = parser.parse_args()
    parts = args.parts.split(",")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, caching allocator "
          f"{'off' if os.environ.get('PYTORCH_NO_CUDA_MEMORY_CACHING') else 'on'}", flush=True)
    if "kernels" in parts:
        for tokens in (16384, 32768, 65536):
            check(f"adaLN Triton kernels, {tokens} tokens", lambda: adaln(tokens, device))
    if "attention" in parts:
        for variant in VARIANTS:
            check(f"{variant} attention layer, 32768 tokens", lambda: attention(variant, 32768, device))
        # 16k: a rank's shard at 32k tokens over 2 GPUs (with padding the ring scores its blocks unfused: 16 GiB)
        check("ring attention with padding keys, 16384 tokens", lambda: padded_ring(16384, device))
    if "model" not in parts:
        dist.destroy_process_group()
        return

    create = bench.create_model

    def four_blocks(*args, **kwargs):
        model = create(*args, **kwargs)
        model.blocks = model.blocks[:4]
        return model

    bench.create_model = four_blocks
    mesh = bench.init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    d = Dist(rank=0, world_size=1, local_rank=0, device=device, mesh=mesh, sp_mesh=None)
    for variant in args.variants.split(","):
        check(f"model rows {variant}, 32768 tokens, 4 blocks",
              lambda: print(bench.run(d, variant, 32768, steps=1, warmup=0), flush=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
