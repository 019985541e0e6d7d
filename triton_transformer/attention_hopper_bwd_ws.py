"""The attention backward for Hopper GPUs at head dims 64 and 128, written in Gluon and
warp-specialized, as FlashAttention-3's (Shah et al., 2024).

The math is `attention_hopper`'s single pass, for one block of BLOCK_N = 64·CONSUMERS keys
K_j, V_j over the query blocks i of 64 rows that see it (scores in log2 units, lse_i the
forward's log-sum-exp in log2 units, Δ_i = Σ_d dO_i · O_i):

    Sᵀ  = K_j Q_iᵀ · scale·log2(e)        (keys, queries)
    Pᵀ  = exp2(Sᵀ - lse_i)                 (causal: 0 where key > query + n_k - n_q)
    dPᵀ = V_j dO_iᵀ
    dSᵀ = Pᵀ ∘ (dPᵀ - Δ_i)
    dV_j += Pᵀ dO_i,   dK_j += dSᵀ Q_i     (registers, summed over i)
    dQ_i += dS_i K_j                       (fp32, added to a (b·h, n_q, d) sum in L2)

Why a second Gluon backward: at d128 `attention_hopper`'s kernel fits the registers only with
32-query steps over 64 keys, one warpgroup per program (wgmma products 32 columns wide, each
program streaming every q and dO row it sees, and a dQ reduction per 64 keys); it reached 0.75x
cuDNN's speed. Here the work is split between warps (`gl.warp_specialize`):

- a loader warp brings the program's K and V once, then each step's q, dO, log-sum-exp and Δ
  by TMA into a ring of STAGES buffers;
- CONSUMERS warpgroups, each owning 64 of the program's keys (its rows of Sᵀ, dPᵀ, dK and
  dV), walk the same query blocks. Per step a consumer issues Sᵀ's and dPᵀ's products, waits
  for Sᵀ only and computes Pᵀ while dPᵀ runs; issues dV's product with Pᵀ from registers,
  then computes dSᵀ while it runs; writes dSᵀ to shared memory and issues dK's product. dQ's
  product needs every consumer's rows of dSᵀ (its reduction runs over the program's keys):
  once all have arrived on the step's `ds_ready` barrier, each consumer computes dQ for its
  half of the head's columns and adds it to the fp32 sum by one TMA bulk reduction.

Against `attention_hopper`'s kernel the step is 64 queries wide (every product 64 columns), q
and dO are read once per 128 keys rather than per 64 and dQ is reduced once per 128 keys,
and one consumer's exponentials run while the other's products do.

dK is scaled by `scale` at the end, dQ by `attention._attention_bwd_dq_kernel`. dK and dV
leave by TMA stores through two buffers their consumer alone still holds (its V and its dQ
tile): with pointer stores, as first written, the one-program-per-SM kernel spent its end
writing 4-byte pieces, and took 460.6 against 406.2 µs at (32, 512, 16) causal (H200,
2026-11-28, `attention_bwd_ws_session26_pointer_stores.md`); they remain for gradients TMA
cannot store.

Measured (H200, 2026-11-28, `attention_bwd_ws_session26.md`): at d128 within 3% of cuDNN's
time (0.98-1.03x) from 512 to 8192 queries, causal or not, and 1.24-1.51x faster than
`attention_hopper`'s kernel; at d64 2-8% faster than that kernel, except causal heads of 2048
queries or more, where it is 2-3% slower (`usable`).

Scope: Hopper (sm_90), fp16 / bf16, head dims 64 and 128, causal (bottom-right aligned) or not,
multi-head (not grouped) attention, no key padding mask, no dropout, tensors TMA can describe.
`attention.launch_attention_bwd` takes it where `usable` says so, the caller allows the
non-deterministic single pass and the launch is eager; everything else runs the other kernels.
torch.compile cannot trace a Gluon kernel: compiled code reaches it through `attention`'s
opaque backward op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from triton_transformer import _gluon
from triton_transformer._gluon import (
    HAVE_GLUON,
    TensorDescriptor,
    gl,
    gluon,
    hopper,
    is_sm90,
    mbarrier,
    tma,
)
from triton_transformer._jit_helpers import longest_first
from triton_transformer.attention_hopper import (
    _aligned_rows,
    _layouts,
    _load_head_rows,
    _load_step,
    _store_head_rows,
)
from triton_transformer.utils import launcher

__all__ = ["HAVE_GLUON", "bwd_tiles", "launch_bwd_ws_sm90", "usable"]

# head dims the kernel takes (rows of 128 and 256 bytes in 16-bit types)
HEAD_DIMS = (64, 128)
# keys per consumer warpgroup and queries per step (a warpgroup product's M and N)
ROWS = gl.constexpr(64) if HAVE_GLUON else 64
# registers per thread of the loader's warpgroup (`_launch`)
LOADER_REGS = 24


if HAVE_GLUON:

    @gluon.jit
    def _bwd_loader(args, meta: gl.constexpr):
        """The loader partition (one warp): the program's K and V (one 64-row block per
        consumer), then each step's q, dO, log-sum-exp and Δ into the ring, each once every
        consumer has handed its buffer back."""
        (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, _dq_desc, q_smem, do_smem,
         k_smem, v_smem, lse_smem, delta_smem, _ds_smem, _dq_smem, kv_bar, ready, empty,
         _ds_ready, b, h, bh, n0, lo, _full_lo, n_steps, _n_q, _n_k, _scales, _dk,
         _dv) = args  # fmt: skip
        STAGES: gl.constexpr = meta[0]
        CONSUMERS: gl.constexpr = k_smem.shape[0]
        nbytes: gl.constexpr = ROWS * k_smem.shape[2] * k_desc.dtype.primitive_bitwidth // 8
        mbarrier.expect(kv_bar, 2 * CONSUMERS * nbytes)
        for c in gl.static_range(CONSUMERS):
            _load_head_rows(k_desc, b, h, n0 + c * ROWS, kv_bar, k_smem.index(c))
            _load_head_rows(v_desc, b, h, n0 + c * ROWS, kv_bar, v_smem.index(c))
        for step in range(n_steps):
            stage = step % STAGES
            # a fresh barrier counts as having completed the phase before 0
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
            _load_step(
                q_desc, do_desc, lse_desc, delta_desc, b, h, bh, lo + step * ROWS,
                ready.index(stage), q_smem.index(stage), do_smem.index(stage),
                lse_smem.index(stage), delta_smem.index(stage), True,
            )  # fmt: skip

    @gluon.jit
    def _bwd_consume(args, meta: gl.constexpr, which: gl.constexpr):
        """Consumer `which` (one warpgroup): dK and dV of keys n0 + 64·which ... + 63 over
        every step, and its HEAD_DIM / CONSUMERS columns of each step's dQ (module
        docstring)."""
        (_q_desc, _k_desc, _v_desc, _do_desc, _lse_desc, _delta_desc, dq_desc, q_smem, do_smem,
         k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready, empty,
         ds_ready, b, h, bh, n0, lo, full_lo, n_steps, N_Q, N_K, scales, dk_dst,
         dv_dst) = args  # fmt: skip
        qk_scale, sm_scale = scales
        STAGES: gl.constexpr = meta[0]
        CAUSAL: gl.constexpr = meta[1]
        STORE_TMA: gl.constexpr = meta[2]
        CONSUMERS: gl.constexpr = k_smem.shape[0]
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        DQ_COLS: gl.constexpr = HEAD_DIM // CONSUMERS
        # (the epilogue stages dK in this consumer's dQ tile: the same bytes at two consumers)
        gl.static_assert(CONSUMERS == 2, "two consumer warpgroups")
        dtype: gl.constexpr = k_smem.dtype
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
        )
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16]
        )
        # Pᵀ and dSᵀ feed dV's and dK's products from registers, in the accumulators' rows
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
        k_w = k_smem.index(which)
        v_w = v_smem.index(which)
        causal_off = N_K - N_Q  # query i sees keys j <= i + causal_off
        offs_n = n0 + which * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
        cols_m = gl.arange(0, ROWS, layout=col_layout)
        st_zero = gl.zeros([ROWS, ROWS], gl.float32, st_layout)
        dq_zero = gl.zeros([ROWS, DQ_COLS], gl.float32, dq_layout)
        dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, kv_layout)
        dq_w = dq_smem.index(which)

        mbarrier.wait(kv_bar, 0)
        for step in range(n_steps):
            stage = step % STAGES
            start_m = lo + step * ROWS
            offs_m = start_m + cols_m
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            q_s = q_smem.index(stage)
            do_s = do_smem.index(stage)
            st = _gluon.mma(k_w, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dpt = _gluon.mma(v_w, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            # entries past n_q read as zeros: +inf makes their P 0
            lse = gl.where(offs_m < N_Q, lse_smem.index(stage).load(col_layout), float("inf"))
            st = _gluon.mma_wait(num_outstanding=1, deps=[st])
            pt = gl.exp2(st * qk_scale - lse[None, :])
            if CAUSAL:  # noqa: SIM102
                if start_m < full_lo:  # the diagonal's blocks
                    pt = gl.where(offs_n[:, None] <= offs_m[None, :] + causal_off, pt, 0.0)
            pt_a = gl.convert_layout(pt.to(dtype), a_layout)
            dv = _gluon.mma(pt_a, do_s, dv, is_async=True)
            delta = delta_smem.index(stage).load(col_layout)
            dpt = _gluon.mma_wait(num_outstanding=1, deps=[dpt])  # dV's product still runs
            dst = (pt * (dpt - delta[None, :])).to(dtype)
            ds_base = (step % 2) * CONSUMERS  # this step's buffers
            ds_smem.index(ds_base + which).store(dst)
            hopper.fence_async_shared()
            # one arrival per warpgroup (Triton syncs its four warps first: all rows stored)
            mbarrier.arrive(ds_ready.index(step % 2))
            dst_a = gl.convert_layout(dst, a_layout)
            dk = _gluon.mma(dst_a, q_s, dk, is_async=True)
            # dQ_i[:, cols] = Σ_c dS_i[:, keys of c] K_j[keys of c, cols], once every
            # consumer's rows of dSᵀ are in shared memory
            mbarrier.wait(ds_ready.index(step % 2), (step // 2) & 1)
            dq = dq_zero
            for c in gl.static_range(CONSUMERS):
                k_cols = k_smem.index(c).slice(which * DQ_COLS, DQ_COLS, dim=1)
                dq = _gluon.mma(
                    ds_smem.index(ds_base + c).permute((1, 0)),
                    k_cols,
                    dq,
                    use_acc=c > 0,
                    is_async=True,
                )
            # (register operands stay live until their products are done)
            dq, dv, dk, pt_a, dst_a = _gluon.mma_wait(
                num_outstanding=0, deps=[dq, dv, dk, pt_a, dst_a]
            )
            mbarrier.arrive(empty.index(stage))  # this stage's q, dO, lse and Δ are read
            # the previous step's reduction has read dq_w (its issuing thread waits, then
            # the warpgroup's barrier tells the others)
            tma.store_wait(0)
            _gluon.cta_barrier()
            dq_w.store(dq)
            hopper.fence_async_shared()
            _gluon.cta_barrier()  # the warpgroup's rows all written before the one reduction
            block = _gluon.reinterpret(dq_w, gl.float32, dq_desc.block_shape, dq_desc.layout)
            _gluon.tma_reduce_add(dq_desc, [bh, start_m, which * DQ_COLS], block)
        tma.store_wait(0)

        dk = dk * sm_scale
        row0 = n0 + which * ROWS
        if STORE_TMA:  # through shared memory, by TMA (rows past n_k clipped)
            # the buffers this consumer alone still holds: its V (read by its own dPᵀ
            # products, done) and its dQ tile, whose last reduction has read it: the same
            # bytes as a (64, HEAD_DIM) 16-bit tile
            _gluon.cta_barrier()
            v_w.store(dv.to(dtype))
            dk_w = _gluon.reinterpret(dq_w, dtype, [ROWS, HEAD_DIM], v_w.layout)
            dk_w.store(dk.to(dtype))
            hopper.fence_async_shared()
            _gluon.cta_barrier()
            _store_head_rows(dv_dst[5], b, h, row0, v_w)
            _store_head_rows(dk_dst[5], b, h, row0, dk_w)
            tma.store_wait(0)
        else:
            rows_n = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, kv_layout))
            cols_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
            _store_rows(dk_dst, dk, b, h, rows_n, cols_d, N_K)
            _store_rows(dv_dst, dv, b, h, rows_n, cols_d, N_K)

    @gluon.jit
    def _store_rows(dst, tile, b, h, rows_n, cols_d, N_K):
        """Store the (keys, d) tile to rows rows_n < N_K of head (b, h) of dst = (base
        pointer, element offset, batch, head and row strides, descriptor)."""
        ptr, off, sb, sh, sn = dst[0], dst[1], dst[2], dst[3], dst[4]
        ptrs = (ptr + off + b.to(gl.int64) * sb + h.to(gl.int64) * sh
                + rows_n.to(gl.int64)[:, None] * sn + cols_d[None, :])  # fmt: skip
        gl.store(ptrs, tile.to(ptr.dtype.element_ty), mask=rows_n[:, None] < N_K)

    @gluon.jit
    def _bwd_consumer_1(args, meta: gl.constexpr):
        """The second consumer, as a worker partition (workers share one signature, the
        loader's: `which` cannot be passed)."""
        _bwd_consume(args, meta, 1)

    @gluon.jit(do_not_specialize=["BH", "H", "N_Q", "N_K"])
    def _attention_bwd_ws_sm90_kernel(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, dk_desc, dv_desc, DK,
        DV, off_dk, off_dv, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
        BH, H, N_Q, N_K, qk_scale, sm_scale,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
        CAUSAL: gl.constexpr, STORE_TMA: gl.constexpr, LPT_BYTES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: dK, dV of BLOCK_N = 64·CONSUMERS keys of one batch·head (grid (key
        blocks, b·h); causal: longest first), and their share of dQ added to dq_desc's tensor
        (fp32, (b·h, n_q, HEAD_DIM), zeroed before). q, k, v and dO come as host-made
        (b, h, n, HEAD_DIM) TMA descriptors, the log-sum-exp and Δ as (b·h, n_q) ones
        (`_descriptors`); rows past n read as zeros. STORE_TMA: dK and dV leave by TMA
        through the (b, h, n_k, HEAD_DIM) descriptors dk_desc, dv_desc; else through pointers:
        DK, DV the gradients' base pointers, their views at element offsets off_dk, off_dv
        with the strides given.
        CONSUMER_REGS, LOADER_REGS: the partitions' registers per thread (`_launch`)."""
        qk_scale = qk_scale.to(gl.float32)
        sm_scale = sm_scale.to(gl.float32)
        dtype: gl.constexpr = q_desc.dtype
        BLOCK_N: gl.constexpr = CONSUMERS * ROWS
        pid = gl.program_id(0)
        bh = gl.program_id(1)
        if CAUSAL:  # each program streams its head's q and dO
            pid, bh = longest_first(pid, bh, BH, N_Q.to(gl.int64) * HEAD_DIM * 4, LPT_BYTES)
        b = bh // H
        h = bh % H
        n0 = pid * BLOCK_N

        # the query blocks that see this key block: causal, rows i >= n0 - (n_k - n_q)
        causal_off = N_K - N_Q
        lo = 0
        if CAUSAL:
            lo = (gl.maximum(n0 - causal_off, 0) // ROWS) * ROWS
        # rows from here on see every key of the block: no mask
        full_lo = gl.maximum(n0 + BLOCK_N - 1 - causal_off, 0)
        n_steps = gl.cdiv(N_Q - lo, ROWS)

        row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [ROWS, HEAD_DIM // CONSUMERS], gl.float32
        )
        vec_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=0, element_bitwidth=32, rank=1
        )
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, ROWS, HEAD_DIM], row_layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, ROWS, HEAD_DIM], row_layout)
        k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], row_layout)
        v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], row_layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], vec_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], vec_layout)
        # dSᵀ by step parity (a consumer may start the next step while another's dQ product
        # still reads this one's), then consumer; each consumer's dQ tile
        ds_smem = gl.allocate_shared_memory(dtype, [2 * CONSUMERS, ROWS, ROWS], ds_layout)
        dq_smem = gl.allocate_shared_memory(
            gl.float32, [CONSUMERS, ROWS, HEAD_DIM // CONSUMERS], dq_layout
        )
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival per consumer
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=CONSUMERS)
        args = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, q_smem, do_smem,
                k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready, empty,
                ds_ready, b, h, bh, n0, lo, full_lo, n_steps, N_Q, N_K, (qk_scale, sm_scale),
                (DK, off_dk, sdkb, sdkh, sdkn, dk_desc),
                (DV, off_dv, sdvb, sdvh, sdvn, dv_desc))  # fmt: skip
        meta: gl.constexpr = (STAGES, CAUSAL, STORE_TMA)  # the partitions' compile-time ones
        # consumer 0 is the default partition (num_warps = 4), and keeps the registers the
        # workers leave of the launch's cap (`_launch`)
        gl.warp_specialize(
            [
                (_bwd_consume, (args, meta, 0)),
                (_bwd_consumer_1, (args, meta)),
                (_bwd_loader, (args, meta)),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )


@functools.cache
def bwd_tiles(causal: bool) -> dict:
    """The program's shape: CONSUMERS warpgroups of 64 keys each (BLOCK_N = 128 keys; the
    kernel takes two), 64 queries per step, a ring of STAGES steps of q, dO, log-sum-exp and
    Δ. Shared memory at d128: 198 KiB with two stages, 226 with three (of the H200's 227).
    Three stages measured 5-11% slower at d128, causal or not, from 512 to 8192 queries (H200,
    2026-11-28, `attention_bwd_ws_session26_stages.md`; e.g. (4, 4096, 16) causal 1535.8
    against 1435.1 µs): two it is."""
    return {"STAGES": 2, "CONSUMERS": 2}


def _launch(consumers: int) -> dict:
    """Launch options of a program of `consumers` warpgroups and the loader, one program per
    SM (`_gluon.warp_specialized_launch`, the loader at `LOADER_REGS`). Two consumers: a cap of
    168, 3 x 168 = 2 x 240 + 24."""
    return _gluon.warp_specialized_launch(consumers, 1, LOADER_REGS)


# Where eager backwards take this kernel: `ENABLED` (benchmarks turn it off to compare), heads
# of at least `MIN_QUERIES` queries, and at d64 with a causal mask fewer than
# `MAX_QUERIES_D64_CAUSAL`. Measured against `attention_hopper`'s kernel (H200, 2026-11-28,
# `attention_bwd_ws_session26.md`, µs per backward, bf16, packed qkv, (b, n, h); causal /
# not; cuDNN in brackets): d128 (32, 512, 16) 406.2 / 486.5 against 504.3 / 669.3 (395.6 /
# 496.0), (16, 1024, 16) 540.8 / 751.5 against 687.0 / 1078.7, (8, 2048, 16) 827.7 / 1286.2
# against 1072.1 / 1909.8, (4, 4096, 16) 1403.7 / 2373.8 against 1844.3 / 3534.7, (2, 8192,
# 16) 2550.5 / 4654.1 against 3394.0 / 7030.6 (2562.6 / 4632.9); d64 (16, 512, 8) 68.0 / 83.3
# against 69.4 / 89.7, (16, 1024, 12) 269.1 / 384.4 against 274.5 / 400.9, (8, 2048, 16)
# 546.4 / 879.3 against 537.6 / 916.8, (4, 4096, 16) 942.1 / 1634.9 against 916.6 / 1713.6.
ENABLED = True
MIN_QUERIES = 512
MAX_QUERIES_D64_CAUSAL = 2048


def _taken(head_dim: int, n_q: int, causal: bool) -> bool:
    """The head dims and query counts above."""
    if head_dim == 64 and causal and n_q >= MAX_QUERIES_D64_CAUSAL:
        return False
    return head_dim in HEAD_DIMS and n_q >= MIN_QUERIES


def usable(q: torch.Tensor, k: torch.Tensor, causal: bool, plain: bool) -> bool:
    """Whether the kernel takes this backward of (b, h, n, d) views q and k: Gluon present,
    `ENABLED`, a Hopper GPU, the head dims and query counts above, a 16-bit dtype, multi-head
    attention (k as many heads as q), at most 65535 batch·heads (grid dim 1), and `plain`: no
    key padding mask and no dropout. The caller has checked the rest: an eager launch,
    TMA-describable tensors and the non-deterministic single pass."""
    b, h, n_q, d = q.shape
    return (
        HAVE_GLUON
        and ENABLED
        and plain
        and _taken(d, n_q, causal)
        and is_sm90(q.device)
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.shape[1] == h
        and b * h <= 65535
    )


def _descriptors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, dq_acc: torch.Tensor, dk: torch.Tensor | None,
    dv: torch.Tensor | None, consumers: int,
) -> tuple:  # fmt: skip
    """The kernel's TMA descriptors, made on the host: q, k, v, dO and (when given, else q's
    stands in) dK, dV by blocks of one head's 64 rows, the log-sum-exp and Δ by 64 entries of
    a row, the dQ sum by 64 rows of one consumer's columns."""
    d = q.shape[3]
    # 64-row blocks of a head and 64 entries of a row, as `attention_hopper`'s; the dQ sum by
    # 64 rows of one consumer's columns (each swizzled as the kernel's buffer, the same bytes)
    rows, _, _, vec = _layouts(d, int(ROWS), int(ROWS))
    acc = gl.NVMMASharedLayout.get_default_for([1, int(ROWS), d // consumers], gl.float32)

    def heads(t: torch.Tensor) -> TensorDescriptor:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, int(ROWS), d], rows)

    def per_head(t: torch.Tensor) -> TensorDescriptor:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, int(ROWS)], vec)

    dq_block = [1, int(ROWS), d // consumers]
    q_desc = heads(q)
    return (
        q_desc, heads(k), heads(v), heads(dout), per_head(lse), per_head(delta),
        TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), dq_block, acc),
        q_desc if dk is None else heads(dk), q_desc if dv is None else heads(dv),
    )  # fmt: skip


