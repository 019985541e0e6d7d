"""LayerNorm: Triton kernels (forward, dx, dweight, dbias) vs a float64 run of the PyTorch branch.

CPU runs use Triton's interpreter with small shapes. The wide-row paths are reached at small N
by monkeypatching `layernorm.MAX_BLOCK_N` down to 16-32 (rows then loop over column blocks),
or the launch tables (the `tables` fixture: every width takes one configuration, e.g. the
"split" backward with 32-column tiles); the shipped tables at 8192-16384+ columns run on a
few rows, and at model scale in the GPU tests.
"""

import importlib
import math
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import (
    check_grads_fold_alike,
    check_launches_bound_per_shape,
    compile_trace_check,
    run_without_interpreter,
    trace_check_result,
)

from triton_transformer.layernorm import STABLE_CLAMP, BwdConfig, LayerNorm, layernorm
from triton_transformer.residual_layernorm import residual_layernorm

# The package re-exports the function `layernorm`, which shadows the submodule attribute.
ln_mod = importlib.import_module("triton_transformer.layernorm")
bmm = importlib.import_module("triton_transformer.bmm")

LOW_PRECISION = [torch.float16, torch.bfloat16]

# Launch configurations that send small rows down the wide-row paths: tiles of 32-64 columns
# stand in for 4096-16384 (the interpreter's cost grows with the tile). Forward (BLOCK_M,
# BLOCK_N, warps), or None for the shipped table; backward a BwdConfig.
SPLIT = BwdConfig("split", 4, 32, 4, 2, sum_block_m=2, sum_block_n=32, sum_warps=4)
WIDE_PATHS = {
    "loop": ((2, 32, 4), BwdConfig("loop", 2, 32, 4, 1)),
    "split": (None, SPLIT),
    "split_prefetch": (
        (1, 64, 4),
        BwdConfig("split", 2, 64, 4, 1, prefetch=True, sum_block_m=1, sum_block_n=64),
    ),
}


@pytest.fixture
def tables():
    """`tables(fwd, bwd)` makes every width take these launch configurations (a one-entry
    table is every width's nearest entry; None keeps the shipped one) until the test ends."""
    saved = (
        ln_mod._LAYERNORM_FWD_CONFIGS,
        ln_mod._LAYERNORM_FWD_STABLE_CONFIGS,
        ln_mod._LAYERNORM_FWD_THIRDS,
        ln_mod._LAYERNORM_FWD_PLAIN_16BIT,
        ln_mod._LAYERNORM_BWD_CONFIGS,
    )

    def use(fwd=None, bwd=None):
        if fwd is not None:  # stable and three-block forwards too: no override is left
            ln_mod._LAYERNORM_FWD_CONFIGS = {16: fwd}
            ln_mod._LAYERNORM_FWD_STABLE_CONFIGS = {}
            ln_mod._LAYERNORM_FWD_THIRDS = {}
            ln_mod._LAYERNORM_FWD_PLAIN_16BIT = {}
        if bwd is not None:
            ln_mod._LAYERNORM_BWD_CONFIGS = {16: bwd}
        ln_mod._clear_config_caches()

    yield use
    (
        ln_mod._LAYERNORM_FWD_CONFIGS,
        ln_mod._LAYERNORM_FWD_STABLE_CONFIGS,
        ln_mod._LAYERNORM_FWD_THIRDS,
        ln_mod._LAYERNORM_FWD_PLAIN_16BIT,
        ln_mod._LAYERNORM_BWD_CONFIGS,
    ) = saved
    ln_mod._clear_config_caches()


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


@pytest.mark.parametrize("N", [5000, 8192 + 37, 16384 + 37])
@pytest.mark.parametrize("stable", [False, True])
def test_shipped_tables_at_wide_rows(N, stable, device):
    # The shipped configurations of width classes 8192 and 16384, and past the largest entry
    # (which takes its nearest), whichever paths they pick; 3 rows keep the interpreter quick.
    x, w, b = _inputs((3, N), device=device)
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


@pytest.mark.parametrize("path", ["single", "looped", "split"])
def test_stable_zero_rows(path, device, monkeypatch, tables):
    if path == "looped":
        monkeypatch.setattr(ln_mod, "MAX_BLOCK_N", 32)
    if path == "split":
        tables(bwd=SPLIT)
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


