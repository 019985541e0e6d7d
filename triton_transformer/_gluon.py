"""What the Gluon kernels for Hopper (`attention_hopper`, `matmul_hopper`) import: Gluon's
modules, the names that differ between Triton 3.6 and 3.7+, the GPU check, and the
package's dropout mask written in Gluon (`keep_tile`).

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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # host-made TMA

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

    @gl_core.builtin
    def reinterpret(smem, dtype, shape, layout, _semantic=None):
        """The shared-memory buffer `smem` seen with another dtype, shape and layout (the same
        bytes): `reinterpret` from Triton 3.7, `_reinterpret` before."""
        view = getattr(smem, "reinterpret", None) or smem._reinterpret
        return view(dtype, shape, layout, _semantic=_semantic)

    HAVE_GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - a Triton whose Gluon lacks these
    # (older, or a future rename): the Triton kernels run instead
    HAVE_GLUON = False
    gluon = gl = hopper = mbarrier = tma = TensorDescriptor = None
    tma_load = tma_store = cta_barrier = mma = mma_wait = tma_reduce_add = reinterpret = None
    philox = keep_tile = None

__all__ = [
    "HAVE_GLUON", "TensorDescriptor", "cta_barrier", "gl", "gluon", "hopper", "is_sm90",
    "keep_tile", "mbarrier", "mma", "mma_wait", "philox", "reinterpret", "tma", "tma_load",
    "tma_reduce_add", "tma_store", "warp_specialized_launch",
]  # fmt: skip


@functools.cache
def is_sm90(device: torch.device) -> bool:
    """Hopper: the kernels' warpgroup products exist on compute capability 9.x only
    (Blackwell has TMA but tensor-memory products instead)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def warp_specialized_launch(consumers: int, per_sm: int, loader_regs: int) -> dict:
    """Launch options of a warp-specialized program of `consumers` consumer warpgroups (4
    warps each, the default partition one of them) and a one-warp loader, `per_sm` programs
    per SM: a register cap per thread that fills the SM's 65,536 registers, which the
    partitions then redistribute (setmaxnreg): the loader's warp takes a warpgroup's share of
    `loader_regs`, each consumer an equal part of the rest, a multiple of 8 (the default
    partition keeps what the workers leave). E.g. two consumers, one program per SM: a cap of
    168, 3 x 168 = 2 x 240 + 24 (loader_regs 24)."""
    slots = consumers + 1  # warpgroups per program
    cap = (65536 // (per_sm * slots * 128)) // 8 * 8
    consumer = (slots * cap - loader_regs) // consumers // 8 * 8
    return {"num_warps": 4, "maxnreg": cap, "CONSUMER_REGS": consumer, "LOADER_REGS": loader_regs}


# ----------------------------------------------------------------------------- dropout masks
# Gluon has no `tl.randint4x`: the package's mask scheme (`_jit_helpers.dropout_keep_tile`)
# written out, for the Gluon kernels that drop (`matmul_hopper`'s relu² epilogue, the
# attention backward).

if HAVE_GLUON:

    @gluon.jit
    def philox(c0, c1, k0, k1):
        """Philox4x32-7 of the counter (c0, c1, 0, 0) under the key (k0, k1), uint32: the
        generator `tl.randint4x(seed, counter, n_rounds=7)` runs (Salmon et al., SC'11)."""
        c2 = gl.zeros_like(c0)
        c3 = gl.zeros_like(c0)
        for _ in gl.static_range(7):
            prev_c0, prev_c2 = c0, c2
            c0 = gl.umulhi(prev_c2, 0xCD9E8D57) ^ c1 ^ k0
            c2 = gl.umulhi(prev_c0, 0xD2511F53) ^ c3 ^ k1
            c1 = prev_c2 * 0xCD9E8D57
            c3 = prev_c0 * 0xD2511F53
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        return c0, c1, c2, c3

    @gluon.jit
    def _keeps(word, threshold):
        """Whether the low and the high 16-bit uniform of each Philox word keep their element."""
        lo = (word & 0xFFFF).to(gl.int32) >= threshold
        hi = ((word >> 16) & 0xFFFF).to(gl.int32) >= threshold
        return lo, hi

    @gluon.jit
    def keep_tile(
        seed, off_m, off_n, N, threshold, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        WARPS: gl.constexpr,
    ):  # fmt: skip
        """The dropout keep mask (bool) of the (BLOCK_M, BLOCK_N) tile at (off_m, off_n) of an
        (M, N) matrix under the int64 `seed` value, `_jit_helpers.dropout_keep_tile`'s: one
        Philox call per row and group of 8 columns (counter row · ⌈N / 8⌉ + column // 8,
        int64), column 8g + j kept when half j % 2 of word j // 2, a 16-bit uniform, is >=
        threshold. Each of the caller's WARPS warps draws whole groups, so the result holds 8
        consecutive columns per thread (BLOCK_N // 8 <= 32)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // (BLOCK_N // 8), BLOCK_N // 8],
                                                [WARPS, 1], [1, 0])  # fmt: skip
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        groups = off_n // 8 + gl.arange(0, BLOCK_N // 8, layout=gl.SliceLayout(0, layout))
        counter = rows.to(gl.int64)[:, None] * ((N + 7) // 8) + groups[None, :]
        k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
        w0, w1, w2, w3 = philox(counter.to(gl.uint32), (counter >> 32).to(gl.uint32), k0, k1)
        lo0, hi0 = _keeps(w0, threshold)
        lo1, hi1 = _keeps(w1, threshold)
        lo2, hi2 = _keeps(w2, threshold)
        lo3, hi3 = _keeps(w3, threshold)
        # column 8g + 4·b2 + 2·b1 + b0 takes half b0 of word 2·b2 + b1: each join appends the
        # next bit of j as the new fastest dimension, b2 first
        lo = gl.join(gl.join(lo0, lo2), gl.join(lo1, lo3))
        hi = gl.join(gl.join(hi0, hi2), gl.join(hi1, hi3))
        return gl.reshape(gl.join(lo, hi), [BLOCK_M, BLOCK_N])
