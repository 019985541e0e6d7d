"""RMSNorm over the last dim, and the fused residual add (+ dropout) + RMSNorm.

`rmsnorm(x, weight, eps, use_triton)`; `use_triton=False` runs the PyTorch reference that
defines the semantics (fp32 arithmetic for fp16/bf16 inputs, one rounding at the end):

    rstd = 1 / sqrt(mean(x²) + eps)
    y    = x * rstd * weight

`residual_rmsnorm(h, branch, weight, dropout_p=...)` returns (h_new, y) with
h_new = h + dropout(branch) and y = rmsnorm(h_new), as `residual_layernorm.py` does for
LayerNorm: the pre-norm block boundary of a Llama-style model in one kernel each way.

The Triton paths are `torch.library.triton_op`s (`triton_transformer::rmsnorm` / `rmsnorm_backward`,
`residual_rmsnorm` / `residual_rmsnorm_backward`; Python names `<op>_op` / `<op>_backward_op`) wired
with `register_autograd`, so torch.compile traces them (no graph break) and a CUDA graph can capture
them (nothing is read on the host; the dropout seed is a 0-dim device tensor). The backward is
first-order only (`utils.first_order_only`). Outputs are fresh tensors, never views.

The kernels follow `layernorm.py` (whose device helpers `_load_x`, `_store_dx`, `_load_x_dy`
and `_layernorm_bwd_colsum_kernel` they import: the residual sum, the dropout mask regenerated
from the seed by the package's one scheme, `_jit_helpers.dropout_keep_tile`, are the same
functions, so the masks match LayerNorm's):

- Forward: BLOCK_M rows per program as a (BLOCK_M, BLOCK_N) tile. BLOCK_N >= N: one read of x,
  one write of y (2·N·e bytes per row, the floor). BLOCK_N < N: a pass for sum(x²) and a pass
  writing y (3·N·e). Only rstd (fp32, one per row) is saved.
- Backward: with xhat = x * rstd and g = dy * w,

      dx      = rstd * (g - xhat * c),   c = mean(xhat * g)
      dweight = sum over rows of dy * xhat

  "row" (BLOCK_N >= N): a program holds BLOCK_M whole rows, reads x and dy once, writes dx
  (3·N·e per row) and accumulates its dweight partial in registers across its contiguous range
  of rows. "loop" (BLOCK_N < N): one pass over column blocks for c, a second writes dx and adds
  the block's dweight into the program's row of fp32 partials. Either way each program writes
  its column sums as one row of a (programs, N) buffer and layernorm's column-sum kernel adds
  the rows in a fixed order: deterministic, no atomics.
- Residual mode: the forward forms x = h + dropout(branch) (rounded to h_new's dtype exactly as
  stored), writes it and normalises it; the backward adds the downstream gradient of h_new and
  writes the (masked) branch gradient, which is dh itself when there is no dropout.

Launch configurations: `_RMSNORM_FWD_CONFIGS` / `_RMSNORM_BWD_CONFIGS` below start from
LayerNorm's H200/H100-tuned entries (the same memory pattern with one statistic less); of the
forward entries only 768-4096 columns were probed for RMSNorm itself (2048 differs,
`benchmarks/probe_modern_tiles.py`);
`benchmarks/bench_modern_ops.py` measures them against Liger-Kernel and torch.compile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op

from triton_transformer.bmm import _grad_home, _traced_grad_acc, folded_grads, grad_targets
from triton_transformer.layernorm import (
    _LAYERNORM_BWD_CONFIGS,
    _LAYERNORM_FWD_CONFIGS,
    BwdConfig,
    _bwd_plan,
    _layernorm_bwd_colsum_kernel,
    _load_x,
    _load_x_dy,
    _nearest,
    _store_dx,
    bound_bwd_key,
    check_out_dtype,
    check_residual_branch,
    param_grads,
    upstream_rows,
    width_class,
)
from triton_transformer.utils import (
    LaunchPlans,
    accumulates_grads,
    as_rows,
    call_op,
    cdiv,
    check_triton_tensor,
    default,
    dropout_threshold,
    eager_apply,
    exists,
    first_order_only,
    has_rows_view,
    is_traced,
    launcher,
    seed_or_draw,
    tensor_facts,
)

# Widest column block a program holds; wider rows loop over column blocks. Tests monkeypatch it
# small to exercise the looped paths at small N.
MAX_BLOCK_N = 32768

# (BLOCK_M, BLOCK_N, num_warps) of the forward and the backward configuration per width class
# (N rounded up to a power of two, >= 16): LayerNorm's tuned entries (see the module docstring).
# RMSNorm has no "split" backward: the widest class loops over 4096-column blocks. Its lighter
# forward (no mean) wants one row per program at 2048 columns: 10.8 against 12.1 µs at
# 4096 x 2048 bf16, Liger's 11.8 (H200, 2026-11-25, `benchmarks/probe_modern_tiles.py`).
_RMSNORM_FWD_CONFIGS: dict[int, tuple[int, int, int]] = {
    **_LAYERNORM_FWD_CONFIGS,
    # the entries RMSNorm was measured with, before LayerNorm's 2026-11-27 retune of these
    128: (16, 128, 4),
    256: (16, 256, 8),
    512: (2, 512, 2),
    2048: (1, 2048, 4),
}
_RMSNORM_BWD_CONFIGS: dict[int, BwdConfig] = {
    **_LAYERNORM_BWD_CONFIGS,
    16384: BwdConfig("loop", 1, 4096, 8, 2),  # no "split" backward here
}
_COLSUM_BLOCK_C = 32
_COLSUM_BLOCK_G = 256
_COLSUM_WARPS = 8


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _rmsnorm_fwd_kernel(
    X, W, Y, Rstd, H, BR, SEED,
    M, N, inv_n, stride_x, stride_y, stride_h, stride_br, eps, threshold, drop_scale,
    SINGLE: tl.constexpr, RESIDUAL: tl.constexpr, DROPOUT: tl.constexpr,
    INT64_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # torch.compile passes Python floats as fp64: compute in fp32 as the eager launch does
    inv_n, eps = tl.cast(inv_n, tl.float32), tl.cast(eps, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    y_rows = Y + rows.to(tl.int64)[:, None] * stride_y
    cols = tl.arange(0, BLOCK_N)
    if SINGLE:
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_x(
            X, H, BR, SEED, rows, 0, mask, N, stride_x, stride_h, stride_br, threshold,
            drop_scale, RESIDUAL, DROPOUT, INT64_IDX, True, BLOCK_N,
        )  # fmt: skip
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) * inv_n + eps)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # The first pass recomputes x (RESIDUAL: from h and branch); only the last stores it.
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            mask = row_mask[:, None] & (off + cols < N)[None, :]
            x = _load_x(
                X, H, BR, SEED, rows, off, mask, N, stride_x, stride_h, stride_br,
                threshold, drop_scale, RESIDUAL, DROPOUT, INT64_IDX, False, BLOCK_N,
            )  # fmt: skip
            ss += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(ss * inv_n + eps)
        for off in range(0, N, BLOCK_N):
            col_mask = off + cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_x(
                X, H, BR, SEED, rows, off, mask, N, stride_x, stride_h, stride_br,
                threshold, drop_scale, RESIDUAL, DROPOUT, INT64_IDX, True, BLOCK_N,
            )  # fmt: skip
            w = tl.load(W + off + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * w[None, :]
            tl.store(y_rows + off + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)


@triton.jit(do_not_specialize=["rows_per_prog"])
def _rmsnorm_bwd_kernel(
    X, W, DY, DX, Partial, Rstd, DHN, DBR, SEED,
    M, N, inv_n, rows_per_prog, stride_x, stride_dy, stride_dx, stride_dhn, stride_dbr,
    threshold, drop_scale,
    SINGLE: tl.constexpr, HAS_DHN: tl.constexpr, WRITE_DBR: tl.constexpr,
    DROPOUT: tl.constexpr, INT64_IDX: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """The "row" (SINGLE) and "loop" backward: dx of rows [pid * rows_per_prog, ...) and their
    dweight column sums as row pid of Partial."""
    inv_n = tl.cast(inv_n, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    cols = tl.arange(0, BLOCK_N)
    dw_out = Partial + pid.to(tl.int64) * N
    if SINGLE:
        col_mask = cols < N
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            rows = row_start + tl.arange(0, BLOCK_M)
            x_next, dy_next = _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy)
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            mask = row_mask[:, None] & col_mask[None, :]
            if PREFETCH:  # the next tile's loads overlap this tile's reductions
                x, dy = x_next, dy_next
                x_next, dy_next = _load_x_dy(
                    X, DY, rows + BLOCK_M, row_end, cols, col_mask, stride_x, stride_dy
                )
            else:
                x, dy = _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy)
            rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
            xhat = x.to(tl.float32) * rstd[:, None]
            dy = dy.to(tl.float32)
            g = dy * w[None, :]
            c = tl.sum(xhat * g, axis=1) * inv_n
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            _store_dx(
                DX, DHN, DBR, SEED, dx, rows, 0, mask, N, stride_dx, stride_dhn, stride_dbr,
                threshold, drop_scale, HAS_DHN, WRITE_DBR, DROPOUT, INT64_IDX, BLOCK_N,
            )  # fmt: skip
            dw_acc += dy * xhat
        tl.store(dw_out + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    else:
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows64 = rows.to(tl.int64)[:, None]
            rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
            # Pass 1: c = mean(xhat * g).
            c = tl.zeros([BLOCK_M], dtype=tl.float32)
            for off in range(0, N, BLOCK_N):
                col_mask = off + cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows64 * stride_x + off + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(DY + rows64 * stride_dy + off + cols[None, :], mask=mask, other=0.0)
                w = tl.load(W + off + cols, mask=col_mask, other=0.0).to(tl.float32)
                xhat = x.to(tl.float32) * rstd[:, None]
                c += tl.sum(xhat * dy.to(tl.float32) * w[None, :], axis=1)
            c = c * inv_n
            # Pass 2: dx, and this row tile's share of the program's dweight partials
            # (read-modify-write of the program's own buffer row; the first tile just writes).
            not_first = tl.full([BLOCK_N], r0, tl.int32) > row_start
            for off in range(0, N, BLOCK_N):
                col_mask = off + cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows64 * stride_x + off + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(DY + rows64 * stride_dy + off + cols[None, :], mask=mask, other=0.0)
                w = tl.load(W + off + cols, mask=col_mask, other=0.0).to(tl.float32)
                xhat = x.to(tl.float32) * rstd[:, None]
                dy = dy.to(tl.float32)
                dx = (dy * w[None, :] - xhat * c[:, None]) * rstd[:, None]
                _store_dx(
                    DX, DHN, DBR, SEED, dx, rows, off, mask, N, stride_dx, stride_dhn,
                    stride_dbr, threshold, drop_scale, HAS_DHN, WRITE_DBR, DROPOUT, INT64_IDX,
                    BLOCK_N,
                )  # fmt: skip
                dw = tl.load(dw_out + off + cols, mask=col_mask & not_first, other=0.0)
                tl.store(dw_out + off + cols, dw + tl.sum(dy * xhat, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------- launch config


@functools.cache
def _rmsnorm_fwd_config(n_cols: int, max_block: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, single) of the forward for rows of `n_cols`."""
    width = width_class(n_cols)
    block_m, block_n, num_warps = _nearest(_RMSNORM_FWD_CONFIGS, width)
    block_n = min(block_n, width, max_block)
    return block_m, block_n, num_warps, n_cols <= block_n


