"""linear_cross_entropy: the chunked Triton path against a float64 reference, and in the model.

The reference is F.linear + F.cross_entropy in float64 on the same (already rounded) inputs.
On CPU the kernels run in Triton's interpreter, so shapes are small; several chunks with a
ragged last one come from a small `chunk_rows`.
"""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from triton_transformer import AutoregressiveWrapper, Transformer
from triton_transformer.bmm import linear
from triton_transformer.checks import raise_pending
from triton_transformer.cross_entropy import cross_entropy
from triton_transformer.linear_cross_entropy import (
    default_chunk_rows,
    linear_cross_entropy,
    linear_cross_entropy_op,
    linear_cross_entropy_scale_op,
    single_chunk_lighter,
)

lce_mod = importlib.import_module("triton_transformer.linear_cross_entropy")

# log(0) = -inf in the interpreter's numpy for rows with nothing to sum (ignored rows).
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LOSS_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-3}


def make_inputs(M, K, V, dtype=torch.float32, device="cpu", ignore_index=None):
    """x (M, K), weight (V, K) scaled so that logits are O(1), labels (M,) with some rows
    ignored (at least one ignored, one kept)."""
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(V, K, device=device) / K**0.5).to(dtype)
    labels = torch.randint(V, (M,), device=device)
    if ignore_index is not None and M > 1:
        drop = torch.rand(M, device=device) < 0.3
        drop[0], drop[-1] = True, False
        labels[drop] = ignore_index
    return x, w, labels


def rel_err(out, ref):
    """Norm-wise relative error in float64; NaN anywhere makes it NaN (so checks fail)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def run(x, w, labels, ignore_index=None, dloss=1.7, use_triton=True, **kwargs):
    """Loss, dx and dW of linear_cross_entropy for an upstream gradient dloss."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = linear_cross_entropy(x, w, labels, ignore_index, use_triton=use_triton, **kwargs)
    loss.backward(torch.tensor(dloss, dtype=loss.dtype, device=loss.device))
    return loss.detach(), x.grad, w.grad


def reference(x, w, labels, ignore_index=None, dloss=1.7):
    """The same in float64 with F.linear and F.cross_entropy (0 when all rows are ignored)."""
    x = x.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    flat = labels.reshape(-1)
    ii = -100 if ignore_index is None else ignore_index
    logits = F.linear(x, w).reshape(-1, w.shape[0])
    nll = F.cross_entropy(logits, flat, ignore_index=ii, reduction="sum")
    loss = nll / (flat != ii).sum().clamp(min=1)
    loss.backward(torch.tensor(dloss, dtype=torch.float64, device=x.device))
    return loss.detach(), x.grad, w.grad


def check(x, w, labels, ignore_index=None, dloss=1.7, **kwargs):
    dtype = x.dtype
    loss, dx, dw = run(x, w, labels, ignore_index, dloss, **kwargs)
    ref_loss, ref_dx, ref_dw = reference(x, w, labels, ignore_index, dloss)
    assert loss.shape == () and loss.dtype == torch.float32
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert dw.shape == w.shape and dw.dtype == w.dtype
    assert abs(loss.item() - ref_loss.item()) <= LOSS_TOL[dtype] * max(abs(ref_loss.item()), 1)
    assert rel_err(dx, ref_dx) <= TOL[dtype]
    assert rel_err(dw, ref_dw) <= TOL[dtype]


# ---- against float64 (interpreter on CPU) -----------------------------------------------------


