"""Run by tests (in a subprocess, with TRITON_INTERPRET=0 so kernels are JITFunctions that
torch.library can trace): Dynamo with fullgraph=True, then AOTAutograd's joint forward+backward
trace, over each op's Triton path, static and dynamic shapes. The forward compiler stops at
the traced graph, so no kernel runs and no GPU is needed. A case passes when the trace reached
the forward compiler holding at least one of our triton ops, and torch's analysis of which
arguments each kernel writes (it reads the kernel's Triton IR) succeeded for every launch:
where it fails, torch warns and assumes every argument is written, and inductor then copies
each view a kernel reads (a 20% slower compiled enwik8 step on an H200 when the attention
kernels called `.to` on an argument that inductor passes as a Python int).

Usage: python _compile_trace_check.py GROUP... (rows: cross_entropy, softmax and dropout;
layernorm: layernorm and residual_layernorm; attention: causal, dropout, padding, GQA).
Prints one line per case and dynamic setting.
"""

import importlib
import sys
from pathlib import Path

import torch
import triton
from torch._dynamo.backends.common import aot_autograd
from triton.backends.compiler import GPUTarget

import triton_transformer.utils as utils_mod

sys.path.insert(0, str(Path(__file__).parent))  # run as a script or by runpy: helpers is beside
from helpers import kernel_analysis_failures


class Target:  # torch's analysis of which kernel arguments are written wants a GPU target
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Target())
utils_mod.interpreter_enabled = lambda: True  # CPU tensors pass the device check
MODULES = ("cross_entropy", "softmax", "dropout", "layernorm", "residual_layernorm", "attention")
mods = {m: importlib.import_module(f"triton_transformer.{m}") for m in MODULES}
for m in mods.values():
    m.check_triton_tensor = lambda *a, **k: None


class Traced(Exception):
    pass


def fw_compiler(gm, example_inputs):
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    raise Traced(sorted(t for t in targets if "triton" in t))


backend = aot_autograd(fw_compiler=fw_compiler)
w = torch.randn(64, 300)
labels = torch.randint(300, (128,))
labels[::7] = -100
ln_w = torch.randn(64, requires_grad=True)
ln_b = torch.randn(64, requires_grad=True)
ce, sm, do = mods["cross_entropy"], mods["softmax"], mods["dropout"]
ln, rl, at = mods["layernorm"], mods["residual_layernorm"], mods["attention"]
kpm = torch.ones(2, 32, dtype=torch.bool)
kpm[1, 20:] = False


def attention_case(heads_kv: int = 2, **kwargs):
    """(128, 64) -> q (2, 2, 32, 64) and k, v with heads_kv heads, causal attention."""

    def case(h):
        q = h.sin().view(2, 2, 32, 64)
        k, v = h.cos().view(2, 2, 32, 64), h.view(2, 2, 32, 64)
        k, v = k[:, :heads_kv], v[:, :heads_kv]
        return at.attention(q, k, v, causal=True, use_triton=True, **kwargs).cos().sum()

    return case


GROUPS = {
    "rows": {
        "cross_entropy inplace": lambda h: ce.cross_entropy(
            h.sin() @ w, labels, -100, use_triton=True, check_labels=False, inplace_backward=True
        ),
        "cross_entropy pure": lambda h: ce.cross_entropy(
            h.sin() @ w, labels, -100, use_triton=True, check_labels=False
        ),
        "softmax causal": lambda h: (sm.softmax(h.sin(), causal=True, use_triton=True) * h).sum(),
        "dropout": lambda h: do.dropout(h.sin(), 0.3, use_triton=True).cos().sum(),
    },
    "layernorm": {
        "layernorm": lambda h: ln.layernorm(h.sin(), ln_w, ln_b, use_triton=True).cos().sum(),
        "layernorm stable": lambda h: (
            ln.layernorm(h.sin(), ln_w, None, stable=True, use_triton=True).cos().sum()
        ),
        "residual dropout": lambda h: sum(
            t.cos().sum()
            for t in rl.residual_layernorm(h, h.sin(), ln_w, ln_b, dropout_p=0.1, use_triton=True)
        ),
        "residual stable": lambda h: (
            rl.residual_layernorm(h, h.sin(), ln_w, None, stable=True, use_triton=True)[1]
            .cos()
            .sum()
        ),
    },
    "attention": {
        "attention causal": attention_case(),
        "attention dropout, padding": attention_case(
            dropout_p=0.1, key_padding_mask=kpm, seed=torch.tensor(3)
        ),
        "attention grouped-query": attention_case(heads_kv=1),
        "attention packed": lambda h: (
            at.attention_packed(h[:96].reshape(2, 32, 96).sin(), 2, causal=True, use_triton=True)
            .cos()
            .sum()
        ),
    },
}


def trace_cases(cases: dict) -> bool:
    """Trace each case (a function of one (128, 64) leaf tensor) with static and dynamic
    shapes; print "OK name dynamic=...: ops" or "FAIL ..."; True when every case reached the
    forward compiler holding at least one of our triton ops. Also used by
    `_modern_trace_check.py`."""
    ok = bool(cases)
    for dynamic in (False, True):
        for name, fn in cases.items():
            torch._dynamo.reset()
            h = torch.randn(128, 64, requires_grad=True)
            try:
                with kernel_analysis_failures() as failures:
                    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(h)
                print(f"FAIL {name} dynamic={dynamic}: the forward compiler was not reached")
                ok = False
            except Exception as e:  # Dynamo wraps the backend's exception (always raised)
                cause = e
                while cause is not None and not isinstance(cause, Traced):
                    cause = cause.__cause__ or cause.__context__
                if cause is None or not cause.args[0]:
                    print(f"FAIL {name} dynamic={dynamic}: {type(e).__name__}: {str(e)[:800]}")
                    ok = False
                elif failures:
                    print(f"FAIL {name} dynamic={dynamic}: kernel-mutation analysis failed: "
                          f"{failures[0]}")  # fmt: skip
                    ok = False
                else:
                    print(f"OK {name} dynamic={dynamic}: {cause.args[0]}")
    return ok


if __name__ == "__main__":
    cases = {name: fn for group in sys.argv[1:] for name, fn in GROUPS[group].items()}
    sys.exit(0 if trace_cases(cases) else 1)
