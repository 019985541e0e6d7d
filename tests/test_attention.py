"""attention (bmm -> softmax -> dropout -> bmm): Triton path against a float64 reference.

The reference is the same function with use_triton=False on float64 copies of the inputs.
"""

import math

import pytest
import torch

from triton_transformer.attention import attention

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# dq and dk pass through the softmax backward, y * (dy - sum(dy * y)), where dy = dO v^T has a
# large common part (v is not centred at zero) that cancels: in bf16 even the PyTorch branch
# is ~2e-2 off float64 here, and the interpreter, which truncates fp32 -> bf16 instead of
# rounding to nearest, roughly triples that. A real bug (a missing scale, a wrong mask) is O(1).
TOL_DQK = {**TOL, torch.bfloat16: 1e-1}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_qkv(b, h, n_q, n_k, d, dtype, device):
    # Not centred at zero; q/k spread enough that the softmax is far from uniform.
    q = (0.3 + 1.0 * torch.randn(b, h, n_q, d, device=device)).to(dtype)
    k = (-0.2 + 1.0 * torch.randn(b, h, n_k, d, device=device)).to(dtype)
    v = (-2.3 + 0.5 * torch.randn(b, h, n_k, d, device=device)).to(dtype)
    return q, k, v


def naive_attention(q, k, v, causal=False, key_padding_mask=None):
    """Textbook attention, written independently of the package, for rows that see a key."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril(n_k - n_q)  # query i sees keys j <= i + n_k - n_q
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    return scores.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ v


def check_attention(q, k, v, dtype, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, use_triton=True, **kwargs)
    grad = (0.7 + torch.randn(out.shape, device=out.device)).to(dtype)
    out.backward(grad)

    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention(*ref_inputs, use_triton=False, **kwargs)
    ref.backward(grad.double())
    naive = naive_attention(*ref_inputs, **kwargs)
    seen = torch.isfinite(naive)  # rows that see no key are NaN here
    assert torch.allclose(ref[seen], naive[seen], rtol=1e-10, atol=1e-10)

    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(q.grad, ref_inputs[0].grad) < TOL_DQK[dtype]
    assert rel_err(k.grad, ref_inputs[1].grad) < TOL_DQK[dtype]
    assert rel_err(v.grad, ref_inputs[2].grad) < TOL[dtype]
    return out


def padding_mask(b, n_k, device):
    # Row 0 keeps its first 9 keys (ragged), row 1 is entirely padding.
    mask = torch.zeros(b, n_k, dtype=torch.bool, device=device)
    mask[0, :9] = True
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_square(causal, dtype, device):
    check_attention(*make_qkv(2, 2, 37, 37, 16, dtype, device), dtype, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q", [1, 5])
def test_attention_causal_kv_cache_step(n_q, dtype, device):
    # n_q < n_k: the queries are the last n_q positions (bottom-right aligned causal mask).
    q, k, v = make_qkv(2, 2, n_q, 37, 16, dtype, device)
    out = check_attention(q, k, v, dtype, causal=True)
    # The last query sees every key, so it matches a non-causal step on that query alone.
    full = attention(q[:, :, -1:], k, v, causal=False, use_triton=True)
    assert rel_err(out[:, :, -1:], full) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_key_padding_mask(causal, dtype, device):
    q, k, v = make_qkv(2, 2, 21, 21, 16, dtype, device)
    mask = padding_mask(2, 21, device)
    out = check_attention(q, k, v, dtype, causal=causal, key_padding_mask=mask)
    if not causal:
        # Padded keys carry no weight: dropping them from k and v changes nothing.
        short = attention(q[:1], k[:1, :, :9], v[:1, :, :9], use_triton=True)
        assert rel_err(out[:1], short) < TOL[dtype]
        # A fully padded row falls back to uniform weights over the keys (finite, no NaN).
        assert rel_err(out[1], v[1].double().mean(dim=-2, keepdim=True).expand_as(out[1])) < 1e-2


def test_attention_transposed_inputs_and_head_dims(device):
    # q/k/v as (b, n, h, d) tensors viewed as (b, h, n, d), as a model's split of heads gives.
    q = (0.3 + torch.randn(2, 19, 3, 24, device=device)).transpose(1, 2)
    k = (-0.2 + torch.randn(2, 23, 3, 24, device=device)).transpose(1, 2)
    v = (-2.3 + 0.5 * torch.randn(2, 23, 3, 24, device=device)).transpose(1, 2)
    check_attention(q, k, v, torch.float32, causal=True)


def test_attention_dropout(device):
    # Uniform attention (q = 0) over ones-valued v: each output is (#kept keys) / (n_k (1 - p)).
    b, h, n_q, n_k, d, p = 2, 2, 32, 64, 16, 0.25
    q = torch.zeros(b, h, n_q, d, device=device)
    k = torch.randn(b, h, n_k, d, device=device)
    v = torch.ones(b, h, n_k, d, device=device)
    out = attention(q, k, v, dropout_p=p, use_triton=True)
    assert out.shape == (b, h, n_q, d)
    kept = out * n_k * (1 - p)
    assert torch.allclose(kept, kept.round(), atol=1e-3)  # whole numbers of kept keys
    assert abs(out.mean().item() - 1.0) < 0.05  # E[mask / (1 - p)] = 1
    assert (kept.round() < n_k).any()  # something was dropped

    # Deterministic under a seed; identity when not training.
    torch.manual_seed(1)
    a = attention(q, k, v, dropout_p=p, use_triton=True)
    torch.manual_seed(1)
    assert torch.equal(a, attention(q, k, v, dropout_p=p, use_triton=True))
    assert torch.equal(
        attention(q, k, v, dropout_p=p, training=False, use_triton=True),
        attention(q, k, v, use_triton=True),
    )


def test_attention_dropout_backward_is_finite(device):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 9, 9, 16, torch.float32, device))
    attention(q, k, v, causal=True, dropout_p=0.5, use_triton=True).sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and torch.isfinite(t.grad).all()


def test_attention_bad_inputs(device):
    q, k, v = make_qkv(2, 2, 5, 7, 16, torch.float32, device)
    with pytest.raises(ValueError, match="q must be 4-D"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="head dim"):
        attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match="n_k"):
        attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match=r"same \(b, h\)"):
        attention(q, k[:1], v[:1])
    with pytest.raises(TypeError, match="one dtype"):
        attention(q, k.half(), v)
    with pytest.raises(TypeError, match="bool"):
        attention(q, k, v, key_padding_mask=torch.ones(2, 7, device=device))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        attention(q, k, v, key_padding_mask=torch.ones(2, 5, dtype=torch.bool, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_gpu(causal, dtype, device):
    q, k, v = make_qkv(4, 8, 512, 512, 64, dtype, device)
    check_attention(q, k, v, dtype, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_gpu_kv_cache_and_padding(dtype, device):
    q, k, v = make_qkv(4, 8, 16, 1000, 64, dtype, device)
    mask = torch.rand(4, 1000, device=device) > 0.2
    check_attention(q, k, v, dtype, causal=True, key_padding_mask=mask)