@functools.cache
def _rmsnorm_bwd_config(n_cols: int, max_block: int) -> BwdConfig:
    """The backward configuration for rows of `n_cols`: a "row" entry whose row does not fit
    its (capped) block loops over blocks instead."""
    width = width_class(n_cols)
    cfg = _nearest(_RMSNORM_BWD_CONFIGS, width)
    block_n = min(cfg.block_n, width, max_block)
    if cfg.kind == "row" and block_n < n_cols:
        return BwdConfig("loop", 1, block_n, cfg.num_warps, cfg.per_sm)
    return cfg._replace(block_n=block_n)


def _clear_config_caches() -> None:
    """Forget the cached configurations and bound launches (after the tables or MAX_BLOCK_N
    change)."""
    _rmsnorm_fwd_config.cache_clear()
    _rmsnorm_bwd_config.cache_clear()
    _PLANS.plans.clear()
    _EAGER_PLANS.plans.clear()


# ----------------------------------------------------------------------------- launchers


# An eager call's launches, bound once per shape (`utils.LaunchPlans`; keyed as layernorm's):
# the forward's, and the backward's two with the shape of its work buffer
_PLANS = LaunchPlans()


def launch_rmsnorm_fwd(
    x2, weight, y2, rstd, eps, *, h2=None, br2=None, p=0.0, seed=None
) -> Callable[..., None] | None:
    """Normalise the rows of x2 into y2 (both (M, N), unit column stride), rstd (M,) fp32.

    Residual mode (h2 and br2 given): x2 is an output, written with h2 + dropout_p(br2). An
    eager call takes the launch bound for its shape (`_PLANS`) when there is one.

    Returns that bound launch, a function of the tensors (x2, weight, y2, rstd, h2 or x2, br2
    or x2, seed or rstd) of another call of this layout (`_EagerPlan` keeps it), or None where
    nothing was bound (traced, no rows)."""
    M, N = x2.shape[0], int(x2.shape[1])  # N is specialised (block sizes); M may be symbolic
    if M == 0 or N == 0:
        return None
    residual = h2 is not None
    dropout = residual and p > 0.0
    tensors = (
        x2, weight, y2, rstd, h2 if residual else x2, br2 if residual else x2,
        seed if dropout else rstd,
    )  # fmt: skip
    strides = (
        x2.stride(0), y2.stride(0), h2.stride(0) if residual else 0,
        br2.stride(0) if residual else 0,
    )  # fmt: skip
    key = None
    if type(M) is int and not is_traced(x2):
        key = ("fwd", M, N, MAX_BLOCK_N, *strides, eps, p, residual, *tensor_facts(*tensors))
        bound = _PLANS.get(key)
        if bound is not None:
            bound(*tensors)
            return bound
    block_m, block_n, num_warps, single = _rmsnorm_fwd_config(N, MAX_BLOCK_N)
    bound = launcher(_rmsnorm_fwd_kernel).bind(
        (cdiv(M, block_m),), *tensors, M, N, 1.0 / N, *strides,
        eps, dropout_threshold(p), 1.0 / (1.0 - p) if dropout else 1.0,
        SINGLE=single, RESIDUAL=residual, DROPOUT=dropout, INT64_IDX=bool(M * N >= 2**31),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return None if key is None else _PLANS.put(key, bound)


def launch_rmsnorm_bwd(
    dy2, x2, weight, rstd, dx2, dweight, *, dhn2=None, dbr2=None, p=0.0, seed=None,
    cfg: BwdConfig | None = None, acc_w: bool = False,
) -> Callable[..., None] | None:  # fmt: skip
    """dx2 (+ dhn2, the downstream gradient of a residual sum), dweight and, when dbr2 is
    given, the branch gradient dropout-masked (p, seed) into dbr2. `cfg` overrides the table.
    acc_w: add dweight to what that tensor holds (`bmm.grad_targets`). An eager call takes
    the launches bound for its shape (`_PLANS`) when there are.

    Returns them, a function of the tensors (x2, weight, dy2, dx2, rstd, dhn2 or dy2, dbr2 or
    dx2, seed or rstd, dweight) of another call of this layout, or None where nothing was
    bound."""
    M, N = x2.shape[0], int(x2.shape[1])
    if N == 0:
        return None
    if M == 0:
        if not acc_w:
            dweight.zero_()
        return None
    dropout = dbr2 is not None and p > 0.0
    # stand-ins for absent tensors (never read)
    tensors = (x2, weight, dy2, dx2, rstd, default(dhn2, dy2), default(dbr2, dx2),
               seed if dropout else rstd, dweight)  # fmt: skip
    strides = tuple(t.stride(0) for t in (x2, dy2, dx2, tensors[5], tensors[6]))
    key = None
    if cfg is None and type(M) is int and not is_traced(x2):
        key = ("bwd", M, N, MAX_BLOCK_N, *strides, p, exists(dhn2), exists(dbr2), acc_w,
               *tensor_facts(*tensors))  # fmt: skip
        plan = _PLANS.get(key)
        if plan is not None:
            plan(*tensors)
            return plan
    cfg = cfg or _rmsnorm_bwd_config(N, MAX_BLOCK_N)
    if cfg.kind not in ("row", "loop"):
        raise ValueError(f"rmsnorm has 'row' and 'loop' backwards, got {cfg.kind!r}")
    if cfg.kind == "row" and cfg.block_n < N:  # the kernel would skip the rest of the row
        raise ValueError(f"a 'row' backward needs BLOCK_N >= N, got {cfg.block_n} < {N}")
    _, groups, rows_per_prog = _bwd_plan(M, N, cfg, x2.device)
    partial = torch.empty(size=(groups, N), dtype=torch.float32, device=x2.device)
    x2, weight, dy2, dx2, rstd, dhn2_, dbr2_, seed_, dweight = tensors
    main = launcher(_rmsnorm_bwd_kernel).bind(
        (groups,), x2, weight, dy2, dx2, partial, rstd, dhn2_, dbr2_, seed_,
        M, N, 1.0 / N, rows_per_prog, *strides, dropout_threshold(p),
        1.0 / (1.0 - p) if dropout else 1.0,
        SINGLE=cfg.kind == "row", HAS_DHN=dhn2 is not None, WRITE_DBR=dbr2 is not None,
        DROPOUT=dropout, INT64_IDX=bool(M * N >= 2**31), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps,
    )  # fmt: skip
    colsum = launcher(_layernorm_bwd_colsum_kernel).bind(
        (cdiv(N, _COLSUM_BLOCK_C),), partial, dweight, dweight, groups, N,
        HAS_BIAS=False, ACC_W=acc_w, ACC_B=False, BLOCK_G=_COLSUM_BLOCK_G, BLOCK_C=_COLSUM_BLOCK_C,
        num_warps=_COLSUM_WARPS,
    )  # fmt: skip

    def launch(x2, weight, dy2, dx2, rstd, dhn2, dbr2, seed, dweight) -> None:
        partial = torch.empty(size=(groups, N), dtype=torch.float32, device=x2.device)
        main(x2, weight, dy2, dx2, partial, rstd, dhn2, dbr2, seed)
        colsum(partial, dweight, dweight)

    return None if key is None else _PLANS.put(key, launch)


# ----------------------------------------------------------------------------- torch.library ops


@triton_op("triton_transformer::rmsnorm", mutates_args=())
def rmsnorm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
    weight_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y a new contiguous tensor shaped like x, in out_dtype (None: x's); rstd
    (rows,) fp32 for the backward. weight_acc: as in `layernorm.layernorm_op`."""
    N = x.shape[-1]
    x2 = as_rows(x)
    M = x2.shape[0]
    y = torch.empty(size=x.shape, dtype=out_dtype or x.dtype, device=x.device)
    rstd = torch.empty(size=(M,), dtype=torch.float32, device=x.device)
    launch_rmsnorm_fwd(x2, weight.contiguous(), y.view(M, N), rstd, eps)
    return y, rstd


@triton_op("triton_transformer::rmsnorm_backward", mutates_args=("weight_acc",))
def rmsnorm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    weight_acc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight), in the dtypes of x and weight; weight_acc as in
    `layernorm.layernorm_backward_op`."""
    N = x.shape[-1]
    x2, dy2 = as_rows(x), as_rows(dy)
    M = x2.shape[0]
    dx = torch.empty(size=x.shape, dtype=x.dtype, device=x.device)
    dweight, _ = param_grads(weight, None, weight_acc, None)
    launch_rmsnorm_bwd(
        dy2, x2, weight.contiguous(), rstd, dx.view(M, N), default(weight_acc, dweight),
        acc_w=exists(weight_acc),
    )  # fmt: skip
    return dx, dweight


def _rmsnorm_setup_context(ctx, inputs, output) -> None:
    x, weight, _, _, weight_acc = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)  # rstd never gets a gradient
    ctx.grad_homes = (_grad_home(weight),)
    ctx.save_for_backward(x, weight, rstd, weight_acc)


@first_order_only("rmsnorm")
def _rmsnorm_backward(ctx, dy, _drstd):
    if dy is None:  # grads are not materialised: y was not used
        return (None,) * 5
    x, weight, rstd, *traced = ctx.saved_tensors
    targets = grad_targets(ctx.grad_homes, traced, dy)
    dx, dweight = call_op(rmsnorm_backward_op, dy, x, weight, rstd, *targets)
    (dweight,) = folded_grads((dweight,), targets, traced)
    return dx, dweight, None, None, None


rmsnorm_op.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup_context)
accumulates_grads(rmsnorm_backward_op)


