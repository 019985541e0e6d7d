"""AdamW: the Triton update against a float64 evaluation of the update's formula, the optimizer
as a drop-in for torch.optim.AdamW (with clip_grad_norm_), tables that follow re-allocated
gradients, and a CUDA-graph capture on the GPU."""

import copy
import math

import pytest
import torch

from triton_transformer import adamw as adamw_module
from triton_transformer.adamw import AdamW, adamw_, grad_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative error of one step's stored results against float64 (fp32: a few ulps of the
# parameter and moments; fp16/bf16: one rounding to the storage type).
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
BETAS = (0.9, 0.95)


def shapes():
    """Every path of the block map: a 1-element tensor, ragged ones, one spanning two
    blocks and a 2-D one."""
    return [(1,), (7,), (adamw_module.BLOCK + 5,), (9, 13)]


def off_centre(shape, dtype, device, scale=1.0, shift=0.3):
    return (shift + scale * torch.randn(shape, dtype=torch.float64, device=device)).to(dtype)


def expected_step(p, g, m, v, step, lr, wd, eps, scale):
    """The module docstring's update in float64 from one step's inputs (step already
    incremented)."""
    beta1, beta2 = BETAS
    g = g.double() * scale
    m = beta1 * m.double() + (1 - beta1) * g
    v = beta2 * v.double() + (1 - beta2) * g * g
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    p = p.double() * (1 - lr * wd) - lr / bias1 * m / (v.sqrt() / math.sqrt(bias2) + eps)
    return p, m, v


def assert_close(out, ref, dtype):
    torch.testing.assert_close(out.double(), ref, rtol=RTOL[dtype], atol=RTOL[dtype] * 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lr_on_device", [False, True])
@pytest.mark.parametrize("max_norm", [None, 0.5, 1e6])
def test_each_step_matches_float64(device, dtype, lr_on_device, max_norm):
    """Three steps, each checked against float64 from that step's own inputs; clipping that
    scales (0.5) and that does not (1e6)."""
    lr_value, wd, eps = 3e-2, 0.1, 1e-8
    params = [off_centre(s, dtype, device).requires_grad_() for s in shapes()]
    lr = torch.tensor(lr_value, device=device) if lr_on_device else lr_value
    opt = AdamW(params, lr=lr, betas=BETAS, eps=eps, weight_decay=wd, use_triton=True)
    for step in range(1, 4):
        for p in params:
            p.grad = off_centre(p.shape, dtype, device, scale=2.0)
        before = [
            (p.detach().clone(), p.grad.clone(), opt.state[p]["exp_avg"].clone(),
             opt.state[p]["exp_avg_sq"].clone()) if opt.state[p] else
            (p.detach().clone(), p.grad.clone(), torch.zeros_like(p), torch.zeros_like(p))
            for p in params
        ]  # fmt: skip
        scale = 1.0
        if max_norm is not None:
            norm = opt.clip_grad_norm(max_norm)
            ref_norm = math.sqrt(sum(float(g.double().square().sum()) for _, g, _, _ in before))
            torch.testing.assert_close(float(norm), ref_norm, rtol=1e-5, atol=0)
            scale = min(1.0, max_norm / (ref_norm + 1e-6))
        opt.step()
        for p, (p0, g0, m0, v0) in zip(params, before, strict=True):
            ref_p, ref_m, ref_v = expected_step(p0, g0, m0, v0, step, lr_value, wd, eps, scale)
            state = opt.state[p]
            assert float(state["step"]) == step and state["step"].dtype == torch.float32
            assert state["exp_avg"].dtype == dtype and p.dtype == dtype
            assert_close(state["exp_avg"], ref_m, dtype)
            assert_close(state["exp_avg_sq"], ref_v, dtype)
            assert_close(p.detach(), ref_p, dtype)
            torch.testing.assert_close(p.grad, g0, rtol=0, atol=0)  # grads never rewritten


def _twin_models(device):
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(13, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 5)
    ).to(device)
    twin = torch.nn.Sequential(
        torch.nn.Linear(13, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 5)
    ).to(device)
    twin.load_state_dict(model.state_dict())
    return model, twin


