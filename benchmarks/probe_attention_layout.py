"""Probe: does the memory layout of q, k and v move our attention against cuDNN's? d64 causal,
bf16, dropout 0, kernel time (`common.kernel_ms`, L2 flushed) of the forward and of the
backward alone (autograd.grad over a retained graph), at the shapes where
`bench_attention.py`'s sweep ((b, h, n, d) tensors, h = 2048 / d) and the model's packed qkv
disagree.

Layouts (both ours and cuDNN's where SDPA takes it):
- "packed": the model's (b, n, 3·h·d) qkv (ours only: `attention_packed`);
- "head-major": separate contiguous (b, h, n, d) tensors, as the sweep passes them;
- "token-major": separate contiguous (b, n, h, d) tensors, passed as (b, h, n, d) views.

Our backward is timed with each kernel that can take it (the warp-specialized Gluon kernel,
the Gluon single pass, the Triton kernels), the forward with the Triton and Gluon kernels;
"default" is what an eager call takes.

    python3 benchmarks/probe_attention_layout.py --out DIR [--shapes B,N,H ...]
Writes DIR/attention_layout.json and attention_layout.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

import triton_transformer.attention as A
import triton_transformer.attention_hopper as single
import triton_transformer.attention_hopper_bwd_ws as ws
import triton_transformer.attention_hopper_fwd as fwd_gluon
from triton_transformer.utils import clear_launch_plans

D = 64
# (b, n, h): the sweep's rows at 4096 and 8192 queries, and the same heads at 16 per token
SHAPES = ((4, 4096, 32), (4, 4096, 16), (2, 8192, 32), (2, 8192, 16))


@contextlib.contextmanager
def kernels(fwd: str, bwd: str) -> Iterator[None]:
    """Route eager calls to one forward ("default", "triton", "gluon") and one backward
    ("default", "ws", "single", "triton") kernel by the modules' gates; restores them."""
    saved = (fwd_gluon.ENABLED, fwd_gluon._taken, single.ENABLED, single._taken, ws.ENABLED,
             ws._taken)  # fmt: skip
    try:
        if fwd == "triton":
            fwd_gluon.ENABLED = False
        elif fwd == "gluon":
            fwd_gluon._taken = lambda d, n_q, causal: d in fwd_gluon.HEAD_DIMS
        if bwd in ("single", "triton"):
            ws.ENABLED = False
        if bwd == "ws":
            ws._taken = lambda d, n_q, causal: d in ws.HEAD_DIMS
        elif bwd == "single":
            single._taken = lambda d, n_q, causal, dropout: d in single.HEAD_DIMS
        elif bwd == "triton":
            single.ENABLED = False
        clear_launch_plans()
        yield
    finally:
        (fwd_gluon.ENABLED, fwd_gluon._taken, single.ENABLED, single._taken, ws.ENABLED,
         ws._taken) = saved  # fmt: skip
        clear_launch_plans()


def inputs(b: int, n: int, h: int, layout: str) -> tuple[torch.Tensor, ...]:
    """q, k, v as (b, h, n, d) tensors or views of `layout`, or (qkv,) for "packed"."""

    def leaf(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) + 0.1).requires_grad_()

    if layout == "packed":
        return (leaf(b, n, 3 * h * D),)
    if layout == "head-major":
        return tuple(leaf(b, h, n, D) for _ in range(3))
    return tuple(leaf(b, n, h, D) for _ in range(3))


def closures(b: int, n: int, h: int, layout: str, who: str) -> tuple[Callable, Callable]:
    """(forward, backward) of `who` ("ours" or "cuDNN") on inputs of `layout`."""
    leaves = inputs(b, n, h, layout)
    views = leaves if layout != "token-major" else tuple(t.transpose(1, 2) for t in leaves)

    def forward() -> torch.Tensor:
        if who == "cuDNN":
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(*views, is_causal=True)
        if layout == "packed":
            return A.attention_packed(leaves[0], h, causal=True, use_triton=True)
        return A.attention(*views, causal=True, use_triton=True)

    out = forward()
    dout = torch.randn_like(out)
    return forward, lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--shapes", nargs="*", default=SHAPES,
        type=lambda s: tuple(int(x) for x in s.split(",")),
    )  # fmt: skip
    args = ap.parse_args()
    env = common.env_info()
    print(env, flush=True)
    rows = []
    for b, n, h in args.shapes:
        for layout in ("packed", "head-major", "token-major"):
            row = {"shape": (b, n, h), "layout": layout, "fwd": {}, "bwd": {}}
            for fwd, bwd in (("default", "default"), ("triton", "ws"), ("gluon", "single"),
                             ("default", "triton")):  # fmt: skip
                with kernels(fwd, bwd):
                    torch.manual_seed(0)
                    f, g = closures(b, n, h, layout, "ours")
                    if fwd not in row["fwd"]:
                        row["fwd"][fwd] = common.kernel_ms(f) * 1e3
                    row["bwd"][bwd] = common.kernel_ms(g) * 1e3
                    del f, g
            if layout != "packed":
                f, g = closures(b, n, h, layout, "cuDNN")
                row["fwd"]["cuDNN"] = common.kernel_ms(f) * 1e3
                row["bwd"]["cuDNN"] = common.kernel_ms(g) * 1e3
                del f, g
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_layout.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    head = next(r for r in rows if r["layout"] == "head-major")
    lines = [f"# Attention d64 causal by layout ({env})", "",
             "µs per call (kernel time, L2 flushed), bf16; cuDNN of the same layout where SDPA",
             "takes it, else of head-major tensors; ratio: cuDNN / ours (fwd + bwd).", "",
             "| (b, n, h) | layout | " + " | ".join(f"fwd {k}" for k in head["fwd"])
             + " | " + " | ".join(f"bwd {k}" for k in head["bwd"]) + " | cuDNN / ours |",
             "|---|---|" + "---|" * (len(head["fwd"]) + len(head["bwd"]) + 1)]  # fmt: skip
    cudnn = {}
    for r in rows:
        if "cuDNN" in r["fwd"]:
            cudnn.setdefault(tuple(r["shape"]), r["fwd"]["cuDNN"] + r["bwd"]["cuDNN"])
    for r in rows:
        ref = cudnn.get(tuple(r["shape"]))
        ours = r["fwd"]["default"] + r["bwd"]["default"]
        cells = [f"{r['fwd'].get(k, float('nan')):.1f}" for k in head["fwd"]]
        cells += [f"{r['bwd'].get(k, float('nan')):.1f}" for k in head["bwd"]]
        cells.append(f"{ref / ours:.3f}" if ref else "-")
        lines.append(f"| {tuple(r['shape'])} | {r['layout']} | " + " | ".join(cells) + " |")
    (out / "attention_layout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
