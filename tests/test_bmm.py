"""bmm and linear: Triton kernels (forward and backward) against a float64 PyTorch reference.

On the CPU the kernels run in Triton's interpreter with 32-wide tiles, so sizes in the tens
(37, 45, 29) already cover ragged edges in M, N and K, and K > BLOCK_K (the K loop).
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    TOL,
    CountAdds,
    check_grads_fold_alike,
    compile_trace_check,
    pretend_gpu,
    rel_err,
)
from torch.utils._python_dispatch import TorchDispatchMode

import triton_transformer.bmm as bmm_module
import triton_transformer.matmul_kernels as kernels_module
import triton_transformer.matmul_plan as plan_module
import triton_transformer.utils as utils_module
from triton_transformer.bmm import bmm, linear
from triton_transformer.utils import draw_seeds

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(shape, dtype, device, mean=-2.3, std=0.5):
    """Never zero and not centred at zero, so a missing term or a wrong sign shows."""
    return (mean + std * torch.randn(shape, device=device)).to(dtype)


def check_bmm(a, b, dtype):
    """bmm(a, b) and its gradients, Triton vs the float64 reference."""
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    out = bmm(a, b, use_triton=True)
    grad = rand(out.shape, dtype, out.device, mean=0.7)
    out.backward(grad)

    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    ref = bmm(a64, b64)
    ref.backward(grad.double())

    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert rel_err(a.grad, a64.grad) < TOL[dtype]
    assert rel_err(b.grad, b64.grad) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((37, 45), (45, 29)),  # 2-D, ragged M/N/K, K > BLOCK_K
        ((3, 37, 45), (3, 45, 29)),  # one batch dim
        ((2, 3, 19, 45), (2, 3, 45, 33)),  # two batch dims, N just over a tile
        ((2, 1, 5), (2, 5, 1)),  # M = N = 1, K < 16
        ((4, 16, 64), (4, 64, 32)),  # exact tile multiples
    ],
)
def test_bmm_matches_float64(a_shape, b_shape, dtype, device):
    check_bmm(rand(a_shape, dtype, device), rand(b_shape, dtype, device, mean=1.1), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_transposed_and_sliced_inputs(dtype, device):
    # a is a transposed view, b a strided slice of a bigger tensor: both are non-contiguous.
    a = rand((2, 3, 45, 37), dtype, device).transpose(-1, -2)
    b = rand((2, 6, 45, 29), dtype, device, mean=1.1)[:, ::2]
    assert not a.is_contiguous() and not b.is_contiguous()
    check_bmm(a, b, dtype)


def test_bmm_reads_transposed_view_in_place(device, monkeypatch):
    # k.transpose(-1, -2) must reach the kernel as a strided view of k's storage, not a copy.
    # fp32 runs the pointer kernel on every device (the batched path) under "triton" ("auto"
    # gives batched products to cuBLAS on a GPU).
    monkeypatch.setattr(plan_module, "matmul_impl", "triton")
    seen = []
    real = plan_module.launch_mm_ptr

    def spy(a, b, c, *args, **kwargs):
        seen.append((a.data_ptr(), b.data_ptr()))
        return real(a, b, c, *args, **kwargs)

    monkeypatch.setattr(plan_module, "launch_mm_ptr", spy)
    q = rand((2, 2, 9, 16), torch.float32, device).requires_grad_()
    k = rand((2, 2, 11, 16), torch.float32, device).requires_grad_()
    bmm(q, k.transpose(-1, -2), use_triton=True).sum().backward()
    assert seen[0] == (q.data_ptr(), k.data_ptr())  # forward
    assert len(seen) == 3  # plus dA and dB, each one launch
    assert seen[1][1] == k.data_ptr() and seen[2][0] == q.data_ptr()  # B^T and A^T in place


def test_bmm_expanded_grad_and_batch_chunks(device, monkeypatch):
    # sum() hands backward a stride-0 gradient; a tiny grid-batch cap forces several launches
    # of the pointer kernel (ours: "triton").
    monkeypatch.setattr(plan_module, "matmul_impl", "triton")
    monkeypatch.setattr(plan_module, "_MAX_GRID_BATCH", 2)
    a = rand((5, 7, 20), torch.float32, device).requires_grad_()
    b = rand((5, 20, 3), torch.float32, device, mean=1.1).requires_grad_()
    out = bmm(a, b, use_triton=True)
    out.sum().backward()
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = a64 @ b64
    ref.sum().backward()
    assert rel_err(out, ref) < 1e-5
    assert rel_err(a.grad, a64.grad) < 1e-5
    assert rel_err(b.grad, b64.grad) < 1e-5


def test_matmul_impl_is_settable_through_bmm(monkeypatch):
    # The switch lives in the planner (matmul_plan); `bmm.matmul_impl`, its documented name,
    # reads and sets that same global.
    monkeypatch.setattr(plan_module, "matmul_impl", plan_module.matmul_impl)  # restored after
    assert bmm_module.matmul_impl == "auto"
    bmm_module.matmul_impl = "triton"
    assert plan_module.matmul_impl == "triton" and bmm_module.matmul_impl == "triton"
    assert "matmul_impl" not in vars(bmm_module)  # no stale copy in bmm's namespace


def test_bmm_is_deterministic(device, monkeypatch):
    monkeypatch.setattr(plan_module, "matmul_impl", "triton")  # our kernel, also on a GPU
    a = rand((2, 40, 70), torch.float16, device)
    b = rand((2, 70, 24), torch.float16, device, mean=1.1)
    assert torch.equal(bmm(a, b, use_triton=True), bmm(a, b, use_triton=True))


@pytest.mark.parametrize("activation", [None, "relu_squared"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape", [(2, 3, 5, 45), (7, 45), (45,)])
def test_linear_matches_float64(x_shape, dtype, activation, device):
    # Centred so about a third of the pre-activations are negative and relu matters.
    x = rand(x_shape, dtype, device, mean=0.3).requires_grad_()
    weight = rand((29, 45), dtype, device, mean=-0.05).requires_grad_()
    y = linear(x, weight, activation, use_triton=True)
    grad = rand(y.shape, dtype, device, mean=0.7)
    y.backward(grad)

    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    pre = x64 @ w64.T
    assert (pre < 0).float().mean() > 0.1 and (pre > 0).float().mean() > 0.1
    ref = linear(x64, w64, activation)
    ref.backward(grad.double())

    assert y.dtype == dtype and y.shape == (*x_shape[:-1], 29)
    assert rel_err(y, ref) < TOL[dtype]
    assert rel_err(x.grad, x64.grad) < TOL[dtype]
    assert rel_err(weight.grad, w64.grad) < TOL[dtype]


@pytest.mark.parametrize("use_triton", [True, False])
def test_linear_and_bmm_follow_autocast(use_triton, device):
    """Under bf16 autocast, fp32 weights meet bf16 activations: both are cast, like matmul."""
    x = rand((3, 7, 45), torch.float32, device).requires_grad_()
    w = rand((29, 45), torch.float32, device, mean=0.1).requires_grad_()
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        y = linear(x.to(torch.bfloat16), w, activation="relu_squared", use_triton=use_triton)
        z = bmm(y, y.transpose(-1, -2), use_triton=use_triton)
    assert y.dtype == z.dtype == torch.bfloat16
    z.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32

    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = torch.relu(x64 @ w64.T).square()
    (y64 @ y64.transpose(-1, -2)).sum().backward()
    assert rel_err(z, y64 @ y64.transpose(-1, -2)) < 3e-2
    assert rel_err(w.grad, w64.grad) < 3e-2
    assert rel_err(x.grad, x64.grad) < 3e-2


def check_mixed_precision_weight_grad(M: int, K: int, N: int, activation, device) -> None:
    """An fp32 weight under bf16 autocast gets its gradient straight from the fp32 accumulator:
    within fp32 rounding of the float64 product of the bf16 operands, not rounded to bf16
    (which would be ~1e-3 off). The forward uses the weight rounded to bf16, as autocast does."""
    x = rand((M, K), torch.bfloat16, device, mean=0.2).requires_grad_()
    w = rand((N, K), torch.float32, device, mean=0.01, std=K**-0.5).requires_grad_()
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        y = linear(x, w, activation, use_triton=True)
    assert y.dtype == torch.bfloat16
    grad = rand(y.shape, torch.bfloat16, device, mean=0.3)
    y.backward(grad)
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16

    w16 = w.detach().to(torch.bfloat16).double()
    dpre = grad.double()
    if activation == "relu_squared":  # d(pre) in bf16 from the op's own pass (tested apart)
        dpre = bmm_module.relu2_grad_op(grad, y.detach(), True).double()
    assert rel_err(w.grad, dpre.T @ x.detach().double()) < 1e-5
    ref_y = x.detach().double() @ w16.T
    if activation == "relu_squared":
        ref_y = torch.relu(ref_y).square()
    assert rel_err(y, ref_y) < 1e-2


@pytest.mark.parametrize("activation", [None, "relu_squared"])
def test_mixed_precision_weight_grad_is_not_rounded(activation, device):
    check_mixed_precision_weight_grad(21, 45, 29, activation, device)


class _CountCasts(TorchDispatchMode):
    """Counts the bf16 copies (`aten._to_copy`) of tensors shaped `shape` inside the context."""

    def __init__(self, shape):
        super().__init__()
        self.shape = tuple(shape)
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is torch.ops.aten._to_copy.default
            and kwargs.get("dtype") == torch.bfloat16
            and tuple(args[0].shape) == self.shape
        ):
            self.casts += 1
        return func(*args, **kwargs)


def test_reuse_weight_casts_shares_one_copy_until_the_weight_changes(device):
    # two micro-batches, one cast of w; an in-place update inside the context is seen (the
    # version counter moves: a stale copy would give the old product); the gradients match
    # those of casting per call
    dev = torch.device(device).type
    w = rand((24, 40), torch.float32, device, mean=0.01, std=0.2).requires_grad_()
    xs = [rand((9, 40), torch.bfloat16, device, mean=0.2) for _ in range(2)]

    def micro_batches():
        for x in xs:
            with torch.autocast(device_type=dev, dtype=torch.bfloat16):
                y = linear(x, w, use_triton=True)
            y.float().square().sum().backward()

    micro_batches()
    grad_per_call, w.grad = w.grad.clone(), None
    with _CountCasts(w.shape) as counter, bmm_module.reuse_weight_casts():
        micro_batches()
        assert counter.casts == 1
        with torch.no_grad():
            w.mul_(-2.0)
        with torch.autocast(device_type=dev, dtype=torch.bfloat16):
            y = linear(xs[0], w, use_triton=True)
        assert counter.casts == 2
    torch.testing.assert_close(w.grad, grad_per_call, rtol=0, atol=0)
    ref = xs[0].double() @ w.detach().to(torch.bfloat16).double().T
    assert rel_err(y, ref) < 1e-2
    assert bmm_module._weight_casts is None  # copies dropped on exit


def test_reuse_weight_casts_with_a_dtype_serve_traced_code(device):
    # reuse_weight_casts(module, dtype) casts the module's linears at entry and hangs each copy
    # on its weight, where code torch.compile traces reads it as a graph input: a compiled
    # module returns the copy itself (not a cast of its own, which would run per call), a new
    # context's new copies need no recompilation, and without a context it casts again.
    from torch._dynamo.testing import CompileCounter

    class Reads(torch.nn.Module):  # the model's route: a weight reached through a submodule
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(40, 24, bias=False)

        def forward(self, x):
            return bmm_module._weight_in(self.lin.weight, x.dtype) * x.sum()

    torch._dynamo.reset()
    net = Reads().to(device)
    weight = net.lin.weight
    counter = CompileCounter()
    compiled = torch.compile(net, backend=counter)
    x = torch.ones(2, dtype=torch.bfloat16, device=device)
    for step in range(2):
        with bmm_module.reuse_weight_casts(net, torch.bfloat16):
            copy = getattr(weight, bmm_module.TRACED_CAST)
            assert copy.dtype == torch.bfloat16
            assert bmm_module._weight_in(weight, torch.bfloat16) is copy  # eager: the same
            copy.fill_(7.0 + step)  # only a read of the copy itself returns this
            assert torch.equal(compiled(x), 2 * copy)
        assert not hasattr(weight, bmm_module.TRACED_CAST)  # dropped on exit
    assert counter.frame_count == 1
    torch.testing.assert_close(compiled(x), 2 * weight.detach().to(torch.bfloat16))
    assert counter.frame_count == 2  # no copy: another graph, which casts


def test_reuse_weight_casts_hung_copies_leave_with_their_context(device):
    # A nested context shares the outer one's copies; fresh_weight_casts (block graphs'
    # captures) takes them off the weights and puts them back; an exception inside the
    # context still takes them off; a dtype without a module is refused.
    net = torch.nn.Sequential(torch.nn.Linear(40, 24, bias=False)).to(device)
    weight = net[0].weight
    with bmm_module.reuse_weight_casts(net, torch.bfloat16):
        outer = getattr(weight, bmm_module.TRACED_CAST)
        with bmm_module.reuse_weight_casts(net, torch.bfloat16):
            assert getattr(weight, bmm_module.TRACED_CAST) is outer
        with bmm_module.fresh_weight_casts(net):
            assert not hasattr(weight, bmm_module.TRACED_CAST)
        assert getattr(weight, bmm_module.TRACED_CAST) is outer
    with pytest.raises(KeyError), bmm_module.reuse_weight_casts(net, torch.bfloat16):
        assert hasattr(weight, bmm_module.TRACED_CAST)
        raise KeyError("inside")
    assert not hasattr(weight, bmm_module.TRACED_CAST) and bmm_module._weight_casts is None
    with pytest.raises(ValueError, match="needs the module"):
        bmm_module.reuse_weight_casts(None, torch.bfloat16).__enter__()
    assert bmm_module._weight_casts is None


class _CountForeachCopies(TorchDispatchMode):
    """Counts `aten._foreach_copy_` calls and the tensors they copy inside the context."""

    def __init__(self):
        super().__init__()
        self.calls, self.tensors = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._foreach_copy_.default:
            self.calls += 1
            self.tensors += len(args[0])
        return func(*args, **(kwargs or {}))


def test_reuse_weight_casts_of_a_module_cast_its_linears_at_once(device):
    # reuse_weight_casts(module): the first cast casts every nn.Linear weight of the module
    # in one foreach copy (tied weights once, a weight already in the dtype not at all); the
    # products read those copies: the same outputs and gradients as casting per call
    dev = torch.device(device).type
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(40, 24, bias=False), torch.nn.Linear(24, 40, bias=False)
    ).to(device)
    net.append(torch.nn.Linear(24, 40, bias=False).to(device))
    net[2].weight = net[1].weight  # tied: cast once
    net.append(torch.nn.Linear(40, 8, bias=False).to(device, torch.bfloat16))  # no cast
    x = rand((9, 40), torch.bfloat16, device, mean=0.2)

    def run():
        with torch.autocast(device_type=dev, dtype=torch.bfloat16):
            h = linear(x, net[0].weight, use_triton=True)
            y = linear(h, net[1].weight, use_triton=True)
            y = linear(h, net[2].weight, use_triton=True) + y
            y = linear(y, net[3].weight, use_triton=True)
        y.float().square().sum().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        net.zero_grad(set_to_none=True)
        return y, grads

    want = run()
    counting = (_CountForeachCopies(), _CountCasts((24, 40)))
    with counting[0] as foreach, counting[1] as single, bmm_module.reuse_weight_casts(net):
        got = run()
    assert (foreach.calls, foreach.tensors) == (1, 2)  # net[0] and the tied net[1]/net[2]
    assert single.casts == 0  # net[0]'s weight: no cast of its own
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_fresh_weight_casts_ignore_an_outer_context(device):
    # code captured into a CUDA graph (block_graphs) must cast its weights itself: inside
    # fresh_weight_casts(*modules) a weight the outer context already cast is cast again, all
    # the modules' nn.Linear weights in one foreach copy; on exit the outer copies are back
    dev = torch.device(device).type
    torch.manual_seed(0)
    first, second = (torch.nn.Linear(40, 40, bias=False).to(device) for _ in range(2))
    x = rand((9, 40), torch.bfloat16, device, mean=0.2)

    def run(lin):
        with torch.autocast(device_type=dev, dtype=torch.bfloat16), torch.no_grad():
            return linear(x, lin.weight, use_triton=True)

    with bmm_module.reuse_weight_casts():
        outer = bmm_module._weight_casts
        want = run(first)
        with _CountForeachCopies() as foreach, bmm_module.fresh_weight_casts(first, second):
            assert bmm_module._weight_casts is not outer
            got = run(first)
        assert (foreach.calls, foreach.tensors) == (1, 2)
        assert bmm_module._weight_casts is outer and len(outer.copies) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def accumulated_grads(activation, in_place: bool, uses: int, device, micro_batches: int = 3):
    """Gradients of an fp32 weight used `uses` times per micro-batch (one or two linears),
    summed over micro-batches by `loss.backward()` under bf16 autocast, with or without
    `accumulate_grads_in_place`; the address of `.grad` after each backward (addresses, not
    tensors: a reference held to `.grad` would make autograd store a copy); and the number
    of separate adds into weight-shaped tensors."""
    torch.manual_seed(0)
    n_out = 2 * 29 if activation == "swiglu" else 29
    w = rand((n_out, 45), torch.float32, device, mean=0.01, std=45**-0.5).requires_grad_()
    x = rand((micro_batches, 21, 45), torch.bfloat16, device, mean=0.2)
    x = x.requires_grad_()
    seen = []
    context = bmm_module.accumulate_grads_in_place() if in_place else contextlib.nullcontext()
    with context, CountAdds(w.shape) as adds:
        for i in range(micro_batches):
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
                loss = (linear(x[i], w, activation, use_triton=True).float() * (0.5 + i)).sum()
                if uses == 2:
                    y2 = linear(x[i].flip(0), w, activation, use_triton=True)
                    loss = loss + (y2.float() ** 2).sum()
            loss.backward()
            seen.append(w.grad.data_ptr())
    return w.grad, x.grad, seen, adds.adds


@pytest.mark.parametrize("uses", [1, 2])
@pytest.mark.parametrize("activation", [None, "relu_squared", "swiglu"])
def test_accumulate_grads_in_place(activation, uses, device, monkeypatch):
    # Inside the context each backward after the first adds its dW into the existing .grad
    # (one GEMM with the gradient as C) and autograd keeps that tensor: the sums are the
    # ones autograd's own accumulation gives. With one use per micro-batch .grad stays one
    # tensor throughout; with two, one use folds the running sum in and the other's plain
    # dW joins it in autograd's buffer (a new tensor, the same sum).
    want_w, want_x, _, want_adds = accumulated_grads(activation, False, uses, device)
    got_w, got_x, seen, got_adds = accumulated_grads(activation, True, uses, device)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=0)
    assert got_w.dtype == torch.float32
    # autograd adds a second use's dW to the first's (3 micro-batches: 3 adds) and each
    # later micro-batch's gradient to .grad (2 adds), each in a kernel of its own; in place
    # only the uses' sums are left
    assert want_adds == 3 * (uses - 1) + 2
    assert got_adds == 3 * (uses - 1)
    if uses == 1:  # the later micro-batches write into the first one's tensor
        assert len(set(seen)) == 1
    # switched off, the context changes nothing (bit for bit)
    monkeypatch.setattr(bmm_module, "ACCUMULATE_IN_PLACE", False)
    off_w, _, _, _ = accumulated_grads(activation, True, uses, device)
    torch.testing.assert_close(off_w, want_w, rtol=0, atol=0)


def test_accumulate_grads_in_place_leaves_other_callers_alone(device):
    # Where the engine will not store into w.grad, the backward returns its own dW and
    # leaves w.grad as it was: torch.autograd.grad (over w, or over x only) and
    # backward(inputs=[x]) inside the context. A forward outside the context, whose backward
    # runs inside it, and a non-leaf weight (w·1) leave the sum to autograd's add.
    w = rand((29, 45), torch.float32, device, mean=0.01).requires_grad_()
    x = rand((21, 45), torch.float32, device, mean=0.2).requires_grad_()
    linear(x, w, use_triton=True).sum().backward()
    first = w.grad.clone()
    y = linear(x, w, use_triton=True)
    with bmm_module.accumulate_grads_in_place():
        (g,) = torch.autograd.grad(linear(x, w, use_triton=True).sum(), w)
        torch.autograd.grad(linear(x, w, use_triton=True).sum(), x)
        linear(x, w, use_triton=True).sum().backward(inputs=[x])
        torch.testing.assert_close(g, first, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w.grad, first, rtol=0, atol=0)  # untouched so far
        with CountAdds(w.shape) as adds:  # autograd's add into w.grad, once each
            y.sum().backward()
            linear(x, w * 1.0, use_triton=True).sum().backward()
    assert adds.adds == 2
    torch.testing.assert_close(w.grad, 3 * first, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("holder", ["reference", "hook"])
def test_accumulate_grads_in_place_yields_to_holders_and_hooks(holder, device):
    # A tensor kept from w.grad must keep seeing every micro-batch (autograd adds in place
    # into it; stored elsewhere, it would go stale), and a hook on w must see one backward's
    # dW, not the running sum: both turn the in-place path off for w.
    w = rand((29, 45), torch.float32, device, mean=0.01).requires_grad_()
    x = rand((21, 45), torch.float32, device, mean=0.2)
    seen = []
    if holder == "hook":
        w.register_hook(lambda g: seen.append(g.clone()))
    with bmm_module.accumulate_grads_in_place():
        linear(x, w, use_triton=True).sum().backward()
        held = w.grad
        for _ in range(2):
            linear(x, w, use_triton=True).sum().backward()
    assert held is w.grad  # autograd added into the held tensor each time
    (dw,) = torch.autograd.grad(linear(x, w, use_triton=True).sum(), w)
    torch.testing.assert_close(w.grad, 3 * dw, rtol=1e-5, atol=1e-6)
    if holder == "hook":  # dW alone each time
        assert len(seen) == 4  # (the last from autograd.grad)
        for g in seen:
            torch.testing.assert_close(g, dw, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_accumulate_grads_in_place_traced_backward_cpu():
    # accumulate_grads_in_place(traced=True): the backward AOTAutograd traces for a linear
    # (relu²) into the relu² feed-forward adds each weight's gradient into the `.grad` the
    # forward passed (accumulate_mm, written back into that graph input) and returns none for
    # the weights; without `.grad`, or traced=False, the weights get their gradients as usual.
    # A subprocess (kernels as JITFunctions, `_compile_trace_check.py`); no kernel runs.
    passed, cases, output = compile_trace_check("fold")
    assert passed and cases == 3, output


def test_accumulate_grads_in_place_traced_leaves_eager_calls_alone(device):
    # traced=True changes nothing for eager code: the ops get no `.grad` (their eager fold,
    # with its checks, is the same), and the global that traced code reads is restored on exit
    w = rand((29, 45), torch.float32, device, mean=0.01).requires_grad_()
    x = rand((21, 45), torch.float32, device, mean=0.2)
    assert bmm_module._traced_grad_acc(w) is None
    with bmm_module.accumulate_grads_in_place(traced=True):
        for _ in range(3):
            linear(x, w, "relu_squared", use_triton=True).sum().backward()
        assert bmm_module._traced_depth == 1
        assert bmm_module._traced_grad_acc(w) is None  # not compiling
    assert bmm_module._traced_depth == 0
    (dw,) = torch.autograd.grad(linear(x, w, "relu_squared", use_triton=True).sum(), w)
    torch.testing.assert_close(w.grad, 3 * dw, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("M, K, N", [(2048, 512, 1536), (8192, 2048, 512), (2048, 512, 2048)])
def test_mixed_precision_weight_grad_gpu(M, K, N, impl, device, monkeypatch):
    # auto: cuBLAS writes the fp32 gradient (mm with out_dtype); triton: the TMA kernel's fp32
    # store (and split-K reduction), at the model's projection shapes
    monkeypatch.setattr(plan_module, "matmul_impl", impl)
    check_mixed_precision_weight_grad(M, K, N, None, device)
    if N == 2048:
        check_mixed_precision_weight_grad(M, K, N, "relu_squared", device)


def test_linear_transposed_input_and_weight(device):
    x = rand((45, 3, 6), torch.float32, device, mean=0.3).permute(1, 2, 0).requires_grad_()
    weight = rand((45, 29), torch.float32, device, mean=-0.05).t().requires_grad_()
    y = linear(x, weight, "relu_squared", use_triton=True)
    y.backward(torch.ones_like(y))
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = linear(x64, w64, "relu_squared")
    ref.backward(torch.ones_like(ref))
    assert rel_err(y, ref) < 1e-5
    assert rel_err(x.grad, x64.grad) < 1e-5
    assert rel_err(weight.grad, w64.grad) < 1e-5


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((2, 0, 5), (2, 5, 3)),
        ((2, 4, 5), (2, 5, 0)),
        ((0, 4, 5), (0, 5, 3)),
        ((2, 4, 0), (2, 0, 3)),  # K = 0
    ],
)
def test_bmm_zero_size(a_shape, b_shape, device):
    a = torch.randn(a_shape, device=device, requires_grad=True)
    b = torch.randn(b_shape, device=device, requires_grad=True)
    out = bmm(a, b, use_triton=True)
    ref = a.detach() @ b.detach()  # K = 0 gives zeros, not an empty tensor
    assert torch.equal(out, ref)
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert not a.grad.any() and not b.grad.any()


@pytest.mark.parametrize("x_shape, w_shape", [((0, 5), (3, 5)), ((2, 0), (3, 0)), ((4, 5), (0, 5))])
def test_linear_zero_size(x_shape, w_shape, device):
    x = torch.randn(x_shape, device=device, requires_grad=True)
    weight = torch.randn(w_shape, device=device, requires_grad=True)
    y = linear(x, weight, "relu_squared", use_triton=True)
    assert torch.equal(y, linear(x.detach(), weight.detach(), "relu_squared"))
    y.sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


def test_bad_inputs(device):
    a = torch.randn(2, 3, 4, device=device)
    with pytest.raises(ValueError, match="a's last dim"):
        bmm(a, torch.randn(2, 5, 6, device=device), use_triton=True)
    with pytest.raises(ValueError, match="batch dims"):
        bmm(a, torch.randn(3, 4, 6, device=device))
    with pytest.raises(ValueError, match="at least 2 dims"):
        bmm(torch.randn(4, device=device), torch.randn(4, 6, device=device))
    with pytest.raises(TypeError, match="same dtype"):
        bmm(a, torch.randn(2, 4, 6, device=device, dtype=torch.float16), use_triton=True)
    with pytest.raises(TypeError, match="dtype"):
        bmm(a.double(), torch.randn(2, 4, 6, device=device).double(), use_triton=True)
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        bmm(a, [[1.0]])

    x = torch.randn(2, 4, device=device)
    with pytest.raises(ValueError, match="x's last dim"):
        linear(x, torch.randn(3, 5, device=device), use_triton=True)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        linear(x, torch.randn(4, device=device))
    with pytest.raises(ValueError, match="activation"):
        linear(x, torch.randn(3, 4, device=device), activation="gelu")
    with pytest.raises(TypeError, match="same dtype"):
        linear(x, torch.randn(3, 4, device=device, dtype=torch.bfloat16), use_triton=True)


def test_launch_config_tiles():
    for dtype in DTYPES:
        for shape in [(1, 1, 1, 1), (37, 45, 29, 3), (512, 512, 64, 32), (4096, 2048, 512, 1)]:
            for interpret in (True, False):
                bm, bn, bk, group, warps, stages = plan_module._ptr_config(*shape, dtype, interpret)
                for block in (bm, bn, bk):
                    assert block >= 16 and block & (block - 1) == 0  # tl.dot: powers of 2, >= 16
                assert bm <= 128 and bn <= 128 and bk <= 64 and group >= 1
                assert warps in (4, 8) and stages >= 1


# ------------------------------------------------------------------------------------------
# Realistic shapes on a GPU
# ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((32, 512, 64), (32, 64, 512)),  # attention scores
        ((32, 512, 512), (32, 512, 64)),  # attention weights @ v
        ((3, 1000, 999), (3, 999, 777)),  # ragged edges at scale
    ],
)
def test_bmm_gpu(a_shape, b_shape, dtype, device):
    k = a_shape[-1]
    check_bmm(
        rand(a_shape, dtype, device, mean=0.2, std=k**-0.5 * 4),
        rand(b_shape, dtype, device, mean=-0.1),
        dtype,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "relu_squared"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "x_shape, w_shape", [((4, 512, 512), (2048, 512)), ((3, 300, 2048), (512, 2048))]
)
def test_linear_gpu(x_shape, w_shape, dtype, activation, device):
    k = w_shape[1]
    x = rand(x_shape, dtype, device, mean=0.1).requires_grad_()
    weight = rand(w_shape, dtype, device, mean=-0.02, std=k**-0.5).requires_grad_()
    y = linear(x, weight, activation, use_triton=True)
    grad = rand(y.shape, dtype, device, mean=0.3)
    y.backward(grad)
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = linear(x64, w64, activation)
    ref.backward(grad.double())
    assert rel_err(y, ref) < TOL[dtype]
    assert rel_err(x.grad, x64.grad) < TOL[dtype]
    assert rel_err(weight.grad, w64.grad) < TOL[dtype]


# ------------------------------------------------------------------------------------------
# Residual epilogue, relu² in fp16, registration, dispatch, the TMA kernel in the interpreter
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", [None, "relu_squared"])
@pytest.mark.parametrize(
    "dtype, res_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # autocast's fp32 residual stream + a bf16 linear
    ],
)
def test_linear_residual_matches_float64(dtype, res_dtype, activation, device):
    x = rand((2, 7, 45), dtype, device, mean=0.3).requires_grad_()
    weight = rand((29, 45), dtype, device, mean=-0.05).requires_grad_()
    res = rand((2, 7, 29), res_dtype, device, mean=1.7).requires_grad_()
    y = linear(x, weight, activation, use_triton=True, residual=res)
    assert y.dtype == torch.promote_types(dtype, res_dtype) and y.shape == res.shape
    grad = rand(y.shape, y.dtype, device, mean=0.7)
    y.backward(grad)

    x64, w64, r64 = (t.detach().double().requires_grad_() for t in (x, weight, res))
    ref = linear(x64, w64, activation, residual=r64)
    ref.backward(grad.double())
    # Judge the product separately from the residual, which would hide its errors.
    assert rel_err(y.double() - res.double(), ref - r64) < TOL[dtype]
    assert rel_err(x.grad, x64.grad) < TOL[dtype]
    assert rel_err(weight.grad, w64.grad) < TOL[dtype]
    assert res.grad.dtype == res_dtype
    assert rel_err(res.grad, r64.grad) < TOL[res_dtype]


def test_linear_residual_checks(device):
    x, w = torch.randn(3, 4, device=device), torch.randn(5, 4, device=device)
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        linear(x, w, use_triton=True, residual=torch.randn(5, device=device))
    with pytest.raises(TypeError, match=r"residual must be a torch\.Tensor"):
        linear(x, w, use_triton=True, residual=1.0)


def test_relu2_fp16_backward_survives_underflow(device):
    # relu(pre) ~ 1e-4 squares to ~1e-8, below fp16's smallest subnormal (6e-8): y is 0, so the
    # old backward, which rebuilt relu(pre) as sqrt(y), lost every gradient. The forward must
    # keep relu(pre) itself. Scales chosen so that the gradients themselves are normal fp16.
    x = rand((12, 45), torch.float16, device, mean=2e-3, std=4e-4).requires_grad_()
    weight = rand((29, 45), torch.float16, device, mean=1.5e-3, std=3e-4).requires_grad_()
    y = linear(x, weight, "relu_squared", use_triton=True)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    pre = x64 @ w64.T
    assert (pre > 5e-5).all() and (y == 0).float().mean() > 0.9  # y underflowed, pre did not
    grad = rand(y.shape, torch.float16, device, mean=30.0, std=5.0)
    y.backward(grad)
    ref = linear(x64, w64, "relu_squared")
    ref.backward(grad.double())
    assert rel_err(x.grad, x64.grad) < 1e-2
    assert rel_err(weight.grad, w64.grad) < 1e-2
    # The old scheme on the same data: d(pre) from sqrt(y) is all zeros.
    dpre_old = bmm_module.relu2_grad_op(grad, y.detach(), True)
    assert rel_err(dpre_old.double() @ w64.detach(), x64.grad) > 0.5


def test_relu2_bf16_saves_no_extra_tensor(device, monkeypatch):
    # bf16 (8-bit exponent) rebuilds relu(pre) = sqrt(y) safely: no second output is written.
    calls = []
    monkeypatch.setattr(bmm_module, "linear_relu2_op", lambda *a: calls.append(a))
    x = rand((6, 45), torch.bfloat16, device, mean=0.3).requires_grad_()
    weight = rand((29, 45), torch.bfloat16, device, mean=-0.05).requires_grad_()
    linear(x, weight, "relu_squared", use_triton=True).sum().backward()
    assert not calls and x.grad is not None


def _opcheck_tests(device):
    # The interpreter cannot run kernels on fake tensors: those checks need CUDA.
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    return tests


def test_registered_custom_ops(device):
    x = rand((7, 45), torch.float32, device).requires_grad_()
    w = rand((24, 45), torch.float32, device).requires_grad_()
    r = rand((7, 24), torch.float32, device).requires_grad_()
    a = rand((3, 9, 16), torch.float32, device).requires_grad_()
    b = rand((3, 16, 8), torch.float32, device).requires_grad_()
    tests = _opcheck_tests(device)
    torch.library.opcheck(bmm_module.bmm_op, (a, b), test_utils=tests)
    torch.library.opcheck(bmm_module.bmm_op, (x, w.t()), test_utils=tests)
    for res in (None, r):
        torch.library.opcheck(bmm_module.linear_op, (x, w, res, False), test_utils=tests)
        torch.library.opcheck(bmm_module.linear_relu2_op, (x, w, res), test_utils=tests)
    torch.library.opcheck(bmm_module.linear_op, (x, w, None, True), test_utils=tests)
    dy, s = rand((7, 24), torch.float32, device), rand((7, 24), torch.float32, device, mean=1.0)
    torch.library.opcheck(bmm_module.relu2_grad_op, (dy, s.abs(), True), test_utils=tests)


@pytest.mark.parametrize(
    "kind", ["bmm", "linear", "relu_squared", "relu_squared_fp16", "residual", "relu_residual"]
)
def test_double_backward_raises(kind, device, assert_first_order_only, monkeypatch):
    # our kernels' ops (on a GPU a plain product's eager call is PyTorch's own op under
    # "auto", whose second derivative is right: test_plain_products_run_pytorchs_op)
    monkeypatch.setattr(plan_module, "matmul_impl", "triton")
    dtype = torch.float16 if kind == "relu_squared_fp16" else torch.float32
    x = rand((5, 16), dtype, device, mean=0.3).requires_grad_()
    w = rand((8, 16), dtype, device, mean=0.1).requires_grad_()
    res = rand((5, 8), dtype, device) if "residual" in kind else None
    act = "relu_squared" if "relu" in kind else None

    def f(x):
        if kind == "bmm":
            return bmm(x, w.t(), use_triton=True)
        return linear(x, w, act, use_triton=True, residual=res)

    assert_first_order_only(f, x, "bmm" if kind == "bmm" else "linear")


def test_layout_for_tma():
    base = torch.empty(64, 48, dtype=torch.bfloat16)
    assert plan_module._layout(base) == (0, 48)
    assert plan_module._layout(base.t()) == (1, 48)
    assert plan_module._layout(base[:, :40]) == (0, 48)  # row stride still 96 bytes
    assert plan_module._layout(base[:, 1:]) is None  # base 2 bytes off 16-byte alignment
    assert plan_module._layout(torch.empty(8, 45, dtype=torch.bfloat16)) is None  # 90-byte rows
    assert plan_module._layout(base[:, ::2]) is None  # no unit stride
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # what torch.compile traces with: no data pointers
        fake = torch.empty(64, 48, dtype=torch.bfloat16)
        assert plan_module._layout(fake.t()) == (1, 48) and plan_module._layout(fake[:, 1:]) is None


def test_plan_picks_paths(monkeypatch):
    # The dispatch on a (pretend) H200 and an A100, without a GPU: the uncached plan function.
    bf16 = torch.bfloat16
    few = ("ptr", plan_module._FEW_ROWS_PTR)
    pretend_gpu(monkeypatch, 9, 132, "H200")
    table = {
        "512x512x8192:tn": "tma",
        "64x64x64:nn": "ptr",
        "64x64x64:nt+relu2": "cublas+ew",
        "4096x2048x512:nt+relu2": "ptr",
        "128x128x128:nt+relu2": "fused",
        "2048x512x2048:nt+res": "cublas+ew",
    }
    monkeypatch.setattr(plan_module, "MATMUL_TABLE", {"H200": table})

    def plan(M, N, K, a_t=0, b_t=1, epi="", impl="auto", force=None, tracing=False, ok=True):
        return plan_module._plan.__wrapped__(
            "cuda", 0, bf16, M, N, K, a_t, b_t, epi, ok, 2, impl, force, tracing
        )

    # auto: cuBLAS for every problem it computes whole, listed or not, traced or not
    assert plan(8192, 512, 512) == ("cublas",)
    assert plan(16384, 50304, 768) == ("cublas",)
    assert plan(8192, 512, 512, epi="+res") == ("cublas",)  # addmm
    assert plan(8192, 512, 512, a_t=1, b_t=0) == ("cublas",)
    assert plan(8192, 512, 512, a_t=-1) == ("cublas",)  # TMA can't describe a: cuBLAS can
    assert plan(8192, 512, 512, tracing=True) == ("cublas",)
    # ... except where the table lists a Triton kernel that measured faster
    assert plan(512, 512, 8192, a_t=1, b_t=0)[:2] == ("tma", 8)  # a weight gradient: split K
    assert plan(64, 64, 64, b_t=0)[0] == "ptr"
    # relu²: fused by default (the TMA kernel on Hopper); the table's "ptr", "cublas+ew"
    assert plan(8192, 2048, 512, epi="+relu2") == ("tma", 1, 132)
    assert plan(128, 128, 128, epi="+relu2")[0] == "tma"  # "fused": the default kernel
    assert plan(4096, 2048, 512, epi="+relu2")[0] == "ptr"
    assert plan(64, 64, 64, epi="+relu2") == ("cublas+ew",)
    assert plan(64, 64, 64, epi="+relu2", ok=False)[0] == "tma"  # cuBLAS can't: fused
    assert plan(64, 64, 64, epi="+relu2", impl="triton")[0] == "tma"
    assert plan(64, 64, 64, epi="+relu2", impl="cublas")[0] == "tma"  # relu² stays fused
    assert plan(64, 64, 64, epi="+relu2", tracing=True) == ("cublas+ew",)
    # traced where eager fuses in the TMA kernel (TMA not traceable): cuBLAS + the relu² pass,
    # not the pointer kernel; a table entry for the pointer kernel still wins
    assert plan(8192, 2048, 512, epi="+relu2", tracing=True) == ("cublas+ew",)
    assert plan(4096, 2048, 512, epi="+relu2", tracing=True)[0] == "ptr"
    assert plan(8192, 2048, 512, epi="+relu2", impl="triton", tracing=True)[0] == "ptr"
    assert plan(64, 64, 64, epi="+relu2+res")[0] == "tma"  # the pass has no residual
    assert plan(8192, 2048, 512, epi="+relu2", force="cublas+ew") == ("cublas+ew",)
    assert plan(8192, 512, 512, force="cublas+ew") == ("cublas",)  # nothing to force
    # a residual of the product's dtype: the product then the add where the table says so
    assert plan(2048, 512, 2048, epi="+res") == ("cublas+ew",)
    assert plan(2048, 512, 2048, epi="+res", impl="cublas") == ("cublas",)  # addmm
    assert plan(8192, 512, 512, epi="+res", force="cublas+ew") == ("cublas+ew",)
    assert plan(2048, 512, 2048, epi="+res", ok=False)[0] == "tma"  # another dtype: ours
    assert plan(8192, 512, 512, epi="+res", ok=False, force="cublas+ew")[0] == "tma"
    # "triton", "cublas", forced kernels, problems cuBLAS can't compute whole
    assert plan(8192, 512, 512, impl="triton")[0] == "tma"
    assert plan(512, 512, 8192, a_t=1, b_t=0, impl="cublas") == ("cublas",)  # listed or not
    assert plan(8192, 512, 512, force="tma")[0] == "tma"
    assert plan(8192, 512, 512, force="ptr")[0] == "ptr"
    assert plan(8192, 512, 512, epi="+res", ok=False)[0] == "tma"  # residual of another dtype
    assert plan(64, 64, 64, a_t=-1, ok=False)[0] == "ptr"  # TMA can't describe a
    assert plan(64, 60, 64, ok=False)[0] == "ptr"  # 120-byte output rows
    assert plan(64, 64, 64, epi="+relu2", ok=False, tracing=True)[0] == "ptr"  # no traced TMA
    # Weight gradients (K = tokens, few output tiles) split K; forward shapes do not.
    assert plan(256, 512, 8192, a_t=1, b_t=0, impl="triton")[1] > 1
    assert plan(8192, 256, 512, impl="triton")[1] == 1
    # decode-sized (<= 16 rows): narrow pointer tiles; plain products with K >= 2048: cuBLAS
    assert plan(5, 512, 512) == few
    assert plan(5, 512, 2048) == ("cublas",)
    assert plan(5, 2048, 512, epi="+relu2") == few
    assert plan(5, 512, 2048, impl="triton") == few
    assert plan(5, 512, 512, impl="cublas") == ("cublas",)
    # another GPU: no TMA; the H200's table does not apply
    pretend_gpu(monkeypatch, 8, 108, "A100")
    assert plan(8192, 512, 512) == ("cublas",)
    assert plan(512, 512, 8192, a_t=1, b_t=0) == ("cublas",)
    assert plan(64, 64, 64, epi="+relu2")[0] == "ptr"
    assert plan(8192, 512, 512, impl="triton")[0] == "ptr"
    # not CUDA: the interpreter, unless a test forces "cublas+ew" (torch.mm, then the pass)
    cpu = plan_module._plan.__wrapped__
    assert cpu("cpu", 0, bf16, 64, 64, 64, -1, -1, "", True, 2, "auto", None)[0] == "ptr"
    assert cpu("cpu", 0, bf16, 64, 64, 64, -1, -1, "+relu2", True, 2, "auto", "cublas+ew") == (
        "cublas+ew",
    )
    assert cpu("cpu", 0, bf16, 64, 64, 64, -1, -1, "+res", True, 2, "auto", "cublas+ew") == (
        "cublas+ew",
    )


def ops_called(monkeypatch) -> list:
    """The ops `bmm.py`'s functions call (through `call_op`), appended as they run."""
    ops = []
    real = bmm_module.call_op
    monkeypatch.setattr(bmm_module, "call_op", lambda op, *a: ops.append(op) or real(op, *a))
    return ops


