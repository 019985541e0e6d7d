"""The Transformer's block graphs (`block_graphs.BlockGraphs`): eager calls of the Triton path
replay the residual blocks as CUDA graphs, forward and backward.

The GPU tests compare a model with graphs against its deep copy without them (same kernels;
deterministic algorithms on, so the same bits) in the ways an ordinary eager loop uses a
model, and check the cases a replay cannot serve: a pending backward, retain_graph,
create_graph, a caller's own whole-step graph. Each asserts that graphs were in fact
captured and replayed, so a silently eager path cannot pass them.
"""

import copy
import pickle

import pytest
import torch
from helpers import deterministic_algorithms

from triton_transformer import Transformer
from triton_transformer.block_graphs import BlockGraphs, suspended
from triton_transformer.cuda_graph import GraphedStep, capturable_train_step

VOCAB, SEQ, BATCH = 256, 64, 4


def make_model(causal: bool = True, dropout: float = 0.0, **kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(
        num_tokens=VOCAB, dim=64, depth=2, heads=2, dim_head=32, max_seq_len=SEQ, causal=causal,
        attn_dropout=dropout, ff_dropout=dropout, use_triton=True, check_token_ids=False, **kw,
    )  # fmt: skip


def test_cuda_graphs_flag_is_checked():
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        make_model(cuda_graphs="yes")


def test_copies_start_without_graphs():
    model = make_model()
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(clone.block_graphs, BlockGraphs)
        assert len(clone.block_graphs) == 0 and clone.block_graphs is not model.block_graphs


def test_suspended_nests():
    from triton_transformer import block_graphs

    with suspended():
        with suspended():
            assert block_graphs._suspended == 2
        assert block_graphs._suspended == 1
    assert block_graphs._suspended == 0


def test_no_graphs_off_cuda(device):
    if device == "cuda":
        pytest.skip("the CPU path")
    model = make_model()
    x = torch.randint(0, VOCAB, (2, 16))
    for _ in range(3):
        model(x, labels=x).backward()
    assert len(model.block_graphs) == 0


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def pair(**kw) -> tuple[Transformer, Transformer]:
    """A model with graphs and its copy without them, on the GPU."""
    graphed = make_model(**kw).cuda()
    eager = copy.deepcopy(graphed)
    eager.cuda_graphs = False
    return graphed, eager


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).cuda() for _ in range(n)]


def replays(model: Transformer) -> int:
    return sum(c.generation for c in model.block_graphs._captured.values())


