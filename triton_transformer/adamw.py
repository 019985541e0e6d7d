"""AdamW: one Triton launch per parameter group, the gradient-norm clip folded into its read.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments). For each
parameter p with gradient g, moments m, v and step count t (after this step's increment):

    g  ← c · g                      c = min(1, max_norm / (‖G‖₂ + 1e-6)) after `clip_grad_norm`,
                                    ‖G‖₂ over every gradient of the optimizer; else c = 1
    m  ← β₁·m + (1 − β₁)·g
    v  ← β₂·v + (1 − β₂)·g²
    p  ← p·(1 − lr·λ) − (lr / (1 − β₁ᵗ)) · m / (√v / √(1 − β₂ᵗ) + ε)

`adamw_(..., use_triton=False)` runs exactly that with torch ops and defines the semantics;
`AdamW` is a drop-in `torch.optim.Optimizer` (same hyperparameters, same state keys, so state
dicts load both ways) whose `step` runs the Triton form of it, one launch per group.

Why a kernel of our own. torch's fused AdamW reaches 83% of copy bandwidth at the GPT-2
preset on an H200, but `clip_grad_norm_` adds a norm pass and an in-place scaling pass over
every gradient: clip and update together run at 66% (1.85 ms for 163 M parameters). Here the
norm is one pass (`clip_grad_norm`), and the update reads the factor c on the device: the
gradients are scaled as they are read, never rewritten (1.27 ms, 96%). So after `step` the
`.grad` tensors are the unclipped ones; the update is the clipped one.

The tensor table. One launch updates every tensor of a group: a device int64 table holds, per
tensor, the addresses of p, g, m, v and the step count and its element count; an int32 block
map says which tensor each program's BLOCK elements belong to. Programs turn the addresses
back into pointers (`int.to(tl.pointer_type(...))`). Addresses change when gradients are
re-allocated (`zero_grad(set_to_none=True)`), so `step` compares them with the table's
(a few hundred ns per tensor on the host) and makes a new table when they differ: a device
copy of the last one whose changed address columns a small kernel rewrites, the addresses
being its launch arguments, which a CUDA graph capture records (a capture allows no copy
from pageable host memory, and pinned memory used in one upsets PyTorch's host allocator).
A table made during a capture is never freed while the optimizer lives, so replays read
valid memory. The first table of a group is uploaded from the host: a capture before any
eager step raises.

Every launch parameter is a device tensor or fixed at construction (lr may be a 0-dim device
tensor, the step counts live on the device, c is computed on the device), so `step` is
capturable in a CUDA graph and never reads a device value on the host. The reductions are
per-block partial sums added in a fixed order: deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import triton
import triton.language as tl

from triton_transformer.utils import (
    TRITON_DTYPES,
    check_triton_tensor,
    interpreter_enabled,
    launcher,
    stream_capturing,
)

__all__ = ["AdamW", "adamw_", "grad_norm"]

# Elements per program and its warps: 8 per thread and stream, two 16-byte vectors of fp32.
# The H200 sweep (`benchmarks/bench_adamw.py --sweep`, 2026-11-26) put this at 92-98% of
# copy bandwidth; 4096 elements on 4 warps spill registers (10x slower).
BLOCK = 1024
NUM_WARPS = 4
CLIP_EPS = 1e-6  # clip_grad_norm_'s: c = max_norm / (norm + 1e-6)

# The tensor table: one row per tensor, these columns (the kernels read them by number).
# _COPY: the address of the parameter's low-precision copy that the update also writes
# (`AdamW.cast_copies`), 0 for none.
_P, _G, _M, _V, _STEP, _NUMEL, _FIRST_BLOCK, _COPY = range(8)
_COLUMNS = tl.constexpr(8)
# the columns of a table's address lists, in the order `TensorTable` takes them
_ADDRESS_COLUMNS = (_P, _G, _M, _V, _STEP, _COPY)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _block_of(TABLE, BLOCK_TENSOR, BLOCK: tl.constexpr):
    """This program's tensor row in TABLE, the offsets of its BLOCK elements and their mask."""
    pid = tl.program_id(0)
    row = TABLE + tl.load(BLOCK_TENSOR + pid).to(tl.int64) * _COLUMNS
    first = tl.load(row + 6)
    offs = (pid - first) * BLOCK + tl.arange(0, BLOCK)
    return row, offs, offs < tl.load(row + 5)


