"""cross_entropy: the Triton kernels (forward and backward) against a float64 reference.

The reference is the PyTorch branch run on float64 copies of the same inputs; the PyTorch
branch itself is checked against `F.cross_entropy` in float64.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from helpers import check_launches_bound_per_shape, compile_trace_check

from triton_transformer.checks import raise_pending
from triton_transformer.cross_entropy import (
    BWD_MAX_BLOCK,
    FWD_MAX_BLOCK,
    cross_entropy,
    cross_entropy_backward_op,
    cross_entropy_inplace_backward_op,
    cross_entropy_inplace_op,
    cross_entropy_op,
)
from triton_transformer.utils import call_op

ce_mod = importlib.import_module("triton_transformer.cross_entropy")

# log(0) = -inf in the interpreter's numpy for rows with nothing to sum (ignored rows).
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

BIG = max(FWD_MAX_BLOCK, BWD_MAX_BLOCK)  # rows this long loop in both kernels

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LOSS_TOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def make_logits(shape, dtype=torch.float32, device="cpu"):
    # Off-centre and spread out, so the softmax is neither uniform nor one-hot.
    return (-2.3 + 1.5 * torch.randn(shape, device=device, dtype=torch.float64)).to(dtype)


def make_labels(shape, V, ignore_index=None, device="cpu"):
    labels = torch.randint(V, shape, device=device)
    if ignore_index is not None and labels.numel() > 1:
        flat = labels.view(-1)
        drop = torch.rand(flat.shape, device=device) < 0.3
        drop[0], drop[-1] = True, False  # at least one ignored, at least one kept
        flat[drop] = ignore_index
    return labels


def rel_err(out, ref):
    """Norm-wise relative error in float64; NaN anywhere makes it NaN (so checks fail)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def run(logits, labels, ignore_index, use_triton, dloss=1.7, **kwargs):
    """Loss and d(dloss * loss)/d(logits); dloss != 1 checks the upstream-gradient scaling.

    The logits are copied first (keeping their strides), since inplace_backward overwrites
    them."""
    x = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device=logits.device)
    x.copy_(logits)
    x.requires_grad_()
    loss = cross_entropy(x, labels, ignore_index=ignore_index, use_triton=use_triton, **kwargs)
    loss.backward(torch.tensor(dloss, dtype=loss.dtype, device=loss.device))
    return loss.detach(), x.grad


def check_against_reference(logits, labels, ignore_index=None, dloss=1.7, **kwargs):
    dtype = logits.dtype
    loss, grad = run(logits, labels, ignore_index, use_triton=True, dloss=dloss, **kwargs)
    ref_loss, ref_grad = run(logits.double(), labels, ignore_index, use_triton=False, dloss=dloss)
    assert loss.shape == () and loss.dtype == torch.float32
    assert grad.shape == logits.shape and grad.dtype == dtype
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert abs(loss.item() - ref_loss.item()) <= LOSS_TOL[dtype] * max(abs(ref_loss.item()), 1)
    if ref_grad.abs().max() == 0:  # V == 1: the gradient is exactly zero
        assert (grad == 0).all()
    else:
        assert rel_err(grad, ref_grad) <= TOL[dtype]


SHAPES = [
    (5, 1),  # V == 1: loss 0, gradient 0
    (1, 37),  # a single row
    (7, 37),  # V not a power of two
    (3, FWD_MAX_BLOCK),  # exactly one full forward block
    (2, BWD_MAX_BLOCK),  # exactly one full backward block, full forward blocks only
    (3, 2 * BIG + 808),  # looped paths with a partial last block
    (2, 3, 37),  # 3-D
    (2, 2, 3, 37),  # 4-D
    (37,),  # 1-D logits, 0-d label
]


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ignore_index", [None, -100])
def test_matches_reference_fp32(shape, ignore_index, inplace, device):
    logits = make_logits(shape, device=device)
    labels = make_labels(shape[:-1], shape[-1], ignore_index, device)
    check_against_reference(logits, labels, ignore_index, inplace_backward=inplace)


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(7, 37), (3, 2 * BIG + 808)], ids=str)
def test_matches_reference_half(shape, dtype, inplace, device):
    logits = make_logits(shape, dtype, device)
    labels = make_labels(shape[:-1], shape[-1], -100, device)
    check_against_reference(logits, labels, -100, inplace_backward=inplace)


