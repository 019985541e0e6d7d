"""Softmax: Triton kernels (forward and backward) against the float64 PyTorch reference.

On a machine without CUDA the kernels run in Triton's CPU interpreter, so the shapes here
are small; the `gpu`-marked tests at the end use realistic shapes.
"""

import importlib

import pytest
import torch
from helpers import check_launches_bound_per_shape

import triton_transformer.utils as utils_mod
from triton_transformer.softmax import softmax

# The package re-exports the function `softmax`, which shadows the submodule as an attribute,
# so `import triton_transformer.softmax as m` would give the function: fetch the module itself.
softmax_mod = importlib.import_module("triton_transformer.softmax")

LOW_PRECISION = (torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def scores(shape, device, dtype=torch.float32, scale=0.5, transposed=False):
    """Fresh random inputs, neither zero nor centred at zero; optionally a transposed view."""
    if transposed:
        shape = (*shape[:-2], shape[-1], shape[-2])
    x = -2.3 + scale * torch.randn(shape, device=device, dtype=torch.float64)
    x = x.to(dtype)
    return x.transpose(-1, -2) if transposed else x


def assert_matches(out, ref, tol):
    """Norm-wise and elementwise closeness to the float64 reference; NaN never passes."""
    assert out.shape == ref.shape
    out = out.double()
    assert not out.isnan().any()
    # exact zeros are required where the reference is all zeros (fully masked rows)
    assert (out - ref).norm() <= tol * ref.norm()
    # elementwise: 2x slack on the absolute part, for the cancellation in dy - sum(dy * y)
    # when y and dx are rounded to bf16
    torch.testing.assert_close(out, ref, rtol=tol, atol=2 * tol * ref.abs().max().item())


def causal_mask(n_q, n_k, device):
    """True where key j is hidden from query i: j > i + (n_k - n_q), built with plain loops."""
    mask = torch.zeros(n_q, n_k, dtype=torch.bool)
    for i in range(n_q):
        for j in range(n_k):
            mask[i, j] = j > i + (n_k - n_q)
    return mask.to(device)


def run_both(x, causal, dy=None):
    """Triton output and dx for x, and the float64 reference's output and dx."""
    x = x.detach().requires_grad_()
    y = softmax(x, causal=causal, use_triton=True)
    x64 = x.detach().double().requires_grad_()
    y64 = softmax(x64, causal=causal)
    if dy is None:
        dy = (-1.1 + torch.randn(y.shape, device=x.device, dtype=torch.float64)).to(x.dtype)
    y.backward(dy)
    y64.backward(dy.double())
    return y, x.grad, y64, x64.grad


@pytest.fixture(params=["single", "looped"])
def path(request, monkeypatch):
    """'looped' shrinks the block so rows longer than 16 take the online max/sum path."""
    if request.param == "looped":
        monkeypatch.setattr(softmax_mod, "MAX_BLOCK_N", 16)
    return request.param


def assert_path(n_cols, path):
    single = softmax_mod._softmax_config((n_cols,), causal=False)[4]
    assert single == (path == "single" or n_cols <= 16)


# --------------------------------------------------------------------------------------------
# Reference semantics
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_q,n_k", [(6, 6), (3, 7), (1, 5)])
def test_reference_matches_torch_softmax(device, n_q, n_k):
    x = scores((2, n_q, n_k), device, torch.float64)
    torch.testing.assert_close(softmax(x), torch.softmax(x, dim=-1))
    masked = x.masked_fill(causal_mask(n_q, n_k, device), float("-inf"))
    y = softmax(x, causal=True)
    torch.testing.assert_close(y, torch.softmax(masked, dim=-1))
    assert (y[..., causal_mask(n_q, n_k, device)] == 0).all()


def test_reference_rows_that_see_nothing_are_zero(device):
    # n_q > n_k: query i sees j <= i - 2, so the first two rows see no key at all.
    x = scores((3, 5, 3), device, torch.float64).requires_grad_()
    y = softmax(x, causal=True)
    assert (y[:, :2] == 0).all()
    torch.testing.assert_close(y[:, 2:].sum(-1), torch.ones(3, 3, device=device, dtype=y.dtype))
    y.backward(torch.randn_like(y))
    assert (x.grad[:, :2] == 0).all() and x.grad.isfinite().all()


# --------------------------------------------------------------------------------------------
# Triton vs reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_cols", [1, 5, 16, 37, 100])
def test_2d(device, path, n_cols):
    assert_path(n_cols, path)
    y, dx, y64, dx64 = run_both(scores((19, n_cols), device), causal=False)
    assert_matches(y, y64, 1e-5)
    assert_matches(dx, dx64, 1e-5)


@pytest.mark.parametrize(
    "shape",
    [
        (2, 9, 9),  # square
        (2, 3, 37),  # cached prefix: n_q < n_k
        (2, 3, 1, 37),  # decode step: one query
        (1, 3, 7, 7),
        (2, 2, 5, 23),
        (2, 9, 5),  # n_q > n_k: the first 4 rows see nothing
        (3, 1, 1),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_3d_4d_causal(device, path, shape, causal):
    y, dx, y64, dx64 = run_both(scores(shape, device), causal=causal)
    assert_matches(y, y64, 1e-5)
    assert_matches(dx, dx64, 1e-5)
    if causal:
        mask = causal_mask(*shape[-2:], device)
        assert (y[..., mask] == 0).all() and (dx[..., mask] == 0).all()
        assert y.sum(-1)[..., : max(0, shape[-2] - shape[-1])].eq(0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(7, 23), (2, 6, 37)])
def test_non_contiguous(device, path, shape, causal):
    """Transposed input, and a row-stride-0 (broadcast) upstream gradient."""
    x = scores(shape, device, transposed=True)
    assert not x.is_contiguous()
    dy = torch.randn(shape[-1], device=device).expand(shape)
    y, dx, y64, dx64 = run_both(x, causal=causal, dy=dy)
    assert_matches(y, y64, 1e-5)
    assert_matches(dx, dx64, 1e-5)


def test_sliced_rows(device, path):
    """Rows whose stride exceeds their length (a column slice) are read in place."""
    x = scores((6, 40), device)[:, 3:30]
    y, dx, y64, dx64 = run_both(x, causal=False)
    assert_matches(y, y64, 1e-5)
    assert_matches(dx, dx64, 1e-5)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 1), (2, 7, 7), (2, 5, 37)])
