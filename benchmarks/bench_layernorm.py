"""GPU benchmark of LayerNorm (plain and stable) and fused residual + LayerNorm.

    python3 benchmarks/bench_layernorm.py --out DIR [--quick] [--jobs K] [--tune]

Providers, side by side in one run: ours (the Triton ops), torch (eager PyTorch), compile
(torch.compile of the eager expression, static shapes) and liger (Liger-Kernel's
LigerLayerNormFunction, plain LayerNorm only, when importable). M = 4096 rows with N in
512..16384, plus 16384 x 1024; fp16 and bf16; modes fwd, bwd and fwd+bwd (training mode: the
forward runs with grad enabled, as in a training step).

Bytes counted are the minimum each op must move, the same for every provider (each input read
once, each output written once; weights and per-row stats ignored):
  layernorm           fwd 2·M·N·e (x, y)       bwd 3·M·N·e (x, dy, dx)
  residual_layernorm  fwd 4·M·N·e (h, branch, h_new, y)
                      bwd 4·M·N·e (h_new, dy, dh_new, dh; dbranch is dh when p = 0)
GB/s uses the kernel time (sum of the op's kernel durations from torch.profiler, L2 flushed
before each call: host overhead excluded, which do_bench's events do not guarantee);
`frac` is GB/s over the device-to-device copy bandwidth measured in the same run; `wall_us` is
host wall-clock per call in a tight loop.

--tune sweeps the Triton kernels' launch configurations (rows per program, warps, backward
programs per SM, and the single-launch "last program reduces" backward) and writes the best
per N: the source of `layernorm._FWD_TABLE` / `_BWD_TABLE` and of `utils.calc_num_warps`.
--jobs K (default 8 on a GPU) compiles everything first in K worker processes (Triton and
Inductor caches on disk), so the timed process does not wait on compilers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_transformer.layernorm import (
    _layernorm_torch,
    _num_sms,
    launch_bwd,
    launch_fwd,
    layernorm,
)
from triton_transformer.residual_layernorm import residual_layernorm
from triton_transformer.utils import cdiv, next_power_of_2

try:  # the shared benchmark helpers (benchmarks/common.py)
    common = importlib.import_module("common")
except ImportError:
    common = None

EPS = 1e-5
# CPU (TRITON_INTERPRET=1, tiny --shapes) only to smoke-test this script.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    common = None  # its helpers need CUDA
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = [(4096, n) for n in (512, 1024, 2048, 4096, 8192, 16384)] + [(16384, 1024)]
QUICK_SHAPES = [(4096, 1024), (4096, 4096), (16384, 1024)]
OPS = ["layernorm", "layernorm_stable", "residual_layernorm"]
MODES = ["fwd", "bwd", "fwd+bwd"]
BYTES_PER_ELEM_PASS = {
    "layernorm": {"fwd": 2, "bwd": 3, "fwd+bwd": 5},
    "layernorm_stable": {"fwd": 2, "bwd": 3, "fwd+bwd": 5},
    "residual_layernorm": {"fwd": 4, "bwd": 4, "fwd+bwd": 8},
}


# ----------------------------------------------------------------------------- measurement


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def ceilings() -> dict:
    if common is not None and hasattr(common, "ceilings"):
        return common.ceilings()
    if DEVICE == "cpu":
        return {"copy_gbps": float("nan")}
    n = (2 << 30) // 4
    src = torch.empty(n, dtype=torch.float32, device=DEVICE).uniform_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return {"copy_gbps": 2 * n * 4 / (ms * 1e-3) / 1e9}


def time_op(fn: Callable[[], object]) -> dict:
    """{"kernel_ms": profiled kernel time (`common.kernel_ms`), "event_ms": do_bench's time,
    "wall_us": host wall per call in a tight loop}; on the CPU only the wall time."""
    if common is not None:
        t = common.time_op(fn)
        return {"kernel_ms": t["ms"], "event_ms": t["event_ms"], "wall_us": t["wall_us"]}
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    fn()
    return {"kernel_ms": float("nan"), "wall_us": (time.perf_counter() - t0) * 1e6}


def _kernel_ms(fn: Callable[[], object]) -> float:
    """Kernel time for the tuning sweep: CUDA-graph replays of direct launches (no host
    overhead in the timing; no L2 flush, so small shapes read partly from L2 for every
    candidate alike)."""
    if DEVICE == "cpu":
        fn()
        return float("nan")
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def _direct_launches():
    """Launch the kernels directly, as inside the triton_ops in eager mode (outside them
    `wrap_triton` would dispatch through its higher-order op: ~100 us of host time each)."""
    try:
        from torch._library.triton import set_wrap_triton_enabled
    except ImportError:  # older torch: wrap_triton launches directly anyway
        import contextlib

        return contextlib.nullcontext()
    return set_wrap_triton_enabled(False)


def liger():
    """liger_kernel.ops.layer_norm (LigerLayerNormFunction), or None if Liger is missing."""
    if common is not None and hasattr(common, "liger") and common.liger() is None:
        return None
    try:
        return importlib.import_module("liger_kernel.ops.layer_norm")
    except Exception:
        return None


def report(out_dir: Path, op: str, rows: list[dict], x: str = "N", y: str = "GB/s") -> None:
    if common is not None and hasattr(common, "report"):
        # M in the panel key: 4096 x 1024 and 16384 x 1024 share N.
        common.report(out_dir, op, rows, x=x, y=y, group=("dtype", "mode", "M"))
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = ["provider", "M", "N", "dtype", "mode", "ms", "wall_us", y, "frac"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        vals = [r.get(k, "") for k in keys]
        lines.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v)
                                         for v in vals) + " |")  # fmt: skip
    (out_dir / f"{op}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = sorted({(r["dtype"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, (dtype, mode) in zip(axes[0], groups, strict=True):
        for prov in sorted({r["provider"] for r in rows}):
            pts = [r for r in rows if (r["provider"], r["dtype"], r["mode"]) == (prov, dtype, mode)]
            pts.sort(key=lambda r: r["M"] * r["N"])
            ax.plot([f"{r['M']}x{r['N']}" for r in pts], [r[y] for r in pts], "o-", label=prov)
        ax.set_title(f"{op} {dtype} {mode}")
        ax.set_ylabel(y)
        ax.tick_params(axis="x", rotation=45)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / f"{op}.png", dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- providers


def _inputs(op: str, M: int, N: int, dtype: torch.dtype):
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=DEVICE, generator=g)

    w = (1.0 + 0.1 * rnd(N)).to(dtype).requires_grad_()
    b = (0.1 * rnd(N)).to(dtype).requires_grad_()
    if op == "residual_layernorm":
        h = (-1.0 + rnd(M, N)).to(dtype).requires_grad_()
        br = rnd(M, N).to(dtype).requires_grad_()
        grads = [rnd(M, N).to(dtype), rnd(M, N).to(dtype)]  # dh_new, dy
        return [h, br, w, b], grads
    x = (-1.0 + rnd(M, N)).to(dtype).requires_grad_()
    return [x, w, b], [rnd(M, N).to(dtype)]


def _torch_fn(op: str):
    if op == "layernorm":
        return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS)
    if op == "layernorm_stable":
        return lambda x, w, b: _layernorm_torch(x, w, b, EPS, True)

    def res(h, br, w, b):
        h_new = h + br
        return h_new, F.layer_norm(h_new, (h.shape[-1],), w, b, EPS)

    return res


def provider_fn(provider: str, op: str):
    """A function of the op's inputs returning its output(s), or None if not offered."""
    if provider == "ours":
        if op == "residual_layernorm":
            return lambda h, br, w, b: residual_layernorm(h, br, w, b, eps=EPS, use_triton=True)
        stable = op == "layernorm_stable"
        return lambda x, w, b: layernorm(x, w, b, EPS, stable, use_triton=True)
    if provider == "torch":
        return _torch_fn(op)
    if provider == "compile":
        if common is not None and hasattr(common, "compiled"):
            return common.compiled(_torch_fn(op), dynamic=False)
        return torch.compile(_torch_fn(op), dynamic=False)
    if provider == "liger" and op == "layernorm":
        mod = liger()
        if mod is None:
            return None
        return lambda x, w, b: mod.LigerLayerNormFunction.apply(x, w, b, EPS)
    return None


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def mode_fns(fn, inputs, grads):
    """{mode: zero-arg callable} for fwd, bwd (autograd.grad of a retained graph), fwd+bwd."""
    outs = _as_tuple(fn(*inputs))

    def fwd():
        return fn(*inputs)

    def bwd():
        return torch.autograd.grad(outs, inputs, grads, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(_as_tuple(fn(*inputs)), inputs, grads)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def _shapes(args, default):
    if args.shapes:
        return [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    return default


def cases(args):
    shapes = _shapes(args, QUICK_SHAPES if args.quick else SHAPES)
    dtypes = ["bf16"] if args.quick else args.dtypes.split(",")
    return [(op, M, N, d) for op in OPS for d in dtypes for (M, N) in shapes]


def run_bench(args, out_dir: Path, shard: tuple[int, int] | None = None) -> list[dict]:
    providers = args.providers.split(",")
    all_cases = cases(args)
    if shard is not None:  # warm-up worker: compile and run once, no timing
        all_cases = all_cases[shard[0] :: shard[1]]
    rows: list[dict] = []
    ceil = None if shard else ceilings()
    if ceil:
        print(f"copy ceiling {ceil['copy_gbps']:.0f} GB/s", flush=True)
    for op, M, N, dname in all_cases:
        dtype = DTYPES[dname]
        inputs, grads = _inputs(op, M, N, dtype)
        for prov in providers:
            fn = provider_fn(prov, op)
            if fn is None:
                continue
            try:
                fns = mode_fns(fn, inputs, grads)
                for mode, f in fns.items():
                    if shard is not None:
                        f()
                        continue
                    t = time_op(f)
                    gbs = BYTES_PER_ELEM_PASS[op][mode] * M * N * dtype.itemsize / (
                        t["kernel_ms"] * 1e-3) / 1e9  # fmt: skip
                    rows.append(dict(op=op, provider=prov, M=M, N=N, dtype=dname, mode=mode,
                                     ms=t["kernel_ms"], wall_us=t["wall_us"],
                                     **{"GB/s": gbs, "frac": gbs / ceil["copy_gbps"]}))  # fmt: skip
                    print(f"row {op} {prov} {M}x{N} {dname} {mode} {t['kernel_ms'] * 1e3:.1f}us "
                          f"{gbs:.0f}GB/s wall {t['wall_us']:.0f}us", flush=True)  # fmt: skip
            except Exception as e:  # a provider failing must not kill the run
                print(f"{prov} {op} {M}x{N} {dname}: {type(e).__name__}: {e}"[:300], flush=True)
            _sync()
        if shard is None:  # partial results survive a timeout
            (out_dir / "layernorm_bench.json").write_text(json.dumps(dict(rows=rows), indent=1))
        del inputs, grads
    return rows


# ----------------------------------------------------------------------------- tuning sweep


def _fwd_candidates(block_n: int):
    for bm in (1, 2, 4, 8, 16, 32):
        for warps in (2, 4, 8, 16, 32):
            per_thread = bm * block_n / (32 * warps)
            if bm * block_n <= 16384 and 4 <= per_thread <= 64:
                yield bm, warps


def _bwd_candidates(block_n: int):
    for bm in (1, 2, 4, 8, 16):
        for warps in (4, 8, 16, 32):
            per_thread = bm * block_n / (32 * warps)
            if bm * block_n <= max(8192, block_n) and 2 <= per_thread <= 32:
                yield bm, warps


TUNE_SHAPES = [(4096, n) for n in (512, 1024, 2048, 4096, 8192, 16384)] + [(16384, 1024)]


def _tune_shape(M: int, N: int, sms: int, shard: tuple[int, int] | None) -> list[dict]:
    """Time every candidate configuration at one shape (bf16). A warm-up shard (i, k) instead
    only compiles (runs once) every k-th candidate, starting at the i-th."""
    timed = shard is None
    count = [0]

    def mine() -> bool:
        count[0] += 1
        return timed or (count[0] - 1) % shard[1] == shard[0]

    dtype = torch.bfloat16
    rows: list[dict] = []
    block_n = max(16, next_power_of_2(N))
    x = (-1.0 + torch.randn(M, N, device=DEVICE)).to(dtype)
    dy = torch.randn(M, N, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(N, device=DEVICE)).to(dtype)
    b = (0.1 * torch.randn(N, device=DEVICE)).to(dtype)
    y = torch.empty_like(x)
    stats = torch.empty((2, M), device=DEVICE)
    dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def fwd(cfg):
        launch_fwd(x, w, b, y, stats, EPS, False, cfg=cfg)

    def bwd(cfg, c):
        launch_bwd(dy, x, w, stats, dx, dw, db, EPS, False, cfg=cfg, counter=c)

    for bm, warps in _fwd_candidates(block_n):
        cfg = (bm, block_n, warps, True)
        if not mine():
            continue
        fwd(cfg)
        if timed:
            ms = _kernel_ms(lambda cfg=cfg: fwd(cfg))
            rows.append(dict(kind="fwd", M=M, N=N, block_m=bm, warps=warps, ms=ms,
                             gbps=2 * M * N * 2 / ms / 1e6))  # fmt: skip
    launch_fwd(x, w, b, y, stats, EPS, False)
    for bm, warps in _bwd_candidates(block_n):
        for prefetch in (False, True):
            for per_sm in (1, 2, 4, 8):
                tiles = cdiv(M, bm)
                programs = max(1, min(tiles, per_sm * sms))
                rpp = cdiv(tiles, programs) * bm
                cfg = (bm, block_n, warps, True, cdiv(M, rpp), rpp, prefetch)
                for fused in (False, True):
                    if fused and (per_sm > 2 or prefetch):
                        continue
                    c = counter if fused else None
                    if per_sm > 1 and not timed:
                        continue  # the same binary as per_sm = 1
                    if not mine():
                        continue
                    bwd(cfg, c)
                    if not timed:
                        continue
                    ms = _kernel_ms(lambda cfg=cfg, c=c: bwd(cfg, c))
                    kind = "bwd_fused" if fused else "bwd"
                    gbps = 3 * M * N * 2 / ms / 1e6
                    rows.append(dict(kind=kind, M=M, N=N, block_m=bm, warps=warps, per_sm=per_sm,
                                     prefetch=prefetch, ms=ms, gbps=gbps))  # fmt: skip
    return rows


def run_tune(args, shard: tuple[int, int] | None = None) -> list[dict]:
    sms = _num_sms(torch.device(DEVICE))
    shapes = _shapes(args, TUNE_SHAPES)
    rows: list[dict] = []
    for M, N in shapes:
        if shard is None and rows:  # partial results survive a timeout
            (args.out / "layernorm_tune.json").write_text(json.dumps(dict(rows=rows), indent=1))
        with _direct_launches():
            shape_rows = _tune_shape(M, N, sms, shard)
        best: dict[str, dict] = {}
        for r in shape_rows:
            if r["kind"] not in best or r["ms"] < best[r["kind"]]["ms"]:
                best[r["kind"]] = r
        for r in best.values():
            print("best", json.dumps(r), flush=True)
        rows += shape_rows
    return rows


def pick_tables(tune_rows: list[dict]) -> dict:
    """Per power-of-two column block, the configuration with the smallest summed time ratio
    to the best at each tuned shape (so one entry serves e.g. 4096 and 16384 rows)."""
    keys = {"fwd": ("block_m", "warps"), "bwd": ("block_m", "warps", "per_sm", "prefetch")}
    tables: dict = {"fwd": {}, "bwd": {}, "fwd_warps_one_row": {}}
    for kind, names in keys.items():
        rows = [r for r in tune_rows if r["kind"] == kind and r["ms"] == r["ms"]]
        for bn in sorted({max(16, next_power_of_2(r["N"])) for r in rows}):
            rs = [r for r in rows if max(16, next_power_of_2(r["N"])) == bn]
            shapes = {(r["M"], r["N"]) for r in rs}
            best = {sh: min(r["ms"] for r in rs if (r["M"], r["N"]) == sh) for sh in shapes}
            score: dict = {}
            count: dict = {}
            for r in rs:
                cfg = tuple(r[k] for k in names)
                score[cfg] = score.get(cfg, 0.0) + r["ms"] / best[(r["M"], r["N"])]
                count[cfg] = count.get(cfg, 0) + 1
            full = [c for c in score if count[c] == len(shapes)]
            tables[kind][bn] = min(full, key=score.__getitem__)
            if kind == "fwd":
                one = [r for r in rs if r["block_m"] == 1]
                if one:
                    tables["fwd_warps_one_row"][bn] = min(one, key=lambda r: r["ms"])["warps"]
    return tables


def install_tables(tables: dict) -> None:
    """Run `ours` with the tuned tables (as if committed to layernorm.py)."""
    ln = sys.modules["triton_transformer.layernorm"]
    ln._FWD_TABLE.update({int(k): tuple(v) for k, v in tables["fwd"].items()})
    ln._BWD_TABLE.update({int(k): tuple(v) for k, v in tables["bwd"].items()})
    ln._fwd_config.cache_clear()
    ln._bwd_block_config.cache_clear()


# ----------------------------------------------------------------------------- main


def _warm(args, jobs: int) -> None:
    """Compile everything in `jobs` worker processes first (shared on-disk caches)."""
    t0 = time.time()
    argv = [sys.executable, __file__, "--out", str(args.out)]
    argv += ["--quick"] * args.quick + ["--tune"] * args.tune
    argv += ["--shapes", args.shapes] if args.shapes else []
    argv += ["--dtypes", args.dtypes, "--providers", args.providers]
    argv += ["--tuned", str(args.tuned)] if args.tuned else []
    procs = [subprocess.Popen([*argv, "--warm-shard", f"{i}/{jobs}"]) for i in range(jobs)]
    codes = [p.wait() for p in procs]
    print(f"warm-up in {jobs} processes: {time.time() - t0:.0f} s, exit codes {codes}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true", help="sweep launch configurations instead")
    ap.add_argument("--shapes", default="", help="MxN,MxN,... instead of the default shapes")
    ap.add_argument("--tuned", type=Path, default=None, help="layernorm_tune.json to apply")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--providers", default="ours,torch,compile,liger")
    ap.add_argument(
        "--jobs", type=int, default=8 if DEVICE == "cuda" else 0,
        help="compile first in this many processes (0: no warm-up)",
    )  # fmt: skip
    ap.add_argument("--warm-shard", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shard = tuple(int(v) for v in args.warm_shard.split("/")) if args.warm_shard else None
    tables = None
    if args.tuned is not None and args.tuned.exists():
        tables = pick_tables(json.loads(args.tuned.read_text())["rows"])
        install_tables(tables)
    if shard is not None:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        if args.tune:
            run_tune(args, shard)
        else:
            run_bench(args, args.out, shard)
        return
    if args.jobs > 1:
        _warm(args, args.jobs)

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                liger=liger() is not None, tuned_tables=tables)  # fmt: skip
    print(json.dumps(meta), flush=True)
    if args.tune:
        rows = run_tune(args)  # (args.out exists: made above)
        (out / "layernorm_tune.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        tables = pick_tables(rows)
        print("tables", json.dumps(tables), flush=True)
        # Ready to paste into triton_transformer/layernorm.py (and utils.calc_num_warps).
        print("_FWD_TABLE: dict[int, tuple[int, int]] = {")
        for bn, cfg in sorted(tables["fwd"].items()):
            print(f"    {bn}: {tuple(cfg)},")
        print("}\n_BWD_TABLE: dict[int, tuple[int, int, int, bool]] = {")
        for bn, cfg in sorted(tables["bwd"].items()):
            print(f"    {bn}: {tuple(cfg)},")
        print("}\n# best warps for one row of block_n (calc_num_warps):",
              json.dumps(tables["fwd_warps_one_row"]), flush=True)  # fmt: skip
        return
    rows = run_bench(args, out)
    (out / "layernorm_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    for op in OPS:
        op_rows = [r for r in rows if r["op"] == op]
        if op_rows:
            report(out, op, op_rows, x="N", y="GB/s")
    # Short table: GB/s per provider (and ours / best other), by op, mode, shape, dtype.
    print("op | mode | dtype | MxN | ours | torch | compile | liger | ours/best-other | wall ours")
    keyed = {(r["op"], r["mode"], r["dtype"], r["M"], r["N"], r["provider"]): r for r in rows}
    for op, M, N, dname in cases(args):
        for mode in MODES:
            vals = {p: keyed.get((op, mode, dname, M, N, p)) for p in
                    ("ours", "torch", "compile", "liger")}  # fmt: skip
            if vals["ours"] is None:
                continue
            others = [v["GB/s"] for p, v in vals.items() if v is not None and p != "ours"]
            ratio = vals["ours"]["GB/s"] / max(others) if others else float("nan")
            cells = [f"{v['GB/s']:.0f}" if v else "-" for v in vals.values()]
            print(f"{op} | {mode} | {dname} | {M}x{N} | " + " | ".join(cells)
                  + f" | {ratio:.2f} | {vals['ours']['wall_us']:.0f}us"
                  + f" ({vals['ours']['frac']:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
