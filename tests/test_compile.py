"""torch.compile of the whole Triton-path model: one graph, no breaks, dropout on.

Every op is a `torch.library.triton_op` and draws its dropout seed as a device tensor, so Dynamo
traces the training forward (and AOTAutograd the backward) without falling back to Python.
GPU only: the interpreter cannot run under fake tensors.
"""

import pytest
import torch
from helpers import kernel_analysis_failures, on_hopper, rel_err

from triton_transformer import AutoregressiveWrapper, Transformer

pytestmark = pytest.mark.gpu


def make_model(
    use_triton: bool, dropout: float = 0.1, cuda_graphs: bool = True
) -> AutoregressiveWrapper:
    model = Transformer(
        num_tokens=256, dim=128, depth=2, heads=4, dim_head=32, max_seq_len=128, causal=True,
        attn_dropout=dropout, ff_dropout=dropout, use_triton=use_triton, check_token_ids=False,
        cuda_graphs=cuda_graphs,
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
    # torch's analysis of which arguments each kernel writes (from its Triton IR) must
    # succeed for every kernel the step launches, or inductor copies every view they read
    model = make_model(use_triton=True, dropout=0.0)
    compiled = torch.compile(model)
    batch = torch.randint(0, 256, (4, 65), device="cuda")
    with kernel_analysis_failures() as failures:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eager_loss = model(batch)
            compiled_loss = compiled(batch)
        grads = torch.autograd.grad(compiled_loss, list(model.parameters()))
    assert not failures, failures
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=2e-2, atol=2e-2)
    assert all(torch.isfinite(g).all() for g in grads)


def test_compiled_model_reads_the_steps_weight_casts():
    # Inside reuse_weight_casts(model, bf16), as a training step opens it, the compiled model
    # reads the step's bf16 copies of its linears (one foreach cast per step, not one cast
    # per weight per micro-batch), as the eager model does: its gradients match eager's, and
    # zeroing the first layer's attention out-projection copy cuts the gradient of that
    # layer's qkv projection to exactly zero in both. No block graphs: their captures cast
    # the weights themselves (`bmm.fresh_weight_casts`).
    from triton_transformer.bmm import TRACED_CAST, reuse_weight_casts

    torch._dynamo.reset()
    model = make_model(use_triton=True, dropout=0.0, cuda_graphs=False)
    compiled = torch.compile(model)
    batch = torch.randint(0, 256, (4, 65), device="cuda")
    names, params = zip(*model.named_parameters(), strict=True)
    qkv0 = names.index("net.layers.0.0.to_qkv.weight")

    def loss_and_grads(fn):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(batch)
        return loss.detach(), torch.autograd.grad(loss, params)

    for perturb in (False, True):
        with reuse_weight_casts(model, torch.bfloat16):
            if perturb:
                getattr(model.net.layers[0][0].to_out.weight, TRACED_CAST).zero_()
            eager_loss, eager_grads = loss_and_grads(model)
            compiled_loss, compiled_grads = loss_and_grads(compiled)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=2e-2, atol=2e-2)
        for name, g, e in zip(names, compiled_grads, eager_grads, strict=True):
            assert g.dtype == e.dtype and rel_err(g, e) < 3e-2, name
        for g in (eager_grads[qkv0], compiled_grads[qkv0]):
            assert (g.abs().max() == 0) == perturb


