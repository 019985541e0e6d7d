"""matmul_hopper: the relu² feed-forward's fused products in Gluon for Hopper, against float64
products, and as the matmul planner's choice.

Gluon has no interpreter: on CPU the kernel is compiled for sm_90 (every epilogue, both
layouts of B); on the GPU it runs every epilogue, layout and dtype at ragged shapes.
"""

import pytest
import torch
from helpers import SM90_DRIVER, check_compiles, needs_gluon, on_hopper, record_calls

import triton_transformer.matmul_hopper as mh

COMPILE_SCRIPT = (
    SM90_DRIVER
    + """
import triton_transformer.matmul_hopper as mh

M, N, K = 1000, 520, 200
a = torch.empty(M, K, dtype=torch.bfloat16)
c = torch.empty(M, N, dtype=torch.bfloat16)
seed = torch.empty((), dtype=torch.int64)
for name, code in mh.EPILOGUES.items():
    for b_t in (False, True):
        b = torch.empty((N, K) if b_t else (K, N), dtype=torch.bfloat16)
        kernel = mh._mm_sm90_kernel.warmup(
            a, b, c, c, M, N, K, K, b.stride(0), N, N, 1.0, seed, 6554, B_T=b_t, EPILOGUE=code,
            GROUP_M=8, NUM_SMS=132, grid=(1,), **mh.TILES, **mh.LAUNCH,
        )
        assert "wgmma.mma_async" in kernel.asm["ptx"]
        print("ok", name, b_t)
"""
)


@needs_gluon
def test_kernel_compiles_for_sm90():
    check_compiles(COMPILE_SCRIPT, len(mh.EPILOGUES) * 2)


@needs_gluon
@pytest.mark.parametrize("hopper", [False, True])
def test_usable_needs_hopper(hopper, monkeypatch):
    # `usable` consults the shared Hopper check (`_gluon.is_sm90`, whose compute-capability
    # logic test_attention_hopper covers)
    monkeypatch.setattr(mh, "is_sm90", lambda device: hopper)
    a = torch.empty(4096, 64, dtype=torch.bfloat16, device="meta")
    b = torch.empty(64, 4096, dtype=torch.bfloat16, device="meta")
    c = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    assert mh.usable(a, b, c, None, 132) is hopper


@needs_gluon
def test_usable_needs_one_dtype_and_tma_describable_tensors(monkeypatch):
    monkeypatch.setattr(mh, "is_sm90", lambda device: True)
    a = torch.empty(128, 64, dtype=torch.bfloat16)
    b = torch.empty(64, 128, dtype=torch.bfloat16)
    c = torch.empty(128, 128, dtype=torch.bfloat16)
    assert mh.usable(a, b, c, c, 1)
    assert not mh.usable(a.float(), b.float(), c.float(), None, 1)  # fp32
    assert not mh.usable(a, b, c.half(), None, 1)  # the output in another dtype
    assert not mh.usable(a, b.half(), c, None, 1)  # B in another dtype
    # the kept tile in another dtype: fp32 would overrun the kernel's 16-bit buffer, fp16
    # read as bf16 would be wrong
    assert not mh.usable(a, b, c, c.float(), 1)
    assert not mh.usable(a, b, c, c.half(), 1)
    assert not mh.usable(torch.empty(64, 128, dtype=torch.bfloat16).t(), b, c, None, 1)  # A (K, M)
    odd_rows = torch.empty(128, 68, dtype=torch.bfloat16)[:, :64]  # a row stride of 136 bytes
    assert not mh.usable(odd_rows, b, c, None, 1)
    assert not mh.usable(a, b, c, torch.empty(128, 128, dtype=torch.bfloat16).t(), 1)  # kept (N, M)
    assert not mh.usable(a, b, c, torch.empty(1, 128, dtype=torch.bfloat16).expand(128, 128), 1)
    shifted = torch.empty(128 * 64 + 1, dtype=torch.bfloat16)[1:].view(128, 64)
    assert not mh.usable(shifted, b, c, None, 1)  # its start 2 bytes off alignment


