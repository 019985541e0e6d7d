"""attention: the fused FlashAttention kernels, the PyTorch reference and the naive composition,
all against an independent float64 implementation written here.

On CPU the kernels run in Triton's interpreter (small shapes, fixed 16/32 tiles that put tile
edges, the causal diagonal and the ragged last block at different places for queries and
keys); `gpu` tests repeat the checks at real shapes with the autotuned tiles.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    compile_trace_check,
    deterministic_algorithms,
    kernel_analysis_failures,
    record_calls,
)

import triton_transformer.attention as attn_mod
from triton_transformer.attention import (
    attention,
    attention_cached,
    attention_naive,
    attention_packed,
    flash_attention_op,
    flash_attention_packed_op,
)
from triton_transformer.utils import clear_launch_plans, draw_seed, draw_seeds

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# dq and dk go through dS = P ∘ (dP - Δ) with Δ = rowsum(dO ∘ O) computed from the *stored*
# output, as in FlashAttention-2. dP_ij - Δ_i = dO_i · (v_j - O_i) cancels the large common part
# of v (-2.3 here), so O's rounding to bf16 (8-bit mantissa) becomes a few per cent of dq and dk;
# the interpreter, which truncates fp32 -> bf16 instead of rounding, doubles that (measured
# ~9e-2, PyTorch's bf16 math ~2e-2). fp16 stays under 1e-2. A real bug (a missing scale, a
# wrong mask, a stale tile) is O(1).
TOL_DQK = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1.5e-1}


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """Relative error; `floor` (an RMS) judges a vanishing reference against the size of
    its terms instead (n_k = 1: dq and dk are 0 up to rounding of cancelling terms)."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite values"
    return ((out - ref).norm() / ref.norm().clamp_min(floor * ref.numel() ** 0.5)).item()


def make_qkv(b, h, n_q, n_k, d, dtype, device):
    # off-centre, spread enough that the softmax is far from uniform
    q = (0.3 + torch.randn(b, h, n_q, d, device=device)).to(dtype)
    k = (-0.2 + torch.randn(b, h, n_k, d, device=device)).to(dtype)
    v = (-2.3 + 0.5 * torch.randn(b, h, n_k, d, device=device)).to(dtype)
    return q, k, v


def visible_mask(n_q, n_k, causal, key_padding_mask, device):
    vis = torch.ones(1, 1, n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        vis = vis & torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)
    if key_padding_mask is not None:
        vis = vis & key_padding_mask[:, None, None, :]
    return vis


def ref_attention(q, k, v, causal=False, key_padding_mask=None, scale=None, keep=None, p=0.0):
    """Textbook float64 attention; rows that see no key are zeros; `keep` a dropout mask."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    vis = visible_mask(q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
    w = s.masked_fill(~vis, float("-inf")).softmax(-1)
    w = torch.where(vis.any(-1, keepdim=True), w, 0.0)  # NaN rows (no key) -> 0
    if keep is not None:
        w = w * keep / (1 - p)
    return w @ v


def out_and_grads(fn, inputs, dout) -> list[torch.Tensor]:
    """fn's output (detached), then the gradients under `dout` of fresh leaf copies of
    `inputs`."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def check_attention(q, k, v, **kwargs):
    """Triton forward and dq/dk/dv vs float64; the PyTorch branch vs float64 as well."""
    dtype = q.dtype
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, use_triton=True, **kwargs)
    assert out.dtype == dtype and out.shape == (*q.shape[:3], v.shape[-1])
    # written as (b, n, h, d): the head merge for the out-projection is a view
    assert out.transpose(1, 2).is_contiguous()
    dout = (0.7 + torch.randn(out.shape, device=out.device)).to(dtype)
    out.backward(dout)

    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_attention(*r, **kwargs)
    ref.backward(dout.double())
    assert rel_err(out, ref) < TOL[dtype]
    for name, t, rt in zip("qkv", (q, k, v), r, strict=True):
        assert t.grad.shape == t.shape and t.grad.dtype == dtype
        tol = TOL[dtype] if name == "v" else TOL_DQK[dtype]
        assert rel_err(t.grad, rt.grad, floor=0.1) < tol, name

    # the PyTorch branch has the same semantics (float64, so to rounding)
    torch_out = attention(*(t.detach().double() for t in (q, k, v)), **kwargs)
    assert rel_err(torch_out, ref) < 1e-12
    return out, ref


# --- forward and backward against float64 ------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, d", [(1, 16), (17, 48), (64, 64), (65, 16), (200, 16)])
def test_lengths_and_head_dims(n, d, causal, device):
    check_attention(*make_qkv(1, 2, n, n, d, torch.float32, device), causal=causal)


@pytest.mark.parametrize("n_q, n_k", [(1, 45), (5, 37), (40, 71), (70, 30)])
def test_causal_rectangular(n_q, n_k, device):
    # Bottom-right aligned: a KV-cache step (n_q < n_k). n_q > n_k: the first n_q - n_k
    # queries see no key and output zeros (no NaN), with zero gradients.
    out, _ = check_attention(*make_qkv(2, 1, n_q, n_k, 16, torch.float32, device), causal=True)
    if n_q > n_k:
        assert (out[:, :, : n_q - n_k] == 0).all()
    # the last query sees every key: it equals a non-causal attention of that query alone
    q, k, v = make_qkv(2, 1, n_q, n_k, 16, torch.float32, device)
    last = attention(q, k, v, causal=True, use_triton=True)[:, :, -1:]
    full = attention(q[:, :, -1:], k, v, use_triton=True)
    assert rel_err(last, full) < 1e-6


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask_and_fully_padded_rows(causal, device):
    b, n = 3, 50
    q, k, v = make_qkv(b, 2, n, n, 32, torch.float32, device)
    mask = torch.rand(b, n, device=device) > 0.4
    mask[1] = False  # a fully padded sequence: every row sees no key
    mask[2, :20] = False  # causal: the first 20 rows of batch 2 see only padded keys
    mask[0, 0] = True
    out, _ = check_attention(q, k, v, causal=causal, key_padding_mask=mask)
    assert (out[1] == 0).all()
    if causal:
        assert (out[2, :, :20] == 0).all()
    # padded keys get no gradient; changing them changes nothing
    q, k, v = (t.requires_grad_() for t in make_qkv(b, 2, n, n, 32, torch.float32, device))
    out = attention(q, k, v, causal=causal, key_padding_mask=mask, use_triton=True)
    out.sum().backward()
    pad = ~mask[:, None, :, None]
    assert (k.grad.masked_select(pad) == 0).all() and (v.grad.masked_select(pad) == 0).all()
    k2 = torch.where(pad, 5 * torch.randn_like(k), k.detach())
    out2 = attention(q, k2, v, causal=causal, key_padding_mask=mask, use_triton=True)
    assert torch.equal(out, out2)