@triton_op("triton_transformer::residual_rmsnorm", mutates_args=())
def residual_rmsnorm_op(
    h: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    p: float,
    seed: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    weight_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h_new, y, rstd): h_new = h + dropout_p(branch) (mask from `seed`, a 0-dim int64 device
    tensor; unused when p == 0) in the promoted dtype of (h, branch), y = rmsnorm(h_new) in
    out_dtype (None: h_new's); both new contiguous tensors shaped like h. rstd (rows,) fp32.
    weight_acc: as in `layernorm.layernorm_op`."""
    N = h.shape[-1]
    h2, br2 = as_rows(h), as_rows(branch)
    M = h2.shape[0]
    dtype = torch.promote_types(h.dtype, branch.dtype)
    h_new = torch.empty(size=h.shape, dtype=dtype, device=h.device)
    y = torch.empty(size=h.shape, dtype=out_dtype or dtype, device=h.device)
    rstd = torch.empty(size=(M,), dtype=torch.float32, device=h.device)
    launch_rmsnorm_fwd(h_new.view(M, N), weight.contiguous(), y.view(M, N), rstd, eps,
               h2=h2, br2=br2, p=p, seed=seed)  # fmt: skip
    return h_new, y, rstd


@triton_op("triton_transformer::residual_rmsnorm_backward", mutates_args=("weight_acc",))
def residual_rmsnorm_backward_op(
    dy: torch.Tensor,
    dh_new: torch.Tensor | None,
    h_new: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    p: float,
    seed: torch.Tensor,
    h_dtype: torch.dtype,
    branch_dtype: torch.dtype,
    weight_acc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, dbranch, dweight): dh = rmsnorm's dx + dh_new (None: zero); dbranch the
    dropout-masked dh, or an empty (0,) tensor when it would equal dh (p == 0 and the same
    dtype: the caller reuses dh). weight_acc as in `layernorm.layernorm_backward_op`."""
    N = h_new.shape[-1]
    x2, dy2 = as_rows(h_new), as_rows(dy)
    M = x2.shape[0]
    dh = torch.empty(size=h_new.shape, dtype=h_dtype, device=h_new.device)
    separate = p > 0.0 or branch_dtype != h_dtype
    dbranch = torch.empty(size=h_new.shape if separate else (0,), dtype=branch_dtype,
                          device=h_new.device)  # fmt: skip
    dweight, _ = param_grads(weight, None, weight_acc, None)
    launch_rmsnorm_bwd(
        dy2, x2, weight.contiguous(), rstd, dh.view(M, N), default(weight_acc, dweight),
        dhn2=as_rows(dh_new) if dh_new is not None else None,
        dbr2=dbranch.view(M, N) if separate else None, p=p, seed=seed, acc_w=exists(weight_acc),
    )  # fmt: skip
    return dh, dbranch, dweight


def _residual_rmsnorm_setup_context(ctx, inputs, output) -> None:
    h, branch, weight, _, ctx.p, seed, _, weight_acc = inputs
    h_new, _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)  # h_new has no gradient after the last block
    ctx.h_dtype, ctx.branch_dtype = h.dtype, branch.dtype
    ctx.grad_homes = (_grad_home(weight),)
    ctx.save_for_backward(h_new, weight, rstd, seed, weight_acc)


