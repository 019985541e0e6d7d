"""RMSNorm and fused residual + RMSNorm: Triton kernels (forward, dx, dweight, the branch
gradient) against a float64 run of the PyTorch branch.

CPU runs use Triton's interpreter at small shapes; the looped (wide-row) paths are reached at
small N by monkeypatching `rmsnorm.MAX_BLOCK_N` down to 16. The compile traces and the sm_90
compilation of every kernel variant are checked in `test_swiglu.py` (one subprocess for all
the modern ops).
"""

import importlib

import pytest
import torch
from _modern_helpers import LOW_PRECISION, TOL, assert_close, grads
from helpers import check_grads_fold_alike, check_launches_bound_per_shape

from triton_transformer.rmsnorm import (
    RMSNorm,
    residual_rmsnorm,
    residual_rmsnorm_backward_op,
    residual_rmsnorm_op,
    rmsnorm,
    rmsnorm_backward_op,
    rmsnorm_op,
)
from triton_transformer.utils import draw_seed

rms_mod = importlib.import_module("triton_transformer.rmsnorm")


@pytest.fixture
def narrow_blocks(monkeypatch):
    """Rows wider than 16 columns loop over column blocks (forward and backward)."""
    monkeypatch.setattr(rms_mod, "MAX_BLOCK_N", 16)
    rms_mod._clear_config_caches()
    yield
    rms_mod._clear_config_caches()


def _inputs(shape, dtype=torch.float32, device="cpu", param_dtype=None):
    """Off-centre x, a random (not all-ones) weight."""
    x = (1.7 + 0.6 * torch.randn(shape, device=device)).to(dtype)
    w = (1.0 + 0.5 * torch.randn(shape[-1], device=device)).to(param_dtype or dtype)
    return x, w


