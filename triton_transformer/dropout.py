"""Dropout: a seeded Triton kernel whose mask is never stored, and the PyTorch reference.

The mask is the package's one dropout scheme (`_jit_helpers.dropout_keep_tile`, shared with
attention, the residual LayerNorm and the matmul epilogue): element i of the row-major order
takes 16-bit half i % 8 of Philox4x32-7(seed, counter i // 8), eight elements per Philox call,
and is kept when that draw r satisfies r >= round(p * 2**16). So the drop probability is p
rounded to a multiple of 2**-16 (off by at most 2**-17; the kept values are scaled by exactly
1 / (1 - p)), and for an (M, N) tensor with N a multiple of 8 the mask is exactly the one those
kernels draw over an (M, N) matrix. The kernel covers the flat order as (BLOCK_M, BLOCK_N)
tiles of a matrix BLOCK_N wide, which that scheme gives the same mask at any tile shape.
Eight elements per Philox call: one call per element is integer work the memory system
cannot hide (its backward, unlike eager's, regenerates the mask instead of reading it).

The seed is a 0-dim int64 *device* tensor drawn from torch's generator (`utils.draw_seed`) and
loaded inside the kernel; nothing is read back on the host. So:
- a captured CUDA graph draws a fresh seed, hence a fresh mask, on every replay;
- `torch.manual_seed` makes runs reproducible;
- torch.compile traces the op without a graph break (it is a `torch.library.triton_op`).
The op saves the seed tensor for backward, which regenerates the same mask: no mask tensor is
kept, only 8 bytes. An eager call that is given no seed outside stream capture takes a host
int instead (`utils.host_seed`, from the same generator's state, as F.dropout's eager kernel
takes its own): the device tensor's draw is a launch and an allocation of its own, a quarter
of the call's host time. The kernel takes either (`_jit_helpers.load_seed`), with one mask
for one value.

The mask follows the row-major (logical) element order and the output is contiguous. A
non-contiguous input, or upstream gradient (e.g. the expanded gradient of a `.sum()`), is read
in place through its strides (up to 4 dims after merging adjacent ones; more are copied).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op

from triton_transformer._jit_helpers import dropout_keep_tile, load_seed
from triton_transformer.utils import (
    LaunchPlans,
    PerCall,
    call_op,
    cdiv,
    check_triton_tensor,
    draw_seed,
    dropout_threshold,
    eager_apply,
    first_order_only,
    host_seed,
    is_traced,
    launcher,
    seed_or_draw,
    tensor_facts,
)

# Tile of one program (BLOCK_M x BLOCK_N elements of the flat order; BLOCK_N a multiple of
# 8), and warps. Not yet tuned on the H200: `benchmarks/bench_dropout.py --sweep` does it.
BLOCK_M, BLOCK_N = 8, 512
NUM_WARPS = 4
# Dims a strided input may have after merging adjacent dims (more: copied first).
MAX_STRIDED_DIMS = 4


@triton.jit
def _strided_offsets(idx, size1, size2, size3, stride0, stride1, stride2, stride3):
    """Memory offsets of logical (row-major) element indices idx of a 4-D strided tensor."""
    i3 = idx % size3
    idx = idx // size3
    i2 = idx % size2
    idx = idx // size2
    i1 = idx % size1
    i0 = idx // size1
    return i0 * stride0 + i1 * stride1 + i2 * stride2 + i3 * stride3


# (SEED: a host int varies per call, `utils.PerCall`)
@triton.jit(do_not_specialize=["SEED"])
def _dropout_kernel(
    X, SEED, Y, n_elements, threshold, scale, size1, size2, size3,
    stride0, stride1, stride2, stride3,
    STRIDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT64: tl.constexpr,
):  # fmt: skip
    """Y (contiguous) = X · keep / (1 - p) over the flat order, seen as rows of BLOCK_N
    elements: program pid owns rows [pid·BLOCK_M, (pid + 1)·BLOCK_M)."""
    # torch.compile passes Python floats as fp64: compute in fp32 as the eager launch does
    scale = tl.cast(scale, tl.float32)
    pid = tl.program_id(0)
    if INT64:  # >= 2**31 elements: 64-bit offsets (and the Philox counter's high word)
        pid = pid.to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    keep = dropout_keep_tile(load_seed(SEED), rows, 0, BLOCK_N, threshold, BLOCK_N, INT64)
    mask = offs < n_elements
    src = offs
    if STRIDED:
        src = _strided_offsets(offs, size1, size2, size3, stride0, stride1, stride2, stride3)
    x = tl.load(X + src, mask=mask).to(tl.float32)
    y = tl.where(keep != 0, x * scale, 0.0)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _strided_layout(x: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """x's sizes and strides with size-1 dims dropped and adjacent dims merged where one
    stride steps both, left-padded to MAX_STRIDED_DIMS; None if more dims remain."""
    sizes: list[int] = []
    strides: list[int] = []
    for size, stride in zip(x.shape, x.stride(), strict=True):
        if size == 1:
            continue
        if sizes and strides[-1] == stride * size:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    if len(sizes) > MAX_STRIDED_DIMS:
        return None
    pad = MAX_STRIDED_DIMS - len(sizes)
    return [1] * pad + sizes, [0] * pad + strides


@triton_op("triton_transformer::dropout", mutates_args=())
def dropout_op(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """x * keep(seed) / (1 - p) elementwise in row-major order, for 0 <= p < 1.

    x: any shape and strides, fp32/fp16/bf16. seed: 0-dim int64 tensor on x's device.
    Returns a new contiguous tensor shaped like x. Backward applies the same mask to the
    gradient (this op again, with the saved seed). An eager call of a shape seen before
    takes its bound launch (`_PLANS`).
    """
    if is_traced(x):
        return _dropout_plan(x, p, seed, bind=False)[0]
    key = (x.shape, x.stride(), p, *tensor_facts(x, seed))
    plan = _PLANS.get(key)
    if plan is not None:
        return plan(x, seed)
    out, plan = _dropout_plan(x, p, seed, bind=True)
    _PLANS.put(key, plan)
    return out


# Eager launches bound per (shape, strides, p, tensor facts) (`utils.LaunchPlans`)
_PLANS = LaunchPlans()


def _dropout_plan(x: torch.Tensor, p: float, seed: torch.Tensor | int, bind: bool):
    """`dropout_op`'s output, and (bind) a function of (x, seed) that does the same for
    another call with x's shape, strides and tensor facts, and a seed of this one's kind (a
    device tensor of its alignment, or a host int)."""
    layout = None if x.is_contiguous() else _strided_layout(x)
    copy = layout is None and not x.is_contiguous()
    if copy:
        x = x.contiguous()  # more than MAX_STRIDED_DIMS irreducible dims
    sizes, strides = layout if layout is not None else ([1] * 4, [0] * 4)
    out = torch.empty(size=x.shape, dtype=x.dtype, device=x.device)
    n = x.numel()
    # 64-bit offsets once an index (padded to whole blocks) or a strided address passes 2**31.
    block = BLOCK_M * BLOCK_N
    span = sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True))
    int64 = max(n + block, span + 1) >= 2**31
    args = (n, dropout_threshold(p), 1.0 / (1.0 - p), *sizes[1:], *strides)
    flags = dict(STRIDED=layout is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, INT64=int64,
                 num_warps=NUM_WARPS)  # fmt: skip
    grid = (cdiv(n, block),)
    if not bind:
        if n:
            launcher(_dropout_kernel)[grid](x, seed, out, *args, **flags)
        return out, None
    seed_arg = PerCall(seed) if type(seed) is int else seed
    bound = launcher(_dropout_kernel).bind(grid, x, seed_arg, out, *args, **flags) if n else None
    shape, dtype = out.shape, out.dtype

    def plan(x: torch.Tensor, seed: torch.Tensor | int) -> torch.Tensor:
        if copy:
            x = x.contiguous()
        out = torch.empty(size=shape, dtype=dtype, device=x.device)
        if bound is not None:
            bound(x, seed, out)
        return out

    return out, plan


def _dropout_setup_context(ctx, inputs, output) -> None:
    _, ctx.p, seed = inputs
    ctx.save_for_backward(seed)


@first_order_only("dropout")
def _dropout_backward(ctx, dy: torch.Tensor):
    # d(x * keep * scale)/dx = keep * scale: the same mask, regenerated from the seed.
    (seed,) = ctx.saved_tensors
    return call_op(dropout_op, dy, ctx.p, seed), None, None


dropout_op.register_autograd(_dropout_backward, setup_context=_dropout_setup_context)


# ----------------------------------------------------------------------------- eager calls
# An eager call (nothing traces) of a layout seen before takes that layout's `_EagerPlan`:
# one key of what the checks and the kernel read (`utils.eager_plan_key`: x and p), one
# lookup, then the bound launches, forward and backward; as `layernorm._EagerPlan`.


class _EagerPlan:
    """The launches of eager dropout calls of one layout of x and one p: `_dropout_plan`'s
    bound launches, one per layout of the tensor masked (x forward, the upstream gradient
    backward) and kind of seed (a device tensor and its alignment, or a host int)."""

    __slots__ = ("bound", "device", "p")

    def __init__(self, x: torch.Tensor, p: float) -> None:
        self.device, self.p = x.device, p
        self.bound: dict[tuple, object] = {}

    def __call__(self, t: torch.Tensor, seed: torch.Tensor | int) -> torch.Tensor:
        """`dropout_op(t, p, seed)` for t of the plan's shape (a host int seed as the device
        tensor of its value)."""
        kind = None if type(seed) is int else not seed.data_ptr() & 15
        key = (t.stride(), t.dtype, not t.data_ptr() & 15, kind)
        bound = self.bound.get(key)
        if bound is not None:
            return bound(t, seed)
        out, self.bound[key] = _dropout_plan(t, self.p, seed, bind=True)
        return out


_EAGER_PLANS = LaunchPlans()


def _eager_plan(x: torch.Tensor, p: float) -> _EagerPlan | None:
    """The plan of this eager call's layout (made on its first call), or None where the
    generic path runs: traced, not a tensor, or what the plan does not cover (p of 0 or 1, an
    empty x)."""
    key, plan = _EAGER_PLANS.find((x,), (p,))
    if key is None or plan is not None:
        return plan
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < p < 1.0:
        return None  # the checks raise, or p needs no kernel
    check_triton_tensor(x, "x")
    if x.numel() == 0:
        return None
    return _EAGER_PLANS.put(key, _EagerPlan(x, float(p)))


class _EagerDropout(torch.autograd.Function):
    """`dropout_op` and its registered backward for an eager call of a planned layout. A host
    int seed is kept on ctx; a seed tensor is saved (autograd then refuses one changed in
    place before the backward, as the registered op's does)."""

    @staticmethod
    def forward(ctx, x, seed, plan):
        host = type(seed) is int
        ctx.host_seed, ctx.plan = seed if host else None, plan
        ctx.save_for_backward(None if host else seed)
        return plan(x, seed)

    @staticmethod
    @first_order_only("dropout")
    def backward(ctx, dy):
        seed = ctx.host_seed
        if seed is None:
            (seed,) = ctx.saved_tensors
        return ctx.plan(dy, seed), None, None


_apply_eager_dropout = eager_apply(_EagerDropout)


def dropout(
    x: torch.Tensor,
    p: float = 0.0,
    training: bool = True,
    use_triton: bool = False,
    *,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Zero each element of `x` with probability `p`; scale the rest by 1 / (1 - p).

    Args:
        x: tensor of any shape (fp32/fp16/bf16 for Triton).
        p: drop probability in [0, 1]. p == 1 returns zeros (like `F.dropout`), in both
            branches, without a kernel.
        training: dropout is applied only in training mode.
        use_triton: run the seeded Triton kernel instead of `F.dropout`.
        seed: Triton only: the 0-dim int64 device tensor the mask is drawn from (e.g. a view
            of `utils.draw_seeds`); None draws one from torch's generator (`utils.host_seed`
            for an eager call outside stream capture, else `utils.draw_seed`). `F.dropout`
            ignores it.

    Returns:
        Tensor shaped like `x`, in its dtype. `x` itself (no copy, no kernel) when p == 0 or
        not training.

    Raises:
        TypeError: `x` is not a tensor (or, for Triton, not fp32/fp16/bf16); `p` not a real
            number.
        ValueError: `p` outside [0, 1] (or NaN).
    """
    if use_triton and training:
        plan = _eager_plan(x, p)
        if plan is not None:
            if seed is None:  # a host int, but a device tensor during stream capture
                drawn = host_seed(plan.device)
                seed = draw_seed(plan.device) if drawn is None else drawn
            else:
                seed = seed_or_draw(seed, plan.device)
            if x.requires_grad and torch.is_grad_enabled():
                return _apply_eager_dropout(x, seed, plan)
            return plan(x, seed)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"p must be a real number, got {p!r}")
    p = float(p)
    if math.isnan(p) or not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1], got {p}")

    if p == 0.0 or not training:
        return x
    if use_triton:
        check_triton_tensor(x, "x")
    # p == 1 (all zeros) and empty tensors need no kernel; F.dropout keeps them in the graph.
    if not use_triton or p == 1.0 or x.numel() == 0:
        return F.dropout(x, p=p, training=True)
    return call_op(dropout_op, x, p, seed_or_draw(seed, x.device))
