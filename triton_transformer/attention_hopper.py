"""The attention backward's single pass for Hopper GPUs, written in Gluon.

Why a second kernel: Triton (3.6) waits for each tile product right after issuing it, so in
`attention._attention_bwd_kernel` the tensor cores sit idle while the exponentials of P run,
and the reverse. Gluon states the schedule explicitly: the products are issued asynchronously
(`warpgroup_mma(..., is_async=True)`) and waited for only where their result is read, and the
next query block's q and dO arrive by TMA while this one computes.

The math is `attention`'s single pass, for one key block K_j, V_j (BLOCK_N keys) over the
query blocks i that see it (scores in log2 units, lse_i the forward's log-sum-exp in log2
units, Δ_i = Σ_d dO_i · O_i):

    Sᵀ  = K_j Q_iᵀ · scale·log2(e)        (BLOCK_N, BLOCK_M)
    Pᵀ  = exp2(Sᵀ - lse_i)                 (causal: 0 where key > query + n_k - n_q)
    dPᵀ = V_j dO_iᵀ
    dSᵀ = Pᵀ ∘ (dPᵀ - Δ_i)
    dV_j += Pᵀ dO_i,   dK_j += dSᵀ Q_i     (registers, summed over i)
    dQ_i += dS_i K_j                       (fp32, added to a (b·h, n_q, d) sum in L2;
                                            at d >= 64 computed as dQ_iᵀ = K_jᵀ dS_iᵀ)

With dropout (keep mask M, rate p) the forward multiplied P by M / (1 - p) before V, so dV
reads that product and dP passes back through it: dV_j += (Pᵀ ∘ Mᵀ / (1 - p)) dO_i and
dPᵀ = (V_j dO_iᵀ) ∘ Mᵀ / (1 - p), while dSᵀ keeps the undropped Pᵀ (Δ_i = Σ dO_i · O_i
already holds the dropped output). M is the package's mask of the (n_q, n_k) scores
(`_gluon.keep_tile`, drawn by rows of queries, transposed into Sᵀ's layout through shared
memory), regenerated from the forward's seed while Sᵀ and dPᵀ run.

dK is scaled by `scale` at the end, dQ by `attention._attention_bwd_dq_kernel`. Per query
block the schedule is: Sᵀ and dPᵀ issued together; exp2 while dPᵀ runs; dSᵀ written to shared
memory (dQ's product reads it from there); dQ, dV and dK issued together; dQ's tile
written to shared memory while dV and dK run, and added to the fp32 sum by one TMA bulk
reduction at the start of the next step (per-element atomics made the kernel 30% slower). The
next step's q and dO, with their log-sum-exp and Δ, arrive by TMA during this one.

The TMA descriptors are made on the host (`_descriptors`) and passed as launch parameters:
q, k, v and dO as 4-D (b, h, n, d) descriptors, so a head's rows past n read as zeros. Made
in the kernel, as first written, they cost every program five descriptor writes to global
memory, each behind a fence and a barrier: 11% of the warp stalls ncu sampled at GPT-2's
shape, and the log-sum-exp's loads through pointers another 8% (H100, 2026-11-28). Both
moved, the backward is 1.11x faster there (`attention_tma_desc_session23.md`).

Not done yet: keeping the tensor cores busy between steps (ncu: the tensor pipe is active a
quarter of the time at GPT-2's shape, cuDNN's a third). Issuing the next block's Sᵀ and
dPᵀ before this block's dQ tile is stored made ptxas (12.8, 12.9) serialize the products
(warning C7514: accumulators carried across the loop's back edge; 15% slower); waiting for
the next Sᵀ within the step avoids the warning but needs more registers (spills; 5-10%
slower). What paid instead: K and V feed Sᵀ's and dPᵀ's products from registers, which
halves those products' shared-memory reads, with 64-query steps at d64 (at GPT-2's shape the
backward then matches cuDNN's on an H200). Producer / consumer warpgroups, as cuDNN and
FlashAttention-3 have, came next, as a kernel of their own: `attention_hopper_bwd_ws`, which
takes the plain (no dropout) d128 heads and most d64 ones.

Scope: Hopper (sm_90), fp16 / bf16, head dims 32, 64 and 128 (row lengths TMA and the
products take without padding), with or without dropout, no key padding mask, multi-head
(not grouped) attention, tensors TMA can describe. `attention.launch_attention_bwd` takes it
where all of that holds, `attention_hopper_bwd_ws` does not take the backward, the caller
allows the non-deterministic single pass and `usable` says it measured faster; everything
else runs the Triton kernel. torch.compile cannot trace a Gluon kernel: compiled code reaches
it through `attention`'s opaque backward op.
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
from triton_transformer.utils import dropout_threshold, launcher

__all__ = ["HAVE_GLUON", "bwd_tiles", "launch_bwd_sm90"]

# head dims this kernel takes (rows of 64, 128 and 256 bytes in 16-bit types); eager launches
# take it at those of `TAKEN_HEAD_DIMS` only
HEAD_DIMS = (32, 64, 128)


if HAVE_GLUON:

    @gluon.jit
    def _load_head_rows(desc, b, h, row, bar, dst):
        """TMA copy of rows [row, row + block rows) of head (b, h) of a (b, h, n, d) descriptor
        into the 2-D buffer dst (the same bytes as the descriptor's 4-D block)."""
        block = _gluon.reinterpret(dst, desc.dtype, desc.block_shape, desc.layout)
        _gluon.tma_load(desc, [b, h, row, 0], bar, block)

    @gluon.jit
    def _store_head_rows(desc, b, h, row, src):
        """TMA store of the 2-D buffer src into rows [row, row + block rows) of head (b, h)
        of a (b, h, n, d) descriptor (rows past n are clipped)."""
        block = _gluon.reinterpret(src, desc.dtype, desc.block_shape, desc.layout)
        _gluon.tma_store(desc, [b, h, row, 0], block)

    @gluon.jit
    def _load_step(
        q_desc, do_desc, lse_desc, delta_desc, b, h, bh, row, bar,
        q_dst, do_dst, lse_dst, delta_dst, LSE_TMA: gl.constexpr,
    ):  # fmt: skip
        """One step's q and dO rows [row, row + BLOCK_M) of head (b, h), and (LSE_TMA) their
        log-sum-exp and Δ (row bh of the (b·h, n_q) tensors), all arriving on `bar`."""
        block_m: gl.constexpr = q_desc.block_shape[2]
        head_dim: gl.constexpr = q_desc.block_shape[3]
        nbytes: gl.constexpr = 2 * block_m * head_dim * q_desc.dtype.primitive_bitwidth // 8
        if LSE_TMA:
            mbarrier.expect(bar, nbytes + 2 * block_m * 4)
        else:
            mbarrier.expect(bar, nbytes)
        _load_head_rows(q_desc, b, h, row, bar, q_dst)
        _load_head_rows(do_desc, b, h, row, bar, do_dst)
        if LSE_TMA:
            lse_block = _gluon.reinterpret(lse_dst, gl.float32, [1, block_m], lse_desc.layout)
            _gluon.tma_load(lse_desc, [bh, row], bar, lse_block)
            delta_block = _gluon.reinterpret(delta_dst, gl.float32, [1, block_m], delta_desc.layout)
            _gluon.tma_load(delta_desc, [bh, row], bar, delta_block)

    @gluon.jit
    def _add_dq(dq_desc, bh, row, src):
        """Add the fp32 tile src (BLOCK_M, d) to rows [row, ...) of head bh of the (b·h, n_q, d)
        sum: one TMA bulk reduction in L2; rows past n_q are dropped."""
        block = _gluon.reinterpret(src, gl.float32, dq_desc.block_shape, dq_desc.layout)
        _gluon.tma_reduce_add(dq_desc, [bh, row, 0], block)

    @gluon.jit(do_not_specialize=["BH", "H", "N_Q", "N_K"])
    def _attention_bwd_sm90_kernel(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV, SEED, LSE, DELTA,
        off_dk, off_dv, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
        BH, H, N_Q, N_K, qk_scale, sm_scale, threshold, drop_scale,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr, DROPOUT: gl.constexpr, KV_IN_REGS: gl.constexpr,
        DQ_T: gl.constexpr, LPT_BYTES: gl.constexpr, LSE_TMA: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: dK, dV of BLOCK_N keys of one batch·head (grid (key blocks, b·h)),
        and their share of dQ added to dq_desc's tensor (fp32, (b·h, n_q, HEAD_DIM), zeroed
        before). The tensors come as host-made TMA descriptors (`_descriptors`): q, k, v, dO
        (b, h, n, HEAD_DIM) and the log-sum-exp and Δ (b·h, n_q), whose rows past n read as
        zeros; LSE, DELTA: the same two as pointers (the `LSE_TMA` off path).
        DROPOUT: the forward dropped P with the package's mask of the (n_q, n_k) scores under
        the seed SEED + (b·h << 32), kept elements scaled by drop_scale = 1 / (1 - p)."""
        qk_scale = qk_scale.to(gl.float32)
        sm_scale = sm_scale.to(gl.float32)
        drop_scale = drop_scale.to(gl.float32)
        dtype: gl.constexpr = q_desc.dtype
        pid = gl.program_id(0)
        bh = gl.program_id(1)
        if CAUSAL:  # each program streams its head's q and dO
            pid, bh = longest_first(pid, bh, BH, N_Q.to(gl.int64) * HEAD_DIM * 4, LPT_BYTES)
        b = bh // H
        h = bh % H
        n0 = pid * BLOCK_N
        seed = 0
        if DROPOUT:  # one Philox key per batch·head, as the forward's
            seed = gl.load(SEED) + (bh.to(gl.int64) << 32)

        # Layouts. Each warpgroup (4 warps) owns 64 keys of Sᵀ, dPᵀ, dK and dV (and 64 rows
        # of dQᵀ); an untransposed dQ tile is split by rows, then by columns over them.
        WARPS_N: gl.constexpr = num_warps // 4
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
        )
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        if DQ_T:  # dQᵀ = Kᵀ dSᵀ, (HEAD_DIM, BLOCK_M): BLOCK_M may be 32 (a product's rows >= 64)
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
            )
            dq_zero = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, dq_layout)
        else:  # dQ = dS K, (BLOCK_M, HEAD_DIM)
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, WARPS_N],
                instr_shape=[16, HEAD_DIM // WARPS_N, 16],
            )  # fmt: skip
            dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
        # Pᵀ and dSᵀ feed dV's and dK's products from registers
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        key_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [BLOCK_M, HEAD_DIM], gl.float32
        )

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], key_layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], key_layout)
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], row_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], row_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_smem_layout)
        # each step's log-sum-exp and Δ, by TMA with its q and dO (a load through pointers
        # there waited in every step)
        vec_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=0, element_bitwidth=32, rank=1
        )
        lse_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(ready.index(0), count=1)
        mbarrier.init(ready.index(1), count=1)

        # the query blocks that see this key block: causal, rows i >= n0 - (n_k - n_q)
        causal_off = N_K - N_Q  # query i sees keys j <= i + causal_off
        lo = 0
        if CAUSAL:
            lo = (gl.maximum(n0 - causal_off, 0) // BLOCK_M) * BLOCK_M
        # rows from here on see every key of the block: no mask
        full_lo = gl.maximum(n0 + BLOCK_N - 1 - causal_off, 0)
        n_steps = gl.cdiv(N_Q - lo, BLOCK_M)

        mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * 2)
        _load_head_rows(k_desc, b, h, n0, kv_bar, k_smem)
        _load_head_rows(v_desc, b, h, n0, kv_bar, v_smem)
        if n_steps > 0:
            _load_step(
                q_desc, do_desc, lse_desc, delta_desc, b, h, bh, lo, ready.index(0),
                q_smem.index(0), do_smem.index(0), lse_smem.index(0), delta_smem.index(0),
                LSE_TMA,
            )  # fmt: skip
        mbarrier.wait(kv_bar, phase=0)

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
        lse_head = LSE + bh.to(gl.int64) * N_Q  # (LSE_TMA off: loaded through pointers)
        delta_head = DELTA + bh.to(gl.int64) * N_Q
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
        cols_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))

        # KV_IN_REGS: K and V feed Sᵀ's and dPᵀ's products from registers, which halves those
        # two products' shared-memory reads (1-2% faster at d64; at d32 the registers cost a
        # program per SM: `attention_gluon_session17_variants.md`)
        k_a = k_smem
        v_a = v_smem
        if KV_IN_REGS:
            kv_a_layout: gl.constexpr = gl.DotOperandLayout(
                operand_index=0, parent=st_layout, k_width=2
            )
            k_a = k_smem.load(kv_a_layout)
            v_a = v_smem.load(kv_a_layout)
        for step in range(n_steps):
            start_m = lo + step * BLOCK_M
            stage = step % 2
            # every warp is past the previous step's products (its stage of q and dO may be
            # refilled) and has written its part of the previous step's dQ tile
            _gluon.cta_barrier()
            if step > 0:
                _add_dq(dq_desc, bh, start_m - BLOCK_M, dq_smem.index(1 - stage))
            # the reduction of two steps back has read this step's dQ buffer (the other warps
            # pass the barrier below only after this one)
            tma.store_wait(1)
            if step + 1 < n_steps:
                nxt = 1 - stage
                _load_step(
                    q_desc, do_desc, lse_desc, delta_desc, b, h, bh, start_m + BLOCK_M,
                    ready.index(nxt), q_smem.index(nxt), do_smem.index(nxt),
                    lse_smem.index(nxt), delta_smem.index(nxt), LSE_TMA,
                )  # fmt: skip
            q_s = q_smem.index(stage)
            do_s = do_smem.index(stage)
            offs_m = start_m + cols_m
            if not LSE_TMA:
                lse = gl.load(lse_head + offs_m, mask=offs_m < N_Q, other=float("inf"))
                delta = gl.load(delta_head + offs_m, mask=offs_m < N_Q, other=0.0)
            mbarrier.wait(ready.index(stage), phase=(step // 2) & 1)
            if LSE_TMA:  # entries past n_q read as zeros: masked as the loads above are
                lse = lse_smem.index(stage).load(gl.SliceLayout(0, st_layout))
                lse = gl.where(offs_m < N_Q, lse, float("inf"))
                delta = delta_smem.index(stage).load(gl.SliceLayout(0, st_layout))

            st = _gluon.mma(k_a, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dpt = _gluon.mma(v_a, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            if DROPOUT:  # the mask of this (queries, keys) tile, drawn while the products run
                keep = _gluon.keep_tile(
                    seed, start_m, n0, N_K, threshold, BLOCK_M, BLOCK_N, num_warps
                )  # fmt: skip
                keep_t = gl.convert_layout(gl.permute(keep.to(gl.int8), (1, 0)), st_layout) != 0
            if KV_IN_REGS:  # (register operands stay live until their products are done)
                st, k_a = _gluon.mma_wait(num_outstanding=1, deps=[st, k_a])
            else:
                st = _gluon.mma_wait(num_outstanding=1, deps=[st])
            pt = gl.exp2(st * qk_scale - lse[None, :])
            if CAUSAL:  # noqa: SIM102
                if start_m < full_lo:  # the diagonal's blocks
                    pt = gl.where(offs_n[:, None] <= offs_m[None, :] + causal_off, pt, 0.0)
            if KV_IN_REGS:
                dpt, v_a = _gluon.mma_wait(num_outstanding=0, deps=[dpt, v_a])
            else:
                dpt = _gluon.mma_wait(num_outstanding=0, deps=[dpt])
            if DROPOUT:  # dV reads the dropped P; dP flows back through the mask
                pt_v = gl.where(keep_t, pt * drop_scale, 0.0)
                dpt = gl.where(keep_t, dpt * drop_scale, 0.0)
            else:
                pt_v = pt
            dst = (pt * (dpt - delta[None, :])).to(dtype)
            ds_smem.store(dst)
            hopper.fence_async_shared()
            _gluon.cta_barrier()  # all of dSᵀ written before any warpgroup reads it

            if DQ_T:
                dq = _gluon.mma(
                    k_smem.permute((1, 0)), ds_smem, dq_zero, use_acc=False, is_async=True
                )
            else:
                dq = _gluon.mma(
                    ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True
                )
            pt_a = gl.convert_layout(pt_v.to(dtype), a_layout)
            dv = _gluon.mma(pt_a, do_s, dv, is_async=True)
            dst_a = gl.convert_layout(dst, a_layout)
            dk = _gluon.mma(dst_a, q_s, dk, is_async=True)
            dq = _gluon.mma_wait(num_outstanding=2, deps=[dq])
            # added by the next step's first thread
            if DQ_T:
                dq_smem.index(stage).permute((1, 0)).store(dq)
            else:
                dq_smem.index(stage).store(dq)
            # Pᵀ and dSᵀ stay live until their products are done
            dv, dk, pt_a, dst_a = _gluon.mma_wait(num_outstanding=0, deps=[dv, dk, pt_a, dst_a])
            # (a fence between the store and the wait above crashes ptxas 12.8 and 12.9)
            hopper.fence_async_shared()

        if n_steps > 0:
            _gluon.cta_barrier()
            _add_dq(dq_desc, bh, lo + (n_steps - 1) * BLOCK_M, dq_smem.index((n_steps - 1) % 2))
            tma.store_wait(0)
        mbarrier.invalidate(kv_bar)
        mbarrier.invalidate(ready.index(0))
        mbarrier.invalidate(ready.index(1))
        dk = dk * sm_scale
        rows_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
        cols_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        keep = rows_n[:, None] < N_K
        rows_n = rows_n.to(gl.int64)
        b = b.to(gl.int64)
        h = h.to(gl.int64)
        dk_ptrs = DK + off_dk + b * sdkb + h * sdkh + rows_n[:, None] * sdkn + cols_d[None, :]
        gl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=keep)
        dv_ptrs = DV + off_dv + b * sdvb + h * sdvh + rows_n[:, None] * sdvn + cols_d[None, :]
        gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=keep)


@functools.cache
def bwd_tiles(head_dim: int, causal: bool) -> dict:
    """Tiles of the kernel: BLOCK_M queries per step, BLOCK_N keys per program, warps, whether
    K and V are held in registers (KV_IN_REGS), whether dQ is computed transposed (DQ_T) and
    whether each step's log-sum-exp and Δ arrive by TMA with its q and dO (LSE_TMA; else
    loaded through pointers in the step). Causal and non-causal heads take the same tiles today.

    Measured (H200, 2026-11-27, `attention_gluon_session17_variants.md`, µs, d64, causal / not,
    (16, 1024, 12) and (8, 2048, 16)): (32, 64, 4 warps), K and V in shared memory, dQᵀ: 320 /
    487 and 621 / 1093, three programs per SM (168 registers); (64, 64, 4), K and V in
    registers, dQᵀ: 334 / 459 and 632 / 983; the same with dQ untransposed: 336 / 470 and 642 /
    1023. So causal heads step over 32 queries, the others over 64. (64, 128, 8 warps) measured
    10-15% slower (one program per SM), (128, 128, 8) slower still. At d32, dQᵀ would be a
    product of 32 rows (wgmma's are 64): dQ untransposed, K and V in shared memory (in registers
    they cost a program per SM). At d128 only the 32-query step fits the registers without
    spills (244 per thread; (64, 64) spills 400 bytes; with today's kernel 96 bytes, and it
    needs 168 KiB of shared memory: one program per SM, ptxas of Triton 3.6, 2026-11-28).

    With the descriptors made on the host (twenty-third session) that choice turned: on an
    H200 (2026-11-28, `attention_tiles_session24.md`, µs, causal d64) the 64-query step with K
    and V in registers takes GPT-2's (16, 1024, 12) in 274.6 against 286.1, (8, 2048, 16) in
    543.7 against 608.8 and (4, 4096, 16) in 920.8 against 1075.4 (cuDNN: 272.9, 543.8,
    921.5); (32, 64) with K and V in registers 296.5 / 618.1 / 1073.5, (32, 128, 8 warps)
    362-369 / 770-787 / 1367-1400. So d64 heads step over 64 queries, causal or not, two
    programs per SM (230 registers; 255 through dropout, no spills). At d128, (32, 128, 8
    warps) measured 1.11-1.24x slower than (32, 64, 4) and the log-sum-exp by TMA 1.14-1.19x
    slower (`attention_tiles_session24.md`).

    LSE_TMA (H100, 2026-11-28, `attention_tma_desc_session23.md`, µs per backward, TMA /
    pointers): d64 causal (16, 1024, 12) 314.0 / 317.8, through dropout 362.3 / 375.1,
    (8, 2048, 16) 628.4 / 633.9, not causal 947.4 / 980.1; d32 causal (8, 2048, 16) 342.4 /
    444.3; but d128 causal (4, 4096, 16) 2255.4 / 1961.8 and (8, 2048, 16) 1286.9 / 1171.3.
    So d128 loads them through pointers (not causal, only dropout takes the kernel there: the
    choice follows the causal measurement)."""
    if head_dim < 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "KV_IN_REGS": False, "DQ_T": False,
                "LSE_TMA": True}  # fmt: skip
    if head_dim > 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "KV_IN_REGS": False, "DQ_T": True,
                "LSE_TMA": False}  # fmt: skip
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "KV_IN_REGS": True, "DQ_T": True,
            "LSE_TMA": True}  # fmt: skip


# Where eager backwards take this kernel: `ENABLED` (benchmarks turn it off to compare), head
# dims of `TAKEN_HEAD_DIMS` (causal: `TAKEN_HEAD_DIMS_CAUSAL`), heads of at least
# `MIN_QUERIES_D64` queries (d64) or `MIN_QUERIES` (the rest). Measured against the Triton
# kernels' backward with the host-made descriptors (H100, 2026-11-28,
# `attention_gluon_session23.md`, µs per backward, bf16, packed qkv, (b, n, h); causal / not):
# (4, 512, 8) d64 29.8 / 29.7 against 31.2 / 31.2; (16, 512, 8) d64 77.9 / 96.1 against
# 87.5 / 101.3; (16, 1024, 12) d64 312.9 / 425.8 against 362.8 / 451.0; (8, 2048, 16) d64
# 634.1 / 946.1 against 717.7 / 1061.0, d32 339.4 / 594.5 against 560.6 / 831.4, d128
# 1155.7 / 2246.6 against 1251.8 / 1868.8; (4, 4096, 16) d64 1086.3 / 1808.9 against
# 1192.5 / 2018.2, d128 1953.5 / 4179.0 against 2169.2 / 3501.3 (d128 not causal with the
# log-sum-exp by TMA, since moved to pointers: not taken either way). Shorter d32 and d128 heads
# were not measured with these descriptors (with the kernel's first ones, d128 causal from
# 2048 queries won, d32 at 2048 did: H200, 2026-11-27, `attention_gluon_session17.md`).
# Through dropout (p = 0.1) the Triton backward draws its mask per (key, query) tile as well,
# and loses at every shape measured: (H200, 2026-11-27, `attention_dropout_session20.md`,
# Gluon / Triton µs, causal; not) (16, 512, 8) d64 99.7 / 111.6; 134.3 / 228.5; (16, 1024,
# 12) d64 395.9 / 472.4; 608.6 / 1141.5; (8, 2048, 16) d64 833.3 / 1028.7; 1409.2 / 2881.3,
# d32 666.7 / 869.7; 1159.1 / 2024.1; (4, 4096, 16) d128 2320.0 / 3661.2; 4111.1 / 6779.8.
# So with dropout it takes every head dim of `HEAD_DIMS` from `MIN_QUERIES_DROPOUT` queries.
ENABLED = True
MIN_QUERIES_D64 = 512
MIN_QUERIES = 2048
MIN_QUERIES_DROPOUT = 512
TAKEN_HEAD_DIMS = (32, 64)
TAKEN_HEAD_DIMS_CAUSAL = (32, 64, 128)


def _taken(head_dim: int, n_q: int, causal: bool, dropout: bool) -> bool:
    """The head dims and query counts above."""
    if dropout:
        return head_dim in HEAD_DIMS and n_q >= MIN_QUERIES_DROPOUT
    if head_dim not in (TAKEN_HEAD_DIMS_CAUSAL if causal else TAKEN_HEAD_DIMS):
        return False
    return n_q >= (MIN_QUERIES_D64 if head_dim == 64 else MIN_QUERIES)


def usable(
    q: torch.Tensor, k: torch.Tensor, head_dim: int, causal: bool, no_key_mask: bool,
    dropout: bool = False,
) -> bool:  # fmt: skip
    """Whether the kernel takes this backward (`dropout`: through the forward's dropout):
    Gluon present, `ENABLED`, a Hopper GPU, the head dims and query counts above, a 16-bit
    dtype, multi-head attention (k as many heads as q), at most 65535 batch·heads (grid dim
    1), and `no_key_mask` (no key padding mask). The caller has checked the rest: an eager
    launch, TMA-describable tensors (`attention._tma_loads`) and the non-deterministic single
    pass."""
    return (
        HAVE_GLUON
        and ENABLED
        and no_key_mask
        and is_sm90(q.device)
        and _taken(head_dim, q.shape[2], causal, dropout)
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[1] == k.shape[1]
        and q.shape[0] * q.shape[1] <= 65535
    )


@functools.cache
def _layouts(head_dim: int, block_m: int, block_n: int) -> tuple:
    """Shared-memory layouts of the descriptors' blocks: a query block and a key block of a
    (b, h, n, d) tensor (16-bit), a dQ block of the (b·h, n_q, d) fp32 sum, and a query block
    of the (b·h, n_q) log-sum-exp / Δ. Each swizzles as the kernel's buffers do (the same
    bytes)."""
    nvmma = gl.NVMMASharedLayout.get_default_for
    return (
        nvmma([1, 1, block_m, head_dim], gl.bfloat16),
        nvmma([1, 1, block_n, head_dim], gl.bfloat16),
        nvmma([1, block_m, head_dim], gl.float32),
        nvmma([1, block_m], gl.float32),
    )


def _descriptors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, dq_acc: torch.Tensor, block_m: int, block_n: int,
) -> tuple:  # fmt: skip
    """The kernel's TMA descriptors, made on the host: the kernel gets each as a launch
    parameter, where descriptors made in the kernel cost each program five global writes,
    fences and barriers (11% of the kernel's warp stalls at GPT-2's shape, ncu on an H100,
    2026-11-28)."""
    d = q.shape[3]
    rows, keys, acc, vec = _layouts(d, block_m, block_n)

    def heads(t: torch.Tensor, block: int, layout) -> TensorDescriptor:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block, d], layout)

    def per_head(t: torch.Tensor) -> TensorDescriptor:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_m], vec)

    return (
        heads(q, block_m, rows), heads(k, block_n, keys), heads(v, block_n, keys),
        heads(dout, block_m, rows), per_head(lse), per_head(delta),
        TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), [1, block_m, d], acc),
    )  # fmt: skip


def _aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """A (b·h, n_q) fp32 tensor whose rows TMA can read (unit stride, rows 16-byte aligned):
    `t` itself, or a copy into rows padded to a multiple of 4 (n_q not a multiple of 4).
    (A flat descriptor over all rows would need no copy, but a load starting at an entry not
    16-byte aligned stopped the GPU with an illegal instruction.)"""
    if t.stride(1) == 1 and t.stride(0) % 4 == 0 and t.data_ptr() % 16 == 0:
        return t
    n_rows, n_cols = t.shape
    padded = torch.empty(n_rows, -(-n_cols // 4) * 4, device=t.device, dtype=t.dtype)
    return padded[:, :n_cols].copy_(t)


def launch_bwd_sm90(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
    dk: torch.Tensor, dv: torch.Tensor, grads_base: torch.Tensor | None,
    grad_offsets: tuple[int, int], lse: torch.Tensor, delta: torch.Tensor, dq_acc: torch.Tensor,
    causal: bool, qk_scale: float, sm_scale: float, lpt_bytes: int,
    dropout_p: float = 0.0, seed: torch.Tensor | None = None,
) -> Callable[..., None]:  # fmt: skip
    """Launch the kernel for (b, h, n, d) views q, k, v, dout (unit stride along d, TMA-
    describable): fills the (b, h, n_k, d) views dk, dv (any strides; views of `grads_base`
    when given, at element offsets `grad_offsets` (`utils.offsets_in`), which the kernel then
    gets, as `attention.launch_attention_bwd` passes it; (0, 0) otherwise) and adds the
    unscaled dQ into dq_acc (fp32, (b·h, n_q, d), contiguous, zeroed). lse, delta: (b·h, n_q)
    fp32, the forward's log-sum-exp in log2 units and Σ dO·O. dropout_p > 0: the forward's
    dropout of P, whose mask `seed` (0-dim int64 device tensor) regenerates.

    Returns the launch bound for tensors of the same layouts and facts: again(q, k, v, dout,
    dk, dv, grads_base, lse, delta, dq_acc, seed), as `utils.KernelLauncher.bind` (each
    descriptor encoded once per address)."""
    dropping = dropout_p > 0.0
    if dropping and seed is None:
        raise ValueError("a backward through dropout needs the forward's seed")
    dk_base, dv_base = (dk, dv) if grads_base is None else (grads_base, grads_base)
    off_dk, off_dv = grad_offsets
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    tiles = bwd_tiles(d, causal)
    descs = _descriptors(
        q, k, v, dout, _aligned_rows(lse), _aligned_rows(delta), dq_acc, tiles["BLOCK_M"],
        tiles["BLOCK_N"],
    )  # fmt: skip
    grid = (-(-n_k // tiles["BLOCK_N"]), b * h, 1)
    bound = launcher(_attention_bwd_sm90_kernel).bind(
        grid, *descs, dk_base, dv_base, seed if dropping else delta, lse, delta, off_dk, off_dv,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        b * h, h, n_q, n_k, qk_scale, sm_scale, dropout_threshold(dropout_p),
        1.0 / (1.0 - dropout_p), HEAD_DIM=d, CAUSAL=causal, DROPOUT=dropping,
        LPT_BYTES=lpt_bytes, **tiles,
    )  # fmt: skip

    def again(q, k, v, dout, dk, dv, grads_base, lse, delta, dq_acc, seed) -> None:
        rows = (_aligned_rows(lse), _aligned_rows(delta))
        written = (dk, dv) if grads_base is None else (grads_base, grads_base)
        bound(q, k, v, dout, *rows, dq_acc, *written, seed if dropping else delta, lse, delta)

    return again
