"""The host side of ``--cpu_offload all`` at SDXL's size: what each pass over 2.57B fp32 parameters in pinned host
memory costs on this machine's cores (the gradient norm as torch computes it and as ``parallel.squared_norm`` does,
the clip multiply that the fused step's ``grad_scale`` replaces, torch's fused CPU AdamW step, and the delayed
update's publishing copy). Measured on a quarter of the size (640M parameters in 1,600 tensors; memory-bound, so the
times scale) and printed as ms at 2.57B.

Usage (repository root): ``PYTHONPATH=. python benchmarks/host_step.py``; needs ~13 GB of host memory.
"""

from __future__ import annotations

import time

import torch

from ditforge.parallel import squared_norm

N, K, SCALE = 640_000_000, 1600, 4


def main() -> None:
    pin = torch.cuda.is_available()

    def tensors():
        return [(torch.empty(N // K).pin_memory() if pin else torch.empty(N // K)).normal_() for _ in range(K)]

    weights, grads = tensors(), tensors()
    for w, g in zip(weights, grads):
        w.grad = g
    opt = torch.optim.AdamW(weights, lr=1e-4, fused=True)
    opt.step()
    masters = [w.clone() for w in weights]

    def ms(f, repeat=3):
        f()
        start = time.perf_counter()
        for _ in range(repeat):
            f()
        return (time.perf_counter() - start) / repeat * SCALE * 1000

    print(f"ms at {N * SCALE / 1e9:.2f}B fp32 parameters in host memory ({K} tensors), {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}:")
    for name, f in [("foreach_norm", lambda: torch._foreach_norm(grads, 2.0)),
                    ("vector_norm each", lambda: [torch.linalg.vector_norm(g) for g in grads]),
                    ("squared_norm (dot each)", lambda: squared_norm(grads)),
                    ("clip mul", lambda: torch._foreach_mul_(grads, 1.0)),
                    ("fused adamw step", opt.step),
                    ("publish copy", lambda: torch._foreach_copy_(weights, masters))]:
        print(f"  {name:26s} {ms(f):7.0f}")


if __name__ == "__main__":
    main()
