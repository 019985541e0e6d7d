"""`utils.launcher`: eager kernel launches through a per-specialisation cache of the compiled
kernel (issue #20). On the GPU every launch after the first takes the direct path, so each
case here launches twice; the cache key must separate everything Triton specialises on."""

import pytest
import torch
import triton
import triton.language as tl

from triton_transformer.utils import PerCall, _specialization, launcher


@triton.jit
def _axpb_kernel(X, Y, n, a, b, SCALE: tl.constexpr, BLOCK: tl.constexpr = 128):
    """y[i] = x[i] * a * SCALE + b for i < n (b an int, so its specialisation matters)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    tl.store(Y + offs, (x * a * SCALE + b).to(Y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, a: float, b: int, scale: int, block: int | None = None):
    y = torch.empty_like(x)
    n = x.numel()
    kw = {} if block is None else {"BLOCK": block}
    launcher(_axpb_kernel)[(triton.cdiv(n, block or 128),)](x, y, n, a, b, SCALE=scale, **kw)
    return y


def test_key_separates_what_triton_specialises_on():
    x = torch.zeros(64)
    base = _specialization(0, (x, 7, 2.0), {"S": 1})
    assert _specialization(0, (x, 7, 2.0), {"S": 1}) == base  # a repeat hits
    assert _specialization(1, (x, 7, 2.0), {"S": 1}) != base  # another device
    assert _specialization(0, (x[1:], 7, 2.0), {"S": 1}) != base  # misaligned pointer
    assert _specialization(0, (x.half(), 7, 2.0), {"S": 1}) != base  # dtype
    assert _specialization(0, (x, 1, 2.0), {"S": 1}) != base  # an int equal to 1
    assert _specialization(0, (x, 16, 2.0), {"S": 1}) != base  # divisible by 16
    assert _specialization(0, (x, 2**31 + 7, 2.0), {"S": 1}) != base  # int64
    assert _specialization(0, (x, 7, 2.0), {"S": 2}) != base  # a constexpr
    assert _specialization(0, (x, 7, 2.0), {"S": True}) != base  # True == 1, but not its type
    assert _specialization(0, (x, 7, True), {"S": 1}) != base  # a bool is not a float
    assert _specialization(0, (x, 7, 9.0), {"S": 1}) == base  # floats: only their type
    assert _specialization(0, (x, object()), {}) is None  # cannot key: Triton's own path


def test_key_of_a_host_made_tma_descriptor():
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(64, 32)
    desc = TensorDescriptor.from_tensor
    base = _specialization(0, (desc(x, [16, 32]), 3), {})
    assert base is not None and hash(base) is not None
    assert _specialization(0, (desc(torch.ones(64, 32), [16, 32]), 3), {}) == base  # new data
    assert _specialization(0, (desc(x, [32, 32]), 3), {}) != base  # block
    assert _specialization(0, (desc(x[:48], [16, 32]), 3), {}) != base  # shape
    assert _specialization(0, (desc(x.half(), [16, 32]), 3), {}) != base  # dtype
    assert _specialization(0, (desc(torch.zeros(64, 36)[:, :32], [16, 32]), 3), {}) != base


def test_launcher_matches_reference(device):
    # twice per case: on the GPU the second launch is the cached direct one
    x = torch.randn(1000, device=device) + 0.5
    for _ in range(2):
        torch.testing.assert_close(_launch(x, 2.0, 3, 1), x * 2.0 + 3)
        torch.testing.assert_close(_launch(x, 2.0, 1, 2), x * 4.0 + 1)  # b == 1
        torch.testing.assert_close(_launch(x, -1.5, 16, 1), x * -1.5 + 16)  # b % 16 == 0
        torch.testing.assert_close(_launch(x[1:], 2.0, 3, 1), x[1:] * 2.0 + 3)  # misaligned
        xh = x.half()
        torch.testing.assert_close(_launch(xh, 2.0, 3, 1), (xh.float() * 2.0 + 3).half())
        torch.testing.assert_close(_launch(x, 2.0, 3, 1, block=64), x * 2.0 + 3)  # a default
    if device == "cuda" and triton.__version__.startswith("3.6"):
        # the Triton on the H200: every cached launch calls its C launcher (`plain_launch`)
        entries = launcher(_axpb_kernel).compiled.values()
        assert entries and all(entry[-1] is not None for entry in entries)


def test_positional_constexprs_are_not_confused(device):
    # a constexpr passed by position is not part of the cache key: such launches take
    # Triton's own path, so SCALE 1 then 3 must not reuse the SCALE=1 kernel
    x = torch.randn(300, device=device)
    for scale in (1, 3, 1, 3):
        y = torch.empty_like(x)
        launcher(_axpb_kernel)[(3,)](x, y, 300, 2.0, 5, scale)
        torch.testing.assert_close(y, x * 2.0 * scale + 5)


@pytest.mark.gpu
def test_launcher_replays_in_a_cuda_graph():
    # a direct launch captured into a CUDA graph reads the captured buffers on replay
    x = torch.randn(4096, device="cuda")
    _launch(x, 2.0, 3, 1)  # compile and cache outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _launch(x, 2.0, 3, 1)
    x.copy_(torch.randn(4096, device="cuda"))
    graph.replay()
    torch.testing.assert_close(y, x * 2.0 + 3)


def test_bound_launch_takes_new_tensors(device):
    # `bind` launches once, then launches with each call's tensors and the bound scalars and
    # constexprs (on the GPU without a key: the caller's cache keys the tensors' facts)
    x = torch.randn(1000, device=device) + 0.5
    y = torch.empty_like(x)
    bound = launcher(_axpb_kernel).bind((8,), x, y, 1000, 2.0, 3, SCALE=2)
    torch.testing.assert_close(y, x * 4.0 + 3)
    for _ in range(2):
        x2, y2 = torch.randn_like(x), torch.empty_like(x)
        bound(x2, y2)
        torch.testing.assert_close(y2, x2 * 4.0 + 3)
    if device == "cuda" and triton.__version__.startswith("3.6"):
        # the Triton on the H200: the bound launch calls its C launcher (`plain_launch`)
        assert bound.calls_c_launcher


@triton.jit
def _axpb_late_kernel(X, n, Y, a, SEED, b, SCALE: tl.constexpr, BLOCK: tl.constexpr = 128):
    """`_axpb_kernel` with tensors after scalars (Y after n, SEED after a, as the matmul
    kernels pass a dropout seed after their sizes): y = x * a * SCALE + b + seed."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    seed = tl.load(SEED).to(tl.float32)
    tl.store(Y + offs, (x * a * SCALE + b + seed).to(Y.dtype.element_ty), mask=mask)