@pytest.mark.parametrize("chunk_rows", [None, 16, 1], ids=["one-chunk", "ragged", "rows"])
@pytest.mark.parametrize("V", [37, 131])
@pytest.mark.parametrize("ignore_index", [None, -100])
def test_matches_reference_fp32(V, ignore_index, chunk_rows, device):
    M = 9 if chunk_rows == 1 else 37  # 37 rows: chunks of 16, 16 and 5
    x, w, labels = make_inputs(M, 24, V, device=device, ignore_index=ignore_index)
    check(x, w, labels, ignore_index, chunk_rows=chunk_rows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_rows", [None, 16], ids=["one-chunk", "ragged"])
def test_matches_reference_half(dtype, chunk_rows, device):
    x, w, labels = make_inputs(37, 24, 131, dtype, device, ignore_index=-100)
    check(x, w, labels, -100, chunk_rows=chunk_rows)


def test_unit_upstream_gradient_and_ignored_label_in_vocabulary(device):
    # dloss exactly 1: backward's scale kernel returns without writing. A real class (0) as
    # the ignored label.
    x, w, labels = make_inputs(23, 16, 37, device=device)
    labels[::3] = 0
    check(x, w, labels, 0, dloss=1.0, chunk_rows=8)


def test_fp16_keeps_small_gradients_under_a_loss_scale(device):
    # fp16 chunks hold softmax - onehot unnormalised: 1 / n_valid and a GradScaler-sized
    # upstream gradient are applied together in fp32.
    x, w, labels = make_inputs(40, 16, 37, torch.float16, device, ignore_index=-100)
    check(x, w, labels, -100, dloss=65536.0, chunk_rows=16)


def test_lm_batch_3d_strided(device):
    # (batch, seq, K) activations shifted by one position, labels likewise: strided views.
    x = torch.randn(3, 12, 16, device=device)[:, :-1]
    w = torch.randn(37, 16, device=device) / 4
    labels = torch.randint(37, (3, 12), device=device)[:, 1:]
    labels[0, :3] = -100
    assert not x.is_contiguous() and not labels.is_contiguous()
    check(x, w, labels, -100, chunk_rows=8)
    # A transposed x (unit stride along rows) and a transposed weight.
    x_t = torch.randn(16, 21, device=device).t()
    w_t = (torch.randn(16, 37, device=device) / 4).t()
    check(x_t, w_t, torch.randint(37, (21,), device=device), chunk_rows=8)


def test_all_ignored_gives_zero(device):
    x, w, _ = make_inputs(10, 16, 37, device=device)
    labels = torch.full((10,), -100, device=device)
    loss, dx, dw = run(x, w, labels, -100, chunk_rows=4)
    assert loss.item() == 0.0 and (dx == 0).all() and (dw == 0).all()


@pytest.mark.parametrize("use_triton", [False, True])
def test_empty_input(use_triton, device):
    x = torch.randn(2, 0, 16, device=device, requires_grad=True)
    w = torch.randn(37, 16, device=device, requires_grad=True)
    labels = torch.zeros(2, 0, dtype=torch.long, device=device)
    loss = linear_cross_entropy(x, w, labels, use_triton=use_triton)
    loss.backward()
    assert loss.item() == 0.0 and (w.grad == 0).all()


def test_only_one_input_requires_grad(device):
    x, w, labels = make_inputs(20, 16, 37, device=device, ignore_index=-100)
    ref_loss, ref_dx, ref_dw = reference(x, w, labels, -100, dloss=1.0)
    for grad_x in (True, False):
        xx, ww = x.clone().requires_grad_(grad_x), w.clone().requires_grad_(not grad_x)
        loss = linear_cross_entropy(xx, ww, labels, -100, use_triton=True, chunk_rows=8)
        loss.backward()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        grad, ref, other = (xx.grad, ref_dx, ww) if grad_x else (ww.grad, ref_dw, xx)
        assert rel_err(grad, ref) <= 1e-5 and other.grad is None


def test_no_grad_forward(device):
    # Evaluation: the loss alone, no gradient written (the inputs are left untouched).
    x, w, labels = make_inputs(37, 16, 131, device=device, ignore_index=-100)
    ref_loss = reference(x, w, labels, -100)[0]
    x.requires_grad_()
    before = x.detach().clone()
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, labels, -100, use_triton=True, chunk_rows=16)
    assert not loss.requires_grad and torch.equal(x.detach(), before)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    # no input requires grad: the same path with grad mode on
    loss2 = linear_cross_entropy(x.detach(), w, labels, -100, use_triton=True, chunk_rows=16)
    assert loss2.item() == loss.item()


def test_autocast_bf16_with_fp32_weight(device):
    # Mixed precision: x cast to bf16, the fp32 weight read through a bf16 copy; both
    # gradients come back in fp32 (the weight's accumulated in fp32).
    x, w, labels = make_inputs(37, 24, 131, device=device, ignore_index=-100)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = linear_cross_entropy(xx, ww, labels, -100, use_triton=True, chunk_rows=16)
        ref_pt = linear_cross_entropy(x, w, labels, -100)  # F.linear under autocast
    (1.7 * loss).backward()
    assert xx.grad.dtype == torch.float32 and ww.grad.dtype == torch.float32
    ref_loss, ref_dx, ref_dw = reference(x.bfloat16(), w.bfloat16(), labels, -100)
    assert abs(loss.item() - ref_loss.item()) <= 2e-3 * ref_loss.item()
    assert abs(loss.item() - ref_pt.item()) <= 5e-3 * ref_loss.item()
    assert rel_err(xx.grad, ref_dx) <= 1e-2 and rel_err(ww.grad, ref_dw) <= 1e-2


def test_reference_branch_is_linear_then_cross_entropy(device):
    x, w, labels = make_inputs(12, 16, 37, device=device, ignore_index=-100)
    got = linear_cross_entropy(x.double(), w.double(), labels, -100)
    assert got.dtype == torch.float64
    ref = reference(x, w, labels, -100)[0]
    assert abs(got.item() - ref.item()) <= 1e-12


