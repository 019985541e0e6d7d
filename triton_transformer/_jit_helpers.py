"""Triton device helpers shared by the row kernels (softmax, cross-entropy) and dropout.

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
