"""SwiGLU's gating, silu(gate) * up, as one fused elementwise kernel each way (Liger-style).

`swiglu(gate, up, use_triton)`; `use_triton=False` runs the PyTorch reference that defines the
semantics (fp32 arithmetic for fp16/bf16, one rounding to the inputs' dtype):

    y = silu(gate) * up = gate * sigmoid(gate) * up

and the backward, with s = sigmoid(gate),

    d(gate) = dy * up * s * (1 + gate * (1 - s))
    d(up)   = dy * gate * s

In a Llama-style feed-forward, `x @ W_in.T` yields (..., 2·hidden) and gate / up are its two
halves (strided views, read in place here); `swiglu(gate, up)` then feeds the down projection.

The Triton path is two `torch.library.triton_op`s, `triton_transformer::swiglu` and
`swiglu_backward` (`swiglu_op` / `swiglu_backward_op`), wired with `register_autograd`
(torch.compile traces them, CUDA graphs capture them), first-order only (`utils.first_order_only`).
The forward reads gate and up once and writes y (3·e bytes per element, the floor); the backward
recomputes sigmoid from the saved gate and up (nothing else is saved) and reads dy, gate, up once,
writing d(gate) and d(up) (5·e per element). Both see their inputs as (rows, N) with a unit-stride
last dim (`as_rows`: a view when one exists, else a copy) and tile them (BLOCK_M, BLOCK_N) on a
1-D grid whose consecutive programs take consecutive column blocks of a row block, so the grid
sweeps memory in address order; where every tensor's rows are contiguous (stride N) the kernels
see one (1, rows·N) row and sweep it in flat tiles of TILE elements. Offsets are 64-bit.

Fused into the matmul: `bmm.linear(x, w_in, activation="swiglu")` computes the same gating in
the epilogue of the projection that produces gate and up (`matmul_kernels.py`'s SWIGLU
variant, two accumulators per tile), so the gating pass does not re-read the (.., 2·hidden)
projection; the epilogue calls `silu_mul`, this module's forward arithmetic. That projection
is still written once, for the backward, which runs this module's backward kernel on it
(`launch_swiglu_bwd` into the halves of one (.., 2·hidden) gradient). Where the planner sends
the product to cuBLAS instead ("cublas+ew", its default: the fused kernel measured no faster on
an H200), the gating is `launch_swiglu_fwd` on its halves. The model's `FeedForward` uses
`linear(..., activation="swiglu")`; `swiglu` stays the op for separate gate and up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op

from triton_transformer.utils import (
    as_rows,
    call_op,
    cdiv,
    check_triton_tensor,
    describe,
    first_order_only,
    launcher,
    next_power_of_2,
    offsets_in,
)

# Elements per program tile and its widest row block (strided rows), and warps per program;
# benchmarks/probe_swiglu_tiles.py sweeps them.
TILE = 1024
MAX_BLOCK_N = 1024
NUM_WARPS = 4


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ((BLOCK_M, 1)), columns ((1, BLOCK_N)), both int64, and mask of this program's
    tile: program p takes row block p // cdiv(N, BLOCK_N) and column block p % cdiv(N,
    BLOCK_N), so consecutive programs read consecutive addresses."""
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(N, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows[:, None], cols[None, :], mask


@triton.jit
def silu_mul(g, u):
    """silu(g) * u = g · sigmoid(g) · u for fp32 tiles: the forward's arithmetic, shared by
    `_swiglu_fwd_kernel` and the matmul epilogue that fuses the gating (`matmul_kernels.py`)."""
    s = 1.0 / (1.0 + tl.exp(-g))
    return g * s * u


@triton.jit
def _swiglu_fwd_kernel(
    G, U, Y, M, N, stride_g, stride_u, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rows * stride_y + cols, silu_mul(g, u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DY, G, U, DG, DU, M, N, stride_dy, stride_g, stride_u, stride_dg, stride_du, off_dg, off_du,
    PACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """d(gate) to DG + off_dg, d(up) to DU + off_du (element offsets). PACKED: both live in
    DG's tensor (`bmm.py`'s fused projection passes its one (rows, 2·N) gradient rather than
    views of its halves) and DU is an unused placeholder."""
    if PACKED:
        DU = DG
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    silu = g * s
    dg = dy * u * (s + silu * (1.0 - s))  # = dy * u * s * (1 + g * (1 - s))
    tl.store(DG + off_dg + rows * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    du = (dy * silu).to(DU.dtype.element_ty)
    tl.store(DU + off_du + rows * stride_du + cols, du, mask=mask)


# ----------------------------------------------------------------------------- launchers


def _launch_shape(M: int, N: int, *tensors: torch.Tensor) -> tuple[int, int, int, int, tuple]:
    """(M, N, BLOCK_M, BLOCK_N, grid) of a launch over (M, N) tensors with unit-stride rows:
    one flat (1, M·N) row in tiles of TILE where every tensor's rows are contiguous (the
    kernels index rows · stride + column, and stride N makes that the flat index), else
    (TILE // BLOCK_N, BLOCK_N) tiles, BLOCK_N up to MAX_BLOCK_N."""
    if M > 1 and all(t.stride(0) == N for t in tensors):
        M, N = 1, M * N
    block_n = min(MAX_BLOCK_N if M > 1 else TILE, max(16, next_power_of_2(N)))
    block_m = max(1, TILE // block_n) if M > 1 else 1
    return M, N, block_m, block_n, (cdiv(M, block_m) * cdiv(N, block_n),)


def launch_swiglu_fwd(
    g2: torch.Tensor, u2: torch.Tensor, y2: torch.Tensor, bind: bool = False
) -> Callable[..., None] | None:
    """y2 = silu(g2) * u2 for 2-D (rows, N) tensors whose last dims are unit-stride (any row
    strides: e.g. the two halves of one (rows, 2·N) projection). Also the "cublas+ew" path of
    `bmm.linear(..., activation="swiglu")`, after cuBLAS wrote the projection. bind: return
    the launch bound, again(g2, u2, y2) for tensors of these layouts and facts."""
    M, N = g2.shape[0], int(g2.shape[1])
    if not (M and N):
        return (lambda *tensors: None) if bind else None
    strides = (g2.stride(0), u2.stride(0), y2.stride(0))
    M, N, block_m, block_n, grid = _launch_shape(M, N, g2, u2, y2)
    launch = launcher(_swiglu_fwd_kernel)
    args = (g2, u2, y2, M, N, *strides)
    flags = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS)
    if bind:
        return launch.bind(grid, *args, **flags)
    launch[grid](*args, **flags)
    return None


def launch_swiglu_bwd(
    dy2: torch.Tensor,
    g2: torch.Tensor,
    u2: torch.Tensor,
    dg2: torch.Tensor,
    du2: torch.Tensor,
    grads_base: torch.Tensor | None = None,
    bind: bool = False,
) -> Callable[..., None] | None:
    """(dg2, du2) = (d(gate), d(up)) for 2-D (rows, N) tensors with unit-stride last dims (any
    row strides: `bmm.linear`'s swiglu backward writes the halves of one (rows, 2·N) tensor).

    grads_base: the tensor dg2 and du2 are views of, or None. The kernel then gets it once,
    with each view's element offset (`utils.offsets_in` says why). bind: return the launch
    bound, again(dy2, g2, u2, dg2, du2) (with grads_base: again(dy2, g2, u2, grads_base,
    dy2)) for tensors of these layouts and facts.
    """
    M, N = g2.shape[0], int(g2.shape[1])
    if not (M and N):
        return (lambda *tensors: None) if bind else None
    dg, du, off_dg, off_du = dg2, du2, 0, 0
    if grads_base is not None:
        dg, du = grads_base, dy2  # dy2: a placeholder the kernel does not use
        off_dg, off_du = offsets_in(grads_base, dg2, du2)
    strides = (dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0))
    M, N, block_m, block_n, grid = _launch_shape(M, N, dy2, g2, u2, dg2, du2)
    launch = launcher(_swiglu_bwd_kernel)
    args = (dy2, g2, u2, dg, du, M, N, *strides, off_dg, off_du)
    flags = dict(
        PACKED=grads_base is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS
    )
    if bind:
        return launch.bind(grid, *args, **flags)
    launch[grid](*args, **flags)
    return None


@triton_op("triton_transformer::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: a new contiguous tensor shaped and typed like gate."""
    N = int(gate.shape[-1])
    g2, u2 = as_rows(gate), as_rows(up)
    y = torch.empty(size=gate.shape, dtype=gate.dtype, device=gate.device)
    launch_swiglu_fwd(g2, u2, y.view(g2.shape[0], N))
    return y


@triton_op("triton_transformer::swiglu_backward", mutates_args=())
def swiglu_backward_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d(gate), d(up)): new contiguous tensors in the dtypes of gate and up."""
    N = int(gate.shape[-1])
    dy2, g2, u2 = as_rows(dy), as_rows(gate), as_rows(up)
    M = g2.shape[0]
    dgate = torch.empty(size=gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(size=up.shape, dtype=up.dtype, device=up.device)
    launch_swiglu_bwd(dy2, g2, u2, dgate.view(M, N), dup.view(M, N))
    return dgate, dup


def _swiglu_setup_context(ctx, inputs, output) -> None:
    gate, up = inputs
    ctx.save_for_backward(gate, up)


@first_order_only("swiglu")
def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return call_op(swiglu_backward_op, dy, gate, up)


swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)


# ----------------------------------------------------------------------------- public API


def _swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference: fp32 arithmetic for fp16/bf16 (fp64 stays fp64), one rounding."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)


def check_swiglu_args(gate: object, up: object, use_triton: bool) -> None:
    """Validate swiglu's arguments: one-line errors."""
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float torch.Tensor, got {describe(t)}")
        if use_triton:
            check_triton_tensor(t, name)
    if up.shape != gate.shape:
        raise ValueError(f"up shape {tuple(up.shape)} != gate shape {tuple(gate.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"up dtype {up.dtype} != gate dtype {gate.dtype}")
    if up.device != gate.device:
        raise ValueError(f"up is on {up.device} but gate is on {gate.device}")
    if gate.dim() == 0:
        raise ValueError("gate must have at least one dim, got a scalar")


def swiglu(gate: torch.Tensor, up: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """silu(gate) * up, elementwise: SwiGLU's gating.

    Args:
        gate: (..., N) float tensor, any strides (e.g. the first half of a projection).
        up: same shape and dtype as gate.
        use_triton: the fused Triton kernels instead of the PyTorch reference.

    Returns:
        (..., N) tensor in gate's dtype: a new tensor, never a view.
    """
    check_swiglu_args(gate, up, use_triton)
    if not use_triton:
        return _swiglu_reference(gate, up)
    return call_op(swiglu_op, gate, up)
