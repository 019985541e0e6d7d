"""Cross entropy with its gradient written in place, for Hopper GPUs, written in Gluon.

For each row x of V logits with label y (`cross_entropy_inplace_op`, and each chunk of the
fused linear + cross-entropy):

    m   = max_j x_j,   s = Σ_j exp(x_j - m),   lse = m + log s
    loss = lse - x_y
    x_j <- (exp(x_j - lse) - [j == y]) · scale         (scale = 1 / n_valid, or 1 for fp16)

Rows too long for registers (GPT-2's 50,304 classes) run in `cross_entropy`'s Triton kernel as
two passes over global memory: the online log-sum-exp, then the gradient. Each row is read
twice and written once; the second read is rarely still in L2 (the GPU has ~2,000 programs'
rows in flight, 200 MB against a 50 MB L2). At GPT-2's loss chunks (4096 x 50,304 bf16) that
kernel moves 0.82 GB in 358 µs against the copy rate's ~205 µs (`step_gpt2_kernels_session18`).

Here each program copies a whole row into shared memory by TMA (a 16-bit row of up to ~56,000
classes is at most ~110 KiB: two programs per SM), then reads it three times from there:
the maximum, the sum of exponentials, the gradient, which is stored to global memory from
registers. Global traffic is one read and one write. The programs are persistent (rows
pid, pid + grid, ...): while a program writes one row's gradient, the TMA loads of its next
row are already under way, one box at a time as each box is read for the last time.

The passes are bound by instructions as much as by memory: a first version that masked and
label-tested every element in every pass was no faster than the Triton kernel. So only the
row's last box is masked, x_y is one global load, the gradient's scale is folded into its
exponent, and the one-hot term is one store after the row's (see the kernel).

Measured (H200, 2026-11-27, `ce_gluon_probe_session19.md`, kernel µs with L2 flushed, this
kernel / the Triton kernel): 4096 x 50,304 bf16 (GPT-2's loss chunk) 237.8 / 325.4 (0.82 of
the copy bandwidth, counting one read and one write); 16384 x 50,304 901.4 / 1235.9; 8192 x
32,000 288.6 / 403.4; 4096 x 100,352 (one program per SM) 518.9 / 643.9.

The row is described to TMA as boxes of 64 columns (a 2-D view of the tensor as rows of 64
elements: V and the row stride must be multiples of 64). A box that reaches past the row's
end reads the next row's first columns (or zeros past the tensor), which the kernel masks
off; the gradient is stored with a column mask, so nothing outside the row is written.

Scope (`usable`): Hopper, Gluon, fp16 / bf16 logits whose rows (outer, inner, V) are evenly
strided, V a multiple of 64 above `cross_entropy.FWD_MAX_BLOCK` and small enough for shared
memory; eager launches and CUDA graphs (torch.compile's `wrap_triton` takes no Gluon kernel).
Everything else runs the Triton kernel.
"""

from __future__ import annotations

import torch
import triton

from triton_transformer import _gluon
from triton_transformer._gluon import HAVE_GLUON, gl, gluon, is_sm90, mbarrier, tma
from triton_transformer.utils import launcher, sm_count, tma_scratch

__all__ = ["ENABLED", "launch_cross_entropy_inplace_sm90", "row_boxes", "usable"]

ENABLED = True  # (benchmarks and tests turn it off to compare with the Triton kernel)
# Shared memory one program may take: two programs per SM up to SMEM_TWO_PER_SM, else one
# (H100 / H200: 227 KiB per program at most, 228 KiB per SM with 1 KiB reserved per program).
SMEM_TWO_PER_SM = 112 * 1024
SMEM_ONE_PER_SM = 220 * 1024
# Columns per box row: 64 16-bit elements, 128 bytes (TMA's 128-byte swizzle span)
BOX_COLS = 64
NUM_WARPS = 8
# Box heights (rows of BOX_COLS) to choose from (`row_boxes`), largest first; benchmarks sweep
# them. H200, 2026-11-27 (`ce_gluon_probe_session19.md`, kernel µs at 8 warps, boxes of 16 /
# 32 / 64 rows): 4096 x 50304 403.7 / 235.8 / 237.8; 8192 x 32000 509.3 / 303.0 / 288.6;
# 4096 x 100352 (one program per SM) 1176.0 / 630.2 / 518.9. Per box, each warp pays a wait,
# a barrier and its loop's overhead: small boxes lose. 4 warps: 236.7-900.1 at 64 rows, as
# fast at two programs per SM, slower at one.
BOX_ROWS = (64, 32, 16)

