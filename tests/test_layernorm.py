"""LayerNorm: Triton kernels (forward, dx, dweight, dbias) vs a float64 run of the PyTorch branch.

CPU runs use Triton's interpreter with small shapes. The looped path (rows longer than one
block) is reached by monkeypatching `layernorm.MAX_BLOCK_N` down to 32, and once with the real
constant by taking N = MAX_BLOCK_N + 37.
"""

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_transformer.layernorm import STABLE_CLAMP, LayerNorm, layernorm

# The package re-exports the function `layernorm`, which shadows the submodule attribute.
ln_mod = importlib.import_module("triton_transformer.layernorm")

LOW_PRECISION = [torch.float16, torch.bfloat16]


def _inputs(shape, dtype=torch.float32, device="cpu", bias=True, param_dtype=None):
    """Non-centred, never-zero x; random weight/bias (not the ones/zeros init)."""
    N = shape[-1]
    param_dtype = param_dtype or dtype
    x = (-2.3 + 0.5 * torch.randn(shape, device=device)).to(dtype)
    w = (1.0 + 0.5 * torch.randn(N, device=device)).to(param_dtype)
    b = (0.3 * torch.randn(N, device=device)).to(param_dtype) if bias else None
    return x, w, b


def _fwd_bwd(x, w, b, dy, eps=1e-5, stable=False, use_triton=True, dtype=None):
    """Output and grads (dx, dw[, db]); `dtype` upcasts the inputs first (the reference)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, w)]
    if b is not None:
        leaves.append(b.detach().to(dtype or b.dtype).requires_grad_())
    y = layernorm(*leaves[:2], leaves[2] if b is not None else None, eps, stable, use_triton)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return (y, *grads)


def _assert_close(actual, expected, tol, name="", floor=None):
    """Row-wise (last dim) relative error <= tol, floored for near-zero rows; NaN/inf fail.

    Row-wise, so rows of very different scale (e.g. below-clamp rows with huge gradients)
    cannot hide an error in another row. `floor` (per row) is the size of the terms a value
    is computed from, for results that cancel exactly (see _cancellation_floors).
    """
    assert actual.shape == expected.shape, name
    a = actual.double()
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    if a.numel() == 0:
        return
    n = a.shape[-1]
    err = (a - expected).reshape(-1, n).norm(dim=-1)
    bound = tol * expected.reshape(-1, n).norm(dim=-1) + 1e-3 * tol * math.sqrt(n)
    if floor is not None:
        bound = bound + tol * floor.reshape(-1)
    bad = (err > bound).nonzero().flatten().tolist()
    assert not bad, f"{name}: rows {bad[:5]}: |diff| {err[bad[:5]]} > {bound[bad[:5]]}"


def _check(x, w, b, eps=1e-5, stable=False, tol=1e-5, dy=None):
    """Triton fwd + bwd vs the float64 reference on the same (already rounded) inputs."""
    # dy in x's dtype, so both runs see the same (rounded) values.
    dy = (torch.randn(x.shape, device=x.device) if dy is None else dy).to(x.dtype)
    out = _fwd_bwd(x, w, b, dy, eps, stable)
    ref = _fwd_bwd(x, w, b, dy.double(), eps, stable, use_triton=False, dtype=torch.float64)
    names, like = ["y", "dx", "dweight", "dbias"][: len(out)], (x, x, w, b)[: len(out)]
    floors = _cancellation_floors(x, w, dy, eps) if x.shape[-1] == 1 else {}
    for name, o, r, t in zip(names, out, ref, like, strict=True):
        assert o.dtype == t.dtype, f"{name} dtype {o.dtype}, expected {t.dtype}"
        _assert_close(o, r, tol, name, floor=floors.get(name))
    return out, ref


def _cancellation_floors(x, w, dy, eps):
    """Sizes of the terms that cancel exactly when N = 1 (variance 0, rstd = 1/sqrt(eps)).

    Then y = bias, dx = 0 and dweight = 0 exactly in float64, while on the GPU the kernel's
    fused multiply-adds leave one rounding of terms amplified by rstd ≈ 316 (e.g.
    fma(x, 1/s, -mean) keeps the unrounded product). Judge those outputs against the size of
    the terms, rstd·|x|·|w|, rstd·|dy·w| and Σ rstd·|dy·x|, as fp32 rounding of them is.
    """
    x64, w64, dy64 = x.double().reshape(-1, 1), w.double(), dy.double().reshape(-1, 1)
    rstd = (x64.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
    return {
        "y": (rstd * x64.abs() * w64.abs()).flatten(),
        "dx": (rstd * (dy64 * w64).abs()).flatten(),
        "dweight": (rstd * (dy64 * x64).abs()).sum(0),
    }


@pytest.mark.parametrize("N", [1, 37, 100, 256])
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp64(N, stable, bias, device):
    # 70 rows: several forward programs and backward groups, the last ones partial.
    x, w, b = _inputs((70, N), device=device, bias=bias)
    _check(x, w, b, stable=stable)


@pytest.mark.parametrize("N", [33, 64, 100])
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_looped_long_rows(N, stable, bias, device, monkeypatch):
    monkeypatch.setattr(ln_mod, "MAX_BLOCK_N", 32)
    # 10 rows: 5 backward groups of 2 rows, so the partial sums accumulate across rows.
    x, w, b = _inputs((10, N), device=device, bias=bias)
    _check(x, w, b, stable=stable)


@pytest.mark.parametrize("stable", [False, True])
def test_looped_with_real_max_block(stable, device):
    x, w, b = _inputs((3, ln_mod.MAX_BLOCK_N + 37), device=device)
    _check(x, w, b, stable=stable)


@pytest.mark.parametrize("shape", [(37,), (2, 5, 37), (2, 3, 4, 37)])
def test_ranks(shape, device):
    x, w, b = _inputs(shape, device=device)
    _check(x, w, b)
    _check(x, w, b, stable=True)


@pytest.mark.parametrize("looped", [False, True])
def test_non_contiguous(looped, device, monkeypatch):
    if looped:
        monkeypatch.setattr(ln_mod, "MAX_BLOCK_N", 32)
    # Transposed (last dim strided: copied by as_rows) ...
    x, w, b = _inputs((9, 100), device=device)
    x = x.t().contiguous().t()  # same values, strides (1, 9)
    dy = torch.randn(100, 9, device=device).t()
    _check(x, w, b, dy=dy)
    # ... and a column slice (row stride 120 != N: passed to the kernels, no copy).
    wide, w, b = _inputs((9, 120), device=device)
    _check(wide[:, 10:110], w[10:110], b[10:110], stable=True)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("looped", [False, True])
def test_low_precision(dtype, stable, looped, device, monkeypatch):
    if looped:
        monkeypatch.setattr(ln_mod, "MAX_BLOCK_N", 32)
    x, w, b = _inputs((24, 100), dtype=dtype, device=device)
    _check(x, w, b, stable=stable, tol=1e-2)


@pytest.mark.parametrize("stable", [False, True])
def test_fp32_params_with_bf16_input(stable, device):
    # As under autocast: bf16 activations, fp32 params. Output bf16, grads in param dtypes.
    x, w, b = _inputs((16, 100), dtype=torch.bfloat16, device=device, param_dtype=torch.float32)
    _check(x, w, b, stable=stable, tol=1e-2)
    # Under autocast both branches keep the input dtype (torch's layer_norm would give fp32).
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y_triton = layernorm(x, w, b, stable=stable, use_triton=True)
        y_torch = layernorm(x, w, b, stable=stable)
    assert y_triton.dtype == y_torch.dtype == torch.bfloat16
    ref = layernorm(x.double(), w.double(), b.double(), stable=stable)
    _assert_close(y_triton, ref, 1e-2, "autocast triton")
    # The PyTorch branch rounds x / scale to bf16 before normalising, which the mean/std
    # ratio of this data (about 5) amplifies: it is the less accurate of the two.
    _assert_close(y_torch, ref, 3e-2, "autocast torch")


def test_stable_all_negative_rows(device):
    # Dividing by the plain max (negative here) would flip the sign of every row.
    N = 50
    x = -(1.0 + torch.rand(8, N, device=device))
    w = 1.0 + 0.5 * torch.randn(N, device=device)
    b = 0.3 * torch.randn(N, device=device)
    out, _ = _check(x, w, b, stable=True)
    # Scaling only rescales the variance against eps: stable ~ plain, same signs.
    plain = layernorm(x, w, b, use_triton=True)
    _assert_close(out[0], plain.double(), 1e-3, "stable vs plain")


@pytest.mark.parametrize("looped", [False, True])
def test_stable_zero_rows(looped, device, monkeypatch):
    if looped:
        monkeypatch.setattr(ln_mod, "MAX_BLOCK_N", 32)
    x, w, b = _inputs((6, 100), device=device)
    x[1] = 0.0
    x[4] = 0.0
    out, _ = _check(x, w, b, stable=True)
    torch.testing.assert_close(out[0][1], b, rtol=0, atol=1e-6)  # zero row -> y = bias


def _tied_rows(device, eps_dtype=torch.float32):
    """Rows whose max |x| is attained several times, with both signs, and a below-clamp row."""
    x = torch.rand(5, 40, device=device) * 2 - 1
    x[0, [3, 17, 30]] = torch.tensor([2.0, -2.0, 2.0], device=device)  # three ties, mixed signs
    x[1, [5, 6]] = -3.0  # two negative ties
    x[2, 9] = 4.0  # a single maximum
    x[3] = torch.rand(40, device=device) * STABLE_CLAMP / 2  # amax < clamp: no scale gradient
    x[3, 7] = STABLE_CLAMP  # amax == clamp: torch's clamp passes the gradient at equality
    return x


@pytest.mark.parametrize("looped", [False, True])
def test_stable_scale_gradient_and_ties(looped, device, monkeypatch):
    if looped:
        monkeypatch.setattr(ln_mod, "MAX_BLOCK_N", 16)
    x = _tied_rows(device)
    x[4] = x[4] * 1e-6  # entirely below the clamp
    w = 1.0 + 0.5 * torch.randn(40, device=device)
    b = 0.3 * torch.randn(40, device=device)
    dy = torch.randn(x.shape, device=device)
    # A large eps makes the gradient through the scale (it enters only via eps) sizeable.
    eps = 0.5
    _, ref = _check(x, w, b, eps=eps, stable=True, dy=dy)

    # The test can tell: dropping the scale's gradient (detaching it) changes dx noticeably.
    xd = x.double().requires_grad_()
    scale = xd.abs().amax(-1, keepdim=True).clamp(min=STABLE_CLAMP).detach()
    y = torch.nn.functional.layer_norm(xd / scale, (40,), w.double(), b.double(), eps)
    (dx_detached,) = torch.autograd.grad(y, xd, dy.double())
    assert (dx_detached - ref[1]).norm() > 1e-3 * ref[1].norm()


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the plain bf16 run, on purpose
@pytest.mark.parametrize(("dtype", "magnitude"), [(torch.float16, 1e4), (torch.bfloat16, 1e25)])
def test_stable_avoids_overflow(dtype, magnitude, device):
    # fp16 x * 1e4: x**2 overflows fp16; bf16 x * 1e25: x**2 overflows even fp32 statistics.
    x, w, b = _inputs((8, 100), device=device)
    x = (x * magnitude).to(dtype)
    w, b = w.to(dtype), b.to(dtype)
    _check(x, w, b, stable=True, tol=2e-2)
    # The PyTorch branch in the low-precision dtype stays finite and accurate too.
    ref = _fwd_bwd(x, w, b, torch.ones_like(x), stable=True, use_triton=False, dtype=torch.float64)
    _assert_close(layernorm(x, w, b, stable=True), ref[0], 2e-2, "torch branch")
    if dtype == torch.bfloat16:  # motivation: without the rescale the fp32 variance is inf
        plain = layernorm(x, w, b, use_triton=True).double()
        assert not torch.allclose(plain, ref[0], rtol=0.1, atol=0.1)


@pytest.mark.parametrize("bias", [False, True])
def test_module_state_dict_interchange(bias, device):
    dim = 37
    theirs = torch.nn.LayerNorm(dim, bias=bias, device=device)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.5)
        if bias:
            theirs.bias.normal_(0.0, 0.3)
    ours = LayerNorm(dim, bias=bias, use_triton=True).to(device)
    assert ours.bias is None if not bias else ours.bias.shape == (dim,)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = -2.3 + 0.5 * torch.randn(4, 6, dim, device=device)
    expected = theirs(x)
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours(x, use_triton=False), expected, rtol=1e-5, atol=1e-5)
    # ... and back.
    back = torch.nn.LayerNorm(dim, bias=bias, device=device)
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back(x), expected)


def test_validation_errors(device):
    x, w, b = _inputs((4, 8), device=device)
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="weight"):
            layernorm(x, w[:7], b, use_triton=use_triton)
        with pytest.raises(ValueError, match="bias"):
            layernorm(x, w, torch.zeros(4, 2, device=device), use_triton=use_triton)
        with pytest.raises(ValueError, match="x"):
            layernorm(torch.tensor(1.0), w[:1], use_triton=use_triton)
    with pytest.raises(TypeError, match="x"):
        layernorm(x.to(torch.int32), w, b, use_triton=True)
    with pytest.raises(TypeError, match="weight"):
        layernorm(x, w.double(), b, use_triton=True)
    with pytest.raises(TypeError, match="bias"):
        layernorm(x, w, b.double(), use_triton=True)
    with pytest.raises(TypeError, match="x"):
        layernorm([1.0, 2.0], w, use_triton=True)
    with pytest.raises(TypeError, match="weight"):
        layernorm(x, None, use_triton=True)


@pytest.mark.parametrize("shape", [(0, 37), (2, 0, 37), (5, 0)])
@pytest.mark.parametrize("stable", [False, True])
def test_zero_size(shape, stable, device):
    x, w, b = _inputs(shape, device=device)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    y = layernorm(x, w, b, stable=stable, use_triton=True)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


# ----------------------------------------------------------------------------- GPU, realistic


GPU_NS = [512, 768, 1000, 4096, 16384, 65536 + 37]


@pytest.mark.gpu
@pytest.mark.parametrize("N", GPU_NS)
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_realistic(N, dtype, stable, device):
    M = 4096 if N <= 16384 else 512
    x, w, b = _inputs((M, N), dtype=dtype, device=device)
    _check(x, w, b, stable=stable, tol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [768, 65536 + 37])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_deterministic(N, stable, device):
    x, w, b = _inputs((4096 if N < 16384 else 512, N), dtype=torch.bfloat16, device=device)
    dy = torch.randn(x.shape, device=device)
    first = _fwd_bwd(x, w, b, dy, stable=stable)
    second = _fwd_bwd(x, w, b, dy, stable=stable)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)


# ----------------------------------------------------------------------------- op contract


def test_strided_4d_input(device):
    # A permuted 4-D input whose rows are not one reshape-able view: copied once into rows,
    # y and dx still come back in x's logical shape.
    base, _, _ = _inputs((3, 37, 2, 5), device=device)
    x = base.permute(0, 2, 3, 1)  # (3, 2, 5, 37), last dim strided
    _, w, b = _inputs((37,), device=device)
    _check(x, w, b)
    # ... and one whose last dim is unit-stride but whose rows are strided (no copy needed).
    wide, w, b = _inputs((2, 3, 4, 50), device=device)
    _check(wide[:, :, 1:, 5:42], w[5:42], b[5:42], stable=True)


@pytest.mark.parametrize("use_triton", [False, True])
def test_output_is_fresh_and_in_place_works(use_triton, device):
    # The Triton op returns a new tensor, not a view of an internal buffer: in-place ops
    # on it (as after the PyTorch branch) work, also under autograd.
    x, w, b = _inputs((2, 3, 40), device=device)
    x.requires_grad_()
    y = layernorm(x, w, b, use_triton=use_triton)
    assert y._base is None and y.is_contiguous()
    expected = layernorm(x.detach().double(), w.double(), b.double())
    y.mul_(2.0)
    y.add_(1.0)
    _assert_close(y.detach(), 2 * expected + 1, 1e-5, "in-place")
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_registered_custom_op(stable, bias, device):
    # Schema and autograd registration of the torch.library ops; on a GPU also their
    # fake-tensor behaviour and AOT tracing (the interpreter cannot run fake tensors).
    x, w, b = _inputs((6, 33), device=device, bias=bias)
    args = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_() if bias else None)
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(ln_mod.layernorm_fwd, (*args, 1e-5, stable), test_utils=tests)
    _, stats = ln_mod.layernorm_fwd(*args, 1e-5, stable)
    # Detached: the backward op has no autograd of its own (once-differentiable).
    bwd_args = (torch.randn_like(x), x.detach(), w.detach(), b.detach() if bias else None, stats,
                1e-5, stable)  # fmt: skip
    torch.library.opcheck(ln_mod.layernorm_bwd, bwd_args, test_utils=tests)


@pytest.mark.parametrize("stable", [False, True])
def test_double_backward_raises(stable, device):
    x, w, b = _inputs((4, 16), device=device)
    x.requires_grad_()
    y = layernorm(x, w, b, stable=stable, use_triton=True)
    (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def test_backward_is_deterministic(device):
    # The dweight/dbias partials are summed in a fixed order: bitwise equal runs.
    x, w, b = _inputs((70, 100), device=device)
    dy = torch.randn(x.shape, device=device)
    first = _fwd_bwd(x, w, b, dy)
    second = _fwd_bwd(x, w, b, dy)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_cuda_graph_capture(stable, device):
    # Forward + backward captured in one CUDA graph; replays on new data match eager.
    x, w, b = _inputs((512, 768), dtype=torch.bfloat16, device=device)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    dy = torch.randn(x.shape, device=device, dtype=x.dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles the kernels) outside the graph
        for _ in range(2):
            layernorm(x, w, b, stable=stable, use_triton=True).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = w.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layernorm(x, w, b, stable=stable, use_triton=True)
        y.backward(dy)
    for _ in range(2):
        with torch.no_grad():
            x.copy_(-2.3 + 0.5 * torch.randn(x.shape, device=device))
        graph.replay()
        torch.cuda.synchronize()
        eager = _fwd_bwd(x.detach(), w.detach(), b.detach(), dy, stable=stable)
        assert torch.equal(y, eager[0])
        for got, want in zip((x.grad, w.grad, b.grad), eager[1:], strict=True):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_compiles_without_graph_breaks(stable, device):
    def f(x, w, b, use_triton=True):
        return layernorm(x.sin(), w, b, stable=stable, use_triton=use_triton).float().cos().sum()

    x, w, b = _inputs((64, 1000), dtype=torch.bfloat16, device=device)
    leaves = [t.requires_grad_() for t in (x, w, b)]
    explanation = torch._dynamo.explain(f)(*leaves)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(f)(*leaves)
    grads = torch.autograd.grad(compiled, leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = f(*ref_leaves, use_triton=False)
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    torch.testing.assert_close(compiled.double(), ref.double(), rtol=1e-2, atol=1e-2)
    for got, want, name in zip(grads, ref_grads, ("dx", "dw", "db"), strict=True):
        _assert_close(got, want, 3e-2, name)


@pytest.mark.parametrize("looped", [False, True])
@pytest.mark.parametrize("block_m", [1, 4])
def test_backward_variants_agree(looped, block_m, device, monkeypatch):
    # The measured alternatives of the backward kernel: prefetching the next row tile (same
    # arithmetic: bitwise-equal results) and the single-launch "last program reduces"
    # reduction (the same partials summed in another fixed order), which must also reset its
    # counter for the next call.
    if looped:
        monkeypatch.setattr(ln_mod, "MAX_BLOCK_N", 32)
    x, w, b = _inputs((50, 100), device=device)
    dy = torch.randn(x.shape, device=device)
    _, stats = ln_mod.layernorm_fwd(x, w, b, 1e-5, False)
    base = ln_mod._bwd_config(50, 100, ln_mod.MAX_BLOCK_N, x.device)
    bm = block_m if base[3] else 1
    rows_per_prog = 4 * bm  # several tiles per program
    cfg = (bm, *base[1:4], ln_mod.cdiv(50, rows_per_prog), rows_per_prog)
    outs = []
    for prefetch, fused in ((False, False), (True, False), (False, True)):
        counter = torch.zeros(1, dtype=torch.int32, device=device) if fused else None
        # NaN-poisoned: every element must be written.
        dx, dw, db = (torch.full_like(t, float("nan")) for t in (x, w, b))
        ln_mod.launch_bwd(
            dy, x, w, stats, dx, dw, db, 1e-5, False, cfg=(*cfg, prefetch), counter=counter
        )
        outs.append((dx, dw, db))
        if fused:
            assert counter.item() == 0
    ref = _fwd_bwd(x, w, b, dy.double(), use_triton=False, dtype=torch.float64)
    for out in outs:
        for got, want, name in zip(out, ref[1:], ("dx", "dw", "db"), strict=True):
            _assert_close(got, want, 1e-5, name)
    for other in outs[1:]:
        assert torch.equal(outs[0][0], other[0])
    assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][2], outs[1][2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_compile_traces_without_graph_breaks_cpu():
    # Dynamo (fullgraph: a graph break fails) and AOTAutograd's joint forward+backward trace of
    # the Triton paths of layernorm and residual_layernorm, static and dynamic shapes, on CPU:
    # a subprocess with TRITON_INTERPRET=0, so the kernels are JITFunctions torch.library can
    # trace. No kernel runs.
    script = Path(__file__).with_name("_compile_trace_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(script.parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script), "layernorm"], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert proc.returncode == 0 and len(lines) == 8, proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out_dtype(use_triton, out_dtype, device):
    # An fp32 stream normalised straight into the matmul dtype (as under autocast): y rounded
    # once from the fp32 result; the gradient arrives in out_dtype and dx is x's dtype.
    x, w, b = _inputs((37, 100), device=device)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y = layernorm(*leaves, use_triton=use_triton, out_dtype=out_dtype)
    assert y.dtype == out_dtype
    dy = torch.randn(x.shape, device=device).to(out_dtype)
    grads = torch.autograd.grad(y, leaves, dy)
    ref = _fwd_bwd(x, w, b, dy.double(), use_triton=False, dtype=torch.float64)
    _assert_close(y, ref[0], 1e-2, "y")
    for name, g, r, like in zip(["dx", "dweight", "dbias"], grads, ref[1:], leaves, strict=True):
        assert g.dtype == like.dtype, name
        _assert_close(g, r, 1e-5, name)  # dy's rounding is shared with the reference
    with pytest.raises(TypeError, match="out_dtype"):
        layernorm(x, w, b, use_triton=use_triton, out_dtype=torch.int32)
