"""Helpers shared by the RMSNorm, RoPE, SwiGLU and modern-block tests."""

import math
import subprocess
from pathlib import Path

import torch
from helpers import run_without_interpreter

LOW_PRECISION = [torch.float16, torch.bfloat16]
# Row-wise relative tolerance against float64 per input dtype.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def assert_close(actual, expected, tol, name=""):
    """Row-wise (last dim) relative error <= tol against a float64 result; NaN/inf fail."""
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    a = actual.double()
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    if a.numel() == 0:
        return
    n = a.shape[-1]
    err = (a - expected.double()).reshape(-1, n).norm(dim=-1)
    bound = tol * expected.double().reshape(-1, n).norm(dim=-1) + 1e-3 * tol * math.sqrt(n)
    bad = (err > bound).nonzero().flatten().tolist()
    assert not bad, f"{name}: rows {bad[:5]}: |diff| {err[bad[:5]]} > {bound[bad[:5]]}"


def grads(fn, leaves, cotangents):
    """(outputs, grads of leaves) of fn(*leaves) for the given output cotangents."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    gs = torch.autograd.grad(
        out, leaves, [c.to(o.dtype) for o, c in zip(out, cotangents, strict=True)]
    )
    return out, gs


def run_trace_check() -> subprocess.CompletedProcess:
    """tests/_modern_trace_check.py in a subprocess with TRITON_INTERPRET=0."""
    return run_without_interpreter(str(Path(__file__).with_name("_modern_trace_check.py")))


# ----------------------------------------------------------------------------- model tests

LLAMA = dict(pos_emb="rope", norm="rmsnorm", ff_act="swiglu", qk_norm=True)


def train_both_branches(models, vocab: int, steps: int = 2) -> list[float]:
    """Two models of one initialisation, `steps` AdamW steps each on the same random
    batches, the first through the PyTorch branch and the second through Triton: asserts the
    losses agree and so do the parameters after the steps. Returns the PyTorch branch's
    losses."""
    device = next(models[0].parameters()).device
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    batches = [torch.randint(0, vocab, (2, 9), device=device) for _ in range(steps)]
    losses = [[], []]
    for x in batches:
        for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
            loss = model(x[:, :-1], labels=x[:, 1:], use_triton=bool(i))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[i].append(loss.item())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=name)
    return losses[0]


def decode_in_steps(model, x: torch.Tensor, kv_cache, use_triton: bool, prompt: int = 5):
    """The logits of x fed through `kv_cache` as a prompt of `prompt` tokens, then one token
    a step (no grad): equal to the full forward's when the cache works."""
    with torch.no_grad():
        steps = [model(x[:, :prompt], kv_cache=kv_cache, use_triton=use_triton)]
        steps += [
            model(x[:, i : i + 1], kv_cache=kv_cache, use_triton=use_triton)
            for i in range(prompt, x.shape[1])
        ]
    return torch.cat(steps, dim=1)


def check_state_dict_round_trip(make, tmp_path, device, vocab: int, **options):
    """A model of `options` after one Triton AdamW step, saved; fresh models loading it give
    its logits: PyTorch ops on the CPU, Triton where its kernels run (the interpreter, or the
    GPU). make(device, seed=..., **kwargs) builds a model. Returns the trained model."""
    trained = make(device, seed=1, **options)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    x = torch.randint(0, vocab, (2, 12), device=device)
    trained(x, labels=x, use_triton=True).backward()
    opt.step()
    path = tmp_path / "model.pt"
    torch.save(trained.state_dict(), path)
    for use_triton, where in ((False, "cpu"), (True, device)):
        fresh = make(where, seed=2, use_triton=use_triton, **options)
        fresh.load_state_dict(torch.load(path, map_location=where))
        torch.testing.assert_close(fresh(x.to(where)).cpu(), trained(x).cpu(), rtol=1e-4, atol=1e-4)
    return trained


def check_graphed_decode(net, new_tokens: int, against_uncached: bool = False):
    """Greedy generation of `new_tokens` after a 50-token prompt, the decode step replayed as
    a CUDA graph, equals the eager cached decode bit for bit (and, against_uncached,
    generation without the cache)."""
    from triton_transformer.autoregressive_wrapper import AutoregressiveWrapper

    with torch.no_grad():
        net.to_logits.weight.mul_(20)  # far from ties
    model = AutoregressiveWrapper(net)
    prompt = torch.randint(0, net.num_tokens, (2, 50), device=next(net.parameters()).device)
    kw = dict(temperature=0.0, use_triton=True)
    eager = model.generate(prompt, new_tokens, cuda_graph=False, **kw)
    graphed = model.generate(prompt, new_tokens, cuda_graph=True, **kw)
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0)
    if against_uncached:
        reference = model.generate(prompt, new_tokens, temperature=0.0, use_kv_cache=False)
        torch.testing.assert_close(graphed, reference, rtol=0, atol=0)


def check_greedy_cached_generation(net, vocab: int):
    """Greedy generation through the KV cache (and past max_seq_len its sliding window)
    equals generation without the cache."""
    from triton_transformer.autoregressive_wrapper import AutoregressiveWrapper

    with torch.no_grad():
        net.to_logits.weight.mul_(20)  # far from ties
    model = AutoregressiveWrapper(net)
    prompt = torch.randint(0, vocab, (2, 12), device=next(net.parameters()).device)
    cached = model.generate(prompt, 6, temperature=0.0, use_triton=True)
    uncached = model.generate(prompt, 6, temperature=0.0, use_kv_cache=False)
    torch.testing.assert_close(cached, uncached)
