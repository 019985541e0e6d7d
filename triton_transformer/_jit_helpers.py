"""Triton device helpers shared by the row kernels (softmax, cross-entropy), the dropout
masks of attention and the relu² matmul epilogue, and the causal attention kernels' program
order.

Naming scheme used by the kernels of `softmax.py`, `cross_entropy.py` and `dropout.py`:

- Tensor pointers are UPPER_CASE, named after the tensor (X, Y, DY, DX, LOGITS, LABELS, LSE,
  LOSS, N_VALID, SEED, DLOSS); inputs come before outputs.
- Then strides `stride_<tensor>` (lower case, per row unless suffixed), then sizes (`n_rows`,
  `n_cols`, `n_elements`), then runtime scalars, then `tl.constexpr` flags and block sizes
  (UPPER_CASE: BLOCK_M rows by BLOCK_N columns per tile).
- Kernels are `_<op>_fwd_kernel` / `_<op>_bwd_kernel`; the torch.library ops are
  `triton_transformer::<op>` (forward) and `triton_transformer::<op>_backward`, bound to the
  Python names `<op>_op` and `<op>_backward_op`.

Every helper works on 2-D tiles of shape (BLOCK_M, BLOCK_N) and reduces over axis 1 with
`keep_dims=True`, so per-row statistics are (BLOCK_M, 1) columns.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def safe_shift(m):
    """The max to shift a row by: 0 instead of -inf for a row with no finite entry, so that
    exp(x - shift) gives zeros there rather than NaN (-inf - -inf)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def online_lse_update(m, s, x):
    """One step of the online log-sum-exp over a (BLOCK_M, BLOCK_N) fp32 tile `x` (masked
    entries loaded as -inf).

    m: running row max, s: running sum of exp(x - safe_shift(m)), both (BLOCK_M, 1) fp32.
    Returns the updated (m, s). A NaN entry makes its row's m and s NaN, as torch does.
    """
    m_new = tl.maximum(m, tl.max(x, axis=1, keep_dims=True))
    shift = safe_shift(m_new)
    s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=1, keep_dims=True)
    return m_new, s


@triton.jit
def tile_exp(x):
    """Single-pass statistics of rows held whole in one tile (masked entries -inf).

    Returns (m, e, s): the row max m, e = exp(x - safe_shift(m)) (one exp per entry) and
    s = sum(e), so softmax = e / s and log-sum-exp = lse_from_stats(m, s).
    """
    m = tl.max(x, axis=1, keep_dims=True)
    e = tl.exp(x - safe_shift(m))
    return m, e, tl.sum(e, axis=1, keep_dims=True)


@triton.jit
def lse_from_stats(m, s):
    """log(sum(exp(x))) from the running (m, s): -inf for a row with no finite entry."""
    return safe_shift(m) + tl.log(s)


@triton.jit
def load_seed(SEED):
    """A kernel's Philox seed as int64: SEED is a host int (an eager launch's, `utils.host_seed`)
    or points at a 0-dim int64 device tensor (`utils.draw_seed`; captured and traced launches).
    The two give one mask for one value. (A compile-time branch: the argument's type picks it.)"""
    if SEED.dtype.is_ptr():  # noqa: SIM108 (a compile-time branch)
        seed = tl.load(SEED).to(tl.int64)
    else:
        seed = SEED.to(tl.int64)
    return seed


