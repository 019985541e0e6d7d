"""attention_hopper: the Gluon single-pass backward for Hopper, against float64 attention and
against the Triton kernels' backward.

Gluon has no interpreter: on CPU the kernel is compiled for sm_90 (front end to PTX, every
head dim and mask variant, so a change that stops it compiling on the installed Triton
fails here); on the GPU it runs every configuration it takes, and each test checks that it
was the kernel that ran.
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
from test_attention import (
    TOL,
    TOL_DQK,
    check_attention,
    check_option,
    make_qkv,
    ref_attention,
    rel_err,
)

import triton_transformer.attention_hopper as ah
import triton_transformer.attention_hopper_bwd_ws as ws
from triton_transformer.attention import attention, attention_packed


@needs_gluon
def test_kernel_compiles_for_sm90():
    check_compiles(COMPILE_SCRIPT, len(ah.HEAD_DIMS) * 2 * 2)


@needs_gluon
@pytest.mark.parametrize("major, taken", [(8, False), (9, True), (10, False)])
def test_taken_on_hopper_only(major, taken, monkeypatch):
    # the kernel's warpgroup products exist on compute capability 9.x only: an Ampere or a
    # Blackwell GPU (which has TMA, so the Triton single pass runs there) must not take it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setattr(ah, "MIN_QUERIES", 1)
    monkeypatch.setattr(ah, "MIN_QUERIES_D64", 1)
    ah.is_sm90.cache_clear()
    try:
        assert ah.is_sm90(torch.device("cuda", 0)) is taken
        q = torch.empty(1, 2, 64, 64, dtype=torch.bfloat16)
        assert not ah.usable(q, q, 64, causal=True, no_key_mask=True)  # a CPU tensor
    finally:
        ah.is_sm90.cache_clear()


# (n queries, head dim, causal, taken): the default thresholds, where the kernel measured faster
DEFAULT_GATE = [
    (511, 64, True, False), (512, 64, True, True), (511, 64, False, False),
    (512, 64, False, True), (2047, 32, False, False), (1024, 32, True, False),
    (2048, 32, True, True), (1024, 128, True, False), (2048, 128, True, True),
    (2048, 128, False, False),
]  # fmt: skip
# the same through dropout: every head dim, causal or not, from 512 queries
DROPOUT_GATE = [
    (511, 64, True, False), (512, 64, True, True), (512, 64, False, True),
    (512, 128, False, True), (1024, 32, True, True), (511, 128, True, False),
]  # fmt: skip


@needs_gluon
def test_default_gate(monkeypatch):
    # on a (pretended) Hopper GPU: d64 heads from 512 queries, the rest from 2048;
    # d128 causal only; and none of it with a key padding mask, fp32, GQA or d48
    monkeypatch.setattr(ah, "is_sm90", lambda device: True)
    for n, d, causal, taken in DEFAULT_GATE:
        q = torch.empty(1, 2, n, d, dtype=torch.bfloat16, device="meta")
        assert ah.usable(q, q, d, causal, no_key_mask=True) is taken, (n, d, causal)
    for n, d, causal, taken in DROPOUT_GATE:
        q = torch.empty(1, 2, n, d, dtype=torch.bfloat16, device="meta")
        assert ah.usable(q, q, d, causal, True, dropout=True) is taken, (n, d, causal)
        assert not ah.usable(q, q, d, causal, False, dropout=True)  # a key padding mask
    q = torch.empty(1, 4, 4096, 64, dtype=torch.bfloat16, device="meta")
    assert ah.usable(q, q, 64, True, no_key_mask=True)
    assert not ah.usable(q, q, 64, True, no_key_mask=False)
    assert not ah.usable(q.float(), q.float(), 64, True, no_key_mask=True)
    assert not ah.usable(q, q[:, :2], 64, True, no_key_mask=True)
    q48 = torch.empty(1, 4, 4096, 48, dtype=torch.bfloat16, device="meta")
    assert not ah.usable(q48, q48, 48, True, no_key_mask=True)


@needs_gluon
@pytest.mark.parametrize("n_q", [64, 65, 300])
def test_log_sum_exp_rows_tma_can_read(n_q):
    # TMA reads the (b·h, n_q) log-sum-exp by rows from 16-byte aligned starts: rows that are
    # not (n_q not a multiple of 4) are copied into padded rows, the values unchanged
    lse = torch.randn(6, n_q) + 3.0
    rows = ah._aligned_rows(lse)
    assert rows.stride(1) == 1 and rows.stride(0) % 4 == 0 and rows.data_ptr() % 16 == 0
    assert (rows is lse) == (n_q % 4 == 0)
    assert torch.equal(rows, lse)


@needs_gluon
def test_descriptors_describe_each_head():
    # q, k, v, dO as (b, h, n, d) with one block of rows of one head; the log-sum-exp and Δ by
    # (b·h, n_q) rows; dQ's sum as (b·h, n_q, d): so rows past a head's n read as zeros
    b, h, n, d = 2, 3, 100, 64
    qkv = torch.empty(b, n, 3, h, d, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.empty(b, h, n, d, dtype=torch.bfloat16)
    lse = torch.empty(b * h, n)
    acc = torch.empty(b * h, n, d)
    descs = ah._descriptors(q, k, v, do, lse, lse, acc, 32, 64)
    for desc, t, block in zip(descs[:4], (q, k, v, do), (32, 64, 64, 32), strict=True):
        assert desc.shape == [b, h, n, d] and desc.strides == list(t.stride())
        assert desc.block_shape == [1, 1, block, d]
    assert descs[4].shape == [b * h, n] and descs[4].block_shape == [1, 32]
    assert descs[6].shape == [b * h, n, d] and descs[6].block_shape == [1, 32, d]


# Compiles the kernel through Triton's front end and NVIDIA back end to PTX for sm_90 with a
# stand-in driver (no GPU), with the arguments of a packed-qkv launch.
COMPILE_SCRIPT = (
    SM90_DRIVER
    + """
