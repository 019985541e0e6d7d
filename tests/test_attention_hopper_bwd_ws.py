"""attention_hopper_bwd_ws: the warp-specialized Gluon backward for d128 heads on Hopper,
against float64 attention and against the single-pass Gluon backward.

Gluon has no interpreter: on CPU the kernel is compiled for sm_90 (causal or not, the shipped
tiles and a deeper ring); on the GPU it runs every configuration it takes, and each test
checks that it was the kernel that ran.
"""

import pytest
import torch
from helpers import (
    SM90_DRIVER,
    check_compiles,
    deterministic_algorithms,
    needs_gluon,
    on_hopper,
    record_calls,
)
from test_attention import check_attention, make_qkv, rel_err
from test_attention_hopper import SHAPES as SINGLE_PASS_SHAPES
from test_attention_hopper import check_graph_replays, check_packed_qkv, run_backward

import triton_transformer.attention_hopper as ah
import triton_transformer.attention_hopper_bwd_ws as ws
from triton_transformer.attention import attention, attention_packed

# Compiles the kernel to PTX for sm_90 with a stand-in driver (no GPU), q, k, v as the packed
# projection's strided views, dK and dV written into d(qkv)
COMPILE_SCRIPT = (
    SM90_DRIVER
    + r"""
import re

import triton_transformer.attention_hopper_bwd_ws as ws

# every head dim, causal or not: the shipped tiles with dK and dV by TMA; a deeper ring with
# dK and dV through pointers
DEEPER = dict(STAGES=3, CONSUMERS=2)
for d in ws.HEAD_DIMS:
    for causal in (False, True):
        for tiles, store_tma in ((ws.bwd_tiles(causal), True), (DEEPER, False)):
            b, h, n = 2, 3, 300
            qkv = torch.empty(b, n, 3, h, d, dtype=torch.bfloat16)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            do = torch.empty(b, h, n, d, dtype=torch.bfloat16)
            lse = torch.empty(b * h, n)
            acc = torch.empty(b * h, n, d)
            dk, dv = (k, v) if store_tma else (None, None)
            descs = ws._descriptors(q, k, v, do, lse, lse, acc, dk, dv, tiles["CONSUMERS"])
            kernel = ws._attention_bwd_ws_sm90_kernel.warmup(
                *descs, qkv, qkv, 0, 0, *k.stride()[:3], *v.stride()[:3], b * h, h, n, n, 0.18,
                0.125, HEAD_DIM=d, CAUSAL=causal, STORE_TMA=store_tma, LPT_BYTES=2**24,
                grid=(1,), **tiles, **ws._launch(tiles["CONSUMERS"]),
            )
            ptx = kernel.asm["ptx"]
            # tiles arrive by TMA from descriptors passed as parameters, none made here; dQ
            # leaves by bulk reductions, dK and dV by TMA stores where asked; the partitions'
            # registers are redistributed
            assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.4d.shared" in ptx
            assert "cp.reduce.async.bulk.tensor.3d" in ptx
            assert ("cp.async.bulk.tensor.4d.global.shared" in ptx) == store_tma
            assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+240;", ptx)
            assert "tensormap.replace" not in ptx
            print("ok", d, causal, tiles, store_tma)
"""
)


@needs_gluon
def test_kernel_compiles_for_sm90():
    check_compiles(COMPILE_SCRIPT, len(ws.HEAD_DIMS) * 2 * 2)


# (n queries, head dim, causal, taken): d128 heads from 512 queries, causal or not; d64 heads
# from 512, with a causal mask below 2048 (longer ones keep `attention_hopper`'s kernel)
DEFAULT_GATE = [
    (512, 128, True, True), (512, 128, False, True), (511, 128, True, False),
    (8192, 128, False, True), (512, 64, True, True), (2047, 64, True, True),
    (2048, 64, True, False), (8192, 64, False, True), (511, 64, False, False),
    (4096, 96, True, False), (4096, 32, False, False),
]  # fmt: skip


