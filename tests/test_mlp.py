"""relu2_mlp (the relu² feed-forward as one op, relu²'s gradient in the epilogue of the backward's
product) and mm_relu2_grad against float64 references.

On the CPU the kernels run in Triton's interpreter with 32-wide tiles: M = 37, D = 48, H = 80
cover ragged tiles in every dimension and K loops longer than one step.
"""

import contextlib

import pytest
import torch
from helpers import TOL, CountAdds, check_grads_fold_alike, pretend_gpu, rel_err

import triton_transformer.bmm as bmm_module
import triton_transformer.matmul_plan as plan_module
import triton_transformer.mlp as mlp_module
import triton_transformer.utils as utils_module
from triton_transformer.bmm import linear, relu2_grad_op
from triton_transformer.mlp import mm_relu2_grad_op, relu2_mlp
from triton_transformer.utils import draw_seeds


def rand(shape, dtype, device, mean=0.2, std=1.0):
    """Off-centre, so that a missing term or a wrong sign shows."""
    return (mean + std * torch.randn(shape, device=device)).to(dtype)


def keep_mask(p: float, seed: torch.Tensor, shape: tuple, device) -> torch.Tensor:
    """The relu² epilogue's dropout mask over an (M, H) output, as `relu2_grad_op`
    regenerates it (tested against the forward's in test_bmm)."""
    ones = torch.ones(shape, device=device)
    return relu2_grad_op(ones, ones, False, p, seed) != 0


def reference(x, w_in, w_out, keep, p):
    """float64: (dropout(relu(x W_inᵀ)²) W_outᵀ) with the given mask."""
    h = (x @ w_in.T).clamp(min=0) ** 2
    if keep is not None:
        h = torch.where(keep, h / (1 - p), 0.0)
    return h @ w_out.T


def check_mlp(x, w_in, w_out, p, device, tol):
    """relu2_mlp's output and its three gradients against float64 (its own dropout mask)."""
    seed = draw_seeds(device, 1)[0] if p > 0 else None
    x, w_in, w_out = (t.detach().requires_grad_() for t in (x, w_in, w_out))
    out = relu2_mlp(x, w_in, w_out, use_triton=True, dropout_p=p, seed=seed)
    dout = rand(out.shape, out.dtype, device, mean=0.3)
    grads = torch.autograd.grad(out, (x, w_in, w_out), dout)
    x64, wi64, wo64 = (t.detach().double().requires_grad_() for t in (x, w_in, w_out))
    M, H = x.reshape(-1, x.shape[-1]).shape[0], w_in.shape[0]
    keep = keep_mask(p, seed, (M, H), device).view(*x.shape[:-1], H) if p > 0 else None
    ref = reference(x64, wi64, wo64, keep, p)
    want = torch.autograd.grad(ref, (x64, wi64, wo64), dout.double())
    assert out.dtype == x.dtype
    assert rel_err(out, ref) < tol
    for g, r in zip(grads, want, strict=True):
        assert rel_err(g, r) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("shape", [(37, 48), (2, 3, 11, 48)], ids=str)
def test_relu2_mlp_matches_fp64(shape, p, dtype, device):
    H = 80  # not a multiple of the 32-wide interpreter tiles nor of 16
    x = rand(shape, dtype, device)
    w_in = rand((H, shape[-1]), dtype, device, mean=0.0, std=0.3)
    w_out = rand((shape[-1], H), dtype, device, mean=0.05, std=0.2)
    check_mlp(x, w_in, w_out, p, device, TOL[dtype])


def test_relu2_mlp_strided_input(device):
    # x a column slice of a wider tensor (row stride 96): read in place
    x = rand((37, 96), torch.float32, device)[:, 24:72]
    w_in = rand((80, 48), torch.float32, device, mean=0.0, std=0.3)
    w_out = rand((48, 80), torch.float32, device, std=0.2)
    assert not x.is_contiguous()
    check_mlp(x, w_in, w_out, 0.0, device, 1e-5)