@needs_gluon
def test_launch_rejects_what_the_planner_screens():
    a = torch.empty(128, 0, dtype=torch.bfloat16)
    b = torch.empty(0, 128, dtype=torch.bfloat16)
    c = torch.empty(128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="empty product"):
        mh.launch_mm_sm90(a, b, c, False, "relu2")
    a, b = torch.empty(128, 64, dtype=torch.bfloat16), torch.empty(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pass kept"):
        mh.launch_mm_sm90(a, b, c, False, "relu2grad_from_square")
    with pytest.raises(ValueError, match="seed"):
        mh.launch_mm_sm90(a, b, c, False, "relu2_dropout", p=0.1)
    with pytest.raises(ValueError, match="no dropout"):
        mh.launch_mm_sm90(a, b, c, False, "relu2", p=0.1)


def test_planner_epilogues():
    # which of the planner's epilogue arguments the Gluon kernel has: relu² with or without
    # its dropout; relu²'s gradient from the forward's output Y (which holds a dropout's mask)
    # or from relu(P) without a dropout; nothing with a residual, a kept relu(P) beside the
    # output, SwiGLU, a plain product, or relu(P)'s gradient after a dropout (no mask in it)
    from triton_transformer.matmul_plan import _gluon_epilogue

    t = torch.empty(2, 2)
    drop = (0.1, torch.zeros((), dtype=torch.int64))
    assert _gluon_epilogue(True, None, None, None, False, None) == "relu2"
    assert _gluon_epilogue(True, None, None, drop, False, None) == "relu2_dropout"
    assert _gluon_epilogue(False, None, None, None, False, (t, True)) == "relu2grad_from_square"
    assert _gluon_epilogue(False, None, None, drop, False, (t, True)) == "relu2grad_from_square"
    assert _gluon_epilogue(False, None, None, None, False, (t, False)) == "relu2grad"
    assert _gluon_epilogue(False, None, None, drop, False, (t, False)) is None
    assert _gluon_epilogue(True, t, None, None, False, None) is None
    assert _gluon_epilogue(True, None, t, None, False, None) is None
    assert _gluon_epilogue(False, None, None, None, True, None) is None
    assert _gluon_epilogue(False, None, None, None, False, None) is None


@needs_gluon
def test_usable_needs_a_tile_per_sm(monkeypatch):
    # problems with fewer output tiles than SMs go to the autotuned Triton kernel
    monkeypatch.setattr(mh, "is_sm90", lambda device: True)
    bm, bn = mh.TILES["BLOCK_M"], mh.TILES["BLOCK_N"]
    a = torch.empty(bm * 12, 64, dtype=torch.bfloat16, device="meta")
    b = torch.empty(64, bn * 11, dtype=torch.bfloat16, device="meta")
    c = torch.empty(bm * 12, bn * 11, dtype=torch.bfloat16, device="meta")
    assert mh.usable(a, b, c, None, 132)  # 12 x 11 tiles
    assert mh.usable(a[:-1], b, c[:-1], None, 132)  # one row fewer: still 12 row tiles
    assert not mh.usable(a, b[:, : bn * 10], c[:, : bn * 10], None, 132)  # 12 x 10


# --- GPU ---------------------------------------------------------------------------------

# (M, N, K): one tile and less, ragged edges in every dimension, several tiles per program
# (GPT-2's feed-forward at 4096 tokens), and several tiles per program with fewer K steps than
# ring buffers (the consumers' turns keep the second from reading the ring a phase early)
SHAPES = [
    (8, 64, 16), (300, 264, 72), (1000, 1032, 200), (4096, 3072, 768), (4096, 4096, 72),
    (2048, 4136, 256),
]  # fmt: skip


def _problem(M, N, K, b_t, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g).to(dtype) + 0.25  # off-centre
    b = torch.randn(N, K, device="cuda", generator=g).to(dtype) * K**-0.5
    b = b if b_t else b.t().contiguous()
    return a, b


def _reference(a, b, b_t, epilogue, kept):
    """The epilogue of a @ b in float64; kept: the forward's output (relu(P) or relu(P)²)."""
    prod = a.double() @ (b.double().t() if b_t else b.double())
    if epilogue == "relu2":
        return prod.clamp_min(0) ** 2
    relu = kept.double().sqrt() if epilogue == "relu2grad_from_square" else kept.double()
    return prod * 2 * relu


@on_hopper
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("epilogue", [e for e in mh.EPILOGUES if e != "relu2_dropout"])
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_against_float64(shape, epilogue, b_t, dtype):
    M, N, K = shape
    a, b = _problem(M, N, K, b_t, dtype)
    kept = None
    if epilogue != "relu2":  # what the forward kept: relu(P)² or relu(P), off-centre
        pre = torch.randn(M, N, device="cuda") + 0.5
        kept = (pre.clamp_min(0) ** (2 if epilogue.endswith("square") else 1)).to(dtype)
    c = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    mh.launch_mm_sm90(a, b, c, b_t, epilogue, kept)
    ref = _reference(a, b, b_t, epilogue, kept)
    assert torch.isfinite(c).all()
    err = (c.double() - ref).norm() / ref.norm()
    assert err < 1e-2, err
    # elementwise too: a misplaced tile shows here even where the norm hides it
    torch.testing.assert_close(c.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@on_hopper
def test_gradient_in_place():
    # the output written over the kept tile (each tile's kept values are read before its
    # output is stored)
    M, N, K = 2048, 4096, 256
    a, b = _problem(M, N, K, False, torch.bfloat16)
    kept = (torch.randn(M, N, device="cuda") + 0.5).clamp_min(0).pow(2).to(torch.bfloat16)
    ref = _reference(a, b, False, "relu2grad_from_square", kept)
    mh.launch_mm_sm90(a, b, kept, False, "relu2grad_from_square", kept)
    assert (kept.double() - ref).norm() / ref.norm() < 1e-2


@on_hopper
def test_strided_rows():
    # operands and outputs that are column slices of wider tensors (row strides above the width)
    M, N, K = 500, 264, 136
    a_wide = torch.randn(M, K + 64, device="cuda").to(torch.bfloat16)
    b_wide = torch.randn(K, N + 8, device="cuda").to(torch.bfloat16) * K**-0.5
    c_wide = torch.zeros(M, N + 40, device="cuda", dtype=torch.bfloat16)
    kept_wide = torch.rand(M, N + 24, device="cuda").to(torch.bfloat16)
    a, b, c, kept = a_wide[:, :K], b_wide[:, :N], c_wide[:, :N], kept_wide[:, :N]
    mh.launch_mm_sm90(a, b, c, False, "relu2grad_from_square", kept)
    ref = _reference(a, b, False, "relu2grad_from_square", kept)
    assert (c.double() - ref).norm() / ref.norm() < 1e-2
    assert (c_wide[:, N:] == 0).all()  # nothing written past the view's columns


@on_hopper
@pytest.mark.parametrize("b_t", [False, True])
def test_gradient_after_dropout(b_t):
    # the forward's output after a dropout of p holds the mask: dP = (dY W) · 2·√Y / √(1 - p)
    # against float64's (dY W) · 2·relu(P) · keep / (1 - p)
    M, N, K, p = 1000, 1032, 200, 0.3
    a, b = _problem(M, N, K, b_t, torch.bfloat16)
    relu = (torch.randn(M, N, device="cuda") + 0.5).clamp_min(0)
    keep = (torch.rand(M, N, device="cuda") >= p).double()
    y = (relu.double() ** 2 * keep / (1 - p)).to(torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    mh.launch_mm_sm90(a, b, c, b_t, "relu2grad_from_square", y, p=p)
    prod = a.double() @ (b.double().t() if b_t else b.double())
    ref = prod * 2 * relu.double() * keep / (1 - p)
    assert (c[keep == 0] == 0).all()
    assert (c.double() - ref).norm() / ref.norm() < 1e-2


@on_hopper
@pytest.mark.parametrize("shape", [(300, 264, 72), (4096, 3072, 768), (2048, 4136, 256)])
@pytest.mark.parametrize("b_t", [False, True])
def test_dropout_forward_draws_the_package_mask(shape, b_t):
    # relu(P)² · keep / (1 - p) with keep the package's mask (`dropout_keep_tile`, as
    # `relu2_grad_op` regenerates it): the same elements dropped, the kept against float64
    from test_mlp import keep_mask

    from triton_transformer.utils import draw_seeds

    M, N, K = shape
    p = 0.3
    a, b = _problem(M, N, K, b_t, torch.bfloat16)
    seed = draw_seeds("cuda", 1)[0]
    c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    mh.launch_mm_sm90(a, b, c, b_t, "relu2_dropout", p=p, seed=seed)
    keep = keep_mask(p, seed, (M, N), "cuda")
    ref = torch.where(keep, _reference(a, b, b_t, "relu2", None) / (1 - p), 0.0)
    assert (c[~keep] == 0).all()
    assert 0.6 < keep.float().mean().item() < 0.8
    assert (c.double() - ref).norm() / ref.norm() < 1e-2
    torch.testing.assert_close(c.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.fixture
def gluon_launches(monkeypatch):
    """The epilogues of the Gluon kernel's launches."""
    return record_calls(monkeypatch, mh, "launch_mm_sm90", lambda *args, **kwargs: args[4])


@on_hopper
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_feed_forward_takes_it(p, gluon_launches):
    # GPT-2's feed-forward at 4096 tokens (384 output tiles): the planner sends the relu²
    # forward and relu²'s gradient to the Gluon kernel; with dropout the forward draws the
    # mask in its epilogue and the gradient reads it from the forward's output. Against
    # float64 (with the package's mask), all three gradients
    from test_mlp import check_mlp, rand

    M, D, H = 4096, 768, 3072
    x = rand((M, D), torch.bfloat16, "cuda")
    w_in = rand((H, D), torch.bfloat16, "cuda", mean=0.0, std=D**-0.5)
    w_out = rand((D, H), torch.bfloat16, "cuda", mean=0.0, std=H**-0.5)
    check_mlp(x, w_in, w_out, p, "cuda", 1e-2)
    forward = "relu2_dropout" if p > 0 else "relu2"
    assert sorted(gluon_launches) == sorted([forward, "relu2grad_from_square"])


@on_hopper
@pytest.mark.parametrize("case", ["disabled", "few tiles"])
def test_feed_forward_not_taken(case, gluon_launches, monkeypatch):
    # switched off, or with fewer output tiles than SMs, the Triton TMA kernel runs (the relu²
    # forward at least), with the same results
    from test_mlp import check_mlp, rand

    import triton_transformer.matmul_plan as plan_module

    tma_launches = []
    real = plan_module.launch_mm_tma
    monkeypatch.setattr(plan_module, "launch_mm_tma", lambda *a: tma_launches.append(1) or real(*a))

    M, D, H = (512, 256, 1024) if case == "few tiles" else (4096, 256, 3072)
    if case == "disabled":
        monkeypatch.setattr(mh, "ENABLED", False)
    x = rand((M, D), torch.bfloat16, "cuda")
    w_in = rand((H, D), torch.bfloat16, "cuda", mean=0.0, std=D**-0.5)
    w_out = rand((D, H), torch.bfloat16, "cuda", mean=0.0, std=H**-0.5)
    check_mlp(x, w_in, w_out, 0.0, "cuda", 1e-2)
    assert gluon_launches == []
    assert tma_launches


@on_hopper
def test_cuda_graph_replays_on_new_inputs():
    # captured once, replayed on new operands: nothing of the first call is baked in
    M, N, K = 2048, 4096, 256
    a, b = _problem(M, N, K, True, torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    mh.launch_mm_sm90(a, b, c, True, "relu2")  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mh.launch_mm_sm90(a, b, c, True, "relu2")
    for seed in (1, 2):
        a2, b2 = _problem(M, N, K, True, torch.bfloat16, seed=seed)
        a.copy_(a2)
        b.copy_(b2)
        graph.replay()
        ref = _reference(a2, b2, True, "relu2", None)
        assert (c.double() - ref).norm() / ref.norm() < 1e-2


@on_hopper
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_compiled_feed_forward_takes_it(p, gluon_launches):
    # torch.compile cannot trace a Gluon kernel: traced code calls the opaque mm_opaque op
    # where an eager call takes the kernel, and that op's eager call launches it. The same
    # output and gradients as the eager feed-forward (one seed, one mask)
    from test_mlp import rand

    from triton_transformer.mlp import relu2_mlp

    M, D, H = 4096, 768, 3072
    x = rand((M, D), torch.bfloat16, "cuda")
    w_in = rand((H, D), torch.bfloat16, "cuda", mean=0.0, std=D**-0.5).requires_grad_()
    w_out = rand((D, H), torch.bfloat16, "cuda", mean=0.0, std=H**-0.5).requires_grad_()
    dout = rand((M, D), torch.bfloat16, "cuda", mean=0.3)
    seed = torch.tensor(7, device="cuda")

    def run(x):
        out = relu2_mlp(x, w_in, w_out, use_triton=True, dropout_p=p, seed=seed)
        return out, (out * dout).float().sum()

    results = []
    for fn in (run, torch.compile(run, fullgraph=True)):
        gluon_launches.clear()
        xs = x.clone().requires_grad_()
        w_in.grad = w_out.grad = None
        out, loss = fn(xs)
        loss.backward()
        forward = "relu2_dropout" if p > 0 else "relu2"
        assert sorted(gluon_launches) == sorted([forward, "relu2grad_from_square"]), fn
        results.append([t.float() for t in (out, xs.grad, w_in.grad, w_out.grad)])
    for a, b in zip(*results, strict=True):
        assert (a - b).norm() / b.norm() < 1e-2