def grads(model: Transformer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gpu_training_loop_matches_eager(set_to_none):
    """bf16 autocast, AdamW, gradient accumulation over two micro-batches: every loss, every
    gradient and the final weights equal the ungraphed model's, bit for bit."""
    graphed, eager = pair()
    results = {}
    with deterministic_algorithms(True):
        for model in (graphed, eager):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses, step_grads = [], []
            for step in range(4):
                opt.zero_grad(set_to_none=set_to_none)
                for x in batches(2, seed=step):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(x, labels=x)
                    loss.backward()
                    losses.append(loss.item())
                step_grads.append(grads(model))
                opt.step()
            weights = [p.detach().clone() for p in model.parameters()]
            results[model is graphed] = losses, step_grads, weights
    assert len(graphed.block_graphs) == 1 and replays(graphed) > 0
    (l_g, g_g, w_g), (l_e, g_e, w_e) = results[True], results[False]
    assert l_g == l_e
    flat_g = [t for step in g_g for t in step] + w_g
    flat_e = [t for step in g_e for t in step] + w_e
    for a, b in zip(flat_g, flat_e, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_evaluation_outputs_are_fresh_and_match():
    graphed, eager = pair()
    graphed.eval(), eager.eval()
    xs = batches(3)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        outs = [graphed(x) for x in xs]  # held across later replays
        refs = [eager(x) for x in xs]
    assert len(graphed.block_graphs) == 1 and replays(graphed) == 2
    for out, ref in zip(outs, refs, strict=True):
        assert torch.equal(out, ref)


@pytest.mark.gpu
def test_gpu_key_padding_mask_is_an_input():
    graphed, eager = pair(causal=False)
    x = batches(1)[0]
    for n_real in (SEQ, SEQ - 5, SEQ - 9):
        mask = torch.arange(SEQ, device="cuda")[None, :].expand(BATCH, SEQ) < n_real
        with torch.no_grad():
            out, ref = graphed(x, mask), eager(x, mask)
        assert torch.equal(out, ref), n_real
    assert replays(graphed) == 2


@pytest.mark.gpu
def test_gpu_two_forwards_then_one_backward():
    """The second forward finds the first one's backward pending: it runs eagerly, so the
    first replay's saved activations stay intact."""
    graphed, eager = pair()
    x1, x2 = batches(2)
    with deterministic_algorithms(True):
        for model in (graphed, eager):
            model(x1, labels=x1).backward()  # the first call: eager; the next one captures
            model.zero_grad()
            (model(x1, labels=x1) + model(x2, labels=x2)).backward()
    assert replays(graphed) == 2  # one forward and one backward replay: the second ran eagerly
    for a, b in zip(grads(graphed), grads(eager), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_second_backward_raises():
    model = make_model().cuda()
    x = batches(1)[0]
    model(x).float().square().mean().backward()
    loss = model(x).float().square().mean()  # a replay
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the Transformer's graphed"):
        loss.backward()


def run(graphs: BlockGraphs, blocks, modules, h: torch.Tensor) -> torch.Tensor:
    y = graphs(blocks, modules, h, None, ())
    return blocks(h, None) if y is None else y


@pytest.mark.gpu
def test_gpu_direct_use_eviction_and_create_graph():
    """BlockGraphs on any function of h: gradients of h and of the weights as eager ones, at
    most max_graphs signatures kept (least recently used dropped), create_graph refused."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).cuda()
    graphs = BlockGraphs(max_graphs=2)

    def blocks(h, mask):
        return torch.relu(lin(h)) * h

    for rows in (3, 4, 5, 3, 4, 5, 3):
        h = torch.randn(rows, 8, device="cuda", requires_grad=True)
        lin.zero_grad()
        run(graphs, blocks, (lin,), h).square().sum().backward()
        got = [h.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]
        h.grad = None
        lin.zero_grad()
        blocks(h, None).square().sum().backward()
        for a, b in zip(got, [h.grad, lin.weight.grad, lin.bias.grad], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert len(graphs) == 2  # shapes 5 and 3, the last two used
    h = torch.randn(3, 8, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match=r"graphed transformer blocks: .*first-order only"):
        torch.autograd.grad(run(graphs, blocks, (lin,), h).sum(), h, create_graph=True)


@pytest.mark.gpu
def test_gpu_dropout_draws_fresh_masks_per_replay():
    model = make_model(dropout=0.3).cuda().train()
    x = batches(1)[0]
    with torch.no_grad():
        losses = [model(x, labels=x).item() for _ in range(4)]
    assert replays(model) == 3 and len(set(losses)) == 4, losses


@pytest.mark.gpu
def test_gpu_new_parameter_storage_takes_effect():
    graphed, eager = pair()
    x = batches(1)[0]
    with torch.no_grad():
        graphed(x), graphed(x)  # captured
        for model in (graphed, eager):  # new storage, new values: a new graph
            w = model.layers[1][0].to_out.weight
            w.data = w.data * 2
        assert torch.equal(graphed(x), eager(x)) and torch.equal(graphed(x), eager(x))
    assert len(graphed.block_graphs) == 2


@pytest.mark.gpu
def test_gpu_no_graphs_inside_a_whole_step_graph():
    model = make_model().cuda()
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda")
    step = GraphedStep(capturable_train_step(_Wrapped(model), batch), warmup_steps=2)
    for _ in range(4):
        step()
    assert step.captured and len(model.block_graphs) == 0


class _Wrapped(torch.nn.Module):
    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch[:, :-1], labels=batch[:, 1:])
