"""Softmax benchmark: M = 4096 rows of N = 256 .. 16384, plain and causal, bf16 (and fp32).

Providers: ours (`softmax(use_triton=True)`), torch (`torch.softmax`; causal: masked_fill with
a cached mask, then softmax), compile (`torch.compile` of the torch function) and liger
(`LigerSoftmaxFunction`, plain only, if installed).

Modes: fwd, fwd+bwd (`torch.autograd.grad` with a fixed random upstream gradient). Bytes
counted: x read and y written (fwd); plus y and dy read and dx written (fwd+bwd); the same for
every provider (a causal kernel may skip the masked half: it still counts the full tensors).

Usage: python3 benchmarks/bench_softmax.py --out DIR [--quick] [--sweep] [--no-compile]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import torch
import triton

from triton_transformer.softmax import softmax

softmax_mod = sys.modules["triton_transformer.softmax"]

M = 4096


def torch_softmax(x: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    if causal:
        x = x.masked_fill(mask, float("-inf"))
    return torch.softmax(x, dim=-1)


def providers(causal: bool, no_compile: bool) -> dict:
    fns = {
        "ours": lambda x, mask: softmax(x, causal=causal, use_triton=True),
        "torch": lambda x, mask: torch_softmax(x, causal, mask),
    }
    if not no_compile:
        fns["compile"] = common.compiled(lambda x, mask: torch_softmax(x, causal, mask))
    lk = common.liger()
    if lk is not None and not causal:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction

        fns["liger"] = lambda x, mask: LigerSoftmaxFunction.apply(x)
    return fns


def bench(args) -> list[dict]:
    ceil = common.ceilings()
    Ns = [256, 1024, 4096, 16384] if args.quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
    dtypes = {"bf16": torch.bfloat16}
    if not args.quick:
        dtypes["fp32"] = torch.float32
    rows = []
    for causal in (False, True):
        fns = providers(causal, args.no_compile)
        for dname, dtype in dtypes.items():
            for N in Ns:
                x = (-2.0 + torch.randn(M, N, device="cuda")).to(dtype).requires_grad_()
                dy = torch.randn(M, N, device="cuda").to(dtype)
                mask = torch.ones(M, N, dtype=torch.bool, device="cuda").triu(N - M + 1)
                es = x.element_size()
                nbytes = {"fwd": 2 * M * N * es, "fwd+bwd": 5 * M * N * es}
                for name, f in fns.items():
                    # compiles are slow: a few sizes, bf16 only
                    compile_ns = (1024, 16384) if args.quick else (1024, 4096, 16384)
                    if name == "compile" and (N not in compile_ns or dname != "bf16"):
                        continue

                    def fwd(f=f, x=x, mask=mask):
                        return f(x, mask)

                    def fwd_bwd(f=f, x=x, mask=mask, dy=dy):
                        return torch.autograd.grad(f(x, mask), x, dy)

                    for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                        try:
                            r = common.time_op(fn)
                        except Exception as e:
                            print(f"{name} N={N} {mode}: {type(e).__name__}: {e}")
                            continue
                        gbps = nbytes[mode] / r["ms"] / 1e6
                        row = {
                            "provider": name, "N": N, "causal": causal, "dtype": dname,
                            "mode": mode, "ms": r["ms"], "wall_us": r["wall_us"], "GB/s": gbps,
                            "frac": gbps / ceil["copy_gbps"],
                        }  # fmt: skip
                        rows.append(row)
                        print(row)
    return rows


def sweep(args) -> list[dict]:
    """ROW_TILE and warps for short rows, warps for long ones (bf16, plain, fwd and fwd+bwd)."""
    out = []
    for N in (256, 1024, 4096, 16384):
        x = (-2.0 + torch.randn(M, N, device="cuda")).to(torch.bfloat16).requires_grad_()
        dy = torch.randn_like(x)
        tiles = (1024, 2048, 4096, 8192) if N < 4096 else (2048,)
        for tile in tiles:
            for warps in (None, 4, 8, 16, 32):
                softmax_mod.ROW_TILE, softmax_mod.NUM_WARPS = tile, warps
                try:
                    f = softmax_mod.softmax_op(x.detach(), False)
                    ms_f = triton.testing.do_bench(
                        lambda x=x: softmax_mod.softmax_op(x.detach(), False)
                    )
                    ms_b = triton.testing.do_bench(
                        lambda f=f, dy=dy: softmax_mod.softmax_backward_op(dy, f, False)
                    )
                except Exception as e:
                    print(f"sweep N={N} tile={tile} warps={warps}: {e}")
                    continue
                row = {"N": N, "ROW_TILE": tile, "warps": str(warps)}
                row.update(fwd_ms=ms_f, bwd_ms=ms_b)
                out.append(row)
                print(row)
    softmax_mod.ROW_TILE, softmax_mod.NUM_WARPS = 2048, None
    return out


def main() -> None:
    common.run_main(
        "softmax", bench, sweep, x="N", y="GB/s", group=("causal", "dtype", "mode"),
        title=f"softmax over rows of N, M = {M}",
    )  # fmt: skip


if __name__ == "__main__":
    main()