_LOG2E = gl.constexpr(1.4426950408889634) if HAVE_GLUON else 1.4426950408889634
_COLS = gl.constexpr(BOX_COLS) if HAVE_GLUON else BOX_COLS  # (kernels read constexpr globals)


if HAVE_GLUON:

    @gluon.jit
    def _load_box(desc, bufs, bars, row_box, j, BOX: gl.constexpr):
        """The TMA load of box j of the row whose first box row is `row_box` into bufs[j],
        signalling bars[j]."""
        bar = bars.index(j)
        mbarrier.expect(bar, BOX * _COLS * 2)
        _gluon.tma_load(desc, [row_box + j * BOX, 0], bar, bufs.index(j))

    @gluon.jit
    def _inside(j, n_cols, layout: gl.constexpr, BOX: gl.constexpr):
        """Which elements of box j lie inside the row (n_cols columns)."""
        r = gl.arange(0, BOX, layout=gl.SliceLayout(1, layout))[:, None]
        c = gl.arange(0, _COLS, layout=gl.SliceLayout(0, layout))[None, :]
        return (j * BOX + r) * _COLS + c < n_cols

    @gluon.jit
    def _box(bufs, j, n_cols, layout: gl.constexpr, BOX: gl.constexpr, LAST: gl.constexpr):
        """Box j of the row in fp32; in the last box (LAST), -inf past the row's end (the other
        boxes lie inside the row)."""
        x = bufs.index(j).load(layout).to(gl.float32)
        if LAST:
            x = gl.where(_inside(j, n_cols, layout, BOX), x, float("-inf"))
        return x

    @gluon.jit
    def _grad_box(
        desc, bufs, bars, j, out, offs, n_cols, shift, valid, next_row_box, has_next,
        layout: gl.constexpr, BOX: gl.constexpr, LAST: gl.constexpr,
    ):  # fmt: skip
        """Box j's gradient exp2(x·log2 e - shift) (0 for an ignored row) stored at out; then,
        once every warp has read the box, its load for the program's next row."""
        x = _box(bufs, j, n_cols, layout, BOX, LAST)
        g = gl.exp2(x * _LOG2E - shift)
        g = gl.where(valid, g, 0.0)
        ptrs = out + j * (BOX * _COLS) + offs
        if LAST:
            gl.store(ptrs, g.to(out.dtype.element_ty), mask=_inside(j, n_cols, layout, BOX))
        else:
            gl.store(ptrs, g.to(out.dtype.element_ty))
        _gluon.cta_barrier()
        if has_next:
            _load_box(desc, bufs, bars, next_row_box, j, BOX)

    @gluon.jit
    def _ce_inplace_sm90_kernel(
        LOGITS, LABELS, N_VALID, LOSS,
        n_rows, n_inner, n_cols, stride_row, stride_labels_outer, stride_labels_inner,
        ignore_index, total_box_rows,
        HAS_IGNORE: gl.constexpr, NORMALIZE_GRAD: gl.constexpr, COUNTED: gl.constexpr,
        BOX: gl.constexpr, N_BOXES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """Per-row loss (0 for an ignored row) into LOSS; the logits overwritten with the
        gradient of the mean loss for an upstream gradient of 1 (NORMALIZE_GRAD: times
        1 / n_valid, n_valid read from N_VALID when COUNTED, else n_rows). A label outside
        [0, V) that is not ignored makes its row's loss and gradient NaN.

        Per row, with L = log2 e and the scale folded into the exponent:
            m = max x,  s = Σ exp2(x·L - m·L),  lse = m + log2(s) / L
            g = exp2(x·L - shift),  shift = lse·L - log2(scale)   (= exp(x - lse) · scale)
        and the label's element is then rewritten as g_y - scale (the one-hot term), so the
        passes over the row carry no per-element label test."""
        dtype: gl.constexpr = LOGITS.dtype.element_ty
        smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BOX, _COLS], dtype)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        desc = tma.make_tensor_descriptor(
            LOGITS, [total_box_rows, _COLS], [_COLS, 1], [BOX, _COLS], smem_layout
        )
        bufs = gl.allocate_shared_memory(dtype, [N_BOXES, BOX, _COLS], smem_layout)
        bars = gl.allocate_shared_memory(gl.int64, [N_BOXES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N_BOXES):
            mbarrier.init(bars.index(i), count=1)

        pid = gl.program_id(0)
        n_progs = gl.num_programs(0)
        stride_box_rows = stride_row // _COLS
        for i in gl.static_range(N_BOXES):  # this program's first row (grid <= n_rows)
            _load_box(desc, bufs, bars, pid * stride_box_rows, i, BOX)
        box_r = gl.arange(0, BOX, layout=gl.SliceLayout(1, layout))[:, None]
        box_c = gl.arange(0, _COLS, layout=gl.SliceLayout(0, layout))[None, :]
        offs = box_r * _COLS + box_c  # each element's offset inside its box
        scale = 1.0
        if NORMALIZE_GRAD:
            if COUNTED:  # noqa: SIM108 (constexpr branches)
                scale = 1.0 / gl.maximum(gl.load(N_VALID), 1.0)
            else:
                scale = 1.0 / n_rows
        log2_scale = gl.log2(scale)

        phase = 0
        for row in range(pid, n_rows, n_progs):
            outer = row // n_inner
            label = gl.load(
                LABELS + outer * stride_labels_outer + (row - outer * n_inner) * stride_labels_inner
            )
            in_range = (label >= 0) & (label < n_cols)
            valid = True
            if HAS_IGNORE:
                valid = label != ignore_index
            out = LOGITS + row.to(gl.int64) * stride_row
            # read before any gradient is written (the passes below hold barriers)
            x_label = gl.load(out + label, mask=valid & in_range, other=0.0).to(gl.float32)

            # pass 1: the maximum, element-wise over the boxes as they land, reduced once
            m_acc = gl.full([BOX, _COLS], float("-inf"), gl.float32, layout)
            for j in range(N_BOXES - 1):
                mbarrier.wait(bars.index(j), phase)
                x = _box(bufs, j, n_cols, layout, BOX, False)
                m_acc = gl.maximum(m_acc, x)
            mbarrier.wait(bars.index(N_BOXES - 1), phase)
            x = _box(bufs, N_BOXES - 1, n_cols, layout, BOX, True)
            m_scaled = gl.max(gl.max(gl.maximum(m_acc, x), axis=1), axis=0) * _LOG2E

            # pass 2: the sum of exponentials
            s_acc = gl.exp2(x * _LOG2E - m_scaled)
            for j in range(N_BOXES - 1):
                x = _box(bufs, j, n_cols, layout, BOX, False)
                s_acc += gl.exp2(x * _LOG2E - m_scaled)
            lse_scaled = m_scaled + gl.log2(gl.sum(gl.sum(s_acc, axis=1), axis=0))
            poison = gl.where(valid & ~in_range, float("nan"), 0.0)
            shift = lse_scaled - log2_scale + poison
            loss = (lse_scaled + poison) / _LOG2E - x_label
            if HAS_IGNORE:
                loss = gl.where(valid, loss, 0.0)
            gl.store(LOSS + row, loss)

            # pass 3: the gradient, stored from registers; each box, once read, takes its part
            # of this program's next row
            next_row = row + n_progs
            has_next = next_row < n_rows
            next_row_box = next_row * stride_box_rows
            for j in range(N_BOXES - 1):
                _grad_box(
                    desc, bufs, bars, j, out, offs, n_cols, shift, valid, next_row_box,
                    has_next, layout, BOX, False,
                )  # fmt: skip
            _grad_box(
                desc, bufs, bars, N_BOXES - 1, out, offs, n_cols, shift, valid, next_row_box,
                has_next, layout, BOX, True,
            )  # fmt: skip
            # the one-hot term: g_y - scale, after every warp's store of g_y (the barrier
            # above orders them)
            g_label = gl.exp2(x_label * _LOG2E - shift) - scale
            gl.store(out + label, g_label.to(dtype), mask=valid & in_range)
            phase ^= 1


def row_boxes(n_cols: int, itemsize: int) -> tuple[int, int, int] | None:
    """(box rows, boxes per row, programs per SM) of a row of n_cols 16-bit classes, or None
    where the row does not fit shared memory: two programs per SM where some box height of
    `BOX_ROWS` fits them, else one; then the tallest box that fits (padding the row to whole
    boxes)."""
    box_rows_needed = -(-n_cols // BOX_COLS)
    for per_sm, budget in ((2, SMEM_TWO_PER_SM), (1, SMEM_ONE_PER_SM)):
        for box in BOX_ROWS:
            n_boxes = -(-box_rows_needed // box)
            if n_boxes * box * BOX_COLS * itemsize <= budget:
                return box, n_boxes, per_sm
    return None


def usable(logits: torch.Tensor) -> bool:
    """Whether the kernel takes the in-place forward of `logits` (outer, inner, V): Gluon,
    `ENABLED`, a Hopper GPU, fp16 / bf16, V a multiple of `BOX_COLS` above
    `cross_entropy.FWD_MAX_BLOCK` (shorter rows stay in the Triton kernel's registers) that
    fits shared memory, evenly strided rows (`_row_stride`) whose stride is a multiple of
    `BOX_COLS`, a 16-byte aligned start, and box-row coordinates within TMA's int32. The
    caller checks that nothing traces the launch."""
    return (logits.storage_offset() * logits.element_size()) % 16 == 0 and takes_strides(logits)


def takes_strides(logits: torch.Tensor) -> bool:
    """`usable` but for the 16-byte aligned start, which Dynamo cannot read (`storage_offset`):
    for traced code choosing the opaque op, whose eager call checks it."""
    stride = _row_stride(logits)
    n_rows = logits.shape[0] * logits.shape[1]
    return (
        stride is not None
        and logits.stride(2) == 1
        and takes_rows(logits.device, logits.dtype, n_rows, logits.shape[2], stride)
    )


def takes_rows(
    device: torch.device, dtype: torch.dtype, n_rows: int, n_cols: int, stride: int | None = None
) -> bool:  # fmt: skip
    """`usable`'s test of n_rows rows of n_cols logits `stride` elements apart (n_cols: dense
    rows), 16-byte aligned, on `device`: what it judges of a tensor, for callers that have
    none yet (`linear_cross_entropy`'s chunks)."""
    from triton_transformer.cross_entropy import FWD_MAX_BLOCK

    # Dynamo warns about calls through functools.cache: the uncached test while it traces
    hopper = is_sm90.__wrapped__(device) if torch.compiler.is_compiling() else is_sm90(device)
    if not (HAVE_GLUON and ENABLED and hopper):
        return False
    if dtype not in (torch.float16, torch.bfloat16) or n_cols <= FWD_MAX_BLOCK:
        return False
    stride = n_cols if stride is None else stride
    return (
        n_cols % BOX_COLS == 0
        and stride % BOX_COLS == 0
        and row_boxes(n_cols, dtype.itemsize) is not None
        and _total_box_rows(n_rows, stride, n_cols) < 2**31
    )


def _total_box_rows(n_rows: int, stride: int, n_cols: int) -> int:
    """Rows of `BOX_COLS` elements from the first row's start to the last row's end: the
    kernel's 2-D view of the logits for TMA."""
    return ((n_rows - 1) * stride + n_cols) // BOX_COLS


def _row_stride(logits: torch.Tensor) -> int | None:
    """The one stride between consecutive rows of logits (outer, inner, V), rows counted
    inner-fastest, or None where the outer and inner strides do not line up."""
    n_outer, n_inner, _ = logits.shape
    if n_inner == 1:
        return logits.stride(0)
    if n_outer == 1 or logits.stride(0) == n_inner * logits.stride(1):
        return logits.stride(1)
    return None


def launch_cross_entropy_inplace_sm90(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int | None,
    n_valid: torch.Tensor, loss_rows: torch.Tensor, normalize: bool, counted: bool,
) -> None:  # fmt: skip
    """The in-place forward of `cross_entropy.launch_cross_entropy_fwd` (write_grad) for
    logits (outer, inner, V) that `usable` takes; labels (outer, inner), loss_rows (outer *
    inner,) fp32; n_valid (0-d fp32) already counted when `counted`."""
    n_outer, n_inner, n_cols = logits.shape
    n_rows = n_outer * n_inner
    if n_rows == 0:
        return
    stride = _row_stride(logits)
    box, n_boxes, per_sm = row_boxes(n_cols, logits.element_size())
    total_box_rows = _total_box_rows(n_rows, stride, n_cols)
    # the device-side descriptor's scratch (a context variable of Triton: set by each launch)
    triton.set_allocator(tma_scratch)
    launcher(_ce_inplace_sm90_kernel)[(min(n_rows, per_sm * sm_count(logits.device)),)](
        logits, labels, n_valid, loss_rows,
        n_rows, n_inner, n_cols, stride, labels.stride(0), labels.stride(1),
        0 if ignore_index is None else ignore_index, total_box_rows,
        HAS_IGNORE=ignore_index is not None, NORMALIZE_GRAD=normalize,
        COUNTED=counted, BOX=box,
        N_BOXES=n_boxes, num_warps=NUM_WARPS,
    )  # fmt: skip