import triton_transformer.attention_hopper as ah

for d in ah.HEAD_DIMS:
    for causal in (False, True):
        for dropout in (False, True):
            b, h, n = 2, 3, 300
            qkv = torch.empty(b, n, 3, h, d, dtype=torch.bfloat16)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            do = torch.empty(b, h, n, d, dtype=torch.bfloat16)
            lse = torch.empty(b * h, n)
            acc = torch.empty(b * h, n, d)
            seed = torch.empty((), dtype=torch.int64)
            tiles = ah.bwd_tiles(d, causal)
            descs = ah._descriptors(q, k, v, do, lse, lse, acc, tiles["BLOCK_M"], tiles["BLOCK_N"])
            kernel = ah._attention_bwd_sm90_kernel.warmup(
                *descs, qkv, qkv, seed, lse, lse, 0, 0, *k.stride()[:3], *v.stride()[:3],
                b * h, h, n, n, 0.18, 0.125, 13107, 1.25, HEAD_DIM=d, CAUSAL=causal,
                DROPOUT=dropout, LPT_BYTES=2**24, grid=(1,), **tiles,
            )
            ptx = kernel.asm["ptx"]
            # every tile arrives by TMA from a descriptor passed as a parameter, none made here
            assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.4d" in ptx
            assert "tensormap.replace" not in ptx
            print("ok", d, causal, dropout)
"""
)


# --- GPU ---------------------------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Counts the Gluon kernel's launches, and lets eager backwards take it at every length and
    head dim it supports (by default only where it measured faster; d128 heads without
    dropout go to `attention_hopper_bwd_ws` unless turned off, as here)."""
    monkeypatch.setattr(ws, "ENABLED", False)
    monkeypatch.setattr(ah, "MIN_QUERIES", 1)
    monkeypatch.setattr(ah, "MIN_QUERIES_D64", 1)
    monkeypatch.setattr(ah, "MIN_QUERIES_DROPOUT", 1)
    monkeypatch.setattr(ah, "TAKEN_HEAD_DIMS", ah.HEAD_DIMS)
    monkeypatch.setattr(ah, "TAKEN_HEAD_DIMS_CAUSAL", ah.HEAD_DIMS)
    return record_calls(monkeypatch, ah, "launch_bwd_sm90")


SHAPES = [  # b, h, n_q, n_k: tile edges, ragged last blocks, a single query block, long heads
    (2, 3, 1000, 1000),
    (1, 2, 2048, 2048),
    (3, 2, 65, 65),
    (1, 1, 1, 1),
    (2, 2, 130, 333),  # causal: bottom-right aligned, n_q < n_k (a KV-cache step)
    (2, 2, 333, 130),  # causal: the first 203 queries see no key (zero output, no gradient)
]