def test_plain_products_on_cublas_plans_all_three_gemms(monkeypatch):
    # `plain_products_on_cublas` asks the planner about the product and both backward GEMMs,
    # each in the orientation our backward computes it: a table entry for any one of them
    # sends the call to our op. On a pretend H200, without a GPU (the planner's own function).
    pretend_gpu(monkeypatch, 9, 132, "H200")
    table: dict[str, str] = {}
    monkeypatch.setattr(plan_module, "MATMUL_TABLE", {"H200": table})
    bf16 = torch.bfloat16

    def on_cublas(M, N, K, a_t=0, b_t=1, weight_grad=True, residual=False, impl="auto"):
        plan_module._plan.cache_clear()  # the tables and device patched here: plan afresh
        on = plan_module._plain_on_cublas.__wrapped__
        return on(0, bf16, M, N, K, a_t, b_t, weight_grad, residual, impl)

    # a linear's x (2048, 512) @ weight.t() (512 -> 2048): every GEMM cuBLAS's
    assert on_cublas(2048, 2048, 512)
    # the forward, dX = dY @ W, dW = dY^T @ X (weight_grad), and bmm's dB = A^T @ dC
    for key, weight_grad, taken in [
        ("2048x2048x512:nt", True, False),
        ("2048x512x2048:nn", True, False),
        ("2048x512x2048:tn", True, False),
        ("512x2048x2048:tn", True, True),  # not a GEMM of this linear
        ("512x2048x2048:tn", False, False),  # bmm's dB = A^T @ dC
        ("2048x512x2048:tn", False, True),
    ]:
        table.clear()
        table[key] = "tma"
        assert on_cublas(2048, 2048, 512, weight_grad=weight_grad) == taken, key
    table.clear()
    table["2048x2048x512:nt+res"] = "tma"  # the product with a residual (torch.addmm's)
    assert on_cublas(2048, 2048, 512) and not on_cublas(2048, 2048, 512, residual=True)
    table.clear()
    assert not on_cublas(2048, 2048, 512, impl="triton")
    assert on_cublas(2048, 2048, 512, impl="cublas")
    # decode-sized products with a short K run the narrow pointer tiles: the forward and dX
    assert not on_cublas(5, 2048, 512)
    assert not on_cublas(5, 512, 2048)  # dX = dY @ W has K = 512
    assert on_cublas(5, 2048, 2048)
    # rows of 2-byte elements not a multiple of 8: a dC that TMA can't describe, still cuBLAS
    assert on_cublas(100, 100, 100, a_t=-1, b_t=-1)
    plan_module._plan.cache_clear()


