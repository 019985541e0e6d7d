"""Scaled dot-product attention: a fused FlashAttention kernel, the composed reference, and PyTorch.

Three implementations of one semantics, softmax(q kᵀ · scale, masked) v:

- `attention(..., use_triton=True)` and `attention_packed` run the fused Triton kernels below
  (FlashAttention-2): the (n_q, n_k) score matrix is never stored.
- `attention(..., use_triton=False)` is the PyTorch reference (`F.scaled_dot_product_attention`
  where its semantics match ours, explicit math otherwise).
- `attention_naive` is lucidrains' composition bmm -> softmax -> dropout -> bmm of the package's
  own ops (the readable reference, `Transformer(attn_impl="naive")`), Triton or PyTorch.

Semantics shared by all three:
- causal attention is bottom-right aligned: query i sees keys j <= i + (n_k - n_q), so a
  KV-cache step (n_q < n_k) is right;
- `key_padding_mask` (b, n_k) bool, True = real token: padded keys get no weight;
- a query row that sees no key at all (every key padded, or n_q > n_k under causal) outputs
  zeros, never NaN, and passes no gradient;
- dropout zeroes attention weights after the softmax, each with probability p, and scales the
  rest by 1 / (1 - p);
- grouped-query / multi-query attention: k and v may have h_kv heads, h_kv dividing q's h;
  query head i reads key/value head i // (h / h_kv) (as k, v repeated with
  `repeat_interleave`), and their gradients sum over each group.

The fused kernels
-----------------
Forward: one program per (block of BLOCK_M queries, batch·head). It walks the key blocks with an
online softmax in fp32 (scores in log2 units, exp2 with scale·log2(e) folded into one multiply),
keeps the running max m, sum l and the output accumulator in registers, and writes the output
and (only when a gradient is needed) the log-sum-exp per query row. Key blocks fully visible to
every query of the block run without masks; only the causal diagonal and the ragged last key
block are masked; blocks past the diagonal are never visited. On Hopper, eager launches of
d128 heads from 128 queries, of d64 heads without a causal mask from 512 and of causal d64
heads of 512 to 2048 (no key padding mask, dropout or device-side key count) run the same
forward written in Gluon and warp-specialized (`attention_hopper_fwd`: a TMA loader warp,
consumer warpgroups computing P_j while P_{j-1} V_{j-1} runs), where it measured faster.

Backward: a small kernel computes Δ_i = Σ_d dO·O; then one launch holds the programs that
recompute the probabilities from q, k and the log-sum-exp. Two variants, as PyTorch's own
kernels (`torch.use_deterministic_algorithms` picks):
- deterministic (no atomics): key-block programs accumulate dK, dV over the query blocks that
  see them, query-block programs accumulate dQ over the key blocks they see; P is computed
  twice per tile (7 tile products);
- single pass (default for causal attention, where it measured faster: eager on Hopper, and
  compiled where `utils.compile_tma()` says inductor can launch it): only key-block
  programs, each adding its share of dQ to an fp32 sum with one TMA bulk reduction per tile
  (5 tile products); a last kernel scales and casts dQ. The order of the additions varies
  from run to run, so dQ does in its last bits. On Hopper, eager launches of long heads take
  the same single pass written in Gluon, where it measured faster: without dropout, d128
  heads from 512 queries and d64 heads from 512 (causal ones below 2048) the warp-specialized
  kernel (`attention_hopper_bwd_ws`: a TMA loader warp, two consumer warpgroups of 64 keys
  sharing each step's q and dO), the rest `attention_hopper`'s (explicitly asynchronous
  products, one warpgroup per program).
Eager launches on Hopper stream their tiles (q and dO; the dQ programs' k and v) and add dQ
through TMA descriptors made on the host (`_bwd_descriptors`); traced launches read tiles
through pointers, and the kernel makes dQ's descriptor itself.

Grouped-query attention (GROUP = h / h_kv > 1, a constexpr: GROUP 1 compiles to the
multi-head kernels unchanged): the forward and dQ programs read K, V of head h // GROUP; K and
V are never expanded. A key/value head's key blocks are dealt round its GROUP query heads'
grid rows, and each key-block program sums dK, dV over the group's query heads in registers,
in a fixed order (deterministic in both variants; the single pass still adds dQ per query head).

Program order: a causal head's blocks differ in work (the forward's last query block and the
backward's first key block see the whole head), and each launch orders a head's blocks longest
first. Across heads the grid is dealt block-major over groups of heads whose streamed tensors
fit `LONGEST_FIRST_BYTES` of L2 (`longest_first`), so the last wave holds short blocks, not
the long ones of the last heads (the backward at GPT-2's shape: 355.8 -> 340.3 µs on an H200).

Decoding (at most 16 queries, no gradient): b·h programs would leave most SMs idle over a
long KV cache, so the keys may be split among programs whose partial results
`_attention_fwd_combine_kernel` merges (FlashDecoding). `attention_cached` runs the same forward
with the key count read from a device tensor, for a CUDA-graphed decode step.

Dropout draws keep/drop per (row, key) from Philox keyed by a seed tensor on the device
(`utils.draw_seed`) and the batch·head index: one Philox call per row and 8 keys, eight 16-bit
uniforms (`_jit_helpers.dropout_keep_tile`, whose docstring says why). The backward regenerates
the same mask, nothing is stored, and a CUDA graph replay draws a new mask.

Layouts: q, k, v may have any strides (the model's are views of the packed qkv projection,
(b, n, 3, h, d), read in place). The output is written as a contiguous (b, n_q, h, d) tensor,
which the out-projection reads as (b, n_q, h·d) without a copy; `attention` returns its
(b, h, n_q, d) view. `attention_packed` takes the qkv projection itself and its backward
writes dq, dk and dv straight into one (b, n, 3·h·d) gradient.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op
from triton.tools.tensor_descriptor import TensorDescriptor

from triton_transformer import attention_hopper, attention_hopper_bwd_ws, attention_hopper_fwd
from triton_transformer._jit_helpers import dropout_keep_tile, longest_first
from triton_transformer.bmm import bmm
from triton_transformer.dropout import dropout
from triton_transformer.softmax import softmax
from triton_transformer.utils import (
    LaunchPlans,
    call_op,
    check_dropout_p,
    check_triton_tensor,
    compile_tma,
    dropout_threshold,
    eager_apply,
    first_order_only,
    interpreter_enabled,
    is_traced,
    launcher,
    layout_key,
    next_power_of_2,
    offsets_in,
    opaque_op,
    seed_or_draw,
    sm_count,
    tma_scratch,
    tracing,
    widened_for_interpreter,
)

__all__ = ["HEAD_DIMS", "attention", "attention_cached", "attention_naive", "attention_packed"]

LOG2E = 1.4426950408889634
HEAD_DIMS = tuple(range(16, 129, 16))  # head dims the fused kernels take
_MAX_GRID_Y = 65535  # CUDA's limit on grid dims 1 and 2


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bh_index():
    """batch·head index of this program: grid dim 1, spilling into dim 2 when batch·head
    exceeds CUDA's 65535 (the caller returns for indices >= b·h)."""
    return tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    """a @ b (+ acc) with fp32 accumulation; IEEE: exact products for fp32 operands (else the
    default, tf32, which fp16/bf16 operands ignore)."""
    if IEEE:  # noqa: SIM108
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _row_mask(offs, n, offs_d, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr):
    """Load/store mask of a (rows, BLOCK_D) tile: rows < n, and columns < HEAD_DIM if padded."""
    mask = offs[:, None] < n
    if PAD_D:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    return mask


