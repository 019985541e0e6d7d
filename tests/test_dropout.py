"""dropout: the seeded Triton kernel (and the F.dropout reference) by their defining properties.

A dropout output is random, so instead of comparing with a fixed reference the tests check
that every element is 0 or x / (1 - p) (against float64), that the kept fraction matches 1 - p
within a 6-sigma binomial bound, that backward applies exactly the forward mask, and that the
mask is reproducible under torch.manual_seed.
"""

import math

import pytest
import torch
import triton

from triton_transformer.dropout import (
    BLOCK_M,
    BLOCK_N,
    _dropout_kernel,
    _strided_layout,
    dropout,
    dropout_op,
)
from triton_transformer.utils import SEED_BOUND, call_op, draw_seed, draw_seeds, host_seed

# Relative error of x * (1 / (1 - p)) after rounding to the dtype (plus the fp32 scale).
RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_x(shape, dtype=torch.float32, device="cpu"):
    # Never zero (so a kept element is never 0) and not centred at zero.
    x = (-2.3 + 0.5 * torch.randn(shape, device=device, dtype=torch.float64)).to(dtype)
    assert (x != 0).all()
    return x


def check_is_dropout_of(out, x, p):
    """Every element of `out` is 0 or x / (1 - p); returns the keep mask."""
    assert out.shape == x.shape and out.dtype == x.dtype
    kept = out != 0
    expected = torch.where(kept, x.double() / (1 - p), 0.0)
    torch.testing.assert_close(out.double(), expected, rtol=RTOL[x.dtype], atol=0)
    return kept


def check_backward_uses_mask(x, p, use_triton=True):
    """Forward then backward with a random upstream gradient: dx = keep * dy / (1 - p)."""
    x = x.detach().requires_grad_()  # keeps the strides (clone might not)
    out = dropout(x, p, use_triton=use_triton)
    kept = check_is_dropout_of(out.detach(), x.detach(), p)
    dy = make_x(x.shape, x.dtype, x.device)
    out.backward(dy)
    expected = torch.where(kept, dy.double() / (1 - p), 0.0)
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
    torch.testing.assert_close(x.grad.double(), expected, rtol=RTOL[x.dtype], atol=0)
    return kept


def check_kept_fraction(kept, p):
    # Binomial(n, 1 - p): a deviation over 6 sigma has probability ~2e-9.
    n = kept.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    frac = kept.double().mean().item()
    assert abs(frac - (1 - p)) <= 6 * sigma, (frac, 1 - p, sigma)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_values_fraction_and_backward(p, use_triton, device):
    # 2**17 elements: a 6-sigma band of about +-0.8% around 1 - p.
    x = make_x((128, 1024), device=device)
    kept = check_backward_uses_mask(x, p, use_triton)
    check_kept_fraction(kept, p)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (3000,), (5, 7, 9), (2, 3, 4, 37)], ids=str)
def test_shapes_and_dtypes(shape, dtype, device):
    check_backward_uses_mask(make_x(shape, dtype, device), 0.5)


BLOCK = BLOCK_M * BLOCK_N  # elements per program


