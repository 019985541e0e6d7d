"""Fused residual (+ dropout) + LayerNorm: the Triton op vs a float64 run of the PyTorch branch.

With dropout the Triton mask is read back from the op itself (branch is never zero, so a
dropped element is exactly h_new == h) and the float64 reference applies that same mask; the
backward must then use the same mask too (dbranch is compared against the reference's).
CPU runs use Triton's interpreter with small shapes; the looped path (rows longer than one
block) is reached by monkeypatching `layernorm.MAX_BLOCK_N` down.
"""

import importlib
import math

import pytest
import torch
from test_layernorm import _assert_close  # row-wise relative error, NaN/inf fail

from triton_transformer.layernorm import layernorm
from triton_transformer.residual_layernorm import (
    residual_layernorm,
    residual_layernorm_backward_op,
    residual_layernorm_op,
)
from triton_transformer.utils import draw_seed

ln_mod = importlib.import_module("triton_transformer.layernorm")

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _inputs(shape, dtype=torch.float32, device="cpu", bias=True, branch_dtype=None):
    """Off-centre residual stream, never-zero branch, random weight/bias."""
    N = shape[-1]
    h = (-2.3 + 0.5 * torch.randn(shape, device=device)).to(dtype)
    sign = torch.where(torch.rand(shape, device=device) < 0.5, -1.0, 1.0)
    br = (sign * (0.2 + torch.rand(shape, device=device))).to(branch_dtype or dtype)
    w = (1.0 + 0.5 * torch.randn(N, device=device)).to(dtype)
    b = (0.3 * torch.randn(N, device=device)).to(dtype) if bias else None
    return h, br, w, b


def _run(h, br, w, b, dy, dhn, p=0.0, stable=False, eps=1e-5, seed=None):
    """Triton forward + backward; returns (h_new, y, dh, dbranch, dw[, db]) and the keep mask."""
    leaves = [t.detach().clone().requires_grad_() for t in (h, br, w)]
    if b is not None:
        leaves.append(b.detach().clone().requires_grad_())
    bias = leaves[3] if b is not None else None
    if seed is None:
        h_new, y = residual_layernorm(
            *leaves[:3], bias, dropout_p=p, eps=eps, stable=stable, use_triton=True
        )
    else:
        h_new, y, _ = residual_layernorm_op(*leaves[:3], bias, eps, stable, p, seed)
    keep = (h_new.detach() != h.to(h_new.dtype)) if p > 0 else torch.ones_like(h, dtype=bool)
    grads = torch.autograd.grad((h_new, y), leaves, (dhn.to(h_new.dtype), dy.to(y.dtype)))
    return (h_new, y, *grads), keep


def _reference(h, br, w, b, dy, dhn, keep, h_new_op, p=0.0, stable=False, eps=1e-5):
    """The PyTorch branch in float64, with the given keep mask as the dropout.

    Both branches normalise the sum *as stored* (rounded to its dtype), so the reference
    normalises the op's h_new (straight-through: the gradient is that of the exact sum). With
    nearly equal elements LayerNorm amplifies that rounding, which is not the kernel's error.
    """
    leaves = [t.detach().double().requires_grad_() for t in (h, br, w)]
    if b is not None:
        leaves.append(b.detach().double().requires_grad_())
    bias = leaves[3] if b is not None else None
    dropped = torch.where(keep, leaves[1] / (1 - p), 0.0)
    h_new, _ = residual_layernorm(leaves[0], dropped, leaves[2], bias, eps=eps, stable=stable)
    h_new = h_new + (h_new_op.detach().double() - h_new).detach()
    y = layernorm(h_new, leaves[2], bias, eps=eps, stable=stable)
    grads = torch.autograd.grad((h_new, y), leaves, (dhn.double(), dy.double()))
    return (h_new, y, *grads)


