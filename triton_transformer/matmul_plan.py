"""How each matmul runs: cuBLAS or one of `matmul_kernels.py`'s Triton kernels, planned per
problem (cached) and launched. `bmm.py`'s ops and `linear_cross_entropy.py` call
`_mm2d_into` (2-D products with the relu², dropout, residual and SwiGLU epilogues) and
`_bmm_into` (batched products).

Kernels and paths (`_plan` picks one per shape, layout, dtype, epilogue and device; cached):
- "cublas": torch.mm; torch.addmm for a residual of the operands' dtype (cuBLAS's own C-input
  epilogue, beta = 1); torch.mm with out_dtype for an fp32 output of fp16/bf16 operands (the
  weight gradients under mixed precision: the fp32 accumulator written as is). Never relu².
- "cublas+ew": relu² without a residual: torch.mm into the output, then `_relu2_ew_kernel`, one
  elementwise pass in place computing relu(y)² [· dropout mask / (1 - p)] (the mask of the
  fused epilogue, so the backward regenerates it the same way) and writing relu(y) where the
  backward needs it (fp16), as the fused epilogue would. SwiGLU ("+swiglu"): torch.mm of the
  (M, 2·H) [gate | up] projection into the pre-activations the backward keeps, then
  `swiglu.py`'s forward kernel on its halves (the unfused linear + swiglu of before). The
  backward is the fused path's. relu²'s gradient ("+relu2grad", `mlp.py`): torch.mm of dY @ W,
  then `_relu2_grad_kernel` in place. A residual of the operands' dtype where `MATMUL_TABLE`
  says so: torch.mm into the output, then the residual added in place (at some shapes
  cuBLAS's addmm runs a slower kernel than its plain product).
- "tma": Hopper (sm_90/sm_100), fp16/bf16, 2-D problems whose operands TMA can describe (last
  or first stride 1, the other stride and the base 16-byte aligned; N·itemsize a multiple of
  16 for the output; with SwiGLU, N = H, which also aligns the up half of the pre-activations).
  `_mm_tma_kernel` is persistent (one program per SM looping over tiles in grouped order),
  loads tiles with device-side tensor descriptors (`tl.make_tensor_descriptor`; its scratch
  comes from `triton.set_allocator`) and is autotuned per (M, N, K, layout, epilogue, dtype)
  over `_tma_configs()`. A transposed operand (W read as (K, N) in the backward, dY^T for dW)
  is a descriptor of the untransposed storage whose tile is transposed in shared memory: no
  copies. Problems with few output tiles and a long K (the weight gradients, K = tokens)
  split K over programs (`_split_k`): fp32 partials in a workspace, summed in a fixed order
  by a second kernel, so results stay deterministic (no atomics). SwiGLU: the SWIGLU variant
  (two accumulators per output tile, the gate and up tiles of the same B descriptor;
  silu(gate)·up, gate and up stored through descriptors), tuned over its own
  `_tma_swiglu_configs()`.
- "ptr": `_mm_ptr_kernel`, the pointer-based (strided, batched) kernel: other GPUs, fp32,
  batched bmm under "triton", decode-sized problems (<= 16 rows, `_FEW_ROWS_PTR`), and
  layouts TMA cannot describe.
- "interp": the same pointer kernel with small tiles and fp32 products for bf16 (the
  interpreter has no bf16 arithmetic); picked when tensors are not on CUDA (CPU tests).

`matmul_impl` (module-level; `bmm.matmul_impl` reads and sets it too) chooses among them on CUDA:
- "auto" (default): every problem cuBLAS computes whole goes to cuBLAS (plain products 2-D
  and batched, residual adds of one dtype, fp32 weight gradients, also while torch.compile
  traces where this PyTorch has a meta kernel for mm's out_dtype), except where
  `MATMUL_TABLE` lists a Triton kernel ("tma"/"ptr") measured faster for this device and
  problem, and decode-sized products with a short K (`_plan_few_rows`). relu² runs fused in
  our epilogue (TMA kernel on Hopper, else the pointer kernel) unless the table says
  "cublas+ew" for the problem: the fused kernel has to beat cuBLAS plus the separate pass.
  A residual of another dtype (autocast's fp32 residual stream under a bf16 product) runs
  in our epilogue: addmm needs one dtype (addmm's out_dtype does not trace: pytorch#163880).
  SwiGLU ("+swiglu") goes to "cublas+ew" wherever cuBLAS computes the product: the fused
  kernel (TMA on Hopper, else the pointer kernel) measured no faster than cuBLAS plus the
  gating pass (H200, 2026-11-25, benchmarks/bench_modern_ops.py --ops linear+swiglu: 0.97x
  and 1.00x at the two shapes), so it runs only where the table says "tma"/"ptr", under
  "triton"/"cublas", or where cuBLAS cannot compute the problem. relu²'s gradient
  ("+relu2grad", the feed-forward's d(pre) = (dY @ W_out) · 2·relu(pre)) runs fused like relu²;
  with the forward's dropout mask to regenerate ("+relu2grad+drop") it goes to "cublas+ew"
  unless the table says "fused" (the mask's draws measured slower in the epilogue at 2 of 3
  presets' shapes, `_plan`).
- "triton": never cuBLAS (benchmarks and tests of our kernels).
- "cublas": cuBLAS wherever it computes the whole problem, listed or not; relu² stays fused.

Why cuBLAS by default: every plain GEMM measured so far went to it. H200, triton 3.6, torch
2.11, benchmarks/bench_matmul.py (kernel times, L2 flushed), the enwik8 model's projections
(d512, ff 2048, vocab 256) at 2048 and 8192 tokens: our best kernel reached 0.59-0.91x of
torch.mm (weight gradients and 2048-token problems lose most: few output tiles, K = 512
leaves little to pipeline), and 0.40-0.79x of torch.addmm with the residual (our epilogue
reads it with plain loads in the accumulator layout); at GPT-2's shapes (d768, 16,384
tokens, vocab 50,304) the TMA kernel ran at 0.90x of cuBLAS (issue "Lead at GPT-2 scale").
The fused relu² forward won:
d512 -> 2048 at 8192 tokens 528 TFLOP/s with the TMA kernel, 0.90x a plain torch.mm of the
same shape and 1.9x PyTorch's mm + relu + square; at 2048 tokens the pointer kernel, 359
TFLOP/s, 0.79x of mm and 1.5x of mm + relu + square. Against cuBLAS + our single
elementwise pass ("cublas+ew"), and every projection of the GPT-2 and large presets (forward,
dX, dW): measured in the next GPU run (`bench_matmul.py --presets`), whose "table" column
gives the entries to add here.

On Hopper, eager launches of the relu² forward (its dropout drawn in the epilogue) and relu²'s
gradient (after a dropout: from the forward's output, which holds the mask) that fill every
SM with `matmul_hopper.TILES` run its warp-specialized Gluon kernel instead of the TMA kernel
or cuBLAS + the pass (`_launch_gluon`): one consumer's epilogue runs while the other's
products do.

Notes: the first call of a shape autotunes (several kernel runs), so warm up before capturing
a CUDA graph. Later eager calls launch the tuned config directly (`_TUNED`). Under
torch.compile the TMA kernel is traced where inductor provides the descriptors' scratch
(`utils.compile_tma`), else the pointer kernel; a relu² (or table-listed SwiGLU) product that
eager would fuse in the TMA kernel then takes "cublas+ew" (inductor launches cuBLAS itself).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
from torch.library import wrap_triton

from triton_transformer import matmul_hopper
from triton_transformer.matmul_kernels import (
    _mm_ptr_kernel,
    _mm_tma_kernel,
    _mm_tma_swiglu_tuned,
    _mm_tma_tuned,
    _relu2_ew_kernel,
    _relu2_grad_kernel,
    _splitk_reduce_kernel,
)
from triton_transformer.swiglu import launch_swiglu_fwd
from triton_transformer.utils import (
    cdiv,
    compile_tma,
    dropout_threshold,
    is_traced,
    launcher,
    next_power_of_2,
    opaque_op,
    sm_count,
    tma_scratch,
    widened_for_interpreter,
)

# Which GEMM runs a problem on CUDA: "auto" (cuBLAS for whatever it computes whole, relu²
# fused, `MATMUL_TABLE`'s exceptions), "triton" (never cuBLAS) or "cublas" (cuBLAS wherever it
# computes the whole problem, relu² fused). See the module docstring. Module-level, read once
# per call.
matmul_impl = "auto"

# The exceptions to "auto"'s rule, per device name and problem "MxNxK:AB[+relu2][+res]",
# "MxNxK:AB+relu2grad[+drop]" or "MxNxK:AB+swiglu" (A/B: "n" row-major, "t" a transposed
# view, "s" other strides; with +swiglu N is the output's width H, the product's 2·H):
# "tma" / "ptr" where that Triton kernel measured faster than cuBLAS (for relu² and SwiGLU,
# the faster of our two fused kernels); for relu² without a residual and relu²'s gradient,
# "cublas+ew" (cuBLAS's product, then our pass) where that measured faster than the fused
# kernel, the default; for SwiGLU and relu²'s gradient with a dropout mask, "fused" (our
# epilogue, TMA where it can) where that measured faster than cuBLAS + the pass, the default.
# benchmarks/bench_matmul.py --presets prints the entries for the enwik8, GPT-2 and large
# presets' projections. Kernel times, L2 flushed.
MATMUL_TABLE: dict[str, dict[str, str]] = {
    "NVIDIA H200": {
        # triton 3.6, torch 2.11, 2026-11-22: enwik8's proj_in at 2048 tokens (a micro-batch
        # of 4 x 512), fused: pointer kernel 359, TMA kernel 337 TFLOP/s
        "2048x2048x512:nt+relu2": "ptr",
        # triton 3.6, torch 2.11, 2026-11-25: the large preset's d(pre) with dropout 0.1,
        # feed-forward fwd+bwd 1.2193 ms fused against 1.2595 with cuBLAS + the pass
        "16384x4096x1024:nn+relu2grad+drop": "fused",
        # triton 3.6, torch 2.11, 2026-11-28 (asked for by the 25th session's table too): the
        # attention output projection with a residual of the product's dtype, TFLOP/s
        # against torch.addmm (medians of 5 interleaved rounds, `matmul_presets_session32`):
        # enwik8 287 against 264, GPT-2 400 against 392, large 487 against 471
        "8192x512x512:nt+res": "ptr",
        "16384x768x768:nt+res": "tma",
        "16384x1024x1024:nt+res": "tma",
        # triton 3.6, torch 2.11, 2026-11-28: enwik8's feed-forward output with a residual of
        # the product's dtype (a bf16 model without autocast): torch.mm then the add 551
        # TFLOP/s against torch.addmm's 536 and our kernels' 474 (`matmul_presets_session32`)
        "8192x512x2048:nt+res": "cublas+ew",
    }
}

# Table entries that pick our fused epilogue over cuBLAS + a separate pass.
_FUSED = ("tma", "ptr", "fused")

# Tests and benchmarks only: force a path where it is allowed: "tma" or "ptr" (our kernels,
# skipping cuBLAS and the table), or "cublas+ew" (relu² without a residual, SwiGLU, or a
# residual of the product's dtype, through cuBLAS and the elementwise pass or the add, on any
# device: on the CPU torch.mm and the interpreter; other problems are planned as without a
# force).
_FORCE_PATH: str | None = None

# Traced code (torch.compile) takes `matmul_hopper`'s kernel where an eager call would, through
# `mm_opaque_op`. False: traced code runs the Triton kernels there (benchmarks compare them).
TRACED_OPAQUE = True


def _mm_opaque(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    relu_squared: bool,
    p: float,
    seed: torch.Tensor | None,
    kept: torch.Tensor | None,
    from_square: bool,
) -> None:
    """`_mm2d_into(a, b, c, relu_squared, drop=(p, seed), grad=(kept, from_square))` as an
    eager call (no drop where p = 0, no grad without `kept`), for traced code: inductor
    cannot trace a Gluon kernel (`wrap_triton` takes `@triton.jit` ones), so it calls this op
    as it is, with the strides it traced. The eager call checks the layouts again and takes
    `matmul_hopper`'s kernel, or the planned one where that kernel does not take them. c: a
    tensor of its own, as the epilogue ops allocate it (an opaque op writing into a view of
    a buffer inside a traced op gave wrong results: `linear_cross_entropy.TRACED_OPAQUE`)."""
    drop = (p, seed) if p > 0.0 else None
    grad = (kept, from_square) if kept is not None else None
    _mm2d_into(a, b, c, relu_squared, drop=drop, grad=grad)


mm_opaque_op = opaque_op("mm", _mm_opaque, mutates_args=("c",))


@mm_opaque_op.register_fake
def _(a, b, c, relu_squared, p, seed, kept, from_square) -> None:
    return None


def _mm_out_dtype_traceable() -> bool:
    """Whether torch.mm(a, b, out_dtype=float32) of bf16 operands runs on meta tensors, as
    torch.compile's fake tensors need (releases without a meta kernel for it failed to trace
    it: pytorch#159023). Then traced fp32 weight gradients can go to cuBLAS too."""
    try:
        a = torch.empty(size=(16, 16), dtype=torch.bfloat16, device="meta")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except Exception:  # no out_dtype overload, or no meta kernel for it
        return False


