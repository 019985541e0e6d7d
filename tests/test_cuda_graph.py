"""GraphedStep: a whole training step (forward, backward, clipping, fused AdamW) in one CUDA graph.

GPU only: CUDA graphs need CUDA. The eager and the captured step run the same kernels, so with
dropout off their losses agree step for step; with dropout on, every replay draws new masks.
"""

import pytest
import torch
from torch import nn

from triton_transformer import AutoregressiveWrapper, Transformer
from triton_transformer.cuda_graph import GraphedStep, StaticInputs
from triton_transformer.cuda_graph import capturable_train_step as make_step

pytestmark = pytest.mark.gpu


def make_model(use_triton: bool, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = Transformer(
        num_tokens=256, dim=128, depth=2, heads=4, dim_head=32, max_seq_len=128, causal=True,
        attn_dropout=dropout, ff_dropout=dropout, use_triton=use_triton, check_token_ids=False,
    )  # fmt: skip
    return AutoregressiveWrapper(model).cuda().train()


@pytest.mark.parametrize("use_triton", [False, True])
def test_graphed_losses_match_eager(use_triton):
    batches = torch.randint(0, 256, (8, 4, 65), generator=torch.Generator().manual_seed(1))
    losses = {}
    for graphed in (False, True):
        model = make_model(use_triton)
        inputs = StaticInputs((4, 65), torch.int64, torch.device("cuda"))
        step = make_step(model, inputs.device_buffer)
        if graphed:
            step = GraphedStep(step, warmup_steps=2)
        out = []
        for b in batches:
            inputs.load(b)
            loss, norm = step()
            out.append(torch.stack([loss, norm]).tolist())
        losses[graphed] = out
        if graphed:
            assert step.captured
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=0)


@pytest.mark.parametrize("use_triton", [False, True])
def test_replays_draw_fresh_dropout_masks(use_triton):
    # lr 0: the weights never change, so only dropout can make two replays' losses differ.
    model = make_model(use_triton, dropout=0.3)
    batch = torch.randint(0, 256, (4, 65), device="cuda")
    step = GraphedStep(make_step(model, batch, lr=0.0), warmup_steps=2)
    losses = [step()[0].item() for _ in range(5)]
    assert step.captured
    assert len(set(losses[2:])) == 3, losses  # the captured call and two replays


def test_optimizer_copies_train_as_casts():
    """The Triton step reads the bf16 weight copies its AdamW wrote in the last update
    (`AdamW.cast_copies`): graphed, its losses equal a step that casts the weights itself
    at every forward. A forward with the weights one update behind changes the losses from
    the second step on by 1.3e-4 to 3.2e-3 relative (this model and data, the PyTorch path on
    the CPU, 2026-11-29): 4x to 100x the tolerance. The two steps are not bit-identical: on an
    H200 their fifth losses differ by 1.09e-5 relative under Triton 3.9, by less than 1e-5
    under Triton 3.6."""
    from triton_transformer.adamw import AdamW
    from triton_transformer.bmm import reuse_weight_casts

    batches = torch.randint(0, 256, (6, 4, 65), generator=torch.Generator().manual_seed(1))
    model = make_model(True)
    inputs = StaticInputs((4, 65), torch.int64, torch.device("cuda"))
    step = GraphedStep(make_step(model, inputs.device_buffer), warmup_steps=2)

    twin = make_model(True)
    params = [p for p in twin.parameters() if p.requires_grad]
    opt = AdamW(params, lr=torch.tensor(1e-3, device="cuda"), use_triton=True)
    losses, ref = [], []
    for b in batches:
        inputs.load(b)
        losses.append(step()[0].item())
        opt.zero_grad(set_to_none=True)
        with reuse_weight_casts(twin), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = twin(b.cuda())
        loss.backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        ref.append(loss.item())
    assert step.captured
    torch.testing.assert_close(losses, ref, rtol=3e-5, atol=0)
