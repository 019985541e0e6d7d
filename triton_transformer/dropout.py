"""Dropout: a seeded Triton kernel whose mask is never stored, and the PyTorch reference.

The Triton kernel draws keep/drop for each element from Philox: one `tl.randint4x` call gives
four 32-bit words, split into eight 16-bit uniforms, used for eight elements. An element is
kept when its 16-bit draw r satisfies r >= round(p * 2**16), so the drop probability is p
rounded to a multiple of 2**-16 (off by at most 2**-17; the kept values are scaled by exactly
1 / (1 - p)). Eight elements per Philox call halve the Philox work per element against four:
in bf16 the four-per-call kernel issued about as many integer instructions as the memory
system could feed, so its backward (which, unlike eager's, regenerates the mask instead of
reading it) trailed eager. The sm_90 PTX of this kernel has about 24 instructions per element.
The mask is a pure function of (seed, element index).

The seed is a 0-dim int64 *device* tensor drawn from torch's generator (`utils.draw_seed`) and
loaded inside the kernel; nothing is read back on the host. So:
- a captured CUDA graph draws a fresh seed, hence a fresh mask, on every replay;
- `torch.manual_seed` makes runs reproducible;
- torch.compile traces the op without a graph break (it is a `torch.library.triton_op`).
The op saves the seed tensor for backward, which regenerates the same mask: no mask tensor is
kept, only 8 bytes.

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

from triton_transformer.utils import (
    call_op,
    cdiv,
    check_triton_tensor,
    dropout_threshold,
    first_order_only,
    launcher,
    seed_or_draw,
)

# Elements per program and warps: BLOCK / 8 Philox calls per program, eight elements each.
# Not yet tuned on the H200 for this kernel: `benchmarks/bench_dropout.py --sweep` does it.
BLOCK = 4096
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


@triton.jit
def _masked_scale(
    X, Y, offs, r, n_elements, threshold, scale, size1, size2, size3,
    stride0, stride1, stride2, stride3, STRIDED: tl.constexpr,
):  # fmt: skip
    mask = offs < n_elements
    src = offs
    if STRIDED:
        src = _strided_offsets(offs, size1, size2, size3, stride0, stride1, stride2, stride3)
    x = tl.load(X + src, mask=mask).to(tl.float32)
    # r is uniform on [0, 2**16): P(keep) = P(r >= threshold) = 1 - threshold / 2**16.
    y = tl.where(r >= threshold, x * scale, 0.0)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_kernel(
    X, SEED, Y, n_elements, threshold, scale, size1, size2, size3,
    stride0, stride1, stride2, stride3,
    STRIDED: tl.constexpr, BLOCK: tl.constexpr, INT64: tl.constexpr,
):  # fmt: skip
    # One Philox call yields 4 x 32 bits = 8 x 16-bit uniforms: counter pid * Q + j drives
    # elements pid * BLOCK + k * Q + j, k = 0..7 (word k // 2, half k % 2), so each element
    # has its own (counter, k) pair and every slab of Q elements is contiguous in memory.
    Q: tl.constexpr = BLOCK // 8
    # torch.compile passes Python floats as fp64: compute in fp32 as the eager launch does
    scale = tl.cast(scale, tl.float32)
    pid = tl.program_id(0)
    if INT64:  # >= 2**31 elements: 64-bit offsets (and the Philox counter's high word)
        pid = pid.to(tl.int64)
    seed = tl.load(SEED)
    idx = tl.arange(0, Q)
    w0, w1, w2, w3 = tl.randint4x(seed, pid * Q + idx)
    offs = pid * BLOCK + idx
    for k in tl.static_range(8):
        w = w0 if k // 2 == 0 else (w1 if k // 2 == 1 else (w2 if k // 2 == 2 else w3))
        r = (w & 0xFFFF) if k % 2 == 0 else ((w >> 16) & 0xFFFF)  # 64-bit words < 3.4
        _masked_scale(
            X, Y, offs + k * Q, r.to(tl.int32), n_elements, threshold, scale, size1, size2,
            size3, stride0, stride1, stride2, stride3, STRIDED,
        )  # fmt: skip


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
    gradient (this op again, with the saved seed).
    """
    layout = None if x.is_contiguous() else _strided_layout(x)
    if layout is None and not x.is_contiguous():
        x = x.contiguous()  # more than MAX_STRIDED_DIMS irreducible dims
    sizes, strides = layout if layout is not None else ([1] * 4, [0] * 4)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.numel()
    # 64-bit offsets once an index (padded to whole blocks) or a strided address passes 2**31.
    span = sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True))
    int64 = max(n + BLOCK, span + 1) >= 2**31
    if n:
        launcher(_dropout_kernel)[(cdiv(n, BLOCK),)](
            x, seed, out, n, dropout_threshold(p), 1.0 / (1.0 - p), *sizes[1:], *strides,
            STRIDED=layout is not None, BLOCK=BLOCK, INT64=int64,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


def _dropout_setup_context(ctx, inputs, output) -> None:
    _, ctx.p, seed = inputs
    ctx.save_for_backward(seed)


@first_order_only("dropout")
def _dropout_backward(ctx, dy: torch.Tensor):
    # d(x * keep * scale)/dx = keep * scale: the same mask, regenerated from the seed.
    (seed,) = ctx.saved_tensors
    return call_op(dropout_op, dy, ctx.p, seed), None, None


dropout_op.register_autograd(_dropout_backward, setup_context=_dropout_setup_context)


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
            of `utils.draw_seeds`); None draws one (`utils.draw_seed`). `F.dropout` ignores it.

    Returns:
        Tensor shaped like `x`, in its dtype. `x` itself (no copy, no kernel) when p == 0 or
        not training.

    Raises:
        TypeError: `x` is not a tensor (or, for Triton, not fp32/fp16/bf16); `p` not a real
            number.
        ValueError: `p` outside [0, 1] (or NaN).
    """
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