@pytest.mark.parametrize("path", ["single", "looped", "split"])
def test_stable_scale_gradient_and_ties(path, device, monkeypatch, tables):
    if path == "looped":
        monkeypatch.setattr(ln_mod, "MAX_BLOCK_N", 16)
    if path == "split":
        tables(bwd=SPLIT._replace(block_n=16, sum_block_n=16))  # ties in several tiles
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


GPU_NS = [384, 512, 768, 1000, 4096, 16384, 65536 + 37]


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


@pytest.mark.gpu
@pytest.mark.parametrize(("M", "N"), [(4096, 16384), (1024, 12288), (65536 + 8, 512)])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_wide_rows(M, N, stable, device):
    # GPT-2-scale widths through the shipped tables, bf16, against float64; and bitwise
    # reproducible. (65,544 x 512: the many-rows entry, plain; the width class's, stable.)
    x, w, b = _inputs((M, N), dtype=torch.bfloat16, device=device)
    dy = torch.randn(x.shape, device=device).to(x.dtype)
    out, _ = _check(x, w, b, stable=stable, tol=1e-2, dy=dy)
    again = _fwd_bwd(x, w, b, dy, stable=stable)
    for a, c in zip(out, again, strict=True):
        assert torch.equal(a, c)


# Configurations the benchmark's sweep tries at wide rows: each must compile and be right.
GPU_WIDE_FWD = [(1, 16384, 16), (1, 16384, 32), (1, 4096, 8), (2, 2048, 8)]
GPU_WIDE_BWD = [
    BwdConfig("row", 1, 16384, 32, 1),
    BwdConfig("row", 1, 16384, 16, 1, prefetch=True),
    BwdConfig("loop", 1, 4096, 8, 1),
    BwdConfig("loop", 2, 2048, 8, 4),
    BwdConfig("split", 8, 256, 4, 4, sum_block_m=1, sum_block_n=4096, sum_warps=8),
    BwdConfig("split", 16, 128, 8, 8, prefetch=True, sum_block_m=2, sum_block_n=2048),
]


@pytest.mark.gpu
@pytest.mark.parametrize("N", [12288, 16384])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_launch_variants_wide(N, stable, device, tables):
    x, w, b = _inputs((512, N), dtype=torch.bfloat16, device=device)
    dy = torch.randn(x.shape, device=device).to(x.dtype)
    for fwd, bwd in zip(GPU_WIDE_FWD + GPU_WIDE_FWD[:2], GPU_WIDE_BWD, strict=True):
        tables(fwd, bwd)
        _check(x, w, b, stable=stable, tol=1e-2, dy=dy)


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
    torch.library.opcheck(ln_mod.layernorm_op, (*args, 1e-5, stable), test_utils=tests)
    _, stats = ln_mod.layernorm_op(*args, 1e-5, stable)
    # Detached: the backward op has no autograd of its own (once-differentiable).
    bwd_args = (torch.randn_like(x), x.detach(), w.detach(), b.detach() if bias else None, stats,
                1e-5, stable)  # fmt: skip
    torch.library.opcheck(ln_mod.layernorm_backward_op, (*bwd_args, None, None), test_utils=tests)
    # with `.grad` accumulators (`bmm.accumulate_grads_in_place`): declared as mutated
    accs = torch.randn_like(w), torch.randn_like(b) if bias else None
    torch.library.opcheck(ln_mod.layernorm_backward_op, (*bwd_args, *accs), test_utils=tests)


@pytest.mark.parametrize("stable", [False, True])
def test_double_backward_raises(stable, device, assert_first_order_only):
    x, w, b = _inputs((4, 16), device=device)
    x.requires_grad_()
    f = lambda x: layernorm(x, w, b, stable=stable, use_triton=True)
    assert_first_order_only(f, x, "layernorm")


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
    from triton_transformer.cuda_graph import capture_graph

    def step():
        y = layernorm(x, w, b, stable=stable, use_triton=True)
        y.backward(dy)
        return y

    graph, y = capture_graph(step, clear_grads=(x, w, b))  # warm-up compiles the kernels
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


