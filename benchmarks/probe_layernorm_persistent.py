"""Probe: a persistent LayerNorm forward against the shipped one and torch.compile's, at the
widths where the shipped forward sat 1-2% behind compile (#19: 768 and 1024 columns plain,
1024 stable), and at the neighbouring widths and GPT-2's 16384 x 768.

The shipped forward launches one program per tile of BLOCK_M rows: at 2**26 elements and
1024 columns that is 16,384 programs of 4 rows. Each program loads its rows, reduces them and
stores them; its loads wait for nothing else in flight, so between one program's last store
and the next program's first load on the same slot the SM's memory pipe idles a little. The
persistent variant here launches `per_sm` programs per SM, each walking the row tiles
`pid, pid + programs, ...` and loading tile i + 1 into registers before it reduces and
stores tile i (PREFETCH), or leaving the overlap to Triton's pipeliner (`tl.range` with
`num_stages`); the weight and bias are loaded once per program, not once per tile. Rows of
three power-of-two blocks (768 = 3·256) are held as three blocks (THIRDS), as the shipped
kernel does.

Kernel time, L2 flushed (`common.kernel_ms`), bf16, outputs checked against the shipped
kernel's.

    python3 benchmarks/probe_layernorm_persistent.py --out DIR
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from bench_layernorm import _torch_fn

import triton_transformer.layernorm as ln
from triton_transformer.utils import cdiv, sm_count


@triton.jit
def _load(X, rows, col0, M, stride_x, BLOCK_N: tl.constexpr):
    cols = col0 + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None]
    ptrs = X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_rows(X, rows, M, stride_x, PARTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile `rows` of X as PARTS blocks of BLOCK_N columns (the unused ones repeat the
    first)."""
    x0 = _load(X, rows, 0, M, stride_x, BLOCK_N)
    x1, x2 = x0, x0
    if PARTS == 3:
        x1 = _load(X, rows, BLOCK_N, M, stride_x, BLOCK_N)
        x2 = _load(X, rows, 2 * BLOCK_N, M, stride_x, BLOCK_N)
    return x0, x1, x2