def test_matches_unfused_triton_path(device):
    # The same function as linear() then cross_entropy(inplace_backward=True).
    x, w, labels = make_inputs(37, 24, 131, device=device, ignore_index=-100)
    fused = run(x, w, labels, -100, chunk_rows=16)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = linear(xx, ww, use_triton=True)
    loss = cross_entropy(logits, labels, -100, use_triton=True, inplace_backward=True)
    loss.backward(torch.tensor(1.7, device=device))
    assert abs(fused[0].item() - loss.item()) <= 1e-6 * loss.item()
    assert rel_err(fused[1], xx.grad) <= 1e-5 and rel_err(fused[2], ww.grad) <= 1e-5


def test_bad_label_gives_nan_without_check(device):
    x, w, labels = make_inputs(10, 16, 37, device=device)
    labels[3] = 37
    with pytest.raises(ValueError, match="labels must lie in"):
        linear_cross_entropy(x, w, labels, use_triton=True)
        raise_pending()  # (a GPU's check: no sync, the error comes later)
    loss = linear_cross_entropy(x, w, labels, use_triton=True, check_labels=False, chunk_rows=4)
    assert torch.isnan(loss)


@pytest.mark.parametrize("ignore_index", [-100, None])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_label_check_after_the_kernels(ignore_index, requires_grad, monkeypatch, device):
    # The default check takes the loss as its verdict after the kernels, a bad label making
    # it NaN (`cross_entropy.check_labels_after`; on a GPU read without a sync, raised by
    # `checks.raise_pending` or the next checked call), and checks nothing more for good
    # labels; with or without ignore_index, so that a label of -2**31 (once the kernels'
    # stand-in for "no ignore_index") raises too.
    checks = []
    ce_mod = importlib.import_module("triton_transformer.cross_entropy")
    original = ce_mod._label_error
    monkeypatch.setattr(ce_mod, "_label_error", lambda *a: checks.append(a) or original(*a))
    x, w, labels = make_inputs(10, 16, 37, device=device, ignore_index=ignore_index)
    x.requires_grad_(requires_grad)
    linear_cross_entropy(x, w, labels, ignore_index, use_triton=True, chunk_rows=4)
    raise_pending()
    assert not checks
    for bad in (37, -1, -(2**31)):
        labels[3] = bad
        with pytest.raises(ValueError, match=f"found label {bad}"):
            linear_cross_entropy(x, w, labels, ignore_index, use_triton=True, chunk_rows=4)
            raise_pending()
    assert len(checks) == 3


def test_default_chunk_rows():
    # GPT-2's batch (16384 tokens, V = 50304, bf16): at most 5248 rows (513 MiB) per chunk,
    # so 4 equal chunks of 4096
    assert default_chunk_rows(16384, 50304, 2) == 4096
    assert default_chunk_rows(16384, 50304, 4) == 2432  # fp32: 7 chunks, the last shorter
    assert default_chunk_rows(16385, 50304, 2) == 4224  # 4 chunks, the last shorter
    assert default_chunk_rows(100, 50304, 2) == 128  # at least 128 rows
    assert default_chunk_rows(5, 10**9, 4) == 128
    assert default_chunk_rows(8192, 256, 4) == 8192  # a small vocabulary: one chunk


def test_default_chunking_splits_rows(device, monkeypatch):
    # With the default chunk size shrunk to 128 rows, 300 rows take three chunks.
    monkeypatch.setattr(lce_mod, "CHUNK_BYTES", 1)
    x, w, labels = make_inputs(300, 16, 37, device=device, ignore_index=-100)
    check(x, w, labels, -100)


def test_single_chunk_lighter():
    # bf16 (e = 2): one chunk holds (M + K)·V·e, chunks 4·V·K + max(rows, K)·V·e
    V = 128256
    assert single_chunk_lighter(4096, V, 4096, 2, 2048)  # 16384·V against 24576·V bytes
    assert single_chunk_lighter(8192, V, 4096, 2, 2048)  # Llama 3 8B's head: equal
    assert not single_chunk_lighter(8193, V, 4096, 2, 2048)
    assert not single_chunk_lighter(8192, V, 2048, 2, 2048)  # Llama 3.2 1B's: 20480 vs 12288
    assert not single_chunk_lighter(16384, 50304, 768, 2, 4096)  # GPT-2's


def _forward_launches(monkeypatch) -> list:
    """Counts the loss kernel's launches: one per chunk."""
    calls = []
    launch = lce_mod.launch_cross_entropy_fwd
    monkeypatch.setattr(
        lce_mod, "launch_cross_entropy_fwd", lambda *a, **k: calls.append(1) or launch(*a, **k)
    )
    return calls


