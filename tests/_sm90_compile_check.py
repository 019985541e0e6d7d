"""Run by tests in a subprocess (TRITON_INTERPRET=0): compile kernels for sm_90 on a CPU machine,
typing their float scalars fp64 as torch.compile's launcher does (eager launches type them fp32).

Triton compiles front end to machine code without a GPU, so a kernel that only breaks under
torch.compile (an fp64 scale promoting an fp32 accumulator, for one) fails here too. Prints one
line per kernel; exits non-zero on the first failure.
"""

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from triton_transformer import adamw, matmul_kernels
from triton_transformer import attention as attn
from triton_transformer import cross_entropy as ce
from triton_transformer import embedding as emb


def signature(kernel, pointers: dict[str, str], floats: set[str], constants: dict) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp64" if name in floats else "i32"
    return sig


def with_defaults(kernel, constants: dict) -> dict:
    """constants plus the defaults of the constexprs they leave out, as a launch takes them."""
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    return {**defaults, **constants}


def compile_sm90(kernel, pointers, floats, constants):
    constants = with_defaults(kernel, constants)
    sig = signature(kernel, pointers, floats, constants)
    names = list(sig)
    src = ASTSource(
        fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constants.items()}
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


bf16 = "*bf16"
common = dict(HEAD_DIM=64, BLOCK_D=64, CAUSAL=True, HAS_KPM=False, DROPOUT=True,
              DROP_INT64=False, INT64_ROWS=False, IEEE=False, GROUP=1)  # fmt: skip
fwd_ptrs = dict(Q=bf16, K=bf16, V=bf16, Out=bf16, LSE="*fp32", KPM=bf16, SEED="*i64",
                KV_LEN="*i64", PART_ACC="*fp32", PART_ML="*fp32")  # fmt: skip
compile_sm90(
    attn._attention_fwd_kernel, fwd_ptrs, {"qk_scale", "out_scale"},
    dict(common, BLOCK_M=128, BLOCK_N=64, WRITE_LSE=True, FOLD_SCALE=True, HAS_KV_LEN=False,
         SPLIT_K=False),
)  # fmt: skip
print("attention forward: ok")
bwd_ptrs = dict(Q=bf16, K=bf16, V=bf16, DO=bf16, DQ=bf16, DK=bf16, DV=bf16, LSE="*fp32",
                DELTA="*fp32", KPM=bf16, SEED="*i64", DQ_ACC="*fp32", OUT=bf16)  # fmt: skip


def bwd_pointers(tma: bool, dq_host_desc: bool) -> dict:
    """The backward's pointers, and its descriptors as the host makes them (BLOCK_M1 = 32,
    BLOCK_N2 = 32, BLOCK_D = 64), or placeholder pointers."""
    tile = "tensordesc<bf16[1, 1, 32, 64]>" if tma else bf16
    dq = "tensordesc<fp32[1, 32, 64]>" if dq_host_desc else bf16
    return {**bwd_ptrs, "Q_DESC": tile, "K_DESC": tile, "V_DESC": tile, "DO_DESC": tile,
            "DQ_DESC": dq}  # fmt: skip


# the deterministic two-program kernel, the single pass with dQ added by TMA bulk reductions
# (Hopper) and by per-element atomics (the interpreter's path), tile loads through pointers or
# host-made TMA descriptors; dQ, dK, dV in one packed tensor or three. (True, True, False,
# False, True) is the single pass as torch.compile traces the model's packed attention (TMA
# reductions through a descriptor the kernel makes, pointer loads). The last two: the one-launch
# backward of short heads (dQ stored whole, no reductions), with pointer and TMA tile loads.
for atomic, dq_tma, dq_host, tma, packed, direct in (
    (False, False, False, False, False, False), (False, False, False, True, True, False),
    (True, True, True, True, True, False), (True, True, True, False, False, False),
    (True, False, False, False, False, False), (True, True, False, False, True, False),
    (False, False, False, False, True, True), (False, False, False, True, False, True),
):  # fmt: skip
    ptx = compile_sm90(
        attn._attention_bwd_kernel, bwd_pointers(tma, dq_host),
        {"qk_scale", "sm_scale", "drop_scale"},
        dict(common, BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, ATOMIC_DQ=atomic,
             DQ_TMA=dq_tma, DQ_HOST_DESC=dq_host, TMA=tma, PACKED_GRADS=packed,
             DQ_DIRECT=direct),
    ).asm["ptx"]  # fmt: skip
    # tiles by 4-D TMA copies, dQ by 3-D bulk reductions; a descriptor made in the kernel
    # (tensormap.replace) only where the launch is traced; atomics only in the single pass
    assert ("cp.async.bulk.tensor.4d" in ptx) == tma
    assert ("cp.reduce.async.bulk.tensor.3d" in ptx) == dq_tma
    assert ("tensormap.replace" in ptx) == (dq_tma and not dq_host)
    assert bool(re.search(r"\b(atom|red)\.global", ptx)) == (atomic and not dq_tma)