@triton.jit
def _adamw_kernel(
    TABLE, BLOCK_TENSOR, P0, G0, C0, LR, CLIP_NORM,
    lr_value, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay, max_norm, clip_eps,
    LR_ON_DEVICE: tl.constexpr, CLIP: tl.constexpr, COPIES: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One AdamW step for BLOCK elements of one tensor of TABLE (p, g, m, v as P0's and
    G0's dtypes, m and v as p's; step counts fp32, already incremented). CLIP: scale g by
    min(1, max_norm / (CLIP_NORM + clip_eps)), CLIP_NORM a 0-dim fp32 device tensor.
    COPIES: also write the new p, rounded to C0's dtype, to the tensor's copy (if its row
    has one)."""
    row, offs, mask = _block_of(TABLE, BLOCK_TENSOR, BLOCK)
    p_type = tl.pointer_type(P0.dtype.element_ty)
    p_ptr = tl.load(row + 0).to(p_type)
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G0.dtype.element_ty))
    m_ptr = tl.load(row + 2).to(p_type)
    v_ptr = tl.load(row + 3).to(p_type)
    step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32)))
    if LR_ON_DEVICE:  # noqa: SIM108
        lr = tl.load(LR).to(tl.float32)
    else:
        lr = lr_value

    # scalars: bias corrections 1 - β^t = 1 - 2^(t·log2 β), the step size, √(1 - β₂ᵗ)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    step_size = lr / bias1
    decay = 1.0 - lr * weight_decay

    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CLIP:
        g *= tl.minimum(max_norm / (tl.load(CLIP_NORM) + clip_eps), 1.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p * decay - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(m_ptr + offs, m.to(P0.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(P0.dtype.element_ty), mask=mask)
    tl.store(p_ptr + offs, p.to(P0.dtype.element_ty), mask=mask)
    if COPIES:
        # the copy holds the stored p, as a cast of the parameter would (p is rounded to
        # P0's dtype first: a fp32 parameter is exactly the fp32 value here)
        copy_addr = tl.load(row + 7)
        if copy_addr != 0:
            copy_ptr = copy_addr.to(tl.pointer_type(C0.dtype.element_ty))
            p_stored = p.to(P0.dtype.element_ty)
            tl.store(copy_ptr + offs, p_stored.to(C0.dtype.element_ty), mask=mask)


@triton.jit
def _grad_sq_sum_kernel(TABLE, BLOCK_TENSOR, G0, PARTIAL, BLOCK: tl.constexpr):
    """PARTIAL[pid] = Σ g² over this program's BLOCK gradient elements, in fp32."""
    row, offs, mask = _block_of(TABLE, BLOCK_TENSOR, BLOCK)
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G0.dtype.element_ty))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(PARTIAL + tl.program_id(0), tl.sum(g * g, 0))


@triton.jit
def _write_addresses_kernel(ROWS, row0, n, column, ADDRESSES):
    """ROWS[row0 + i, column] = ADDRESSES[i] for i < n (ADDRESSES a tuple of int64): a column
    of addresses written by a kernel, whose arguments a CUDA graph capture records (a capture
    refuses copies from pageable host memory, and pinned memory used in a capture upsets
    PyTorch's host allocator)."""
    dst = ROWS + row0.to(tl.int64) * _COLUMNS + column
    for i in tl.static_range(len(ADDRESSES)):
        tl.store(dst + i * _COLUMNS, ADDRESSES[i], mask=i < n)