def test_low_precision(device, path, dtype, causal, shape):
    y, dx, y64, dx64 = run_both(scores(shape, device, dtype), causal=causal)
    assert y.dtype == dtype and dx.dtype == dtype
    assert_matches(y, y64, TOL[dtype])
    assert_matches(dx, dx64, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("causal", [False, True])
def test_neg_inf_inputs(device, path, dtype, causal):
    """-inf entries get probability 0; all -inf rows give zeros, never NaN, in both branches."""
    x = scores((2, 6, 37), device, dtype)
    x[torch.rand(x.shape, device=device) < 0.3] = float("-inf")
    x[0, 1] = float("-inf")  # a fully -inf row
    x[1, 4, -5:] = float("-inf")  # -inf exactly where the causal diagonal ends
    y, dx, y64, dx64 = run_both(x, causal=causal)
    assert_matches(y, y64, TOL[dtype])
    assert_matches(dx, dx64, TOL[dtype])
    assert (y[x == float("-inf")] == 0).all() and (dx[x == float("-inf")] == 0).all()
    assert (y[0, 1] == 0).all() and (dx[0, 1] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_large_magnitude(device, path, causal):
    """1e4-scale scores: the max shift must keep exp() from overflowing."""
    x = scores((3, 5, 37), device, scale=1e4)
    x[0, 0, :8] = 3e4  # ties at a large value
    y, dx, y64, dx64 = run_both(x, causal=causal)
    assert_matches(y, y64, 1e-5)
    assert_matches(dx, dx64, 1e-5)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy inf - inf
@pytest.mark.parametrize("use_triton", [False, True])
def test_nan_and_pos_inf_rows_are_nan(device, path, use_triton):
    """As torch.softmax: a NaN or +inf entry makes its whole row NaN; other rows unaffected."""
    x = scores((4, 37), device)
    x[1, 7] = float("nan")
    x[2, 30] = float("inf")
    y = softmax(x, use_triton=use_triton)
    assert y[1:3].isnan().all()
    assert torch.softmax(x, dim=-1)[1:3].isnan().all()
    assert_matches(y[[0, 3]], softmax(x.double())[[0, 3]], 1e-5)


# --------------------------------------------------------------------------------------------
# Validation and edge cases
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize(
    "shape,causal", [((0, 5), False), ((3, 0), False), ((2, 0, 4), True), ((2, 3, 0), True)]
)
def test_zero_size(device, use_triton, shape, causal):
    x = torch.randn(shape, device=device, requires_grad=True)
    y = softmax(x, causal=causal, use_triton=use_triton)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("use_triton", [False, True])
def test_bad_shapes(device, use_triton):
    with pytest.raises(ValueError, match="causal"):
        softmax(torch.randn(5, device=device), causal=True, use_triton=use_triton)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        softmax(torch.tensor(1.0, device=device), use_triton=use_triton)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        softmax([1.0, 2.0], use_triton=use_triton)


def test_bad_dtype(device):
    for dtype in (torch.float64, torch.int64):
        with pytest.raises(TypeError, match="dtype"):
            softmax(torch.ones(3, 4, device=device, dtype=dtype), use_triton=True)


def test_cpu_tensor_without_interpreter(monkeypatch):
    monkeypatch.setattr(utils_mod, "interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        softmax(torch.randn(3, 4), use_triton=True)


# --------------------------------------------------------------------------------------------
# Realistic shapes on a GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("n_cols", [512, 1000, 2048, 3001, 4096, 8192, 12289, 16384, 20000, 65536])
def test_gpu_rows(device, dtype, n_cols):
    n_rows = 4096 if n_cols <= 16384 else 512
    y, dx, y64, dx64 = run_both(scores((n_rows, n_cols), device, dtype, scale=2.0), causal=False)
    assert_matches(y, y64, TOL[dtype])
    assert_matches(dx, dx64, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize(
    "shape",
    [
        (4, 8, 1024, 1024),  # causal self-attention
        (2, 12, 777, 777),
        (2, 8, 256, 2048),  # chunked prefill over a cached prefix
        (8, 16, 1, 4096),  # decode step
        (2, 4, 1, 40000),  # decode step with a long cache: looped path
        (2, 4, 300, 200),  # n_q > n_k
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_attention_shapes(device, dtype, shape, causal):
    y, dx, y64, dx64 = run_both(scores(shape, device, dtype, scale=3.0), causal=causal)
    assert_matches(y, y64, TOL[dtype])
    assert_matches(dx, dx64, TOL[dtype])
    if causal:
        mask = torch.ones(shape[-2:], device=device, dtype=torch.bool)
        mask = mask.triu(shape[-1] - shape[-2] + 1)
        assert (y[..., mask] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_gpu_transposed_and_neg_inf(device, dtype):
    x = scores((4, 8, 512, 700), device, dtype, transposed=True)
    x[..., 100:300] = float("-inf")
    x[0, 0, 5] = float("-inf")
    y, dx, y64, dx64 = run_both(x, causal=True)
    assert_matches(y, y64, TOL[dtype])
    assert_matches(dx, dx64, TOL[dtype])


# --------------------------------------------------------------------------------------------
# torch.library registration, double backward, capture and compile
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_registered_custom_ops(device, causal):
    # Schema and autograd registration; on a GPU also fake tensors and AOT tracing (the
    # interpreter cannot run kernels on fake tensors).
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    x = scores((2, 5, 7), device).requires_grad_()
    torch.library.opcheck(softmax_mod.softmax_op, (x, causal), test_utils=tests)
    y = softmax_mod.softmax_op(x.detach(), causal)
    dy = torch.randn(7, device=device).expand(2, 5, 7)  # broadcast: read in place
    torch.library.opcheck(softmax_mod.softmax_backward_op, (dy, y, causal), test_utils=tests)


@pytest.mark.parametrize("causal", [False, True])
def test_double_backward_raises(causal, device, assert_first_order_only):
    x = scores((4, 9), device).requires_grad_()
    assert_first_order_only(lambda x: softmax(x, causal, use_triton=True), x, "softmax")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cuda_graph_capture(device, causal):
    x = scores((4, 8, 256, 256), device, torch.bfloat16).requires_grad_()
    dy = scores(x.shape, device, torch.bfloat16)

    from triton_transformer.cuda_graph import capture_graph

    def step():
        y = softmax(x, causal=causal, use_triton=True)
        y.backward(dy)
        return y

    graph, y = capture_graph(step, clear_grads=(x,))
    for _ in range(2):
        x.data.copy_(scores(x.shape, device, torch.bfloat16, scale=2.0))
        graph.replay()
        torch.cuda.synchronize()
        x64 = x.detach().double().requires_grad_()
        y64 = softmax(x64, causal=causal)
        y64.backward(dy.double())
        assert_matches(y, y64, TOL[torch.bfloat16])
        assert_matches(x.grad, x64.grad, TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_compiles_without_graph_breaks(device, causal):
    def f(x):
        return (softmax(x.sin(), causal=causal, use_triton=True) * x).sum()

    x = scores((2, 4, 64, 64), device).requires_grad_()
    explanation = torch._dynamo.explain(f)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    out = torch.compile(f)(x)
    out.backward()
    x64 = x.detach().double().requires_grad_()
    ref = (softmax(x64.sin(), causal=causal) * x64).sum()
    ref.backward()
    assert abs(out.item() - ref.item()) <= 1e-5 * ref.abs().item()
    assert_matches(x.grad, x64.grad, 1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_eager_launches_bound_per_shape(causal, device):
    # an eager call's first launch of a shape binds the forward's and the backward's launch
    # (`_PLANS`); later calls of that shape take them (`helpers.check_launches_bound_per_shape`).
    # Another dtype or layout binds its own.
    x = scores((2, 3, 9, 40), device)
    dy = torch.randn_like(x)

    def run(x):
        leaf = x.detach().requires_grad_()
        y = softmax(leaf, causal=causal, use_triton=True)
        y.backward(dy.to(y.dtype))
        return y, leaf.grad

    padded = torch.empty(2, 3, 9, 48, device=device)[..., :40]  # row stride 48
    # the padded rows' backward reads the new, dense y: its plan holds
    check_launches_bound_per_shape(softmax_mod._PLANS.plans, run, x, padded, 5)