# Probed once, at import: inside a trace, tensors made here would be traced ones.
_MM_OUT_DTYPE_TRACEABLE = _mm_out_dtype_traceable()

# CUDA caps the 2nd grid dim (the batch here) at 65535; larger batches launch in chunks.
_MAX_GRID_BATCH = 65535


# ------------------------------------------------------------------------------------------
# Host side: plans (cached per shape), launches
# ------------------------------------------------------------------------------------------


def _pow2(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= n, clamped to [lo, hi]."""
    return max(lo, min(hi, next_power_of_2(n)))


@functools.cache
def _ptr_config(
    M: int, N: int, K: int, batch: int, dtype: torch.dtype, interpret: bool, swiglu: bool = False
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) of the pointer kernel.

    A fixed heuristic rather than triton.autotune: no benchmarking on first call, and the
    same tiles (hence the same summation order) on every run. swiglu: the SWIGLU epilogue
    (N the output's width; two accumulators and two B tiles per K step): on GPUs BLOCK_N is
    capped at 64 and BLOCK_K at 32 for fp16/bf16, fp32 takes 8 warps: compiled for sm_90
    (triton 3.9) these spill no registers, where the plain tiles with a second accumulator
    did (128x64x64: 128 bytes of stack; fp32 on 4 warps: 104).
    """
    if interpret:
        # Each program costs ~1 ms in the interpreter whatever its tile size, so use tiles
        # as large as the problem up to 32 (tl.dot needs >= 16 on GPUs; keep the same floor).
        return _pow2(M, 16, 32), _pow2(N, 16, 32), _pow2(K, 16, 32), 8, 4, 1
    if dtype == torch.float32:
        # ieee fp32 goes through FMA units, not tensor cores: 64x64 tiles with a 32-deep K
        # step keep the per-thread accumulator (32 fp32; SWIGLU's two on 8 warps too) and
        # shared memory small.
        return _pow2(M, 16, 64), _pow2(N, 16, 64), _pow2(K, 16, 32), 8, 8 if swiglu else 4, 3
    # fp16/bf16 on tensor cores: 128x128x64 tiles, 8 warps, 3 stages (96 KiB of shared
    # memory, fits any GPU since Ampere) for large problems; for small ones narrow N, then M,
    # to 64 so that there are enough programs for the SMs (an H100 has 132).
    block_m, block_n = _pow2(M, 16, 128), _pow2(N, 16, 64 if swiglu else 128)
    if batch * cdiv(M, block_m) * cdiv(N, block_n) < 128:
        block_n = min(block_n, 64)
    if batch * cdiv(M, block_m) * cdiv(N, block_n) < 128:
        block_m = min(block_m, 64)
    # SWIGLU's 128x64 tiles count twice (two accumulators, two B tiles): 8 warps, 3 stages
    big = block_m * block_n * (2 if swiglu else 1) >= 128 * 128
    block_k = _pow2(K, 16, 32 if swiglu else 64)
    return block_m, block_n, block_k, 8, 8 if big else 4, 3 if big else 4


def _split_k(M: int, N: int, K: int, num_sms: int) -> int:
    """K chunks for the TMA kernel when 128x128 output tiles would leave SMs idle and K is
    long (weight gradients: K = tokens). From the split sweep of bench_matmul.py on an H200:
    >= 32 tiles want K chunks of ~2048 within two waves; fewer tiles want chunks of ~512
    within one wave."""
    tiles = cdiv(M, 128) * cdiv(N, 128)
    if tiles >= num_sms:
        return 1
    if tiles >= 32:
        split, cap = K // 2048, 2 * num_sms // tiles
    else:
        split, cap = K // 512, num_sms // tiles
    return max(1, min(split, cap, 16))


def _layout(x: torch.Tensor) -> tuple[int, int] | None:
    """(transposed, row stride) for a TMA descriptor of 2-D `x`, or None if TMA can't read it.

    Row-major (last stride 1) or a transposed view (first stride 1); the other stride and
    the start address must be 16-byte aligned. The start is judged by the storage offset
    (PyTorch's allocators align storages to >= 256 bytes), so fake tensors work too.
    """
    s0, s1 = x.stride()
    es = x.element_size()
    if (x.storage_offset() * es) % 16:
        return None
    if s1 == 1 and s0 > 0 and (s0 * es) % 16 == 0:
        return 0, int(s0)
    if s0 == 1 and s1 > 0 and (s1 * es) % 16 == 0:
        return 1, int(s1)
    return None


@functools.cache
def _plan(
    device_type: str,
    index: int,
    dtype: torch.dtype,
    M: int,
    N: int,
    K: int,
    a_t: int,
    b_t: int,
    epi: str,
    cublas_ok: bool,
    out_size: int,
    impl: str,
    force: str | None,
    tracing: bool = False,
) -> tuple:
    """How one 2-D problem runs: ("cublas",), ("cublas+ew",), ("tma", split_k, num_sms) or
    ("ptr", config). The rule is the module docstring's.

    a_t / b_t: the operands' TMA layouts (0 row-major, 1 transposed, -1 not describable).
    epi: "", "+relu2", "+res", "+relu2+res", "+swiglu" (N is then the output's width H; the
    product's is 2·H) or "+relu2grad[+drop]" (relu²'s backward, d(pre) from dY @ W, with the
    forward's dropout mask). cublas_ok: torch.mm / torch.addmm computes the product and its
    residual into the output (one dtype throughout, or an fp32 output of fp16/bf16 operands
    without a residual); relu², its gradient or the SwiGLU gating is then our separate pass
    ("cublas+ew").
    out_size: the output's element size in bytes. tracing: torch.compile is tracing the op
    and may not trace the TMA kernel (`utils.compile_tma()` false: this torch's inductor
    does not provide the descriptors' scratch allocator).
    """
    swiglu = epi == "+swiglu"
    act = swiglu or "+relu2" in epi
    plain = cublas_ok and not act  # cuBLAS computes the whole problem
    # cuBLAS's product, then relu² in place or the SwiGLU gating (a pass of its own)
    ew = cublas_ok and epi in ("+relu2", "+swiglu", "+relu2grad", "+relu2grad+drop")
    # a residual of the product's dtype: addmm ("cublas"), or the product then the add
    add_ew = cublas_ok and epi == "+res"
    if force == "cublas+ew":
        if ew or add_ew:
            return ("cublas+ew",)
        force = None  # forces nothing else
    if device_type != "cuda":
        return ("ptr", _ptr_config(M, N, K, 1, dtype, True, swiglu))
    props = torch.cuda.get_device_properties(index)  # read once per problem: cached
    major, num_sms, name = props.major, props.multi_processor_count, props.name
    half = dtype in (torch.float16, torch.bfloat16)
    choice = None
    if impl == "auto" and force is None:
        lay = ("nt"[a_t] if a_t >= 0 else "s") + ("nt"[b_t] if b_t >= 0 else "s")
        choice = MATMUL_TABLE.get(name, {}).get(f"{M}x{N}x{K}:{lay}{epi}")
    if force is None:
        if plain and impl == "cublas":
            return ("cublas",)
        if (ew or add_ew) and choice == "cublas+ew":
            return ("cublas+ew",)
        if swiglu and ew and impl == "auto" and choice not in _FUSED:
            # the fused kernel measured no faster than cuBLAS + the gating pass (H200,
            # 2026-11-25, forward kernel time: 0.2075 against 0.2010 ms at 16384 x 768 ->
            # 2 x 2048, 0.6366 against 0.6353 at 8192 x 2048 -> 2 x 5632; modern_ops.md);
            # decode-sized products too (the fused few-rows tiles are not measured)
            return ("cublas+ew",)
        if epi == "+relu2grad+drop" and ew and impl == "auto" and choice not in _FUSED:
            # with the dropout mask the fused epilogue measured slower than cuBLAS + the pass
            # at enwik8's feed-forward (H200, 2026-11-25, the feed-forward's fwd+bwd kernel
            # time, benchmarks/probe_relu2_mlp.py: 0.2311 against 0.2176 ms at 8192 tokens,
            # 0.7919 against 0.7871 at GPT-2's 16384 x 768 -> 3072; faster only at the large
            # preset's, whose table entry says so)
            return ("cublas+ew",)
        if M <= 16 and half:
            return _plan_few_rows(K, impl, plain, swiglu)
        if plain and impl == "auto" and choice not in ("tma", "ptr"):
            return ("cublas",)
    tma = major in (9, 10) and half and a_t >= 0 and b_t >= 0 and (N * out_size) % 16 == 0
    if tma and tracing and ew and force is None and impl != "triton" and choice != "ptr":
        # torch.compile: where eager runs the fused TMA kernel, cuBLAS's product and our
        # relu² (or SwiGLU) pass (inductor launches cuBLAS itself) rather than the pointer
        # kernel
        return ("cublas+ew",)
    if force == "ptr" or not tma or choice == "ptr" or tracing:
        return ("ptr", _ptr_config(M, N, K, 1, dtype, False, swiglu))
    return ("tma", _split_k(M, N, K, num_sms) if epi == "" else 1, num_sms)


def _transposed(t: int) -> int:
    """The `_plan` layout of a transposed view of an operand of layout t (-1 stays -1)."""
    return t if t < 0 else 1 - t


def plain_products_on_cublas(
    a: torch.Tensor, b: torch.Tensor, weight_grad: bool, residual: bool = False
) -> bool:
    """Whether cuBLAS runs all three GEMMs of c = a @ b [+ residual] and its backward under
    the current plan: the product (torch.addmm with a residual), dA = dC @ b^T, and
    dB = a^T @ dC, or with `weight_grad` its transpose dC^T @ a (`bmm.linear`'s weight
    gradient, in the weight's (N, K) layout).

    a (M, K) and b (K, N) are 2-D, or 3-D with a batch other than 1 (torch.bmm unless our
    kernel is asked for, `_bmm_into`), on CUDA, of one dtype (the residual's too), with no
    other epilogue. dC is taken to be contiguous, the common case. Then PyTorch's own op
    computes those same three cuBLAS products, with its C++ autograd and none of our Python
    around them: `bmm.bmm` and `bmm.linear` run it for such eager calls.
    """
    if not _cublas_allowed(a):
        return False
    if a.dim() == 3:
        if a.shape[0] != 1:  # torch.bmm (an empty batch too: nothing to launch)
            return True
        a, b = a[0], b[0]
    (M, K), N = a.shape, b.shape[1]
    return _plain_on_cublas(
        a.device.index, a.dtype, int(M), int(N), int(K), _orientation(a), _orientation(b),
        weight_grad, residual, matmul_impl,
    )  # fmt: skip


def residual_product(residual: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """residual + a @ b with PyTorch's own ops, as the plan computes it (a, b 2-D on CUDA and
    the residual (M, N), all of one dtype, where `plain_products_on_cublas(a, b, ...,
    residual=True)`): torch.addmm, or torch.mm and then the add where the table says
    "cublas+ew"."""
    (M, K), N = a.shape, b.shape[1]
    plan = _plan(
        a.device.type, a.device.index, a.dtype, int(M), int(N), int(K), _orientation(a),
        _orientation(b), "+res", True, a.element_size(), matmul_impl, _FORCE_PATH,
    )  # fmt: skip
    if plan[0] == "cublas+ew":
        return torch.mm(a, b).add_(residual)
    return torch.addmm(residual, a, b)


def plain_linear_on_cublas(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`plain_products_on_cublas(x2, weight.t(), weight_grad=True)` for `bmm.linear`'s x
    (..., K), read as x2 (M, K), and weight (N, K) of x's dtype, without making either view:
    a view of a tensor that requires grad costs an eager call microseconds of host time."""
    if not _cublas_allowed(x):
        return False
    N, K = weight.shape
    M = x.numel() // K if K else 0
    if x.dim() == 2:
        x_t = _orientation(x)
    elif x.is_contiguous():  # x2 is row-major, K elements apart
        aligned = (x.storage_offset() * x.element_size()) % 16 == 0
        x_t = 0 if aligned and (K * x.element_size()) % 16 == 0 else -1
    else:  # x2 as linear makes it (a copy where the dims do not merge)
        x_t = _orientation(x.unsqueeze(0) if x.dim() == 1 else x.flatten(0, -2))
    return _plain_on_cublas(
        x.device.index, x.dtype, int(M), int(N), int(K), x_t, _transposed(_orientation(weight)),
        True, False, matmul_impl,
    )  # fmt: skip


def _cublas_allowed(x: torch.Tensor) -> bool:
    """Whether the plan may give a product of x's device to cuBLAS at all (CUDA, and neither
    `matmul_impl="triton"` nor a forced path)."""
    return x.device.type == "cuda" and matmul_impl != "triton" and _FORCE_PATH is None


def _orientation(x: torch.Tensor) -> int:
    """`_plan`'s layout of 2-D x: 0 row-major, 1 transposed, -1 not TMA-describable."""
    layout = _layout(x)
    return layout[0] if layout else -1


@functools.cache
def _plain_on_cublas(
    index: int, dtype: torch.dtype, M: int, N: int, K: int, a_t: int, b_t: int,
    weight_grad: bool, residual: bool, impl: str,
) -> bool:  # fmt: skip
    if M == 0 or N == 0 or K == 0:
        return False  # our path's empty products (no GEMM at all)
    size = dtype.itemsize
    dc_t = 0 if (N * size) % 16 == 0 else -1  # a contiguous (M, N) dC

    def cublas(m: int, n: int, k: int, lhs_t: int, rhs_t: int, epi: str = "") -> bool:
        plan = _plan("cuda", index, dtype, m, n, k, lhs_t, rhs_t, epi, True, size, impl, None)
        return plan[0] == "cublas" or (epi == "+res" and plan[0] == "cublas+ew")

    if weight_grad:  # dB^T = dC^T @ a: (N, K), summed over M
        db = cublas(N, K, M, _transposed(dc_t), a_t)
    else:  # dB = a^T @ dC: (K, N)
        db = cublas(K, N, M, _transposed(a_t), dc_t)
    product = cublas(M, N, K, a_t, b_t, "+res" if residual else "")
    return product and cublas(M, K, N, dc_t, _transposed(b_t)) and db


# Decode-sized products (M <= 16 rows: a token per sequence) stream the weight once, so they
# are latency- and bandwidth-bound: many narrow programs, each walking a long K step. H200,
# enwik8 decode shapes, kernel time (benchmarks/probe_decode_gemm.py, 2026-11-22): this config
# 2.7-3.7 us at K = 512 (cuBLAS 3.0-3.7, the TMA kernel 6.5-8.2, torch's mm + relu + square
# 5.7); at K = 2048 cuBLAS wins (5.4 vs 6.2 us), so plain products with a long K go there under
# "auto".
_FEW_ROWS_PTR = (16, 16, 256, 8, 4, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages
# The SWIGLU epilogue's (two accumulators, two B tiles): a 128-deep K step, which compiles for
# sm_90 without spilling registers (256 spilled 152 bytes). Not measured yet.
_FEW_ROWS_PTR_SWIGLU = (16, 16, 128, 8, 4, 3)


def _plan_few_rows(K: int, impl: str, cublas_ok: bool, swiglu: bool = False) -> tuple:
    """The plan of a decode-sized fp16/bf16 problem (cublas_ok: cuBLAS computes it whole)."""
    if cublas_ok and impl == "auto" and K >= 2048:
        return ("cublas",)
    return ("ptr", _FEW_ROWS_PTR_SWIGLU if swiglu else _FEW_ROWS_PTR)


_EPI = {  # (relu², residual) -> the table's key suffix
    (False, False): "",
    (True, False): "+relu2",
    (False, True): "+res",
    (True, True): "+relu2+res",
}


# Eager launches after the first: (grid, tuned config kwargs) per problem, so that the
# autotuner's per-call work is skipped. Filled from the autotuner's pick.
_TUNED: dict[tuple, tuple] = {}


def _dropout_args(drop: tuple[float, torch.Tensor] | None, placeholder: torch.Tensor) -> tuple:
    """(SEED, threshold, drop_scale) kernel arguments of an epilogue dropout (p, seed)."""
    if drop is None:
        return placeholder, 0, 1.0
    p, seed = drop
    return seed, dropout_threshold(p), 1.0 / (1.0 - p)


def launch_mm_tma(
    a, b, c, r, aux, relu_squared, a_lay, b_lay, split, num_sms, drop, swiglu=False, grad=None,
    bind=False,
) -> Callable[..., None] | None:  # fmt: skip
    """Persistent TMA kernel (autotuned) for 2-D a (M, K), b (K, N) into c (M, N); with
    swiglu, b (K, 2·N) is [gate | up] and aux (M, 2·N) receives both pre-activations
    (`_mm_tma_swiglu_tuned`, tuned over its own configs); grad: (s, from_square) of the
    RELU2_GRAD epilogue (s row-major, TMA-describable). bind (no residual, aux or split):
    return the tuned launch bound, again(a, b, c, s, seed) as `bind_mm2d`'s; None before the
    problem is tuned."""
    M, K = a.shape
    N = c.shape[1]
    # A context variable in Triton: set it in whichever thread launches (autograd's too).
    triton.set_allocator(tma_scratch)
    ws = c
    if split > 1:
        ws = torch.empty(size=(split, M, N), device=c.device, dtype=torch.float32)
    if grad is not None:  # the epilogue reads s where a residual would be
        r = grad[0]
    rs = r.stride() if r is not None else (0, 0)
    xs = aux.stride(0) if aux is not None else N
    args = (
        a, b, c, r if r is not None else c, aux if aux is not None else c, ws,
        M, N, K, a_lay[1], b_lay[1], N, rs[0], rs[1], xs, split, *_dropout_args(drop, c),
    )  # fmt: skip
    flags = {
        "A_T": bool(a_lay[0]),
        "B_T": bool(b_lay[0]),
        "RELU_SQUARED": relu_squared,
        "HAS_RESIDUAL": r is not None and grad is None,
        "STORE_AUX": aux is not None,
        "DROPOUT": drop is not None,
        "SWIGLU": swiglu,
        "SPLIT": split > 1,
        "NUM_SMS": num_sms,
        "RELU2_GRAD": _relu2_grad_flag(grad),
    }

    def grid(meta):
        bm, bn = meta["BLOCK_M"], meta["BLOCK_N"]
        return (min(num_sms, ((M + bm - 1) // bm) * ((N + bn - 1) // bn) * split),)

    autotuned = _mm_tma_swiglu_tuned if swiglu else _mm_tma_tuned
    if is_traced(a):  # torch.compile: inductor tunes and launches
        wrap_triton(autotuned)[grid](*args, **flags)
    else:
        key = (M, N, K, split, a_lay[0], b_lay[0], relu_squared, r is not None)
        key += (aux is not None, a.dtype, c.dtype, None if r is None else r.dtype, num_sms)
        key += (drop is not None, swiglu, flags["RELU2_GRAD"])
        tuned = _TUNED.get(key)
        if tuned is not None and bind and split == 1:
            bound = launcher(_mm_tma_kernel).bind(tuned[0], *args, **flags, **tuned[1])

            # the bound tensors: a, b, c, the residual's slot (s), aux's, the workspace's, seed
            def again(a, b, c, s, seed) -> None:
                triton.set_allocator(tma_scratch)  # per launching thread, as above
                bound(a, b, c, c if s is None else s, c, c, c if seed is None else seed)

            return again
        if tuned is not None:
            launcher(_mm_tma_kernel)[tuned[0]](*args, **flags, **tuned[1])
        else:
            autotuned[grid](*args, **flags)
            best = getattr(autotuned, "best_config", None)
            if best is not None:
                _TUNED[key] = (grid(best.kwargs), best.all_kwargs())
    if split > 1:
        mn = M * N
        launcher(_splitk_reduce_kernel)[(cdiv(mn, 1024),)](ws, c, mn, split, BLOCK=1024)
    return None


def launch_mm_ptr(
    a, b, c, r, aux, relu_squared, cfg, interpret, drop=None, swiglu=False, grad=None,
    bind=False,
) -> Callable[..., None] | None:  # fmt: skip
    """Pointer kernel over 3-D views a (B, M, K), b (B, K, N), c (B, M, N); with swiglu (batch
    1), b (1, K, 2·N) is [gate | up] and aux (M, 2·N) receives both pre-activations; grad
    (batch 1): (s, from_square) of the RELU2_GRAD epilogue. bind (batch 1, no residual or
    aux, no bf16 in the interpreter): return the launch bound, again(a, b, c, s, seed) as
    `bind_mm2d`'s, for 2-D a, b, c (the kernel reads their strides as bound)."""
    has_residual = r is not None
    if grad is not None:  # the epilogue reads s where a residual would be
        r = grad[0]
    c_out, aux_out = c, aux
    # interpreted, a bound launch takes only what it reads as given (no bf16: no widened copies)
    bind = bind and a.shape[0] == 1 and not (interpret and any(
        t is not None and t.dtype == torch.bfloat16 for t in (a, b, r, c, aux)))  # fmt: skip
    if interpret:
        # Triton's interpreter has no bf16 arithmetic and rounds stores to bf16 by truncation:
        # it gets fp32 operands and writes fp32 buffers, cast here as a GPU's store rounds
        a, b, r = widened_for_interpreter(a, b, r)
        c, aux = _fp32_buffer(c), _fp32_buffer(aux)
    batch, M, K = a.shape
    N = c.shape[2]
    block_m, block_n, block_k, group_m, num_warps, num_stages = cfg
    # ieee: exact fp32 products (tf32 would cost ~1e-3 relative error); fp16/bf16 operands
    # ignore the setting and always use tensor cores.
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    rs = r.stride()[-2:] if r is not None else (0, 0)
    xs = aux.stride(-2) if aux is not None else N
    grid_mn = cdiv(M, block_m) * cdiv(N, block_n)
    for start in range(0, batch, _MAX_GRID_BATCH):
        # Slice only when the batch needs several launches: views cost host time.
        end = min(batch, start + _MAX_GRID_BATCH)
        a_, b_, c_ = a, b, c
        if end - start < batch:
            a_, b_, c_ = a[start:end], b[start:end], c[start:end]
        launch = launcher(_mm_ptr_kernel)
        launch = launch.bind if bind else launch[(grid_mn, end - start)]
        bound = launch(
            *(((grid_mn, 1),) if bind else ()),
            a_, b_, c_, r if r is not None else c_, aux if aux is not None else c_,
            M, N, K, *a_.stride(), *b_.stride(), *c_.stride(), rs[0], rs[1], xs,
            *_dropout_args(drop, c_),
            RELU_SQUARED=relu_squared, HAS_RESIDUAL=has_residual, STORE_AUX=aux is not None,
            DROPOUT=drop is not None, SWIGLU=swiglu, DOT_PRECISION=precision,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
            RELU2_GRAD=_relu2_grad_flag(grad), num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    if interpret:
        for out, buffer in ((c_out, c), (aux_out, aux)):
            if out is not buffer:
                out.copy_(buffer)  # round to nearest, as a GPU's store does
    if not bind:
        return None

    # the bound tensors: a, b, c, the residual's slot (s), aux's, seed
    def again(a, b, c, s, seed) -> None:
        bound(a, b, c, c if s is None else s, c, c if seed is None else seed)

    return again


def _fp32_buffer(t: torch.Tensor | None) -> torch.Tensor | None:
    """An fp32 stand-in for a bf16 output of an interpreted launch (t itself otherwise)."""
    if t is None or t.dtype != torch.bfloat16:
        return t
    return torch.empty(size=t.shape, dtype=torch.float32, device=t.device)


def _relu2_grad_flag(grad: tuple[torch.Tensor, bool] | None) -> int:
    """The kernels' RELU2_GRAD: 0 none, 1 s holds relu(pre), 2 s holds relu²'s output."""
    return 0 if grad is None else 2 if grad[1] else 1


def _gluon_epilogue(
    relu_squared: bool,
    residual: torch.Tensor | None,
    aux: torch.Tensor | None,
    drop: tuple | None,
    swiglu: bool,
    grad: tuple[torch.Tensor, bool] | None,
) -> str | None:
    """The `matmul_hopper` epilogue of a product with these epilogue arguments (those of
    `_mm2d_into`), or None where the Gluon kernel has none: relu² and its dropout (no kept
    relu(y) beside it), or relu²'s gradient: without a dropout mask, or read from the
    forward's output after its dropout, which holds the mask (`matmul_hopper`'s docstring)."""
    if residual is not None or aux is not None or swiglu:
        return None
    if grad is not None:
        if grad[1]:
            return "relu2grad_from_square"
        return "relu2grad" if drop is None else None
    if relu_squared:
        return "relu2" if drop is None else "relu2_dropout"
    return None


def _takes_gluon(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, num_sms: int, relu_squared: bool,
    residual: torch.Tensor | None, aux: torch.Tensor | None, drop: tuple | None, swiglu: bool,
    grad: tuple[torch.Tensor, bool] | None,
) -> bool:  # fmt: skip
    """Whether a problem of `_mm2d_into` runs as `matmul_hopper`'s Gluon kernel: it has the
    epilogue, `matmul_hopper.usable` takes the tensors, and traced code may call it
    (`mm_opaque_op`, `TRACED_OPAQUE`)."""
    epilogue = _gluon_epilogue(relu_squared, residual, aux, drop, swiglu, grad)
    kept = grad[0] if grad is not None else None
    if epilogue is None or not matmul_hopper.usable(a, b, c, kept, num_sms):
        return False
    return TRACED_OPAQUE or not is_traced(a)


def _launch_gluon(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, b_lay: tuple[int, int], num_sms: int,
    relu_squared: bool, drop: tuple | None, grad: tuple[torch.Tensor, bool] | None,
    bind: bool = False,
) -> Callable[..., None] | None:  # fmt: skip
    """Run a problem `_takes_gluon` as `matmul_hopper`'s Gluon kernel. b_lay: b's TMA
    layout (`_layout`), a transposed view of an (N, K) tensor or row-major (K, N). Traced
    (torch.compile), the launch is `mm_opaque_op`, which inductor calls as it is. bind: return
    the launch bound, again(a, b, c, s, seed) as `bind_mm2d`'s."""
    epilogue = _gluon_epilogue(relu_squared, None, None, drop, False, grad)
    kept = grad[0] if grad is not None else None
    p, seed = drop if drop is not None else (0.0, None)
    if is_traced(a):
        mm_opaque_op(a, b, c, relu_squared, p, seed, kept, grad is not None and grad[1])
        return None
    b_t = bool(b_lay[0])  # the kernel reads b as stored: (N, K) when b is its transpose
    bound = matmul_hopper.launch_mm_sm90(
        a, b.t() if b_t else b, c, b_t, epilogue, kept, num_sms, p=p,
        seed=seed if epilogue == "relu2_dropout" else None, bind=bind,
    )  # fmt: skip
    if bound is None:
        return None
    draws = epilogue == "relu2_dropout"

    # b's storage is what the kernel reads, whether b is its transpose or not
    def again(a, b, c, s, seed) -> None:
        bound(a, b, c, c if s is None else s, seed if draws else c)

    return again


def _empty_product(a: torch.Tensor, c: torch.Tensor, residual, aux) -> bool:
    """Write a product with no output or an empty sum (K = 0) without a kernel, and say
    whether it was one: relu(0)² = 0, silu(0)·0 = 0, d(pre) = 0 · slope (aux: relu(0) or the
    zero pre-activations); act(0) = 0 leaves nothing for a dropout to scale."""
    if c.numel() == 0:
        return True
    if a.shape[1] != 0:
        return False
    if residual is None:
        c.zero_()
    else:
        c.copy_(residual)
    if aux is not None:
        aux.zero_()
    return True


def _route(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, relu_squared: bool,
    residual: torch.Tensor | None, aux: torch.Tensor | None, drop: tuple | None, swiglu: bool,
    grad: tuple[torch.Tensor, bool] | None,
) -> tuple:  # fmt: skip
    """How `_mm2d_into` runs a non-empty product: (path, plan, a_lay, b_lay), path one of
    "gluon", "tma", "ptr", "cublas" and "cublas+ew"; plan `_plan`'s; a_lay, b_lay the
    operands' TMA layouts (`_layout`, CUDA only)."""
    M, K = a.shape
    N = c.shape[1]
    device = a.device
    M, N, K = int(M), int(N), int(K)  # symbolic sizes: specialise (plans are per shape)
    epi = "+swiglu" if swiglu else _EPI[relu_squared, residual is not None]
    if grad is not None:  # the mask's draws cost the epilogue more than the separate pass
        epi = "+relu2grad+drop" if drop is not None else "+relu2grad"
    if device.type != "cuda":  # the interpreter; torch.mm where a test forces "cublas+ew"
        cublas_ok = c.dtype == a.dtype and (residual is None or residual.dtype == a.dtype)
        plan = _plan(
            device.type, 0, a.dtype, M, N, K, -1, -1, epi, cublas_ok, c.element_size(),
            matmul_impl, _FORCE_PATH,
        )  # fmt: skip
        return plan[0], plan, None, None
    a_lay, b_lay = _layout(a), _layout(b)
    if grad is not None and _orientation(grad[0]) != 0:
        a_lay = None  # the epilogue's descriptor of s needs it row-major: no TMA
    a_t, b_t = a_lay[0] if a_lay else -1, b_lay[0] if b_lay else -1  # `_plan`'s layouts
    traced = is_traced(a)
    # cuBLAS computes the product in one dtype, addmm's residual in that dtype, and
    # fp16/bf16 products written in fp32 (the weight gradients of mixed precision; while
    # tracing only where mm's out_dtype has a meta kernel)
    widen = c.dtype == torch.float32 and residual is None
    widen = widen and (not traced or _MM_OUT_DTYPE_TRACEABLE)
    cublas_ok = c.dtype == a.dtype or widen
    if residual is not None:
        cublas_ok = cublas_ok and residual.dtype == a.dtype
    plan = _plan(
        "cuda", device.index, a.dtype, M, N, K, a_t, b_t, epi, cublas_ok, c.element_size(),
        matmul_impl, _FORCE_PATH, traced and not compile_tma(),
    )  # fmt: skip
    # Hopper's Gluon kernel for eager "tma" problems it has the epilogue of, and for relu²'s
    # gradient after a dropout, read from the forward's output, whatever the plan (it
    # needs no mask there; GPT-2 preset at dropout 0.1: the step 1.014× the one with
    # cuBLAS + the pass regenerating the mask, `step_gpt2_dropout_session19*.md`).
    # A forced "tma" means the Triton kernel: tests and benchmarks compare them.
    if not traced or compile_tma():  # a traced plan differs only without TMA kernels
        eager_tma = plan[0] == "tma"
    else:
        eager_tma = _plan(
            "cuda", device.index, a.dtype, M, N, K, a_t, b_t, epi, cublas_ok,
            c.element_size(), matmul_impl, _FORCE_PATH,
        )[0] == "tma"  # fmt: skip
    gluon_first = eager_tma or (epi == "+relu2grad+drop" and grad[1])
    if gluon_first and _FORCE_PATH is None:  # noqa: SIM102
        if _takes_gluon(a, b, c, sm_count(device), relu_squared, residual, aux, drop, swiglu,
                        grad):  # fmt: skip
            return "gluon", plan, a_lay, b_lay
    return plan[0], plan, a_lay, b_lay


def _mm2d_into(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    relu_squared: bool = False,
    residual: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    drop: tuple[float, torch.Tensor] | None = None,
    swiglu: bool = False,
    grad: tuple[torch.Tensor, bool] | None = None,
) -> None:
    """c = dropout(act(a @ b)) [+ residual] for 2-D a (M, K), b (K, N) of any strides; c
    (M, N) fresh.

    aux (M, N, contiguous, a's dtype): with relu_squared, also receives relu(a @ b).
    drop: (p, seed) of a dropout after the activation (relu_squared only), or None.
    swiglu (no residual, dropout or relu²): b is (K, 2·N), [gate | up] columns (the weight's
    [gate; up] rows, transposed); c = silu(a @ b_gate) * (a @ b_up), and aux (M, 2·N,
    contiguous, a's dtype; required) receives a @ b itself, the pre-activations the backward
    reads. Fused in the matmul's epilogue, or cuBLAS's product into aux, then
    `swiglu.launch_swiglu_fwd` ("cublas+ew").
    grad (no other epilogue; drop allowed): (s, from_square), relu²'s backward: c = (a @ b) ·
    2·relu(pre) [· the forward's mask / (1 - p)], relu(pre) = sqrt(s (1 - p)) if from_square
    else s (M, N, any strides): fused in the epilogue, or cuBLAS's product, then
    `_relu2_grad_kernel` in place ("cublas+ew").
    """
    if _empty_product(a, c, residual, aux):
        return
    route = _route(a, b, c, relu_squared, residual, aux, drop, swiglu, grad)
    _run(route, a, b, c, relu_squared, residual, aux, drop, swiglu, grad)


def _run(
    route: tuple, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, relu_squared: bool,
    residual: torch.Tensor | None, aux: torch.Tensor | None, drop: tuple | None, swiglu: bool,
    grad: tuple[torch.Tensor, bool] | None, bind: bool = False,
) -> Callable[..., None] | None:  # fmt: skip
    """Launch `_route`'s path for `_mm2d_into`'s problem. bind (no residual; aux only with
    swiglu on "cublas+ew"): return the launches bound, again(a, b, c, s, seed) as
    `bind_mm2d`'s, or None where this path has none (the pointer kernel in the interpreter, a
    TMA problem before its tuning or split over K)."""
    path, plan, a_lay, b_lay = route
    if path == "gluon":
        return _launch_gluon(a, b, c, b_lay, sm_count(a.device), relu_squared, drop, grad, bind)
    if path == "tma":
        return launch_mm_tma(
            a, b, c, residual, aux, relu_squared, a_lay, b_lay, plan[1], plan[2], drop, swiglu,
            grad, bind,
        )  # fmt: skip
    if path == "ptr":
        interpret = a.device.type != "cuda"
        bound = launch_mm_ptr(
            a[None], b[None], c[None], residual, aux, relu_squared, plan[1], interpret, drop,
            swiglu, grad, bind,
        )  # fmt: skip
        if bound is None:
            return None
        return lambda a, b, c, s, seed: bound(a, b, c, s, seed)
    if path == "cublas+ew" and residual is not None and residual is not c:
        torch.mm(a, b, out=c)
        c.add_(residual)
    elif residual is not None:
        # the residual as cuBLAS's own C input (beta = 1); also where it is c itself (a
        # gradient accumulated in place), which the product would overwrite before the add
        torch.addmm(residual, a, b, out=c)
    elif path == "cublas+ew" and swiglu:
        torch.mm(a, b, out=aux)  # [gate | up], kept for the backward
        n = c.shape[1]
        gating = launch_swiglu_fwd(aux[:, :n], aux[:, n:], c, bind)  # the gating pass
        if bind:

            def again(a, b, c, aux, seed) -> None:
                torch.mm(a, b, out=aux)
                gating(aux[:, :n], aux[:, n:], c)

            return again
    else:
        widened = c.dtype != a.dtype  # fp32 accumulator written as is, no cast pass
        if widened:
            torch.mm(a, b, c.dtype, out=c)
        else:
            torch.mm(a, b, out=c)
        after = None
        if path == "cublas+ew" and grad is not None:
            after = launch_relu2_grad(c, grad[0], c, grad[1], drop, bind)
        elif path == "cublas+ew":
            after = _relu2_in_place(c, aux, drop, bind)
        if bind:
            return _bound_cublas(widened, path == "cublas+ew", after)
    return None


def _bound_cublas(widened: bool, ew: bool, after: Callable | None) -> Callable | None:
    """`_run`'s bound launches of a cuBLAS path: torch.mm, then the bound relu² pass."""
    if ew and after is None:
        return None

    def again(a, b, c, s, seed) -> None:
        if widened:
            torch.mm(a, b, c.dtype, out=c)
        else:
            torch.mm(a, b, out=c)
        if ew:
            after(c, s, seed)

    return again


def bind_mm2d(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    relu_squared: bool = False,
    drop: tuple[float, torch.Tensor] | None = None,
    grad: tuple[torch.Tensor, bool] | None = None,
    swiglu_pre: torch.Tensor | None = None,
) -> Callable[..., None] | None:
    """`_mm2d_into(a, b, c, relu_squared, drop=drop, grad=grad)` (no residual), or with
    swiglu_pre `_mm2d_into(a, b, c, aux=swiglu_pre, swiglu=True)`, for an eager caller that
    repeats it with tensors of these same layouts (shapes, strides, dtypes, 16-byte
    alignment, device) and module switches (`matmul_impl`, `_FORCE_PATH`): computes c now,
    and returns again(a, b, c, s, seed), which launches what this call launched for new
    tensors without planning it again (s: grad's tensor, or swiglu's pre-activations; seed:
    drop's; None where absent). None where there is nothing to bind (traced, empty, a path
    without bound launches yet, SwiGLU fused in a Triton epilogue): call this again next
    time."""
    swiglu = swiglu_pre is not None
    if _empty_product(a, c, None, swiglu_pre):
        return None
    route = _route(a, b, c, relu_squared, None, swiglu_pre, drop, swiglu, grad)
    bind = not is_traced(a) and (not swiglu or route[0] == "cublas+ew")
    return _run(route, a, b, c, relu_squared, None, swiglu_pre, drop, swiglu, grad, bind)


class BoundProducts:
    """The bound products of an op's eager plan (`bmm._EagerPlan`, `mlp._EagerPlan`), one per
    slot: `run(slot, a, b, c, ...)` computes c as `_mm2d_into` would, through the slot's
    bound launches (`bind_mm2d`), made on the first call that can bind them. A slot stands
    for one layout of each operand: a caller whose operands' layouts vary (an upstream
    gradient) puts that layout in the slot's key."""

    __slots__ = ("bound",)

    def __init__(self) -> None:
        self.bound: dict[object, Callable[..., None] | None] = {}

    def run(
        self,
        slot: object,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        relu_squared: bool = False,
        drop: tuple[float, torch.Tensor] | None = None,
        grad: tuple[torch.Tensor, bool] | None = None,
        swiglu_pre: torch.Tensor | None = None,
    ) -> None:
        """c = the product of `bind_mm2d`'s arguments (swiglu_pre: SwiGLU's, written too)."""
        again = self.bound.get(slot)
        if again is not None:
            s = swiglu_pre if grad is None else grad[0]
            again(a, b, c, s, None if drop is None else drop[1])
        else:
            self.bound[slot] = bind_mm2d(a, b, c, relu_squared, drop, grad, swiglu_pre)


def _relu2_in_place(
    c: torch.Tensor,
    aux: torch.Tensor | None,
    drop: tuple[float, torch.Tensor] | None,
    bind: bool = False,
) -> Callable[..., None] | None:
    """c (M, N, contiguous) = dropout(relu(c)²) in place, aux = relu(c) if given: the relu²
    epilogue after cuBLAS's product (`_relu2_ew_kernel`). bind (no aux): return the launch
    bound, again(c, s, seed) (s unused)."""
    M, N = c.shape
    grid = (cdiv(M, 16), cdiv(N, 256))
    launch = launcher(_relu2_ew_kernel)
    # 16 x 256 tiles, 4 warps: the d(pre) pass's (`launch_relu2_grad`), also one read and write
    bound = (launch.bind if bind else launch[grid])(
        *((grid,) if bind else ()), c, aux if aux is not None else c, M, N,
        *_dropout_args(drop, c), STORE_AUX=aux is not None, DROPOUT=drop is not None,
        BLOCK_M=16, BLOCK_N=256, num_warps=4,
    )  # fmt: skip
    if not bind:
        return None
    return lambda c, s, seed: bound(c, c, c if seed is None else seed)


def launch_relu2_grad(
    dy: torch.Tensor,
    s: torch.Tensor,
    dp: torch.Tensor,
    from_square: bool,
    drop: tuple[float, torch.Tensor] | None,
    bind: bool = False,
) -> Callable[..., None] | None:
    """dp (M, N, contiguous) = dy · 2·relu(pre) [· the forward's mask / (1 - p)] for dy and s
    (M, N) of any strides, relu(pre) = sqrt(s) if from_square else s: `_relu2_grad_kernel`.
    Each element is read and written by the same program, so dp may be dy itself: relu²'s
    backward in place after cuBLAS's product dY @ W ("cublas+ew"), or `relu2_grad_op`. bind:
    return the launch bound, again(dp, s, seed) for dy = dp ("cublas+ew"), or
    again(dy, s, dp, seed) where dy is not dp."""
    M, N = dp.shape
    grid = (cdiv(M, 16), cdiv(N, 256))
    launch = launcher(_relu2_grad_kernel)
    bound = (launch.bind if bind else launch[grid])(
        *((grid,) if bind else ()), dy, s, dp, M, N, *dy.stride(), *s.stride(),
        *_dropout_args(drop, dp), FROM_SQUARE=from_square, DROPOUT=drop is not None,
        BLOCK_M=16, BLOCK_N=256, num_warps=4,
    )  # fmt: skip
    if not bind:
        return None
    if dy is dp:
        return lambda dp, s, seed: bound(dp, s, dp, dp if seed is None else seed)
    return lambda dy, s, dp, seed: bound(dy, s, dp, dp if seed is None else seed)


# Whether torch.addmm(..., out_dtype=float32) accepts an fp32 accumulator with fp16/bf16
# factors on this torch (None: not tried yet). Without it the Triton GEMM's residual epilogue
# accumulates.
_addmm_out_dtype_ok: bool | None = None


def accumulate_mm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c += a @ b in place, for 2-D a (M, K), b (K, N) and c (M, N) in a's dtype or fp32 (a
    weight's gradient summed over chunks or micro-batches): cuBLAS with c as its own C input
    (beta = 1) where it can, else our kernel's residual epilogue (each program reads its
    residual tile before it stores the same tile, so the two may alias)."""
    global _addmm_out_dtype_ok
    if c.numel() == 0:
        return
    if c.device.type == "cuda" and not is_traced(c) and matmul_impl != "triton":
        if a.dtype == c.dtype:
            torch.addmm(c, a, b, out=c)
            return
        if _addmm_out_dtype_ok is not False:
            try:  # cuBLAS with an fp32 C; older torch requires C in the factors' dtype
                torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
                _addmm_out_dtype_ok = True
                return
            except (RuntimeError, TypeError, NotImplementedError):
                _addmm_out_dtype_ok = False
    _mm2d_into(a, b, c, residual=c)


def _bmm_into(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """c[i] = a[i] @ b[i] for 3-D views of any strides: torch.bmm on CUDA (unless
    `matmul_impl` is "triton" or a path is forced), else the pointer kernel; batch 1 is 2-D."""
    batch, M, K = (int(d) for d in a.shape)  # symbolic sizes: specialise
    if batch == 1:
        _mm2d_into(a[0], b[0], c[0])
        return
    if c.numel() == 0:
        return
    if K == 0:
        c.zero_()
        return
    interpret = a.device.type != "cuda"
    # a plain product: cuBLAS's batched GEMM unless our kernel is asked for
    if not interpret and matmul_impl != "triton" and _FORCE_PATH is None and c.dtype == a.dtype:
        torch.bmm(a, b, out=c)
        return
    cfg = _ptr_config(M, int(b.shape[2]), K, batch, a.dtype, interpret)
    launch_mm_ptr(a, b, c, None, None, False, cfg, interpret)
