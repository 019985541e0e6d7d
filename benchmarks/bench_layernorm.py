"""GPU benchmark of LayerNorm (plain and stable) and fused residual + LayerNorm, and the sweep
of its launch configurations.

    python3 benchmarks/bench_layernorm.py --out DIR [--quick] [--widths sweep] [--ops ...]
        [--rounds R]
    python3 benchmarks/bench_layernorm.py --out DIR --tune [--widths N,N,...] [--rows M]
    python3 benchmarks/bench_layernorm.py --out DIR --tuned DIR/layernorm_tune.json ...

Comparison (default): providers side by side in one run: ours (the Triton ops), torch (eager
PyTorch), compile (torch.compile of the eager expression, static shapes) and liger
(Liger-Kernel's LigerLayerNormFunction, plain LayerNorm only, when importable). M = 4096 rows
with N in 512..16384, plus 16384 x 1024, fp16 and bf16; or with `--widths sweep` the sweep's
widths N = 128..16384 at 2**26 / N rows (128 MB per bf16 tensor); modes fwd, bwd and fwd+bwd
(training mode: the forward runs with grad enabled, as in a training step).

Bytes counted are the minimum each op must move, the same for every provider (each input read
once, each output written once; weights and per-row stats ignored):
  layernorm           fwd 2·M·N·e (x, y)       bwd 3·M·N·e (x, dy, dx)
  residual_layernorm  fwd 4·M·N·e (h, branch, h_new, y)
                      bwd 4·M·N·e (h_new, dy, dh_new, dh; dbranch is dh when p = 0)
GB/s uses the kernel time (sum of the op's kernel durations from torch.profiler, L2 flushed
before each call: host overhead excluded, which do_bench's events do not guarantee);
`frac` is GB/s over the device-to-device copy bandwidth measured in the same run; `wall_us` is
host wall-clock per call in a tight loop.
With --rounds R the kernel time is the median of R rounds in which the providers and modes
of a shape alternate (`common.interleaved_kernel_ms`).

--tune sweeps the launch configurations of `layernorm._LAYERNORM_FWD_CONFIGS` /
`_LAYERNORM_BWD_CONFIGS` at
N = 16384, 12288, 8192, 4096, 2048, 1024, 768, 512, 384, 256, 128 (2**26 / N rows, bf16, plain
and stable, forward and backward; the stages and the caps on the candidates are described
above `run_tune`) against torch.compile of the reference, and prints the best configuration
per width and ready-to-paste tables; `layernorm_tune.json` keeps every timing and the tables,
which `--tuned` installs into a comparison run. --jobs K (default on a GPU: 16 with --tune,
else 8) compiles everything first in K worker processes (Triton and Inductor caches on disk),
so the timed process does not wait on compilers.
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
    MAX_BLOCK_N,
    BwdConfig,
    _layernorm_reference,
    launch_layernorm_bwd,
    launch_layernorm_bwd_rowsums,
    launch_layernorm_fwd,
    layernorm,
    width_class,
)
from triton_transformer.residual_layernorm import residual_layernorm

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
# The sweep's widths and their row counts: 2**26 elements, 128 MB per bf16 tensor, far larger
# than L2. Widest first, so a run cut short has the widths of the issue; in each width class
# its power of two first (its finalists are timed at the narrower width too). 512, the small
# model's width, keeps class 512 from being chosen at 384 alone.
SWEEP_WIDTHS = (16384, 12288, 8192, 4096, 2048, 1024, 768, 512, 384, 256, 128)
SWEEP_ELEMS = 1 << 26


def sweep_rows(n: int) -> int:
    return max(1, round(SWEEP_ELEMS / n))


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
        return lambda x, w, b: _layernorm_reference(x, w, b, EPS, True)

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
    if args.widths:
        return [(args.rows or sweep_rows(n), n) for n in args.widths]
    return default


def cases(args):
    shapes = _shapes(args, QUICK_SHAPES if args.quick else SHAPES)
    dtypes = ["bf16"] if args.quick else args.dtypes.split(",")
    ops = [op for op in args.ops.split(",") if op in OPS]
    return [(op, M, N, d) for op in ops for d in dtypes for (M, N) in shapes]


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
        timed = []  # (row, fn) of every provider and mode, for the interleaved rounds
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
                    row = dict(op=op, provider=prov, M=M, N=N, dtype=dname, mode=mode,
                               ms=t["kernel_ms"], wall_us=t["wall_us"])  # fmt: skip
                    timed.append((row, f))
            except Exception as e:  # a provider failing must not kill the run
                print(f"{prov} {op} {M}x{N} {dname}: {type(e).__name__}: {e}"[:300], flush=True)
            _sync()
        if timed and args.rounds > 1 and torch.cuda.is_available():
            times = common.interleaved_kernel_ms(
                [f for _, f in timed], args.rounds, first=[row["ms"] for row, _ in timed]
            )
            for (row, _), (median, fastest, slowest) in zip(timed, times, strict=True):
                row.update(ms=median, ms_min=fastest, ms_max=slowest)
        for row, _ in timed:
            gbs = BYTES_PER_ELEM_PASS[op][row["mode"]] * M * N * dtype.itemsize / (
                row["ms"] * 1e-3) / 1e9  # fmt: skip
            row.update({"GB/s": gbs, "frac": gbs / ceil["copy_gbps"] if ceil else float("nan")})
            rows.append(row)
            print(f"row {op} {row['provider']} {M}x{N} {dname} {row['mode']} "
                  f"{row['ms'] * 1e3:.1f}us {gbs:.0f}GB/s wall {row['wall_us']:.0f}us",
                  flush=True)  # fmt: skip
        if shard is None:  # partial results survive a timeout
            (out_dir / "layernorm_bench.json").write_text(json.dumps(dict(rows=rows), indent=1))
        del inputs, grads
    return rows


# ----------------------------------------------------------------------------- tuning sweep
#
# Per width, in stages (kernel times with L2 flushed, `common.kernel_ms`; bf16):
#   fwd-1   every forward candidate, plain (`fwd_candidates`);
#   fwd-2   the TOP fastest, the shipped entry and the finalists of the wider width of the same
#           class (12288 runs after 16384), plain and stable;
#   bwd-1   every backward kernel variant (`bwd_candidates`) at its kind's default programs
#           per SM, plain;
#   bwd-2   the TOP fastest of bwd-1 with programs per SM in {1, 2, 4, 8} (16 too for split)
#           and prefetch toggled ("row" tiles up to 8192 and "split");
#   sums    the split's row-sums kernel alone, every `sums_candidates` tile, plain (when split
#           is among the candidates: N >= 4096);
#   bwd-3   the TOP fastest of bwd-1 and bwd-2 (split with the fastest row-sums tile), the
#           shipped entry and the wider width's finalists, plain and stable.
# torch.compile of the reference (its training forward, and its backward) is timed per width
# and variant. Caps: TOP = 4 finalists; candidate lists longer than --max-candidates (24) are
# thinned evenly; the stable variant is timed only for the finalists (it shares the tables).
# Widths left when --budget-s is spent are skipped (named in the output).

TOP = 4
FWD_ITERS, FINAL_ITERS = 3, 10  # profiled calls per timing: screening, finalists
BWD_PER_SM = {"row": 2, "loop": 2, "split": 4}  # bwd-1's programs per SM
SUMS_DEFAULT = (1, 4096, 8)  # bwd-1's row-sums tile for split (capped at the width)


def _warps(tile: int, per_thread) -> list[int]:
    """Power-of-two warp counts (1-32) giving `tile` elements `per_thread` to each thread."""
    out = []
    for pt in per_thread:
        warps = tile // (32 * pt)
        if warps * 32 * pt == tile and warps in (1, 2, 4, 8, 16, 32):
            out.append(warps)
    return out


def _thin(cands: list, cap: int) -> list:
    """At most `cap` candidates, evenly spaced over the list (deterministic)."""
    if len(cands) <= cap:
        return cands
    return [cands[round(i * (len(cands) - 1) / (cap - 1))] for i in range(cap)]


def fwd_candidates(width: int, cap: int) -> list[tuple[int, int, int]]:
    """(BLOCK_M, BLOCK_N, warps): rows in registers, tiles of 512..max(16384, width) elements
    with 4-32 per thread (64 for one wide row); from width 8192, also one row per program
    looping over 2048-8192-wide blocks, 8-32 per thread."""
    out = []
    bm = 1
    while bm * width <= max(16384, width):
        tile = bm * width
        if tile >= 512:
            per_thread = (4, 8, 16, 32, 64) if bm == 1 and width >= 8192 else (4, 8, 16, 32)
            out += [(bm, width, w) for w in _warps(tile, per_thread)]
        bm *= 2
    if width >= 8192:
        for bn in (2048, 4096, 8192):
            if bn < width:
                out += [(1, bn, w) for w in _warps(bn, (8, 16, 32))]
    return _thin(out, cap)


def bwd_candidates(width: int, cap: int) -> list[BwdConfig]:
    """bwd-1's kernel variants: "row" tiles of 512..max(8192, width) elements, 2-16 per thread
    (32 for one wide row), prefetching up to 4096; from width 8192 "loop" over 2048-8192-wide
    blocks, 1 or 2 rows, 16 per thread; from width 4096 "split" with 2048- and 4096-element
    tiles 128-512 columns wide, 8-16 per thread."""
    out = []
    bm = 1
    while bm * width <= max(8192, width):
        tile = bm * width
        if tile >= 512:
            per_thread = (2, 4, 8, 16, 32) if bm == 1 and width >= 8192 else (2, 4, 8, 16)
            out += [BwdConfig("row", bm, width, w, BWD_PER_SM["row"], prefetch=tile <= 4096)
                    for w in _warps(tile, per_thread)]  # fmt: skip
        bm *= 2
    if width >= 8192:  # 1 or 2 rows per tile (2: half the partials' read-modify-writes)
        for bm in (1, 2):
            for bn in (2048, 4096, 8192):
                if bn < width:
                    out += [BwdConfig("loop", bm, bn, w, BWD_PER_SM["loop"])
                            for w in _warps(bm * bn, (16,))]  # fmt: skip
    if width >= 4096:
        sm, sn, sw = _sums_capped(SUMS_DEFAULT, width)
        for bm, bn in ((16, 128), (32, 128), (8, 256), (16, 256), (4, 512), (8, 512)):
            out += [BwdConfig("split", bm, bn, w, BWD_PER_SM["split"], sum_block_m=sm,
                              sum_block_n=sn, sum_warps=sw)
                    for w in _warps(bm * bn, (8, 16))]  # fmt: skip
    return _thin(out, cap)


def _sums_capped(sums: tuple[int, int, int], width: int) -> tuple[int, int, int]:
    return sums[0], min(sums[1], width), sums[2]


def sums_candidates(width: int, cap: int) -> list[tuple[int, int, int]]:
    """Row-sums tiles (BLOCK_M, BLOCK_N, warps): 4096-16384 elements, blocks of 2048..width,
    8-16 elements per thread (of x and of dy)."""
    out = []
    for tile in (4096, 8192, 16384):
        for bm in (1, 2, 4):
            bn = tile // bm
            if 2048 <= bn <= width:
                out += [(bm, bn, w) for w in _warps(tile, (8, 16))]
    return _thin(out, cap)


def bwd_variants(cfg: BwdConfig) -> list[BwdConfig]:
    """bwd-2's neighbours of a bwd-1 finalist: other programs per SM, prefetch toggled."""
    per_sm = (1, 2, 4, 8, 16) if cfg.kind == "split" else (1, 2, 4, 8)
    out = [cfg._replace(per_sm=k) for k in per_sm if k != cfg.per_sm]
    if cfg.kind == "split" or (cfg.kind == "row" and cfg.block_m * cfg.block_n <= 8192):
        out.append(cfg._replace(prefetch=not cfg.prefetch))
    return out