def test_relu2_mlp_through_cublas_and_the_pass(device, monkeypatch):
    # "cublas+ew": the product by torch.mm, then relu²'s gradient in place (the traced path
    # without the TMA kernel, and the table's choice where that measured faster)
    monkeypatch.setattr(plan_module, "_FORCE_PATH", "cublas+ew")
    x = rand((37, 48), torch.float32, device)
    w_in = rand((80, 48), torch.float32, device, mean=0.0, std=0.3)
    w_out = rand((48, 80), torch.float32, device, std=0.2)
    check_mlp(x, w_in, w_out, 0.3, device, 1e-5)


@pytest.mark.parametrize("from_square", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_mm_relu2_grad_matches_fp64(from_square, p, device):
    M, K, N = 37, 45, 72
    dy = rand((M, K), torch.float32, device)
    w = rand((K, N), torch.float32, device, std=0.5)
    relu = rand((M, N), torch.float32, device).clamp(min=0)  # relu(pre), zeros included
    seed = draw_seeds(device, 1)[0] if p > 0 else None
    keep = keep_mask(p, seed, (M, N), device) if p > 0 else torch.ones(M, N, dtype=torch.bool)
    keep = keep.to(device)
    scale = 1 / (1 - p)
    s = torch.where(keep, relu**2 * scale, 0.0) if from_square else relu  # what forward kept
    got = mm_relu2_grad_op(dy, w, s, from_square, p, seed)
    want = (dy.double() @ w.double()) * 2 * relu.double() * torch.where(keep, scale, 0.0).double()
    assert got.dtype == dy.dtype and got.is_contiguous()
    assert rel_err(got, want) < 1e-5


def test_relu2_mlp_fp16_runs_the_two_linears(device, monkeypatch):
    # fp16's relu² output underflows: relu2_mlp runs the linears, whose relu² keeps relu(pre)
    calls = []
    monkeypatch.setattr(mlp_module, "relu2_mlp_op", lambda *a: calls.append(a))
    x = rand((37, 48), torch.float16, device)
    w_in = rand((80, 48), torch.float16, device, mean=0.0, std=0.3)
    w_out = rand((48, 80), torch.float16, device, std=0.2)
    got = relu2_mlp(x, w_in, w_out, use_triton=True)
    want = linear(linear(x, w_in, "relu_squared", use_triton=True), w_out, use_triton=True)
    assert not calls and torch.equal(got, want)
    check_mlp(x, w_in, w_out, 0.0, device, TOL[torch.float16])


def test_relu2_mlp_reference_is_the_two_linears(device):
    # the PyTorch branch is the two linears' (the semantics the Triton branch must meet)
    x = rand((2, 7, 48), torch.float32, device)
    w_in = rand((80, 48), torch.float32, device, mean=0.0, std=0.3)
    w_out = rand((48, 80), torch.float32, device, std=0.2)
    want = linear(linear(x, w_in, "relu_squared"), w_out)
    assert torch.equal(relu2_mlp(x, w_in, w_out), want)


def test_relu2_mlp_mixed_precision_weight_grads(device):
    # bf16 autocast with fp32 weights: bf16 products, fp32 weight gradients in one rounding
    dtype = torch.bfloat16
    x = rand((37, 48), torch.float32, device).requires_grad_()
    w_in = rand((80, 48), torch.float32, device, mean=0.0, std=0.3).requires_grad_()
    w_out = rand((48, 80), torch.float32, device, std=0.2).requires_grad_()
    with torch.autocast(device, dtype=dtype):
        out = relu2_mlp(x, w_in, w_out, use_triton=True)
    assert out.dtype == dtype
    out.float().sum().backward()
    assert w_in.grad.dtype == w_out.grad.dtype == torch.float32
    x64, wi64, wo64 = (t.detach().double().requires_grad_() for t in (x, w_in, w_out))
    reference(x64, wi64, wo64, None, 0.0).sum().backward()
    for t, r in ((x, x64), (w_in, wi64), (w_out, wo64)):
        assert rel_err(t.grad, r.grad) < 2e-2


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(w_out=torch.zeros(48, 81)), "w_out"),
        (dict(w_in=torch.zeros(80)), "2-D"),
        (dict(x=torch.zeros(5, 47)), "x"),
        (dict(w_out=torch.zeros(48, 80, dtype=torch.float64)), "dtype"),
        (dict(dropout_p=1.0), "dropout"),
    ],
)
def test_relu2_mlp_rejects_bad_input(bad, match):
    args = dict(x=torch.zeros(5, 48), w_in=torch.zeros(80, 48), w_out=torch.zeros(48, 80))
    p = bad.pop("dropout_p", 0.0)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        relu2_mlp(args["x"], args["w_in"], args["w_out"], use_triton=False, dropout_p=p)