@pytest.mark.parametrize("K, chunks", [(200, 1), (16, 3)], ids=["one-chunk", "chunks"])
def test_bf16_weight_takes_one_chunk_where_lighter(K, chunks, device, monkeypatch):
    # 300 rows, 37 classes, default chunks shrunk to 128 rows: with K = 200 one chunk holds
    # (300 + 200)·37·2 = 37,000 bytes against chunks' 4·37·200 + 200·37·2 = 44,400, so it
    # takes one (dW in bf16 from one product); with K = 16 the chunks are lighter
    monkeypatch.setattr(lce_mod, "CHUNK_BYTES", 1)
    calls = _forward_launches(monkeypatch)
    x, w, labels = make_inputs(300, K, 37, torch.bfloat16, device, ignore_index=-100)
    check(x, w, labels, -100)
    assert len(calls) == chunks


def test_bf16_weight_without_autograd_keeps_its_chunks(device, monkeypatch):
    # no gradient is written under no_grad, so one chunk would save nothing: evaluation keeps
    # the default chunks (three of 128 rows here) even for a weight that requires grad
    monkeypatch.setattr(lce_mod, "CHUNK_BYTES", 1)
    calls = _forward_launches(monkeypatch)
    x, w, labels = make_inputs(300, 200, 37, torch.bfloat16, device, ignore_index=-100)
    w.requires_grad_()
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, labels, -100, use_triton=True)
    assert len(calls) == 3
    ref_loss = reference(x, w, labels, -100)[0]
    assert abs(loss.item() - ref_loss.item()) <= LOSS_TOL[torch.bfloat16] * abs(ref_loss.item())


def test_bf16_weight_gradient_from_one_product(device, monkeypatch):
    # one chunk and a bf16 weight: dW is written in bf16 by its product (no fp32 buffer, no
    # cast); with an fp32 weight under autocast, or several chunks, it stays fp32
    x, w, labels = make_inputs(40, 24, 37, torch.bfloat16, device, ignore_index=-100)
    _, dx, dw, _ = linear_cross_entropy_op(x, w, labels, -100, 64, True, True, True)
    assert dw.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16
    _, ref_dx, ref_dw = reference(x, w, labels, -100, dloss=1.0)
    assert rel_err(dw, ref_dw) <= 1e-2 and rel_err(dx, ref_dx) <= 1e-2
    with pytest.raises(ValueError, match="one chunk"):  # chunks would accumulate in bf16
        linear_cross_entropy_op(x, w, labels, -100, 16, True, True, True)
    seen = []
    chunks = lce_mod._forward_chunks  # dw_in_x_dtype is its 9th argument
    monkeypatch.setattr(lce_mod, "_forward_chunks", lambda *a: seen.append(a[8]) or chunks(*a))
    for chunk_rows, want in ((None, True), (40, True), (16, False)):
        run(x, w, labels, -100, chunk_rows=chunk_rows)
        assert seen.pop() is want, chunk_rows
    with torch.autocast(device, dtype=torch.bfloat16):  # an fp32 weight read through a copy
        run(x.float(), w.float(), labels, -100)
    assert seen.pop() is False


# ---- autograd contract, errors, registration ---------------------------------------------------


def test_double_backward_raises(device, assert_first_order_only):
    x, w, labels = make_inputs(6, 16, 37, device=device)
    x.requires_grad_()
    f = lambda x: linear_cross_entropy(x, w, labels, use_triton=True)
    assert_first_order_only(f, x, "linear_cross_entropy")


