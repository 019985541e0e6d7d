"""Next-token training loss and sampling for a causal `Transformer`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from triton_transformer.bmm import reuse_weight_casts
from triton_transformer.cuda_graph import GraphedStep
from triton_transformer.transformer import KVCache, StaticKVCache
from triton_transformer.utils import default, exists

__all__ = ["AutoregressiveWrapper", "top_k"]


def top_k(logits: torch.Tensor, thres: float = 0.9) -> torch.Tensor:
    """Keep the k = max(1, int((1 - thres) * V)) largest logits of each row, the rest -inf.

    logits: (..., V) -> (..., V).
    """
    k = max(1, int((1 - thres) * logits.shape[-1]))
    val, ind = logits.topk(k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter_(-1, ind, val)


class _CachedDecode:
    """Feeds a generation to the net through a `KVCache`: each call passes only the tokens
    the cache has not seen and returns the last position's logits (b, V)."""

    def __init__(self, net: nn.Module, kwargs: dict) -> None:
        self.net, self.kwargs = net, kwargs
        self.cache = KVCache()

    @property
    def length(self) -> int:
        return self.cache.length

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x, kv_cache=self.cache, **self.kwargs)[:, -1]


@contextlib.contextmanager
def _ids_unchecked(net: nn.Module) -> Iterator[None]:
    """Skip the net's token-id range check: it reads the device, which capture forbids, and
    a sampled id is in range by construction."""
    checked = net.check_token_ids
    net.check_token_ids = False
    try:
        yield
    finally:
        net.check_token_ids = checked


