"""cross_entropy_hopper: the in-place cross entropy of long rows in Gluon for Hopper, against a
float64 reference, and as the choice of `cross_entropy`'s in-place forward and the fused
linear + cross-entropy.

Gluon has no interpreter: on CPU the kernel is compiled for sm_90 and the gate is checked; on
the GPU it runs every option at vocabularies that pad its boxes or not, one or two programs per
SM, and more rows than programs.
"""

import pytest
import torch
from helpers import SM90_DRIVER, check_compiles, needs_gluon, on_hopper

import triton_transformer.cross_entropy_hopper as ceh
from triton_transformer.cross_entropy import FWD_MAX_BLOCK, cross_entropy, cross_entropy_inplace_op
from triton_transformer.linear_cross_entropy import linear_cross_entropy

COMPILE_SCRIPT = (
    SM90_DRIVER
    + """
import triton_transformer.cross_entropy_hopper as ceh

M, V = 300, 50304
labels = torch.empty(1, M, dtype=torch.int64)
n_valid, loss = torch.empty((), dtype=torch.float32), torch.empty(M)
box, n_boxes, _ = ceh.row_boxes(V, 2)
for dtype in (torch.bfloat16, torch.float16):
    x = torch.empty(M, V, dtype=dtype)
    for has_ignore, counted in ((False, False), (False, True), (True, True)):
        kernel = ceh._ce_inplace_sm90_kernel.warmup(
            x, labels, n_valid, loss, M, M, V, V, M, 1, -100, M * V // 64,
            HAS_IGNORE=has_ignore, NORMALIZE_GRAD=dtype == torch.bfloat16, COUNTED=counted,
            BOX=box, N_BOXES=n_boxes, num_warps=ceh.NUM_WARPS, grid=(1,),
        )
        assert "cp.async.bulk.tensor" in kernel.asm["ptx"]
        print("ok", dtype, has_ignore, counted)
"""
)


@needs_gluon
def test_kernel_compiles_for_sm90():
    check_compiles(COMPILE_SCRIPT, 6)


def test_row_boxes():
    # GPT-2's padded vocabulary: 786 rows of 64, in 13 boxes of 64 (832 rows, 104 KiB)
    assert ceh.row_boxes(50304, 2) == (64, 13, 2)
    # rows that only fit one program per SM: in boxes of 64, or (1750 rows of 64: 28 boxes of
    # 64 would take 224 KiB) the tallest box that fits; and a row that fits none
    assert ceh.row_boxes(100352, 2) == (64, 25, 1)
    assert ceh.row_boxes(1750 * 64, 2) == (32, 55, 1)
    assert ceh.row_boxes(128256, 2) is None
    for n_cols in (16448, 32000, 50304, 65536, 100352):
        box, n_boxes, per_sm = ceh.row_boxes(n_cols, 2)
        assert box * n_boxes * ceh.BOX_COLS >= n_cols > box * (n_boxes - 1) * ceh.BOX_COLS
        budget = ceh.SMEM_TWO_PER_SM if per_sm == 2 else ceh.SMEM_ONE_PER_SM
        assert box * n_boxes * ceh.BOX_COLS * 2 <= budget