@needs_gluon
def test_gate(monkeypatch):
    # on a (pretended) Hopper GPU: the head dims and lengths above; 16-bit dtypes, multi-head
    # attention, and only plain attention (no key padding mask, no dropout)
    monkeypatch.setattr(ws, "is_sm90", lambda device: True)
    for n, d, causal, taken in DEFAULT_GATE:
        q = torch.empty(2, 4, n, d, dtype=torch.bfloat16, device="meta")
        assert ws.usable(q, q, causal, plain=True) is taken, (n, d, causal)
    q = torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16, device="meta")
    assert ws.usable(q.half(), q.half(), True, plain=True)
    assert not ws.usable(q, q, True, plain=False)
    assert not ws.usable(q, q[:, :2], True, plain=True)  # grouped-query heads
    assert not ws.usable(q.float(), q.float(), True, plain=True)
    monkeypatch.setattr(ws, "ENABLED", False)
    assert not ws.usable(q, q, True, plain=True)


@needs_gluon
def test_launch_options():
    # two consumers and the loader fill an SM's 65,536 registers: 2 x 240 + 24 = 3 x 168
    launch = ws._launch(2)
    assert launch["maxnreg"] == 168 and launch["num_warps"] == 4
    assert 2 * launch["CONSUMER_REGS"] + launch["LOADER_REGS"] <= 3 * launch["maxnreg"]
    assert launch["CONSUMER_REGS"] == 240


