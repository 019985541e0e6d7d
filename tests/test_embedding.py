"""Token + positional embedding: the Triton op vs a float64 run of the PyTorch branch.

Forward and both table gradients at sizes that reach every code path: vocabularies and
widths that are not multiples of the tiles, several token tiles, repeated and absent ids,
a window of positions that starts past 0 (a KV-cache step), no positional table, and
fp32/fp16/bf16 tables. fp32 gradients go through the three-way bf16 split on a GPU, so
they must still agree to ~1e-5. Vocabularies above ONE_HOT_MAX_VOCAB take the atomic
scatter backward (deterministic algorithms off) or PyTorch's embedding (on).
"""

import pytest
import torch
from helpers import deterministic_algorithms
from test_bmm import _opcheck_tests

import triton_transformer.embedding as embedding_module
from triton_transformer.checks import raise_pending
from triton_transformer.embedding import ONE_HOT_MAX_VOCAB, embedding, embedding_backward_op
from triton_transformer.utils import call_op

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LARGE_VOCAB = ONE_HOT_MAX_VOCAB + 76  # the scatter backward's range


def _tables(n_vocab, dim, max_len, dtype, device):
    w = (0.7 + torch.randn(n_vocab, dim, device=device)).to(dtype).requires_grad_()
    p = (-0.4 + torch.randn(max_len, dim, device=device)).to(dtype).requires_grad_()
    return w, p


def _check(
    b, n, n_vocab, dim, max_len, start, dtype, device, with_pos=True, id_dtype=None,
    n_distinct=None,
):  # fmt: skip
    ids = torch.randint(0, n_vocab, (b, n), device=device, dtype=id_dtype or torch.int64)
    if n_distinct:  # repeated ids: several tokens add into each of a few rows spread over V
        ids = torch.randperm(n_vocab, device=device)[:n_distinct][ids % n_distinct].to(ids.dtype)
    ids[0, 0] = n_vocab - 1  # the last vocab row, in the ragged last vocab tile
    w, p = _tables(n_vocab, dim, max_len, dtype, device)
    pos = p if with_pos else None
    g = 1.5 + torch.randn(b, n, dim, device=device)  # off-centre upstream gradient

    h = embedding(ids, w, pos, start, use_triton=True)
    assert h.shape == (b, n, dim) and h.dtype == dtype
    h.backward(g.to(dtype))

    w64 = w.detach().double().requires_grad_()
    p64 = p.detach().double().requires_grad_()
    ref = embedding(ids, w64, p64 if with_pos else None, start, use_triton=False)
    ref.backward(g.to(dtype).double())

    tol = TOL[dtype]
    torch.testing.assert_close(h.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=tol, atol=tol * 10)
    if with_pos:
        torch.testing.assert_close(p.grad.double(), p64.grad, rtol=tol, atol=tol * 10)
    else:
        assert p.grad is None


