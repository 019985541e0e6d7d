"""The modern-block options of `Transformer` (pos_emb, norm, ff_act, qk_norm): defaults leave
the classic model unchanged, every option trains on CPU with the Triton and PyTorch branches
agreeing step by step, state dicts round-trip across branches, and the KV-cache decode with
rotary embeddings (KVCache and StaticKVCache, positions on the device) equals the full
forward."""

import pytest
import torch
from _modern_helpers import (
    LLAMA,
    check_graphed_decode,
    check_greedy_cached_generation,
    check_state_dict_round_trip,
    decode_in_steps,
    train_both_branches,
)

from triton_transformer.rmsnorm import RMSNorm
from triton_transformer.transformer import KVCache, StaticKVCache, Transformer

VOCAB, MAX_LEN = 48, 16
SMALL = dict(num_tokens=VOCAB, dim=32, max_seq_len=MAX_LEN, depth=2, heads=2, dim_head=16)

# Every pair of two options' values appears in at least one combination (6 rows cover the
# 3 x 2 pairs of ff_act with each other option); LLAMA itself trains in the round-trip test.
COMBOS = [
    dict(),
    dict(pos_emb="rope", norm="rmsnorm", ff_act="relu2", qk_norm=True),
    dict(pos_emb="learned", norm="rmsnorm", ff_act="swiglu", qk_norm=True),
    dict(pos_emb="rope", norm="layernorm", ff_act="swiglu", qk_norm=False),
    dict(pos_emb="learned", norm="layernorm", ff_act="gelu", qk_norm=True),
    dict(pos_emb="rope", norm="rmsnorm", ff_act="gelu", qk_norm=False),
]


def _ids(combo: dict) -> str:
    return "-".join(str(v) for v in combo.values()) or "defaults"


def make(device="cpu", seed=0, **kwargs) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(**{**SMALL, "causal": True, **kwargs}).to(device)


def test_defaults_are_the_classic_model():
    # same parameters, names and shapes as before the options existed, and the explicit
    # defaults build the identical model (same initialisation, bit for bit)
    model = make()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {"token_emb.weight": (VOCAB, 32), "pos_emb.weight": (MAX_LEN, 32),
                "norm.weight": (32,), "to_logits.weight": (VOCAB, 32)}  # fmt: skip
    for i in range(2):
        expected |= {f"layers.{i}.0.norm.weight": (32,), f"layers.{i}.0.to_qkv.weight": (96, 32),
                     f"layers.{i}.0.to_out.weight": (32, 32), f"layers.{i}.1.norm.weight": (32,),
                     f"layers.{i}.1.proj_in.weight": (128, 32),
                     f"layers.{i}.1.proj_out.weight": (32, 128)}  # fmt: skip
    assert shapes == expected
    assert model.norm.stable and not isinstance(model.layers[0][0].norm, RMSNorm)
    explicit = make(pos_emb="learned", norm="layernorm", ff_act="relu2", qk_norm=False)
    for (k, a), b in zip(model.state_dict().items(), explicit.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    x = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(model(x), explicit(x))


def test_llama_options_parameters():
    model = make(**LLAMA)
    keys = set(model.state_dict())
    assert "pos_emb.weight" not in keys and model.pos_emb is None
    assert {"layers.0.0.q_norm.weight", "layers.0.0.k_norm.weight"} <= keys
    assert model.state_dict()["layers.0.0.q_norm.weight"].shape == (16,)
    assert model.state_dict()["layers.1.1.proj_in.weight"].shape == (2 * 128, 32)
    assert isinstance(model.norm, RMSNorm) and isinstance(model.layers[1][1].norm, RMSNorm)
    assert model.options == {**LLAMA, "rope_base": 10000.0}


@pytest.mark.parametrize("combo", COMBOS, ids=_ids)
def test_trains_with_both_branches_agreeing(combo, device):
    # two copies from one initialisation, two AdamW steps each: the Triton and PyTorch
    # branches give the same losses, and the same parameters after the steps (one layer:
    # the interpreter is slow; the decode tests below run two)
    train_both_branches([make(device, depth=1, **combo) for _ in range(2)], VOCAB)


@pytest.mark.parametrize("ff_act", ["swiglu", "gelu"])
def test_dropout_paths_run(ff_act, device):
    # the feed-forward dropout after swiglu / gelu (the dropout op, seeded on the device)
    model = make(device, depth=1, ff_act=ff_act, pos_emb="rope", ff_dropout=0.3, attn_dropout=0.1)
    x = torch.randint(0, VOCAB, (2, 10), device=device)
    loss = model(x[:, :-1], labels=x[:, 1:], use_triton=True)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    model.eval()  # no dropout: both branches agree
    torch.testing.assert_close(model(x, use_triton=True), model(x), rtol=1e-4, atol=1e-4)


def test_state_dict_round_trip(tmp_path, device):
    trained = check_state_dict_round_trip(make, tmp_path, device, VOCAB, **LLAMA)
    with pytest.raises(RuntimeError, match=r"pos_emb\.weight"):
        make().load_state_dict(trained.state_dict())  # the classic model has a table


@pytest.mark.parametrize("cache", ["KVCache", "StaticKVCache"])
@pytest.mark.parametrize("use_triton", [False, True])
def test_rope_decode_with_cache_matches_full_forward(cache, use_triton, device):
    # the prompt in one call, then one token a step: each step's logits equal the full
    # forward's at that position (rotated cached keys, cache positions on the device)
    model = make(device, **LLAMA).eval()
    x = torch.randint(0, VOCAB, (2, 9), device=device)
    with torch.no_grad():
        full = model(x, use_triton=use_triton)
    kv = KVCache() if cache == "KVCache" else StaticKVCache()
    torch.testing.assert_close(
        decode_in_steps(model, x, kv, use_triton), full, rtol=1e-4, atol=1e-4
    )


def test_rope_generate_cache_and_window_match_reference(device):
    # greedy generation through the cache, then past max_seq_len through the sliding window
    check_greedy_cached_generation(make(device, **LLAMA), VOCAB)


def test_option_validation():
    for kwargs, match in (
        (dict(pos_emb="alibi"), "pos_emb must be one of"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(ff_act="relu"), "ff_act must be one of"),
        (dict(rope_base=0), "rope_base"),
    ):
        with pytest.raises(ValueError, match=match):
            make(**kwargs)
    with pytest.raises(TypeError, match="qk_norm"):
        make(qk_norm="yes")


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_llama_block_trains_and_compiles(device):
    cfg = dict(num_tokens=256, dim=256, max_seq_len=256, depth=2, heads=4, dim_head=64)
    model = Transformer(causal=True, use_triton=True, check_token_ids=False, **cfg, **LLAMA)
    model = model.to(device)
    x = torch.randint(0, 256, (4, 257), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(x[:, :-1], labels=x[:, 1:])
        explanation = torch._dynamo.explain(lambda x: model(x[:, :-1], labels=x[:, 1:]))(x)
        compiled = torch.compile(model)(x[:, :-1], labels=x[:, 1:])
        reference = model(x[:, :-1], labels=x[:, 1:], use_triton=False)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(reference, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_llama_graphed_decode_matches_eager(device):
    cfg = dict(num_tokens=256, dim=256, max_seq_len=128, depth=2, heads=4, dim_head=64)
    net = Transformer(causal=True, **cfg, **LLAMA).to(device)
    check_graphed_decode(net, 100)
