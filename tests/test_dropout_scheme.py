"""One dropout mask scheme for every Triton kernel that drops (`_jit_helpers.dropout_keep_tile`).

Each kernel's mask is read off its output and compared, element for element, with an
independent NumPy implementation of the scheme (`helpers.philox_keep_mask`): the helper itself
at unaligned widths and 64-bit counters, `dropout` (the flat order, any tile), the residual
LayerNorm's branch dropout (forward and backward), the relu² matmul epilogue, and attention's
dropout on its weights (key = seed + (batch·head << 32)).
"""

import pytest
import torch
import triton
import triton.language as tl
from helpers import philox_keep_mask

from triton_transformer._jit_helpers import dropout_keep_tile
from triton_transformer.attention import attention
from triton_transformer.bmm import linear
from triton_transformer.dropout import dropout
from triton_transformer.residual_layernorm import residual_layernorm
from triton_transformer.utils import dropout_threshold

P = 0.3
SEED = 1234567


def seed_tensor(device, value: int = SEED) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64, device=device)


@triton.jit
def _keep_tile_kernel(SEED, OUT, n_rows, n_cols, threshold, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, INT64: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.program_id(1) * BLOCK_N
    cols = start + tl.arange(0, BLOCK_N)
    keep = dropout_keep_tile(tl.load(SEED), rows, start, n_cols, threshold, BLOCK_N, INT64)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tl.store(OUT + rows[:, None] * n_cols + cols[None, :], keep, mask=mask)


@pytest.mark.parametrize("int64", [False, True])
@pytest.mark.parametrize("n_cols, block_n", [(37, 16), (64, 32), (100, 64)])
def test_keep_tile_matches_numpy_philox(n_cols, block_n, int64, device):
    n_rows = 21
    out = torch.full((n_rows, n_cols), 7, dtype=torch.int8, device=device)
    grid = (triton.cdiv(n_rows, 8), triton.cdiv(n_cols, block_n))
    _keep_tile_kernel[grid](
        seed_tensor(device), out, n_rows, n_cols, dropout_threshold(P), BLOCK_M=8,
        BLOCK_N=block_n, INT64=int64,
    )  # fmt: skip
    assert torch.equal(out.cpu().bool(), philox_keep_mask(SEED, n_rows, n_cols, P))
    assert ((out == 0) | (out == 1)).all()  # every element written


def positive(shape, device, dtype=torch.float32) -> torch.Tensor:
    return (torch.rand(shape, device=device) + 0.5).to(dtype)


@pytest.mark.parametrize("shape", [(6, 40), (3, 5, 24), (1000,)], ids=str)
def test_dropout_is_the_scheme_over_the_flat_order(shape, device):
    x = positive(shape, device)
    kept = dropout(x, P, use_triton=True, seed=seed_tensor(device)) != 0
    ref = philox_keep_mask(SEED, x.numel() // 8 + 1, 8, P).flatten()[: x.numel()]
    assert torch.equal(kept.cpu().flatten(), ref)
    # rows whose width is a multiple of 8: the same mask as the (rows, width) matrix's
    if shape[-1] % 8 == 0:
        rows = x.numel() // shape[-1]
        assert torch.equal(kept.cpu().reshape(rows, -1), philox_keep_mask(SEED, rows, shape[-1], P))


@pytest.mark.parametrize("n", [40, 100])
def test_residual_layernorm_branch_dropout_is_the_scheme(n, device):
    rows = 9
    h = torch.zeros(rows, n, device=device)
    branch = positive((rows, n), device).requires_grad_()
    weight = torch.ones(n, device=device)
    h_new, _ = residual_layernorm(
        h, branch, weight, None, dropout_p=P, use_triton=True, seed=seed_tensor(device)
    )
    ref = philox_keep_mask(SEED, rows, n, P)
    assert torch.equal((h_new != 0).cpu(), ref)
    h_new.sum().backward()  # the backward regenerates the same mask for the branch gradient
    assert torch.equal((branch.grad != 0).cpu(), ref)


def test_relu2_epilogue_dropout_is_the_scheme(device):
    x, w = positive((19, 32), device), positive((48, 32), device)  # relu(x wᵀ) > 0 everywhere
    out = linear(x, w, "relu_squared", use_triton=True, dropout_p=P, seed=seed_tensor(device))
    assert torch.equal((out != 0).cpu(), philox_keep_mask(SEED, 19, 48, P))


def test_attention_dropout_is_the_scheme(device):
    b, h, n, d = 2, 2, 24, 32  # n <= d: v's rows one-hot, so out[i, j] = dropped weight (i, j)
    q = torch.randn(b, h, n, d, device=device) * 0.1
    k = torch.randn(b, h, n, d, device=device) * 0.1
    v = torch.eye(n, d, device=device).expand(b, h, n, d)
    out = attention(q, k, v, dropout_p=P, use_triton=True, seed=seed_tensor(device))
    for bh in range(b * h):
        kept = (out[bh // h, bh % h, :, :n] != 0).cpu()
        assert torch.equal(kept, philox_keep_mask(SEED + (bh << 32), n, n, P)), bh