def test_explicit_scale(device):
    q, k, v = make_qkv(2, 2, 33, 40, 16, torch.float32, device)
    check_attention(q, k, v, scale=0.5)
    check_attention(q, k, v, scale=0.05, causal=True)
    # scale <= 0 takes the unfolded path (a row max does not commute with a negative scale)
    check_attention(q, k, v, scale=-0.3, causal=True)
    check_attention(
        q[:, :, :5], k, v, scale=0.0, key_padding_mask=torch.rand(2, 40, device=device) > 0.5
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision(dtype, device):
    check_attention(*make_qkv(2, 2, 70, 70, 48, dtype, device), causal=True)
    check_attention(*make_qkv(1, 2, 9, 45, 64, dtype, device), causal=True)


def test_arbitrary_strides(device):
    # q and k: (b, n, h, d) seen as (b, h, n, d); v: every other element of its last dim
    b, h, n_q, n_k, d = 2, 3, 19, 23, 32
    q = (0.3 + torch.randn(b, n_q, h, d, device=device)).transpose(1, 2)
    k = (-0.2 + torch.randn(b, n_k, h, d, device=device)).transpose(1, 2)
    v = (-2.3 + 0.5 * torch.randn(b, h, n_k, 2 * d, device=device))[..., ::2]
    assert v.stride(-1) == 2
    check_attention(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "causal, deterministic", [(True, False), (True, True), (False, False)], ids=str
)
def test_packed_qkv(dtype, causal, deterministic, device):
    # The model's layout: q, k, v are views of one (b, n, 3·h·d) projection output; the
    # backward writes d(qkv) whole (PACKED_GRADS) from the single pass and from the
    # two-program kernel (deterministic algorithms).
    b, n, h, d = 2, 37, 2, 48
    qkv = torch.randn(b, n, 3 * h * d, device=device)
    qkv = (qkv + torch.tensor([0.3, -0.2, -2.3], device=device).repeat_interleave(h * d)).to(dtype)
    qkv.requires_grad_()
    with deterministic_algorithms(deterministic):
        out = attention_packed(qkv, h, causal=causal, use_triton=True)
        assert out.shape == (b, n, h * d) and out.is_contiguous() and out.dtype == dtype
        dout = torch.randn(out.shape, device=device).to(dtype)
        out.backward(dout)

    r = qkv.detach().double().requires_grad_()
    q, k, v = r.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    ref = ref_attention(q, k, v, causal=causal).transpose(1, 2).reshape(b, n, h * d)
    ref.backward(dout.double())
    assert rel_err(out, ref) < TOL[dtype]
    assert qkv.grad.shape == qkv.shape and qkv.grad.is_contiguous()
    assert rel_err(qkv.grad, r.grad) < TOL_DQK[dtype]
    # the PyTorch branch agrees
    torch_out = attention_packed(qkv.detach().double(), h, causal=causal)
    assert rel_err(torch_out, ref) < 1e-12
    # and so do the views handed to `attention` (same kernel, different op)
    q, k, v = qkv.detach().view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    view_out = attention(q, k, v, causal=causal, use_triton=True)
    view_out = view_out.transpose(1, 2).reshape(b, n, -1)
    assert torch.equal(view_out, out.detach())


def test_naive_composition_matches(device):
    # attention_naive (bmm -> softmax -> dropout -> bmm) has the same semantics, fully padded
    # rows included (zeros, the rule; it used to average v).
    q, k, v = make_qkv(2, 2, 21, 21, 16, torch.float32, device)
    mask = torch.rand(2, 21, device=device) > 0.3
    mask[1] = False
    for causal in (False, True):
        ref = ref_attention(q, k, v, causal=causal, key_padding_mask=mask)
        for use_triton in (False, True):
            out = attention_naive(
                q, k, v, causal=causal, key_padding_mask=mask, use_triton=use_triton
            )
            assert rel_err(out, ref) < 1e-5
            assert (out[1] == 0).all()
    out = attention_naive(q[:, :, :9], k[:, :, :3], v[:, :, :3], causal=True, scale=0.3)
    ref = ref_attention(q[:, :, :9], k[:, :, :3], v[:, :, :3], causal=True, scale=0.3)
    assert rel_err(out, ref) < 1e-6


# --- dropout ----------------------------------------------------------------------------------


def dropout_mask(shape, p, seed, causal=False, device="cpu"):
    """The keep mask the kernel draws for (b, h, n_q, n_k) under torch seed `seed`, read off
    with q = 0 (uniform weights) and v = identity on a window of up to 128 keys:
    out[i, j] = keep_ij / (n_k (1-p)). The mask depends on the seed and positions only, never
    on the data or the head dim, so longer key ranges are read window by window."""
    b, h, n_q, n_k = shape
    d = min(128, max(16, 16 * math.ceil(n_k / 16)))
    q = torch.zeros(b, h, n_q, d, device=device)
    k = torch.zeros(b, h, n_k, d, device=device)
    windows = []
    for j0 in range(0, n_k, d):
        width = min(d, n_k - j0)
        v = torch.zeros(n_k, d, device=device)
        v[j0 : j0 + width, :width] = torch.eye(width, device=device)
        torch.manual_seed(seed)
        out = attention(q, k, v.expand(b, h, n_k, d), dropout_p=p, use_triton=True)
        windows.append(out[..., :width])
    scaled = torch.cat(windows, -1).double() * n_k * (1 - p)
    keep = scaled.round()
    assert torch.allclose(scaled, keep, atol=1e-5)  # every weight is 0 or 1 / (n_k (1 - p))
    assert ((keep == 0) | (keep == 1)).all()
    return keep.bool()


def test_dropout_keep_rate_and_reproducibility(device):
    p = 0.3
    shape = (2, 2, 150, 48)
    keep = dropout_mask(shape, p, seed=11, device=device)
    n = keep.numel()
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) < 3 * math.sqrt(p * (1 - p) / n), rate
    assert torch.equal(keep, dropout_mask(shape, p, seed=11, device=device))
    assert not torch.equal(keep, dropout_mask(shape, p, seed=12, device=device))
    # heads and batches draw different masks
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_forward_and_backward_use_one_mask(causal, device):
    # Same torch seed -> the same mask; the output and all three gradients match float64
    # attention with that mask applied to the weights.
    p, shape = 0.25, (1, 2, 37, 45)
    keep = dropout_mask(shape, p, seed=5, device=device)
    q, k, v = (t.requires_grad_() for t in make_qkv(*shape, 32, torch.float32, device))
    torch.manual_seed(5)
    out = attention(q, k, v, causal=causal, dropout_p=p, use_triton=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_attention(*r, causal=causal, keep=keep, p=p)
    ref.backward(dout.double())
    assert rel_err(out, ref) < 1e-5
    for t, rt in zip((q, k, v), r, strict=True):
        assert rel_err(t.grad, rt.grad) < 1e-5
    # two calls draw two masks; eval mode (training=False) has no dropout
    again = attention(q, k, v, causal=causal, dropout_p=p, use_triton=True)
    assert not torch.equal(out, again)
    plain = attention(q, k, v, causal=causal, use_triton=True)
    assert torch.equal(attention(q, k, v, causal=causal, dropout_p=p, training=False,
                                 use_triton=True), plain)  # fmt: skip


def test_empty_sizes(device):
    # no queries or no keys: empty outputs, or zeros (a row with no key), and zero gradients
    for n_q, n_k in ((0, 5), (5, 0), (0, 0)):
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, n_q, n_k, 16, torch.float32, device))
        for use_triton in (False, True):
            out = attention(q, k, v, causal=True, use_triton=use_triton)
            assert out.shape == (1, 2, n_q, 16) and (out == 0).all()
            out.sum().backward()
            assert all(t.grad.shape == t.shape and (t.grad == 0).all() for t in (q, k, v))
            q.grad = k.grad = v.grad = None