# --------------------------------------------------------------------------------------------
# The tensor table
# --------------------------------------------------------------------------------------------


ADDRESSES_PER_LAUNCH = 32  # the length of _write_addresses_kernel's tuple (one kernel)


def _write_addresses(rows: torch.Tensor, column: int, addresses: list[int]) -> None:
    """rows[:, column] = addresses, on rows' device, without a host-to-device copy."""
    for row0 in range(0, len(addresses), ADDRESSES_PER_LAUNCH):
        chunk = addresses[row0 : row0 + ADDRESSES_PER_LAUNCH]
        padded = tuple(chunk + [chunk[-1]] * (ADDRESSES_PER_LAUNCH - len(chunk)))  # all int64
        # Triton's own launch path (launcher() cannot key a tuple argument)
        _write_addresses_kernel[(1,)](rows, row0, len(chunk), column, padded, num_warps=1)


class TensorTable:
    """The device table of one launch's tensors (see the module docstring): the addresses
    of each tensor's parameter, gradient, moments and step count (and low-precision copy),
    its element count and its first block; and the block map. `key` is the tuple of
    addresses it was built from.

    tensors: [params, grads, exp_avgs, exp_avg_sqs, steps] and optionally a sixth list, the
    copies the update writes (None where a parameter has none; one dtype).

    With `like`, a table of the same element counts (a previous table of the same group),
    the new one is `like`'s rows copied on the device with the address columns that changed
    rewritten by `_write_addresses`, and shares its block map: what a CUDA graph capture
    allows. Without it, the table is uploaded from the host, which a capture refuses."""

    def __init__(
        self, tensors: Sequence[Sequence[torch.Tensor]], key: tuple, like: TensorTable | None = None
    ) -> None:
        params = tensors[0]
        check_triton_tensor(params[0], "a parameter")  # on CUDA (or the interpreter)
        device = params[0].device
        self.key, self.block = key, BLOCK
        self.numels = tuple(p.numel() for p in params)
        self.addresses = [[0 if t is None else t.data_ptr() for t in ts] for ts in tensors]
        columns = _ADDRESS_COLUMNS[: len(tensors)]
        if like is not None and (like.numels, like.block, len(like.addresses)) == (
            self.numels, BLOCK, len(self.addresses)
        ):  # fmt: skip
            self.rows = like.rows.clone()
            self.block_tensor, self.n_blocks = like.block_tensor, like.n_blocks
            for column, new, old in zip(columns, self.addresses, like.addresses, strict=True):
                if new != old:
                    _write_addresses(self.rows, column, new)
        else:
            if stream_capturing():
                raise RuntimeError(
                    "AdamW: a CUDA graph capture met parameters no eager step has seen; take "
                    "one eager `AdamW.step` with the same parameters before capturing"
                )
            numels = torch.tensor(self.numels, dtype=torch.int64)
            blocks = (numels + BLOCK - 1) // BLOCK
            rows = torch.zeros(len(params), _COLUMNS.value, dtype=torch.int64)
            for column, addresses in zip(columns, self.addresses, strict=True):
                rows[:, column] = torch.tensor(addresses, dtype=torch.int64)
            rows[:, _NUMEL] = numels
            rows[:, _FIRST_BLOCK] = torch.cumsum(blocks, 0) - blocks
            self.n_blocks = int(blocks.sum())
            self.rows = rows.to(device)
            ids = torch.arange(len(params), dtype=torch.int32)
            self.block_tensor = torch.repeat_interleave(ids, blocks).to(device)
        # the kernels' pointer types come from these (empty: no gradient kept alive)
        self.param0 = torch.empty(0, dtype=params[0].dtype, device=device)
        self.grad0 = torch.empty(0, dtype=tensors[1][0].dtype, device=device)
        copies = [c for c in tensors[5] if c is not None] if len(tensors) > 5 else []
        self.copy0 = torch.empty(0, dtype=copies[0].dtype, device=device) if copies else None