def test_bound_launch_takes_tensors_after_scalars(device):
    # each call's tensors go to the slots the bound call's tensors took, in their order; the
    # bound launch keeps none of the first call's (they would be launched again, and held)
    x = torch.randn(1000, device=device) + 0.5
    y = torch.empty_like(x)
    seed = torch.tensor(5.0, device=device)
    bound = launcher(_axpb_late_kernel).bind((8,), x, 1000, y, 2.0, seed, 3, SCALE=2)
    torch.testing.assert_close(y, x * 4.0 + 8)
    for shift in (1.0, -7.0):
        x2, y2 = torch.randn_like(x), torch.empty_like(x)
        bound(x2, y2, torch.tensor(shift, device=device))
        torch.testing.assert_close(y2, x2 * 4.0 + 3 + shift)
    assert not _tensors_held(bound)
    if device == "cuda" and triton.__version__.startswith("3.6"):
        assert bound.calls_c_launcher


@triton.jit(do_not_specialize=["b"])
def _axpb_per_call_kernel(X, b, Y, n, a, BLOCK: tl.constexpr = 128):
    """y = x * a + b, b an int the bound launch takes per call."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    tl.store(Y + offs, (x * a + b).to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["b"])
def _axpb_late_per_call_kernel(X, n, Y, a, b, BLOCK: tl.constexpr = 128):
    """`_axpb_per_call_kernel` with the per-call int after scalars (bind's template path)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    tl.store(Y + offs, (x * a + b).to(Y.dtype.element_ty), mask=mask)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("first", [7, 16, 1])
def test_bound_launch_takes_per_call_scalars(device, first, late):
    # a `PerCall` scalar takes its place per call as a tensor does (values of every class
    # Triton would specialise on: the parameter is in do_not_specialize), first among the
    # arguments or after scalars; the other scalars stay bound. Binding again with another
    # value adds no entry to the launcher's cache (keyed by value, it would grow per bind).
    kernel = _axpb_late_per_call_kernel if late else _axpb_per_call_kernel

    def bind(x, b, y):
        args = (x, 1000, y, 2.0, PerCall(b)) if late else (x, PerCall(b), y, 1000, 2.0)
        return launcher(kernel).bind((8,), *args)

    x = torch.randn(1000, device=device) + 0.5
    y = torch.empty_like(x)
    bound = bind(x, first, y)
    torch.testing.assert_close(y, x * 2.0 + first)
    for b in (first, 1, 16, 12345, 0):
        x2, y2 = torch.randn_like(x), torch.empty_like(x)
        bound(*((x2, y2, b) if late else (x2, b, y2)))
        torch.testing.assert_close(y2, x2 * 2.0 + b)
    assert not _tensors_held(bound)
    cached = len(launcher(kernel).compiled)
    for b in (first + 3, 2**20 + 5):
        bind(x, b, y)
        torch.testing.assert_close(y, x * 2.0 + b)
    assert len(launcher(kernel).compiled) == cached
    if device == "cuda" and triton.__version__.startswith("3.6"):
        assert bound.calls_c_launcher


def _tensors_held(fn, depth: int = 4) -> bool:
    """Whether a tensor is reachable from fn's closure (through nested closures, tuples,
    lists and dicts): what a bound launch must not keep alive."""
    seen = []
    todo = [c.cell_contents for c in fn.__closure__ or ()]
    for _ in range(depth):
        nested = []
        for obj in todo:
            if isinstance(obj, torch.Tensor):
                return True
            if isinstance(obj, (tuple, list)):
                nested.extend(obj)
            elif isinstance(obj, dict):
                nested.extend(obj.values())
            elif callable(obj) and getattr(obj, "__closure__", None) and obj not in seen:
                seen.append(obj)
                nested.extend(c.cell_contents for c in obj.__closure__)
        todo = nested
    return False


def test_bound_launch_holds_no_tensor(device):
    # neither layout of the arguments (tensors first, or after a scalar) keeps the bound
    # call's tensors alive in the launch it returns
    x = torch.randn(64, device=device)
    y, seed = torch.empty_like(x), torch.tensor(1.0, device=device)
    bound = launcher(_axpb_kernel).bind((1,), x, y, 64, 2.0, 3, SCALE=1)
    assert not _tensors_held(bound)
    bound = launcher(_axpb_late_kernel).bind((1,), x, 64, y, 2.0, seed, 3, SCALE=1)
    assert not _tensors_held(bound)
    assert _tensors_held(lambda: x + y)  # the probe sees a held one


@pytest.mark.gpu
def test_bound_launch_replays_in_a_cuda_graph():
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    bound = launcher(_axpb_kernel).bind((32,), x, y, 4096, 2.0, 3, SCALE=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound(x, y)
    x.copy_(torch.randn(4096, device="cuda"))
    graph.replay()
    torch.testing.assert_close(y, x * 2.0 + 3)


@triton.jit
def _scale_tiles_kernel(X_DESC, Y, n_cols, a, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = a * x, x read through a host-made TMA descriptor in (BLOCK_M, BLOCK_N) tiles."""
    row = tl.program_id(0) * BLOCK_M
    x = X_DESC.load([row, 0])
    rows = row + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], x * a)


def test_bound_launch_takes_the_tensor_a_descriptor_describes(device):
    # a host-made descriptor's place takes, per call, the tensor to describe; on the GPU each
    # address's descriptor is encoded once and reused (`_host_descriptors`): a later call
    # at a seen address, with new contents, and one at a new address both read right
    from triton.tools.tensor_descriptor import TensorDescriptor

    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("host-made TMA descriptors need sm_90")
    x = torch.randn(64, 32, device=device) + 0.5
    y = torch.empty_like(x)
    desc = TensorDescriptor.from_tensor(x, [16, 32])
    bound = launcher(_scale_tiles_kernel).bind((4,), desc, y, 32, 3.0, BLOCK_M=16, BLOCK_N=32)
    torch.testing.assert_close(y, 3.0 * x)
    pair = [torch.randn_like(x) for _ in range(2)]
    for step in range(5):
        x2 = pair[step % 2]
        x2.add_(1.0)  # new contents at an address seen before
        y2 = torch.empty_like(x)
        bound(x2, y2)
        torch.testing.assert_close(y2, 3.0 * x2)
    assert not _tensors_held(bound)
    if device == "cuda" and triton.__version__.startswith("3.6"):
        # the Triton on the H200: its launcher has the form `_host_descriptors` knows
        assert bound.encodes_descriptors


class _StandInLauncher:
    """What `_host_descriptors` reads of a compiled kernel's launcher in Triton 3.6: `launch`,
    the Python step over the C launcher (its closure names them), and the launch flags."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, c_launcher, positions: set, metas: list) -> None:
        def wrapper(launcher, tensordesc_indices, tensordesc_meta):
            def inner(*args):  # Triton's own step: the direct path never calls it
                raise AssertionError((launcher, tensordesc_indices, tensordesc_meta))

            return inner

        # the C launcher itself for a kernel without descriptors, as 3.6 keeps it
        self.launch = wrapper(c_launcher, positions, metas) if positions else c_launcher

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # 3.6's signature
        raise AssertionError("the direct paths call the C launcher")


class _CLauncher:
    """A stand-in of the generated C launcher (not a Python function): records its calls."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_plain_launch_finds_the_c_launcher(monkeypatch):
    # a kernel without descriptors: `plain_launch` hands back 3.6's C launcher and the launch
    # flags, and None for any other form (a Python step in `launch`, scratch memory, another
    # argument protocol, another `__call__` signature)
    from triton.backends.nvidia import driver as nvidia

    from triton_transformer._host_descriptors import plain_launch

    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT_LEN", 13, raising=False)
    c_launcher = _CLauncher()
    run = _StandInLauncher(c_launcher, set(), [])
    run.launch_pdl = True
    assert plain_launch(run) == (c_launcher, False, True)
    assert plain_launch(_StandInLauncher(c_launcher, {1}, [None])) is None  # Python step
    scratch = _StandInLauncher(c_launcher, set(), [])
    scratch.profile_scratch_size = 64
    assert plain_launch(scratch) is None

    class Newer(_StandInLauncher):
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, *args):
            raise AssertionError

    assert plain_launch(Newer(c_launcher, set(), [])) is None
    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT_LEN", 14)
    assert plain_launch(run) is None


def test_descriptor_launch_expands_each_address_once(monkeypatch):
    # the direct path against a stand-in of Triton 3.6's launcher (CPU: the real one runs on
    # the GPU tests): the C launcher gets the arguments in signature order, each descriptor
    # expanded by Triton's `make_tensordesc_arg`, called once per address where it encodes
    # (metadata given) and at every call where it passes the tensor itself (no metadata)
    from triton.backends.nvidia import driver as nvidia
    from triton.tools.tensor_descriptor import TensorDescriptor

    from triton_transformer import _host_descriptors

    expanded = []

    def make_arg(desc, meta):
        expanded.append((desc.base.data_ptr(), meta is None))
        if meta is None:
            return [desc.base, *desc.shape]
        return [("map", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia, "make_tensordesc_arg", make_arg)
    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT_LEN", 13, raising=False)
    monkeypatch.setattr(_host_descriptors, "MAX_ADDRESSES", 2)
    calls = []
    run = _StandInLauncher(lambda *a: calls.append(a), {1, 3}, [{"swizzle": 128}, None])

    def desc(t):
        return TensorDescriptor.from_tensor(t, [4, 8])

    first = [torch.zeros(16, 8) for _ in range(4)]
    args = (first[0], desc(first[1]), 7, desc(first[2]), first[3])
    launch = _host_descriptors.descriptor_launch(run, args, [5, "C"], [0, 1, 3, 4])
    assert launch is not None

    u, a, b, w = (torch.zeros(16, 8) for _ in range(4))
    launch(1, 2, 3, "stream", "fn", "meta", (u, a, b, w))
    want = [
        1, 2, 3, "stream", "fn", False, False, None, None, "meta", None, None, None,
        u, ("map", a.data_ptr(), 128), 16, 8, 8, 1, 7, b, 16, 8, w, 5, "C",
    ]  # fmt: skip
    (got,) = calls
    assert len(got) == len(want)
    for g, x in zip(got, want, strict=True):
        assert g is x if isinstance(x, torch.Tensor) else g == x
    assert sorted(expanded) == sorted([(a.data_ptr(), False), (b.data_ptr(), True)])

    # a seen address: no new encoding for the descriptor with metadata
    expanded.clear()
    launch(1, 2, 3, "stream", "fn", "meta", (u, a, b, w))
    assert expanded == [(b.data_ptr(), True)]
    # at most MAX_ADDRESSES kept: a, a2, then a3 starts the dict again, so a is new once more
    a2, a3 = torch.zeros(16, 8), torch.zeros(16, 8)
    for t in (a2, a3, a):
        launch(1, 2, 3, "stream", "fn", "meta", (u, t, b, w))
    assert [p for p, plain in expanded if not plain] == [a2.data_ptr(), a3.data_ptr(), a.data_ptr()]
    assert calls[-1][14] == ("map", a.data_ptr(), 128)

    # anything else: None, and the bound launch takes Triton's launcher
    other = _StandInLauncher(lambda *a: None, {1}, [{"swizzle": 128}])  # not args' descriptors
    assert _host_descriptors.descriptor_launch(other, args, [5, "C"], [0, 1, 3, 4]) is None
    scratch = _StandInLauncher(lambda *a: None, {1, 3}, [{"swizzle": 128}, None])
    scratch.global_scratch_size = 128
    assert _host_descriptors.descriptor_launch(scratch, args, [5, "C"], [0, 1, 3, 4]) is None
    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT_LEN", 14)  # another launcher protocol
    assert _host_descriptors.descriptor_launch(run, args, [5, "C"], [0, 1, 3, 4]) is None


def test_descriptor_launch_keeps_whole_calls_by_address(monkeypatch):
    # every descriptor encoded (metadata given), every per-call argument a tensor: a call at
    # addresses seen before reuses its whole argument list, plain tensors as their addresses
    # (the list holds no tensor), no encoding at all; any new address builds a new list
    import gc
    import weakref

    from triton.backends.nvidia import driver as nvidia
    from triton.tools.tensor_descriptor import TensorDescriptor

    from triton_transformer import _host_descriptors

    expanded = []

    def make_arg(desc, meta):
        expanded.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia, "make_tensordesc_arg", make_arg)
    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT_LEN", 13, raising=False)
    calls = []
    run = _StandInLauncher(lambda *a: calls.append(a), {1}, [{"swizzle": 64}])
    t0, t1, t2 = (torch.zeros(16, 8) for _ in range(3))
    args = (t0, TensorDescriptor.from_tensor(t1, [4, 8]), 7, t2)
    launch = _host_descriptors.descriptor_launch(run, args, ["C"], [0, 1, 3])

    u, a, w = (torch.zeros(16, 8) for _ in range(3))
    for _ in range(3):
        launch(1, 1, 1, "stream", "fn", "meta", (u, a, w))
    want = [u.data_ptr(), ("map", a.data_ptr(), 64), 16, 8, 8, 1, 7, w.data_ptr(), "C"]
    assert all(list(c[13:]) == want for c in calls) and len(calls) == 3
    assert expanded == [a.data_ptr()]  # encoded once
    w2 = torch.zeros(16, 8)
    launch(1, 1, 1, "stream", "fn", "meta", (u, a, w2))  # a new address: a new list
    assert calls[-1][-2] == w2.data_ptr() and expanded == [a.data_ptr()]
    held = [weakref.ref(t) for t in (u, a, w, w2)]
    del u, a, w, w2
    gc.collect()
    assert all(r() is None for r in held)  # the kept lists hold addresses, not tensors