# Every kind of backward configuration, for rows of 100 (width class 128). "row" prefetching
# the next tile is the same arithmetic as without; so is "split".
BWD_VARIANTS = {
    "row": BwdConfig("row", 4, 128, 4, 1),
    "row_prefetch": BwdConfig("row", 4, 128, 4, 1, prefetch=True),
    "row_1": BwdConfig("row", 1, 128, 4, 2, prefetch=True),
    "loop": BwdConfig("loop", 1, 32, 4, 1),
    "loop_2_rows": BwdConfig("loop", 2, 64, 4, 2),
    "split": SPLIT,
    "split_prefetch": SPLIT._replace(prefetch=True),
    "split_1": BwdConfig("split", 1, 64, 4, 4, sum_block_m=4, sum_block_n=128),
}


@pytest.mark.parametrize("stable", [False, True])
def test_backward_variants_agree(stable, device):
    # Each variant launched directly on one problem (50 rows: several tiles per program, a
    # partial last one) matches float64; with the same arithmetic, prefetching is bitwise
    # equal. The variants sum dweight/dbias in different fixed orders: close, not equal.
    x, w, b = _inputs((50, 100), device=device)
    dy = torch.randn(x.shape, device=device)
    _, stats = ln_mod.layernorm_op(x, w, b, 1e-5, stable)
    ref = _fwd_bwd(x, w, b, dy.double(), stable=stable, use_triton=False, dtype=torch.float64)
    outs = {}
    for name, cfg in BWD_VARIANTS.items():
        # NaN-poisoned: every element must be written.
        dx, dw, db = (torch.full_like(t, float("nan")) for t in (x, w, b))
        ln_mod.launch_layernorm_bwd(dy, x, w, stats, dx, dw, db, 1e-5, stable, cfg=cfg)
        outs[name] = (dx, dw, db)
        for got, want, what in zip(outs[name], ref[1:], ("dx", "dw", "db"), strict=True):
            _assert_close(got, want, 1e-5, f"{name} {what}")
    for a, c in (("row", "row_prefetch"), ("split", "split_prefetch")):
        for got, want in zip(outs[a], outs[c], strict=True):
            assert torch.equal(got, want), (a, c)
    # The dx of "split" is computed from the same row sums as "row": equal up to fp32
    # summation order within a row.
    _assert_close(outs["split"][0], outs["row"][0].double(), 1e-6, "split vs row dx")


def test_row_config_must_hold_the_row(device):
    x, w, b = _inputs((4, 100), device=device)
    _, stats = ln_mod.layernorm_op(x, w, b, 1e-5, False)
    dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    with pytest.raises(ValueError, match="row"):
        ln_mod.launch_layernorm_bwd(x, x, w, stats, dx, dw, db, 1e-5, False,
                                    cfg=BWD_VARIANTS["loop"]._replace(kind="row"))  # fmt: skip


def test_config_lookup(tables):
    # Blocks are capped at the width class and at MAX_BLOCK_N; a "row" entry whose row does not
    # fit its block (a wider class than the entry's, or a small MAX_BLOCK_N) loops instead.
    big = 2**15
    tables(fwd=(1, 8192, 16), bwd=BwdConfig("row", 1, 8192, 16, 4))
    assert ln_mod._layernorm_fwd_config(100, big) == (1, 128, 16, True)
    assert ln_mod._layernorm_fwd_config(20000, big) == (1, 8192, 16, False)
    assert ln_mod._layernorm_fwd_config(100, 32) == (1, 32, 16, False)
    assert ln_mod._layernorm_bwd_config(100, big) == BwdConfig("row", 1, 128, 16, 4)
    assert ln_mod._layernorm_bwd_config(8192, big) == BwdConfig("row", 1, 8192, 16, 4)
    assert ln_mod._layernorm_bwd_config(8193, big) == BwdConfig("loop", 1, 8192, 16, 4)
    assert ln_mod._layernorm_bwd_config(100, 32) == BwdConfig("loop", 1, 32, 16, 4)
    split = BwdConfig("split", 8, 256, 4, 4, sum_block_m=1, sum_block_n=4096, sum_warps=8)
    tables(bwd=split)
    assert ln_mod._layernorm_bwd_config(100, big) == split._replace(block_n=128, sum_block_n=128)
    assert ln_mod._layernorm_bwd_config(30000, big) == split
    assert ln_mod._layernorm_bwd_config(30000, 64) == split._replace(block_n=64, sum_block_n=64)