def _check(x, w, tol, eps=1e-5):
    dy = torch.randn(x.shape, device=x.device).to(x.dtype)
    out, gs = grads(lambda a, b: rmsnorm(a, b, eps, use_triton=True), (x, w), (dy,))
    ref, rgs = grads(lambda a, b: rmsnorm(a, b, eps), (x.double(), w.double()), (dy.double(),))
    assert out[0].dtype == x.dtype and gs[0].dtype == x.dtype and gs[1].dtype == w.dtype
    assert_close(out[0], ref[0], tol, "y")
    assert_close(gs[0], rgs[0], tol, "dx")
    assert_close(gs[1], rgs[1], tol, "dweight")


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("shape", [(1, 3), (7, 37), (3, 5, 64), (2, 2, 3, 100)])
def test_forward_backward(shape, dtype, device):
    x, w = _inputs(shape, dtype, device)
    _check(x, w, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_looped_paths(dtype, device, narrow_blocks):
    # N = 37 over 16-column blocks: the two-pass forward and the "loop" backward, with a
    # partial last block; 29 rows over several programs and row tiles.
    x, w = _inputs((29, 37), dtype, device)
    _check(x, w, TOL[dtype])


def test_strided_inputs(device):
    base = 1.0 + torch.randn(11, 2, 80, device=device)
    w = 1.0 + 0.5 * torch.randn(37, device=device)
    _check(base[:, 1, 3:40], w, 1e-5)  # row stride 160: read in place
    _check(base[:, :, :37:2].transpose(0, 1), w[:19], 1e-5)  # column stride 2: copied


def test_mixed_dtypes_and_out_dtype(device):
    # bf16 activations with an fp32 weight, and an fp32 input normalised into bf16 (autocast)
    x, w = _inputs((13, 48), torch.bfloat16, device, param_dtype=torch.float32)
    _check(x, w, 1e-2)
    x32 = x.float()
    for use_triton in (False, True):
        y = rmsnorm(x32, w, use_triton=use_triton, out_dtype=torch.bfloat16)
        assert y.dtype == torch.bfloat16
        assert_close(y, rmsnorm(x32.double(), w.double()), 1e-2, "y")


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_matches_reference(dtype, narrow, device, monkeypatch):
    if narrow:
        monkeypatch.setattr(rms_mod, "MAX_BLOCK_N", 16)
    rms_mod._clear_config_caches()
    h, w = _inputs((3, 7, 37), dtype, device)
    br = torch.randn(h.shape, device=device).to(dtype)
    dhn, dy = (torch.randn(h.shape, device=device).to(dtype) for _ in range(2))

    def fused(h, br, w):
        return residual_rmsnorm(h, br, w, use_triton=True)

    def ref(h, br, w):
        return residual_rmsnorm(h, br, w)

    out, gs = grads(fused, (h, br, w), (dhn, dy))
    rout, rgs = grads(ref, (h.double(), br.double(), w.double()), (dhn.double(), dy.double()))
    # h_new is rounded to dtype before it is normalised: compare y against the reference on it
    _, (y_of_hnew,) = out[0], rmsnorm(out[0].double(), w.double())[None]
    assert_close(out[0], rout[0], TOL[dtype], "h_new")
    assert_close(out[1], y_of_hnew, TOL[dtype], "y")
    for name, g, r in zip(("dh", "dbranch", "dweight"), gs, rgs, strict=True):
        assert_close(g, r, TOL[dtype], name)
    rms_mod._clear_config_caches()


@pytest.mark.parametrize("narrow", [False, True])
def test_residual_dropout_mask_consistent(narrow, device, monkeypatch):
    # The forward's kept elements are branch / (1 - p), the rest 0; the backward's branch
    # gradient is dh masked and scaled by the same mask (regenerated from the saved seed).
    if narrow:
        monkeypatch.setattr(rms_mod, "MAX_BLOCK_N", 16)
    rms_mod._clear_config_caches()
    p = 0.3
    h, w = _inputs((6, 45), device=device)
    br = 1.0 + torch.rand(h.shape, device=device)  # never 0: a zero in h_new - h means dropped
    leaves = [t.requires_grad_() for t in (h, br, w)]
    h_new, y = residual_rmsnorm(*leaves, dropout_p=p, use_triton=True)
    kept = (h_new - h).abs() > 1e-3
    assert 0.5 < kept.float().mean() < 0.9
    torch.testing.assert_close((h_new - h)[kept], br[kept] / (1 - p), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, rmsnorm(h_new, w), rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    dh, dbr = torch.autograd.grad((y * dy).sum() + h_new.sum(), leaves[:2])
    torch.testing.assert_close(dbr, torch.where(kept, dh / (1 - p), 0.0), rtol=1e-5, atol=1e-6)
    # not training: no dropout at all
    h_new, _ = residual_rmsnorm(h, br, w, dropout_p=p, training=False, use_triton=True)
    torch.testing.assert_close(h_new, h + br)
    rms_mod._clear_config_caches()


@pytest.mark.parametrize("use_triton", [False, True])
def test_with_and_without_grad_recording(use_triton, device):
    # call_op's two eager paths (the autograd.Function, the plain implementation) agree, and
    # outputs are fresh tensors
    x, w = _inputs((5, 40), device=device)
    with torch.no_grad():
        y0 = rmsnorm(x, w, use_triton=use_triton)
        h0, r0 = residual_rmsnorm(x, x.cos(), w, use_triton=use_triton)
    y1 = rmsnorm(x, w.requires_grad_(), use_triton=use_triton)
    h1, r1 = residual_rmsnorm(x, x.cos(), w, use_triton=use_triton)
    assert y1.requires_grad and not y0.requires_grad
    assert torch.equal(y0, y1.detach()) and torch.equal(h0, h1) and torch.equal(r0, r1.detach())
    assert y1._base is None and h1._base is None


def test_registered_custom_ops(device):
    x, w = _inputs((6, 33), device=device)
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    x.requires_grad_(), w.requires_grad_()
    torch.library.opcheck(rmsnorm_op, (x, w, 1e-5), test_utils=tests)
    _, rstd = rmsnorm_op(x, w, 1e-5)
    for acc in (None, torch.randn_like(w)):  # a `.grad` accumulator or none
        bwd_args = (torch.randn_like(x), x.detach(), w.detach(), rstd, acc)
        torch.library.opcheck(rmsnorm_backward_op, bwd_args, test_utils=tests)
    br, seed = torch.randn_like(x).requires_grad_(), draw_seed(device)
    torch.library.opcheck(residual_rmsnorm_op, (x, br, w, 1e-5, 0.2, seed), test_utils=tests)
    h_new, _, rstd = residual_rmsnorm_op(x, br, w, 1e-5, 0.2, seed)
    bwd_args = (torch.randn_like(x), torch.randn_like(x), h_new.detach(), w.detach(), rstd, 0.2,
                seed, x.dtype, br.dtype)  # fmt: skip
    for acc in (None, torch.randn_like(w)):
        torch.library.opcheck(residual_rmsnorm_backward_op, (*bwd_args, acc), test_utils=tests)


@pytest.mark.parametrize("which", ["rmsnorm", "residual_rmsnorm"])
def test_double_backward_raises(which, device, assert_first_order_only):
    x, w = _inputs((4, 16), device=device)
    x.requires_grad_()
    if which == "rmsnorm":
        assert_first_order_only(lambda x: rmsnorm(x, w, use_triton=True), x, "rmsnorm")
    else:
        f = lambda br: residual_rmsnorm(x.detach(), br, w, dropout_p=0.2, use_triton=True)[1]
        assert_first_order_only(f, x, "residual_rmsnorm")


def test_double_backward_reference(device):
    # use_triton=False is the way to higher-order gradients: it gives them
    x, w = _inputs((4, 8), torch.float64, device)
    x.requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x: rmsnorm(x, w), (x,))


@pytest.mark.parametrize("shape", [(0, 37), (5, 0)])
def test_zero_size(shape, device):
    x, w = _inputs(shape, device=device)
    leaves = [t.requires_grad_() for t in (x, w)]
    rmsnorm(*leaves, use_triton=True).sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))
    h_new, y = residual_rmsnorm(x, x.detach(), w, dropout_p=0.1, use_triton=True)
    assert h_new.shape == y.shape == x.shape


