"""Grouped-query and multi-query attention (`kv_heads`): k and v with h_kv heads, each shared
by h / h_kv query heads (query head h reads key/value head h // group).

The fused kernels, forward and backward (dK, dV summed over each group inside the kernel),
against float64 attention over k and v repeated to q's heads; the cached decode; the PyTorch
branches; and `Transformer(kv_heads=...)`: parameters, training with both branches agreeing,
the KV-cache decode, state dicts. On CPU the kernels run in Triton's interpreter (tiny shapes);
`gpu` tests repeat the checks at real shapes.
"""

import pytest
import torch
from _modern_helpers import (
    LLAMA,
    check_graphed_decode,
    check_greedy_cached_generation,
    check_state_dict_round_trip,
    decode_in_steps,
    train_both_branches,
)
from helpers import deterministic_algorithms
from test_attention import (
    TOL,
    TOL_DQK,
    check_backward_kernels_agree,
    check_cached_over,
    dropout_mask,
    make_qkv,
    ref_attention,
    rel_err,
)

from triton_transformer.attention import attention, attention_cached, attention_naive
from triton_transformer.transformer import KVCache, StaticKVCache, Transformer


def make_gqa(b, h, h_kv, n_q, n_k, d, dtype, device):
    """q with h heads; k, v with h_kv (off-centre values, as `make_qkv`)."""
    q = make_qkv(b, h, n_q, n_k, d, dtype, device)[0]
    _, k, v = make_qkv(b, h_kv, n_q, n_k, d, dtype, device)
    return q, k, v