def test_stable_forward_takes_its_override_at_exact_classes_only():
    # the stable forward's entries replace the plain ones at the classes they list (capped as
    # the plain ones are); any other class, and every plain forward, takes the plain table
    big = 2**15
    plain = ln_mod._nearest(ln_mod._LAYERNORM_FWD_CONFIGS, 1024)
    stable = ln_mod._LAYERNORM_FWD_STABLE_CONFIGS[1024]
    assert stable != plain  # the override is one: else this test checks nothing
    assert ln_mod._layernorm_fwd_config(768, big, True)[:3] == stable
    assert ln_mod._layernorm_fwd_config(768, big, False)[:3] == plain
    assert ln_mod._layernorm_fwd_config(768, big)[:3] == plain
    missing = next(w for w in (2048, 4096, 8192) if w not in ln_mod._LAYERNORM_FWD_STABLE_CONFIGS)
    assert ln_mod._layernorm_fwd_config(missing, big, True) == ln_mod._layernorm_fwd_config(
        missing, big, False
    )


def _record_fwd_launches(monkeypatch) -> list:
    """The forward kernel's launch keywords, one dict per launch (the keyed launch, or an
    eager call's first launch of a shape, which binds it), appended as `layernorm.py`
    launches."""
    seen = []
    real = ln_mod.launcher

    class Spy:
        def __init__(self, kernel):
            self.kernel, self.launch = kernel, real(kernel)

        def _seen(self, kwargs):
            if self.kernel is ln_mod._layernorm_fwd_kernel:
                seen.append(kwargs)

        def __getitem__(self, grid):
            def call(*args, **kwargs):
                self._seen(kwargs)
                return self.launch[grid](*args, **kwargs)

            return call

        def bind(self, grid, *args, **kwargs):
            self._seen(kwargs)
            return self.launch.bind(grid, *args, **kwargs)

    monkeypatch.setattr(ln_mod, "launcher", Spy)
    return seen