def test_ignore_index_inside_vocabulary(device):
    # A real class id (e.g. a pad token 0) can be the ignored label.
    logits = make_logits((9, 37), device=device)
    labels = make_labels((9,), 37, device=device)
    labels[::3] = 0
    check_against_reference(logits, labels, ignore_index=0)


def test_transposed_logits(device):
    # Last dim not unit-stride: the wrapper makes a contiguous copy.
    logits = make_logits((37, 6), device=device).t()
    labels = make_labels((6,), 37, -100, device)
    check_against_reference(logits, labels, -100)


def test_strided_rows_and_labels(device):
    # The language-model case: logits[:, :-1] and labels[:, 1:] are views with gaps.
    logits = make_logits((2, 5, 37), device=device)[:, :-1]
    labels = make_labels((2, 5), 37, -100, device)[:, 1:]
    check_against_reference(logits, labels, -100)
    # Rows with a stride larger than V and strided labels: both reach the kernels uncopied.
    wide = make_logits((6, 50), device=device)[:, :37]
    labels = make_labels((6, 2), 37, -100, device)[:, 1]
    assert wide.stride() == (50, 1) and labels.stride() == (2,)
    check_against_reference(wide, labels, -100)


def test_minus_inf_logits(device):
    # Masked-out classes: a whole first block of -inf exercises the online max guard.
    n_inf = FWD_MAX_BLOCK + 10
    V = n_inf + 300
    logits = make_logits((3, V), device=device)
    logits[:, :n_inf] = float("-inf")
    labels = torch.randint(n_inf, V, (3,), device=device)
    loss, grad = run(logits, labels, None, use_triton=True)
    ref_loss, ref_grad = run(logits.double(), labels, None, use_triton=False)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert (grad[:, :n_inf] == 0).all()
    assert rel_err(grad, ref_grad) <= 1e-5


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
def test_looped_rows_edge_cases(inplace, device, monkeypatch):
    # The looped forward (each block loaded one iteration ahead): rows rising block after
    # block (the running max replaced every time), falling, -inf before and after finite
    # entries, and a NaN in a later block, which must reach its row's loss (and only its).
    monkeypatch.setattr(ce_mod, "FWD_MAX_BLOCK", 64)
    monkeypatch.setattr(ce_mod, "INPLACE_LOOP_BLOCK", 32)
    V = 200
    ramp = torch.linspace(-4.0, 6.0, V, dtype=torch.float64, device=device)
    logits = torch.stack([ramp, ramp.flip(0), make_logits((V,), torch.float64, device)])
    logits[2, :70] = float("-inf")
    logits[2, 150:] = float("-inf")
    labels = torch.tensor([3, 190, 100], device=device)
    check_against_reference(logits.float(), labels, None, inplace_backward=inplace)
    logits = torch.cat([logits, make_logits((1, V), torch.float64, device)])
    logits[3, 130] = float("nan")
    loss, grad = run(logits.float(), torch.tensor([3, 190, 100, 5], device=device), None, True,
                     inplace_backward=inplace)  # fmt: skip
    assert torch.isnan(loss)
    assert torch.isnan(grad[3]).all() and torch.isfinite(grad[:3]).all()


@pytest.mark.parametrize("use_triton", [False, True])
def test_all_ignored_gives_zero(use_triton, device):
    logits = make_logits((4, 37), device=device)
    labels = torch.full((4,), -100, device=device)
    loss, grad = run(logits, labels, -100, use_triton)
    assert loss.item() == 0.0
    assert grad.shape == logits.shape and (grad == 0).all()


@pytest.mark.parametrize("use_triton", [False, True])
def test_empty_input(use_triton, device):
    logits = make_logits((0, 37), device=device)
    labels = torch.zeros(0, dtype=torch.long, device=device)
    loss, grad = run(logits, labels, None, use_triton)
    assert loss.item() == 0.0 and grad.shape == (0, 37)


@pytest.mark.parametrize("ignore_index", [None, -100, 3])
def test_reference_matches_torch(ignore_index, device):
    # The PyTorch branch is F.cross_entropy (mean over kept positions) when that is defined.
    logits = make_logits((2, 5, 37), torch.float64, device)
    labels = make_labels((2, 5), 37, ignore_index, device)
    ours, grad = run(logits, labels, ignore_index, use_triton=False)
    x = logits.clone().requires_grad_()
    kwargs = {} if ignore_index is None else {"ignore_index": ignore_index}
    ref = F.cross_entropy(x.view(-1, 37), labels.view(-1), **kwargs)
    (1.7 * ref).backward()
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-15)