def expand(t: torch.Tensor, h: int) -> torch.Tensor:
    """k or v repeated to h heads: head i of the result is head i // group."""
    return t.repeat_interleave(h // t.shape[1], dim=1)


def check_gqa(q, k, v, deterministic=False, keep=None, p=0.0, seed=None, **kwargs):
    """The Triton forward and dq, dk, dv against float64 attention over k, v repeated to q's
    heads (whose gradients autograd sums over each group); the PyTorch branch as well.
    Returns the three Triton gradients."""
    dtype, h = q.dtype, q.shape[1]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if seed is not None:
        torch.manual_seed(seed)
    with deterministic_algorithms(deterministic):
        out = attention(q, k, v, use_triton=True, dropout_p=p, **kwargs)
        assert out.shape == q.shape and out.dtype == dtype
        dout = (0.7 + torch.randn(out.shape, device=out.device)).to(dtype)
        out.backward(dout)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_attention(r[0], expand(r[1], h), expand(r[2], h), keep=keep, p=p, **kwargs)
    ref.backward(dout.double())
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    for name, t, rt in zip("qkv", (q, k, v), r, strict=True):
        assert t.grad.shape == t.shape and t.grad.dtype == dtype, name
        tol = TOL[dtype] if name == "v" else TOL_DQK[dtype]
        assert rel_err(t.grad, rt.grad, floor=0.1) < tol, (name, rel_err(t.grad, rt.grad, 0.1))
    if p == 0.0:  # the PyTorch branch, in float64: the same function and gradients
        t64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        torch_out = attention(*t64, **kwargs)
        torch_out.backward(dout.double())
        assert rel_err(torch_out, ref) < 1e-12
        for t, rt in zip(t64, r, strict=True):
            assert rel_err(t.grad, rt.grad, floor=0.1) < 1e-12
    return [t.grad for t in (q, k, v)]


# (h, h_kv): group sizes 1, 2, 4 and multi-query
GROUPS = [(4, 4), (4, 2), (8, 2), (4, 1)]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h, h_kv", GROUPS)
def test_forward_backward(h, h_kv, causal, deterministic, device):
    # 37 keys: two key blocks of the interpreter's 32, so with 4 query heads per key/value
    # head two of each group's grid rows hold spare key-block programs
    q, k, v = make_gqa(1, h, h_kv, 37, 37, 16, torch.float32, device)
    check_gqa(q, k, v, deterministic=deterministic, causal=causal)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_rectangular_and_many_key_blocks(deterministic, device):
    # 100 keys = 4 key blocks dealt round 2 query heads' rows (2 each); bottom-right causal
    # with n_q < n_k and n_q > n_k (rows that see no key: zeros, no gradient)
    for n_q, n_k in ((45, 100), (21, 13)):
        q, k, v = make_gqa(1, 4, 2, n_q, n_k, 32, torch.float32, device)
        check_gqa(q, k, v, deterministic=deterministic, causal=True)
    check_gqa(*make_gqa(1, 6, 2, 19, 100, 16, torch.float32, device), deterministic=deterministic)


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask(causal, device):
    b, n = 3, 37
    q, k, v = make_gqa(b, 4, 2, n, n, 16, torch.float32, device)
    mask = torch.rand(b, n, device=device) > 0.4
    mask[1] = False  # a fully padded sequence: every row sees no key
    mask[2, :20] = False
    mask[0, 0] = True
    for deterministic in (False, True):
        _, dk, dv = check_gqa(
            q, k, v, deterministic=deterministic, causal=causal, key_padding_mask=mask
        )
        pad = ~mask[:, None, :, None]
        assert (dk.masked_select(pad) == 0).all() and (dv.masked_select(pad) == 0).all()
    out = attention(q, k, v, causal=causal, key_padding_mask=mask, use_triton=True)
    assert (out[1] == 0).all()
    # padded keys are never read: changing them changes nothing
    k2 = torch.where(~mask[:, None, :, None], 5 * torch.randn_like(k), k)
    assert torch.equal(out, attention(q, k2, v, causal=causal, key_padding_mask=mask,
                                      use_triton=True))  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_one_mask_per_query_head(causal, device):
    # the mask is drawn per query head (batch·query-head Philox key), as in multi-head
    # attention of q's shape: read it off there, then forward and every gradient match
    # float64 with it, in both backward kernels
    p, (b, h, h_kv, n_q, n_k) = 0.25, (1, 4, 2, 29, 37)
    keep = dropout_mask((b, h, n_q, n_k), p, seed=7, device=device)
    q, k, v = make_gqa(b, h, h_kv, n_q, n_k, 32, torch.float32, device)
    grads = [
        check_gqa(q, k, v, deterministic=det, keep=keep, p=p, seed=7, causal=causal)
        for det in (False, True)
    ]
    for a, g in zip(*grads, strict=True):
        assert rel_err(a, g) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision(dtype, device):
    check_gqa(*make_gqa(2, 4, 2, 45, 45, 32, dtype, device), causal=True)
    check_gqa(*make_gqa(1, 4, 1, 9, 45, 64, dtype, device), causal=True, deterministic=True)


def test_strided_views(device):
    # q, k, v as views of one grouped projection (b, n, (h + 2·h_kv)·d), the model's layout
    b, n, h, h_kv, d = 2, 23, 4, 2, 16
    qkv = torch.randn(b, n, (h + 2 * h_kv) * d, device=device)
    q, k, v = qkv.view(b, n, h + 2 * h_kv, d).transpose(1, 2).split((h, h_kv, h_kv), dim=1)
    assert not k.is_contiguous()
    check_gqa(q, k, v, causal=True)


def test_deterministic_and_default_backward_agree(device):
    check_backward_kernels_agree(*make_gqa(1, 4, 2, 70, 70, 32, torch.float32, device))


def test_pytorch_branches(device):
    # attention(use_triton=False) and the naive composition (both branches) accept the
    # grouped shapes; any head dim on the PyTorch side
    q, k, v = make_gqa(2, 6, 3, 11, 14, 8, torch.float64, device)
    mask = torch.rand(2, 14, device=device) > 0.3
    for causal in (False, True):
        ref = ref_attention(q, expand(k, 6), expand(v, 6), causal=causal, key_padding_mask=mask)
        out = attention(q, k, v, causal=causal, key_padding_mask=mask)
        assert rel_err(out, ref) < 1e-12
        q32, k32, v32 = make_gqa(2, 4, 1, 21, 21, 16, torch.float32, device)
        ref32 = ref_attention(q32, expand(k32, 4), expand(v32, 4), causal=causal)
        for use_triton in (False, True):
            naive = attention_naive(q32, k32, v32, causal=causal, use_triton=use_triton)
            assert rel_err(naive, ref32) < 1e-5


def check_cached_gqa(b, h, h_kv, n_q, cache_len, capacity, d, dtype, device):
    """attention_cached over (b, h_kv, capacity, d) caches (`check_cached_over`)."""
    check_cached_over(*make_gqa(b, h, h_kv, n_q, cache_len, d, dtype, device), capacity)


@pytest.mark.parametrize(
    "h, h_kv, n_q, cache_len, capacity",
    # the interpreter splits the keys in three (split-K decode and its combine kernel)
    [(4, 2, 1, 37, 70), (4, 1, 3, 50, 64), (8, 2, 16, 65, 100), (4, 4, 1, 1, 40)],
)
def test_cached_decode(h, h_kv, n_q, cache_len, capacity, device):
    check_cached_gqa(2, h, h_kv, n_q, cache_len, capacity, 16, torch.float32, device)


def test_cached_decode_bf16(device):
    check_cached_gqa(1, 4, 2, 2, 50, 64, 32, torch.bfloat16, device)


def test_bad_shapes(device):
    q, k, v = make_gqa(2, 4, 2, 5, 7, 16, torch.float32, device)
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="2 heads must divide q's 3 heads"):
            attention(q[:, :3], k, v, use_triton=use_triton)
        with pytest.raises(ValueError, match=r"same \(b, h\)"):
            attention(q, k, v[:, :1], use_triton=use_triton)
        with pytest.raises(ValueError, match="heads must divide"):
            attention_cached(q[:, :3], k, v, torch.tensor(7, device=device), use_triton=use_triton)
    with pytest.raises(ValueError, match="heads must divide"):
        attention_naive(q, k[:, :0], v[:, :0])