compile_sm90(
    attn._attention_bwd_dq_kernel, dict(DQ_ACC="*fp32", DQ=bf16), {"sm_scale"},
    dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64),
)  # fmt: skip
print("attention backward: ok")

mm_ptrs = dict(A=bf16, B=bf16, C=bf16, R=bf16, AUX=bf16, WS="*fp32", SEED="*i64")
compile_sm90(
    matmul_kernels._mm_tma_kernel, mm_ptrs, {"drop_scale"},
    dict(A_T=False, B_T=True, RELU_SQUARED=True, HAS_RESIDUAL=False, STORE_AUX=True,
         DROPOUT=True, SWIGLU=False, SPLIT=False, NUM_SMS=132, BLOCK_M=128, BLOCK_N=128,
         BLOCK_K=64, GROUP_M=8, EPI_SUB=2, FLATTEN=True),
)  # fmt: skip
print("TMA matmul, relu² + dropout epilogue: ok")
for epi_sub in (1, 2):
    compile_sm90(
        matmul_kernels._mm_tma_kernel, mm_ptrs, {"drop_scale"},
        dict(A_T=False, B_T=False, RELU_SQUARED=False, HAS_RESIDUAL=False, STORE_AUX=False,
             DROPOUT=True, SWIGLU=False, SPLIT=False, NUM_SMS=132, BLOCK_M=128, BLOCK_N=128,
             BLOCK_K=64, GROUP_M=8, EPI_SUB=epi_sub, FLATTEN=True, RELU2_GRAD=2),
    )  # fmt: skip
print("TMA matmul, relu² gradient + dropout epilogue: ok")
compile_sm90(
    matmul_kernels._relu2_grad_kernel, dict(DY=bf16, S=bf16, DP=bf16, SEED="*i64"), {"drop_scale"},
    dict(FROM_SQUARE=True, DROPOUT=True, BLOCK_M=16, BLOCK_N=256),
)  # fmt: skip
print("relu² gradient with dropout: ok")
compile_sm90(
    attn._attention_fwd_kernel, fwd_ptrs, {"qk_scale", "out_scale"},
    dict(common, DROPOUT=False, BLOCK_M=16, BLOCK_N=128, WRITE_LSE=False, FOLD_SCALE=True,
         HAS_KV_LEN=True, SPLIT_K=True),
)  # fmt: skip
compile_sm90(
    attn._attention_fwd_combine_kernel, dict(PART_ACC="*fp32", PART_ML="*fp32", Out=bf16), set(),
    dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_S=64),
)  # fmt: skip
print("attention over a KV cache whose length is on the device: ok")
# grouped-query attention (4 query heads per key/value head): the forward, the decode, and the
# backward's key-block programs looping over the group (deterministic, and the single pass)
gqa = dict(common, GROUP=4)
compile_sm90(
    attn._attention_fwd_kernel, fwd_ptrs, {"qk_scale", "out_scale"},
    dict(gqa, BLOCK_M=128, BLOCK_N=64, WRITE_LSE=True, FOLD_SCALE=True, HAS_KV_LEN=False,
         SPLIT_K=False),
)  # fmt: skip
compile_sm90(
    attn._attention_fwd_kernel, fwd_ptrs, {"qk_scale", "out_scale"},
    dict(gqa, DROPOUT=False, BLOCK_M=16, BLOCK_N=128, WRITE_LSE=False, FOLD_SCALE=True,
         HAS_KV_LEN=True, SPLIT_K=True),
)  # fmt: skip
for atomic, tma, direct in ((False, False, False), (False, True, False), (True, True, False),
                           (False, False, True)):  # fmt: skip
    compile_sm90(
        attn._attention_bwd_kernel, bwd_pointers(tma, atomic),
        {"qk_scale", "sm_scale", "drop_scale"},
        dict(gqa, HAS_KPM=True, BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32,
             ATOMIC_DQ=atomic, DQ_TMA=atomic, DQ_HOST_DESC=atomic, TMA=tma,
             PACKED_GRADS=False, DQ_DIRECT=direct),
    )  # fmt: skip
print("grouped-query attention: ok")