@needs_gluon
def test_descriptors_describe_each_head():
    # q, k, v, dO as (b, h, n, 128) by 64 rows of one head; the log-sum-exp and Δ by 64
    # entries of a (b·h, n_q) row; the dQ sum as (b·h, n_q, 128) by 64 rows of one
    # consumer's 64 columns
    b, h, n, d = 2, 3, 100, 128
    qkv = torch.empty(b, n, 3, h, d, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.empty(b, h, n, d, dtype=torch.bfloat16)
    lse = torch.empty(b * h, n)
    acc = torch.empty(b * h, n, d)
    dqkv = torch.empty_like(qkv)
    dk, dv = dqkv[:, :, 1].transpose(1, 2), dqkv[:, :, 2].transpose(1, 2)
    descs = ws._descriptors(q, k, v, do, lse, lse, acc, dk, dv, 2)
    for i, t in zip((0, 1, 2, 3, 7, 8), (q, k, v, do, dk, dv), strict=True):
        assert descs[i].shape == [b, h, n, d] and descs[i].strides == list(t.stride())
        assert descs[i].block_shape == [1, 1, 64, d] and descs[i].base is t
    assert descs[4].shape == [b * h, n] and descs[4].block_shape == [1, 64]
    assert descs[6].shape == [b * h, n, d] and descs[6].block_shape == [1, 64, 64]
    # without gradients TMA can store, q's descriptor stands in for theirs
    assert ws._descriptors(q, k, v, do, lse, lse, acc, None, None, 2)[7].base is q


@pytest.mark.parametrize(
    "view, storable",
    [
        (lambda t: t, True),
        (lambda t: t.transpose(1, 2), True),  # (b, n, h, d) storage: the packed gradient's
        (lambda t: t[..., 1:65], False),  # a start off 16 bytes
        (lambda t: t.transpose(2, 3), False),  # d not the unit stride
        (lambda t: t[:, :, :, :120], True),
    ],
)
def test_gradients_tma_can_store(view, storable):
    t = view(torch.empty(2, 3, 100, 128, dtype=torch.bfloat16))
    assert ws._storable(t) is storable


# --- GPU ---------------------------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Counts the kernel's launches, and lets eager backwards take it at every length (by
    default only where it measured faster)."""
    monkeypatch.setattr(ws, "_taken", lambda d, n_q, causal: d in ws.HEAD_DIMS)
    return record_calls(monkeypatch, ws, "launch_bwd_ws_sm90")


# the single pass's shapes (tile edges, ragged last blocks, n_q < n_k and n_q > n_k under a
# causal mask), one whole 128-key block and a head of many steps
SHAPES = [*SINGLE_PASS_SHAPES, (2, 2, 128, 128), (1, 2, 4096, 4096)]


@on_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", ws.HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gpu_against_float64(shape, d, causal, dtype, launches):
    b, h, n_q, n_k = shape
    check_attention(*make_qkv(b, h, n_q, n_k, d, dtype, "cuda"), causal=causal)
    assert len(launches) == 1


@on_hopper
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_packed_qkv(causal, stages, launches, monkeypatch):
    # the model's layout (strided views of one projection, one gradient); each ring depth
    monkeypatch.setattr(ws, "bwd_tiles", lambda _c: {"STAGES": stages, "CONSUMERS": 2})
    check_packed_qkv(128, causal)
    assert len(launches) == 1


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", ws.HEAD_DIMS)
def test_gpu_pointer_stores(d, causal, launches, monkeypatch):
    # gradients TMA cannot store leave through pointers: the same checks against float64
    monkeypatch.setattr(ws, "_storable", lambda t: False)
    for b, h, n_q, n_k in [(2, 3, 1000, 1000), (2, 2, 333, 130)]:
        check_attention(*make_qkv(b, h, n_q, n_k, d, torch.bfloat16, "cuda"), causal=causal)
    assert len(launches) == 2


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_matches_the_single_pass(causal, monkeypatch, launches):
    # the same gradients as `attention_hopper`'s kernel (bf16 inputs, fp32 sums in another
    # order: to the rounding of the bf16 outputs)
    monkeypatch.setattr(ah, "MIN_QUERIES", 1)
    monkeypatch.setattr(ah, "TAKEN_HEAD_DIMS", ah.HEAD_DIMS)
    single = record_calls(monkeypatch, ah, "launch_bwd_sm90")
    q, k, v = make_qkv(2, 4, 1500, 1500, 128, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    grads = {}
    for enabled in (True, False):
        monkeypatch.setattr(ws, "ENABLED", enabled)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        attention(qs, ks, vs, causal=causal, use_triton=True).backward(dout)
        grads[enabled] = [t.grad.float() for t in (qs, ks, vs)]
    assert len(launches) == 1 and len(single) == 1
    for a, b in zip(grads[True], grads[False], strict=True):
        assert rel_err(a, b) < 1e-2


@on_hopper
def test_gpu_not_taken_where_it_does_not_apply(launches):
    # deterministic algorithms, a key padding mask, dropout, grouped-query heads, other head
    # dims and fp32 take the other kernels
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 256, 256, 128, torch.bfloat16, "cuda"))
    kpm = torch.ones(1, 256, dtype=torch.bool, device="cuda")
    with deterministic_algorithms(True):
        run_backward(q, k, v, causal=True)
    run_backward(q, k, v, causal=True, key_padding_mask=kpm)
    run_backward(q, k, v, causal=True, dropout_p=0.1)
    run_backward(q, k[:, :2], v[:, :2], causal=True)
    q32, k32, v32 = (t.requires_grad_() for t in make_qkv(1, 2, 256, 256, 32, q.dtype, "cuda"))
    run_backward(q32, k32, v32, causal=True)
    qf, kf, vf = (t.float().detach().requires_grad_() for t in (q, k, v))
    run_backward(qf, kf, vf, causal=True)
    assert launches == []
    run_backward(q, k, v, causal=True)
    run_backward(q, k, v, causal=False)
    assert len(launches) == 2


@on_hopper
def test_gpu_cuda_graph_replays(launches):
    check_graph_replays(128)
    assert len(launches) >= 2


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_compiled_backward_takes_it(causal, launches):
    # torch.compile cannot launch a Gluon kernel: the traced backward calls the opaque
    # backward op, whose eager call launches the kernel. The same gradients as the eager
    # backward (dQ's fp32 sums in another order)
    b, n, h, d = 2, 1024, 4, 128
    qkv = (0.2 + torch.randn(b, n, 3 * h * d, device="cuda")).to(torch.bfloat16)
    dout = torch.randn(b, n, h * d, device="cuda", dtype=torch.bfloat16)

    def run(x):
        return attention_packed(x, h, causal=causal, use_triton=True)

    grads = []
    for fn in (run, torch.compile(run, fullgraph=True)):
        x = qkv.clone().requires_grad_()
        fn(x).backward(dout)
        grads.append(x.grad.float())
    assert len(launches) == 2
    assert rel_err(grads[1], grads[0]) < 1e-2