def _groups(model):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _train(model, opt, sched, steps, device, clip_ours):
    torch.manual_seed(2)
    for _ in range(steps):
        x = off_centre((16, 13), torch.float32, device)
        loss = model(x).square().mean() * 50  # big gradients: the clip bites
        opt.zero_grad(set_to_none=True)  # fresh gradient tensors every step
        loss.backward()
        if clip_ours:
            opt.clip_grad_norm(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()


@pytest.mark.parametrize("use_triton", [False, True])
def test_drop_in_for_torch_adamw(device, use_triton):
    """Two param groups, a tensor learning rate driven by LambdaLR, gradients re-allocated
    each step and clipped: the same parameters as torch.optim.AdamW + clip_grad_norm_."""
    model, twin = _twin_models(device)
    lr = lambda: torch.tensor(1e-2, device=device)
    ours = AdamW(_groups(model), lr=lr(), betas=BETAS, use_triton=use_triton)
    ref = torch.optim.AdamW(_groups(twin), lr=lr(), betas=BETAS, capturable=device == "cuda")
    warm = lambda s: min(1.0, (s + 1) / 3)
    s1 = torch.optim.lr_scheduler.LambdaLR(ours, warm)
    s2 = torch.optim.lr_scheduler.LambdaLR(ref, warm)
    _train(model, ours, s1, 5, device, clip_ours=True)
    _train(twin, ref, s2, 5, device, clip_ours=False)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert set(ours.state_dict()["state"][0]) == set(ref.state_dict()["state"][0])


def test_state_dicts_load_both_ways(device):
    """torch's AdamW state resumes in ours and ours in torch's: the same next steps."""
    model, twin = _twin_models(device)
    ref = torch.optim.AdamW(_groups(twin), lr=1e-2, betas=BETAS)
    sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0)
    _train(twin, ref, sched, 2, device, clip_ours=False)
    model.load_state_dict(twin.state_dict())
    ours = AdamW(_groups(model), lr=1e-2, betas=BETAS, use_triton=True)
    # (copies: load_state_dict keeps tensors that need no cast, so the two would share them)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # its step counts: CPU tensors
    _train(model, ours, torch.optim.lr_scheduler.LambdaLR(ours, lambda s: 1.0), 2, device, True)
    _train(twin, ref, sched, 2, device, clip_ours=False)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    back = torch.optim.AdamW(_groups(twin), lr=1e-2, betas=BETAS)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    for p_ours, p_back in zip(model.parameters(), twin.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(back.state[p_back][key].cpu(), ours.state[p_ours][key].cpu())
    assert back.param_groups[0]["decoupled_weight_decay"]


def test_params_without_gradient_are_skipped(device):
    a = off_centre((5,), torch.float32, device).requires_grad_()
    b = off_centre((6,), torch.float32, device).requires_grad_()
    b_before = b.detach().clone()
    opt = AdamW([a, b], use_triton=True)
    a.grad = torch.ones_like(a)
    opt.step()
    assert b not in opt.state and torch.equal(b.detach(), b_before)
    assert float(opt.state[a]["step"]) == 1


def test_a_gradient_that_comes_and_goes(device):
    """The cached launch lists (every parameter with a gradient) are left as soon as one
    gradient is missing, and taken up again: each step updates exactly the parameters that
    have a gradient, as the reference optimizer does."""
    params = [off_centre((n,), torch.float32, device).requires_grad_() for n in (5, 6, 7)]
    twins = [p.detach().clone().requires_grad_() for p in params]
    ours = AdamW(params, lr=1e-2, use_triton=True)
    ref = AdamW(twins, lr=1e-2, use_triton=False)
    for present in ((0, 1, 2), (0, 2), (0, 1, 2), (1,), (0, 1)):
        for i, (p, q) in enumerate(zip(params, twins, strict=True)):
            g = off_centre(p.shape, torch.float32, device) if i in present else None
            p.grad, q.grad = g, None if g is None else g.clone()
        ours.step()
        ref.step()
        for p, q in zip(params, twins, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [float(ours.state[p]["step"]) for p in params] == [4.0, 4.0, 3.0]


def test_mixed_dtypes_and_non_contiguous_params(device):
    """fp32 and bf16 parameters in one group take one launch each; a transposed parameter
    (its state transposed too) takes the reference update; all as float64 says."""
    lr, wd, eps = 1e-2, 0.1, 1e-8
    params = [
        off_centre((33,), torch.float32, device),
        off_centre((17,), torch.bfloat16, device),
        off_centre((6, 9), torch.float32, device).t(),
    ]
    params = [p.requires_grad_() for p in params]
    assert not params[2].is_contiguous()
    opt = AdamW(params, lr=lr, betas=BETAS, eps=eps, weight_decay=wd, use_triton=True)
    for p in params:
        p.grad = off_centre(tuple(p.shape), p.dtype, device).t().contiguous().t() if p.ndim == 2 \
            else off_centre(p.shape, p.dtype, device)  # fmt: skip
    before = [(p.detach().clone(), p.grad.clone()) for p in params]
    opt.step()
    for p, (p0, g0) in zip(params, before, strict=True):
        zeros = torch.zeros_like(p0)
        ref_p, ref_m, _ = expected_step(p0, g0, zeros, zeros, 1, lr, wd, eps, 1.0)
        assert_close(p.detach(), ref_p, p.dtype)
        assert_close(opt.state[p]["exp_avg"], ref_m, p.dtype)


def test_table_follows_reallocated_gradients(device):
    """The cached table is rebuilt when a gradient moves (and reused when nothing did)."""
    p = off_centre((100,), torch.float32, device).requires_grad_()
    twin = p.detach().clone().requires_grad_()
    ours = AdamW([p], lr=1e-2, use_triton=True)
    ref = AdamW([twin], lr=1e-2, use_triton=False)
    grads, tables = [], []  # both kept alive: every gradient a new address
    for _ in range(3):
        g = off_centre((100,), torch.float32, device)
        p.grad, twin.grad = g.clone(), g.clone()
        grads.append(p.grad)
        ours.step()
        ref.step()
        tables.append(ours._tables[0])
    assert len({id(t) for t in tables}) == 3
    ours.step()  # the same gradient again: the same table
    ref.step()
    assert ours._tables[0] is tables[-1]
    torch.testing.assert_close(p, twin, rtol=1e-5, atol=1e-6)


def test_rebuilt_table_equals_a_fresh_one(device):
    """A table made from the last one (device copy, the moved gradients' addresses written by
    the kernel, the block map shared) holds what a table built from scratch holds."""
    from triton_transformer.adamw import ADDRESSES_PER_LAUNCH, TensorTable, table_key

    n = ADDRESSES_PER_LAUNCH + 3  # two launches of the address kernel
    params = [torch.zeros(i % 5 + 1, device=device) for i in range(n)]
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    steps = [torch.zeros((), device=device) for _ in params]
    old_grads = [torch.zeros_like(p) for p in params]
    copies = [torch.zeros_like(p) if i % 3 else None for i, p in enumerate(params)]
    lists = [params, old_grads, *states, steps, copies]
    first = TensorTable(lists, table_key(lists))
    new_grads = [torch.zeros_like(p) for p in params]
    copies = [torch.zeros_like(p) if i % 3 else None for i, p in enumerate(params)]
    lists = [params, new_grads, *states, steps, copies]
    rebuilt = TensorTable(lists, table_key(lists), like=first)
    fresh = TensorTable(lists, table_key(lists))
    assert torch.equal(rebuilt.rows, fresh.rows) and not torch.equal(rebuilt.rows, first.rows)
    assert rebuilt.block_tensor is first.block_tensor
    assert torch.equal(rebuilt.block_tensor, fresh.block_tensor)


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_cast_copies_hold_each_update(device, use_triton, copy_dtype):
    """`cast_copies`: after every step each copy equals its parameter cast (rounded to
    nearest even) bit for bit, parameters without a copy are untouched by the option, and
    the updates equal an optimizer's without copies."""
    params = [off_centre(s, torch.float32, device).requires_grad_() for s in shapes()]
    twins = [p.detach().clone().requires_grad_() for p in params]
    opt = AdamW(params, lr=3e-2, betas=BETAS, use_triton=use_triton)
    ref = AdamW(twins, lr=3e-2, betas=BETAS, use_triton=use_triton)
    copied = params[1:3]  # one ragged tensor, one spanning two blocks
    opt.cast_copies(copied, copy_dtype)
    for step in range(3):
        for p, t in zip(params, twins, strict=True):
            p.grad = off_centre(p.shape, torch.float32, device, scale=2.0)
            t.grad = p.grad.clone()
        for o in (opt, ref):
            o.clip_grad_norm(1.0)
            o.step()
        for p, t in zip(params, twins, strict=True):
            assert torch.equal(p, t), step
        current = opt.current_copies()
        assert [id(p) for p, _ in current] == [id(p) for p in copied]
        for p, c in current:
            assert c.dtype == copy_dtype and torch.equal(c, p.detach().to(copy_dtype)), step


def test_a_changed_parameter_leaves_its_copy_out(device):
    """A parameter changed in place outside `step` (its version moves) has no current copy
    until the next step rewrites it; the others keep theirs."""
    params = [off_centre((7, 3), torch.float32, device).requires_grad_() for _ in range(2)]
    opt = AdamW(params, lr=1e-2, use_triton=True)
    opt.cast_copies(params, torch.bfloat16)
    assert len(opt.current_copies()) == 2  # written from the parameters at once
    with torch.no_grad():
        params[0].add_(1.0)
    assert [p for p, _ in opt.current_copies()] == [params[1]]
    for p in params:
        p.grad = off_centre(p.shape, torch.float32, device)
    opt.step()
    current = opt.current_copies()
    assert len(current) == 2
    for p, c in current:
        assert torch.equal(c, p.detach().to(torch.bfloat16))


def test_reuse_weight_casts_takes_the_copies(device):
    """`bmm.reuse_weight_casts(module, copies=...)` hands `linear` the optimizer's copies
    instead of casting (the same tensors), and still casts a weight without one."""
    from triton_transformer import bmm

    model, _ = _twin_models(device)
    opt = AdamW(_groups(model), lr=1e-2, use_triton=True)
    first, last = model[0].weight, model[2].weight
    assert bmm.trainable_casts(model, torch.bfloat16) == [first, last]
    opt.cast_copies([first], torch.bfloat16)
    (copy,) = [c for _, c in opt.current_copies()]
    with bmm.reuse_weight_casts(model, copies=opt.current_copies()):
        assert bmm._weight_in(first, torch.bfloat16) is copy
        cast = bmm._weight_in(last, torch.bfloat16)
        assert torch.equal(cast, last.detach().to(torch.bfloat16))
    with bmm.reuse_weight_casts(model):  # without them: a cast of its own
        assert bmm._weight_in(first, torch.bfloat16) is not copy


def test_cast_copies_errors_and_skips(device):
    p = off_centre((5,), torch.float32, device).requires_grad_()
    opt = AdamW([p], lr=1e-2, use_triton=True)
    opt.cast_copies([p.detach().clone()], torch.bfloat16)  # not updated by it: no copy
    assert opt.current_copies() == []
    with pytest.raises(ValueError, match="a floating dtype"):
        opt.cast_copies([p], torch.int32)
    opt.cast_copies([p], torch.bfloat16)
    opt.cast_copies([p], torch.bfloat16)  # again: nothing new
    q = off_centre((5,), torch.float32, device).requires_grad_()
    opt.add_param_group({"params": [q]})
    with pytest.raises(ValueError, match=r"keeps copies in torch\.bfloat16, not torch\.float16"):
        opt.cast_copies([q], torch.float16)
    g = [torch.zeros_like(p)]
    state = [[torch.zeros_like(p)], [torch.zeros_like(p)], [torch.zeros((), device=device)]]
    with pytest.raises(ValueError, match="one per parameter"):
        adamw_([p], g, *state, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
               copies=[])  # fmt: skip
    with pytest.raises(ValueError, match="the parameter's shape"):
        adamw_([p], g, *state, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
               copies=[torch.zeros(4, device=device)])  # fmt: skip


def test_no_gradient_outlives_zero_grad(device):
    """The optimizer keeps no reference to a gradient between steps: zero_grad(set_to_none)
    frees them (a cached one would hold a whole gradient set through the next backward)."""
    import weakref

    params = [off_centre((n,), torch.float32, device).requires_grad_() for n in (5, 6)]
    opt = AdamW(params, lr=1e-2, use_triton=True)
    for _ in range(3):  # the first step takes the slow path, the later ones the cached lists
        for p in params:
            p.grad = off_centre(p.shape, torch.float32, device)
        refs = [weakref.ref(p.grad) for p in params]
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(r() is None for r in refs)


def test_zero_grad_drops_an_unused_clip(device):
    p = off_centre((10,), torch.float32, device).requires_grad_()
    twin = p.detach().clone().requires_grad_()
    ours = AdamW([p], lr=1e-2, use_triton=True)
    ref = AdamW([twin], lr=1e-2, use_triton=True)
    p.grad = torch.full_like(p, 100.0)
    ours.clip_grad_norm(1e-3)  # the step is then abandoned
    ours.zero_grad()
    g = off_centre((10,), torch.float32, device)
    p.grad, twin.grad = g.clone(), g.clone()
    ours.step()
    ref.step()
    torch.testing.assert_close(p, twin, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_norm_both_branches(device, dtype):
    grads = [off_centre(s, dtype, device) for s in shapes()]
    grads.append(off_centre((8, 5), dtype, device).t())  # non-contiguous: summed by torch
    ref = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    for use_triton in (False, True):
        norm = grad_norm(grads, use_triton=use_triton)
        assert norm.dtype == torch.float32 and norm.ndim == 0
        torch.testing.assert_close(float(norm), ref, rtol=1e-5, atol=0)


def test_functional_update_lengths_and_sparse_are_checked(device):
    p = torch.zeros(3, device=device)
    with pytest.raises(ValueError, match="same length"):
        adamw_([p], [], [p], [p], [torch.zeros(())], lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8,
               weight_decay=0.0)  # fmt: skip
    with pytest.raises(ValueError, match="shaped like the parameter"):
        adamw_([p], [torch.zeros(4, device=device)], [p], [p], [torch.zeros((), device=device)],
               lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0)  # fmt: skip
    sparse = torch.zeros(3, device=device).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        adamw_([p], [sparse], [p], [p], [torch.zeros((), device=device)], lr=1e-3, beta1=0.9,
               beta2=0.9, eps=1e-8, weight_decay=0.0)  # fmt: skip
    with pytest.raises(ValueError, match="at least one"):
        grad_norm([])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "learning rate"),
        ({"eps": -1.0}, "epsilon"),
        ({"betas": (1.0, 0.9)}, "beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "beta parameter at index 1"),
        ({"weight_decay": -0.1}, "weight_decay"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW([torch.zeros(2, requires_grad=True)], **kwargs)


def test_clip_errors(device):
    p = torch.zeros(3, device=device, requires_grad=True)
    opt = AdamW([p], use_triton=True)
    with pytest.raises(ValueError, match="no parameter has a gradient"):
        opt.clip_grad_norm(1.0)
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="max_norm must be positive"):
        opt.clip_grad_norm(0.0)


def test_cpu_params_without_interpreter_raise(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="need a CUDA tensor"):
        AdamW([p], use_triton=True).step()


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large_step_matches_float64(dtype):
    """Real sizes (a GPT-2 embedding's 38.6M elements, a matrix, a vector), one step with
    clipping, against float64."""
    lr, wd, eps = 1e-3, 0.1, 1e-8
    params = [
        off_centre(s, dtype, "cuda").requires_grad_()
        for s in [(50304, 768), (768, 3072), (768,), (3,)]
    ]
    opt = AdamW(params, lr=torch.tensor(lr, device="cuda"), betas=BETAS, eps=eps,
                weight_decay=wd, use_triton=True)  # fmt: skip
    for p in params:
        p.grad = off_centre(p.shape, dtype, "cuda", scale=1e-3)
    before = [(p.detach().clone(), p.grad.clone()) for p in params]
    norm = opt.clip_grad_norm(1.0)
    ref_norm = torch.linalg.vector_norm(torch.cat([g.double().flatten() for _, g in before]))
    torch.testing.assert_close(norm.double(), ref_norm, rtol=1e-5, atol=0)
    scale = min(1.0, 1.0 / (float(ref_norm) + 1e-6))
    opt.step()
    for p, (p0, g0) in zip(params, before, strict=True):
        zeros = torch.zeros_like(p0)
        ref_p, ref_m, ref_v = expected_step(p0, g0, zeros, zeros, 1, lr, wd, eps, scale)
        assert_close(p.detach(), ref_p, dtype)
        assert_close(opt.state[p]["exp_avg"], ref_m, dtype)
        assert_close(opt.state[p]["exp_avg_sq"], ref_v, dtype)


@pytest.mark.gpu
def test_gpu_captured_step_replays_as_eager_and_deterministically():
    """A training step (zero_grad to None, backward, clip, update) captured in a CUDA graph
    after two eager steps: every replay equals the same steps run eagerly, bit for bit
    (the update's sums have a fixed order), and the capture's table stays alive."""
    from triton_transformer.cuda_graph import GraphedStep

    model, twin = _twin_models("cuda")
    x = off_centre((64, 13), torch.float32, "cuda")

    def make_step(m):
        opt = AdamW(_groups(m), lr=torch.tensor(1e-2, device="cuda"), betas=BETAS,
                    use_triton=True)  # fmt: skip

        def step():
            opt.zero_grad(set_to_none=True)
            loss = m(x).square().mean() * 50
            loss.backward()
            norm = opt.clip_grad_norm(1.0)
            opt.step()
            return loss.detach(), norm

        return opt, step

    opt, step = make_step(model)
    graphed = GraphedStep(step, warmup_steps=2)
    _, eager_step = make_step(twin)
    for _ in range(6):
        loss, norm = graphed()
        ref_loss, ref_norm = eager_step()
        assert torch.equal(loss, ref_loss) and torch.equal(norm, ref_norm)
    assert graphed.captured and opt._captured
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
