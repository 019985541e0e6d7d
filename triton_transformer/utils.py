"""Small helpers shared by every op: defaults, launch heuristics, input validation and
autograd glue."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.autograd import forward_ad

from triton_transformer._host_descriptors import (
    descriptor_launch,
    descriptor_template,
    is_descriptor,
    plain_launch,
    rebased,
)

T = TypeVar("T")
R = TypeVar("R")

# What torch.compile, export and AOTAutograd hand an op while tracing it.
_TRACED = (FakeTensor, FunctionalTensor)

# dtypes the Triton kernels accept; they compute in float32 whatever the storage type.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def exists(val: Any) -> bool:
    return val is not None


def default(val: T | None, d: T) -> T:
    return val if val is not None else d


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints, in plain Python.

    Host code uses this, not `triton.cdiv`: that is a ConstexprFunction in newer Triton and
    costs microseconds per call.
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), in plain Python (see `cdiv`)."""
    return 1 << (max(n, 1) - 1).bit_length()


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached): launch heuristics size grids by it."""
    return torch.cuda.get_device_properties(device).multi_processor_count


# Seeds are drawn in [0, SEED_BOUND): Triton passes such an int as an int32 argument, so a
# host seed never changes a kernel's signature.
SEED_BOUND = 2**31 - 1
_MASK64 = 2**64 - 1
_HOST_SEED_LOCK = threading.Lock()


def draw_seed(device: torch.device | str) -> torch.Tensor:
    """A Philox seed for one dropout mask: a 0-dim int64 tensor on `device`, in [0, SEED_BOUND).

    Drawn from torch's generator of that device (CUDA's for CUDA tensors), never read on the
    host: kernels `tl.load` it. So a captured CUDA graph draws a fresh seed on every replay,
    `torch.manual_seed` makes runs reproducible, and torch.compile sees no `.item()`. Ops save
    the tensor for backward, which regenerates the same mask from it.
    """
    return torch.randint(0, SEED_BOUND, (), device=device, dtype=torch.int64)


def check_dropout_p(p: object) -> float:
    """`p` as a float in [0, 1): the drop probability of an op whose kernels scale by
    1 / (1 - p). Raises TypeError for a non-number (bool included), ValueError otherwise."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {p!r}")
    p = float(p)
    if not 0.0 <= p < 1.0:  # also rejects NaN (math.isnan would graph-break under Dynamo)
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return p


def dropout_threshold(p: float) -> int:
    """The 16-bit threshold of the dropout kernels (`dropout.py`'s and
    `_jit_helpers.dropout_keep_tile`): an element drops when its
    uniform r in [0, 2**16) is below it, i.e. with probability p rounded to a multiple of
    2**-16 (off by at most 2**-17; kept values are still scaled by exactly 1 / (1 - p))."""
    return round(p * 2**16)


def draw_seeds(device: torch.device | str, count: int) -> torch.Tensor:
    """`count` seeds as one (count,) tensor, with one launch: `seeds[i]` (a 0-dim view) is
    a seed for one op. A model draws all of a forward's dropout seeds this way instead of
    paying one tiny random-number kernel per op."""
    return torch.randint(0, SEED_BOUND, (count,), device=device, dtype=torch.int64)


