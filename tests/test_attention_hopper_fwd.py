"""attention_hopper_fwd: the warp-specialized Gluon forward for Hopper, against float64
attention and against the Triton forward.

Gluon has no interpreter: on CPU the kernel is compiled for sm_90 (every head dim, causal or
not, grouped-query heads, with and without the log-sum-exp); on the GPU it runs every
configuration it takes, and each test checks that it was the kernel that ran.
"""

import pytest
import torch
from helpers import SM90_DRIVER, check_compiles, needs_gluon, on_hopper, record_calls
from test_attention import TOL, check_attention, make_qkv, ref_attention, rel_err
from test_attention_hopper import SHAPES as BWD_SHAPES

import triton_transformer.attention_hopper as ah
import triton_transformer.attention_hopper_bwd_ws as ws
import triton_transformer.attention_hopper_fwd as af
from triton_transformer import attention as attn
from triton_transformer.attention import attention, attention_packed

# Compiles the kernel to PTX for sm_90 with a stand-in driver (no GPU), q, k, v as the packed
# projection's strided views; grouped-query heads with every other variant
COMPILE_SCRIPT = (
    SM90_DRIVER
    + """
import triton_transformer.attention_hopper_fwd as af

# the shipped tiles of short and long heads; grouped-query heads without the log-sum-exp on
# three consumers in turns; one consumer, two programs per SM
OTHERS = (
    dict(BLOCK_N=64, STAGES=2, PINGPONG=True, CONSUMERS=3, PER_SM=1, PERSISTENT=True,
         OUT_IN_V=False),
    dict(BLOCK_N=128, STAGES=2, PINGPONG=False, CONSUMERS=1, PER_SM=2, PERSISTENT=False,
         OUT_IN_V=True),
)
for d in af.HEAD_DIMS:
    for causal in (False, True):
        shipped = (af.fwd_tiles(d, causal, 512), af.fwd_tiles(d, causal, 4096))
        for (group, need_lse), tiles in zip(((1, True), (1, True), (2, False), (1, True)),
                                            (*shipped, *OTHERS)):
            b, h, n = 2, 4, 300
            qkv = torch.empty(b, n, 3, h, d, dtype=torch.bfloat16)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            k, v = k[:, : h // group], v[:, : h // group]
            out = torch.empty(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)
            lse = torch.empty(b * h, n)
            tiles = dict(tiles)
            del tiles["PERSISTENT"]  # the grid's size only
            launch = af._launch(tiles["CONSUMERS"], tiles.pop("PER_SM"))
            cols = af._out_cols(d, tiles["OUT_IN_V"])
            kernel = af._attention_fwd_sm90_kernel.warmup(
                *af._descriptors(q, k, v, out, tiles["BLOCK_N"], cols), lse, b * h, h, n, n, 0.18,
                HEAD_DIM=d, CAUSAL=causal, GROUP=group, WRITE_LSE=need_lse, grid=(1,), **tiles,
                **launch,
            )
            ptx = kernel.asm["ptx"]
            # tiles by TMA from descriptors passed as parameters; the output by a TMA store
            assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.4d" in ptx
            assert "cp.async.bulk.tensor.4d.global.shared" in ptx
            assert "tensormap.replace" not in ptx
            print("ok", d, causal, group, tiles)
"""
)


@needs_gluon
def test_kernel_compiles_for_sm90():
    check_compiles(COMPILE_SCRIPT, len(af.HEAD_DIMS) * 2 * 4)


# (n queries, head dim, causal, taken): the default thresholds, where the kernel measured faster
DEFAULT_GATE = [
    (512, 128, True, True), (128, 128, True, True), (128, 128, False, True),
    (127, 128, False, False), (127, 128, True, False),
    (4096, 64, True, False), (2048, 64, False, True), (512, 64, False, True),
    (511, 64, False, False),
    (512, 64, True, True), (2048, 64, True, True), (511, 64, True, False),
    (2049, 64, True, False), (4096, 32, False, False), (4096, 48, False, False),
]  # fmt: skip


