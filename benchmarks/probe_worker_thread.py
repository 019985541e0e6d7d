"""Probe: where an eager layernorm's extra host time on autograd's device thread goes.

With the backward on autograd's device (worker) thread, PyTorch's default for CUDA tensors, our
layernorm's forward + backward costs ~200 µs more than on the calling thread; PyTorch's own
ops ~60 (`probe_host_floor.py`). This times the op's Python backward body (the registered
backward, kernels launched, nothing synchronised) on whichever thread runs it, next to the
whole forward + backward, and the same for an `autograd.Function` whose backward returns its
input: if the body takes as long on both threads, the difference is spent around the node, in
autograd's hand-off, not in our Python.

    python3 benchmarks/probe_worker_thread.py
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton_transformer.layernorm as ln

BODY_US: dict[str, list[float]] = {}


def _timed(backward):
    def body(ctx, *grads):
        start = time.perf_counter()
        out = backward(ctx, *grads)
        name = threading.current_thread().name
        BODY_US.setdefault(name, []).append((time.perf_counter() - start) * 1e6)
        return out

    return body


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    @_timed
    def backward(ctx, dy):
        return dy


def _per_call_us(fn, calls: int = 300) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    BODY_US.clear()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    # before the op's first eager call, which builds its autograd.Function from this
    ln.layernorm_op._backward_fn = _timed(ln.layernorm_op._backward_fn)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, device="cuda", requires_grad=True)
    cases = {
        "our layernorm": lambda: ln.layernorm(x, w, use_triton=True).float().sum().backward(),
        "Function, identity": lambda: _Identity.apply(x).float().sum().backward(),
    }
    for name, fn in cases.items():
        for thread in ("worker", "calling", "worker", "calling"):
            with torch.autograd.set_multithreading_enabled(thread == "worker"):
                total = _per_call_us(fn)
            bodies = {k: f"{statistics.median(v):.0f}" for k, v in BODY_US.items()}
            print(f"{name}, {thread} thread: fwd + bwd {total:.0f} µs, backward body "
                  f"median µs by thread {bodies}")  # fmt: skip


if __name__ == "__main__":
    main()
