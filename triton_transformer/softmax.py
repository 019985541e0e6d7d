"""Softmax over the last dimension, optionally causal, with Triton forward and backward kernels.

Semantics (the PyTorch branch defines them, the Triton branch matches):

- `causal=True` treats x as attention scores (..., n_q, n_k): query i sees keys
  j <= i + (n_k - n_q), bottom-right aligned as in flash-attention, so a KV-cache step
  (n_q < n_k) works. Masked entries of the output are exactly 0.
- A row that sees no key (causal with n_q > n_k: the first n_q - n_k rows), or whose
  entries are all -inf, outputs zeros and gets a zero gradient, in both branches.
- -inf entries get probability 0; NaN or +inf entries make their row NaN (as torch.softmax).

The kernels mask causally from the row's query index (row % n_q): no mask tensor exists.
Rows that fit one block are done in a single pass, several rows per program; longer rows use
an online max/sum over blocks (`_jit_helpers.online_lse_update`, shared with cross-entropy).
The backward reads only the saved output: dx = y * (dy - sum(dy * y)).

Both directions are `torch.library.triton_op`s (`triton_transformer::softmax` and
`triton_transformer::softmax_backward`), so torch.compile traces them and CUDA graphs capture
them; the backward is first-order only (`utils.first_order_only`: create_graph=True raises).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from triton_transformer._jit_helpers import online_lse_update, safe_shift, tile_exp
from triton_transformer.utils import (
    LaunchPlans,
    as_rows,
    call_op,
    cdiv,
    check_triton_tensor,
    first_order_only,
    is_traced,
    launcher,
    row_launch_params,
    tensor_facts,
)

# Longest row held in registers in one pass; longer rows loop over blocks of this size.
# Module-level so tests can shrink it to exercise the looped path on small inputs.
MAX_BLOCK_N = 16384
# Short rows are packed several per program so a tile holds about this many elements:
# fewer, fatter programs (fewer launches of tiny programs on GPU, far faster in the interpreter).
ROW_TILE = 2048
# Warps per program; None: `calc_num_warps` of the tile size (benchmarks sweep this).
NUM_WARPS: int | None = None


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _row_setup(n_rows, n_cols, n_q, diag, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's rows as a (BLOCK_M, 1) int64 column, and how many leading keys each row
    sees, (BLOCK_M, 1): 0 for rows past the end and for causal rows that see nothing."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    # causal: query q = row % n_q sees keys j < q + diag, diag = n_k - n_q + 1 (may be <= 0).
    n_valid = tl.minimum(rows % n_q + diag, n_cols) if CAUSAL else tl.zeros_like(rows) + n_cols
    n_valid = tl.where(rows < n_rows, n_valid, 0)
    # int64: row * stride can exceed int32 on large tensors.
    return rows.to(tl.int64)[:, None], n_valid[:, None]


@triton.jit
def _softmax_fwd_kernel(
    X, Y, stride_x, stride_y, n_rows, n_cols, n_q, diag,
    CAUSAL: tl.constexpr, SINGLE_PASS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows, n_valid = _row_setup(n_rows, n_cols, n_q, diag, CAUSAL, BLOCK_M)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_N)[None, :]
    x_row = X + rows * stride_x
    y_row = Y + rows * stride_y

    if SINGLE_PASS:
        # Masked keys and padding load as -inf, so exp() makes them exactly 0.
        x = tl.load(x_row + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
        _, e, s = tile_exp(x)
        # s >= 1 when the row has a finite max (the max adds exp(0) = 1), so s == 0 only for an
        # all -inf row, whose 0 / 0 becomes 0. (tl.maximum(s, 1.0) would also swallow NaN.)
        y = e / tl.where(s == 0.0, 1.0, s)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=row_ok & (cols < n_cols))
    else:
        # Pass 1: online max/sum; blocks past the last visible key are skipped.
        m = tl.full([BLOCK_M, 1], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_M, 1], tl.float32)
        for start in range(0, tl.max(n_valid), BLOCK_N):
            c = start + cols
            x = tl.load(x_row + c, mask=c < n_valid, other=float("-inf")).to(tl.float32)
            m, s = online_lse_update(m, s, x)
        shift = safe_shift(m)
        inv_s = 1.0 / tl.where(s == 0.0, 1.0, s)
        # Pass 2: write every column, the zeros of masked keys included.
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            x = tl.load(x_row + c, mask=c < n_valid, other=float("-inf")).to(tl.float32)
            y = tl.exp(x - shift) * inv_s
            tl.store(y_row + c, y.to(Y.dtype.element_ty), mask=row_ok & (c < n_cols))


@triton.jit
def _softmax_bwd_kernel(
    Y, DY, DX, stride_y, stride_dy, stride_dx, n_rows, n_cols, n_q, diag,
    CAUSAL: tl.constexpr, SINGLE_PASS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # dx = y * (dy - sum(dy * y)); y is 0 at masked keys, so dx is 0 there and they are not read.
    rows, n_valid = _row_setup(n_rows, n_cols, n_q, diag, CAUSAL, BLOCK_M)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_N)[None, :]
    y_row = Y + rows * stride_y
    dy_row = DY + rows * stride_dy
    dx_row = DX + rows * stride_dx

    if SINGLE_PASS:
        y = tl.load(y_row + cols, mask=cols < n_valid, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=cols < n_valid, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(y * dy, axis=1, keep_dims=True))
        tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=row_ok & (cols < n_cols))
    else:
        dot = tl.zeros([BLOCK_M, 1], tl.float32)
        for start in range(0, tl.max(n_valid), BLOCK_N):
            c = start + cols
            y = tl.load(y_row + c, mask=c < n_valid, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + c, mask=c < n_valid, other=0.0).to(tl.float32)
            dot += tl.sum(y * dy, axis=1, keep_dims=True)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            y = tl.load(y_row + c, mask=c < n_valid, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + c, mask=c < n_valid, other=0.0).to(tl.float32)
            dx = y * (dy - dot)
            tl.store(dx_row + c, dx.to(DX.dtype.element_ty), mask=row_ok & (c < n_cols))


# --------------------------------------------------------------------------------------------
# Launch parameters and the torch.library ops
# --------------------------------------------------------------------------------------------


def _softmax_config(shape: torch.Size, causal: bool) -> tuple:
    """(n_q, diag, BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps) for x of this shape. Causal query
    q sees keys j < q + diag, diag = n_k - n_q + 1. n_q and diag stay symbolic under
    torch.compile's dynamic shapes; the row length picks the constexpr block sizes, so it is
    made concrete (int(): one compiled kernel per row length)."""
    n_cols = shape[-1]
    n_q = shape[-2] if causal else 1
    diag = n_cols - n_q + 1 if causal else 0
    return n_q, diag, *row_launch_params(int(n_cols), MAX_BLOCK_N, ROW_TILE, NUM_WARPS)


# An eager call's launch, bound once per shape (`utils.LaunchPlans`): the forward's and the
# backward's
_PLANS = LaunchPlans()


def launch_softmax(
    kernel, tensors: tuple, shape: torch.Size, causal: bool, n_rows: int, *sizes: int
) -> None:  # fmt: skip
    """Launch `kernel` (the forward or the backward) over the rows of `tensors`, for scores of
    `shape`, with `sizes` (its row strides and sizes, before n_q and diag); an eager call takes
    the launch bound for its key (`_PLANS`), or binds it."""
    key = None
    if not is_traced(tensors[0]):
        key = (kernel, shape, causal, *sizes, MAX_BLOCK_N, ROW_TILE, NUM_WARPS,
               *tensor_facts(*tensors))  # fmt: skip
        bound = _PLANS.get(key)
        if bound is not None:
            bound(*tensors)
            return
    n_q, diag, block_m, block_n, single_pass, num_warps = _softmax_config(shape, causal)
    bound = launcher(kernel).bind(
        (cdiv(n_rows, block_m),), *tensors, *sizes, n_q, diag,
        CAUSAL=causal, SINGLE_PASS=single_pass, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )  # fmt: skip
    if key is not None:
        _PLANS.put(key, bound)


@triton_op("triton_transformer::softmax", mutates_args=())
def softmax_op(x: torch.Tensor, causal: bool) -> torch.Tensor:
    """Softmax over the last dim of x (..., N) (causal: scores (..., n_q, n_k)); a new
    contiguous tensor of x's shape and dtype. Backward: `softmax_backward_op`. An eager call
    takes the launch bound for its shape (`_PLANS`) when there is one."""
    y = torch.empty(size=x.shape, dtype=x.dtype, device=x.device)
    if x.numel() > 0:
        x_rows = as_rows(x)  # a view unless the last dim is not unit-stride
        n_rows, n_cols = x_rows.shape
        launch_softmax(
            _softmax_fwd_kernel, (x_rows, y), x.shape, causal, n_rows,
            x_rows.stride(0), n_cols, n_rows, n_cols,
        )  # fmt: skip
    return y


@triton_op("triton_transformer::softmax_backward", mutates_args=())
def softmax_backward_op(dy: torch.Tensor, y: torch.Tensor, causal: bool) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)) for y = softmax_op(x, causal) (contiguous); dy may have any
    strides with a unit-stride last dim (a broadcast dy is read in place). An eager call takes
    the launch bound for its shape (`_PLANS`) when there is one."""
    dx = torch.empty(size=y.shape, dtype=y.dtype, device=y.device)
    if y.numel() > 0:
        dy_rows = as_rows(dy)
        n_rows, n_cols = dy_rows.shape
        launch_softmax(
            _softmax_bwd_kernel, (y, dy_rows, dx), y.shape, causal, n_rows,
            n_cols, dy_rows.stride(0), n_cols, n_rows, n_cols,
        )  # fmt: skip
    return dx


