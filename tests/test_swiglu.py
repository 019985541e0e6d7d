"""SwiGLU's gating silu(gate) * up: the fused Triton kernels against a float64 run of the
PyTorch branch; plus the compile-trace and sm_90 checks of every modern op (RMSNorm, RoPE,
SwiGLU) in one subprocess (`_modern_trace_check.py`); and the feed-forward's gating fused into
its input projection (`linear(..., activation="swiglu")`, tested itself in test_bmm.py)."""

import pytest
import torch
from _modern_helpers import (
    LLAMA,
    LOW_PRECISION,
    TOL,
    assert_close,
    grads,
    run_trace_check,
    train_both_branches,
)

import triton_transformer.bmm as bmm_module
import triton_transformer.swiglu as sw_mod
from triton_transformer.bmm import linear
from triton_transformer.swiglu import swiglu, swiglu_backward_op, swiglu_op
from triton_transformer.transformer import FeedForward, Transformer


def _pair(shape, dtype=torch.float32, device="cpu"):
    gate = (0.5 + 2.0 * torch.randn(shape, device=device)).to(dtype)
    up = (-0.2 + torch.randn(shape, device=device)).to(dtype)
    return gate, up


def _check(gate, up, tol):
    dy = torch.randn(gate.shape, device=gate.device).to(gate.dtype)
    out, gs = grads(lambda g, u: swiglu(g, u, use_triton=True), (gate, up), (dy,))
    ref, rgs = grads(lambda g, u: swiglu(g, u), (gate.double(), up.double()), (dy.double(),))
    for name, o, e in zip(("y", "dgate", "dup"), (*out, *gs), (*ref, *rgs), strict=True):
        assert o.dtype == gate.dtype and o.shape == gate.shape, name
        assert_close(o, e, tol, name)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("shape", [(1,), (7, 37), (3, 5, 64), (2, 3, 2, 1030)])
def test_forward_backward(shape, dtype, device):
    # 1030 columns: two column tiles of MAX_BLOCK_N = 1024, the second partial
    gate, up = _pair(shape, dtype, device)
    _check(gate, up, TOL[dtype])


def test_strided_halves_and_extremes(device):
    # the model's case: gate and up are the halves of one projection (row stride 2·N)
    x = torch.randn(3, 4, 2 * 45, device=device)
    gate, up = x.chunk(2, dim=-1)
    _check(gate, up, 1e-5)
    _check(gate.transpose(0, 1), up.transpose(0, 1), 1e-5)
    _check(gate[..., ::3], up[..., ::3], 1e-5)  # non-unit last stride: copied
    # saturated sigmoids: no overflow, silu(-100) = 0, silu(100) = 100
    g = torch.tensor([[-100.0, -30.0, 0.0, 30.0, 100.0]], device=device)
    u = torch.ones_like(g)
    torch.testing.assert_close(swiglu(g, u, use_triton=True), swiglu(g, u))
    _check(g, u, 1e-5)


@pytest.mark.parametrize("use_triton", [False, True])
def test_with_and_without_grad_recording(use_triton, device):
    gate, up = _pair((5, 40), device=device)
    with torch.no_grad():
        a = swiglu(gate, up, use_triton=use_triton)
    b = swiglu(gate.requires_grad_(), up, use_triton=use_triton)
    assert b.requires_grad and not a.requires_grad and torch.equal(a, b.detach())
    assert b._base is None


def test_registered_custom_ops(device):
    gate, up = _pair((6, 33), device=device)
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(swiglu_op, (gate.requires_grad_(), up.requires_grad_()), test_utils=tests)
    torch.library.opcheck(
        swiglu_backward_op, (torch.randn_like(gate), gate.detach(), up.detach()), test_utils=tests
    )


def test_double_backward_raises(device, assert_first_order_only):
    gate, up = _pair((4, 16), device=device)
    gate.requires_grad_()
    assert_first_order_only(lambda g: swiglu(g, up, use_triton=True), gate, "swiglu")


def test_validation_errors(device):
    gate, up = _pair((4, 8), device=device)
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="up shape"):
            swiglu(gate, up[:2], use_triton=use_triton)
        with pytest.raises(TypeError, match="up dtype"):
            swiglu(gate, up.half(), use_triton=use_triton)
        with pytest.raises(TypeError, match="gate must be a float"):
            swiglu(gate.long(), up, use_triton=use_triton)
    with pytest.raises(TypeError, match="dtype"):
        swiglu(gate.double(), up.double(), use_triton=True)