def _check(h, br, w, b, p=0.0, stable=False, eps=1e-5, tol=None, seed=None):
    dy = torch.randn(h.shape, device=h.device)
    dhn = torch.randn(h.shape, device=h.device)
    out, keep = _run(h, br, w, b, dy, dhn, p, stable, eps, seed)
    # dy and dhn as the op saw them (rounded to the output dtype).
    dtype = out[0].dtype
    ref = _reference(h, br, w, b, dy.to(dtype), dhn.to(dtype), keep, out[0], p, stable, eps)
    tol = tol or max(TOL[h.dtype], TOL[br.dtype])
    names = ["h_new", "y", "dh", "dbranch", "dweight", "dbias"]
    likes = [out[0], out[0], h, br, w, b]
    for name, o, r, like in zip(names, out, ref, likes, strict=False):
        assert o.dtype == like.dtype, f"{name}: dtype {o.dtype}, expected {like.dtype}"
        _assert_close(o, r, tol, name)
    return out, keep


@pytest.mark.parametrize("N", [7, 37, 100, 256])
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp64(N, stable, bias, device):
    h, br, w, b = _inputs((70, N), device=device, bias=bias)
    _check(h, br, w, b, stable=stable)


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("stable", [False, True])
def test_dropout_matches_fp64_with_its_mask(p, stable, device):
    h, br, w, b = _inputs((64, 100), device=device)
    _, keep = _check(h, br, w, b, p=p, stable=stable)
    # The mask is a real dropout mask: kept fraction within 6 sigma of 1 - p.
    sigma = math.sqrt(p * (1 - p) / keep.numel())
    assert abs(keep.double().mean().item() - (1 - p)) <= 6 * sigma


@pytest.mark.parametrize("N", [33, 100])
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_looped_long_rows(N, stable, p, device, monkeypatch):
    monkeypatch.setattr(ln_mod, "MAX_BLOCK_N", 32)
    h, br, w, b = _inputs((10, N), device=device)
    _check(h, br, w, b, p=p, stable=stable)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_low_precision(dtype, p, device):
    h, br, w, b = _inputs((24, 100), dtype=dtype, device=device)
    _check(h, br, w, b, p=p, stable=True)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_fp32_stream_with_bf16_branch(p, device):
    # As under autocast: an fp32 residual stream plus a bf16 matmul output -> fp32 h_new and y,
    # dh in fp32 and dbranch in bf16.
    h, br, w, b = _inputs((16, 100), device=device, branch_dtype=torch.bfloat16)
    out, _ = _check(h, br, w, b, p=p, tol=1e-2)
    assert out[0].dtype == out[1].dtype == torch.float32
    assert out[2].dtype == torch.float32 and out[3].dtype == torch.bfloat16


def test_strided_and_4d(device):
    base_h, _, w, b = _inputs((2, 3, 6, 50), device=device)
    _, base_br, _, _ = _inputs((2, 6, 3, 50), device=device)
    # Row-strided 4-D views with a unit-stride last dim (rows passed by stride, or copied
    # once where no 2-D view exists) ...
    h = base_h[:, :, 1:4, 5:45]
    br = base_br.transpose(1, 2)[:, :, 1:4, 5:45]
    _check(h, br, w[5:45], b[5:45], p=0.25)
    # ... and a branch whose last dim is strided.
    br_t = br.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert br_t.stride(-1) != 1
    _check(h, br_t, w[5:45], b[5:45], stable=True)


def test_mask_reproducible_and_fresh(device):
    h, br, w, b = _inputs((32, 64), device=device)
    torch.manual_seed(11)
    a, _ = residual_layernorm(h, br, w, b, dropout_p=0.5, use_triton=True)
    c, _ = residual_layernorm(h, br, w, b, dropout_p=0.5, use_triton=True)
    torch.manual_seed(11)
    a2, _ = residual_layernorm(h, br, w, b, dropout_p=0.5, use_triton=True)
    assert torch.equal(a, a2)
    assert not torch.equal(a != h, c != h)
    # The mask is a function of the seed tensor only.
    s = draw_seed(device)
    m1 = residual_layernorm_op(h, br, w, b, 1e-5, False, 0.5, s)[0] != h
    m2 = residual_layernorm_op(h, br, w, b, 1e-5, False, 0.5, s.clone())[0] != h
    m3 = residual_layernorm_op(h, br, w, b, 1e-5, False, 0.5, s + 1)[0] != h
    assert torch.equal(m1, m2) and not torch.equal(m1, m3)