def _with_sums(cfg: BwdConfig, sums: tuple[int, int, int]) -> BwdConfig:
    sm, sn, sw = sums
    return cfg._replace(sum_block_m=sm, sum_block_n=sn, sum_warps=sw)


def _cfg_json(cfg) -> list | dict:
    return cfg._asdict() if isinstance(cfg, BwdConfig) else list(cfg)


def fmt_bwd(cfg: BwdConfig) -> str:
    """A BwdConfig as it is written in layernorm.py."""
    args = [f'"{cfg.kind}"', *(str(v) for v in cfg[1:5])]
    if cfg.prefetch:
        args.append("prefetch=True")
    if cfg.kind == "split":
        args += [f"sum_block_m={cfg.sum_block_m}", f"sum_block_n={cfg.sum_block_n}",
                 f"sum_warps={cfg.sum_warps}"]  # fmt: skip
    return f"BwdConfig({', '.join(args)})"


def _time_ms(fn: Callable[[], object], iters: int) -> float:
    """Kernel time per call (`common.kernel_ms`: profiler, L2 flushed); on the CPU only the
    interpreter's wall time of one call, which exercises the script and nothing else."""
    if common is not None:
        return common.kernel_ms(fn, iters)
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


class SweepProblem:
    """bf16 tensors of one sweep shape and launchers of the kernels on them (direct launches,
    as inside the ops); stats of both variants from the shipped forward."""

    def __init__(self, M: int, N: int):
        g = torch.Generator(device=DEVICE).manual_seed(0)
        dtype = torch.bfloat16
        self.M, self.N = M, N
        self.x = (-1.0 + torch.randn(M, N, device=DEVICE, generator=g)).to(dtype)
        self.dy = torch.randn(M, N, device=DEVICE, generator=g).to(dtype)
        self.w = (1 + 0.1 * torch.randn(N, device=DEVICE, generator=g)).to(dtype)
        self.b = (0.1 * torch.randn(N, device=DEVICE, generator=g)).to(dtype)
        self.y, self.dx = torch.empty_like(self.x), torch.empty_like(self.x)
        self.dw, self.db = torch.empty_like(self.w), torch.empty_like(self.b)
        self.stats = {s: torch.empty((3 if s else 2, M), device=DEVICE) for s in (False, True)}
        self.rowsums = torch.empty((3, M), device=DEVICE)
        for stable in (False, True):
            launch_layernorm_fwd(self.x, self.w, self.b, self.y, self.stats[stable], EPS, stable)

    def fwd(self, cfg, stable: bool) -> Callable[[], None]:
        stats = torch.empty_like(self.stats[stable])  # the backward's stats stay intact
        return lambda: launch_layernorm_fwd(
            self.x, self.w, self.b, self.y, stats, EPS, stable, cfg=cfg
        )

    def bwd(self, cfg: BwdConfig, stable: bool) -> Callable[[], None]:
        return lambda: launch_layernorm_bwd(self.dy, self.x, self.w, self.stats[stable], self.dx,
                                            self.dw, self.db, EPS, stable, cfg=cfg)  # fmt: skip

    def sums(self, cfg: BwdConfig, stable: bool) -> Callable[[], None]:
        rowsums = self.rowsums[: 3 if stable else 2]
        return lambda: launch_layernorm_bwd_rowsums(self.x, self.w, self.dy, self.stats[stable],
                                                    rowsums, EPS, stable, cfg)  # fmt: skip

    def compiled(self, stable: bool) -> dict[str, Callable[[], object]]:
        """torch.compile of the reference: the training forward (grad enabled, as in a step)
        and the backward of a retained graph."""
        op = "layernorm_stable" if stable else "layernorm"
        fn = common.compiled(_torch_fn(op), dynamic=False) if common else torch.compile(
            _torch_fn(op), dynamic=False)  # fmt: skip
        leaves = [t.detach().requires_grad_() for t in (self.x, self.w, self.b)]
        with torch.enable_grad():
            out = fn(*leaves)
        return {
            "fwd": lambda: fn(*leaves),
            "bwd": lambda: torch.autograd.grad(out, leaves, self.dy, retain_graph=True),
        }