def test_one_backward_per_forward(device):
    x, w, labels = make_inputs(6, 16, 37, device=device)
    x.requires_grad_()
    loss = linear_cross_entropy(x, w, labels, use_triton=True)
    loss.backward(torch.tensor(2.0, device=device), retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


@pytest.mark.parametrize("use_triton", [False, True])
def test_bad_arguments(use_triton, device):
    x, w, labels = make_inputs(6, 16, 37, device=device)
    f = lambda *a, **k: linear_cross_entropy(*a, use_triton=use_triton, **k)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        f(x.tolist(), w, labels)
    with pytest.raises(TypeError, match="weight must be a floating-point"):
        f(x, w.long(), labels)
    with pytest.raises(TypeError, match="labels must be int64"):
        f(x, w, labels.int())
    with pytest.raises(TypeError, match="same dtype"):
        f(x, w.double(), labels)
    with pytest.raises(TypeError, match="ignore_index"):
        f(x, w, labels, ignore_index=1.5)
    with pytest.raises(TypeError, match="chunk_rows"):
        f(x, w, labels, chunk_rows=2.0)
    with pytest.raises(ValueError, match="chunk_rows"):
        f(x, w, labels, chunk_rows=0)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        f(x, w[None], labels)
    with pytest.raises(ValueError, match="x's last dim"):
        f(x[:, :8], w, labels)
    with pytest.raises(ValueError, match="labels shape"):
        f(x, w, labels[:5])
    with pytest.raises(ValueError, match="labels on"):
        f(x, w, labels.to("meta"))
    with pytest.raises(ValueError, match="empty vocabulary"):
        f(x, w[:0], labels)


def test_triton_rejects_float64(device):
    x, w, labels = make_inputs(6, 16, 37, device=device)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        linear_cross_entropy(x.double(), w.double(), labels, use_triton=True)


def test_registered_custom_ops(device):
    # Schema (and, on a GPU, fake tensors and AOT tracing); no autograd of their own (the
    # autograd.Function wraps them).
    tests = ["test_schema"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    x, w, labels = make_inputs(7, 16, 37, device=device, ignore_index=-100)
    # without an ignore_index every label must be in range (a -100 poisons the loss with NaN,
    # which opcheck's eager-vs-traced comparison counts as a mismatch)
    in_range = labels.clamp(min=0)
    for args in (
        (x, w, labels, -100, 4, True, True, False),
        (x, w, in_range, None, 16, False, False, False),
        (x.bfloat16(), w.bfloat16(), labels, -100, 7, True, True, True),  # dW in bf16
    ):
        torch.library.opcheck(linear_cross_entropy_op, args, test_utils=tests)
    _, dx, dw, n_valid = linear_cross_entropy_op(x, w, labels, -100, 4, True, True, False)
    dloss = torch.tensor(1.3, device=device)
    for divide in (False, True):
        torch.library.opcheck(
            linear_cross_entropy_scale_op, (dx.clone(), dw.clone(), dloss, n_valid, divide),
            test_utils=tests,
        )  # fmt: skip


# The trace check: Dynamo with fullgraph (any graph break fails), then AOTAutograd's joint
# forward + backward trace, stopped at the partitioner: no kernel runs. TRITON_INTERPRET=0 in a
# subprocess, because torch.library traces JITFunctions only.
_TRACE_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch._dynamo.backends.common import aot_autograd
    import triton_transformer.utils as utils_mod
    utils_mod.interpreter_enabled = lambda: True  # CPU tensors pass the device check
    import triton_transformer.linear_cross_entropy as lce

    class Traced(Exception):
        pass

    def partition(joint, inputs, **kwargs):
        ops = {str(n.target) for n in joint.graph.nodes if n.op == "call_function"}
        raise Traced(sorted(t for t in ops if "triton" in t))

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)
    w = torch.randn(300, 64, requires_grad=True)
    w16 = torch.randn(300, 64).bfloat16().requires_grad_()
    labels = torch.randint(300, (128,))
    labels[::7] = -100

    def fused(h, ignore, autocast, bf16):
        # bf16: a bf16 weight in the default one chunk, its dW written in bf16 (the op's
        # dw_in_x_dtype); else chunks of 48 rows, dW accumulated in fp32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return lce.linear_cross_entropy(
                h.sin(), w16 if bf16 else w, labels.clamp(min=0) if ignore is None else labels,
                ignore, use_triton=True, check_labels=False, chunk_rows=None if bf16 else 48,
            )

    ok = True
    for dynamic in (False, True):
        for ignore, autocast, bf16 in (
            (-100, False, False), (None, False, False), (-100, True, False), (-100, False, True)
        ):
            torch._dynamo.reset()
            h = torch.randn(128, 64, dtype=torch.bfloat16 if bf16 else torch.float32)
            h.requires_grad_()
            name = f"ignore={ignore} autocast={autocast} bf16={bf16} dynamic={dynamic}"
            try:
                fn = lambda h: fused(h, ignore, autocast, bf16)
                torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(h)
                print(f"FAIL {name}: the partitioner was not reached")
                ok = False
            except Exception as e:  # Dynamo wraps the backend's exception
                cause = e
                while cause is not None and not isinstance(cause, Traced):
                    cause = cause.__cause__ or cause.__context__
                if cause is None or not cause.args[0]:
                    print(f"FAIL {name}: {type(e).__name__}: {str(e)[:800]}")
                    ok = False
                else:
                    print(f"OK {name}: {cause.args[0]}")
    sys.exit(0 if ok else 1)
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_compile_traces_without_graph_breaks_cpu():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _TRACE_SCRIPT], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert proc.returncode == 0 and len(lines) == 8, proc.stdout + proc.stderr[-3000:]


# ---- in the model ------------------------------------------------------------------------------