def test_relu2_mlp_double_backward_raises(device, assert_first_order_only):
    w_in = rand((80, 48), torch.float32, device, mean=0.0, std=0.3)
    w_out = rand((48, 80), torch.float32, device, std=0.2)
    x = rand((37, 48), torch.float32, device).requires_grad_()
    assert_first_order_only(lambda x: relu2_mlp(x, w_in, w_out, use_triton=True), x, "relu2_mlp")


def test_relu2_mlp_no_grad_and_inference(device):
    # called without autograd recording: the op's implementation runs directly
    x = rand((37, 48), torch.float32, device)
    w_in = rand((80, 48), torch.float32, device, mean=0.0, std=0.3)
    w_out = rand((48, 80), torch.float32, device, std=0.2)
    with torch.no_grad():
        got = relu2_mlp(x, w_in, w_out, use_triton=True)
    assert got.grad_fn is None
    assert rel_err(got, reference(x.double(), w_in.double(), w_out.double(), None, 0)) < 1e-5


def test_relu2_mlp_opcheck(device):
    x = rand((37, 48), torch.float32, device).requires_grad_()
    w_in = rand((80, 48), torch.float32, device, mean=0.0, std=0.3).requires_grad_()
    w_out = rand((48, 80), torch.float32, device, std=0.2).requires_grad_()
    seed = draw_seeds(device, 1)[0]
    # The interpreter cannot run kernels on fake tensors: those checks need CUDA.
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    for p in (0.0, 0.2):
        args = (x, w_in, w_out, p, seed if p else None)
        torch.library.opcheck(mlp_module.relu2_mlp_op, args, test_utils=tests)
    s = rand((37, 80), torch.float32, device).abs()
    args = (x.detach(), w_out.detach(), s, True, 0.2, seed)
    torch.library.opcheck(mlp_module.mm_relu2_grad_op, args, test_utils=tests)


def test_plan_relu2grad_rule(monkeypatch):
    # On a (pretend) H200: "+relu2grad" fused by default (the TMA kernel), "cublas+ew" where the
    # table says so; with the dropout mask "cublas+ew" by default, fused where the table says
    # "fused"; "cublas+ew" while tracing without the TMA kernel; the interpreter's pointer
    # kernel on the CPU unless forced
    pretend_gpu(monkeypatch, 9, 132, "H200")
    table = {"64x64x64:nn+relu2grad": "cublas+ew", "128x128x128:nn+relu2grad+drop": "fused"}
    monkeypatch.setattr(plan_module, "MATMUL_TABLE", {"H200": table})
    bf16 = torch.bfloat16

    def plan(M, N, K, epi, tracing=False, device="cuda", force=None):
        return plan_module._plan.__wrapped__(
            device, 0, bf16, M, N, K, 0, 0, epi, True, 2, "auto", force, tracing
        )

    assert plan(8192, 2048, 512, "+relu2grad") == ("tma", 1, 132)
    assert plan(64, 64, 64, "+relu2grad") == ("cublas+ew",)
    assert plan(8192, 2048, 512, "+relu2grad+drop") == ("cublas+ew",)
    assert plan(128, 128, 128, "+relu2grad+drop") == ("tma", 1, 132)
    assert plan(8192, 2048, 512, "+relu2grad", tracing=True) == ("cublas+ew",)
    assert plan(64, 64, 64, "+relu2grad", device="cpu")[0] == "ptr"
    assert plan(64, 64, 64, "+relu2grad", device="cpu", force="cublas+ew") == ("cublas+ew",)


