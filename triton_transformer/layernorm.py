"""LayerNorm over the last dim, with an optional CogView "PB-relax" stable variant.

`layernorm(x, weight, bias, eps, stable, use_triton)`; `use_triton=False` runs the PyTorch
reference that defines the semantics:

    if stable: x = x / x.abs().amax(-1, keepdim=True).clamp(min=STABLE_CLAMP)
    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias

Triton design:
- Forward: each program normalises BLOCK_M rows held as a (BLOCK_M, BLOCK_N) tile (several
  rows per program when N is small, to cut the program count). Statistics are fp32. A row
  longer than MAX_BLOCK_N is processed in a loop over column blocks: one pass merges per-block
  mean/M2 (Chan's parallel variance), one pass writes y (plus a first pass for the row's max
  |x| when stable). Only mean and rstd per row (and the scale when stable) are saved.
- Backward: with xhat = (u - mean) * rstd, u = x / scale (scale = 1 unless stable) and
  g = dy * w, du = rstd * (g - c2 - xhat * c1) with c1 = mean(xhat * g), c2 = mean(g). Long
  rows take two passes (reductions first, then dx). dweight/dbias use a deterministic two-stage
  reduction: program p owns a fixed group of rows and writes its column sums into row p of a
  (num_groups, N) fp32 buffer, which a column-sum kernel then reduces. No atomics, no locks.
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

from triton_transformer.utils import (
    as_rows,
    calc_num_warps,
    check_triton_tensor,
    exists,
    row_block_size,
)

# Lower bound on the stable variant's per-row scale, so an all-zero row does not divide by
# zero. 2**-14 is the smallest normal fp16 and is exact in fp16, bf16 and fp32, so both
# branches clamp to the same value in every dtype.
STABLE_CLAMP = 2.0**-14

# Widest column block one program holds in registers; longer rows loop over blocks.
# Tests monkeypatch it small to exercise the looped path.
MAX_BLOCK_N = 8192
# Target elements per tile when several short rows share a program.
_TILE_ELEMS = 2048
# Backward programs per SM: each owns a group of rows and one row of the partial buffer.
_BWD_PROGRAMS_PER_SM = 4


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _ln_fwd_kernel(
    X, W, B, Y, Stats,
    M, N, inv_n, stride_x, stride_y, eps, clamp,
    HAS_BIAS: tl.constexpr, STABLE: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # inv_n = 1/N comes from the host: fp32 division on the GPU is approximate (div.full),
    # so `sum / N` would not even reproduce x exactly for N = 1.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = X + rows.to(tl.int64)[:, None] * stride_x
    y_rows = Y + rows.to(tl.int64)[:, None] * stride_y
    cols = tl.arange(0, BLOCK_N)

    if SINGLE:
        # The whole row fits one block: load once, everything stays in registers.
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
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
        if STABLE:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for off in range(0, N, BLOCK_N):
                mask = row_mask[:, None] & (off + cols < N)[None, :]
                x = tl.load(x_rows + off + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            scale = tl.maximum(amax, clamp)
        # One pass for mean and M2: exact two-pass statistics within each block, merged
        # across blocks with Chan's formula (stable, unlike sum / sum-of-squares).
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            mask = row_mask[:, None] & (off + cols < N)[None, :]
            x = tl.load(x_rows + off + cols[None, :], mask=mask, other=0.0).to(tl.float32)
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
            x = tl.load(x_rows + off + cols[None, :], mask=mask, other=0.0).to(tl.float32)
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
def _ln_bwd_kernel(
    X, W, DY, DX, Partial, Stats,
    M, N, inv_n, rows_per_group, stride_x, stride_dy, stride_dx, eps,
    HAS_BIAS: tl.constexpr, STABLE: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0)
    row_start = group * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, M)
    cols = tl.arange(0, BLOCK_N)
    # This program's row of the (num_groups, N) partial sums; dbias partials follow dweight's.
    dw_out = Partial + group.to(tl.int64) * N
    db_out = dw_out + tl.num_programs(0).to(tl.int64) * N

    if SINGLE:
        col_mask = cols < N
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows.to(tl.int64)[:, None]
            x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
            x = x.to(tl.float32)
            dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
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
            tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            dw_acc += dy * xhat
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
            # Pass 2: dx, and this row tile's share of the group's dweight/dbias partials
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
                tl.store(DX + rows64 * stride_dx + c, dx.to(DX.dtype.element_ty), mask=mask)
                pmask = col_mask & not_first
                dw = tl.load(dw_out + off + cols, mask=pmask, other=0.0)
                tl.store(dw_out + off + cols, dw + tl.sum(dy * xhat, axis=0), mask=col_mask)
                if HAS_BIAS:
                    db = tl.load(db_out + off + cols, mask=pmask, other=0.0)
                    tl.store(db_out + off + cols, db + tl.sum(dy, axis=0), mask=col_mask)


@triton.jit
def _colsum_kernel(
    Partial, DW, DB, G, N,
    HAS_BIAS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Sum the (G, N) partials over G in a fixed order: dweight (and dbias) per column."""
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
            db += tl.load(Partial + G * N + offs, mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(dw, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, tl.sum(db, axis=0).to(DB.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------- launch config


@functools.cache
def _row_config(n_cols: int, max_block: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, single_block) for rows of `n_cols` elements."""
    block_n = row_block_size(n_cols, max_block)
    block_m = max(1, _TILE_ELEMS // block_n) if n_cols <= block_n else 1
    return block_m, block_n, calc_num_warps(block_m * block_n), n_cols <= block_n


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter runs programs one by one: few groups are cheapest
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _bwd_groups(n_rows: int, block_m: int, n_sms: int) -> tuple[int, int]:
    """(num_groups, rows_per_group): a fixed split of the rows over the backward programs.

    Depends only on the shape and the device, so dweight/dbias sum in the same order every run.
    """
    tiles = triton.cdiv(n_rows, block_m)
    rows_per_group = triton.cdiv(tiles, min(tiles, _BWD_PROGRAMS_PER_SM * n_sms)) * block_m
    return triton.cdiv(n_rows, rows_per_group), rows_per_group


# ----------------------------------------------------------------------------- autograd


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, stable):
        shape, N = x.shape, x.shape[-1]
        ctx.eps, ctx.stable, ctx.has_bias = eps, stable, exists(bias)
        ctx.bias_dtype = bias.dtype if exists(bias) else None
        if x.numel() == 0:
            ctx.save_for_backward(None, weight, None)
            return x.new_empty(shape)

        x2 = as_rows(x)
        M = x2.shape[0]
        weight = weight.contiguous()
        bias = bias.contiguous() if exists(bias) else None
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        # One fp32 buffer for the per-row stats: mean, rstd (and scale when stable).
        stats = torch.empty((3 if stable else 2, M), dtype=torch.float32, device=x.device)
        block_m, block_n, num_warps, single = _row_config(N, MAX_BLOCK_N)
        _ln_fwd_kernel[(triton.cdiv(M, block_m),)](
            x2, weight, bias if exists(bias) else weight, y, stats,
            M, N, 1.0 / N, x2.stride(0), y.stride(0), eps, STABLE_CLAMP,
            HAS_BIAS=exists(bias), STABLE=stable, SINGLE=single,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )  # fmt: skip
        ctx.save_for_backward(x2, weight, stats)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, stats = ctx.saved_tensors
        has_bias = ctx.has_bias
        if x2 is None:  # zero-size input
            dw = torch.zeros_like(weight)
            db = torch.zeros(weight.shape, dtype=ctx.bias_dtype, device=weight.device)
            return dy.new_empty(dy.shape), dw, db if has_bias else None, None, None

        M, N = x2.shape
        dy2 = as_rows(dy)
        dx = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
        block_m, block_n, num_warps, single = _row_config(N, MAX_BLOCK_N)
        groups, rows_per_group = _bwd_groups(M, block_m, _num_sms(x2.device))
        partial = torch.empty(
            (2 if has_bias else 1, groups, N), dtype=torch.float32, device=x2.device
        )
        _ln_bwd_kernel[(groups,)](
            x2, weight, dy2, dx, partial, stats,
            M, N, 1.0 / N, rows_per_group, x2.stride(0), dy2.stride(0), dx.stride(0), ctx.eps,
            HAS_BIAS=has_bias, STABLE=ctx.stable, SINGLE=single,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )  # fmt: skip
        dweight = torch.empty_like(weight)
        dbias = torch.empty(N, dtype=ctx.bias_dtype, device=x2.device) if has_bias else None
        _colsum_kernel[(triton.cdiv(N, 64),)](
            partial, dweight, dbias if has_bias else dweight, groups, N,
            HAS_BIAS=has_bias, BLOCK_G=32, BLOCK_C=64,
        )  # fmt: skip
        return dx.view(dy.shape), dweight, dbias, None, None


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
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, stable: bool
) -> torch.Tensor:
    dtype = x.dtype
    if stable:
        x = x / x.abs().amax(-1, keepdim=True).clamp(min=STABLE_CLAMP)
    if weight.dtype != dtype or (exists(bias) and bias.dtype != dtype):
        # e.g. fp32 params with bf16 activations: compute in fp32, like the kernel does.
        x, weight = x.float(), weight.float()
        bias = bias.float() if exists(bias) else None
    # `.to(dtype)`: output in the input's dtype, also under autocast (which runs layer_norm
    # in fp32); a no-op otherwise.
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps).to(dtype)


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    stable: bool = False,
    use_triton: bool = False,
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

    Returns:
        (..., N) tensor in x's dtype.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dim to normalise over, got a scalar")
    if use_triton:
        check_triton_tensor(x, "x")
    _check_param(weight, "weight", x, use_triton)
    if exists(bias):
        _check_param(bias, "bias", x, use_triton)
    if not use_triton:
        return _layernorm_torch(x, weight, bias, eps, stable)
    return _LayerNormFunction.apply(x, weight, bias, float(eps), bool(stable))


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

    def forward(self, x: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
        """x: (..., dim) -> (..., dim); `use_triton=None` uses the module's flag."""
        use_triton = self.use_triton if use_triton is None else use_triton
        return layernorm(x, self.weight, self.bias, self.eps, self.stable, use_triton)

    def extra_repr(self) -> str:
        return f"{self.dim}, bias={self.bias is not None}, stable={self.stable}, eps={self.eps}"
