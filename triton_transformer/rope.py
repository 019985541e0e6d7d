"""Rotary position embeddings (RoPE) of queries and keys, in one fused kernel each way.

`rope(q, k, positions=None, base=10000.0, use_triton=...)` rotates q (b, h_q, n, d) and
k (b, h_k, n, d), the (batch, heads, seq, head_dim) layout of `attention.py`, by the angles of
their positions, in the half-split convention of GPT-NeoX and Llama (`rotate_half`): with
x = [x1, x2] split into halves of d/2 along the last dim and, for i < d/2,

    inv_freq_i = base ** (-2i / d)
    theta_i    = position * inv_freq_i
    out        = [x1 * cos(theta) - x2 * sin(theta),  x2 * cos(theta) + x1 * sin(theta)]

`positions`: None means 0..n-1; else an integer device tensor (n,) or (b, n), e.g. a KV cache's
positions, read on the device (no host value, so a decode step can be a CUDA graph).
`use_triton=False` runs the PyTorch reference that defines the semantics: angles, cos and sin
in fp32 (fp64 for fp64 inputs), the rotation in fp32, one rounding to the input's dtype.

The Triton path is one `torch.library.triton_op`, `triton_transformer::rope`, with
`register_autograd`: a rotation is orthogonal, so the backward is the same kernel rotating the
output gradients by the negative angles (dq = R(-theta) dq_out). It is first-order only
(`utils.first_order_only`), as every op here. Outputs are fresh tensors, laid out as
(b, n, h, d) in memory and returned as (b, h, n, d) views of it (the layout the attention
kernel's output has, so `rearrange(.., "b h n d -> b n (h d)")` needs no copy either).

Triton design: a program owns BLOCK_S positions of one sequence and computes their
(BLOCK_S, d/2) angles, cos and sin once in fp32, then rotates every head of q and of k at
those positions (the angles are shared by all heads: sin/cos cost once per position, not per
element). Each element is read once and written once (the floor: 2·e bytes per element of
q and k). The inverse frequencies are exp2(-2i/d · log2(base)) in the kernel (no table to
cache per device), and the angle is reduced to [-pi, pi] (Cody-Waite, two constants) before
tl.cos / tl.sin, whose fast GPU versions lose accuracy far from zero; theta itself is rounded
to fp32 as in the reference, so at position p both carry an angle error of about p · 2**-24.
Inputs of any strides with a unit-stride last dim are read in place (a view of the qkv
projection is); others are copied first. Offsets are 64-bit per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from triton_transformer.utils import (
    LaunchPlans,
    call_op,
    cdiv,
    check_triton_tensor,
    describe,
    eager_apply,
    first_order_only,
    launcher,
    next_power_of_2,
    tensor_facts,
)

DEFAULT_BASE = 10000.0

# Elements of the (BLOCK_S, d/2) angle tile per program: BLOCK_S = TILE // (d/2 rounded up),
# within [1, n rounded up]. Not swept yet (the benchmark measures it).
TILE = 512
NUM_WARPS = 4

# 2·pi split for the range reduction: _TWO_PI_HI has 8 significant bits, so k · _TWO_PI_HI is
# exact in fp32 for |k| < 2**16 (angles below ~4e5 rad), and the remainder goes to _LO.
# (tl.constexpr: globals a kernel reads must be.)
_TWO_PI_HI = tl.constexpr(6.28125)
_TWO_PI_LO = tl.constexpr(2.0 * math.pi - 6.28125)
_INV_TWO_PI = tl.constexpr(1.0 / (2.0 * math.pi))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _cos_sin(theta):
    """cos and sin of an fp32 tile, after reducing it to [-pi, pi]."""
    k = tl.floor(theta * _INV_TWO_PI + 0.5)
    r = (theta - k * _TWO_PI_HI) - k * _TWO_PI_LO
    return tl.cos(r), tl.sin(r)


@triton.jit
def _rotate_heads(
    X, XO, n_heads, row, row_o, stride_h, stride_ho, half, cols, mask, cos, sin,
):  # fmt: skip
    """Rotate the first/second halves of every head of X at the rows `row` (int64 element
    offsets of each position, (BLOCK_S, 1)) into XO (offsets `row_o`)."""
    x_ptr = X + row
    o_ptr = XO + row_o
    for _ in range(0, n_heads):  # pointers advance by a head each step (64-bit, no overflow)
        x1 = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + half + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + cols, (x1 * cos - x2 * sin).to(XO.dtype.element_ty), mask=mask)
        tl.store(o_ptr + half + cols, (x2 * cos + x1 * sin).to(XO.dtype.element_ty), mask=mask)
        x_ptr += stride_h
        o_ptr += stride_ho


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, POS,
    n_q_heads, n_k_heads, seq_len, half, n_tiles,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_qob, stride_qoh, stride_qos, stride_kob, stride_koh, stride_kos,
    stride_pb, stride_ps, freq_scale,
    HAS_POS: tl.constexpr, INVERSE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program pid rotates positions [tile * BLOCK_S, ...) of sequence b = pid // n_tiles,
    every head of q and of k. freq_scale = -2 · log2(base) / d."""
    freq_scale = tl.cast(freq_scale, tl.float32)  # torch.compile passes Python floats as fp64
    pid = tl.program_id(0)
    b = (pid // n_tiles).to(tl.int64)
    s = (pid % n_tiles) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_mask = s < seq_len
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = s_mask[:, None] & (cols < half)
    if HAS_POS:
        pos = tl.load(POS + b * stride_pb + s.to(tl.int64) * stride_ps, mask=s_mask, other=0)
        pos = pos.to(tl.float32)
    else:
        pos = s.to(tl.float32)
    inv_freq = tl.exp2(tl.arange(0, BLOCK_D).to(tl.float32) * freq_scale)
    cos, sin = _cos_sin(pos[:, None] * inv_freq[None, :])
    if INVERSE:
        sin = -sin
    s64 = s.to(tl.int64)[:, None]
    _rotate_heads(
        Q, QO, n_q_heads, b * stride_qb + s64 * stride_qs, b * stride_qob + s64 * stride_qos,
        stride_qh, stride_qoh, half, cols, mask, cos, sin,
    )  # fmt: skip
    _rotate_heads(
        K, KO, n_k_heads, b * stride_kb + s64 * stride_ks, b * stride_kob + s64 * stride_kos,
        stride_kh, stride_koh, half, cols, mask, cos, sin,
    )  # fmt: skip


# ----------------------------------------------------------------------------- launcher


def _block_s(seq_len: int, half: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_D) for sequences of `seq_len` and half head dims of `half`."""
    block_d = next_power_of_2(half)
    return max(1, min(next_power_of_2(seq_len), TILE // block_d)), block_d


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _empty_bnhd(x: torch.Tensor) -> torch.Tensor:
    """A fresh (b, h, n, d) tensor like x, stored as (b, n, h, d)."""
    b, h, n, d = x.shape
    return torch.empty(size=(b, n, h, d), dtype=x.dtype, device=x.device).transpose(1, 2)


def launch_rope(
    q, k, qo, ko, positions, base: float, inverse: bool, bind: bool = False
) -> Callable[..., None] | None:
    """Rotate q into qo and k into ko (all (b, h, n, d), unit last stride).

    bind: return the launch bound for another call of these layouts (`_EagerPlan`), a
    function of the tensors (q, k, qo, ko, positions or q); else None."""
    b, n_q, seq, d = q.shape
    n_k = k.shape[1]
    if q.numel() + k.numel() == 0:
        return None
    half = int(d) // 2
    block_s, block_d = _block_s(int(seq), half)
    n_tiles = cdiv(seq, block_s)
    if positions is None:
        pos, stride_pb, stride_ps = q, 0, 0  # a stand-in, never read
    else:
        pos = positions
        stride_pb, stride_ps = (0, pos.stride(0)) if pos.dim() == 1 else pos.stride()
    args = (
        q, k, qo, ko, pos, n_q, n_k, seq, half, n_tiles,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        stride_pb, stride_ps, -2.0 * math.log2(base) / d,
    )  # fmt: skip
    flags = dict(HAS_POS=positions is not None, INVERSE=inverse, BLOCK_S=block_s,
                 BLOCK_D=block_d, num_warps=NUM_WARPS)  # fmt: skip
    if bind:
        return launcher(_rope_kernel).bind((b * n_tiles,), *args, **flags)
    launcher(_rope_kernel)[(b * n_tiles,)](*args, **flags)
    return None


# ----------------------------------------------------------------------------- torch.library op


@triton_op("triton_transformer::rope", mutates_args=())
def rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor | None,
    base: float,
    inverse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q rotated, k rotated) by the angles of `positions` (negated when `inverse`): new
    (b, h, n, d) tensors stored as (b, n, h, d), in the dtypes of q and k."""
    q, k = _unit_last(q), _unit_last(k)
    qo, ko = _empty_bnhd(q), _empty_bnhd(k)
    launch_rope(q, k, qo, ko, positions, base, inverse)
    return qo, ko


def _rope_setup_context(ctx, inputs, output) -> None:
    _, _, positions, ctx.base, ctx.inverse = inputs
    ctx.save_for_backward(positions)


@first_order_only("rope")
def _rope_backward(ctx, dqo, dko):
    (positions,) = ctx.saved_tensors
    # R(theta)^T = R(-theta): the backward rotates the gradients the other way.
    dq, dk = call_op(rope_op, dqo, dko, positions, ctx.base, not ctx.inverse)
    return dq, dk, None, None, None


rope_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)