def test_deterministic(device):
    logits = make_logits((5, BIG + 100), device=device)
    labels = make_labels((5,), BIG + 100, -100, device)
    a, b = run(logits, labels, -100, True), run(logits, labels, -100, True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("use_triton", [False, True])
def test_bad_arguments(use_triton, device):
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    ce = lambda *a, **k: cross_entropy(*a, use_triton=use_triton, **k)
    with pytest.raises(ValueError, match="labels shape"):
        ce(logits, labels[:3])
    with pytest.raises(ValueError, match="labels shape"):
        ce(logits, labels[None])
    with pytest.raises(TypeError, match="int64"):
        ce(logits, labels.int())
    with pytest.raises(TypeError, match="int64"):
        ce(logits, labels.float())
    with pytest.raises(TypeError, match="floating"):
        ce(labels[:, None].expand(4, 37), labels)
    with pytest.raises(TypeError, match="ignore_index"):
        ce(logits, labels, ignore_index=1.5)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        ce(logits.tolist(), labels)
    with pytest.raises(ValueError, match="V == 0"):
        ce(logits[:, :0], labels)


@pytest.mark.parametrize("bad", [37, -1, -100])
def test_out_of_range_label_reference_raises(bad, device):
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    labels[2] = bad
    with pytest.raises(ValueError, match=f"found label {bad}"):
        cross_entropy(logits, labels)
    # Not ignored because ignore_index names another value.
    with pytest.raises(ValueError, match="ignore_index=-5"):
        cross_entropy(logits, labels, ignore_index=-5)


@pytest.mark.parametrize("bad", [37, -1])
def test_out_of_range_label_triton(bad, device):
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    labels[2] = bad
    labels[0] = -100  # ignored, so not an error
    # Fast path (check_labels=False): no host sync; the bad row makes the loss (and its
    # gradient row) NaN, in both modes.
    for inplace in (False, True):
        loss, grad = run(
            logits, labels, -100, use_triton=True, check_labels=False, inplace_backward=inplace
        )
        assert torch.isnan(loss)
        assert torch.isnan(grad[2]).all() and torch.isfinite(grad[[0, 1, 3]]).all()
    # The default checks (on a GPU without a sync: the error comes later); so does the debug
    # path (anomaly detection), first, from the call itself.
    with pytest.raises(ValueError, match="found label"):
        cross_entropy(logits, labels, ignore_index=-100, use_triton=True)
        raise_pending()
    with torch.autograd.set_detect_anomaly(True), pytest.raises(ValueError, match="found label"):
        cross_entropy(logits, labels, ignore_index=-100, use_triton=True, check_labels=False)


def test_triton_rejects_float64(device):
    logits = make_logits((4, 37), torch.float64, device)
    with pytest.raises(TypeError, match="dtype"):
        cross_entropy(logits, make_labels((4,), 37, device=device), use_triton=True)


# ---- ignored rows, in-place gradient, registration --------------------------------------------


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
@pytest.mark.parametrize("V", [37, 2 * BIG + 808], ids=["single", "looped"])
def test_ignored_rows_of_neg_inf_give_zero_grad(V, inplace, device):
    # An ignored row is never read: even all -inf (or NaN) logits give 0 gradient, and the
    # row is left out of the loss.
    logits = make_logits((4, V), device=device)
    labels = make_labels((4,), V, device=device)
    labels[[1, 3]] = -100
    logits[1] = float("-inf")
    logits[3] = float("nan")
    loss, grad = run(logits, labels, -100, use_triton=True, inplace_backward=inplace)
    kept = [0, 2]
    ref_loss, ref_grad = run(logits[kept].double(), labels[kept], -100, use_triton=False)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert (grad[[1, 3]] == 0).all()
    assert rel_err(grad[kept], ref_grad) <= 1e-5
    # The PyTorch branch agrees: zeros, not NaN, on the ignored rows.
    ref_loss_all, ref_grad_all = run(logits.double(), labels, -100, use_triton=False)
    assert ref_loss_all.item() == ref_loss.item()
    assert (ref_grad_all[[1, 3]] == 0).all() and torch.equal(ref_grad_all[kept], ref_grad)


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
def test_looped_reductions(inplace, device, monkeypatch):
    # The one-program loss sum and valid count loop over blocks of rows when there are more
    # rows than one block (16 here; 8192 by default).
    monkeypatch.setattr(ce_mod, "MAX_REDUCE_BLOCK", 16)
    logits = make_logits((3, 23, 37), device=device)
    labels = make_labels((3, 23), 37, -100, device)
    check_against_reference(logits, labels, -100, inplace_backward=inplace)
    labels = make_labels((3, 23), 37, None, device)
    check_against_reference(logits, labels, None, inplace_backward=inplace)


def test_inplace_loop_settings(monkeypatch):
    # The looped in-place forward's (block, warps): the GPU model's tuned pair, the default
    # elsewhere (the interpreter too), and the module's settings over both where given.
    monkeypatch.setattr(ce_mod.torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    tuned = ce_mod._INPLACE_LOOP_TUNED["NVIDIA H200"]
    assert ce_mod._inplace_loop_tuned.__wrapped__(torch.device("cuda", 0)) == tuned
    monkeypatch.setattr(ce_mod.torch.cuda, "get_device_name", lambda device: "Some GPU")
    default = ce_mod._INPLACE_LOOP_DEFAULT
    assert ce_mod._inplace_loop_tuned.__wrapped__(torch.device("cuda", 0)) == default
    assert ce_mod._inplace_loop(torch.device("cpu")) == ce_mod._INPLACE_LOOP_DEFAULT
    monkeypatch.setattr(ce_mod, "INPLACE_LOOP_BLOCK", 1024)
    assert ce_mod._inplace_loop(torch.device("cpu")) == (1024, ce_mod._INPLACE_LOOP_DEFAULT[1])
    monkeypatch.setattr(ce_mod, "INPLACE_LOOP_WARPS", 2)
    assert ce_mod._inplace_loop(torch.device("cpu")) == (1024, 2)


def test_inplace_gradient_aliases_the_logits(device):
    # The gradient handed to the producer of the logits is the logits' own storage.
    h = make_logits((6, 5), device=device).requires_grad_()
    w = make_logits((5, 37), device=device)
    labels = make_labels((6,), 37, -100, device)
    logits = h @ w
    seen = []
    logits.register_hook(lambda g: seen.append((g.data_ptr(), g.clone())))
    loss = cross_entropy(logits, labels, -100, use_triton=True, inplace_backward=True)
    (2.5 * loss).backward()
    assert seen[0][0] == logits.data_ptr()
    ref_logits = (h.detach() @ w).double().requires_grad_()
    (2.5 * cross_entropy(ref_logits, labels, -100)).backward()
    assert rel_err(seen[0][1], ref_logits.grad) <= 1e-5
    assert rel_err(h.grad, ref_logits.grad @ w.double().t()) <= 1e-5


def test_inplace_unit_upstream_gradient_is_left_as_written(device):
    # loss.backward() (upstream gradient exactly 1): the scale kernel exits without writing.
    logits = make_logits((5, 37), device=device)
    labels = make_labels((5,), 37, -100, device)
    check_against_reference(logits, labels, -100, dloss=1.0, inplace_backward=True)


def test_inplace_fp16_keeps_small_gradients_under_a_loss_scale(device):
    # fp16 stores softmax - onehot unnormalised, so 1 / n_valid and a GradScaler-sized
    # upstream gradient are applied together in fp32, not after an fp16 underflow.
    logits = make_logits((64, 37), torch.float16, device) * 4
    labels = make_labels((64,), 37, -100, device)
    check_against_reference(logits, labels, -100, dloss=65536.0, inplace_backward=True)


def test_inplace_is_pure_without_grad(device):
    # Without autograd (no requires_grad, or no_grad) the logits are left untouched.
    logits = make_logits((5, 37), device=device)
    labels = make_labels((5,), 37, device=device)
    before = logits.clone()
    cross_entropy(logits, labels, use_triton=True, inplace_backward=True)
    with torch.no_grad():
        cross_entropy(logits.requires_grad_(), labels, use_triton=True, inplace_backward=True)
    assert torch.equal(logits.detach(), before)


def test_inplace_errors(device):
    labels = make_labels((5,), 37, device=device)
    # A node that saved the logits would read a gradient: autograd's version check catches it.
    x = make_logits((5, 37), device=device).requires_grad_()
    logits = x.exp()  # exp saves its output
    loss = cross_entropy(logits, labels, use_triton=True, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # The buffer is scaled in place: a second backward through the same graph is refused.
    x = make_logits((5, 37), device=device).requires_grad_()
    loss = cross_entropy(x * 1.0, labels, use_triton=True, inplace_backward=True)
    loss.backward(torch.tensor(2.0, device=device), retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
def test_double_backward_raises(inplace, device, assert_first_order_only):
    x = make_logits((4, 37), device=device).requires_grad_()
    labels = make_labels((4,), 37, device=device)

    def f(x):  # x * 1.0: the in-place backward overwrites its logits
        return cross_entropy(x * 1.0, labels, use_triton=True, inplace_backward=inplace)

    assert_first_order_only(f, x, "cross_entropy")


def test_registered_custom_ops(device):
    # Schema and autograd registration; on a GPU also fake tensors and AOT tracing (the
    # interpreter cannot run kernels on fake tensors).
    tests = ["test_schema", "test_autograd_registration"]
    if device == "cuda":
        tests += ["test_faketensor", "test_aot_dispatch_dynamic"]
    logits = make_logits((2, 3, 37), device=device)
    labels = make_labels((2, 3), 37, -100, device)
    x = logits.clone().requires_grad_()
    torch.library.opcheck(cross_entropy_op, (x, labels, -100), test_utils=tests)
    # without an ignore_index every label must be in range (a -100 would poison the loss
    # with NaN, which opcheck's eager-vs-traced comparison counts as a mismatch)
    in_range = make_labels((2, 3), 37, device=device)
    torch.library.opcheck(cross_entropy_op, (x, in_range, None), test_utils=tests)
    _, lse, n_valid = cross_entropy_op(logits, labels, -100)
    dloss = torch.tensor(1.3, device=device)
    args = (dloss, logits, labels, lse, n_valid, -100)
    torch.library.opcheck(cross_entropy_backward_op, args, test_utils=tests)
    # The in-place pair: no autograd of their own (the autograd.Function wraps them).
    mutable_tests = [t for t in tests if t != "test_autograd_registration"]
    torch.library.opcheck(
        cross_entropy_inplace_op, (logits.clone(), labels, -100), test_utils=mutable_tests
    )
    torch.library.opcheck(
        cross_entropy_inplace_backward_op, (logits.clone(), dloss, n_valid),
        test_utils=mutable_tests,
    )  # fmt: skip


def test_label_check_refuses_stream_capture(device, monkeypatch):
    # The host check would replay a stale answer in a CUDA graph: it raises instead.
    import triton_transformer.utils as utils_mod

    monkeypatch.setattr(utils_mod, "_CUDA_BUILT", True)  # (a CPU build: no stream to ask)
    monkeypatch.setattr(utils_mod.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(utils_mod.torch.cuda, "is_current_stream_capturing", lambda: True)
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    for use_triton in (False, True):
        with pytest.raises(RuntimeError, match="check_labels=False"):
            cross_entropy(logits, labels, use_triton=use_triton)


def test_loss_takes_in_place_ops_on_every_call(device):
    # The loss is a fresh 0-d tensor on the eager plan's first call and on its later (bound)
    # ones alike, as F.cross_entropy's is: an in-place op on it is recorded, not refused
    logits = make_logits((6, 37), device=device).requires_grad_()
    labels = make_labels((6,), 37, device=device)
    want = torch.autograd.grad(2 * F.cross_entropy(logits.float(), labels), logits)[0]
    for _ in range(3):
        loss = cross_entropy(logits, labels, use_triton=True)
        loss.mul_(2)
        (got,) = torch.autograd.grad(loss, logits)
        torch.testing.assert_close(got, want)


def test_label_check_runs_where_cuda_was_never_initialised(monkeypatch):
    # A CUDA build on a machine without a usable GPU (no driver, CUDA_VISIBLE_DEVICES=""):
    # asking the current stream whether it captures raises there. A process that never
    # initialised CUDA cannot be capturing, so the checked call does not ask.
    import triton_transformer.utils as utils_mod

    def no_device():
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")

    monkeypatch.setattr(utils_mod, "_CUDA_BUILT", True)
    monkeypatch.setattr(utils_mod.torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(utils_mod.torch.cuda, "is_current_stream_capturing", no_device)
    logits = make_logits((4, 37), device="cpu")
    labels = make_labels((4,), 37, device="cpu")
    loss = cross_entropy(logits, labels)
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), labels))


# ---- realistic shapes on a GPU ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(8192, 256), (4096, 50257)], ids=str)
def test_gpu_realistic(shape, dtype, device):
    logits = make_logits(shape, dtype, device)
    labels = make_labels(shape[:-1], shape[-1], -100, device)
    check_against_reference(logits, labels, -100)


@pytest.mark.gpu
def test_gpu_lm_batch_3d(device):
    # (batch, seq, vocab) bf16 logits shifted by one position, as in next-token training.
    logits = make_logits((8, 1025, 50257), torch.bfloat16, device)[:, :-1]
    labels = make_labels((8, 1025), 50257, -100, device)[:, 1:]
    check_against_reference(logits, labels, -100)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape", [(8192, 256), (4096, 32000), (4096, 50304), (512, 131072)], ids=str
)
def test_gpu_realistic_inplace(shape, dtype, device):
    logits = make_logits(shape, dtype, device)
    labels = make_labels(shape[:-1], shape[-1], -100, device)
    labels[:7] = -100
    logits[3] = float("-inf")  # an ignored row of -inf logits
    check_against_reference(logits, labels, -100, inplace_backward=True, check_labels=False)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [256, 32000])
def test_gpu_inplace_peak_memory(V, device):
    # In place, forward + backward allocate only per-row buffers; the pure mode allocates a
    # logits-sized gradient (checked too, so the measurement can fail).
    n_rows = 16384
    labels = make_labels((n_rows,), V, -100, device)
    logits_bytes = n_rows * V * 2
    extra = {}
    for inplace in (False, True):
        x = make_logits((n_rows, V), torch.bfloat16, device).requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = cross_entropy(
            x.view(n_rows, V), labels, -100, use_triton=True, check_labels=False,
            inplace_backward=inplace,
        )  # fmt: skip
        loss.backward()
        torch.cuda.synchronize()
        extra[inplace] = torch.cuda.max_memory_allocated() - base
        if inplace:
            assert x.grad.data_ptr() == x.data_ptr()
        del x, loss
    assert extra[False] >= logits_bytes
    assert extra[True] <= 64 * n_rows + (1 << 20), extra  # a few fp32 per row + 1 MiB


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
def test_gpu_cuda_graph_capture(inplace, device):
    # A captured forward+backward replays with fresh logits and labels in the static buffers.
    V, n_rows = 1000, 512
    h = make_logits((n_rows, 64), device=device).requires_grad_()
    w = make_logits((64, V), device=device) * 0.1
    labels = make_labels((n_rows,), V, -100, device)

    def step():
        loss = cross_entropy(
            h @ w, labels, -100, use_triton=True, check_labels=False, inplace_backward=inplace
        )
        loss.backward()
        return loss

    from triton_transformer.cuda_graph import capture_graph

    graph, loss = capture_graph(step, clear_grads=(h,))
    for _ in range(2):
        h.data.copy_(make_logits(h.shape, device=device))
        labels.copy_(make_labels((n_rows,), V, -100, device))
        h.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref_h = h.detach().double().requires_grad_()
        ref = cross_entropy(ref_h @ w.double(), labels, -100)
        ref.backward()
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
        assert rel_err(h.grad, ref_h.grad) <= 1e-5
    # The host label check refuses to be captured.
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="check_labels=False"), torch.cuda.graph(graph):
        cross_entropy(h @ w, labels, -100, use_triton=True)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
