"""Host RAM and time to load a single-file transformer (issue 63): ditforge's reader
(``ditforge.models.adapters.single_file.load_component``, tensor by tensor) beside diffusers'
``WanTransformer3DModel.from_single_file(file, config=folder, subfolder="transformer")``, on random weights of a
Wan transformer config written here by hand.

    PYTHONPATH=. python benchmarks/single_file.py --model 1.3b --layers 6        # CPU, a few hundred MB
    PYTHONPATH=. python benchmarks/single_file.py --model 14b --dir /scratch     # the 14B row (about 28 GB bf16)

Configs (Wan-AI's Wan2.1 config.json files, diffusers' names): ``1.3b``: dim 1536 (12 heads of 128), 30 layers, FFN
8960; ``14b``: dim 5120 (40 heads of 128), 40 layers, FFN 13824; both in / out 16 channels, text_dim 4096, freq_dim
256, patch (1, 2, 2). ``--layers`` keeps the first N blocks (the file's size scales with them).

Files: the ComfyUI layout (``model.diffusion_model.`` + the original keys, ``ditforge.weights.original.to_original``)
in bf16, and in float8 e4m3 (every 2-D weight of the blocks, as ComfyUI's ``*_fp8_e4m3fn`` files; the rest bf16).
Rows: each file loaded by ``ditforge`` into bf16, the fp8 file also with its float8 kept (``ditforge_keep_fp8``,
what ``--fp8_base`` does), and by ``from_single_file`` into bf16. Each load runs in a fresh interpreter and then
reads every tensor (moves the model to the GPU where there is one; else sums its bytes): a tensor read from a
file stays memory-mapped until used, so without it the pages would not count. ``peak_rss_gb``: ``ru_maxrss`` after
that minus the one before the load (imports, the config folder read); ``anon_gb``: the growth of anonymous memory
(``RssAnon``; the rest is the file's page cache, which the kernel may drop); ``x file`` / ``x model``: the peak
over the file's size and over the loaded parameters' bytes; ``load_s``: the wall time of the load and the read.
Prints a table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "1.3b": dict(num_attention_heads=12, attention_head_dim=128, num_layers=30, ffn_dim=8960),
    "14b": dict(num_attention_heads=40, attention_head_dim=128, num_layers=40, ffn_dim=13824),
}
COMMON = dict(in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, patch_size=(1, 2, 2))

_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import torch
loader, folder, file = sys.argv[1:4]
from diffusers import WanTransformer3DModel
from ditforge.models.adapters.single_file import load_component
from ditforge.models.adapters.wan import WanDenoiser


def anon_kb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))


WanTransformer3DModel.load_config(folder, subfolder="transformer")
if torch.cuda.is_available():  # the CUDA context's host memory before the baseline, not in the load's peak
    torch.zeros(1, device="cuda")
before, anon = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, anon_kb()
start = time.perf_counter()
if loader == "from_single_file":
    model = WanTransformer3DModel.from_single_file(file, config=folder, subfolder="transformer",
                                                   torch_dtype=torch.bfloat16, local_files_only=True)
else:
    model = load_component(Path(folder), "transformer", ("diffusers", "WanTransformer3DModel"), file, WanDenoiser,
                           torch.bfloat16, keep_fp8=loader == "ditforge_keep_fp8")
# tensors read from a file stay memory-mapped until used: every one is read here (to the GPU where there is one,
# as training and sampling move it), so the pages count
if torch.cuda.is_available():
    model.to("cuda")
    torch.cuda.synchronize()
else:
    for p in model.parameters():
        p.data.view(torch.uint8).max()  # no wider temporary
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
dtypes = sorted({str(p.dtype) for p in model.parameters()})
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak_rss_kb": after - before, "anon_kb": anon_kb() - anon, "load_s": seconds, "dtypes": dtypes,
                  "model_bytes": model_bytes}))
"""


