"""RoPE: the fused Triton kernel (q and k, forward and the inverse-rotation backward) against a
float64 run of the PyTorch branch, on (batch, heads, seq, head_dim) inputs: contiguous, strided
views of a packed qkv projection, transposed, with q and k head counts that differ, with and
without device positions ((n,) and (b, n)), fp32/fp16/bf16."""

import importlib

import pytest
import torch
from _modern_helpers import LOW_PRECISION, TOL, assert_close, grads

from triton_transformer.rope import rope, rope_op

rope_mod = importlib.import_module("triton_transformer.rope")


def _qk(b, hq, hk, n, d, dtype=torch.float32, device="cpu"):
    q = (0.4 + torch.randn(b, hq, n, d, device=device)).to(dtype)
    k = (-0.3 + torch.randn(b, hk, n, d, device=device)).to(dtype)
    return q, k


def _check(q, k, positions=None, tol=1e-5, base=10000.0):
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    f = lambda q, k: rope(q, k, positions, base=base, use_triton=True)
    r = lambda q, k: rope(q, k, positions, base=base)
    out, gs = grads(f, (q, k), (dq, dk))
    ref, rgs = grads(r, (q.double(), k.double()), (dq.double(), dk.double()))
    for name, o, e, like in zip(
        ("q", "k", "dq", "dk"), (*out, *gs), (*ref, *rgs), (q, k, q, k), strict=True
    ):
        assert o.dtype == like.dtype and o.shape == like.shape, name
        assert_close(o, e, tol, name)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("shape", [(2, 3, 3, 7, 8), (1, 4, 2, 33, 6), (3, 1, 1, 1, 2)])
def test_forward_backward(shape, dtype, device):
    # odd seq lengths, head_dim 2, 6 (half 3: a masked block) and 8, more q heads than k
    q, k = _qk(*shape, dtype=dtype, device=device)
    _check(q, k, tol=TOL[dtype])


@pytest.mark.parametrize("pos_shape", ["n", "bn"])
def test_positions(pos_shape, device):
    b, n = 2, 9
    q, k = _qk(b, 2, 2, n, 16, device=device)
    positions = torch.randint(0, 200, (n,) if pos_shape == "n" else (b, n), device=device)
    _check(q, k, positions, tol=2e-5)
    # int32 positions, a strided (b, n) view, another base
    pos32 = torch.randint(0, 50, (b, 2 * n), device=device, dtype=torch.int32)[:, ::2]
    _check(q, k, pos32, tol=2e-5, base=500000.0)