def test_zero_size(device):
    gate, up = _pair((0, 7), device=device)
    leaves = [gate.requires_grad_(), up.requires_grad_()]
    swiglu(*leaves, use_triton=True).sum().backward()
    assert gate.grad.shape == gate.shape
    assert sw_mod.MAX_BLOCK_N >= 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_compile_traces_and_sm90_kernels_cpu():
    # Dynamo (fullgraph) + AOTAutograd's joint trace of rmsnorm, residual_rmsnorm, rope (with
    # and without positions) and swiglu, static and dynamic shapes (no kernel runs), then
    # every kernel variant compiled for sm_90 with bf16 pointers and fp64 float scalars.
    proc = run_trace_check()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert proc.returncode == 0 and len(lines) == 19, proc.stdout + proc.stderr[-3000:]


# ----------------------------------------------------------------------------- feed-forward


def _spy_linear_swiglu(monkeypatch) -> list:
    """Record the calls of the fused projection: its op (`bmm.linear_swiglu_op`) or an eager
    plan's (`bmm._EagerPlan.swiglu_forward`)."""
    calls = []
    real = bmm_module.linear_swiglu_op
    monkeypatch.setattr(bmm_module, "linear_swiglu_op", lambda *a: calls.append(1) or real(*a))
    planned = bmm_module._EagerPlan.swiglu_forward
    monkeypatch.setattr(
        bmm_module._EagerPlan, "swiglu_forward", lambda *a: calls.append(1) or planned(*a)
    )
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_feedforward_fuses_the_gating_into_its_projection(dtype, device, monkeypatch):
    # The PyTorch branch is the same numbers as before the fusion (linear, halves, swiglu's
    # reference), bit for bit; the Triton branch runs the fused op and agrees with it, forward
    # and gradients. The parameters are unchanged: proj_in (2·hidden, dim).
    torch.manual_seed(0)
    ff = FeedForward(32, mult=2, dropout=0.0, use_triton=True, act="swiglu").to(device, dtype)
    assert set(ff.state_dict()) == {"norm.weight", "proj_in.weight", "proj_out.weight"}
    assert ff.proj_in.weight.shape == (128, 32)
    y = torch.randn(2, 9, 32, device=device).to(dtype)
    gate, up = linear(y, ff.proj_in.weight).chunk(2, dim=-1)
    before = linear(swiglu(gate, up), ff.proj_out.weight)
    assert torch.equal(ff.from_normed(y, use_triton=False), before)
    calls = _spy_linear_swiglu(monkeypatch)
    out, gs = grads(lambda y: ff.from_normed(y, use_triton=True), (y,), (torch.ones_like(y),))
    ref, rgs = grads(lambda y: ff.from_normed(y, use_triton=False), (y,), (torch.ones_like(y),))
    assert calls == [1]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(out[0], ref[0].double(), tol, "y")
    assert_close(gs[0], rgs[0].double(), tol, "dy")


def test_llama_model_trains_alike_through_the_fused_projection(device, monkeypatch):
    # the Llama block (rope, rmsnorm, swiglu, qk-norm): two AdamW steps through the PyTorch
    # branch and through Triton agree (losses and parameters), the gating in the projection
    calls = _spy_linear_swiglu(monkeypatch)
    cfg = dict(num_tokens=48, dim=32, max_seq_len=16, depth=1, heads=2, dim_head=16)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        # no block graphs: on a GPU their capture calls the op once more, and replays not at
        # all, so the count would not be one call per step (test_block_graphs covers them)
        models.append(Transformer(causal=True, cuda_graphs=False, **cfg, **LLAMA).to(device))
    train_both_branches(models, 48)
    assert len(calls) == 2  # one layer, two Triton steps


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_realistic(dtype, device):
    x = torch.randn(8, 1024, 2 * 2816, device=device, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    _check(gate, up, TOL[dtype])


@pytest.mark.gpu
def test_gpu_compiles_without_graph_breaks(device):
    gate, up = _pair((512, 2048), torch.bfloat16, device)
    leaves = [gate.requires_grad_(), up.requires_grad_()]
    f = lambda g, u: swiglu(g.sin(), u, use_triton=True).float().sum()
    explanation = torch._dynamo.explain(f)(*leaves)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.testing.assert_close(torch.compile(f)(*leaves), f(*leaves), rtol=1e-2, atol=1.0)