def test_gpu_compiles_without_graph_breaks(inplace, device):
    w = make_logits((64, 512), device=device) * 0.1
    labels = make_labels((256,), 512, -100, device)

    def f(h):
        logits = (h.sin() @ w).float()
        return cross_entropy(
            logits, labels, -100, use_triton=True, check_labels=False, inplace_backward=inplace
        )

    h = make_logits((256, 64), device=device).requires_grad_()
    explanation = torch._dynamo.explain(f)(h)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    loss = torch.compile(f)(h)
    loss.backward()
    ref_h = h.detach().double().requires_grad_()
    ref = cross_entropy(ref_h.sin() @ w.double(), labels, -100)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-4 * abs(ref.item())
    assert rel_err(h.grad, ref_h.grad) <= 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile for real")
def test_compile_traces_without_graph_breaks_cpu():
    # Dynamo (fullgraph: any graph break fails) and AOTAutograd's joint forward+backward trace
    # of the Triton paths of cross_entropy (both modes), softmax and dropout, static and dynamic
    # shapes, on CPU. A subprocess, because the kernels must be JITFunctions
    # (TRITON_INTERPRET=0) for torch.library to trace them; no kernel runs.
    passed, cases, output = compile_trace_check("rows")
    assert passed and cases == 8, output