@triton.jit
def _load_parts(P, PARTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A weight or bias as PARTS blocks of BLOCK_N (fp32), as `_load_rows` splits a row."""
    cols = tl.arange(0, BLOCK_N)
    p0 = tl.load(P + cols).to(tl.float32)
    p1, p2 = p0, p0
    if PARTS == 3:
        p1 = tl.load(P + BLOCK_N + cols).to(tl.float32)
        p2 = tl.load(P + 2 * BLOCK_N + cols).to(tl.float32)
    return p0, p1, p2


@triton.jit
def _normalize_store(
    Y, Stats, x0, x1, x2, w0, w1, w2, b0, b1, b2, rows, M, stride_y, inv_n, eps, clamp,
    HAS_BIAS: tl.constexpr, STABLE: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Normalise one tile (x0, and x1, x2 when PARTS == 3) and store y and the stats."""
    if STABLE:
        amax = tl.max(tl.abs(x0), axis=1)
        if PARTS == 3:
            amax = tl.maximum(
                amax, tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
            )
        scale = tl.maximum(amax, clamp)
        inv_scale = (1.0 / scale)[:, None]
        x0 = x0 * inv_scale
        if PARTS == 3:
            x1, x2 = x1 * inv_scale, x2 * inv_scale
    total = tl.sum(x0, axis=1)
    if PARTS == 3:
        total += tl.sum(x1, axis=1) + tl.sum(x2, axis=1)
    mean = total * inv_n
    x0 = x0 - mean[:, None]
    m2 = tl.sum(x0 * x0, axis=1)
    if PARTS == 3:
        x1, x2 = x1 - mean[:, None], x2 - mean[:, None]
        m2 += tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    rstd = tl.rsqrt(m2 * inv_n + eps)
    row_mask = rows < M
    y_rows = Y + rows.to(tl.int64)[:, None] * stride_y
    cols = tl.arange(0, BLOCK_N)
    y0 = x0 * rstd[:, None] * w0[None, :]
    if HAS_BIAS:
        y0 += b0[None, :]
    tl.store(y_rows + cols[None, :], y0.to(Y.dtype.element_ty), mask=row_mask[:, None])
    if PARTS == 3:
        y1 = x1 * rstd[:, None] * w1[None, :]
        y2 = x2 * rstd[:, None] * w2[None, :]
        if HAS_BIAS:
            y1 += b1[None, :]
            y2 += b2[None, :]
        tl.store(
            y_rows + BLOCK_N + cols[None, :], y1.to(Y.dtype.element_ty), mask=row_mask[:, None]
        )
        tl.store(
            y_rows + 2 * BLOCK_N + cols[None, :], y2.to(Y.dtype.element_ty), mask=row_mask[:, None]
        )
    tl.store(Stats + rows, mean, mask=row_mask)
    tl.store(Stats + M + rows, rstd, mask=row_mask)
    if STABLE:
        tl.store(Stats + 2 * M + rows, scale, mask=row_mask)


@triton.jit
def _ln_fwd_persistent_kernel(
    X, W, B, Y, Stats, M, inv_n, stride_x, stride_y, eps, clamp,
    HAS_BIAS: tl.constexpr, STABLE: tl.constexpr, PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    inv_n, eps, clamp = (
        tl.cast(inv_n, tl.float32),
        tl.cast(eps, tl.float32),
        tl.cast(clamp, tl.float32),
    )
    pid, programs = tl.program_id(0), tl.num_programs(0)
    n_tiles = tl.cdiv(M, BLOCK_M)
    lanes = tl.arange(0, BLOCK_M)
    w0, w1, w2 = _load_parts(W, PARTS, BLOCK_N)
    b0, b1, b2 = _load_parts(B, PARTS, BLOCK_N)
    if PREFETCH:
        x0, x1, x2 = _load_rows(X, pid * BLOCK_M + lanes, M, stride_x, PARTS, BLOCK_N)
        for tile in range(pid, n_tiles, programs):
            rows = tile * BLOCK_M + lanes
            n0, n1, n2 = _load_rows(X, rows + programs * BLOCK_M, M, stride_x, PARTS, BLOCK_N)
            _normalize_store(
                Y, Stats, x0, x1, x2, w0, w1, w2, b0, b1, b2, rows, M, stride_y, inv_n, eps,
                clamp, HAS_BIAS, STABLE, PARTS, BLOCK_N,
            )  # fmt: skip
            x0, x1, x2 = n0, n1, n2
    else:
        for tile in tl.range(pid, n_tiles, programs, num_stages=STAGES):
            rows = tile * BLOCK_M + lanes
            x0, x1, x2 = _load_rows(X, rows, M, stride_x, PARTS, BLOCK_N)
            _normalize_store(
                Y, Stats, x0, x1, x2, w0, w1, w2, b0, b1, b2, rows, M, stride_y, inv_n, eps,
                clamp, HAS_BIAS, STABLE, PARTS, BLOCK_N,
            )  # fmt: skip


def persistent_fwd(
    x2, w, b, y2, stats, eps, stable, block_m, parts, warps, per_sm, prefetch, stages
):
    M, N = x2.shape
    programs = min(cdiv(M, block_m), per_sm * sm_count(x2.device))
    _ln_fwd_persistent_kernel[(programs,)](
        x2, w, b, y2, stats, M, 1.0 / N, x2.stride(0), y2.stride(0), eps, ln.STABLE_CLAMP,
        HAS_BIAS=True, STABLE=stable, PARTS=parts, BLOCK_M=block_m, BLOCK_N=N // parts,
        PREFETCH=prefetch, STAGES=stages, num_warps=warps,
    )  # fmt: skip


# (N, M): the sweep's widths at 2**26 elements, and GPT-2's rows
SHAPES = [(1024, 65536), (768, 87381), (768, 16384), (512, 131072), (2048, 32768), (1024, 16384)]
# (block_m, warps, per_sm, prefetch, stages)
VARIANTS = [
    (bm, w, ps, pf, st)
    for bm, w in ((1, 4), (2, 4), (4, 4), (2, 8))
    for ps in (4, 8, 16)
    for pf, st in ((True, 1), (False, 2))
]


def _row(n: int, m: int, stable: bool) -> dict:
    torch.manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    stats = torch.empty(3 if stable else 2, m, device="cuda")
    ref_y = torch.empty_like(x)
    ln.launch_layernorm_fwd(x, w, b, ref_y, stats.clone(), 1e-5, stable)
    fn = common.compiled(_torch_fn("layernorm_stable" if stable else "layernorm"), dynamic=False)
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    out = {"N": n, "M": m, "stable": stable}
    out["compile"] = common.kernel_ms(functools.partial(fn, *leaves))
    out["shipped"] = common.kernel_ms(
        functools.partial(ln.launch_layernorm_fwd, x, w, b, y, stats, 1e-5, stable)
    )
    parts = 3 if n in (768, 384, 12288) else 1
    for bm, warps, ps, pf, st in VARIANTS:
        name = f"bm{bm} w{warps} ps{ps} " + ("prefetch" if pf else f"stages{st}")
        run = functools.partial(
            persistent_fwd, x, w, b, y, stats, 1e-5, stable, bm, parts, warps, ps, pf, st
        )
        try:
            y.zero_()
            run()
            torch.cuda.synchronize()
            err = (y.float() - ref_y.float()).abs().max().item()
            out[name] = common.kernel_ms(run) if err < 0.07 else f"wrong ({err:.3g})"
        except Exception as e:  # a variant that does not compile
            out[name] = f"{type(e).__name__}: {str(e)[:80]}"
    return out


def main() -> None:
    _, out = common.parse_out(__doc__)
    rows = []
    for n, m in SHAPES:
        for stable in (False, True):
            if stable and n not in (1024, 768):
                continue
            row = _row(n, m, stable)
            rows.append(row)
            timed = {
                k: v
                for k, v in row.items()
                if k not in ("N", "M", "stable", "compile", "shipped") and isinstance(v, float)
            }
            best = min(timed.items(), key=lambda kv: kv[1]) if timed else ("-", float("nan"))
            print(
                f"{m}x{n} stable={stable}: compile {row['compile'] * 1e3:.1f} "
                f"shipped {row['shipped'] * 1e3:.1f} "
                f"best {best[0]} {best[1] * 1e3:.1f} µs",
                flush=True,
            )
    (out / "layernorm_persistent.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