@pytest.mark.parametrize("tile_loads, dq_reductions", [(True, True), (True, False), (False, True)])
def test_backward_descriptors_made_on_the_host(tile_loads, dq_reductions):
    # the Triton backward's TMA descriptors (`_bwd_descriptors`): q and dO over their (b, h,
    # n_q, d) views in blocks of one head's BLOCK_M1 rows, k and v over (b, h_kv, n_k, d) in
    # BLOCK_N2 rows, the dQ sum over (b·h, n_q, d) in BLOCK_M1 rows, all BLOCK_D wide (past d:
    # zeros); views of packed tensors keep their strides; q stands in for those not asked for
    from triton_transformer.attention import _bwd_descriptors

    b, h, h_kv, n_q, n_k, d = 2, 4, 2, 50, 70, 48
    q = torch.empty(b, n_q, h, 2 * d, dtype=torch.bfloat16)[..., :d].transpose(1, 2)
    kv = torch.empty(b, n_k, 2, h_kv, d, dtype=torch.bfloat16)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    dout = torch.empty(b, n_q, h, d, dtype=torch.bfloat16).transpose(1, 2)
    dq_acc = torch.empty(b * h, n_q, d)
    config = {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 16}
    descs = _bwd_descriptors(q, k, v, dout, dq_acc, config, 64, tile_loads, dq_reductions)
    want = [(q, 32), (k, 16), (v, 16), (dout, 32), (dq_acc, 32)]
    asked = [tile_loads] * 4 + [dq_reductions]
    for desc, (t, rows), made in zip(descs, want, asked, strict=True):
        if not made:
            assert desc is q
            continue
        assert desc.base is t and list(desc.shape) == list(t.shape)
        assert list(desc.strides) == list(t.stride())
        assert list(desc.block_shape) == [1] * (t.dim() - 2) + [rows, 64]


def test_64_bit_offsets_and_grid_spill(device, monkeypatch):
    # The paths for huge problems, forced on small ones: 64-bit row offsets and Philox
    # counters, and batch·head spilling from grid dim 1 into dim 2 (past 65535 on CUDA).
    import triton_transformer.attention as A

    launch_meta = A._launch_meta

    def forced(q, k, v):
        return {**launch_meta(q, k, v), "DROP_INT64": True, "INT64_ROWS": True}

    monkeypatch.setattr(A, "_launch_meta", forced)
    monkeypatch.setattr(A, "_MAX_GRID_Y", 3)  # b·h = 8 -> a (.., 3, 3) grid
    check_attention(*make_qkv(2, 4, 37, 37, 16, torch.float32, device), causal=True)
    # dropout with 64-bit counters: still one mask for forward and backward
    p, shape = 0.25, (1, 2, 21, 30)
    keep = dropout_mask(shape, p, seed=3, device=device)
    q, k, v = (t.requires_grad_() for t in make_qkv(*shape, 16, torch.float32, device))
    torch.manual_seed(3)
    out = attention(q, k, v, dropout_p=p, use_triton=True)
    out.backward(torch.ones_like(out))
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_attention(*r, keep=keep, p=p)
    ref.backward(torch.ones_like(ref))
    assert rel_err(out, ref) < 1e-5
    assert all(rel_err(t.grad, rt.grad) < 1e-5 for t, rt in zip((q, k, v), r, strict=True))


@pytest.mark.parametrize("deterministic", [False, True], ids=["single-pass", "deterministic"])
@pytest.mark.parametrize(
    "heads_per_group, kv_heads, grid_y",
    [(1, 4, None), (3, 4, None), (3, 2, None), (3, 4, 3)],
    ids=["identity", "ragged", "grouped-query", "grid-spill"],
)
def test_longest_first_head_groups(
    heads_per_group, kv_heads, grid_y, deterministic, device, monkeypatch
):
    # Causal launches deal their programs block-major over groups of heads
    # (`_jit_helpers.longest_first`). An L2 budget of three heads' streamed tensors (4·n·d
    # bytes each: the same n for queries and keys here) splits b·h = 8 into groups 3, 3, 2,
    # so the last group is ragged; a budget of one head is the identity order. Also with
    # grouped-query attention (key blocks dealt round each group's query heads) and with
    # batch·head spilling into grid dim 2 (programs past b·h return before the remap).
    # n = 200 gives several blocks per head for the interpreter's tiles and the GPU's. Every
    # (block, head) must be computed exactly once: forward and all three gradients against
    # float64.
    from test_gqa import check_gqa, make_gqa

    import triton_transformer.attention as A

    n, d = 200, 16
    monkeypatch.setattr(A, "LONGEST_FIRST_BYTES", heads_per_group * 4 * n * d)
    if grid_y is not None:
        monkeypatch.setattr(A, "_MAX_GRID_Y", grid_y)  # b·h = 8 -> a (.., 3, 3) grid
    q, k, v = make_gqa(2, 4, kv_heads, n, n, d, torch.float32, device)
    check_gqa(q, k, v, deterministic=deterministic, causal=True)


# --- the registered ops ----------------------------------------------------------------------


def test_registered_ops(device):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 17, 17, 16, torch.float32, device))
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    seed = draw_seed(device)
    mask = torch.ones(1, 17, dtype=torch.bool, device=device)
    torch.library.opcheck(
        flash_attention_op, (q, k, v, mask, seed, True, 0.25, 0.1, True), test_utils=tests
    )
    qkv = torch.randn(1, 17, 3, 2, 16, device=device, requires_grad=True)
    torch.library.opcheck(
        flash_attention_packed_op, (qkv, None, None, False, 0.25, 0.0, True), test_utils=tests
    )


def test_no_lse_without_grad(device):
    q, k, v = make_qkv(1, 2, 17, 17, 16, torch.float32, device)
    out, lse = flash_attention_op(q, k, v, None, None, True, 0.25, 0.0, False)
    assert lse.numel() == 0
    out2, lse2 = flash_attention_op(q, k, v, None, None, True, 0.25, 0.0, True)
    assert lse2.shape == (2, 17) and torch.equal(out, out2)
    with torch.no_grad():
        torch.testing.assert_close(
            attention(q.requires_grad_(), k, v, causal=True, scale=0.25, use_triton=True),
            out2.transpose(1, 2),
        )


def test_double_backward_raises(device, assert_first_order_only):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 1, 9, 9, 16, torch.float32, device))
    assert_first_order_only(lambda q: attention(q, k, v, use_triton=True), q, "attention")
    qkv = torch.randn(1, 9, 3 * 2 * 16, device=device, requires_grad=True)
    f = lambda qkv: attention_packed(qkv, 2, causal=True, use_triton=True)
    assert_first_order_only(f, qkv, "attention_packed")


