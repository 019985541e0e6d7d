"""LayerNorm over the last dim, with an optional CogView "PB-relax" stable variant.

`layernorm(x, weight, bias, eps, stable, use_triton)`; `use_triton=False` runs the PyTorch
reference that defines the semantics:

    if stable: x = x / x.abs().amax(-1, keepdim=True).clamp(min=STABLE_CLAMP)
    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias

The Triton path is two `torch.library.triton_op`s, `triton_transformer::layernorm_fwd` and
`triton_transformer::layernorm_bwd`, wired together with `register_autograd`, so torch.compile
traces both (no graph break) and a CUDA graph can capture them (nothing is read on the host).
The backward is once-differentiable: `create_graph=True` raises instead of silently dropping
second-order terms. The output is a fresh tensor (not a view), so in-place ops on it work.

The kernels here are shared with the fused residual + LayerNorm op
(`triton_transformer/residual_layernorm.py`): with RESIDUAL the forward first forms
x = h + dropout(branch), writes it, and normalises it; the backward adds the downstream
gradient of that sum and writes the masked branch gradient too.

Triton design:
- Forward: each program normalises BLOCK_M rows held as a (BLOCK_M, BLOCK_N) tile (several
  rows per program when N is small). Rows up to MAX_BLOCK_N stay in registers (one read of x,
  one write of y); statistics are fp32 and two-pass within the tile. A longer row is processed
  in a loop over column blocks: one pass merges per-block mean/M2 (Chan's parallel variance),
  one pass writes y (plus a first pass for the row's max |x| when stable). Only mean and rstd
  per row (and the scale when stable) are saved.
- Backward: with xhat = (u - mean) * rstd, u = x / scale (scale = 1 unless stable) and
  g = dy * w, du = rstd * (g - c2 - xhat * c1) with c1 = mean(xhat * g), c2 = mean(g). One
  pass over x and dy when the row fits a block (two when it does not). dweight/dbias: a fixed
  number of programs (a multiple of the SM count, per N from _BWD_TABLE) each own a contiguous
  range of rows, accumulate their column sums in registers and write them as one row of a
  (programs, N) fp32 buffer; a tiny column-sum kernel then adds those rows in a fixed order.
  No atomics, no locks, no waiting: deterministic, and it runs in the interpreter (which runs
  programs one after another). See `_bwd_config` for why this is not a single launch.
- Stable backward: dx = du / s plus the gradient through the scale s = max|x| (not detached,
  to match autograd of the PyTorch branch). LayerNorm ignores its input's scale except
  through eps, and indeed sum(du * u) = N * c1 * eps * rstd^2 exactly, so the kernel uses
  dL/ds = -N * c1 * eps * rstd^2 / s (no cancelling sum). It flows to the tied maxima of |x|
  as sign(x_j) / count (torch's amax splits ties evenly), and nowhere when amax < clamp
  (then no |x_j| equals s, as the clamp's gradient is zero there).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from torch.autograd.function import once_differentiable
from torch.library import triton_op, wrap_triton

from triton_transformer.utils import (
    as_rows,
    calc_num_warps,
    call_op,
    cdiv,
    check_triton_tensor,
    exists,
    row_block_size,
    sm_count,
)

# Lower bound on the stable variant's per-row scale, so an all-zero row does not divide by
# zero. 2**-14 is the smallest normal fp16 and is exact in fp16, bf16 and fp32, so both
# branches clamp to the same value in every dtype.
STABLE_CLAMP = 2.0**-14

# Widest column block one program holds in registers; longer rows loop over blocks.
# Tests monkeypatch it small to exercise the looped path. (16384 in registers was measured
# 2-4x slower on an H200 than looping over 8192-wide blocks: register spills.)
MAX_BLOCK_N = 8192

# Launch configurations keyed by the power-of-two column block. Forward: (rows per program,
# warps). Backward: (rows per tile, warps, programs per SM, prefetch the next tile). Blocks not
# listed fall back to the nearest entry. Blocks 512-4096 come from the H200 sweep of 2026-11-22
# (`benchmarks/bench_layernorm.py --tune --shapes ...`, kernel times, bf16) at 2048 and 8192 x
# 512, 4096 and 16384 x 1024, 4096 x 2048 and 4096 x 4096: each entry is within 6% of the
# best at every swept shape. The backward wants few elements per thread (4-8), 4 warps up to
# N = 1024, and the next tile's loads prefetched: at 2048 x 512 it takes 7.2 µs against 24.9
# for the old (4 rows, 8 warps, 4 per SM) entry, at 4096 x 1024 9.9 against 24.6. The other
# blocks keep the configurations of revision 4b80779 (a 2048-element tile, `calc_num_warps`
# warps, 4 backward programs per SM), not yet swept.
_FWD_TABLE: dict[int, tuple[int, int]] = {
    16: (128, 8),
    32: (64, 8),
    64: (32, 8),
    128: (16, 8),
    256: (8, 8),
    512: (2, 2),
    1024: (4, 4),
    2048: (4, 4),
    4096: (2, 8),
    8192: (1, 16),
}
_BWD_TABLE: dict[int, tuple[int, int, int, bool]] = {
    16: (128, 8, 4, False),
    32: (64, 8, 4, False),
    64: (32, 8, 4, False),
    128: (16, 8, 4, False),
    256: (8, 8, 4, False),
    512: (1, 4, 4, True),
    1024: (4, 4, 2, True),
    2048: (2, 8, 2, True),
    4096: (1, 8, 2, True),
    8192: (1, 16, 4, False),
}
# Column-sum kernel: columns per program, partial rows per step (one step covers up to 256
# backward programs, so the few column programs are not latency-bound loops) and warps.
_COLSUM_BLOCK_C = 32
_COLSUM_BLOCK_G = 256
_COLSUM_WARPS = 8


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _keep_mask(SEED, rows, cols, N, p, INT64_IDX: tl.constexpr):
    """Dropout keep mask of a tile: Philox uniform of the row-major index (row * N + col) >= p.

    A pure function of (seed, index), so the backward regenerates the forward's mask.
    """
    seed = tl.load(SEED)
    if INT64_IDX:
        idx = rows.to(tl.int64)[:, None] * N + cols[None, :]
    else:
        idx = rows[:, None] * N + cols[None, :]
    return tl.rand(seed, idx) >= p


@triton.jit
def _load_x(
    X, H, BR, SEED, rows, cols, mask, N, stride_x, stride_h, stride_br, p, drop_scale,
    RESIDUAL: tl.constexpr, DROPOUT: tl.constexpr, INT64_IDX: tl.constexpr,
    STORE_X: tl.constexpr,
):  # fmt: skip
    """The fp32 tile of x: loaded from X, or (RESIDUAL) formed as h + dropout(branch),
    rounded to X's dtype exactly as the stored sum is (and stored into X when STORE_X)."""
    r64 = rows.to(tl.int64)[:, None]
    if RESIDUAL:
        h = tl.load(H + r64 * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        br = tl.load(BR + r64 * stride_br + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            keep = _keep_mask(SEED, rows, cols, N, p, INT64_IDX)
            br = tl.where(keep, br * drop_scale, 0.0)
        xs = (h + br).to(X.dtype.element_ty)
        if STORE_X:
            tl.store(X + r64 * stride_x + cols[None, :], xs, mask=mask)
        x = xs.to(tl.float32)
    else:
        x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _ln_fwd_kernel(
    X, W, B, Y, Stats, H, BR, SEED,
    M, N, inv_n, stride_x, stride_y, stride_h, stride_br, eps, clamp, p, drop_scale,
    HAS_BIAS: tl.constexpr, STABLE: tl.constexpr, SINGLE: tl.constexpr,
    RESIDUAL: tl.constexpr, DROPOUT: tl.constexpr, INT64_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # inv_n = 1/N comes from the host: fp32 division on the GPU is approximate (div.full),
    # so `sum / N` would not even reproduce x exactly for N = 1.
    # torch.compile passes Python floats as fp64: compute in fp32 as the eager launch does
    inv_n, eps = tl.cast(inv_n, tl.float32), tl.cast(eps, tl.float32)
    clamp = tl.cast(clamp, tl.float32)
    p, drop_scale = tl.cast(p, tl.float32), tl.cast(drop_scale, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    y_rows = Y + rows.to(tl.int64)[:, None] * stride_y
    cols = tl.arange(0, BLOCK_N)

    if SINGLE:
        # The whole row fits one block: load once, everything stays in registers.
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_x(
            X, H, BR, SEED, rows, cols, mask, N, stride_x, stride_h, stride_br, p, drop_scale,
            RESIDUAL, DROPOUT, INT64_IDX, True,
        )  # fmt: skip
        if STABLE:
            scale = tl.maximum(tl.max(tl.abs(x), axis=1), clamp)
            # x * (1/scale), never x / scale: the GPU's approximate division may be
            # compiled differently in the backward kernel, and u must match there bit for bit
            # (a one-ulp difference times rstd is a visible error in xhat).
            x = x * (1.0 / scale)[:, None]
        mean = tl.sum(x, axis=1) * inv_n
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) * inv_n + eps)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Passes before the last recompute x (RESIDUAL: from h and branch; the sum is stored
        # only in the last pass, so no pass reads what another thread wrote).
        if STABLE:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for off in range(0, N, BLOCK_N):
                mask = row_mask[:, None] & (off + cols < N)[None, :]
                x = _load_x(
                    X, H, BR, SEED, rows, off + cols, mask, N, stride_x, stride_h, stride_br,
                    p, drop_scale, RESIDUAL, DROPOUT, INT64_IDX, False,
                )  # fmt: skip
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            scale = tl.maximum(amax, clamp)
        # One pass for mean and M2: exact two-pass statistics within each block, merged
        # across blocks with Chan's formula (stable, unlike sum / sum-of-squares).
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            mask = row_mask[:, None] & (off + cols < N)[None, :]
            x = _load_x(
                X, H, BR, SEED, rows, off + cols, mask, N, stride_x, stride_h, stride_br,
                p, drop_scale, RESIDUAL, DROPOUT, INT64_IDX, False,
            )  # fmt: skip
            if STABLE:
                x = x * (1.0 / scale)[:, None]
            n_seen = off * 1.0  # as fp32 (`off` may be a Python int in the interpreter)
            n_blk = tl.minimum(N - off, BLOCK_N) * 1.0
            blk_mean = tl.sum(x, axis=1) / n_blk
            d = tl.where(mask, x - blk_mean[:, None], 0.0)
            delta = blk_mean - mean
            mean += delta * (n_blk / (n_seen + n_blk))
            m2 += tl.sum(d * d, axis=1) + delta * delta * (n_seen * n_blk / (n_seen + n_blk))
        rstd = tl.rsqrt(m2 * inv_n + eps)
        for off in range(0, N, BLOCK_N):
            col_mask = off + cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_x(
                X, H, BR, SEED, rows, off + cols, mask, N, stride_x, stride_h, stride_br,
                p, drop_scale, RESIDUAL, DROPOUT, INT64_IDX, True,
            )  # fmt: skip
            if STABLE:
                x = x * (1.0 / scale)[:, None]
            w = tl.load(W + off + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
            if HAS_BIAS:
                y += tl.load(B + off + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows + off + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    # Stats is (2 or 3, M) fp32: mean, rstd (and scale when stable) of u = x / scale.
    tl.store(Stats + rows, mean, mask=row_mask)
    tl.store(Stats + M + rows, rstd, mask=row_mask)
    if STABLE:
        tl.store(Stats + 2 * M + rows, scale, mask=row_mask)


@triton.jit
def _ln_xhat_g(x, dy, w, mask, mean, rstd, scale, STABLE: tl.constexpr):
    """Recompute xhat = (u - mean) * rstd (u = x / scale when stable) and g = w * dy."""
    u = x
    if STABLE:
        u = x * (1.0 / scale)[:, None]  # exactly as in the forward kernel
    xhat = tl.where(mask, (u - mean[:, None]) * rstd[:, None], 0.0)
    return xhat, dy * w[None, :]


@triton.jit
def _ln_dx(xhat, g, x, mask, c1, c2, tie_grad, rstd, scale, STABLE: tl.constexpr):
    """dx of one tile from the row reductions c1 = mean(xhat * g), c2 = mean(g)."""
    du = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
    if STABLE:
        # u = x / s: dx = du / s, plus dL/ds * sign(x) / count at the tied maxima of |x|.
        tie = (tl.abs(x) == scale[:, None]) & mask
        signed = tl.where(x > 0, tie_grad[:, None], -tie_grad[:, None])
        du = du * (1.0 / scale)[:, None] + tl.where(tie, signed, 0.0)
    return du


@triton.jit
def _store_dx(
    DX, DHN, DBR, SEED, dx, rows, cols, mask, N, stride_dx, stride_dhn, stride_dbr, p,
    drop_scale,
    HAS_DHN: tl.constexpr, WRITE_DBR: tl.constexpr, DROPOUT: tl.constexpr,
    INT64_IDX: tl.constexpr,
):  # fmt: skip
    """Store dx (+ the downstream gradient of the residual sum) and the branch gradient."""
    r64 = rows.to(tl.int64)[:, None]
    if HAS_DHN:
        dx += tl.load(DHN + r64 * stride_dhn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WRITE_DBR:
        dbr = dx
        if DROPOUT:
            keep = _keep_mask(SEED, rows, cols, N, p, INT64_IDX)
            dbr = tl.where(keep, dx * drop_scale, 0.0)
        tl.store(DBR + r64 * stride_dbr + cols[None, :], dbr.to(DBR.dtype.element_ty), mask=mask)


@triton.jit
def _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy):
    """x and dy tiles of `rows` (masked past row_end), in their storage dtype."""
    mask = (rows < row_end)[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
    return x, dy


@triton.jit
def _ln_bwd_kernel(
    X, W, DY, DX, Partial, Stats, DHN, DBR, SEED, DW, DB, Counter,
    M, N, inv_n, rows_per_prog, stride_x, stride_dy, stride_dx, stride_dhn, stride_dbr,
    eps, p, drop_scale,
    HAS_BIAS: tl.constexpr, STABLE: tl.constexpr, SINGLE: tl.constexpr,
    HAS_DHN: tl.constexpr, WRITE_DBR: tl.constexpr, DROPOUT: tl.constexpr,
    INT64_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr, FUSED_REDUCE: tl.constexpr, RED_G: tl.constexpr,
    RED_C: tl.constexpr,
):  # fmt: skip
    # torch.compile passes Python floats as fp64: compute in fp32 as the eager launch does
    inv_n, eps = tl.cast(inv_n, tl.float32), tl.cast(eps, tl.float32)
    p, drop_scale = tl.cast(p, tl.float32), tl.cast(drop_scale, tl.float32)
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    cols = tl.arange(0, BLOCK_N)
    # This program's row of the (programs, N) partial sums; dbias partials follow dweight's.
    dw_out = Partial + pid.to(tl.int64) * N
    db_out = dw_out + tl.num_programs(0).to(tl.int64) * N

    if SINGLE:
        col_mask = cols < N
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            rows = row_start + tl.arange(0, BLOCK_M)
            x_next, dy_next = _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy)
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            mask = row_mask[:, None] & col_mask[None, :]
            if PREFETCH:
                # Issue the next tile's loads before this tile's reductions, so their memory
                # latency overlaps this tile's work.
                x, dy = x_next, dy_next
                x_next, dy_next = _load_x_dy(
                    X, DY, rows + BLOCK_M, row_end, cols, col_mask, stride_x, stride_dy
                )
            else:
                x, dy = _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
            mean = tl.load(Stats + rows, mask=row_mask, other=0.0)
            rstd = tl.load(Stats + M + rows, mask=row_mask, other=0.0)
            scale = rstd  # unused unless STABLE
            if STABLE:
                scale = tl.load(Stats + 2 * M + rows, mask=row_mask, other=1.0)
            xhat, g = _ln_xhat_g(x, dy, w, mask, mean, rstd, scale, STABLE)
            c1 = tl.sum(xhat * g, axis=1) * inv_n
            c2 = tl.sum(g, axis=1) * inv_n
            tie_grad = c1  # unused unless STABLE
            if STABLE:
                count = tl.sum(((tl.abs(x) == scale[:, None]) & mask).to(tl.float32), axis=1)
                tie_grad = -N * c1 * eps * rstd * rstd / scale / tl.maximum(count, 1.0)
            dx = _ln_dx(xhat, g, x, mask, c1, c2, tie_grad, rstd, scale, STABLE)
            _store_dx(
                DX, DHN, DBR, SEED, dx, rows, cols, mask, N, stride_dx, stride_dhn, stride_dbr,
                p, drop_scale, HAS_DHN, WRITE_DBR, DROPOUT, INT64_IDX,
            )  # fmt: skip
            dw_acc += dy * xhat
            if HAS_BIAS:
                db_acc += dy
        tl.store(dw_out + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if HAS_BIAS:
            tl.store(db_out + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows64 = rows.to(tl.int64)[:, None]
            mean = tl.load(Stats + rows, mask=row_mask, other=0.0)
            rstd = tl.load(Stats + M + rows, mask=row_mask, other=0.0)
            scale = rstd  # unused unless STABLE
            if STABLE:
                scale = tl.load(Stats + 2 * M + rows, mask=row_mask, other=1.0)
            # Pass 1: the row reductions (and the count of tied maxima).
            c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
            c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
            count = tl.zeros([BLOCK_M], dtype=tl.float32)
            for off in range(0, N, BLOCK_N):
                col_mask = off + cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                c = off + cols[None, :]
                x = tl.load(X + rows64 * stride_x + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows64 * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + off + cols, mask=col_mask, other=0.0).to(tl.float32)
                xhat, g = _ln_xhat_g(x, dy, w, mask, mean, rstd, scale, STABLE)
                c1 += tl.sum(xhat * g, axis=1)
                c2 += tl.sum(g, axis=1)
                if STABLE:
                    tie = (tl.abs(x) == scale[:, None]) & mask
                    count += tl.sum(tie.to(tl.float32), axis=1)
            c1 = c1 * inv_n
            c2 = c2 * inv_n
            tie_grad = c1  # unused unless STABLE
            if STABLE:
                tie_grad = -N * c1 * eps * rstd * rstd / scale / tl.maximum(count, 1.0)
            # Pass 2: dx, and this row tile's share of the program's dweight/dbias partials
            # (read-modify-write of the program's own buffer row; the first tile just writes).
            not_first = tl.full([BLOCK_N], r0, tl.int32) > row_start
            for off in range(0, N, BLOCK_N):
                col_mask = off + cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                c = off + cols[None, :]
                x = tl.load(X + rows64 * stride_x + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows64 * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + off + cols, mask=col_mask, other=0.0).to(tl.float32)
                xhat, g = _ln_xhat_g(x, dy, w, mask, mean, rstd, scale, STABLE)
                dx = _ln_dx(xhat, g, x, mask, c1, c2, tie_grad, rstd, scale, STABLE)
                _store_dx(
                    DX, DHN, DBR, SEED, dx, rows, off + cols, mask, N, stride_dx, stride_dhn,
                    stride_dbr, p, drop_scale, HAS_DHN, WRITE_DBR, DROPOUT, INT64_IDX,
                )  # fmt: skip
                pmask = col_mask & not_first
                dw = tl.load(dw_out + off + cols, mask=pmask, other=0.0)
                tl.store(dw_out + off + cols, dw + tl.sum(dy * xhat, axis=0), mask=col_mask)
                if HAS_BIAS:
                    db = tl.load(db_out + off + cols, mask=pmask, other=0.0)
                    tl.store(db_out + off + cols, db + tl.sum(dy, axis=0), mask=col_mask)

    if FUSED_REDUCE:
        # Measured alternative to the column-sum launch (off by default, see _bwd_config):
        # the last program to take a ticket sums every program's partials, in a fixed order.
        # Wait-free (no program waits for another) and deterministic; Counter must be 0 on
        # entry and is reset to 0 by that last program.
        tl.debug_barrier()  # all of this program's partial stores precede its ticket
        ticket = tl.atomic_add(Counter, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            G = tl.num_programs(0)
            for c0 in range(0, N, RED_C):
                rc = c0 + tl.arange(0, RED_C)
                cm = rc < N
                dw = tl.zeros([RED_G, RED_C], dtype=tl.float32)
                db = tl.zeros([RED_G, RED_C], dtype=tl.float32)
                for g0 in range(0, G, RED_G):
                    gs = g0 + tl.arange(0, RED_G)
                    m = (gs < G)[:, None] & cm[None, :]
                    offs = gs.to(tl.int64)[:, None] * N + rc[None, :]
                    dw += tl.load(Partial + offs, mask=m, other=0.0, cache_modifier=".cg")
                    if HAS_BIAS:
                        db += tl.load(
                            Partial + G.to(tl.int64) * N + offs,
                            mask=m,
                            other=0.0,
                            cache_modifier=".cg",
                        )
                tl.store(DW + rc, tl.sum(dw, axis=0).to(DW.dtype.element_ty), mask=cm)
                if HAS_BIAS:
                    tl.store(DB + rc, tl.sum(db, axis=0).to(DB.dtype.element_ty), mask=cm)
            tl.atomic_xchg(Counter, 0)


@triton.jit
def _colsum_kernel(
    Partial, PartialB, DW, DB, G, N,
    HAS_BIAS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Sum the (G, N) partials over G in a fixed order: dweight (and dbias, from PartialB) per
    column."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    db = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        gs = g0 + tl.arange(0, BLOCK_G)
        mask = (gs < G)[:, None] & col_mask[None, :]
        offs = gs.to(tl.int64)[:, None] * N + cols[None, :]
        dw += tl.load(Partial + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            db += tl.load(PartialB + offs, mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(dw, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, tl.sum(db, axis=0).to(DB.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------- launch config


def _nearest(table: dict, block_n: int):
    if block_n in table:
        return table[block_n]
    return table[min(table, key=lambda k: abs(k.bit_length() - block_n.bit_length()))]


@functools.cache
def _fwd_config(n_cols: int, max_block: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, single_block) of the forward kernel for rows of `n_cols`."""
    block_n = row_block_size(n_cols, max_block)
    if n_cols > block_n:  # looped long rows: one row per program
        return 1, block_n, calc_num_warps(block_n), False
    block_m, num_warps = _nearest(_FWD_TABLE, block_n)
    return block_m, block_n, num_warps, True


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter runs programs one by one: few programs are cheapest
    return sm_count(device)


@functools.cache
def _bwd_block_config(n_cols: int, max_block: int, device: torch.device):
    """The per-N part of the backward configuration (see `_bwd_config`)."""
    block_n = row_block_size(n_cols, max_block)
    single = n_cols <= block_n
    if single:
        block_m, num_warps, per_sm, prefetch = _nearest(_BWD_TABLE, block_n)
    else:
        block_m, num_warps, per_sm, prefetch = 1, calc_num_warps(block_n), 4, False
    max_programs = per_sm * _num_sms(device)
    return block_m, block_n, num_warps, single, max_programs, prefetch


def _bwd_config(n_rows, n_cols: int, max_block: int, device: torch.device):
    """(BLOCK_M, BLOCK_N, num_warps, single, programs, rows_per_prog, prefetch): backward config.

    The rows are split into `programs` contiguous ranges of `rows_per_prog` rows, a fixed
    function of the shape and the device, so dweight/dbias sum in the same order every run.
    `n_rows` may be symbolic (a SymInt while torch.compile traces with dynamic shapes): only
    the per-N part is cached, the rest is plain (symbolic-safe) integer arithmetic.

    Why two launches: finishing the column sums inside the same launch needs either a
    program that waits for the others (a spin-wait: forbidden, and it hangs the interpreter)
    or a "last program to arrive reduces" ticket (FUSED_REDUCE in the kernel), which is
    wait-free and deterministic but makes one program read all (programs x N) partials alone
    (MBs at large N), and needs a zeroed counter per call (an extra memset, or state mutated
    behind torch.compile's back); see the measurements in benchmarks/bench_layernorm.py --tune.
    """
    block_m, block_n, num_warps, single, max_programs, prefetch = _bwd_block_config(
        n_cols, max_block, device
    )
    tiles = cdiv(n_rows, block_m)
    programs = torch.sym_min(tiles, max_programs)
    rows_per_prog = cdiv(tiles, programs) * block_m
    programs = cdiv(n_rows, rows_per_prog)
    return block_m, block_n, num_warps, single, programs, rows_per_prog, prefetch


# ----------------------------------------------------------------------------- launchers
# Shared by the layernorm and residual_layernorm ops (and the benchmark's tuning sweep).


def launch_fwd(
    x2, weight, bias, y2, stats, eps, stable, *, h2=None, br2=None, p=0.0, seed=None, cfg=None
) -> None:
    """Normalise the rows of x2 into y2 (both (M, N), unit column stride), stats (2|3, M).

    Residual mode (h2 and br2 given): x2 is an output, written with h2 + dropout_p(br2)."""
    M, N = x2.shape[0], int(x2.shape[1])  # N is specialised (block sizes); M may be symbolic
    if M == 0 or N == 0:
        return
    block_m, block_n, num_warps, single = cfg or _fwd_config(N, MAX_BLOCK_N)
    residual = h2 is not None
    dropout = residual and p > 0.0
    wrap_triton(_ln_fwd_kernel)[(cdiv(M, block_m),)](
        x2, weight, bias if exists(bias) else weight, y2, stats,
        h2 if residual else x2, br2 if residual else x2, seed if dropout else stats,
        M, N, 1.0 / N, x2.stride(0), y2.stride(0),
        h2.stride(0) if residual else 0, br2.stride(0) if residual else 0,
        eps, STABLE_CLAMP, p, 1.0 / (1.0 - p) if dropout else 1.0,
        HAS_BIAS=exists(bias), STABLE=stable, SINGLE=single, RESIDUAL=residual,
        DROPOUT=dropout, INT64_IDX=bool(M * N >= 2**31),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip


def launch_bwd(
    dy2, x2, weight, stats, dx2, dweight, dbias, eps, stable, *,
    dhn2=None, dbr2=None, p=0.0, seed=None, cfg=None, counter=None,
) -> None:  # fmt: skip
    """dx2 (+ dhn2, the downstream gradient of a residual sum), dweight, dbias (or None) and,
    when dbr2 is given, the branch gradient dropout-masked (p, seed) into dbr2.

    `counter` (a zeroed int32 tensor) selects the single-launch "last program reduces"
    variant, kept for measurements (benchmarks/bench_layernorm.py --tune)."""
    M, N = x2.shape[0], int(x2.shape[1])  # N is specialised (block sizes); M may be symbolic
    if N == 0:
        return
    if M == 0:
        dweight.zero_()
        if exists(dbias):
            dbias.zero_()
        return
    block_m, block_n, num_warps, single, programs, rows_per_prog, prefetch = cfg or _bwd_config(
        M, N, MAX_BLOCK_N, x2.device
    )
    has_bias = exists(dbias)
    partial = torch.empty((2 if has_bias else 1, programs, N), dtype=torch.float32,
                          device=x2.device)  # fmt: skip
    dropout = exists(dbr2) and p > 0.0
    wrap_triton(_ln_bwd_kernel)[(programs,)](
        x2, weight, dy2, dx2, partial, stats,
        dhn2 if exists(dhn2) else dy2, dbr2 if exists(dbr2) else dx2,
        seed if dropout else stats, dweight, dbias if has_bias else dweight,
        counter if exists(counter) else stats,
        M, N, 1.0 / N, rows_per_prog, x2.stride(0), dy2.stride(0), dx2.stride(0),
        dhn2.stride(0) if exists(dhn2) else 0, dbr2.stride(0) if exists(dbr2) else 0,
        eps, p, 1.0 / (1.0 - p) if dropout else 1.0,
        HAS_BIAS=has_bias, STABLE=stable, SINGLE=single, HAS_DHN=exists(dhn2),
        WRITE_DBR=exists(dbr2), DROPOUT=dropout, INT64_IDX=bool(M * N >= 2**31),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        PREFETCH=prefetch, FUSED_REDUCE=exists(counter), RED_G=32, RED_C=128,
    )  # fmt: skip
    if exists(counter):
        return
    block_c, block_g = _COLSUM_BLOCK_C, _COLSUM_BLOCK_G
    wrap_triton(_colsum_kernel)[(cdiv(N, block_c),)](
        partial[0], partial[-1], dweight, dbias if has_bias else dweight, programs, N,
        HAS_BIAS=has_bias, BLOCK_G=block_g, BLOCK_C=block_c, num_warps=_COLSUM_WARPS,
    )  # fmt: skip


# ----------------------------------------------------------------------------- torch.library ops


@triton_op("triton_transformer::layernorm_fwd", mutates_args=())
def layernorm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    stable: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stats): y a new contiguous tensor shaped like x, in out_dtype (None: x's); stats
    (2 or 3, rows) fp32 holds each row's mean, rstd (and scale when stable) for the
    backward."""
    N = x.shape[-1]
    x2 = as_rows(x)
    M = x2.shape[0]
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    stats = torch.empty((3 if stable else 2, M), dtype=torch.float32, device=x.device)
    launch_fwd(x2, weight.contiguous(), bias, y.view(M, N), stats, eps, stable)
    return y, stats


@triton_op("triton_transformer::layernorm_bwd", mutates_args=())
def layernorm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stats: torch.Tensor,
    eps: float,
    stable: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); dbias is an empty (0,) tensor when bias is None."""
    N = x.shape[-1]
    x2, dy2 = as_rows(x), as_rows(dy)
    M = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty_like(weight)
    dbias = torch.empty((N if exists(bias) else 0,), dtype=weight.dtype if bias is None
                        else bias.dtype, device=x.device)  # fmt: skip
    launch_bwd(dy2, x2, weight.contiguous(), stats, dx.view(M, N), dweight,
               dbias if exists(bias) else None, eps, stable)  # fmt: skip
    return dx, dweight, dbias


def _ln_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, ctx.eps, ctx.stable, _ = inputs
    _, stats = output
    ctx.mark_non_differentiable(stats)
    # stats get no gradient: without this autograd would zero-fill one for every call
    ctx.set_materialize_grads(False)
    ctx.has_bias = exists(bias)
    ctx.save_for_backward(x, weight, bias, stats)


@once_differentiable
def _ln_backward(ctx, dy, _dstats):
    if dy is None:  # grads are not materialised: y was not used
        return None, None, None, None, None, None
    x, weight, bias, stats = ctx.saved_tensors
    dx, dweight, dbias = layernorm_bwd(dy, x, weight, bias, stats, ctx.eps, ctx.stable)
    return dx, dweight, dbias if ctx.has_bias else None, None, None, None


layernorm_fwd.register_autograd(_ln_backward, setup_context=_ln_setup_context)


# ----------------------------------------------------------------------------- public API


def _check_param(p: object, name: str, x: torch.Tensor, use_triton: bool) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if p.shape != (x.shape[-1],):
        raise ValueError(
            f"{name} must have shape ({x.shape[-1]},) to match the last dim of x "
            f"{tuple(x.shape)}, got {tuple(p.shape)}"
        )
    if use_triton:
        check_triton_tensor(p, name)
        if p.device != x.device:
            raise ValueError(f"{name} is on {p.device} but x is on {x.device}")


def _layernorm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    stable: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    dtype = x.dtype
    if stable:
        x = x / x.abs().amax(-1, keepdim=True).clamp(min=STABLE_CLAMP)
    if weight.dtype != dtype or (exists(bias) and bias.dtype != dtype):
        # e.g. fp32 params with bf16 activations: compute in fp32, like the kernel does.
        x, weight = x.float(), weight.float()
        bias = bias.float() if exists(bias) else None
    # `.to(...)`: output in the input's dtype (or out_dtype), also under autocast (which runs
    # layer_norm in fp32); a no-op otherwise.
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps).to(out_dtype or dtype)


def check_out_dtype(out_dtype: object) -> None:
    if out_dtype is not None and not (
        isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point
    ):
        raise TypeError(f"out_dtype must be a floating torch.dtype or None, got {out_dtype!r}")


def check_layernorm_args(x: object, weight: object, bias: object, use_triton: bool) -> None:
    """Validate layernorm's tensors (shared with residual_layernorm)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dim to normalise over, got a scalar")
    if use_triton:
        check_triton_tensor(x, "x")
    _check_param(weight, "weight", x, use_triton)
    if exists(bias):
        _check_param(bias, "bias", x, use_triton)


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    stable: bool = False,
    use_triton: bool = False,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Layer normalisation over the last dim of `x`.

    Args:
        x: (..., N) float tensor, any rank >= 1, any strides.
        weight: (N,) scale; may have another float dtype than x (computed in fp32).
        bias: (N,) shift, or None for no bias.
        eps: added to the variance.
        stable: divide each row by its max |x| (clamped to >= STABLE_CLAMP) first, so huge
            activations cannot overflow (CogView's PB-relax); differentiable through the scale.
        use_triton: run the Triton kernels instead of the PyTorch reference.
        out_dtype: the output's float dtype (None: x's). The kernel computes in fp32 and
            rounds once into it: an fp32 residual stream feeding bf16 matmuls under autocast
            gets its bf16 input without a cast pass (and the gradient comes back in bf16).

    Returns:
        (..., N) tensor in out_dtype: a new tensor, never a view (in-place ops on it work).
    """
    check_layernorm_args(x, weight, bias, use_triton)
    check_out_dtype(out_dtype)
    if not use_triton:
        return _layernorm_torch(x, weight, bias, eps, stable, out_dtype)
    return call_op(layernorm_fwd, x, weight, bias, float(eps), bool(stable), out_dtype)[0]


class LayerNorm(nn.Module):
    """LayerNorm over the last dim; params `weight`/`bias` named like torch.nn.LayerNorm, so
    state dicts interchange. `bias=False` registers `bias` as None (no shift)."""

    def __init__(
        self,
        dim: int,
        bias: bool = True,
        stable: bool = False,
        eps: float = 1e-5,
        use_triton: bool = False,
    ):
        super().__init__()
        self.dim, self.stable, self.eps, self.use_triton = dim, stable, eps, use_triton
        self.weight = nn.Parameter(torch.ones(dim))
        if bias:
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("bias", None)

    def forward(
        self,
        x: torch.Tensor,
        use_triton: bool | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x: (..., dim) -> (..., dim) in out_dtype (None: x's); `use_triton=None` uses the
        module's flag."""
        use_triton = self.use_triton if use_triton is None else use_triton
        return layernorm(
            x, self.weight, self.bias, self.eps, self.stable, use_triton, out_dtype=out_dtype
        )

    def extra_repr(self) -> str:
        return f"{self.dim}, bias={self.bias is not None}, stable={self.stable}, eps={self.eps}"
