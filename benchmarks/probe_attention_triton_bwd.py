"""Probe: the Triton attention backward (`attention._attention_bwd_kernel`) where Hopper's Gluon
kernel does not take it: grouped-query heads, a key padding mask, the deterministic path, head
dim 128 below 2048 queries. Kernel time per backward (`common.kernel_ms`, L2 flushed: every
kernel the backward launches), bf16, causal. Run it against two checkouts, then compare:

    python3 benchmarks/probe_attention_triton_bwd.py --out DIR --label after
    PYTHONPATH=/path/to/old/checkout python3 benchmarks/probe_attention_triton_bwd.py \\
        --out DIR --label before
    python3 benchmarks/probe_attention_triton_bwd.py --out DIR --compare before after

(the package is imported from PYTHONPATH first, so the second line measures the old code).
Writes DIR/attention_triton_bwd_LABEL.json; --compare writes attention_triton_bwd.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import common  # benchmarks/ is the script's directory, first on sys.path
import torch

# name, (b, n, h, h_kv, d), key padding mask, deterministic
CASES = [
    ("GQA, GPT-2 shape", (16, 1024, 12, 4, 64), False, False),
    ("GQA, large shape", (8, 2048, 16, 4, 64), False, False),
    ("GQA 12 / 3 (the Llama-style GPT-2 block's)", (16, 1024, 12, 3, 64), False, False),
    ("key padding mask", (16, 1024, 12, 12, 64), True, False),
    ("deterministic", (16, 1024, 12, 12, 64), False, True),
    ("deterministic GQA", (8, 2048, 16, 4, 64), False, True),
    ("d128, 1024 queries", (16, 1024, 16, 16, 128), False, False),
]


def backward(b: int, n: int, h: int, h_kv: int, d: int, padded: bool):
    """A closure running one backward of our causal attention over a retained graph."""
    from triton_transformer.attention import attention

    def leaf(heads: int) -> torch.Tensor:
        t = torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16) + 0.3
        return t.requires_grad_()

    q, k, v = leaf(h), leaf(h_kv), leaf(h_kv)
    kpm = None
    if padded:  # the last eighth of each sequence's keys padded
        kpm = torch.ones(b, n, device="cuda", dtype=torch.bool)
        kpm[:, n - n // 8 :] = False
    out = attention(q, k, v, causal=True, key_padding_mask=kpm, use_triton=True)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def measure(label: str, out: Path) -> None:
    # deterministic algorithms on must not add fills of fresh tensors to the kernel time
    torch.utils.deterministic.fill_uninitialized_memory = False
    rows = []
    for name, (b, n, h, h_kv, d), padded, deterministic in CASES:
        torch.manual_seed(0)
        torch.use_deterministic_algorithms(deterministic)
        try:
            fn = backward(b, n, h, h_kv, d, padded)
            grads = fn()
            us = common.kernel_ms(fn) * 1e3
        finally:
            torch.use_deterministic_algorithms(False)
        rows.append({"case": name, "shape": [b, n, h, h_kv, d], "us": us,
                     "grad_norms": [g.float().norm().item() for g in grads]})  # fmt: skip
        print(label, json.dumps(rows[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"attention_triton_bwd_{label}.json").write_text(
        json.dumps({"env": common.env_info(), "rows": rows}, indent=1)
    )


def compare(out: Path, before: str, after: str) -> None:
    a, b = (
        json.loads((out / f"attention_triton_bwd_{x}.json").read_text()) for x in (before, after)
    )
    lines = [f"# The Triton attention backward, {before} against {after} ({b['env']})", "",
             "µs per backward (kernel time, L2 flushed), bf16, causal; grad norms: the largest",
             "relative difference of |dq|, |dk|, |dv| between the two.", "",
             f"| case | (b, n, h, h_kv, d) | {before} µs | {after} µs | {before} / {after} "
             "| grad norms |", "|---|---|---|---|---|---|"]  # fmt: skip
    for x, y in zip(a["rows"], b["rows"], strict=True):
        diff = max(
            abs(p - q) / abs(p) for p, q in zip(x["grad_norms"], y["grad_norms"], strict=True)
        )
        lines.append(f"| {x['case']} | {tuple(x['shape'])} | {x['us']:.1f} | {y['us']:.1f} | "
                     f"{x['us'] / y['us']:.3f} | {diff:.1e} |")  # fmt: skip
    (out / "attention_triton_bwd.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="after")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        compare(Path(args.out), *args.compare)
    else:
        measure(args.label, Path(args.out))


if __name__ == "__main__":
    main()