def test_masks_differ_across_blocks(device):
    # Each element has its own random number: no program block, and no quarter of one (each
    # Philox call serves eight elements), repeats another's mask.
    out = dropout(make_x((4 * BLOCK,), device=device), 0.5, use_triton=True)
    chunks = (out != 0).view(16, BLOCK // 4)
    for i in range(16):
        for j in range(i):
            assert not torch.equal(chunks[i], chunks[j]), (i, j)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_input(dtype, device):
    base = make_x((40, 30), dtype, device)
    for x in (base.t(), base[:, ::3], base.t()[::2]):
        assert not x.is_contiguous()
        check_backward_uses_mask(x, 0.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_upstream_gradients(dtype, device):
    # Backward reads a non-contiguous gradient through its strides: expanded (stride 0, as
    # from .sum() or a broadcast), transposed, and a 6-D one with too many dims (copied).
    x = make_x((6, 7, 9), dtype, device).requires_grad_()
    out = dropout(x, 0.4, use_triton=True)
    kept = check_is_dropout_of(out.detach(), x.detach(), 0.4)
    for dy in (
        make_x((9,), dtype, device).expand(6, 7, 9),
        make_x((9, 7, 6), dtype, device).permute(2, 1, 0),
        make_x((6, 1, 9), dtype, device).expand(6, 7, 9),
    ):
        assert not dy.is_contiguous()
        (dx,) = torch.autograd.grad(out, x, dy, retain_graph=True)
        expected = torch.where(kept, dy.double() / 0.6, 0.0)
        torch.testing.assert_close(dx.double(), expected, rtol=RTOL[dtype], atol=0)
    x6 = make_x((2, 3, 4, 5, 6, 7), dtype, device)[:, ::2, :, ::2, :, ::2]
    assert _strided_layout(x6) is None
    check_backward_uses_mask(x6, 0.3)


def test_strided_layout_merges_dims():
    t = torch.empty(4, 5, 6)
    assert _strided_layout(t[:, 1:3]) == ([1, 1, 4, 12], [0, 0, 30, 1])
    assert _strided_layout(torch.empty(3).expand(2, 5, 3)) == ([1, 1, 10, 3], [0, 0, 0, 1])
    assert _strided_layout(t.permute(2, 0, 1)) == ([1, 1, 6, 20], [0, 0, 1, 6])
    assert _strided_layout(t.permute(2, 1, 0)) == ([1, 6, 5, 4], [0, 1, 6, 30])
    assert _strided_layout(t[:, :, None, :]) == ([1, 1, 1, 120], [0, 0, 0, 1])


def test_reproducible_under_manual_seed(device):
    x = make_x((64, 100), device=device)
    torch.manual_seed(1234)
    a = dropout(x, 0.5, use_triton=True)
    b = dropout(x, 0.5, use_triton=True)  # the generator moved on: a new mask
    torch.manual_seed(1234)
    a2 = dropout(x, 0.5, use_triton=True)
    torch.manual_seed(1235)
    c = dropout(x, 0.5, use_triton=True)
    assert torch.equal(a, a2)
    assert not torch.equal(a != 0, b != 0)
    assert not torch.equal(a != 0, c != 0)


def test_backward_keeps_its_own_mask(device):
    # The seed is stored per call: interleaved calls do not disturb each other's backward.
    x1 = make_x((50, 60), device=device).requires_grad_()
    x2 = make_x((50, 60), device=device).requires_grad_()
    out1 = dropout(x1, 0.5, use_triton=True)
    out2 = dropout(x2, 0.5, use_triton=True)
    (out2.sum() + out1.sum()).backward()
    for x, out in ((x1, out1), (x2, out2)):
        torch.testing.assert_close(x.grad, torch.where(out != 0, 2.0, 0.0), rtol=0, atol=0)


def test_int64_offsets_path(device):
    # Tensors of >= 2**31 elements use 64-bit offsets; below 2**32 they give the same mask.
    x = make_x((3 * BLOCK + 5,), device=device)
    outs = []
    for int64 in (False, True):
        out = torch.empty_like(x)
        grid = (triton.cdiv(x.numel(), BLOCK),)
        seed = torch.tensor(987, device=device)
        _dropout_kernel[grid](
            x, seed, out, x.numel(), 32768, 2.0, 1, 1, 1, 0, 0, 0, 0,
            STRIDED=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, INT64=int64,
        )  # fmt: skip
        check_is_dropout_of(out, x, 0.5)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("use_triton", [False, True])
def test_identity_when_off(use_triton, device):
    x = make_x((4, 5), device=device)
    assert dropout(x, 0.0, use_triton=use_triton) is x
    assert dropout(x, 0, use_triton=use_triton) is x
    assert dropout(x, 0.5, training=False, use_triton=use_triton) is x
    assert dropout(x, use_triton=use_triton) is x  # default p = 0


@pytest.mark.parametrize("use_triton", [False, True])
def test_p_one_gives_zeros(use_triton, device):
    x = make_x((4, 5), device=device).requires_grad_()
    out = dropout(x, 1.0, use_triton=use_triton)
    assert out.shape == x.shape and (out == 0).all()
    out.sum().backward()
    assert (x.grad == 0).all()


@pytest.mark.parametrize("use_triton", [False, True])
def test_empty(use_triton, device):
    x = make_x((0, 5), device=device).requires_grad_()
    out = dropout(x, 0.5, use_triton=use_triton)
    assert out.shape == (0, 5)
    out.sum().backward()
    assert x.grad.shape == (0, 5)


@pytest.mark.parametrize("use_triton", [False, True])
def test_bad_arguments(use_triton, device):
    x = make_x((4, 5), device=device)
    for p in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="p must be in"):
            dropout(x, p, use_triton=use_triton)
    for p in ("0.5", None, True, torch.tensor(0.5)):
        with pytest.raises(TypeError, match="p must be a real number"):
            dropout(x, p, use_triton=use_triton)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        dropout(x.tolist(), 0.5, use_triton=use_triton)


def test_triton_rejects_bad_dtypes(device):
    for x in (make_x((4, 5), torch.float64, device), torch.ones(4, 5, dtype=torch.int64)):
        with pytest.raises(TypeError, match="dtype"):
            dropout(x.to(device), 0.5, use_triton=True)


# ---- large tensors on a GPU ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_gpu_large(p, dtype, device):
    x = make_x((8, 1024, 2048), dtype, device)  # 2**24 elements: 6 sigma = +-0.15%
    kept = check_backward_uses_mask(x, p)
    check_kept_fraction(kept, p)


@pytest.mark.gpu
def test_gpu_over_2_31_elements(device):
    # 64-bit offsets: the tail past 2**31 gets its own random numbers (no wrap-around).
    n = 2**31 + 3 * BLOCK + 5
    x = torch.empty(n, dtype=torch.float16, device=device).uniform_(1.0, 2.0)
    out = dropout(x, 0.5, use_triton=True)
    head, tail = slice(0, 2**20), slice(2**31 - 2**19, n)
    for part in (head, tail):
        kept = check_is_dropout_of(out[part], x[part], 0.5)
        check_kept_fraction(kept, 0.5)
    assert not torch.equal(out[: 3 * BLOCK] != 0, out[2**31 : 2**31 + 3 * BLOCK] != 0)


# ---- capture and compile safety ----------------------------------------------------------------


def test_seed_is_a_device_tensor_from_torchs_generator(device):
    # The op takes its seed as a tensor on x's device (never a host int baked into the launch),
    # drawn from torch's generator: re-seeding torch replays the seed, hence the mask.
    torch.manual_seed(7)
    s1 = draw_seed(device)
    torch.manual_seed(7)
    s2 = draw_seed(device)
    assert s1.device.type == torch.device(device).type and s1.dtype == torch.int64
    assert s1.dim() == 0 and torch.equal(s1, s2)
    x = make_x((30, 40), device=device)
    assert torch.equal(dropout_op(x, 0.5, s1), dropout_op(x, 0.5, s2))
    assert not torch.equal(dropout_op(x, 0.5, s1), dropout_op(x, 0.5, s1 + 1))


def test_registered_custom_op(device):
    # Schema and autograd registration of the torch.library op; on a GPU also its fake-tensor
    # (meta) behaviour and AOT tracing, which the interpreter cannot run (it would execute the
    # kernel on fake tensors).
    x = make_x((8, 33), device=device).requires_grad_()
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(dropout_op, (x, 0.5, draw_seed(device)), test_utils=tests)
    xt = make_x((33, 8), device=device).t().requires_grad_()  # the strided path
    torch.library.opcheck(dropout_op, (xt, 0.5, draw_seed(device)), test_utils=tests)


def test_double_backward_raises(device, assert_first_order_only):
    # The backward is itself not differentiable: create_graph=True must fail loudly, never
    # return a second derivative with terms silently missing.
    x = make_x((8, 16), device=device).requires_grad_()
    assert_first_order_only(lambda x: dropout(x, 0.5, use_triton=True), x, "dropout")


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_draw_fresh_masks(device):
    # A captured forward+backward: each replay draws a new seed on the device (a new mask),
    # and each replay's backward applies that replay's forward mask.
    x = make_x((256, 512), device=device).requires_grad_()
    dy = make_x(x.shape, device=device)
    from triton_transformer.cuda_graph import capture_graph

    def step():
        out = dropout(x, 0.5, use_triton=True)
        out.backward(dy)
        return out

    graph, out = capture_graph(step, clear_grads=(x,))  # warmed up outside the graph first
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        kept = check_is_dropout_of(out, x.detach(), 0.5)
        torch.testing.assert_close(x.grad, torch.where(kept, dy * 2, 0.0), rtol=0, atol=0)
        masks.append(kept)
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.gpu
def test_gpu_compiles_without_graph_breaks(device):
    def f(x):
        return dropout(x.sin(), 0.3, use_triton=True).cos().sum()

    x = make_x((64, 96), device=device).requires_grad_()
    explanation = torch._dynamo.explain(f)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.manual_seed(3)
    compiled = torch.compile(f)(x)
    compiled.backward()
    assert torch.isfinite(x.grad).all()


def test_call_op_dispatches_only_when_needed(device, monkeypatch):
    # Eager calls skip the dispatcher: inference runs the op's function directly, and a call
    # that records autograd runs it inside the op's eager autograd.Function (whose backward
    # is the registered one). Same result as the dispatched op.
    x = make_x((8, 16), device=device)
    seed = draw_seed(device)
    expected = dropout_op(x, 0.5, seed)  # through the dispatcher
    call_op(dropout_op, x, 0.5, seed)  # fill call_op's per-op caches, inference and autograd
    call_op(dropout_op, x.clone().requires_grad_(), 0.5, seed)
    monkeypatch.setattr(dropout_op, "_opoverload", None)  # a dispatch would now raise
    torch.testing.assert_close(call_op(dropout_op, x, 0.5, seed), expected, rtol=0, atol=0)
    with torch.no_grad():
        call_op(dropout_op, x.requires_grad_(), 0.5, seed)
    out = call_op(dropout_op, x, 0.5, seed)  # x requires grad, grad mode on
    assert type(out.grad_fn).__name__ == "Eager_dropoutBackward"
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.where(out != 0, 2.0, 0.0), rtol=0, atol=0)


