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
layernorm: layernorm and residual_layernorm; attention: causal, dropout, padding, GQA, bf16
(the GPU table's tiles); fold: the backward graph of a linear and the relu² feed-forward
inside `bmm.accumulate_grads_in_place(traced=True)`, see `fold_cases`; norm_fold: the same
for the four norms' parameters, see `norm_fold_cases`; opaque_route: traced attention calls
the opaque ops where an eager call launches what inductor cannot, see `opaque_route_cases`).
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
MODULES = (
    "cross_entropy", "softmax", "dropout", "layernorm", "residual_layernorm", "attention", "bmm",
    "mlp", "rmsnorm",
)  # fmt: skip
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


def attention_case(
    heads_kv: int = 2, dtype: torch.dtype = torch.float32, batch: int = 2, **kwargs
):  # fmt: skip
    """(128, 64) -> q (batch, 2, 64 / batch, 64) and k, v with heads_kv heads, causal
    attention. 32 keys fit one of the interpreter's key blocks (the one-launch backward), 64
    take two (the launches of longer heads)."""

    def case(h):
        h = h.to(dtype)
        shape = (batch, 2, 64 // batch, 64)
        q, k, v = h.sin().view(shape), h.cos().view(shape), h.view(shape)
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
        "attention two key blocks": attention_case(batch=1),
        # bf16 takes the GPU table's causal d64 tiles, whose register cap (maxnreg) a traced
        # launch leaves out (`attention._launch_fitting`)
        "attention bf16": attention_case(dtype=torch.bfloat16),
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


class BackwardTraced(Exception):
    pass


def backward_graph(fn, inputs: tuple, bw_compiler, traced: bool, fw_compiler=None):
    """Compile fn(*inputs) inside `accumulate_grads_in_place(traced)` with a backend whose
    backward compiler is `bw_compiler` (which raises BackwardTraced with what it found) and
    whose forward compiler is `fw_compiler` (default: the graph as it is); return those
    findings."""
    bmm = mods["bmm"]
    torch._dynamo.reset()
    torch._functorch.config.force_non_lazy_backward_lowering = True  # compile it now
    backend = aot_autograd(fw_compiler=fw_compiler or (lambda gm, _: gm), bw_compiler=bw_compiler)
    try:
        with bmm.accumulate_grads_in_place(traced=traced):
            torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, BackwardTraced):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return cause.args
    raise RuntimeError("the backward compiler was not reached")


def fold_backward(with_grads: bool, traced: bool) -> tuple[list, list]:
    """Trace a linear (relu²) into the relu² feed-forward, fp32 weights, inside
    `accumulate_grads_in_place(traced)`, the weights holding a `.grad` or not; return the
    backward graph's (the inputs that accumulate_mm calls add into, as (node kind, whether
    the graph copies the result back into that input), whether each output is None)."""
    bmm, mlp = mods["bmm"], mods["mlp"]
    ws = [torch.randn(*shape, requires_grad=True) for shape in ((64, 64), (96, 64), (64, 96))]
    for w in ws:
        w.grad = torch.zeros_like(w) if with_grads else None

    def fn(h):
        y = bmm.linear(h, ws[0], "relu_squared", use_triton=True)
        return mlp.relu2_mlp(y, ws[1], ws[2], use_triton=True).cos().sum()

    def bw_compiler(gm, example_inputs):
        # functionalised: auto_functionalized(accumulate_mm, c's base...) then copy_(base, new)
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        copied = {n.args[0] for n in nodes if n.target == torch.ops.aten.copy_.default}
        bases = [
            base
            for n in nodes
            if n.args and "accumulate_mm" in str(n.args[0])
            for base in n.kwargs["_all_bases"]
        ]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        raise BackwardTraced([(b.op, b in copied) for b in bases], [o is None for o in outputs])

    return backward_graph(fn, (torch.randn(128, 64, requires_grad=True),), bw_compiler, traced)


