"""Token + positional embedding: one gather kernel forward; backward, two deterministic
kernels (small vocabularies) or an atomic scatter-add (large ones).

With ids (b, n), a token table W (V, D) and a positional table P (max_len, D):

    h[b, i] = W[ids[b, i]] + P[start + i]

and, with g = dL/dh flattened to T = b·n rows,

    dW[v] = Σ_{t : ids_t = v} g[t]                       (a scatter-add over tokens)
    dP[p] = Σ_b g[b, p - start]   for start <= p < start + n, else 0.

Why a kernel of our own: on an H200, PyTorch's CUDA embedding backward on ≤ 3072 tokens runs
`embedding_backward_feature_kernel` with D / 32 thread blocks (16 at D = 512): 62 µs per
micro-batch of the enwik8 config, 3% of its step, plus a separate reduction for dP.

The scatter-add is written as a matrix product, dW = onehot(ids)ᵀ g, with K = T long and
a small (V, D) output, so it is split over K: a program owns a (BLOCK_V, BLOCK_D) tile of
one chunk of tokens' fp32 partial sum and walks the chunk in tiles of BLOCK_T, building the
(BLOCK_V, BLOCK_T) one-hot tile from the ids in registers and multiplying it with the
(BLOCK_T, BLOCK_D) tile of g on tensor cores; a second kernel adds the partials in chunk
order and computes dP. The one-hot entries are 0 and 1, so bf16/fp16 gradients multiply
exactly; an fp32 gradient is split into three bf16 parts, g = g1 + g2 + g3 (g1 = bf16(g),
g2 = bf16(g - g1), g3 = bf16(g - g1 - g2): 24 significand bits, all of fp32's), each
multiplied exactly. Sums run in fp32 in a fixed order: deterministic,
no atomics.

The work is V·T·D multiply-adds (times 3 for fp32), which pays only for small vocabularies
such as a byte-level model's 256. Above ONE_HOT_MAX_VOCAB the backward scatters instead: a
program loads a (BLOCK_T, BLOCK_D) tile of g and its tokens' ids and atomically adds the
tile, in fp32, into a zeroed fp32 dW at rows ids (cast to the table's dtype afterwards);
dP is the reduce kernel's positional part alone. PyTorch's CUDA embedding backward sorts the
ids first: at the GPT-2 preset (vocabulary 50,304, D = 768, 16,384 tokens) 0.29 ms per step,
against 0.03 ms for torch.compile's atomic scatter (issue #19). Atomics add in whatever order
the programs run, so the fp32 sums vary in their last bits from run to run: as PyTorch's own
kernels (index_add_) and this package's attention backward do, the scatter is taken only while
`torch.use_deterministic_algorithms` is off; on, a vocabulary above ONE_HOT_MAX_VOCAB takes
PyTorch's embedding (whose sort-based backward is deterministic) and a positional add.

Ids outside [0, V): `embedding(check_ids=True)` (the default) raises an IndexError for them
in an eager call, as PyTorch's embedding does on the CPU (on CUDA it hits a device-side
assert). An eager Triton call checks without a sync: its kernel flags a bad id on the
device, and a later checked call raises (`triton_transformer.checks`; on the CPU, the call
itself); other calls check the ids first, with a sync. The check is refused during CUDA
stream capture and skipped under torch.compile. Without the check (check_ids=False: the
Transformer, which checks its inputs itself, or a captured / compiled step) the kernel
writes a row of NaN for such an id, never a plausible zero row: the loss turns NaN, and the
trainer's non-finite check (read off the hot path, once per step) stops the run. Such ids
get no gradient.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op

from triton_transformer import checks
from triton_transformer.utils import (
    LaunchPlans,
    PerCall,
    as_rows,
    call_op,
    cdiv,
    check_not_capturing,
    check_triton_tensor,
    default,
    describe,
    eager_apply,
    first_order_only,
    interpreter_enabled,
    is_traced,
    launcher,
    shares_address,
    sm_count,
    widened_for_interpreter,
)

__all__ = ["ONE_HOT_MAX_VOCAB", "TokenIdError", "embedding"]

# Largest vocabulary whose backward runs as the one-hot product (see the module docstring).
ONE_HOT_MAX_VOCAB = 1024


@triton.jit(do_not_specialize=["start"])
def _embedding_fwd_kernel(
    IDS, WEIGHT, POS, H, BAD, start,
    stride_weight, stride_pos, stride_h,
    n_tokens, seq_len, n_vocab, dim,
    HAS_POS: tl.constexpr, CHECK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """h[t] = W[ids[t]] + P[start + t % seq_len] for one (BLOCK_T, BLOCK_D) tile, in fp32.
    CHECK: a program of the first column tile that meets an id outside [0, n_vocab) writes
    1 into the 0-d fp32 BAD, the id check's slot (`checks.reserve`, zeroed)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_in = offs_t < n_tokens
    tile_in = t_in[:, None] & (offs_d[None, :] < dim)
    ids = tl.load(IDS + offs_t, mask=t_in, other=0).to(tl.int64)
    known = (ids >= 0) & (ids < n_vocab)
    if CHECK:
        n_bad = tl.sum(tl.where(known | ~t_in, 0, 1), axis=0)
        tl.store(BAD, 1.0, mask=(n_bad > 0) & (tl.program_id(1) == 0))
    h = tl.load(
        WEIGHT + ids[:, None] * stride_weight + offs_d[None, :],
        mask=tile_in & known[:, None], other=0.0,
    ).to(tl.float32)  # fmt: skip
    if HAS_POS:
        pos = (start + offs_t % seq_len).to(tl.int64)
        pos_rows = tl.load(POS + pos[:, None] * stride_pos + offs_d[None, :], mask=tile_in)
        h += pos_rows.to(tl.float32)
    # An unchecked out-of-range id gets a NaN row, so the loss shows it (a zero row would not)
    h = tl.where(known[:, None], h, float("nan"))
    rows = offs_t.to(tl.int64)
    tl.store(H + rows[:, None] * stride_h + offs_d[None, :], h.to(H.dtype.element_ty), mask=tile_in)