def test_explicit_seed(device):
    # A given seed tensor (here views of one draw_seeds tensor) fixes the mask: the same
    # view gives the same mask, another view another one; the generator is not touched.
    x = torch.randn(5000, device=device) + 3.0
    seeds = draw_seeds(device, 2)
    state = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
    a = dropout(x, 0.3, use_triton=True, seed=seeds[0])
    assert torch.equal(a, dropout(x, 0.3, use_triton=True, seed=seeds[0]))
    assert not torch.equal(a, dropout(x, 0.3, use_triton=True, seed=seeds[1]))
    after = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
    assert torch.equal(state, after)
    with pytest.raises(TypeError, match="seed"):
        dropout(x, 0.3, use_triton=True, seed=seeds)  # not 0-dim
    with pytest.raises(TypeError, match="seed"):
        dropout(x, 0.3, use_triton=True, seed=seeds[0].int())


def test_eager_call_takes_a_host_seed(device):
    # An eager call given no seed takes a host int from torch's generator (`host_seed`): the
    # mask of the device tensor of that value, forward and backward, the generator advanced
    # as the draw advances it. The plan binds one launch per kind of seed.
    import triton_transformer.dropout as dropout_mod

    x = make_x((7, 130), device=device)
    torch.manual_seed(11)
    value = host_seed(torch.device(device))
    after = dropout(x, 0.3, use_triton=True)  # the generator's next seed
    torch.manual_seed(11)
    xl = x.clone().requires_grad_()
    out = dropout(xl, 0.3, use_triton=True)
    seed = torch.tensor(value, device=device)
    assert torch.equal(out, dropout_op(x, 0.3, seed))
    assert torch.equal(dropout(x, 0.3, use_triton=True), after)
    dy = make_x(x.shape, device=device)
    out.backward(dy)
    assert torch.equal(xl.grad, dropout_op(dy, 0.3, seed))
    (plan,) = dropout_mod._EAGER_PLANS.plans.values()
    assert [key[-1] for key in plan.bound] == [None]  # bound for a host seed only
    dropout(x, 0.3, use_triton=True, seed=seed)
    assert len(plan.bound) == 2  # x's layout (dy's too) with a host seed, with a device seed


