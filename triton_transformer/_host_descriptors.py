"""Bound launches (`utils.KernelLauncher.bind`) through Triton 3.6's launcher: host-made TMA
descriptors encoded once per address, and the C launcher called directly.

A kernel that takes a host-made `TensorDescriptor` gets a CUtensorMap per descriptor at
each launch, which the CUDA driver encodes from the tensor's address, shape, strides, block
and swizzle (`cuTensorMapEncodeTiled`). Triton's launcher does that in Python for every
descriptor of every launch, after walking the whole argument list: an eager attention
forward + backward at 512 queries takes 13 descriptors. A bound launch knows all but the
address, so `descriptor_launch` encodes each address once and keeps the result: a training
loop's caching allocator hands the same few addresses back step after step, and an address
seen before costs one dict lookup.

This calls Triton's CUDA launcher below its public surface, in the form Triton 3.6 gives
it: `CudaLauncher.launch` wraps the generated C launcher in a Python step that expands each
descriptor with `make_tensordesc_arg`. The expansion itself stays Triton's (its function is
called for each new address). Where that form is not found (another Triton release, a
kernel with scratch memory), `descriptor_launch` returns None and the bound launch goes
through Triton's launcher.

A kernel without descriptors has the C launcher itself as `CudaLauncher.launch`, behind
`CudaLauncher.__call__`'s Python step (scratch checks); `plain_launch` hands a bound launch
that C launcher, under the same condition.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

# encodings kept per descriptor argument, about half a KiB each; past this the dict starts
# again. A model's layers share one plan per layout, so a step cycles through a few
# addresses per layer (each layer's saved activations): 64 covers a few dozen layers.
MAX_ADDRESSES = 64

# what Triton 3.6's launcher passes the C launcher before the kernel's arguments: the grid
# (3), stream, function, cooperative and PDL flags, two scratch buffers, the packed
# metadata, the launch metadata and the two launch hooks
_BASE_ARGS = 13


def is_descriptor(a: Any) -> bool:
    """Whether `a` is a host-made TMA descriptor (Triton's or Gluon's `TensorDescriptor`)."""
    return type(a).__name__ == "TensorDescriptor"


def descriptor_template(desc: Any) -> Any:
    """The host-made TMA descriptor `desc` without its tensor: what a bound launch keeps, to
    pass `rebased` copies per call (the descriptor itself would keep its tensor's memory
    alive as long as the op's plan)."""
    return rebased(desc, None)


def rebased(desc: Any, base: Any) -> Any:
    """A copy of the host-made TMA descriptor `desc` over `base`, a tensor of the shape,
    strides, dtype and 16-byte alignment of the one `desc` was made for, without the
    descriptor's checks (a copy of one that passed them; `copy.copy` costs five times as
    much)."""
    new = object.__new__(type(desc))
    new.__dict__.update(desc.__dict__)
    new.base = base
    return new


def _has_36_form(run: Any) -> bool:
    """Whether the compiled kernel's launcher `run` has Triton 3.6's form (its `__call__`
    takes the grid, stream and function, then passes the rest on: `_BASE_ARGS` before the
    kernel's arguments) and asks for no scratch memory."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return False
    call = getattr(vars(type(run)).get("__call__"), "__code__", None)
    return (
        getattr(nvidia, "_BASE_ARGS_FORMAT_LEN", None) == _BASE_ARGS
        and call is not None
        and call.co_argcount == 6
        and getattr(run, "global_scratch_size", 1) == 0
        and getattr(run, "profile_scratch_size", 1) == 0
    )


def plain_launch(run: Any) -> tuple | None:
    """(C launcher, cooperative-grid flag, PDL flag) of a compiled kernel that takes no
    host-made descriptor, where its launcher `run` has Triton 3.6's form: there `run.launch`
    is the generated C launcher itself, which a bound launch calls as `run(...)` would
    (`_BASE_ARGS` first: the grid, stream, function, the two flags, no scratch, the packed
    metadata, no launch metadata or hooks), skipping its Python step (about a µs: a
    closure and two scratch checks per launch). None elsewhere."""
    launch = getattr(run, "launch", None)
    if launch is None or inspect.isfunction(launch) or not _has_36_form(run):
        return None  # (a Python function: the step that expands descriptors)
    return launch, run.launch_cooperative_grid, run.launch_pdl


def _launcher_parts(run: Any) -> tuple | None:
    """(C launcher, the descriptors' argument positions, their metadata, Triton's
    `make_tensordesc_arg`) of the compiled kernel's launcher `run`, where it has Triton 3.6's
    form; else None."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return None
    make_arg = getattr(nvidia, "make_tensordesc_arg", None)
    wrapper = getattr(run, "launch", None)
    code, closure = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if make_arg is None or code is None or closure is None:
        return None
    try:
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure), strict=True))
    except ValueError:  # an empty cell: not the form known here
        return None
    if (
        not _has_36_form(run)
        or len(inspect.signature(make_arg).parameters) != 2
        or not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys()
    ):
        return None
    positions = sorted(cells["tensordesc_indices"])
    metas = list(cells["tensordesc_meta"])
    if len(metas) != len(positions):
        return None
    return cells["launcher"], positions, metas, make_arg