def _model_grads(model, x, labels, fused):
    model.fused_loss = fused
    model.zero_grad(set_to_none=True)
    loss = model(x, labels=labels, ignore_index=-100)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_fused_matches_unfused(dtype, device):
    # Same parameters, same loss and gradients whether the loss is fused or not.
    model = Transformer(
        num_tokens=131, dim=32, max_seq_len=8, depth=1, heads=2, dim_head=16, causal=True,
        use_triton=True,
    ).to(device)  # fmt: skip
    assert model.fused_loss
    x = torch.randint(131, (2, 8), device=device)
    labels = torch.randint(131, (2, 8), device=device)
    labels[0, :2] = -100
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        fused = _model_grads(model, x, labels, True)
        unfused = _model_grads(model, x, labels, False)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    names = ["loss"] + [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, fused, unfused, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    # evaluation: the chunked loss without gradients, and logits still there when asked for
    with torch.no_grad():
        eval_loss = model(x, labels=labels, ignore_index=-100)
        logits = model(x)
    ref = F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), ignore_index=-100)
    assert logits.shape == (2, 8, 131)
    assert abs(eval_loss.item() - ref.item()) <= 1e-5 * ref.item()  # both in fp32
    assert (
        model.state_dict().keys()
        == Transformer(
            num_tokens=131, dim=32, max_seq_len=8, depth=1, heads=2, dim_head=16, fused_loss=False
        )
        .state_dict()
        .keys()
    )


def test_model_loss_chunk_rows(device, monkeypatch):
    # `loss_chunk_rows` reaches the fused loss (3 rows per chunk: 6 chunks of 16 tokens, the
    # last one short), with the same loss and gradients as the default single chunk; bad
    # values fail at construction
    seen = []
    real = lce_mod.launch_cross_entropy_fwd
    monkeypatch.setattr(
        lce_mod,
        "launch_cross_entropy_fwd",
        lambda z, *a, **kw: seen.append(z.shape[1]) or real(z, *a, **kw),
    )
    kwargs = dict(num_tokens=37, dim=32, max_seq_len=8, depth=1, heads=2, dim_head=16,
                  causal=True, use_triton=True)  # fmt: skip
    model = Transformer(**kwargs).to(device)
    x = torch.randint(37, (2, 8), device=device)
    labels = torch.randint(37, (2, 8), device=device)
    default = _model_grads(model, x, labels, True)
    assert seen == [16]
    seen.clear()
    model.loss_chunk_rows = 3
    chunked = _model_grads(model, x, labels, True)
    assert seen == [3, 3, 3, 3, 3, 1]
    for a, b in zip(default, chunked, strict=True):
        assert rel_err(a, b) <= 1e-5
    assert Transformer(**kwargs, loss_chunk_rows=3).loss_chunk_rows == 3
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="loss_chunk_rows must be a positive int or None"):
            Transformer(**kwargs, loss_chunk_rows=bad)


# ---- realistic shapes on a GPU -----------------------------------------------------------------


