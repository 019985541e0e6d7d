"""Probe: what a label or id check costs a loop whose GPU work is queued ahead of the host.

Each iteration queues `--matmuls` bf16 products of (4096, 4096) @ (4096, 4096) (GPU work the
host does not wait for), then one checked call: cross_entropy on (64, 256) logits, or
embedding of (2, 32) ids. Rows, per call kind:
- "unchecked": check_labels / check_ids False;
- "deferred": the default check of this code (`triton_transformer.checks`: no sync);
- "sync": the previous code's check, emulated: the unchecked call, then a host read of the
  loss (`math.isnan(loss.item())`) for cross_entropy, or of `((ids < 0) | (ids >= V)).any()`
  before the call for embedding (one sync each, as e9370fe-af26d7b ran them).
Prints µs per iteration (min and median over rounds of `--iters`), and the matmuls alone.

    python3 benchmarks/probe_check_pipeline.py [--rounds 5] [--iters 50] [--matmuls 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from triton_transformer import checks
from triton_transformer.cross_entropy import cross_entropy
from triton_transformer.embedding import embedding


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--matmuls", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    logits = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    labels = torch.randint(0, 256, (64,), device=dev)
    ids = torch.randint(0, 256, (2, 32), device=dev)
    w = torch.randn(256, 512, device=dev)
    pos = torch.randn(512, 512, device=dev)

    def work() -> None:
        for _ in range(args.matmuls):
            torch.mm(a, b, out=c)

    def ce_sync() -> None:
        loss = cross_entropy(logits, labels, use_triton=True, check_labels=False)
        math.isnan(loss.item())

    def emb_sync() -> None:
        bool(((ids < 0) | (ids >= 256)).any())
        embedding(ids, w, pos, use_triton=True, check_ids=False)

    calls = {
        "matmuls alone": lambda: None,
        "cross_entropy unchecked": lambda: cross_entropy(
            logits, labels, use_triton=True, check_labels=False
        ),
        "cross_entropy deferred": lambda: cross_entropy(logits, labels, use_triton=True),
        "cross_entropy sync": ce_sync,
        "embedding unchecked": lambda: embedding(ids, w, pos, use_triton=True, check_ids=False),
        "embedding deferred": lambda: embedding(ids, w, pos, use_triton=True),
        "embedding sync": emb_sync,
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():  # warm-up: compile, bind, plan
        work()
        fn()
    torch.cuda.synchronize()
    for _ in range(args.rounds):  # interleaved rounds: each kind sees the same host state
        for name, fn in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.iters):
                work()
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / args.iters * 1e6)
            checks.raise_pending()
    name = torch.cuda.get_device_name()
    print(f"# {name}, torch {torch.__version__}: µs per iteration", end=" ")
    print(f"({args.matmuls} matmuls + one call)")
    print("\n| call | min | median |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):,.0f} | {statistics.median(ts):,.0f} |")


if __name__ == "__main__":
    main()