def table_key(tensors: Sequence[Sequence[torch.Tensor]]) -> tuple:
    """What tells a table's tensors apart from one step to the next: the addresses of the
    parameters, of the gradients and of the copies (the moments and step counts are the
    optimizer's own, and move only when a state dict is loaded, which drops the tables)."""
    copies = tuple(0 if c is None else c.data_ptr() for c in tensors[5]) if len(tensors) > 5 else ()
    return (
        tuple(p.data_ptr() for p in tensors[0]) + tuple(g.data_ptr() for g in tensors[1]) + copies
    )


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def launch_adamw(
    table: TensorTable,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    clip: tuple[torch.Tensor, float] | None,
) -> None:
    """One AdamW step of every tensor of `table` (step counts already incremented).
    clip: (global gradient norm, 0-dim fp32 device tensor; max_norm) or None."""
    on_device = isinstance(lr, torch.Tensor)
    norm, max_norm = clip if clip is not None else (table.rows, 0.0)
    copies = table.copy0 is not None
    launcher(_adamw_kernel)[(table.n_blocks,)](
        table.rows, table.block_tensor, table.param0, table.grad0,
        table.copy0 if copies else table.param0, lr if on_device else table.rows, norm,
        0.0 if on_device else float(lr), beta1, beta2, math.log2(beta1) if beta1 else -math.inf,
        math.log2(beta2) if beta2 else -math.inf, eps, weight_decay, float(max_norm), CLIP_EPS,
        LR_ON_DEVICE=on_device, CLIP=clip is not None, COPIES=copies, BLOCK=table.block,
        num_warps=NUM_WARPS,
    )  # fmt: skip


def launch_grad_sq_sum(table: TensorTable, partial: torch.Tensor) -> None:
    """partial (table.n_blocks,) fp32 = the per-block sums of squares of the gradients."""
    launcher(_grad_sq_sum_kernel)[(table.n_blocks,)](
        table.rows,
        table.block_tensor,
        table.grad0,
        partial,
        BLOCK=table.block,
        num_warps=NUM_WARPS,
    )


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _check_lists(params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == n):
        raise ValueError(
            "params, grads, exp_avgs, exp_avg_sqs and steps must have the same length, got "
            f"{n}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}, {len(steps)}"
        )
    rows = zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True)
    for i, (p, g, m, v, s) in enumerate(rows):
        if g.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients")
        if g.shape != p.shape or m.shape != p.shape or v.shape != p.shape:
            raise ValueError(
                f"tensor {i}: grad, exp_avg and exp_avg_sq must be shaped like the parameter "
                f"{tuple(p.shape)}, got {tuple(g.shape)}, {tuple(m.shape)}, {tuple(v.shape)}"
            )
        if s.numel() != 1:
            raise ValueError(f"tensor {i}: a step count must be a 1-element tensor")


def _check_copies(params: Sequence[torch.Tensor], copies: Sequence[torch.Tensor | None]) -> None:
    if len(copies) != len(params):
        raise ValueError(f"copies: one per parameter ({len(params)}), got {len(copies)}")
    dtypes = {c.dtype for c in copies if c is not None}
    if len(dtypes) > 1:
        raise ValueError(f"copies: one dtype for all, got {sorted(map(str, dtypes))}")
    for i, (p, c) in enumerate(zip(params, copies, strict=True)):
        if c is not None and (c.shape != p.shape or c.device != p.device):
            raise ValueError(
                f"copy {i}: must have the parameter's shape {tuple(p.shape)} and device "
                f"{p.device}, got {tuple(c.shape)} on {c.device}"
            )
        if c is not None and not (c.is_floating_point() and c.is_contiguous()):
            raise ValueError(f"copy {i}: must be a contiguous floating tensor, got {c.dtype}")


