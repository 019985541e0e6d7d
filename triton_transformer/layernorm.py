"""LayerNorm over the last dim, with an optional CogView "PB-relax" stable variant.

`layernorm(x, weight, bias, eps, stable, use_triton)`; `use_triton=False` runs the PyTorch
reference that defines the semantics:

    if stable: x = x / x.abs().amax(-1, keepdim=True).clamp(min=STABLE_CLAMP)
    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias

The Triton path is two `torch.library.triton_op`s, `triton_transformer::layernorm` and
`triton_transformer::layernorm_backward`, wired together with `register_autograd`, so torch.compile
traces both (no graph break) and a CUDA graph can capture them (nothing is read on the host).
The backward is first-order only (`utils.first_order_only`): `create_graph=True` raises instead
of silently dropping second-order terms. The output is a fresh tensor (not a view), so
in-place ops on it work.

The kernels here are shared with the fused residual + LayerNorm op
(`triton_transformer/residual_layernorm.py`): with RESIDUAL the forward first forms
x = h + dropout(branch), writes it, and normalises it; the backward adds the downstream
gradient of that sum and writes the masked branch gradient too. The mask is the package's one
scheme (`_jit_helpers.dropout_keep_tile`, keyed by (seed, row, column) of the (M, N) branch,
as `dropout.py`'s, attention's and the matmul epilogue's), regenerated in the backward.

Triton design (e = bytes per element; "per row" = per row of N elements):
- Forward: each program normalises BLOCK_M rows held as a (BLOCK_M, BLOCK_N) tile (several
  rows per program when N is small). With BLOCK_N >= N the rows stay in registers: one read
  of x, one write of y (2·N·e per row, the floor); statistics are fp32 and two-pass within the
  tile. A row of three power-of-two blocks (768 = 3·256) is held as three such tiles
  (`_LAYERNORM_FWD_THIRDS`), every lane busy. With BLOCK_N < N the row is processed in a loop
  over column blocks: one pass merges per-block mean/M2 (Chan's parallel variance), one pass
  writes y (plus a first pass for the row's max |x| when stable): 3·N·e per row (4·N·e
  stable), the re-reads from L2 while the rows in flight fit there. Only mean and rstd per row
  (and the scale when stable) are saved.
- Backward: with xhat = (u - mean) * rstd, u = x / scale (scale = 1 unless stable) and
  g = dy * w,

      du = rstd * (g - c2 - xhat * c1),      c1 = mean(xhat * g),  c2 = mean(g)
      dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy

  (dx = du unless stable, below): no element of dx can be written before two reductions over
  its whole row, and dweight/dbias are sums over all rows. Three variants, chosen per row
  width by `_LAYERNORM_BWD_CONFIGS`:
  "row": a program holds BLOCK_M whole rows in registers: reads x and dy once and writes dx
    (3·N·e per row, the floor), accumulating its dweight/dbias partials in registers across
    its rows. Registers bound it: at N = 16384, xhat, g and the two fp32 accumulators of one
    row are 64K 32-bit values, an SM's whole register file.
  "loop": pass 1 over column blocks for c1, c2; pass 2 re-reads x and dy, writes dx and adds
    each block's dweight/dbias into the program's row of fp32 partials in global memory:
    5·N·e + 16·N bytes per row (x and dy twice, dx, the partials read and written), served by
    L2 only while the rows in flight and the (programs, N) partials fit there.
  "split": two kernels. A row-sums kernel streams x and dy once over column blocks for c1, c2
    (and the stable tie gradient) of each row; then a column-tiled kernel, one program per
    (column tile, range of rows), reads x and dy again, writes dx and accumulates dweight/
    dbias for its columns in registers: 5·N·e per row and no N-wide state in any program, so
    it takes any width at full occupancy.
  dweight/dbias: each program (for "split", each range of rows) writes its column sums as one
  row of a (programs, N) fp32 buffer; a small column-sum kernel adds those rows in a fixed
  order. No atomics, no locks, no waiting: deterministic, and it runs in the interpreter
  (which runs programs one after another).
- Stable backward: dx = du / s plus the gradient through the scale s = max|x| (not detached,
  to match autograd of the PyTorch branch). LayerNorm ignores its input's scale except
  through eps, and indeed sum(du * u) = N * c1 * eps * rstd^2 exactly, so the kernel uses
  dL/ds = -N * c1 * eps * rstd^2 / s (no cancelling sum). It flows to the tied maxima of |x|
  as sign(x_j) / count (torch's amax splits ties evenly), and nowhere when amax < clamp
  (then no |x_j| equals s, as the clamp's gradient is zero there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op

from triton_transformer._jit_helpers import dropout_keep_tile
from triton_transformer.bmm import _grad_home, _traced_grad_acc, folded_grads, grad_targets
from triton_transformer.utils import (
    LaunchPlans,
    accumulates_grads,
    as_rows,
    call_op,
    cdiv,
    check_dropout_p,
    check_triton_tensor,
    default,
    dropout_threshold,
    eager_apply,
    exists,
    first_order_only,
    has_rows_view,
    is_traced,
    launcher,
    next_power_of_2,
    sm_count,
    tensor_facts,
)

# Lower bound on the stable variant's per-row scale, so an all-zero row does not divide by
# zero. 2**-14 is the smallest normal fp16 and is exact in fp16, bf16 and fp32, so both
# branches clamp to the same value in every dtype.
STABLE_CLAMP = 2.0**-14

# Widest column block any program holds: the tables' blocks are capped at it, and rows wider
# than the block loop over column blocks (or take the "split" backward). Tests monkeypatch it
# small to exercise those paths at small N.
MAX_BLOCK_N = 32768


class BwdConfig(NamedTuple):
    """A backward launch configuration (a `_LAYERNORM_BWD_CONFIGS` entry; see the module docstring).

    kind: "row", "loop" or "split".
    block_m, block_n, num_warps: the main kernel's tile, BLOCK_M rows x BLOCK_N columns ("row":
        BLOCK_N is the width class, the whole row; "loop": the column block of the passes;
        "split": the column tile of the dx kernel).
    per_sm: main-kernel programs per SM ("split": programs of the dx kernel, over all its
        column tiles); each owns a contiguous range of rows, and the count is a fixed function
        of the shape and device, so dweight/dbias sum in the same order every run.
    prefetch: load the next row tile before this tile's reductions ("row" and "split").
    sum_block_m, sum_block_n, sum_warps: "split" only, the row-sums kernel's tile.
    """

    kind: str
    block_m: int
    block_n: int
    num_warps: int
    per_sm: int
    prefetch: bool = False
    sum_block_m: int = 1
    sum_block_n: int = 4096
    sum_warps: int = 8


# Launch configurations keyed by the width class of a row: N rounded up to a power of two (at
# least 16). Classes not listed take the nearest entry. Forward: (BLOCK_M rows per program,
# BLOCK_N, warps); BLOCK_N >= N keeps the rows in registers, BLOCK_N < N loops over blocks.
#
# Classes 512-4096 come from the H200 sweep of 2026-11-22 (bf16, kernel times) at 2048 and
# 8192 x 512, 4096 and 16384 x 1024, 4096 x 2048 and 4096 x 4096 (`layernorm_tune_512.json`,
# `layernorm_tune_1024_4096.json` in benchmarks/results/NVIDIA-H200): each entry is within 6%
# of the best at every swept shape. The backward wants few elements per thread (4-8), 4 warps
# up to N = 1024, and the next tile's loads prefetched: at 2048 x 512 it takes 7.2 µs against
# 24.9 for the older (4 rows, 8 warps, 4 per SM) entry, at 4096 x 1024 9.9 against 24.6.
#
# Classes 8192 and 16384 (and 128 and 256 until the retune below) come from
# `benchmarks/bench_layernorm.py --tune` on an H100 (2026-11-24; 2**26-element bf16 tensors,
# kernel times against torch.compile's, plain / stable, forward then backward: 128: 1.00 /
# 0.99, 0.76 / 0.76; 256: 0.98 / 1.00, 0.98 / 0.93; 8192: 1.00 / 0.83, 0.50 / 0.48; 16384:
# 0.96 / 0.97, 0.81 / 0.61, < 1 faster). At 16384 the forward holds the row in registers and
# the backward takes the "split" variant (5·N·e bytes per row against the looped variant's
# 5·N·e + 16·N). The same sweep's picks for 512-4096 are not taken: at its 128 MB tensors they
# tie the entries above (0.84-1.00 of compile), which were measured at the model's own shapes.
# Classes 16-64 are not swept.
#
# Classes 128, 256 and 512 of the forward, and the stable forward's overrides below, come from
# the H200 sweep of 2026-11-27 (`bench_layernorm.py --tune --widths 16384,1024,768,384,256`,
# then `probe_layernorm_fwd.py`, kernel µs at 2**26 elements per bf16 tensor, the previous
# entry -> this one, torch.compile's in brackets): plain 128: 71.0 -> 66.8 (69.3); 256: 74.4
# -> 65.7 (68.4); 384: 76.3 -> 69.1 (69.4); 512: 67.6 -> 67.8 (67.6); stable 128: 74.0 ->
# 68.8 (78.5); 256: 79.0 -> 69.4 (71.4); 384: 86.5 -> 72.8 (91.6); 512: 71.0 -> 69.2 (70.6);
# 768: 85.2 -> 71.0 (71.2), and at GPT-2's 16384 x 768 18.2 -> 16.5 (15.4); 1024: 69.8 ->
# 68.1 (67.6). The plain 1024 class keeps its entry: the sweep's pick ties it at 1024 columns
# (67.3 against 68.1) and loses at GPT-2's 16384 x 768 (16.3 against 15.9), which the model's
# residual forward runs. Cache hints (`evict_first` on x, as inductor's kernels have) measured
# 0-3% slower everywhere and are not used.
_LAYERNORM_FWD_CONFIGS: dict[int, tuple[int, int, int]] = {
    16: (128, 16, 8),
    32: (64, 32, 8),
    64: (32, 64, 8),
    128: (16, 128, 2),
    256: (8, 256, 2),
    512: (4, 512, 2),
    1024: (4, 1024, 4),
    2048: (4, 2048, 4),
    4096: (2, 4096, 8),
    8192: (1, 8192, 16),
    16384: (1, 16384, 8),
}
# The stable forward (one more row reduction, the absolute maximum) at the classes where it
# wants another tile than the plain one: fewer warps per row (above). Only exact classes.
_LAYERNORM_FWD_STABLE_CONFIGS: dict[int, tuple[int, int, int]] = {
    128: (8, 128, 1),
    512: (2, 512, 1),
    1024: (2, 1024, 2),
}
# Rows of three power-of-two blocks (768 = 3·256) held as three blocks of registers (the
# kernel's THIRDS) instead of one block of the next power of two with a quarter of its lanes
# idle: keyed by the exact width, plain and stable forwards (the residual form keeps the
# tables: at GPT-2's 16384 x 768 it measured 39.6 against 39.3 µs). H200, 2026-11-27
# (`probe_layernorm_fwd.py`, kernel µs at 2**26 elements per bf16 tensor, one block -> three,
# torch.compile's in brackets): 768 plain 69.9 -> 67.6 (67.7), stable 71.1 -> 68.3 (70.9); 384
# plain 69.5 -> 67.6 (69.4), stable 72.6 -> 68.9 (92.3); 12288 plain 83.7 -> 68.5 (90.0),
# stable 108.5 -> 73.8 (138.2). Other widths of this form are not measured.
_LAYERNORM_FWD_THIRDS: dict[int, tuple[int, int, int]] = {
    384: (8, 128, 2),
    768: (4, 256, 2),
    12288: (1, 4096, 8),
}
# The plain forward (not stable, not the residual form) of fp16/bf16 rows at exactly these
# widths, where two rows per program beat the class's four. H200, 2026-11-28 (`bench_layernorm`
# and a probe of the 33rd session, kernel µs, medians of 9 interleaved rounds, bf16, 1024
# columns, (4, 1024, 4) -> (2, 1024, 4), torch.compile's in brackets): 8192 rows 11.01 ->
# 10.75 (11.40); 16384 19.59 -> 19.04 (19.71); 32768 36.04 -> 35.10 (35.88); 65536 68.38 ->
# 66.28 (67.83); at 4096 rows 6.55 -> 6.78 (6.55), at 2048 4.63 -> 4.36 (4.07). fp32 rows keep
# the class's tile: (2, 1024, 4) measured 35.59 against 35.04 at 16384 rows.
_LAYERNORM_FWD_PLAIN_16BIT: dict[int, tuple[int, int, int]] = {
    1024: (2, 1024, 4),
}
_LAYERNORM_BWD_CONFIGS: dict[int, BwdConfig] = {
    16: BwdConfig("row", 128, 16, 8, 4),
    32: BwdConfig("row", 64, 32, 8, 4),
    64: BwdConfig("row", 32, 64, 8, 4),
    128: BwdConfig("row", 64, 128, 16, 1),
    256: BwdConfig("row", 32, 256, 16, 2, prefetch=True),
    512: BwdConfig("row", 1, 512, 4, 4, prefetch=True),
    1024: BwdConfig("row", 4, 1024, 4, 2, prefetch=True),
    2048: BwdConfig("row", 2, 2048, 8, 2, prefetch=True),
    4096: BwdConfig("row", 1, 4096, 8, 2, prefetch=True),
    8192: BwdConfig("row", 1, 8192, 16, 2, prefetch=True),
    16384: BwdConfig("split", 16, 128, 4, 4, sum_block_m=1, sum_block_n=8192, sum_warps=16),
}
# Plain (not stable) backward entries for many rows: (least rows, entry). At 512 columns the
# entry above, tuned at the model's 2,048-8,192 rows, falls behind from ~16K rows on; the
# H100 sweep's pick at 131,072 rows (8 rows and 8 warps per program, 2 per SM) wins from 32K.
# H200, `benchmarks/probe_layernorm_rows.py`, bf16 kernel µs, shipped / this entry: 4,096
# rows 10.9 / 17.7; 16,384 29.1 / 27.7; 32,768 52.9 / 41.7; 65,536 98.0 / 68.7; 131,072
# 187.7 / 121.8. Stable LayerNorm keeps the entry above (32.0 / 42.8 at 16,384 rows,
# 210.2 / 231.0 at 131,072).
# At 256 columns the plain backward takes its own entry at any row count: the H200 sweep of
# 2026-11-27 (262,144 rows, the only count swept at this class, as for the entry above, from an
# H100) timed it at 123.7 µs against the table's 129.7 and compile's 126.8; the stable
# backward keeps the table's (167.8 µs against this one's 178.1).
_LAYERNORM_BWD_MANY_ROWS: dict[int, tuple[int, BwdConfig]] = {
    256: (1, BwdConfig("row", 16, 256, 8, 2)),
    512: (32768, BwdConfig("row", 8, 512, 8, 2, prefetch=True)),
}
# Backward entries of the residual form (`residual_layernorm`: the downstream gradient of the
# sum added, the branch gradient written), plain LayerNorm. In the model the residual stream
# is fp32: 20 bytes per element read and written, against the 6 of the bf16 op the table
# above was tuned on. H200, `benchmarks/probe_residual_ln_bwd.py` (2026-11-27; 96 "row"
# configurations; kernel µs, the entry above -> this one): 8192 x 512 28.9 -> 24.6,
# 16384 x 768 68.3 -> 62.4, 16384 x 1024 79.1 -> 74.5.
_LAYERNORM_BWD_RESIDUAL: dict[int, BwdConfig] = {
    512: BwdConfig("row", 4, 512, 2, 4, prefetch=True),
    1024: BwdConfig("row", 1, 1024, 8, 4, prefetch=True),
}
# Column-sum kernel: columns per program, partial rows per step (one step covers up to 256
# backward programs, so the few column programs are not latency-bound loops) and warps.
_COLSUM_BLOCK_C = 32
_COLSUM_BLOCK_G = 256
_COLSUM_WARPS = 8
# Eager launches bound once per shape (`utils.LaunchPlans`): the forward's kernel, and the
# backward's kernels with the shapes of their work buffers. A hit skips the tables, the grid
# and the launcher's key; what the tables give is part of the key only through the shape
# (and MAX_BLOCK_N), so `_clear_config_caches` forgets the plans with the configurations.
_PLANS = LaunchPlans()


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _keep_mask(SEED, rows, col0, N, threshold, BLOCK_N: tl.constexpr, INT64_IDX: tl.constexpr):
    """Dropout keep mask (bool) of the tile `rows` x [col0, col0 + BLOCK_N) of the (M, N)
    branch: the package's one mask scheme (`_jit_helpers.dropout_keep_tile`), a pure function
    of (seed, row, column), so the backward regenerates the forward's mask."""
    return dropout_keep_tile(tl.load(SEED), rows, col0, N, threshold, BLOCK_N, INT64_IDX) != 0