def _gbps(kind: str, M: int, N: int, ms: float) -> float:
    return (2 if kind == "fwd" else 3) * M * N * 2 / (ms * 1e-3) / 1e9


def _shipped(N: int) -> tuple[tuple[int, int, int], BwdConfig]:
    """The plain forward's and backward's entries at width N for bf16 rows (an exact-width
    tile where the forward takes one)."""
    ln = sys.modules["triton_transformer.layernorm"]
    fwd = (
        ln._layernorm_fwd_exact_config(N, MAX_BLOCK_N)
        or ln._layernorm_fwd_config(N, MAX_BLOCK_N)[:3]
    )
    return fwd, ln._layernorm_bwd_config(N, MAX_BLOCK_N)


def _top(times: dict, k: int) -> list:
    return sorted((c for c in times if times[c] == times[c]), key=times.__getitem__)[:k]


def tune_width(N: int, M: int, args, prior: dict, log: Callable[[dict], None]) -> dict:
    """Run every stage at one width; returns {"fwd"/"bwd": {cfg: {stable: ms}}, "compile"}."""
    cap = args.max_candidates
    width = width_class(N)
    prob = SweepProblem(M, N)
    ship_f, ship_b = _shipped(N)

    def timed(stage, kind, cfg, stable, fn, iters) -> float:
        try:
            ms = _time_ms(fn, iters)
        except Exception as e:  # a candidate that fails to compile or launch is skipped
            print(f"  {stage} {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
            ms = float("nan")
        log(dict(stage=stage, kind=kind, N=N, M=M, stable=stable, cfg=_cfg_json(cfg), ms=ms,
                 gbps=_gbps(kind, M, N, ms)))  # fmt: skip
        return ms

    result: dict = {"fwd": {}, "bwd": {}, "compile": {}}
    if args.compile:
        for stable in (False, True):
            try:
                fns = prob.compiled(stable)
            except Exception as e:
                print(f"  compile {N} stable={stable}: {type(e).__name__}: {e}"[:300])
                continue
            for kind, fn in fns.items():
                result["compile"][(kind, stable)] = timed("compile", kind, "compile", stable, fn,
                                                          FINAL_ITERS)  # fmt: skip
    # forward
    t1 = {c: timed("fwd-1", "fwd", c, False, prob.fwd(c, False), FWD_ITERS)
          for c in fwd_candidates(width, cap)}  # fmt: skip
    finals = dict.fromkeys([*_top(t1, TOP), ship_f, *prior.get(("fwd", width), [])])
    for c in finals:
        result["fwd"][c] = {s: timed("fwd-2", "fwd", c, s, prob.fwd(c, s), FINAL_ITERS)
                            for s in (False, True)}  # fmt: skip
    # backward
    b1 = {c: timed("bwd-1", "bwd", c, False, prob.bwd(c, False), FWD_ITERS)
          for c in bwd_candidates(width, cap)}  # fmt: skip
    b2 = {}
    for c in _top(b1, TOP):
        for v in bwd_variants(c):
            if v not in b1 and v not in b2:
                b2[v] = timed("bwd-2", "bwd", v, False, prob.bwd(v, False), FWD_ITERS)
    both = {**b1, **b2}
    best_split = next((c for c in _top(both, len(both)) if c.kind == "split"), None)
    best_sums = None
    if best_split is not None:
        ts = {s: timed("sums", "bwd", s, False, prob.sums(_with_sums(best_split, s), False),
                       FWD_ITERS) for s in sums_candidates(width, cap)}  # fmt: skip
        best_sums = (_top(ts, 1) or [None])[0]
    top = [_with_sums(c, best_sums) if c.kind == "split" and best_sums else c
           for c in _top(both, TOP)]  # fmt: skip
    finals = dict.fromkeys([*top, ship_b, *prior.get(("bwd", width), [])])
    for c in finals:
        result["bwd"][c] = {s: timed("bwd-3", "bwd", c, s, prob.bwd(c, s), FINAL_ITERS)
                            for s in (False, True)}  # fmt: skip
    for kind in ("fwd", "bwd"):  # the next width of this class times these finalists too
        seen = prior.setdefault((kind, width), [])
        seen += [c for c in result[kind] if c not in seen]
    _print_width(N, M, result, ship_f, ship_b)
    return result


def _print_width(N: int, M: int, result: dict, ship_f, ship_b) -> None:
    copy = ceilings()["copy_gbps"]
    for kind, ship in (("fwd", ship_f), ("bwd", ship_b)):
        for stable in (False, True):
            times = {c: t[stable] for c, t in result[kind].items()}
            best = (_top(times, 1) or [None])[0]
            if best is None:
                continue
            comp = result["compile"].get((kind, stable), float("nan"))
            name = "stable" if stable else "plain"
            shown = fmt_bwd(best) if kind == "bwd" else str(best)
            print(f"{M}x{N} {kind} {name}: best {shown} {times[best] * 1e3:.1f}us "
                  f"{_gbps(kind, M, N, times[best]):.0f}GB/s "
                  f"({_gbps(kind, M, N, times[best]) / copy:.0%} of copy), "
                  f"shipped {times.get(ship, float('nan')) * 1e3:.1f}us, "
                  f"compile {comp * 1e3:.1f}us -> best/compile {comp / times[best]:.2f}x",
                  flush=True)  # fmt: skip


def pick_tables(results: dict[int, dict]) -> dict:
    """Per width class and direction, the finalist with the smallest sum over the class's
    widths and both variants of (its time / the best finalist's time), among those timed at
    every width of the class."""
    tables: dict = {"fwd": {}, "bwd": {}}
    for kind in ("fwd", "bwd"):
        classes: dict[int, list[int]] = {}
        for N in results:
            classes.setdefault(width_class(N), []).append(N)
        for width, ns in sorted(classes.items()):
            common_cfgs = set.intersection(*(set(results[n][kind]) for n in ns))
            score: dict = {}
            for n in ns:
                for stable in (False, True):
                    times = {c: t[stable] for c, t in results[n][kind].items()}
                    best = min((t for t in times.values() if t == t), default=float("nan"))
                    for c in common_cfgs:
                        score[c] = score.get(c, 0.0) + times[c] / best
            ok = [c for c in common_cfgs if score[c] == score[c]]
            if ok:
                tables[kind][width] = min(ok, key=score.__getitem__)
    return tables


def print_tables(tables: dict, results: dict[int, dict]) -> None:
    """The full tables as they are written in layernorm.py: swept classes replaced, the others
    kept; and the chosen entries' ratio to torch.compile at every swept width."""
    ln = sys.modules["triton_transformer.layernorm"]
    fwd = {**ln._LAYERNORM_FWD_CONFIGS, **tables["fwd"]}
    bwd = {**ln._LAYERNORM_BWD_CONFIGS, **tables["bwd"]}
    print("_LAYERNORM_FWD_CONFIGS: dict[int, tuple[int, int, int]] = {")
    for k, v in sorted(fwd.items()):
        print(f"    {k}: {tuple(v)},{'' if k in tables['fwd'] else '  # not swept'}")
    print("}\n_BWD_TABLE: dict[int, BwdConfig] = {")
    for k, v in sorted(bwd.items()):
        print(f"    {k}: {fmt_bwd(v)},{'' if k in tables['bwd'] else '  # not swept'}")
    print("}")
    print("width | rows | fwd plain | fwd stable | bwd plain | bwd stable  (chosen entry, "
          "time / compile's: < 1 is faster)")  # fmt: skip
    for N, res in results.items():
        cells = []
        for kind in ("fwd", "bwd"):
            cfg = tables[kind].get(width_class(N))
            for stable in (False, True):
                t = res[kind].get(cfg, {}).get(stable, float("nan"))
                comp = res["compile"].get((kind, stable), float("nan"))
                cells.append(f"{t * 1e3:.1f}us {t / comp:.2f}")
        print(f"{N} | {res['M']} | " + " | ".join(cells), flush=True)


def install_tables(tables: dict) -> None:
    """Run `ours` with tuned tables (as if pasted into layernorm.py): JSON keys are strings,
    forward entries lists and backward entries dicts."""
    ln = sys.modules["triton_transformer.layernorm"]
    ln._LAYERNORM_FWD_CONFIGS.update({int(k): tuple(v) for k, v in tables["fwd"].items()})
    for k in tables["fwd"]:  # a tuned class's entry serves the stable forward too
        ln._LAYERNORM_FWD_STABLE_CONFIGS.pop(int(k), None)
    ln._LAYERNORM_BWD_CONFIGS.update({int(k): BwdConfig(**v) for k, v in tables["bwd"].items()})
    ln._clear_config_caches()


def _prefetch_toggled(cfg: BwdConfig) -> list[BwdConfig]:
    """bwd-2's other binary of a bwd-1 candidate (its per-SM variants share the binary)."""
    return [v for v in bwd_variants(cfg) if v.prefetch != cfg.prefetch]


def _warm_tune(args, shard: tuple[int, int]) -> None:
    """Warm-up worker: run once (so compile, into the on-disk caches) every shard[1]-th of
    the kernels and torch.compile graphs the sweep can time, starting at the shard[0]-th."""
    cap = args.max_candidates
    # torch.compile's graphs take longest: first, so every worker gets one or two
    jobs = [(N, "compile", None, s) for N in args.widths for s in (False, True) if args.compile]
    for N in args.widths:
        width = width_class(N)
        bwd = bwd_candidates(width, cap)
        split = next((c for c in bwd if c.kind == "split"), None)
        for stable in (False, True):
            jobs += [(N, "fwd", c, stable) for c in fwd_candidates(width, cap)]
            jobs += [(N, "bwd", v, stable) for c in bwd for v in (c, *_prefetch_toggled(c))]
            if split is not None:
                jobs += [(N, "sums", _with_sums(split, s), stable)
                         for s in sums_candidates(width, cap)]  # fmt: skip
            ship_f, ship_b = _shipped(N)
            jobs += [(N, "fwd", ship_f, stable), (N, "bwd", ship_b, stable)]
    prob = None
    for N, kind, cfg, stable in jobs[shard[0] :: shard[1]]:
        if prob is None or prob.N != N:
            prob = None  # free the previous width's tensors first
            prob = SweepProblem(args.rows or sweep_rows(N), N)
        try:
            if kind == "compile":
                for fn in prob.compiled(stable).values():
                    fn()
            else:
                getattr(prob, kind)(cfg, stable)()
        except Exception as e:
            print(f"warm {N} {kind} {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
    _sync()


def run_tune(args) -> tuple[dict, list[dict]]:
    """The sweep (stages above) at every width while the budget lasts; returns the tables and
    every timing."""
    start = args.start
    rows: list[dict] = []
    results: dict[int, dict] = {}
    prior: dict = {}
    skipped = []
    for N in args.widths:
        if time.time() - start > args.budget_s:
            skipped.append(N)
            continue
        M = args.rows or sweep_rows(N)
        t0 = time.time()
        with _direct_launches():
            res = tune_width(N, M, args, prior, rows.append)
        res["M"] = M
        results[N] = res
        print(f"width {N}: {time.time() - t0:.0f} s (total {time.time() - start:.0f} s)",
              flush=True)  # fmt: skip
        (args.out / "layernorm_tune.json").write_text(json.dumps(dict(rows=rows), indent=1))
    if skipped:
        print(f"budget of {args.budget_s:.0f} s spent: widths {skipped} not swept", flush=True)
    tables = pick_tables(results)
    print_tables(tables, results)
    return tables, rows


# ----------------------------------------------------------------------------- main


def _warm(args, jobs: int) -> None:
    """Compile everything in `jobs` worker processes first (shared on-disk caches)."""
    t0 = time.time()
    argv = [sys.executable, __file__, *sys.argv[1:]]
    # one Inductor compile thread per worker: `jobs` workers already fill the machine
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    procs = [subprocess.Popen([*argv, "--warm-shard", f"{i}/{jobs}"], env=env)
             for i in range(jobs)]  # fmt: skip
    codes = [p.wait() for p in procs]
    print(f"warm-up in {jobs} processes: {time.time() - t0:.0f} s, exit codes {codes}", flush=True)


def _parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="comparison: kernel time as the median of R interleaved rounds",
    )
    ap.add_argument("--tune", action="store_true", help="sweep launch configurations instead")
    ap.add_argument("--shapes", default="", help="MxN,MxN,... instead of the default shapes")
    ap.add_argument(
        "--widths", default="",
        help="N,N,... or 'sweep' (the sweep's widths), at --rows rows (default 2**26 / N)",
    )  # fmt: skip
    ap.add_argument("--rows", type=int, default=0, help="rows at every --widths width")
    ap.add_argument("--ops", default=",".join(OPS), help="comparison: ops to run")
    ap.add_argument("--tuned", type=Path, default=None, help="layernorm_tune.json to apply")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--providers", default="ours,torch,compile,liger")
    ap.add_argument("--no-compile", action="store_true", help="--tune: no torch.compile times")
    ap.add_argument("--max-candidates", type=int, default=24, help="--tune: per list")
    ap.add_argument("--budget-s", type=float, default=225.0, help="--tune: skip widths after")
    ap.add_argument("--jobs", type=int, default=None,
                    help="compile first in this many processes (0: no warm-up)")  # fmt: skip
    ap.add_argument("--warm-shard", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.widths:
        ws = SWEEP_WIDTHS if args.widths == "sweep" else [int(n) for n in args.widths.split(",")]
        args.widths = list(ws)
    elif args.tune:
        args.widths = list(SWEEP_WIDTHS)
    if args.jobs is None:
        args.jobs = (min(16, os.cpu_count() or 1) if args.tune else 8) if DEVICE == "cuda" else 0
    args.compile = not args.no_compile and DEVICE == "cuda"
    args.start = time.time()
    return args


def main() -> None:
    args = _parse_args()
    shard = tuple(int(v) for v in args.warm_shard.split("/")) if args.warm_shard else None
    tables = None
    if args.tuned is not None and args.tuned.exists():
        tables = json.loads(args.tuned.read_text())["tables"]
        install_tables(tables)
    if shard is not None:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        if args.tune:
            with _direct_launches():
                _warm_tune(args, shard)
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
        print(f"copy ceiling {ceilings()['copy_gbps']:.0f} GB/s", flush=True)
        tables, rows = run_tune(args)
        tables_json = {k: {str(w): _cfg_json(c) for w, c in v.items()} for k, v in tables.items()}
        (out / "layernorm_tune.json").write_text(
            json.dumps(dict(meta=meta, tables=tables_json, rows=rows), indent=1)
        )
        print(f"done in {time.time() - args.start:.0f} s", flush=True)
        return
    rows = run_bench(args, out)
    (out / "layernorm_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    for op in OPS:
        op_rows = [r for r in rows if r["op"] == op]
        if op_rows:
            report(out, op, op_rows, x="N", y="GB/s")
    # Short table: GB/s per provider, ours / compile, ours / best other and ours' fraction of
    # the copy ceiling, by op, mode, shape, dtype.
    print("op | mode | dtype | MxN | ours | torch | compile | liger | ours/compile "
          "| ours/best-other | wall ours (frac of copy)")  # fmt: skip
    keyed = {(r["op"], r["mode"], r["dtype"], r["M"], r["N"], r["provider"]): r for r in rows}
    for op, M, N, dname in cases(args):
        for mode in MODES:
            vals = {p: keyed.get((op, mode, dname, M, N, p)) for p in
                    ("ours", "torch", "compile", "liger")}  # fmt: skip
            if vals["ours"] is None:
                continue
            others = [v["GB/s"] for p, v in vals.items() if v is not None and p != "ours"]
            ratio = vals["ours"]["GB/s"] / max(others) if others else float("nan")
            comp = vals["compile"]
            vs_compile = vals["ours"]["GB/s"] / comp["GB/s"] if comp else float("nan")
            cells = [f"{v['GB/s']:.0f}" if v else "-" for v in vals.values()]
            print(f"{op} | {mode} | {dname} | {M}x{N} | " + " | ".join(cells)
                  + f" | {vs_compile:.2f} | {ratio:.2f} | {vals['ours']['wall_us']:.0f}us"
                  + f" ({vals['ours']['frac']:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
