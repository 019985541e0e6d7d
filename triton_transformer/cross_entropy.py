"""Cross entropy over a vocabulary: fused Triton kernels and the PyTorch reference.

`cross_entropy(logits, labels)` is the mean negative log-likelihood of `labels` under
softmax(logits), over the positions whose label is not `ignore_index`.

Triton path. Rows of up to `FWD_MAX_BLOCK` classes are held whole in registers (several short
rows per program); longer rows loop over the vocabulary with an online log-sum-exp
(`_jit_helpers.online_lse_update`, shared with softmax). Ignored rows read nothing: their
loads are masked off, their loss is 0 and their gradient exactly 0 (an ignored row of -inf
logits gives 0, never NaN). The mean is a fixed-order reduction in one small program (no
atomics: deterministic), divided on the device: no host sync anywhere.

Two modes:
- default (`inplace_backward=False`): the op is pure. Forward saves the per-row log-sum-exp
  (fp32, one per row); backward recomputes softmax from the logits and writes
  dlogits = (softmax - onehot) * dloss / n_valid into a new tensor. Memory as
  `F.cross_entropy`.
- `inplace_backward=True` (Liger-Kernel's trick; for the model's loss path, where nothing
  reads the logits afterwards): forward overwrites the logits with d(loss)/d(logits) for an
  upstream gradient of 1, while it computes the loss. Backward multiplies that buffer in place
  by the upstream gradient, a 0-d device tensor read inside the kernel: when it is exactly 1
  (a plain `loss.backward()`) every program returns at once. Extra memory: per-row buffers
  only. fp16 logits store (softmax - onehot) and apply 1 / n_valid in backward too, so small
  gradients do not underflow before a GradScaler's factor reaches them.
  The mutation is declared to torch (`mutates_args`), so autograd raises if another node
  saved the logits, and torch.compile keeps the kernel in place. One backward per forward
  (the buffer is scaled in place; `retain_graph` reuse raises).

Labels. A label outside [0, V) that is not `ignore_index` is an error. With
`check_labels=True` (the default, for library users) a call raises a clear error for one and
refuses CUDA stream capture. The Triton kernels make a bad label's row loss and gradient NaN,
so an eager Triton call on a GPU checks after its kernels without waiting for them
(`check_labels_after`, `triton_transformer.checks`): the mean's kernel writes a NaN loss into
a slot of pinned host memory, and a later checked call (or `checks.raise_pending()`) that
finds it there checks the labels and raises; the loss itself is NaN meanwhile. On the CPU
(the interpreter) the call itself raises. The reference checks first, with a sync
(F.cross_entropy would stop at a device-side assert), and so do traced calls, the in-place
mode (whose kernel would overwrite the logits) and anomaly-detection mode
(`torch.autograd.set_detect_anomaly(True)`, which also turns the check on where
check_labels=False). With `check_labels=False` (inside a training
step) nothing is checked and a bad label gives a NaN loss.

All positions ignored (or no positions at all): the loss is 0 and its gradient is 0 (torch's
mean reduction would give NaN = 0/0).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from triton_transformer import checks, cross_entropy_hopper
from triton_transformer._jit_helpers import (
    lse_from_stats,
    online_lse_update,
    tile_exp,
)
from triton_transformer.utils import (
    LaunchPlans,
    call_op,
    cdiv,
    check_not_capturing,
    check_triton_tensor,
    default,
    eager_apply,
    empty_scalar,
    first_order_only,
    is_traced,
    launcher,
    layout_key,
    opaque_op,
    refuse_second_backward,
    row_launch_params,
    tracing,
)

# Longest row the forward holds in registers in one pass, and the backward's block; longer rows
# loop over blocks of this size. Short rows are packed several per program, so that a tile
# holds about ROW_TILE elements. Module-level so tests can reach the looped paths and
# benchmarks can sweep them (`benchmarks/bench_cross_entropy.py --sweep`).
FWD_MAX_BLOCK = 16384
BWD_MAX_BLOCK = 8192
ROW_TILE = 4096
# Rows longer than FWD_MAX_BLOCK loop over blocks on LOOP_NUM_WARPS warps, each loop loading
# the block after the one it works on (two blocks per program in flight). A forward that also
# writes the gradient (in place, the model's loss path) reads each row twice and writes it
# once, in blocks of INPLACE_LOOP_BLOCK on INPLACE_LOOP_WARPS warps; None (the default): the
# tuned pair of this GPU model in `_INPLACE_LOOP_TUNED`, else `_INPLACE_LOOP_DEFAULT`.
INPLACE_LOOP_BLOCK: int | None = None
INPLACE_LOOP_WARPS: int | None = None
LOOP_NUM_WARPS = 8
# `benchmarks/probe_ce_inplace.py`, 2026-11-27, kernel time at 4096 and 16384 rows of GPT-2's
# 50,304 classes, 8192 x 32000 and 8192 x 128256, against the one-block loop at (4096, 8):
# - H100: (8192, 8) 1.20x, 1.20x, 1.28x, 1.02x (76-83% of the copy bandwidth counting one
#   read and one write); 4 and 16 warps slower;
# - H200: (2048, 4) 1.01x, 1.01x, 0.99x, 1.00x: loading ahead gains nothing there, and
#   (8192, 8) is 0.86-0.90x.
_INPLACE_LOOP_TUNED = {"NVIDIA H100 80GB HBM3": (8192, 8), "NVIDIA H200": (2048, 4)}
_INPLACE_LOOP_DEFAULT = (8192, 8)
# Warps per program; None: derived from the tile (benchmarks sweep these).
FWD_NUM_WARPS: int | None = None
BWD_NUM_WARPS: int | None = None
# Block of the one-program reductions (loss sum, valid count): up to 8192 rows are summed in
# one iteration, so that step costs about one memory latency, not one per 1024 rows. (Fixed,
# not sized to the row count, so the row count may stay symbolic under torch.compile.)
MAX_REDUCE_BLOCK = 8192


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _row_offsets(rows, n_inner, stride_outer, stride_inner):
    """Offsets of rows r = outer * n_inner + inner of a (outer, inner, ...) strided view."""
    outer = rows // n_inner
    return outer * stride_outer + (rows - outer * n_inner) * stride_inner


@triton.jit
def _load_labels(
    LABELS, rows, n_rows, n_inner, stride_labels_outer, stride_labels_inner, ignore_index,
    HAS_IGNORE: tl.constexpr,
):  # fmt: skip
    """(label, valid) for `rows`: valid is False past the end and for ignored rows."""
    row_ok = rows < n_rows
    offs = _row_offsets(rows, n_inner, stride_labels_outer, stride_labels_inner)
    label = tl.load(LABELS + offs, mask=row_ok, other=0)
    valid = row_ok
    if HAS_IGNORE:
        valid = valid & (label != ignore_index)
    return label, valid


@triton.jit
def _cross_entropy_fwd_kernel(
    LOGITS, LABELS, N_VALID, LOSS, LSE,
    stride_logits_outer, stride_logits_inner, stride_labels_outer, stride_labels_inner,
    n_rows, n_inner, n_cols, ignore_index,
    HAS_IGNORE: tl.constexpr, WRITE_GRAD: tl.constexpr, NORMALIZE_GRAD: tl.constexpr,
    COUNTED: tl.constexpr, SINGLE_PASS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per-row loss (0 if ignored) into LOSS and, unless WRITE_GRAD, the row's log-sum-exp into
    LSE. WRITE_GRAD: overwrite the logits with (softmax - onehot), times 1 / n_valid when
    NORMALIZE_GRAD: n_valid read from N_VALID when COUNTED (counted before this launch: rows
    not ignored, or the rows of all of a chunked loss's launches), else this launch's n_rows."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    row_ok = rows < n_rows
    label, valid = _load_labels(
        LABELS, rows, n_rows, n_inner, stride_labels_outer, stride_labels_inner, ignore_index,
        HAS_IGNORE,
    )  # fmt: skip
    x_row = LOGITS + _row_offsets(rows, n_inner, stride_logits_outer, stride_logits_inner)
    in_range = (label >= 0) & (label < n_cols)
    x_label = tl.load(x_row + label, mask=valid & in_range, other=0.0).to(tl.float32)
    # A bad label poisons its row (loss and gradient) with NaN.
    poison = tl.where(valid & ~in_range, float("nan"), 0.0)
    grad_scale = 1.0
    if NORMALIZE_GRAD:
        n_valid = tl.maximum(tl.load(N_VALID), 1.0) if COUNTED else n_rows
        grad_scale = 1.0 / n_valid
    cols = tl.arange(0, BLOCK_N)[None, :]

    if SINGLE_PASS:
        # Ignored rows load nothing (all -inf), so their stats are m = -inf, s = 0.
        x = tl.load(x_row + cols, mask=valid & (cols < n_cols), other=float("-inf")).to(tl.float32)
        m, e, s = tile_exp(x)
        lse = lse_from_stats(m, s) + poison
        if WRITE_GRAD:
            p = e * (1.0 / tl.where(valid, s, 1.0) + poison)  # (ignored rows: e = 0)
            g = tl.where(valid, (p - tl.where(cols == label, 1.0, 0.0)) * grad_scale, 0.0)
            tl.store(x_row + cols, g.to(LOGITS.dtype.element_ty), mask=row_ok & (cols < n_cols))
    else:
        # Each loop loads the block after the one it works on (the last such load is masked
        # off: no memory traffic).
        m = tl.full([BLOCK_M, 1], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_M, 1], tl.float32)
        n_read = tl.max(tl.where(valid, n_cols, 0))  # 0 for an ignored row: no loop at all
        x_next = tl.load(x_row + cols, mask=valid & (cols < n_cols), other=float("-inf"))
        for start in range(0, n_read, BLOCK_N):
            x = x_next.to(tl.float32)
            c = start + BLOCK_N + cols
            x_next = tl.load(x_row + c, mask=valid & (c < n_cols), other=float("-inf"))
            m, s = online_lse_update(m, s, x)
        lse = lse_from_stats(m, s) + poison
        if WRITE_GRAD:
            lse_g = tl.where(valid, lse, 0.0)  # ignored rows: exp(-inf - 0) = 0, not NaN
            # The second read of the row may hit L2.
            x_next = tl.load(x_row + cols, mask=valid & (cols < n_cols), other=float("-inf"))
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                x = x_next.to(tl.float32)
                x_next = tl.load(
                    x_row + c + BLOCK_N, mask=valid & (c + BLOCK_N < n_cols), other=float("-inf")
                )
                p = tl.exp(x - lse_g)
                g = tl.where(valid, (p - tl.where(c == label, 1.0, 0.0)) * grad_scale, 0.0)
                tl.store(x_row + c, g.to(LOGITS.dtype.element_ty), mask=row_ok & (c < n_cols))

    tl.store(LOSS + rows, tl.where(valid, lse - x_label, 0.0), mask=row_ok)
    if not WRITE_GRAD:
        tl.store(LSE + rows, lse, mask=row_ok)


@triton.jit
def _cross_entropy_bwd_kernel(
    LOGITS, LABELS, LSE, N_VALID, DLOSS, DX,
    stride_logits_outer, stride_logits_inner, stride_labels_outer, stride_labels_inner,
    stride_dx, n_rows, n_inner, n_cols, ignore_index,
    HAS_IGNORE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """DX = (softmax(x) - onehot(label)) * dloss / max(n_valid, 1); 0 on ignored rows, whose
    logits are not read."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    row_ok = rows < n_rows
    label, valid = _load_labels(
        LABELS, rows, n_rows, n_inner, stride_labels_outer, stride_labels_inner, ignore_index,
        HAS_IGNORE,
    )  # fmt: skip
    x_row = LOGITS + _row_offsets(rows, n_inner, stride_logits_outer, stride_logits_inner)
    dx_row = DX + rows * stride_dx
    lse = tl.load(LSE + rows, mask=valid, other=0.0)
    scale = tl.load(DLOSS).to(tl.float32) / tl.maximum(tl.load(N_VALID), 1.0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=valid & (c < n_cols), other=float("-inf")).to(tl.float32)
        p = tl.exp(x - lse)
        g = tl.where(valid, (p - tl.where(c == label, 1.0, 0.0)) * scale, 0.0)
        tl.store(dx_row + c, g.to(DX.dtype.element_ty), mask=row_ok & (c < n_cols))