# ----------------------------------------------------------------------------- the model

VOCAB, MAX_LEN = 48, 16
SMALL = dict(num_tokens=VOCAB, dim=32, max_seq_len=MAX_LEN, depth=2, heads=4, dim_head=16)


def make(device="cpu", seed=0, **kwargs) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(**{**SMALL, "causal": True, **kwargs}).to(device)


def test_model_parameters_and_options():
    # kv_heads None or = heads: the classic model, parameter for parameter, bit for bit
    classic = make()
    for same in (make(kv_heads=None), make(kv_heads=4)):
        assert same.options == classic.options and "kv_heads" not in same.options
        for (name, a), b in zip(classic.state_dict().items(), same.state_dict().values(),
                                strict=True):  # fmt: skip
            assert torch.equal(a, b), name
    assert classic.state_dict()["layers.0.0.to_qkv.weight"].shape == (3 * 4 * 16, 32)
    for kv_heads in (2, 1):
        model = make(kv_heads=kv_heads)
        assert model.options["kv_heads"] == kv_heads
        shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
        assert shapes.keys() == classic.state_dict().keys()
        assert shapes["layers.1.0.to_qkv.weight"] == ((4 + 2 * kv_heads) * 16, 32)
        assert shapes["layers.1.0.to_out.weight"] == (32, 4 * 16)
    for bad, exc in ((3, ValueError), (0, ValueError), (8, ValueError), (2.0, ValueError)):
        with pytest.raises(exc, match="kv_heads"):
            make(kv_heads=bad)