def _storable(t: torch.Tensor) -> bool:
    """Whether TMA can store rows of the (b, h, n, d) view t: unit stride along d, 16-byte
    aligned start and strides."""
    size = t.element_size()
    return (
        t.stride(3) == 1
        and t.data_ptr() % 16 == 0
        and all(s * size % 16 == 0 for s in t.stride()[:3])
    )


def launch_bwd_ws_sm90(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
    dk: torch.Tensor, dv: torch.Tensor, grads_base: torch.Tensor | None,
    grad_offsets: tuple[int, int], lse: torch.Tensor, delta: torch.Tensor, dq_acc: torch.Tensor,
    causal: bool, qk_scale: float, sm_scale: float, lpt_bytes: int, tiles: dict | None = None,
) -> Callable[..., None]:  # fmt: skip
    """Launch the kernel for (b, h, n, d) views q, k, v, dout (d of `HEAD_DIMS`, unit stride
    along d, TMA-describable): fills the (b, h, n_k, d) views dk, dv (any strides; views of
    `grads_base` when given, at element offsets `grad_offsets`, as
    `attention_hopper.launch_bwd_sm90` takes them) and adds the unscaled dQ into dq_acc (fp32,
    (b·h, n_q, d), contiguous, zeroed). lse, delta: (b·h, n_q) fp32, the forward's
    log-sum-exp in log2 units and Σ dO·O.
    tiles: `bwd_tiles` unless given (benchmarks).

    Returns the launch bound for tensors of the same layouts and facts: again(q, k, v, dout,
    dk, dv, grads_base, lse, delta, dq_acc, seed) (seed unused: `attention_hopper`'s
    signature), as `utils.KernelLauncher.bind` (each descriptor encoded once per address)."""
    dk_base, dv_base = (dk, dv) if grads_base is None else (grads_base, grads_base)
    off_dk, off_dv = grad_offsets
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    tiles = tiles or bwd_tiles(causal)
    consumers = tiles["CONSUMERS"]
    # dK and dV by TMA where it can store them (the model's d(qkv) views, fresh tensors)
    store_tma = _storable(dk) and _storable(dv)
    descs = _descriptors(
        q, k, v, dout, _aligned_rows(lse), _aligned_rows(delta), dq_acc,
        dk if store_tma else None, dv if store_tma else None, consumers,
    )  # fmt: skip
    grid = (-(-n_k // (consumers * int(ROWS))), b * h, 1)
    bound = launcher(_attention_bwd_ws_sm90_kernel).bind(
        grid, *descs, dk_base, dv_base, off_dk, off_dv,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        b * h, h, n_q, n_k, qk_scale, sm_scale, HEAD_DIM=d, CAUSAL=causal,
        STORE_TMA=store_tma, LPT_BYTES=lpt_bytes, **tiles, **_launch(consumers),
    )  # fmt: skip

    def again(q, k, v, dout, dk, dv, grads_base, lse, delta, dq_acc, seed) -> None:
        stored = (dk, dv) if store_tma else (q, q)
        written = (dk, dv) if grads_base is None else (grads_base, grads_base)
        bound(q, k, v, dout, _aligned_rows(lse), _aligned_rows(delta), dq_acc, *stored, *written)

    return again