@triton.jit
def _cross_entropy_bwd_scale_kernel(
    DLOSS, N_VALID, DX, stride_dx_outer, stride_dx_inner, n_rows, n_inner, n_cols,
    DIVIDE_BY_N_VALID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """DX *= dloss (and / max(n_valid, 1) if DIVIDE_BY_N_VALID), in place. With a factor of
    exactly 1 every program returns without touching DX."""
    d = tl.load(DLOSS).to(tl.float32)
    if DIVIDE_BY_N_VALID:
        d = d / tl.maximum(tl.load(N_VALID), 1.0)
    if d != 1.0:
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
        row_ok = rows < n_rows
        dx_row = DX + _row_offsets(rows, n_inner, stride_dx_outer, stride_dx_inner)
        cols = tl.arange(0, BLOCK_N)[None, :]
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_ok & (c < n_cols)
            g = tl.load(dx_row + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + c, (g * d).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_fwd_reduce_kernel(
    LOSS_ROWS, LABELS, N_VALID, LOSS, VERDICT, stride_labels_outer, stride_labels_inner,
    n_rows, n_inner, ignore_index,
    HAS_IGNORE: tl.constexpr, SUM_LOSS: tl.constexpr, COUNT: tl.constexpr,
    HAS_VERDICT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program. COUNT: N_VALID = number of non-ignored rows. SUM_LOSS: LOSS = sum of
    LOSS_ROWS / max(n_valid, 1), n_valid counted here or read from N_VALID, and (HAS_VERDICT)
    a NaN loss (a bad label's) into VERDICT, a label check's zeroed slot (`checks.reserve`).
    Lane-wise partial sums in a fixed order, then a tree: deterministic."""
    total = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = (start + tl.arange(0, BLOCK)).to(tl.int64)
        if SUM_LOSS:
            total += tl.load(LOSS_ROWS + rows, mask=rows < n_rows, other=0.0)
        if COUNT:
            _, valid = _load_labels(
                LABELS, rows, n_rows, n_inner, stride_labels_outer, stride_labels_inner,
                ignore_index, HAS_IGNORE,
            )  # fmt: skip
            count += tl.where(valid, 1.0, 0.0)
    if COUNT:
        n_valid = tl.sum(count, axis=0)
        tl.store(N_VALID, n_valid)
    else:
        n_valid = tl.load(N_VALID)
    if SUM_LOSS:
        loss = tl.sum(total, axis=0) / tl.maximum(n_valid, 1.0)
        tl.store(LOSS, loss)
        if HAS_VERDICT:  # only a NaN: a store to host memory delays the kernel's end
            tl.store(VERDICT, loss, mask=loss != loss)


# --------------------------------------------------------------------------------------------
# Launch parameters and the torch.library ops
# --------------------------------------------------------------------------------------------


# The vocabulary size picks the constexpr block sizes, so it is made concrete (int(): under
# torch.compile's dynamic shapes, one compiled kernel per vocabulary size; rows stay symbolic).
def _cross_entropy_fwd_config(
    n_cols: int, write_grad: bool, device: torch.device
) -> tuple[int, int, bool, int]:
    n_cols = int(n_cols)
    if write_grad and n_cols > FWD_MAX_BLOCK:
        block, warps = _inplace_loop(device)
        return row_launch_params(n_cols, block, ROW_TILE, FWD_NUM_WARPS, warps)
    return row_launch_params(n_cols, FWD_MAX_BLOCK, ROW_TILE, FWD_NUM_WARPS, LOOP_NUM_WARPS)


def _inplace_loop(device: torch.device) -> tuple[int, int]:
    """(block, warps) of the looped in-place forward on `device`: the module's settings where
    given, else the GPU model's tuned pair."""
    tuned = _inplace_loop_tuned(device) if device.type == "cuda" else _INPLACE_LOOP_DEFAULT
    block = INPLACE_LOOP_BLOCK if INPLACE_LOOP_BLOCK is not None else tuned[0]
    return block, INPLACE_LOOP_WARPS if INPLACE_LOOP_WARPS is not None else tuned[1]


@functools.cache
def _inplace_loop_tuned(device: torch.device) -> tuple[int, int]:
    return _INPLACE_LOOP_TUNED.get(torch.cuda.get_device_name(device), _INPLACE_LOOP_DEFAULT)


def _cross_entropy_bwd_config(n_cols: int) -> tuple[int, int, bool, int]:
    return row_launch_params(int(n_cols), BWD_MAX_BLOCK, ROW_TILE, BWD_NUM_WARPS, LOOP_NUM_WARPS)


# An eager call's launches (`cross_entropy_op`'s two, its backward's one), bound once per
# shape (`utils.LaunchPlans`)
_PLANS = LaunchPlans()


def _switches() -> tuple:
    """The module settings the launches read (tests and benchmarks change them): part of
    every plan's key."""
    return (
        FWD_MAX_BLOCK, BWD_MAX_BLOCK, ROW_TILE, LOOP_NUM_WARPS, FWD_NUM_WARPS, BWD_NUM_WARPS,
        MAX_REDUCE_BLOCK,
    )  # fmt: skip


def _strides_2level(t: torch.Tensor) -> tuple[int, int]:
    """(stride of dim 0, stride of dim 1) of a tensor viewed as (outer, inner, ...)."""
    return t.stride(0), t.stride(1)


def launch_cross_entropy_fwd(
    logits, labels, ignore_index, n_valid, loss_rows, lse, write_grad, normalize, counted=None
):
    """The forward kernel over logits (outer, inner, V), labels (outer, inner): loss_rows and
    (unless write_grad) lse; write_grad: the logits overwritten with their gradient, times
    1 / n_valid when normalize, n_valid read from memory when counted (None: when there is an
    ignore_index; `linear_cross_entropy` counts all its chunks' rows first), else the rows of
    this launch. An eager in-place forward over long rows on Hopper runs
    `cross_entropy_hopper`'s kernel (one read of each row instead of two). Returns the launch
    again for tensors of the same layouts and facts: again(logits, labels, n_valid, loss_rows,
    lse), the Triton kernel's bound (`utils.KernelLauncher.bind`)."""
    counted = ignore_index is not None if counted is None else counted
    if write_grad and not is_traced(logits) and cross_entropy_hopper.usable(logits):
        cross_entropy_hopper.launch_cross_entropy_inplace_sm90(
            logits, labels, ignore_index, n_valid, loss_rows, normalize, counted
        )
        return lambda logits, labels, n_valid, loss_rows, lse: (
            cross_entropy_hopper.launch_cross_entropy_inplace_sm90(
                logits, labels, ignore_index, n_valid, loss_rows, normalize, counted
            )
        )
    n_outer, n_inner, n_cols = logits.shape
    n_rows = n_outer * n_inner
    block_m, block_n, single_pass, num_warps = _cross_entropy_fwd_config(
        n_cols, write_grad, logits.device
    )
    return launcher(_cross_entropy_fwd_kernel).bind(
        (cdiv(n_rows, block_m),), logits, labels, n_valid, loss_rows, lse,
        *_strides_2level(logits), *_strides_2level(labels),
        n_rows, n_inner, n_cols, 0 if ignore_index is None else ignore_index,
        HAS_IGNORE=ignore_index is not None, WRITE_GRAD=write_grad, NORMALIZE_GRAD=normalize,
        COUNTED=counted, SINGLE_PASS=single_pass, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )  # fmt: skip


def launch_cross_entropy_fwd_reduce(
    loss_rows, labels, ignore_index, n_valid, loss, sum_loss, count, verdict=None
):
    """One program: n_valid = the labels not ignored (count), loss = the mean of loss_rows
    over them (sum_loss), also written into `verdict` where given and NaN (a label check's
    zeroed slot, `checks.reserve`). Returns the launch bound for tensors of the same layouts
    and facts: again(loss_rows, labels, n_valid, loss, verdict or loss)."""
    n_outer, n_inner = labels.shape
    return launcher(_cross_entropy_fwd_reduce_kernel).bind(
        (1,), loss_rows, labels, n_valid, loss, default(verdict, loss), *_strides_2level(labels),
        n_outer * n_inner, n_inner, 0 if ignore_index is None else ignore_index,
        HAS_IGNORE=ignore_index is not None, SUM_LOSS=sum_loss, COUNT=count,
        HAS_VERDICT=verdict is not None, BLOCK=MAX_REDUCE_BLOCK, num_warps=8,
    )  # fmt: skip


def _forward_launches(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int | None, verdict=None
):
    """Run the forward's two launches (per-row losses and log-sum-exps, then the mean, also
    into `verdict` where given) into fresh outputs and bind them: ((loss, lse, n_valid),
    again), again(logits, labels, verdict) running them again for new tensors of the same
    layouts into fresh outputs (a verdict slot where this call had one, else None)."""
    n_rows = logits.shape[0] * logits.shape[1]
    traced = is_traced(logits)

    def outputs(device: torch.device) -> tuple[torch.Tensor, ...]:
        """(loss_rows, lse, n_valid, loss). The scalars: `empty_scalar`'s view where traced
        (for inductor), else 0-d tensors at once (half the host time, and the loss is no
        view: in-place ops on it work as on F.cross_entropy's, first call or later)."""
        rows = torch.empty(n_rows, dtype=torch.float32, device=device)
        lse = torch.empty(n_rows, dtype=torch.float32, device=device)
        if traced:
            return rows, lse, empty_scalar(device), empty_scalar(device)
        n_valid = torch.empty(size=(), dtype=torch.float32, device=device)
        return rows, lse, n_valid, torch.empty(size=(), dtype=torch.float32, device=device)

    loss_rows, lse, n_valid, loss = outputs(logits.device)
    rows = launch_cross_entropy_fwd(
        logits, labels, ignore_index, n_valid, loss_rows, lse, False, False
    )
    mean = launch_cross_entropy_fwd_reduce(
        loss_rows, labels, ignore_index, n_valid, loss, True, True, verdict
    )

    def again(logits, labels, verdict) -> tuple[torch.Tensor, ...]:
        loss_rows, lse, n_valid, loss = outputs(logits.device)
        rows(logits, labels, n_valid, loss_rows, lse)
        mean(loss_rows, labels, n_valid, loss, default(verdict, loss))
        return loss, lse, n_valid

    return (loss, lse, n_valid), again


def _backward_launch(tensors: tuple, ignore_index: int | None):
    """Run the backward's launch on tensors = (logits, labels, lse, n_valid, dloss, dx) and
    bind it: again(*tensors) for new tensors of the same layouts."""
    logits = tensors[0]
    n_outer, n_inner, n_cols = logits.shape
    n_rows = n_outer * n_inner
    block_m, block_n, _, num_warps = _cross_entropy_bwd_config(n_cols)
    return launcher(_cross_entropy_bwd_kernel).bind(
        (cdiv(n_rows, block_m),), *tensors,
        *_strides_2level(logits), *_strides_2level(tensors[1]), n_cols,
        n_rows, n_inner, n_cols, 0 if ignore_index is None else ignore_index,
        HAS_IGNORE=ignore_index is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )  # fmt: skip


@triton_op("triton_transformer::cross_entropy", mutates_args=())
def cross_entropy_op(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: Optional[int],  # noqa: UP045 (torch 2.11's schema inference)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean cross entropy: logits (outer, inner, V) with a unit-stride last dim, labels
    (outer, inner) int64, any strides. Returns (loss 0-d fp32, lse (outer * inner,) fp32,
    n_valid 0-d fp32); the last two are for `cross_entropy_backward_op`. An eager call takes
    the launches bound for its shape (`_PLANS`) when there are."""
    key = None
    if not is_traced(logits):
        key = ("fwd", *layout_key(logits, labels), ignore_index, logits.device, *_switches())
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(logits, labels, None)
    out, plan = _forward_launches(logits, labels, ignore_index)
    if key is not None:
        _PLANS.put(key, plan)
    return out


@triton_op("triton_transformer::cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: Optional[int],  # noqa: UP045
) -> torch.Tensor:
    """d(dloss * loss)/d(logits) as a new contiguous tensor shaped and typed like logits. An
    eager call takes the launch bound for its shape (`_PLANS`) when there is one."""
    dx = torch.empty(size=logits.shape, dtype=logits.dtype, device=logits.device)
    tensors = (logits, labels, lse, n_valid, dloss, dx)
    key = None
    if not is_traced(logits):
        key = ("bwd", *layout_key(*tensors), ignore_index, logits.device, *_switches())
        bound = _PLANS.get(key)
        if bound is not None:
            bound(*tensors)
            return dx
    bound = _backward_launch(tensors, ignore_index)
    if key is not None:
        _PLANS.put(key, bound)
    return dx


def _cross_entropy_setup_context(ctx, inputs, output) -> None:
    logits, labels, ctx.ignore_index = inputs
    _, lse, n_valid = output
    ctx.mark_non_differentiable(lse, n_valid)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for lse and n_valid
    ctx.save_for_backward(logits, labels, lse, n_valid)


@first_order_only("cross_entropy")
def _cross_entropy_backward(ctx, dloss, _dlse, _dn_valid):
    if dloss is None:  # grads are not materialised: the loss was not used
        return None, None, None
    logits, labels, lse, n_valid = ctx.saved_tensors
    dx = call_op(cross_entropy_backward_op, dloss, logits, labels, lse, n_valid, ctx.ignore_index)
    return dx, None, None


cross_entropy_op.register_autograd(
    _cross_entropy_backward, setup_context=_cross_entropy_setup_context
)


def _cross_entropy_inplace_impl(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: Optional[int],  # noqa: UP045 (torch 2.11's schema inference)
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `cross_entropy_op`, and overwrites `logits` with d(loss)/d(logits) (for fp16
    logits: without the 1 / n_valid factor). Returns (loss 0-d fp32, n_valid 0-d fp32)."""
    n_outer, n_inner, _ = logits.shape
    device = logits.device
    has_ignore = ignore_index is not None
    normalize = logits.dtype != torch.float16
    loss_rows = torch.empty(n_outer * n_inner, dtype=torch.float32, device=device)
    n_valid = empty_scalar(device)
    loss = empty_scalar(device)
    if has_ignore:  # the gradient needs 1 / n_valid before any row is written
        launch_cross_entropy_fwd_reduce(loss_rows, labels, ignore_index, n_valid, loss, False, True)
    launch_cross_entropy_fwd(
        logits, labels, ignore_index, n_valid, loss_rows, loss_rows, True, normalize
    )
    launch_cross_entropy_fwd_reduce(
        loss_rows, labels, ignore_index, n_valid, loss, True, not has_ignore
    )
    return loss, n_valid


cross_entropy_inplace_op = triton_op(
    "triton_transformer::cross_entropy_inplace", mutates_args={"logits"}
)(_cross_entropy_inplace_impl)

# Traced code (torch.compile) cannot launch `cross_entropy_hopper`'s Gluon kernel, which eager
# calls take for long rows on Hopper: there it calls the op's implementation as an opaque op,
# which inductor calls as it is, with the strides it traced, and which launches what an eager
# call launches. False: traced code runs the Triton kernel.
TRACED_OPAQUE = True
cross_entropy_inplace_opaque_op = opaque_op(
    "cross_entropy_inplace", _cross_entropy_inplace_impl, mutates_args=("logits",)
)


@cross_entropy_inplace_opaque_op.register_fake
def _(logits, labels, ignore_index):
    return logits.new_empty((), dtype=torch.float32), logits.new_empty((), dtype=torch.float32)


@triton_op("triton_transformer::cross_entropy_inplace_backward", mutates_args={"grad"})
def cross_entropy_inplace_backward_op(
    grad: torch.Tensor, dloss: torch.Tensor, n_valid: torch.Tensor
) -> None:
    """grad *= dloss in place (fp16: dloss / n_valid); a no-op on the device when that factor
    is exactly 1. grad: the logits buffer written by `cross_entropy_inplace_op`."""
    n_outer, n_inner, n_cols = grad.shape
    n_rows = n_outer * n_inner
    block_m, block_n, _, num_warps = _cross_entropy_bwd_config(n_cols)
    launcher(_cross_entropy_bwd_scale_kernel)[(cdiv(n_rows, block_m),)](
        dloss, n_valid, grad, *_strides_2level(grad), n_rows, n_inner, n_cols,
        DIVIDE_BY_N_VALID=grad.dtype == torch.float16, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )  # fmt: skip


class _CrossEntropyInplaceFunction(torch.autograd.Function):
    """Autograd for `cross_entropy_inplace_op`. torch.library cannot attach autograd to an op
    that mutates its input, so this is the one autograd.Function of the Triton path; Dynamo
    traces it (both methods call torch.library ops) without a graph break."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        op = cross_entropy_inplace_op
        traced = tracing(logits)
        if TRACED_OPAQUE and traced and cross_entropy_hopper.takes_strides(logits):
            op = cross_entropy_inplace_opaque_op
        loss, n_valid = call_op(op, logits, labels, ignore_index)
        ctx.save_for_backward(logits, n_valid)  # logits now hold the gradient
        return loss

    @staticmethod
    @first_order_only("cross_entropy")
    def backward(ctx, dloss):
        refuse_second_backward(
            ctx,
            "cross_entropy(inplace_backward=True) scales its gradient buffer in place, so it "
            "supports one backward per forward (no retain_graph reuse)",
        )
        grad, n_valid = ctx.saved_tensors
        call_op(cross_entropy_inplace_backward_op, grad, dloss, n_valid)
        return grad, None, None


# ----------------------------------------------------------------------------- eager calls
# An eager call (nothing traces) of a layout seen before takes that layout's `_EagerPlan`, as
# `layernorm`'s do: one key of every fact the checks and the kernels read
# (`utils.eager_plan_key`: logits, labels, ignore_index, the module's switches), one lookup,
# then the launches bound for it. It skips the checks, `_as_rows_3d`, `call_op`, the op's
# autograd wrapper and a plan key of every launch's tensors. Kernels, saved tensors and
# gradients are `cross_entropy_op`'s. (`inplace_backward` with autograd recording keeps the
# generic path: its op mutates the logits, which the dispatcher records.)


class _EagerPlan:
    """The launches of eager cross_entropy calls of one layout: at least one position, V > 0,
    logits and labels that `_as_rows_3d` views without a copy (what `_eager_plan` admits).
    The `fwd` and `bwd` entries are the bound launches a plan's first calls make, on the
    views; later calls pass the caller's logits and labels as they are: a bound launch reads
    each tensor's address alone (its layout is bound), which the views share, and a view
    costs an eager call microseconds of host time."""

    __slots__ = ("bwd", "fwd", "ignore_index", "labels_shape", "logits_shape", "rows_shape")

    def __init__(self, logits: torch.Tensor, logits3: torch.Tensor, labels2: torch.Tensor,
                 ignore_index: int | None) -> None:  # fmt: skip
        self.logits_shape = logits.shape
        self.rows_shape, self.labels_shape = logits3.shape, labels2.shape
        self.ignore_index = ignore_index
        self.fwd: dict[bool, Callable[..., tuple]] = {}  # by whether a verdict is written
        self.bwd: dict[tuple, Callable[..., None]] = {}

    def forward(self, logits, labels, verdict) -> tuple[torch.Tensor, ...]:
        """(loss, lse, n_valid), as `cross_entropy_op` returns them; a NaN loss also into
        `verdict` (a label check's zeroed slot, `checks.reserve`) where given."""
        fwd = self.fwd.get(verdict is not None)
        if fwd is not None:
            return fwd(logits, labels, verdict)
        logits3, labels2 = logits.view(self.rows_shape), labels.view(self.labels_shape)
        out, self.fwd[verdict is not None] = _forward_launches(
            logits3, labels2, self.ignore_index, verdict
        )
        return out

    def backward(self, dloss, logits, labels, lse, n_valid) -> torch.Tensor:
        """d(dloss · loss)/d(logits), contiguous in logits' shape, as
        `cross_entropy_backward_op` returns it (viewed); dloss's dtype and alignment pick the
        launch."""
        dx = torch.empty(size=self.logits_shape, dtype=logits.dtype, device=logits.device)
        key = (dloss.dtype, not dloss.data_ptr() & 15)
        bwd = self.bwd.get(key)
        if bwd is not None:
            bwd(logits, labels, lse, n_valid, dloss, dx)
        else:
            views = (logits.view(self.rows_shape), labels.view(self.labels_shape))
            tensors = (*views, lse, n_valid, dloss, dx.view(self.rows_shape))
            self.bwd[key] = _backward_launch(tensors, self.ignore_index)
        return dx


_EAGER_PLANS = LaunchPlans()


def _eager_plan(logits, labels, ignore_index) -> _EagerPlan | None:
    """The plan of this eager call's layout, made on its first call; None where the generic
    path must run: traced tensors, an ignore_index that is not an int (the checks raise),
    anything else the checks would refuse, no position, or rows that need a copy (a layout
    whose call takes the generic path is remembered as False, so it is judged once)."""
    if ignore_index is not None and type(ignore_index) is not int:
        return None
    key, plan = _EAGER_PLANS.find((logits, labels), (ignore_index, *_switches()))
    if key is None or plan is not None:
        return plan or None
    _check_args(logits, labels, ignore_index, True)
    if labels.numel() == 0 or not _rows_are_views(logits, labels):
        _EAGER_PLANS.put(key, False)
        return None
    logits3, labels2 = _as_rows_3d(logits, labels)
    return _EAGER_PLANS.put(key, _EagerPlan(logits, logits3, labels2, ignore_index))


class _EagerCrossEntropy(torch.autograd.Function):
    """`cross_entropy_op` and its registered backward for an eager call of a planned layout."""

    @staticmethod
    def forward(ctx, logits, labels, plan, verdict):
        loss, lse, n_valid = plan.forward(logits, labels, verdict)
        ctx.save_for_backward(logits, labels, lse, n_valid)
        ctx.plan = plan
        return loss

    @staticmethod
    @first_order_only("cross_entropy")
    def backward(ctx, dloss):
        logits, labels, lse, n_valid = ctx.saved_tensors
        return ctx.plan.backward(dloss, logits, labels, lse, n_valid), None, None, None


_apply_eager_cross_entropy = eager_apply(_EagerCrossEntropy)


# --------------------------------------------------------------------------------------------
# PyTorch reference and public function
# --------------------------------------------------------------------------------------------


_LABEL_CHECK = "cross_entropy's label range check (pass check_labels=False inside a captured step)"


def _label_error(labels: torch.Tensor, V: int, ignore_index: int | None) -> ValueError | None:
    """The error for the first label outside [0, V) that is not ignore_index, or None. Syncs
    with a CUDA device."""
    bad = (labels < 0) | (labels >= V)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if not bad.any():
        return None
    return ValueError(
        f"labels must lie in [0, {V}) (the vocabulary size) or equal ignore_index="
        f"{ignore_index}; found label {labels[bad][0].item()}"
    )


def _check_labels_in_range(labels: torch.Tensor, V: int, ignore_index: int | None) -> None:
    """Raise ValueError if a non-ignored label is outside [0, V). Syncs with a CUDA device, so
    it refuses to run during CUDA stream capture."""
    check_not_capturing(_LABEL_CHECK)
    err = _label_error(labels, V, ignore_index)
    if err is not None:
        raise err


def check_labels_after(
    loss: torch.Tensor, labels: torch.Tensor, V: int, ignore_index: int | None, ticket=None
) -> None:
    """The label check of an eager Triton call, after its kernels (the caller has refused
    stream capture and polled earlier checks before launching them). A bad label makes the
    kernels' loss NaN, so the loss is the verdict: written by the kernels into the slot of
    `ticket` (`checks.reserve`) where NaN, or else copied there (`checks.check_later`), it is
    read once the GPU has written it, without a sync, and only a NaN loss checks the labels
    (`_label_error`: a NaN from the logits themselves raises nothing). On the CPU it raises
    now. Checking first would cost five launches and a sync on every call."""
    error = functools.partial(_label_error, labels, V, ignore_index)
    if ticket is None:
        checks.check_later(loss, math.isnan, error)
    else:
        checks.defer(ticket, math.isnan, error)


def check_labels_before(
    check_labels: bool, labels: torch.Tensor, V: int, ignore_index: int | None, after_ok: bool
) -> bool:
    """The label check a call asks for (check_labels, or anomaly detection in eager code),
    before its kernels: the full check where it must come first, else the refusal of stream
    capture and a poll of earlier calls' deferred checks. after_ok: the call is an eager
    Triton one whose kernels make a bad label's loss NaN. Returns whether the caller then
    runs `check_labels_after`."""
    compiling = torch.compiler.is_compiling()
    # (Dynamo cannot trace is_anomaly_enabled(): a compiled caller gets the check it asks for)
    anomaly = not compiling and torch.is_anomaly_enabled()
    if not (check_labels or anomaly):
        return False
    if after_ok and labels.numel() > 0 and not (compiling or anomaly):
        check_not_capturing(_LABEL_CHECK)
        checks.poll()
        return True
    _check_labels_in_range(labels, V, ignore_index)
    return False


def _cross_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int | None
) -> torch.Tensor:
    V = logits.shape[-1]
    # Compute in at least fp32 (fp64 stays fp64, for float64 references).
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = logits.reshape(-1, V).to(dtype)
    flat = labels.reshape(-1)
    if ignore_index is None:
        return _nll_rows(rows, flat).sum() / max(flat.numel(), 1)
    valid = flat != ignore_index
    # Ignored rows get harmless logits 0 and label 0 and are then masked out, so they add 0,
    # and 0 gradient (never NaN: an ignored row of -inf logits would give NaN through softmax).
    rows = torch.where(valid[:, None], rows, 0.0)
    nll = _nll_rows(rows, torch.where(valid, flat, 0))
    return torch.where(valid, nll, 0.0).sum() / valid.sum().clamp(min=1)


def _nll_rows(rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log softmax(rows)[label] of each row of rows (M, V), labels (M,), with no label
    skipped: F.cross_entropy always skips its ignore_index, -100 unless told otherwise, so a
    bad label of -100 would silently drop out of a loss whose ignore_index is None or another
    value (and still count in its mean). An out-of-range label raises here (CPU) or trips a
    device-side assert (CUDA), as F.cross_entropy does for the others."""
    return -rows.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)


def _leading_dims_merge(t: torch.Tensor, n_dims: int) -> bool:
    """True if t's first n_dims dims can be viewed as one (a single stride steps them)."""
    for i in range(n_dims - 1):
        if t.shape[i + 1] != 1 and t.stride(i) != t.stride(i + 1) * t.shape[i + 1]:
            return False
    return True


def _rows_are_views(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """Whether `_as_rows_3d` returns views of both (no copy), judged from the strides."""
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        return False
    lead = labels.dim()
    return lead <= 1 or (
        _leading_dims_merge(logits, lead - 1) and _leading_dims_merge(labels, lead - 1)
    )


def _as_rows_3d(logits: torch.Tensor, labels: torch.Tensor):
    """logits (..., V) as an (outer, inner, V) tensor with a unit-stride last dim, and labels
    as (outer, inner): views where the strides allow (e.g. the shifted slices logits[:, :-1],
    labels[:, 1:] of a language-model batch), copies otherwise. (No try/except on view(), so
    Dynamo traces it.)"""
    V = logits.shape[-1]
    if logits.stride(-1) != 1 and V > 1:
        logits = logits.contiguous()
    lead = labels.dim()
    if lead <= 1:
        return logits.reshape(1, labels.numel(), V), labels.reshape(1, labels.numel())
    inner = labels.shape[-1]
    if not _leading_dims_merge(logits, lead - 1):
        logits = logits.contiguous()
    if not _leading_dims_merge(labels, lead - 1):
        labels = labels.contiguous()
    return logits.reshape(-1, inner, V), labels.reshape(-1, inner)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int | None = None,
    use_triton: bool = False,
    *,
    check_labels: bool = True,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Mean cross entropy of `labels` under softmax(`logits`) over the last dim.

    Args:
        logits: (..., V) float tensor (fp32/fp16/bf16; the PyTorch branch also takes fp64).
        labels: (...) int64 tensor, same leading shape as `logits`, values in [0, V) or
            `ignore_index`.
        ignore_index: label value whose positions are left out of the mean; None ignores
            nothing.
        use_triton: run the fused Triton kernels instead of the PyTorch reference.
        check_labels: raise for a label out of range (refused during CUDA stream capture).
            An eager Triton call on a GPU raises from a later checked call, or from
            `triton_transformer.checks.raise_pending()`, without a sync (its loss is NaN
            meanwhile; see the module docstring); the reference, the in-place mode and
            anomaly-detection mode check first, with a sync. Pass False inside a training
            step: the Triton branch then returns NaN for a bad label.
        inplace_backward: (Triton branch, when logits require grad) overwrite `logits` with
            the gradient during forward, so backward needs no logits-sized buffer. Use it only
            when nothing reads the logits afterwards (a model's loss path); one backward per
            forward. The PyTorch branch ignores it.

    Returns:
        0-d tensor: the mean loss over non-ignored positions, float32 (float64 for float64
        logits). 0, with zero gradient, when every position is ignored.

    Raises:
        TypeError: non-tensor inputs, non-floating logits, labels not int64, or a
            non-integer ignore_index.
        ValueError: mismatched shapes or devices, V == 0 with positions present, or (with
            check_labels, or in anomaly-detection mode) a label outside [0, V) that is not
            ignore_index.
        RuntimeError: the label check during CUDA stream capture.
    """
    records = torch.is_grad_enabled() and getattr(logits, "requires_grad", False)
    if use_triton and not (inplace_backward and records):
        plan = _eager_plan(logits, labels, ignore_index)
        if plan is not None:
            V = logits.shape[-1]
            after = check_labels_before(check_labels, labels, V, ignore_index, True)
            verdict, ticket = checks.reserve(logits.device) if after else (None, None)
            if records:
                loss = _apply_eager_cross_entropy(logits, labels, plan, verdict)
            else:
                loss = plan.forward(logits, labels, verdict)[0]
            if after:
                check_labels_after(loss, labels, V, ignore_index, ticket)
            return loss
    _check_args(logits, labels, ignore_index, use_triton)
    # an eager Triton call checks after its kernels (`check_labels_after`); the reference
    # first (F.cross_entropy would stop at a device-side assert), and so do traced calls and
    # the in-place path (its kernel would have overwritten the caller's logits)
    after_ok = use_triton and not is_traced(logits) and not (inplace_backward and records)
    after = check_labels_before(check_labels, labels, logits.shape[-1], ignore_index, after_ok)
    # No positions: the reference already gives 0 connected to the graph; nothing to launch.
    if not use_triton or labels.numel() == 0:
        return _cross_entropy_reference(logits, labels, ignore_index)

    logits3, labels2 = _as_rows_3d(logits, labels)
    if inplace_backward and records:
        loss = _CrossEntropyInplaceFunction.apply(logits3, labels2, ignore_index)
    else:
        loss = call_op(cross_entropy_op, logits3, labels2, ignore_index)[0]
    if after:
        check_labels_after(loss, labels, logits.shape[-1], ignore_index)
    return loss


def _check_args(logits, labels, ignore_index, use_triton: bool) -> None:
    """`cross_entropy`'s argument checks (not the labels' values)."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("logits and labels must be torch.Tensors")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64 class indices, got {labels.dtype}")
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
    ):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")
    if logits.dim() < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without its last "
            f"(vocabulary) dim; logits shape is {tuple(logits.shape)}"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels on {labels.device} but logits on {logits.device}")
    if logits.shape[-1] == 0 and labels.numel() > 0:
        raise ValueError("logits has an empty vocabulary dim (V == 0)")

    if use_triton:
        check_triton_tensor(logits, "logits")