# --- GPU: real shapes, the TMA kernel's epilogue, graphs and compile --------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("impl", ["auto", "cublas+ew", "ptr"])
@pytest.mark.parametrize("shape", [(4096, 768, 3072), (1000, 512, 2048)], ids=str)
def test_relu2_mlp_gpu(shape, impl, p, device, monkeypatch):
    # GPT-2's and enwik8's feed-forward (and a ragged row count), bf16: the TMA epilogue (auto
    # on Hopper), cuBLAS + the pass, and the pointer kernel's epilogue
    if impl != "auto":
        monkeypatch.setattr(plan_module, "_FORCE_PATH", impl)
    M, D, H = shape
    x = rand((M, D), torch.bfloat16, device)
    w_in = rand((H, D), torch.bfloat16, device, mean=0.0, std=D**-0.5)
    w_out = rand((D, H), torch.bfloat16, device, mean=0.0, std=H**-0.5)
    check_mlp(x, w_in, w_out, p, device, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_tma", [True, False])
def test_relu2_mlp_compiled_gpu(compile_tma, device, monkeypatch):
    monkeypatch.setattr(utils_module, "COMPILE_TMA", compile_tma)
    torch._dynamo.reset()
    x = rand((2048, 512), torch.bfloat16, device).requires_grad_()
    w_in = rand((2048, 512), torch.float32, device, mean=0.0, std=512**-0.5).requires_grad_()
    w_out = rand((512, 2048), torch.float32, device, mean=0.0, std=2048**-0.5).requires_grad_()
    seed = draw_seeds(device, 1)[0]

    def f(x, w_in, w_out):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return relu2_mlp(x, w_in, w_out, use_triton=True, dropout_p=0.1, seed=seed)

    explanation = torch._dynamo.explain(f)(x, w_in, w_out)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    out = torch.compile(f)(x, w_in, w_out)
    dout = rand(out.shape, out.dtype, device)
    got = [out, *torch.autograd.grad(out, (x, w_in, w_out), dout)]
    ref = f(x, w_in, w_out)
    want = [ref, *torch.autograd.grad(ref, (x, w_in, w_out), dout)]
    for g, r in zip(got, want, strict=True):
        assert rel_err(g, r) < 1e-2


def test_accumulate_grads_in_place(device, monkeypatch):
    # The op's two weight gradients, inside `bmm.accumulate_grads_in_place` (the trainer's
    # micro-batches): each backward after the first adds dW_in and dW_out into the weights'
    # .grad in its product, with no separate add, and the sums equal autograd's own.

    def run(in_place: bool):
        torch.manual_seed(0)
        w_in = (0.1 * torch.randn(48, 32, device=device)).requires_grad_()
        w_out = (0.1 * torch.randn(32, 48, device=device)).requires_grad_()
        x = rand((3, 19, 32), torch.bfloat16, device)
        context = bmm_module.accumulate_grads_in_place() if in_place else contextlib.nullcontext()
        with context, CountAdds(w_in.shape) as adds_in, CountAdds(w_out.shape) as adds_out:
            for i in range(3):
                with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
                    y = relu2_mlp(x[i], w_in, w_out, use_triton=True)
                (y.float() * (1.0 + i)).sum().backward()
        return w_in.grad, w_out.grad, adds_in.adds + adds_out.adds

    want_in, want_out, want_adds = run(False)
    got_in, got_out, got_adds = run(True)
    torch.testing.assert_close(got_in, want_in, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    assert got_in.dtype == got_out.dtype == torch.float32
    assert (want_adds, got_adds) == (4, 0)  # two later micro-batches x two weights
    monkeypatch.setattr(bmm_module, "ACCUMULATE_IN_PLACE", False)
    off_in, _, off_adds = run(True)
    torch.testing.assert_close(off_in, want_in, rtol=0, atol=0)
    assert off_adds == 4


# ----------------------------------------------------------------------------- eager plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, p", [((37, 48), 0.0), ((3, 13, 48), 0.0), ((37, 48), 0.25)])
def test_eager_plan_matches_registered_op(shape, p, dtype, device):
    # An eager call takes its layout's plan (made on the first call, its four products bound
    # on the first calls that can bind them, taken by later calls): forward and backward bit
    # for bit what the registered op gives through the dispatcher, with a dense, an expanded
    # (a sum's) and a strided upstream gradient, with and without a dropout.
    mlp_module._EAGER_PLANS.plans.clear()
    x = rand(shape, dtype, device)
    w_in = rand((80, shape[-1]), dtype, device, mean=0.05, std=0.2)
    w_out = rand((shape[-1], 80), dtype, device, mean=0.0, std=0.1)
    seed = draw_seeds(device, 2)[1]  # a view 8 bytes into its buffer
    dense = torch.randn(shape, device=device).to(dtype)
    wide = torch.randn((*shape[:-1], 2 * shape[-1]), device=device).to(dtype)
    expanded = torch.ones((), device=device, dtype=dtype).expand(shape)
    for dy in (dense, expanded, wide[..., ::2]):
        results = []
        for plan in (True, True, False):
            leaves = [t.detach().requires_grad_() for t in (x, w_in, w_out)]
            if plan:
                y = relu2_mlp(*leaves, use_triton=True, dropout_p=p, seed=seed)
            else:
                x2 = leaves[0].reshape(-1, shape[-1])
                y = mlp_module.relu2_mlp_op(x2, *leaves[1:], p, seed)[0].view(shape)
            y.backward(dy)
            results.append((y, *(t.grad for t in leaves)))
        assert len(mlp_module._EAGER_PLANS.plans) == 1
        for got in results[:2]:
            for a, want in zip(got, results[2], strict=True):
                assert torch.equal(a, want)
    plan = next(iter(mlp_module._EAGER_PLANS.plans.values()))
    if dtype == torch.float32 or device == "cuda":  # bf16 interpreted: widened, not bound
        # h, out, dx, dw_in; d(pre) and dW_out per layout of dout
        assert len(plan.products.bound) == 4 + 2 * 3
        assert None not in plan.products.bound.values()


def test_eager_plan_without_autograd_and_accumulating(device):
    # No autograd recorded: the plan's forward alone. Inside `accumulate_grads_in_place` the
    # weight gradients are added into `.grad`, as the generic path adds them.
    mlp_module._EAGER_PLANS.plans.clear()
    x = rand((33, 40), torch.float32, device)
    w_in = rand((48, 40), torch.float32, device, mean=0.05, std=0.2)
    w_out = rand((40, 48), torch.float32, device, mean=0.0, std=0.1)
    want = mlp_module.relu2_mlp_op(x, w_in, w_out)[0]
    with torch.no_grad():
        assert torch.equal(relu2_mlp(x, w_in.requires_grad_(), w_out, use_triton=True), want)
    w_in.requires_grad_(False)
    y = relu2_mlp(x, w_in, w_out, use_triton=True)
    assert torch.equal(y, want) and y.grad_fn is None
    assert len(mlp_module._EAGER_PLANS.plans) == 1

    dys = [torch.randn(33, 40, device=device) for _ in range(3)]
    check_grads_fold_alike(lambda wi, wo: relu2_mlp(x, wi, wo, use_triton=True), [w_in, w_out], dys)


def test_eager_plan_keeps_the_checks(device):
    # A plan is taken only by calls of its validated layout: a later call with a weight of
    # another shape or dtype, or a bad dropout, still raises the generic path's error.
    mlp_module._EAGER_PLANS.plans.clear()
    x = rand((8, 16), torch.float32, device)
    w_in, w_out = rand((24, 16), torch.float32, device), rand((16, 24), torch.float32, device)
    relu2_mlp(x, w_in, w_out, use_triton=True)
    with pytest.raises(ValueError, match="need x"):
        relu2_mlp(x, w_in, w_out[:8], use_triton=True)
    with pytest.raises(TypeError, match="one dtype"):
        relu2_mlp(x, w_in, w_out.double(), use_triton=True)
    with pytest.raises(ValueError, match="dropout"):
        relu2_mlp(x, w_in, w_out, use_triton=True, dropout_p=-0.5)
    assert len(mlp_module._EAGER_PLANS.plans) == 1
