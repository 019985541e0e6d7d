"""What the Gluon kernels for Hopper (`attention_hopper`, `matmul_hopper`) import: Gluon's
modules, the names that differ between Triton 3.6 and 3.7+, and the GPU check.

`HAVE_GLUON` is false on a Triton without Gluon (< 3.5); the Triton kernels run instead.
"""

from __future__ import annotations

import functools

import torch

try:  # Gluon ships with Triton >= 3.5
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language import _core as gl_core
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    # TMA tile copies: `async_load` / `async_store` from Triton 3.7, `async_copy_*` before
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # a barrier of the program's warps: `barrier` from Triton 3.7, `thread_barrier` before
    cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    mma, mma_wait = hopper.warpgroup_mma, hopper.warpgroup_mma_wait

    if hasattr(tma, "async_atomic_add"):  # Triton >= 3.7
        tma_reduce_add = tma.async_atomic_add
    else:  # Triton 3.6 has the operation but no function for it

        @gl_core.builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """Add the shared-memory tile `src` to the tile of `tensor_desc` at `coord` (one
            TMA bulk reduction, in L2; rows and columns outside the tensor are dropped)."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(
                ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
            )

    HAVE_GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - a Triton whose Gluon lacks these
    # (older, or a future rename): the Triton kernels run instead
    HAVE_GLUON = False
    gluon = gl = hopper = mbarrier = tma = None
    tma_load = tma_store = cta_barrier = mma = mma_wait = tma_reduce_add = None

__all__ = [
    "HAVE_GLUON", "cta_barrier", "gl", "gluon", "hopper", "is_sm90", "mbarrier", "mma",
    "mma_wait", "tma", "tma_load", "tma_reduce_add", "tma_store",
]  # fmt: skip


@functools.cache
def is_sm90(device: torch.device) -> bool:
    """Hopper: the kernels' warpgroup products exist on compute capability 9.x only
    (Blackwell has TMA but tensor-memory products instead)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