# SwiGLU fused into the matmul's epilogue (two accumulators, gate and up tiles of one weight):
# the TMA kernel at each of its own tuning configs (their warps and stages: the registers and
# shared memory are what they risk), the weight read transposed and row-major; the pointer
# kernel at the planner's GPU tiles for bf16 and fp32, and the decode-sized ones
swiglu = dict(RELU_SQUARED=False, HAS_RESIDUAL=False, STORE_AUX=True, DROPOUT=False, SWIGLU=True)
for i, cfg in enumerate(matmul_kernels._tma_swiglu_configs()):
    for b_t in (True, False) if i == 0 else (True,):
        consts = dict(swiglu, A_T=False, B_T=b_t, SPLIT=False, NUM_SMS=132, **cfg.kwargs)
        consts = with_defaults(matmul_kernels._mm_tma_kernel, consts)
        sig = signature(matmul_kernels._mm_tma_kernel, mm_ptrs, {"drop_scale"}, consts)
        names = list(sig)
        src = ASTSource(
            fn=matmul_kernels._mm_tma_kernel, signature=sig,
            constexprs={(names.index(k),): v for k, v in consts.items()},
        )  # fmt: skip
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
print("TMA matmul, SwiGLU epilogue: ok")
for ptr, cfg in (
    (bf16, (128, 64, 32)),
    ("*fp32", (64, 64, 32)),
    (bf16, (16, 16, 128)),
    (bf16, (64, 64, 32)),
):
    compile_sm90(
        matmul_kernels._mm_ptr_kernel, dict(mm_ptrs, A=ptr, B=ptr, C=ptr, R=ptr, AUX=ptr),
        {"drop_scale"},
        dict(swiglu, DOT_PRECISION="ieee" if ptr == "*fp32" else "tf32",
             BLOCK_M=cfg[0], BLOCK_N=cfg[1], BLOCK_K=cfg[2], GROUP_M=8),
    )  # fmt: skip
print("pointer matmul, SwiGLU epilogue: ok")
compile_sm90(
    matmul_kernels._mm_ptr_kernel, mm_ptrs, {"drop_scale"},
    dict(RELU_SQUARED=False, HAS_RESIDUAL=False, STORE_AUX=False, DROPOUT=True, SWIGLU=False,
         DOT_PRECISION="tf32", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8,
         RELU2_GRAD=1),
)  # fmt: skip
print("pointer matmul, relu² gradient + dropout epilogue: ok")

# The embedding's backward at large vocabularies: the atomic scatter, then the reduce kernel's
# positional part alone, with an fp32 placeholder for DWEIGHT and a bf16 dP (dW and dP of
# different dtypes; the interpreter does not type-check the kernel's two branches)
compile_sm90(
    emb._embedding_bwd_scatter_kernel, dict(DH=bf16, IDS="*i64", DWEIGHT="*fp32"), set(),
    dict(BLOCK_T=32, BLOCK_D=128),
)  # fmt: skip
compile_sm90(
    emb._embedding_bwd_reduce_kernel,
    dict(PARTIAL="*fp32", DH=bf16, DWEIGHT="*fp32", DPOS=bf16), set(),
    dict(HAS_VOCAB=False, HAS_POS=True, BLOCK_R=32, BLOCK_D=128),
)  # fmt: skip
compile_sm90(
    emb._embedding_bwd_reduce_kernel,
    dict(PARTIAL="*fp32", DH=bf16, DWEIGHT=bf16, DPOS=bf16), set(),
    dict(HAS_VOCAB=True, HAS_POS=True, BLOCK_R=32, BLOCK_D=128),
)  # fmt: skip
print("embedding backward, scatter and positions: ok")

# AdamW over a tensor table (addresses turned into typed pointers in the kernel); eager
# launches type its float scalars fp32 (it is not traced)
scalars = dict.fromkeys(
    ("lr_value", "beta1", "beta2", "log2_beta1", "log2_beta2", "eps", "weight_decay",
     "max_norm", "clip_eps"), "fp32",
)  # fmt: skip
for param, grad, copies in (("*fp32", "*fp32", False), (bf16, bf16, False),
                            ("*fp32", bf16, False), ("*fp32", bf16, True)):  # fmt: skip
    compile_sm90(
        adamw._adamw_kernel,
        dict(scalars, TABLE="*i64", BLOCK_TENSOR="*i32", P0=param, G0=grad,
             C0=bf16 if copies else param, LR="*fp32", CLIP_NORM="*fp32"), set(),
        dict(LR_ON_DEVICE=True, CLIP=True, COPIES=copies, BLOCK=4096),
    )  # fmt: skip
compile_sm90(
    adamw._grad_sq_sum_kernel,
    dict(TABLE="*i64", BLOCK_TENSOR="*i32", G0=bf16, PARTIAL="*fp32"),
    set(),
    dict(BLOCK=4096),
)
compile_sm90(
    adamw._write_addresses_kernel,
    dict(ROWS="*i64", ADDRESSES=("i64",) * adamw.ADDRESSES_PER_LAUNCH),
    set(),
    {},
)
print("AdamW and the gradient norm over a tensor table: ok")

# The cross-entropy forward's looped path (each block loaded one iteration ahead), pure and in
# place (the gradient written over bf16 logits), with ignore_index
for write_grad in (False, True):
    compile_sm90(
        ce._cross_entropy_fwd_kernel,
        dict(LOGITS=bf16, LABELS="*i64", N_VALID="*fp32", LOSS="*fp32", LSE="*fp32"), set(),
        dict(HAS_IGNORE=True, WRITE_GRAD=write_grad, NORMALIZE_GRAD=write_grad,
             COUNTED=write_grad, SINGLE_PASS=False, BLOCK_M=1, BLOCK_N=8192),
    )  # fmt: skip
print("cross-entropy forward, looped: ok")