@first_order_only("residual_rmsnorm")
def _residual_rmsnorm_backward(ctx, dh_new, dy, _drstd):
    if dy is None and dh_new is None:
        return (None,) * 8
    h_new, weight, rstd, seed, *traced = ctx.saved_tensors
    if dy is None:  # y unused: only the residual sum passes a gradient (rare; kept simple)
        dy = torch.zeros_like(h_new)
    targets = grad_targets(ctx.grad_homes, traced, dy)
    dh, dbranch, dweight = call_op(
        residual_rmsnorm_backward_op, dy, dh_new, h_new, weight, rstd, ctx.p, seed, ctx.h_dtype,
        ctx.branch_dtype, *targets,
    )  # fmt: skip
    if ctx.p == 0.0 and ctx.branch_dtype == ctx.h_dtype:
        dbranch = dh  # d(h + branch)/d(branch) = 1: the same gradient, written once
    (dweight,) = folded_grads((dweight,), targets, traced)
    return dh, dbranch, dweight, None, None, None, None, None


residual_rmsnorm_op.register_autograd(
    _residual_rmsnorm_backward, setup_context=_residual_rmsnorm_setup_context
)
accumulates_grads(residual_rmsnorm_backward_op)


# ----------------------------------------------------------------------------- eager calls
# As layernorm's (`layernorm._EagerPlan`): an eager call (nothing traces) of a layout seen
# before takes that layout's plan, found by one key of what the checks and the kernels read
# (`utils.eager_plan_key`) and one lookup, then the launches bound on its first call. Per
# call it skips the checks, `call_op`, the registered op's autograd wrapper, `as_rows` views
# and a key per launch. One plan class serves rmsnorm and residual_rmsnorm (`residual`: h and
# branch in, their sum h_new out as well); kernels, saved tensors and gradients are the
# registered ops'.


