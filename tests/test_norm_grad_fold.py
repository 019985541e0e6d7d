"""The norms' parameter gradients summed over micro-batches in place
(`bmm.accumulate_grads_in_place`): layernorm, residual_layernorm, rmsnorm and residual_rmsnorm
add dweight (and dbias) into the parameters' `.grad` in their column-sum kernel, instead of
autograd adding a fresh gradient in a kernel of its own."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import CountAdds, compile_trace_check

import triton_transformer.bmm as bmm_module
from triton_transformer.layernorm import layernorm
from triton_transformer.residual_layernorm import residual_layernorm
from triton_transformer.rmsnorm import residual_rmsnorm, rmsnorm

NORMS = ["layernorm", "residual_layernorm", "rmsnorm", "residual_rmsnorm"]
N = 45  # columns: not a power of two, so the column sums' last block is ragged


def rand(shape, dtype, device, mean: float, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, dtype=torch.float64) * std + mean).to(device=device, dtype=dtype)


def norm_params(norm: str, device, bias: bool = True) -> list[torch.Tensor]:
    w = rand((N,), torch.float32, device, mean=1.0, std=0.3).requires_grad_()
    if norm.endswith("rmsnorm") or not bias:
        return [w]
    return [w, rand((N,), torch.float32, device, mean=0.1, std=0.3).requires_grad_()]


def norm_loss(norm: str, params, x: torch.Tensor, scale: float) -> torch.Tensor:
    """A loss through one call of `norm` (Triton path) whose parameter gradients depend on
    x and `scale`; the residual norms also pass a gradient through h_new."""
    w, b = params[0], params[1] if len(params) > 1 else None
    cols = torch.linspace(0.5, 1.5, N, device=x.device)
    if norm == "layernorm":
        y = layernorm(x, w, b, use_triton=True)
    elif norm == "rmsnorm":
        y = rmsnorm(x, w, use_triton=True)
    else:
        fn = residual_layernorm if norm == "residual_layernorm" else residual_rmsnorm
        kwargs = {"bias": b} if norm == "residual_layernorm" else {}
        h_new, y = fn(x, x.flip(0), w, use_triton=True, **kwargs)
        return (y * cols).sum() * scale + (h_new**2).sum()
    return (y * cols).sum() * scale


def accumulated(norm: str, in_place: bool, device, bias: bool = True, micro_batches: int = 3):
    """The parameters' `.grad` after `micro_batches` backwards, and the number of separate
    adds into parameter-shaped tensors (autograd's accumulation into `.grad`)."""
    torch.manual_seed(0)
    params = norm_params(norm, device, bias)
    x = rand((micro_batches, 21, N), torch.float32, device, mean=0.3)
    context = bmm_module.accumulate_grads_in_place() if in_place else contextlib.nullcontext()
    with context, CountAdds((N,)) as adds:
        for i in range(micro_batches):
            norm_loss(norm, params, x[i], 0.5 + i).backward()
    return [p.grad for p in params], adds.adds


@pytest.mark.parametrize("norm", NORMS)
def test_norm_grads_accumulate_in_place(norm, device, monkeypatch):
    # Each backward after the first adds its column sums into .grad: the sums are autograd's
    # (one fp32 rounding fewer per micro-batch) and autograd adds nothing.
    want, want_adds = accumulated(norm, False, device)
    got, got_adds = accumulated(norm, True, device)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert want_adds == 2 * len(want)  # micro-batches 2 and 3, each parameter
    assert got_adds == 0
    # switched off, the context changes nothing (bit for bit)
    monkeypatch.setattr(bmm_module, "ACCUMULATE_IN_PLACE", False)
    off, off_adds = accumulated(norm, True, device)
    for g, w in zip(off, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert off_adds == want_adds


@pytest.mark.parametrize("norm", ["layernorm", "residual_layernorm"])
def test_norm_grads_without_bias_accumulate_in_place(norm, device):
    want, _ = accumulated(norm, False, device, bias=False)
    got, adds = accumulated(norm, True, device, bias=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert adds == 0


@pytest.mark.parametrize("norm", NORMS)
def test_norm_grads_yield_to_hooks_and_other_callers(norm, device):
    # A hook on a parameter sees one backward's gradient, never the running sum; a held
    # reference to .grad keeps seeing every micro-batch; torch.autograd.grad returns the
    # gradient and leaves .grad alone. The other parameter (bias) still folds.
    torch.manual_seed(1)
    params = norm_params(norm, device)
    x = rand((21, N), torch.float32, device, mean=0.3)
    seen = []
    params[0].register_hook(lambda g: seen.append(g.clone()))
    (once,) = torch.autograd.grad(norm_loss(norm, params, x, 1.0), params[:1])
    with bmm_module.accumulate_grads_in_place():
        norm_loss(norm, params, x, 1.0).backward()
        held = [p.grad for p in params]
        for _ in range(2):
            norm_loss(norm, params, x, 1.0).backward()
        (again,) = torch.autograd.grad(norm_loss(norm, params, x, 1.0), params[:1])
    assert all(h is p.grad for h, p in zip(held, params, strict=True))
    torch.testing.assert_close(params[0].grad, 3 * once, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again, once, rtol=0, atol=0)
    assert len(seen) == 5
    for g in seen:
        torch.testing.assert_close(g, once, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_norm_grads_traced_backward_cpu():
    # accumulate_grads_in_place(traced=True): the backward AOTAutograd traces for each norm
    # adds dweight (and dbias) into the `.grad` its forward passed, written back into that
    # graph input, and returns no gradient for the parameters; without `.grad` nothing is
    # passed. A subprocess (kernels as JITFunctions, `_compile_trace_check.py`); no kernel runs.
    passed, cases, output = compile_trace_check("norm_fold")
    assert passed and cases == 5, output


def test_norm_backward_ops_skip_the_dispatcher_eagerly():
    # The backward ops declare their `.grad` accumulators as mutated (for tracing), which
    # would send every eager call through the dispatcher (`utils.call_op`); registered with
    # `utils.accumulates_grads`, an eager backward calls the implementation directly.
    from triton_transformer import layernorm, residual_layernorm, rmsnorm, utils

    ops = (
        layernorm.layernorm_backward_op,
        residual_layernorm.residual_layernorm_backward_op,
        rmsnorm.rmsnorm_backward_op,
        rmsnorm.residual_rmsnorm_backward_op,
    )
    for op in ops:
        assert utils._mutates(op)
        assert utils._eager_impl(op) is not None