def test_bad_inputs(device):
    q, k, v = make_qkv(2, 2, 5, 7, 16, torch.float32, device)
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="q must be 4-D"):
            attention(q[0], k, v, use_triton=use_triton)
        with pytest.raises(TypeError, match=r"k must be a torch\.Tensor"):
            attention(q, k.tolist(), v, use_triton=use_triton)
        with pytest.raises(ValueError, match="head dim"):
            attention(q, k[..., :8], v, use_triton=use_triton)
        with pytest.raises(ValueError, match="n_k"):
            attention(q, k, v[:, :, :3], use_triton=use_triton)
        with pytest.raises(ValueError, match=r"same \(b, h\)"):
            attention(q, k[:1], v[:1], use_triton=use_triton)
        with pytest.raises(TypeError, match="one dtype"):
            attention(q, k.half(), v, use_triton=use_triton)
        with pytest.raises(TypeError, match="key_padding_mask must be a bool"):
            attention(q, k, v, key_padding_mask=torch.ones(2, 7, device=device))
        bad = torch.ones(2, 5, dtype=torch.bool, device=device)
        with pytest.raises(ValueError, match="key_padding_mask must have shape"):
            attention(q, k, v, key_padding_mask=bad, use_triton=use_triton)
        meta_mask = torch.ones(2, 7, dtype=torch.bool, device="meta")
        with pytest.raises(ValueError, match="key_padding_mask is on"):
            attention(q, k, v, key_padding_mask=meta_mask, use_triton=use_triton)
        with pytest.raises(ValueError, match="dropout_p"):
            attention(q, k, v, dropout_p=1.0, use_triton=use_triton)
        with pytest.raises(TypeError, match="scale"):
            attention(q, k, v, scale="0.5", use_triton=use_triton)
    # the kernel takes head dims 16, 32, ..., 128; the PyTorch branch takes any
    for d in (8, 24, 144):
        q, k, v = make_qkv(1, 1, 5, 5, d, torch.float32, device)
        with pytest.raises(ValueError, match=f"head dim {d} is not supported"):
            attention(q, k, v, use_triton=True)
        assert attention(q, k, v).shape == (1, 1, 5, d)
    with pytest.raises(TypeError, match=r"q has dtype torch\.float64"):
        attention(*make_qkv(1, 1, 5, 5, 16, torch.float64, device), use_triton=True)
    with pytest.raises(ValueError, match="3 · heads"):
        attention_packed(torch.randn(1, 4, 96, device=device), 5, use_triton=True)


# --- attention over a KV cache whose length is on the device ---------------------------------


def check_cached(b, h, n_q, cache_len, capacity, d, dtype, device):
    """attention_cached over a cache of cache_len real positions of `capacity`."""
    check_cached_over(*make_qkv(b, h, n_q, cache_len, d, dtype, device), capacity)