def test_plain_linear_asks_what_the_2d_product_would(monkeypatch):
    # `plain_linear_on_cublas` (a plain linear's eager hot path) reads x's 2-D view and
    # weight.t() off the tensors it is given: for every layout it answers what
    # `plain_products_on_cublas` answers for the views themselves. Fake CUDA tensors on a
    # pretend H200; a table entry per orientation, so each layout's answer is asked for.
    from torch._subclasses.fake_tensor import FakeTensorMode

    pretend_gpu(monkeypatch, 9, 132, "H200")
    table: dict[str, str] = {}
    monkeypatch.setattr(plan_module, "MATMUL_TABLE", {"H200": table})
    bf16 = torch.bfloat16
    answers = set()
    with FakeTensorMode():

        def strided(shape, strides, offset=0):  # a view of a buffer (fake tensors index poorly)
            buffer = torch.empty(4 << 20, dtype=bf16, device="cuda")
            return buffer.as_strided(shape, strides, offset)

        xs = {
            "2-D": strided((2048, 1024), (1024, 1)),
            "3-D contiguous": strided((4, 512, 1024), (512 * 1024, 1024, 1)),
            "3-D strided rows": strided((4, 512, 1024), (512 * 1032, 1032, 1)),
            "3-D offset by 2": strided((4, 512, 1024), (512 * 1032, 1032, 1), 2),  # TMA can't
            "2-D transposed": strided((2048, 1024), (1, 2048)),
            "rows of 1020": strided((4, 512, 1020), (512 * 1020, 1020, 1)),
            "1-D contiguous": strided((1024,), (1,)),
            "1-D strided": strided((1024,), (2,)),
        }
        weights = {
            "contiguous": strided((768, 1024), (1024, 1)),
            "transposed": strided((768, 1024), (1, 768)),
            "rows of 1020": strided((768, 1020), (1020, 1)),
        }
        entries = [None, "2048x768x1024:nt", "2048x768x1024:tt", "2048x768x1024:nn"]
        for entry in [*entries, "2048x768x1020:ss"]:  # "s": rows TMA cannot describe
            table.clear()
            if entry:
                table[entry] = "tma"
            for x_name, x in xs.items():
                for w_name, w in weights.items():
                    if x.shape[-1] != w.shape[1]:
                        continue
                    plan_module._plain_on_cublas.cache_clear()
                    plan_module._plan.cache_clear()
                    got = plan_module.plain_linear_on_cublas(x, w)
                    x2 = x.view(-1, x.shape[-1])
                    want = plan_module.plain_products_on_cublas(x2, w.t(), True)
                    assert got == want, (entry, x_name, w_name)
                    answers.add(got)
        no_rows = strided((0, 1024), (1024, 1))
        assert not plan_module.plain_linear_on_cublas(no_rows, weights["contiguous"])
    assert answers == {True, False}
    plan_module._plain_on_cublas.cache_clear()
    plan_module._plan.cache_clear()