@triton.jit
def _load_x(
    X, H, BR, SEED, rows, col0, mask, N, stride_x, stride_h, stride_br, threshold, drop_scale,
    RESIDUAL: tl.constexpr, DROPOUT: tl.constexpr, INT64_IDX: tl.constexpr,
    STORE_X: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The fp32 tile of x at `rows` x [col0, col0 + BLOCK_N): loaded from X, or (RESIDUAL)
    formed as h + dropout(branch), rounded to X's dtype exactly as the stored sum is (and
    stored into X when STORE_X)."""
    r64 = rows.to(tl.int64)[:, None]
    cols = col0 + tl.arange(0, BLOCK_N)
    if RESIDUAL:
        h = tl.load(H + r64 * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        br = tl.load(BR + r64 * stride_br + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            keep = _keep_mask(SEED, rows, col0, N, threshold, BLOCK_N, INT64_IDX)
            br = tl.where(keep, br * drop_scale, 0.0)
        xs = (h + br).to(X.dtype.element_ty)
        if STORE_X:
            tl.store(X + r64 * stride_x + cols[None, :], xs, mask=mask)
        x = xs.to(tl.float32)
    else:
        x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _store_y(Y, W, B, y_rows, xc, rstd, col0, mask, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = xc · rstd · w (+ b) of the block of columns [col0, col0 + BLOCK_N), all inside the
    row, stored at the rows `y_rows` (pointers to each row's start) under the row mask."""
    cols = col0 + tl.arange(0, BLOCK_N)
    y = xc * rstd[:, None] * tl.load(W + cols).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols).to(tl.float32)[None, :]
    tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layernorm_fwd_kernel(
    X, W, B, Y, Stats, H, BR, SEED,
    M, N, inv_n, stride_x, stride_y, stride_h, stride_br, eps, clamp, threshold, drop_scale,
    HAS_BIAS: tl.constexpr, STABLE: tl.constexpr, SINGLE: tl.constexpr,
    RESIDUAL: tl.constexpr, DROPOUT: tl.constexpr, INT64_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, THIRDS: tl.constexpr = False,
):  # fmt: skip
    # THIRDS (with SINGLE): N = 3·BLOCK_N, the row held as three blocks of registers, so a
    # width such as 768 = 3·256 runs with every lane busy instead of in a 1024-wide block.
    # inv_n = 1/N comes from the host: fp32 division on the GPU is approximate (div.full),
    # so `sum / N` would not even reproduce x exactly for N = 1.
    # torch.compile passes Python floats as fp64: compute in fp32 as the eager launch does
    inv_n, eps = tl.cast(inv_n, tl.float32), tl.cast(eps, tl.float32)
    clamp = tl.cast(clamp, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    y_rows = Y + rows.to(tl.int64)[:, None] * stride_y
    cols = tl.arange(0, BLOCK_N)

    if SINGLE and THIRDS:
        # The same math as the one-block path below, over the three blocks' partial sums.
        mask = row_mask[:, None] & (cols < BLOCK_N)[None, :]  # every column is in the row
        x0 = _load_x(
            X, H, BR, SEED, rows, 0, mask, N, stride_x, stride_h, stride_br, threshold,
            drop_scale, RESIDUAL, DROPOUT, INT64_IDX, True, BLOCK_N,
        )  # fmt: skip
        x1 = _load_x(
            X, H, BR, SEED, rows, BLOCK_N, mask, N, stride_x, stride_h, stride_br, threshold,
            drop_scale, RESIDUAL, DROPOUT, INT64_IDX, True, BLOCK_N,
        )  # fmt: skip
        x2 = _load_x(
            X, H, BR, SEED, rows, 2 * BLOCK_N, mask, N, stride_x, stride_h, stride_br,
            threshold, drop_scale, RESIDUAL, DROPOUT, INT64_IDX, True, BLOCK_N,
        )  # fmt: skip
        if STABLE:
            amax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
            scale = tl.maximum(tl.maximum(amax, tl.max(tl.abs(x2), axis=1)), clamp)
            inv_scale = (1.0 / scale)[:, None]  # x * (1/scale): see the one-block path
            x0, x1, x2 = x0 * inv_scale, x1 * inv_scale, x2 * inv_scale
        mean = (tl.sum(x0, axis=1) + tl.sum(x1, axis=1) + tl.sum(x2, axis=1)) * inv_n
        x0, x1, x2 = x0 - mean[:, None], x1 - mean[:, None], x2 - mean[:, None]
        m2 = tl.sum(x0 * x0, axis=1) + tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = tl.rsqrt(m2 * inv_n + eps)
        _store_y(Y, W, B, y_rows, x0, rstd, 0, mask, HAS_BIAS, BLOCK_N)
        _store_y(Y, W, B, y_rows, x1, rstd, BLOCK_N, mask, HAS_BIAS, BLOCK_N)
        _store_y(Y, W, B, y_rows, x2, rstd, 2 * BLOCK_N, mask, HAS_BIAS, BLOCK_N)
    elif SINGLE:
        # The whole row fits one block: load once, everything stays in registers.
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_x(
            X, H, BR, SEED, rows, 0, mask, N, stride_x, stride_h, stride_br, threshold,
            drop_scale, RESIDUAL, DROPOUT, INT64_IDX, True, BLOCK_N,
        )  # fmt: skip
        if STABLE:
            scale = tl.maximum(tl.max(tl.abs(x), axis=1), clamp)
            # x * (1/scale), never x / scale: the GPU's approximate division may be
            # compiled differently in the backward kernel, and u must match there bit for bit
            # (a one-ulp difference times rstd is a visible error in xhat).
            x = x * (1.0 / scale)[:, None]
        mean = tl.sum(x, axis=1) * inv_n
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) * inv_n + eps)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Passes before the last recompute x (RESIDUAL: from h and branch; the sum is stored
        # only in the last pass, so no pass reads what another thread wrote).
        if STABLE:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for off in range(0, N, BLOCK_N):
                mask = row_mask[:, None] & (off + cols < N)[None, :]
                x = _load_x(
                    X, H, BR, SEED, rows, off, mask, N, stride_x, stride_h, stride_br,
                    threshold, drop_scale, RESIDUAL, DROPOUT, INT64_IDX, False, BLOCK_N,
                )  # fmt: skip
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            scale = tl.maximum(amax, clamp)
        # One pass for mean and M2: exact two-pass statistics within each block, merged
        # across blocks with Chan's formula (stable, unlike sum / sum-of-squares).
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            mask = row_mask[:, None] & (off + cols < N)[None, :]
            x = _load_x(
                X, H, BR, SEED, rows, off, mask, N, stride_x, stride_h, stride_br,
                threshold, drop_scale, RESIDUAL, DROPOUT, INT64_IDX, False, BLOCK_N,
            )  # fmt: skip
            if STABLE:
                x = x * (1.0 / scale)[:, None]
            n_seen = off * 1.0  # as fp32 (`off` may be a Python int in the interpreter)
            n_blk = tl.minimum(N - off, BLOCK_N) * 1.0
            blk_mean = tl.sum(x, axis=1) / n_blk
            d = tl.where(mask, x - blk_mean[:, None], 0.0)
            delta = blk_mean - mean
            mean += delta * (n_blk / (n_seen + n_blk))
            m2 += tl.sum(d * d, axis=1) + delta * delta * (n_seen * n_blk / (n_seen + n_blk))
        rstd = tl.rsqrt(m2 * inv_n + eps)
        for off in range(0, N, BLOCK_N):
            col_mask = off + cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_x(
                X, H, BR, SEED, rows, off, mask, N, stride_x, stride_h, stride_br,
                threshold, drop_scale, RESIDUAL, DROPOUT, INT64_IDX, True, BLOCK_N,
            )  # fmt: skip
            if STABLE:
                x = x * (1.0 / scale)[:, None]
            w = tl.load(W + off + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
            if HAS_BIAS:
                y += tl.load(B + off + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows + off + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    # Stats is (2 or 3, M) fp32: mean, rstd (and scale when stable) of u = x / scale.
    tl.store(Stats + rows, mean, mask=row_mask)
    tl.store(Stats + M + rows, rstd, mask=row_mask)
    if STABLE:
        tl.store(Stats + 2 * M + rows, scale, mask=row_mask)


@triton.jit
def _ln_xhat_g(x, dy, w, mask, mean, rstd, scale, STABLE: tl.constexpr):
    """Recompute xhat = (u - mean) * rstd (u = x / scale when stable) and g = w * dy."""
    u = x
    if STABLE:
        u = x * (1.0 / scale)[:, None]  # exactly as in the forward kernel
    xhat = tl.where(mask, (u - mean[:, None]) * rstd[:, None], 0.0)
    return xhat, dy * w[None, :]


@triton.jit
def _ln_dx(xhat, g, x, mask, c1, c2, tie_grad, rstd, scale, STABLE: tl.constexpr):
    """dx of one tile from the row reductions c1 = mean(xhat * g), c2 = mean(g)."""
    du = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
    if STABLE:
        # u = x / s: dx = du / s, plus dL/ds * sign(x) / count at the tied maxima of |x|.
        tie = (tl.abs(x) == scale[:, None]) & mask
        signed = tl.where(x > 0, tie_grad[:, None], -tie_grad[:, None])
        du = du * (1.0 / scale)[:, None] + tl.where(tie, signed, 0.0)
    return du


@triton.jit
def _store_dx(
    DX, DHN, DBR, SEED, dx, rows, col0, mask, N, stride_dx, stride_dhn, stride_dbr, threshold,
    drop_scale,
    HAS_DHN: tl.constexpr, WRITE_DBR: tl.constexpr, DROPOUT: tl.constexpr,
    INT64_IDX: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Store dx of the tile `rows` x [col0, col0 + BLOCK_N) (+ the downstream gradient of the
    residual sum) and the branch gradient."""
    r64 = rows.to(tl.int64)[:, None]
    cols = col0 + tl.arange(0, BLOCK_N)
    if HAS_DHN:
        dx += tl.load(DHN + r64 * stride_dhn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WRITE_DBR:
        dbr = dx
        if DROPOUT:
            keep = _keep_mask(SEED, rows, col0, N, threshold, BLOCK_N, INT64_IDX)
            dbr = tl.where(keep, dx * drop_scale, 0.0)
        tl.store(DBR + r64 * stride_dbr + cols[None, :], dbr.to(DBR.dtype.element_ty), mask=mask)


@triton.jit
def _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy):
    """x and dy tiles of `rows` (masked past row_end), in their storage dtype."""
    mask = (rows < row_end)[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
    return x, dy


@triton.jit
def _ln_row_sums(
    X, W, DY, rows, row_mask, N, inv_n, stride_x, stride_dy, eps, mean, rstd, scale,
    STABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """c1 = mean(xhat * g) and c2 = mean(g) of BLOCK_M rows in one pass over column blocks,
    and (STABLE) each row's scale gradient per tied maximum, tie_grad (else c1, unused)."""
    cols = tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)[:, None]
    c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    count = tl.zeros([BLOCK_M], dtype=tl.float32)
    for off in range(0, N, BLOCK_N):
        col_mask = off + cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        c = off + cols[None, :]
        x = tl.load(X + rows64 * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + off + cols, mask=col_mask, other=0.0).to(tl.float32)
        xhat, g = _ln_xhat_g(x, dy, w, mask, mean, rstd, scale, STABLE)
        c1 += tl.sum(xhat * g, axis=1)
        c2 += tl.sum(g, axis=1)
        if STABLE:
            tie = (tl.abs(x) == scale[:, None]) & mask
            count += tl.sum(tie.to(tl.float32), axis=1)
    c1 = c1 * inv_n
    c2 = c2 * inv_n
    tie_grad = c1  # unused unless STABLE
    if STABLE:
        tie_grad = -N * c1 * eps * rstd * rstd / scale / tl.maximum(count, 1.0)
    return c1, c2, tie_grad


@triton.jit
def _load_stats(Stats, rows, row_mask, M, STABLE: tl.constexpr):
    """mean, rstd and (STABLE) scale of `rows` (else rstd, unused) from the forward's stats."""
    mean = tl.load(Stats + rows, mask=row_mask, other=0.0)
    rstd = tl.load(Stats + M + rows, mask=row_mask, other=0.0)
    scale = rstd  # unused unless STABLE
    if STABLE:
        scale = tl.load(Stats + 2 * M + rows, mask=row_mask, other=1.0)
    return mean, rstd, scale


# rows_per_prog and G change with the row count and the programs per SM: not specialised on
# (their divisibility would compile a kernel per value class, for nothing).
@triton.jit(do_not_specialize=["rows_per_prog"])
def _layernorm_bwd_kernel(
    X, W, DY, DX, Partial, Stats, DHN, DBR, SEED,
    M, N, inv_n, rows_per_prog, stride_x, stride_dy, stride_dx, stride_dhn, stride_dbr,
    eps, threshold, drop_scale,
    HAS_BIAS: tl.constexpr, STABLE: tl.constexpr, SINGLE: tl.constexpr,
    HAS_DHN: tl.constexpr, WRITE_DBR: tl.constexpr, DROPOUT: tl.constexpr,
    INT64_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    """The "row" (SINGLE) and "loop" backward: dx of rows [pid * rows_per_prog, ...) and their
    dweight/dbias column sums as row pid of Partial (dbias's rows follow dweight's)."""
    # torch.compile passes Python floats as fp64: compute in fp32 as the eager launch does
    inv_n, eps = tl.cast(inv_n, tl.float32), tl.cast(eps, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    cols = tl.arange(0, BLOCK_N)
    dw_out = Partial + pid.to(tl.int64) * N
    db_out = dw_out + tl.num_programs(0).to(tl.int64) * N

    if SINGLE:
        col_mask = cols < N
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            rows = row_start + tl.arange(0, BLOCK_M)
            x_next, dy_next = _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy)
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            mask = row_mask[:, None] & col_mask[None, :]
            if PREFETCH:
                # Issue the next tile's loads before this tile's reductions, so their memory
                # latency overlaps this tile's work.
                x, dy = x_next, dy_next
                x_next, dy_next = _load_x_dy(
                    X, DY, rows + BLOCK_M, row_end, cols, col_mask, stride_x, stride_dy
                )
            else:
                x, dy = _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
            mean, rstd, scale = _load_stats(Stats, rows, row_mask, M, STABLE)
            xhat, g = _ln_xhat_g(x, dy, w, mask, mean, rstd, scale, STABLE)
            c1 = tl.sum(xhat * g, axis=1) * inv_n
            c2 = tl.sum(g, axis=1) * inv_n
            tie_grad = c1  # unused unless STABLE
            if STABLE:
                count = tl.sum(((tl.abs(x) == scale[:, None]) & mask).to(tl.float32), axis=1)
                tie_grad = -N * c1 * eps * rstd * rstd / scale / tl.maximum(count, 1.0)
            dx = _ln_dx(xhat, g, x, mask, c1, c2, tie_grad, rstd, scale, STABLE)
            _store_dx(
                DX, DHN, DBR, SEED, dx, rows, 0, mask, N, stride_dx, stride_dhn, stride_dbr,
                threshold, drop_scale, HAS_DHN, WRITE_DBR, DROPOUT, INT64_IDX, BLOCK_N,
            )  # fmt: skip
            dw_acc += dy * xhat
            if HAS_BIAS:
                db_acc += dy
        tl.store(dw_out + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if HAS_BIAS:
            tl.store(db_out + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows64 = rows.to(tl.int64)[:, None]
            mean, rstd, scale = _load_stats(Stats, rows, row_mask, M, STABLE)
            # Pass 1: the row reductions (and the count of tied maxima).
            c1, c2, tie_grad = _ln_row_sums(
                X, W, DY, rows, row_mask, N, inv_n, stride_x, stride_dy, eps, mean, rstd, scale,
                STABLE, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            # Pass 2: dx, and this row tile's share of the program's dweight/dbias partials
            # (read-modify-write of the program's own buffer row; the first tile just writes).
            not_first = tl.full([BLOCK_N], r0, tl.int32) > row_start
            for off in range(0, N, BLOCK_N):
                col_mask = off + cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                c = off + cols[None, :]
                x = tl.load(X + rows64 * stride_x + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + rows64 * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + off + cols, mask=col_mask, other=0.0).to(tl.float32)
                xhat, g = _ln_xhat_g(x, dy, w, mask, mean, rstd, scale, STABLE)
                dx = _ln_dx(xhat, g, x, mask, c1, c2, tie_grad, rstd, scale, STABLE)
                _store_dx(
                    DX, DHN, DBR, SEED, dx, rows, off, mask, N, stride_dx, stride_dhn,
                    stride_dbr, threshold, drop_scale, HAS_DHN, WRITE_DBR, DROPOUT, INT64_IDX,
                    BLOCK_N,
                )  # fmt: skip
                pmask = col_mask & not_first
                dw = tl.load(dw_out + off + cols, mask=pmask, other=0.0)
                tl.store(dw_out + off + cols, dw + tl.sum(dy * xhat, axis=0), mask=col_mask)
                if HAS_BIAS:
                    db = tl.load(db_out + off + cols, mask=pmask, other=0.0)
                    tl.store(db_out + off + cols, db + tl.sum(dy, axis=0), mask=col_mask)


@triton.jit
def _layernorm_bwd_rowsum_kernel(
    X, W, DY, Stats, RowSums, M, N, inv_n, stride_x, stride_dy, eps,
    STABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The "split" backward's kernel 1: RowSums (2 or 3, M) fp32 = c1, c2 (and tie_grad when
    stable) of each row, reading x and dy once."""
    inv_n, eps = tl.cast(inv_n, tl.float32), tl.cast(eps, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    mean, rstd, scale = _load_stats(Stats, rows, row_mask, M, STABLE)
    c1, c2, tie_grad = _ln_row_sums(
        X, W, DY, rows, row_mask, N, inv_n, stride_x, stride_dy, eps, mean, rstd, scale,
        STABLE, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    tl.store(RowSums + rows, c1, mask=row_mask)
    tl.store(RowSums + M + rows, c2, mask=row_mask)
    if STABLE:
        tl.store(RowSums + 2 * M + rows, tie_grad, mask=row_mask)


@triton.jit(do_not_specialize=["rows_per_prog"])
def _layernorm_bwd_cols_kernel(
    X, W, DY, DX, Partial, Stats, RowSums, DHN, DBR, SEED,
    M, N, rows_per_prog, stride_x, stride_dy, stride_dx, stride_dhn, stride_dbr, threshold,
    drop_scale,
    HAS_BIAS: tl.constexpr, STABLE: tl.constexpr, HAS_DHN: tl.constexpr,
    WRITE_DBR: tl.constexpr, DROPOUT: tl.constexpr, INT64_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """The "split" backward's kernel 2: program (j, k) owns column tile j and the k-th range of
    rows_per_prog rows. It writes their dx from the row sums of kernel 1, and its dweight/dbias
    column sums into row k of Partial (dbias's rows follow dweight's)."""
    drop_scale = tl.cast(drop_scale, tl.float32)
    col0 = tl.program_id(0) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    group = tl.program_id(1)
    row_start = group * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        rows = row_start + tl.arange(0, BLOCK_M)
        x_next, dy_next = _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        if PREFETCH:
            x, dy = x_next, dy_next
            x_next, dy_next = _load_x_dy(
                X, DY, rows + BLOCK_M, row_end, cols, col_mask, stride_x, stride_dy
            )
        else:
            x, dy = _load_x_dy(X, DY, rows, row_end, cols, col_mask, stride_x, stride_dy)
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
        mean, rstd, scale = _load_stats(Stats, rows, row_mask, M, STABLE)
        c1 = tl.load(RowSums + rows, mask=row_mask, other=0.0)
        c2 = tl.load(RowSums + M + rows, mask=row_mask, other=0.0)
        tie_grad = c1  # unused unless STABLE
        if STABLE:
            tie_grad = tl.load(RowSums + 2 * M + rows, mask=row_mask, other=0.0)
        xhat, g = _ln_xhat_g(x, dy, w, mask, mean, rstd, scale, STABLE)
        dx = _ln_dx(xhat, g, x, mask, c1, c2, tie_grad, rstd, scale, STABLE)
        _store_dx(
            DX, DHN, DBR, SEED, dx, rows, col0, mask, N, stride_dx, stride_dhn, stride_dbr,
            threshold, drop_scale, HAS_DHN, WRITE_DBR, DROPOUT, INT64_IDX, BLOCK_N,
        )  # fmt: skip
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    dw_out = Partial + group.to(tl.int64) * N
    tl.store(dw_out + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        db_out = dw_out + tl.num_programs(1).to(tl.int64) * N
        tl.store(db_out + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit(do_not_specialize=["G"])
def _layernorm_bwd_colsum_kernel(
    Partial, DW, DB, G, N,
    HAS_BIAS: tl.constexpr, ACC_W: tl.constexpr, ACC_B: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Sum the (G, N) partials over G in a fixed order: dweight per column from Partial's first
    G rows (and dbias from its next G: Partial is (2, G, N) with a bias). ACC_W / ACC_B: add the
    sum to what DW / DB hold (a parameter's `.grad`, summed over micro-batches in place)
    instead of overwriting it. (One buffer, not a view per half: a view costs an eager call
    microseconds of host time.)"""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    db = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        gs = g0 + tl.arange(0, BLOCK_G)
        mask = (gs < G)[:, None] & col_mask[None, :]
        offs = gs.to(tl.int64)[:, None] * N + cols[None, :]
        dw += tl.load(Partial + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            offs_b = (gs + G).to(tl.int64)[:, None] * N + cols[None, :]
            db += tl.load(Partial + offs_b, mask=mask, other=0.0)
    dw_sum = tl.sum(dw, axis=0)
    if ACC_W:
        dw_sum += tl.load(DW + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(DW + cols, dw_sum.to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        db_sum = tl.sum(db, axis=0)
        if ACC_B:
            db_sum += tl.load(DB + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(DB + cols, db_sum.to(DB.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------- launch config


def width_class(n_cols: int) -> int:
    """The launch tables' key for rows of `n_cols`: N rounded up to a power of two, >= 16."""
    return max(16, next_power_of_2(n_cols))


def _nearest(table: dict, width: int):
    if width in table:
        return table[width]
    return table[min(table, key=lambda k: abs(k.bit_length() - width.bit_length()))]


@functools.cache
def _layernorm_fwd_config(
    n_cols: int, max_block: int, stable: bool = False
) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, single) of the forward kernel for rows of `n_cols`: the
    `_LAYERNORM_FWD_STABLE_CONFIGS` entry of the width class (stable, where it has one) or the
    `_LAYERNORM_FWD_CONFIGS` one, its block capped at the width class and at max_block (a row
    wider than the block loops over blocks)."""
    width = width_class(n_cols)
    if stable and width in _LAYERNORM_FWD_STABLE_CONFIGS:
        block_m, block_n, num_warps = _LAYERNORM_FWD_STABLE_CONFIGS[width]
    else:
        block_m, block_n, num_warps = _nearest(_LAYERNORM_FWD_CONFIGS, width)
    block_n = min(block_n, width, max_block)
    return block_m, block_n, num_warps, n_cols <= block_n


def _layernorm_fwd_exact_config(
    n_cols: int, max_block: int, stable: bool = False, itemsize: int = 2
) -> tuple[int, int, int] | None:
    """The tile (BLOCK_M, BLOCK_N, num_warps) an exact-width table gives a row of n_cols (not
    the residual form): `_LAYERNORM_FWD_PLAIN_16BIT`'s for the plain forward of 2-byte rows,
    else `_LAYERNORM_FWD_THIRDS`' (BLOCK_N = n_cols / 3); None where neither has one whose
    block fits max_block (the class tables above then)."""
    cfg = _LAYERNORM_FWD_PLAIN_16BIT.get(n_cols) if not stable and itemsize == 2 else None
    cfg = cfg or _LAYERNORM_FWD_THIRDS.get(n_cols)
    return cfg if cfg is not None and cfg[1] <= max_block else None


@functools.cache
def _layernorm_bwd_config(
    n_cols: int, max_block: int, many_rows: bool = False, residual: bool = False
) -> BwdConfig:
    """The backward configuration for rows of `n_cols`: the `_LAYERNORM_BWD_CONFIGS` entry with
    its blocks capped at the width class and at max_block. A "row" entry whose row no longer fits
    its block (max_block, or a wider class than the entry's) loops over blocks instead.
    many_rows: the `_LAYERNORM_BWD_MANY_ROWS` entry of the class, where it has one; residual
    (a plain LayerNorm's residual form): the `_LAYERNORM_BWD_RESIDUAL` entry, where it has
    one."""
    width = width_class(n_cols)
    cfg = _nearest(_LAYERNORM_BWD_CONFIGS, width)
    if many_rows and width in _LAYERNORM_BWD_MANY_ROWS:
        cfg = _LAYERNORM_BWD_MANY_ROWS[width][1]
    if residual and width in _LAYERNORM_BWD_RESIDUAL:
        cfg = _LAYERNORM_BWD_RESIDUAL[width]
    block_n = min(cfg.block_n, width, max_block)
    if cfg.kind == "row" and block_n < n_cols:
        return BwdConfig("loop", 1, block_n, cfg.num_warps, cfg.per_sm)
    if cfg.kind == "split":
        return cfg._replace(block_n=block_n, sum_block_n=min(cfg.sum_block_n, width, max_block))
    return cfg._replace(block_n=block_n)


def _many_rows(n_rows: int | torch.SymInt, n_cols: int, stable: bool) -> bool:
    """Whether a plain backward of n_rows rows takes its class's `_LAYERNORM_BWD_MANY_ROWS`
    entry (n_rows may be symbolic under torch.compile: the comparison becomes a guard)."""
    entry = _LAYERNORM_BWD_MANY_ROWS.get(width_class(n_cols))
    return not stable and entry is not None and bool(n_rows >= entry[0])


def _clear_config_caches() -> None:
    """Forget the cached configurations (after the tables change: the benchmark, tests)."""
    _layernorm_fwd_config.cache_clear()
    _layernorm_bwd_config.cache_clear()
    _PLANS.plans.clear()
    _EAGER_PLANS.plans.clear()


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter runs programs one by one: few programs are cheapest
    return sm_count(device)


def _bwd_plan(n_rows, n_cols: int, cfg: BwdConfig, device: torch.device):
    """(col_tiles, groups, rows_per_prog) of the main backward kernel's grid.

    The rows are split into `groups` contiguous ranges of `rows_per_prog` rows (a multiple of
    BLOCK_M), about per_sm x SMs programs in all ("split": over its col_tiles column tiles too,
    at least one range). A fixed function of the shape, the configuration and the device, so
    dweight/dbias sum in the same order every run. `n_rows` may be symbolic (a SymInt while
    torch.compile traces with dynamic shapes): plain (symbolic-safe) integer arithmetic.

    Why a separate column-sum launch: finishing the column sums inside this launch needs
    either a program that waits for the others (a spin-wait: forbidden, and it hangs the
    interpreter) or a "last program to arrive reduces" ticket, which is wait-free and
    deterministic but leaves one program to read all (groups x N) partials alone. That variant
    was measured slower at every shape of the 2026-11-22 H200 sweep (e.g. 16.4 against 7.2 µs
    at 2048 x 512, 134.9 against 34.0 at 4096 x 4096; `layernorm_tune_*.json`) and removed.
    """
    col_tiles = cdiv(n_cols, cfg.block_n) if cfg.kind == "split" else 1
    max_groups = max(1, cfg.per_sm * _num_sms(device) // col_tiles)
    tiles = cdiv(n_rows, cfg.block_m)
    groups = torch.sym_min(tiles, max_groups)
    rows_per_prog = cdiv(tiles, groups) * cfg.block_m
    groups = cdiv(n_rows, rows_per_prog)
    return col_tiles, groups, rows_per_prog


# ----------------------------------------------------------------------------- launchers
# Shared by the layernorm and residual_layernorm ops (and the benchmark's tuning sweep).


def launch_layernorm_fwd(
    x2, weight, bias, y2, stats, eps, stable, *, h2=None, br2=None, p=0.0, seed=None, cfg=None
) -> Callable[..., None] | None:
    """Normalise the rows of x2 into y2 (both (M, N), unit column stride), stats (2|3, M).

    Residual mode (h2 and br2 given): x2 is an output, written with h2 + dropout_p(br2).
    `cfg` (BLOCK_M, BLOCK_N, num_warps) overrides the tables (the benchmark's sweep); a
    BLOCK_N of N / 3 holds the row as three blocks (THIRDS), as `_LAYERNORM_FWD_THIRDS` does
    for the plain and stable forwards at its widths (`_layernorm_fwd_exact_config`). An eager
    call takes the launch bound for its shape (`_PLANS`) when there is one.

    Returns that bound launch, a function of the tensors (x2, weight, bias or weight, y2,
    stats, h2 or x2, br2 or x2, seed or stats) of another call of this layout (`_EagerPlan`
    keeps it), or None where nothing was bound (traced, cfg given, no rows)."""
    M, N = x2.shape[0], int(x2.shape[1])  # N is specialised (block sizes); M may be symbolic
    if M == 0 or N == 0:
        return None
    residual = h2 is not None
    dropout = residual and p > 0.0
    tensors = (
        x2, weight, bias if exists(bias) else weight, y2, stats,
        h2 if residual else x2, br2 if residual else x2, seed if dropout else stats,
    )  # fmt: skip
    key = None
    if cfg is None and type(M) is int and not is_traced(x2):
        # residual itself, not only h2's and br2's row strides: a residual call whose h2 and
        # br2 broadcast one row (stride 0) would otherwise key as a plain one
        key = ("fwd", residual, M, N, MAX_BLOCK_N, x2.stride(0), y2.stride(0),
               h2.stride(0) if residual else 0, br2.stride(0) if residual else 0,
               eps, stable, p, exists(bias), *tensor_facts(*tensors))  # fmt: skip
        bound = _PLANS.get(key)
        if bound is not None:
            bound(*tensors)
            return bound
    if cfg is None:
        cfg = None if residual else _layernorm_fwd_exact_config(N, MAX_BLOCK_N, stable,
                                                                x2.element_size())  # fmt: skip
    if cfg is None:
        block_m, block_n, num_warps, single = _layernorm_fwd_config(N, MAX_BLOCK_N, stable)
        thirds = False
    else:
        block_m, block_n, num_warps = cfg
        thirds = 3 * block_n == N  # a block of a third of the row: three blocks held
        single = block_n >= N or thirds
    grid = (cdiv(M, block_m),)
    scalars = (
        M, N, 1.0 / N, x2.stride(0), y2.stride(0),
        h2.stride(0) if residual else 0, br2.stride(0) if residual else 0,
        eps, STABLE_CLAMP, dropout_threshold(p), 1.0 / (1.0 - p) if dropout else 1.0,
    )  # fmt: skip
    flags = dict(
        HAS_BIAS=exists(bias), STABLE=stable, SINGLE=single, RESIDUAL=residual,
        DROPOUT=dropout, INT64_IDX=bool(M * N >= 2**31),
        BLOCK_M=block_m, BLOCK_N=block_n, THIRDS=thirds, num_warps=num_warps,
    )  # fmt: skip
    kernel = launcher(_layernorm_fwd_kernel)
    if key is None:
        kernel[grid](*tensors, *scalars, **flags)
        return None
    return _PLANS.put(key, kernel.bind(grid, *tensors, *scalars, **flags))


def launch_layernorm_bwd_rowsums(
    x2, weight, dy2, stats, rowsums, eps, stable, cfg: BwdConfig
) -> None:
    """The "split" backward's first kernel: rowsums (2|3, M) fp32 = c1, c2 (and tie_grad)."""
    M, N = x2.shape[0], int(x2.shape[1])
    launcher(_layernorm_bwd_rowsum_kernel)[(cdiv(M, cfg.sum_block_m),)](
        x2, weight, dy2, stats, rowsums, M, N, 1.0 / N, x2.stride(0), dy2.stride(0), eps,
        STABLE=stable, BLOCK_M=cfg.sum_block_m, BLOCK_N=cfg.sum_block_n,
        num_warps=cfg.sum_warps,
    )  # fmt: skip


def launch_layernorm_bwd(
    dy2, x2, weight, stats, dx2, dweight, dbias, eps, stable, *,
    dhn2=None, dbr2=None, p=0.0, seed=None, cfg: BwdConfig | None = None,
    acc_w: bool = False, acc_b: bool = False,
) -> Callable[..., None] | None:  # fmt: skip
    """dx2 (+ dhn2, the downstream gradient of a residual sum), dweight, dbias (or None) and,
    when dbr2 is given, the branch gradient dropout-masked (p, seed) into dbr2. acc_w /
    acc_b: add dweight / dbias to what those tensors hold (`bmm.grad_targets`).

    `cfg` overrides `_LAYERNORM_BWD_CONFIGS` (the benchmark's sweep, tests) and is used as
    given. An eager call takes the launches bound for its shape (`_PLANS`) when there are.
    Returns them, a function of the tensors (x2, weight, dy2, dx2, stats, dhn2 or dy2, dbr2
    or dx2, seed or stats, dweight, dbias or dweight) of another call of this layout, or None
    where nothing was bound."""
    M, N = x2.shape[0], int(x2.shape[1])  # N is specialised (block sizes); M may be symbolic
    if N == 0:
        return None
    if M == 0:  # no rows: zero gradients (nothing to add to an accumulated one)
        if not acc_w:
            dweight.zero_()
        if exists(dbias) and not acc_b:
            dbias.zero_()
        return None
    has_bias = exists(dbias)
    dropout = exists(dbr2) and p > 0.0
    # stand-ins for absent tensors (never read)
    tensors = (x2, weight, dy2, dx2, stats, default(dhn2, dy2), default(dbr2, dx2),
               seed if dropout else stats, dweight, dbias if has_bias else dweight)  # fmt: skip
    key = None
    if cfg is None and type(M) is int and not is_traced(x2):
        key = ("bwd", M, N, MAX_BLOCK_N, *(t.stride(0) for t in tensors[:4]),
               tensors[5].stride(0), tensors[6].stride(0), eps, stable, p, has_bias,
               exists(dhn2), exists(dbr2), acc_w, acc_b, *tensor_facts(*tensors))  # fmt: skip
        plan = _PLANS.get(key)
        if plan is not None:
            plan(*tensors)
            return plan
    plan = _bwd_launches(tensors, M, N, eps, stable, p, cfg, exists(dhn2), exists(dbr2), acc_w,
                         acc_b)  # fmt: skip
    return None if key is None else _PLANS.put(key, plan)


def _bwd_launches(tensors, M, N, eps, stable, p, cfg, has_dhn, write_dbr, acc_w, acc_b):
    """Launch the backward's kernels for `launch_layernorm_bwd`'s tensors (x2, weight, dy2,
    dx2, stats, dhn2, dbr2, seed, dweight, dbias, stand-ins where absent) and return them
    bound for the next call of this shape (work buffers allocated per call)."""
    x2, weight, dy2, dx2, stats, dhn2, dbr2, seed, dweight, dbias = tensors
    has_bias = dbias is not dweight
    residual = has_dhn and not stable
    cfg = cfg or _layernorm_bwd_config(N, MAX_BLOCK_N, _many_rows(M, N, stable), residual)
    if cfg.kind == "row" and cfg.block_n < N:  # the kernel would skip the rest of the row
        raise ValueError(f"a 'row' backward needs BLOCK_N >= N, got {cfg.block_n} < {N}")
    col_tiles, groups, rows_per_prog = _bwd_plan(M, N, cfg, x2.device)
    partial_shape = (2 if has_bias else 1, groups, N)
    partial = torch.empty(size=partial_shape, dtype=torch.float32, device=x2.device)
    dropout = write_dbr and p > 0.0
    strides = (x2.stride(0), dy2.stride(0), dx2.stride(0), dhn2.stride(0), dbr2.stride(0))
    threshold, drop_scale = (dropout_threshold(p), 1.0 / (1.0 - p)) if dropout else (0, 1.0)
    flags = dict(HAS_BIAS=has_bias, STABLE=stable, HAS_DHN=has_dhn, WRITE_DBR=write_dbr,
                 DROPOUT=dropout, INT64_IDX=bool(M * N >= 2**31), BLOCK_M=cfg.block_m,
                 BLOCK_N=cfg.block_n, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps)  # fmt: skip
    rowsums_shape = None
    if cfg.kind == "split":
        rowsums_shape = (3 if stable else 2, M)
        rowsums = torch.empty(size=rowsums_shape, dtype=torch.float32, device=x2.device)
        sums = launcher(_layernorm_bwd_rowsum_kernel).bind(
            (cdiv(M, cfg.sum_block_m),), x2, weight, dy2, stats, rowsums,
            M, N, 1.0 / N, x2.stride(0), dy2.stride(0), eps,
            STABLE=stable, BLOCK_M=cfg.sum_block_m, BLOCK_N=cfg.sum_block_n,
            num_warps=cfg.sum_warps,
        )  # fmt: skip
        main = launcher(_layernorm_bwd_cols_kernel).bind(
            (col_tiles, groups), x2, weight, dy2, dx2, partial, stats, rowsums, dhn2, dbr2,
            seed, M, N, rows_per_prog, *strides, threshold, drop_scale, **flags,
        )  # fmt: skip
    else:
        main = launcher(_layernorm_bwd_kernel).bind(
            (groups,), x2, weight, dy2, dx2, partial, stats, dhn2, dbr2, seed,
            M, N, 1.0 / N, rows_per_prog, *strides, eps, threshold, drop_scale,
            SINGLE=cfg.kind == "row", **flags,
        )  # fmt: skip
    colsum = launcher(_layernorm_bwd_colsum_kernel).bind(
        (cdiv(N, _COLSUM_BLOCK_C),), partial, dweight, dbias, groups, N,
        HAS_BIAS=has_bias, ACC_W=acc_w, ACC_B=acc_b and has_bias,
        BLOCK_G=_COLSUM_BLOCK_G, BLOCK_C=_COLSUM_BLOCK_C,
        num_warps=_COLSUM_WARPS,
    )  # fmt: skip

    def launch(x2, weight, dy2, dx2, stats, dhn2, dbr2, seed, dweight, dbias) -> None:
        partial = torch.empty(size=partial_shape, dtype=torch.float32, device=x2.device)
        if rowsums_shape is not None:
            rowsums = torch.empty(size=rowsums_shape, dtype=torch.float32, device=x2.device)
            sums(x2, weight, dy2, stats, rowsums)
            main(x2, weight, dy2, dx2, partial, stats, rowsums, dhn2, dbr2, seed)
        else:
            main(x2, weight, dy2, dx2, partial, stats, dhn2, dbr2, seed)
        colsum(partial, dweight, dbias)

    return launch


# ----------------------------------------------------------------------------- torch.library ops


@triton_op("triton_transformer::layernorm", mutates_args=())
def layernorm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    stable: bool,
    out_dtype: torch.dtype | None = None,
    weight_acc: torch.Tensor | None = None,
    bias_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stats): y a new contiguous tensor shaped like x, in out_dtype (None: x's); stats
    (2 or 3, rows) fp32 holds each row's mean, rstd (and scale when stable) for the
    backward. weight_acc, bias_acc: the parameters' `.grad` in a traced forward inside
    `bmm.accumulate_grads_in_place(traced=True)` (`bmm._traced_grad_acc`), else None; not
    read here: the backward adds the gradients into them."""
    N = x.shape[-1]
    x2 = as_rows(x)
    M = x2.shape[0]
    y = torch.empty(size=x.shape, dtype=out_dtype or x.dtype, device=x.device)
    stats = torch.empty(size=(3 if stable else 2, M), dtype=torch.float32, device=x.device)
    launch_layernorm_fwd(x2, weight.contiguous(), bias, y.view(M, N), stats, eps, stable)
    return y, stats


@triton_op("triton_transformer::layernorm_backward", mutates_args=("weight_acc", "bias_acc"))
def layernorm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stats: torch.Tensor,
    eps: float,
    stable: bool,
    weight_acc: torch.Tensor | None,
    bias_acc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); dbias is an empty (0,) tensor when bias is None. weight_acc /
    bias_acc given: dweight / dbias are added into them in place (`bmm.grad_targets`) and
    returned as empty (0,) tensors. (No defaults: torch 2.11's version bump of mutated
    arguments indexes the call's arguments without filling defaults in.)"""
    N = x.shape[-1]
    x2, dy2 = as_rows(x), as_rows(dy)
    M = x2.shape[0]
    dx = torch.empty(size=x.shape, dtype=x.dtype, device=x.device)
    dweight, dbias = param_grads(weight, bias, weight_acc, bias_acc)
    launch_layernorm_bwd(
        dy2, x2, weight.contiguous(), stats, dx.view(M, N), default(weight_acc, dweight),
        default(bias_acc, dbias) if exists(bias) else None, eps, stable,
        acc_w=exists(weight_acc), acc_b=exists(bias_acc),
    )  # fmt: skip
    return dx, dweight, dbias


def param_grads(weight, bias, weight_acc, bias_acc) -> tuple[torch.Tensor, torch.Tensor]:
    """The (dweight, dbias) a norm's backward op returns: new tensors like the parameters,
    (0,) where there is no bias or where the gradient goes into an accumulator instead."""

    def grad_like(p: torch.Tensor | None, acc: torch.Tensor | None, dtype: torch.dtype):
        if p is None or acc is not None:
            return torch.empty(size=(0,), dtype=dtype, device=weight.device)
        return torch.empty_like(p)

    return grad_like(weight, weight_acc, weight.dtype), grad_like(bias, bias_acc, weight.dtype)


def _layernorm_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, ctx.eps, ctx.stable, _, weight_acc, bias_acc = inputs
    _, stats = output
    ctx.mark_non_differentiable(stats)
    # stats get no gradient: without this autograd would zero-fill one for every call
    ctx.set_materialize_grads(False)
    ctx.has_bias = exists(bias)
    ctx.grad_homes = (_grad_home(weight), _grad_home(bias) if exists(bias) else None)
    ctx.save_for_backward(x, weight, bias, stats, weight_acc, bias_acc)


@first_order_only("layernorm")
def _layernorm_backward(ctx, dy, _dstats):
    if dy is None:  # grads are not materialised: y was not used
        return (None,) * 8
    x, weight, bias, stats, *traced = ctx.saved_tensors
    targets = grad_targets(ctx.grad_homes, traced, dy)
    dx, dweight, dbias = call_op(
        layernorm_backward_op, dy, x, weight, bias, stats, ctx.eps, ctx.stable, *targets
    )
    dweight, dbias = folded_grads((dweight, dbias if ctx.has_bias else None), targets, traced)
    return dx, dweight, dbias, None, None, None, None, None


layernorm_op.register_autograd(_layernorm_backward, setup_context=_layernorm_setup_context)
accumulates_grads(layernorm_backward_op)


# ----------------------------------------------------------------------------- eager calls
# An eager call (nothing traces) of a layout seen before takes that layout's `_EagerPlan`:
# one key of every fact the checks and the kernels read (`utils.eager_plan_key`: shapes,
# strides, dtypes, devices, 16-byte alignment, the scalars), one lookup, then the launches
# bound for it. Per call it skips what the generic path pays on top of the kernels: the
# checks, `call_op`, the op's autograd wrapper of eight inputs, `as_rows` views and a plan key
# of every launch's tensors. The kernels, the saved tensors and the gradients are the generic
# path's.


class _EagerPlan:
    """The launches of eager layernorm calls of one layout: x viewable as (M, N) rows of unit
    column stride, contiguous parameters (what `_eager_plan` admits). `fwd` and the `bwd`
    entries are the bound launches the generic launchers return on a plan's first call."""

    __slots__ = ("bwd", "device", "eps", "fwd", "n_cols", "n_rows", "out_dtype", "p", "shape",
                 "stable", "stats_shape")  # fmt: skip

    def __init__(self, x: torch.Tensor, eps: float, stable: bool, out_dtype) -> None:
        self.shape, self.device = x.shape, x.device
        self.out_dtype = out_dtype or x.dtype
        self.n_cols = x.shape[-1]
        self.n_rows = x.numel() // self.n_cols
        self.stats_shape = (3 if stable else 2, self.n_rows)
        self.eps, self.stable, self.p = eps, stable, 0.0
        self.fwd: Callable[..., None] | None = None
        self.bwd: dict[tuple, Callable[..., None] | None] = {}

    def forward(self, x, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, stats), as `layernorm_op` returns them."""
        y = torch.empty(size=self.shape, dtype=self.out_dtype, device=self.device)
        stats = torch.empty(size=self.stats_shape, dtype=torch.float32, device=self.device)
        fwd = self.fwd
        if fwd is not None:
            fwd(x, weight, weight if bias is None else bias, y, stats, x, x, stats)
        else:
            rows = (self.n_rows, self.n_cols)
            self.fwd = launch_layernorm_fwd(
                x.view(rows), weight, bias, y.view(rows), stats, self.eps, self.stable
            )
        return y, stats

    def backward(self, dy, x, weight, bias, stats, acc_w, acc_b) -> tuple:
        """(dx, dweight, dbias) for dy of any layout; the parameters' as `bound_grads`
        returns them."""
        dx = torch.empty(size=self.shape, dtype=x.dtype, device=self.device)
        return (dx, *bound_grads(self, dy, x, weight, bias, stats, dx, acc_w, acc_b))


def bound_grads(
    plan, dy, x, weight, bias, stats, dx, acc_w, acc_b, *, dh_new=None, dbranch=None, seed=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of an eager norm plan (`_EagerPlan`, `residual_layernorm._EagerPlan`: its
    n_rows, n_cols, eps, stable, p and dict `bwd`) into dx, and into dbranch, the residual
    form's masked branch gradient, where given (dh_new: the residual sum's upstream gradient;
    seed: its dropout's). Rows of the upstream gradients are read in place, or copied where
    they have no unit column stride (e.g. a sum's expanded gradient); dense ones take the
    launches bound in plan.bwd for their dtypes and alignment, the seed's and the gradient
    targets. Returns (dweight, dbias): new tensors, None where the gradient went into acc_w /
    acc_b or there is no bias (unlike the backward ops, no empty stand-ins to allocate)."""
    dweight = torch.empty_like(weight) if acc_w is None else None
    dbias = torch.empty_like(bias) if bias is not None and acc_b is None else None
    dweight_into = dweight if acc_w is None else acc_w
    dbias_into = None if bias is None else (dbias if acc_b is None else acc_b)
    dy2, dhn2, dense = upstream_rows(dy, dh_new)
    key = bound_bwd_key(dy2, dhn2, seed, acc_w, acc_b) if dense else None
    bwd = plan.bwd.get(key) if dense else None
    if bwd is not None:
        bwd(x, weight, dy2, dx, stats, dy2 if dhn2 is None else dhn2,
            dx if dbranch is None else dbranch, stats if seed is None else seed, dweight_into,
            dweight_into if dbias_into is None else dbias_into)  # fmt: skip
        return dweight, dbias
    rows = (plan.n_rows, plan.n_cols)
    bwd = launch_layernorm_bwd(
        dy2.view(rows), x.view(rows), weight, stats, dx.view(rows), dweight_into, dbias_into,
        plan.eps, plan.stable, dhn2=None if dhn2 is None else dhn2.view(rows),
        dbr2=None if dbranch is None else dbranch.view(rows), p=plan.p, seed=seed,
        acc_w=acc_w is not None, acc_b=acc_b is not None,
    )  # fmt: skip
    if dense:
        plan.bwd[key] = bwd
    return dweight, dbias


def bound_bwd_key(dy2, dhn2, seed, acc_w, acc_b=None) -> tuple:
    """The key of a norm plan's bound backward launch (`bound_grads`, rmsnorm's plan): what
    the kernel's specialisation reads from the per-call tensors. The plain call (no residual
    gradient, seed or accumulator: the norms' backward in most models) keys on dy2's dtype
    and 16-byte alignment alone, without the list and the pass over five tensors the general
    key builds (its length tells the two apart)."""
    facts = (dy2.dtype, not dy2.data_ptr() & 15)
    if dhn2 is None and seed is None and acc_w is None and acc_b is None:
        return facts
    present = [t for t in (dhn2, seed, acc_w, acc_b) if t is not None]
    nones = (dhn2 is None, seed is None, acc_w is None, acc_b is None)
    return (*facts, *nones, *tensor_facts(*present))


def upstream_rows(dy: torch.Tensor, dh_new: torch.Tensor | None) -> tuple:
    """(dy2, dhn2, dense): the upstream gradients of a norm plan's backward as its kernels
    read them. Dense (both contiguous, possibly after `as_rows` copied one without unit
    column stride, e.g. a sum's expanded gradient): the tensors as they are, which the plan's
    bound launches read in place. Otherwise (rows with a stride of their own, e.g. the
    gradient of a slice that `torch.cat` hands back) both as (M, N) rows views, which the
    launcher keys and launches afresh: a bound launch holds the row strides it was bound
    with, and a tensor's N-D stride(0) is not its row stride."""
    dy2 = dy if dy.is_contiguous() else as_rows(dy)
    dhn2 = dh_new if dh_new is None or dh_new.is_contiguous() else as_rows(dh_new)
    if dy2.is_contiguous() and (dhn2 is None or dhn2.is_contiguous()):
        return dy2, dhn2, True
    return as_rows(dy2), None if dhn2 is None else as_rows(dhn2), False


_EAGER_PLANS = LaunchPlans()


def _eager_plan(x, weight, bias, eps, stable, out_dtype) -> _EagerPlan | None:
    """The plan of this eager call's layout, made on its first call; None where the generic
    path must run: traced tensors, anything the checks would refuse, or a layout the plan
    does not cover."""
    key, plan = _EAGER_PLANS.find((x, weight, bias), (eps, stable, out_dtype))
    if key is None or plan is not None:
        return plan
    check_layernorm_args(x, weight, bias, True)
    check_out_dtype(out_dtype)
    if x.numel() == 0 or not (plain_params(weight, bias) and has_rows_view(x)):
        return None
    return _EAGER_PLANS.put(key, _EagerPlan(x, float(eps), bool(stable), out_dtype))


def plain_params(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a norm's parameters are contiguous, as its eager plan passes them."""
    return weight.is_contiguous() and (bias is None or bias.is_contiguous())


class _EagerLayerNorm(torch.autograd.Function):
    """`layernorm_op` and its registered backward for an eager call of a planned layout."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan):
        y, stats = plan.forward(x, weight, bias)
        ctx.save_for_backward(x, weight, bias, stats)
        ctx.plan = plan
        ctx.grad_homes = (_grad_home(weight), None if bias is None else _grad_home(bias))
        return y

    @staticmethod
    @first_order_only("layernorm")
    def backward(ctx, dy):
        x, weight, bias, stats = ctx.saved_tensors
        homes = ctx.grad_homes
        targets = (None, None)
        if homes[0] is not None or homes[1] is not None:
            targets = grad_targets(homes, (None, None), dy)
        dx, dweight, dbias = ctx.plan.backward(dy, x, weight, bias, stats, *targets)
        if targets[0] is not None or targets[1] is not None:
            dweight, dbias = folded_grads((dweight, dbias), targets, (None, None))
        return dx, dweight, dbias if bias is not None else None, None


_apply_eager_layernorm = eager_apply(_EagerLayerNorm)


# ----------------------------------------------------------------------------- public API


def _check_param(p: object, name: str, x: torch.Tensor, use_triton: bool) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(p).__name__}")
    if p.shape != (x.shape[-1],):
        raise ValueError(
            f"{name} must have shape ({x.shape[-1]},) to match the last dim of x "
            f"{tuple(x.shape)}, got {tuple(p.shape)}"
        )
    if use_triton:
        check_triton_tensor(p, name)
        if p.device != x.device:
            raise ValueError(f"{name} is on {p.device} but x is on {x.device}")


def _layernorm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    stable: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    dtype = x.dtype
    if stable:
        x = x / x.abs().amax(-1, keepdim=True).clamp(min=STABLE_CLAMP)
    if weight.dtype != dtype or (exists(bias) and bias.dtype != dtype):
        # e.g. fp32 params with bf16 activations: compute in fp32, like the kernel does.
        x, weight = x.float(), weight.float()
        bias = bias.float() if exists(bias) else None
    # `.to(...)`: output in the input's dtype (or out_dtype), also under autocast (which runs
    # layer_norm in fp32); a no-op otherwise.
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps).to(out_dtype or dtype)


def check_out_dtype(out_dtype: object) -> None:
    if out_dtype is not None and not (
        isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point
    ):
        raise TypeError(f"out_dtype must be a floating torch.dtype or None, got {out_dtype!r}")


def check_residual_branch(
    h: torch.Tensor, branch: object, dropout_p: object, training: bool, use_triton: bool
) -> float:
    """Validate a residual norm's `branch` against h (residual_layernorm, residual_rmsnorm) and
    return the dropout probability in effect (0 outside training)."""
    if not isinstance(branch, torch.Tensor):
        raise TypeError(f"branch must be a torch.Tensor, got {type(branch).__name__}")
    if branch.shape != h.shape:
        raise ValueError(f"branch shape {tuple(branch.shape)} != h shape {tuple(h.shape)}")
    p = check_dropout_p(dropout_p) if training else 0.0
    if use_triton:
        check_triton_tensor(branch, "branch")
        if branch.device != h.device:
            raise ValueError(f"branch is on {branch.device} but h is on {h.device}")
    return p


def check_layernorm_args(x: object, weight: object, bias: object, use_triton: bool) -> None:
    """Validate layernorm's tensors (shared with residual_layernorm)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dim to normalise over, got a scalar")
    if use_triton:
        check_triton_tensor(x, "x")
    _check_param(weight, "weight", x, use_triton)
    if exists(bias):
        _check_param(bias, "bias", x, use_triton)


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    stable: bool = False,
    use_triton: bool = False,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Layer normalisation over the last dim of `x`.

    Args:
        x: (..., N) float tensor, any rank >= 1, any strides.
        weight: (N,) scale; may have another float dtype than x (computed in fp32).
        bias: (N,) shift, or None for no bias.
        eps: added to the variance.
        stable: divide each row by its max |x| (clamped to >= STABLE_CLAMP) first, so huge
            activations cannot overflow (CogView's PB-relax); differentiable through the scale.
        use_triton: run the Triton kernels instead of the PyTorch reference.
        out_dtype: the output's float dtype (None: x's). The kernel computes in fp32 and
            rounds once into it: an fp32 residual stream feeding bf16 matmuls under autocast
            gets its bf16 input without a cast pass (and the gradient comes back in bf16).

    Returns:
        (..., N) tensor in out_dtype: a new tensor, never a view (in-place ops on it work).
    """
    if use_triton:
        plan = _eager_plan(x, weight, bias, eps, stable, out_dtype)
        if plan is not None:
            if torch.is_grad_enabled() and (
                x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
            ):
                return _apply_eager_layernorm(x, weight, bias, plan)
            return plan.forward(x, weight, bias)[0]
    check_layernorm_args(x, weight, bias, use_triton)
    check_out_dtype(out_dtype)
    if not use_triton:
        return _layernorm_reference(x, weight, bias, eps, stable, out_dtype)
    accs = _traced_grad_acc(weight), _traced_grad_acc(bias) if exists(bias) else None
    return call_op(layernorm_op, x, weight, bias, float(eps), bool(stable), out_dtype, *accs)[0]


class LayerNorm(nn.Module):
    """LayerNorm over the last dim; params `weight`/`bias` named like torch.nn.LayerNorm, so
    state dicts interchange. `bias=False` registers `bias` as None (no shift)."""

    def __init__(
        self,
        dim: int,
        bias: bool = True,
        stable: bool = False,
        eps: float = 1e-5,
        use_triton: bool = False,
    ):
        super().__init__()
        self.dim, self.stable, self.eps, self.use_triton = dim, stable, eps, use_triton
        self.weight = nn.Parameter(torch.ones(dim))
        if bias:
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("bias", None)

    def forward(
        self,
        x: torch.Tensor,
        use_triton: bool | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x: (..., dim) -> (..., dim) in out_dtype (None: x's); `use_triton=None` uses the
        module's flag."""
        use_triton = self.use_triton if use_triton is None else use_triton
        return layernorm(
            x, self.weight, self.bias, self.eps, self.stable, use_triton, out_dtype=out_dtype
        )

    def extra_repr(self) -> str:
        return f"{self.dim}, bias={self.bias is not None}, stable={self.stable}, eps={self.eps}"
