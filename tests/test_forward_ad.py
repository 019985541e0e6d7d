"""Forward-mode AD (`torch.autograd.forward_ad`) through the Triton ops: their kernels have
no forward-mode derivative, so a call whose input carries a tangent must raise (or, where
use_triton runs PyTorch's own op, carry the right tangent), never return a result without
one (a silent zero JVP). A dual tensor need not require grad, so such a call records no
backward and once ran the kernels on the primal alone."""

import re

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from triton_transformer.attention import attention, attention_packed
from triton_transformer.bmm import bmm, linear
from triton_transformer.cross_entropy import cross_entropy
from triton_transformer.dropout import dropout
from triton_transformer.embedding import embedding
from triton_transformer.layernorm import layernorm
from triton_transformer.linear_cross_entropy import linear_cross_entropy
from triton_transformer.mlp import relu2_mlp
from triton_transformer.residual_layernorm import residual_layernorm
from triton_transformer.rmsnorm import residual_rmsnorm, rmsnorm
from triton_transformer.rope import rope
from triton_transformer.softmax import softmax
from triton_transformer.swiglu import swiglu

D = 16


def _on(x: torch.Tensor, values) -> torch.Tensor:
    """An integer tensor of `values` on x's device (labels, ids, a seed)."""
    return torch.tensor(values, device=x.device)


# f(x, use_triton) for x of shape (3, D), the input that carries the tangent
OPS = {
    "layernorm": lambda x, w, ut: layernorm(x, w, use_triton=ut),
    "residual_layernorm": lambda x, w, ut: residual_layernorm(x, x * 0.5, w, use_triton=ut)[1],
    "rmsnorm": lambda x, w, ut: rmsnorm(x, w, use_triton=ut),
    "residual_rmsnorm": lambda x, w, ut: residual_rmsnorm(x, x * 0.5, w, use_triton=ut)[1],
    "softmax": lambda x, w, ut: softmax(x, use_triton=ut),
    "dropout": lambda x, w, ut: dropout(x, 0.3, use_triton=ut, seed=_on(x, 5)),
    "swiglu": lambda x, w, ut: swiglu(x, x * 0.5, use_triton=ut),
    "linear": lambda x, w, ut: linear(x, w.repeat(2, 1), use_triton=ut),
    "linear relu2": lambda x, w, ut: linear(x, w.repeat(2, 1), "relu_squared", use_triton=ut),
    "linear swiglu": lambda x, w, ut: linear(x, w.repeat(4, 1), "swiglu", use_triton=ut),
    "relu2_mlp": lambda x, w, ut: relu2_mlp(x, w.repeat(2, 1), w.repeat(2, 1).t(), use_triton=ut),
    "bmm": lambda x, w, ut: bmm(x[None], w.repeat(2, 1).t()[None], use_triton=ut),
    "cross_entropy": lambda x, w, ut: cross_entropy(x, _on(x, [1, 2, 3]), use_triton=ut),
    "linear_cross_entropy": lambda x, w, ut: linear_cross_entropy(
        x, w.repeat(2, 1), _on(x, [1, 0, 1]), use_triton=ut
    ),
    "attention": lambda x, w, ut: attention(
        x[None, None], x[None, None] * 0.5, x[None, None], causal=True, use_triton=ut
    ),
    "attention_packed": lambda x, w, ut: attention_packed(
        x.repeat(1, 3)[None], heads=1, causal=True, use_triton=ut
    ),
    "rope": lambda x, w, ut: rope(x[None, None], x[None, None] * 0.5, use_triton=ut)[0],
    "embedding": lambda x, w, ut: embedding(_on(x, [[0, 2, 1]]), x, use_triton=ut),
}
NO_REFERENCE_JVP = {"attention", "attention_packed"}  # SDPA has no forward AD itself


def _tangent(f, x, t, w, use_triton):
    with fwAD.dual_level():
        y = f(fwAD.make_dual(x, t), w, use_triton)
        return fwAD.unpack_dual(y).tangent


@pytest.mark.parametrize("name", list(OPS))
def test_a_tangent_through_a_triton_op_raises_or_is_right(name, device):
    """Each op raises, or (where use_triton runs PyTorch's own op: plain products go to
    cuBLAS through torch.mm on CUDA) carries the reference's tangent."""
    gen = torch.Generator().manual_seed(3)
    x, t, w = (torch.randn(3, D, generator=gen).to(device) for _ in range(3))
    w = w[0]
    f = OPS[name]
    f(x, w, True)  # a plain call first: its eager plan exists when the dual call comes
    expected = None if name in NO_REFERENCE_JVP else _tangent(f, x, t, w, False)
    if name not in NO_REFERENCE_JVP:  # the reference carries the tangent through
        assert expected is not None
    for _ in range(2):
        try:
            tangent = _tangent(f, x, t, w, True)
        except RuntimeError as error:
            assert re.search(r"no forward-mode derivative.*use_triton=False", str(error))
            continue
        assert expected is not None and tangent is not None, name
        assert torch.allclose(tangent, expected, rtol=1e-4, atol=1e-5), name
    f(x, w, True)  # and a plain call after the dual level takes its plan again