def _staging(copies: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None] | None:
    """fp32 stand-ins for 16-bit copies under Triton's interpreter, which rounds fp32 to
    16 bits by truncation, not to nearest even as a cast does: the kernel writes these, then
    `_unstage` casts them on the host. None where the kernel can write the copies (the GPU)."""
    if not interpreter_enabled() or all(c is None or c.dtype == torch.float32 for c in copies):
        return None
    return [None if c is None else torch.empty(size=c.shape, device=c.device) for c in copies]


def _unstage(copies: Sequence[torch.Tensor | None], staged: Sequence[torch.Tensor | None]) -> None:
    for c, s in zip(copies, staged, strict=True):
        if c is not None:
            c.copy_(s)


def _triton_ready(p, g, m, v, s) -> bool:
    """Whether the kernel can update this tensor: flat storage of one dtype per role and
    the step count as an fp32 tensor, all on one device."""
    return (
        p.dtype in TRITON_DTYPES
        and g.dtype in TRITON_DTYPES
        and m.dtype == v.dtype == p.dtype
        and s.dtype == torch.float32
        and all(t.is_contiguous() for t in (p, g, m, v))
        and p.device == g.device == m.device == v.device == s.device
    )


def _reference_update(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, scale) -> None:
    """The update of the module docstring for one tensor, in torch ops, in place."""
    g = g.float() if scale is None else g.float() * scale
    m32 = m.float().lerp_(g, 1 - beta1)
    v32 = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step = step.float()
    bias1 = 1 - torch.pow(beta1, step)
    bias2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
    denom = v32.sqrt() / bias2_sqrt + eps
    p32 = p.float() * (1 - lr * weight_decay) - (lr / bias1) * m32 / denom
    m.copy_(m32)
    v.copy_(v32)
    p.copy_(p32)


@torch.no_grad()
def adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    clip: tuple[torch.Tensor, float] | None = None,
    use_triton: bool = False,
    table: TensorTable | None = None,
    copies: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """One AdamW step of every tensor, in place: the update of the module docstring.

    Args:
        params, grads, exp_avgs, exp_avg_sqs: tensors of one shape per index (Triton: fp32,
            fp16 or bf16, contiguous; the moments in the parameter's dtype).
        steps: the step counts (1-element tensors; Triton: fp32 on the parameter's device),
            incremented here before the update.
        lr: a float or a 0-dim device tensor (read on the device: capturable).
        clip: (global gradient norm, 0-dim tensor; max_norm): scale every gradient by
            min(1, max_norm / (norm + 1e-6)) as it is read. None: no scaling.
        use_triton: one kernel launch per (parameter dtype, gradient dtype) instead of the
            torch reference. Tensors the kernel cannot take (non-contiguous ones, a step count
            not fp32) take the reference update.
        table: a prebuilt `TensorTable` of exactly these tensors, copies included
            (`AdamW` caches them); None builds one (an upload per call).
        copies: per parameter None or a tensor of its shape (one floating dtype for all)
            that receives the updated parameter cast to its dtype, as `copy.copy_(p)` after
            the update would (the Triton path writes it in the update's launch).
    """
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, steps)
    if copies is not None:
        _check_copies(params, copies)
    if not params:
        return
    torch._foreach_add_(list(steps), 1)
    scale = None
    if clip is not None:
        norm, max_norm = clip
        scale = torch.clamp(max_norm / (norm.float() + CLIP_EPS), max=1.0)
    copies = list(copies) if copies is not None else [None] * len(params)
    kernel_lists: dict[tuple, list[list[torch.Tensor]]] = {}
    rows = zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies, strict=True)
    for p, g, m, v, s, c in rows:
        if use_triton and _triton_ready(p, g, m, v, s):
            lists = kernel_lists.setdefault((p.dtype, g.dtype, p.device), [[], [], [], [], [], []])
            for column, t in zip(lists, (p, g, m, v, s, c), strict=True):
                column.append(t)
        else:
            _reference_update(p, g, m, v, s, lr, beta1, beta2, eps, weight_decay, scale)
            if c is not None:
                c.copy_(p)
    for lists in kernel_lists.values():
        if all(c is None for c in lists[5]):
            lists = lists[:5]
        use = table if table is not None and len(kernel_lists) == 1 else None
        staged = None
        if use is None or len(use.rows) != len(lists[0]):
            staged = _staging(lists[5]) if len(lists) > 5 else None
            targets = lists if staged is None else [*lists[:5], staged]
            use = TensorTable(targets, table_key(targets))
        launch_adamw(use, lr, beta1, beta2, eps, weight_decay, clip)
        if staged is not None:
            _unstage(lists[5], staged)


