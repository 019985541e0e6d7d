"""GPU benchmark of the modern-block ops: RMSNorm (and the fused residual + RMSNorm), RoPE and
SwiGLU, and the feed-forward's projection with the SwiGLU gating fused into its epilogue, ours
against PyTorch eager, torch.compile and Liger-Kernel, in one run.

    python3 benchmarks/bench_modern_ops.py --out DIR [--quick] [--no-compile] [--ops ...]
    python3 benchmarks/bench_modern_ops.py --out DIR --ops linear+swiglu   # fused vs cuBLAS + ew
    TRITON_INTERPRET=1 python3 benchmarks/bench_modern_ops.py --out DIR --smoke   # CPU check

Providers: ours (the Triton ops: `rmsnorm`, `residual_rmsnorm`, `rope`, `swiglu`), torch (the
same functions' PyTorch branch, eager), compile (torch.compile of that branch, static shapes)
and liger (`liger_kernel.ops.rms_norm.LigerRMSNormFunction`, `liger_kernel.ops.rope.
LigerRopeFunction`, `liger_kernel.ops.swiglu.LigerSiLUMulFunction`, imported lazily; skipped
when Liger-Kernel is missing, and a provider that fails is recorded with its error, not fatal).
Liger's RoPE reads precomputed (seq, head_dim) cos/sin tables, built outside the timed call;
ours computes them in the kernel. residual_rmsnorm has no Liger counterpart.

linear+swiglu, x (M, K) and a weight (2·H, K) of gate rows then up rows -> silu(x W_gᵀ) ·
(x W_uᵀ) (M, H), shapes (M, K, H): ours is `bmm.linear(x, w, activation="swiglu")` with its
forward forced to the fused kernel (`matmul_plan._FORCE_PATH = "tma"`: the TMA kernel's SWIGLU
epilogue on Hopper, else the pointer kernel's), cublas+ew the same call forced to "cublas+ew"
(torch.mm of the (M, 2·H) projection, then `swiglu.py`'s forward kernel); the backward, the
same for both (swiglu's backward kernel into one (M, 2·H) gradient, then dX and dW on cuBLAS),
runs unforced. torch is F.linear, then F.silu(gate) * up on the halves (compile: that, through
torch.compile); liger is Liger's own MLP's composition, torch.mm of x with each half of the
weight (contiguous gate and up: halves of one projection would be copied first), then
`LigerSiLUMulFunction`. Which of fused and cublas+ew the planner should pick per shape (the
`MATMUL_TABLE` entry: "fused" where the fused kernel won the forward; cublas+ew, the
planner's default, needs none) ends `modern_ops.md`.

Modes: fwd (inference: no grad recorded) and fwd+bwd (the forward with grad enabled, then
torch.autograd.grad of all differentiable inputs). bf16 by default.

Bytes counted are the minimum each op must move, the same for every provider (e = bytes per
element; weights, per-row statistics and cos/sin tables ignored):
  rmsnorm           fwd 2·M·N·e (x, y)                 fwd+bwd 5·M·N·e (+ x, dy, dx)
  residual_rmsnorm  fwd 4·M·N·e (h, branch, h_new, y)  fwd+bwd 8·M·N·e (+ h_new, dy, dh_new, dh)
  rope              fwd 2·(|q|+|k|)·e                  fwd+bwd 4·(|q|+|k|)·e
  swiglu            fwd 3·M·N·e (gate, up, y)          fwd+bwd 8·M·N·e (+ dy, gate, up, dg, du)
linear+swiglu is compute-bound and reports TFLOP/s instead: fwd 2·M·K·2H, fwd+bwd 3x that (dX,
dW), elementwise work not counted; `frac` is over torch.mm's bf16 rate measured in the run.
GB/s uses the GPU kernel time (`common.time_op`: kernel durations summed by torch.profiler, L2
flushed before every call); `event_ms` is triton.testing.do_bench's median and `wall_us` the
host time per call in a synchronised loop. `frac` is GB/s over the device-to-device copy
bandwidth measured in the same run.

Writes, under --out: `<op>.json` / `<op>.md` / `<op>.png` per op (`common.report`) and
`modern_ops.json` (every row plus the environment) and `modern_ops.md` (ours against each
other provider, kernel time and wall time, per op, shape and mode).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_transformer import matmul_plan
from triton_transformer.bmm import linear
from triton_transformer.rmsnorm import residual_rmsnorm, rmsnorm
from triton_transformer.rope import rope
from triton_transformer.swiglu import swiglu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPS = ("rmsnorm", "residual_rmsnorm", "rope", "swiglu", "linear+swiglu")
MODES = ("fwd", "fwd+bwd")
EPS = 1e-6
# Shapes per op: (M, N) rows x width for the norms and swiglu; (b, h_q, h_k, n, d) for rope;
# (M, K, H) tokens x model width -> hidden (the weight 2·H x K) for linear+swiglu.
SHAPES = {
    "rmsnorm": [(4096, 768), (4096, 2048), (8192, 4096), (4096, 8192), (2048, 16384)],
    "residual_rmsnorm": [(4096, 768), (8192, 4096)],
    "rope": [(8, 12, 12, 1024, 64), (4, 32, 8, 2048, 128), (1, 32, 32, 8192, 128)],
    "swiglu": [(8192, 2048), (8192, 5632), (4096, 11008), (8192, 14336)],
    "linear+swiglu": [(16384, 768, 2048), (8192, 2048, 5632)],
}
QUICK = {op: shapes[:2] for op, shapes in SHAPES.items()}
SMOKE = {
    "rmsnorm": [(8, 40)],
    "residual_rmsnorm": [(8, 40)],
    "rope": [(1, 2, 1, 5, 8)],
    "swiglu": [(8, 40)],
    "linear+swiglu": [(8, 16, 40)],
}
BYTES = {  # elements-passes per element of the op's main tensor (see the docstring)
    "rmsnorm": {"fwd": 2, "fwd+bwd": 5},
    "residual_rmsnorm": {"fwd": 4, "fwd+bwd": 8},
    "rope": {"fwd": 2, "fwd+bwd": 4},
    "swiglu": {"fwd": 3, "fwd+bwd": 8},
}
FLOPS = {"linear+swiglu": {"fwd": 1, "fwd+bwd": 3}}  # x 2·M·K·2H (the docstring)
PROVIDERS = ("ours", "cublas+ew", "torch", "compile", "liger")


def _common():
    """benchmarks/common.py (its helpers need CUDA), or None on the CPU."""
    if DEVICE != "cuda":
        return None
    import common

    return common


def _liger_ops():
    """liger_kernel.ops (the kernels) if importable, else None."""
    common = _common()
    mod = common.liger() if common is not None else None
    return mod.ops if mod is not None else None


# ----------------------------------------------------------------------------- inputs


def make_inputs(op: str, shape: tuple, dtype: torch.dtype) -> tuple[list, dict]:
    """(differentiable inputs, extra non-differentiable arguments) of one case."""
    g = dict(device=DEVICE, dtype=dtype)
    if op == "rope":
        b, hq, hk, n, d = shape
        q, k = torch.randn(b, hq, n, d, **g), torch.randn(b, hk, n, d, **g)
        return [q, k], {}
    if op == "linear+swiglu":
        M, K, H = shape
        return [torch.randn(M, K, **g), torch.randn(2 * H, K, **g) * K**-0.5], {}
    M, N = shape
    if op == "swiglu":
        return [torch.randn(M, N, **g), torch.randn(M, N, **g)], {}
    w = 1.0 + 0.1 * torch.randn(N, device=DEVICE, dtype=torch.float32)
    if op == "rmsnorm":
        return [torch.randn(M, N, **g), w.to(dtype)], {}
    return [torch.randn(M, N, **g), torch.randn(M, N, **g), w.to(dtype)], {}


def main_elems(op: str, shape: tuple) -> int:
    if op == "rope":
        b, hq, hk, n, d = shape
        return b * (hq + hk) * n * d
    if op == "linear+swiglu":  # the output, M x H
        return shape[0] * shape[2]
    return shape[0] * shape[1]


def _forward_forced(path: str, fn: Callable) -> Callable:
    """fn with the planner's `_FORCE_PATH` set to `path` for its call (the forward) only: the
    backward, run later by autograd, is planned as without a force."""

    def run(*args):
        saved = matmul_plan._FORCE_PATH
        matmul_plan._FORCE_PATH = path
        try:
            return fn(*args)
        finally:
            matmul_plan._FORCE_PATH = saved

    return run


def _torch_linear_swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_swiglu_fn(provider: str) -> Callable | None:
    """linear+swiglu's function per provider (see the module docstring); None if absent."""
    if provider in ("ours", "cublas+ew"):
        fused = lambda x, w: linear(x, w, "swiglu", use_triton=True)
        return _forward_forced("tma" if provider == "ours" else "cublas+ew", fused)
    if provider == "torch":
        return _torch_linear_swiglu
    if provider == "compile":
        common = _common()
        compile_fn = common.compiled if common is not None else torch.compile
        return compile_fn(_torch_linear_swiglu)
    if provider != "liger" or _liger_ops() is None:
        return None
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def liger(x, w):
        H = w.shape[0] // 2
        return LigerSiLUMulFunction.apply(torch.mm(x, w[:H].t()), torch.mm(x, w[H:].t()))

    return liger