def test_seed_changed_in_place_raises(device):
    # a seed tensor changed before the backward would give the backward another mask:
    # autograd refuses it, on the eager plan's path as on the registered op's
    x = make_x((8, 40), device=device).requires_grad_()
    eager = lambda s: dropout(x, 0.5, use_triton=True, seed=s)
    for call in (eager, lambda s: dropout_op(x, 0.5, s)):
        seed = torch.tensor(5, device=device)
        out = call(seed)
        seed.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_checkpoint_replays_the_mask(device):
    # torch.utils.checkpoint restores the generator's state before recomputing the forward,
    # so the recomputed dropout draws the forward's seed and the gradient uses its mask
    from torch.utils.checkpoint import checkpoint

    def f(x):
        return dropout(x.sin(), 0.5, use_triton=True).cos()

    x = make_x((33, 70), device=device)
    grads = []
    for use_checkpoint in (False, True):
        xl = x.clone().requires_grad_()
        torch.manual_seed(5)
        y = checkpoint(f, xl, use_reentrant=False) if use_checkpoint else f(xl)
        torch.manual_seed(6)  # the generator moved on before the backward
        y.backward(torch.ones_like(y))
        grads.append((y.detach(), xl.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])


@pytest.mark.gpu
def test_gpu_host_seed(device):
    # From the CUDA generator's (seed, offset): replayed by torch.cuda.manual_seed, one
    # Philox call's offset per seed, within [0, SEED_BOUND); None while capturing
    dev = torch.device(device)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    torch.cuda.manual_seed(3)
    seeds = [host_seed(dev) for _ in range(64)]
    assert generator.get_offset() == 4 * 64
    torch.cuda.manual_seed(3)
    assert [host_seed(dev) for _ in range(64)] == seeds
    assert len(set(seeds)) == 64 and all(0 <= s < SEED_BOUND for s in seeds)
    torch.cuda.manual_seed(4)
    assert host_seed(dev) not in seeds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert host_seed(dev) is None