def seed_or_draw(seed: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """`seed` checked (a 0-dim int64 tensor on `device`), or a fresh one from `draw_seed`."""
    if seed is None:
        return draw_seed(device)
    if not isinstance(seed, torch.Tensor) or seed.dim() != 0 or seed.dtype != torch.int64:
        raise TypeError(f"seed must be a 0-dim int64 tensor, got {describe(seed)}")
    if seed.device != device:
        raise ValueError(f"seed is on {seed.device} but the input is on {device}")
    return seed


def host_seed(device: torch.device) -> int | None:
    """A Philox seed for one dropout mask of an eager launch, drawn on the host as F.dropout's
    CUDA kernel takes its own: from the state of torch's generator of `device`, which it
    advances. None during CUDA stream capture, where a replay would reuse a host value: the
    caller then draws a device tensor (`draw_seed`).

    The seed is a function of the generator's (seed, Philox offset), so `torch.manual_seed`
    and `torch.cuda.manual_seed` make it reproducible, and `torch.utils.checkpoint`, which
    restores the generator's state, replays it. Taking it costs no launch and no allocation
    (the device tensor's draw costs both). On the CPU (Triton's interpreter), whose generator
    has no offset, it is drawn from the generator with `torch.randint`."""
    if device.type != "cuda":
        return int(torch.randint(0, SEED_BOUND, ()))
    if torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    # two of these calls must not read one offset. torch's own draws lock the generator in
    # C++, which this cannot take: a draw of torch's on another thread between the read and
    # the advance could have its own advance undone (no thread of the package draws there)
    with _HOST_SEED_LOCK:
        offset = generator.get_offset()
        generator.set_offset(offset + 4)  # one Philox call's worth, as torch's draws advance
    # SplitMix64's output function at state seed + (offset + 1)·γ: distinct offsets give
    # unrelated 31-bit keys
    z = (generator.initial_seed() + (offset + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % SEED_BOUND


def describe(t: object) -> str:
    """What an argument is, for error messages: a tensor's dtype and shape, else its type."""
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


# Whether this torch was built with CUDA (a CPU build has no stream to capture).
_CUDA_BUILT = torch.backends.cuda.is_built()


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph: False on a CPU build and in
    a process that has not initialised CUDA (no capture can run there; asking would raise on
    a CUDA build without a usable GPU, e.g. with CUDA_VISIBLE_DEVICES=""). Not behind
    `torch.cuda.is_available()`, which reads an environment variable and counts the devices
    on every call (a few µs on the H200's host, in every checked eager call)."""
    return _CUDA_BUILT and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_not_capturing(what: str) -> None:
    """Raise if a CUDA graph is being captured: `what` needs a host value that a replay
    would silently reuse (a stale seed, a checked flag)."""
    if stream_capturing():
        raise RuntimeError(
            f"{what} reads a value on the host, which a CUDA graph would replay stale; "
            "it cannot run during stream capture"
        )


def empty_scalar(device: torch.device) -> torch.Tensor:
    """A 0-d fp32 tensor for a kernel to write, as a view of a 1-element one: inductor lowers
    a 0-d `empty` to a fill kernel of its own, a 1-element one to no kernel (torch 2.11-2.13,
    `empty_strided`'s zeroed ranges make a no-op node only where the tensor has a dim)."""
    return torch.empty(1, dtype=torch.float32, device=device).view(())


def opaque_op(name: str, impl: Callable[..., Any], mutates_args: tuple[str, ...] = ()) -> Any:
    """`impl` registered as the custom op triton_transformer::`name`_opaque, for traced code to
    call where an eager call launches what inductor cannot (a Gluon kernel, a register cap):
    inductor calls it as it is, with tensors of the strides it traced (`needs_exact_strides`;
    older torch: their traced stride order). Register its fake implementation on the result."""
    tag = getattr(torch.Tag, "needs_exact_strides", None) or torch.Tag.needs_fixed_stride_order
    return torch.library.custom_op(
        f"triton_transformer::{name}_opaque", mutates_args=mutates_args, tags=(tag,)
    )(impl)


def first_order_only(op_name: str) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorate the backward of a Triton op (a `register_autograd` backward or an
    autograd.Function's) whose kernels are not differentiable: a backward that runs with
    create_graph=True raises a RuntimeError naming `op_name` instead of returning gradients
    that silently lack their second-order terms.

    Why not `torch.autograd.function.once_differentiable`: it runs the backward under no_grad
    and, only when an incoming gradient requires grad, routes the outputs through an error
    node whose inputs are *detached* copies of them. That node has no edge into the graph,
    so `torch.autograd.grad(..., inputs=x)`, which runs only nodes on a path to x, prunes it:
    the second derivative comes back without the terms through this op (44-90% off the
    PyTorch reference in the issue's `f(x).sum() * (x ** 2).sum()` pattern), no error. And
    when only the saved inputs require grad (a constant upstream gradient), the result has
    no grad_fn at all and is silently treated as a constant. torch.library's
    `register_autograd` just calls the function, so nothing there catches it either.

    The engine runs a backward with grad mode on exactly when create_graph=True, and this
    node only exists because an input required grad, so grad mode alone says a
    higher-order graph is being asked for: raise at once (a plain backward pays one
    `torch.is_grad_enabled()`). Not while torch.compile / export traces the backward
    (AOTAutograd's joint trace runs it with grad mode off in torch 2.13, but need not; a
    compiled graph's own backward refuses create_graph=True at run time) nor on fake
    tensors: the backward then runs under no_grad, as once_differentiable ran it.
    """

    def decorate(backward: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(backward)
        def wrapper(ctx: Any, *grads: Any) -> R:
            if not torch.is_grad_enabled():  # the plain backward: create_graph=False
                return backward(ctx, *grads)
            if not tracing(*grads):
                raise RuntimeError(
                    f"{op_name}: the Triton backward is first-order only, but it was asked "
                    "for a differentiable gradient (create_graph=True, i.e. a double "
                    "backward or higher-order gradients); pass use_triton=False for "
                    "higher-order gradients"
                )
            with torch.no_grad():
                return backward(ctx, *grads)

        return wrapper

    return decorate


def tracing(*tensors: object) -> bool:
    """True while torch.compile or export traces, or when `tensors` are traced ones: fake or
    functional tensors (AOTAutograd's joint trace of a backward, make_fx under a FakeTensorMode).
    Dynamo's own tensors are not fake to `is_traced`, hence is_compiling as well."""
    return torch.compiler.is_compiling() or any(is_traced(t) for t in tensors)


def is_traced(t: object) -> bool:
    """Whether `t` is a tensor torch.compile, export or AOTAutograd hands an op while tracing
    it (fake or functional), not one holding data."""
    return isinstance(t, _TRACED)


def refuse_second_backward(ctx: Any, message: str) -> None:
    """For a backward that scales its saved buffers in place: raise `message` on a second
    backward through the same graph (retain_graph reuse), which would scale them twice. Not
    while torch.compile traces the backward (the compiled graph is not rerun that way)."""
    if torch.compiler.is_compiling():
        return
    if getattr(ctx, "backward_done", False):
        raise RuntimeError(message)
    ctx.backward_done = True


def call_op(op: Any, *args: Any) -> Any:
    """Call `op`, a `torch.library` triton_op, through the dispatcher only when that is needed.

    Under torch.compile the registered op runs (Dynamo traces it; autograd uses its
    registered backward). Eagerly the dispatcher is skipped: a call that records no autograd
    (inference: generation, evaluation) runs the op's Python implementation directly, and one
    that does runs it inside `_eager_function(op)`, an autograd.Function made of the same
    implementation, setup_context and backward. Same kernels, same saved tensors; what it
    saves is torch.library's custom-op dispatch and autograd registration: on an H200 host
    a layernorm forward + backward went from 985 to 637 µs of host time, a linear from 1129
    to 867 (`benchmarks/bench_overhead.py`; PyTorch's own: 269 and 318).
    """
    if torch.compiler.is_compiling() or _first_tensor_traced(args):
        return op(*args)  # the registered op, which tracing records as one node
    if forward_ad_active():
        refuse_tangents(op._name, args)
    impl = _eager_impl(op)
    if impl is None:
        return op(*args)
    records_grad = torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )
    if not records_grad:
        return impl(*args)
    eager = _eager_function(op)
    if eager is None:
        return op(*args)
    function, defaults = eager
    if len(args) < len(defaults):  # setup_context and backward see every input, as torch's
        args = (*args, *defaults[len(args) :])
    return function.apply(*args)


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (`torch.autograd.forward_ad.dual_level`), so
    that tensors may carry tangents. One module attribute read: cheap enough for every call."""
    return forward_ad._current_level >= 0


def refuse_tangents(op_name: str, args: tuple) -> None:
    """Raise if a tensor among `args` carries a forward-mode tangent. The Triton kernels have
    no forward-mode derivative, and a call that records no backward (a dual tensor need not
    require grad) would otherwise run them on the primal and return a result without a
    tangent: a silent zero JVP. (Under `torch.func.jvp` and with inputs that require grad,
    autograd.Function's missing jvp raises on its own.)"""
    for a in args:
        if isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None:
            raise RuntimeError(
                f"{op_name}: the Triton kernels have no forward-mode derivative, but an "
                "input carries a tangent (torch.autograd.forward_ad); pass use_triton=False "
                "for forward-mode AD"
            )


def eager_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """`function.apply` for the ops' eager plans, without its Python prologue.

    `Function.apply` is a Python classmethod that, before the C++ `_FunctionBase.apply`,
    builds a closure, looks up `setup_context`, asks whether functorch transforms (vmap,
    grad, ...) are active and, when not, unwraps the functorch wrappers of tensors that
    outlived their transform ("dead" wrappers) from the arguments: 2.8 µs per call on the
    CPU host (8.5 against 5.7 µs for an empty Function), a tenth of a plan's forward on the
    H200's. The returned function makes the C++ call itself while no transform is active,
    else defers to `function.apply` (always, for a function that defines setup_context). It
    skips the dead-wrapper pass: a plan is only found for tensors with storage
    (`eager_plan_key` reads data_ptr, which a functorch wrapper has not), so a wrapper never
    reaches a plan."""
    _call_backward_directly(function)
    if function.setup_context is not torch.autograd.Function.setup_context:
        return function.apply  # (its prologue binds the defaults setup_context sees)
    c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
    transforms_active = torch._C._are_functorch_transforms_active

    def apply(*args: Any) -> Any:
        if transforms_active():
            return function.apply(*args)
        return c_apply(*args)

    return apply


def _call_backward_directly(function: type[torch.autograd.Function]) -> None:
    """Have autograd's engine call `function.backward` itself for the nodes `function` makes.

    The engine runs a Python node through its context's `apply` method, which torch's
    `BackwardCFunction` defines in Python: it looks up backward and vjp on the Function,
    refuses a Function defining both, and asks the class for `boxed_grads_call` before
    calling backward (0.31 against 0.14 µs per backward on the CPU host, per op and
    backward). For a Function that defines backward alone and not that flag, as the ops'
    eager Functions do, those checks always pass, so the context's class gets an `apply`
    that calls backward at once. Elsewhere (vjp, boxed gradients) torch's stays."""
    backward_cls = getattr(function, "_backward_cls", None)
    plain = (
        backward_cls is not None
        and function.vjp is torch.autograd.Function.vjp
        and not getattr(function, "boxed_grads_call", False)
    )
    if plain:
        backward = function.backward

        def apply(ctx: Any, *grads: Any) -> Any:
            return backward(ctx, *grads)

        backward_cls.apply = apply


def _first_tensor_traced(args: tuple) -> bool:
    """Whether the first tensor among `args` is a traced one: tracing (fake or functional
    tensors) hands an op nothing but traced tensors, so one look is enough."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return is_traced(a)
    return False


@functools.cache
def _eager_impl(op: Any) -> Callable[..., Any] | None:
    """The function `op` was made from, to call without the dispatcher; None where the
    dispatcher must run (an op that mutates an input) or the function cannot be found.

    torch's `triton_op` keeps `backend_fn`, a wrapper that turns `wrap_triton` off around
    the function (a context manager per call); the ops here launch through `launcher`,
    which decides by the tensors it is given, so the function inside is called directly.
    """
    wrapped = getattr(op, "_init_fn", None)  # torch's CustomOpDef keeps the registered one
    # the dispatcher bumps a mutated input's version (not needed for a `.grad` accumulator)
    if wrapped is None or (_mutates(op) and op not in _GRAD_ACCUMULATING):
        return None
    code, cells = wrapped.__code__, wrapped.__closure__ or ()
    inner = dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=True))
    fn = inner.get("fn")
    return fn if callable(fn) and wrapped.__name__ == "backend_fn" else wrapped


# Ops whose only mutated arguments are parameters' `.grad` tensors that a backward adds into
# (`bmm.grad_targets`): nothing else holds those tensors (`bmm._foldable` checks it eagerly),
# so an eager call may skip the dispatcher and its version bump like any other op's.
_GRAD_ACCUMULATING: set = set()


def accumulates_grads(op: Any) -> Any:
    """Register `op` (a triton_op) as mutating only `.grad` accumulators; returns it."""
    _GRAD_ACCUMULATING.add(op)
    return op


@functools.cache
def _mutates(op: Any) -> bool:
    """Whether `op` writes one of its inputs (`mutates_args`): such calls keep the
    dispatcher, whose version-counter bump lets autograd catch a node that saved the
    overwritten tensor."""
    return any(
        a.alias_info is not None and a.alias_info.is_write for a in op._opoverload._schema.arguments
    )


@functools.cache
def _eager_function(op: Any) -> tuple[type[torch.autograd.Function], tuple] | None:
    """An autograd.Function running `op`'s implementation forward and its registered
    `setup_context` / backward, and the defaults of the op's parameters (None if it has no
    registered autograd). One class per op, so that `ctx.needs_input_grad` lines up with the
    op's own inputs."""
    setup = getattr(op, "_setup_context_fn", None)
    backward = getattr(op, "_backward_fn", None)
    if setup is None or backward is None:
        return None
    impl = _eager_impl(op)
    # the op's own defaults, from its schema: setup_context and backward see every input
    schema = op._opoverload._schema
    defaults = tuple(a.default_value if a.has_default_value() else None for a in schema.arguments)

    def forward(ctx: Any, *args: Any) -> Any:
        out = impl(*args)
        setup(ctx, args, out)
        return out

    def run_backward(ctx: Any, *grads: Any) -> Any:
        grad_inputs = backward(ctx, *grads)
        return grad_inputs if isinstance(grad_inputs, tuple) else (grad_inputs,)

    name = f"Eager_{getattr(op, '_name', 'op').replace('::', '_')}"
    function = type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(run_backward)},
    )
    return function, defaults


def calc_num_warps(block_size: int) -> int:
    """Warps for a row kernel whose block holds `block_size` elements.

    4 warps below 2048 elements, 8 from 2048, 16 from 4096 (lucidrains' heuristic).
    """
    num_warps = 4
    if block_size >= 2048:
        num_warps = 8
    if block_size >= 4096:
        num_warps = 16
    return num_warps


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Triton reads the variable when a kernel is decorated, so it must be set before
    `triton_transformer` is imported. Ops read it only off their hot path (e.g. for a tensor
    that is not on CUDA), or once per cached launch configuration.
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false")


def widened_for_interpreter(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The kernels' input tensors as Triton's interpreter must get them: it has no bf16
    arithmetic (and rounds conversions to bf16 by truncation), so bf16 inputs are passed as
    fp32 copies there and the kernel runs its fp32 path; the kernels themselves carry no
    interpreter flag. None passes through. Call only where `interpreter_enabled()`: compiled
    launches take the tensors as they are."""
    return tuple(t.float() if t is not None and t.dtype == torch.bfloat16 else t for t in tensors)


@functools.cache
def row_block_size(n_cols: int, max_block: int) -> int:
    """Power-of-two block for rows of `n_cols` elements, capped at `max_block`.

    Rows longer than the cap are processed in a loop over blocks.
    """
    return min(max_block, max(16, next_power_of_2(n_cols)))


@functools.cache
def row_launch_params(
    n_cols: int,
    max_block: int,
    row_tile: int,
    num_warps: int | None,
    loop_num_warps: int | None = None,
) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps) of a row kernel (softmax, cross-entropy) for
    rows of n_cols entries. Rows that fit one block are packed BLOCK_M to a program (about
    row_tile elements); longer rows get a program each and loop over blocks.

    num_warps None picks `calc_num_warps` of the tile, or, for a looping kernel,
    loop_num_warps when that is given."""
    block_n = row_block_size(n_cols, max_block)
    single_pass = n_cols <= block_n
    block_m = max(1, row_tile // block_n) if single_pass else 1
    if num_warps is None:
        if single_pass or loop_num_warps is None:
            num_warps = calc_num_warps(block_m * block_n)
        else:
            num_warps = loop_num_warps
    return block_m, block_n, single_pass, num_warps


def check_triton_tensor(x: Any, name: str) -> None:
    """Raise a clear error if `x` cannot be handed to a Triton kernel.

    Checks the type, the dtype (float32/float16/bfloat16) and the device (CUDA, or any
    device when Triton's CPU interpreter is on).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in TRITON_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; the Triton kernels take float32, float16 or "
            "bfloat16. Cast it, or pass use_triton=False for the PyTorch reference."
        )
    if x.device.type != "cuda" and not interpreter_enabled():
        raise ValueError(
            f"{name} is on device '{x.device}', but Triton kernels need a CUDA tensor. "
            "To run them on the CPU, set TRITON_INTERPRET=1 in the environment before "
            "importing triton_transformer (slow), or pass use_triton=False."
        )


def shares_address(*pairs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether each (view, tensor) pair has one address: the view a launch was bound with
    (`as_rows`, a flattening) was made without a copy. A later call of the same layout (an
    eager plan's key) then makes its views without copies too, and its bound launch, which
    reads each tensor's address alone, can take the tensors themselves, sparing the views'
    host time."""
    return all(view.data_ptr() == t.data_ptr() for view, t in pairs)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View `x` of shape (..., N) as a 2-D (rows, N) tensor whose last dim is unit-stride.

    Copies only when no such view exists (e.g. a transposed input). An empty x gives an empty
    (rows, N) tensor (reshape(-1, 0) would be ambiguous), for ops that then launch nothing.
    """
    if x.numel() == 0:
        return x.new_empty((math.prod(x.shape[:-1]), x.shape[-1]))
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


# Launching a kernel eagerly, at a fraction of Triton's host cost.
#
# `kernel[grid](*args, **kwargs)` makes Triton bind every argument against the kernel's
# signature, derive its specialisation (dtypes, 16-byte alignment, ints equal to 1 or
# divisible by 16, int32/int64 range), hash that into a cache key and look the compiled
# kernel up: about 12 µs of Python per launch on an H100 host, on top of the ~9 µs the
# compiled launcher itself takes. A model step launches ~100 kernels eagerly.
# `launcher(kernel)[grid](...)` keys its own cache on the same facts, computed in one pass
# over the arguments, and calls the compiled kernel's launcher directly with the arguments
# in signature order (constexprs included, which is what Triton passes it). A miss, and
# anything it cannot key exactly (a callable grid, a tensor passed by keyword, launch hooks
# such as a profiler's, Triton's interpreter), takes Triton's own
# path; traced tensors (torch.compile, export) take `wrap_triton`, which records the launch.
# Not seen by the cache: Triton's debug and instrumentation knobs toggled after a kernel's
# first launch, and `pre_run_hooks` (the project sets neither).

_KEYABLE = (int, float, bool, str, type(None))


def _specialization(device: int, args: tuple, kwargs: dict) -> tuple | None:
    """The cache key of a launch: what Triton specialises each positional argument on (a
    tensor's dtype and 16-byte alignment; a float's or bool's type), an int's value (it
    decides Triton's facts: equal to 1, divisible by 16, within int32), then the keyword
    arguments as given. A coarser key would reuse a kernel compiled for other facts; a finer
    one only costs one launch through Triton's path per new value (a training loop repeats
    its shapes). A host-made TMA descriptor is keyed by all it holds but its tensor's address:
    dtype, 16-byte alignment, shape, strides, block, layout and options (padding, tf32
    rounding). None when an argument cannot be keyed."""
    key = [device]
    for a in args:
        t = type(a)
        if t is int:  # the value itself: finer than Triton's facts, and cheaper to take
            key.append(a)
        elif isinstance(a, torch.Tensor):
            key.append(a.dtype)
            key.append(a.data_ptr() % 16 == 0)
        elif t is float or t is bool or a is None:
            key.append(t)
        elif t.__name__ == "TensorDescriptor" and isinstance(a.base, torch.Tensor):
            key.append((
                t, a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
                tuple(a.block_shape), getattr(a, "layout", None), getattr(a, "padding", None),
                getattr(a, "round_f32_to_tf32", None),
            ))  # fmt: skip
        else:
            return None
    # by type too: True, 1 and 1.0 are equal, but a constexpr's type changes the kernel
    key.extend((name, v.__class__, v) for name, v in kwargs.items())
    return tuple(key)


def _no_launch_hooks(runtime: Any) -> bool:
    """Whether no launch hook (a profiler's, Proton's) is set: Triton 3.6+ keeps them in
    HookChains, empty by default; older releases use None. (Unrolled: a bound launch asks
    on every call.)"""
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (
        leave is None or not getattr(leave, "calls", True)
    )


def _device_getter(driver: Any) -> Callable[[], int]:
    """The current device's index as Triton's driver asks for it, for a bound launch: where
    that is `torch.cuda.current_device` (the CUDA driver), torch's C getter itself, which
    skips the Python lazy-initialisation check (three calls, about 1 µs per launch on the
    H200's host): a bound launch only exists after a launch initialised CUDA."""
    get_device = driver.active.get_current_device
    c_getter = getattr(torch._C, "_cuda_getDevice", None)
    if get_device is torch.cuda.current_device and c_getter is not None:
        return c_getter
    return get_device


class KernelLauncher:
    """`launcher(kernel)[grid](*args, **kwargs)`: launches `kernel` as `kernel[grid]` would,
    through a per-specialisation cache of its compiled form (see the comment above)."""

    __slots__ = (
        "compiled", "defaults", "direct", "driver", "kernel", "knobs", "n_keyable", "names",
    )  # fmt: skip

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, tuple] = {}
        params = getattr(kernel, "params", None)
        # Triton's interpreter (CPU tests) runs kernels itself: nothing to cache there
        self.direct = params is not None and not interpreter_enabled() and _has_knobs()
        if self.direct:
            from triton import knobs
            from triton.runtime import driver

            self.names = [p.name for p in params]
            self.defaults = [p.default for p in params]
            # positional arguments up to the first constexpr: `_specialization` keys runtime
            # arguments only (a constexpr passed by position takes Triton's path)
            constexprs = [i for i, p in enumerate(params) if p.is_constexpr]
            self.n_keyable = constexprs[0] if constexprs else len(params)
            self.driver, self.knobs = driver, knobs  # an import per launch costs a µs

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple, *args: Any, **kwargs: Any) -> None:
        if args and is_traced(args[0]):  # torch.compile / export: record the launch
            from torch.library import wrap_triton

            wrap_triton(self.kernel)[grid](*args, **kwargs)
            return
        if not self.direct or type(grid) is not tuple or len(args) > self.n_keyable:
            self.kernel[grid](*args, **kwargs)
            return
        driver = self.driver
        device = driver.active.get_current_device()
        key = _specialization(device, args, kwargs)
        try:
            entry = None if key is None else self.compiled.get(key)
        except TypeError:  # an unhashable keyword value
            key = entry = None
        if entry is None or not _no_launch_hooks(self.knobs.runtime):
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and entry is None and compiled is not None:
                self._remember(key, compiled, len(args), kwargs)
            return
        run, function, metadata, tail, c_launch = entry
        stream = driver.active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        if c_launch is not None:  # Triton 3.6's C launcher (`_host_descriptors.plain_launch`)
            launch, coop, pdl = c_launch
            launch(grid[0], g1, g2, stream, function, coop, pdl, None, None, metadata, None,
                   None, None, *args, *tail)  # fmt: skip
        else:
            run(grid[0], g1, g2, stream, function, metadata, None, None, None, *args, *tail)

    def bind(self, grid: tuple, *args: Any, **kwargs: Any) -> Callable[..., None]:
        """Launch once as `self[grid](*args, **kwargs)`, then return a launch of the same
        kernel whose tensor arguments are given per call: `bound(*tensors)` launches with
        those tensors, in the places and order the tensors of `args` take, the rest of `args`
        and `kwargs` as bound here, and no key computed. A host-made TMA descriptor's place
        takes the tensor it describes (of the bound one's shape, strides, dtype and 16-byte
        alignment); each address's descriptor is encoded once (`_host_descriptors`). For a
        caller that keys its own cache of bound launches on every fact the kernel's
        specialisation reads from the tensors (dtype, 16-byte alignment), so a hit is the
        same specialisation (the ops' `LaunchPlans`: `layernorm._PLANS`, attention's
        `_FWD_PLANS` / `_BWD_PLANS`, ...): per call it saves the key's pass over every
        argument. The bound launch holds none of this call's tensors. A `PerCall` scalar
        takes its place among the per-call arguments as a tensor does.
        Where the direct path cannot run (Triton's interpreter, an argument it cannot key,
        launch hooks set at the call), it launches as `self[grid]` does."""
        slots = [i for i, a in enumerate(args) if _per_call(a)]
        scalars = [i for i, a in enumerate(args) if type(a) is PerCall]
        if scalars:
            args = tuple([a.value if type(a) is PerCall else a for a in args])
        n_lead = len(slots) if slots == list(range(len(slots))) else 0
        fixed = args[n_lead:] if n_lead else ()  # (held: never one of this call's tensors)
        if n_lead:  # the common layout, tensors first: no argument list to fill per call

            def place(tensors: tuple) -> tuple:
                return (*tensors, *fixed)
        else:  # a tensor after a scalar (a seed after the sizes): filled into its slot
            template = [None if i in slots else a for i, a in enumerate(args)]

            def place(tensors: tuple) -> tuple:
                full = template.copy()
                for i, t in zip(slots, tensors, strict=True):
                    full[i] = t
                return tuple(full)

        # each descriptor's template, by its place among the per-call arguments
        descs = [
            (n, descriptor_template(args[i])) for n, i in enumerate(slots) if is_descriptor(args[i])
        ]
        if descs:  # Triton's path takes descriptors: the tensors wrapped per call
            place_tensors = place

            def place(tensors: tuple) -> tuple:
                wrapped = list(tensors)
                for n, desc in descs:
                    wrapped[n] = rebased(desc, wrapped[n])
                return place_tensors(wrapped)

        # With a per-call scalar, Triton's own launch: `launch` keys an int by its value, so
        # each value would file a cache entry of its own; the compiled kernel is filed below
        # under a stand-in value (the parameter is not specialised on: one kernel serves all)
        unbound = self.kernel[grid] if scalars else functools.partial(self.launch, grid)
        compiled = unbound(*args, **kwargs)  # (`launch` returns None)
        entry = None
        if (
            self.direct and type(grid) is tuple and args and len(args) <= self.n_keyable
            and not is_traced(args[0])  # traced: `launch` recorded it, nothing to bind
        ):  # fmt: skip
            device = self.driver.active.get_current_device()
            keyed = tuple([0 if i in scalars else a for i, a in enumerate(args)])
            key = _specialization(device, keyed, kwargs)
            entry = None if key is None else self.compiled.get(key)
            if entry is None and compiled is not None and key is not None:
                self._remember(key, compiled, len(args), kwargs)
                entry = self.compiled.get(key)

        def relaunch(tensors: tuple) -> None:
            unbound(*place(tensors), **kwargs)

        if entry is None:
            return lambda *tensors: relaunch(tensors)
        run, function, metadata, tail, plain = entry
        g0, g1, g2 = (*grid, 1, 1)[:3]
        runtime = self.knobs.runtime
        # torch's current device and stream, looked up once here (through the driver's lazy
        # proxy each attribute costs a Python step)
        get_device = _device_getter(self.driver)
        get_stream = self.driver.active.get_current_stream
        raw = descriptor_launch(run, args, tail, slots) if descs else None
        c_launch, coop, pdl = (None, None, None) if descs or plain is None else plain

        def bound(*tensors: Any) -> None:
            current = get_device()
            # a profiler's hooks (Triton's path calls them), or another device (the function
            # handle is the bound device's): the keyed launch
            if current != device or not _no_launch_hooks(runtime):
                relaunch(tensors)
                return
            stream = get_stream(current)
            if raw is not None:
                raw(g0, g1, g2, stream, function, metadata, tensors)
            elif c_launch is not None and n_lead:  # Triton 3.6's C launcher, tensors first
                c_launch(g0, g1, g2, stream, function, coop, pdl, None, None, metadata, None,
                         None, None, *tensors, *fixed, *tail)  # fmt: skip
            elif c_launch is not None:
                c_launch(g0, g1, g2, stream, function, coop, pdl, None, None, metadata, None,
                         None, None, *place(tensors), *tail)  # fmt: skip
            elif n_lead and not descs:
                run(g0, g1, g2, stream, function, metadata, None, None, None, *tensors, *fixed,
                    *tail)  # fmt: skip
            else:
                run(g0, g1, g2, stream, function, metadata, None, None, None, *place(tensors),
                    *tail)  # fmt: skip

        bound.encodes_descriptors = raw is not None  # (tests)
        bound.calls_c_launcher = raw is not None or c_launch is not None  # (tests)
        return bound

    def _remember(self, key: tuple, compiled: Any, n_args: int, kwargs: dict) -> None:
        """Cache what a hit needs: the launcher, the function handle, the metadata, the
        parameters after the positional ones in signature order (keywords or defaults: all
        of them part of the key, so fixed for it), and the C launcher where Triton 3.6's can
        be called directly (`_host_descriptors.plain_launch`: a kernel without host-made
        descriptors; None otherwise)."""
        if any(isinstance(v, torch.Tensor) or not isinstance(v, (*_KEYABLE, _tl_dtype()))
               for v in kwargs.values()):  # fmt: skip
            return
        tail = []
        for name, default in zip(self.names[n_args:], self.defaults[n_args:], strict=True):
            if name in kwargs:
                tail.append(kwargs[name])
            elif default is inspect.Parameter.empty:
                return  # a parameter Triton bound some other way: leave it to Triton
            else:
                tail.append(default)
        run = compiled.run
        self.compiled[key] = (run, compiled.function, compiled.packed_metadata, tail,
                              plain_launch(run))  # fmt: skip


class PerCall:
    """An argument of `KernelLauncher.bind` that the bound launch takes per call, as it takes
    tensors: a scalar that changes from call to call (a host seed, `host_seed`). Its kernel
    parameter must be in the kernel's `do_not_specialize`, since the bound launch runs the
    specialisation compiled for the value bound here with every value."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _per_call(a: Any) -> bool:
    """Whether `bind` takes `a` per call: a tensor, a host-made TMA descriptor (it holds one)
    or a `PerCall` scalar."""
    return isinstance(a, torch.Tensor) or is_descriptor(a) or type(a) is PerCall


@functools.cache
def _tl_dtype() -> type:
    import triton.language as tl

    return tl.dtype


@functools.cache
def _has_knobs() -> bool:
    """Whether this Triton has the launch API the direct path calls (triton >= 3.4)."""
    try:
        from triton import knobs

        return hasattr(knobs.runtime, "launch_enter_hook")
    except ImportError:
        return False


# by id: a JITFunction hashes its source's digest under a lock
_LAUNCHERS: dict[int, KernelLauncher] = {}


# every op's `LaunchPlans`, for `clear_launch_plans`
_ALL_PLANS: list = []


def clear_launch_plans() -> None:
    """Forget every op's bound launches: after a test or benchmark changes what a launch takes
    (a configuration table, a monkeypatched launcher), so the next call of a shape looks it
    up again."""
    for plans in _ALL_PLANS:
        plans.plans.clear()


def tensor_facts(*tensors: torch.Tensor) -> tuple:
    """What a kernel's specialisation reads from these tensors (dtype, 16-byte alignment): the
    tensors' part of the key of an op's cache of bound launches (`LaunchPlans`)."""
    return tuple([(t.dtype, not t.data_ptr() & 15) for t in tensors])


def layout_key(*tensors: torch.Tensor | None) -> tuple:
    """The tensors' part of the key of an op's cache of bound launches (`LaunchPlans`): each
    one's shape and strides (None where absent) and `tensor_facts` of those present."""
    present = [t for t in tensors if t is not None]
    layouts = tuple([None if t is None else (t.shape, t.stride()) for t in tensors])
    return (*layouts, *tensor_facts(*present))


# The tensor types of eager calls: not traced, whatever `is_traced` would say (its isinstance
# against the traced types costs 0.16 µs, a type lookup 0.03).
_PLAIN_TENSORS = frozenset((torch.Tensor, nn.Parameter))


def eager_plan_key(tensors: tuple, scalars: tuple) -> tuple | None:
    """The key of an eager call's plan (each op module's `_EagerPlan`: the norms, dropout,
    cross_entropy, attention, linear, relu2_mlp, rope, ...): the `scalars` as given with
    their types (False == 0 == 0.0 and 2.0 == 2 hash alike, but the checks may refuse a bool
    or a float where they take the number: a plan made by a valid call must not admit
    them), then, per tensor of `tensors`, every fact of it that the op's checks and its
    kernels' specialisation read: shape, strides, dtype, device and the address modulo 16
    (None where absent). A call whose tensors match a validated call's in all of them
    passes the same checks, so a plan hit skips them. None where the call takes the op's
    generic path: traced (Dynamo, or fake or functional tensors), an argument that is not a
    tensor with storage (the op's checks then raise), or inside a forward-mode AD level
    (`call_op` refuses tangents).

    One flat tuple, the facts read inline: one tuple to build, hash and compare instead of
    one per tensor (2.2 against 2.75 µs for layernorm's three tensors on the CPU host, a
    fifth of an eager call's own Python)."""
    first = tensors[0]
    if (
        torch.compiler.is_compiling()
        or forward_ad_active()
        or (type(first) not in _PLAIN_TENSORS and is_traced(first))
    ):
        return None
    key = [*scalars, *map(type, scalars)]
    try:
        for t in tensors:
            if t is None:
                key.append(None)
            else:
                key += (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
    except (AttributeError, TypeError, RuntimeError):
        return None
    return tuple(key)


def has_rows_view(t: torch.Tensor) -> bool:
    """Whether non-empty t (..., N) has an (M, N) view of unit column stride: what the row
    kernels read without a copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows.stride(-1) == 1 and rows.data_ptr() == t.data_ptr()


class LaunchPlans:
    """An op's eager launches bound once per shape: `plans.get(key)` or None, then
    `plans.put(key, plan)` with what `KernelLauncher.bind` returned. The key is the op's to
    make: every launch argument that is not a per-call tensor (sizes, strides, scalars, flags)
    and `tensor_facts` of the tensors. Only for calls on real tensors with int sizes (not
    traced). Cleared when it holds `limit` plans (a loop through ever new shapes, e.g.
    generation without a cache, must not grow it without bound)."""

    __slots__ = ("limit", "plans")

    def __init__(self, limit: int = 512) -> None:
        self.plans: dict[tuple, Any] = {}
        self.limit = limit
        _ALL_PLANS.append(self)

    def get(self, key: tuple) -> Any:
        return self.plans.get(key)

    def find(self, tensors: tuple, scalars: tuple) -> tuple[tuple | None, Any]:
        """(key, plan) of an eager call whose plan is keyed by `eager_plan_key(tensors,
        scalars)`: (None, None) where the call takes the op's generic path, (key, None) where
        its plan is still to be made."""
        key = eager_plan_key(tensors, scalars)
        return key, (None if key is None else self.plans.get(key))

    def put(self, key: tuple, plan: Any) -> Any:
        if len(self.plans) >= self.limit:
            self.plans.clear()
        self.plans[key] = plan
        return plan


def launcher(kernel: Any) -> KernelLauncher:
    """The `KernelLauncher` of a `@triton.jit` kernel (one per kernel, made on first use;
    kernels are module globals, so ids are never reused)."""
    found = _LAUNCHERS.get(id(kernel))
    if found is None:
        found = _LAUNCHERS[id(kernel)] = KernelLauncher(kernel)
    return found


def offsets_in(base: torch.Tensor, *views: torch.Tensor) -> tuple[int, ...]:
    """Each view's element offset into `base`, the tensor it is a view of. A kernel that writes
    several slices of one tensor takes the tensor once plus these offsets: under torch.compile
    a kernel writing into views makes functionalization copy each view out and back, and one
    tensor passed as several mutated arguments is cloned once per argument (the writes to all
    but one clone are lost)."""
    return tuple(int(v.storage_offset() - base.storage_offset()) for v in views)


def tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for device-side TMA descriptors (`tl.make_tensor_descriptor`): pass to
    `triton.set_allocator` before launching a kernel that makes them."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


# Whether torch.compile may trace the kernels that make device-side TMA descriptors (the Hopper
# matmul; attention keeps its pointer loads when traced, see `attention._tma_loads`). True /
# False force it; None (default) asks `_inductor_sets_allocator`. Eager launches set
# `triton.set_allocator(tma_scratch)` themselves; a traced launch is made by inductor's
# generated code, which must do it.
COMPILE_TMA: bool | None = None


@functools.cache
def _inductor_sets_allocator() -> bool:
    """Whether this torch's inductor sets Triton's scratch allocator before it launches a kernel
    (`CachingAutotuner.run` calls `triton.set_allocator`), which kernels making device-side
    tensor descriptors need. Read from its source once: torch has no flag for it."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        return "set_allocator" in inspect.getsource(CachingAutotuner.run)
    except Exception:  # no inductor, or no source to read
        return False


def compile_tma() -> bool:
    """Whether traced (torch.compile) launches may take the TMA-descriptor kernels. The probe
    reads that inductor's launcher sets the allocator, which it does on a kernel's first
    launch; Triton's allocator is per thread, so a compiled graph first run in one thread and
    later in a new one relies on inductor setting it there too (torch 2.11, H200: the compiled
    forward + backward tests of tests/test_bmm.py, whose backward runs on autograd's device
    thread, pass with the traced TMA kernel)."""
    if COMPILE_TMA is not None:
        return COMPILE_TMA
    import triton

    return hasattr(triton, "set_allocator") and _inductor_sets_allocator()