class _EagerPlan:
    """The launches of eager rmsnorm / residual_rmsnorm calls of one layout: x (or h and
    branch) viewable as (M, N) rows of unit column stride, a contiguous weight (what
    `_eager_plan` admits). Forward per alignment of the seed (dropout); backward per dtype and
    alignment of the upstream gradients (dense ones) and of the seed, and per gradient
    target."""

    __slots__ = ("branch_dtype", "bwd", "device", "eps", "fwd", "h_dtype", "n_cols", "n_rows",
                 "out_dtype", "p", "residual", "shape", "sum_dtype")  # fmt: skip

    def __init__(self, x, branch, eps: float, p: float, out_dtype) -> None:
        self.shape, self.device = x.shape, x.device
        self.residual = branch is not None
        self.h_dtype = x.dtype
        self.branch_dtype = branch.dtype if self.residual else x.dtype
        self.sum_dtype = torch.promote_types(self.h_dtype, self.branch_dtype)
        self.out_dtype = out_dtype or self.sum_dtype
        self.n_cols = x.shape[-1]
        self.n_rows = x.numel() // self.n_cols
        self.eps, self.p = eps, p
        self.fwd: dict = {}
        self.bwd: dict = {}

    def forward(self, x, branch, weight, seed) -> tuple:
        """(x_or_h_new, y, rstd): `rmsnorm_op`'s (y, rstd) after x itself, or
        `residual_rmsnorm_op`'s (h_new, y, rstd) for h = x; seed None when p == 0."""
        h_new = x
        if self.residual:
            h_new = torch.empty(size=self.shape, dtype=self.sum_dtype, device=self.device)
        y = torch.empty(size=self.shape, dtype=self.out_dtype, device=self.device)
        rstd = torch.empty(size=(self.n_rows,), dtype=torch.float32, device=self.device)
        key = None if seed is None else tensor_facts(seed)
        fwd = self.fwd.get(key)
        if fwd is not None:
            fwd(h_new, weight, y, rstd, x, x if branch is None else branch,
                rstd if seed is None else seed)  # fmt: skip
            return h_new, y, rstd
        rows = (self.n_rows, self.n_cols)
        self.fwd[key] = launch_rmsnorm_fwd(
            h_new.view(rows), weight, y.view(rows), rstd, self.eps,
            h2=x.view(rows) if self.residual else None,
            br2=branch.view(rows) if self.residual else None, p=self.p, seed=seed,
        )  # fmt: skip
        return h_new, y, rstd

    def backward(self, dy, dh_new, x, weight, rstd, seed, acc_w) -> tuple:
        """(dx, dbranch, dweight): `rmsnorm_backward_op`'s (dx, dweight), or
        `residual_rmsnorm_backward_op`'s (dh, dbranch, dweight), for upstream gradients of any
        layout (dh_new None: zero); but dbranch None where there is none or it equals dh, and
        dweight None where it went into acc_w. x: the normalised rows (h_new in residual
        mode)."""
        dx = torch.empty(size=self.shape, dtype=self.h_dtype, device=self.device)
        dbranch = None  # None also where it equals dx (the caller then reuses dx)
        if self.residual and (self.p > 0.0 or self.branch_dtype != self.h_dtype):
            dbranch = torch.empty(size=self.shape, dtype=self.branch_dtype, device=self.device)
        dweight = torch.empty_like(weight) if acc_w is None else None  # None: into acc_w
        dweight_into = dweight if acc_w is None else acc_w
        dy2, dhn2, dense = upstream_rows(dy, dh_new)
        key = bound_bwd_key(dy2, dhn2, seed, acc_w) if dense else None
        bwd = self.bwd.get(key) if dense else None
        if bwd is not None:
            bwd(x, weight, dy2, dx, rstd, dy2 if dhn2 is None else dhn2,
                dx if dbranch is None else dbranch, rstd if seed is None else seed,
                dweight_into)  # fmt: skip
            return dx, dbranch, dweight
        rows = (self.n_rows, self.n_cols)
        bwd = launch_rmsnorm_bwd(
            dy2.view(rows), x.view(rows), weight, rstd, dx.view(rows), dweight_into,
            dhn2=None if dhn2 is None else dhn2.view(rows),
            dbr2=None if dbranch is None else dbranch.view(rows), p=self.p, seed=seed,
            acc_w=acc_w is not None,
        )  # fmt: skip
        if dense:
            self.bwd[key] = bwd
        return dx, dbranch, dweight


