"""Probe: host µs of an eager cross_entropy call with and without its label check, against
F.cross_entropy (PyTorch's own, which checks nothing on the host), and dropout against
F.dropout. Calling thread, interleaved rounds; prints a markdown table of min / median µs.

    python3 benchmarks/probe_ce_host.py [--rounds 7] [--calls 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from triton_transformer.cross_entropy import cross_entropy
from triton_transformer.dropout import dropout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=150)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    logits = torch.randn(64, 256, device=dev, dtype=dt, requires_grad=True)
    labels = torch.randint(0, 256, (64,), device=dev)
    x = torch.randn(64, 512, device=dev, dtype=dt, requires_grad=True)
    cases = {
        "ce ours (check)": lambda: cross_entropy(logits, labels, use_triton=True),
        "ce ours (no check)": lambda: cross_entropy(
            logits, labels, use_triton=True, check_labels=False
        ),
        "ce ours reference (check)": lambda: cross_entropy(logits, labels, use_triton=False),
        "F.cross_entropy": lambda: F.cross_entropy(logits, labels),
        "dropout ours": lambda: dropout(x, 0.1, use_triton=True),
        "F.dropout": lambda: F.dropout(x, 0.1),
    }
    times: dict = {}
    for _ in range(args.rounds):
        for name, fwd in cases.items():

            def fwd_bwd(fwd=fwd):
                fwd().float().sum().backward()

            for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                with torch.autograd.set_multithreading_enabled(False):
                    for _ in range(5):
                        fn()
                    times.setdefault((name, mode), []).append(common.wall_us(fn, args.calls))
    print(f"# {common.env_info()}\n\n| call | mode | min | median |\n|---|---|---|---|")
    for (name, mode), v in times.items():
        print(f"| {name} | {mode} | {min(v):.0f} | {statistics.median(v):.0f} |")


if __name__ == "__main__":
    main()