@needs_gluon
def test_usable_gate(monkeypatch):
    monkeypatch.setattr(ceh, "is_sm90", lambda device: True)
    V = 50304

    def logits(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    assert ceh.usable(logits(1, 64, V))
    assert ceh.usable(logits(4, 16, V))  # (outer, inner) rows evenly strided
    assert not ceh.usable(logits(1, 64, V, dtype=torch.float32))
    assert not ceh.usable(logits(1, 64, V - 8))  # V not a multiple of 64
    assert not ceh.usable(logits(1, 64, FWD_MAX_BLOCK))  # short rows stay in registers
    assert not ceh.usable(logits(1, 64, 128256))  # too long for shared memory
    wide = logits(1, 64, V + 32)
    assert not ceh.usable(wide[:, :, :V])  # a row stride not a multiple of 64
    wide = logits(1, 64, V + 64)
    assert ceh.usable(wide[:, :, :V])
    assert ceh.usable(wide[:, :, 8 : V + 8])  # a start 16 bytes in
    assert not ceh.usable(wide[:, :, 4 : V + 4])  # a start 8 bytes in: TMA needs 16
    assert not ceh.usable(logits(4, 16, V).transpose(0, 1))  # rows not evenly strided
    # 2**31 box rows or more: past TMA's int32 coordinates (a meta tensor: no memory)
    assert ceh.usable(logits(1, (2**31 - 1) * 64 // V, V))
    assert not ceh.usable(logits(1, 2**31 * 64 // V + 1, V))
    monkeypatch.setattr(ceh, "is_sm90", lambda device: False)
    assert not ceh.usable(logits(1, 64, V))


def _reference(logits, labels, ignore_index, normalize):
    """(mean loss, its gradient) in float64 for an upstream gradient of 1; without normalize
    (fp16) the gradient is softmax - onehot, not divided by the valid count."""
    x = logits.double().detach().requires_grad_()
    flat_labels = labels.reshape(-1)
    ignore = -100 if ignore_index is None else ignore_index
    loss = torch.nn.functional.cross_entropy(
        x.reshape(-1, x.shape[-1]), flat_labels, ignore_index=ignore
    )
    loss.backward()
    grad = x.grad
    if not normalize:
        grad = grad * (flat_labels != ignore).sum()
    return loss.detach(), grad


def _labels(shape, V, ignore_index, device):
    labels = torch.randint(V, shape, device=device)
    if ignore_index is not None:
        drop = torch.rand(shape, device=device) < 0.3
        drop.view(-1)[0] = True
        labels[drop] = ignore_index
    return labels


@pytest.fixture
def launches(monkeypatch):
    """The number of Gluon launches so far (a list holding one count)."""
    count = [0]
    launch = ceh.launch_cross_entropy_inplace_sm90

    def counting(*args, **kwargs):
        count[0] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(ceh, "launch_cross_entropy_inplace_sm90", counting)
    return count


# (outer, inner, V): few rows; more rows than programs (two per SM); a vocabulary just above
# the register path's (257 rows of 64 in 5 boxes of 64: the last box holds only the
# last 64 columns); one program per SM; (outer, inner)
GPU_SHAPES = [(1, 5, 50304), (1, 700, 50304), (3, 300, 16448), (1, 300, 100352), (2, 150, 32000)]


@on_hopper
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("ignore_index", [None, -100], ids=["all", "ignore"])
def test_matches_float64(shape, dtype, ignore_index, launches):
    logits = (-2.3 + 1.5 * torch.randn(shape, device="cuda")).to(dtype)
    labels = _labels(shape[:2], shape[2], ignore_index, "cuda")
    normalize = dtype != torch.float16
    ref_loss, ref_grad = _reference(logits, labels, ignore_index, normalize)
    x = logits.clone()
    loss, _ = cross_entropy_inplace_op(x, labels, ignore_index)
    assert launches[0] == 1
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    err = (x.double() - ref_grad).norm() / ref_grad.norm()
    assert err <= 1e-2, err
    if ignore_index is not None:  # ignored rows: exactly zero
        assert (x[labels == ignore_index] == 0).all()


@on_hopper
def test_matches_the_triton_kernel_and_writes_only_its_rows(launches, monkeypatch):
    V = 50304
    wide = torch.full((2, 400, V + 128), 7.0, device="cuda", dtype=torch.bfloat16)
    logits = wide[:, :, :V]  # rows strided V + 128 apart, padding after each
    logits.copy_(-2.3 + 1.5 * torch.randn(logits.shape, device="cuda"))
    labels = _labels((2, 400), V, -100, "cuda")
    x_triton = logits.clone()
    monkeypatch.setattr(ceh, "ENABLED", False)
    loss_triton, _ = cross_entropy_inplace_op(x_triton, labels, -100)
    assert launches[0] == 0
    monkeypatch.setattr(ceh, "ENABLED", True)
    loss, _ = cross_entropy_inplace_op(logits, labels, -100)
    assert launches[0] == 1
    torch.testing.assert_close(loss, loss_triton, rtol=1e-5, atol=0)
    torch.testing.assert_close(logits, x_triton, rtol=1e-2, atol=1e-6)
    assert (wide[:, :, V:] == 7.0).all()  # the padding between rows is untouched


@on_hopper
def test_out_of_range_label_poisons_its_row(launches):
    V = 50304
    logits = torch.randn(1, 300, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(V, (1, 300), device="cuda")
    labels[0, 7] = V
    loss, _ = cross_entropy_inplace_op(logits, labels, -100)
    assert launches[0] == 1
    assert loss.isnan()
    assert logits[0, 7].isnan().all()
    assert torch.isfinite(logits[0, :7]).all() and torch.isfinite(logits[0, 8:]).all()


@on_hopper
def test_cuda_graph_replays_on_new_logits(launches):
    V = 50304
    static = torch.empty(1, 512, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(V, (1, 512), device="cuda")
    static.normal_()
    cross_entropy_inplace_op(static.clone(), labels, None)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, _ = cross_entropy_inplace_op(static, labels, None)
    for _ in range(2):
        fresh = -1.0 + 2.0 * torch.randn(1, 512, V, device="cuda", dtype=torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        ref_loss, ref_grad = _reference(fresh, labels, None, True)
        assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
        assert (static.double() - ref_grad).norm() / ref_grad.norm() <= 1e-2
    assert launches[0] >= 2


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_linear_cross_entropy_takes_it(dtype, launches):
    M, K, V = 1000, 96, 50304
    x = (0.5 * torch.randn(M, K, device="cuda")).to(dtype).requires_grad_()
    w = (0.5 * torch.randn(V, K, device="cuda")).to(dtype).requires_grad_()
    labels = _labels((M,), V, -100, "cuda")
    loss = linear_cross_entropy(x, w, labels, ignore_index=-100, use_triton=True, chunk_rows=384)
    loss.backward()
    assert launches[0] == 3  # one per chunk
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64 @ w64.t(), labels, ignore_index=-100)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad)):
        assert (got.double() - want).norm() / want.norm() <= 1e-2


@on_hopper
def test_cross_entropy_inplace_backward_uses_it(launches):
    V = 50304
    logits = torch.randn(4, 64, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(V, (4, 64), device="cuda")
    x = logits * 1.0  # the in-place op overwrites its input: not a leaf
    loss = cross_entropy(x, labels, use_triton=True, inplace_backward=True)
    loss.backward(torch.tensor(2.0, device="cuda"))
    assert launches[0] == 1
    ref_loss, ref_grad = _reference(logits, labels, None, True)
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    assert (logits.grad.double() - 2.0 * ref_grad).norm() / (2.0 * ref_grad).norm() <= 1e-2


@on_hopper
@pytest.mark.parametrize("fused", [False, True], ids=["inplace", "linear"])
def test_compiled_loss_takes_it(fused, launches):
    # torch.compile cannot trace a Gluon kernel: traced code calls the opaque
    # cross_entropy_inplace_opaque op, whose eager call launches the kernel; the same loss and
    # gradients as the eager call
    M, K, V = 1000, 96, 50304
    x = (0.5 * torch.randn(M, K, device="cuda")).to(torch.bfloat16)
    w = (0.5 * torch.randn(V, K, device="cuda")).to(torch.bfloat16).requires_grad_()
    labels = _labels((M,), V, -100, "cuda")

    def run(x):  # no host check of the labels: it reads them, which a full graph cannot
        if fused:
            return linear_cross_entropy(x, w, labels, ignore_index=-100, use_triton=True,
                                        chunk_rows=384, check_labels=False)  # fmt: skip
        return cross_entropy(x @ w.t(), labels, -100, use_triton=True, inplace_backward=True,
                             check_labels=False)  # fmt: skip

    results = []
    for fn in (run, torch.compile(run, fullgraph=True)):
        launches[0] = 0
        xs = x.clone().requires_grad_()
        w.grad = None
        loss = fn(xs)
        loss.backward()
        assert launches[0] == (3 if fused else 1), fn
        results.append((loss.float(), xs.grad.float(), w.grad.float()))
    (loss, *grads), (ref_loss, *ref_grads) = results[1], results[0]
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got - want).norm() / want.norm() <= 1e-2
