"""Transformer: shapes, loss, masking, causality, Triton/PyTorch parity, KV cache, errors.

Triton runs in the CPU interpreter here, so the models are tiny.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import triton_transformer.transformer as tt
from triton_transformer import checks
from triton_transformer.embedding import TokenIdError
from triton_transformer.layernorm import LayerNorm
from triton_transformer.transformer import KVCache, StaticKVCache, Transformer

VOCAB = 32


def make_model(device, **kwargs) -> Transformer:
    cfg = dict(num_tokens=VOCAB, dim=32, max_seq_len=16, depth=2, heads=2, dim_head=16)
    cfg.update(kwargs)
    return Transformer(**cfg).to(device)


def tokens(device, b=2, n=12, vocab=VOCAB):
    return torch.randint(0, vocab, (b, n), device=device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# --- forward and loss -------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_logits_shape_and_loss(device, causal):
    model = make_model(device, causal=causal)
    x, labels = tokens(device), tokens(device)
    logits = model(x)
    assert logits.shape == (2, 12, VOCAB)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()

    loss = model(x, labels=labels)
    assert loss.shape == ()
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


def test_init_loss_is_near_uniform(device):
    # nanoGPT-style init: logits start small, so the loss is about log(V)
    model = make_model(device, num_tokens=256, depth=4)
    x = tokens(device, vocab=256)
    loss = model(x, labels=tokens(device, vocab=256))
    assert abs(loss.item() - math.log(256)) < 0.1


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_ignore_index(device, ignore_index):
    model = make_model(device, causal=True)
    x, labels = tokens(device), tokens(device)
    labels[0, :5] = ignore_index
    labels[1, -2:] = ignore_index
    logits = model(x)
    loss = model(x, labels=labels, ignore_index=ignore_index)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    # the ignored positions really are left out: the unignored mean differs
    if ignore_index >= 0:
        assert not torch.allclose(model(x, labels=labels), loss)


def test_int32_tokens(device):
    model = make_model(device)
    x = tokens(device)
    torch.testing.assert_close(model(x.int()), model(x))


def test_padding_mask_hides_padded_keys(device):
    model = make_model(device, causal=False)
    x = tokens(device)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, 8:] = False
    mask[1, 3:5] = False  # padding need not be at the end
    x2 = x.clone()
    x2[~mask] = (x2[~mask] + 1) % VOCAB  # change only the padded tokens

    out, out2 = model(x, mask=mask), model(x2, mask=mask)
    torch.testing.assert_close(out[mask], out2[mask], rtol=1e-5, atol=1e-6)
    # without the mask the real tokens do see the change (so the check above has teeth)
    assert not torch.allclose(model(x)[mask], model(x2)[mask], rtol=1e-5, atol=1e-6)


def test_causal_model_ignores_future_tokens(device):
    model = make_model(device, causal=True)
    x = tokens(device)
    j = 7
    x2 = x.clone()
    x2[:, j] = (x2[:, j] + 1) % VOCAB
    out, out2 = model(x), model(x2)
    torch.testing.assert_close(out[:, :j], out2[:, :j])
    assert not torch.allclose(out[:, j:], out2[:, j:])


def test_dropout_only_in_training(device):
    model = make_model(device, attn_dropout=0.3, ff_dropout=0.3)
    x = tokens(device)
    model.train()
    assert not torch.allclose(model(x), model(x))
    model.eval()
    out = model(x)
    torch.testing.assert_close(model(x), out)
    # eval with dropout equals the same weights without dropout
    plain = make_model(device)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(plain(x), out)


# --- Triton vs PyTorch ------------------------------------------------------------------


def test_state_dict_is_independent_of_use_triton(device):
    a = make_model(device, use_triton=True)
    b = make_model(device, use_triton=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(sa[k].shape == sb[k].shape for k in sa)
    # bias-free model: no bias anywhere
    assert not any("bias" in k for k in sa)


def run_model(base, dtype, use_triton, x, mask, labels):
    """A copy of `base` in `dtype`: its logits, loss and parameter gradients (float64)."""
    model = copy.deepcopy(base).to(dtype)
    model.use_triton = use_triton  # the constructor's default flag, used by every call
    logits = model(x, mask)
    loss = model(x, mask, labels=labels, ignore_index=-100)
    loss.backward()
    keep = (lambda t: t[mask]) if mask is not None else (lambda t: t)  # real tokens only
    return [keep(logits).double(), loss.double()] + [p.grad.double() for p in model.parameters()]


def check_triton_parity(device, cfg, dtype, causal, b, n):
    """Triton vs PyTorch paths of one model, both vs a float64 PyTorch reference."""
    base = make_model(device, causal=causal, **cfg)
    vocab = cfg["num_tokens"]
    x, labels = tokens(device, b, n, vocab), tokens(device, b, n, vocab)
    labels[0, 0] = -100
    mask = None
    if not causal:
        mask = torch.ones_like(x, dtype=torch.bool)
        mask[-1, n // 2 + 1 :] = False
        labels[~mask] = -100

    ref = run_model(base, torch.float64, False, x, mask, labels)
    tri = run_model(base, dtype, True, x, mask, labels)
    pt = run_model(base, dtype, False, x, mask, labels)
    names = ["logits", "loss"] + [name for name, _ in base.named_parameters()]
    eps = torch.finfo(dtype).eps
    for name, a_tri, a_pt, a_ref in zip(names, tri, pt, ref, strict=True):
        assert torch.isfinite(a_tri).all(), name
        err_tri, err_pt = rel_err(a_tri, a_ref), rel_err(a_pt, a_ref)
        # as accurate as PyTorch in the same dtype, up to a floor of a few rounding units
        # (the ratio alone is noisy where PyTorch happens to be almost exact)...
        assert err_tri < max(3 * err_pt, 8 * eps, 1e-5), (name, err_tri, err_pt)
        # ...and close in absolute terms
        if dtype == torch.float32:
            assert rel_err(a_tri, a_pt) < 1e-4, name
        else:
            assert err_tri < 32 * eps, (name, err_tri)


@pytest.mark.parametrize("attn_impl", ["flash", "naive"])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_matches_pytorch(device, causal, attn_impl):
    """Logits, loss and every parameter gradient agree between the two paths (fp32, no
    dropout) and with a float64 reference."""
    cfg = dict(num_tokens=48, dim=32, max_seq_len=8, depth=2, heads=2, dim_head=16)
    check_triton_parity(device, {**cfg, "attn_impl": attn_impl}, torch.float32, causal, b=2, n=8)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_and_naive_compute_the_same_function(device, causal):
    # same parameters, same function; a fully padded row (all outputs meaningless but finite)
    flash = make_model(device, causal=causal)
    naive = make_model(device, causal=causal, attn_impl="naive")
    naive.load_state_dict(flash.state_dict())
    x = tokens(device)
    mask = None
    if not causal:
        mask = torch.ones_like(x, dtype=torch.bool)
        mask[0, 5:] = False
        mask[1] = False
    for use_triton in (False, True):
        a = flash(x, mask, use_triton=use_triton)
        b = naive(x, mask, use_triton=use_triton)
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        assert rel_err(a, b) < 1e-5, use_triton


def test_attn_impl_is_checked(device):
    with pytest.raises(ValueError, match="attn_impl"):
        make_model(device, attn_impl="fast")


def test_token_id_check_refuses_stream_capture(device, monkeypatch):
    # The check reads a flag back from the device: under CUDA graph capture it must raise a
    # clear error instead of syncing (simulated here on any machine).
    import triton_transformer.utils as utils_mod

    monkeypatch.setattr(utils_mod, "_CUDA_BUILT", True)  # (a CPU build: no stream to ask)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    model = make_model(device)
    with pytest.raises(RuntimeError, match="check_token_ids=False"):
        model(tokens(device))
    model.check_token_ids = False
    assert model(tokens(device)).shape == (2, 12, VOCAB)


def test_triton_built_model_loads_into_pytorch_model(device):
    cfg = dict(num_tokens=48, dim=32, max_seq_len=8, depth=1, heads=2, dim_head=16)
    tri = make_model(device, causal=True, use_triton=True, **cfg)
    ref = make_model(device, causal=True, use_triton=False, **cfg)
    ref.load_state_dict(tri.state_dict())
    x = tokens(device, n=8, vocab=48)
    assert rel_err(tri(x), ref(x)) < 1e-5


@pytest.mark.parametrize("attn_impl", ["flash", "naive"])
def test_use_triton_flag_reaches_every_op(device, monkeypatch, attn_impl):
    """The constructor flag is the default; a per-call flag overrides it, for every op."""
    seen = []

    def spy(name, fn):
        def wrapped(*args, use_triton, **kwargs):
            seen.append((name, use_triton))
            return fn(*args, use_triton=False, **kwargs)  # stay on the fast path

        return wrapped

    attn_op = "attention_packed" if attn_impl == "flash" else "attention_naive"
    # (the feed-forward's dropout runs inside its `linear`: the relu² epilogue)
    for name in ("linear", attn_op, "cross_entropy", "linear_cross_entropy"):
        monkeypatch.setattr(tt, name, spy(name, getattr(tt, name)))
    monkeypatch.setattr(LayerNorm, "forward", spy("layernorm", LayerNorm.forward))

    model = make_model(device, depth=1, causal=True, use_triton=True, attn_impl=attn_impl)
    x = tokens(device)
    for call_flag, expected in [(None, True), (False, False), (True, True)]:
        seen.clear()
        model(x, labels=x, use_triton=call_flag)
        # the Triton path's loss is the fused projection + cross entropy (fused_loss)
        loss_op = "linear_cross_entropy" if expected else "cross_entropy"
        assert {name for name, _ in seen} == {"linear", attn_op, loss_op, "layernorm"}
        assert all(flag is expected for _, flag in seen), seen


# --- KV cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("cache_cls", [KVCache, StaticKVCache])
@pytest.mark.parametrize(
    "use_triton, attn_impl", [(False, "flash"), (True, "flash"), (True, "naive")]
)
def test_kv_cache_matches_full_forward(device, use_triton, attn_impl, cache_cls):
    """KVCache, and StaticKVCache (its length on the device: a graphed decode step's): a run
    fed in chunks gives the full forward's logits; after reset the buffers start over."""
    n = 10 if not use_triton else 6
    model = make_model(
        device, causal=True, max_seq_len=12, use_triton=use_triton, attn_impl=attn_impl
    ).eval()
    x = tokens(device, n=n)
    with torch.no_grad():
        full = model(x)
        cache = cache_cls()
        chunks = [3, 1, 2] + [1] * (n - 6)  # a multi-token prompt, then steps of 1 and 2
        outs, start = [], 0
        for size in chunks:
            outs.append(model(x[:, start : start + size], kv_cache=cache))
            start += size
            assert int(cache.length) == start
        assert len(cache.keys) == 2 and cache.keys[0].shape == (2, 2, 12, 16)
        assert rel_err(torch.cat(outs, dim=1), full) < 1e-5
        cache.reset()
        assert rel_err(model(x[:, :4], kv_cache=cache), full[:, :4]) < 1e-5


@pytest.mark.parametrize("cache_cls", [KVCache, StaticKVCache])
def test_kv_cache_errors(device, cache_cls):
    model = make_model(device, causal=True, max_seq_len=8)
    cache = cache_cls()
    with torch.no_grad():
        model(tokens(device, n=6), kv_cache=cache)
        with pytest.raises(ValueError, match="max_seq_len"):
            model(tokens(device, n=9), kv_cache=cache)
        if cache_cls is KVCache:  # its length is a host value, so the sum is checked too
            with pytest.raises(ValueError, match="max_seq_len"):
                model(tokens(device, n=3), kv_cache=cache)
        with pytest.raises(ValueError, match="batch size"):
            model(tokens(device, b=3, n=1), kv_cache=cache)
        assert int(cache.length) == 6  # failed calls leave the cache as it was
        with pytest.raises(ValueError, match="different shape"):
            make_model(device, causal=True, max_seq_len=8, depth=1)(
                tokens(device, n=1), kv_cache=cache
            )
        with pytest.raises(ValueError, match="different shape"):
            make_model(device, causal=True, max_seq_len=8, depth=3)(
                tokens(device, n=1), kv_cache=cache
            )
        with pytest.raises(ValueError, match="causal"):
            make_model(device, causal=False)(tokens(device, n=1), kv_cache=cache_cls())
        cache.reset()
        model(tokens(device, n=8), kv_cache=cache)  # reset frees the whole length again


# --- errors -----------------------------------------------------------------------------


def test_errors(device):
    model = make_model(device, max_seq_len=16)
    causal = make_model(device, causal=True)
    x = tokens(device)

    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(device, n=17))
    for bad in (-1, VOCAB):
        x_bad = x.clone()
        x_bad[1, 3] = bad
        with pytest.raises(ValueError, match="token ids outside"):
            model(x_bad)
    labels = x.clone()
    labels[0, 0] = VOCAB
    with pytest.raises(ValueError, match="labels"):
        model(x, labels=labels)
    labels[0, 0] = -100  # fine once it is the ignore_index
    model(x, labels=labels, ignore_index=-100)

    with pytest.raises(ValueError, match="mask"):
        causal(x, torch.ones_like(x, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask shape"):
        model(x, torch.ones(2, 11, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="bool"):
        model(x, torch.ones_like(x))
    with pytest.raises(ValueError, match="labels shape"):
        model(x, labels=x[:, :-1])
    with pytest.raises(ValueError, match="integer"):
        model(x, labels=x.float())
    with pytest.raises(ValueError, match="integer"):
        model(x.float())
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        model(x[0])
    with pytest.raises(ValueError, match="at least one token"):
        model(x[:, :0])
    with pytest.raises(ValueError, match="dim"):
        Transformer(num_tokens=8, dim=0, max_seq_len=4, depth=1)
    with pytest.raises(ValueError, match="attn_dropout"):
        Transformer(num_tokens=8, dim=8, max_seq_len=4, depth=1, attn_dropout=1.0)


def test_token_id_check_can_be_turned_off(device):
    if device != "cpu":
        pytest.skip("an out-of-range id is a device-side assert on CUDA")
    model = make_model(device, check_token_ids=False)
    x = tokens(device)
    x[0, 0] = VOCAB
    with pytest.raises(IndexError):  # the embedding's own error, not the model's check
        model(x)


def _spy_range_checks(monkeypatch) -> list:
    """Record each forward's choice: ("sync", whether _check_inputs checks the ranges), then
    the check flag the embedding and the loss are called with."""
    flags = []
    check_inputs = Transformer._check_inputs
    monkeypatch.setattr(
        Transformer, "_check_inputs",
        lambda self, *a: flags.append(("sync", a[-1])) or check_inputs(self, *a),
    )  # fmt: skip
    for name, flag in (("embedding", "check_ids"), ("linear_cross_entropy", "check_labels"),
                       ("cross_entropy", "check_labels")):  # fmt: skip
        op = getattr(tt, name)
        spy = lambda *a, _op=op, _flag=flag, **k: flags.append(k[_flag]) or _op(*a, **k)
        monkeypatch.setattr(tt, name, spy)
    return flags


@pytest.mark.parametrize("fused", [True, False])
def test_triton_model_leaves_the_range_checks_to_its_ops(device, monkeypatch, fused):
    # An eager Triton call with labels leaves the id and label checks to its embedding and
    # loss, which check after their kernels (on a GPU a later call or raise_pending raises,
    # on the CPU the call itself), with the errors the PyTorch path gives
    model = make_model(device, use_triton=True, causal=True, fused_loss=fused, cuda_graphs=False)
    x, labels = tokens(device), tokens(device)
    model(x, labels=labels).backward()  # (the first call makes the checks' slots)
    flags = _spy_range_checks(monkeypatch)
    no_sync = device == "cuda" and fused  # (the unfused loss's in-place backward checks first)
    if no_sync:
        torch.cuda.set_sync_debug_mode("error")  # a forward that syncs raises
    try:
        loss = model(x, labels=labels)
    finally:
        if no_sync:
            torch.cuda.set_sync_debug_mode(0)
    assert flags == [("sync", False), True, True] and torch.isfinite(loss)

    bad_x = x.clone()
    bad_x[1, 3] = VOCAB
    with pytest.raises(TokenIdError, match=f"found id {VOCAB}") as info:
        model(bad_x, labels=labels)
        checks.raise_pending()
    assert isinstance(info.value, ValueError) and isinstance(info.value, IndexError)
    bad_labels = labels.clone()
    bad_labels[0, 0] = -1
    with pytest.raises(ValueError, match="labels must lie in"):
        model(x, labels=bad_labels)
        bad_labels.copy_(labels)  # a label buffer refilled in place before the check resolves
        checks.raise_pending()
    bad_labels[0, 0] = -1
    model(x, labels=bad_labels, ignore_index=-1)  # fine once it is the ignore_index
    checks.raise_pending()


def test_triton_model_checks_logits_and_cached_calls_first(device, monkeypatch):
    # A call that returns logits (a sampler would stop at a device-side assert on NaN ones)
    # or feeds a KV cache (a bad id's NaN keys would stay there) checks its ids first
    model = make_model(device, use_triton=True, causal=True)
    flags = _spy_range_checks(monkeypatch)
    x = tokens(device)
    model(x)
    model(x[:, :4], kv_cache=KVCache())
    assert flags == [("sync", True), False, ("sync", True), False]
    x[0, 2] = VOCAB
    with pytest.raises(TokenIdError, match="token ids outside"):
        model(x)
    cache = KVCache()
    with pytest.raises(TokenIdError, match="token ids outside"):
        model(x[:, :4], kv_cache=cache)
    assert cache.length == 0  # nothing was written


def test_pytorch_model_checks_ids_first(device):
    # The PyTorch path checks before its ops (F.embedding would hit a device-side assert),
    # raising the same TokenIdError
    model = make_model(device)
    x = tokens(device)
    x[0, 1] = -3
    with pytest.raises(TokenIdError, match="token ids outside") as info:
        model(x)
    assert isinstance(info.value, IndexError)


# --- realistic shapes on a GPU ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_matches_pytorch_gpu(device, dtype, causal):
    """enwik8-sized model, fp32/fp16/bf16."""
    cfg = dict(num_tokens=256, dim=512, max_seq_len=512, depth=4, heads=8, dim_head=64)
    check_triton_parity(device, cfg, dtype, causal, b=4, n=512)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_matches_full_forward_gpu(dtype):
    cfg = dict(num_tokens=256, dim=512, max_seq_len=256, depth=4, heads=8, dim_head=64)
    model = Transformer(causal=True, use_triton=True, **cfg).cuda().to(dtype).eval()
    x = torch.randint(0, 256, (4, 256), device="cuda")
    with torch.no_grad():
        full = model(x).float()
        cache = KVCache()
        outs = [model(x[:, :200], kv_cache=cache)]
        outs += [model(x[:, i : i + 1], kv_cache=cache) for i in range(200, 256)]
    err = rel_err(torch.cat(outs, dim=1).float(), full)
    # a wrong position or a stale cache entry would be an O(1) error
    assert err < (1e-5 if dtype == torch.float32 else 32 * torch.finfo(dtype).eps)


def test_narrow_integer_ids_are_checked_without_wrapping(device):
    """uint8 ids and labels under a vocabulary larger than 256: the range check compares
    them in a wide dtype (in uint8, num_tokens 300 would wrap to 44 and flag valid ids, and
    an ignore_index of -100 to 156, which would let a label 156 pass as ignored)."""
    model = make_model(device, num_tokens=300)
    x = torch.randint(0, 256, (2, 12), device=device)
    x[0, 0], x[1, 1] = 200, 255  # above 300 % 256 = 44: flagged when the check wraps
    labels = torch.randint(0, 256, (2, 12), device=device)
    labels[0, 3], labels[1, 4] = 156, -100 % 256
    wide = model(x, labels=labels)
    narrow = model(x.to(torch.uint8), labels=labels.to(torch.uint8))
    assert torch.allclose(narrow, wide)
    # a label equal to ignore_index's wrapped value is an ordinary label, not an ignored one
    with_ignore = model(x.to(torch.uint8), labels=labels.to(torch.uint8), ignore_index=-100)
    assert torch.allclose(with_ignore, model(x, labels=labels, ignore_index=-100))