@pytest.mark.parametrize(
    "kind",
    ["linear", "linear 3-D", "residual", "residual 3-D", "bmm 2-D", "bmm 4-D", "bmm batch 1"],
)
def test_plain_products_run_pytorchs_op(kind, device, monkeypatch):
    # Where cuBLAS would run all three GEMMs (forced here: on the CPU it never holds), an
    # eager call is PyTorch's own op: none of ours runs, the results are the reference's, and
    # so is the second derivative (the issue's pattern), which our op refuses.
    asked = []

    def all_cublas(a, b, weight_grad, residual):
        asked.append((tuple(a.shape), tuple(b.shape), weight_grad, residual))
        return True

    def linear_on_cublas(x, weight):  # a plain linear's question, as the 2-D product's
        return all_cublas(x.reshape(-1, x.shape[-1]), weight.t(), True, False)

    monkeypatch.setattr(plan_module, "plain_products_on_cublas", all_cublas)
    monkeypatch.setattr(plan_module, "plain_linear_on_cublas", linear_on_cublas)
    monkeypatch.setattr(bmm_module, "call_op", lambda *args: pytest.fail("our op ran"))
    shapes = {
        "linear": ((7, 45), (24, 45)),
        "linear 3-D": ((2, 3, 45), (24, 45)),
        "residual": ((7, 45), (24, 45)),
        "residual 3-D": ((2, 3, 45), (24, 45)),
        "bmm 2-D": ((7, 45), (45, 24)),
        "bmm 4-D": ((2, 3, 7, 45), (2, 3, 45, 24)),
        "bmm batch 1": ((1, 7, 45), (1, 45, 24)),
    }
    x_shape, w_shape = shapes[kind]
    x = rand(x_shape, torch.float32, device, mean=0.3).requires_grad_()
    w = rand(w_shape, torch.float32, device, mean=0.1).requires_grad_()
    lin = not kind.startswith("bmm")
    h = rand((*x_shape[:-1], 24), torch.float32, device) if "residual" in kind else None
    h64 = None if h is None else h.double()

    def f(x, w, use_triton):
        if not lin:
            return bmm(x, w, use_triton=use_triton)
        res = h if x.dtype == torch.float32 else h64
        return linear(x, w, use_triton=use_triton, residual=res)

    def second_order(x, w, use_triton):
        s = f(x, w, use_triton).sum() * (x**2).sum()
        (g,) = torch.autograd.grad(s, x, create_graph=True)
        return torch.autograd.grad((g * g).sum(), (x, w))

    y = f(x, w, True)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    ref = f(x64, w64, False)
    assert rel_err(y, ref) < 1e-5
    grad = rand(y.shape, torch.float32, device, mean=0.7)
    y.backward(grad)
    ref.backward(grad.double())
    assert rel_err(x.grad, x64.grad) < 1e-5 and rel_err(w.grad, w64.grad) < 1e-5
    for got, want in zip(second_order(x, w, True), second_order(x64, w64, False), strict=True):
        assert rel_err(got, want) < 1e-5
    # what the planner was asked: the 2-D product our op would have computed (a batch for
    # bmm's 4-D operands), with a linear's weight gradient in the weight's layout
    M = x.numel() // 45
    expected = {
        "linear": ((M, 45), (45, 24), True, False),
        "linear 3-D": ((M, 45), (45, 24), True, False),
        "residual": ((M, 45), (45, 24), True, True),
        "residual 3-D": ((M, 45), (45, 24), True, True),
        "bmm 2-D": ((7, 45), (45, 24), False, False),
        "bmm 4-D": ((6, 7, 45), (6, 45, 24), False, False),
        "bmm batch 1": ((1, 7, 45), (1, 45, 24), False, False),
    }
    assert asked[0] == expected[kind]


def test_plain_products_keep_our_op_where_it_does_more(device, monkeypatch):
    # An epilogue, a residual of a wider dtype, a wider weight under autocast and a weight
    # gradient folded into `.grad` (`accumulate_grads_in_place`) are ours to compute,
    # whatever the planner says.
    monkeypatch.setattr(plan_module, "plain_products_on_cublas", lambda *args: True)
    monkeypatch.setattr(plan_module, "plain_linear_on_cublas", lambda *args: True)
    ops = ops_called(monkeypatch)
    x = rand((7, 48), torch.float32, device, mean=0.3).requires_grad_()
    w = rand((16, 48), torch.float32, device, mean=0.1).requires_grad_()
    h = rand((7, 16), torch.float32, device)
    y = linear(x, w, "relu_squared", use_triton=True)  # ours through its eager plan
    assert type(y.grad_fn).__name__ == "_EagerLinearBackward"
    linear(x.bfloat16(), w.bfloat16(), use_triton=True, residual=h)  # bf16 product, fp32 sum
    assert ops == [bmm_module.linear_op]
    ops.clear()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        linear(x, w, use_triton=True)  # x cast to bf16, the fp32 weight read through a copy
    assert ops == [bmm_module.linear_op]
    ops.clear()
    w.grad = torch.zeros_like(w)
    with bmm_module.accumulate_grads_in_place():
        linear(x, w, use_triton=True).sum().backward()
    assert ops[0] is bmm_module.linear_op
    ops.clear()
    linear(x, w, use_triton=True)
    assert ops == []


