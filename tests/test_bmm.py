"""bmm and linear: Triton kernels (forward and backward) against a float64 PyTorch reference.

On the CPU the kernels run in Triton's interpreter with 32-wide tiles, so sizes in the tens
(37, 45, 29) already cover ragged edges in M, N and K, and K > BLOCK_K (the K loop).
"""

import pytest
import torch

import triton_transformer.bmm as bmm_module
from triton_transformer.bmm import bmm, linear

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Norm-wise relative error allowed against float64 (fp32 uses ieee products, not tf32).
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere fails every comparison."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


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
    seen = []
    real = bmm_module._matmul

    def spy(a, b, c, *args, **kwargs):
        seen.append((a.data_ptr(), b.data_ptr()))
        return real(a, b, c, *args, **kwargs)

    monkeypatch.setattr(bmm_module, "_matmul", spy)
    q = rand((2, 2, 9, 16), torch.float32, device).requires_grad_()
    k = rand((2, 2, 11, 16), torch.float32, device).requires_grad_()
    bmm(q, k.transpose(-1, -2), use_triton=True).sum().backward()
    assert seen[0] == (q.data_ptr(), k.data_ptr())  # forward
    assert len(seen) == 3  # plus dA and dB, each one launch
    assert seen[1][1] == k.data_ptr() and seen[2][0] == q.data_ptr()  # B^T and A^T in place


def test_bmm_expanded_grad_and_batch_chunks(device, monkeypatch):
    # sum() hands backward a stride-0 gradient; a tiny grid-batch cap forces several launches.
    monkeypatch.setattr(bmm_module, "_MAX_GRID_BATCH", 2)
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


def test_bmm_is_deterministic(device):
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
                bm, bn, bk, group, warps, stages = bmm_module._matmul_config(
                    *shape, dtype, interpret
                )
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