@pytest.mark.parametrize("ignore_index", [None, -100])
def test_eager_launches_bound_per_shape(ignore_index, device):
    # an eager call of the op without a plan of the public function's (`_EagerPlan`) binds
    # the forward's two launches and the backward's one on a shape's first call (`_PLANS`);
    # later calls of that shape take them (`helpers.check_launches_bound_per_shape`). Another
    # dtype or layout (a transposed view of the logits) binds its own.
    V = 300
    logits = make_logits((3, 7, V), device=device)
    labels = make_labels((3, 7), V, ignore_index, device=device)

    def run(logits):
        leaf = logits.detach().requires_grad_()
        loss = call_op(cross_entropy_op, leaf, labels, ignore_index)[0]
        loss.backward()
        return loss, leaf.grad

    transposed = torch.empty(7, 3, V, device=device).transpose(0, 1)  # strides (V, 3V, 1)
    check_launches_bound_per_shape(ce_mod._PLANS.plans, run, logits, transposed, 6)


def _through_registered_op(logits, labels, ignore_index):
    """cross_entropy's Triton path through torch.library's dispatch and registered autograd:
    the generic path an eager plan (`_EagerPlan`) must agree with."""
    return cross_entropy_op(*ce_mod._as_rows_3d(logits, labels), ignore_index)[0]