def test_backward_uses_forward_mask_across_interleaved_calls(device):
    # Each call saves its own seed: two interleaved calls backpropagate their own masks.
    outs = []
    for _ in range(2):
        h, br, w, b = _inputs((20, 48), device=device)
        br.requires_grad_()
        h_new, _ = residual_layernorm(h, br, w, b, dropout_p=0.5, use_triton=True)
        outs.append((h, br, h_new))
    sum(h_new.sum() for _, _, h_new in outs).backward()
    for h, br, h_new in outs:
        keep = h_new != h
        torch.testing.assert_close(br.grad, torch.where(keep, 2.0, 0.0), rtol=0, atol=0)


@pytest.mark.parametrize("use_triton", [False, True])
def test_eval_and_p0_are_plain_add(use_triton, device):
    h, br, w, b = _inputs((8, 40), device=device)
    for kwargs in ({"dropout_p": 0.0}, {"dropout_p": 0.5, "training": False}):
        h_new, y = residual_layernorm(h, br, w, b, use_triton=use_triton, **kwargs)
        torch.testing.assert_close(h_new, h + br, rtol=0, atol=0)
        expected = layernorm((h + br).double(), w.double(), b.double())
        _assert_close(y, expected, 1e-5, "y")


def test_outputs_are_fresh(device):
    h, br, w, b = _inputs((2, 5, 40), device=device)
    h_new, y = residual_layernorm(h, br, w, b, use_triton=True)
    assert h_new._base is None and y._base is None
    assert h_new.data_ptr() != h.data_ptr()
    y.add_(1.0)
    h_new.mul_(2.0)


def test_reads_a_layernorm_modules_parameters(device):
    # The model calls the functional op with its LayerNorm modules' weight and bias.
    from triton_transformer.layernorm import LayerNorm

    norm = LayerNorm(40, bias=False).to(device)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    h, br, _, _ = _inputs((3, 7, 40), device=device)
    h_new, y = residual_layernorm(h, br, norm.weight, norm.bias, eps=norm.eps, use_triton=True)
    torch.testing.assert_close(h_new, h + br)
    torch.testing.assert_close(y, norm(h + br), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_registered_custom_op(p, device):
    h, br, w, b = _inputs((6, 33), device=device)
    seed = draw_seed(device)
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    args = (h.requires_grad_(), br.requires_grad_(), w.requires_grad_(), b.requires_grad_())
    torch.library.opcheck(residual_layernorm_op, (*args, 1e-5, True, p, seed), test_utils=tests)
    h_new, _, stats = residual_layernorm_op(*args, 1e-5, True, p, seed)
    # Detached: the backward op has no autograd of its own (once-differentiable).
    bwd_args = (torch.randn_like(h), torch.randn_like(h), h_new.detach(), w.detach(), b.detach(),
                stats, 1e-5, True, p, seed, h.dtype, br.dtype)  # fmt: skip
    for accs in ((None, None), (torch.randn_like(w), torch.randn_like(b))):  # .grad accumulators
        torch.library.opcheck(residual_layernorm_backward_op, (*bwd_args, *accs), test_utils=tests)


@pytest.mark.parametrize("output", [0, 1], ids=["h_new", "y"])
def test_double_backward_raises(output, device, assert_first_order_only):
    h, br, w, b = _inputs((4, 16), device=device)
    br.requires_grad_()

    def f(br):
        return residual_layernorm(h, br, w, b, dropout_p=0.2, use_triton=True)[output]

    assert_first_order_only(f, br, "residual_layernorm")


def test_validation_errors(device):
    h, br, w, b = _inputs((4, 8), device=device)
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="branch shape"):
            residual_layernorm(h, br[:2], w, b, use_triton=use_triton)
        for p in (1.0, -0.1, float("nan")):
            with pytest.raises(ValueError, match="dropout_p"):
                residual_layernorm(h, br, w, b, dropout_p=p, use_triton=use_triton)
        with pytest.raises(TypeError, match="dropout_p"):
            residual_layernorm(h, br, w, b, dropout_p="0.1", use_triton=use_triton)
        with pytest.raises(ValueError, match="weight"):
            residual_layernorm(h, br, w[:3], b, use_triton=use_triton)
    with pytest.raises(TypeError, match="branch"):
        residual_layernorm(h, br.to(torch.int32), w, b, use_triton=True)


