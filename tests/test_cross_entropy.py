"""cross_entropy: the Triton kernels (forward and backward) against a float64 reference.

The reference is the PyTorch branch run on float64 copies of the same inputs; the PyTorch
branch itself is checked against `F.cross_entropy` in float64.
"""

import pytest
import torch
import torch.nn.functional as F

from triton_transformer.cross_entropy import BWD_MAX_BLOCK, FWD_MAX_BLOCK, cross_entropy

BIG = max(FWD_MAX_BLOCK, BWD_MAX_BLOCK)  # rows this long loop in both kernels

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LOSS_TOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def make_logits(shape, dtype=torch.float32, device="cpu"):
    # Off-centre and spread out, so the softmax is neither uniform nor one-hot.
    return (-2.3 + 1.5 * torch.randn(shape, device=device, dtype=torch.float64)).to(dtype)


def make_labels(shape, V, ignore_index=None, device="cpu"):
    labels = torch.randint(V, shape, device=device)
    if ignore_index is not None and labels.numel() > 1:
        flat = labels.view(-1)
        drop = torch.rand(flat.shape, device=device) < 0.3
        drop[0], drop[-1] = True, False  # at least one ignored, at least one kept
        flat[drop] = ignore_index
    return labels


def rel_err(out, ref):
    """Norm-wise relative error in float64; NaN anywhere makes it NaN (so checks fail)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def run(logits, labels, ignore_index, use_triton, dloss=1.7):
    """Loss and d(dloss * loss)/d(logits); dloss != 1 checks the upstream-gradient scaling."""
    x = logits.detach().requires_grad_()  # keeps the strides (clone might not)
    loss = cross_entropy(x, labels, ignore_index=ignore_index, use_triton=use_triton)
    loss.backward(torch.tensor(dloss, dtype=loss.dtype, device=loss.device))
    return loss.detach(), x.grad


def check_against_reference(logits, labels, ignore_index=None):
    dtype = logits.dtype
    loss, grad = run(logits, labels, ignore_index, use_triton=True)
    ref_loss, ref_grad = run(logits.double(), labels, ignore_index, use_triton=False)
    assert loss.shape == () and loss.dtype == torch.float32
    assert grad.shape == logits.shape and grad.dtype == dtype
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert abs(loss.item() - ref_loss.item()) <= LOSS_TOL[dtype] * max(abs(ref_loss.item()), 1)
    if ref_grad.abs().max() == 0:  # V == 1: the gradient is exactly zero
        assert (grad == 0).all()
    else:
        assert rel_err(grad, ref_grad) <= TOL[dtype]


SHAPES = [
    (5, 1),  # V == 1: loss 0, gradient 0
    (1, 37),  # a single row
    (7, 37),  # V not a power of two
    (3, FWD_MAX_BLOCK),  # exactly one full forward block
    (2, BWD_MAX_BLOCK),  # exactly one full backward block, full forward blocks only
    (3, 2 * BIG + 808),  # looped paths with a partial last block
    (2, 3, 37),  # 3-D
    (2, 2, 3, 37),  # 4-D
    (37,),  # 1-D logits, 0-d label
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ignore_index", [None, -100])
def test_matches_reference_fp32(shape, ignore_index, device):
    logits = make_logits(shape, device=device)
    labels = make_labels(shape[:-1], shape[-1], ignore_index, device)
    check_against_reference(logits, labels, ignore_index)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(7, 37), (3, 2 * BIG + 808)], ids=str)
def test_matches_reference_half(shape, dtype, device):
    logits = make_logits(shape, dtype, device)
    labels = make_labels(shape[:-1], shape[-1], -100, device)
    check_against_reference(logits, labels, -100)


def test_ignore_index_inside_vocabulary(device):
    # A real class id (e.g. a pad token 0) can be the ignored label.
    logits = make_logits((9, 37), device=device)
    labels = make_labels((9,), 37, device=device)
    labels[::3] = 0
    check_against_reference(logits, labels, ignore_index=0)


def test_transposed_logits(device):
    # Last dim not unit-stride: the wrapper makes a contiguous copy.
    logits = make_logits((37, 6), device=device).t()
    labels = make_labels((6,), 37, -100, device)
    check_against_reference(logits, labels, -100)


def test_strided_rows_and_labels(device):
    # The language-model case: logits[:, :-1] and labels[:, 1:] are views with gaps.
    logits = make_logits((2, 5, 37), device=device)[:, :-1]
    labels = make_labels((2, 5), 37, -100, device)[:, 1:]
    check_against_reference(logits, labels, -100)
    # Rows with a stride larger than V and strided labels: both reach the kernels uncopied.
    wide = make_logits((6, 50), device=device)[:, :37]
    labels = make_labels((6, 2), 37, -100, device)[:, 1]
    assert wide.stride() == (50, 1) and labels.stride() == (2,)
    check_against_reference(wide, labels, -100)


def test_minus_inf_logits(device):
    # Masked-out classes: a whole first block of -inf exercises the online max guard.
    n_inf = FWD_MAX_BLOCK + 10
    V = n_inf + 300
    logits = make_logits((3, V), device=device)
    logits[:, :n_inf] = float("-inf")
    labels = torch.randint(n_inf, V, (3,), device=device)
    loss, grad = run(logits, labels, None, use_triton=True)
    ref_loss, ref_grad = run(logits.double(), labels, None, use_triton=False)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert (grad[:, :n_inf] == 0).all()
    assert rel_err(grad, ref_grad) <= 1e-5


@pytest.mark.parametrize("use_triton", [False, True])
def test_all_ignored_gives_zero(use_triton, device):
    logits = make_logits((4, 37), device=device)
    labels = torch.full((4,), -100, device=device)
    loss, grad = run(logits, labels, -100, use_triton)
    assert loss.item() == 0.0
    assert grad.shape == logits.shape and (grad == 0).all()


@pytest.mark.parametrize("use_triton", [False, True])
def test_empty_input(use_triton, device):
    logits = make_logits((0, 37), device=device)
    labels = torch.zeros(0, dtype=torch.long, device=device)
    loss, grad = run(logits, labels, None, use_triton)
    assert loss.item() == 0.0 and grad.shape == (0, 37)


@pytest.mark.parametrize("ignore_index", [None, -100, 3])
def test_reference_matches_torch(ignore_index, device):
    # The PyTorch branch is F.cross_entropy (mean over kept positions) when that is defined.
    logits = make_logits((2, 5, 37), torch.float64, device)
    labels = make_labels((2, 5), 37, ignore_index, device)
    ours, grad = run(logits, labels, ignore_index, use_triton=False)
    x = logits.clone().requires_grad_()
    kwargs = {} if ignore_index is None else {"ignore_index": ignore_index}
    ref = F.cross_entropy(x.view(-1, 37), labels.view(-1), **kwargs)
    (1.7 * ref).backward()
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-15)


def test_deterministic(device):
    logits = make_logits((5, BIG + 100), device=device)
    labels = make_labels((5,), BIG + 100, -100, device)
    a, b = run(logits, labels, -100, True), run(logits, labels, -100, True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("use_triton", [False, True])
def test_bad_arguments(use_triton, device):
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    ce = lambda *a, **k: cross_entropy(*a, use_triton=use_triton, **k)
    with pytest.raises(ValueError, match="labels shape"):
        ce(logits, labels[:3])
    with pytest.raises(ValueError, match="labels shape"):
        ce(logits, labels[None])
    with pytest.raises(TypeError, match="int64"):
        ce(logits, labels.int())
    with pytest.raises(TypeError, match="int64"):
        ce(logits, labels.float())
    with pytest.raises(TypeError, match="floating"):
        ce(labels[:, None].expand(4, 37), labels)
    with pytest.raises(TypeError, match="ignore_index"):
        ce(logits, labels, ignore_index=1.5)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        ce(logits.tolist(), labels)
    with pytest.raises(ValueError, match="V == 0"):
        ce(logits[:, :0], labels)


@pytest.mark.parametrize("bad", [37, -1, -100])
def test_out_of_range_label_reference_raises(bad, device):
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    labels[2] = bad
    with pytest.raises(ValueError, match=f"found label {bad}"):
        cross_entropy(logits, labels)
    # Not ignored because ignore_index names another value.
    with pytest.raises(ValueError, match="ignore_index=-5"):
        cross_entropy(logits, labels, ignore_index=-5)


@pytest.mark.parametrize("bad", [37, -1])
def test_out_of_range_label_triton(bad, device):
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    labels[2] = bad
    labels[0] = -100  # ignored, so not an error
    # Fast path: no host sync; the bad row makes the loss (and its gradient row) NaN.
    loss, grad = run(logits, labels, -100, use_triton=True)
    assert torch.isnan(loss)
    assert torch.isnan(grad[2]).all() and torch.isfinite(grad[[0, 1, 3]]).all()
    # Debug path: anomaly detection turns on the host check.
    with torch.autograd.set_detect_anomaly(True), pytest.raises(ValueError, match="found label"):
        cross_entropy(logits, labels, ignore_index=-100, use_triton=True)


def test_triton_rejects_float64(device):
    logits = make_logits((4, 37), torch.float64, device)
    with pytest.raises(TypeError, match="dtype"):
        cross_entropy(logits, make_labels((4,), 37, device=device), use_triton=True)


# ---- realistic shapes on a GPU ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(8192, 256), (4096, 50257)], ids=str)
def test_gpu_realistic(shape, dtype, device):
    logits = make_logits(shape, dtype, device)
    labels = make_labels(shape[:-1], shape[-1], -100, device)
    check_against_reference(logits, labels, -100)


@pytest.mark.gpu
def test_gpu_lm_batch_3d(device):
    # (batch, seq, vocab) bf16 logits shifted by one position, as in next-token training.
    logits = make_logits((8, 1025, 50257), torch.bfloat16, device)[:, :-1]
    labels = make_labels((8, 1025), 50257, -100, device)[:, 1:]
    check_against_reference(logits, labels, -100)