@triton.jit
def dropout_keep_tile(seed, rows, start_col, n_cols, threshold, BLOCK_N: tl.constexpr,
                      INT64: tl.constexpr):  # fmt: skip
    """Dropout keep mask of one tile of a (rows, n_cols) matrix: rows (BLOCK_M,) by columns
    [start_col, start_col + BLOCK_N), as a (BLOCK_M, BLOCK_N) int8 tile of 0/1.

    One Philox4x32-7 call per row and group of 8 columns, counter = row · ⌈n_cols / 8⌉ +
    col // 8 (int64 counters when INT64): its four 32-bit words are eight 16-bit uniforms r,
    and column 8g + j takes half j % 2 of word j // 2. Kept when r >= threshold =
    round(p · 2**16) (`utils.dropout_threshold`). The mask is a function of (seed, row, col)
    only, so kernels with different tile shapes (multiples of 8 columns, starting at
    multiples of 8) draw the same one; a kernel working on transposed tiles transposes it.

    Eight elements per Philox call: one call per element is integer work the tensor cores
    cannot hide (attention with dropout 0.1 took 4.2 of 9.8 ms of an H200 training step).
    Philox4x32-7, as FlashAttention-2's CUDA dropout: 7 rounds pass BigCrush (Salmon et al.,
    SC'11); Triton's default 10 add a margin at 40% more work per call.
    """
    tl.static_assert(BLOCK_N % 8 == 0, "dropout tiles span whole groups of 8 columns")
    # `& 0xFFFF` on both halves: before Triton 3.4 an int64 counter made randint4x return
    # 64-bit words, whose bits above 32 must not leak into the 16-bit uniforms
    groups = tl.cdiv(n_cols, 8)
    g = start_col // 8 + tl.arange(0, BLOCK_N // 8)
    if INT64:
        counter = rows.to(tl.int64)[:, None] * groups + g[None, :]
    else:
        counter = rows[:, None] * groups + g[None, :]
    w0, w1, w2, w3 = tl.randint4x(seed, counter, n_rounds=7)
    k0 = ((w0 & 0xFFFF).to(tl.int32) >= threshold).to(tl.int8)
    k1 = (((w0 >> 16) & 0xFFFF).to(tl.int32) >= threshold).to(tl.int8)
    k2 = ((w1 & 0xFFFF).to(tl.int32) >= threshold).to(tl.int8)
    k3 = (((w1 >> 16) & 0xFFFF).to(tl.int32) >= threshold).to(tl.int8)
    k4 = ((w2 & 0xFFFF).to(tl.int32) >= threshold).to(tl.int8)
    k5 = (((w2 >> 16) & 0xFFFF).to(tl.int32) >= threshold).to(tl.int8)
    k6 = ((w3 & 0xFFFF).to(tl.int32) >= threshold).to(tl.int8)
    k7 = (((w3 >> 16) & 0xFFFF).to(tl.int32) >= threshold).to(tl.int8)
    # interleave(a, b) puts a at even, b at odd positions: three levels put k_j at 8g + j
    even = tl.interleave(tl.interleave(k0, k4), tl.interleave(k2, k6))
    odd = tl.interleave(tl.interleave(k1, k5), tl.interleave(k3, k7))
    return tl.interleave(even, odd)


@triton.jit
def longest_first(pid, bh, BH, head_bytes, L2_BYTES: tl.constexpr):
    """(block, batch·head) that program (pid, bh) of a causal attention launch takes, so that
    the grid runs its longest programs first across heads, not only within each (shared by
    `attention`'s Triton kernels and `attention_hopper`'s Gluon backward).

    The GPU starts programs in grid order, dim 0 fastest, and a causal head's first blocks
    carry the most work (the launches order them so). In head-major order the last wave
    still holds the long blocks of the last heads, while SMs that finished sit idle: at
    GPT-2's shape that tail is several percent of the kernel. So position L = bh·P + pid
    (P programs per head) is dealt block-major over groups of g heads: group L // (g·P),
    block L % (g·P) // g', head L % (g·P) % g' (g' = g, fewer in the last group). A group's
    streamed tensors (head_bytes per head) fit L2_BYTES, so its blocks still read them from
    L2; L2_BYTES = 0 gives g = 1, the identity."""
    n_prog = tl.num_programs(0)
    heads = tl.maximum(tl.minimum(L2_BYTES // head_bytes, BH), 1)
    lin = bh.to(tl.int64) * n_prog + pid
    group = lin // (heads * n_prog)
    first = group * heads
    in_group = tl.minimum(heads, BH - first)
    rank = lin - first * n_prog
    return (rank // in_group).to(tl.int32), (first + rank % in_group).to(tl.int32)