@needs_gluon
def test_gate(monkeypatch):
    # on a (pretended) Hopper GPU: d128 heads from 128 queries, d64 heads without a causal
    # mask from 512, causal ones of 512 to 2048; 16-bit dtypes, whole query-head groups,
    # and only plain attention (no mask, dropout or device-side length)
    monkeypatch.setattr(af, "is_sm90", lambda device: True)
    for n, d, causal, taken in DEFAULT_GATE:
        q = torch.empty(2, 4, n, d, dtype=torch.bfloat16, device="meta")
        assert af.usable(q, q, causal, d**-0.5, plain=True) is taken, (n, d, causal)
    q = torch.empty(2, 4, 512, 128, dtype=torch.bfloat16, device="meta")
    assert af.usable(q, q, True, 0.125, plain=True)
    assert af.usable(q, q[:, :2], False, 0.125, plain=True)  # grouped-query heads
    assert not af.usable(q, q[:, :3], False, 0.125, plain=True)
    assert not af.usable(q, q, True, 0.125, plain=False)
    assert not af.usable(q, q, True, -0.125, plain=True)  # the max is folded before the scale
    assert not af.usable(q.float(), q.float(), True, 0.125, plain=True)
    assert not af.usable(q, q[:, :, :0], True, 0.125, plain=True)  # no key
    assert af.usable(q.half(), q.half(), False, 0.1, plain=True)


def test_short_heads_take_their_tiles():
    # causal d128 heads below D128_CAUSAL_LONG queries: one consumer, two programs per SM,
    # 64-key blocks; longer heads and non-causal ones keep two consumers
    short = af.fwd_tiles(128, True, 512)
    assert (short["CONSUMERS"], short["PER_SM"], short["BLOCK_N"]) == (1, 2, 64)
    assert af.fwd_tiles(128, True, af.D128_CAUSAL_LONG - 1) == short
    long = af.fwd_tiles(128, True, af.D128_CAUSAL_LONG)
    assert (long["CONSUMERS"], long["PER_SM"], long["BLOCK_N"]) == (2, 1, 128)
    assert af.fwd_tiles(128, False, 512) == long
    assert af.fwd_tiles(64, True, 512) == af.fwd_tiles(64, True, 4096)
    # d64 heads without a causal mask below D64_LONG queries: two consumers, as d128 heads;
    # from there three consumers in turns
    assert af.fwd_tiles(64, False, af.D64_LONG - 1) == long
    three = af.fwd_tiles(64, False, af.D64_LONG)
    assert (three["CONSUMERS"], three["PINGPONG"]) == (3, True)
    # the output leaves through the last V buffer where the consumers' rows fit it
    assert short["OUT_IN_V"] and long["OUT_IN_V"]


@pytest.mark.parametrize("d", [64, 128])
def test_tma_check_traces_on_views_made_in_the_graph(d, monkeypatch):
    # the packed op's q, k, v are views made inside the compiled graph, whose storage offset
    # Dynamo cannot trace: the check that picks the opaque forward must not read it there
    # (a graph break, or an error under fullgraph), and must answer as eagerly
    monkeypatch.setattr(attn, "_has_tma", lambda device: True)

    def takes_tma(x):
        q, k, v = attn._split_packed(x.unflatten(-1, (3, 4, -1)))
        return x * 2 if attn._tma_layouts(q, k, v) else x * 3

    x = torch.randn(2, 64, 3 * 4 * d, dtype=torch.bfloat16)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(takes_tma, fullgraph=True)(x), takes_tma(x))
    assert torch.equal(takes_tma(x), x * 2)