def fold_cases() -> bool:
    """The fold's traced backward: with `.grad` present and traced=True, three accumulate_mm
    calls, each into a graph input (the `.grad` passed to the op) that the graph writes back,
    and no gradient output for the three weights (None: autograd adds nothing); without
    `.grad`, or with traced=False, no accumulate_mm and a gradient for each weight."""
    ok = True
    for with_grads, traced in ((True, True), (False, True), (True, False)):
        calls, none_outputs = fold_backward(with_grads, traced)
        folds = with_grads and traced
        # outputs: h's gradient, then the weights' and, when passed, the .grad inputs' (None)
        good = calls == ([("placeholder", True)] * 3 if folds else []) and none_outputs == (
            [False] + [True] * 6 if folds else [False] * 4
        )
        ok &= good
        print(f"{'OK' if good else 'FAIL'} fold .grad={with_grads} traced={traced}: "
              f"accumulate_mm into {calls}, None outputs {none_outputs}")  # fmt: skip
    return ok


def norm_fold_backward(norm: str, with_grads: bool) -> tuple[int, list]:
    """Trace one call of `norm` (its Triton path; fp32 parameters, each holding a `.grad` or
    not) inside `accumulate_grads_in_place(traced=True)`; return the backward graph's (number
    of graph inputs it copies a result back into, whether each output is None)."""
    rn = mods["rmsnorm"]
    params = [torch.randn(64, requires_grad=True) for _ in range(1 if "rms" in norm else 2)]
    for p in params:
        p.grad = torch.zeros_like(p) if with_grads else None

    def fn(h):
        if norm == "layernorm":
            return ln.layernorm(h, *params, use_triton=True).cos().sum()
        if norm == "rmsnorm":
            return rn.rmsnorm(h, params[0], use_triton=True).cos().sum()
        if norm == "residual_layernorm":
            h_new, y = rl.residual_layernorm(h, h.sin(), *params, use_triton=True)
        else:
            h_new, y = rn.residual_rmsnorm(h, h.sin(), params[0], use_triton=True)
        return y.cos().sum() + h_new.sum()

    def bw_compiler(gm, example_inputs):
        nodes = list(gm.graph.nodes)
        copied = {
            n.args[0]
            for n in nodes
            if n.op == "call_function" and n.target == torch.ops.aten.copy_.default
            and n.args[0].op == "placeholder"
        }  # fmt: skip
        outputs = next(n for n in nodes if n.op == "output").args[0]
        raise BackwardTraced(len(copied), [o is None for o in outputs])

    return backward_graph(fn, (torch.randn(128, 64, requires_grad=True),), bw_compiler, True)


def norm_fold_cases() -> bool:
    """The norms' traced backward with `.grad` present: each parameter's `.grad` (a graph
    input) written back by the graph, and no gradient output for the parameters; without
    `.grad` (layernorm), nothing written back and a gradient for each."""
    ok = True
    cases = [(n, True) for n in ("layernorm", "residual_layernorm", "rmsnorm", "residual_rmsnorm")]
    for norm, with_grads in [*cases, ("layernorm", False)]:
        copied, none_outputs = norm_fold_backward(norm, with_grads)
        n_params = 1 if "rms" in norm else 2
        # outputs: h's gradient, then the parameters' and, when passed, the .grad inputs'
        if with_grads:
            good = copied == n_params and none_outputs == [False] + [True] * 2 * n_params
        else:
            good = copied == 0 and none_outputs == [False] * (1 + n_params)
        ok &= good
        print(f"{'OK' if good else 'FAIL'} norm_fold {norm} .grad={with_grads}: "
              f"{copied} inputs written back, None outputs {none_outputs}")  # fmt: skip
    return ok


