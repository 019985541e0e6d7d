"""Dropout benchmark (p = 0.1): forward and backward GB/s, ours against eager and compile.

Providers: ours (`dropout(use_triton=True)`: Philox mask regenerated from a seed, nothing
stored), torch (`F.dropout`: writes a bool mask in forward, reads it in backward) and compile
(`torch.compile` of `F.dropout`).

Modes: fwd; bwd (`torch.autograd.grad` of a retained forward with a contiguous upstream
gradient: only the backward kernels run); bwd-expanded (the upstream gradient is a
stride-0 broadcast, as `.sum()` gives: ours reads it in place). Bytes counted: one tensor read
and one written, the same for every provider (eager also moves its 1-byte mask, not counted),
so GB/s compares time.

Usage: python3 benchmarks/bench_dropout.py --out DIR [--quick] [--sweep] [--no-compile]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import torch
import torch.nn.functional as F
import triton

import triton_transformer.dropout as dropout_mod
from triton_transformer.dropout import dropout
from triton_transformer.utils import draw_seed

P = 0.1


def providers(no_compile: bool) -> dict:
    fns = {
        "ours": lambda x: dropout(x, P, use_triton=True),
        "torch": lambda x: F.dropout(x, P, training=True),
    }
    if not no_compile:
        fns["compile"] = common.compiled(lambda x: F.dropout(x, P, training=True))
    return fns


def bench(args) -> list[dict]:
    ceil = common.ceilings()
    sizes = [1 << 22, 1 << 26] if args.quick else [1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28]
    rows = []
    for dname, dtype in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
        for n in sizes:
            x = torch.randn(n, device="cuda").to(dtype).requires_grad_()
            dy = torch.randn(n, device="cuda").to(dtype)
            nbytes = 2 * n * x.element_size()
            for name, f in providers(args.no_compile).items():
                if name == "compile" and args.quick and n != 1 << 26:
                    continue
                out = f(x)

                def fwd(f=f, x=x):
                    return f(x)

                def bwd(out=out, x=x, dy=dy):
                    return torch.autograd.grad(out, x, dy, retain_graph=True)

                x2 = x.detach().view(-1, 1024).requires_grad_()
                out2 = f(x2)
                dy2 = dy[:1024].expand(n // 1024, 1024)

                def bwd_expanded(out2=out2, x2=x2, dy2=dy2):
                    return torch.autograd.grad(out2, x2, dy2, retain_graph=True)

                for mode, fn in (("fwd", fwd), ("bwd", bwd), ("bwd-expanded", bwd_expanded)):
                    try:
                        r = common.time_op(fn)
                    except Exception as e:
                        print(f"{name} n={n} {mode}: {type(e).__name__}: {e}")
                        continue
                    gbps = nbytes / r["ms"] / 1e6
                    row = {
                        "provider": name, "n": n, "dtype": dname, "mode": mode, "ms": r["ms"],
                        "wall_us": r["wall_us"], "GB/s": gbps, "frac": gbps / ceil["copy_gbps"],
                    }  # fmt: skip
                    rows.append(row)
                    print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def sweep(args) -> list[dict]:
    """Tile rows (BLOCK_M, of BLOCK_N = 512 elements) and warps of the kernel (fwd = bwd: the
    same kernel), 2**26 elements."""
    out = []
    n = 1 << 26
    seed = draw_seed("cuda")
    shipped = dropout_mod.BLOCK_M, dropout_mod.NUM_WARPS
    for dname, dtype in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
        x = torch.randn(n, device="cuda").to(dtype)
        for block_m in (2, 4, 8, 16, 32):
            for warps in (2, 4, 8, 16):
                dropout_mod.BLOCK_M, dropout_mod.NUM_WARPS = block_m, warps
                try:
                    ms = triton.testing.do_bench(lambda x=x: dropout_mod.dropout_op(x, P, seed))
                except Exception as e:
                    print(f"sweep {block_m} {warps}: {e}")
                    continue
                row = {"dtype": dname, "BLOCK_M": block_m, "warps": warps, "ms": ms,
                       "GB/s": 2 * n * x.element_size() / ms / 1e6}  # fmt: skip
                out.append(row)
                print(row)
    dropout_mod.BLOCK_M, dropout_mod.NUM_WARPS = shipped
    return out


def main() -> None:
    common.run_main(
        "dropout", bench, sweep, x="n", y="GB/s", group=("dtype", "mode"), title=f"dropout p={P}"
    )


if __name__ == "__main__":
    main()
