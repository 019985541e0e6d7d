"""Probe of where an eager step's host time goes: cProfile of the Triton model's eager training
step and inference forward at a step preset (`bench_step.PRESETS`), after warm-up; prints the
functions with the most own time and the most cumulative time.

    python3 benchmarks/probe_eager_host.py [--preset small] [--top 30]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_step
import common

from triton_transformer.cuda_graph import capturable_train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=list(bench_step.PRESETS))
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    p = bench_step.PRESETS[args.preset]
    torch.manual_seed(0)
    model = bench_step.build("triton", "eager", p, 0.0)
    batch = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1), device="cuda")
    step = capturable_train_step(model, batch, lr=3e-4)
    for _ in range(5):
        step()

    def infer():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model(batch)

    for _ in range(3):
        infer()
    common.host_profile(infer, 10, args.top, "inference forward")
    with torch.autograd.set_multithreading_enabled(False):
        common.host_profile(step, 5, args.top, "training step (backward on the calling thread)")


if __name__ == "__main__":
    main()