class _GraphedDecode:
    """Feeds a generation to the net through a `StaticKVCache`: the prompt in one eager call,
    then every one-token step as a replay of one captured CUDA graph (after two eager
    warm-up steps). A step's host cost is then one graph launch instead of a launch per
    kernel, which is what limits decoding a small model."""

    def __init__(self, net: nn.Module, batch: int, device: torch.device, kwargs: dict) -> None:
        self.net, self.kwargs = net, kwargs
        self.cache = StaticKVCache()
        self.length = 0  # tokens fed so far, counted on the host
        self.token = torch.empty(size=(batch, 1), dtype=torch.long, device=device)
        self.step = GraphedStep(self._step, warmup_steps=2)

    def _step(self) -> torch.Tensor:
        with _ids_unchecked(self.net):
            return self.net(self.token, kv_cache=self.cache, **self.kwargs)[:, -1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.length == 0:  # the prompt: any length, once
            logits = self.net(x, kv_cache=self.cache, **self.kwargs)[:, -1]
        else:
            self.token.copy_(x)  # x is (b, 1): the token sampled last
            logits = self.step()  # the graph's output: read it before the next step
        self.length += x.shape[1]
        return logits


class AutoregressiveWrapper(nn.Module):
    """Wraps a causal `Transformer` for next-token training (`forward`) and sampling (`generate`).

    ignore_index: label id left out of the training loss (None: nothing ignored).
    pad_value: fills `generate`'s output after a sequence's eos token (None: the eos token,
        so every position from the first eos on holds eos).
    """

    def __init__(
        self, net: nn.Module, ignore_index: int | None = None, pad_value: int | None = None
    ) -> None:
        super().__init__()
        if not getattr(net, "causal", False):
            raise ValueError("AutoregressiveWrapper needs a causal net (Transformer(causal=True))")
        self.net = net
        self.max_seq_len: int = net.max_seq_len
        self.ignore_index = ignore_index
        self.pad_value = pad_value

    def forward(self, seq: torch.Tensor, **kwargs) -> torch.Tensor:
        """Mean next-token cross-entropy of seq (b, n), n >= 2: the net reads seq[:, :-1] and
        predicts seq[:, 1:]. kwargs go to the net (e.g. use_triton)."""
        if not isinstance(seq, torch.Tensor) or seq.ndim != 2 or seq.shape[1] < 2:
            shape = tuple(seq.shape) if isinstance(seq, torch.Tensor) else type(seq).__name__
            raise ValueError(f"seq must have shape (batch, n) with n >= 2, got {shape}")
        kwargs.setdefault("ignore_index", self.ignore_index)
        return self.net(seq[:, :-1], labels=seq[:, 1:], **kwargs)

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        length: int,
        temperature: float = 1.0,
        filter_thres: float = 0.9,
        eos_token: int | None = None,
        *,
        use_kv_cache: bool = True,
        cuda_graph: bool | None = None,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Sample `length` tokens following `prompt`; returns only the new tokens.

        prompt: (b, n) integer ids, or (n,) for a single sequence; n >= 1.
        Returns (b, length), or (length,) for a 1-D prompt.

        Each step keeps the top-k logits (`top_k(logits, filter_thres)`), divides by
        `temperature` and samples; temperature 0 picks the argmax (greedy, no randomness).
        With `eos_token`, a sequence stops at its first eos: later positions hold `pad_value`
        (default eos), and sampling ends once every sequence has produced eos.
        Reproducible under `torch.manual_seed` or with `generator` (on the prompt's device).

        Runs in eval mode (the previous mode is restored) without autograd. While the
        sequence fits in max_seq_len, each step feeds only the new token through a KV cache
        (`use_kv_cache=False` recomputes the whole prefix each step, for checking); past that,
        each step recomputes over the last max_seq_len tokens (sliding window). kwargs go to
        the net (e.g. use_triton).

        cuda_graph: run the cached one-token steps as replays of one captured CUDA graph
        (a `StaticKVCache` holds the length on the device). None: on whenever the KV cache is
        used on a CUDA device. The logits match the eager cached steps to rounding.
        """
        if not isinstance(prompt, torch.Tensor) or prompt.ndim not in (1, 2):
            raise ValueError("prompt must be a (batch, n) or (n,) tensor of token ids")
        if prompt.shape[-1] == 0 or prompt.numel() == 0:
            raise ValueError("prompt must hold at least one token per sequence")
        if not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be a non-negative int, got {length!r}")
        if not 0.0 <= temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {temperature!r}")
        if not 0.0 <= filter_thres <= 1.0:
            raise ValueError(f"filter_thres must be in [0, 1], got {filter_thres!r}")
        num_tokens = self.net.num_tokens
        if exists(eos_token) and not (isinstance(eos_token, int) and 0 <= eos_token < num_tokens):
            raise ValueError(f"eos_token must be an id in [0, {num_tokens}), got {eos_token!r}")

        is_1d = prompt.ndim == 1
        prompt = prompt[None] if is_1d else prompt
        was_training = self.net.training
        self.net.eval()
        try:
            sample_args = (temperature, filter_thres, generator)
            if cuda_graph is None:
                cuda_graph = use_kv_cache and prompt.is_cuda
            if cuda_graph and not prompt.is_cuda:
                raise ValueError(
                    f"cuda_graph=True needs a prompt on a CUDA device, not {prompt.device}"
                )
            decode = (cuda_graph, use_kv_cache)
            # one bf16 copy of each weight under autocast, all made at the first cast
            with reuse_weight_casts(self.net):
                out = self._generate(prompt, length, eos_token, decode, sample_args, kwargs)
        finally:
            self.net.train(was_training)
        return out[0] if is_1d else out

    def _generate(
        self,
        prompt: torch.Tensor,
        length: int,
        eos_token: int | None,
        decode: tuple[bool, bool],
        sample_args: tuple,
        kwargs: dict,
    ) -> torch.Tensor:
        b, t = prompt.shape
        seq = prompt.new_empty(b, t + length)  # prompt, then the tokens sampled so far
        seq[:, :t] = prompt
        cuda_graph, use_kv_cache = decode
        cached = None
        if use_kv_cache and t <= self.max_seq_len:
            cached = (
                _GraphedDecode(self.net, b, prompt.device, kwargs)
                if cuda_graph
                else _CachedDecode(self.net, kwargs)
            )
        done = torch.zeros(b, dtype=torch.bool, device=prompt.device)

        cur = t
        for _ in range(length):
            if exists(cached) and cur <= self.max_seq_len:
                # feed only what the cache has not seen: the prompt, then one token a step
                logits = cached(seq[:, cached.length : cur])
            else:
                # positions are absolute, so a window that slides needs a full recompute
                cached = None
                logits = self.net(seq[:, max(0, cur - self.max_seq_len) : cur], **kwargs)[:, -1]
            sample = self._pick(logits, *sample_args)
            if exists(eos_token):
                # finished sequences keep emitting eos (a valid id to feed back)
                sample = sample.masked_fill(done, eos_token)
                done |= sample == eos_token
            seq[:, cur] = sample
            cur += 1
            if exists(eos_token) and done.all():
                break

        out = seq[:, t:]
        if exists(eos_token):
            out[:, cur - t :] = eos_token  # steps skipped after every sequence ended
            pad = default(self.pad_value, eos_token)
            if pad != eos_token:
                is_eos = out == eos_token
                after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
                out = out.masked_fill(after_eos, pad)
        return out

    @staticmethod
    def _pick(
        logits: torch.Tensor,
        temperature: float,
        filter_thres: float,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """Next token (b,) from the last position's logits (b, V)."""
        if temperature == 0:
            return logits.argmax(dim=-1)
        logits = top_k(logits.float(), filter_thres) / temperature
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