@triton.jit
def _embedding_bwd_partial_kernel(
    DH, IDS, PARTIAL, stride_dh, n_tokens, tokens_per_split, n_vocab, dim,
    SPLIT_FP32: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """PARTIAL[s] (V, D) fp32 = onehot(ids)ᵀ g over token split s (grid dim 2), one
    (BLOCK_V, BLOCK_D) tile per program. Every element of PARTIAL is written, zeros included."""
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    split = tl.program_id(2)
    d_in = offs_d < dim
    t_lo = split * tokens_per_split
    t_hi = tl.minimum(t_lo + tokens_per_split, n_tokens)
    acc = tl.zeros([BLOCK_V, BLOCK_D], tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_in = offs_t < t_hi
        ids = tl.load(IDS + offs_t, mask=t_in, other=-1)
        hit = ids[None, :] == offs_v[:, None]  # (BLOCK_V, BLOCK_T) one-hot tile
        rows = offs_t.to(tl.int64)
        g = tl.load(
            DH + rows[:, None] * stride_dh + offs_d[None, :],
            mask=t_in[:, None] & d_in[None, :], other=0.0,
        )  # fmt: skip
        if SPLIT_FP32:  # three exact bf16 products carry all 24 significand bits
            onehot = hit.to(tl.bfloat16)
            g1 = g.to(tl.bfloat16)
            rest = g - g1.to(tl.float32)
            g2 = rest.to(tl.bfloat16)
            g3 = (rest - g2.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(onehot, g1, acc)
            acc = tl.dot(onehot, g2, acc)
            acc = tl.dot(onehot, g3, acc)
        else:  # bf16/fp16 gradients: 0/1 times g is exact in g's own type
            acc = tl.dot(hit.to(g.dtype), g, acc)
    v_rows = (split * n_vocab + offs_v).to(tl.int64)
    out = PARTIAL + v_rows[:, None] * dim + offs_d[None, :]
    tl.store(out, acc, mask=(offs_v[:, None] < n_vocab) & d_in[None, :])


@triton.jit(do_not_specialize=["start"])
def _embedding_bwd_reduce_kernel(
    PARTIAL, DH, DWEIGHT, DPOS, start,
    stride_dh, stride_dweight, stride_dpos,
    n_splits, batch, seq_len, n_vocab, n_pos, dim,
    HAS_VOCAB: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """HAS_VOCAB: programs [0, cdiv(V, BLOCK_R)) sum dW = Σ_s PARTIAL[s], in split order. The
    rest (HAS_POS): dP[p] = Σ_b g[b, p - start], zero outside the window. (BLOCK_R, BLOCK_D)
    tiles; every element of dW and dP is written by exactly one program. Without HAS_VOCAB
    (the scatter path, which has no partials) PARTIAL and DWEIGHT are unused placeholders:
    compiled out, so torch.compile's analysis sees no write to them."""
    pid = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_in = offs_d < dim
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    pos_block = pid  # this program's block of positions (negative: a vocabulary program)
    if HAS_VOCAB:
        n_vblocks = tl.cdiv(n_vocab, BLOCK_R)
        pos_block = pid - n_vblocks
        if pid < n_vblocks:
            offs_v = pid * BLOCK_R + tl.arange(0, BLOCK_R)
            v_in = offs_v < n_vocab
            for split in range(n_splits):
                rows = (split * n_vocab + offs_v).to(tl.int64)
                acc += tl.load(
                    PARTIAL + rows[:, None] * dim + offs_d[None, :],
                    mask=v_in[:, None] & d_in[None, :], other=0.0,
                )  # fmt: skip
            out = DWEIGHT + offs_v[:, None].to(tl.int64) * stride_dweight + offs_d[None, :]
            tl.store(out, acc.to(DWEIGHT.dtype.element_ty), mask=v_in[:, None] & d_in[None, :])
    if HAS_POS:  # noqa: SIM102 (a constexpr: without positions the block compiles out)
        if pos_block >= 0:
            offs_p = pos_block * BLOCK_R + tl.arange(0, BLOCK_R)
            i = offs_p - start  # position within the sequence
            seen = (i >= 0) & (i < seq_len)
            for b in range(batch):
                rows = (b * seq_len + i).to(tl.int64)
                acc += tl.load(
                    DH + rows[:, None] * stride_dh + offs_d[None, :],
                    mask=seen[:, None] & d_in[None, :], other=0.0,
                ).to(tl.float32)  # fmt: skip
            out = DPOS + offs_p[:, None].to(tl.int64) * stride_dpos + offs_d[None, :]
            tl.store(out, acc.to(DPOS.dtype.element_ty), mask=(offs_p[:, None] < n_pos) & d_in)


@triton.jit
def _embedding_bwd_scatter_kernel(
    DH, IDS, DWEIGHT, stride_dh, n_tokens, n_vocab, dim,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """DWEIGHT[ids[t]] += g[t] (DWEIGHT: (V, D) fp32, contiguous, zeroed) for one
    (BLOCK_T, BLOCK_D) tile of tokens and columns, by fp32 atomic adds. Ids outside
    [0, V) add nothing."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_in = offs_t < n_tokens
    ids = tl.load(IDS + offs_t, mask=t_in, other=-1).to(tl.int64)  # int64: ids·D may pass 2³¹
    known = t_in & (ids >= 0) & (ids < n_vocab)
    tile_in = known[:, None] & (offs_d[None, :] < dim)
    rows = offs_t.to(tl.int64)
    g = tl.load(DH + rows[:, None] * stride_dh + offs_d[None, :], mask=tile_in, other=0.0)
    # relaxed: the sums need no ordering with any other memory access, only atomicity
    out = DWEIGHT + ids[:, None] * dim + offs_d[None, :]
    tl.atomic_add(out, g.to(tl.float32), mask=tile_in, sem="relaxed")


# Tiles. Forward: a gather, 64 tokens by 128 columns per program. Backward: BLOCK_V = 64 is
# the smallest M of a Hopper warpgroup MMA. One (vocab, column) tile walking all T tokens
# was latency-bound (42 µs at T = 2048 and 162 at 8192 on an H200, with 32 programs), so
# the tokens are split into chunks of >= _MIN_SPLIT_TOKENS, enough to give every SM two
# programs; the reduce pass sums the fp32 partials in split order.
_EMBEDDING_FWD_CONFIG = {"BLOCK_T": 64, "BLOCK_D": 128, "num_warps": 4}
_EMBEDDING_BWD_CONFIG = {"BLOCK_V": 64, "BLOCK_T": 64, "BLOCK_D": 64, "num_warps": 4}
_EMBEDDING_BWD_REDUCE_CONFIG = {"BLOCK_R": 32, "BLOCK_D": 128, "num_warps": 4}
_EMBEDDING_BWD_INTERP_CONFIG = {"BLOCK_V": 16, "BLOCK_T": 16, "BLOCK_D": 32}
_EMBEDDING_BWD_REDUCE_INTERP_CONFIG = {"BLOCK_R": 16, "BLOCK_D": 32}
# The scatter (vocabularies above ONE_HOT_MAX_VOCAB): 32 tokens by 128 columns, 32 fp32 adds
# per thread; 3072 programs at the GPT-2 preset's 16,384 tokens and D = 768.
_EMBEDDING_BWD_SCATTER_CONFIG = {"BLOCK_T": 32, "BLOCK_D": 128, "num_warps": 4}
_EMBEDDING_BWD_SCATTER_INTERP_CONFIG = {"BLOCK_T": 16, "BLOCK_D": 32}
_MIN_SPLIT_TOKENS = 256
_MAX_PARTIAL_BYTES = 64 << 20


@functools.cache
def _n_splits(n_tokens: int, n_vocab: int, dim: int, device: torch.device) -> int:
    """Token chunks of the backward's first pass (cached per shape)."""
    if device.type != "cuda":
        return min(2, max(1, n_tokens // 16))  # the interpreter: two chunks when it can
    tiles = cdiv(n_vocab, _EMBEDDING_BWD_CONFIG["BLOCK_V"]) * cdiv(
        dim, _EMBEDDING_BWD_CONFIG["BLOCK_D"]
    )
    want = cdiv(2 * sm_count(device), tiles)
    by_tokens = max(1, n_tokens // _MIN_SPLIT_TOKENS)
    by_memory = max(1, _MAX_PARTIAL_BYTES // (n_vocab * dim * 4))
    return max(1, min(want, by_tokens, by_memory))


def _forward(ids, weight, pos_weight, start: int, bad=None, bind=False):
    """`embedding_op`'s output, and (bind) a function of (ids, weight, pos_weight, start,
    bad) that does the same for another call of these tensors' shapes, strides and facts.
    bad: the id check's slot (`checks.reserve`), which the kernel sets to 1 for an id out of
    range (None: no check; then also None in the bound function's calls)."""
    b, n = ids.shape
    n_vocab, dim = weight.shape
    out_shape, dtype = (b, n, dim), weight.dtype
    h = torch.empty(size=out_shape, device=weight.device, dtype=dtype)
    if h.numel() == 0:
        return h, (lambda *args: torch.empty(size=out_shape, device=args[1].device, dtype=dtype))
    has_pos = pos_weight is not None
    flat_ids, table, pos = _kernel_inputs(ids, weight, pos_weight)
    tile = _EMBEDDING_FWD_CONFIG
    grid = (cdiv(b * n, tile["BLOCK_T"]), cdiv(dim, tile["BLOCK_D"]))
    sizes = (table.stride(0), pos.stride(0), dim, b * n, n, n_vocab, dim)
    flags = dict(HAS_POS=has_pos, CHECK=bad is not None, **tile)
    flag = h if bad is None else bad  # (a placeholder without the check: never written)
    if not bind:
        launcher(_embedding_fwd_kernel)[grid](flat_ids, table, pos, h, flag, start, *sizes, **flags)
        return h, None
    bound = launcher(_embedding_fwd_kernel).bind(
        grid, flat_ids, table, pos, h, flag, PerCall(start), *sizes, **flags
    )
    # Later calls of this layout pass ids and tables as they are where their flat / rows
    # views share their address (a bound launch reads each tensor's address alone, and a view
    # costs host time), and convert them again where those were copies
    in_place = shares_address((flat_ids, ids), (table, weight), (pos, default(pos_weight, weight)))

    def launch(ids, weight, pos_weight, start, bad) -> torch.Tensor:
        h = torch.empty(size=out_shape, device=weight.device, dtype=dtype)
        flag = h if bad is None else bad
        if in_place:
            bound(ids, weight, pos_weight if has_pos else weight, h, flag, start)
        else:
            bound(*_kernel_inputs(ids, weight, pos_weight), h, flag, start)
        return h

    return h, launch


def _kernel_inputs(ids, weight, pos_weight) -> tuple[torch.Tensor, ...]:
    """The forward kernel's (ids (b·n,) contiguous, weight rows, positional rows or weight's
    again as the placeholder): views, or copies where none exists ((b, 1) id slices reshape
    to strided views; tables of strided columns)."""
    table = as_rows(weight)
    return ids.reshape(-1).contiguous(), table, table if pos_weight is None else as_rows(pos_weight)


@triton_op("triton_transformer::embedding", mutates_args=())
def embedding_op(
    ids: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: torch.Tensor | None,
    start: int,
    scatter: bool,
) -> torch.Tensor:
    """(b, n) ids, (V, D) weight, optional (max_len, D) pos_weight -> (b, n, D) in weight's
    dtype: weight[ids] + pos_weight[start : start + n]. scatter: the backward's dW by atomic
    scatter-add (not deterministic) instead of the one-hot product; the forward ignores it."""
    return _forward(ids, weight, pos_weight, start)[0]


def _backward(dh, ids, n_vocab: int, n_pos: int, start: int, weight_dtype, scatter, bind=False):
    """`embedding_backward_op`'s (dW, dP), and (bind) a function of (dh, ids, start) that
    does the same for another call of these tensors' shapes, strides and facts."""
    b, n, dim = dh.shape
    device = dh.device
    interpret = interpreter_enabled() or device.type != "cuda"
    reduce_tile = _EMBEDDING_BWD_REDUCE_INTERP_CONFIG if interpret else _EMBEDDING_BWD_REDUCE_CONFIG
    n_tokens = b * n
    g = as_rows(dh)
    if interpret:  # no bf16 arithmetic there: it gets the gradient in fp32
        (g,) = widened_for_interpreter(g)
    flat_ids = ids.reshape(-1).contiguous()
    if scatter:
        tile = _EMBEDDING_BWD_SCATTER_INTERP_CONFIG if interpret else _EMBEDDING_BWD_SCATTER_CONFIG
        main_grid = (cdiv(n_tokens, tile["BLOCK_T"]), cdiv(dim, tile["BLOCK_D"]))
        main_kernel, main_args = _embedding_bwd_scatter_kernel, (n_tokens, n_vocab, dim)
        # (zeros: the atomics add into it, and no program owns a row to initialise)
        work_shape, reduce_vocab, n_splits = (n_vocab, dim), 0, 0
    else:
        tile = _EMBEDDING_BWD_INTERP_CONFIG if interpret else _EMBEDDING_BWD_CONFIG
        # whole token tiles per split (at least one), and no empty split: no tokens, no
        # splits, and the reduce pass writes zeros
        splits = _n_splits(int(n_tokens), int(n_vocab), int(dim), device)  # int: cache key
        per_split = max(1, cdiv(cdiv(n_tokens, splits), tile["BLOCK_T"])) * tile["BLOCK_T"]
        n_splits = cdiv(n_tokens, per_split)
        main_grid = (cdiv(n_vocab, tile["BLOCK_V"]), cdiv(dim, tile["BLOCK_D"]), n_splits)
        main_kernel = _embedding_bwd_partial_kernel
        # the split exists for the GPU's tf32 products; the interpreter's fp32 ones are
        # exact, and it rounds casts to bf16 by truncation
        main_args = (n_tokens, per_split, n_vocab, dim)
        tile = dict(tile, SPLIT_FP32=g.dtype == torch.float32 and not interpret)
        work_shape, reduce_vocab = (n_splits, n_vocab, dim), n_vocab
    runs_main = n_tokens > 0 if scatter else n_splits > 0
    # dW from the partials (one-hot path) and dP; the scatter path's dP alone, with g as the
    # placeholder of PARTIAL and DWEIGHT (read-only: a mutated argument passed twice would be
    # cloned apart under torch.compile)
    block_r = reduce_tile["BLOCK_R"]
    n_programs = cdiv(reduce_vocab, block_r) + cdiv(n_pos, block_r)
    reduce_grid = (n_programs, cdiv(dim, reduce_tile["BLOCK_D"]))
    reduce_args = (g.stride(0), dim, dim, n_splits, b, n, reduce_vocab, n_pos, dim)
    reduce_flags = dict(HAS_VOCAB=not scatter, HAS_POS=n_pos > 0, **reduce_tile)

    def run(g, flat_ids, start, main, reduce) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate the outputs and work buffer, launch `main` (g, ids, work) and `reduce`
        (partials, g, dW, dP, start) where they have work."""
        dpos = torch.empty(size=(n_pos, dim), device=device, dtype=weight_dtype)
        if scatter:
            dweight = work = torch.zeros(size=work_shape, device=device, dtype=torch.float32)
        else:
            dweight = torch.empty(size=(n_vocab, dim), device=device, dtype=weight_dtype)
            work = torch.empty(size=work_shape, device=device, dtype=torch.float32)
        if runs_main:
            main(g, flat_ids, work)
        if n_programs:
            partial_, dweight_ = (g, g) if scatter else (work, dweight)
            reduce(partial_, g, dweight_, dpos if n_pos else dweight_, start)
        if scatter and weight_dtype != torch.float32:
            dweight = dweight.to(weight_dtype)  # the fp32 sums, rounded once
        return dweight, dpos

    if not bind:

        def main(g, flat_ids, work) -> None:
            launcher(main_kernel)[main_grid](g, flat_ids, work, g.stride(0), *main_args, **tile)

        def reduce(partial, g, dweight, dpos, start) -> None:
            launcher(_embedding_bwd_reduce_kernel)[reduce_grid](
                partial, g, dweight, dpos, start, *reduce_args, **reduce_flags
            )

        return run(g, flat_ids, start, main, reduce), None

    bound = {}  # the first call's launches, bound for the next calls

    def bind_main(g, flat_ids, work) -> None:
        bound["main"] = launcher(main_kernel).bind(
            main_grid, g, flat_ids, work, g.stride(0), *main_args, **tile
        )

    def bind_reduce(partial, g, dweight, dpos, start) -> None:
        bound["reduce"] = launcher(_embedding_bwd_reduce_kernel).bind(
            reduce_grid, partial, g, dweight, dpos, PerCall(start), *reduce_args, **reduce_flags
        )

    out = run(g, flat_ids, start, bind_main, bind_reduce)
    main_bound, reduce_bound = bound.get("main"), bound.get("reduce")
    in_place = shares_address((g, dh), (flat_ids, ids))  # (as in `_forward`)

    def launch(dh, ids, start) -> tuple[torch.Tensor, torch.Tensor]:
        if in_place:
            return run(dh, ids, start, main_bound, reduce_bound)
        g = as_rows(dh)
        if interpret:
            (g,) = widened_for_interpreter(g)
        return run(g, ids.reshape(-1).contiguous(), start, main_bound, reduce_bound)

    return out, launch


@triton_op("triton_transformer::embedding_backward", mutates_args=())
def embedding_backward_op(
    dh: torch.Tensor,
    ids: torch.Tensor,
    n_vocab: int,
    n_pos: int,
    start: int,
    weight_dtype: torch.dtype,
    scatter: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW (n_vocab, D), dP (n_pos, D)) from dh (b, n, D); n_pos = 0: no positional table
    (dP is then empty). Both in weight_dtype, accumulated in fp32. scatter: dW by fp32
    atomics (summation order varies from run to run), else the deterministic one-hot product."""
    return _backward(dh, ids, n_vocab, n_pos, start, weight_dtype, scatter)[0]


def _embedding_setup_context(ctx, inputs, output) -> None:
    ids, weight, pos_weight, ctx.start, ctx.scatter = inputs
    ctx.n_vocab = weight.shape[0]
    ctx.n_pos = pos_weight.shape[0] if pos_weight is not None else 0
    ctx.weight_dtype = weight.dtype
    ctx.save_for_backward(ids)


@first_order_only("embedding")
def _embedding_backward(ctx, dh: torch.Tensor):
    (ids,) = ctx.saved_tensors
    dweight, dpos = call_op(
        embedding_backward_op,
        dh, ids, ctx.n_vocab, ctx.n_pos, ctx.start, ctx.weight_dtype, ctx.scatter,
    )  # fmt: skip
    return None, dweight, dpos if ctx.n_pos else None, None, None


embedding_op.register_autograd(_embedding_backward, setup_context=_embedding_setup_context)


class TokenIdError(IndexError, ValueError):
    """A token id outside the table: an IndexError, as PyTorch's embedding raises, and a
    ValueError, as `Transformer`'s input check raises for one (it leaves an eager Triton
    call's ids to this op's check)."""


def _id_error(ids: torch.Tensor, n_vocab: int) -> TokenIdError | None:
    """The error for the first id outside [0, n_vocab), or None. Syncs with a CUDA device."""
    bad = (ids < 0) | (ids >= n_vocab)
    if not bad.any():
        return None
    first = ids[bad][0].item()
    return TokenIdError(f"token ids must lie in [0, {n_vocab}) (weight's rows); found id {first}")


def _check_ids_in_range(ids: torch.Tensor, n_vocab: int) -> None:
    """Raise a TokenIdError (an IndexError, as `F.embedding` raises on the CPU) if an id is
    outside [0, n_vocab). Syncs with a CUDA device, so it refuses to run during CUDA stream
    capture."""
    check_not_capturing(_ID_CHECK)
    err = _id_error(ids, n_vocab)
    if err is not None:
        raise err


_ID_CHECK = "embedding's token-id range check (pass check_ids=False inside a captured step)"


# ----------------------------------------------------------------------------- eager calls
# An eager call (nothing traces) of a layout seen before takes that layout's `_EagerPlan`, as
# `layernorm`'s do: one key of what the checks and the kernels read (`utils.eager_plan_key`:
# ids, the tables, scatter and the check), one lookup, then the launches bound for it (start
# passed per call, and the id check's slot). Kernels and gradients are the registered ops'.
#
# Its id check does not wait for the GPU (`triton_transformer.checks`): the forward kernel
# sets the call's slot of pinned host memory to 1 when it meets an id out of range, and a
# later checked call that finds it set checks the ids and raises.


class _EagerPlan:
    """The launches of eager embedding calls of one layout (`_eager_plan`): `fwd`, and one
    backward per layout of the upstream gradient, bound on their first calls."""

    __slots__ = ("bwd", "fwd", "n_pos", "n_vocab", "scatter", "weight_dtype")

    def __init__(self, weight, pos_weight, scatter: bool) -> None:
        self.n_vocab = weight.shape[0]
        self.n_pos = 0 if pos_weight is None else pos_weight.shape[0]
        self.weight_dtype, self.scatter = weight.dtype, scatter
        self.fwd: Callable[..., torch.Tensor] | None = None
        self.bwd: dict[tuple, Callable[..., tuple]] = {}

    def forward(self, ids, weight, pos_weight, start: int, bad) -> torch.Tensor:
        """weight[ids] + pos_weight[start : start + n]; ids out of range set `bad` (a check's
        slot; None: no check, as in the plan's first call, whose key says which)."""
        if self.fwd is not None:
            return self.fwd(ids, weight, pos_weight, start, bad)
        h, self.fwd = _forward(ids, weight, pos_weight, start, bad, bind=True)
        return h

    def backward(self, dh, ids, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dh.stride(), dh.dtype, not dh.data_ptr() & 15)
        bwd = self.bwd.get(key)
        if bwd is not None:
            return bwd(dh, ids, start)
        out, self.bwd[key] = _backward(
            dh, ids, self.n_vocab, self.n_pos, start, self.weight_dtype, self.scatter, bind=True
        )
        return out


_EAGER_PLANS = LaunchPlans()


def _eager_plan(ids, weight, pos_weight, scatter: bool, check: bool) -> _EagerPlan | None:
    """The plan of this eager call's layout (made on its first call; the checks have run), or
    None where the generic path runs: traced, or tables of no columns."""
    key, plan = _EAGER_PLANS.find((ids, weight, pos_weight), (scatter, check))
    if key is None or plan is not None:
        return plan
    if weight.shape[1] == 0:  # no row to write: no kernel would check the ids
        return None
    return _EAGER_PLANS.put(key, _EagerPlan(weight, pos_weight, scatter))


class _EagerEmbedding(torch.autograd.Function):
    """`embedding_op` and its registered backward for an eager call of a planned layout."""

    @staticmethod
    def forward(ctx, ids, weight, pos_weight, start, bad, plan):
        ctx.save_for_backward(ids)
        ctx.start, ctx.plan = start, plan
        return plan.forward(ids, weight, pos_weight, start, bad)

    @staticmethod
    @first_order_only("embedding")
    def backward(ctx, dh):
        (ids,) = ctx.saved_tensors
        dweight, dpos = ctx.plan.backward(dh, ids, ctx.start)
        return None, dweight, dpos if ctx.plan.n_pos else None, None, None, None


_apply_eager_embedding = eager_apply(_EagerEmbedding)


def embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: torch.Tensor | None = None,
    start: int = 0,
    use_triton: bool = False,
    *,
    check_ids: bool = True,
) -> torch.Tensor:
    """Token embedding plus (optionally) learned absolute positions.

    Args:
        ids: (b, n) int32/int64 token ids in [0, V).
        weight: (V, D) token table.
        pos_weight: optional (max_len, D) positional table; row start + i is added at
            position i (start: the number of tokens before ids, e.g. a KV cache's length).
        use_triton: the fused Triton kernels. Their backward is deterministic up to
            ONE_HOT_MAX_VOCAB rows; above, dW is an fp32 atomic scatter-add whose last bits
            vary from run to run, so with `torch.use_deterministic_algorithms(True)` a
            vocabulary that large takes the PyTorch path (deterministic, sort-based) instead.
        check_ids: raise a `TokenIdError` (an IndexError and a ValueError) for an id outside
            [0, V) (refused during CUDA stream capture; skipped under torch.compile). An
            eager Triton call on a GPU raises it from a later checked call, or from
            `triton_transformer.checks.raise_pending()`, without a sync (its rows are NaN
            meanwhile); PyTorch's path (use_triton=False, or deterministic algorithms with a
            vocabulary above ONE_HOT_MAX_VOCAB) and anomaly-detection mode check first, with
            a sync. Pass False where the ids are checked already or in a captured /
            compiled step: the Triton kernel then writes NaN rows for out-of-range ids, so
            the loss turns NaN (the trainer's non-finite check stops the run), and
            F.embedding raises an IndexError on the CPU and hits a device-side assert on
            CUDA.

    Returns:
        (b, n, D) tensor in weight's dtype: weight[ids] + pos_weight[start : start + n].

    Raises:
        TypeError / ValueError: ids not an integer (b, n) tensor, tables not 2-D or of
            different widths, or positions start .. start + n outside the positional table.
        TokenIdError: (check_ids) an id outside [0, V); an IndexError and a ValueError.
        RuntimeError: the id check during CUDA stream capture.
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be an int32/int64 tensor, got {describe(ids)}")
    if ids.dim() != 2:
        raise ValueError(f"ids must have shape (batch, seq), got {tuple(ids.shape)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D (vocab, dim) tensor, got {describe(weight)}")
    n = ids.shape[1]
    try:  # an int, or what slicing takes as one (not a float: int() would truncate it)
        start = operator.index(start)
    except TypeError:
        raise TypeError(f"start must be an int, got {describe(start)}") from None
    if pos_weight is not None:
        if not isinstance(pos_weight, torch.Tensor) or pos_weight.dim() != 2:
            raise ValueError(
                f"pos_weight must be a 2-D (max_len, dim) tensor, got {describe(pos_weight)}"
            )
        if pos_weight.shape[1] != weight.shape[1]:
            raise ValueError(
                f"pos_weight's dim {pos_weight.shape[1]} != weight's dim {weight.shape[1]}"
            )
        if start < 0 or start + n > pos_weight.shape[0]:
            raise ValueError(
                f"positions {start}..{start + n - 1} are outside pos_weight's "
                f"{pos_weight.shape[0]} rows"
            )
    # Above ONE_HOT_MAX_VOCAB the backward scatters with atomics (see the module docstring):
    # PyTorch's embedding instead when deterministic algorithms are asked for
    scatter = weight.shape[0] > ONE_HOT_MAX_VOCAB
    torch_path = not use_triton or (scatter and torch.are_deterministic_algorithms_enabled())
    # (Dynamo would break the graph on the check's data-dependent branch: a compiled caller
    # relies on the NaN rows instead)
    compiling = torch.compiler.is_compiling()
    # first, with a sync: F.embedding would stop at a device-side assert, a traced call has
    # no plan, and anomaly detection wants the error from this call
    if check_ids and not compiling and (torch_path or is_traced(ids) or torch.is_anomaly_enabled()):
        _check_ids_in_range(ids, weight.shape[0])
        check_ids = False
    if torch_path:
        h = F.embedding(ids, weight)
        return h if pos_weight is None else h + pos_weight[start : start + n]
    check_triton_tensor(weight, "weight")
    if pos_weight is not None:
        check_triton_tensor(pos_weight, "pos_weight")
        if pos_weight.dtype != weight.dtype or pos_weight.device != weight.device:
            raise ValueError(
                f"pos_weight ({pos_weight.dtype}, {pos_weight.device}) must match weight "
                f"({weight.dtype}, {weight.device})"
            )
    if ids.device != weight.device:
        raise ValueError(f"ids are on {ids.device}, weight on {weight.device}")
    check = check_ids and not compiling
    plan = _eager_plan(ids, weight, pos_weight, scatter, check)
    if plan is None:
        if check:
            _check_ids_in_range(ids, weight.shape[0])
        return call_op(embedding_op, ids, weight, pos_weight, int(start), scatter)
    bad = ticket = None
    if check:  # after the kernel, without a sync (see "eager calls" above)
        check_not_capturing(_ID_CHECK)
        checks.poll()
        bad, ticket = checks.reserve(weight.device)
    start = int(start)
    records = torch.is_grad_enabled() and (
        weight.requires_grad or (pos_weight is not None and pos_weight.requires_grad)
    )
    if records:
        h = _apply_eager_embedding(ids, weight, pos_weight, start, bad, plan)
    else:
        h = plan.forward(ids, weight, pos_weight, start, bad)
    if check:
        checks.defer(ticket, bool, functools.partial(_late_id_error, ids, weight.shape[0]))
    return h


def _late_id_error(ids: torch.Tensor, n_vocab: int) -> TokenIdError:
    """The error of a call whose kernel met an id out of range: `_id_error`'s, naming the id,
    or a general one where ids changed in place before the check could read them."""
    return _id_error(ids, n_vocab) or TokenIdError(
        f"token ids must lie in [0, {n_vocab}) (weight's rows); a call met one outside, but "
        "its ids changed before the check could name it"
    )
