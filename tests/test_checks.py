"""Deferred device checks (`triton_transformer.checks`): the ring's order, its late errors and
its waits, with events the test completes by hand (CPU); the real ring on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

import triton_transformer.checks as checks
from triton_transformer.cross_entropy import cross_entropy
from triton_transformer.embedding import embedding


class FakeEvent:
    """A CUDA event whose completion the test decides: record() leaves it pending."""

    def __init__(self) -> None:
        self.done = True
        self.waits = 0

    def record(self, stream) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


@pytest.fixture
def ring(monkeypatch):
    ring = checks._Ring([FakeEvent() for _ in range(3)], None)
    monkeypatch.setattr(checks, "_RINGS", {"fake": ring})
    monkeypatch.setattr(checks, "_pending", 0)
    return ring


def push(ring, value: float, message: str | None) -> None:
    """What a checked call does: reserve a slot, its kernels write the verdict, defer."""
    error = (lambda: ValueError(message)) if message else (lambda: None)
    index = checks._reserve(ring)
    assert ring.array[index, 0] == 0.0
    ring.values[index, 0] = value
    checks.defer((ring, index), math.isnan, error)


def test_a_bad_verdict_raises_once_from_the_first_poll_after_its_event(ring):
    push(ring, 1.0, None)
    push(ring, float("nan"), "bad labels")
    checks.poll()  # nothing completed yet
    assert checks._pending == 2
    ring.events[0].done = True
    checks.poll()  # the good one resolves; the bad one is still in flight
    assert checks._pending == 1
    ring.events[1].done = True
    with pytest.raises(ValueError, match=r"bad labels .*found by a later call"):
        checks.poll()
    assert checks._pending == 0
    checks.poll()  # raised once
    checks.raise_pending()


def test_check_later_copies_a_verdict_that_requires_grad_outside_autograd(monkeypatch):
    # (a loss is the verdict of a call that records autograd; on the CPU it is read at once)
    loss = torch.tensor(2.0, requires_grad=True) * 1.5
    checks.check_later(loss, math.isnan, lambda: ValueError("never"))
    with pytest.raises(ValueError, match=r"^bad$"):
        checks.check_later(loss * float("nan"), math.isnan, lambda: ValueError("bad"))


def test_a_nan_verdict_whose_error_is_none_raises_nothing(ring):
    push(ring, float("nan"), None)  # e.g. a NaN loss from NaN logits, good labels
    checks.raise_pending()
    assert checks._pending == 0 and ring.events[0].waits == 1


def test_verdicts_resolve_in_order_and_stop_at_a_pending_one(ring):
    push(ring, float("nan"), "first")
    push(ring, float("nan"), "second")
    ring.events[1].done = True  # the later one finished first (another stream)
    checks.poll()
    assert checks._pending == 2
    with pytest.raises(ValueError, match="first"):
        checks.raise_pending()
    with pytest.raises(ValueError, match="second"):
        checks.raise_pending()
    checks.raise_pending()


def test_a_full_ring_waits_for_its_oldest_verdict_and_reuses_its_slot(ring):
    push(ring, float("nan"), "oldest")
    push(ring, 2.0, None)
    push(ring, 3.0, None)
    # a fourth verdict needs slot 0: its reservation waits for that one's event, which is
    # bad, and raises without taking a slot; the next one takes slot 0, zeroed
    with pytest.raises(ValueError, match="oldest"):
        checks._reserve(ring)
    assert ring.events[0].waits == 1 and checks._pending == 2
    assert [p[0] for p in ring.pending] == [1, 2] and ring.next == 0
    push(ring, 4.0, None)  # slot 0
    push(ring, 5.0, None)  # slot 1 waited for, good
    assert ring.events[1].waits == 1 and [p[0] for p in ring.pending] == [2, 0, 1]
    checks.raise_pending()


def test_a_bad_verdict_resolved_before_the_next_slot_is_raised_not_spun_on(ring):
    # Two threads' calls interleaved: A reserves slot 0, B slot 1, B defers first (bad),
    # then A; C takes slot 2. The next reservation needs slot 0 and resolves B's bad verdict
    # (oldest pending) first: it raises it (it spun on it forever, holding the lock).
    a, b = checks._reserve(ring), checks._reserve(ring)
    ring.values[b, 0] = float("nan")
    checks.defer((ring, b), math.isnan, lambda: ValueError("B's bad label"))
    checks.defer((ring, a), math.isnan, lambda: None)
    push(ring, 1.0, None)
    with pytest.raises(ValueError, match="B's bad label"):
        checks._reserve(ring)
    assert checks._reserve(ring) == 0  # A's slot, waited for
    checks.raise_pending()


def test_a_slot_taken_but_never_deferred_is_skipped_while_others_are_pending(ring):
    # (a call that failed between reserve and defer): its slot is free again, the pending
    # ones are not reused
    push(ring, 1.0, None)
    checks._reserve(ring)  # slot 1, never deferred
    push(ring, 2.0, None)  # slot 2
    push(ring, 3.0, None)  # slot 0 is pending: waits for it, then takes it
    assert ring.events[0].waits == 1 and sorted(ring.busy) == [0, 2]
    push(ring, 5.0, None)  # slot 1: free, no wait
    assert ring.events[1].waits == 0 and sorted(ring.busy) == [0, 1, 2]
    checks.raise_pending()


def test_a_cpu_slot_is_read_at_once():
    slot, ticket = checks.reserve(torch.device("cpu"))
    slot.fill_(0.5)
    checks.defer(ticket, math.isnan, lambda: ValueError("never"))
    slot, ticket = checks.reserve(torch.device("cpu"))
    slot.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"^now$"):
        checks.defer(ticket, math.isnan, lambda: ValueError("now"))


@pytest.mark.gpu
def test_cross_entropy_on_a_gpu_raises_later_without_a_sync():
    # On a GPU a bad label does not raise from its own call (no sync): the loss is NaN, and
    # the error comes from raise_pending(), or from a later checked call once the kernels
    # have finished, naming itself as late; the copies and events live on the real ring.
    checks.raise_pending()
    logits = torch.randn(4, 37, device="cuda")
    labels = torch.randint(0, 37, (4,), device="cuda")
    bad = labels.clone()
    bad[2] = 40
    loss = cross_entropy(logits, bad, use_triton=True)
    assert checks._pending == 1
    torch.cuda.synchronize()
    assert torch.isnan(loss)
    with pytest.raises(ValueError, match=r"found label 40.*found by a later call"):
        cross_entropy(logits, labels, use_triton=True)
    good = cross_entropy(logits, labels, use_triton=True)
    checks.raise_pending()
    assert checks._pending == 0 and torch.isfinite(good)
    for _ in range(3 * checks._SLOTS):  # the ring wraps around, nothing lost
        cross_entropy(logits, labels, use_triton=True)
    cross_entropy(logits, bad, use_triton=True)
    with pytest.raises(ValueError, match="found label 40"):
        checks.raise_pending()


@pytest.mark.gpu
def test_embedding_on_a_gpu_raises_later_without_a_sync():
    # The forward kernel writes the call's stamp into the device's flag for a bad id; the
    # deferred check of that call finds it, a later good call does not (its stamp differs)
    checks.raise_pending()
    w = torch.randn(10, 8, device="cuda", requires_grad=True)
    ids = torch.randint(0, 10, (2, 5), device="cuda")
    bad = ids.clone()
    bad[1, 2] = 11
    h = embedding(bad, w, use_triton=True)
    assert checks._pending == 1
    torch.cuda.synchronize()
    assert torch.isnan(h[1, 2]).all() and torch.isfinite(h[0]).all()
    with pytest.raises(IndexError, match=r"found id 11.*found by a later call"):
        embedding(ids, w, use_triton=True)
    embedding(ids, w, use_triton=True).sum().backward()
    checks.raise_pending()
    assert torch.isfinite(w.grad).all()
