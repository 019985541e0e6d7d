"""Range checks of device data (labels, token ids) that raise without waiting for the GPU.

Checking that every label of a CUDA tensor lies in [0, V) needs a verdict only the GPU can
give, after the kernels queued before it. Reading it at once (`.item()`) makes the host wait
for all of them: 11 µs per call on an H200's host when the GPU is idle, and in a training
loop the host stops running ahead of the GPU at every check, so the GPU then waits for the
host's next launches.

Here the verdict goes to pinned host memory, and nothing waits for it. An eager Triton call
takes a slot of the device's ring (`reserve`: a 0-d fp32 tensor in pinned memory that no
pending check holds, zeroed); its kernels write a bad verdict there through the slot's mapped
device address (no copy, no launch of its own; only a bad one: a store to host memory delays
the end of its kernel by ~30 µs on an H200), or `check_later` copies a device tensor there
without blocking. `defer(ticket, is_bad, error)` then records an event on the current stream.
The next checked call (`poll()`, at the start of every cross_entropy, linear_cross_entropy
and embedding call that checks; not in backwards, which a CUDA graph may be capturing) reads
every slot whose event has completed and, for a verdict that `is_bad` says is bad, raises
what `error()` returns (that may sync: it is the error path), naming it as an earlier
call's. `raise_pending()` waits for every pending verdict and raises the first bad one: call
it where an error must surface at a known point (the end of an epoch, a test). Until then
the call's own output shows the bad input (a NaN loss, NaN rows): nothing is silently wrong.
PyTorch's CUDA ops report bad indices asynchronously too (a device-side assert surfaces at a
later sync, and leaves the CUDA context unusable; this does not).

A pending check holds its call's labels or ids (at most 64 calls' per device) until it
resolves: its error names the first bad value, read then; a kernel-flagged embedding call
whose ids changed in place meanwhile still raises, without naming one, but a loss's verdict
(a NaN loss) cannot tell a bad label from NaN logits, so labels refilled in place before
their check resolves raise nothing (the loss reads NaN; `Transformer` checks a copy).

On the CPU (Triton's interpreter) the slot is a CPU tensor, read at once: the call itself
raises. Under anomaly detection the ops check before launching
(`cross_entropy.check_labels_before`), so the error comes from the call that made it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import torch

__all__ = ["check_later", "defer", "poll", "raise_pending", "reserve"]

# Pending verdicts per device before a new one waits for the oldest (a host running this far
# ahead of its GPU is rare: the launch queue itself holds ~1,000 kernels).
_SLOTS = 64

_LATE = (
    " (found by a later call: this check runs without waiting for the GPU, so the first "
    "checked call after the kernels finished raises it; see triton_transformer.checks)"
)

Error = Callable[[], Exception | None]


class _Ring:
    """One device's verdict slots in pinned host memory, an event per slot and the pending
    checks in order. `events`: one per slot, each with record(stream), query() and
    synchronize() (the tests pass fakes)."""

    __slots__ = ("array", "busy", "device_index", "events", "next", "pending", "slots", "values")

    def __init__(self, events: list, device_index: int | None) -> None:
        pinned = device_index is not None  # (None: the tests' fake events, a CPU build)
        # a row of 16 bytes per slot: each slot 16-byte aligned, as the kernels that write
        # it were specialised for
        self.values = torch.zeros((len(events), 4), dtype=torch.float32, pin_memory=pinned)
        self.slots = [self.values[i, 0] for i in range(len(events))]  # 0-d views, made once
        self.array = self.values.numpy()  # the host's reads and writes, without a dispatch
        self.device_index = device_index
        self.events = events
        # (slot, is_bad, error) per pending verdict, oldest first; their slots
        self.pending: collections.deque[tuple[int, Callable, Error]] = collections.deque()
        self.busy: set[int] = set()
        self.next = 0


_RINGS: dict[torch.device, _Ring] = {}
_STREAMS: dict[tuple, torch.cuda.Stream] = {}
_LOCK = threading.Lock()
_pending = 0  # verdicts pending on every device: `poll`'s test when there are none


def reserve(device: torch.device) -> tuple[torch.Tensor, tuple]:
    """(slot, ticket): a zeroed 0-d fp32 tensor for this call's kernels to write a verdict
    into, and the ticket `defer` takes once they are queued. On a CUDA device the slot is
    pinned host memory of the device's ring that no pending check holds (kernels write it
    through its mapped address); otherwise a CPU tensor. Call outside CUDA stream capture."""
    if device.type != "cuda":
        slot = torch.zeros((), dtype=torch.float32)
        return slot, (None, slot)
    ring = _RINGS.get(device)
    if ring is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with _LOCK:
            ring = _RINGS.setdefault(
                device, _Ring([torch.cuda.Event() for _ in range(_SLOTS)], index)
            )
    index = _reserve(ring)
    return ring.slots[index], (ring, index)


def _reserve(ring: _Ring) -> int:
    """The index of the ring's next free slot, zeroed; where every slot is pending, after
    waiting for the oldest (raising the error of a bad one, without taking a slot)."""
    while True:
        with _LOCK:
            bad = None
            while ring.next in ring.busy:
                ring.events[ring.pending[0][0]].synchronize()
                bad = _resolve(ring)
                if bad is not None:
                    break
            if bad is None:
                index = ring.next
                ring.next = (index + 1) % len(ring.slots)
                ring.array[index, 0] = 0.0  # (no kernel writes it: its check has resolved)
                return index
        _raise(bad(), late=True)  # (None: nothing to raise after all; wait on)


def defer(ticket: tuple, is_bad: Callable[[float], bool], error: Error) -> None:
    """Check the verdict of `ticket` (`reserve`) once the kernels queued so far on the
    current stream have run: if `is_bad(value)`, raise `error()` (None: nothing to raise
    after all, e.g. a NaN loss whose labels were fine). A CPU slot is checked now."""
    ring, index = ticket
    if ring is None:  # a CPU slot: the ticket holds the tensor itself
        if is_bad(index.item()):
            _raise(error(), late=False)
        return
    key = None if ring.device_index is None else torch._C._cuda_getCurrentStream(ring.device_index)
    _push(ring, index, key, is_bad, error)


def check_later(verdict: torch.Tensor, is_bad: Callable[[float], bool], error: Error) -> None:
    """`defer` of a verdict a kernel wrote to device memory (0-d fp32): copied into a slot
    without blocking, then checked as `defer` checks."""
    slot, ticket = reserve(verdict.device)
    # (detached: a loss that requires grad would make autograd record the copy)
    slot.copy_(verdict.detach(), non_blocking=True)
    defer(ticket, is_bad, error)


def _stream(key: tuple) -> torch.cuda.Stream:
    """The torch Stream of `torch._C._cuda_getCurrentStream`'s (id, device, type): made once
    per stream (`torch.cuda.current_stream` builds one per call, 8.7 µs on an H200's host)."""
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(
            stream_id=key[0], device_index=key[1], device_type=key[2]
        )
    return stream


def _push(ring: _Ring, index: int, stream_key, is_bad, error: Error) -> None:
    """Record the slot's event on the stream and queue its check."""
    global _pending
    with _LOCK:
        ring.events[index].record(None if stream_key is None else _stream(stream_key))
        ring.pending.append((index, is_bad, error))
        ring.busy.add(index)
        _pending += 1


def poll() -> None:
    """Raise the error of the oldest bad verdict whose kernels have run, if any."""
    if not _pending:
        return
    bad = None
    with _LOCK:
        for ring in _RINGS.values():
            bad = _resolve(ring)
            if bad is not None:
                break
    if bad is not None:
        _raise(bad(), late=True)


def raise_pending() -> None:
    """Wait for every pending verdict and raise the first bad one's error, if any."""
    while _pending:
        bad = None
        with _LOCK:
            for ring in _RINGS.values():
                if ring.pending:  # (events of other streams may finish out of order)
                    ring.events[ring.pending[0][0]].synchronize()
                bad = bad or _resolve(ring)
        if bad is not None:
            _raise(bad(), late=True)


def _resolve(ring: _Ring) -> Error | None:
    """Drop the ring's completed verdicts, oldest first, up to the first bad one; return that
    one's error callable (None: no bad verdict completed). Called with the lock held."""
    global _pending
    while ring.pending:
        index, is_bad, error = ring.pending[0]
        if not ring.events[index].query():
            return None
        ring.pending.popleft()
        ring.busy.discard(index)
        _pending -= 1
        if is_bad(float(ring.array[index, 0])):
            return error
    return None


def _raise(err: Exception | None, late: bool) -> None:
    if err is None:
        return
    if late:
        err = type(err)(f"{err}{_LATE}")
    raise err