# ----------------------------------------------------------------------------- eager calls
# An eager call (nothing traces) of a layout seen before takes that layout's `_EagerPlan`,
# as `layernorm._EagerPlan`: one key of what the checks and the kernel read
# (`utils.eager_plan_key` of q, k and positions, and the base), one lookup, then the launch
# bound on the first call. The kernel, the saved tensors and the gradients are `rope_op`'s.


class _EagerPlan:
    """The launches of eager rope calls of one layout: q and k of unit last stride (what
    `_eager_plan` admits). The forward's, bound on the first call; the backward's (the
    inverse rotation) per layout and tensor facts of the upstream gradients."""

    __slots__ = ("base", "bwd", "fwd")

    def __init__(self, base: float) -> None:
        self.base = base
        self.fwd: Callable[..., None] | None = None
        self.bwd: dict[tuple, Callable[..., None] | None] = {}

    def forward(self, q, k, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_op(q, k, positions, base, False)`."""
        qo, ko = _empty_bnhd(q), _empty_bnhd(k)
        if self.fwd is not None:
            self.fwd(q, k, qo, ko, q if positions is None else positions)
        else:
            self.fwd = launch_rope(q, k, qo, ko, positions, self.base, False, bind=True)
        return qo, ko

    def backward(self, dqo, dko, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_op(dqo, dko, positions, base, True)`: the inverse rotation."""
        dqo, dko = _unit_last(dqo), _unit_last(dko)
        dq, dk = _empty_bnhd(dqo), _empty_bnhd(dko)
        key = (dqo.stride(), dko.stride(), *tensor_facts(dqo, dko))
        bwd = self.bwd.get(key)
        if bwd is not None:
            bwd(dqo, dko, dq, dk, dqo if positions is None else positions)
        else:
            self.bwd[key] = launch_rope(dqo, dko, dq, dk, positions, self.base, True, bind=True)
        return dq, dk


_EAGER_PLANS = LaunchPlans()


def _eager_plan(q, k, positions, base) -> _EagerPlan | None:
    """The plan of this eager call's layout, made on its first call (after the checks); None
    where the generic path runs: traced, not tensors (the checks raise), empty, or q or k
    without a unit last stride (the op copies those first)."""
    key, plan = _EAGER_PLANS.find((q, k, positions), (base,))
    if key is None or plan is not None:
        return plan
    check_rope_args(q, k, positions, base, True)
    if q.numel() == 0 or k.numel() == 0 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return None
    return _EAGER_PLANS.put(key, _EagerPlan(float(base)))


class _EagerRope(torch.autograd.Function):
    """`rope_op` and its registered backward for an eager call of a planned layout."""

    @staticmethod
    def forward(ctx, q, k, positions, plan):
        ctx.save_for_backward(positions)
        ctx.plan = plan
        return plan.forward(q, k, positions)

    @staticmethod
    @first_order_only("rope")
    def backward(ctx, dqo, dko):
        (positions,) = ctx.saved_tensors
        # R(theta)^T = R(-theta): the backward rotates the gradients the other way.
        return (*ctx.plan.backward(dqo, dko, positions), None, None)


_apply_eager_rope = eager_apply(_EagerRope)


# ----------------------------------------------------------------------------- public API


def _rope_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference (see the module docstring)."""
    seq, d = q.shape[-2], q.shape[-1]
    compute = torch.float64 if torch.float64 in (q.dtype, k.dtype) else torch.float32
    pos = torch.arange(seq, device=q.device) if positions is None else positions
    exponent = torch.arange(0, d, 2, device=q.device, dtype=torch.float64) / d
    inv_freq = (base**-exponent).to(compute)
    theta = pos.to(compute)[..., None] * inv_freq  # (n, d/2) or (b, n, d/2)
    if theta.dim() == 3:
        theta = theta[:, None]  # broadcast over heads
    cos, sin = theta.cos(), theta.sin()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.to(compute).chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def _check_qk(t: object, name: str, use_triton: bool) -> None:
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float torch.Tensor, got {describe(t)}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got {describe(t)}")
    if use_triton:
        check_triton_tensor(t, name)


def check_rope_args(
    q: object, k: object, positions: object, base: object, use_triton: bool
) -> None:
    """Validate rope's arguments: one-line errors."""
    _check_qk(q, "q", use_triton)
    _check_qk(k, "k", use_triton)
    b, _, seq, d = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, seq and head_dim"
        )
    if d % 2:
        raise ValueError(f"head_dim must be even for the half-split rotation, got {d}")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ValueError(f"base must be a positive number, got {base!r}")
    if positions is None:
        return
    if (
        not isinstance(positions, torch.Tensor)
        or positions.dtype.is_floating_point
        or (positions.dtype in (torch.bool, torch.complex64, torch.complex128))
    ):
        raise TypeError(f"positions must be an integer tensor, got {describe(positions)}")
    if positions.shape not in ((seq,), (b, seq)):
        raise ValueError(
            f"positions must have shape ({seq},) or ({b}, {seq}), got {tuple(positions.shape)}"
        )
    if positions.device != q.device:
        raise ValueError(f"positions is on {positions.device} but q is on {q.device}")


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    base: float = DEFAULT_BASE,
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embeddings of q and k (half-split, GPT-NeoX / Llama convention).

    Args:
        q: (b, h_q, n, d) queries, any strides; d even.
        k: (b, h_k, n, d) keys (h_k may differ from h_q), same b, n, d.
        positions: None (positions 0..n-1), or an integer tensor (n,) or (b, n) on q's device
            holding each token's position (e.g. the cache positions of a decode step).
        base: the frequency base (10000 in GPT-NeoX / Llama 2; 500000 in Llama 3).
        use_triton: the fused Triton kernel (one launch for q and k) instead of the reference.

    Returns:
        (q_rot, k_rot), new tensors shaped and typed like q and k (the Triton path's are
        (b, h, n, d) views of (b, n, h, d) storage).
    """
    if use_triton:
        plan = _eager_plan(q, k, positions, base)
        if plan is not None:
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
                return _apply_eager_rope(q, k, positions, plan)
            return plan.forward(q, k, positions)
    check_rope_args(q, k, positions, base, use_triton)
    if not use_triton:
        return _rope_reference(q, k, positions, float(base))
    return call_op(rope_op, q, k, positions, float(base), False)
