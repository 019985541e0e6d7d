"""Test setup: without a CUDA GPU the Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton (and so triton_transformer) is imported,
which is why it happens here, at collection time, before any test module loads.
"""

import os
import re
import zlib
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    """'cuda' on a GPU machine, else 'cpu' (kernels then run in the interpreter)."""
    return DEVICE


def _assert_first_order_only(f, x: torch.Tensor, op_name: str) -> None:
    """`f(x)` runs a Triton op whose backward is first-order only: every create_graph=True
    gradient through it raises a RuntimeError naming `op_name` and pointing to
    use_triton=False, instead of a second derivative with terms silently missing (issue #20).
    A plain gradient still works."""
    match = rf"^{re.escape(op_name)}: .*first-order only.*use_triton=False"
    # The pattern: the upstream gradient depends on x too, and grad(..., x) prunes
    # graph nodes off the path to x (once_differentiable's detached error node was one).
    s = f(x).float().sum() * (x.float() ** 2).sum()
    with pytest.raises(RuntimeError, match=match):
        (g,) = torch.autograd.grad(s, x, create_graph=True)
        torch.autograd.grad((g * g).sum(), x)
    # A constant upstream gradient: the result would depend on x through the saved inputs only.
    with pytest.raises(RuntimeError, match=match):
        torch.autograd.grad(f(x).float().sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(f(x).float().sum(), x)
    assert g.shape == x.shape and torch.isfinite(g).all()


@pytest.fixture
def assert_first_order_only():
    """`_assert_first_order_only(f, x, op_name)`, for each op's test module."""
    return _assert_first_order_only


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible seed per test: fresh data, yet failures replay.
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    yield


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    # Ops bind their eager launches once per shape (`utils.LaunchPlans`): a test that patches
    # a table or a launcher must see its own launches looked up, not an earlier test's.
    from triton_transformer.utils import clear_launch_plans  # after TRITON_INTERPRET is set

    clear_launch_plans()
    yield


@pytest.fixture(autouse=True)
def _no_pending_checks():
    # A GPU's eager label and id checks raise from a later call (`triton_transformer.checks`):
    # a bad verdict a test leaves pending fails that test here, never the next one.
    yield
    from triton_transformer import checks

    checks.raise_pending()


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    """A small, repetitive text file (a tiny model learns it within a few dozen steps), for
    the training, CLI and distributed tests."""
    lines = [f"{i % 10} the quick brown fox jumps over the lazy dog {i % 7}.\n" for i in range(800)]
    path = tmp_path_factory.mktemp("corpus") / "fox.txt"
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def corpus(corpus_file):
    """`corpus_file` loaded (split 90/5/5), for tests that hand the trainer a corpus."""
    from triton_transformer.training.data import load_corpus  # after TRITON_INTERPRET is set above

    return load_corpus(str(corpus_file))