def test_three_block_rows(device, monkeypatch):
    # rows of three power-of-two blocks take the three-block tile (plain and stable; not the
    # residual form, nor once its block exceeds MAX_BLOCK_N) and match float64, forward and
    # backward, through the op
    big = ln_mod.MAX_BLOCK_N
    assert ln_mod._layernorm_fwd_exact_config(768, big) == (4, 256, 2)
    assert ln_mod._layernorm_fwd_exact_config(768, big, True, 4) == (4, 256, 2)
    assert ln_mod._layernorm_fwd_exact_config(768, 128) is None
    assert ln_mod._layernorm_fwd_exact_config(1024, big, False, 4) is None
    monkeypatch.setattr(ln_mod, "_LAYERNORM_FWD_THIRDS", {48: (2, 16, 1), 96: (4, 32, 2)})
    seen = _record_fwd_launches(monkeypatch)
    for n, stable in ((48, False), (48, True), (96, False), (96, True)):
        _check(*_inputs((70, n), device=device, bias=True), stable=stable)
        last = seen[-1]
        assert (last["THIRDS"], last["BLOCK_N"], last["RESIDUAL"]) == (True, n // 3, False)
    h, branch = torch.randn(5, 48, device=device), torch.randn(5, 48, device=device)
    residual_layernorm(h, branch, torch.ones(48, device=device), use_triton=True)
    assert seen[-1]["THIRDS"] is False and seen[-1]["RESIDUAL"] is True


def test_plain_16bit_rows_take_their_tile(device, monkeypatch):
    # the plain forward of fp16/bf16 rows at a width of `_LAYERNORM_FWD_PLAIN_16BIT` takes its
    # tile; fp32 rows, the stable forward and the residual form keep the class's. Forward and
    # backward against float64 through the op.
    big = ln_mod.MAX_BLOCK_N
    assert ln_mod._layernorm_fwd_exact_config(1024, big) == (2, 1024, 4)
    assert ln_mod._layernorm_fwd_exact_config(1024, big, True) is None
    assert ln_mod._layernorm_fwd_exact_config(1024, big, False, 4) is None
    assert ln_mod._layernorm_fwd_exact_config(1024, 512) is None
    monkeypatch.setattr(ln_mod, "_LAYERNORM_FWD_PLAIN_16BIT", {48: (2, 64, 1)})
    monkeypatch.setattr(ln_mod, "_LAYERNORM_FWD_CONFIGS", {64: (8, 64, 2)})
    monkeypatch.setattr(ln_mod, "_LAYERNORM_FWD_STABLE_CONFIGS", {})
    ln_mod._clear_config_caches()
    seen = _record_fwd_launches(monkeypatch)
    for dtype, stable, block_m in (
        (torch.bfloat16, False, 2), (torch.float16, False, 2), (torch.float32, False, 8),
        (torch.bfloat16, True, 8),
    ):  # fmt: skip
        _check(
            *_inputs((37, 48), dtype, device),
            stable=stable,
            tol=1e-5 if dtype == torch.float32 else 1e-2,
        )
        assert seen[-1]["BLOCK_M"] == block_m, (dtype, stable)
    h = torch.randn(5, 48, device=device, dtype=torch.bfloat16)
    residual_layernorm(h, h, torch.ones(48, device=device), use_triton=True)
    assert seen[-1]["BLOCK_M"] == 8


def test_config_lookup_residual(monkeypatch, device):
    # the residual form of a plain LayerNorm takes its own entry where the width class has
    # one (768 is in the 1024 class); other classes, and the stable norm's residual form,
    # keep the plain table's
    big = ln_mod.MAX_BLOCK_N
    residual = ln_mod._LAYERNORM_BWD_RESIDUAL
    assert ln_mod._layernorm_bwd_config(768, big, False, True) == residual[1024]
    assert ln_mod._layernorm_bwd_config(512, big, True, True) == residual[512]
    assert (
        ln_mod._layernorm_bwd_config(2048, big, False, True) == ln_mod._LAYERNORM_BWD_CONFIGS[2048]
    )
    seen = []
    real = ln_mod._layernorm_bwd_config
    monkeypatch.setattr(ln_mod, "_layernorm_bwd_config", lambda *a: seen.append(a) or real(*a))
    for stable in (False, True):
        x, w, b = _inputs((4, 100), device=device)
        _, stats = ln_mod.layernorm_op(x, w, b, 1e-5, stable)
        dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
        ln_mod.launch_layernorm_bwd(x, x, w, stats, dx, dw, db, 1e-5, stable, dhn2=x)
    assert [a[3] for a in seen] == [True, False]


def test_eager_launches_bound_per_shape(device):
    # an eager call's first launch of a shape binds the forward's and the backward's launches
    # (`_PLANS`); later calls of that shape take them (`helpers.check_launches_bound_per_shape`).
    # Another dtype or alignment binds its own.
    x, w, b = _inputs((37, 48), device=device)
    dy = torch.randn_like(x)

    def run(x):
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        y = layernorm(*leaves, use_triton=True)
        y.backward(dy.to(y.dtype))
        return (y, *(t.grad for t in leaves))

    shifted = torch.empty(x.numel() + 1, device=device)[1:].view_as(x)  # 4 bytes off
    check_launches_bound_per_shape(ln_mod._PLANS.plans, run, x, shifted, 6)
    ln_mod._clear_config_caches()
    assert not ln_mod._PLANS.plans


def _through_registered_op(x, w, b, stable, out_dtype=None):
    """layernorm's Triton path through torch.library's dispatch and registered autograd: the
    generic path an eager plan (`_EagerPlan`) must agree with."""
    return ln_mod.layernorm_op(x, w, b, 1e-5, stable, out_dtype)[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize(
    "shape, dtype, param_dtype, out_dtype",
    [
        ((3, 37, 48), torch.float32, None, None),
        ((70, 100), torch.float16, None, torch.float32),
        ((2, 5, 64), torch.float16, torch.float32, None),
    ],
)
def test_eager_plan_matches_registered_op(
    shape, dtype, param_dtype, out_dtype, bias, stable, device
):
    # An eager call takes its layout's plan (`_EagerPlan`: made on the first call, its launches
    # bound then, taken by every later call). Both calls give, bit for bit, what the registered
    # op gives through the dispatcher, forward and backward, with a dense, an expanded (a
    # sum's) and a strided upstream gradient.
    x, w, b = _inputs(shape, dtype, device, bias, param_dtype)
    dense = torch.randn(shape, device=device).to(out_dtype or dtype)
    wide = torch.randn((*shape[:-1], 2 * shape[-1]), device=device).to(out_dtype or dtype)
    for dy in (dense, torch.ones((), device=device).to(dense.dtype).expand(shape), wide[..., ::2]):
        results = []
        for fn in (layernorm, layernorm, _through_registered_op):
            leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
            xl, wl, bl = (*leaves, None)[:3]
            if fn is layernorm:
                y = layernorm(xl, wl, bl, stable=stable, use_triton=True, out_dtype=out_dtype)
            else:
                y = fn(xl, wl, bl, stable, out_dtype)
            y.backward(dy)
            results.append((y, *(t.grad for t in leaves)))
        assert len(ln_mod._EAGER_PLANS.plans) == 1
        for got in results[:2]:
            for a, want in zip(got, results[2], strict=True):
                assert torch.equal(a, want)
        assert results[0][0].dtype == (out_dtype or dtype)


def test_eager_plan_without_autograd_and_with_accumulated_grads(device):
    # No autograd recorded (no_grad, or no input requiring grad): the plan's forward alone.
    # Inside `bmm.accumulate_grads_in_place` its backward adds into the parameters' `.grad`
    # as the generic path does.
    x, w, b = _inputs((33, 40), device=device)
    want = _through_registered_op(x, w, b, False)
    with torch.no_grad():
        assert torch.equal(layernorm(x, w.requires_grad_(), b, use_triton=True), want)
    w.requires_grad_(False)
    y = layernorm(x, w, b, use_triton=True)
    assert torch.equal(y, want) and y.grad_fn is None
    assert len(ln_mod._EAGER_PLANS.plans) == 1

    dys = [torch.randn(33, 40, device=device) for _ in range(3)]
    check_grads_fold_alike(lambda wl, bl: layernorm(x, wl, bl, use_triton=True), [w, b], dys)


def test_eager_plan_keeps_the_checks(device):
    # A plan is taken only by calls of its validated layout: a later call with a parameter of
    # another shape, a non-tensor or an integer input still raises the generic path's error.
    x, w, b = _inputs((8, 16), device=device)
    layernorm(x, w, b, use_triton=True)
    with pytest.raises(ValueError, match="weight must have shape"):
        layernorm(x, w[:8], b, use_triton=True)
    with pytest.raises(TypeError, match="dtype"):
        layernorm(x.to(torch.int32), w, b, use_triton=True)
    with pytest.raises(TypeError, match=r"bias must be a torch\.Tensor"):
        layernorm(x, w, 1.0, use_triton=True)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        layernorm(x.tolist(), w, b, use_triton=True)
    assert len(ln_mod._EAGER_PLANS.plans) == 1


def test_config_lookup_many_rows():
    # 512-wide plain rows from 32K rows on take the many-rows entry; fewer rows, stable
    # LayerNorm and other widths keep the width class's
    entry = ln_mod._LAYERNORM_BWD_MANY_ROWS[512][1]
    shipped = ln_mod._LAYERNORM_BWD_CONFIGS[512]
    assert ln_mod._many_rows(32768, 512, False) and ln_mod._many_rows(131072, 500, False)
    assert not ln_mod._many_rows(32767, 512, False)
    assert not ln_mod._many_rows(131072, 512, True)
    assert not ln_mod._many_rows(131072, 1024, False)
    big = ln_mod.MAX_BLOCK_N
    assert ln_mod._layernorm_bwd_config(512, big, True) == entry
    assert ln_mod._layernorm_bwd_config(512, big, False) == shipped
    assert ln_mod._layernorm_bwd_config(1024, big, True) == ln_mod._LAYERNORM_BWD_CONFIGS[1024]
    # 256-wide plain rows take theirs at any row count; stable ones keep the class's
    entry_256 = ln_mod._LAYERNORM_BWD_MANY_ROWS[256][1]
    assert ln_mod._many_rows(1, 256, False) and ln_mod._many_rows(4096, 200, False)
    assert not ln_mod._many_rows(4096, 256, True)
    assert ln_mod._layernorm_bwd_config(256, big, True) == entry_256
    assert ln_mod._layernorm_bwd_config(256, big, False) == ln_mod._LAYERNORM_BWD_CONFIGS[256]


@pytest.mark.parametrize("M", [1, 7, 50, 4096, 100_003])
@pytest.mark.parametrize("N", [100, 16384, 65536 + 37])
@pytest.mark.parametrize("kind", ["row", "split"])
def test_backward_grid_covers_rows_once(M, N, kind, monkeypatch):
    # Contiguous ranges of whole tiles, none empty, that cover the rows exactly once; "split"
    # programs spread over its column tiles too (at least one range of rows each).
    cfg = BwdConfig(kind, 4, 256, 4, 4)
    for sms in (2, 132):
        monkeypatch.setattr(ln_mod, "_num_sms", lambda _device, n=sms: n)
        col_tiles, groups, rows_per_prog = ln_mod._bwd_plan(M, N, cfg, torch.device("cpu"))
        assert rows_per_prog % cfg.block_m == 0
        assert (groups - 1) * rows_per_prog < M <= groups * rows_per_prog
        assert col_tiles == (ln_mod.cdiv(N, 256) if kind == "split" else 1)
        assert groups <= max(1, cfg.per_sm * sms // col_tiles)


# ----------------------------------------------------------------------------- wide-row paths


@pytest.mark.parametrize("path", WIDE_PATHS)
@pytest.mark.parametrize("N", [37, 100, 257])
@pytest.mark.parametrize(("stable", "bias"), [(False, True), (True, True), (True, False)])
def test_wide_paths_match_fp64(path, N, stable, bias, device, tables):
    # 70 rows: several backward ranges of rows, the last ones partial; N = 37 fits one block,
    # 100 and 257 (odd) take several, the last partial.
    tables(*WIDE_PATHS[path])
    x, w, b = _inputs((70, N), device=device, bias=bias)
    _check(x, w, b, stable=stable)


@pytest.mark.parametrize("path", WIDE_PATHS)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("stable", [False, True])
def test_wide_paths_low_precision(path, dtype, stable, device, tables):
    tables(*WIDE_PATHS[path])
    x, w, b = _inputs((24, 100), dtype=dtype, device=device)
    _check(x, w, b, stable=stable, tol=1e-2)


@pytest.mark.parametrize("path", WIDE_PATHS)
def test_wide_paths_strided_and_nd(path, device, tables):
    tables(*WIDE_PATHS[path])
    # 3-D, and a column slice (row stride 120 != N: passed to the kernels, no copy) ...
    x, w, b = _inputs((2, 9, 100), device=device)
    _check(x, w, b, stable=True)
    wide, w, b = _inputs((9, 120), device=device)
    _check(wide[:, 10:110], w[10:110], b[10:110])
    # ... a permuted 4-D input (last dim strided: copied once) with a strided gradient, and
    # fp32 parameters with bf16 activations (as under autocast).
    base, _, _ = _inputs((3, 100, 2, 5), device=device)
    x = base.permute(0, 2, 3, 1)
    _, w, b = _inputs((100,), device=device)
    dy = torch.randn(3, 2, 100, 5, device=device).transpose(-1, -2)
    _check(x, w, b, dy=dy)
    x, w, b = _inputs((16, 100), dtype=torch.bfloat16, device=device, param_dtype=torch.float32)
    _check(x, w, b, stable=True, tol=1e-2)


@pytest.mark.parametrize("path", WIDE_PATHS)
@pytest.mark.parametrize(("p", "stable"), [(0.0, True), (0.3, False)])
def test_wide_paths_residual(path, p, stable, device, tables):
    # The fused residual (+ dropout) LayerNorm shares these kernels: its downstream gradient
    # of the sum and its masked branch gradient through each path.
    from test_residual_layernorm import _check as check_residual
    from test_residual_layernorm import _inputs as residual_inputs

    tables(*WIDE_PATHS[path])
    h, br, w, b = residual_inputs((10, 100), device=device)
    check_residual(h, br, w, b, p=p, stable=stable)


def _run_cpu_script(code: str) -> subprocess.CompletedProcess:
    """`code` in a subprocess with TRITON_INTERPRET=0 (`helpers.run_without_interpreter`)."""
    return run_without_interpreter("-c", textwrap.dedent(code))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_compile_traces_split_backward_cpu():
    # As test_compile_traces_without_graph_breaks_cpu below, with every width on the "split"
    # backward: its extra launch, 2-D grid and row ranges from a symbolic row count (the
    # script names sm_90 as the target of torch's kernel analysis, which needs one).
    script = Path(__file__).with_name("_compile_trace_check.py")
    proc = _run_cpu_script(f"""
        import importlib, runpy, sys
        ln = importlib.import_module("triton_transformer.layernorm")
        ln._LAYERNORM_BWD_CONFIGS = {{16: ln.{SPLIT!r}}}
        sys.argv = [{str(script)!r}, "layernorm"]
        runpy.run_path({str(script)!r}, run_name="__main__")
    """)
    passed, cases, output = trace_check_result(proc)
    assert passed and cases == 8, output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_kernels_compile_for_sm90_cpu():
    # Every kernel variant the tables and the sweep may pick, compiled for sm_90 as
    # torch.compile launches it (float scalars fp64), bf16: what the interpreter cannot check.
    proc = _run_cpu_script("""
        import importlib
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        ln = importlib.import_module("triton_transformer.layernorm")
        POINTERS = dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16", H="*bf16", BR="*bf16",
                        DY="*bf16", DX="*bf16", DHN="*bf16", DBR="*bf16", Stats="*fp32",
                        Partial="*fp32", RowSums="*fp32", SEED="*i64",
                        DW="*bf16", DB="*bf16")
        FLOATS = {"inv_n", "eps", "clamp", "p", "drop_scale"}

        def compile_sm90(kernel, num_warps, **constants):
            sig = {n: "constexpr" if n in constants else POINTERS.get(n) or
                   ("fp64" if n in FLOATS else "i32") for n in kernel.arg_names}
            names = list(sig)
            src = ASTSource(fn=kernel, signature=sig,
                            constexprs={(names.index(k),): v for k, v in constants.items()})
            triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps))

        io = dict(HAS_BIAS=True, INT64_IDX=False, DROPOUT=True)
        for stable in (False, True):
            for bm, bn, warps, single in ((1, 16384, 16, True), (4, 1024, 4, True),
                                          (1, 4096, 8, False)):
                compile_sm90(ln._layernorm_fwd_kernel, warps, STABLE=stable, SINGLE=single,
                             RESIDUAL=True, BLOCK_M=bm, BLOCK_N=bn, **io)
            for bm, bn, warps, single, prefetch in ((1, 8192, 16, True, False),
                                                    (4, 1024, 4, True, True),
                                                    (1, 4096, 8, False, False)):
                compile_sm90(ln._layernorm_bwd_kernel, warps, STABLE=stable, SINGLE=single,
                             HAS_DHN=True, WRITE_DBR=True, BLOCK_M=bm, BLOCK_N=bn,
                             PREFETCH=prefetch, **io)
            for prefetch in (False, True):
                compile_sm90(ln._layernorm_bwd_cols_kernel, 4, STABLE=stable, HAS_DHN=True,
                             WRITE_DBR=True, BLOCK_M=8, BLOCK_N=256, PREFETCH=prefetch, **io)
            compile_sm90(ln._layernorm_bwd_rowsum_kernel, 8, STABLE=stable, BLOCK_M=1, BLOCK_N=4096)
        compile_sm90(ln._layernorm_bwd_colsum_kernel, 8, HAS_BIAS=True, BLOCK_G=256, BLOCK_C=32)
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_compile_traces_without_graph_breaks_cpu():
    # Dynamo (fullgraph: a graph break fails) and AOTAutograd's joint forward+backward trace of
    # the Triton paths of layernorm and residual_layernorm, static and dynamic shapes, on CPU:
    # a subprocess with TRITON_INTERPRET=0, so the kernels are JITFunctions torch.library can
    # trace. No kernel runs.
    passed, cases, output = compile_trace_check("layernorm")
    assert passed and cases == 8, output


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