def test_compiled_micro_batches_add_weight_grads_in_place():
    # Inside accumulate_grads_in_place(traced=True), as the trainer opens it around its
    # micro-batches: from the second micro-batch on, the compiled backward adds each linear's
    # dW into its `.grad` itself and hands autograd no gradient for it (a hook on the weight
    # is called with None), and so does each layer norm's column-sum kernel for its weight,
    # while the embeddings' gradients still reach autograd. The sums match the eager model's
    # accumulation (whose fold a hooked weight turns off), and no kernel's argument analysis
    # failed.
    from torch import nn

    from triton_transformer.bmm import accumulate_grads_in_place

    torch._dynamo.reset()
    model = make_model(use_triton=True, dropout=0.0, cuda_graphs=False)
    compiled = torch.compile(model)
    batches = [torch.randint(0, 256, (4, 65), device="cuda") for _ in range(3)]
    linear_w = model.net.layers[0][0].to_qkv.weight
    norm_w = model.net.layers[0][0].norm.weight
    emb_w = model.net.token_emb.weight
    assert isinstance(model.net.layers[0][0].to_qkv, nn.Linear)
    seen = {"linear": [], "norm": [], "embedding": []}
    linear_w.register_hook(lambda g: seen["linear"].append(g is not None))
    norm_w.register_hook(lambda g: seen["norm"].append(g is not None))
    emb_w.register_hook(lambda g: seen["embedding"].append(g is not None))

    def accumulate(fn):
        model.zero_grad(set_to_none=True)
        for calls in seen.values():
            calls.clear()
        with accumulate_grads_in_place(traced=True):
            for batch in batches:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = fn(batch)
                loss.backward()
        return [p.grad.clone() for p in model.parameters()], {k: list(v) for k, v in seen.items()}

    eager_grads, eager_seen = accumulate(model)
    with kernel_analysis_failures() as failures:
        compiled_grads, compiled_seen = accumulate(compiled)
    assert not failures, failures
    assert eager_seen == {"linear": [True] * 3, "norm": [True] * 3, "embedding": [True] * 3}
    folded = [True, False, False]
    assert compiled_seen == {"linear": folded, "norm": folded, "embedding": [True] * 3}
    names = [n for n, _ in model.named_parameters()]
    for name, g, e in zip(names, compiled_grads, eager_grads, strict=True):
        assert g.dtype == e.dtype and rel_err(g, e) < 3e-2, name


@on_hopper
def test_compiled_model_takes_the_hopper_kernels(monkeypatch):
    # At GPT-2's width and vocabulary, where eager calls take the Gluon kernels on Hopper (the
    # attention forward and backward, the relu² feed-forward's products, the in-place loss),
    # the compiled model takes them too, through their opaque ops, and its loss and gradients
    # match the eager model's.
    import triton_transformer.attention_hopper_bwd_ws as ws
    import triton_transformer.attention_hopper_fwd as af
    import triton_transformer.cross_entropy_hopper as ceh
    import triton_transformer.matmul_hopper as mh

    launchers = ((af, "launch_fwd_sm90"), (ws, "launch_bwd_ws_sm90"), (mh, "launch_mm_sm90"),
                 (ceh, "launch_cross_entropy_inplace_sm90"))  # fmt: skip
    launched = set()
    for module, name in launchers:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            launched.add(_name)
            again = _real(*args, **kwargs)  # a bound launch (`LaunchPlans`), or None

            def counted_again(*args):
                launched.add(_name)
                return again(*args)

            return counted_again if callable(again) else again

        monkeypatch.setattr(module, name, counted)
    torch._dynamo.reset()
    model = Transformer(
        num_tokens=50304, dim=768, depth=1, heads=12, dim_head=64, max_seq_len=1024,
        causal=True, use_triton=True, check_token_ids=False, cuda_graphs=False,
    )  # fmt: skip
    model = AutoregressiveWrapper(model).cuda().train()
    compiled = torch.compile(model)
    batch = torch.randint(0, 50304, (4, 1025), device="cuda")
    params = list(model.parameters())
    results = {}
    for name, fn in (("eager", model), ("compiled", compiled)):
        launched.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(batch)
        grads = torch.autograd.grad(loss, params)
        results[name] = (loss.detach(), grads, set(launched))
    for name in ("eager", "compiled"):
        assert results[name][2] == {n for _, n in launchers}, name
    torch.testing.assert_close(results["compiled"][0], results["eager"][0], rtol=2e-2, atol=2e-2)
    for g, e in zip(results["compiled"][1], results["eager"][1], strict=True):
        assert rel_err(g, e) < 3e-2