_EAGER_PLANS = LaunchPlans()


def _eager_plan(x, branch, weight, eps, dropout_p, training, out_dtype) -> _EagerPlan | None:
    """The plan of this eager call's layout (branch None: rmsnorm's, else residual_rmsnorm's
    with h = x), made on its first call after the checks; None where the generic path runs:
    traced, not tensors (the checks raise), or a layout the plan does not cover."""
    scalars = (eps, dropout_p, training, out_dtype)
    key, plan = _EAGER_PLANS.find((x, branch, weight), scalars)
    if key is None or plan is not None:
        return plan
    check_rmsnorm_args(x, weight, eps, True)
    check_out_dtype(out_dtype)
    p = 0.0 if branch is None else check_residual_branch(x, branch, dropout_p, training, True)
    if x.numel() == 0 or not (weight.is_contiguous() and has_rows_view(x)):
        return None
    if branch is not None and not has_rows_view(branch):
        return None
    return _EAGER_PLANS.put(key, _EagerPlan(x, branch, float(eps), p, out_dtype))


class _EagerRMSNorm(torch.autograd.Function):
    """`rmsnorm_op` and its registered backward for an eager call of a planned layout."""

    @staticmethod
    def forward(ctx, x, weight, plan):
        _, y, rstd = plan.forward(x, None, weight, None)
        ctx.save_for_backward(x, weight, rstd)
        ctx.plan = plan
        ctx.grad_home = _grad_home(weight)
        return y

    @staticmethod
    @first_order_only("rmsnorm")
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        target = None
        if ctx.grad_home is not None:
            (target,) = grad_targets((ctx.grad_home,), (None,), dy)
        dx, _, dweight = ctx.plan.backward(dy, None, x, weight, rstd, None, target)
        if target is not None:
            (dweight,) = folded_grads((dweight,), (target,), (None,))
        return dx, dweight, None