@on_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", ah.HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gpu_against_float64(shape, d, causal, dtype, launches):
    b, h, n_q, n_k = shape
    check_attention(*make_qkv(b, h, n_q, n_k, d, dtype, "cuda"), causal=causal)
    assert len(launches) == 1


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", ah.HEAD_DIMS)
def test_gpu_packed_qkv(d, causal, launches):
    check_packed_qkv(d, causal)
    assert len(launches) == 1


def check_packed_qkv(d: int, causal: bool) -> None:
    """The model's layout: q, k, v are strided views of one (b, n, 3·h·d) projection, and the
    backward writes dq, dk, dv into one gradient. Output and gradients against float64."""
    b, n, h = 2, 777, 4
    qkv = (0.2 + torch.randn(b, n, 3 * h * d, device="cuda")).to(torch.bfloat16)
    qkv.requires_grad_()
    out = attention_packed(qkv, h, causal=causal, use_triton=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    r = qkv.detach().double().view(b, n, 3, h, d).permute(2, 0, 3, 1, 4).requires_grad_()
    ref = ref_attention(r[0], r[1], r[2], causal=causal).transpose(1, 2).reshape(b, n, h * d)
    ref.backward(dout.double())
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    grad = qkv.grad.view(b, n, 3, h, d)
    ref_grad = r.grad.permute(1, 3, 0, 2, 4)
    for i, name in enumerate("qkv"):
        tol = TOL[torch.bfloat16] if name == "v" else TOL_DQK[torch.bfloat16]
        assert rel_err(grad[:, :, i], ref_grad[:, :, i], floor=0.1) < tol, name


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_matches_the_triton_backward(causal, monkeypatch):
    # the same gradients as the Triton kernels' backward (bf16 inputs, fp32 sums: to the
    # rounding of the bf16 outputs)
    monkeypatch.setattr(ws, "ENABLED", False)  # (it would take these heads)
    q, k, v = make_qkv(2, 4, 1024, 1024, 64, torch.bfloat16, "cuda")
    grads = {}
    for enabled in (True, False):
        monkeypatch.setattr(ah, "ENABLED", enabled)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = attention(qs, ks, vs, causal=causal, use_triton=True)
        out.backward(torch.ones_like(out))
        grads[enabled] = [t.grad.float() for t in (qs, ks, vs)]
    for a, b in zip(grads[True], grads[False], strict=True):
        assert rel_err(a, b) < 1e-2


DROPOUT_SHAPES = [(2, 3, 1000, 1000), (3, 2, 65, 65), (2, 2, 130, 333), (2, 2, 333, 130)]


@on_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", ah.HEAD_DIMS)
@pytest.mark.parametrize("shape", DROPOUT_SHAPES, ids=str)
def test_gpu_dropout_against_float64(shape, d, causal, dtype, launches):
    # the backward regenerates the forward's mask (read off the forward by `dropout_mask`):
    # the output and all three gradients against float64 attention with that mask
    b, h, n_q, n_k = shape
    check_option(b, h, n_q, d, causal, True, False, False, dtype, "cuda", n_k=n_k)
    assert len(launches) == 1


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_dropout_matches_the_triton_backward(causal, monkeypatch, launches):
    # one seed, one mask: the Gluon and the Triton backward through dropout agree
    q, k, v = make_qkv(2, 4, 1024, 1024, 64, torch.bfloat16, "cuda")
    dout = torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for enabled in (True, False):
        monkeypatch.setattr(ah, "ENABLED", enabled)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        torch.manual_seed(3)
        attention(qs, ks, vs, causal=causal, dropout_p=0.1, use_triton=True).backward(dout)
        grads[enabled] = [t.grad.float() for t in (qs, ks, vs)]
    assert len(launches) == 1
    for a, b in zip(grads[True], grads[False], strict=True):
        assert rel_err(a, b) < 1e-2


def run_backward(q, k, v, **kwargs) -> None:
    """One Triton-path attention forward and backward of q, k, v (kwargs: `attention`'s)."""
    out = attention(q, k, v, use_triton=True, **kwargs)
    out.backward(torch.randn_like(out))  # (`.sum()`'s expanded gradient is no TMA operand)


@on_hopper
def test_gpu_not_taken_where_it_does_not_apply(launches):
    # deterministic algorithms, a key padding mask, grouped-query heads, head dims it lacks
    # and fp32 take the Triton kernels
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 256, 256, 64, torch.bfloat16, "cuda"))
    kpm = torch.ones(1, 256, dtype=torch.bool, device="cuda")
    with deterministic_algorithms(True):
        run_backward(q, k, v, causal=True)
        run_backward(q, k, v, causal=True, dropout_p=0.1)
    run_backward(q, k, v, causal=True, key_padding_mask=kpm)
    run_backward(q, k[:, :2], v[:, :2], causal=True)
    q48, k48, v48 = (t.requires_grad_() for t in make_qkv(1, 2, 256, 256, 48, q.dtype, "cuda"))
    run_backward(q48, k48, v48, causal=True)
    qf, kf, vf = (t.float().detach().requires_grad_() for t in (q, k, v))
    run_backward(qf, kf, vf, causal=True)
    assert launches == []
    run_backward(q, k, v, causal=True)
    run_backward(q, k, v, causal=False)
    run_backward(q, k, v, causal=True, dropout_p=0.1)
    assert len(launches) == 3