def _softmax_setup_context(ctx, inputs, output) -> None:
    ctx.causal = inputs[1]
    ctx.save_for_backward(output)


@first_order_only("softmax")
def _softmax_backward(ctx, dy: torch.Tensor):
    (y,) = ctx.saved_tensors
    return call_op(softmax_backward_op, dy, y, ctx.causal), None


softmax_op.register_autograd(_softmax_backward, setup_context=_softmax_setup_context)


# --------------------------------------------------------------------------------------------
# PyTorch reference and public function
# --------------------------------------------------------------------------------------------


def _softmax_reference(x: torch.Tensor, causal: bool) -> torch.Tensor:
    if x.numel() == 0:
        return x.clone()  # empty, yet still part of the autograd graph
    if causal:
        n_q, n_k = x.shape[-2:]
        masked = torch.ones(n_q, n_k, dtype=torch.bool, device=x.device).triu(n_k - n_q + 1)
        x = x.masked_fill(masked, float("-inf"))
    # fp32 math for fp16/bf16, as the kernels do.
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    # Shifting by the max is exact for softmax, so it needs no gradient. An all -inf row (or
    # a causal row that sees no key) shifts by 0 so it gives exp() = 0s rather than NaN.
    m = xf.detach().amax(dim=-1, keepdim=True)
    m = m.nan_to_num(nan=0.0, posinf=float("inf"), neginf=0.0)
    e = torch.exp(xf - m)
    # The sum is >= 1 unless the row is all -inf (its max adds exp(0) = 1), so clamping at 1
    # only turns that row's 0 / 0 into zeros.
    y = e / e.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return y.to(x.dtype)


def softmax(x: torch.Tensor, causal: bool = False, use_triton: bool = False) -> torch.Tensor:
    """Softmax of `x` over its last dimension.

    Args:
        x: (..., N) tensor, at least 1-D. With `causal=True`, attention scores (..., n_q, n_k).
        causal: mask keys j > i + (n_k - n_q) for query i (bottom-right aligned). Masked
            entries are 0; rows that see no key (n_q > n_k) are all 0.
        use_triton: run the Triton kernels (float32/float16/bfloat16 CUDA tensors, or any
            device under TRITON_INTERPRET=1) instead of the PyTorch reference.

    Returns:
        (..., N) tensor of x's dtype; each row sums to 1 (0 for a row with nothing visible).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (softmax runs over the last one)")
    if causal and x.dim() < 2:
        raise ValueError(
            f"causal softmax needs scores of shape (..., n_q, n_k); x has shape {tuple(x.shape)}"
        )
    if not use_triton:
        return _softmax_reference(x, causal)
    check_triton_tensor(x, "x")
    return call_op(softmax_op, x, bool(causal))