def check_cached_over(q, k, v, capacity):
    """attention_cached (Triton and PyTorch) of q (b, h, n_q, d) over caches of `capacity`
    positions holding k, v (b, h_kv, cache_len, d; h_kv dividing h: grouped-query attention)
    against float64 causal attention over k, v repeated to h heads; stale positions hold NaN
    (must never be read)."""
    b, h, n_q, d = q.shape
    h_kv, cache_len, dtype, device = k.shape[1], k.shape[2], q.dtype, q.device
    k_cache = torch.full((b, h_kv, capacity, d), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    k_cache[:, :, :cache_len], v_cache[:, :, :cache_len] = k, v
    length = torch.tensor(cache_len, device=device)
    group = h // h_kv
    k_ref, v_ref = (t.repeat_interleave(group, dim=1) for t in (k, v))
    ref = ref_attention(q, k_ref, v_ref, causal=True)
    for use_triton in (True, False):
        out = attention_cached(q, k_cache, v_cache, length, use_triton=use_triton)
        assert out.shape == (b, h, n_q, d) and out.dtype == dtype
        assert rel_err(out, ref) < TOL[dtype], (use_triton, rel_err(out, ref))


@pytest.mark.parametrize(
    "n_q, cache_len, capacity",
    [(1, 1, 40), (1, 37, 40), (1, 40, 40), (3, 17, 64), (17, 17, 70), (16, 65, 100)],
)
@pytest.mark.parametrize("d", [16, 48])
def test_cached_attention(n_q, cache_len, capacity, d, device):
    check_cached(2, 2, n_q, cache_len, capacity, d, torch.float32, device)


def test_cached_attention_bf16_and_scale(device):
    check_cached(1, 3, 2, 50, 64, 64, torch.bfloat16, device)
    q, k, v = make_qkv(1, 2, 1, 30, 16, torch.float32, device)
    length = torch.tensor(30, device=device)
    ref = ref_attention(q, k, v, causal=True, scale=0.7)
    for use_triton in (True, False):
        out = attention_cached(q, k, v, length, scale=0.7, use_triton=use_triton)
        assert rel_err(out, ref) < TOL[torch.float32]


def test_cached_attention_reads_the_length_each_call(device):
    # one set of buffers, the length changed in place: what a replayed CUDA graph sees
    q, k, v = make_qkv(1, 2, 1, 48, 16, torch.float32, device)
    length = torch.tensor(0, device=device)
    for n in (5, 33, 48):
        length.fill_(n)
        ref = ref_attention(q, k[:, :, :n], v[:, :, :n], causal=True)
        out = attention_cached(q, k, v, length, use_triton=True)
        assert rel_err(out, ref) < TOL[torch.float32]


def test_cached_attention_bad_inputs(device):
    q, k, v = make_qkv(1, 2, 3, 10, 16, torch.float32, device)
    for use_triton in (False, True):
        with pytest.raises(TypeError, match="cache_len must be a 0-dim integer tensor"):
            attention_cached(q, k, v, 10, use_triton=use_triton)
        with pytest.raises(TypeError, match="cache_len must be a 0-dim integer tensor"):
            attention_cached(q, k, v, torch.tensor([10], device=device), use_triton=use_triton)
        with pytest.raises(TypeError, match="cache_len must be a 0-dim integer tensor"):
            attention_cached(q, k, v, torch.tensor(1.0, device=device), use_triton=use_triton)
        with pytest.raises(ValueError, match="cache_len is on meta"):
            attention_cached(q, k, v, torch.tensor(3, device="meta"), use_triton=use_triton)
        with pytest.raises(ValueError, match="do not fit a cache of capacity 2"):
            attention_cached(q, k[:, :, :2], v[:, :, :2], torch.tensor(2, device=device))
        with pytest.raises(ValueError, match="n_k"):
            attention_cached(q, k, v[:, :, :4], torch.tensor(4, device=device))
    with pytest.raises(ValueError, match="head dim 8 is not supported"):
        attention_cached(q[..., :8], k[..., :8], v[..., :8], torch.tensor(3), use_triton=True)


# --- every option: head dims x causal x dropout x key padding x backward path --------------


def check_option(b, h, n, d, causal, dropout, padded, deterministic, dtype, device, n_k=None):
    """One configuration of the fused kernels, forward and all three gradients, against
    float64 attention with the kernel's own dropout mask (read off by `dropout_mask`):
    n queries and n_k keys (default n)."""
    p, seed = (0.2, 17) if dropout else (0.0, None)
    n_k = n if n_k is None else n_k
    q, k, v = (t.requires_grad_() for t in make_qkv(b, h, n, n_k, d, dtype, device))
    kpm = None
    if padded:
        kpm = torch.rand(b, n_k, device=device) > 0.3
        kpm[0, : n_k // 3] = False  # a run of padded keys: whole key tiles with no weight
    keep = dropout_mask((b, h, n, n_k), p, seed, device=device) if dropout else None
    if dropout:
        torch.manual_seed(seed)
    with deterministic_algorithms(deterministic):
        out = attention(q, k, v, causal=causal, key_padding_mask=kpm, dropout_p=p, use_triton=True)
        dout = (0.7 + torch.randn(out.shape, device=device)).to(dtype)
        out.backward(dout)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_attention(*r, causal=causal, key_padding_mask=kpm, keep=keep, p=p)
    ref.backward(dout.double())
    assert rel_err(out, ref) < TOL[dtype]
    for name, t, rt in zip("qkv", (q, k, v), r, strict=True):
        tol = TOL[dtype] if name == "v" else TOL_DQK[dtype]
        assert rel_err(t.grad, rt.grad, floor=0.1) < tol, name
    return [t.grad for t in (q, k, v)]


OPTION_MATRIX = [
    (d, causal, dropout, padded)
    for d in range(16, 129, 16)
    for causal in (False, True)
    for dropout in (False, True)
    for padded in (False, True)
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("d, causal, dropout, padded", OPTION_MATRIX)
def test_every_option(d, causal, dropout, padded, deterministic, device):
    # tiny shapes: 37 rows put the interpreter's 16/32 tiles' edges and the causal diagonal
    # in different places; fp32 and fp16 alternate over the head dims (bf16, whose rounding
    # the interpreter truncates, has tests of its own above and a full matrix on the GPU)
    dtype = torch.float32 if d % 32 else torch.float16
    check_option(1, 2, 37, d, causal, dropout, padded, deterministic, dtype, device)


def test_single_pass_and_deterministic_backward_agree(device):
    # the two backward kernels compute the same gradients (to fp32 rounding)
    check_backward_kernels_agree(*make_qkv(2, 3, 70, 70, 32, torch.float32, device))


# --- heads of one key block: the backward in one launch ----------------------------------


def one_launch_block(d: int, dtype: torch.dtype, causal: bool, dropout: bool) -> int:
    """The most keys a head may have for its backward to take one launch: one key block of
    the two-program tiles (the interpreter's fixed ones on the CPU)."""
    if attn_mod.interpreter_enabled():
        return attn_mod._INTERP_BWD["BLOCK_N1"]
    return attn_mod._attention_bwd_config(d, dtype, causal, dropout)["BLOCK_N1"]


def backward_kernels(monkeypatch, run) -> list[str]:
    """Names of the kernels `run()` launches, bound afresh (launch plans cleared first)."""
    clear_launch_plans()
    with monkeypatch.context() as patch:
        names = record_calls(patch, attn_mod, "launcher", record=lambda kernel: kernel.fn.__name__)
        run()
    return names


@pytest.mark.parametrize("causal", [False, True])
def test_short_heads_take_one_backward_launch(causal, monkeypatch, device):
    # keys that fit one key block: one program per head computes Δ, dQ, dK and dV (no Δ
    # launch, no dQ programs or fp32 dQ sum); one key more: the launches of longer heads
    d, dtype = 32, torch.float32
    block = one_launch_block(d, dtype, causal, False)
    for n_k, one in ((block, True), (block + 1, False)):
        q, k, v = (t.requires_grad_() for t in make_qkv(2, 3, 20, n_k, d, dtype, device))
        out = attention(q, k, v, causal=causal, use_triton=True)
        names = backward_kernels(monkeypatch, lambda o=out: o.backward(torch.ones_like(o)))
        assert (names == ["_attention_bwd_kernel"]) == one, names
        assert "_attention_bwd_delta_kernel" in names or one


ONE_LAUNCH_OPTIONS = [
    (d, causal, dropout, padded)
    for d in (16, 48, 128)
    for causal in (False, True)
    for dropout in (False, True)
    for padded in (False, True)
]


@pytest.mark.parametrize("d, causal, dropout, padded", ONE_LAUNCH_OPTIONS)
def test_one_launch_every_option(d, causal, dropout, padded, device):
    # 29 queries and keys: one key block of the interpreter's 32 (so one launch), two of its
    # 16-query blocks, the causal diagonal crossing both; fp32 and fp16 as `test_every_option`
    dtype = torch.float32 if d % 32 else torch.float16
    check_option(2, 2, 29, d, causal, dropout, padded, False, dtype, device)


# (b, h, h_kv, n_q, n_k, causal, dropout p, padded, packed): more queries than keys with a causal
# mask (the first n_q - n_k rows see no key: zero gradients, stored by the one launch too),
# key padding, grouped-query heads summing dK and dV over their group, the packed op's d(qkv)
ONE_LAUNCH_CASES = [
    pytest.param((2, 2, 2, 70, 30, True, 0.0, False, False), id="causal-rows-without-keys"),
    pytest.param((2, 3, 3, 29, 29, False, 0.0, True, False), id="padded"),
    pytest.param((1, 4, 2, 24, 24, True, 0.2, False, False), id="gqa-dropout"),
    pytest.param((2, 4, 1, 9, 31, False, 0.0, True, False), id="mqa-padded"),
    pytest.param((2, 2, 2, 25, 25, True, 0.1, False, True), id="packed-dropout"),
]


@pytest.mark.parametrize("case", ONE_LAUNCH_CASES)
def test_one_launch_agrees_with_the_longer_heads_launches(case, monkeypatch, device):
    # the one-launch backward against the launches a longer head takes (single pass or two
    # programs, tested against float64 elsewhere), on the same inputs and dropout seed;
    # one writer per output element: bit-identical across two runs, on the GPU too
    b, h, h_kv, n_q, n_k, causal, p, padded, packed = case
    q, k, v = make_qkv(b, h, n_q, n_k, 32, torch.float32, device)
    k, v = k[:, :h_kv].contiguous(), v[:, :h_kv].contiguous()
    kpm = torch.rand(b, n_k, device=device) > 0.3 if padded else None
    seed = draw_seed(device)
    dout = (0.7 + torch.randn(b, n_q, h, 32, device=device)).transpose(1, 2)

    def grads() -> list[torch.Tensor]:
        if packed:
            qkv = torch.cat([t.transpose(1, 2) for t in (q, k, v)], 2).flatten(2)
            return out_and_grads(
                lambda x: attention_packed(x, h, causal=causal, dropout_p=p, seed=seed,
                                           use_triton=True),
                (qkv,), dout.transpose(1, 2).flatten(2),
            )  # fmt: skip
        return out_and_grads(
            lambda *t: attention(*t, causal=causal, key_padding_mask=kpm, dropout_p=p, seed=seed,
                                 use_triton=True),
            (q, k, v), dout,
        )  # fmt: skip

    runs = []  # [outputs and gradients] per run
    names = backward_kernels(monkeypatch, lambda: runs.append(grads()))
    assert names == ["_attention_fwd_kernel", "_attention_bwd_kernel"], names
    runs.append(grads())
    for first, again in zip(runs[0], runs[1], strict=True):
        assert torch.equal(first, again)
    monkeypatch.setattr(attn_mod, "ONE_LAUNCH_MAX_QUERIES", 0)
    names = backward_kernels(monkeypatch, lambda: runs.append(grads()))
    assert "_attention_bwd_delta_kernel" in names, names
    for got, want in zip(runs[0], runs[2], strict=True):
        assert rel_err(got, want) < 1e-5


def check_backward_kernels_agree(q, k, v):
    """The single-pass and the deterministic backward give q, k, v the same gradients (to
    fp32 rounding), causal, for fp32 inputs."""
    grads = []
    for det in (False, True):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        with deterministic_algorithms(det):
            out = attention(qs, ks, vs, causal=True, use_triton=True)
            out.backward(torch.ones_like(out))
        grads.append([t.grad for t in (qs, ks, vs)])
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-5


# --- GPU: real shapes, the tutorial's check, capture and compile -----------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, d", [(1024, 64), (777, 128), (513, 80), (300, 96)])
def test_gpu_real_shapes(n, d, causal, dtype, device):
    check_attention(*make_qkv(2, 4, n, n, d, dtype, device), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "b, n_q, cache_len, capacity, d",
    [(1, 1, 4000, 4096, 64), (16, 1, 300, 512, 64), (2, 5, 1000, 2048, 128), (1, 16, 77, 8192, 80)],
)
def test_gpu_cached_attention_split_keys(b, n_q, cache_len, capacity, d, dtype, device):
    # a few queries per head: the keys are split among programs, then combined
    check_cached(b, 8, n_q, cache_len, capacity, d, dtype, device)


@pytest.mark.gpu
def test_gpu_fp32_and_padding_and_kv_cache(device):
    check_attention(*make_qkv(2, 4, 300, 300, 64, torch.float32, device), causal=True)
    q, k, v = make_qkv(4, 8, 256, 256, 64, torch.bfloat16, device)
    mask = torch.rand(4, 256, device=device) > 0.2
    mask[3] = False
    check_attention(q, k, v, key_padding_mask=mask)
    # decode: a few queries against a KV cache in a (b, h, max_len, d) buffer
    cache = torch.randn(2, 4, 8, 1024, 64, device=device, dtype=torch.bfloat16)
    for n_q in (1, 3):
        q = torch.randn(4, 8, n_q, 64, device=device, dtype=torch.bfloat16)
        check_attention(q, cache[0, ..., :999, :], cache[1, ..., :999, :], causal=True)


@pytest.mark.gpu
def test_gpu_triton_tutorial_check(device):
    # Triton's 06-fused-attention test: (1, 2, 1024, 64) fp16, causal, sm_scale 0.5,
    # against fp32-softmax attention in fp16, atol 1e-2 forward and backward.
    torch.manual_seed(20)
    shape = (1, 2, 1024, 64)
    q, k, v = (
        torch.empty(shape, dtype=torch.float16, device=device).normal_(0.0, 0.5).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn_like(q)
    mask = torch.tril(torch.ones(1024, 1024, device=device))
    p = torch.matmul(q, k.transpose(2, 3)) * 0.5
    p = torch.softmax(p.masked_fill(mask == 0, float("-inf")).float(), dim=-1).half()
    ref = torch.matmul(p, v)
    ref.backward(dout)
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = attention(q, k, v, causal=True, scale=0.5, use_triton=True)
    out.backward(dout)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=0)
    for t, rg in zip((q, k, v), ref_grads, strict=True):
        torch.testing.assert_close(t.grad, rg, atol=1e-2, rtol=0)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(device):
    # forward + backward with dropout, captured: each replay draws a new mask on the device
    qkv = torch.randn(2, 256, 3 * 4 * 64, device=device, dtype=torch.bfloat16)
    qkv.requires_grad_()
    dout = torch.randn(2, 256, 4 * 64, device=device, dtype=torch.bfloat16)

    def step():
        qkv.grad = None
        out = attention_packed(qkv, 4, causal=True, dropout_p=0.2, use_triton=True)
        out.backward(dout)
        return out

    from triton_transformer.cuda_graph import capture_graph

    graph, out = capture_graph(step)
    results = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.isfinite(qkv.grad).all()
        results.append((out.clone(), qkv.grad.clone()))
    assert not torch.equal(results[0][0], results[1][0])
    assert not torch.equal(results[0][1], results[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_compiled_short_heads_match_eager(causal, monkeypatch, device):
    # the one-launch backward of short heads, traced (TRACED_OPAQUE off: the Triton kernels
    # themselves, not the opaque op) and eager: the same gradients, one backward kernel each
    torch._dynamo.reset()
    monkeypatch.setattr(attn_mod, "TRACED_OPAQUE", False)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    qkv = make_qkv(2, 4, 48, 48, 64, torch.bfloat16, device)
    dout = torch.randn_like(qkv[0])

    def f(q, k, v):
        return attention(q, k, v, causal=causal, use_triton=True)

    want, got = out_and_grads(f, qkv, dout), []
    kernels = backward_kernels(
        monkeypatch, lambda: got.extend(out_and_grads(torch.compile(f), qkv, dout))
    )
    assert kernels.count("_attention_bwd_kernel") == 1, kernels  # (traced launches)
    assert "_attention_bwd_delta_kernel" not in kernels, kernels
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 2e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_compile_traces_and_kernel_analysis_cpu():
    # Dynamo (fullgraph) and AOTAutograd's joint trace of attention (causal; dropout with key
    # padding; grouped-query; bf16, whose forward tiles carry a register cap; packed qkv),
    # static and dynamic shapes, on CPU, with torch's analysis of which arguments each kernel
    # writes required to succeed. A subprocess: the kernels must be JITFunctions
    # (TRITON_INTERPRET=0); no kernel runs.
    passed, cases, output = compile_trace_check("attention")
    assert passed and cases == 12, output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_traced_code_calls_the_opaque_ops_where_eager_launches_differ_cpu():
    # Inductor cannot launch a Gluon kernel, nor keep a register cap: where an eager call
    # does (made to, on the CPU), the traced graphs hold the *_opaque ops: the attention
    # forward and backward (packed or not; the forward also where it takes the Gluon
    # kernel; the backward also where it takes the Triton single pass on Hopper), the
    # in-place and the fused loss; with a module's TRACED_OPAQUE off, the triton_ops'
    # kernels. A subprocess.
    passed, cases, output = compile_trace_check("opaque_route")
    assert passed and cases == 12, output


@pytest.mark.gpu
def test_gpu_compiles_without_graph_breaks(device):
    def f(qkv, q, k, v):
        a = attention_packed(qkv, 4, causal=True, dropout_p=0.1, use_triton=True)
        b = attention(q, k, v, causal=True, use_triton=True)
        return a.float().sum() + b.float().sum()

    qkv = torch.randn(2, 128, 3 * 4 * 64, device=device, dtype=torch.bfloat16)
    qkv.requires_grad_()
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 64, 100, 64, torch.bfloat16, device))
    explanation = torch._dynamo.explain(f)(qkv, q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    # torch reads which arguments each kernel writes from its Triton IR: that must succeed,
    # or inductor copies every view the kernels read
    with kernel_analysis_failures() as failures:
        torch.compile(f)(qkv, q, k, v).backward()
    assert not failures, failures
    assert all(torch.isfinite(t.grad).all() for t in (qkv, q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("traced_single_pass", [True, False])
@pytest.mark.parametrize(
    "d, causal, kv_heads", [(64, True, 4), (128, True, 4), (64, False, 4), (64, True, 2)]
)
def test_gpu_compiled_gradients_match_eager(
    d, causal, kv_heads, traced_single_pass, device, monkeypatch
):
    """Traced launches (pointer loads; the single pass with TMA dQ reductions for causal
    attention, or the two-program backward with TRACED_SINGLE_PASS off) give eager's
    gradients (the single pass with TMA tile loads too, for causal attention)."""
    import triton_transformer.attention as attention_module
    from triton_transformer.utils import compile_tma

    torch._dynamo.reset()
    monkeypatch.setattr(attention_module, "TRACED_SINGLE_PASS", traced_single_pass)
    # the Triton kernels' launches: on a Hopper GPU the Gluon backwards would take these d64
    # and d128 heads, eager and traced alike (through the opaque op; test_attention_hopper
    # and test_attention_hopper_bwd_ws cover them)
    monkeypatch.setattr(attention_module.attention_hopper, "ENABLED", False)
    monkeypatch.setattr(attention_module.attention_hopper_bwd_ws, "ENABLED", False)
    # traced kernels, not the opaque op that launches the single pass as eager code does
    monkeypatch.setattr(attention_module, "TRACED_OPAQUE", False)
    # the flag is read while the backward is traced: a graph cached by another test (the
    # same function with the other flag) would skip the trace
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    passes = []
    single_pass = attention_module._single_pass

    def spy(*args):
        passes.append(single_pass(*args))
        return passes[-1]

    monkeypatch.setattr(attention_module, "_single_pass", spy)
    q, k, v = make_qkv(2, 4, 1000, 1000, d, torch.bfloat16, device)
    k, v = k[:, :kv_heads].contiguous(), v[:, :kv_heads].contiguous()
    dout = torch.randn_like(q)

    def f(q, k, v):
        return attention(q, k, v, causal=causal, use_triton=True)

    want = out_and_grads(f, (q, k, v), dout)
    got = out_and_grads(torch.compile(f), (q, k, v), dout)
    assert len(passes) == 2  # one eager launch, one traced
    assert passes[0] == causal  # eager: the single pass where causal
    assert passes[-1] == (causal and traced_single_pass and compile_tma())
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 2e-2


def test_kernels_compile_for_sm90_as_torch_compile_launches_them():
    """torch.compile types Python float arguments fp64 (eager launches: fp32). Compiling the
    kernels for sm_90 here, with no GPU, catches what would only fail under compile on one."""
    script = Path(__file__).with_name("_sm90_compile_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["attention forward: ok", "attention backward: ok"]
    assert "attention over a KV cache whose length is on the device: ok" in proc.stdout
    assert "embedding backward, scatter and positions: ok" in proc.stdout  # dW fp32, dP bf16
    assert "cross-entropy forward, looped: ok" in proc.stdout


def test_dropout_explicit_seed(device):
    # attention / attention_packed with a given seed tensor: the same seed, the same mask
    b, h, n, d = 1, 2, 40, 16
    qkv = torch.randn(b, n, 3 * h * d, device=device)
    seeds = draw_seeds(device, 2)
    kw = dict(causal=True, dropout_p=0.4, use_triton=True)
    out = attention_packed(qkv, h, seed=seeds[0], **kw)
    assert torch.equal(out, attention_packed(qkv, h, seed=seeds[0], **kw))
    assert not torch.equal(out, attention_packed(qkv, h, seed=seeds[1], **kw))
    q, k, v = qkv.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    assert torch.equal(out, attention(q, k, v, seed=seeds[0], **kw).transpose(1, 2).flatten(2))
    with pytest.raises(TypeError, match="seed"):
        attention(q, k, v, seed=seeds, **kw)


# (b, h, h_kv, n, d, causal, dropout_p, key padding, packed qkv): on a GPU (bf16) the last
# ones reach the Gluon forward (d128 from 512 queries), the warp-specialized backward, the
# Gluon single pass (dropout) and the Triton kernels' TMA tile loads (d64 causal, 1024)
ON_GPU = pytest.mark.gpu
PLAN_CASES = [
    pytest.param((2, 2, 2, 40, 32, True, 0.1, True, False), id="mask-dropout"),
    pytest.param((2, 2, 2, 40, 32, True, 0.0, False, True), id="packed"),
    pytest.param((2, 4, 2, 33, 16, False, 0.0, False, False), id="gqa"),
    pytest.param((2, 4, 4, 512, 128, True, 0.0, False, True), id="gpu-d128", marks=ON_GPU),
    pytest.param((2, 4, 4, 1024, 64, True, 0.0, False, True), id="gpu-d64", marks=ON_GPU),
    pytest.param((2, 4, 4, 1024, 64, True, 0.1, False, False), id="gpu-dropout", marks=ON_GPU),
    pytest.param((2, 4, 2, 1024, 64, True, 0.0, True, False), id="gpu-gqa-mask", marks=ON_GPU),
    pytest.param((1, 2, 2, 8, 64, False, 0.0, False, False), id="gpu-decode", marks=ON_GPU),
]


@pytest.mark.parametrize("case", PLAN_CASES)
def test_eager_launches_bound_per_shape(case, device):
    # an eager call's first launch of a shape binds the forward's and the backward's launches
    # (in an `_EagerPlan`: `attention`'s in `_EAGER_PLANS`, `attention_packed`'s in
    # `_PACKED_PLANS`); later calls of that shape take them, with their own tensors: the same
    # output and gradients as launches looked up afresh. Another dtype or alignment binds its
    # own.
    b, h, h_kv, n, d, causal, p, padded, packed = case
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kpm = None
    if padded:
        kpm = torch.rand(b, n, device=device) > 0.25
        kpm[:, 0] = True
    kw = dict(causal=causal, key_padding_mask=kpm, dropout_p=p, use_triton=True)
    if packed:
        inputs = [torch.randn(b, n, 3 * h * d, device=device).to(dtype)]
    else:
        q, k, v = make_qkv(b, h, n, n, d, dtype, device)
        inputs = [q, k[:, :h_kv].contiguous(), v[:, :h_kv].contiguous()]
    dout = torch.randn(b, n, h * d, device=device).to(dtype)

    def run(*tensors):
        torch.manual_seed(0)  # the same dropout mask every call
        leaves = [t.detach().requires_grad_() for t in tensors]
        if packed:
            out = attention_packed(leaves[0], h, **kw)
        else:
            out = attention(*leaves, **kw).transpose(1, 2).flatten(2)
        out.backward(dout.to(out.dtype))
        return (out, *(t.grad for t in leaves))

    def check(got, want):
        # dQ is summed in a varying order on a GPU (the single pass's reductions)
        tol = 0 if device == "cpu" else 2e-2
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)

    def bound_launches() -> list[int]:
        eager = [*attn_mod._EAGER_PLANS.plans.values(), *attn_mod._PACKED_PLANS.plans.values()]
        return [
            len(attn_mod._FWD_PLANS.plans) + sum(len(plan.fwd) for plan in eager),
            len(attn_mod._BWD_PLANS.plans) + sum(len(plan.bwd) for plan in eager),
        ]

    if device == "cuda":  # a plan keeps no tensor (a TMA descriptor's) of the call that made it
        before = torch.cuda.memory_allocated()
        run(*[t.clone() for t in inputs])
        assert torch.cuda.memory_allocated() == before
    else:
        run(*inputs)
    assert bound_launches() == [1, 1]
    other = [t + 0.25 for t in inputs]  # new tensors, new values
    bound = run(*other)
    assert bound_launches() == [1, 1]
    clear_launch_plans()
    check(bound, run(*other))
    run(*[t.half() for t in inputs])
    assert bound_launches() == [2, 2]
    shifted = [torch.empty(t.numel() + 1, device=device, dtype=t.dtype)[1:] for t in other]
    shifted = [s.view_as(t).copy_(t) for s, t in zip(shifted, other, strict=True)]
    check(run(*shifted), bound)  # 2 bytes off: no TMA descriptors, other specialisations
    assert bound_launches() == [3, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d, causal, dropout, padded", OPTION_MATRIX)
def test_gpu_every_option(d, causal, dropout, padded, dtype, deterministic, device):
    # the whole matrix of supported options at seq 2048, each launched on the GPU with the
    # tiles the tables give it (a configuration that cannot fit must pick smaller ones)
    check_option(1, 2, 2048, d, causal, dropout, padded, deterministic, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d, causal, dropout, padded", OPTION_MATRIX)
def test_gpu_one_launch_every_option(d, causal, dropout, padded, dtype, device):
    # the same matrix for heads of one key block (61 keys: the one-launch backward at every
    # head dim's tiles), 3 x 5 heads
    assert one_launch_block(d, dtype, causal, dropout) >= 61
    check_option(3, 5, 61, d, causal, dropout, padded, False, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpu_deterministic_backward_is_bit_identical(dropout, device):
    qkv = torch.randn(4, 1024, 3 * 8 * 64, device=device, dtype=torch.bfloat16)
    dout = torch.randn(4, 1024, 8 * 64, device=device, dtype=torch.bfloat16)
    seed = draw_seed(device)
    grads = []
    with deterministic_algorithms(True):
        for _ in range(2):
            x = qkv.clone().requires_grad_()
            out = attention_packed(x, 8, causal=True, dropout_p=dropout, seed=seed, use_triton=True)
            out.backward(dout)
            grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize(
    "case",
    [
        pytest.param((2, 2, 2, 20, 16, True, 0.0, False), id="causal"),
        pytest.param((1, 4, 2, 24, 32, False, 0.3, True), id="gqa-mask-dropout"),
        pytest.param((2, 4, 4, 128, 64, True, 0.0, False), id="gpu-causal", marks=ON_GPU),
        pytest.param(
            (2, 4, 2, 256, 128, False, 0.2, True), id="gpu-gqa-mask-dropout", marks=ON_GPU
        ),
    ],
)
def test_eager_plan_matches_registered_op(case, device):
    # An eager `attention` call takes its layout's plan (`attention._EagerPlan`: made on the
    # first call, its launches bound then, taken by every later call). Each call gives what
    # the registered op gives through the dispatcher from the same seed, forward and backward
    # (bit for bit on the CPU; on a GPU dQ sums in a varying order), with a dense and a
    # strided upstream gradient; without autograd its forward alone.
    b, h, h_kv, n, d, causal, p, padded = case
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = make_qkv(b, h, n, n, d, dtype, device)
    k, v = k[:, :h_kv].contiguous(), v[:, :h_kv].contiguous()
    kpm = None
    if padded:
        kpm = torch.rand(b, n, device=device) > 0.25
        kpm[:, 0] = True
    seed = torch.tensor(77, device=device)
    scale = 1.0 / math.sqrt(d)
    wide = torch.randn(b, h, n, 2 * d, device=device).to(dtype)
    tol = 0 if device == "cpu" else 2e-2
    for dout in (torch.randn(b, h, n, d, device=device).to(dtype), wide[..., ::2]):
        results = []
        for registered in (False, False, True):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            if registered:
                out = attn_mod.flash_attention_op(*leaves, kpm, seed, causal, scale, p, True)
                out = out[0].transpose(1, 2)
            else:
                out = attention(
                    *leaves, causal=causal, key_padding_mask=kpm, dropout_p=p,
                    use_triton=True, seed=seed,
                )  # fmt: skip
            out.backward(dout)
            results.append((out, *(t.grad for t in leaves)))
        for got in results[:2]:
            for a, want in zip(got, results[2], strict=True):
                torch.testing.assert_close(a, want, rtol=tol, atol=tol)
    assert len(attn_mod._EAGER_PLANS.plans) == 1
    with torch.no_grad():
        got = attention(q, k, v, causal=causal, key_padding_mask=kpm, dropout_p=p,
                        use_triton=True, seed=seed)  # fmt: skip
    torch.testing.assert_close(got, results[2][0], rtol=tol, atol=tol)
    assert len(attn_mod._EAGER_PLANS.plans) == 1


@pytest.mark.parametrize(
    "case",
    [
        pytest.param((2, 2, 20, 16, True, 0.0, False), id="causal"),
        pytest.param((1, 2, 24, 32, False, 0.3, True), id="mask-dropout"),
        pytest.param((2, 4, 128, 64, True, 0.0, False), id="gpu-causal", marks=ON_GPU),
        pytest.param((2, 2, 256, 128, False, 0.2, True), id="gpu-mask-dropout", marks=ON_GPU),
    ],
)
def test_eager_packed_plan_matches_registered_op(case, device):
    # An eager `attention_packed` call takes its layout's plan (`_PACKED_PLANS`): what the
    # registered packed op gives through the dispatcher from the same seed, forward and d(qkv)
    # (bit for bit on the CPU; on a GPU dQ sums in a varying order), with a dense and a
    # strided upstream gradient; without autograd its forward alone.
    b, h, n, d, causal, p, padded = case
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    qkv = (0.2 + torch.randn(b, n, 3 * h * d, device=device)).to(dtype)
    kpm = None
    if padded:
        kpm = torch.rand(b, n, device=device) > 0.25
        kpm[:, 0] = True
    seed = draw_seeds(device, 2)[1]  # a view 8 bytes into its buffer
    scale = 1.0 / math.sqrt(d)
    wide = torch.randn(b, n, 2 * h * d, device=device).to(dtype)
    tol = 0 if device == "cpu" else 2e-2
    attn_mod._PACKED_PLANS.plans.clear()
    for dout in (torch.randn(b, n, h * d, device=device).to(dtype), wide[..., ::2]):
        results = []
        for registered in (False, False, True):
            leaf = qkv.detach().requires_grad_()
            if registered:
                qkv5 = leaf.unflatten(-1, (3, h, -1))
                out = flash_attention_packed_op(qkv5, kpm, seed, causal, scale, p, True)[0]
                out = out.view(b, n, -1)
            else:
                out = attention_packed(
                    leaf, h, causal=causal, key_padding_mask=kpm, dropout_p=p,
                    use_triton=True, seed=seed,
                )  # fmt: skip
            out.backward(dout)
            results.append((out, leaf.grad))
        for got in results[:2]:
            for a, want in zip(got, results[2], strict=True):
                torch.testing.assert_close(a, want, rtol=tol, atol=tol)
    assert len(attn_mod._PACKED_PLANS.plans) == 1
    with torch.no_grad():
        got = attention_packed(qkv, h, causal=causal, key_padding_mask=kpm, dropout_p=p,
                               use_triton=True, seed=seed)  # fmt: skip
    torch.testing.assert_close(got, results[2][0], rtol=tol, atol=tol)
    assert len(attn_mod._PACKED_PLANS.plans) == 1


def test_eager_packed_plan_keeps_the_checks(device):
    # the packed generic path's errors still come after a plan exists, heads=2.0 included
    qkv = torch.randn(1, 8, 3 * 2 * 16, device=device)
    attention_packed(qkv, 2, use_triton=True)
    with pytest.raises(ValueError, match="3 · heads"):
        attention_packed(qkv, 2.0, use_triton=True)
    with pytest.raises(ValueError, match="3 · heads"):
        attention_packed(qkv, 5, use_triton=True)
    with pytest.raises(ValueError, match="dropout_p"):
        attention_packed(qkv, 2, dropout_p=1.0, use_triton=True)
    with pytest.raises(ValueError, match="qkv must be"):
        attention_packed(qkv[0], 2, use_triton=True)
    assert len(attn_mod._PACKED_PLANS.plans) == 1


def test_eager_plan_keeps_the_checks(device):
    # A plan is taken only by calls of its validated layout: the generic path's errors still
    # come after one exists.
    q, k, v = make_qkv(1, 2, 8, 8, 16, torch.float32, device)
    attention(q, k, v, use_triton=True)
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], k, v, use_triton=True)
    with pytest.raises(ValueError, match="head dim"):
        attention(q[..., :8], k[..., :8], v[..., :8], use_triton=True)
    with pytest.raises(TypeError, match="scale"):
        attention(q, k, v, scale=float("nan"), use_triton=True)
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, k, v, dropout_p=1.0, use_triton=True)
    with pytest.raises(TypeError, match="key_padding_mask"):
        attention(q, k, v, key_padding_mask=torch.ones(1, 8, device=device), use_triton=True)
    assert len(attn_mod._EAGER_PLANS.plans) == 1