@pytest.mark.parametrize(
    "kwargs",
    [dict(kv_heads=2), dict(kv_heads=1, **LLAMA), dict(kv_heads=2, attn_impl="naive")],
    ids=["gqa", "mqa-llama", "gqa-naive"],
)
def test_trains_with_both_branches_agreeing(kwargs, device):
    # two copies from one initialisation, two AdamW steps each: the Triton and PyTorch
    # branches give the same losses and parameters
    losses = train_both_branches([make(device, depth=1, **kwargs) for _ in range(2)], VOCAB)
    assert losses[0] != losses[1]  # the step changed the model


@pytest.mark.parametrize("cache", ["KVCache", "StaticKVCache"])
@pytest.mark.parametrize("use_triton", [False, True])
def test_decode_with_cache_matches_full_forward(cache, use_triton, device):
    # the prompt in one call, then one token a step; the cache holds kv_heads heads
    model = make(device, kv_heads=2, **LLAMA).eval()
    x = torch.randint(0, VOCAB, (2, 9), device=device)
    with torch.no_grad():
        full = model(x, use_triton=use_triton)
    kv = KVCache() if cache == "KVCache" else StaticKVCache()
    steps = decode_in_steps(model, x, kv, use_triton)
    assert kv.keys[0].shape == (2, 2, MAX_LEN, 16) and len(kv.values) == 2
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    # a cache of another head count is refused
    with pytest.raises(ValueError, match="different shape"), torch.no_grad():
        make(device).eval()(x[:, :1], kv_cache=kv, use_triton=use_triton)


def test_generate_cached_matches_uncached(device):
    check_greedy_cached_generation(make(device, kv_heads=1), VOCAB)


def test_state_dict_round_trip(tmp_path, device):
    trained = check_state_dict_round_trip(make, tmp_path, device, VOCAB, kv_heads=2)
    with pytest.raises(RuntimeError, match=r"to_qkv\.weight"):
        make().load_state_dict(trained.state_dict())  # 4 key/value heads: another shape


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_real_shapes(d, dtype, deterministic, device):
    check_gqa(*make_gqa(2, 8, 2, 1024, 1024, d, dtype, device), deterministic=deterministic,
              causal=True)  # fmt: skip
    check_gqa(*make_gqa(2, 8, 1, 777, 777, d, dtype, device), deterministic=deterministic)


@pytest.mark.gpu
def test_gpu_dropout_and_padding(device):
    b, h, h_kv, n = 2, 8, 2, 512
    keep = dropout_mask((b, h, n, n), 0.1, seed=3, device=device)
    check_gqa(*make_gqa(b, h, h_kv, n, n, 64, torch.float32, device), keep=keep, p=0.1, seed=3,
              causal=True)  # fmt: skip
    mask = torch.rand(b, n, device=device) > 0.2
    check_gqa(*make_gqa(b, h, h_kv, n, n, 64, torch.bfloat16, device), key_padding_mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "b, h_kv, n_q, cache_len, capacity, d",
    [(1, 2, 1, 4000, 4096, 64), (16, 1, 1, 300, 512, 64), (2, 2, 5, 1000, 2048, 128)],
)
def test_gpu_cached_decode(b, h_kv, n_q, cache_len, capacity, d, dtype, device):
    check_cached_gqa(b, 8, h_kv, n_q, cache_len, capacity, d, dtype, device)


@pytest.mark.gpu
def test_gpu_graphed_decode_matches_eager(device):
    cfg = dict(num_tokens=256, dim=256, max_seq_len=128, depth=2, heads=8, dim_head=32)
    net = Transformer(causal=True, kv_heads=2, **cfg, **LLAMA).to(device)
    check_graphed_decode(net, 60, against_uncached=True)


@pytest.mark.gpu
def test_gpu_compiles_without_graph_breaks(device):
    q, k, v = (t.requires_grad_() for t in make_gqa(2, 8, 2, 256, 256, 64, torch.bfloat16, device))

    def f(q, k, v):
        return attention(q, k, v, causal=True, use_triton=True).float().sum()

    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.compile(f)(q, k, v).backward()
    assert k.grad.shape == k.shape and all(torch.isfinite(t.grad).all() for t in (q, k, v))
