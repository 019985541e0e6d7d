"""The relu² feed-forward's two fused products for Hopper GPUs, written in Gluon.

    forward:   Y = relu(X Wᵀ)²                      (M, N) = (tokens, ff)
    backward:  dP = (dY W) · 2·relu(P),  relu(P) = √Y (what the forward kept) or relu(P) itself

With the forward's dropout, Y = relu(P)² · keep / (1 - p) is what the backward reads, and
relu(P) · keep = √(Y (1 - p)) holds the mask already (keep is 0 or 1):

    dP = (dY W) · 2·relu(P) · keep / (1 - p) = (dY W) · 2·√Y · s,   s = 1 / √(1 - p)

so the backward runs without the mask, as the same epilogue times the scalar s. The forward's
dropout draws the mask of `_jit_helpers.dropout_keep_tile` (one Philox4x32-7 call per row and
group of 8 columns; the package's one scheme) after the tile has left the registers for the
output buffer, in a layout of 8 consecutive columns per thread (`_gluon.keep_tile`).

Both are persistent matmuls whose epilogue touches a second (M, N) tile: the forward writes
Y, the backward reads Y as well. In `matmul_kernels._mm_tma_kernel` (Triton 3.6) that read is
a synchronous load in the epilogue: at GPT-2's feed-forward the backward product took 160 µs
against the forward's 119 (`mm_epilogue_tiles_session13.md`), and loading the tile before the
main loop kept it in registers (spills). Here the work is split between warps
(`gl.warp_specialize`), as cuBLAS and CUTLASS do on Hopper:

- a loader warp brings the A and B tiles of each K step by TMA into a ring of STAGES
  shared-memory buffers, in the order the products consume them, across tiles;
- two consumer warpgroups take alternate 128 x 128 output tiles ("ping-pong", in turns):
  while one runs its products (asynchronous warpgroup products, one in flight), the other
  runs its epilogue. Each consumer loads its tile of Y by TMA into its own output buffer
  when its tile starts, reads it there in the epilogue, and stores the output from the same
  buffer by an asynchronous TMA store.

A software-pipelined version without the split (8 warps, 128 x 256 tiles, the next loads
issued between products, Y loaded halfway through the K loop; commit 24ae204) was faster than
the Triton kernel on the backward but kept the tensor cores idle during its epilogue.

Measured (H200, 2026-11-27, `mm_gluon_session18.md`, kernel µs, L2 flushed; Triton TMA
kernel / the pipelined version / this kernel, cuBLAS's plain product alone in brackets): GPT-2's
feed-forward (16384 x 768 -> 3072) forward 121.0 / 119.5 / 116.6 (111.2), backward 160.4 /
145.1 / 128.7; the large preset's (16384 x 1024 -> 4096) forward 201.2 / 196.8 / 192.3
(192.4), backward 259.7 / 225.5 / 209.2; enwik8's (8192 x 512 -> 2048) forward 32.1 / 33.1 /
32.4 (29.6), backward 50.1 / 42.0 / 38.0. With dropout 0.1, in the GPT-2 preset's graphed step
(`step_gpt2_dropout_kernels_session19*.md`, µs per product): the forward 159.3 against the
Triton kernel's 171.5 (the mask's draws cost it 43 µs: the epilogue then outlasts the other
consumer's products); the backward from Y 132.6, where cuBLAS + the pass regenerating the
mask ran before (the step 1.014× faster).

Scope: Hopper (sm_90), fp16 / bf16 operands and output, A (M, K) with unit column stride,
B (K, N) or its transpose (N, K) with unit column stride, Y (M, N) with unit column stride,
no residual, no relu(P) kept beside the forward's output (the model's fp16 path keeps it and
runs the Triton kernel). `matmul_plan` takes it for eager launches where
`usable` says so; traced code runs the Triton kernel or cuBLAS + the elementwise pass (torch's
`wrap_triton` does not take Gluon kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from triton_transformer import _gluon
from triton_transformer._gluon import HAVE_GLUON, gl, gluon, hopper, is_sm90, mbarrier, tma
from triton_transformer.matmul_kernels import _grouped_tile
from triton_transformer.utils import dropout_threshold, launcher, tma_scratch

__all__ = ["EPILOGUES", "HAVE_GLUON", "launch_mm_sm90", "usable"]

# The epilogues (the kernel's EPILOGUE): relu² of the product, or relu²'s backward with the
# forward's kept tile holding relu(P) ("relu2grad") or Y = relu(P)² ("relu2grad_from_square")
EPILOGUES = {"relu2": 1, "relu2grad": 2, "relu2grad_from_square": 3, "relu2_dropout": 4}

# registers per thread of the worker partitions: the second consumer, the loader (see `LAUNCH`)
_CONSUMER_REGS = gl.constexpr(232) if HAVE_GLUON else 232
_LOADER_REGS = gl.constexpr(40) if HAVE_GLUON else 40


if HAVE_GLUON:

    @gluon.jit
    def _issue_loads(
        off_m, off_n, k, stage, a_desc, b_desc, ready, a_smem, b_smem, B_T: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    ):  # fmt: skip
        """The TMA loads of one K step (A's tile at (off_m, k); B's at (k, off_n), or at (off_n,
        k) when B is stored (N, K)) into ring buffer `stage`, which signals `ready[stage]`
        when both have landed."""
        bar = ready.index(stage)
        mbarrier.expect(bar, (BLOCK_M + BLOCK_N) * BLOCK_K * 2)
        _gluon.tma_load(a_desc, [off_m, k], bar, a_smem.index(stage))
        if B_T:
            _gluon.tma_load(b_desc, [off_n, k], bar, b_smem.index(stage))
        else:
            _gluon.tma_load(b_desc, [k, off_n], bar, b_smem.index(stage))

    @gluon.jit
    def _schedule(M, N, K, meta: gl.constexpr):
        """This program's share of the work, the same in every partition: its first tile
        (tiles start, start + NUM_SMS, ...), the tile grid, K steps per tile, its tile count
        (the grid has at most one program per tile)."""
        start = gl.program_id(0)
        num_pid_m = gl.cdiv(M, meta[2])
        num_pid_n = gl.cdiv(N, meta[3])
        k_tiles = gl.cdiv(K, meta[4])
        my_tiles = gl.cdiv(num_pid_m * num_pid_n - start, meta[7])
        return start, num_pid_m, num_pid_n, k_tiles, my_tiles

    @gluon.jit
    def _ws_loader(args, meta: gl.constexpr):
        """The loader partition (one warp): every K step of this program's tiles, in order,
        into the ring; waits for a buffer's `empty` barrier, which its consumer signals."""
        (a_desc, b_desc, _y_desc, _c_desc, a_smem, b_smem, _c_smem, ready, empty, _y_bar,
         _turn, M, N, K, _scale, _seed, _threshold) = args  # fmt: skip
        B_T: gl.constexpr = meta[0]
        BLOCK_M: gl.constexpr = meta[2]
        BLOCK_N: gl.constexpr = meta[3]
        BLOCK_K: gl.constexpr = meta[4]
        STAGES: gl.constexpr = meta[5]
        GROUP_M: gl.constexpr = meta[6]
        NUM_SMS: gl.constexpr = meta[7]
        start, num_pid_m, num_pid_n, k_tiles, my_tiles = _schedule(M, N, K, meta)
        step = 0
        for t in range(my_tiles):
            pid_m, pid_n = _grouped_tile(start + t * NUM_SMS, num_pid_m, num_pid_n, GROUP_M)
            for ki in range(k_tiles):
                stage = step % STAGES
                # a fresh barrier counts as having completed the phase before 0
                mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
                _issue_loads(
                    pid_m * BLOCK_M, pid_n * BLOCK_N, ki * BLOCK_K, stage, a_desc, b_desc, ready,
                    a_smem, b_smem, B_T, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                step += 1

    @gluon.jit
    def _ws_consume(args, meta: gl.constexpr, which: gl.constexpr):
        """Consumer `which` (one warpgroup): tiles which, which + 2, ... of this program,
        products from the ring, then its epilogue through its own buffer c_smem[which] while
        the other consumer's products run."""
        (_a_desc, _b_desc, y_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, y_bar,
         turn, M, N, K, scale, SEED, threshold) = args  # fmt: skip
        B_T: gl.constexpr = meta[0]
        EPILOGUE: gl.constexpr = meta[1]
        BLOCK_M: gl.constexpr = meta[2]
        BLOCK_N: gl.constexpr = meta[3]
        STAGES: gl.constexpr = meta[5]
        GROUP_M: gl.constexpr = meta[6]
        NUM_SMS: gl.constexpr = meta[7]
        dtype: gl.constexpr = c_desc.dtype
        GRAD: gl.constexpr = EPILOGUE == 2 or EPILOGUE == 3  # the backward's, reading Y
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        start, num_pid_m, num_pid_n, k_tiles, my_tiles = _schedule(M, N, K, meta)
        buf = c_smem.index(which)
        bar = y_bar.index(which)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for t in range(which, my_tiles, 2):
            pid_m, pid_n = _grouped_tile(start + t * NUM_SMS, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            if GRAD:  # Y's tile into the buffer, once this consumer's last output has left it
                tma.store_wait(0)
                _gluon.cta_barrier()
                mbarrier.expect(bar, BLOCK_M * BLOCK_N * 2)
                _gluon.tma_load(y_desc, [off_m, off_n], bar, buf)
            # Turns: the ring's barriers tell phases apart only by parity, so a consumer waits
            # on them only once the other has passed all of its previous tile's buffers (its
            # (t // 2)-th turn; consumer 0's first passes on the fresh barrier)
            mbarrier.wait(turn.index(which), ((t // 2) & 1) ^ (1 - which))
            step = t * k_tiles
            acc = zero
            for ki in range(k_tiles):
                stage = step % STAGES
                mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
                if B_T:  # noqa: SIM108 (constexpr branches)
                    b_op = b_smem.index(stage).permute((1, 0))
                else:
                    b_op = b_smem.index(stage)
                acc = _gluon.mma(a_smem.index(stage), b_op, acc, is_async=True)
                acc = _gluon.mma_wait(num_outstanding=1, deps=[acc])
                # the previous step's product is done: its buffer goes back to the loader
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=ki > 0)
                step += 1
            mbarrier.arrive(turn.index(1 - which))  # the other consumer's turn
            acc = _gluon.mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))

            if GRAD:  # dP = acc · 2·relu(P) · scale, relu(P) = √Y or the kept relu(P)
                mbarrier.wait(bar, (t // 2) & 1)  # this consumer's (t // 2)-th tile
                kept = buf.load(acc_layout).to(gl.float32)
                if EPILOGUE == 3:
                    kept = gl.sqrt(kept)
                acc = acc * ((2.0 * scale) * kept)
                _gluon.cta_barrier()  # every warp has read Y before the output overwrites it
            else:
                tma.store_wait(0)  # this consumer's previous output has left the buffer
                _gluon.cta_barrier()
            if EPILOGUE == 1 or EPILOGUE == 4:
                acc = gl.maximum(acc, 0.0)
                acc = acc * acc
            if EPILOGUE == 4:  # relu² · keep / (1 - p): scaled here, the dropped zeroed below
                acc = acc * scale
            buf.store(acc.to(dtype))
            if EPILOGUE == 4:  # the mask, drawn with the tile out of the registers
                _gluon.cta_barrier()  # every warp's part of the tile written
                keep = _gluon.keep_tile(
                    gl.load(SEED), off_m, off_n, N, threshold, BLOCK_M, BLOCK_N, 4
                )
                y = buf.load(keep.type.layout)
                buf.store(gl.where(keep, y, gl.zeros_like(y)))
            hopper.fence_async_shared()
            _gluon.cta_barrier()  # every warp's part written before the one store
            _gluon.tma_store(c_desc, [off_m, off_n], buf)
        tma.store_wait(0)

    @gluon.jit
    def _ws_consumer_1(args, meta: gl.constexpr):
        """The second consumer, as a worker partition (workers share one signature, the
        loader's: `which` cannot be passed)."""
        _ws_consume(args, meta, 1)

    @gluon.jit
    def _mm_sm90_kernel(
        A, B, C, Y, M, N, K, stride_a, stride_b, stride_c, stride_y, scale, SEED, threshold,
        B_T: gl.constexpr, EPILOGUE: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
        GROUP_M: gl.constexpr, NUM_SMS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """C = epilogue(A @ B) (times scale; relu2_dropout: and the mask of SEED at
        threshold), one program per SM walking tiles start, start + NUM_SMS, ... (grouped
        order, `_grouped_tile`), warp-specialized: a loader warp fills the ring of STAGES
        buffers; two consumer warpgroups (the default partition and a worker; num_warps = 4)
        take alternate tiles, so that one's epilogue overlaps the other's products. TMA pads
        out-of-bounds loads with zeros and clips stores: ragged edges need no masks."""
        dtype: gl.constexpr = A.dtype.element_ty
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        a_desc = tma.make_tensor_descriptor(A, [M, K], [stride_a, 1], [BLOCK_M, BLOCK_K], a_layout)
        if B_T:
            b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
            b_desc = tma.make_tensor_descriptor(
                B, [N, K], [stride_b, 1], [BLOCK_N, BLOCK_K], b_layout
            )
            b_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_layout)
        else:
            b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
            b_desc = tma.make_tensor_descriptor(
                B, [K, N], [stride_b, 1], [BLOCK_K, BLOCK_N], b_layout
            )
            b_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_layout)
        c_desc = tma.make_tensor_descriptor(C, [M, N], [stride_c, 1], [BLOCK_M, BLOCK_N], c_layout)
        y_desc = tma.make_tensor_descriptor(Y, [M, N], [stride_y, 1], [BLOCK_M, BLOCK_N], c_layout)
        a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
        c_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        y_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(y_bar.index(i), count=1)
            mbarrier.init(turn.index(i), count=1)
        args = (a_desc, b_desc, y_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, y_bar,
                turn, M, N, K, scale, SEED, threshold)  # fmt: skip
        # the partitions' compile-time parameters, in this order (worker partitions share one
        # signature: one tuple keeps it short)
        meta: gl.constexpr = (B_T, EPILOGUE, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, NUM_SMS)
        gl.warp_specialize(
            [
                (_ws_consume, (args, meta, 0)),
                (_ws_consumer_1, (args, meta)),
                (_ws_loader, (args, meta)),
            ],
            [4, 1],
            [_CONSUMER_REGS, _LOADER_REGS],
        )


# 128 x 128 tiles per consumer warpgroup (128 fp32 accumulator registers per thread), five
# 32 KiB stages plus two 32 KiB output tiles: 224 of the 227 KiB of shared memory. Measured
# (`mm_gluon_session18.md`): 5 stages 0.5-4% faster than 4; 64 x 256 consumer tiles 4-8%
# slower.
TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 5}
# The launch: 4 warps per consumer partition (the kernel's accumulator layout assumes it) and
# 168 registers per thread (three warpgroups in the SM's 65536), which the partitions then
# redistribute: `_CONSUMER_REGS` per consumer thread, `_LOADER_REGS` for the loader's warpgroup
# (3 x 168 = 2 x 232 + 40).
LAUNCH = {"num_warps": 4, "maxnreg": 168}
ENABLED = True


def usable(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, kept: torch.Tensor | None, num_sms: int
) -> bool:
    """Whether the kernel takes the product c = epilogue(a @ b): Gluon present, `ENABLED`, a
    Hopper GPU, fp16 / bf16 a, b, c and `kept` all of one dtype, a, c and `kept`
    TMA-describable row by row, and at least one of `TILES`' output tiles per SM (smaller
    problems run the autotuned Triton kernel, which picks smaller tiles). The caller has
    checked b's layout (a TMA-describable (K, N) tensor or transposed view), the epilogue
    (relu² or its backward, no dropout or residual) and that nothing traces the launch."""
    if not (HAVE_GLUON and ENABLED and is_sm90(a.device)):
        return False
    tensors = (a, b, c) if kept is None else (a, b, c, kept)
    if a.dtype not in (torch.float16, torch.bfloat16) or any(t.dtype != a.dtype for t in tensors):
        return False
    tiles = -(-a.shape[0] // TILES["BLOCK_M"]) * -(-c.shape[1] // TILES["BLOCK_N"])
    rows = (a, c) if kept is None else (a, c, kept)
    return tiles >= num_sms and all(_tma_ok(t) for t in rows)


def _tma_ok(t: torch.Tensor) -> bool:
    """A 2-D 16-bit tensor TMA can describe row by row: unit column stride, a positive
    16-byte aligned row stride and start (judged by the storage offset: storages are
    256-byte aligned)."""
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and t.stride(0) > 0
        and (t.stride(0) * 2) % 16 == 0
        and (t.storage_offset() * 2) % 16 == 0
    )


def launch_mm_sm90(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, b_t: bool, epilogue: str,
    kept: torch.Tensor | None = None, num_sms: int | None = None, tiles: dict | None = None,
    p: float = 0.0, seed: torch.Tensor | None = None, bind: bool = False,
) -> Callable[..., None] | None:  # fmt: skip
    """c (M, N) = epilogue(a (M, K) @ b) with b (K, N), or b (N, K) read transposed when b_t
    (a weight W as Wᵀ). epilogue: a key of `EPILOGUES`; kept (M, N): the forward's tile the
    backward epilogues read. p: the forward's dropout: "relu2_dropout" draws its mask from
    `seed` (a 0-dim int64 device tensor) and scales the kept by 1 / (1 - p);
    "relu2grad_from_square" reads its output Y, which holds the mask, and scales by
    1 / √(1 - p) (no seed). tiles: `TILES` unless given (benchmarks). bind: return the
    launch bound (`utils.KernelLauncher.bind`), again(a, b, c, y, seed), y: kept (c where
    there is none), seed: c where there is none."""
    M, K = a.shape
    N = c.shape[1]
    if M == 0 or N == 0 or K == 0:
        raise ValueError(f"an empty product ({M} x {K} @ {K} x {N}): the caller handles it")
    if epilogue.startswith("relu2grad") and kept is None:
        raise ValueError(f"the {epilogue!r} epilogue reads the forward's kept tile: pass kept")
    if (epilogue == "relu2_dropout") != (seed is not None):
        raise ValueError("the relu2_dropout epilogue, and only it, draws its mask from a seed")
    if p > 0.0 and epilogue not in ("relu2_dropout", "relu2grad_from_square"):
        raise ValueError(f"the {epilogue!r} epilogue has no dropout (p={p})")
    scale = 1.0
    if p > 0.0:
        scale = 1.0 / (1.0 - p) if epilogue == "relu2_dropout" else (1.0 - p) ** -0.5
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    tiles = tiles or TILES
    # the device-side descriptors' scratch: a context variable of Triton, so set in whichever
    # thread launches (autograd's too), as `matmul_plan.launch_mm_tma` does
    triton.set_allocator(tma_scratch)
    n_tiles = -(-M // tiles["BLOCK_M"]) * -(-N // tiles["BLOCK_N"])
    y = kept if kept is not None else c
    grid = (min(num_sms, n_tiles),)
    launch = launcher(_mm_sm90_kernel)
    bound = (launch.bind if bind else launch[grid])(
        *((grid,) if bind else ()), a, b, c, y, M, N, K, a.stride(0), b.stride(0), c.stride(0),
        y.stride(0), scale, seed if seed is not None else c, dropout_threshold(p),
        B_T=b_t, EPILOGUE=EPILOGUES[epilogue], GROUP_M=8, NUM_SMS=num_sms, **tiles, **LAUNCH,
    )  # fmt: skip
    if not bind:
        return None

    def again(a, b, c, y, seed) -> None:
        triton.set_allocator(tma_scratch)  # per launching thread, as above
        bound(a, b, c, y, seed)

    return again