@pytest.mark.parametrize("ignore_index", [None, -100])
@pytest.mark.parametrize(
    "shape, dtype, sliced",
    [((3, 7, 300), torch.float32, False), ((37, 50), torch.bfloat16, False),
     ((2, 9, 64), torch.float16, True), ((64,), torch.float32, False)],
)  # fmt: skip
def test_eager_plan_matches_registered_op(shape, dtype, sliced, ignore_index, device):
    # An eager call takes its layout's plan (made on the first call, its launches bound then,
    # taken by every later call). Both calls give, bit for bit, what the registered op gives
    # through the dispatcher: the loss and the logits' gradient, for upstream gradients of 1,
    # of 1.7 and of an unaligned view. sliced: a language model's shifted logits[:, :-1]
    # (rows of a wider batch, a view `_as_rows_3d` keeps).
    full = make_logits((*shape[:-2], shape[-2] + 1, shape[-1]) if sliced else shape, dtype, device)
    logits = full[..., :-1, :] if sliced else full
    labels = make_labels(logits.shape[:-1], shape[-1], ignore_index, device=device)
    buffer = torch.tensor([0.0, 1.7, 0.5], device=device)
    for dloss in (None, buffer[1], buffer[1:].view(2)[1]):  # the last one 4-byte aligned only
        results = []
        for fn in (cross_entropy, cross_entropy, _through_registered_op):
            leaf = logits.detach().requires_grad_()
            if fn is cross_entropy:
                loss = cross_entropy(leaf, labels, ignore_index, use_triton=True)
            else:
                loss = fn(leaf, labels, ignore_index)
            loss.backward(dloss)
            results.append((loss, leaf.grad))
        assert len(ce_mod._EAGER_PLANS.plans) == 1
        for got in results[:2]:
            for a, want in zip(got, results[2], strict=True):
                assert torch.equal(a, want)
        assert results[0][1].shape == logits.shape and results[0][1].dtype == dtype
    with torch.no_grad():  # no autograd recorded: the plan's forward alone
        assert torch.equal(cross_entropy(logits, labels, ignore_index, use_triton=True),
                           results[2][0])  # fmt: skip
    assert len(ce_mod._EAGER_PLANS.plans) == 1