def write_files(model_name: str, layers: int | None, root: Path, kinds: tuple[str, ...]) -> dict[str, Path]:
    """The config folder (``root/transformer/config.json``) and the single files of ``kinds`` (bf16, fp8), written
    once. The random weights are drawn on the GPU where there is one (a 14B model's draw takes minutes on the host)."""
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from ditforge.models.adapters.wan import WanDenoiser
    from ditforge.weights.original import to_original

    config = {**CONFIGS[model_name], **COMMON}
    if layers:
        config["num_layers"] = layers
    files = {k: v for k, v in {"bf16": root / "wan_bf16.safetensors",
                                "fp8": root / "wan_fp8_e4m3fn.safetensors"}.items() if k in kinds}
    if all(f.is_file() for f in files.values()) and (root / "transformer" / "config.json").is_file():
        return files
    from accelerate import init_empty_weights

    with init_empty_weights():  # shapes only: a 14B model's float32 init would take 57 GB
        model = WanTransformer3DModel(**config)
    model.save_config(root / "transformer")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device).manual_seed(0)
    shapes = {k: (torch.randn(v.shape, generator=g, dtype=torch.bfloat16, device=device) * 0.02).cpu()
              for k, v in model.state_dict().items()}
    state = {"model.diffusion_model." + k: v.contiguous()
             for k, v in to_original(shapes, WanDenoiser.original_layouts["transformer"]).items()}
    del model, shapes
    if "bf16" in files:
        save_file(state, str(files["bf16"]))
    if "fp8" in files:
        for k, v in state.items():
            if k.startswith("model.diffusion_model.blocks.") and v.ndim == 2:
                state[k] = v.to(torch.float8_e4m3fn)
        save_file(state, str(files["fp8"]))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(CONFIGS), default="1.3b")
    parser.add_argument("--layers", type=int, help="keep the first N blocks (default: all)")
    parser.add_argument("--dir", default="/tmp/ditforge_single_file", help="where the files are written (kept)")
    parser.add_argument("--out", default="single_file.json")
    parser.add_argument("--files", nargs="+", choices=("bf16", "fp8"), default=("bf16", "fp8"),
                        help="which single files to write and load (default: both)")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    files = write_files(args.model, args.layers, root, tuple(args.files))
    rows = []
    for kind, file in files.items():
        loaders = ["ditforge", "from_single_file"] + (["ditforge_keep_fp8"] if kind == "fp8" else [])
        for loader in loaders:
            out = subprocess.run([sys.executable, "-c", _CHILD, loader, str(root), str(file)], check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            got = json.loads(out)
            size = file.stat().st_size
            peak = got["peak_rss_kb"] * 1024
            rows.append({"file": kind, "loader": loader, "file_gb": size / 1e9, "model_gb": got["model_bytes"] / 1e9,
                         "peak_rss_gb": peak / 1e9, "anon_gb": got["anon_kb"] * 1024 / 1e9, "ratio": peak / size,
                         "ratio_model": peak / got["model_bytes"], "load_s": got["load_s"], "dtypes": got["dtypes"]})
            _write(args, rows)  # row by row: a long job leaves what it measured
    print(f"{'file':<6} {'loader':<18} {'file GB':>8} {'model GB':>9} {'peak RSS GB':>12} {'anon GB':>8} "
          f"{'x file':>7} {'x model':>8} {'load s':>7}  dtypes")
    for r in rows:
        print(f"{r['file']:<6} {r['loader']:<18} {r['file_gb']:8.2f} {r['model_gb']:9.2f} {r['peak_rss_gb']:12.2f} "
              f"{r['anon_gb']:8.2f} {r['ratio']:7.2f} {r['ratio_model']:8.2f} {r['load_s']:7.1f}  "
              f"{','.join(r['dtypes'])}")


def _write(args, rows: list[dict]) -> None:
    import diffusers
    import safetensors
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    Path(args.out).write_text(json.dumps({"model": args.model, "layers": args.layers, "date": time.strftime(
        "%Y-%m-%d"), "device": device, "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__,
                                                    "safetensors": safetensors.__version__}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