def test_traced_products_go_to_cublas(monkeypatch):
    # What torch.compile hands the op bodies: fake CUDA tensors (no GPU needed). Under "auto"
    # a traced fp32 weight gradient of bf16 operands (torch.mm with out_dtype) and a batched
    # product (torch.bmm) reach cuBLAS, no Triton kernel; without mm's out_dtype on fake
    # tensors (`_MM_OUT_DTYPE_TRACEABLE` False) the weight gradient is ours.
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not plan_module._MM_OUT_DTYPE_TRACEABLE:
        pytest.skip("this PyTorch has no meta kernel for torch.mm's out_dtype")

    def no_triton(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched")

    plans = []
    uncached = plan_module._plan.__wrapped__

    def plan(*args):  # uncached, and recorded
        plans.append(uncached(*args))
        return plans[-1]

    pretend_gpu(monkeypatch, 9, 132, "H200")
    monkeypatch.setattr(plan_module, "_plan", plan)
    monkeypatch.setattr(plan_module, "launch_mm_tma", no_triton)
    monkeypatch.setattr(plan_module, "launch_mm_ptr", no_triton)
    monkeypatch.setattr(utils_module, "COMPILE_TMA", True)  # reach a launch without a copy
    bf16 = torch.bfloat16
    with FakeTensorMode():
        dy = torch.empty(4096, 768, dtype=bf16, device="cuda")
        x = torch.empty(4096, 3072, dtype=bf16, device="cuda")
        dw = torch.empty(768, 3072, dtype=torch.float32, device="cuda")
        plan_module._mm2d_into(dy.t(), x, dw)  # dW = dY^T @ X, written in fp32
        assert plans == [("cublas",)]
        q = torch.empty(8, 128, 64, dtype=bf16, device="cuda")
        scores = torch.empty(8, 128, 128, dtype=bf16, device="cuda")
        plan_module._bmm_into(q, q.transpose(-1, -2), scores)
        monkeypatch.setattr(plan_module, "_MM_OUT_DTYPE_TRACEABLE", False)
        with pytest.raises(AssertionError, match="Triton"):
            plan_module._mm2d_into(dy.t(), x, dw)
        assert plans[-1][0] == "tma"
        monkeypatch.setattr(plan_module, "matmul_impl", "triton")
        with pytest.raises(AssertionError, match="Triton"):
            plan_module._bmm_into(q, q.transpose(-1, -2), scores)


def test_split_k_choice():
    # Measured best splits on an H200 (bench_matmul.py's sweep): the heuristic reproduces them.
    best = {(1536, 512, 2048): 1, (512, 512, 2048): 4, (2048, 512, 2048): 1,
            (512, 2048, 2048): 1, (256, 512, 2048): 4, (1536, 512, 8192): 4,
            (512, 512, 8192): 8, (2048, 512, 8192): 4, (512, 2048, 8192): 4}  # fmt: skip
    for (M, N, K), split in best.items():
        assert plan_module._split_k(M, N, K, 132) == split, (M, N, K)
    assert plan_module._split_k(8192, 2048, 512, 132) == 1
    assert plan_module._split_k(512, 512, 512, 132) == 1  # short K: not worth a second kernel
    for M, N, K in [(128, 128, 1 << 20), (1, 1, 1 << 16), (4096, 4096, 1 << 16)]:
        split = plan_module._split_k(M, N, K, 132)
        tiles = -(-M // 128) * -(-N // 128)
        assert 1 <= split <= 16 and (split == 1 or tiles * split <= 2 * 132)


def _run_tma_kernel(
    a, b, relu_squared=False, residual=None, save_relu=False, split=1, sub=1, drop=None,
    swiglu=False,
):  # fmt: skip
    """The Hopper kernel with fixed small tiles (no autotuning), as the interpreter runs it.
    drop: (p, seed) of the epilogue dropout. swiglu: b is (K, 2·N) [gate | up]; aux (M, 2·N)
    receives the pre-activations."""
    M, K = a.shape
    N = b.shape[1] // 2 if swiglu else b.shape[1]
    la, lb = plan_module._layout(a), plan_module._layout(b)
    c = torch.full((M, N), float("nan"), dtype=a.dtype, device=a.device)
    aux = torch.full_like(c, float("nan")) if save_relu else None
    if swiglu:
        aux = torch.full((M, 2 * N), float("nan"), dtype=a.dtype, device=a.device)
    ws = torch.empty((split, M, N), device=a.device) if split > 1 else c
    rs = residual.stride() if residual is not None else (0, 0)
    num_sms = 3  # fewer programs than tiles: each loops over several (persistent)
    kernels_module._mm_tma_kernel[(num_sms,)](
        a, b, c, residual if residual is not None else c, aux if aux is not None else c, ws,
        M, N, K, la[1], lb[1], N, rs[0], rs[1], aux.stride(0) if aux is not None else N, split,
        *plan_module._dropout_args(drop, c),
        A_T=bool(la[0]), B_T=bool(lb[0]), RELU_SQUARED=relu_squared,
        HAS_RESIDUAL=residual is not None, STORE_AUX=aux is not None, DROPOUT=drop is not None,
        SWIGLU=swiglu, SPLIT=split > 1,
        NUM_SMS=num_sms, BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, EPI_SUB=sub, FLATTEN=True,
    )  # fmt: skip
    if split > 1:
        kernels_module._splitk_reduce_kernel[(-(-M * N // 256),)](ws, c, M * N, split, BLOCK=256)
    return c, aux


@pytest.mark.parametrize(
    "a_t, b_t, relu_squared, has_res, save_relu, split, sub, p",
    [
        (False, True, False, False, False, 1, 1, 0.0),  # forward: X @ W^T
        (False, False, False, False, False, 1, 2, 0.0),  # dX = dY @ W, halves stored apart
        (True, False, False, False, False, 3, 1, 0.0),  # dW = dY^T @ X, split K
        (True, True, False, False, False, 1, 1, 0.0),
        (False, True, True, True, True, 1, 2, 0.0),  # relu², residual and relu(pre) together
        (False, True, True, False, False, 1, 1, 0.0),
        (False, True, True, False, True, 1, 2, 0.25),  # + dropout, halves stored apart
        (False, True, True, True, True, 1, 1, 0.5),
    ],
)
def test_tma_kernel_logic(a_t, b_t, relu_squared, has_res, save_relu, split, sub, p, device):
    # Dims that are multiples of 8 (16-byte rows in fp16) but not of the 32-wide tiles: the
    # descriptors' zero padding and clipped stores cover the ragged edges. On a GPU this runs
    # on Hopper only; on the CPU in the interpreter.
    if device == "cuda" and torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("TMA needs sm_90+")
    if device == "cuda":
        import triton

        triton.set_allocator(utils_module.tma_scratch)
    M, N, K = 40, 48, 104
    dtype = torch.float16
    A = rand((M, K), dtype, device, mean=0.3)
    B = rand((K, N), dtype, device, mean=-0.1)
    a = A.t().contiguous().t() if a_t else A
    b = B.t().contiguous().t() if b_t else B
    res = rand((M, N), dtype, device, mean=1.5) if has_res else None
    drop = (p, draw_seeds(device, 1)[0]) if p > 0 else None
    c, aux = _run_tma_kernel(a, b, relu_squared, res, save_relu, split, sub, drop)
    ref = A.double() @ B.double()
    if relu_squared:
        relu = ref.clamp_min(0)
        assert (ref < 0).any() and (ref > 0).any()
        if save_relu:
            assert rel_err(aux, relu) < 1e-2
        ref = relu * relu
    if drop is not None:
        # the mask as the backward's relu2_grad kernel regenerates it (other tile shapes):
        # d(pre) for dy = 1, relu(pre) = 1/2 is exactly keep / (1 - p)
        half = torch.full((M, N), 0.5, device=device)
        keep = bmm_module.relu2_grad_op(torch.ones_like(half), half, False, p, drop[1]) != 0
        assert 0 < keep.double().mean() < 1
        ref = torch.where(keep, ref / (1 - p), 0.0)
    if has_res:
        ref = ref + res.double()
    assert rel_err(c, ref) < 1e-2


# ------------------------------------------------------------------------------------------
# The model's projections on a GPU: both paths, CUDA graphs, torch.compile, autotune cache
# ------------------------------------------------------------------------------------------

# (K in, N out, activation) of every projection of the model (d512, ff 4x, vocab 256).
MODEL_SHAPES = [
    (512, 1536, None),  # to_qkv
    (512, 512, None),  # to_out
    (512, 2048, "relu_squared"),  # proj_in
    (2048, 512, None),  # proj_out
    (512, 256, None),  # to_logits
]


def check_linear_bf16(M, K, N, activation, device):
    x = rand((M, K), torch.bfloat16, device, mean=0.1, std=1.0).requires_grad_()
    weight = rand((N, K), torch.bfloat16, device, mean=-0.01, std=K**-0.5).requires_grad_()
    y = linear(x, weight, activation, use_triton=True)
    grad = rand(y.shape, torch.bfloat16, device, mean=0.3)
    y.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = linear(x64, w64, activation)
    ref.backward(grad.double())
    assert rel_err(y, ref) < 1e-2
    assert rel_err(x.grad, x64.grad) < 1e-2
    assert rel_err(weight.grad, w64.grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "ptr"])
@pytest.mark.parametrize("M", [2048, 8192])
@pytest.mark.parametrize("K, N, activation", MODEL_SHAPES)
def test_model_shapes_gpu(K, N, activation, M, path, device, monkeypatch):
    # Every projection forward and backward (dX, dW) through the Hopper TMA kernel and through
    # the pointer fallback, matmul_impl forced to Triton (no cuBLAS table entry applies).
    monkeypatch.setattr(plan_module, "matmul_impl", "triton")
    monkeypatch.setattr(plan_module, "_FORCE_PATH", path)
    tma_calls = []
    real = plan_module.launch_mm_tma
    monkeypatch.setattr(plan_module, "launch_mm_tma", lambda *a: tma_calls.append(1) or real(*a))
    check_linear_bf16(M, K, N, activation, device)
    hopper = torch.cuda.get_device_capability()[0] in (9, 10)
    assert len(tma_calls) == (3 if path == "tma" and hopper else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [5, 2048, 8192])
@pytest.mark.parametrize("K, N, activation", MODEL_SHAPES)
def test_plain_products_run_pytorchs_op_gpu(K, N, activation, M, device, monkeypatch):
    # Under "auto" a plain projection whose three GEMMs the H200's plan gives to cuBLAS is
    # F.linear in an eager call (decode-sized ones with a short K keep the pointer kernel,
    # relu² its epilogue, through its eager plan); under "triton" our op. Forward and
    # backward against float64.
    ops = ops_called(monkeypatch)
    plans = bmm_module._EAGER_PLANS.plans
    plans.clear()
    check_linear_bf16(M, K, N, activation, device)
    native = activation is None and (M > 16 or (K >= 2048 and N >= 2048))
    assert (ops == [] and not plans) == native, ops
    assert bool(plans) == (activation == "relu_squared")  # no op of the dispatcher's
    ops.clear()
    plans.clear()
    monkeypatch.setattr(plan_module, "matmul_impl", "triton")
    check_linear_bf16(M, K, N, activation, device)
    if activation == "relu_squared":
        assert plans and not ops
    else:
        assert ops and ops[0] is bmm_module.linear_op


@pytest.mark.gpu
@pytest.mark.parametrize("res_dtype", [torch.bfloat16, torch.float32])
def test_residual_linear_runs_pytorchs_op_gpu(res_dtype, device, monkeypatch):
    # a residual of the product's dtype: torch.addmm (cuBLAS's C input), PyTorch's own op; an
    # fp32 residual stream under a bf16 product: our epilogue. Against float64.
    ops = ops_called(monkeypatch)
    x = rand((4, 512, 512), torch.bfloat16, device, mean=0.1, std=1.0).requires_grad_()
    w = rand((768, 512), torch.bfloat16, device, mean=-0.01, std=512**-0.5).requires_grad_()
    h = rand((4, 512, 768), res_dtype, device, mean=1.0).requires_grad_()
    y = linear(x, w, use_triton=True, residual=h)
    grad = rand(y.shape, y.dtype, device, mean=0.3)
    y.backward(grad)
    assert (ops == []) == (res_dtype == torch.bfloat16), ops
    x64, w64, h64 = (t.detach().double().requires_grad_() for t in (x, w, h))
    ref = linear(x64, w64, residual=h64)
    ref.backward(grad.double())
    assert rel_err(y.double() - h.double(), ref - h64) < 1e-2
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad), (h.grad, h64.grad)):
        assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
def test_table_residual_entries_gpu(device, monkeypatch):
    # each residual product `MATMUL_TABLE` lists for this GPU ("MxNxK:nt+res", a residual of
    # the product's dtype, which goes to torch.addmm without an entry) runs our op at that
    # shape ("tma", "ptr") or PyTorch's mm then the add ("cublas+ew"), and its output matches
    # float64
    table = plan_module.MATMUL_TABLE.get(torch.cuda.get_device_name(), {})
    keys = [k for k in table if k.endswith(":nt+res")]
    shapes = [tuple(map(int, k.split(":")[0].split("x"))) for k in keys]
    entries = [table[k] for k in keys]
    if not shapes:
        pytest.skip("no residual entries for this GPU")
    ops = ops_called(monkeypatch)
    for (M, N, K), entry in zip(shapes, entries, strict=True):
        ops.clear()
        x = rand((M, K), torch.bfloat16, device, mean=0.1, std=1.0)
        w = rand((N, K), torch.bfloat16, device, mean=-0.01, std=K**-0.5)
        h = rand((M, N), torch.bfloat16, device, mean=1.0)
        with CountAdds((M, N)) as adds:
            y = linear(x, w, use_triton=True, residual=h)
        if entry == "cublas+ew":  # PyTorch's own mm, then the add
            assert ops == [] and adds.adds == 1, (M, N, K, ops, adds.adds)
        else:
            assert ops == [bmm_module.linear_op], (M, N, K, ops)
        ref = torch.addmm(h.double(), x.double(), w.double().t())
        assert rel_err(y.double() - h.double(), ref - h.double()) < 1e-2, (M, N, K)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 8, 512, 64), (1, 512, 64), (512, 64)])