@pytest.mark.parametrize(
    "b, n, n_vocab, dim, max_len, start",
    [
        (2, 17, 40, 48, 32, 0),  # ragged everything, several token tiles
        (3, 5, 7, 32, 20, 9),  # a window of positions past 0, tiny vocab
        (1, 1, 16, 16, 4, 3),  # one token at the last position
        (4, 33, 70, 80, 40, 7),  # several vocab and column tiles
    ],
)
def test_matches_float64_reference(b, n, n_vocab, dim, max_len, start, device):
    _check(b, n, n_vocab, dim, max_len, start, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_tables(dtype, device):
    _check(2, 19, 50, 48, 24, 2, dtype, device)


def test_strided_ids(device):
    # a (b, 1) column of a wider id tensor (a decode step's slice) and a transposed view; each
    # twice, new ids in place the second time (the plan's bound launch, ids flattened again)
    seq = torch.randint(0, 30, (3, 12), device=device)
    w, p = _tables(30, 16, 12, torch.float32, device)
    for ids, start in ((seq[:, 5:6], 5), (seq[:, 2:9], 2), (seq.T[:4], 0)):
        for _ in range(2):
            h = embedding(ids, w, p, start, use_triton=True)
            torch.testing.assert_close(h, embedding(ids, w, p, start), rtol=0, atol=0)
            seq.random_(0, 30)


def test_no_positional_table_and_int32_ids(device):
    _check(2, 21, 33, 32, 21, 0, torch.float32, device, with_pos=False, id_dtype=torch.int32)


def test_repeated_ids_sum_their_gradients(device):
    # every token is id 3: its row's gradient is the sum of all rows of g, the others zero
    ids = torch.full((2, 9), 3, device=device)
    w, p = _tables(10, 16, 9, torch.float32, device)
    g = torch.randn(2, 9, 16, device=device)
    embedding(ids, w, p, use_triton=True).backward(g)
    expected = torch.zeros(10, 16, device=device, dtype=torch.float64)
    expected[3] = g.double().sum((0, 1))
    torch.testing.assert_close(w.grad.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p.grad, g.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_vocab", [10, LARGE_VOCAB], ids=["one_hot", "scatter"])
def test_empty_batch(n_vocab, device):
    # no tokens: an empty output, and zero gradients for both tables
    ids = torch.zeros((0, 3), dtype=torch.int64, device=device)
    w, p = _tables(n_vocab, 8, 6, torch.float32, device)
    h = embedding(ids, w, p, 2, use_triton=True)
    assert h.shape == (0, 3, 8)
    h.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(p.grad, torch.zeros_like(p))


def test_deterministic(device):
    ids = torch.randint(0, 30, (3, 40), device=device)
    w, p = _tables(30, 32, 40, torch.float32, device)
    g = torch.randn(3, 40, 32, device=device)
    grads = []
    for _ in range(2):
        w.grad = p.grad = None
        embedding(ids, w, p, use_triton=True).backward(g)
        grads.append((w.grad.clone(), p.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def _spy_ops(monkeypatch) -> list:
    """Record `scatter` of every backward launched (eager plans and registered ops alike)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[6])
        return backward(*args, **kwargs)

    backward = embedding_module._backward
    monkeypatch.setattr(embedding_module, "_backward", spy)
    return calls


@pytest.mark.parametrize(
    "b, n, dim, max_len, start, dtype, with_pos",
    [
        (3, 17, 40, 32, 5, torch.float32, True),  # ragged tiles, positions past 0
        (1, 33, 48, 33, 0, torch.float32, False),  # no positional table
        (2, 11, 40, 16, 4, torch.float16, True),
        (2, 11, 40, 16, 4, torch.bfloat16, True),
    ],
)
def test_large_vocab_scatter_matches_float64_reference(
    b, n, dim, max_len, start, dtype, with_pos, device, monkeypatch
):
    # above ONE_HOT_MAX_VOCAB: the gather forward and the atomic scatter backward, 5 distinct
    # ids (plus the last row) so that several tokens, of several tiles, add into one row
    calls = _spy_ops(monkeypatch)
    _check(b, n, LARGE_VOCAB, dim, max_len, start, dtype, device, with_pos, n_distinct=5)
    assert calls == [True]


def test_large_vocab_int32_ids(device, monkeypatch):
    # int32 ids through the scatter (it widens them to int64 for the row offsets; an offset
    # past 2**31 itself needs a GPU-sized table: the GPT-2 shape's GPU test)
    calls = _spy_ops(monkeypatch)
    _check(2, 9, 2000, 40, 9, 0, torch.float32, device, id_dtype=torch.int32)
    assert calls == [True]


@pytest.mark.parametrize("scatter", [False, True])
def test_registered_ops(scatter, device):
    # torch.library's checks of both ops with either backward (on CUDA also fake tensors and
    # AOTAutograd's trace, which catch a mutated argument the schema does not declare)
    tests = _opcheck_tests(device)
    ids = torch.randint(0, 1100, (2, 9), device=device)
    w = torch.randn(1100, 40, device=device, requires_grad=True)
    p = torch.randn(16, 40, device=device, requires_grad=True)
    torch.library.opcheck(embedding_module.embedding_op, (ids, w, p, 3, scatter), test_utils=tests)
    torch.library.opcheck(
        embedding_module.embedding_op, (ids, w, None, 0, scatter), test_utils=tests
    )
    dh = torch.randn(2, 9, 40, device=device)
    args = (dh, ids, 1100, 16, 3, torch.float32, scatter)
    torch.library.opcheck(embedding_module.embedding_backward_op, args, test_utils=tests)


def test_large_vocab_deterministic_takes_pytorch_path(device, monkeypatch):
    # deterministic algorithms on: atomics would reorder the fp32 sums, so PyTorch's
    # embedding (deterministic sort-based backward) runs instead of the Triton op
    def refuse(*args):
        raise AssertionError("embedding_op ran under deterministic algorithms")

    monkeypatch.setattr(embedding_module, "embedding_op", refuse)
    with deterministic_algorithms(True):
        _check(2, 13, LARGE_VOCAB, 40, 20, 3, torch.float32, device, n_distinct=4)


def test_small_vocab_deterministic_keeps_triton_path(device, monkeypatch):
    # the one-hot backward is deterministic: deterministic algorithms keep it
    calls = _spy_ops(monkeypatch)
    with deterministic_algorithms(True):
        _check(2, 13, 40, 32, 20, 3, torch.float32, device)
    assert calls == [False]


@pytest.mark.parametrize(
    "args, match",
    [
        (lambda w, p: (torch.zeros(2, 3), w, p), "int32/int64"),
        (lambda w, p: (torch.zeros(6, dtype=torch.long), w, p), r"\(batch, seq\)"),
        (lambda w, p: (torch.zeros(1, 3, dtype=torch.long), w[0], p), "weight must be"),
        (lambda w, p: (torch.zeros(1, 3, dtype=torch.long), w, p[:, :4]), "pos_weight's dim"),
        (lambda w, p: (torch.zeros(1, 5, dtype=torch.long), w, p, 2), "outside pos_weight"),
        (lambda w, p: (torch.zeros(1, 3, dtype=torch.long), w, p.half()), "must match"),
    ],
)
def test_bad_input(args, match, device):
    w, p = _tables(10, 8, 6, torch.float32, device)
    ids, *tables = args(w.detach(), p.detach())
    with pytest.raises((TypeError, ValueError), match=match):
        embedding(ids.to(device), *tables, use_triton=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, n", [(4, 512), (16, 512), (3, 1000)])
def test_gpu_model_shapes(b, n, dtype):
    _check(b, n, 256, 512, 1024, 0, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_gpu_gpt2_scatter(grad_dtype):
    # the GPT-2 preset's step: 16 x 1024 tokens, vocabulary 50,304, D = 768, fp32 tables;
    # dh in fp32 (through autograd) and bf16 (the backward op itself, as a bf16 graph hands
    # it over). The atomics reorder the fp32 sums: ~1e-5 against float64.
    b, n, n_vocab, dim = 16, 1024, 50304, 768
    ids = torch.randint(0, n_vocab, (b, n), device="cuda")
    w, p = _tables(n_vocab, dim, n, torch.float32, "cuda")
    h = embedding(ids, w, p, use_triton=True, check_ids=False)
    torch.testing.assert_close(h.double(), w.double()[ids] + p.double(), rtol=1e-5, atol=1e-5)
    g = (1.5 + torch.randn(b, n, dim, device="cuda")).to(grad_dtype)
    dw64 = torch.zeros(n_vocab, dim, device="cuda", dtype=torch.float64)
    dw64.index_add_(0, ids.reshape(-1), g.double().reshape(-1, dim))
    dp64 = g.double().sum(0)
    if grad_dtype == torch.float32:
        h.backward(g)
        dw, dp = w.grad, p.grad
    else:
        dw, dp = embedding_backward_op(g, ids, n_vocab, n, 0, torch.float32, True)
    assert dw.dtype == dp.dtype == torch.float32
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dp.double(), dp64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("bad_id", [-1, 10, 1 << 40])
def test_out_of_range_ids_raise(bad_id, use_triton, device):
    # check_ids (the default): an IndexError naming the id, as PyTorch's embedding raises
    w, p = _tables(10, 8, 6, torch.float32, device)
    ids = torch.randint(0, 10, (2, 5), device=device)
    ids[1, 3] = bad_id
    with pytest.raises(IndexError, match=rf"\[0, 10\).*found id {bad_id}"):
        embedding(ids, w, p, use_triton=use_triton)
        raise_pending()  # (a GPU's eager Triton call: no sync, the error comes later)


def test_reference_raises_without_the_check():
    # check_ids=False leaves the PyTorch path to F.embedding, which raises on the CPU itself
    w, p = _tables(10, 8, 6, torch.float32, "cpu")
    ids = torch.tensor([[1, 10, 2]])
    with pytest.raises(IndexError):
        embedding(ids, w, p, use_triton=False, check_ids=False)


@pytest.mark.parametrize("n_vocab", [10, LARGE_VOCAB], ids=["one_hot", "scatter"])
@pytest.mark.parametrize("with_pos", [False, True])
def test_unchecked_out_of_range_ids_give_nan_rows(with_pos, n_vocab, device):
    # check_ids=False (the Transformer, captured steps): out-of-range ids get NaN rows, so
    # the loss turns NaN, never a silent zero row; the other rows and gradients are unchanged
    w, p = _tables(n_vocab, 8, 6, torch.float32, device)
    pos = p if with_pos else None
    ids = torch.randint(0, n_vocab, (2, 6), device=device)
    bad = torch.zeros_like(ids, dtype=torch.bool)
    bad[0, 2] = bad[1, 5] = True
    bad_ids = torch.where(bad, torch.tensor([-3, n_vocab], device=device)[ids % 2], ids)
    h = embedding(bad_ids, w, pos, use_triton=True, check_ids=False)
    assert torch.isnan(h[bad]).all() and torch.isfinite(h[~bad]).all()
    torch.testing.assert_close(h[~bad], embedding(ids, w, pos)[~bad], rtol=0, atol=0)
    assert torch.isnan(h.sum())
    g = torch.randn_like(h)
    (dw,) = torch.autograd.grad(h, w, g)
    (ref,) = torch.autograd.grad(embedding(ids, w, pos), w, torch.where(bad[..., None], 0, g))
    torch.testing.assert_close(dw, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("table", ["weight", "pos_weight"])
def test_double_backward_raises(table, device, assert_first_order_only):
    w, p = _tables(10, 8, 6, torch.float32, device)
    ids = torch.randint(0, 10, (2, 5), device=device)
    if table == "weight":
        assert_first_order_only(lambda w: embedding(ids, w, p, use_triton=True), w, "embedding")
    else:
        assert_first_order_only(lambda p: embedding(ids, w, p, use_triton=True), p, "embedding")


@pytest.mark.parametrize("n_vocab", [10, LARGE_VOCAB], ids=["one_hot", "scatter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_pos", [False, True])
def test_eager_plan_matches_the_registered_ops(with_pos, dtype, n_vocab, device):
    # Eager calls of one layout share a plan whose launches are bound on its first call,
    # start and the check's stamp passed per call: outputs and gradients equal the registered
    # ops' (bit for bit, but for the scatter's atomics on a GPU), for several starts, a
    # strided upstream gradient, int32 ids, with and without autograd recording.
    w, p = _tables(n_vocab, 40, 24, dtype, device)
    pos = p if with_pos else None
    ids = torch.randint(0, n_vocab, (2, 9), device=device, dtype=torch.int32)
    scatter = n_vocab > ONE_HOT_MAX_VOCAB
    exact = 0 if device == "cpu" or not scatter else 1e-5
    for start in (0, 5, 15):
        for strided in (False, True):
            g = 0.5 + torch.randn(2, 9, 80 if strided else 40, device=device, dtype=dtype)
            g = g[..., ::2] if strided else g
            h = embedding(ids, w, pos, start, use_triton=True)
            grads = torch.autograd.grad(h, (w, p) if with_pos else (w,), g)
            ref = call_op(embedding_module.embedding_op, ids, w, pos, start, scatter)
            dw, dp = call_op(
                embedding_module.embedding_backward_op,
                g, ids, n_vocab, 24 if with_pos else 0, start, dtype, scatter,
            )  # fmt: skip
            assert torch.equal(h, ref)
            torch.testing.assert_close(grads[0], dw, rtol=exact, atol=exact)
            if with_pos:
                torch.testing.assert_close(grads[1], dp, rtol=exact, atol=exact)
        with torch.no_grad():
            assert torch.equal(embedding(ids, w, pos, start, use_triton=True), h)
    plans = [v for v in embedding_module._EAGER_PLANS.plans.values() if v]
    assert len(plans) == 1 and len(plans[0].bwd) == 2  # one per upstream layout


def test_eager_plan_checks_and_unchecked_calls_apart(device):
    # check_ids is part of a plan's key: an unchecked call of a layout a checked call planned
    # launches without the flag (NaN rows, no error), and the checked plan still raises.
    w, p = _tables(10, 8, 6, torch.float32, device)
    ids = torch.randint(0, 10, (2, 5), device=device)
    embedding(ids, w, p, use_triton=True)
    bad = ids.clone()
    bad[0, 1] = 12
    assert torch.isnan(embedding(bad, w, p, use_triton=True, check_ids=False)[0, 1]).all()
    raise_pending()
    with pytest.raises(IndexError, match="found id 12"):
        embedding(bad, w, p, use_triton=True)
        raise_pending()
    assert len(embedding_module._EAGER_PLANS.plans) == 2


@pytest.mark.parametrize("strided", ["weight", "pos_weight"])
def test_eager_plan_reads_tables_of_strided_columns(strided, device):
    # Tables whose columns are not unit-stride (a transposed view) are read through a copy on
    # every call, as on the first: the plan's second call gave garbage.
    w, p = _tables(10, 8, 7, torch.float32, device)
    w, p = w.detach(), p.detach()
    if strided == "weight":
        w = w.t().contiguous().t()
    else:
        p = p.t().contiguous().t()
    ids = torch.randint(0, 10, (2, 5), device=device)
    want = w[ids] + p[1:6]
    for _ in range(2):
        torch.testing.assert_close(embedding(ids, w, p, 1, use_triton=True), want)


def test_zero_width_tables_still_check_ids(device):
    # D = 0: no kernel runs to flag an id, so the ids are checked on the host
    ids = torch.tensor([[1, 11]], device=device)
    for _ in range(2):
        with pytest.raises(IndexError, match="found id 11"):
            embedding(ids, torch.randn(10, 0, device=device), use_triton=True)
            raise_pending()


def test_a_late_id_error_without_a_bad_id_left_still_raises():
    # The kernel met an id out of range, but the ids were changed in place before the
    # deferred check read them: the error says so instead of passing silently.
    err = embedding_module._late_id_error(torch.tensor([[1, 2]]), 10)
    assert isinstance(err, IndexError) and "changed before" in str(err)
    err = embedding_module._late_id_error(torch.tensor([[1, 12]]), 10)
    assert "found id 12" in str(err)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("start", [1.9, "float tensor"])
def test_start_must_be_an_integer(start, use_triton, device):
    """A float start was truncated by the Triton path (int(1.9) = 1: positions silently
    shifted) where the reference's slice refuses it; both raise a TypeError now. An integer
    0-d tensor is taken as its value, as a slice takes it."""
    w, pos = torch.randn(10, 8, device=device), torch.randn(16, 8, device=device)
    ids = torch.randint(0, 10, (2, 3), device=device)
    if start == "float tensor":
        start = torch.tensor(2.7)
    with pytest.raises(TypeError, match="start"):
        embedding(ids, w, pos, start, use_triton=use_triton)
    h = embedding(ids, w, pos, torch.tensor(2), use_triton=use_triton)
    assert torch.allclose(h, w[ids] + pos[2:5])