@triton.jit
def _head_rows(bh, H, N_Q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block tl.program_id(0) of BLOCK_M query rows of batch·head bh, for the row kernels:
    (b, h, row offsets, the same as int64, column offsets, the (rows < n_q, columns <
    HEAD_DIM) mask)."""
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = _row_mask(offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D != HEAD_DIM)
    return b, h, offs_m, offs_m.to(tl.int64), offs_d, mask


@triton.jit
def _fwd_block(
    acc, l_i, m_i, q, k_base, v_base, kpm_base, skn, skd, svn, svd, skpm,
    offs_m, offs_d, lo, hi, N_K, causal_off, qk_scale, seed, threshold,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    DROPOUT: tl.constexpr, DROP_INT64: tl.constexpr,
    INT64_ROWS: tl.constexpr, IEEE: tl.constexpr, FOLD_SCALE: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks [lo, hi). MASKED: mask keys >= n_k and, if CAUSAL, keys
    past each row's diagonal; otherwise every key of every block is visible.

    FOLD_SCALE (scale > 0): the row max is taken on the raw scores and scaled once per row,
    so each score costs one fused multiply-add, s·scale - m, before its exp2 (max commutes
    with a positive scale; -inf masks stay -inf)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if INT64_ROWS:  # noqa: SIM108
            rows_n = offs_n.to(tl.int64)
        else:
            rows_n = offs_n
        if MASKED:
            kmask = offs_n[None, :] < N_K
            if PAD_D:
                kmask = kmask & (offs_d[:, None] < HEAD_DIM)
            k = tl.load(
                k_base + rows_n[None, :] * skn + offs_d[:, None] * skd, mask=kmask, other=0.0
            )
        elif PAD_D:
            k = tl.load(
                k_base + rows_n[None, :] * skn + offs_d[:, None] * skd,
                mask=offs_d[:, None] < HEAD_DIM, other=0.0,
            )  # fmt: skip
        else:
            k = tl.load(k_base + rows_n[None, :] * skn + offs_d[:, None] * skd)
        qk = _mm(q, k, None, IEEE)  # (BLOCK_M, BLOCK_N)
        if FOLD_SCALE:
            row_scale = qk_scale
        else:
            qk = qk * qk_scale  # log2 units
            row_scale = 1.0
        if MASKED:
            visible = offs_n[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_off)
            qk = tl.where(visible, qk, float("-inf"))
        if HAS_KPM:
            real = tl.load(kpm_base + offs_n * skpm, mask=offs_n < N_K, other=0)
            qk = tl.where(real[None, :] != 0, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * row_scale)
        if MASKED or HAS_KPM:  # noqa: SIM108
            # a row that has seen no visible key yet keeps m = -inf: subtract 0 instead,
            # so its p and alpha are exp2(-inf) = 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = tl.math.exp2(qk * row_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = dropout_keep_tile(seed, offs_m, start_n, N_K, threshold, BLOCK_N, DROP_INT64)
            p = tl.where(keep != 0, p, 0.0)
        if MASKED:
            vmask = offs_n[:, None] < N_K
            if PAD_D:
                vmask = vmask & (offs_d[None, :] < HEAD_DIM)
            v = tl.load(
                v_base + rows_n[:, None] * svn + offs_d[None, :] * svd, mask=vmask, other=0.0
            )
        elif PAD_D:
            v = tl.load(
                v_base + rows_n[:, None] * svn + offs_d[None, :] * svd,
                mask=offs_d[None, :] < HEAD_DIM, other=0.0,
            )  # fmt: skip
        else:
            v = tl.load(v_base + rows_n[:, None] * svn + offs_d[None, :] * svd)
        acc = _mm(p.to(v.dtype), v, acc, IEEE)
        m_i = m_new
    return acc, l_i, m_i


# Lengths are not specialised (divisibility by 16 buys nothing behind masks), so a new sequence
# length, e.g. each step of a growing KV cache, never recompiles.
@triton.jit(do_not_specialize=["BH", "H", "N_Q", "N_K"])
def _attention_fwd_kernel(
    Q, K, V, Out, LSE, KPM, SEED, KV_LEN, PART_ACC, PART_ML,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son,
    skpm_b, skpm_n,
    BH, H, N_Q, N_K, qk_scale, threshold, out_scale, SPLIT_LEN, N_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
    DROP_INT64: tl.constexpr, WRITE_LSE: tl.constexpr,
    INT64_ROWS: tl.constexpr, IEEE: tl.constexpr, FOLD_SCALE: tl.constexpr,
    HAS_KV_LEN: tl.constexpr, SPLIT_K: tl.constexpr, GROUP: tl.constexpr,
    LPT_BYTES: tl.constexpr,
):  # fmt: skip
    """GROUP: query heads per key/value head (grouped-query attention): query head h reads
    K and V of head h // GROUP; 1 (multi-head) compiles to the plain indexing. LPT_BYTES:
    causal launches run longest first across heads in groups whose K and V fit this many
    bytes (`longest_first`)."""
    # torch.compile passes Python floats as fp64: compute in fp32 as the eager launch does
    qk_scale, out_scale = tl.cast(qk_scale, tl.float32), tl.cast(out_scale, tl.float32)
    if HAS_KV_LEN:
        # a KV cache whose length lives on the device (a CUDA-graphed decode step): only its
        # first N_K keys are real, and the causal diagonal is placed by that length
        N_K = tl.load(KV_LEN).to(tl.int32)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    bh = _bh_index()
    if bh >= BH:
        return
    n_blocks = tl.cdiv(N_Q, BLOCK_M)
    pid_m = tl.program_id(0)
    if CAUSAL and not SPLIT_K:  # each program streams its head's K and V
        pid_m, bh = longest_first(pid_m, bh, BH, tl.cast(N_K, tl.int64) * HEAD_DIM * 4, LPT_BYTES)
    split = 0
    if SPLIT_K:  # grid dim 0 holds (split, query block) pairs
        split = pid_m // n_blocks
        pid_m = pid_m % n_blocks
    if CAUSAL:
        pid_m = n_blocks - 1 - pid_m  # the longest rows (most key blocks) start first
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if INT64_ROWS:  # noqa: SIM108
        rows_m = offs_m.to(tl.int64)
    else:
        rows_m = offs_m

    q_mask = _row_mask(offs_m, N_Q, offs_d, HEAD_DIM, PAD_D)
    q = tl.load(
        Q + b * sqb + h * sqh + rows_m[:, None] * sqn + offs_d[None, :] * sqd,
        mask=q_mask,
        other=0.0,
    )
    if GROUP == 1:  # noqa: SIM108
        h_kv = h
    else:
        h_kv = h // GROUP
    k_base = K + b * skb + h_kv * skh
    v_base = V + b * svb + h_kv * svh
    kpm_base = KPM + b * skpm_b

    seed = 0
    if DROPOUT:
        seed = tl.load(SEED) + (bh.to(tl.int64) << 32)  # one Philox key per batch·head

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    causal_off = N_K - N_Q  # query i sees keys j <= i + causal_off
    m0 = pid_m * BLOCK_M
    if CAUSAL:
        # keys < m0 + causal_off + 1 are visible to every row of the block; rows end at
        # m0 + BLOCK_M - 1 + causal_off; later key blocks are skipped altogether
        full_end = tl.minimum(tl.maximum(m0 + causal_off + 1, 0), N_K)
        full_end = (full_end // BLOCK_N) * BLOCK_N
        hi = tl.minimum(tl.maximum(m0 + BLOCK_M + causal_off, 0), N_K)
    else:
        full_end = (N_K // BLOCK_N) * BLOCK_N
        hi = N_K
    # unmasked key blocks [lo, mid), masked ones [mid2, end)
    lo = 0
    mid = full_end
    mid2 = full_end
    end = hi
    if SPLIT_K:  # this program's share: keys [split·SPLIT_LEN, (split + 1)·SPLIT_LEN)
        lo = split * SPLIT_LEN
        mid = tl.maximum(tl.minimum(full_end, lo + SPLIT_LEN), lo)
        mid2 = tl.maximum(full_end, lo)
        end = tl.minimum(hi, lo + SPLIT_LEN)
    acc, l_i, m_i = _fwd_block(
        acc, l_i, m_i, q, k_base, v_base, kpm_base, skn, skd, svn, svd, skpm_n,
        offs_m, offs_d, lo, mid, N_K, causal_off, qk_scale, seed, threshold,
        BLOCK_N, HEAD_DIM, PAD_D, False, CAUSAL, HAS_KPM, DROPOUT, DROP_INT64,
        INT64_ROWS, IEEE, FOLD_SCALE,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_block(
        acc, l_i, m_i, q, k_base, v_base, kpm_base, skn, skd, svn, svd, skpm_n,
        offs_m, offs_d, mid2, end, N_K, causal_off, qk_scale, seed, threshold,
        BLOCK_N, HEAD_DIM, PAD_D, True, CAUSAL, HAS_KPM, DROPOUT, DROP_INT64,
        INT64_ROWS, IEEE, FOLD_SCALE,
    )  # fmt: skip

    if SPLIT_K:
        # the split's unnormalised accumulator and its (m, l):
        # `_attention_fwd_combine_kernel` merges
        part = (bh.to(tl.int64) * N_SPLITS + split) * N_Q + offs_m
        in_q = offs_m < N_Q
        tl.store(PART_ACC + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=in_q[:, None])
        tl.store(PART_ML + part * 2, m_i, mask=in_q)
        tl.store(PART_ML + part * 2 + 1, l_i, mask=in_q)
        return

    seen = l_i > 0.0  # rows that saw no key output zeros
    inv_l = tl.where(seen, out_scale / tl.where(seen, l_i, 1.0), 0.0)
    out = acc * inv_l[:, None]
    o_ptrs = Out + b * sob + h * soh + rows_m[:, None] * son + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_mask)
    if WRITE_LSE:
        # +inf for rows that saw nothing: the backward's exp2(s - lse) is then 0
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
        tl.store(LSE + bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


# Split-K decoding (FlashDecoding): with a few queries per head, b·h programs leave most of the
# GPU idle over a long KV cache, so the keys are split among programs. Split s returns its
# running max m_s (log2 units), sum l_s = Σ_j 2^(x_j - m_s) and accumulator a_s = Σ_j
# 2^(x_j - m_s) v_j; with M = max_s m_s the attention output is
#     o = Σ_s 2^(m_s - M) a_s / Σ_s 2^(m_s - M) l_s,
# summed over s in a fixed order (deterministic). A split that saw no key has m_s = -inf,
# l_s = 0 and drops out; a row no split saw outputs zeros.
@triton.jit(do_not_specialize=["BH", "H", "N_Q", "N_SPLITS"])
def _attention_fwd_combine_kernel(
    PART_ACC, PART_ML, Out, sob, soh, son, BH, H, N_Q, N_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One program per (query row, batch·head); BLOCK_S splits are merged per step, loaded
    together (a loop of one split per step would wait on memory N_SPLITS times)."""
    bh = _bh_index()
    if bh >= BH:
        return
    row = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    m_tot = tl.full([], float("-inf"), tl.float32)
    l_tot = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, N_SPLITS, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        in_s = offs_s < N_SPLITS
        part = (bh.to(tl.int64) * N_SPLITS + offs_s) * N_Q + row
        m_s = tl.load(PART_ML + part * 2, mask=in_s, other=float("-inf"))
        l_s = tl.load(PART_ML + part * 2 + 1, mask=in_s, other=0.0)
        a_s = tl.load(
            PART_ACC + part[:, None] * BLOCK_D + offs_d[None, :], mask=in_s[:, None], other=0.0
        )
        m_new = tl.maximum(m_tot, tl.max(m_s, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN
        alpha = tl.math.exp2(m_tot - m_sub)
        w = tl.math.exp2(m_s - m_sub)  # 0 for splits that saw no key
        l_tot = l_tot * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha + tl.sum(w[:, None] * a_s, 0)
        m_tot = m_new
    out = acc * tl.where(l_tot > 0.0, 1.0 / tl.where(l_tot > 0.0, l_tot, 1.0), 0.0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    tl.store(
        Out + b * sob + h * soh + row.to(tl.int64) * son + offs_d,
        out.to(Out.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit(do_not_specialize=["BH", "H", "N_Q"])
def _attention_bwd_delta_kernel(
    Out, DO, DELTA, DQ_ACC, sob, soh, son, sdob, sdoh, sdon, sdod, BH, H, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ZERO_DQ: tl.constexpr,
):  # fmt: skip
    """Δ_i = Σ_d O[i, d] · dO[i, d] in fp32. ZERO_DQ: also zero the rows of the fp32 dQ
    accumulator (b·h, n_q, HEAD_DIM) that the single-pass backward adds into (no memset
    launch of its own)."""
    bh = _bh_index()
    if bh >= BH:
        return
    b, h, offs_m, rows, offs_d, mask = _head_rows(bh, H, N_Q, HEAD_DIM, BLOCK_D, BLOCK_M)
    o = tl.load(
        Out + b * sob + h * soh + rows[:, None] * son + offs_d[None, :], mask=mask, other=0.0
    )
    do = tl.load(
        DO + b * sdob + h * sdoh + rows[:, None] * sdon + offs_d[None, :] * sdod,
        mask=mask, other=0.0,
    )  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)
    if ZERO_DQ:
        acc_ptrs = DQ_ACC + (bh.to(tl.int64) * N_Q + rows[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(acc_ptrs, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=mask)


@triton.jit(do_not_specialize=["BH", "H", "N_Q"])
def _attention_bwd_dq_kernel(
    DQ_ACC, DQ, off_dq, sdqb, sdqh, sdqn, sdqd, BH, H, N_Q, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """DQ + off_dq (any strides, q's dtype) = sm_scale · DQ_ACC, the fp32 sum the single-pass
    backward's key-block programs added up."""
    bh = _bh_index()
    if bh >= BH:
        return
    b, h, _, rows, offs_d, mask = _head_rows(bh, H, N_Q, HEAD_DIM, BLOCK_D, BLOCK_M)
    acc = tl.load(
        DQ_ACC + (bh.to(tl.int64) * N_Q + rows[:, None]) * HEAD_DIM + offs_d[None, :],
        mask=mask, other=0.0,
    )  # fmt: skip
    dq = acc * tl.cast(sm_scale, tl.float32)
    dq_ptrs = DQ + off_dq + b * sdqb + h * sdqh + rows[:, None] * sdqn + offs_d[None, :] * sdqd
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=mask)


@triton.jit
def _head_tile(desc, b, h, row):
    """Rows [row, row + block) of head (b, h) of a host-made (b, h, n, d) TMA descriptor, as a
    2-D tile; rows past n and columns past d read as zeros."""
    tile = desc.load([b.to(tl.int32), h.to(tl.int32), row, 0])  # (descriptor offsets: 32-bit)
    return tile.reshape(tile.shape[2], tile.shape[3])


@triton.jit
def _bwd_dkdv_block(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_acc, key_real, b, h, bh,
    sqn, sqd, sdon, sdod, son, sdqn, sdqd,
    n0, offs_n, offs_d, lo, hi, N_Q, N_K, causal_off, qk_scale, sm_scale, seed, threshold,
    drop_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
    MASKED: tl.constexpr, DROPOUT: tl.constexpr, DROP_INT64: tl.constexpr,
    INT64_ROWS: tl.constexpr, IEEE: tl.constexpr, ATOMIC_DQ: tl.constexpr, HAS_KPM: tl.constexpr,
    DQ_TMA: tl.constexpr, TMA: tl.constexpr, DQ_DIRECT: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block over query blocks [lo, hi), in transposed (key, query) tiles.
    MASKED: apply the causal diagonal. Rows >= n_q load lse = +inf, hence p = 0.

    TMA: q_base, do_base are (b, h, n_q, HEAD_DIM) descriptors, read at head (b, h).
    ATOMIC_DQ: also add this key block's share of dQ, dSᵀᵀ K (unscaled), to the fp32
    (b·h, n_q, HEAD_DIM) sum: with DQ_TMA `dq_acc` is its descriptor, whose bulk reduce (one
    TMA instruction per tile) adds it in L2 at head bh, else the pointer to head bh's rows,
    added element by element with atomics.
    DQ_DIRECT (the head's only key block): this block's dS K is all of dQ, stored scaled
    through `dq_acc`, head (b, h)'s dQ (row stride sdqn, column stride sdqd), and Δ is summed
    here from O (`delta_base`: head (b, h) of the output, row stride son) and dO.
    Either way padded keys (key_real 0) get p = 0 here: their dS must not reach dQ."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if INT64_ROWS:  # noqa: SIM108
            rows_m = offs_m.to(tl.int64)
        else:
            rows_m = offs_m
        mask = _row_mask(offs_m, N_Q, offs_d, HEAD_DIM, PAD_D)
        if TMA:  # zero-filled past n_q and HEAD_DIM
            q = _head_tile(q_base, b, h, start_m)
            do = _head_tile(do_base, b, h, start_m)
        else:
            q = tl.load(
                q_base + rows_m[:, None] * sqn + offs_d[None, :] * sqd, mask=mask, other=0.0
            )
            do = tl.load(
                do_base + rows_m[:, None] * sdon + offs_d[None, :] * sdod, mask=mask, other=0.0
            )
        do = do.to(q.dtype)
        lse = tl.load(lse_base + offs_m, mask=offs_m < N_Q, other=float("inf"))
        if DQ_DIRECT:  # Δ_i = Σ_d O[i, d] · dO[i, d], as `_attention_bwd_delta_kernel` sums it
            o_ptrs = delta_base + rows_m[:, None] * son + offs_d[None, :]
            o = tl.load(o_ptrs, mask=mask, other=0.0)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        else:
            delta = tl.load(delta_base + offs_m, mask=offs_m < N_Q, other=0.0)
        qkT = _mm(k, tl.trans(q), None, IEEE) * qk_scale  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(qkT - lse[None, :])
        if MASKED:
            pT = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_off, pT, 0.0)
        if (ATOMIC_DQ or DQ_DIRECT) and HAS_KPM:
            pT = tl.where(key_real[:, None] != 0, pT, 0.0)
        dpT = _mm(v, tl.trans(do), None, IEEE)  # (dO Vᵀ)ᵀ
        if DROPOUT:
            keepT = tl.trans(
                dropout_keep_tile(seed, offs_m, n0, N_K, threshold, BLOCK_N, DROP_INT64)
            )
            pdT = tl.where(keepT != 0, pT * drop_scale, 0.0)
            dpT = tl.where(keepT != 0, dpT * drop_scale, 0.0)
        else:
            pdT = pT
        dv = _mm(pdT.to(do.dtype), do, dv, IEEE)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = _mm(dsT, q, dk, IEEE)
        if ATOMIC_DQ:
            dq = _mm(tl.trans(dsT), k, None, IEEE)  # (BLOCK_M, BLOCK_D)
            if DQ_TMA:  # rows >= n_q and columns >= HEAD_DIM fall outside: clipped
                tile = dq.reshape(1, dq.shape[0], dq.shape[1])
                dq_acc.atomic_add([bh.to(tl.int32), start_m, 0], tile)
            else:
                dq_ptrs = dq_acc + rows_m[:, None] * HEAD_DIM + offs_d[None, :]
                tl.atomic_add(dq_ptrs, dq, mask=mask, sem="relaxed")
        if DQ_DIRECT:
            dq = _mm(tl.trans(dsT), k, None, IEEE) * sm_scale
            dq_ptrs = dq_acc + rows_m[:, None] * sdqn + offs_d[None, :] * sdqd
            tl.store(dq_ptrs, dq.to(dq_acc.dtype.element_ty), mask=mask)
    return dk, dv


@triton.jit
def _bwd_dq_block(
    dq, q, do, lse, delta, k_base, v_base, b, h_kv, kpm_base, skn, skd, svn, svd, skpm,
    offs_m, offs_d, lo, hi, N_K, causal_off, qk_scale, seed, threshold, drop_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, MASKED: tl.constexpr,
    HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, DROP_INT64: tl.constexpr,
    INT64_ROWS: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """dQ of one query block over key blocks [lo, hi). Keys >= n_k load as zero rows, so they
    add nothing to dQ = dS K; MASKED applies the causal diagonal. TMA: k_base, v_base are
    (b, h_kv, n_k, HEAD_DIM) descriptors, read at head (b, h_kv)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if INT64_ROWS:  # noqa: SIM108
            rows_n = offs_n.to(tl.int64)
        else:
            rows_n = offs_n
        if TMA:  # zero-filled past n_k and HEAD_DIM
            k = _head_tile(k_base, b, h_kv, start_n)
            v = _head_tile(v_base, b, h_kv, start_n)
        else:
            mask = _row_mask(offs_n, N_K, offs_d, HEAD_DIM, PAD_D)
            k = tl.load(
                k_base + rows_n[:, None] * skn + offs_d[None, :] * skd, mask=mask, other=0.0
            )
            v = tl.load(
                v_base + rows_n[:, None] * svn + offs_d[None, :] * svd, mask=mask, other=0.0
            )
        qk = _mm(q, tl.trans(k), None, IEEE) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk - lse[:, None])
        if MASKED:
            p = tl.where(offs_n[None, :] <= offs_m[:, None] + causal_off, p, 0.0)
        if HAS_KPM:
            real = tl.load(kpm_base + offs_n * skpm, mask=offs_n < N_K, other=0)
            p = tl.where(real[None, :] != 0, p, 0.0)
        dp = _mm(do, tl.trans(v), None, IEEE)
        if DROPOUT:
            keep = dropout_keep_tile(seed, offs_m, start_n, N_K, threshold, BLOCK_N, DROP_INT64)
            dp = tl.where(keep != 0, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = _mm(ds.to(k.dtype), k, dq, IEEE)
    return dq


@triton.jit
def _bwd_dkdv_head(
    dk, dv, k, v, q_src, do_src, lse_base, delta_base, dq_src, kpm_base, b, h, bh,
    sqn, sqd, sdon, sdod, son, sdqn, sdqd, skpm_n,
    n0, offs_n, offs_d, N_Q, N_K, causal_off, qk_scale, sm_scale, seed, threshold, drop_scale,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
    DROP_INT64: tl.constexpr, INT64_ROWS: tl.constexpr,
    IEEE: tl.constexpr, ATOMIC_DQ: tl.constexpr, HAS_KPM: tl.constexpr,
    DQ_TMA: tl.constexpr, TMA: tl.constexpr, DQ_DIRECT: tl.constexpr,
):  # fmt: skip
    """dK, dV of the key block at n0 over every query block of one query head (b, h), batch·head
    bh: its q and dO (TMA: the (b, h, n_q, HEAD_DIM) descriptors; else pointers to the head),
    lse and Δ at the given bases, added to dk, dv; with ATOMIC_DQ also that head's dQ share
    (dq_src: DQ_TMA the sum's (b·h, n_q, HEAD_DIM) descriptor, else its pointer); with
    DQ_DIRECT the head's dQ itself (dq_src: the head's dQ, delta_base: the head's output O;
    see `_bwd_dkdv_block`). A key-block program calls it once (multi-head) or once per query
    head of its group (grouped-query attention)."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    dq_acc = dq_src
    if ATOMIC_DQ and not DQ_TMA:
        dq_acc = dq_src + bh.to(tl.int64) * N_Q * HEAD_DIM  # this head's dQ sum
    key_real = 1
    if HAS_KPM:
        key_real = tl.load(kpm_base + offs_n * skpm_n, mask=offs_n < N_K, other=0)
    if CAUSAL:
        # rows i >= n0 - causal_off see some key of the block; rows
        # i >= n0 + BLOCK_N1 - 1 - causal_off see all of them. DQ_DIRECT walks every row
        # (under the mask) instead: each row's dQ, zero where it sees no key, is stored here.
        lo = (tl.maximum(n0 - causal_off, 0) // BLOCK_M1) * BLOCK_M1
        if DQ_DIRECT:
            lo = 0
        full_lo = tl.maximum(n0 + BLOCK_N1 - 1 - causal_off, 0)
        full_lo = tl.minimum(
            tl.cdiv(full_lo, BLOCK_M1) * BLOCK_M1, tl.cdiv(N_Q, BLOCK_M1) * BLOCK_M1
        )
        full_lo = tl.maximum(full_lo, lo)
        dk, dv = _bwd_dkdv_block(
            dk, dv, k, v, q_src, do_src, lse_base, delta_base, dq_acc, key_real, b, h, bh,
            sqn, sqd, sdon, sdod, son, sdqn, sdqd,
            n0, offs_n, offs_d, lo, full_lo, N_Q, N_K, causal_off, qk_scale, sm_scale, seed,
            threshold, drop_scale, BLOCK_M1, BLOCK_N1, HEAD_DIM, PAD_D, True, DROPOUT,
            DROP_INT64, INT64_ROWS, IEEE, ATOMIC_DQ, HAS_KPM, DQ_TMA, TMA, DQ_DIRECT,
        )  # fmt: skip
    else:
        full_lo = 0
    dk, dv = _bwd_dkdv_block(
        dk, dv, k, v, q_src, do_src, lse_base, delta_base, dq_acc, key_real, b, h, bh,
        sqn, sqd, sdon, sdod, son, sdqn, sdqd,
        n0, offs_n, offs_d, full_lo, N_Q, N_Q, N_K, causal_off, qk_scale, sm_scale, seed,
        threshold, drop_scale, BLOCK_M1, BLOCK_N1, HEAD_DIM, PAD_D, False, DROPOUT,
        DROP_INT64, INT64_ROWS, IEEE, ATOMIC_DQ, HAS_KPM, DQ_TMA, TMA, DQ_DIRECT,
    )  # fmt: skip
    return dk, dv


@triton.jit(do_not_specialize=["BH", "H", "N_Q", "N_K"])
def _attention_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, LSE, DELTA, KPM, SEED, DQ_ACC, OUT,
    Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC, off_dq, off_dk, off_dv,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdon, sdod,
    sdqb, sdqh, sdqn, sdqd, sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, sob, soh, son,
    skpm_b, skpm_n,
    BH, H, N_Q, N_K, qk_scale, sm_scale, threshold, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
    DROP_INT64: tl.constexpr, INT64_ROWS: tl.constexpr,
    IEEE: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
    DQ_HOST_DESC: tl.constexpr, TMA: tl.constexpr, DQ_DIRECT: tl.constexpr,
    GROUP: tl.constexpr, PACKED_GRADS: tl.constexpr, LPT_BYTES: tl.constexpr,
):  # fmt: skip
    """Programs [0, cdiv(n_k, BLOCK_N1)) compute dK, dV of one key block; the rest dQ of one
    query block. Each output element is written by exactly one program: no atomics. dQ, dK
    and dV start at DQ + off_dq, DK + off_dk and DV + off_dv (elements); PACKED_GRADS: all
    three live in DQ's tensor (the packed op's d(qkv)) and DK, DV are unused placeholders.

    GROUP > 1 (grouped-query attention, query head h reading key/value head h // GROUP): the
    key blocks of a key/value head are dealt round the grid rows of its GROUP query heads
    (row h takes blocks h % GROUP, h % GROUP + GROUP, ...: cdiv(n_k, BLOCK_N1 · GROUP)
    key-block programs per row), and each sums dK, dV over the group's query heads in
    registers, in a fixed order. dQ programs stay one per query head.

    ATOMIC_DQ (single pass, non-deterministic): only the key-block programs run, and each
    adds its share of dQ into DQ_ACC (fp32, (b·h, n_q, HEAD_DIM)) with atomics;
    `_attention_bwd_dq_kernel` then scales and casts it into DQ. P is computed once per
    (query, key) tile instead of twice: 5 tile products instead of 7.

    DQ_DIRECT (heads of one key block: n_k <= BLOCK_N1): only the key-block programs run,
    one per head, and each stores its head's dQ whole, with Δ summed from OUT, the forward's
    (b, n_q, h, d) output (strides sob, soh, son; unit stride along d), instead of read from
    DELTA: one launch for the whole backward, no fp32 sum, and still one writer per output
    element.

    TMA descriptors, made on the host and passed as launch parameters (made in the kernel,
    each program paid a global write, a fence and a barrier per descriptor, per head of its
    group): TMA, the tiles streamed by q and dO (Q_DESC, DO_DESC) and by k and v (K_DESC,
    V_DESC), each over its (b, h, n, HEAD_DIM) view, zeros past n and HEAD_DIM; DQ_TMA, the
    dQ sum's bulk reductions through DQ_DESC over DQ_ACC as (b·h, n_q, HEAD_DIM), or, without
    DQ_HOST_DESC (traced launches), a descriptor of it made here once. Descriptors not used
    are placeholders."""
    # torch.compile passes Python floats as fp64: compute in fp32 as the eager launch does
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    if PACKED_GRADS:
        DK = DQ
        DV = DQ
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    bh = _bh_index()
    if bh >= BH:
        return
    pid = tl.program_id(0)
    if CAUSAL:  # each program streams its head's q and dO (dQ programs: k and v)
        pid, bh = longest_first(pid, bh, BH, tl.cast(N_Q, tl.int64) * HEAD_DIM * 4, LPT_BYTES)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    if GROUP == 1:  # noqa: SIM108
        h_kv = h
    else:
        h_kv = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    dq_src = DQ_ACC
    if DQ_TMA:
        if DQ_HOST_DESC:
            dq_src = DQ_DESC
        else:
            dq_src = tl.make_tensor_descriptor(
                DQ_ACC, [BH, N_Q, HEAD_DIM], [tl.cast(N_Q, tl.int64) * HEAD_DIM, HEAD_DIM, 1],
                [1, BLOCK_M1, BLOCK_D],
            )  # fmt: skip
    if DQ_DIRECT:  # each head's own dQ and O (see `_bwd_dkdv_block`)
        dq_src = DQ + off_dq + b * sdqb + h * sdqh
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h_kv * skh
    v_base = V + b * svb + h_kv * svh
    do_base = DO + b * sdob + h * sdoh
    lse_base = LSE + bh.to(tl.int64) * N_Q
    delta_base = DELTA + bh.to(tl.int64) * N_Q
    if DQ_DIRECT:
        delta_base = OUT + b * sob + h * soh
    kpm_base = KPM + b * skpm_b
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED) + (bh.to(tl.int64) << 32)
    causal_off = N_K - N_Q  # query i sees keys j <= i + causal_off
    n_kblocks = tl.cdiv(N_K, BLOCK_N1)
    if GROUP == 1:
        n_kprog = n_kblocks
        kb = pid
    else:
        h_in_group = bh % H % GROUP
        n_kprog = tl.cdiv(n_kblocks, GROUP)
        kb = pid * GROUP + h_in_group  # may pass the last block: then nothing to do

    if pid < n_kprog:
        n0 = kb * BLOCK_N1
        offs_n = n0 + tl.arange(0, BLOCK_N1)
        if INT64_ROWS:  # noqa: SIM108
            rows_n = offs_n.to(tl.int64)
        else:
            rows_n = offs_n
        kv_mask = _row_mask(offs_n, N_K, offs_d, HEAD_DIM, PAD_D)
        k = tl.load(k_base + rows_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + rows_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N1, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N1, BLOCK_D], tl.float32)
        if GROUP == 1:
            q_src, do_src = q_base, do_base  # where q and dO stream from
            if TMA:
                q_src, do_src = Q_DESC, DO_DESC
            dk, dv = _bwd_dkdv_head(
                dk, dv, k, v, q_src, do_src, lse_base, delta_base, dq_src, kpm_base, b, h, bh,
                sqn, sqd, sdon, sdod, son, sdqn, sdqd, skpm_n,
                n0, offs_n, offs_d, N_Q, N_K, causal_off, qk_scale, sm_scale, seed, threshold,
                drop_scale, BLOCK_M1, BLOCK_N1, HEAD_DIM, BLOCK_D, CAUSAL, DROPOUT, DROP_INT64,
                INT64_ROWS, IEEE, ATOMIC_DQ, HAS_KPM, DQ_TMA, TMA, DQ_DIRECT,
            )  # fmt: skip
        else:
            # sum over the group's query heads, h_kv·GROUP + g, in a fixed order (none for a
            # spare program past the last key block)
            bh0 = bh - h_in_group  # batch·head index of the group's first query head
            for g in range(0, tl.where(kb < n_kblocks, GROUP, 0)):
                bh_g = bh0 + g
                h_g = (bh_g % H).to(tl.int64)
                seed_g = 0
                if DROPOUT:
                    seed_g = tl.load(SEED) + (bh_g.to(tl.int64) << 32)
                q_src, do_src = Q + b * sqb + h_g * sqh, DO + b * sdob + h_g * sdoh
                if TMA:
                    q_src, do_src = Q_DESC, DO_DESC
                delta_g, dq_g = DELTA + bh_g.to(tl.int64) * N_Q, dq_src
                if DQ_DIRECT:
                    delta_g, dq_g = OUT + b * sob + h_g * soh, DQ + off_dq + b * sdqb + h_g * sdqh
                dk, dv = _bwd_dkdv_head(
                    dk, dv, k, v, q_src, do_src, LSE + bh_g.to(tl.int64) * N_Q, delta_g, dq_g,
                    kpm_base, b, h_g, bh_g, sqn, sqd, sdon, sdod, son, sdqn, sdqd, skpm_n,
                    n0, offs_n, offs_d, N_Q, N_K, causal_off, qk_scale, sm_scale, seed_g,
                    threshold, drop_scale, BLOCK_M1, BLOCK_N1, HEAD_DIM, BLOCK_D, CAUSAL,
                    DROPOUT, DROP_INT64, INT64_ROWS, IEEE, ATOMIC_DQ, HAS_KPM, DQ_TMA, TMA,
                    DQ_DIRECT,
                )  # fmt: skip
        dk = dk * sm_scale
        if HAS_KPM:  # a padded key has p = 0 in every row: no gradient
            real = tl.load(kpm_base + offs_n * skpm_n, mask=offs_n < N_K, other=0)
            dk = tl.where(real[:, None] != 0, dk, 0.0)
            dv = tl.where(real[:, None] != 0, dv, 0.0)
        b_dk = (
            DK + off_dk + b * sdkb + h_kv * sdkh + rows_n[:, None] * sdkn + offs_d[None, :] * sdkd
        )
        tl.store(b_dk, dk.to(DK.dtype.element_ty), mask=kv_mask)
        b_dv = (
            DV + off_dv + b * sdvb + h_kv * sdvh + rows_n[:, None] * sdvn + offs_d[None, :] * sdvd
        )
        tl.store(b_dv, dv.to(DV.dtype.element_ty), mask=kv_mask)
    else:
        pid_m = pid - n_kprog
        if CAUSAL:
            pid_m = tl.cdiv(N_Q, BLOCK_M2) - 1 - pid_m  # longest rows first
        m0 = pid_m * BLOCK_M2
        offs_m = m0 + tl.arange(0, BLOCK_M2)
        if INT64_ROWS:  # noqa: SIM108
            rows_m = offs_m.to(tl.int64)
        else:
            rows_m = offs_m
        q_mask = _row_mask(offs_m, N_Q, offs_d, HEAD_DIM, PAD_D)
        q = tl.load(q_base + rows_m[:, None] * sqn + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
        do = tl.load(
            do_base + rows_m[:, None] * sdon + offs_d[None, :] * sdod, mask=q_mask, other=0.0
        )
        do = do.to(q.dtype)
        lse = tl.load(lse_base + offs_m, mask=offs_m < N_Q, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=offs_m < N_Q, other=0.0)
        dq = tl.zeros([BLOCK_M2, BLOCK_D], tl.float32)
        k_src, v_src = k_base, v_base  # where k and v stream from
        if TMA:
            k_src, v_src = K_DESC, V_DESC
        if CAUSAL:
            full_end = tl.minimum(tl.maximum(m0 + causal_off + 1, 0), N_K)
            full_end = (full_end // BLOCK_N2) * BLOCK_N2
            hi = tl.minimum(tl.maximum(m0 + BLOCK_M2 + causal_off, 0), N_K)
            dq = _bwd_dq_block(
                dq, q, do, lse, delta, k_src, v_src, b, h_kv, kpm_base, skn, skd, svn, svd, skpm_n,
                offs_m, offs_d, full_end, hi, N_K, causal_off, qk_scale, seed, threshold,
                drop_scale, BLOCK_N2, HEAD_DIM, PAD_D, True, HAS_KPM, DROPOUT, DROP_INT64,
                INT64_ROWS, IEEE, TMA,
            )  # fmt: skip
        else:
            full_end = N_K
        dq = _bwd_dq_block(
            dq, q, do, lse, delta, k_src, v_src, b, h_kv, kpm_base, skn, skd, svn, svd, skpm_n,
            offs_m, offs_d, 0, full_end, N_K, causal_off, qk_scale, seed, threshold,
            drop_scale, BLOCK_N2, HEAD_DIM, PAD_D, False, HAS_KPM, DROPOUT, DROP_INT64,
            INT64_ROWS, IEEE, TMA,
        )  # fmt: skip
        dq = dq * sm_scale
        b_dq = DQ + off_dq + b * sdqb + h * sdqh + rows_m[:, None] * sdqn + offs_d[None, :] * sdqd
        tl.store(b_dq, dq.to(DQ.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------------------------


@functools.cache
def _attention_fwd_config(
    decode: bool, d: int, dtype: torch.dtype, causal: bool, dropout: bool
) -> dict:
    """Forward tiles for one problem class: a fixed table, not runtime autotuning (no
    benchmarking on a first call, and the same tiles, hence the same summation order, on
    every run). bf16/fp16 entries are the winners of `benchmarks/bench_attention.py --sweep`
    on an H200 (seq 4096, 2026-11-22; TFLOP/s in the comments, runner-up within 2% where
    noted); rerun it on other GPUs. Every entry fits the H200's 227 KiB of shared memory
    (`tests/test_attention.py::test_gpu_every_option` launches each class); a GPU with less
    gets smaller tiles from `_launch_fitting`."""
    if dtype == torch.float32:  # ieee fp32 runs on FMA units: small tiles, few registers
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if decode:  # n_q <= 16: a few queries against a long KV cache
        return {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
    if d <= 64 and causal:  # 381 (128x64, 4 warps: 375)
        # registers capped so that one more program fits each SM (uncapped: 133 per thread
        # without dropout, 175 with; 65,536 per SM): 7-10% faster at the step presets
        # without dropout, 13-15% with (`probe_attention_regs.py`, H200, 2026-11-27).
        # Traced launches run uncapped (`_launch_fitting`).
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                "maxnreg": 152 if dropout else 128}  # fmt: skip
    if d <= 64:  # 436 (4 warps: 429)
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    if causal and dropout:
        # the 4-warp tile below needs 254 registers per thread with the mask's draws: 1128
        # against 1549 µs at (4, 4096, 16) d128, p = 0.1 (`probe_attention_regs.py`, H200,
        # 2026-11-27; without dropout both take 607-611)
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    if causal:  # 442 at 4096, 225 at 512 (128x64, 8 warps: 432 and 203; profiler, 2026-11-22)
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if dropout:
        # 128x128 tiles in 3 stages plus the mask's layout conversions need 240 KiB of shared
        # memory (the H200 has 227): two stages
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}  # 493


@functools.cache
def _attention_bwd_config(
    d: int, dtype: torch.dtype, causal: bool, dropout: bool = False, atomic: bool = False
) -> dict:
    """Backward tiles: key blocks of BLOCK_N1 stepping over BLOCK_M1 queries (dK, dV), query
    blocks of BLOCK_M2 stepping over BLOCK_N2 keys (dQ; unused by the single-pass `atomic`
    kernel). Sweep winners as in `_attention_fwd_config` (TFLOP/s counting the backward as 2.5
    forwards)."""
    if atomic:
        return _ATOMIC_BWD[d <= 64, dtype == torch.float32]
    if dtype == torch.float32:
        return {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
                "num_warps": 4, "num_stages": 2}  # fmt: skip
    if d <= 64 and causal and dropout:
        # the mask's Philox draws favour narrower dQ key tiles: 145 vs 165 us at b16 h8 seq 512,
        # 51.6 vs 54.0 at b4, 404 vs 398 at b4 seq 2048 (p = 0.1, profiler, 2026-11-22)
        return {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
                "num_warps": 4, "num_stages": 3}  # fmt: skip
    if d <= 64 and causal:  # 238
        return {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64,
                "num_warps": 4, "num_stages": 3}  # fmt: skip
    if d <= 64:  # 338
        return {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32,
                "num_warps": 4, "num_stages": 3}  # fmt: skip
    # d 128: 363 non-causal, 281 causal (the d <= 64 tiles: 158 and 134, register spills)
    return {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
            "num_warps": 8, "num_stages": 3}  # fmt: skip


def _atomic_tiles(m1: int, n1: int, warps: int, stages: int) -> dict:
    # BLOCK_M2/N2 size the dQ programs, which the single pass does not launch
    return {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": 16, "BLOCK_N2": 16,
            "num_warps": warps, "num_stages": stages}  # fmt: skip


# Single-pass backward tiles per (d <= 64, fp32), causal only (see `_single_pass`): the
# winners of `bench_attention.py --sweep` on an H100 (2026-11-24, kernel time; TFLOP/s at seq
# 1024 / 4096, against the two-program kernel's best in brackets): d64 186 / 262 (181 / 242),
# d128 211 / 311 (207 / 287).
_ATOMIC_BWD = {
    (True, False): _atomic_tiles(64, 64, 4, 3),
    (False, False): _atomic_tiles(64, 128, 8, 2),
    (True, True): _atomic_tiles(32, 64, 4, 2),
    (False, True): _atomic_tiles(32, 64, 4, 2),
}


def _single_pass(causal: bool, deterministic: bool, dq_tma: bool, interpret: bool) -> bool:
    """Whether the backward takes the single pass (dQ added by TMA bulk reductions).

    It is faster where it skips the most recomputation relative to its reductions: causal
    attention, +2-10% on an H100 (sweep above). Without a causal mask the two-program kernel
    measured faster (d64 at seq 1024: 300 TFLOP/s against 244; d128: 326 against 299), so it
    stays the default there, deterministic or not. The interpreter runs the single pass's
    math (with plain atomics) for its tests."""
    if deterministic:
        return False
    return interpret or (dq_tma and causal)


# Heads of at most this many queries whose keys fit one key-block program take the
# one-launch backward (`_one_launch`); longer ones spread their query blocks over programs.
ONE_LAUNCH_MAX_QUERIES = 128


def _one_launch(
    q: torch.Tensor, k: torch.Tensor, causal: bool, dropping: bool, config: dict | None,
    interpret: bool,
) -> bool:  # fmt: skip
    """Whether a Triton backward (not Gluon's) of these (b, h, n, d) views takes one launch
    (`_attention_bwd_kernel`'s DQ_DIRECT): every key of a head fits one key block of the
    two-program tiles, and at most ONE_LAUNCH_MAX_QUERIES queries. Then a head's one
    key-block program sees every (query, key) pair, so it can sum Δ itself and store dQ
    whole: no Δ launch, no dQ programs or fp32 sum, and, with one writer per element,
    deterministic as the two-program kernel is. Short heads are launch-bound: the kernels
    saved are most of their time."""
    if q.shape[2] > ONE_LAUNCH_MAX_QUERIES:
        return False
    if config is None:
        d = int(q.shape[3])
        config = _INTERP_BWD if interpret else _attention_bwd_config(d, q.dtype, causal, dropping)
    return k.shape[2] <= config["BLOCK_N1"]


# Interpreter: fixed small tiles, deliberately unequal (so tile edges, the causal diagonal and
# the ragged last block fall differently for queries and keys).
_INTERP_FWD = {"BLOCK_M": 32, "BLOCK_N": 16}
_INTERP_BWD = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16}


@functools.cache
def _dtype_meta(d: int, dtype: torch.dtype) -> dict:
    """Launch settings fixed by head dim and dtype (cached; read the environment once)."""
    interpret = interpreter_enabled()
    fp32 = dtype == torch.float32
    return {
        "interpret": interpret,
        "BLOCK_D": max(16, next_power_of_2(d)),
        # exact fp32 products for fp32 inputs (tf32 would cost ~1e-3); the interpreter gets
        # bf16 inputs as fp32 copies (`utils.widened_for_interpreter`), hence this path too
        "IEEE": fp32,
    }


def _launch_meta(q, k, v) -> dict:
    """Launch settings of one call. Plain arithmetic on sizes (no cache keyed on sizes, which
    may be symbolic under torch.compile): 64-bit offsets only where products can pass 2**31;
    batch·head spills from grid dim 1 into dim 2 past CUDA's 65535."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    bh = b * h
    return {
        **_dtype_meta(int(d), q.dtype),
        "DROP_INT64": bool(n_q * n_k >= 2**31),
        "INT64_ROWS": bool(_max_row_offset(q, k, v) >= 2**31),
        "grid_bh": (bh, 1) if bh <= _MAX_GRID_Y else (_MAX_GRID_Y, -(-bh // _MAX_GRID_Y)),
    }


# Eager launches whose table tiles did not fit this GPU's shared memory: (kernel, flags,
# tiles) -> the fewer pipeline stages that did.
_FITTED: dict[tuple, dict] = {}


def _launch_fitting(kernel, grid: tuple, args: tuple, consts: dict, config: dict):
    """Launch `kernel` with the table's tiles (and its register cap, `maxnreg`, if any);
    where they need more shared memory than this GPU has (Triton raises OutOfResources
    before anything runs), retry with fewer pipeline stages (the grid does not depend on
    them), down to one, and remember what fitted. Returns the launch bound for the next
    call's tensors (`KernelLauncher.bind`: the leading tensor arguments per call), or None
    when traced. Traced launches (torch.compile) take the table's tiles as they are, without
    the register cap: inductor keeps only num_warps and num_stages of a user kernel's launch
    options (torch 2.11-2.13), so a cap would be dropped anyway (passed in an autotuner's
    config, the compiled enwik8 step's attention forward took the same time as uncapped,
    H200, 2026-11-27)."""
    if is_traced(args[0]):
        tiles = {k: v for k, v in config.items() if k != "maxnreg"}
        launcher(kernel)[grid](*args, **consts, **tiles)
        return None
    key = (kernel, *consts.values(), *config.values())
    tiles = _FITTED.get(key, config)
    while True:
        try:
            bound = launcher(kernel).bind(grid, *args, **consts, **tiles)
            break
        except triton.runtime.errors.OutOfResources:
            if tiles["num_stages"] <= 1:
                raise
            tiles = {**tiles, "num_stages": tiles["num_stages"] - 1}
    if tiles is not config:
        _FITTED[key] = tiles
    return bound


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Hopper or newer CUDA device, kernels compiled (not the interpreter). Cached: every
    backward asks, and the answer is fixed per device (Triton reads TRITON_INTERPRET once)."""
    if device.type != "cuda" or interpreter_enabled():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


# Whether the backward may load its streamed tiles through TMA descriptors (Hopper, eager
# launches of fp16/bf16 tensors TMA can describe); benchmarks turn it off to compare. It does
# for causal attention with d <= 64 only: there it measured 2-9% faster than pointer loads
# (H100, 2026-11-24: single pass 186 / 283 TFLOP/s against 182 / 260 at seq 1024 / 4096),
# elsewhere slower (d128 causal single pass 181 against 206 at seq 1024; d64 non-causal 286
# against 305), and in the forward slower at every shape tried (d64 causal 264 against 308).
TMA_LOADS = True

# Without dropout, heads of at most this many queries load the backward's tiles by pointers:
# each key-block program there walks few query blocks, and the descriptors' setup does not pay
# (H200, 2026-11-27, `probe_attention_regs.py`, two runs: (4, 512, 8) 31.3 against 32.7 µs,
# (16, 512, 8) 82.6 against 85.7; at 1024 queries TMA wins, 341.7 against 343.8, and with
# dropout at every length, 41.1 against 42.6 at (4, 512, 8)). Measured with descriptors the
# kernel made; with the host-made ones (since 2026-11-28) the threshold was not re-measured.
TMA_LOADS_MIN_QUERIES = 513

# Whether a traced backward may take the single pass (its dQ reductions go through a
# device-side TMA descriptor, its tiles through pointer loads); False keeps the two-program
# kernel there. Only with TRACED_OPAQUE off: on, traced code launches the single pass
# eagerly inside the opaque op (`_traced_backward_op`). Read when the backward is traced: a
# compiled graph keeps the kernel it was traced with, and so do inductor's FX-graph and
# AOTAutograd caches, on disk across processes (turn them off, or clear them, after changing
# it). The compiled enwik8 step trained with it (H200, 2026-11-26: 7.67 against 7.83 GPU ms
# per step, `benchmarks/probe_compile.py`).
TRACED_SINGLE_PASS = True


# Causal launches run their longest programs first across heads, in groups of heads whose
# streamed tensors (the backward's q and dO, the forward's K and V) fit this many bytes of L2
# (`longest_first`); 0 keeps head-major order.
LONGEST_FIRST_BYTES = 16 * 2**20


def _tma_loads(*tensors: torch.Tensor) -> bool:
    """TMA tile loads for these (b, h, n, d) views: `_tma_layouts`, and no tracing. (Traced
    with inductor's scratch allocator, `utils.compile_tma`, a compiled attention passed its
    unit test but the compiled enwik8 training step hit an illegal memory access on an H200,
    torch 2.11 / triton 3.6, 2026-11-25, where the same step without TMA trained; the single
    pass's TMA dQ reductions alone train there (2026-11-26, `TRACED_SINGLE_PASS`), so the tile
    loads are the suspect: traced launches keep pointer loads until that is understood.)"""
    return not is_traced(tensors[0]) and _tma_layouts(*tensors)


def _tma_layouts(*tensors: torch.Tensor) -> bool:
    """Whether TMA can load tiles of these (b, h, n, d) views (`TMA_LOADS` on, a Hopper GPU):
    unit stride along d, 16-byte aligned starts and row / head / batch strides (judged by the
    storage offset: PyTorch aligns storages), 2-byte elements.

    While torch.compile traces, the storage offset is not read: Dynamo cannot trace it for a
    view made inside the graph (the packed qkv's), and a traced call only chooses between an
    op and its opaque twin, whose eager call checks again on the real tensors."""
    if not (TMA_LOADS and _has_tma(tensors[0].device)):
        return False
    compiling = torch.compiler.is_compiling()
    for t in tensors:
        if t.element_size() != 2 or t.stride(3) != 1:
            return False
        offset = 0 if compiling else t.storage_offset()
        if any((x * 2) % 16 for x in (offset, t.stride(0), t.stride(1), t.stride(2))):
            return False
    return True


def _group(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per key/value head: 1 for multi-head attention, h / h_kv for grouped-query
    attention (k, v with h_kv heads), h for multi-query."""
    h, h_kv = q.shape[1], k.shape[1]
    return int(h // h_kv) if h_kv and h != h_kv else 1


def _max_row_offset(*tensors: torch.Tensor) -> int:
    # the largest in-head offset a kernel computes: row index * row stride (+ head dim)
    return max(t.shape[2] * abs(t.stride(2)) + t.shape[3] * abs(t.stride(3)) for t in tensors)


# An eager call's launches, bound once per shape (`utils.LaunchPlans`): the forward's and the
# backward's, keyed on everything their decisions read but the tensors' addresses.
_FWD_PLANS = LaunchPlans()
_BWD_PLANS = LaunchPlans()


def _switches() -> tuple:
    """The module switches and tables the launches read, which benchmarks change between
    calls: part of every plan's key."""
    return (
        TMA_LOADS, TMA_LOADS_MIN_QUERIES, LONGEST_FIRST_BYTES, ONE_LAUNCH_MAX_QUERIES,
        _attention_fwd_config, _attention_bwd_config, attention_hopper,
        attention_hopper.ENABLED, attention_hopper_bwd_ws.ENABLED, attention_hopper_fwd.ENABLED,
    )  # fmt: skip


def launch_attention_fwd(
    q, k, v, kpm, seed, causal, scale, dropout_p, need_lse, config=None, kv_len=None
):
    """Launch the forward for (b, h, n, d) views; returns out (b, n_q, h, d) contiguous and
    lse (b·h, n_q) fp32 (empty when not needed). `config`: tiles (benchmark sweeps only).
    kv_len: a 0-dim integer device tensor; only keys [0, kv_len) of k, v are real. An eager
    call takes the launches bound for its shape (`_FWD_PLANS`) when there are."""
    key = None
    if config is None and not is_traced(q):
        key = (
            *layout_key(q, k, v, kpm, seed, kv_len), causal, scale, dropout_p, need_lse,
            q.device, *_switches(),
        )  # fmt: skip
        plan = _FWD_PLANS.get(key)
        if plan is not None:
            return plan(q, k, v, kpm, seed, kv_len)
    out, lse, plan = _fwd_launches(
        q, k, v, kpm, seed, causal, scale, dropout_p, need_lse, config, kv_len
    )
    if key is not None:
        _FWD_PLANS.put(key, plan)
    return out, lse


def _fwd_launches(q, k, v, kpm, seed, causal, scale, dropout_p, need_lse, config, kv_len):
    """Launch `launch_attention_fwd`'s forward; returns (out, lse, plan), where plan(q, k, v,
    kpm, seed, kv_len) launches it again, bound, for tensors of the same layouts and facts
    (outputs and work buffers allocated per call)."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    out, lse = _forward_outputs(q, need_lse)
    if out.numel() == 0:
        return out, lse, lambda q, *_: _forward_outputs(q, need_lse)
    interpret = _dtype_meta(int(d), q.dtype)["interpret"]  # cached: no environment read
    if interpret:
        q, k, v = widened_for_interpreter(q, k, v)
    has_kpm = kpm is not None
    dropping = dropout_p > 0.0
    gluon = config is None and _fwd_takes_gluon(q, k, v, causal, scale, has_kpm, dropping, kv_len)
    if gluon and not is_traced(q):
        # Hopper's warp-specialized forward in Gluon (`attention_hopper_fwd`; traced code
        # reaches this eagerly, through the opaque op: `_traced_forward_op`)
        again = attention_hopper_fwd.launch_fwd_sm90(
            q, k, v, out.transpose(1, 2), lse, causal, scale * LOG2E, need_lse
        )

        def gluon_plan(q, k, v, kpm, seed, kv_len):
            out, lse = _forward_outputs(q, need_lse)
            again(q, k, v, out.transpose(1, 2), lse)
            return out, lse

        return out, lse, gluon_plan
    meta = _launch_meta(q, k, v)
    decode = bool(n_q <= 16)
    if config is None:
        config = (
            _INTERP_FWD
            if interpret
            else _attention_fwd_config(decode, int(d), q.dtype, causal, dropping)
        )
    m_blocks = -(-n_q // config["BLOCK_M"])
    n_splits, split_len = 1, n_k
    if decode and not (need_lse or dropping):
        n_splits, split_len = _key_splits(b * h * m_blocks, n_k, config["BLOCK_N"], q.device)

    def tensors(q, k, v, out, lse, kpm, seed, kv_len) -> tuple:
        part_acc = part_ml = q  # the splits' partial results (unused without splits)
        if n_splits > 1:
            rows = b * h * n_splits * n_q
            part_acc = torch.empty(
                size=(rows, meta["BLOCK_D"]), device=q.device, dtype=torch.float32
            )
            part_ml = torch.empty(size=(rows, 2), device=q.device, dtype=torch.float32)
        kpm_arg = kpm.view(torch.uint8) if has_kpm else q  # bytes: loads as 0/1
        return (
            q, k, v, out, lse, kpm_arg, seed if dropping else q,
            q if kv_len is None else kv_len, part_acc, part_ml,
        )  # fmt: skip

    first = tensors(q, k, v, out, lse, kpm, seed, kv_len)
    scalars = (
        *q.stride(), *k.stride(), *v.stride(), out.stride(0), out.stride(2), out.stride(1),
        kpm.stride(0) if has_kpm else 0, kpm.stride(1) if has_kpm else 0,
        b * h, h, n_q, n_k, scale * LOG2E, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p),
        split_len, n_splits,
    )  # fmt: skip
    consts = dict(
        HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], CAUSAL=causal, HAS_KPM=has_kpm,
        DROPOUT=dropping, DROP_INT64=meta["DROP_INT64"], WRITE_LSE=need_lse,
        INT64_ROWS=meta["INT64_ROWS"], IEEE=meta["IEEE"],
        FOLD_SCALE=scale > 0, HAS_KV_LEN=kv_len is not None, SPLIT_K=n_splits > 1,
        GROUP=_group(q, k), LPT_BYTES=LONGEST_FIRST_BYTES,
    )  # fmt: skip
    gy, gz = meta["grid_bh"]
    grid = (m_blocks * n_splits, gy, gz)
    main = _launch_fitting(_attention_fwd_kernel, grid, first + scalars, consts, config)
    combine = None
    if n_splits > 1:
        # interpreter: 2 splits per step, so that the tests' 3 splits take a ragged 2nd step
        block_s = 2 if interpret else min(64, next_power_of_2(n_splits))
        combine = launcher(_attention_fwd_combine_kernel).bind(
            (n_q, gy, gz), first[8], first[9], out, out.stride(0), out.stride(2),
            out.stride(1), b * h, h, n_q, n_splits, HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"],
            BLOCK_S=block_s,
        )  # fmt: skip

    def plan(q, k, v, kpm, seed, kv_len):
        out, lse = _forward_outputs(q, need_lse)
        if interpret:
            q, k, v = widened_for_interpreter(q, k, v)
        args = tensors(q, k, v, out, lse, kpm, seed, kv_len)
        main(*args)
        if combine is not None:
            combine(args[8], args[9], out)
        return out, lse

    return out, lse, plan


def _key_splits(programs: int, n_k: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(splits, keys per split) for a decode launch of `programs` (batch·head·query-block)
    programs over n_k keys.

    Fixed by the shapes alone, so a CUDA graph's launch stays valid as the cache fills: n_k
    is the cache's capacity, and the real keys fill the first splits. So the splits are
    short (about eight programs per SM over the whole capacity, at least two key blocks
    each), and a cache filled to a quarter still spreads over a quarter of them; the splits
    past its length return at once. Only launches that would leave most SMs idle over a
    long cache split: at b16 h8 (128 programs) one pass already streams K and V at 3.7 TB/s,
    and below 8 key blocks the merge costs what the split saves (H200, `attention_decode.md`).
    The interpreter splits in three, which puts split edges inside the tests' small caches."""
    key_blocks = -(-n_k // block_n)
    if device.type == "cuda" and not interpreter_enabled():
        sms = sm_count(device)
        if 2 * programs > sms or key_blocks < 8:
            return 1, n_k
        blocks_per_split = max(2, -(-key_blocks // -(-8 * sms // programs)))
    else:
        blocks_per_split = -(-key_blocks // 3)
    return -(-key_blocks // blocks_per_split), blocks_per_split * block_n


def _fwd_takes_gluon(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    has_kpm: bool, dropping: bool, kv_len: torch.Tensor | None,
) -> bool:  # fmt: skip
    """Whether a forward of these tensors (traced or not) takes `attention_hopper_fwd`'s
    kernel: its `usable` (no key padding mask, dropout or device-side key count) and
    TMA-describable q, k and v."""
    plain = not (has_kpm or dropping) and kv_len is None
    return attention_hopper_fwd.usable(q, k, causal, scale, plain) and _tma_layouts(q, k, v)


def _takes_gluon(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, has_kpm: bool,
    causal: bool, dropping: bool, deterministic: bool,
) -> str | None:  # fmt: skip
    """Which Gluon kernel a backward of these tensors (traced or not) takes: "ws"
    (`attention_hopper_bwd_ws`'s), "single" (`attention_hopper`'s) or None (the Triton
    kernels). A Gluon kernel needs: not `deterministic`, its `usable`, and TMA-describable
    q, k, v and dout."""
    if deterministic:
        return None
    if attention_hopper_bwd_ws.usable(q, k, causal, not (has_kpm or dropping)):
        kernel = "ws"
    elif attention_hopper.usable(q, k, int(q.shape[3]), causal, not has_kpm, dropping):
        kernel = "single"
    else:
        return None
    return kernel if _tma_layouts(q, k, v, dout) else None


def _bwd_descriptors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dq_acc: torch.Tensor,
    config: dict, block_d: int, tile_loads: bool, dq_reductions: bool,
) -> tuple:  # fmt: skip
    """The Triton backward's TMA descriptors, made on the host (`_attention_bwd_kernel`'s
    Q_DESC, K_DESC, V_DESC, DO_DESC, DQ_DESC): with `tile_loads`, q and dout (b, h, n_q, d)
    in blocks of the key-block programs' BLOCK_M1 rows, k and v (b, h_kv, n_k, d) in blocks
    of the dQ programs' BLOCK_N2; with `dq_reductions`, the fp32 dQ sum (b·h, n_q, d) in
    blocks of BLOCK_M1 rows. Blocks are BLOCK_D wide (columns past d read as zeros). Each one
    not asked for is a placeholder (q)."""

    def blocks(t: torch.Tensor, rows: int) -> TensorDescriptor:
        block = [1] * (t.dim() - 2) + [rows, block_d]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    descs = [q] * 5
    if tile_loads:
        m1, n2 = config["BLOCK_M1"], config["BLOCK_N2"]
        descs[:4] = blocks(q, m1), blocks(k, n2), blocks(v, n2), blocks(dout, m1)
    if dq_reductions:
        descs[4] = blocks(dq_acc, config["BLOCK_M1"])
    return tuple(descs)


def launch_attention_bwd(
    dout, q, k, v, out, lse, kpm, seed, causal, scale, dropout_p, dq, dk, dv, config=None,
    deterministic=None, grads_base: torch.Tensor | None = None,
):  # fmt: skip
    """Launch the backward: fills dq, dk, dv (any strides) for (b, h, n, d) views; `out` and
    `dout` are (b, n_q, h, d) tensors (dout of any strides).

    grads_base: the tensor dq, dk and dv are views of (the packed op's d(qkv)), or None. The
    kernels then get it once, with each view's element offset (`utils.offsets_in`: under
    torch.compile, writes into three views cost three copies of d(qkv) per call).

    deterministic: None follows `torch.are_deterministic_algorithms_enabled()`, as SDPA
    does: off, causal attention takes the single-pass kernel, which adds dQ in fp32 with TMA
    reductions (faster; the summation order varies in the last bits); on, dK/dV and dQ
    programs each recompute P (bit-reproducible). See `_single_pass`.

    An eager call takes the launches bound for its shape (`_BWD_PLANS`) when there are.
    """
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    if n_q == 0 or n_k == 0 or b * h == 0:
        for t in (dq, dk, dv):
            t.zero_()
        return
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    tensors = (dout, q, k, v, out, lse, kpm, seed, dq, dk, dv, grads_base)
    key = None
    if config is None and not is_traced(q):
        offsets = None if grads_base is None else offsets_in(grads_base, dq, dk, dv)
        key = (
            *layout_key(*tensors), offsets, causal, scale, dropout_p, deterministic,
            q.device, *_switches(),
        )  # fmt: skip
        plan = _BWD_PLANS.get(key)
        if plan is not None:
            plan(*tensors)
            return
    plan = _bwd_launches(tensors, causal, scale, dropout_p, config, deterministic)
    if key is not None:
        _BWD_PLANS.put(key, plan)


def _bwd_launches(tensors: tuple, causal, scale, dropout_p, config, deterministic):
    """Launch `launch_attention_bwd`'s kernels for its tensors (dout, q, k, v, out, lse, kpm,
    seed, dq, dk, dv, grads_base; None where absent) and return them bound for the next call
    of the same layouts and facts: plan(*tensors) (work buffers allocated per call)."""
    dout, q, k, v, out, lse, kpm, seed, dq, dk, dv, grads_base = tensors
    b, h, n_q, d = q.shape
    interpret = _dtype_meta(int(d), q.dtype)["interpret"]  # cached: no environment read
    if interpret:
        dout, q, k, v = widened_for_interpreter(dout, q, k, v)
    meta = _launch_meta(q, k, v)
    # The single pass adds dQ by TMA bulk reductions on Hopper (per-element atomics measured
    # slower than the two-program kernel there). Traced (torch.compile), it runs where
    # inductor sets Triton's scratch allocator (`utils.compile_tma`) and TRACED_SINGLE_PASS
    # allows it; its tile loads stay pointer loads there (see `_tma_loads`).
    traced = is_traced(q)
    dq_tma = _has_tma(q.device) and (not traced or (TRACED_SINGLE_PASS and compile_tma()))
    has_kpm = kpm is not None
    dropping = dropout_p > 0.0
    # Hopper's Gluon kernels (`attention_hopper`, `attention_hopper_bwd_ws`): eager launches
    # of what they take
    gluon = None
    if not traced:
        gluon = _takes_gluon(dout, q, k, v, has_kpm, causal, dropping, deterministic)
    one_launch = gluon is None and _one_launch(q, k, causal, dropping, config, interpret)
    atomic = not one_launch and (
        gluon is not None or _single_pass(causal, deterministic, dq_tma, interpret)
    )
    gy, gz = meta["grid_bh"]
    block_d = meta["BLOCK_D"]

    def buffers(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if one_launch:  # Δ summed in the kernel, dQ stored whole: q stands in for both
            return q, q
        delta = torch.empty(size=(b * h, n_q), device=q.device, dtype=torch.float32)
        # the single pass's fp32 dQ sum; the delta kernel zeroes it
        shape = (b * h, n_q, d) if atomic else (0,)
        return delta, torch.empty(size=shape, device=q.device, dtype=torch.float32)

    delta, dq_acc = buffers(q)
    bm = 64 if not interpret else 32
    grid_rows = (-(-n_q // bm), gy, gz)
    delta_launch = None
    if not one_launch:
        delta_launch = launcher(_attention_bwd_delta_kernel).bind(
            grid_rows, out, dout, delta, dq_acc, out.stride(0), out.stride(2), out.stride(1),
            dout.stride(0), dout.stride(2), dout.stride(1), dout.stride(3), b * h, h, n_q,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm, ZERO_DQ=atomic,
        )  # fmt: skip
    offsets = (0, 0, 0) if grads_base is None else offsets_in(grads_base, dq, dk, dv)

    def written(q, dq, dk, dv, grads_base) -> tuple:
        # the tensors the kernels write: dq, dk, dv, or the base they are views of (q stands
        # in for the unused two)
        return (dq, dk, dv) if grads_base is None else (grads_base, q, q)

    grads = written(q, dq, dk, dv, grads_base)
    if gluon == "ws":  # Hopper's warp-specialized backward (`attention_hopper_bwd_ws`)
        main = attention_hopper_bwd_ws.launch_bwd_ws_sm90(
            q, k, v, dout.transpose(1, 2), dk, dv, grads_base, offsets[1:], lse, delta, dq_acc,
            causal, scale * LOG2E, scale, LONGEST_FIRST_BYTES,
        )  # fmt: skip
    elif gluon:  # Hopper's single pass in Gluon (`attention_hopper`; its descriptors host-made)
        main = attention_hopper.launch_bwd_sm90(
            q, k, v, dout.transpose(1, 2), dk, dv, grads_base, offsets[1:], lse, delta,
            dq_acc, causal, scale * LOG2E, scale, LONGEST_FIRST_BYTES, dropout_p,
            seed if dropping else None,
        )  # fmt: skip
    else:
        main = _triton_bwd(
            tensors, (dout, q, k, v), grads, delta, dq_acc, offsets, config, meta, causal,
            scale, dropout_p, atomic, dq_tma, traced, one_launch,
        )  # fmt: skip
    dq_launch = None
    if atomic:
        dq_launch = launcher(_attention_bwd_dq_kernel).bind(
            grid_rows, dq_acc, grads[0], offsets[0], *dq.stride(), b * h, h, n_q, scale,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm,
        )  # fmt: skip

    def plan(dout, q, k, v, out, lse, kpm, seed, dq, dk, dv, grads_base) -> None:
        if interpret:
            dout, q, k, v = widened_for_interpreter(dout, q, k, v)
        delta, dq_acc = buffers(q)
        if delta_launch is not None:
            delta_launch(out, dout, delta, dq_acc)
        grads = written(q, dq, dk, dv, grads_base)
        if gluon:
            main(q, k, v, dout.transpose(1, 2), dk, dv, grads_base, lse, delta, dq_acc, seed)
        else:
            main(dout, q, k, v, out, grads, lse, delta, dq_acc, kpm, seed)
        if dq_launch is not None:
            dq_launch(dq_acc, grads[0])

    return plan


def _triton_bwd(
    tensors, widened, grads, delta, dq_acc, offsets, config, meta, causal, scale, dropout_p,
    atomic, dq_tma, traced, one_launch,
):  # fmt: skip
    """Launch `_attention_bwd_kernel` for `_bwd_launches` (widened: its dout, q, k, v as the
    kernel reads them); returns it bound: again(dout, q, k, v, out, grads, lse, delta, dq_acc,
    kpm, seed), or None when traced. one_launch: `_one_launch` (the kernel's DQ_DIRECT)."""
    _, _, _, _, out, lse, kpm, seed, dq, dk, dv, grads_base = tensors
    dout, q, k, v = widened
    d = q.shape[3]
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    has_kpm = kpm is not None
    dropping = dropout_p > 0.0

    def leading(dout, q, k, v, out, grads, lse, delta, dq_acc, kpm, seed) -> list:
        return [
            q, k, v, dout, *grads, lse, delta, kpm.view(torch.uint8) if has_kpm else q,
            seed if dropping else q, dq_acc if atomic else delta, out if one_launch else q,
            *[q] * 5,
        ]  # fmt: skip

    args = [
        *leading(dout, q, k, v, out, grads, lse, delta, dq_acc, kpm, seed), *offsets,
        *q.stride(), *k.stride(), *v.stride(),
        dout.stride(0), dout.stride(2), dout.stride(1), dout.stride(3),
        *dq.stride(), *dk.stride(), *dv.stride(), out.stride(0), out.stride(2), out.stride(1),
        kpm.stride(0) if has_kpm else 0, kpm.stride(1) if has_kpm else 0,
        b * h, h, n_q, n_k, scale * LOG2E, scale, dropout_threshold(dropout_p),
        1.0 / (1.0 - dropout_p),
    ]  # fmt: skip
    consts = dict(
        HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], CAUSAL=causal, HAS_KPM=has_kpm,
        DROPOUT=dropping, DROP_INT64=meta["DROP_INT64"],
        INT64_ROWS=meta["INT64_ROWS"], IEEE=meta["IEEE"], ATOMIC_DQ=atomic,
        DQ_TMA=atomic and dq_tma, DQ_HOST_DESC=atomic and dq_tma and not traced,
        DQ_DIRECT=one_launch,
        TMA=causal and d <= 64 and (dropping or n_q >= TMA_LOADS_MIN_QUERIES)
        and _tma_loads(q, k, v, dout),
        GROUP=_group(q, k), PACKED_GRADS=grads_base is not None,
        LPT_BYTES=LONGEST_FIRST_BYTES,
    )  # fmt: skip
    if config is None and meta["interpret"]:
        config = _INTERP_BWD
    elif config is None:
        config = _attention_bwd_config(int(d), q.dtype, causal, dropping, atomic)
    # a key/value head's key blocks are shared among its query heads' grid rows
    key_blocks = -(-n_k // config["BLOCK_N1"])
    n_prog = -(-key_blocks // consts["GROUP"])
    if not (atomic or one_launch):
        n_prog += -(-n_q // config["BLOCK_M2"])
    descs = None
    if consts["TMA"] or consts["DQ_HOST_DESC"]:  # (eager launches only: `_tma_loads`)
        descs = _bwd_descriptors(
            q, k, v, dout.transpose(1, 2), dq_acc, config, meta["BLOCK_D"], consts["TMA"],
            consts["DQ_HOST_DESC"],
        )  # fmt: skip
        args[13:18] = descs
    elif consts["DQ_TMA"]:  # traced: the kernel makes dQ's descriptor itself
        triton.set_allocator(tma_scratch)  # a context variable: set it in this thread
    grid = (n_prog, *meta["grid_bh"])
    bound = _launch_fitting(_attention_bwd_kernel, grid, tuple(args), consts, config)
    if bound is None:
        return None
    # a placeholder (q) where no descriptor is asked for, else the tensor the descriptor describes
    described = None if descs is None else [not isinstance(t, torch.Tensor) for t in descs]

    def again(dout, q, k, v, out, grads, lse, delta, dq_acc, kpm, seed) -> None:
        per_call = leading(dout, q, k, v, out, grads, lse, delta, dq_acc, kpm, seed)
        if described is not None:
            bases = (q, k, v, dout.transpose(1, 2), dq_acc)
            per_call[13:18] = [base if d else q for d, base in zip(described, bases, strict=True)]
        bound(*per_call)

    return again


# ---------------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------------


# Traced code (torch.compile) cannot launch some kernels as an eager call does: a Gluon kernel
# (`wrap_triton` takes `@triton.jit` ones: `attention_hopper`'s backward) or a register cap
# (inductor keeps only num_warps and num_stages of a user kernel's options: the forward's
# `maxnreg` tiles). Where an eager call would, traced code calls the op's implementation as an
# opaque custom op (`utils.opaque_op`), which inductor calls as it is, with the strides it traced,
# and which launches what an eager call launches. False: traced code runs the Triton kernels
# traced, uncapped (benchmarks compare them).
TRACED_OPAQUE = True


def _forward_outputs(q, need_lse):
    b, h, n_q, d = q.shape
    out = torch.empty(size=(b, n_q, h, d), device=q.device, dtype=q.dtype)
    lse = torch.empty(size=(b * h, n_q) if need_lse else (0,), device=q.device, dtype=torch.float32)
    return out, lse


def _traced_forward_op(
    op, opaque_op, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
    scale: float, has_kpm: bool, dropout_p: float,
):  # fmt: skip
    """`opaque_op` where traced code would launch the forward without its register cap, or
    where an eager forward would take `attention_hopper_fwd`'s kernel."""
    if not (TRACED_OPAQUE and tracing(q)):
        return op
    gluon = _fwd_takes_gluon(q, k, v, causal, scale, has_kpm, dropout_p > 0.0, None)
    return opaque_op if gluon or _capped_forward(q, causal, dropout_p) else op


def _capped_forward(q: torch.Tensor, causal: bool, dropout_p: float) -> bool:
    """Whether the forward's launch caps its registers: fp16 / bf16 on CUDA, tiles of
    `_attention_fwd_config` with a `maxnreg`."""
    if q.device.type != "cuda" or q.dtype.itemsize != 2:
        return False
    # Dynamo warns about calls through functools.cache: read the table itself
    config = _attention_fwd_config.__wrapped__(
        q.shape[2] <= 16, int(q.shape[3]), q.dtype, causal, dropout_p > 0
    )
    return "maxnreg" in config


def _traced_backward_op(op, opaque_op, dout, qkv, kpm, ctx):
    """`opaque_op` where an eager backward would take `attention_hopper`'s kernel, which traced
    code cannot launch, or the Triton single pass on Hopper. qkv: (q, k, v), or the packed
    (b, n, 3, h, d) tensor (split only when traced: eager calls pay nothing)."""
    if not (TRACED_OPAQUE and is_traced(qkv[0] if isinstance(qkv, tuple) else qkv)):
        return op
    q, k, v = qkv if isinstance(qkv, tuple) else _split_packed(qkv)
    deterministic = torch.are_deterministic_algorithms_enabled()
    dropping = ctx.dropout_p > 0.0
    gluon = _takes_gluon(dout, q, k, v, kpm is not None, ctx.causal, dropping, deterministic)
    # The single pass adds dQ through a TMA descriptor: made on the host by an eager launch,
    # in the kernel when traced, which then needs Triton's scratch allocator set in whichever
    # thread runs the graph. Inductor's launcher sets it; other backends (aot_eager, export,
    # opcheck's aot_dispatch test on an H200, 2026-11-28) do not, and the kernel raised.
    single = _has_tma(q.device) and _single_pass(ctx.causal, deterministic, True, False)
    return opaque_op if gluon or single else op


def _flash_attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout_p: float,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention of (b, h, n, d) q, k, v (any strides). Returns the output as a
    contiguous (b, n_q, h, d) tensor and the per-row log-sum-exp (b·h, n_q) in log2 units
    (empty unless need_lse). seed: 0-dim int64 device tensor, used when dropout_p > 0."""
    return launch_attention_fwd(q, k, v, key_padding_mask, seed, causal, scale, dropout_p, need_lse)


flash_attention_op = triton_op("triton_transformer::flash_attention", mutates_args=())(
    _flash_attention_impl
)
flash_attention_opaque_op = opaque_op("flash_attention", _flash_attention_impl)
flash_attention_opaque_op.register_fake(lambda q, *args: _forward_outputs(q, args[-1]))


def _flash_attention_backward_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (shaped and laid out like q, k, v where those are dense) from dout, the
    (b, n_q, h, d) gradient of `flash_attention_op`'s output."""
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    launch_attention_bwd(
        dout, q, k, v, out, lse, key_padding_mask, seed, causal, scale, dropout_p, dq, dk, dv
    )
    return dq, dk, dv


flash_attention_backward_op = triton_op(
    "triton_transformer::flash_attention_backward", mutates_args=()
)(_flash_attention_backward_impl)
flash_attention_backward_opaque_op = opaque_op(
    "flash_attention_backward", _flash_attention_backward_impl
)
flash_attention_backward_opaque_op.register_fake(
    lambda dout, q, k, v, *args: tuple(torch.empty_like(t) for t in (q, k, v))
)


def _flash_attention_setup_context(ctx, inputs, output) -> None:
    q, k, v, kpm, seed, ctx.causal, ctx.scale, ctx.dropout_p, _ = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse on every call
    ctx.save_for_backward(q, k, v, out, lse, kpm, seed)


@first_order_only("attention")
def _flash_attention_backward(ctx, dout: torch.Tensor | None, _dlse: torch.Tensor | None):
    if dout is None:  # grads are not materialised: the output was not used
        return (None,) * 9
    q, k, v, out, lse, kpm, seed = ctx.saved_tensors
    if lse.numel() == 0 and out.numel() != 0:
        raise RuntimeError("flash_attention was called with need_lse=False; cannot backward")
    op = _traced_backward_op(
        flash_attention_backward_op, flash_attention_backward_opaque_op, dout, (q, k, v), kpm, ctx
    )
    dq, dk, dv = call_op(
        op, dout, q, k, v, out, lse, kpm, seed, ctx.causal, ctx.scale, ctx.dropout_p
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None


for _op in (flash_attention_op, flash_attention_opaque_op):
    _op.register_autograd(_flash_attention_backward, setup_context=_flash_attention_setup_context)


def _split_packed(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (b, n, 3, h, d) -> three (b, h, n, d) views
    return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))


def _flash_attention_packed_impl(
    qkv: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout_p: float,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention over a packed (b, n, 3, h, d) qkv tensor (any strides): q, k, v are
    read in place. Same outputs as `flash_attention_op`."""
    q, k, v = _split_packed(qkv)
    return launch_attention_fwd(q, k, v, key_padding_mask, seed, causal, scale, dropout_p, need_lse)


flash_attention_packed_op = triton_op(
    "triton_transformer::flash_attention_packed", mutates_args=()
)(_flash_attention_packed_impl)
flash_attention_packed_opaque_op = opaque_op("flash_attention_packed", _flash_attention_packed_impl)
flash_attention_packed_opaque_op.register_fake(
    lambda qkv, *args: _forward_outputs(_split_packed(qkv)[0], args[-1])
)


def _flash_attention_packed_backward_impl(
    dout: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """d(qkv) as one contiguous (b, n, 3, h, d) tensor: the kernel writes dq, dk and dv
    into its three slices (no concatenation)."""
    dqkv = torch.empty(size=qkv.shape, device=qkv.device, dtype=qkv.dtype)
    q, k, v = _split_packed(qkv)
    dq, dk, dv = _split_packed(dqkv)
    launch_attention_bwd(
        dout, q, k, v, out, lse, key_padding_mask, seed, causal, scale, dropout_p, dq, dk, dv,
        grads_base=dqkv,
    )  # fmt: skip
    return dqkv


flash_attention_packed_backward_op = triton_op(
    "triton_transformer::flash_attention_packed_backward", mutates_args=()
)(_flash_attention_packed_backward_impl)
flash_attention_packed_backward_opaque_op = opaque_op(
    "flash_attention_packed_backward", _flash_attention_packed_backward_impl
)
flash_attention_packed_backward_opaque_op.register_fake(
    lambda dout, qkv, *args: torch.empty(size=qkv.shape, device=qkv.device, dtype=qkv.dtype)
)


def _flash_attention_packed_setup_context(ctx, inputs, output) -> None:
    qkv, kpm, seed, ctx.causal, ctx.scale, ctx.dropout_p, _ = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse on every call
    ctx.save_for_backward(qkv, out, lse, kpm, seed)


@first_order_only("attention_packed")
def _flash_attention_packed_backward(ctx, dout: torch.Tensor | None, _dlse: torch.Tensor | None):
    if dout is None:  # grads are not materialised: the output was not used
        return (None,) * 7
    qkv, out, lse, kpm, seed = ctx.saved_tensors
    if lse.numel() == 0 and out.numel() != 0:
        raise RuntimeError("flash_attention_packed was called with need_lse=False")
    op = _traced_backward_op(
        flash_attention_packed_backward_op, flash_attention_packed_backward_opaque_op, dout, qkv,
        kpm, ctx,
    )  # fmt: skip
    dqkv = call_op(op, dout, qkv, out, lse, kpm, seed, ctx.causal, ctx.scale, ctx.dropout_p)
    return dqkv, None, None, None, None, None, None


for _op in (flash_attention_packed_op, flash_attention_packed_opaque_op):
    _op.register_autograd(
        _flash_attention_packed_backward, setup_context=_flash_attention_packed_setup_context
    )


@triton_op("triton_transformer::flash_attention_cached", mutates_args=())
def flash_attention_cached_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of (b, h, n_q, d) q over the first cache_len positions of
    (b, h, capacity, d) caches (cache_len: 0-dim integer device tensor). Inference only: no
    log-sum-exp, no autograd. Returns a contiguous (b, n_q, h, d) tensor."""
    out, _ = launch_attention_fwd(
        q, k_cache, v_cache, None, None, True, scale, 0.0, False, kv_len=cache_len
    )
    return out


# ---------------------------------------------------------------------------------------------
# Validation and the public functions
# ---------------------------------------------------------------------------------------------


def _check_scale(scale, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite real number or None, got {scale!r}")
    return float(scale)


def _check_inputs(q, k, v, key_padding_mask, use_triton: bool) -> None:
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (b, h, n, d), got shape {tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v need one device, got {q.device}, {k.device}, {v.device}")
    h, h_kv = q.shape[1], k.shape[1]
    if not (q.shape[0] == k.shape[0] == v.shape[0] and h_kv == v.shape[1]):
        raise ValueError(
            f"q, k, v need the same (b, h) (k, v may share fewer heads), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if (h_kv == 0 and h != 0) or (h_kv and h % h_kv):
        raise ValueError(f"k and v's {h_kv} heads must divide q's {h} heads (grouped-query)")
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        raise ValueError(
            f"q, k, v need one head dim, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v need one length n_k, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor (True = real token)")
        expected = (k.shape[0], k.shape[2])
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(
                f"key_padding_mask must have shape (b, n_k) = {expected}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != k.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, k on {k.device}")
    if use_triton:
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            check_triton_tensor(t, name)
        if q.shape[-1] not in HEAD_DIMS:
            raise ValueError(
                f"head dim {q.shape[-1]} is not supported by the fused attention kernel "
                f"(multiples of 16 from 16 to 128); use use_triton=False"
            )


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Grouped-query attention on the PyTorch paths: k, v repeated to q's heads (head h
    reads h // group); their gradients sum back over each group. The kernels never do this."""
    group = _group(q, k)
    if group == 1:
        return k, v
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def _attention_reference(q, k, v, causal, key_padding_mask, dropout_p, scale) -> torch.Tensor:
    """The PyTorch semantics: SDPA where it agrees with ours, explicit math elsewhere."""
    k, v = _expand_kv(q, k, v)
    n_q, n_k = q.shape[2], k.shape[2]
    if key_padding_mask is None and (not causal or n_q == n_k) and n_q and n_k:
        # SDPA's causal mask is top-left aligned, equal to ours only when n_q == n_k; then
        # every row sees key 0, so no row is empty
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal and n_q > 1, scale=scale
        )
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril(n_k - n_q)  # query i sees keys j <= i + n_k - n_q
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    # A finite fill keeps an all-masked row finite; multiplying by `visible` then zeroes it
    # (and passes it no gradient), while visible weights are unchanged.
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    attn = torch.softmax(scores, dim=-1) * visible
    if dropout_p > 0.0:
        attn = F.dropout(attn, p=dropout_p)
    return torch.matmul(attn, v)


# ---------------------------------------------------------------------------------------------
# Eager calls
# ---------------------------------------------------------------------------------------------
# An eager `attention` call (nothing traces) of a layout seen before takes that layout's
# `_EagerPlan`: one key of what the checks and the launches read (`utils.eager_plan_key` of
# q, k, v and the mask, the scalars as given, the module switches), one lookup, then the
# launches `_fwd_launches` and `_bwd_launches` bound on its first call; as
# `layernorm._EagerPlan`. The kernels and saved tensors are `flash_attention_op`'s.
# `attention_packed` calls take plans of the same class keyed by the qkv tensor
# (`_PACKED_PLANS`), whose backward writes d(qkv) whole.


class _EagerPlan:
    """The launches of eager attention calls of one layout: forward per need of the
    log-sum-exp and layout of the seed, backward per layout of dout and of the seed and per
    `torch.are_deterministic_algorithms_enabled()`."""

    __slots__ = ("bwd", "causal", "dropout_p", "fwd", "scale")

    def __init__(self, causal: bool, scale: float, dropout_p: float) -> None:
        self.causal, self.scale, self.dropout_p = causal, scale, dropout_p
        self.fwd: dict[tuple, Callable] = {}
        self.bwd: dict[tuple, Callable] = {}

    def forward(self, q, k, v, kpm, seed, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) as `flash_attention_op` returns them."""
        key = (need_lse, seed is None or not seed.data_ptr() & 15)
        fwd = self.fwd.get(key)
        if fwd is not None:
            return fwd(q, k, v, kpm, seed, None)
        out, lse, self.fwd[key] = _fwd_launches(
            q, k, v, kpm, seed, self.causal, self.scale, self.dropout_p, need_lse, None, None
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, kpm, seed, grads=None) -> tuple:
        """(dq, dk, dv) as `flash_attention_backward_op` returns them; grads: (dq, dk, dv,
        their base), views of one tensor the kernels write (`attention_packed`'s d(qkv)),
        else they are allocated here."""
        if grads is None:
            grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None)
        dq, dk, dv, _ = grads
        deterministic = torch.are_deterministic_algorithms_enabled()
        tensors = (dout, q, k, v, out, lse, kpm, seed, *grads)
        key = (dout.stride(), dout.dtype, not dout.data_ptr() & 15, deterministic,
               seed is None or not seed.data_ptr() & 15)  # fmt: skip
        bwd = self.bwd.get(key)
        if bwd is not None:
            bwd(*tensors)
        else:
            self.bwd[key] = _bwd_launches(
                tensors, self.causal, self.scale, self.dropout_p, None, deterministic
            )
        return dq, dk, dv


_EAGER_PLANS = LaunchPlans()


def _eager_plan(q, k, v, key_padding_mask, causal, dropout_p, training, scale):
    """The plan of this eager `attention` call's layout, made on its first call (after the
    checks); None where the generic path runs: traced, not tensors (the checks raise), or
    an empty attention."""
    kpm = key_padding_mask
    key, plan = _EAGER_PLANS.find((q, k, v, kpm), (causal, dropout_p, training, scale, _switches()))
    if key is None or plan is not None:
        return plan
    _check_inputs(q, k, v, kpm, use_triton=True)
    p = check_dropout_p(dropout_p) if training else 0.0
    scale = _check_scale(scale, q.shape[-1])
    if q.numel() == 0 or k.numel() == 0:
        return None
    return _EAGER_PLANS.put(key, _EagerPlan(bool(causal), scale, p))


class _EagerAttention(torch.autograd.Function):
    """`flash_attention_op` and its registered backward for an eager call of a planned
    layout: returns out, (b, n_q, h, d)."""

    @staticmethod
    def forward(ctx, q, k, v, kpm, seed, plan):
        out, lse = plan.forward(q, k, v, kpm, seed, True)
        ctx.save_for_backward(q, k, v, out, lse, kpm, seed)
        ctx.plan = plan
        return out

    @staticmethod
    @first_order_only("attention")
    def backward(ctx, dout):
        q, k, v, out, lse, kpm, seed = ctx.saved_tensors
        dq, dk, dv = ctx.plan.backward(dout, q, k, v, out, lse, kpm, seed)
        return dq, dk, dv, None, None, None


_apply_eager_attention = eager_apply(_EagerAttention)


# `attention_packed`'s eager calls take `_EagerPlan`s of their own (`_PACKED_PLANS`, keyed by
# the qkv tensor's layout): the same launches, q, k and v read as views of qkv, the backward
# writing d(qkv) whole as `flash_attention_packed_backward_op` does.
_PACKED_PLANS = LaunchPlans()


def _eager_packed_plan(qkv, heads, kpm, causal, dropout_p, training, scale):
    """`_eager_plan` of an `attention_packed` call: None where its generic path runs."""
    scalars = (heads, causal, dropout_p, training, scale, _switches())
    key, plan = _PACKED_PLANS.find((qkv, kpm), scalars)
    if key is None or plan is not None:
        return plan
    q, k, v = _check_packed(qkv, heads)
    _check_inputs(q, k, v, kpm, use_triton=True)
    p = check_dropout_p(dropout_p) if training else 0.0
    scale = _check_scale(scale, q.shape[-1])
    if qkv.numel() == 0:
        return None
    return _PACKED_PLANS.put(key, _EagerPlan(bool(causal), scale, p))


class _EagerPackedAttention(torch.autograd.Function):
    """`flash_attention_packed_op` and its registered backward for an eager call of a planned
    layout: returns out, (b, n, h, d)."""

    @staticmethod
    def forward(ctx, qkv, heads, kpm, seed, plan):
        q, k, v = _split_packed(qkv.unflatten(-1, (3, heads, -1)))
        out, lse = plan.forward(q, k, v, kpm, seed, True)
        ctx.save_for_backward(qkv, out, lse, kpm, seed)
        ctx.plan, ctx.heads = plan, heads
        return out

    @staticmethod
    @first_order_only("attention_packed")
    def backward(ctx, dout):
        qkv, out, lse, kpm, seed = ctx.saved_tensors
        dqkv = torch.empty(size=qkv.shape, device=qkv.device, dtype=qkv.dtype)
        packed = (3, ctx.heads, -1)
        q, k, v = _split_packed(qkv.unflatten(-1, packed))
        grads = (*_split_packed(dqkv.unflatten(-1, packed)), dqkv)
        ctx.plan.backward(dout, q, k, v, out, lse, kpm, seed, grads)
        return dqkv, None, None, None, None


_apply_eager_packed_attention = eager_apply(_EagerPackedAttention)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = True,
    scale: float | None = None,
    use_triton: bool = False,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale, masked) v, as `F.scaled_dot_product_attention`.

    Args:
        q: (b, h, n_q, d) queries; k, v: (b, h_kv, n_k, d), h_kv dividing h (grouped-query
            attention when h_kv < h: query head i reads key/value head i // (h / h_kv)). Any
            strides. Triton: fp32/fp16/bf16 on CUDA, d a multiple of 16 from 16 to 128.
        causal: query i sees keys j <= i + (n_k - n_q) (bottom-right aligned: a KV-cache step
            with n_q < n_k is right).
        key_padding_mask: optional (b, n_k) bool, True = real token.
        dropout_p: dropout on the attention weights (only when `training`).
        scale: score scale; None means 1 / sqrt(d).
        use_triton: run the fused FlashAttention kernel (else the PyTorch reference).
        seed: Triton with dropout only: the 0-dim int64 device tensor the mask is drawn from
            (e.g. a view of `utils.draw_seeds`); None draws one. The reference ignores it.

    Returns:
        (b, h, n_q, d) in q's dtype. A row that sees no key is zeros. From the Triton path it
        is a view of a contiguous (b, n_q, h, d) tensor, so `out.transpose(1, 2)` reshapes to
        (b, n_q, h·d) without a copy.
    """
    if use_triton:
        plan = _eager_plan(q, k, v, key_padding_mask, causal, dropout_p, training, scale)
        if plan is not None:
            seed = seed_or_draw(seed, q.device) if plan.dropout_p > 0.0 else None
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                out = _apply_eager_attention(q, k, v, key_padding_mask, seed, plan)
            else:
                out = plan.forward(q, k, v, key_padding_mask, seed, False)[0]
            return out.transpose(1, 2)
    _check_inputs(q, k, v, key_padding_mask, use_triton)
    dropout_p = check_dropout_p(dropout_p) if training else 0.0
    scale = _check_scale(scale, q.shape[-1])
    if not use_triton:
        return _attention_reference(q, k, v, causal, key_padding_mask, dropout_p, scale)
    seed = seed_or_draw(seed, q.device) if dropout_p > 0.0 else None
    op = _traced_forward_op(
        flash_attention_op, flash_attention_opaque_op, q, k, v, causal, scale,
        key_padding_mask is not None, dropout_p,
    )  # fmt: skip
    out, _ = call_op(
        op, q, k, v, key_padding_mask, seed, causal, scale, dropout_p, _needs_grad(q, k, v)
    )  # fmt: skip
    return out.transpose(1, 2)


def attention_packed(
    qkv: torch.Tensor,
    heads: int,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = True,
    scale: float | None = None,
    use_triton: bool = False,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-attention over the packed qkv projection output.

    qkv: (b, n, 3·h·d), laid out as (b, n, 3, h, d) (q, k, v; then heads): the output of
        one `x @ W_qkvᵀ`. The kernel reads q, k and v in place, and its backward writes
        d(qkv) as one tensor.
    Returns (b, n, h·d), ready for the out-projection (no copy on the Triton path).
    Other arguments as in `attention`.
    """
    if use_triton:
        kpm = key_padding_mask
        plan = _eager_packed_plan(qkv, heads, kpm, causal, dropout_p, training, scale)
        if plan is not None:
            seed = seed_or_draw(seed, qkv.device) if plan.dropout_p > 0.0 else None
            b, n, _ = qkv.shape
            if torch.is_grad_enabled() and qkv.requires_grad:
                out = _apply_eager_packed_attention(qkv, heads, kpm, seed, plan)
            else:
                q, k, v = _split_packed(qkv.unflatten(-1, (3, heads, -1)))
                out = plan.forward(q, k, v, kpm, seed, False)[0]
            return out.view(b, n, -1)
    q, k, v = _check_packed(qkv, heads)
    b, n, _ = qkv.shape
    qkv5 = qkv.unflatten(-1, (3, heads, -1))  # a view
    if not use_triton:
        out = attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
            training=training, scale=scale, use_triton=False,
        )  # fmt: skip
        return out.transpose(1, 2).reshape(b, n, -1)
    _check_inputs(q, k, v, key_padding_mask, use_triton=True)
    dropout_p = check_dropout_p(dropout_p) if training else 0.0
    scale = _check_scale(scale, q.shape[-1])
    seed = seed_or_draw(seed, qkv.device) if dropout_p > 0.0 else None
    op = _traced_forward_op(
        flash_attention_packed_op, flash_attention_packed_opaque_op, q, k, v, causal, scale,
        key_padding_mask is not None, dropout_p,
    )  # fmt: skip
    out, _ = call_op(
        op, qkv5, key_padding_mask, seed, causal, scale, dropout_p, _needs_grad(qkv)
    )  # fmt: skip
    return out.view(b, n, -1)


def _check_packed(qkv: object, heads: object) -> tuple[torch.Tensor, ...]:
    """`attention_packed`'s checks of qkv and heads; returns q, k, v, (b, h, n, d) views."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3:
        raise ValueError(f"qkv must be a (b, n, 3·h·d) tensor, got {getattr(qkv, 'shape', qkv)}")
    if not isinstance(heads, int) or heads < 1 or qkv.shape[-1] % (3 * heads):
        raise ValueError(f"qkv's last dim {qkv.shape[-1]} is not 3 · heads ({heads}) · d")
    return _split_packed(qkv.unflatten(-1, (3, heads, -1)))


def attention_cached(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: torch.Tensor,
    *,
    scale: float | None = None,
    use_triton: bool = False,
) -> torch.Tensor:
    """Causal attention of new queries over a KV cache whose length lives on the device.

    The decode step of a CUDA-graphed generation loop: the buffers keep one shape and the
    number of cached tokens is read by the kernel, so no host value changes between steps.

    Args:
        q: (b, h, n_q, d) queries of the n_q newest tokens.
        k_cache, v_cache: (b, h_kv, capacity, d), h_kv dividing h (grouped-query attention,
            as in `attention`); positions [0, cache_len) are real, the last
            n_q of them the new tokens' own keys and values. Later positions are never read.
        cache_len: 0-dim integer tensor on q's device, n_q <= cache_len <= capacity (not
            checked: it is a device value).
        scale: score scale; None means 1 / sqrt(d).
        use_triton: the fused kernel (else the PyTorch reference, over the whole capacity).

    Returns:
        (b, h, n_q, d): query i attends to keys j <= cache_len - n_q + i. Inference only:
        nothing is recorded for autograd.
    """
    _check_inputs(q, k_cache, v_cache, None, use_triton)
    if (
        not isinstance(cache_len, torch.Tensor)
        or cache_len.dim() != 0
        or cache_len.dtype.is_floating_point
        or cache_len.dtype == torch.bool
    ):
        raise TypeError(f"cache_len must be a 0-dim integer tensor, got {cache_len!r}")
    if cache_len.device != q.device:
        raise ValueError(f"cache_len is on {cache_len.device}, q on {q.device}")
    if q.shape[2] > k_cache.shape[2]:
        raise ValueError(f"{q.shape[2]} queries do not fit a cache of capacity {k_cache.shape[2]}")
    scale = _check_scale(scale, q.shape[-1])
    with torch.no_grad():
        if use_triton:
            out = call_op(flash_attention_cached_op, q, k_cache, v_cache, cache_len, scale)
            return out.transpose(1, 2)
        k_cache, v_cache = _expand_kv(q, k_cache, v_cache)
        n_q, capacity = q.shape[2], k_cache.shape[2]
        rows = torch.arange(n_q, device=q.device)[:, None]
        cols = torch.arange(capacity, device=q.device)[None, :]
        visible = cols <= rows + (cache_len - n_q)  # also keeps every key < cache_len
        scores = torch.matmul(q, k_cache.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        # stale positions may hold anything (0 · NaN is NaN): zero them, not just their weights
        stale = (cols >= cache_len).transpose(0, 1)  # (capacity, 1)
        return torch.matmul(torch.softmax(scores, dim=-1) * visible, v_cache.masked_fill(stale, 0))


def attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = True,
    scale: float | None = None,
    use_triton: bool = False,
) -> torch.Tensor:
    """The same attention composed of the package's ops: bmm -> softmax -> dropout -> bmm.

    lucidrains' design, kept as the readable reference (`Transformer(attn_impl="naive")`):
    the (n_q, n_k) score matrix is materialised. Every op takes `use_triton`. Same arguments,
    semantics and result as `attention` (any head dim).
    """
    _check_inputs(q, k, v, key_padding_mask, use_triton=False)
    if use_triton:
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            check_triton_tensor(t, name)
    dropout_p = check_dropout_p(dropout_p) if training else 0.0
    scale = _check_scale(scale, q.shape[-1])
    k, v = _expand_kv(q, k, v)  # grouped-query: the composition attends per query head
    # k's transposed view goes to bmm as is: its kernel reads strides, so nothing is copied.
    scores = bmm(q * scale, k.transpose(-1, -2), use_triton=use_triton)
    if key_padding_mask is not None:
        # In place is safe: bmm's backward needs its inputs, not this output. A finite fill
        # (not -inf) keeps a fully padded row from becoming 0/0.
        scores.masked_fill_(~key_padding_mask[:, None, None, :], -torch.finfo(scores.dtype).max)
    # the softmax masks causally itself, and outputs zeros for rows that see no key (n_q > n_k)
    attn = softmax(scores, causal=causal, use_triton=use_triton)
    if key_padding_mask is not None:
        # zero the padded keys' weights: already ~0 in rows with a real key, and a row whose
        # every visible key is padded (uniform weights from the finite fill) becomes zeros
        attn = attn * key_padding_mask[:, None, None, :].to(attn.dtype)
    attn = dropout(attn, p=dropout_p, training=True, use_triton=use_triton)
    return bmm(attn, v, use_triton=use_triton)
