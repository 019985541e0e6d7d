"""The plumbing of the ops' eager plans in `utils`: `eager_apply` (the plans call their
autograd.Functions through the C++ apply, without `Function.apply`'s Python prologue, except
under functorch transforms) and `eager_plan_key` (a plan made by a valid call admits no call
the checks refuse)."""

import pytest
import torch

from triton_transformer.attention import attention
from triton_transformer.bmm import linear
from triton_transformer.rope import rope
from triton_transformer.utils import eager_apply


class _Double(torch.autograd.Function):
    """y = 2·x + c (c a Python number, as a plan is passed); the backward returns 3·g for x,
    not the true 2·g, so a test sees that this backward ran."""

    @staticmethod
    def forward(ctx, x, c):
        return x * 2 + c

    @staticmethod
    def backward(ctx, g):
        return g * 3, None


class _WithSetupContext(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


def test_same_outputs_and_graph_as_apply():
    apply = eager_apply(_Double)
    x = torch.randn(5, requires_grad=True)
    y = apply(x, 0.5)
    want = _Double.apply(x, 0.5)
    assert torch.equal(y, want) and type(y.grad_fn) is type(want.grad_fn)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    with torch.no_grad():
        assert apply(x, 0.5).grad_fn is None


def test_defers_to_apply_under_functorch_transforms():
    # Under torch.func.grad, Function.apply takes functorch's path, which refuses a Function
    # without setup_context: that error shows eager_apply deferred to it
    apply = eager_apply(_Double)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: apply(x, 0.5).sum())(torch.randn(3))


class _WithVjp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def vjp(ctx, g):
        return g * 5


class _Counted(torch.autograd.Function):
    """y = x; its backward counts its calls and returns 3·g."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Counted.calls += 1
        return g * 3


def test_the_engine_calls_backward_directly():
    # eager_apply gives the Function's nodes an `apply` that calls backward itself, in place
    # of torch's Python one (which looks backward and vjp up on every call); same result,
    # through autograd's engine and through grad_fn.apply
    torch_apply = _Counted._backward_cls.apply
    apply = eager_apply(_Counted)
    assert _Counted._backward_cls.apply is not torch_apply
    x = torch.randn(4, requires_grad=True)
    apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0)) and _Counted.calls == 1
    g = apply(x).grad_fn.apply(torch.ones(4))
    assert torch.equal(g, torch.full_like(x, 3.0)) and _Counted.calls == 2


def test_functions_with_vjp_keep_torchs_backward_call():
    torch_apply = _WithVjp._backward_cls.apply
    apply = eager_apply(_WithVjp)
    assert _WithVjp._backward_cls.apply is torch_apply
    x = torch.randn(3, requires_grad=True)
    apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 5.0))


def test_functions_with_setup_context_keep_apply():
    assert eager_apply(_WithSetupContext) == _WithSetupContext.apply


def test_plan_keys_tell_bools_from_numbers(device):
    # False == 0 == 0.0 and True == 1 == 1.0 hash alike; the checks refuse a bool where they
    # take a number. Made by a valid call first, a plan must not admit the refused one.
    x = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(16, 8, device=device)
    q = torch.randn(1, 2, 4, 16, device=device, requires_grad=True)
    calls = [
        (lambda p: linear(x, w, activation="relu_squared", dropout_p=p, use_triton=True), 0.0),
        (lambda p: attention(q, q, q, dropout_p=p, use_triton=True), 0.0),
        (lambda b: rope(q, q, base=b, use_triton=True), 1.0),
    ]
    for call, valid in calls:
        call(valid)
        with pytest.raises((TypeError, ValueError)):
            call(bool(valid))