@torch.no_grad()
def grad_norm(
    grads: Sequence[torch.Tensor],
    *,
    use_triton: bool = False,
    tables: Sequence[TensorTable] | None = None,
) -> torch.Tensor:
    """‖G‖₂ over every element of every gradient: a 0-dim fp32 tensor on their device
    (torch.nn.utils.clip_grad_norm_'s total norm), never read on the host.

    use_triton: per-block sums of squares (one launch per table), added in a fixed order.
    tables: `TensorTable`s covering exactly `grads` (`AdamW` passes its own); None builds
    them per dtype (Triton-ready gradients: contiguous fp32/fp16/bf16)."""
    if not grads:
        raise ValueError("grad_norm needs at least one gradient")
    if not use_triton:
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        )
    if tables is None:
        by_dtype: dict[tuple, list[torch.Tensor]] = {}
        rest = []
        for g in grads:
            if g.dtype in TRITON_DTYPES and g.is_contiguous():
                by_dtype.setdefault((g.dtype, g.device), []).append(g)
            else:
                rest.append(g)
        tables = [TensorTable([gs, gs], ()) for gs in by_dtype.values()]
    else:
        rest = []
    partial = torch.empty(sum(t.n_blocks for t in tables), dtype=torch.float32,
                          device=grads[0].device)  # fmt: skip
    start = 0
    for t in tables:
        launch_grad_sq_sum(t, partial[start : start + t.n_blocks])
        start += t.n_blocks
    total = partial.sum()
    for g in rest:
        total = total + g.float().square().sum()
    return total.sqrt()


