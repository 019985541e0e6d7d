"""Probe: the norms' small backwards as one program (`layernorm.ONE_PROGRAM_ELEMENTS`) against
the grid and column-sum launches they replace, GPU time per backward.

Two GPU times per shape and side: the kernels' time (`common.kernel_ms`: profiler, L2 flushed)
and a CUDA graph of 20 back-to-back backwards replayed, per backward (what the GPU spends
with launch latency and the gap between two launches included, no host). The "one" side
runs every shape as one program, beyond the shipped threshold too. bf16 x and dy, fp32
weight (the model's), layernorm with a bias and rmsnorm, interleaved rounds, medians.

    python3 benchmarks/probe_norm_one_program.py --out DIR [--rounds 5]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from triton_transformer import layernorm as ln
from triton_transformer import rmsnorm as rms

SHAPES = [(8, 512), (32, 512), (64, 512), (128, 512), (256, 512), (16, 1024), (32, 1024),
          (64, 1024), (8, 2048), (16, 2048), (4, 4096), (8, 4096), (128, 256)]  # fmt: skip
GRAPH_CALLS = 20


def backward_of(op: str, M: int, N: int):
    """A closure launching one backward of `op` at (M, N), its outputs preallocated."""
    x = (1.5 + torch.randn(M, N, device="cuda")).bfloat16()
    dy = torch.randn(M, N, device="cuda").bfloat16()
    w = 1 + 0.1 * torch.randn(N, device="cuda")
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    if op == "layernorm":
        b, db = torch.randn_like(w), torch.empty_like(w)
        stats = torch.empty(2, M, device="cuda")
        ln.launch_layernorm_fwd(x, w, b, torch.empty_like(x), stats, 1e-5, False)
        return lambda: ln.launch_layernorm_bwd(dy, x, w, stats, dx, dw, db, 1e-5, False)
    rstd = torch.empty(M, device="cuda")
    rms.launch_rmsnorm_fwd(x, w, torch.empty_like(x), rstd, 1e-5)
    return lambda: rms.launch_rmsnorm_bwd(dy, x, w, rstd, dx, dw)


def graph_us(fn) -> float:
    """GPU µs per call of fn, GRAPH_CALLS calls captured in one graph and replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * GRAPH_CALLS)


def side(one: bool) -> None:
    """Every shape of the probe as one program, or none."""
    ln.ONE_PROGRAM_ELEMENTS = 1 << 30 if one else 0
    ln._clear_config_caches()
    rms._clear_config_caches()


def main() -> None:
    args, out = common.parse_out(
        __doc__, lambda ap: ap.add_argument("--rounds", type=int, default=5)
    )
    default = ln.ONE_PROGRAM_ELEMENTS
    by_default = {shape: ln._one_program(*shape, ln.MAX_BLOCK_N) for shape in SHAPES}
    rows = []
    for op in ("layernorm", "rmsnorm"):
        for M, N in SHAPES:
            times = {(s, k): [] for s in (True, False) for k in ("kernel", "graph")}
            for r in range(args.rounds):
                for one in (True, False) if r % 2 == 0 else (False, True):
                    side(one)
                    fn = backward_of(op, M, N)
                    times[(one, "kernel")].append(common.kernel_ms(fn) * 1e3)
                    times[(one, "graph")].append(graph_us(fn))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append(
                f"| {op} | {M} x {N} | {by_default[(M, N)]} | "
                f"{med[(True, 'kernel')]:.2f} / {med[(False, 'kernel')]:.2f} | "
                f"{med[(True, 'graph')]:.2f} / {med[(False, 'graph')]:.2f} |"
            )
    ln.ONE_PROGRAM_ELEMENTS = default
    text = "\n".join([
        f"# The norms' small backwards: one program against the grid + column sums "
        f"({args.rounds} interleaved rounds, medians; {common.env_info()})",
        "",
        "| op | rows x cols | one program by default | kernel µs: one / grid | "
        "graph-replayed µs per backward: one / grid |",
        "|---|---|---|---|---|",
        *rows,
    ]) + "\n"  # fmt: skip
    print(text)
    (out / "norm_one_program.md").write_text(text)


if __name__ == "__main__":
    main()