def traced_graph_ops(fn, keep: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Trace fn (of one (128, 64) leaf tensor) forward and backward; return the forward and
    backward graphs' call targets containing one of `keep`, sorted, each once."""
    found = []

    def ours(gm):
        # a mutating custom op is traced as auto_functionalized(op, ...)
        targets = [
            str(n.args[0] if "auto_functionalized" in str(n.target) else n.target)
            for n in gm.graph.nodes
            if n.op == "call_function"
        ]
        return sorted({t for t in targets if any(k in t for k in keep)})

    def fw_compiler(gm, example_inputs):
        found.append(ours(gm))
        return gm

    def bw_compiler(gm, example_inputs):
        raise BackwardTraced(ours(gm))

    h = torch.randn(128, 64, requires_grad=True)
    backward = backward_graph(fn, (h,), bw_compiler, False, fw_compiler)[0]
    return found[0], backward


# (name, module whose TRACED_OPAQUE switches it, [(module, attribute)] made to say yes, fn,
# the opaque ops expected in the forward and backward graphs)
lce = importlib.import_module("triton_transformer.linear_cross_entropy")
ceh = importlib.import_module("triton_transformer.cross_entropy_hopper")
OPAQUE_ROUTES = [
    ("attention", at, [(at, "_capped_forward"), (at, "_takes_gluon")], attention_case(),
     ["flash_attention_opaque"], ["flash_attention_backward_opaque"]),
    ("attention packed", at, [(at, "_capped_forward"), (at, "_takes_gluon")],
     GROUPS["attention"]["attention packed"], ["flash_attention_packed_opaque"],
     ["flash_attention_packed_backward_opaque"]),
    ("attention gluon forward", at, [(at, "_fwd_takes_gluon")], attention_case(),
     ["flash_attention_opaque"], []),
    # the Triton single pass on Hopper: traced, its dQ descriptor would be made in the kernel,
    # which needs Triton's allocator in the thread that runs the graph
    ("attention single pass", at, [(at, "_has_tma")], attention_case(), [],
     ["flash_attention_backward_opaque"]),
    ("cross_entropy inplace", ce, [(ceh, "takes_strides")], GROUPS["rows"]["cross_entropy inplace"],
     ["cross_entropy_inplace_opaque"], []),
    ("linear_cross_entropy", lce, [(ceh, "takes_rows")],
     lambda h: lce.linear_cross_entropy(h.sin(), w.t(), labels, -100, use_triton=True,
                                        check_labels=False), ["linear_cross_entropy_opaque"], []),
]  # fmt: skip


def opaque_route_cases() -> bool:
    """Where an eager call launches what inductor cannot (made to, on the CPU: an attention
    forward capping its registers, Gluon kernels of the attention backward and the losses),
    the traced graphs call the opaque `*_opaque` ops, unless the module's `TRACED_OPAQUE` is
    off: then the triton_ops, traced into their kernels' launches. Also the attention
    backward's single pass on a Hopper GPU (made to be one)."""
    ok = True
    for name, module, patches, fn, want_fwd, want_bwd in OPAQUE_ROUTES:
        for enabled in (True, False):
            saved = [getattr(m, a) for m, a in patches]
            module.TRACED_OPAQUE = enabled
            for m, a in patches:
                setattr(m, a, lambda *args: True)
            try:
                fwd, bwd = traced_graph_ops(fn, ("_opaque", "triton_kernel_wrapper"))
            finally:
                module.TRACED_OPAQUE = True
                for (m, a), value in zip(patches, saved, strict=True):
                    setattr(m, a, value)
            opaque = [[t for t in g if "_opaque" in t] for g in (fwd, bwd)]
            if enabled:
                want = [[f"triton_transformer.{op}.default" for op in ops]
                        for ops in (want_fwd, want_bwd)]  # fmt: skip
                good = opaque == want
            else:
                good = opaque == [[], []] and "triton_kernel_wrapper" in " ".join(fwd)
            ok &= good
            print(f"{'OK' if good else 'FAIL'} opaque_route {name} TRACED_OPAQUE={enabled}: "
                  f"forward {fwd}, backward {bwd}")  # fmt: skip
    return ok


if __name__ == "__main__":
    groups = sys.argv[1:]
    special = {"fold": fold_cases, "norm_fold": norm_fold_cases, "opaque_route": opaque_route_cases}
    cases = {
        name: fn for group in groups if group not in special for name, fn in GROUPS[group].items()
    }
    ok = trace_cases(cases) if cases else True
    for group in groups:
        if group in special:
            ok &= special[group]()
    sys.exit(0 if ok else 1)