_apply_eager_rmsnorm = eager_apply(_EagerRMSNorm)


class _EagerResidualRMSNorm(torch.autograd.Function):
    """`residual_rmsnorm_op` and its registered backward for an eager call of a planned
    layout: returns (h_new, y)."""

    @staticmethod
    def forward(ctx, h, branch, weight, seed, plan):
        h_new, y, rstd = plan.forward(h, branch, weight, seed)
        ctx.set_materialize_grads(False)  # as the op's: an unused output gets no zeros
        ctx.save_for_backward(h_new, weight, rstd, seed)
        ctx.plan = plan
        ctx.grad_home = _grad_home(weight)
        return h_new, y

    @staticmethod
    @first_order_only("residual_rmsnorm")
    def backward(ctx, dh_new, dy):
        if dy is None and dh_new is None:
            return (None,) * 5
        h_new, weight, rstd, seed = ctx.saved_tensors
        if dy is None:  # y unused: only the residual sum passes a gradient (rare)
            dy = torch.zeros_like(h_new)
        plan, target = ctx.plan, None
        if ctx.grad_home is not None:
            (target,) = grad_targets((ctx.grad_home,), (None,), dy)
        dh, dbranch, dweight = plan.backward(dy, dh_new, h_new, weight, rstd, seed, target)
        if dbranch is None:
            dbranch = dh  # d(h + branch)/d(branch) = 1: the same gradient, written once
        if target is not None:
            (dweight,) = folded_grads((dweight,), (target,), (None,))
        return dh, dbranch, dweight, None, None


_apply_eager_residual_rmsnorm = eager_apply(_EagerResidualRMSNorm)


