"""Run by the modern-op tests in a subprocess with TRITON_INTERPRET=0 (kernels are JITFunctions
torch.library can trace): Dynamo with fullgraph=True, then AOTAutograd's joint forward+backward
trace, over the Triton paths of rmsnorm, residual_rmsnorm, rope and swiglu, static and dynamic
shapes; no kernel runs. Then every kernel variant is compiled for sm_90 with bf16 pointers and
fp64 float scalars (as torch.compile launches them): what the interpreter cannot check.

Usage: python _modern_trace_check.py. Prints one line per case ("OK ..." / "FAIL ...").
"""

import importlib
import sys

import torch
import triton

# its backend, its loop and its GPU target for torch's kernel analysis (a sibling script)
from _compile_trace_check import trace_cases
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import triton_transformer.utils as utils_mod

utils_mod.interpreter_enabled = lambda: True  # CPU tensors pass the device check
MODULES = ("rmsnorm", "rope", "swiglu")
mods = {m: importlib.import_module(f"triton_transformer.{m}") for m in MODULES}
for m in mods.values():
    m.check_triton_tensor = lambda *a, **k: None
rms, rope, sw = mods["rmsnorm"], mods["rope"], mods["swiglu"]


w = torch.randn(64, requires_grad=True)
pos = torch.arange(3, 35)
CASES = {
    "rmsnorm": lambda h: rms.rmsnorm(h.sin(), w, use_triton=True).cos().sum(),
    "residual_rmsnorm dropout": lambda h: sum(
        t.cos().sum() for t in rms.residual_rmsnorm(h, h.sin(), w, dropout_p=0.1, use_triton=True)
    ),
    "rope": lambda h: sum(
        t.cos().sum() for t in rope.rope(h.view(4, 2, 16, 64), h.view(4, 2, 16, 64).sin(),
                                         use_triton=True)
    ),
    "rope positions": lambda h: sum(
        t.cos().sum() for t in rope.rope(h.view(2, 2, 32, 64), h.view(2, 2, 32, 64).sin(), pos,
                                         use_triton=True)
    ),
    "swiglu": lambda h: sw.swiglu(h.sin(), h.cos(), use_triton=True).sum(),
}  # fmt: skip
ok = trace_cases(CASES)

POINTERS = dict(X="*bf16", W="*fp32", Y="*bf16", H="*bf16", BR="*bf16", DY="*bf16", DX="*bf16",
                DHN="*bf16", DBR="*bf16", Rstd="*fp32", Partial="*fp32", SEED="*i64",
                Q="*bf16", K="*bf16", QO="*bf16", KO="*bf16", POS="*i64", G="*bf16", U="*bf16",
                DG="*bf16", DU="*bf16")  # fmt: skip
FLOATS = {"inv_n", "eps", "p", "drop_scale", "freq_scale"}


def compile_sm90(kernel, num_warps, **constants):
    sig = {
        n: "constexpr" if n in constants else POINTERS.get(n) or ("fp64" if n in FLOATS else "i32")
        for n in kernel.arg_names
    }
    names = list(sig)
    src = ASTSource(
        fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constants.items()}
    )
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


variants = {
    "rms fwd single": (rms._rmsnorm_fwd_kernel, 4, dict(SINGLE=True, BLOCK_M=4, BLOCK_N=1024)),
    "rms fwd loop residual": (
        rms._rmsnorm_fwd_kernel, 8, dict(SINGLE=False, BLOCK_M=1, BLOCK_N=4096, RESIDUAL=True,
                                     DROPOUT=True, INT64_IDX=True),
    ),
    "rms bwd row prefetch": (
        rms._rmsnorm_bwd_kernel, 4, dict(SINGLE=True, BLOCK_M=4, BLOCK_N=1024, PREFETCH=True,
                                     HAS_DHN=True, WRITE_DBR=True, DROPOUT=True),
    ),
    "rms bwd loop": (rms._rmsnorm_bwd_kernel, 8, dict(SINGLE=False, BLOCK_M=1, BLOCK_N=4096)),
    "rope": (rope._rope_kernel, 4, dict(HAS_POS=True, INVERSE=False, BLOCK_S=8, BLOCK_D=64)),
    "rope inverse": (rope._rope_kernel, 4, dict(HAS_POS=False, INVERSE=True, BLOCK_S=16,
                                                BLOCK_D=32)),
    "swiglu fwd": (sw._swiglu_fwd_kernel, 4, dict(BLOCK_M=2, BLOCK_N=1024)),
    "swiglu bwd": (sw._swiglu_bwd_kernel, 4, dict(PACKED=False, BLOCK_M=2, BLOCK_N=1024)),
    "swiglu bwd packed": (sw._swiglu_bwd_kernel, 4, dict(PACKED=True, BLOCK_M=2, BLOCK_N=1024)),
}  # fmt: skip
defaults = dict(RESIDUAL=False, DROPOUT=False, INT64_IDX=False, HAS_DHN=False, WRITE_DBR=False,
                PREFETCH=False)  # fmt: skip
for name, (kernel, warps, consts) in variants.items():
    consts = {k: v for k, v in {**defaults, **consts}.items() if k in kernel.arg_names}
    try:
        compile_sm90(kernel, warps, **consts)
        print(f"OK sm90 {name}")
    except Exception as e:
        print(f"FAIL sm90 {name}: {type(e).__name__}: {str(e)[:800]}")
        ok = False
sys.exit(0 if ok else 1)