def test_default_positions_are_arange(device):
    q, k = _qk(2, 2, 2, 11, 8, device=device)
    a = rope(q, k, use_triton=True)
    b = rope(q, k, torch.arange(11, device=device), use_triton=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # position 0 is the identity; an offset sequence equals a slice of a longer one
    torch.testing.assert_close(a[0][:, :, 0], q[:, :, 0])
    tail = rope(q[:, :, 4:], k[:, :, 4:], torch.arange(4, 11, device=device), use_triton=True)
    torch.testing.assert_close(tail[0], a[0][:, :, 4:], rtol=1e-6, atol=1e-6)


def test_strided_inputs(device):
    # q, k as the model takes them from its qkv projection: views with row stride 3·h·d
    b, n, h, d = 2, 5, 3, 8
    qkv = torch.randn(b, n, 3, h, d, device=device)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    _check(q, k)
    # a non-unit last stride (copied first) and a transposed batch/heads layout
    big = torch.randn(h, b, n, 2 * d, device=device)
    _check(big[..., ::2].transpose(0, 1), big[..., 1::2].transpose(0, 1))


def test_rotation_preserves_norms_and_relative_scores(device):
    # what makes it RoPE: |R x| = |x|, and <R_m q, R_n k> depends on m - n only
    q, k = _qk(1, 1, 1, 6, 16, device=device)
    qr, _ = rope(q, k, use_triton=True)
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-5)
    q0, k0 = q[:, :, :1].expand_as(q), k[:, :, :1].expand_as(k)
    s = (rope(q0, k0, use_triton=True)[0] * rope(q0, k0, use_triton=True)[1].roll(1, 2)).sum(-1)
    torch.testing.assert_close(s[..., 2:], s[..., 1:2].expand(-1, -1, 4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_triton", [False, True])
def test_with_and_without_grad_recording(use_triton, device):
    q, k = _qk(2, 2, 1, 7, 8, device=device)
    with torch.no_grad():
        a = rope(q, k, use_triton=use_triton)
    b = rope(q.requires_grad_(), k, use_triton=use_triton)
    assert b[0].requires_grad and not a[0].requires_grad
    assert torch.equal(a[0], b[0].detach()) and torch.equal(a[1], b[1].detach())
    assert b[0].data_ptr() != q.data_ptr()


def test_registered_custom_op(device):
    q, k = _qk(2, 2, 1, 7, 8, device=device)
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    args = (q.requires_grad_(), k.requires_grad_())
    torch.library.opcheck(rope_op, (*args, None, 10000.0, False), test_utils=tests)
    pos = torch.arange(3, 10, device=device)
    torch.library.opcheck(rope_op, (*args, pos, 10000.0, True), test_utils=tests)


@pytest.mark.parametrize("positions", [None, "n", "bn"])
@pytest.mark.parametrize("layout", ["contiguous", "qkv view"])
def test_eager_plan_matches_registered_op(layout, positions, device):
    # An eager call takes its layout's plan (`rope._EagerPlan`: made on the first call, its
    # launches bound then, taken by every later call). Both calls give, bit for bit, what the
    # registered op gives through the dispatcher, forward and backward, with dense, strided
    # (non-unit last stride: copied) and one absent (zero-filled) upstream gradient.
    b, hq, hk, n, d = 2, 4, 2, 7, 8
    if layout == "contiguous":
        q, k = _qk(b, hq, hk, n, d, torch.float16, device)
    else:  # views of a packed projection, as the model takes them
        proj = torch.randn(b, n, hq + 2 * hk, d, device=device)
        q, k = proj[:, :, :hq].transpose(1, 2), proj[:, :, hq : hq + hk].transpose(1, 2)
    pos = None
    if positions is not None:
        pos = torch.randint(0, 99, (n,) if positions == "n" else (b, n), device=device)
    wide = torch.randn(b, hq, n, 2 * d, device=device).to(q.dtype)
    upstreams = [
        (torch.randn_like(q), torch.randn_like(k)),
        (wide[..., ::2], torch.randn_like(k).transpose(1, 2).contiguous().transpose(1, 2)),
        (torch.randn_like(q), None),
    ]
    for dqo, dko in upstreams:
        results = []
        for registered in (False, False, True):
            ql, kl = (t.detach().requires_grad_() for t in (q, k))
            if registered:
                qo, ko = rope_op(ql, kl, pos, 10000.0, False)
            else:
                qo, ko = rope(ql, kl, pos, use_triton=True)
            outs, ups = ((qo,), (dqo,)) if dko is None else ((qo, ko), (dqo, dko))
            torch.autograd.backward(outs, ups)
            results.append((qo, ko, ql.grad, kl.grad))
        for got in results[:2]:
            for a, want in zip(got, results[2], strict=True):
                assert torch.equal(a, want) and a.stride() == want.stride()
    assert len(rope_mod._EAGER_PLANS.plans) == 1
    with torch.no_grad():  # the plan's forward alone
        for a, want in zip(rope(q, k, pos, use_triton=True), results[2][:2], strict=True):
            assert torch.equal(a, want)


def test_eager_plan_keeps_the_checks(device):
    # A plan is taken only by calls of its validated layout: the generic path's errors still
    # come after one exists.
    q, k = _qk(2, 2, 2, 5, 8, device=device)
    rope(q, k, use_triton=True)
    with pytest.raises(ValueError, match="must match q"):
        rope(q, k[:1], use_triton=True)
    with pytest.raises(ValueError, match="base"):
        rope(q, k, base=-1.0, use_triton=True)
    with pytest.raises(ValueError, match="positions must have shape"):
        rope(q, k, torch.arange(4, device=device), use_triton=True)
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        rope(q, k, torch.zeros(5, device=device), use_triton=True)
    assert len(rope_mod._EAGER_PLANS.plans) == 1


def test_double_backward_raises(device, assert_first_order_only):
    q, k = _qk(1, 2, 2, 5, 8, device=device)
    q.requires_grad_()
    assert_first_order_only(lambda q: rope(q, k, use_triton=True)[0], q, "rope")


def test_validation_errors(device):
    q, k = _qk(2, 2, 2, 5, 8, device=device)
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="4-D"):
            rope(q[0], k, use_triton=use_triton)
        with pytest.raises(ValueError, match="must match q"):
            rope(q, k[:, :, :3], use_triton=use_triton)
        with pytest.raises(ValueError, match="even"):
            rope(q[..., :5], k[..., :5], use_triton=use_triton)
        with pytest.raises(ValueError, match="positions must have shape"):
            rope(q, k, torch.arange(4, device=device), use_triton=use_triton)
        with pytest.raises(TypeError, match="integer"):
            rope(q, k, torch.arange(5, device=device).float(), use_triton=use_triton)
        with pytest.raises(ValueError, match="base"):
            rope(q, k, base=0.0, use_triton=use_triton)
    with pytest.raises(TypeError, match="dtype"):
        rope(q.double(), k.double(), use_triton=True)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_realistic(d, dtype, device):
    q, k = _qk(4, 12, 4, 1024, d, dtype=dtype, device=device)
    # fp32 angles of positions up to ~1e3 carry ~1e3 * 2**-24 rad of rounding (either branch)
    _check(q, k, tol=TOL[dtype] if dtype != torch.float32 else 2e-4)


@pytest.mark.gpu
def test_gpu_long_positions(device):
    # positions near 2**17: the range reduction keeps the fast sin/cos accurate
    q, k = _qk(1, 4, 4, 256, 128, device=device)
    pos = torch.arange(2**17 - 256, 2**17, device=device)
    out = rope(q, k, pos, use_triton=True)
    ref = rope(q.double(), k.double(), pos)
    # the reference's angles are exact; fp32 angles at 2**17 are off by up to ~2**17 * 2**-24
    assert_close(out[0], ref[0], 2e-2, "q")


@pytest.mark.gpu
def test_gpu_cuda_graph_with_device_positions(device):
    q, k = _qk(2, 4, 4, 1, 64, device=device)
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        rope(q, k, pos, use_triton=True)  # compile outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope(q, k, pos, use_triton=True)
    for p in (3, 77):
        pos.fill_(p)
        graph.replay()
        torch.testing.assert_close(out[0], rope(q, k, pos)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_compiles_without_graph_breaks(device):
    q, k = _qk(2, 4, 4, 128, 64, dtype=torch.bfloat16, device=device)
    leaves = [q.requires_grad_(), k.requires_grad_()]
    f = lambda q, k: sum(t.float().sum() for t in rope(q.sin(), k, use_triton=True))
    explanation = torch._dynamo.explain(f)(*leaves)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.testing.assert_close(torch.compile(f)(*leaves), f(*leaves), rtol=1e-2, atol=1e-1)