# ----------------------------------------------------------------------------- public API


def _rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The reference: fp32 arithmetic for fp16/bf16 x (fp64 stays fp64), one rounding."""
    dtype = x.dtype
    compute = torch.promote_types(torch.promote_types(dtype, weight.dtype), torch.float32)
    xf = x.to(compute)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(compute)).to(out_dtype or dtype)


def check_rmsnorm_args(x: object, weight: object, eps: object, use_triton: bool) -> None:
    """Validate rmsnorm's arguments (shared with residual_rmsnorm)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dim to normalise over, got a scalar")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match the last dim of x "
            f"{tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if use_triton:
        check_triton_tensor(x, "x")
        check_triton_tensor(weight, "weight")
        if weight.device != x.device:
            raise ValueError(f"weight is on {weight.device} but x is on {x.device}")


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    use_triton: bool = False,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Root-mean-square normalisation over the last dim of `x`: x / sqrt(mean(x²) + eps) * w.

    Args:
        x: (..., N) float tensor, any rank >= 1, any strides.
        weight: (N,) scale; may have another float dtype than x (computed in fp32).
        eps: added to the mean square.
        use_triton: run the Triton kernels instead of the PyTorch reference.
        out_dtype: the output's float dtype (None: x's); the kernel rounds once into it.

    Returns:
        (..., N) tensor in out_dtype: a new tensor, never a view.
    """
    if use_triton:
        plan = _eager_plan(x, None, weight, eps, 0.0, False, out_dtype)
        if plan is not None:
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                return _apply_eager_rmsnorm(x, weight, plan)
            return plan.forward(x, None, weight, None)[1]
    check_rmsnorm_args(x, weight, eps, use_triton)
    check_out_dtype(out_dtype)
    if not use_triton:
        return _rmsnorm_reference(x, weight, eps, out_dtype)
    return call_op(rmsnorm_op, x, weight, float(eps), out_dtype, _traced_grad_acc(weight))[0]


def residual_rmsnorm(
    h: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    training: bool = True,
    eps: float = 1e-5,
    use_triton: bool = False,
    out_dtype: torch.dtype | None = None,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_new, y): h_new = h + dropout(branch), y = rmsnorm(h_new, weight) over the last dim.

    Args:
        h: (..., N) residual stream, any strides.
        branch: the block's output, same shape as h (dtype may differ: h_new is promoted).
        weight: (N,) RMSNorm scale.
        dropout_p: dropout probability on `branch`, in [0, 1); applied only when `training`.
            Triton: a Philox mask keyed by a device seed (not the mask F.dropout draws).
        eps: added to the mean square.
        use_triton: one fused Triton kernel each way instead of the PyTorch reference.
        out_dtype: y's float dtype (None: h_new's).
        seed: Triton only: the 0-dim int64 device tensor the dropout mask is drawn from (the
            package's one scheme, `dropout.dropout`'s); None draws one. F.dropout ignores it.

    Returns:
        (h_new, y), new tensors shaped like h; h_new in the promoted dtype of (h, branch).
    """
    if use_triton:
        plan = _eager_plan(h, branch, weight, eps, dropout_p, training, out_dtype)
        if plan is not None:
            seed = seed_or_draw(seed, h.device) if plan.p > 0.0 else None
            if torch.is_grad_enabled() and (
                h.requires_grad or branch.requires_grad or weight.requires_grad
            ):
                return _apply_eager_residual_rmsnorm(h, branch, weight, seed, plan)
            return plan.forward(h, branch, weight, seed)[:2]
    check_rmsnorm_args(h, weight, eps, use_triton)
    check_out_dtype(out_dtype)
    p = check_residual_branch(h, branch, dropout_p, training, use_triton)
    if not use_triton:
        h_new = h + (F.dropout(branch, p) if p > 0.0 else branch)
        return h_new, _rmsnorm_reference(h_new, weight, eps, out_dtype)
    # The seed is drawn only with dropout; otherwise weight stands in (never read).
    seed = seed_or_draw(seed, h.device) if p > 0.0 else weight
    h_new, y, _ = call_op(
        residual_rmsnorm_op, h, branch, weight, float(eps), p, seed, out_dtype,
        _traced_grad_acc(weight),
    )  # fmt: skip
    return h_new, y


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned scale `weight` (ones at init), named like
    torch.nn.RMSNorm's so state dicts interchange."""

    def __init__(self, dim: int, eps: float = 1e-5, use_triton: bool = False) -> None:
        super().__init__()
        self.dim, self.eps, self.use_triton = dim, eps, use_triton
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self,
        x: torch.Tensor,
        use_triton: bool | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x: (..., dim) -> (..., dim) in out_dtype (None: x's); `use_triton=None` uses the
        module's flag."""
        use_triton = self.use_triton if use_triton is None else use_triton
        return rmsnorm(x, self.weight, self.eps, use_triton, out_dtype=out_dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