@pytest.mark.parametrize("shape", [(0, 37), (5, 0)])
def test_zero_size(shape, device):
    h, br, w, b = _inputs(shape, device=device)
    leaves = [t.requires_grad_() for t in (h, br, w, b)]
    h_new, y = residual_layernorm(*leaves, dropout_p=0.1, use_triton=True)
    assert h_new.shape == y.shape == h.shape
    (h_new.sum() + y.sum()).backward()
    assert h.grad.shape == h.shape and br.grad.shape == br.shape
    assert torch.equal(w.grad, torch.zeros_like(w))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("N", [512, 1000, 4096, 16384, 20000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_realistic(N, dtype, p, stable, device):
    M = 2048 if N <= 4096 else 256
    h, br, w, b = _inputs((M, N), dtype=dtype, device=device)
    _check(h, br, w, b, p=p, stable=stable)


@pytest.mark.gpu
def test_gpu_over_2_31_elements_mask_differs(device):
    # 64-bit element indices for the mask past 2**31 elements: rows there are not repeats.
    M, N = 2**31 // 4096 + 2, 4096
    h = torch.zeros((M, N), dtype=torch.bfloat16, device=device)
    br = torch.ones_like(h)
    w = torch.ones(N, dtype=torch.bfloat16, device=device)
    h_new, _ = residual_layernorm(h, br, w, dropout_p=0.5, use_triton=True)
    keep = h_new != 0
    assert not torch.equal(keep[:2], keep[-2:])
    frac = keep[-2:].double().mean().item()
    assert abs(frac - 0.5) < 6 * math.sqrt(0.25 / (2 * N))


@pytest.mark.gpu
def test_gpu_cuda_graph_fresh_masks_and_backward_mask(device):
    h, br, w, b = _inputs((256, 512), dtype=torch.bfloat16, device=device)
    br.requires_grad_()
    dy = torch.randn(h.shape, device=device, dtype=h.dtype)
    from triton_transformer.cuda_graph import capture_graph

    def step():
        h_new, y = residual_layernorm(h, br, w, b, dropout_p=0.5, use_triton=True)
        torch.autograd.backward((h_new, y), (torch.ones_like(h), dy))
        return h_new, y

    graph, (h_new, _) = capture_graph(step, clear_grads=(br,))
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        keep = h_new != h
        # d(h_new)/d(branch) is the mask * 2 on the ones part; y's part goes through the mask too.
        assert torch.equal(br.grad == 0, ~keep)
        masks.append(keep)
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.gpu
def test_gpu_compiles_without_graph_breaks(device):
    def f(h, br, w):
        h_new, y = residual_layernorm(h, br.sin(), w, dropout_p=0.1, use_triton=True)
        return h_new.float().sum() + y.float().cos().sum()

    h, br, w, _ = _inputs((64, 1000), dtype=torch.bfloat16, device=device, bias=False)
    leaves = [t.requires_grad_() for t in (h, br, w)]
    explanation = torch._dynamo.explain(f)(*leaves)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    out = torch.compile(f)(*leaves)
    grads = torch.autograd.grad(out, leaves)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("used", ["h_new", "y"])
def test_one_output_unused(used, device):
    # The last block's h_new, or a y nobody reads: backward through the other output alone.
    h, br, w, b = _inputs((6, 40), device=device)
    leaves = [t.requires_grad_() for t in (h, br, w, b)]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    outs = residual_layernorm(*leaves, use_triton=True)
    ref_outs = residual_layernorm(*ref_leaves)
    k = 0 if used == "h_new" else 1
    dy = torch.randn(h.shape, device=device)
    grads = torch.autograd.grad(outs[k], leaves, dy, allow_unused=True)
    ref_grads = torch.autograd.grad(ref_outs[k], ref_leaves, dy.double(), allow_unused=True)
    for got, want, like, name in zip(grads, ref_grads, leaves, ("dh", "dbranch", "dw", "db"),
                                     strict=True):  # fmt: skip
        # Our op always returns parameter gradients (zeros when only h_new is used).
        want = torch.zeros_like(like, dtype=torch.float64) if want is None else want
        got = torch.zeros_like(like) if got is None else got
        _assert_close(got, want, 1e-5, name)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_out_dtype_keeps_fp32_stream(use_triton, p, device):
    # Under autocast the model asks for y in bf16 (the next matmul's dtype) while h_new stays
    # the fp32 residual stream; the gradient of y arrives in bf16.
    h, br, w, b = _inputs((16, 100), device=device, branch_dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (h, br, w, b)]
    torch.manual_seed(3)
    h_new, y = residual_layernorm(
        *leaves[:3], leaves[3], dropout_p=p, use_triton=use_triton, out_dtype=torch.bfloat16
    )
    assert h_new.dtype == torch.float32 and y.dtype == torch.bfloat16
    keep = (h_new.detach() != h) if p > 0 else torch.ones_like(h, dtype=torch.bool)
    dy = torch.randn(h.shape, device=device).to(torch.bfloat16)
    dhn = torch.randn(h.shape, device=device)
    grads = torch.autograd.grad((h_new, y), leaves, (dhn, dy))
    ref = _reference(h, br, w, b, dy, dhn, keep, h_new, p)
    _assert_close(h_new, ref[0], 1e-5, "h_new")
    _assert_close(y, ref[1], 1e-2, "y")
    names = ["dh", "dbranch", "dweight", "dbias"]
    for name, g, r, like, tol in zip(names, grads, ref[2:], leaves, [1e-5, 1e-2, 1e-5, 1e-5],
                                     strict=True):  # fmt: skip
        assert g.dtype == like.dtype, name
        _assert_close(g, r, tol, name)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize(
    "shape, dtype, branch_dtype, p, out_dtype",
    [
        ((3, 17, 48), torch.float32, None, 0.0, None),
        ((40, 100), torch.float32, torch.float16, 0.3, torch.float16),
        ((2, 5, 64), torch.float16, None, 0.2, None),
    ],
)
def test_eager_plan_matches_registered_op(
    shape, dtype, branch_dtype, p, out_dtype, bias, stable, device
):
    # An eager call takes its layout's plan (`residual_layernorm._EagerPlan`: made on the first
    # call, its launches bound then, taken by every later call). Both calls give, bit for bit,
    # what the registered op gives through the dispatcher from the same seed, forward and
    # backward: both outputs used (dense upstream gradients, one strided over columns, or one
    # with rows of a stride of their own against a dense other: a slice's gradient from
    # torch.cat) or y alone.
    import triton_transformer.residual_layernorm as rln_mod

    h, br, w, b = _inputs(shape, dtype, device, bias, branch_dtype)
    seed = torch.tensor(4321, device=device)
    sum_dtype = torch.promote_types(h.dtype, br.dtype)
    y_dtype = out_dtype or sum_dtype
    wide = (*shape[:-1], 2 * shape[-1])
    dense = lambda dt: torch.randn(shape, device=device).to(dt)
    padded = lambda dt: torch.randn(wide, device=device).to(dt)[..., : shape[-1]]
    upstreams = [
        (dense(y_dtype), dense(sum_dtype)),
        (dense(y_dtype), torch.randn(wide, device=device).to(sum_dtype)[..., ::2]),
        (dense(y_dtype), padded(sum_dtype)),
        (padded(y_dtype), dense(sum_dtype)),
        (dense(y_dtype), None),
    ]
    for dy, dhn in upstreams:
        results = []
        for registered in (False, False, True):
            leaves = [t.detach().requires_grad_() for t in (h, br, w, b) if t is not None]
            hl, brl, wl, bl = (*leaves, None)[:4]
            if registered:
                h_new, y, _ = residual_layernorm_op(
                    hl, brl, wl, bl, 1e-5, stable, p, seed if p else wl, out_dtype
                )
            else:
                h_new, y = residual_layernorm(
                    hl, brl, wl, bl, dropout_p=p, stable=stable, use_triton=True,
                    out_dtype=out_dtype, seed=seed,
                )  # fmt: skip
            if dhn is None:
                torch.autograd.backward(y, dy)
            else:
                torch.autograd.backward((h_new, y), (dhn, dy))
            results.append((h_new, y, *(t.grad for t in leaves)))
        for got in results[:2]:
            for a, want in zip(got, results[2], strict=True):
                assert torch.equal(a, want)
    assert len(rln_mod._EAGER_PLANS.plans) == 1
    with torch.no_grad():
        got = residual_layernorm(h, br, w, b, dropout_p=p, stable=stable, use_triton=True,
                                 out_dtype=out_dtype, seed=seed)  # fmt: skip
    for a, want in zip(got, results[2][:2], strict=True):
        assert torch.equal(a, want)
    assert len(rln_mod._EAGER_PLANS.plans) == 1


def test_eager_plan_keeps_the_checks(device):
    # A plan is taken only by calls of its validated layout: the generic path's errors still
    # come after one exists.
    import triton_transformer.residual_layernorm as rln_mod

    h, br, w, b = _inputs((6, 16), device=device)
    residual_layernorm(h, br, w, b, use_triton=True)
    with pytest.raises(ValueError, match="branch shape"):
        residual_layernorm(h, br[:3], w, b, use_triton=True)
    with pytest.raises(ValueError, match="weight must have shape"):
        residual_layernorm(h, br, w[:8], b, use_triton=True)
    with pytest.raises(ValueError, match="dropout_p"):
        residual_layernorm(h, br, w, b, dropout_p=1.0, use_triton=True)
    assert len(rln_mod._EAGER_PLANS.plans) == 1


@pytest.mark.parametrize("order", ["plain_first", "residual_first"])
def test_plain_and_row_broadcast_residual_calls_keep_their_own_launches(order, device):
    """A residual call at p = 0 whose h and branch both have row stride 0 (`expand`ed rows)
    and a plain layernorm of the same (M, N) once shared the forward's bound launch: every
    other fact of their keys is equal, so whichever ran second took the other's kernel
    (the residual call then returned h_new unwritten; the plain one wrote x[0] + x[0] into
    its own input x). Each must match its reference, in either order, and leave x as it was."""
    M, N = 6, 40
    gen = torch.Generator().manual_seed(7)
    w, b = (torch.randn(N, generator=gen).to(device) for _ in range(2))
    x = (torch.randn(M, N, generator=gen) + 1.0).to(device)
    h = (torch.randn(1, N, generator=gen) - 0.5).to(device).expand(M, N)
    branch = (torch.randn(1, N, generator=gen) + 0.5).to(device).expand(M, N)
    x_before = x.clone()

    def plain():
        y = layernorm(x, w, b, use_triton=True)
        _assert_close(y, layernorm(x.double(), w.double(), b.double()), 1e-5)
        assert torch.equal(x, x_before)

    def residual():
        h_new, y = residual_layernorm(h, branch, w, b, use_triton=True)
        h_ref, y_ref = residual_layernorm(h.double(), branch.double(), w.double(), b.double())
        _assert_close(h_new, h_ref, 1e-5)
        _assert_close(y, y_ref, 1e-5)

    calls = (plain, residual) if order == "plain_first" else (residual, plain)
    for call in (*calls, *calls):  # the second round takes the plans the first one made
        call()