def _step_peak(x, w, labels, fused: bool, chunk_rows=None) -> tuple[int, list[torch.Tensor]]:
    """Extra peak memory (bytes above what was allocated before) of one forward + backward of
    the output projection + loss under bf16 autocast; and (loss, dx, dW)."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if fused:
            loss = linear_cross_entropy(
                x, w, labels, -100, use_triton=True, check_labels=False, chunk_rows=chunk_rows
            )
        else:
            logits = linear(x, w, use_triton=True)
            loss = cross_entropy(
                logits, labels, -100, use_triton=True, check_labels=False, inplace_backward=True
            )
            del logits
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, [loss.detach(), x.grad, w.grad]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4096, 16384])
def test_gpu_gpt2_shape_matches_unfused_with_less_memory(rows, device):
    # GPT-2's output layer: 768 -> 50304, bf16 autocast, fp32 weight.
    K, V = 768, 50304
    x = torch.randn(rows, K, device=device)
    w = torch.randn(V, K, device=device) * 0.02
    labels = torch.randint(V, (rows,), device=device)
    labels[:17] = -100
    chunk_rows = rows // 4  # four chunks (the default takes one at 4096 rows)
    for fused in (True, False):  # warm-up: autotuning, cuBLAS workspaces
        _step_peak(x, w, labels, fused, chunk_rows)
    peak_fused, got = _step_peak(x, w, labels, True, chunk_rows)
    peak_unfused, ref = _step_peak(x, w, labels, False)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    assert abs(got[0].item() - ref[0].item()) <= 1e-3 * ref[0].item()
    assert rel_err(got[1], ref[1]) <= 1e-2 and rel_err(got[2], ref[2]) <= 1e-2
    logits_bytes = rows * V * 2
    chunk_bytes = chunk_rows * V * 2
    saved = peak_unfused - peak_fused
    print(f"rows {rows}: peak fused {peak_fused / 1e9:.3f} GB, unfused {peak_unfused / 1e9:.3f}")
    assert saved >= 0.9 * (logits_bytes - chunk_bytes), (peak_fused, peak_unfused)


@pytest.mark.gpu
def test_gpu_bf16_weight_one_chunk_holds_less(device, monkeypatch):
    # A bf16 weight with K = tokens: default chunks shrunk to 1024 rows would hold dW's fp32
    # accumulator (512 MiB) beside a chunk's logits, then the accumulator beside its bf16 cast
    # (768 MiB); one chunk holds the logits and dW in bf16 (512 MiB), so the default takes it
    M, K, V = 4096, 4096, 32768
    monkeypatch.setattr(lce_mod, "CHUNK_BYTES", 2**26)
    x, w, labels = make_inputs(M, K, V, torch.bfloat16, device, ignore_index=-100)
    for chunk_rows in (None, 1024):  # warm-up
        _step_peak(x, w, labels, True, chunk_rows)
    peak_one, got = _step_peak(x, w, labels, True)
    peak_chunks, ref = _step_peak(x, w, labels, True, 1024)
    assert got[2].dtype == torch.bfloat16
    assert abs(got[0].item() - ref[0].item()) <= 1e-3 * ref[0].item()
    assert rel_err(got[1], ref[1]) <= 1e-2 and rel_err(got[2], ref[2]) <= 1e-2
    print(f"peak one chunk {peak_one / 2**20:.0f} MiB, chunks {peak_chunks / 2**20:.0f} MiB")
    assert peak_chunks - peak_one >= 0.8 * 256 * 2**20, (peak_one, peak_chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_realistic_against_float64(dtype, device):
    x, w, labels = make_inputs(3000, 512, 32000, dtype, device, ignore_index=-100)
    check(x, w, labels, -100, chunk_rows=1024, check_labels=False)


def _train_losses(fused: bool, steps: int = 30) -> list[float]:
    torch.manual_seed(0)
    model = Transformer(
        num_tokens=8192, dim=256, max_seq_len=256, depth=2, heads=4, dim_head=64, causal=True,
        use_triton=True, check_token_ids=False, fused_loss=fused,
    )  # fmt: skip
    model = AutoregressiveWrapper(model).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    # A learnable stream over 512 of the 8192 ids: each token is the previous one, plus 1
    # half of the time.
    losses = []
    for _ in range(steps):
        start = torch.randint(0, 512, (8, 1), generator=gen)
        walk = torch.randint(0, 2, (8, 257), generator=gen).cumsum(1)
        batch = ((start + walk) % 512).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
def test_gpu_training_loss_curves_match(monkeypatch):
    monkeypatch.setattr(lce_mod, "CHUNK_BYTES", 512 * 8192 * 2)  # 4 chunks of 512 tokens
    fused, unfused = _train_losses(True), _train_losses(False)
    assert fused[-1] < fused[0] - 1.0  # it learns
    diffs = [abs(a - b) for a, b in zip(fused, unfused, strict=True)]
    assert max(diffs) <= 0.02 * max(unfused), (fused, unfused)


@pytest.mark.gpu
def test_gpu_cuda_graph_matches_eager(monkeypatch):
    from triton_transformer.cuda_graph import GraphedStep, StaticInputs

    monkeypatch.setattr(lce_mod, "CHUNK_BYTES", 128 * 1000 * 2)  # 4 chunks of 128 tokens

    batches = torch.randint(0, 1000, (6, 4, 129), generator=torch.Generator().manual_seed(1))
    losses = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = Transformer(
            num_tokens=1000, dim=128, depth=2, heads=4, dim_head=32, max_seq_len=128,
            causal=True, use_triton=True, check_token_ids=False,
        )  # fmt: skip
        model = AutoregressiveWrapper(model).cuda().train()
        params = list(model.parameters())
        opt = torch.optim.AdamW(
            params, lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True
        )
        inputs = StaticInputs((4, 129), torch.int64, torch.device("cuda"))

        def step(model=model, opt=opt, params=params, inputs=inputs):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(inputs.device_buffer)
            loss.backward()
            norm = nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            return loss.detach(), norm

        run_step = GraphedStep(step, warmup_steps=2) if graphed else step
        out = []
        for b in batches:
            inputs.load(b)
            loss, norm = run_step()
            out.append(torch.stack([loss, norm]).tolist())
        losses[graphed] = out
        if graphed:
            assert run_step.captured
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=0)


@pytest.mark.gpu
def test_gpu_compiles_without_graph_breaks(device):
    w = (torch.randn(1000, 64, device=device) * 0.1).requires_grad_()
    labels = torch.randint(1000, (256,), device=device)
    labels[::7] = -100

    def f(h):
        return linear_cross_entropy(
            h.sin(), w, labels, -100, use_triton=True, check_labels=False, chunk_rows=96
        )

    h = torch.randn(256, 64, device=device, requires_grad=True)
    explanation = torch._dynamo.explain(f)(h)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    loss = torch.compile(f)(h)
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(h.detach().sin(), w, labels, -100, dloss=1.0)
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * ref_loss.item()
    assert rel_err(w.grad, ref_dw) <= 1e-4
    assert rel_err(h.grad, ref_dh * h.detach().cos().double()) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [None, 4])
@pytest.mark.parametrize("check_labels", [True, False])
def test_eager_plan_matches_the_registered_op(check_labels, chunk_rows, dtype, device, monkeypatch):
    # An eager call binds its chunks' kernels and products once per layout (`_Launches`,
    # the label check's verdict written by the mean's kernel where it checks); later calls
    # reuse them. Loss and gradients equal the registered op's bit for bit (the same
    # kernels), one chunk or three (the last one shorter), with and without autograd.
    checked = []
    check_pair = lce_mod._check_pair
    monkeypatch.setattr(
        lce_mod, "_check_pair", lambda *a, **k: checked.append(1) or check_pair(*a, **k)
    )
    x, w, labels = make_inputs(10, 16, 37, dtype, device, ignore_index=-100)
    rows = chunk_rows or 10
    ref_loss, ref_dx, ref_dw, _ = linear_cross_entropy_op(
        x, w, labels, -100, rows, True, True, dtype == torch.bfloat16 and rows == 10
    )
    for _ in range(2):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        kwargs = dict(use_triton=True, chunk_rows=chunk_rows, check_labels=check_labels)
        loss = linear_cross_entropy(xs, ws, labels, -100, **kwargs)
        loss.backward()
        assert torch.equal(loss, ref_loss) and torch.equal(xs.grad, ref_dx)
        assert torch.equal(ws.grad, ref_dw.to(dtype))
        with torch.no_grad():
            again = linear_cross_entropy(x, w, labels, -100, **kwargs)
        assert torch.equal(again, ref_loss)
    plans = list(lce_mod._EAGER_PLANS.plans.values())
    assert len(plans) == 2  # with gradients and without
    n_chunks = 3 if chunk_rows else 1  # + the count and the mean; + dx's and dW's scale
    assert sorted(len(p.kernels) for p in plans) == [2 + n_chunks, 4 + n_chunks]
    # the second call of each layout (with and without autograd) skipped the checks
    assert len(checked) == 2 and len(lce_mod._PLANNED_CALLS.plans) == 2


def test_planned_calls_keep_the_checks(device):
    # A planned call is keyed by every fact the checks read: another dtype, shape, gradient
    # request or ignore_index is checked (and planned) afresh, and bad labels still raise.
    x, w, labels = make_inputs(10, 16, 37, torch.float32, device, ignore_index=-100)
    for _ in range(2):
        linear_cross_entropy(x, w, labels, -100, use_triton=True)
    with pytest.raises(TypeError, match="same dtype"):
        linear_cross_entropy(x, w.double(), labels, -100, use_triton=True)
    with pytest.raises(ValueError, match="labels shape"):
        linear_cross_entropy(x, w, labels[:9], -100, use_triton=True)
    bad = labels.clone()
    bad[4] = 37
    with pytest.raises(ValueError, match="found label 37"):
        linear_cross_entropy(x, w, bad, -100, use_triton=True)
        raise_pending()
    # (b, n) labels sliced from (b, n + 1) ones: read through a copy, every call
    strided = torch.cat([labels.view(2, 5), labels[:2, None]], 1)[:, :5]
    want = linear_cross_entropy(x, w, labels, -100, use_triton=True)
    for _ in range(2):
        got = linear_cross_entropy(x.view(2, 5, 16), w, strided, -100, use_triton=True)
        assert torch.equal(got, want)
    loss = linear_cross_entropy(x.requires_grad_(), w, labels.clamp(min=0), None, use_triton=True)
    loss.backward()
    assert x.grad is not None and len(lce_mod._PLANNED_CALLS.plans) == 3


def test_planned_call_made_under_anomaly_detection_keeps_the_check(device):
    # A layout first called in anomaly-detection mode (which checks before the kernels, so
    # its launches write no verdict) is not planned for later checked calls: those still
    # raise for a bad label.
    x, w, labels = make_inputs(8, 16, 11, device=device)
    bad = labels.clone()
    bad[3] = 40
    with torch.autograd.set_detect_anomaly(True):
        linear_cross_entropy(x, w, labels, use_triton=True)
    for _ in range(2):
        with pytest.raises(ValueError, match="found label 40"):
            linear_cross_entropy(x, w, bad, use_triton=True)
            raise_pending()


def test_planned_call_follows_chunk_bytes(monkeypatch, device):
    # The default chunking reads CHUNK_BYTES (benchmarks sweep it in one process): a planned
    # call of a layout seen before chooses its chunks again when it changes.
    x, w, labels = make_inputs(256, 16, 11, device=device)
    seen = []
    chunks = lce_mod._forward_chunks  # chunk_rows is its 6th argument
    monkeypatch.setattr(lce_mod, "_forward_chunks", lambda *a: seen.append(a[5]) or chunks(*a))
    linear_cross_entropy(x, w, labels, use_triton=True)
    monkeypatch.setattr(lce_mod, "CHUNK_BYTES", 128 * 11 * 4)
    linear_cross_entropy(x, w, labels, use_triton=True)
    assert seen == [256, 128]