def test_descriptors_describe_each_head():
    # (b, h, n, d) views of q, k, v and the output, one head's 64 query rows or BLOCK_N keys
    if not af.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    b, h, n, d = 2, 3, 100, 64
    qkv = torch.empty(b, n, 3, h, d, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out = torch.empty(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)
    descs = af._descriptors(q, k, v, out, 128, 32)
    for desc, t, block in zip(descs, (q, k, v, out), (64, 128, 128, 64), strict=True):
        assert desc.shape == [b, h, n, d] and desc.strides == list(t.stride())
        assert desc.block_shape == [1, 1, block, 32 if t is out else d]
    # the output's stores from a V buffer: rows of at most 128 bytes
    assert af._out_cols(128, True) == 64 and af._out_cols(64, True) == 64
    assert af._out_cols(128, False) == 128


# --- GPU ---------------------------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Counts the Gluon forward's launches, and lets eager forwards take it at every length and
    head dim it supports (by default only where it measured faster)."""
    monkeypatch.setattr(af, "_taken", lambda d, n_q, causal: d in af.HEAD_DIMS)
    return record_calls(monkeypatch, af, "launch_fwd_sm90")


# the backward's shapes (tile edges, ragged last blocks, n_q < n_k and n_q > n_k under a
# causal mask), and one whole 128-row query block
SHAPES = [*BWD_SHAPES, (2, 2, 128, 128)]


@on_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", af.HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gpu_against_float64(shape, d, causal, dtype, launches):
    # the output against float64, and the gradients: the backward reads this forward's
    # output and log-sum-exp
    b, h, n_q, n_k = shape
    check_attention(*make_qkv(b, h, n_q, n_k, d, dtype, "cuda"), causal=causal)
    assert len(launches) == 1


# every shape `fwd_tiles` gives and others benchmarks time (key blocks, ring depth, turns,
# consumers, programs per SM, a persistent grid or one program per unit of work, the output
# through the last V buffer or the query buffer), at the head dims each fits (registers,
# shared memory)
KEYS = ("BLOCK_N", "STAGES", "PINGPONG", "CONSUMERS", "PER_SM", "PERSISTENT", "OUT_IN_V")
TILES = [
    (dict(zip(KEYS, values, strict=True)), dims)
    for values, dims in [
        ((128, 3, False, 2, 1, True, True), (32, 64, 128)),
        ((128, 3, False, 2, 1, True, False), (64, 128)),
        ((128, 3, False, 2, 1, False, True), (64, 128)),
        ((64, 2, False, 2, 1, True, False), (32, 64, 128)),
        ((128, 2, True, 2, 1, True, True), (32, 64, 128)),
        ((128, 3, True, 3, 1, True, False), (32, 64)),
        ((128, 3, True, 3, 1, False, False), (64,)),
        ((64, 4, False, 3, 1, True, False), (32, 64, 128)),
        ((64, 3, False, 1, 3, True, True), (32, 64)),
        ((64, 3, False, 1, 3, True, False), (64,)),
        ((64, 3, False, 1, 3, False, True), (64,)),
        ((128, 3, True, 1, 2, True, True), (32, 64, 128)),
        ((64, 3, False, 1, 2, True, True), (32, 64, 128)),
    ]
]


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "tiles, d", [(t, d) for t, dims in TILES for d in dims], ids=lambda x: str(x)
)
def test_gpu_other_tiles(tiles, d, causal, launches, monkeypatch):
    monkeypatch.setattr(af, "fwd_tiles", lambda *_: tiles)
    for b, h, n_q, n_k in [(2, 3, 1000, 1000), (2, 2, 333, 130), (1, 2, 64, 64)]:
        q, k, v = make_qkv(b, h, n_q, n_k, d, torch.bfloat16, "cuda")
        out = attention(q, k, v, causal=causal, use_triton=True)
        assert rel_err(out, ref_attention(q, k, v, causal=causal)) < TOL[torch.bfloat16]
    assert len(launches) == 3


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "tiles, d", [(t, d) for t, dims in TILES if t["PERSISTENT"] for d in dims],
    ids=lambda x: str(x),
)  # fmt: skip
def test_gpu_persistent_programs_take_many_tiles(tiles, d, causal, launches, monkeypatch):
    # a GPU of one SM: PER_SM programs deal every tile among them, so each walks tiles of
    # different heads and lengths (causal, n_q != n_k, grouped-query heads) with its ring,
    # query buffer and turns carried from one tile to the next
    monkeypatch.setattr(af, "fwd_tiles", lambda *_: tiles)
    monkeypatch.setattr(af, "sm_count", lambda device: 1)
    for b, h, n_q, n_k, group in [(2, 3, 1000, 1000, 1), (3, 4, 333, 517, 2), (2, 2, 700, 300, 1)]:
        q, k, v = make_qkv(b, h, n_q, n_k, d, torch.float16, "cuda")
        k, v = k[:, : h // group], v[:, : h // group]
        out = attention(q, k, v, causal=causal, use_triton=True)
        ref = ref_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                            causal=causal)  # fmt: skip
        assert rel_err(out, ref) < TOL[torch.float16], (b, h, n_q, n_k)
    assert len(launches) == 3


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", af.HEAD_DIMS)
def test_gpu_grouped_query_heads(d, causal, launches):
    # query head i reads key/value head i // 3
    q, k, v = make_qkv(2, 6, 700, 700, d, torch.bfloat16, "cuda")
    out = attention(q, k[:, :2], v[:, :2], causal=causal, use_triton=True)
    ref = ref_attention(q, k[:, :2].repeat_interleave(3, 1), v[:, :2].repeat_interleave(3, 1),
                        causal=causal)  # fmt: skip
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert len(launches) == 1


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", (64, 128))
def test_gpu_matches_the_triton_forward(d, causal, monkeypatch, launches):
    # the output and the log-sum-exp the Triton forward writes (bf16 inputs, fp32 sums in
    # another order: to the rounding of the bf16 output)
    q, k, v = make_qkv(2, 4, 1500, 1500, d, torch.bfloat16, "cuda")
    results = {}
    for enabled in (True, False):
        monkeypatch.setattr(af, "ENABLED", enabled)
        results[enabled] = attn.launch_attention_fwd(
            q, k, v, None, None, causal, d**-0.5, 0.0, True
        )  # fmt: skip
    assert len(launches) == 1
    (out, lse), (out_t, lse_t) = results[True], results[False]
    assert rel_err(out, out_t) < 4e-3
    assert (lse - lse_t).abs().max().item() < 1e-3


@on_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_packed_qkv_and_no_grad(causal, launches):
    # the model's layout (strided views of one projection), with and without a gradient
    # (without, no log-sum-exp is written)
    b, n, h, d = 2, 777, 4, 64
    qkv = (0.2 + torch.randn(b, n, 3 * h * d, device="cuda")).to(torch.bfloat16)
    r = qkv.double().view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    ref = ref_attention(r[0], r[1], r[2], causal=causal).transpose(1, 2).reshape(b, n, h * d)
    with torch.no_grad():
        out = attention_packed(qkv, h, causal=causal, use_triton=True)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    out = attention_packed(qkv.requires_grad_(), h, causal=causal, use_triton=True)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert len(launches) == 2


@on_hopper
def test_gpu_not_taken_where_it_does_not_apply(launches):
    # a key padding mask, dropout, a KV cache length on the device, head dims it lacks, fp32
    # and an explicit tile config take the Triton forward
    q, k, v = make_qkv(1, 4, 256, 256, 64, torch.bfloat16, "cuda")
    kpm = torch.ones(1, 256, dtype=torch.bool, device="cuda")
    attention(q, k, v, causal=True, key_padding_mask=kpm, use_triton=True)
    attention(q, k, v, causal=True, dropout_p=0.1, use_triton=True)
    attn.attention_cached(q[:, :, :4], k, v, torch.tensor(256, device="cuda"), use_triton=True)
    q48, k48, v48 = make_qkv(1, 2, 256, 256, 48, q.dtype, "cuda")
    attention(q48, k48, v48, causal=True, use_triton=True)
    attention(q.float(), k.float(), v.float(), causal=True, use_triton=True)
    assert launches == []
    attention(q, k, v, causal=True, use_triton=True)
    assert len(launches) == 1


@on_hopper
def test_gpu_cuda_graph_replays(launches):
    # captured once, replayed on new inputs: the output follows them
    q, k, v = make_qkv(2, 4, 512, 512, 128, torch.bfloat16, "cuda")
    attention(q, k, v, causal=True, use_triton=True)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, causal=True, use_triton=True)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        assert rel_err(out, ref_attention(q, k, v, causal=True)) < TOL[torch.bfloat16]
    assert len(launches) >= 2


@on_hopper
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_compiled_forward_takes_it(packed, launches, monkeypatch):
    # torch.compile cannot launch a Gluon kernel: the traced forward calls the opaque op,
    # whose eager call launches the kernel; the same output and gradients as eager code
    # (the backward: the Triton kernels, traced)
    monkeypatch.setattr(ah, "ENABLED", False)
    monkeypatch.setattr(ws, "ENABLED", False)
    b, n, h, d = 2, 1024, 4, 64
    qkv = (0.2 + torch.randn(b, n, 3 * h * d, device="cuda")).to(torch.bfloat16)
    dout = torch.randn(b, n, h * d, device="cuda", dtype=torch.bfloat16)

    def run(x):
        if packed:
            return attention_packed(x, h, causal=True, use_triton=True)
        q, k, v = x.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
        out = attention(q, k, v, causal=True, use_triton=True)
        return out.transpose(1, 2).reshape(b, n, h * d)

    results = []
    for fn in (run, torch.compile(run, fullgraph=True)):
        launches.clear()
        x = qkv.clone().requires_grad_()
        out = fn(x)
        out.backward(dout)
        assert len(launches) == 1, fn
        results.append((out, x.grad.float()))
    assert torch.equal(results[1][0], results[0][0])  # one kernel, one summation order
    assert rel_err(results[1][1], results[0][1]) < 1e-2
