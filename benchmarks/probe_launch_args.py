"""Probe: what a kernel's pointer arguments cost Triton's C launcher, passed as tensors or as
the addresses themselves.

For each tensor argument Triton 3.6's generated launcher calls the object's `data_ptr()`
through Python and then asks the CUDA driver for the pointer's attributes
(`cuPointerGetAttribute`); an int argument is taken as the address at once. A bound launch
(`utils.KernelLauncher.bind`) could pass `t.data_ptr()` itself. This times, per launch, a
kernel of 1, 4 and 10 pointer arguments that does nothing, launched back to back from
Python (one synchronise per round, the minimum over rounds):

- the C launcher called directly with the tensors (what a bound launch does today);
- the same with `t.data_ptr()` of each tensor taken in Python per call;
- Triton's own `kernel[grid](...)`.

    python3 benchmarks/probe_launch_args.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton


@triton.jit
def _one(p0, n):
    pass


@triton.jit
def _four(p0, p1, p2, p3, n):
    pass


@triton.jit
def _ten(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, n):
    pass


def per_call_us(fn, calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def launches(kernel, ts: list) -> dict:
    """The three ways of launching `kernel` on the tensors `ts` (and n = 7)."""
    from triton_transformer.utils import launcher

    kl = launcher(kernel)
    kl[(1,)](*ts, 7)
    _, function, metadata, tail, plain = next(iter(kl.compiled.values()))
    if plain is None:
        raise SystemExit("not Triton 3.6's launcher form: nothing to compare")
    c_launch, coop, pdl = plain
    stream = torch.cuda.current_stream().cuda_stream
    head = (1, 1, 1, stream, function, coop, pdl, None, None, metadata, None, None, None)

    def as_tensors():
        c_launch(*head, *ts, 7, *tail)

    def as_ints():
        c_launch(*head, *[t.data_ptr() for t in ts], 7, *tail)

    def tritons():
        kernel[(1,)](*ts, 7)

    return {"tensors": as_tensors, "ints": as_ints, "kernel[grid]": tritons}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    tensors = [torch.empty(1024, device="cuda") for _ in range(10)]
    results = {}
    for name, kernel, n_ptr in (("1 pointer", _one, 1), ("4 pointers", _four, 4),
                                ("10 pointers", _ten, 10)):  # fmt: skip
        row = {}
        for label, fn in launches(kernel, tensors[:n_ptr]).items():
            fn()
            row[label] = round(per_call_us(fn, a.calls, a.rounds), 2)
        results[name] = row
        print(name, row, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "launch_args.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