def test_eager_launch_bound_per_shape(device):
    # the first eager call of a shape binds its launch (its `_EAGER_PLANS` entry); a repeat
    # takes it and draws the same mask from the same seed; a view of more irreducible dims
    # than the kernel walks is copied first, on the bound path too
    import triton_transformer.dropout as dropout_mod

    x = torch.randn(6, 130, device=device) + 0.5
    seed = torch.tensor(1234, device=device)
    first = dropout(x, 0.3, use_triton=True, seed=seed)
    (plan,) = dropout_mod._EAGER_PLANS.plans.values()
    assert len(plan.bound) == 1
    assert torch.equal(dropout(x, 0.3, use_triton=True, seed=seed), first)
    assert len(plan.bound) == 1 and len(dropout_mod._EAGER_PLANS.plans) == 1
    odd = torch.randn(2, 3, 4, 5, 6, 7, device=device)[:, :, ::2, :, ::2, ::2]  # 5 dims
    want = dropout(odd.contiguous(), 0.3, use_triton=True, seed=seed)
    for _ in range(2):
        assert torch.equal(dropout(odd, 0.3, use_triton=True, seed=seed), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_plan_matches_registered_op(dtype, device):
    # An eager call takes its layout's plan (`dropout._EagerPlan`: made on the first call, its
    # launches bound then, taken by every later call). Each call gives, bit for bit, what the
    # registered op gives through the dispatcher from the same seed, forward and backward,
    # with a dense, an expanded (a sum's) and a strided upstream gradient, and a seed that
    # is a view not 16-byte aligned (`draw_seeds(...)[1]`).
    import triton_transformer.dropout as dropout_mod

    x = (torch.randn(5, 3, 130, device=device) + 0.5).to(dtype)
    wide = torch.randn(5, 3, 260, device=device).to(dtype)
    dys = (torch.randn_like(x), torch.ones((), device=device, dtype=dtype).expand(x.shape))
    seeds = draw_seeds(device, 2)
    for dy in (*dys, wide[..., ::2]):
        for seed in (seeds[0], seeds[1]):
            results = []
            for registered in (False, False, True):
                xl = x.detach().requires_grad_()
                if registered:
                    y = dropout_op(xl, 0.3, seed)
                else:
                    y = dropout(xl, 0.3, use_triton=True, seed=seed)
                y.backward(dy)
                results.append((y, xl.grad))
            for got in results[:2]:
                for a, want in zip(got, results[2], strict=True):
                    assert torch.equal(a, want)
    assert len(dropout_mod._EAGER_PLANS.plans) == 1
    with torch.no_grad():
        assert torch.equal(dropout(x, 0.3, use_triton=True, seed=seeds[0]),
                           dropout_op(x, 0.3, seeds[0]))  # fmt: skip
    assert len(dropout_mod._EAGER_PLANS.plans) == 1


def test_eager_plan_keeps_the_checks(device):
    # A plan is taken only by calls of its validated layout and p: the generic path's errors
    # still come after one exists, and p of 0 or 1 takes no plan (no kernel).
    import triton_transformer.dropout as dropout_mod

    x = torch.randn(4, 16, device=device)
    dropout(x, 0.3, use_triton=True)
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(x, 1.5, use_triton=True)
    with pytest.raises(TypeError, match="p must be a real number"):
        dropout(x, "0.3", use_triton=True)
    with pytest.raises(TypeError, match="dtype"):
        dropout(x.to(torch.int32), 0.3, use_triton=True)
    with pytest.raises(TypeError, match="seed"):
        dropout(x, 0.3, use_triton=True, seed=torch.tensor(1.0, device=device))
    assert dropout(x, 0.0, use_triton=True) is x
    assert torch.equal(dropout(x, 1.0, use_triton=True), torch.zeros_like(x))
    assert len(dropout_mod._EAGER_PLANS.plans) == 1