def test_plain_bmm_runs_pytorchs_op_gpu(shape, device, monkeypatch):
    # bmm: batched products are torch.bmm's under "auto", 2-D ones (and a batch of 1) cuBLAS's
    # per the plan: the eager call is torch.matmul; forward and backward against float64
    ops = ops_called(monkeypatch)
    q = rand(shape, torch.bfloat16, device, mean=0.1, std=1.0)
    k = rand(shape, torch.bfloat16, device, mean=-0.2, std=1.0)
    check_bmm(q, k.transpose(-1, -2), torch.bfloat16)
    assert ops == []


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("K, N, activation", MODEL_SHAPES)
def test_few_rows_gpu(K, N, activation, M, device, monkeypatch):
    # decode-sized products (a token per sequence) take the narrow pointer tiles, or cuBLAS
    # for plain products with a long K; forward and backward against float64
    ptr_calls = []
    real = plan_module.launch_mm_ptr
    monkeypatch.setattr(plan_module, "launch_mm_ptr", lambda *a: ptr_calls.append(a[6]) or real(*a))
    check_linear_bf16(M, K, N, activation, device)
    few_rows = ptr_calls.count(plan_module._FEW_ROWS_PTR)
    # the forward (unless cuBLAS takes it) and dX = dY @ W (M rows, K = N: cuBLAS if N >= 2048)
    expected = (activation is not None or K < 2048) + (N < 2048)
    assert few_rows == expected, (ptr_calls, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "cublas"])