def descriptor_launch(run: Any, args: tuple, tail: list, slots: list[int]) -> Callable | None:
    """A launch of the compiled kernel whose launcher is `run`, bound to `args` (positional,
    host-made descriptors among them) and `tail` (the parameters after them, in signature
    order): launch(g0, g1, g2, stream, function, metadata, tensors) takes the per-call
    arguments at `slots` of `args`, a tensor in each descriptor's place. None where Triton's
    launcher does not have the form this module knows, or its descriptors are not `args`'s."""
    parts = _launcher_parts(run)
    if parts is None:
        return None
    raw, positions, metas, make_arg = parts
    if positions != [i for i in slots if is_descriptor(args[i])]:
        return None
    fixed = [None if i in slots else a for i, a in enumerate((*args, *tail))]
    # the last descriptor first: an expansion leaves the positions before it where they are
    expand = [
        (i, descriptor_template(args[i]), meta, {})
        for i, meta in reversed(list(zip(positions, metas, strict=True)))
    ]
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    # whole argument lists by the addresses of a call's tensors: where every per-call
    # argument is a tensor and every descriptor is passed encoded (metadata: what a training
    # loop's calls take), a call whose addresses were seen reuses the list it built, with
    # each plain tensor as its address (the C launcher takes an int pointer as it is) and so
    # holding no tensor. An address decides everything a list holds: the plan fixes the
    # shapes, strides and dtypes.
    by_addresses: dict[tuple, list] | None = None
    if all(meta is not None for meta in metas) and all(
        isinstance(args[i], torch.Tensor) or is_descriptor(args[i]) for i in slots
    ):
        by_addresses = {}
    places = {i for i, _, _, _ in expand}

    def expanded(call: list) -> list:
        """`call` with each descriptor's place (a tensor there) expanded to its encoding."""
        for i, desc, meta, encoded in expand:
            t = call[i]
            arg = encoded.get(t.data_ptr())
            if arg is None:
                arg = make_arg(rebased(desc, t), meta)
                # without metadata Triton passes the tensor itself: nothing to keep
                if meta is not None:
                    if len(encoded) >= MAX_ADDRESSES:
                        encoded.clear()
                    encoded[t.data_ptr()] = arg
            call[i : i + 1] = arg
        return call

    def arguments(tensors) -> list:
        call = fixed.copy()
        for i, t in zip(slots, tensors, strict=True):
            call[i] = t
        return expanded(call)

    def addressed(tensors, addresses: tuple) -> list:
        """`arguments` with each plain tensor as its address, kept for `addresses`."""
        call = fixed.copy()
        for i, t, address in zip(slots, tensors, addresses, strict=True):
            call[i] = t if i in places else address
        if len(by_addresses) >= MAX_ADDRESSES:
            by_addresses.clear()
        by_addresses[addresses] = call = expanded(call)
        return call

    def launch(g0, g1, g2, stream, function, metadata, tensors) -> None:
        if by_addresses is None:
            call = arguments(tensors)
        else:
            addresses = tuple([t.data_ptr() for t in tensors])
            call = by_addresses.get(addresses)
            if call is None:
                call = addressed(tensors, addresses)
        raw(g0, g1, g2, stream, function, coop, pdl, None, None, metadata, None, None, None,
            *call)  # fmt: skip

    return launch
