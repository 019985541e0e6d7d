"""Test setup: without a CUDA GPU the Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton (and so triton_transformer) is imported,
which is why it happens here, at collection time, before any test module loads.
"""

import os
import zlib

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


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible seed per test: fresh data, yet failures replay.
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    yield