def test_matmul_impl_gpu(impl, device, monkeypatch):
    monkeypatch.setattr(plan_module, "matmul_impl", impl)
    check_linear_bf16(2048, 512, 512, None, device)
    check_linear_bf16(2048, 512, 2048, "relu_squared", device)  # the epilogue stays Triton
    # A residual of the same dtype goes to torch.addmm (under "auto" as under "cublas").
    x = rand((2048, 2048), torch.bfloat16, device, mean=0.1)
    w = rand((512, 2048), torch.bfloat16, device, mean=-0.01, std=2048**-0.5)
    h = rand((2048, 512), torch.bfloat16, device, mean=1.0)
    y = linear(x, w, use_triton=True, residual=h)
    ref = linear(x.double(), w.double(), residual=h.double())
    assert rel_err(y.double() - h.double(), ref - h.double()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_cublas_ew_gpu(p, device, monkeypatch):
    # relu² through cuBLAS and the elementwise pass at a GPT-2 shape (d768 -> 3072), forward
    # and backward against float64; with dropout, the fused epilogue's mask (same seed).
    M, K, N = 4096, 768, 3072
    monkeypatch.setattr(plan_module, "_FORCE_PATH", "cublas+ew")
    if p == 0.0:
        check_linear_bf16(M, K, N, "relu_squared", device)
        return
    x = rand((M, K), torch.bfloat16, device, mean=0.1, std=1.0)
    w = rand((N, K), torch.bfloat16, device, mean=-0.01, std=K**-0.5)
    seed = draw_seeds(device, 1)[0]
    y = linear(x, w, "relu_squared", use_triton=True, dropout_p=p, seed=seed)
    monkeypatch.setattr(plan_module, "_FORCE_PATH", None)
    y_fused = linear(x, w, "relu_squared", use_triton=True, dropout_p=p, seed=seed)
    relu2 = (x.double() @ w.double().T).clamp(min=0) ** 2
    live = relu2 > 1e-3 * relu2.max()
    assert torch.equal(y[live] != 0, y_fused[live] != 0)
    assert rel_err(y, torch.where(y.double() != 0, relu2 / (1 - p), 0.0)) < 1e-2


@pytest.mark.gpu
def test_compiled_mixed_precision_weight_grad_gpu(device, monkeypatch):
    # Under torch.compile an fp32 weight's gradient (bf16 operands) is cuBLAS's mm with
    # out_dtype where this PyTorch traces it (`_MM_OUT_DTYPE_TRACEABLE`), else our kernel:
    # either way fp32, and equal to eager's to fp32 rounding.
    monkeypatch.setattr(plan_module, "matmul_impl", "auto")
    torch._dynamo.reset()
    x = rand((2048, 768), torch.bfloat16, device, mean=0.2)
    w = rand((3072, 768), torch.float32, device, mean=0.01, std=768**-0.5).requires_grad_()
    grad = rand((2048, 3072), torch.bfloat16, device, mean=0.3)

    def f(x, w):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return linear(x, w, use_triton=True)

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        (g,) = torch.autograd.grad(fn(x, w), w, grad)
        grads.append(g)
    assert grads[1].dtype == torch.float32
    assert rel_err(grads[1], grads[0]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_residual_gpu(dtype, device):
    x = rand((4096, 2048), dtype, device, mean=0.1).requires_grad_()
    w = rand((512, 2048), dtype, device, mean=-0.01, std=2048**-0.5).requires_grad_()
    h = rand((4096, 512), torch.float32, device, mean=1.0).requires_grad_()
    y = linear(x, w, "relu_squared", use_triton=True, residual=h)
    grad = rand(y.shape, torch.float32, device, mean=0.3)
    y.backward(grad)
    x64, w64, h64 = (t.detach().double().requires_grad_() for t in (x, w, h))
    ref = linear(x64, w64, "relu_squared", residual=h64)
    ref.backward(grad.double())
    assert rel_err(y.double() - h.double(), ref - h64) < 1e-2
    assert rel_err(x.grad, x64.grad) < 1e-2 and rel_err(w.grad, w64.grad) < 1e-2
    assert torch.equal(h.grad, grad)


@pytest.mark.gpu
def test_cuda_graph_capture_gpu(device):
    # Forward and backward of a relu² projection and a plain one, captured and replayed twice
    # on new data; the replay matches eager. Autotuning happens in the warm-up, not in capture.
    x = rand((2048, 512), torch.bfloat16, device).requires_grad_()
    w1 = rand((2048, 512), torch.bfloat16, device, std=512**-0.5).requires_grad_()
    w2 = rand((512, 2048), torch.bfloat16, device, std=2048**-0.5).requires_grad_()

    def step():
        h = linear(x, w1, "relu_squared", use_triton=True)
        out = linear(h, w2, use_triton=True, residual=x)
        out.float().square().mean().backward()
        return out

    from triton_transformer.cuda_graph import capture_graph

    graph, out = capture_graph(step, clear_grads=(x, w1, w2))
    static_grads = [p.grad for p in (x, w1, w2)]  # the graph writes these buffers
    outs = []
    for _ in range(2):
        with torch.no_grad():
            for p in (x, w1, w2):
                p.copy_(rand(p.shape, p.dtype, device, std=p.shape[1] ** -0.5))
        graph.replay()
        torch.cuda.synchronize()
        got = [out.clone()] + [g.clone() for g in static_grads]
        for p in (x, w1, w2):
            p.grad = None
        want = [step().detach()] + [p.grad for p in (x, w1, w2)]
        for g, e in zip(got, want, strict=True):
            assert rel_err(g, e) < 1e-3
        outs.append(got[0])
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("compile_tma", [True, False])
def test_compile_without_graph_breaks_gpu(compile_tma, device, monkeypatch):
    # Traced with the TMA kernel (inductor allocates its descriptor scratch) or the pointer one.
    monkeypatch.setattr(utils_module, "COMPILE_TMA", compile_tma)
    monkeypatch.setattr(plan_module, "matmul_impl", "triton")
    torch._dynamo.reset()

    def f(x, w1, w2, q, k):
        h = linear(x, w1, "relu_squared", use_triton=True)
        out = linear(h, w2, use_triton=True, residual=x)
        s = bmm(q, k.transpose(-1, -2), use_triton=True)
        return out.float().sum() + s.float().sum()

    args = [
        rand((1024, 512), torch.bfloat16, device).requires_grad_(),
        rand((2048, 512), torch.bfloat16, device, std=512**-0.5).requires_grad_(),
        rand((512, 2048), torch.bfloat16, device, std=2048**-0.5).requires_grad_(),
        rand((4, 128, 64), torch.bfloat16, device).requires_grad_(),
        rand((4, 128, 64), torch.bfloat16, device).requires_grad_(),
    ]
    explanation = torch._dynamo.explain(f)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    loss = torch.compile(f)(*args)
    loss.backward()
    got = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    ref = f(*args)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    for g, a in zip(got, args, strict=True):
        assert rel_err(g, a.grad) < 1e-2


@pytest.mark.gpu
def test_autotune_cache_per_shape_gpu(device, monkeypatch):
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the autotuned kernel is the Hopper path")
    monkeypatch.setattr(plan_module, "matmul_impl", "triton")
    w = rand((512, 512), torch.bfloat16, device, std=512**-0.5)
    for M in (1024, 3072):
        linear(rand((M, 512), torch.bfloat16, device), w, use_triton=True)
    keys = list(kernels_module._mm_tma_tuned.cache)
    for M in (1024, 3072):
        assert any(k[:3] == (M, 512, 512) for k in keys), keys
    n = len(keys)
    linear(rand((1024, 512), torch.bfloat16, device), w, use_triton=True)
    assert len(kernels_module._mm_tma_tuned.cache) == n  # same shape: the cached config
    # Eager launches after the first skip the autotuner: its pick is kept per problem.
    assert any(k[:3] == (1024, 512, 512) for k in plan_module._TUNED)


# --- dropout fused into the relu² epilogue ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 24), (2, 3, 19, 40)], ids=str)
def test_linear_relu2_dropout_matches_fp64(shape, dtype, device):
    # y = dropout(relu(x Wᵀ)²): the mask is read off y where relu² > 0 (elsewhere it cannot
    # matter), then forward and both gradients are compared with float64 under that mask.
    p, N = 0.3, 72  # N > one 64-column tile and not a multiple of 16
    x = rand(shape, dtype, device, mean=0.2, std=1.0).requires_grad_()
    w = rand((N, shape[-1]), dtype, device, mean=0.0, std=0.3).requires_grad_()
    y = linear(x, w, "relu_squared", use_triton=True, dropout_p=p)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    pre = x64 @ w64.T
    relu2 = pre.clamp(min=0) ** 2
    keep = y.detach().double() != 0
    live = relu2 > 1e-3 * relu2.max()  # clearly nonzero: a zero output there means dropped
    rate = keep[live].double().mean().item()
    assert abs(rate - (1 - p)) < 3 * ((p * (1 - p)) / live.sum().item()) ** 0.5 + 1e-3
    ref = torch.where(keep, relu2 / (1 - p), 0.0)
    assert rel_err(y, ref) < TOL[dtype]
    dy = torch.randn(y.shape, device=device).to(dtype)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    rx, rw = torch.autograd.grad(ref, (x64, w64), dy.double())
    assert rel_err(gx, rx) < TOL[dtype] and rel_err(gw, rw) < TOL[dtype]


def test_linear_relu2_dropout_seeds(device):
    x = rand((33, 16), torch.float32, device, mean=0.5, std=1.0)
    w = rand((48, 16), torch.float32, device, mean=0.0, std=0.5)
    seeds = draw_seeds(device, 2)
    a = linear(x, w, "relu_squared", use_triton=True, dropout_p=0.5, seed=seeds[0])
    assert torch.equal(a, linear(x, w, "relu_squared", use_triton=True, dropout_p=0.5,
                                 seed=seeds[0]))  # fmt: skip
    assert not torch.equal(a, linear(x, w, "relu_squared", use_triton=True, dropout_p=0.5,
                                     seed=seeds[1]))  # fmt: skip
    torch.manual_seed(4)
    b = linear(x, w, "relu_squared", use_triton=True, dropout_p=0.5)
    torch.manual_seed(4)
    assert torch.equal(b, linear(x, w, "relu_squared", use_triton=True, dropout_p=0.5))


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cublas_ew_relu2_matches_float64(dtype, p, device, monkeypatch):
    # "cublas+ew" (forced; on the CPU torch.mm, then the pass in the interpreter): torch.mm,
    # then relu² and the dropout in one elementwise pass. Same mask as the fused epilogue
    # from the same seed, forward and both gradients against float64 (fp16 keeps relu(pre)
    # for the backward through the pass's second output).
    calls = []
    real = plan_module._relu2_in_place
    monkeypatch.setattr(plan_module, "_relu2_in_place", lambda *a: calls.append(a[1]) or real(*a))
    N = 72  # > one 64-column tile, not a multiple of 16
    x = rand((2, 19, 40), dtype, device, mean=0.2, std=1.0).requires_grad_()
    w = rand((N, 40), dtype, device, mean=0.0, std=0.3).requires_grad_()
    seed = draw_seeds(device, 1)[0]
    dy = rand((2, 19, N), dtype, device, mean=0.3)
    outs = {}
    for force in (None, "cublas+ew"):
        monkeypatch.setattr(plan_module, "_FORCE_PATH", force)
        y = linear(x, w, "relu_squared", use_triton=True, dropout_p=p, seed=seed)
        outs[force] = (y.detach(), *torch.autograd.grad(y, (x, w), dy))
    assert len(calls) == 1 and (calls[0] is not None) == (dtype == torch.float16)
    y_fused, y = outs[None][0], outs["cublas+ew"][0]
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    relu2 = (x64 @ w64.T).clamp(min=0) ** 2
    live = relu2 > 1e-3 * relu2.max()  # clearly nonzero: a zero output there means dropped
    assert torch.equal(y[live] != 0, y_fused[live] != 0)  # the fused epilogue's mask
    ref = torch.where(y.double() != 0, relu2 / (1 - p), 0.0)
    refs = (ref.detach(), *torch.autograd.grad(ref, (x64, w64), dy.double()))
    for got, want in zip(outs["cublas+ew"], refs, strict=True):
        assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_cublas_ew_residual_matches_float64(dtype, device, monkeypatch):
    # a residual of the product's dtype through "cublas+ew" (forced; on the CPU torch.mm, as
    # on CUDA): the product, then the residual added in place; forward and the three
    # gradients against float64. An accumulation into c itself (the residual is the output)
    # takes addmm: the product would overwrite the residual before the add.
    monkeypatch.setattr(plan_module, "_FORCE_PATH", "cublas+ew")
    x = rand((2, 19, 40), dtype, device, mean=0.2, std=1.0).requires_grad_()
    w = rand((72, 40), dtype, device, mean=0.0, std=0.3).requires_grad_()
    h = rand((2, 19, 72), dtype, device, mean=1.0).requires_grad_()
    dy = rand((2, 19, 72), dtype, device, mean=0.3)
    with CountAdds((38, 72)) as adds:  # the product's rows, as the op computes them
        y = linear(x, w, use_triton=True, residual=h)
    assert adds.adds == 1  # the forward's add
    got = (y.detach(), *torch.autograd.grad(y, (x, w, h), dy))
    x64, w64, h64 = (t.detach().double().requires_grad_() for t in (x, w, h))
    ref = x64 @ w64.T + h64
    refs = (ref.detach(), *torch.autograd.grad(ref, (x64, w64, h64), dy.double()))
    for g, want in zip(got, refs, strict=True):
        assert rel_err(g, want) < TOL[dtype]
    a, b = rand((19, 40), dtype, device, mean=0.2), rand((40, 72), dtype, device, mean=-0.1)
    c = rand((19, 72), dtype, device, mean=1.0)
    want = c.double() + a.double() @ b.double()
    plan_module._mm2d_into(a, b, c, residual=c)
    assert rel_err(c, want) < TOL[dtype]


def test_residual_product_follows_the_plan(monkeypatch):
    # an eager linear with a residual of its dtype runs PyTorch's own ops where cuBLAS runs its
    # GEMMs (`residual_product`): torch.addmm, or torch.mm then the add where the plan says
    # "cublas+ew" (forced here; the table's entries are `test_plan_picks_paths`')
    called = []
    for name in ("addmm", "mm"):
        real = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda *a, _r=real, _n=name, **k: called.append(_n) or _r(*a, **k)
        )
    a, w = torch.randn(8, 16, dtype=torch.float64), torch.randn(24, 16, dtype=torch.float64)
    r = torch.randn(8, 24, dtype=torch.float64)
    want = r + a @ w.t()
    assert torch.allclose(plan_module.residual_product(r, a, w.t()), want)
    assert called == ["addmm"]
    called.clear()
    monkeypatch.setattr(plan_module, "_FORCE_PATH", "cublas+ew")
    assert torch.allclose(plan_module.residual_product(r, a, w.t()), want)
    assert called == ["mm"]


@pytest.mark.parametrize("use_triton", [False, True])
def test_linear_dropout_arguments(use_triton, device):
    x, w = torch.randn(4, 16, device=device), torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match="relu_squared"):
        linear(x, w, use_triton=use_triton, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        linear(x, w, "relu_squared", use_triton=use_triton, dropout_p=1.0)
    # p = 0 is the plain op; the PyTorch branch drops with F.dropout
    y = linear(x, w, "relu_squared", use_triton=use_triton, dropout_p=0.0)
    assert torch.allclose(y, torch.relu(x @ w.T) ** 2, rtol=1e-4, atol=1e-4)


def test_ops_reject_dropout_without_relu2_or_seed(device):
    # the ops check for themselves what `linear` checks: their backward could not mask
    x, w = torch.randn(4, 16, device=device), torch.randn(8, 16, device=device)
    seed = draw_seeds(device, 1)[0]
    with pytest.raises(ValueError, match="relu_squared"):
        bmm_module.linear_op(x, w, None, False, 0.1, seed)
    with pytest.raises(ValueError, match="seed"):
        bmm_module.linear_op(x, w, None, True, 0.1, None)
    with pytest.raises(ValueError, match="seed"):
        bmm_module.relu2_grad_op(torch.ones(4, 8, device=device), torch.ones(4, 8, device=device),
                                 False, 0.1, None)  # fmt: skip


# --- SwiGLU fused into the projection's epilogue ------------------------------------------------


def swiglu64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x W_gateᵀ) · (x W_upᵀ) in float64, written out (w's rows: gate, then up)."""
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def check_linear_swiglu(x, w, tol, dy=None):
    """linear(x, w, "swiglu") forward, dx and dW against float64; returns (y, dx, dW)."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = linear(x, w, "swiglu", use_triton=True)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0] // 2)
    dy = rand(y.shape, x.dtype, x.device, mean=0.3) if dy is None else dy
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = swiglu64(x64, w64)
    assert rel_err(linear(x64, w64, "swiglu"), ref) < 1e-12  # the PyTorch branch's semantics
    rx, rw = torch.autograd.grad(ref, (x64, w64), dy.double())
    assert rel_err(y, ref) < tol
    assert gx.dtype == x.dtype and rel_err(gx, rx) < tol
    assert gw.dtype == w.dtype and rel_err(gw, rw) < tol
    return y.detach(), gx, gw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["2d", "3d", "strided"])
def test_linear_swiglu_matches_float64(layout, dtype, device):
    # H = 40: not a multiple of the 32-wide tiles; M = 37 rows, K = 48 > BLOCK_K (the K loop).
    # Centred so that gate spans silu's curved part, negative and positive.
    w = rand((80, 48), dtype, device, mean=0.02, std=0.2)
    if layout == "2d":
        x = rand((37, 48), dtype, device, mean=0.2, std=1.0)
    elif layout == "3d":
        x = rand((2, 3, 7, 48), dtype, device, mean=0.2, std=1.0)
    else:  # a transposed view: (37, 48) with strides (1, 37)
        x = rand((48, 37), dtype, device, mean=0.2, std=1.0).t()
    gate = x.double() @ w.double()[:40].T
    assert (gate < -1).any() and (gate > 1).any()
    check_linear_swiglu(x, w, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_swiglu_cublas_ew_matches_fused(dtype, device, monkeypatch):
    # "cublas+ew" (forced; on the CPU torch.mm and swiglu.py's forward kernel in the
    # interpreter): the projection into the pre-activations, then the gating pass. Same
    # function as the fused epilogue: both against float64, and against each other.
    calls = []
    real = plan_module.launch_swiglu_fwd
    monkeypatch.setattr(plan_module, "launch_swiglu_fwd", lambda *a: calls.append(1) or real(*a))
    x = rand((2, 19, 48), dtype, device, mean=0.2, std=1.0)
    w = rand((80, 48), dtype, device, mean=0.02, std=0.2)
    dy = rand((2, 19, 40), dtype, device, mean=0.3)
    outs = {}
    for force in ("ptr", "cublas+ew"):  # the fused pointer kernel (any dtype, any device)
        monkeypatch.setattr(plan_module, "_FORCE_PATH", force)
        outs[force] = check_linear_swiglu(x, w, TOL[dtype], dy)
    assert len(calls) == 1  # the "cublas+ew" forward only
    for fused, ew in zip(outs["ptr"], outs["cublas+ew"], strict=True):
        # fp32: the same sums (up to the summation order); fp16/bf16 also round gate and up
        # before the pass, which the fused epilogue reads in fp32
        assert rel_err(ew, fused) < (1e-6 if dtype == torch.float32 else TOL[dtype])


def test_linear_swiglu_saves_what_the_unfused_path_saved(device):
    # x, the weight and the (M, 2H) pre-activations: as linear + swiglu (whose gate and up are
    # views of the projection), never the (M, H) output nor a copy of the projection
    x = rand((2, 5, 48), torch.float32, device).requires_grad_()
    w = rand((80, 48), torch.float32, device, std=0.2).requires_grad_()

    def saved(f):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: shapes.append((tuple(t.shape), t.untyped_storage().data_ptr())) or t,
            lambda t: t,
        ):
            f()
        return shapes

    fused = saved(lambda: linear(x, w, "swiglu", use_triton=True))  # (x itself, not a view)
    assert sorted(s for s, _ in fused) == sorted([(2, 5, 48), (80, 48), (10, 80)])

    def unfused():
        from triton_transformer.swiglu import swiglu

        gate, up = linear(x, w, use_triton=True).chunk(2, dim=-1)
        return swiglu(gate, up, use_triton=True)

    storages = {ptr for _, ptr in saved(unfused)}
    assert len(storages) == len({ptr for _, ptr in fused}) == 3


def test_linear_swiglu_arguments(device):
    x, w = torch.randn(4, 16, device=device), torch.randn(8, 16, device=device)
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="2·H rows"):
            linear(x, w[:7], "swiglu", use_triton=use_triton)
        with pytest.raises(ValueError, match="no residual"):
            linear(x, w, "swiglu", use_triton=use_triton, residual=torch.randn(4, 4))
        with pytest.raises(ValueError, match="relu_squared"):
            linear(x, w, "swiglu", use_triton=use_triton, dropout_p=0.1)
        y = linear(x, w, "swiglu", use_triton=use_triton, dropout_p=0.0)
        assert rel_err(y, swiglu64(x, w)) < 1e-5
    with pytest.raises(ValueError, match="even row count"):  # the op checks for itself
        bmm_module.linear_swiglu_op(x, w[:7])
    # K = 0: zeros (silu(0) · 0), and zero gradients; no rows: empty
    x0 = torch.randn(3, 0, device=device, requires_grad=True)
    w0 = torch.randn(8, 0, device=device, requires_grad=True)
    y0 = linear(x0, w0, "swiglu", use_triton=True)
    assert torch.equal(y0, torch.zeros(3, 4, device=device))
    y0.sum().backward()
    assert x0.grad.shape == x0.shape and w0.grad.shape == w0.shape and not w0.grad.any()
    assert linear(x[:0], w, "swiglu", use_triton=True).shape == (0, 4)


def test_linear_swiglu_follows_autocast_with_fp32_weight_grads(device):
    # bf16 autocast, fp32 weight: the product reads its bf16 copy, the weight gradient comes
    # straight from the fp32 accumulator of d(pre)ᵀ x (d(pre) from the op's own pass); the
    # PyTorch branch under autocast gives the same function
    dev = torch.device(device).type
    x = rand((21, 48), torch.bfloat16, device, mean=0.2).requires_grad_()
    w = rand((80, 48), torch.float32, device, mean=0.01, std=48**-0.5).requires_grad_()
    with torch.autocast(device_type=dev, dtype=torch.bfloat16):
        y = linear(x, w, "swiglu", use_triton=True)
        y_ref = linear(x, w, "swiglu")
    assert y.dtype == y_ref.dtype == torch.bfloat16
    grad = rand(y.shape, torch.bfloat16, device, mean=0.3)
    y.backward(grad)
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    w16 = w.detach().to(torch.bfloat16)
    pre = bmm_module.linear_swiglu_op(x.detach(), w.detach(), w16)[1]
    dpre = bmm_module.linear_swiglu_backward_op(grad, pre).double()
    assert rel_err(w.grad, dpre.T @ x.detach().double()) < 1e-5
    assert rel_err(y, swiglu64(x.detach(), w16)) < 1e-2
    assert rel_err(y_ref, swiglu64(x.detach(), w16)) < 1e-2


def test_linear_swiglu_registered_ops(device):
    x = rand((7, 45), torch.float32, device).requires_grad_()
    w = rand((24, 45), torch.float32, device).requires_grad_()
    tests = _opcheck_tests(device)
    torch.library.opcheck(bmm_module.linear_swiglu_op, (x, w), test_utils=tests)
    torch.library.opcheck(
        bmm_module.linear_swiglu_op, (x.detach().bfloat16(), w, w.detach().bfloat16()),
        test_utils=tests,
    )  # fmt: skip
    dy, pre = rand((7, 12), torch.float32, device), rand((7, 24), torch.float32, device)
    torch.library.opcheck(bmm_module.linear_swiglu_backward_op, (dy, pre), test_utils=tests)
    torch.library.opcheck(
        bmm_module.linear_swiglu_backward_op, (dy[:1, :5].expand(7, 5), pre[:, :10]),
        test_utils=tests,
    )  # fmt: skip


def test_linear_swiglu_double_backward_raises(device, assert_first_order_only):
    x = rand((5, 16), torch.float32, device, mean=0.3).requires_grad_()
    w = rand((8, 16), torch.float32, device, mean=0.1)
    assert_first_order_only(lambda x: linear(x, w, "swiglu", use_triton=True), x, "linear")


def test_plan_swiglu_paths(monkeypatch):
    # "+swiglu": cuBLAS + swiglu's pass by default where cuBLAS computes the product (the
    # fused kernel measured no faster), the table's "tma" or "ptr", forced paths, the fused
    # kernel under "triton"/"cublas" or where cuBLAS can't, traced -> cuBLAS + the pass
    bf16 = torch.bfloat16
    pretend_gpu(monkeypatch, 9, 132, "H200")
    table = {
        "8192x5632x2048:nt+swiglu": "tma",
        "4096x2048x512:nt+swiglu": "ptr",
        "1024x2048x768:nt+swiglu": "fused",
    }
    monkeypatch.setattr(plan_module, "MATMUL_TABLE", {"H200": table})

    def plan(M, N, K, a_t=0, b_t=1, impl="auto", force=None, tracing=False, ok=True, size=2):
        return plan_module._plan.__wrapped__(
            "cuda", 0, bf16, M, N, K, a_t, b_t, "+swiglu", ok, size, impl, force, tracing
        )

    ptr_cfg = plan_module._ptr_config(16384, 2048, 768, 1, bf16, False, True)
    assert ptr_cfg[1] <= 64 and ptr_cfg[2] <= 32  # two accumulators: narrower tiles
    assert plan(16384, 2048, 768) == ("cublas+ew",)  # the default: cuBLAS + the pass
    assert plan(8192, 5632, 2048) == ("tma", 1, 132)  # the table can say fused
    assert plan(4096, 2048, 512)[0] == "ptr"
    assert plan(1024, 2048, 768) == ("tma", 1, 132)  # "fused": the faster fused kernel
    assert plan(16384, 2048, 768, ok=False) == ("tma", 1, 132)  # cuBLAS can't: fused
    assert plan(16384, 2048, 768, force="cublas+ew") == ("cublas+ew",)
    assert plan(8192, 5632, 2048, force="tma")[0] == "tma"  # forced: the table is skipped
    assert plan(16384, 2048, 768, force="ptr") == ("ptr", ptr_cfg)
    assert plan(16384, 2048, 768, impl="triton")[0] == "tma"
    assert plan(16384, 2048, 768, impl="cublas")[0] == "tma"  # stays fused, as relu²
    assert plan(16384, 2048, 768, tracing=True) == ("cublas+ew",)
    assert plan(16384, 2048, 768, tracing=True, impl="triton")[0] == "ptr"
    assert plan(16384, 2048, 768, tracing=True, ok=False)[0] == "ptr"
    assert plan(16384, 2044, 768, impl="triton")[0] == "ptr"  # 4088-byte rows: no TMA
    assert plan(16384, 2048, 768, a_t=-1, impl="triton")[0] == "ptr"
    assert plan(5, 2048, 768) == ("cublas+ew",)  # decode-sized: the fused tiles unmeasured
    assert plan(5, 2048, 768, impl="triton") == ("ptr", plan_module._FEW_ROWS_PTR_SWIGLU)
    pretend_gpu(monkeypatch, 8, 108, "A100")
    assert plan(16384, 2048, 768) == ("cublas+ew",)
    assert plan(16384, 2048, 768, impl="triton")[0] == "ptr"
    cpu = plan_module._plan.__wrapped__
    assert cpu("cpu", 0, bf16, 37, 40, 48, -1, -1, "+swiglu", True, 2, "auto", None)[0] == "ptr"


@pytest.mark.parametrize("b_t, sub", [(True, 1), (True, 2), (False, 2)])
def test_tma_kernel_swiglu_logic(b_t, sub, device):
    # The SWIGLU variant of the Hopper kernel in the interpreter (or on Hopper): gate and up
    # tiles from one B descriptor, both accumulators' pre-activations stored to AUX, y =
    # silu(gate) · up; H = 48 is not a multiple of the 32-wide tiles (the last gate tile reads
    # up columns, which the stores clip), B read transposed (the weight) or row-major.
    if device == "cuda" and torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("TMA needs sm_90+")
    if device == "cuda":
        import triton

        triton.set_allocator(utils_module.tma_scratch)
    M, H, K = 40, 48, 104
    A = rand((M, K), torch.float16, device, mean=0.1)
    W = rand((2 * H, K), torch.float16, device, mean=0.02, std=0.15)
    b = W.t() if b_t else W.t().contiguous()
    c, aux = _run_tma_kernel(A, b, sub=sub, swiglu=True)
    pre = A.double() @ W.double().T
    assert rel_err(aux, pre) < 1e-3
    assert rel_err(c, swiglu64(A, W)) < 1e-2


def test_swiglu_kernels_compile_for_sm90():
    # `_sm90_compile_check.py` (no GPU needed): the TMA kernel's SWIGLU variant at each of its
    # tuning configs (warps, stages), the pointer kernel's at the planner's GPU tiles
    script = Path(__file__).with_name("_sm90_compile_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(script.parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "TMA matmul, SwiGLU epilogue: ok" in lines
    assert "pointer matmul, SwiGLU epilogue: ok" in lines


# GPU: the Llama feed-forward shapes (GPT-2 small's d768 -> 2 x 2048; Llama-7B-ish d2048 ->
# 2 x 5632), both paths the planner chooses between, forward and backward against float64
SWIGLU_GPU_SHAPES = [(16384, 768, 2048), (8192, 2048, 5632)]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "cublas+ew"])
@pytest.mark.parametrize("M, K, H", SWIGLU_GPU_SHAPES)
def test_linear_swiglu_gpu(M, K, H, path, device, monkeypatch):
    monkeypatch.setattr(plan_module, "_FORCE_PATH", path)
    calls = []
    for name in ("launch_mm_tma", "launch_swiglu_fwd"):
        real = getattr(plan_module, name)
        monkeypatch.setattr(
            plan_module, name, lambda *a, n=name, f=real, **k: calls.append(n) or f(*a, **k)
        )
    x = rand((M, K), torch.bfloat16, device, mean=0.05, std=1.0)
    w = rand((2 * H, K), torch.bfloat16, device, mean=0.0, std=K**-0.5)
    check_linear_swiglu(x, w, 1e-2)
    hopper = torch.cuda.get_device_capability()[0] in (9, 10)
    if path == "cublas+ew":
        assert calls.count("launch_swiglu_fwd") == 1
    elif hopper:  # the fused forward, and the forced backward GEMMs (dX, dW)
        assert calls.count("launch_mm_tma") == 3 and "launch_swiglu_fwd" not in calls


@pytest.mark.gpu
@pytest.mark.parametrize("compile_tma", [True, False])
def test_linear_swiglu_compiles_gpu(compile_tma, device, monkeypatch):
    # Traced: the TMA kernel where inductor provides its scratch, else cuBLAS + swiglu's pass
    # (as relu²); no graph breaks, and the same numbers as eager
    monkeypatch.setattr(utils_module, "COMPILE_TMA", compile_tma)
    torch._dynamo.reset()
    x = rand((2, 1024, 768), torch.bfloat16, device, mean=0.05).requires_grad_()
    w = rand((4096, 768), torch.float32, device, std=768**-0.5).requires_grad_()

    def f(x, w):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return linear(x, w, "swiglu", use_triton=True).float().square().sum()

    explanation = torch._dynamo.explain(f)(x, w)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        loss = fn(x, w)
        grads.append((loss.detach(), *torch.autograd.grad(loss, (x, w))))
    for got, want in zip(grads[1], grads[0], strict=True):
        assert rel_err(got, want) < 1e-2
    assert grads[1][2].dtype == torch.float32


# ----------------------------------------------------------------------------- eager plan


def _relu2_through_registered_op(x, w, p=0.0, seed=None):
    """relu² `linear` through torch.library's dispatch and registered autograd (x 2-D): the
    generic path the eager plan (`bmm._EagerPlan`) must agree with."""
    return bmm_module.linear_op(x, w, None, True, p, seed)


def _plan_matches_registered_op(x, w, out_shape, planned, through_op) -> torch.Tensor:
    """With a dense, an expanded (a sum's) and a strided upstream gradient: two calls
    `planned(x, w)` through one eager plan give bit for bit what the registered op
    `through_op(x2, w)` (x as rows) gives, forward and backward. Returns the op's output."""
    dtype, device = x.dtype, x.device
    dense = torch.randn(out_shape, device=device).to(dtype)
    wide = torch.randn((*out_shape[:-1], 2 * out_shape[-1]), device=device).to(dtype)
    expanded = torch.ones((), device=device, dtype=dtype).expand(out_shape)
    for dy in (dense, expanded, wide[..., ::2]):
        results = []
        for plan in (True, True, False):
            xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
            if plan:
                y = planned(xl, wl)
            else:
                y = through_op(xl.reshape(-1, x.shape[-1]), wl).view(out_shape)
            y.backward(dy)
            results.append((y, xl.grad, wl.grad))
        assert len(bmm_module._EAGER_PLANS.plans) == 1
        for got in results[:2]:
            for a, want in zip(got, results[2], strict=True):
                assert torch.equal(a, want)
    return results[2][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, p", [((37, 48), 0.0), ((3, 13, 48), 0.0), ((37, 48), 0.25)])
def test_eager_linear_plan_matches_registered_op(shape, p, dtype, device):
    # An eager relu² call takes its layout's plan (made on the first call, its products bound
    # on the first call that can bind them, taken by later calls): forward and backward bit
    # for bit what the registered op gives through the dispatcher, with a dense, an expanded
    # (a sum's) and a strided upstream gradient, with and without a dropout.
    bmm_module._EAGER_PLANS.plans.clear()
    x = rand(shape, dtype, device, mean=0.2)
    w = rand((40, shape[-1]), dtype, device, mean=0.05, std=0.2)
    seed = draw_seeds(device, 2)[1]  # a view 8 bytes into its buffer
    _plan_matches_registered_op(
        x, w, (*shape[:-1], 40),
        lambda x, w: linear(x, w, "relu_squared", use_triton=True, dropout_p=p, seed=seed),
        lambda x2, w: _relu2_through_registered_op(x2, w, p, seed),
    )  # fmt: skip
    plan = next(iter(bmm_module._EAGER_PLANS.plans.values()))
    if dtype == torch.float32 or device == "cuda":  # bf16 interpreted: widened, not bound
        assert len(plan.products.bound) == 3 and None not in plan.products.bound.values()
        assert len(plan.grads) == 3 and None not in plan.grads.values()


def test_eager_linear_plan_without_autograd_under_autocast_and_accumulating(device):
    # No autograd recorded (no_grad, or nothing requiring grad): the plan's forward alone.
    # Under autocast the fp32 weight is read through its bf16 copy and its gradient comes
    # back in fp32; inside `accumulate_grads_in_place` dW is added into `.grad`; both as the
    # generic path gives them.
    bmm_module._EAGER_PLANS.plans.clear()
    x = rand((33, 40), torch.float32, device, mean=0.2)
    w = rand((24, 40), torch.float32, device, mean=0.05, std=0.2)
    want = _relu2_through_registered_op(x, w)
    with torch.no_grad():
        assert torch.equal(linear(x, w.requires_grad_(), "relu_squared", use_triton=True), want)
    w.requires_grad_(False)
    y = linear(x, w, "relu_squared", use_triton=True)
    assert torch.equal(y, want) and y.grad_fn is None

    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        y = linear(xl, wl, "relu_squared", use_triton=True)
    w_lp = wl.detach().bfloat16().requires_grad_()
    xr = x.detach().requires_grad_()
    want = _relu2_through_registered_op(xr.bfloat16(), w_lp)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    assert wl.grad.dtype == torch.float32
    torch.testing.assert_close(xl.grad, xr.grad, rtol=0, atol=0)
    torch.testing.assert_close(wl.grad, w_lp.grad.float(), rtol=2e-2, atol=1e-2)

    dys = [torch.randn(33, 24, device=device) for _ in range(3)]
    check_grads_fold_alike(lambda wl: linear(x, wl, "relu_squared", use_triton=True), [w], dys)


def test_eager_linear_plan_keeps_the_checks(device):
    # A plan is taken only by calls of its validated layout: a later call with a weight of
    # another shape, a bad dropout or an integer input still raises the generic path's error;
    # fp16 and a residual take the generic path.
    bmm_module._EAGER_PLANS.plans.clear()
    x = rand((8, 16), torch.float32, device, mean=0.2)
    w = rand((12, 16), torch.float32, device)
    linear(x, w, "relu_squared", use_triton=True)
    with pytest.raises(ValueError, match="last dim"):
        linear(x, w[:, :8], "relu_squared", use_triton=True)
    with pytest.raises(ValueError, match="dropout"):
        linear(x, w, "relu_squared", use_triton=True, dropout_p=1.5)
    with pytest.raises(TypeError, match="dtype"):
        linear(x.to(torch.int32), w, "relu_squared", use_triton=True)
    with pytest.raises(ValueError, match="activation"):
        linear(x, w, "gelu", use_triton=True)
    assert len(bmm_module._EAGER_PLANS.plans) == 1
    linear(x.half(), w.half(), "relu_squared", use_triton=True)
    linear(x, w, "relu_squared", use_triton=True, residual=torch.zeros(8, 12, device=device))
    assert len(bmm_module._EAGER_PLANS.plans) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 48), (3, 13, 48)])
