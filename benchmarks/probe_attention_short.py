"""Probe: the one-launch attention backward of short heads (`attention._one_launch`) against
the launches a longer head takes (Δ, then the single pass and its dQ pass, or the two-program
kernel: `ONE_LAUNCH_MAX_QUERIES = 0`) and PyTorch's SDPA, forward + backward, bf16.

Per shape, in one process, interleaved rounds:
- kernel time per forward + backward (`common.interleaved_kernel_ms`, L2 flushed): every
  kernel each side launches;
- host µs per eager forward + backward (`common.wall_us`, calling thread and autograd's
  worker thread), minimum and median over the rounds;
- the largest difference between the two Triton sides' dq, dk, dv (same inputs and seed).

    python3 benchmarks/probe_attention_short.py --out DIR [--rounds 7]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

import triton_transformer.attention as attn
from triton_transformer.utils import draw_seed

# (b, h, n, d), causal, dropout p: bench_overhead's 32-query heads, short training contexts,
# the head-dim 128 tiles' one key block, a dropout mask
SHAPES = [
    ((2, 8, 32, 64), True, 0.0), ((32, 16, 64, 64), True, 0.0), ((64, 12, 64, 64), True, 0.1),
    ((16, 16, 128, 128), True, 0.0), ((16, 16, 128, 128), False, 0.0),
    ((128, 8, 100, 64), False, 0.0),
]  # fmt: skip


def sides(shape, causal: bool, p: float) -> tuple[dict, float]:
    """{side: fwd+bwd call} for one shape, and the largest gradient difference between the
    Triton sides."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    seed = draw_seed("cuda")

    def triton_side(max_queries: int):
        def call():
            attn.ONE_LAUNCH_MAX_QUERIES = max_queries
            out = attn.attention(q, k, v, causal=causal, dropout_p=p, seed=seed, use_triton=True)
            out.float().sum().backward()
            attn.ONE_LAUNCH_MAX_QUERIES = 128

        return call

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
        out.float().sum().backward()

    calls = {"one launch": triton_side(128), "longer heads' launches": triton_side(0),
             "SDPA": sdpa}  # fmt: skip
    grads = []
    for name in ("one launch", "longer heads' launches"):
        for t in (q, k, v):
            t.grad = None
        calls[name]()
        grads.append([t.grad.float() for t in (q, k, v)])
    diff = max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))
    return calls, diff


def main() -> None:
    def add_args(ap):
        ap.add_argument("--rounds", type=int, default=7)
        ap.add_argument("--calls", type=int, default=100)

    args, out = common.parse_out(__doc__, add_args)
    rows, results = [], []
    for shape, causal, p in SHAPES:
        calls, diff = sides(shape, causal, p)
        names = list(calls)
        kernel = common.interleaved_kernel_ms([calls[n] for n in names], args.rounds)
        host: dict = {n: {"calling": [], "worker": []} for n in names}
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else reversed(names):
                for thread in ("calling", "worker"):
                    with torch.autograd.set_multithreading_enabled(thread == "worker"):
                        host[n][thread].append(common.wall_us(calls[n], args.calls))
        label = f"{shape} {'causal' if causal else 'full'} p={p}"
        result = {"shape": label, "max_grad_diff": diff, "sides": {}}
        for n, (med, lo, hi) in zip(names, kernel, strict=True):
            c, w = host[n]["calling"], host[n]["worker"]
            result["sides"][n] = {"kernel_us": [med * 1e3, lo * 1e3, hi * 1e3],
                                  "calling_us": c, "worker_us": w}  # fmt: skip
            rows.append(
                f"| {label} | {n} | {med * 1e3:.1f} | {min(c):.0f} / {statistics.median(c):.0f}"
                f" | {min(w):.0f} / {statistics.median(w):.0f} | {diff:.2e} |"
            )
        results.append(result)
    text = "\n".join([
        f"# Short heads, fwd + bwd, bf16 ({args.rounds} interleaved rounds; {common.env_info()})",
        "",
        "| shape | side | kernel µs (median) | host µs calling thread min / median | "
        "worker thread min / median | max grad diff (Triton sides) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]) + "\n"  # fmt: skip
    print(text)
    (out / "attention_short.md").write_text(text)
    (out / "attention_short.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
