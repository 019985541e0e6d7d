"""Matmul benchmark: every projection GEMM of the model, forward / dX / dW, ours vs cuBLAS.

For M (tokens) in 2048 and 8192 and each projection (K in -> N out) of the model (d512):
  fwd  Y  = X @ W^T      (M, N, K)   relu² fused for 512 -> 2048
  dX   dX = dY @ W       (M, K, N)
  dW   dW = dY^T @ X     (N, K, M)   K = tokens: split K when the output has few tiles
Providers: ours (the TMA kernel on Hopper: matmul_impl="triton"), ours(ptr) (our pointer
kernel), ours(auto) (the shipped policy, MATMUL_TABLE; with --auto), torch (torch.mm = cuBLAS,
plain GEMM: the target is ours >= 0.9x it), torch+relu² (mm, relu, square in eager), old (the
kernel before this change, when --old gives its bmm.py), compile (torch.compile of the same
PyTorch expression, with --compile). Kernel times come from torch.profiler (L2 flushed), so
host overhead does not leak into them; wall_us is the host time per call.
Also: the fused residual forward (ours vs torch.addmm), the relu² backward's elementwise
d(pre) pass, a split-K sweep of the weight gradients, host wall time per `linear` call at a
small shape (ours vs --old vs F.linear), and the autotuned config per shape.

Writes <out>/matmul.{md,png,json}, <out>/matmul_extra.json, and <out>/matmul_table.json: per
problem, "cublas" where our best kernel stayed below 0.9x cuBLAS (torch.addmm for residuals;
never for relu²) and "ptr" where the pointer kernel beat the TMA one: bmm.MATMUL_TABLE's format.

Usage: python3 benchmarks/bench_matmul.py --out DIR [--quick] [--old OLD_BMM.py] [--compile]
           [--M 2048,8192] [--shapes 512->256,...] [--no-sweep] [--auto]
(--old: e.g. `git show 9342bf6:triton_transformer/bmm.py > old_bmm.py`.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import triton_transformer.bmm as bmm_module

SHAPES = [  # (K in, N out, relu²)
    (512, 1536, False),
    (512, 512, False),
    (512, 2048, True),
    (2048, 512, False),
    (512, 256, False),
]


def load_old(path: str | None):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("old_bmm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def layout_key(M: int, N: int, K: int, a: torch.Tensor, b: torch.Tensor) -> str:
    la, lb = bmm_module._layout(a), bmm_module._layout(b)
    ch = lambda lay: "nt"[lay[0]] if lay else "s"
    return f"{M}x{N}x{K}:{ch(la)}{ch(lb)}"


def timed(fn) -> dict | None:
    """{"ms": kernel time (profiler), "event_ms": do_bench median, "wall_us": host per call}."""
    try:
        fn()  # warm-up (autotuning, compilation)
        torch.cuda.synchronize()
        return common.time_op(fn)
    except Exception:
        traceback.print_exc()
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="M = 8192 only")
    parser.add_argument("--old", default=None, help="path of the previous bmm.py")
    parser.add_argument("--compile", action="store_true", help="add torch.compile (fwd)")
    parser.add_argument("--M", default="2048,8192", help="token counts, comma-separated")
    parser.add_argument("--shapes", default=None, help='e.g. "512->256,2048->512" (default all)')
    parser.add_argument("--no-sweep", action="store_true", help="skip the split-K sweep")
    parser.add_argument("--auto", action="store_true", help='add ours under matmul_impl="auto"')
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    old = load_old(args.old)
    dev = "cuda"
    bf16 = torch.bfloat16
    ceil = common.ceilings()
    peak = ceil["bf16_tflops"]
    print(f"ceilings: {ceil}", flush=True)
    bmm_module.matmul_impl = "triton"  # "ours" is our kernel; "ours(auto)" the shipped policy
    rows, extra, table = [], {"split_sweep": [], "wall": [], "relu2_grad": []}, {}

    def add(provider, M, K, N, mode, shape, gemm, t, flops):
        if t is None:
            return None
        tf = flops / t["ms"] / 1e9
        row = {"provider": provider, "M": M, "shape": shape, "mode": mode, "gemm": gemm}
        row.update(dtype="bf16", ms=t["ms"], event_ms=t["event_ms"], wall_us=t["wall_us"])
        row["TFLOP/s"] = tf
        row["frac"] = tf / peak
        rows.append(row)
        with open(out / "rows.jsonl", "a") as f:  # partial results survive a timeout
            f.write(json.dumps(row) + "\n")
        return tf

    ms_list = [8192] if args.quick else [int(m) for m in args.M.split(",")]
    wanted = None if args.shapes is None else set(args.shapes.split(","))
    for M in ms_list:
        for K, N, relu in SHAPES:
            if wanted is not None and f"{K}->{N}" not in wanted:
                continue
            shape = f"{K}->{N}" + (" relu²" if relu else "")
            x = torch.randn(M, K, device=dev, dtype=bf16)
            w = torch.randn(N, K, device=dev, dtype=bf16) * K**-0.5
            dy = torch.randn(M, N, device=dev, dtype=bf16)
            problems = {  # mode: (a, b, (M, N, K) of the GEMM)
                "fwd": (x, w.t(), (M, N, K)),
                "dX": (dy, w, (M, K, N)),
                "dW": (dy.t(), x, (N, K, M)),
            }
            for mode, (a, b, (gm, gn, gk)) in problems.items():
                flops = 2 * gm * gn * gk
                gemm = f"{gm}x{gn}x{gk}"
                ep = relu and mode == "fwd"
                if mode == "fwd":
                    ours = lambda x=x, w=w, ep=ep: bmm_module.linear_op(x, w, None, ep)
                else:
                    ours = lambda a=a, b=b: bmm_module.bmm_op(a, b)
                with torch.no_grad():
                    t_ours = add("ours", M, K, N, mode, shape, gemm, timed(ours), flops)
                    bmm_module._FORCE_PATH = "ptr"  # our pointer kernel, the other Triton path
                    t_ptr = add("ours(ptr)", M, K, N, mode, shape, gemm, timed(ours), flops)
                    bmm_module._FORCE_PATH = None
                    if args.auto:
                        bmm_module.matmul_impl = "auto"
                        add("ours(auto)", M, K, N, mode, shape, gemm, timed(ours), flops)
                        bmm_module.matmul_impl = "triton"
                    t_torch = add("torch", M, K, N, mode, shape, gemm,
                                  timed(lambda a=a, b=b: torch.mm(a, b)), flops)  # fmt: skip
                    if ep:

                        def eager(x=x, w=w):
                            y = F.relu(F.linear(x, w))
                            return y * y

                        add("torch+relu²", M, K, N, mode, shape, gemm, timed(eager), flops)
                    t_old = None
                    if old is not None:
                        c = torch.empty(gm, gn, device=dev, dtype=bf16)
                        fn = lambda a=a, b=b, c=c, ep=ep: old._matmul(
                            a[None], b[None], c[None], relu_squared=ep
                        )
                        t_old = add("old", M, K, N, mode, shape, gemm, timed(fn), flops)
                    if args.compile and mode == "fwd":

                        def expr(x, w, ep=ep):
                            y = F.linear(x, w)
                            if ep:
                                y = F.relu(y)
                                y = y * y
                            return y

                        cf = common.compiled(expr)
                        add("compile", M, K, N, mode, shape, gemm,
                            timed(lambda x=x, w=w, cf=cf: cf(x, w)), flops)  # fmt: skip
                if t_ours and t_torch:
                    t_ptr = t_ptr or 0.0
                    key = layout_key(gm, gn, gk, a, b) + ("+relu2" if ep else "")
                    # relu² stays in Triton: the faster of our two kernels.
                    table[key] = "ptr" if t_ptr > t_ours else None
                    if not ep and max(t_ours, t_ptr) < 0.9 * t_torch:
                        table[key] = "cublas"
                    choice = table[key] or "tma"
                    print(f"{M=} {shape:14s} {mode}: tma {t_ours:5.0f} ptr {t_ptr:5.0f} "
                          f"old {t_old or 0:5.0f} torch{'(mm only)' if ep else ''} "
                          f"{t_torch:5.0f} TFLOP/s -> {choice}", flush=True)  # fmt: skip

                if mode == "dW" and not args.no_sweep:  # split-K sweep of the weight gradient
                    la, lb = bmm_module._layout(a), bmm_module._layout(b)
                    _, num_sms, _ = bmm_module._device_info(torch.cuda.current_device())
                    c = torch.empty(gm, gn, device=dev, dtype=bf16)
                    for split in (1, 2, 4, 8, 16):

                        def run_split(a=a, b=b, c=c, s=split, la=la, lb=lb, n=num_sms):
                            bmm_module._launch_tma(a, b, c, None, None, False, la, lb, s, n, None)

                        t = timed(run_split)
                        if t:
                            print(f"split {gemm} {split}: {flops / t['ms'] / 1e9:.0f} TFLOP/s")
                            extra["split_sweep"].append(
                                {"M": M, "gemm": gemm, "split": split, "ms": t["ms"],
                                 "TFLOP/s": flops / t["ms"] / 1e9,
                                 "heuristic": bmm_module._split_k(gm, gn, gk, num_sms)}
                            )  # fmt: skip

            if relu:  # the relu² backward's elementwise pass: read dy and y, write d(pre)
                y = torch.rand(M, N, device=dev, dtype=bf16)
                t = timed(lambda dy=dy, y=y: bmm_module.relu2_grad_op(dy, y, True))
                if t:
                    extra["relu2_grad"].append(
                        {"M": M, "N": N, "ms": t["ms"], "GB/s": 3 * M * N * 2 / t["ms"] / 1e6,
                         "copy_gbps": ceil["copy_gbps"]}
                    )  # fmt: skip
            if not relu and N == 512:  # fused residual: h + x @ W^T
                h = torch.randn(M, N, device=dev, dtype=bf16)
                flops = 2 * M * N * K
                with torch.no_grad():
                    t1 = add("ours", M, K, N, "fwd+res", shape, f"{M}x{N}x{K}",
                             timed(lambda x=x, w=w, h=h: bmm_module.linear_op(x, w, h, False)),
                             flops)  # fmt: skip
                    addmm = lambda x=x, w=w, h=h: torch.addmm(h, x, w.t())
                    g = f"{M}x{N}x{K}"
                    t2 = add("torch", M, K, N, "fwd+res", shape, g, timed(addmm), flops)
                if t1 and t2:
                    key = layout_key(M, N, K, x, w.t()) + "+res"
                    table[key] = "cublas" if t2 > t1 else None
                    print(f"{M=} {shape:14s} fwd+res: ours {t1:6.1f} addmm {t2:6.1f} "
                          f"({t1 / t2:.2f}x)", flush=True)  # fmt: skip

    # Host wall time per call at a small shape (the kernels take a few µs).
    x = torch.randn(16, 512, device=dev, dtype=bf16)
    w = torch.randn(512, 512, device=dev, dtype=bf16)

    def kernel_only(x, w):  # ours without the op dispatch and checks: the launch alone
        y = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        bmm_module._mm2d_into(x, w.t(), y)
        return y

    cases = {
        "ours": lambda x, w: bmm_module.linear(x, w, use_triton=True),
        "ours:op": lambda x, w: bmm_module.linear_op(x, w, None, False),
        "ours:launch": kernel_only,
        "ours:cublas": lambda x, w: bmm_module.linear_op(x, w, None, False),
        "F.linear": F.linear,
    }
    if old is not None:
        cases["old"] = lambda x, w: old.linear(x, w, use_triton=True)
    for name, fn in cases.items():
        for mode in ("fwd", "fwd+bwd") if ":" not in name else ("fwd",):
            xx = x.clone().requires_grad_(mode != "fwd")
            ww = w.clone().requires_grad_(mode != "fwd")

            def call(fn=fn, xx=xx, ww=ww, mode=mode, name=name):
                bmm_module.matmul_impl = "cublas" if name == "ours:cublas" else "auto"
                y = fn(xx, ww)
                if mode != "fwd":
                    y.backward(torch.ones_like(y))

            for _ in range(20):
                call()
            torch.cuda.synchronize()
            n = 300
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / n * 1e6
            extra["wall"].append({"impl": name, "mode": mode, "us_per_call": us})
            print(f"wall per linear call (16x512 @ 512x512, {mode}): {name} {us:.1f} us")

    extra["autotuned"] = {
        str(k): str(v) for k, v in getattr(bmm_module._mm_tma_tuned, "cache", {}).items()
    }
    name = torch.cuda.get_device_name()
    table = {k: v for k, v in sorted(table.items()) if v}
    (out / "matmul_table.json").write_text(json.dumps({name: table}, indent=1))
    (out / "matmul_extra.json").write_text(json.dumps(extra, indent=1))
    common.report(out, "matmul", rows, x="M", y="TFLOP/s", group=("shape", "mode"))
    print(json.dumps(extra["split_sweep"]))
    print(json.dumps(extra["relu2_grad"]))
    print("MATMUL_TABLE entries:", json.dumps(table))


if __name__ == "__main__":
    main()