def test_eager_swiglu_plan_matches_registered_op(shape, dtype, device):
    # An eager SwiGLU call takes its layout's plan too (the product and its gating pass bound
    # on the first call where cuBLAS computes it, "cublas+ew"; the gating's backward per
    # layout of dy): forward and backward bit for bit what the registered op gives, with a
    # dense, an expanded and a strided upstream gradient; a dropout or an odd row count still
    # raises.
    bmm_module._EAGER_PLANS.plans.clear()
    x = rand(shape, dtype, device, mean=0.2)
    w = rand((40, shape[-1]), dtype, device, mean=0.05, std=0.2)
    want = _plan_matches_registered_op(
        x, w, (*shape[:-1], 20),
        lambda x, w: linear(x, w, "swiglu", use_triton=True),
        lambda x2, w: bmm_module.linear_swiglu_op(x2, w)[0],
    )  # fmt: skip
    with torch.no_grad():
        assert torch.equal(linear(x, w, "swiglu", use_triton=True), want)
    plan = next(iter(bmm_module._EAGER_PLANS.plans.values()))
    assert len(plan.grads) == 1  # (the expanded and strided ones read as contiguous copies)
    if device == "cuda" and bmm_module.matmul_plan.matmul_impl == "auto":
        assert None not in plan.products.bound.values()
    with pytest.raises(ValueError, match="dropout_p > 0"):
        linear(x, w, "swiglu", use_triton=True, dropout_p=0.1)
    with pytest.raises(ValueError, match="2·H rows"):
        linear(x, w[:39], "swiglu", use_triton=True)