# --------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update as one Triton launch per parameter group (and dtype).

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: learning rate, a float or a 0-dim tensor on the parameters' device (then an LR
            scheduler fills it in place and a CUDA graph replay reads the current value).
        betas, eps, weight_decay: as torch.optim.AdamW's (same defaults).
        use_triton: the Triton kernels (CUDA, or Triton's interpreter on CPU); False runs
            the torch reference (`adamw_`).

    State per parameter: "step" (a 0-dim fp32 tensor on its device), "exp_avg",
    "exp_avg_sq", as torch.optim.AdamW's capturable state: state dicts load both ways.

    `clip_grad_norm(max_norm)` returns the global gradient norm and makes the next `step`
    clip by it (see the module docstring); the `.grad` tensors are not rewritten.

    `cast_copies(params, dtype)` keeps a low-precision copy of each of those parameters that
    every `step` rewrites in the update's own launch (2 bytes more written per element),
    and `current_copies()` hands them to `bmm.reuse_weight_casts`, which then casts none of
    those weights before the next forward (a pass reading 4 and writing 2 bytes per element;
    GPT-2 preset: 163 M parameters, six launches).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        use_triton: bool = False,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("a tensor lr must have one element")
        if not float(lr) >= 0.0:
            raise ValueError(f"Invalid learning rate: {float(lr)}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.use_triton = use_triton
        self._tables: dict[int, TensorTable] = {}  # per group: the last table used
        # per group with one launch: (its params list, its lists without the gradients, the
        # table)
        self._last: dict[int, tuple[list, list[list[torch.Tensor]], TensorTable]] = {}
        self._captured: list[TensorTable] = []  # tables a CUDA graph may replay: kept alive
        self._clip: tuple[torch.Tensor, float] | None = None
        # id(param) -> [param, its copy, what the kernel writes (the copy, or an fp32 stand-in
        # under the interpreter, `_staging`), the param's version when the copy was written]
        self._copies: dict[int, list] = {}

    @torch.no_grad()
    def cast_copies(self, params: Iterable[torch.Tensor], dtype: torch.dtype) -> None:
        """From now on keep each of `params` also as a copy in `dtype`, written from the
        parameter now and rewritten by every `step` that updates it. One dtype per
        optimizer. Skipped: tensors this optimizer does not update (a frozen weight, one
        left out of its groups: the forward keeps casting those), parameters already in
        `dtype`, and parameters already copied."""
        if not dtype.is_floating_point:
            raise ValueError(f"cast_copies: a floating dtype, got {dtype}")
        known = {id(p) for group in self.param_groups for p in group["params"]}
        for p in params:
            if id(p) not in known:
                continue
            current = next(iter(self._copies.values()), None)
            if current is not None and current[1].dtype != dtype:
                raise ValueError(
                    f"cast_copies: this optimizer keeps copies in {current[1].dtype}, not {dtype}"
                )
            if p.dtype == dtype or id(p) in self._copies:
                continue
            copy = p.detach().to(dtype, memory_format=torch.contiguous_format)
            staged = _staging([copy])
            self._copies[id(p)] = [p, copy, copy if staged is None else staged[0], p._version]
        self._tables.clear()  # the tables gain the copies' column
        self._last.clear()

    def current_copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, copy) of every `cast_copies` copy that holds its parameter's value: the
        parameter's version counter has not moved since the copy was written (an in-place
        change of the parameter outside `step` leaves its copy out until the next step)."""
        return [(p, c) for p, c, _, version in self._copies.values() if p._version == version]

    def _group_tensors(self, group: dict) -> list[list[torch.Tensor]]:
        """[params, grads, exp_avgs, exp_avg_sqs, steps] of the group's parameters that have
        a gradient, creating state on first use and moving a saved step count to an fp32
        tensor on the parameter's device (a state dict of torch's non-capturable AdamW
        keeps it on the CPU)."""
        lists: list[list[torch.Tensor]] = [[], [], [], [], []]
        if self._copies:
            lists.append([])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step = state["step"]
            if not isinstance(step, torch.Tensor):
                step = state["step"] = torch.tensor(float(step), device=p.device)
            elif step.device != p.device or step.dtype != torch.float32:
                step = state["step"] = step.to(device=p.device, dtype=torch.float32)
            for column, t in zip(
                lists[:5], (p, p.grad, state["exp_avg"], state["exp_avg_sq"], step), strict=True
            ):
                column.append(t)
            if self._copies:
                entry = self._copies.get(id(p))
                lists[5].append(None if entry is None else entry[2])
        if self._copies and all(c is None for c in lists[5]):
            lists.pop()
        return lists

    def _table(self, index: int, lists: list[list[torch.Tensor]]) -> TensorTable | None:
        """The group's cached table if its addresses still hold, else a new one (kept alive
        while the optimizer lives if made during a CUDA graph capture); None when the
        group's tensors need more than one launch (mixed dtypes, tensors the kernel cannot
        take), which `adamw_` sorts out itself."""
        if not all(_triton_ready(*ts) for ts in zip(*lists[:5], strict=True)):
            return None
        kinds = {(p.dtype, g.dtype, p.device) for p, g in zip(lists[0], lists[1], strict=True)}
        if len(kinds) != 1:
            return None
        key = table_key(lists)
        table = self._tables.get(index)
        if table is None or table.key != key:
            table = self._new_table(index, lists, key, table)
        return table

    def _new_table(
        self, index: int, lists: list[list[torch.Tensor]], key: tuple, like: TensorTable | None
    ) -> TensorTable:
        """A new table for group `index`, cached; kept alive while the optimizer lives when
        a CUDA graph capture made it (its replays read it)."""
        table = self._tables[index] = TensorTable(lists, key, like=like)
        if stream_capturing():
            self._captured.append(table)
        return table

    def _launch_lists(
        self, index: int, group: dict
    ) -> tuple[list[list[torch.Tensor]], TensorTable | None]:
        """(lists, table) for group `index`: `_group_tensors`' lists and `_table`'s table.

        The hot path of an eager loop: when every parameter of the group has a gradient
        and the group's last call made a table (one launch), only the gradients are read
        anew, and the table is reused while the parameters' and gradients' addresses hold:
        a few attribute reads per parameter on the host."""
        last = self._last.get(index)
        params = group["params"]
        if last is not None and last[0] is params and len(last[1][0]) == len(params):
            lists, table = last[1], last[2]
            grads = [p.grad for p in lists[0]]
            grad_dtype = table.grad0.dtype
            if all(g is not None and g.dtype == grad_dtype and g.is_contiguous() for g in grads):
                lists = [lists[0], grads, *lists[2:]]
                key = table_key(lists)
                if key != table.key:
                    table = self._new_table(index, lists, key, table)
                    self._last[index] = (group["params"], last[1], table)
                return lists, table
        lists = self._group_tensors(group)
        table = self._table(index, lists) if self.use_triton and lists[0] else None
        complete = len(lists[0]) == len(group["params"])
        if table is not None and complete:
            # no gradients kept: zero_grad(set_to_none=True) must free them
            self._last[index] = (group["params"], [lists[0], [], *lists[2:]], table)
        else:
            self._last.pop(index, None)
        return lists, table

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of every gradient (a 0-dim fp32 device tensor, not read on
        the host); the next `step` scales the gradients it reads by
        min(1, max_norm / (norm + 1e-6)), as `torch.nn.utils.clip_grad_norm_` would have."""
        max_norm = float(max_norm)
        if not max_norm > 0.0:
            raise ValueError(f"max_norm must be positive, got {max_norm}")
        prepared = [self._launch_lists(i, g) for i, g in enumerate(self.param_groups)]
        grads = [g for lists, _ in prepared for g in lists[1]]
        if not grads:
            raise ValueError("clip_grad_norm: no parameter has a gradient")
        tables = [table for lists, table in prepared if lists[0]]
        if not all(t is not None for t in tables):
            tables = None
        norm = grad_norm(grads, use_triton=self.use_triton, tables=tables)
        self._clip = (norm, max_norm)
        return norm

    @torch.no_grad()
    def step(self, closure=None):  # torch.optim's signature
        """One AdamW step of every parameter that has a gradient (clipped if
        `clip_grad_norm` was called since the last step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            lists, table = self._launch_lists(index, group)
            if not lists[0]:
                continue
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], clip=self._clip)  # fmt: skip
            copies = lists[5] if len(lists) > 5 else None
            if table is None:
                adamw_(*lists[:5], copies=copies, use_triton=self.use_triton, **hyper)
            else:  # checked when the table was made: one launch, no per-tensor checks
                torch._foreach_add_(lists[4], 1)
                launch_adamw(table, **hyper)
            if copies is not None:
                self._copies_written(lists[0])
        self._clip = None
        return loss

    def _copies_written(self, params: list[torch.Tensor]) -> None:
        """After a step updated `params`: cast fp32 stand-ins into their copies (the
        interpreter, `_staging`), and record each copied parameter's version."""
        for p in params:
            entry = self._copies.get(id(p))
            if entry is None:
                continue
            if entry[2] is not entry[1]:
                entry[1].copy_(entry[2])
            entry[3] = p._version

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; also drops a `clip_grad_norm` that no `step` used (the gradients it
        measured are gone)."""
        self._clip = None
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._tables.clear()  # new state tensors: new addresses
        self._last.clear()