def test_eager_plan_keeps_the_checks(device):
    # A plan is keyed on every fact its checks read: a call that differs in one of them (the
    # labels' dtype or shape, ignore_index's type) is checked as the first call was, and
    # raises the same errors; rows that need a copy (the vocabulary dim not of unit stride)
    # run the generic path without a plan.
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    cross_entropy(logits, labels, use_triton=True)
    (plan,) = ce_mod._EAGER_PLANS.plans.values()
    with pytest.raises(TypeError, match="int64"):
        cross_entropy(logits, labels.int(), use_triton=True)
    with pytest.raises(TypeError, match="ignore_index"):
        cross_entropy(logits, labels, ignore_index=True, use_triton=True)
    with pytest.raises(ValueError, match="labels shape"):
        cross_entropy(logits, labels[:3], use_triton=True)
    columns = make_logits((37, 4), device=device).t()  # (4, 37) of strides (1, 4)
    loss = cross_entropy(columns, labels, use_triton=True)
    assert [p for p in ce_mod._EAGER_PLANS.plans.values() if p] == [plan]
    ref = cross_entropy(columns.double(), labels)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())


@pytest.mark.parametrize("inplace", [False, True])
def test_label_check_after_the_kernels(inplace, monkeypatch, device):
    # The default check of an eager Triton call takes the loss as its verdict, after the
    # kernels (`check_labels_after`), and checks the labels only when it is NaN: a bad label
    # raises, without or with autograd recording (on a GPU from `checks.raise_pending`, or
    # the next checked call; in the interpreter from the call itself); NaN logits with good
    # labels return their NaN loss; good labels run no check. (The in-place mode with
    # autograd recording checks first instead.)
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    bad = labels.clone()
    bad[1] = 37
    for requires_grad in (False, True):
        leaf = logits.clone().requires_grad_(requires_grad)
        with pytest.raises(ValueError, match="found label 37"):
            loss = cross_entropy(leaf, bad, use_triton=True, inplace_backward=inplace)
            assert torch.isnan(loss)  # what a deferred check returns meanwhile
            raise_pending()
    nan = logits.clone()
    nan[2, 5] = float("nan")
    assert torch.isnan(cross_entropy(nan.requires_grad_(), labels, use_triton=True,
                                     inplace_backward=inplace))  # fmt: skip
    raise_pending()  # (nothing: the labels are good)
    checks = []
    original = ce_mod._label_error
    monkeypatch.setattr(ce_mod, "_label_error", lambda *a: checks.append(a) or original(*a))
    leaf = logits.clone().requires_grad_()
    cross_entropy(leaf, labels, use_triton=True, inplace_backward=inplace)
    raise_pending()
    assert len(checks) == (1 if inplace else 0)
    with pytest.raises(ValueError, match="found label 37"):
        cross_entropy(logits.clone(), bad, use_triton=True, inplace_backward=inplace)
        raise_pending()
    assert len(checks) == (2 if inplace else 1)