@on_hopper
def test_gpu_taken_by_default_where_it_measured_faster(monkeypatch, launches):
    # the defaults: d64 heads from 512 queries, the rest from 2048; d128 causal only
    monkeypatch.setattr(ah, "MIN_QUERIES", 2048)
    monkeypatch.setattr(ah, "MIN_QUERIES_D64", 512)
    monkeypatch.setattr(ah, "TAKEN_HEAD_DIMS", (32, 64))
    monkeypatch.setattr(ah, "TAKEN_HEAD_DIMS_CAUSAL", (32, 64, 128))
    monkeypatch.setattr(ah, "MIN_QUERIES_DROPOUT", 512)
    for n, d, causal, taken in DEFAULT_GATE:
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, n, n, d, torch.bfloat16, "cuda"))
        before = len(launches)
        run_backward(q, k, v, causal=causal)
        assert (len(launches) > before) == taken, (n, d, causal)
    for n, d, causal, taken in DROPOUT_GATE:
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, n, n, d, torch.bfloat16, "cuda"))
        before = len(launches)
        run_backward(q, k, v, causal=causal, dropout_p=0.1)
        assert (len(launches) > before) == taken, (n, d, causal, "dropout")


@on_hopper
def test_gpu_cuda_graph_replays(launches):
    check_graph_replays(64)
    assert len(launches) >= 2


def check_graph_replays(d: int) -> None:
    """A causal attention backward captured once and replayed on new inputs: the gradients
    follow the inputs (against float64)."""
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 512, 512, d, torch.bfloat16, "cuda"))
    dout = torch.randn(2, 4, 512, d, device="cuda", dtype=torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        attention(q, k, v, causal=True, use_triton=True).backward(dout)
        return [t.grad for t in (q, k, v)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
        graph.replay()
        r = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_attention(*r, causal=True).backward(dout.double())
        for g, rt in zip(grads, r, strict=True):
            assert rel_err(g, rt.grad, floor=0.1) < TOL_DQK[torch.bfloat16]


@on_hopper
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_compiled_backward_takes_it(packed, dropout_p, launches):
    # torch.compile cannot launch a Gluon kernel: the traced backward calls the opaque
    # *_backward_opaque op, whose eager call launches the kernel. The same gradients as the
    # eager backward (one seed, one mask; dQ's fp32 sums in another order)
    b, n, h, d = 2, 1024, 4, 64
    qkv = (0.2 + torch.randn(b, n, 3 * h * d, device="cuda")).to(torch.bfloat16)
    dout = torch.randn(b, n, h * d, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor(5, device="cuda")

    def run(x):
        if packed:
            out = attention_packed(x, h, causal=True, dropout_p=dropout_p, seed=seed,
                                   use_triton=True)  # fmt: skip
        else:
            q, k, v = x.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
            out = attention(q, k, v, causal=True, dropout_p=dropout_p, seed=seed, use_triton=True)
            out = out.transpose(1, 2).reshape(b, n, h * d)
        return (out * dout).float().sum()

    grads = []
    for fn in (run, torch.compile(run, fullgraph=True)):
        launches.clear()
        x = qkv.clone().requires_grad_()
        fn(x).backward()
        assert len(launches) == 1, fn
        grads.append(x.grad.float())
    assert rel_err(grads[1], grads[0]) < 1e-2