def _rope_tables(n: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face-layout (1, n, d) cos/sin tables, for Liger's RoPE."""
    inv_freq = 10000.0 ** -(torch.arange(0, d, 2, device=DEVICE, dtype=torch.float64) / d)
    theta = torch.arange(n, device=DEVICE, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((theta, theta), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def provider_fn(provider: str, op: str, shape: tuple, dtype: torch.dtype) -> Callable | None:
    """The function of a provider for one op: f(*inputs) -> tensor or tuple; None if absent."""
    if op == "linear+swiglu":
        return linear_swiglu_fn(provider)
    if provider == "cublas+ew":  # linear+swiglu's only
        return None
    use_triton = provider == "ours"
    if provider in ("ours", "torch", "compile"):
        fns = {
            "rmsnorm": lambda x, w: rmsnorm(x, w, EPS, use_triton),
            "residual_rmsnorm": lambda h, br, w: residual_rmsnorm(
                h, br, w, eps=EPS, use_triton=use_triton
            ),
            "rope": lambda q, k: rope(q, k, use_triton=use_triton),
            "swiglu": lambda gate, up: swiglu(gate, up, use_triton),
        }
        fn = fns[op]
        if provider == "compile":
            common = _common()
            fn = common.compiled(fn) if common is not None else torch.compile(fn)
        return fn
    ops = _liger_ops()
    if provider != "liger" or ops is None or op == "residual_rmsnorm":
        return None
    if op == "rmsnorm":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS)
    if op == "rope":
        from liger_kernel.ops.rope import LigerRopeFunction

        cos, sin = _rope_tables(shape[3], shape[4], dtype)
        return lambda q, k: LigerRopeFunction.apply(q, k, cos, sin)
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return lambda gate, up: LigerSiLUMulFunction.apply(gate, up)


def mode_fn(fn: Callable, inputs: list, mode: str) -> Callable[[], object]:
    """The timed call: the forward alone (no grad), or forward + backward of every input."""
    if mode == "fwd":

        def run():
            with torch.no_grad():
                return fn(*inputs)

        return run
    leaves = [t.detach().requires_grad_() for t in inputs]
    with torch.no_grad():
        out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    cotangents = [torch.randn_like(o) for o in outs]

    def run():
        res = fn(*leaves)
        res = res if isinstance(res, tuple) else (res,)
        return torch.autograd.grad(res, leaves, cotangents)

    return run


def time_call(run: Callable[[], object]) -> dict:
    common = _common()
    if common is not None:
        return common.time_op(run)
    run()  # CPU smoke: one warm call, one timed
    t0 = time.perf_counter()
    run()
    return {
        "ms": float("nan"),
        "event_ms": float("nan"),
        "wall_us": (time.perf_counter() - t0) * 1e6,
    }


# ----------------------------------------------------------------------------- run


def run_bench(args) -> list[dict]:
    common = _common()
    ceilings = common.ceilings() if common is not None else {}
    copy_gbps = ceilings.get("copy_gbps", float("nan"))
    shapes = SMOKE if args.smoke else QUICK if args.quick else SHAPES
    providers = [p for p in PROVIDERS if p != "compile" or not args.no_compile]
    rows = []
    for op in args.ops:
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            for shape in shapes[op]:
                inputs, _ = make_inputs(op, shape, dtype)
                elem = torch.empty((), dtype=dtype).element_size()
                for mode in MODES:
                    for provider in providers:
                        row = dict(op=op, dtype=dname, mode=mode, shape="x".join(map(str, shape)),
                                   size=main_elems(op, shape), provider=provider)  # fmt: skip
                        try:
                            fn = provider_fn(provider, op, shape, dtype)
                            if fn is None:
                                continue
                            t = time_call(mode_fn(fn, inputs, mode))
                        except Exception as e:  # a provider's failure is a result, not fatal
                            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                            rows.append(row)
                            print(json.dumps(row), flush=True)
                            continue
                        row.update(ms=t["ms"], event_ms=t["event_ms"], wall_us=t["wall_us"])
                        if op in FLOPS:  # compute-bound: TFLOP/s over torch.mm's rate
                            M, K, H = shape
                            flops = FLOPS[op][mode] * 2 * M * K * 2 * H
                            tflops = flops / (t["ms"] * 1e-3) / 1e12
                            peak = ceilings.get("bf16_tflops", float("nan"))
                            row.update({"TFLOP/s": tflops, "frac": tflops / peak})
                        else:
                            nbytes = BYTES[op][mode] * main_elems(op, shape) * elem
                            gbps = nbytes / (t["ms"] * 1e-3) / 1e9
                            row.update({"GB/s": gbps, "frac": gbps / copy_gbps})
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    return "error" if "error" in r else f"{r['ms']:.4g} / {r['wall_us']:.0f}"


def _ratio(ours: dict | None, other: dict | None) -> str:
    if not ours or not other or "ms" not in ours or "ms" not in other:
        return "-"
    return f"{other['ms'] / ours['ms']:.2f}"


def _table_entries(rows: list[dict]) -> list[str]:
    """linear+swiglu: the `MATMUL_TABLE` entry per shape, from the forward's kernel times
    ("fused" where the fused kernel beat cuBLAS + the gating pass; "cublas+ew", the planner's
    default, needs no entry and is listed for the record). Keys "MxHxK:nt+swiglu" (x
    row-major, the weight read transposed)."""
    keyed = {(r["shape"], r["mode"], r["provider"]): r for r in rows if r["op"] == "linear+swiglu"}
    lines = []
    for shape in dict.fromkeys(s for s, _, _ in keyed):
        fused, ew = keyed.get((shape, "fwd", "ours")), keyed.get((shape, "fwd", "cublas+ew"))
        if not fused or not ew or "ms" not in fused or "ms" not in ew:
            continue
        M, K, H = shape.split("x")
        pick = "cublas+ew" if ew["ms"] < fused["ms"] else "fused"
        lines.append(
            f'- `"{M}x{H}x{K}:nt+swiglu": "{pick}"` (fwd: fused {fused["ms"]:.4g} ms, '
            f"cublas+ew {ew['ms']:.4g} ms)"
        )
    return lines


def summary(rows: list[dict]) -> str:
    """Markdown: per op, shape, dtype and mode, each provider's kernel ms and wall µs, and
    ours' kernel-time speedup over each other provider (> 1: ours faster)."""
    others = PROVIDERS[1:]
    lines = [
        "# Modern-block ops: ours against torch, torch.compile and Liger-Kernel",
        "",
        "kernel ms (torch.profiler, L2 flushed) / wall µs per call; x = other's kernel time "
        "over ours'. cublas+ew: linear+swiglu only (cuBLAS's projection, then our gating pass).",
        "",
        "| op | dtype | shape | mode | " + " | ".join(PROVIDERS) + " | "
        + " | ".join(f"x {p}" for p in others) + " |",
        "|" + "---|" * (4 + len(PROVIDERS) + len(others)),
    ]  # fmt: skip
    keyed = {(r["op"], r["dtype"], r["shape"], r["mode"], r["provider"]): r for r in rows}
    cases = dict.fromkeys((r["op"], r["dtype"], r["shape"], r["mode"]) for r in rows)
    for case in cases:
        get = {p: keyed.get((*case, p)) for p in PROVIDERS}
        cells = [_cell(r) for r in get.values()]
        ratios = [_ratio(get["ours"], get[p]) for p in others]
        lines.append("| " + " | ".join([*case, *cells, *ratios]) + " |")
    entries = _table_entries(rows)
    if entries:
        lines += ["", "## linear+swiglu: MATMUL_TABLE entries (forward kernel time)", ""]
        lines += entries
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "## Providers that failed", ""]
        lines += [
            f"- {r['provider']} {r['op']} {r['shape']} {r['mode']}: {r['error']}" for r in errors
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description="RMSNorm, RoPE, SwiGLU and linear+swiglu benchmark")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="two shapes per op")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check)")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    args = ap.parse_args()
    start = time.time()
    rows = run_bench(args)
    args.out.mkdir(parents=True, exist_ok=True)
    common = _common()
    env = common.env_info() if common is not None else {"device": "cpu", "torch": torch.__version__}
    env["liger"] = _liger_ops() is not None
    (args.out / "modern_ops.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    (args.out / "modern_ops.md").write_text(summary(rows))
    if common is not None:
        for op in args.ops:
            y = "TFLOP/s" if op in FLOPS else "GB/s"
            op_rows = [r for r in rows if r["op"] == op and y in r]
            if op_rows:
                common.report(args.out, op.replace("+", "_"), op_rows, x="size", y=y)
    print(f"done in {time.time() - start:.0f}s; {args.out / 'modern_ops.md'}")


if __name__ == "__main__":
    main()
