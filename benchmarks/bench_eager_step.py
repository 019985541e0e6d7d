"""The model step in an ordinary eager loop (no whole-step CUDA graph): PyTorch ops against
Triton ops.

For each preset (enwik8, GPT-2 and large shapes, `bench_step.PRESETS`) and provider, the
training step of `cuda_graph.capturable_train_step` (bf16 autocast; torch's fused AdamW for
PyTorch ops, the package's `adamw.AdamW` for Triton ops) runs eagerly
with autograd's backward on its device worker thread (PyTorch's default) and on the calling
thread (`torch.autograd.set_multithreading_enabled(False)`, what the trainer does); ms per step
is the median of 5 x 10 steps. Providers: "torch" (use_triton=False), "triton" (the default:
the blocks replayed as CUDA graphs, `block_graphs`) and "triton-nographs" (cuda_graphs=False,
every kernel launched from Python). Also GPU ms per step (profiler) and GPU busy, peak memory
(allocated, and reserved: the block graphs' pools are counted only there), and an inference
forward (no_grad). Writes eager_step_<label>.json.

Usage: python3 benchmarks/bench_eager_step.py --out DIR [--label after] [--presets small gpt2]
    [--providers torch triton-nographs] [--profile]
To compare two checkouts, run it with PYTHONPATH pointing at each (the package is imported
from PYTHONPATH first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
import common

from triton_transformer.cuda_graph import capturable_train_step

KERNELS_KEPT = 25  # the longest kernels of each step, kept in the JSON (where the GPU time goes)


def ms_per_step(step, steps: int = 10) -> float:
    return common.wall_us(step, steps) / 1e3


def measure(preset: str, provider: str, profile: bool = False) -> dict:
    p = bench_step.PRESETS[preset]
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = bench_step.build(provider.removesuffix("-nographs"), "eager", p, 0.0)
    if provider == "triton-nographs":
        model.net.cuda_graphs = False
    batch = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1), device="cuda")
    step = capturable_train_step(model, batch, lr=3e-4)
    for _ in range(5):  # autotuning, allocator warm-up
        step()
    row = {}
    for threaded in (True, False):
        with torch.autograd.set_multithreading_enabled(threaded):
            ms_per_step(step, 3)
            ms = statistics.median(ms_per_step(step) for _ in range(5))
        row["ms_worker_thread" if threaded else "ms_calling_thread"] = ms
    if profile:  # on the calling thread, where cProfile sees the backward too
        with torch.autograd.set_multithreading_enabled(False):
            common.host_profile(step, 5, 30, f"{preset} {provider} step")
    row["peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20
    # The block graphs' intermediates are freed when captured and rewritten at each replay: the
    # allocator counts them as free while the graphs' pools hold them, so the allocated peak
    # understates the Triton model's (GPT-2 fused step, H200, 2026-11-27: 3,394 MiB allocated,
    # 7,578 reserved; `probe_lce_chunks.py`). The reserved peak counts them, and the cache too.
    row["peak_reserved_MiB"] = torch.cuda.max_memory_reserved() / 2**20
    row["gpu_ms"], kernels = common.gpu_time_per_step(step)
    row["kernels"] = kernels[:KERNELS_KEPT]
    row["gpu_busy_worker_thread"] = min(1.0, row["gpu_ms"] / row["ms_worker_thread"])

    def infer():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model(batch)

    infer()
    infer()  # the second call of a signature captures the block graphs
    row["inference_ms"] = statistics.median(ms_per_step(infer) for _ in range(5))
    row["inference_gpu_ms"] = common.gpu_time_per_step(infer)[0]
    tokens = p["batch"] * p["seq"]
    for key in ("worker_thread", "calling_thread"):
        row[f"tokens/s_{key}"] = tokens / row[f"ms_{key}"] * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--label", default="after")
    ap.add_argument("--presets", nargs="+", default=["small", "gpt2", "large"])
    ap.add_argument(
        "--providers", nargs="+", default=["torch", "triton", "triton-nographs"],
        choices=["torch", "triton", "triton-nographs"],
    )  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true", help="print a cProfile of each step (calling thread)"
    )
    args = ap.parse_args()
    results = {}
    for preset in args.presets:
        for provider in args.providers:
            results[f"{preset}/{provider}"] = row = measure(preset, provider, args.profile)
            scalars = {k: round(v, 2) for k, v in row.items() if k != "kernels"}
            print(args.label, preset, provider, scalars)
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"eager_step_{args.label}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