def test_validation_errors(device):
    x, w = _inputs((4, 8), device=device)
    # with plans of x's layout made first (`_EagerPlan`): a plan is taken only by calls of its
    # validated layout, and the checks still raise for every other call
    rmsnorm(x, w, use_triton=True)
    residual_rmsnorm(x, x, w, use_triton=True)
    assert len(rms_mod._EAGER_PLANS.plans) == 2
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="weight must have shape"):
            rmsnorm(x, w[:3], use_triton=use_triton)
        with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
            rmsnorm(x.tolist(), w, use_triton=use_triton)
        with pytest.raises(ValueError, match="eps"):
            rmsnorm(x, w, -1.0, use_triton=use_triton)
        with pytest.raises(ValueError, match="branch shape"):
            residual_rmsnorm(x, x[:2], w, use_triton=use_triton)
        with pytest.raises(ValueError, match="dropout_p"):
            residual_rmsnorm(x, x, w, dropout_p=1.0, use_triton=use_triton)
    with pytest.raises(TypeError, match="dtype"):
        rmsnorm(x.double(), w.double(), use_triton=True)
    with pytest.raises(TypeError, match="seed"):
        residual_rmsnorm(x, x, w, dropout_p=0.1, use_triton=True, seed=3)


def test_module_matches_torch_rmsnorm(device):
    norm = RMSNorm(24, eps=1e-6).to(device)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    ref = torch.nn.RMSNorm(24, eps=1e-6).to(device)
    ref.load_state_dict(norm.state_dict())  # same parameter name
    x = torch.randn(3, 5, 24, device=device)
    for use_triton in (False, True):
        torch.testing.assert_close(norm(x, use_triton=use_triton), ref(x), rtol=1e-5, atol=1e-5)
    assert "eps=1e-06" in repr(norm)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("N", [768, 1000, 4096, 8192, 16384, 20000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_realistic(N, dtype, device):
    x, w = _inputs((2048, N), dtype, device)
    _check(x, w, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_gpu_residual_realistic(p, device):
    h, w = _inputs((4, 1024, 768), torch.bfloat16, device, param_dtype=torch.float32)
    br = torch.randn_like(h)
    leaves = [t.requires_grad_() for t in (h, br, w)]
    h_new, y = residual_rmsnorm(*leaves, dropout_p=p, use_triton=True)
    assert_close(y, rmsnorm(h_new.double(), w.double()), 1e-2, "y")
    (y.float().square().sum() + h_new.float().sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.gpu
def test_gpu_deterministic_dweight(device):
    x, w = _inputs((8192, 1024), torch.bfloat16, device, param_dtype=torch.float32)
    dy = torch.randn_like(x)
    runs = [grads(lambda a, b: rmsnorm(a, b, use_triton=True), (x, w), (dy,))[1][1] for _ in "ab"]
    assert torch.equal(*runs)


@pytest.mark.gpu
def test_gpu_compiles_without_graph_breaks(device):
    x, w = _inputs((512, 1024), torch.bfloat16, device)
    leaves = [t.requires_grad_() for t in (x, w)]
    f = lambda x, w: residual_rmsnorm(x, x.sin(), w, dropout_p=0.0, use_triton=True)[1]
    explanation = torch._dynamo.explain(f)(*leaves)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    out = torch.compile(f)(*leaves)
    torch.testing.assert_close(out, f(*leaves), rtol=1e-2, atol=1e-2)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), leaves))


@pytest.mark.parametrize("residual", [False, True])
def test_eager_launches_bound_per_shape(residual, device):
    # an eager call's first launch of a shape binds the forward's and the backward's launches
    # (`_PLANS`); later calls of that shape take them (`helpers.check_launches_bound_per_shape`).
    # Another dtype or alignment binds its own.
    x, w = _inputs((37, 48), device=device)
    branch = torch.randn_like(x)
    dy = torch.randn_like(x)

    def run(x):
        leaves = [t.detach().requires_grad_() for t in (x, w, branch)]
        if residual:
            h, y = residual_rmsnorm(leaves[0], leaves[2], leaves[1], use_triton=True)
            (h.float().sum() + (y * dy.to(y.dtype)).sum()).backward()
            outs = (h, y)
        else:
            y = rmsnorm(leaves[0], leaves[1], use_triton=True)
            y.backward(dy.to(y.dtype))
            outs = (y,)
        return (*outs, *(t.grad for t in leaves if t.grad is not None))

    shifted = torch.empty(x.numel() + 1, device=device)[1:].view_as(x)  # 4 bytes off
    # the residual backward reads the new (aligned) sum, not the shifted h: its plan holds
    check_launches_bound_per_shape(rms_mod._PLANS.plans, run, x, shifted, 5 if residual else 6)


@pytest.mark.parametrize(
    "shape, dtype, branch_dtype, param_dtype, p, out_dtype",
    [
        ((3, 17, 48), torch.float32, None, None, 0.0, None),
        ((40, 100), torch.float32, torch.float16, None, 0.3, torch.float16),
        ((2, 5, 64), torch.float16, None, torch.float32, 0.2, None),
    ],
)
@pytest.mark.parametrize("residual", [False, True])
def test_eager_plan_matches_registered_op(
    residual, shape, dtype, branch_dtype, param_dtype, p, out_dtype, device
):
    # An eager call takes its layout's plan (`_EagerPlan`: made on the first call, its
    # launches bound then, taken by every later call). Both calls give, bit for bit, what the
    # registered op gives through the dispatcher (from the same seed), forward and backward,
    # with upstream gradients dense, expanded (a sum's), strided over columns (copied) or with
    # rows of a stride of their own (a slice's gradient from torch.cat: launched afresh); in
    # residual mode also with h_new's gradient in each layout against a dense one, or none.
    x, w = _inputs(shape, dtype, device, param_dtype)
    br = torch.randn(shape, device=device).to(branch_dtype or dtype)
    seed = torch.tensor(4321, device=device)
    sum_dtype = torch.promote_types(x.dtype, br.dtype) if residual else x.dtype
    y_dtype = out_dtype or sum_dtype
    wide = (*shape[:-1], 2 * shape[-1])
    layouts = {
        "dense": lambda dt: torch.randn(shape, device=device).to(dt),
        "expanded": lambda dt: torch.ones((), device=device).to(dt).expand(shape),
        "columns": lambda dt: torch.randn(wide, device=device).to(dt)[..., ::2],
        "padded rows": lambda dt: torch.randn(wide, device=device).to(dt)[..., : shape[-1]],
    }
    pairs = [(name, None) for name in layouts]
    if residual:
        pairs += [("dense", "padded rows"), ("padded rows", "dense"), ("expanded", "columns")]
    for dy_layout, dhn_layout in pairs:
        dy = layouts[dy_layout](y_dtype)
        dhn = None if dhn_layout is None else layouts[dhn_layout](sum_dtype)
        results = []
        for registered in (False, False, True):
            leaves = [t.detach().requires_grad_() for t in (x, w, br)]
            xl, wl, brl = leaves
            if not residual:
                y = (rmsnorm_op(xl, wl, 1e-5, out_dtype)[0] if registered
                     else rmsnorm(xl, wl, use_triton=True, out_dtype=out_dtype))  # fmt: skip
                forward = (y,)
                outs, upstream = forward, (dy,)
            else:
                if registered:
                    h_new, y, _ = residual_rmsnorm_op(xl, brl, wl, 1e-5, p, seed if p else wl,
                                                      out_dtype)  # fmt: skip
                else:
                    h_new, y = residual_rmsnorm(xl, brl, wl, dropout_p=p, use_triton=True,
                                                out_dtype=out_dtype, seed=seed)  # fmt: skip
                forward = (h_new, y)
                outs, upstream = ((y,), (dy,)) if dhn is None else (forward, (dhn, dy))
            torch.autograd.backward(outs, upstream)
            results.append((*outs, *(t.grad for t in leaves)))
        for got in results[:2]:
            for a, want in zip(got, results[2], strict=True):
                assert (a is None and want is None) or torch.equal(a, want)
        assert results[0][-3].dtype == x.dtype and len(rms_mod._EAGER_PLANS.plans) == 1
    with torch.no_grad():  # the plan's forward alone
        got = (residual_rmsnorm(x, br, w, dropout_p=p, use_triton=True, out_dtype=out_dtype,
                                seed=seed) if residual
               else (rmsnorm(x, w, use_triton=True, out_dtype=out_dtype),))  # fmt: skip
    for a, want in zip(got, forward, strict=True):  # the registered op's last forward
        assert torch.equal(a, want)
    assert len(rms_mod._EAGER_PLANS.plans) == 1


@pytest.mark.parametrize("residual", [False, True])
def test_eager_plan_with_accumulated_grads(residual, device, monkeypatch):
    # Inside `bmm.accumulate_grads_in_place` a plan's backward adds into the weight's `.grad`
    # (from the second backward on, once there is one) and the sums equal those outside it;
    # an input that does not require grad takes the plan's forward alone.
    targets = []
    real = rms_mod.grad_targets
    monkeypatch.setattr(rms_mod, "grad_targets", lambda *a: targets.append(real(*a)) or targets[-1])
    x, w = _inputs((33, 40), device=device)
    br = torch.randn_like(x)
    if residual:
        forward = lambda wl: residual_rmsnorm(x, br, wl, use_triton=True)[1]
    else:
        forward = lambda wl: rmsnorm(x, wl, use_triton=True)
    y = forward(w)
    assert y.grad_fn is None and len(rms_mod._EAGER_PLANS.plans) == 1
    dys = [torch.randn(33, 40, device=device) for _ in range(3)]
    check_grads_fold_alike(forward, [w], dys)
    assert [t[0] is not None for t in targets] == [False, True, True]
