"""Dropout: a seeded Triton kernel whose mask is never stored, and the PyTorch reference.

The Triton kernel draws keep/drop for each element from Philox (`tl.rand4x`: one call gives four
uniforms, used for four elements), so the mask is a pure function of (seed, element index).

The seed is a 0-dim int64 *device* tensor drawn from torch's generator (`utils.draw_seed`) and
loaded inside the kernel; nothing is read back on the host. So:
- a captured CUDA graph draws a fresh seed, hence a fresh mask, on every replay;
- `torch.manual_seed` makes runs reproducible;
- torch.compile traces the op without a graph break (it is a `torch.library.triton_op`).
The op saves the seed tensor for backward, which regenerates the same mask: no mask tensor is
kept, only 8 bytes.

The mask follows the row-major (logical) element order: a non-contiguous input is copied to a
contiguous one first, and so is a non-contiguous upstream gradient.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable
from torch.library import triton_op, wrap_triton

from triton_transformer.utils import cdiv, check_triton_tensor, draw_seed

# Elements per program (measured on an H200 with 2**26 elements: 2048 elements and 4 warps run at
# copy speed in fp32; one Philox call per element instead of per 4 ran about 1.5x slower).
BLOCK = 2048
NUM_WARPS = 4


@triton.jit
def _masked_scale(X, Y, offs, N, r, p, scale):
    mask = offs < N
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    # r is uniform on [0, 1), so P(keep) = P(r >= p) = 1 - p.
    y = tl.where(r >= p, x * scale, 0.0)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_kernel(X, Y, N, p, scale, SEED, BLOCK: tl.constexpr, INT64: tl.constexpr):
    # One Philox call yields 4 random numbers: counter pid * Q + j drives elements
    # pid * BLOCK + k * Q + j, k = 0..3, so each element has its own (counter, k) pair.
    Q: tl.constexpr = BLOCK // 4
    pid = tl.program_id(0)
    if INT64:  # >= 2**31 elements: 64-bit offsets (and the Philox counter's high word)
        pid = pid.to(tl.int64)
    seed = tl.load(SEED)
    idx = tl.arange(0, Q)
    r0, r1, r2, r3 = tl.rand4x(seed, pid * Q + idx)
    offs = pid * BLOCK + idx
    _masked_scale(X, Y, offs, N, r0, p, scale)
    _masked_scale(X, Y, offs + Q, N, r1, p, scale)
    _masked_scale(X, Y, offs + 2 * Q, N, r2, p, scale)
    _masked_scale(X, Y, offs + 3 * Q, N, r3, p, scale)


@triton_op("triton_transformer::dropout", mutates_args=())
def dropout_op(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """x * keep(seed) / (1 - p) elementwise in row-major order, for 0 <= p < 1.

    x: any shape, fp32/fp16/bf16. seed: 0-dim int64 tensor on x's device. Returns a new
    contiguous tensor shaped like x. Backward applies the same mask to the gradient.
    """
    x = x.contiguous()  # no-op when already contiguous
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        wrap_triton(_dropout_kernel)[(cdiv(n, BLOCK),)](
            x, out, n, p, 1.0 / (1.0 - p), seed,
            BLOCK=BLOCK, INT64=n >= 2**31, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


def _dropout_setup_context(ctx, inputs, output) -> None:
    _, ctx.p, seed = inputs
    ctx.save_for_backward(seed)


@once_differentiable
def _dropout_backward(ctx, dy: torch.Tensor):
    # d(x * keep * scale)/dx = keep * scale: the same mask, regenerated from the seed.
    (seed,) = ctx.saved_tensors
    return dropout_op(dy, ctx.p, seed), None, None


dropout_op.register_autograd(_dropout_backward, setup_context=_dropout_setup_context)


def dropout(
    x: torch.Tensor, p: float = 0.0, training: bool = True, use_triton: bool = False
) -> torch.Tensor:
    """Zero each element of `x` with probability `p`; scale the rest by 1 / (1 - p).

    Args:
        x: tensor of any shape (fp32/fp16/bf16 for Triton).
        p: drop probability in [0, 1]. p == 1 returns zeros (like `F.dropout`), in both
            branches, without a kernel.
        training: dropout is applied only in training mode.
        use_triton: run the seeded Triton kernel instead of `F.dropout`.

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
    return dropout_op(x, p, draw_seed(x.device))
