"""torch.compile of the whole Triton-path model: one graph, no breaks, dropout on.

Every op is a `torch.library.triton_op` and draws its dropout seed as a device tensor, so Dynamo
traces the training forward (and AOTAutograd the backward) without falling back to Python.
GPU only: the interpreter cannot run under fake tensors.
"""

import pytest
import torch

from triton_transformer import AutoregressiveWrapper, Transformer

pytestmark = pytest.mark.gpu


def make_model(use_triton: bool, dropout: float = 0.1) -> AutoregressiveWrapper:
    model = Transformer(
        num_tokens=256, dim=128, depth=2, heads=4, dim_head=32, max_seq_len=128, causal=True,
        attn_dropout=dropout, ff_dropout=dropout, use_triton=use_triton, check_token_ids=False,
    )  # fmt: skip
    return AutoregressiveWrapper(model).cuda().train()


def test_triton_model_traces_without_graph_breaks():
    model = make_model(use_triton=True)
    batch = torch.randint(0, 256, (4, 65), device="cuda")

    def loss_fn(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(batch)

    explanation = torch._dynamo.explain(loss_fn)(batch)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_triton_model_trains_like_eager():
    # dropout off: compiled and eager code draw their seeds differently
    model = make_model(use_triton=True, dropout=0.0)
    compiled = torch.compile(model)
    batch = torch.randint(0, 256, (4, 65), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager_loss = model(batch)
        compiled_loss = compiled(batch)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(compiled_loss, list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)