def test_in_place_call_checks_before_writing(device):
    # The in-place mode with autograd recording checks its labels before its kernel runs: a
    # bad label raises with the caller's logits as they were (the kernel would have written
    # the gradient over them).
    logits = make_logits((4, 37), device=device)
    labels = make_labels((4,), 37, device=device)
    labels[1] = -1
    leaf = logits.clone().requires_grad_()
    with pytest.raises(ValueError, match="found label -1"):
        cross_entropy(leaf, labels, use_triton=True, inplace_backward=True)
    assert torch.equal(leaf.detach(), logits) and leaf._version == 0


def test_eager_plan_judges_a_layout_once(monkeypatch, device):
    # Logits whose rows need a copy take the generic path, which copies them once per call:
    # the plan lookup judges such a layout from its strides and remembers it (no copy of its
    # own, no second check). An ignore_index that cannot key a plan (not an int) raises the
    # checks' TypeError.
    copies = []
    original = ce_mod._as_rows_3d
    monkeypatch.setattr(ce_mod, "_as_rows_3d", lambda *a: copies.append(1) or original(*a))
    columns = make_logits((37, 4), device=device).t()  # (4, 37) of strides (1, 4)
    labels = make_labels((4,), 37, device=device)
    for _ in range(3):
        cross_entropy(columns, labels, use_triton=True)
    assert len(copies) == 3
    assert list(ce_mod._EAGER_PLANS.plans.values()) == [False]
    with pytest.raises(TypeError, match="ignore_index must be an int or None"):
        cross_entropy(columns, labels, ignore_index=[1], use_triton=True)


@pytest.mark.parametrize("ignore_index", [None, -1])
def test_reference_never_skips_a_label_of_minus_100(ignore_index, device):
    """F.cross_entropy skips its own ignore_index, -100, even when the caller's is None or
    another value: the reference (check_labels=False) then dropped such a row from the loss
    silently and still counted it in the mean. It must fail as for any other bad label."""
    if device != "cpu":
        pytest.skip("a bad label is a device-side assert on CUDA")
    logits = torch.randn(2, 5, 12)
    labels = torch.randint(0, 12, (2, 5))
    labels[0, 1] = -100
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        cross_entropy(logits, labels, ignore_index, check_labels=False)
    labels[0, 1] = 3  # a good label there: the same call runs
    loss = cross_entropy(logits, labels, ignore_index, check_labels=False)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 12), labels.reshape(-1)))
