"""A small GPT/BERT-style transformer whose every hot op can run as a Triton kernel.

Token embedding + learned absolute positional embedding, `depth` pre-norm residual blocks
(multi-head attention, then a relu-squared feed-forward), a final stable layernorm and a
bias-free projection to logits. All projections are bias-free and the norms have no bias.

Options (Transformer keyword arguments; the defaults are the model above, parameter for
parameter): `pos_emb="rope"` (rotary q/k embeddings, `rope.py`, instead of the learned table),
`norm="rmsnorm"` (RMSNorm everywhere, fused with the residual adds as LayerNorm is, and a plain
final RMSNorm), `ff_act="swiglu" | "gelu"` (silu(gate) * up with a 2·hidden input projection,
`swiglu.py`; or exact GELU, PyTorch's F.gelu on both branches: no Triton kernel) and
`qk_norm=True` (RMSNorm over head_dim of q and k before the rotation) and `kv_heads`
(grouped-query / multi-query attention: fewer key/value heads, each shared by a group of query
heads, in the kernels and the KV caches). Together: the Llama-style block.

`use_triton` only picks which implementation of each op runs (Triton kernel or the PyTorch
reference); the parameters, and so the state dict, are the same either way.

Incremental decoding: pass a `KVCache()` to `forward` of a causal model; each call appends
the new tokens' keys/values and attends over everything cached so far. A `StaticKVCache()`
does the same with its length on the device, so that a decode step can be a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from triton_transformer.attention import (
    attention,
    attention_cached,
    attention_naive,
    attention_packed,
)
from triton_transformer.block_graphs import BlockGraphs
from triton_transformer.bmm import linear
from triton_transformer.cross_entropy import cross_entropy
from triton_transformer.dropout import dropout
from triton_transformer.embedding import TokenIdError, embedding
from triton_transformer.layernorm import LayerNorm
from triton_transformer.linear_cross_entropy import linear_cross_entropy
from triton_transformer.mlp import relu2_mlp
from triton_transformer.residual_layernorm import residual_layernorm
from triton_transformer.rmsnorm import RMSNorm, residual_rmsnorm
from triton_transformer.rope import DEFAULT_BASE, rope
from triton_transformer.utils import check_not_capturing, default, draw_seeds, exists, is_traced

__all__ = ["ATTN_IMPLS", "KVCache", "StaticKVCache", "Transformer"]

ATTN_IMPLS = ("flash", "naive")
POS_EMBS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
FF_ACTS = ("relu2", "swiglu", "gelu")


@dataclass
class KVCache:
    """Keys and values of the tokens a causal `Transformer` has seen, for incremental decoding.

    Create it empty (`KVCache()`) and pass it to every `Transformer.forward` call of one
    generation. The first call allocates, per layer, key and value buffers of shape
    (batch, kv_heads, max_seq_len, dim_head) in the activations' dtype and device; each call
    writes its tokens at positions [length, length + n) and advances `length`. Positions at
    or past `length` hold stale data and are never read.

    Meant for inference (under `torch.no_grad()`): the buffers are written in place.
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    @property
    def batch_size(self) -> int | None:
        return self.keys[0].shape[0] if self.keys else None

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept for reuse)."""
        self.length = 0

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer `layer`'s new k, v (b, h, n, d) after the cached tokens.

        Returns that layer's keys and values for all length + n tokens, (b, h, length + n, d).
        `length` itself is advanced by the model once every layer has appended.
        """
        if layer == len(self.keys):  # first use of this layer: allocate its buffers
            shape = (*k.shape[:2], capacity, k.shape[-1])
            self.keys.append(k.new_empty(shape))
            self.values.append(v.new_empty(shape))
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class StaticKVCache:
    """A KV cache for CUDA-graphed decoding: fixed buffers, and the length on the device.

    Used like `KVCache` (pass it to every `Transformer.forward` of one generation), but the
    number of cached tokens is `length`, a 0-dim int64 tensor on the model's device that each
    forward reads and advances on the device. A forward over it therefore bakes in no host
    value that changes per step, and a decode step can be captured once and replayed
    (`AutoregressiveWrapper.generate(cuda_graph=True)`). Attention reads the buffers through
    `attention_cached`, whichever `attn_impl` the model has.

    The buffers are zero-filled when first allocated; `reset()` forgets every cached token.
    Since the length is a device value, a forward cannot check that it stays within
    max_seq_len: the caller keeps count (an out-of-range write fails in `index_copy_`).
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length: torch.Tensor | None = None  # tokens cached, before the current forward
        self._positions: torch.Tensor | None = None  # the current forward's tokens
        self._seen: torch.Tensor | None = None  # length + their number
        self.filled = False  # a forward has written every layer (a host flag, set once)

    @property
    def batch_size(self) -> int | None:
        return self.keys[0].shape[0] if self.keys else None

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept for reuse)."""
        if self.length is not None:
            self.length.zero_()

    def begin(self, n: int, device: torch.device) -> torch.Tensor:
        """Start a forward of n tokens; returns their positions (n,) int64 on the device."""
        if self.length is None:
            self.length = torch.zeros((), dtype=torch.int64, device=device)
        self._positions = self.length + torch.arange(n, device=device)
        self._seen = self.length + n
        return self._positions

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write layer `layer`'s new k, v (b, h, n, d) at the current positions.

        Returns the whole buffers (b, h, capacity, d) and the number of real positions in
        them (0-dim device tensor), for `attention_cached`.
        """
        if layer == len(self.keys):  # first use of this layer: allocate its buffers
            shape = (*k.shape[:2], capacity, k.shape[-1])
            self.keys.append(k.new_zeros(shape))
            self.values.append(v.new_zeros(shape))
        self.keys[layer].index_copy_(2, self._positions, k)
        self.values[layer].index_copy_(2, self._positions, v)
        return self.keys[layer], self.values[layer], self._seen

    def finish(self) -> None:
        """Advance `length` past the current forward's tokens (on the device)."""
        self.length.copy_(self._seen)
        self.filled = True


def _matmul_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a matmul reading x computes in: autocast's when it is on for x's device
    (None otherwise). The norms write their output in it directly, so the fp32 residual
    stream's normalised copy needs no separate cast pass, nor its gradient one back."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _make_norm(kind: str, dim: int, use_triton: bool) -> LayerNorm | RMSNorm:
    """A block's pre-norm: a bias-free LayerNorm or an RMSNorm (parameter `weight` either way)."""
    if kind == "rmsnorm":
        return RMSNorm(dim, use_triton=use_triton)
    return LayerNorm(dim, bias=False, use_triton=use_triton)


def _add_and_norm(
    h: torch.Tensor, branch: torch.Tensor, norm: LayerNorm | RMSNorm, use_triton: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + branch, norm(h + branch)) in one fused op, with `norm`'s parameters."""
    if isinstance(norm, RMSNorm):
        return residual_rmsnorm(
            h, branch, norm.weight, eps=norm.eps, use_triton=use_triton,
            out_dtype=_matmul_dtype(h),
        )  # fmt: skip
    return residual_layernorm(
        h, branch, norm.weight, norm.bias, eps=norm.eps, stable=norm.stable,
        use_triton=use_triton, out_dtype=_matmul_dtype(h),
    )  # fmt: skip


def _widened(ids: torch.Tensor) -> torch.Tensor:
    """Integer ids as int32 / int64 (narrower ones converted), for comparisons with Python
    ints that a narrower dtype would wrap."""
    return ids if ids.dtype in (torch.int32, torch.int64) else ids.long()


def _is_int_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not (
        t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool
    )


class Attention(nn.Module):
    """Pre-norm multi-head self-attention: norm -> qkv projection -> attention -> out.

    attn_impl "flash": the fused FlashAttention kernel (use_triton) or PyTorch's reference
    semantics; without a KV cache (and without qk_norm / rope) it reads q, k, v in place from
    the qkv projection and its backward writes d(qkv) in one piece (`attention_packed`).
    "naive": lucidrains' composition bmm -> softmax -> dropout -> bmm (`attention_naive`), the
    readable reference.

    norm: "layernorm" or "rmsnorm" (the pre-norm, `self.norm`). qk_norm: RMSNorm over head_dim
    of q and k (`q_norm`, `k_norm`, weights (dim_head,)) before the rotation. rope: rotate q
    and k by their positions (`rope.rope`, base `rope_base`) before attending.

    kv_heads (None: heads): grouped-query attention, kv_heads key/value heads (dividing
    heads; 1 is multi-query) shared by heads // kv_heads query heads each. `to_qkv` then
    projects to (heads + 2·kv_heads)·dim_head features, laid out q heads, k heads, v heads
    (with kv_heads = heads the classic (3, heads, dim_head) layout, parameter for parameter),
    the KV cache holds kv_heads heads, and the kernels read each key/value head for its whole
    group (`attention`: its Triton path never expands K and V).
    """

    def __init__(
        self,
        dim: int,
        *,
        heads: int,
        dim_head: int,
        causal: bool,
        dropout: float,
        max_seq_len: int,
        use_triton: bool,
        attn_impl: str = "flash",
        norm: str = "layernorm",
        qk_norm: bool = False,
        rope: bool = False,
        rope_base: float = DEFAULT_BASE,
        kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.attn_impl = attn_impl
        self.heads = heads
        self.kv_heads = default(kv_heads, heads)
        self.max_seq_len = max_seq_len
        self.causal = causal
        self.dropout = dropout
        self.rope = rope
        self.rope_base = rope_base
        inner_dim = heads * dim_head
        self.norm = _make_norm(norm, dim, use_triton)
        self.to_qkv = nn.Linear(dim, (heads + 2 * self.kv_heads) * dim_head, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(dim_head, use_triton=use_triton)
            self.k_norm = RMSNorm(dim_head, use_triton=use_triton)
        else:
            self.q_norm = self.k_norm = None

    def from_normed(
        self,
        y: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        use_triton: bool,
        kv_cache: KVCache | StaticKVCache | None = None,
        layer: int = 0,
        seed: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y (b, n, dim) -> (b, n, dim), where y = self.norm(x) is computed by the caller (the
        model fuses it with the previous residual add). With a `kv_cache` the new keys/values
        are appended to layer `layer`'s cache and the queries attend over all cached tokens.
        `seed`: the attention dropout's (see `attention`). `positions`: the rotary positions
        of the n tokens, (n,) int on the device (None: 0..n-1; used only with rope)."""
        qkv = linear(y, self.to_qkv.weight, use_triton=use_triton)
        kwargs = dict(
            causal=self.causal,
            key_padding_mask=mask,
            dropout_p=self.dropout,
            training=self.training,
            use_triton=use_triton,
        )
        if self.attn_impl == "flash":
            kwargs["seed"] = seed
        plain = not self.rope and self.q_norm is None and self.kv_heads == self.heads
        if self.attn_impl == "flash" and not exists(kv_cache) and plain:
            # q, k, v read in place from qkv; out is (b, n, h*d) without a copy
            out = attention_packed(qkv, self.heads, **kwargs)
        else:
            if self.kv_heads == self.heads:
                q, k, v = rearrange(qkv, "b n (qkv h d) -> qkv b h n d", qkv=3, h=self.heads)
            else:  # grouped-query: (heads, kv_heads, kv_heads) heads of q, k, v; views
                qkv = rearrange(qkv, "b n (h d) -> b h n d", h=self.heads + 2 * self.kv_heads)
                q, k, v = qkv.split((self.heads, self.kv_heads, self.kv_heads), dim=1)
            if self.q_norm is not None:
                q = self.q_norm(q, use_triton=use_triton)
                k = self.k_norm(k, use_triton=use_triton)
            if self.rope:  # the cache then holds rotated keys
                q, k = rope(q, k, positions, base=self.rope_base, use_triton=use_triton)
            if isinstance(kv_cache, StaticKVCache):
                k_cache, v_cache, seen = kv_cache.append(layer, k, v, self.max_seq_len)
                out = attention_cached(q, k_cache, v_cache, seen, use_triton=use_triton)
            else:
                if exists(kv_cache):
                    k, v = kv_cache.append(layer, k, v, self.max_seq_len)
                # causal attention is bottom-right aligned: n_q < n_k (a cache step) is right
                attend = attention if self.attn_impl == "flash" else attention_naive
                out = attend(q, k, v, **kwargs)
            out = rearrange(out, "b h n d -> b n (h d)")  # a view for the fused kernel's output
        return linear(out, self.to_out.weight, use_triton=use_triton)


class FeedForward(nn.Module):
    """Pre-norm feed-forward: norm -> linear + activation + dropout -> linear.

    act "relu2": relu(.)**2, with the dropout, in the input projection's epilogue, and the
    whole feed-forward one op (`mlp.relu2_mlp`, Triton: relu²'s gradient in the backward's
    product epilogue).
    "swiglu": the input projection's weight holds 2·hidden rows, gate then up, and silu(gate) *
    up feeds the output projection: `linear(..., activation="swiglu")`, one op for the
    projection and the gating (Triton: cuBLAS then the gating kernel, or the gating in the
    projection's epilogue where the planner lists it; the PyTorch branch is the projection,
    then `swiglu`'s reference), then the dropout. "gelu": exact GELU (F.gelu on both
    branches: no Triton kernel). hidden = dim * mult in every case.
    """

    def __init__(
        self,
        dim: int,
        *,
        mult: int,
        dropout: float,
        use_triton: bool,
        norm: str = "layernorm",
        act: str = "relu2",
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.act = act
        self.norm = _make_norm(norm, dim, use_triton)
        hidden = dim * mult
        self.proj_in = nn.Linear(dim, hidden * (2 if act == "swiglu" else 1), bias=False)
        self.proj_out = nn.Linear(hidden, dim, bias=False)

    def from_normed(
        self, y: torch.Tensor, *, use_triton: bool, seed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """y (b, n, dim) -> (b, n, dim), where y = self.norm(x) is computed by the caller (the
        model fuses it with the previous residual add). `seed`: the dropout's (see
        `bmm.linear`, `dropout.dropout`)."""
        p = self.dropout if self.training else 0.0
        if self.act == "relu2":
            # relu² and the dropout after it in the input projection's epilogue, relu²'s
            # gradient in the epilogue of the backward's dout @ W_out (Triton: one op)
            return relu2_mlp(
                y, self.proj_in.weight, self.proj_out.weight, use_triton=use_triton,
                dropout_p=p, seed=seed,
            )  # fmt: skip
        if self.act == "swiglu":
            # silu(gate) * up in the projection's epilogue; the dropout stays its own op
            x = linear(y, self.proj_in.weight, activation="swiglu", use_triton=use_triton)
        else:
            x = F.gelu(linear(y, self.proj_in.weight, use_triton=use_triton))
        x = dropout(x, p, use_triton=use_triton, seed=seed)
        return linear(x, self.proj_out.weight, use_triton=use_triton)


class Transformer(nn.Module):
    """Decoder (causal=True, GPT) or encoder (causal=False, BERT) transformer language model.

    Weights are initialised as in nanoGPT: every linear and embedding weight ~ N(0, 0.02),
    the two residual output projections of each block ~ N(0, 0.02 / sqrt(2 * depth)) so the
    residual stream's variance does not grow with depth; layernorm weights are 1.

    `check_token_ids` (default True) makes `forward` raise for token ids or labels outside
    [0, num_tokens): a `TokenIdError` for ids (a ValueError and an IndexError) and a
    ValueError for labels. An eager call with use_triton and labels (a training or
    evaluation step) leaves the check to its embedding and loss, whose kernels flag a bad id
    or label without a sync (`triton_transformer.checks`; the unfused loss in a training step
    still checks its labels first, for its in-place backward): the error then comes from a
    later call's forward, or from `checks.raise_pending()` (call it before an optimizer step
    that must not see a bad batch; it waits for the GPU), and meanwhile that call's loss is
    NaN. Other calls (the PyTorch path, traced calls, calls that return logits or use a KV
    cache) check first, reading one boolean back from the device (a sync). During CUDA graph
    capture it raises a RuntimeError instead (a replay would skip it): turn it off
    (constructor or attribute) in captured steps.

    `attn_impl`: "flash" (default; the fused attention kernel under use_triton) or "naive"
    (the bmm -> softmax -> dropout -> bmm composition). Both compute the same function and
    have the same parameters.

    `cuda_graphs` (default True; constructor or attribute): eager calls of the Triton path
    on CUDA replay the residual blocks, forward and backward, as CUDA graphs captured per
    input shape (`block_graphs.BlockGraphs`, kept in `block_graphs`), so that an ordinary
    eager training or evaluation loop is not bound by Python's launch cost. Calls with a KV
    cache, traced calls (torch.compile) and calls inside a graph of the caller's own run the
    blocks eagerly. `block_graphs.reset()` drops the graphs (and their memory).

    `fused_loss` (default True; constructor or attribute): with `labels` and use_triton, the
    loss comes from `linear_cross_entropy`, the output projection and cross entropy in chunks
    of tokens, so the (tokens x num_tokens) logits never exist whole. False materialises the
    logits first (as the PyTorch path always does). Same parameters either way.
    `loss_chunk_rows` (constructor or attribute): rows per chunk of the fused loss; None
    (default) takes `linear_cross_entropy.default_chunk_rows` (at most `CHUNK_BYTES` of
    logits per chunk). Fewer rows hold less memory and run slower, each chunk adding a pass
    over the fp32 weight gradient: at the GPT-2 preset (H200, `benchmarks/RESULTS.md`,
    33rd session, one call) the default 4096 rows saved 1.23 GB of the step's peak memory
    against the unfused loss at 0.98x its speed, 2048 rows 1.44 GB at 0.97x, 1408 rows 1.50
    GB at 0.95x, 1024 rows 1.53 GB at 0.94x.

    Block options (the defaults are the classic model; see the module docstring):
    `pos_emb` "learned" (the `pos_emb` table) or "rope" (no table; q and k rotated with base
    `rope_base`, the decode paths passing their cache positions on the device); `norm`
    "layernorm" (bias-free, final norm stable) or "rmsnorm" (every norm, the final one too);
    `ff_act` "relu2", "swiglu" or "gelu"; `qk_norm` RMSNorm of q and k over head_dim;
    `kv_heads` (None: heads) key/value heads of grouped-query attention, dividing heads (1:
    multi-query), which the KV caches hold. `options` holds them, to record in a checkpoint
    (kv_heads only when it differs from heads).
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        dim: int,
        max_seq_len: int,
        depth: int,
        heads: int = 8,
        dim_head: int = 64,
        causal: bool = False,
        attn_dropout: float = 0.0,
        ff_dropout: float = 0.0,
        ff_mult: int = 4,
        use_triton: bool = False,
        check_token_ids: bool = True,
        attn_impl: str = "flash",
        fused_loss: bool = True,
        pos_emb: str = "learned",
        norm: str = "layernorm",
        ff_act: str = "relu2",
        qk_norm: bool = False,
        rope_base: float = DEFAULT_BASE,
        kv_heads: int | None = None,
        cuda_graphs: bool = True,
        loss_chunk_rows: int | None = None,
    ) -> None:
        super().__init__()
        for name, val, allowed in (
            ("attn_impl", attn_impl, ATTN_IMPLS),
            ("pos_emb", pos_emb, POS_EMBS),
            ("norm", norm, NORMS),
            ("ff_act", ff_act, FF_ACTS),
        ):
            if val not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {val!r}")
        if not isinstance(qk_norm, bool):
            raise TypeError(f"qk_norm must be a bool, got {qk_norm!r}")
        if isinstance(rope_base, bool) or not isinstance(rope_base, (int, float)) or rope_base <= 0:
            raise ValueError(f"rope_base must be a positive number, got {rope_base!r}")
        for name, val in dict(
            num_tokens=num_tokens,
            dim=dim,
            max_seq_len=max_seq_len,
            depth=depth,
            heads=heads,
            dim_head=dim_head,
            ff_mult=ff_mult,
        ).items():
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        for name, p in dict(attn_dropout=attn_dropout, ff_dropout=ff_dropout).items():
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p!r}")
        kv_heads = default(kv_heads, heads)
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
            raise ValueError(f"kv_heads must be a positive int or None, got {kv_heads!r}")
        if heads % kv_heads:
            raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
        if loss_chunk_rows is not None and (
            isinstance(loss_chunk_rows, bool) or not isinstance(loss_chunk_rows, int)
            or loss_chunk_rows < 1
        ):  # fmt: skip
            raise ValueError(
                f"loss_chunk_rows must be a positive int or None, got {loss_chunk_rows!r}"
            )

        self.num_tokens = num_tokens
        self.max_seq_len = max_seq_len
        self.depth = depth
        self.heads = heads
        self.kv_heads = kv_heads
        self.dim_head = dim_head
        self.causal = causal
        self.use_triton = use_triton
        self.check_token_ids = check_token_ids
        self.attn_impl = attn_impl
        self.fused_loss = fused_loss
        self.loss_chunk_rows = loss_chunk_rows
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
        self.cuda_graphs = cuda_graphs
        self.block_graphs = BlockGraphs()
        self.options = dict(
            pos_emb=pos_emb, norm=norm, ff_act=ff_act, qk_norm=qk_norm, rope_base=float(rope_base)
        )
        if kv_heads != heads:  # recorded only when grouped: a default model's options as before
            self.options["kv_heads"] = kv_heads

        self.token_emb = nn.Embedding(num_tokens, dim)
        # None with rope: no positional table, no `pos_emb.weight` in the state dict
        self.pos_emb = nn.Embedding(max_seq_len, dim) if pos_emb == "learned" else None
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [
                    Attention(
                        dim,
                        heads=heads,
                        dim_head=dim_head,
                        causal=causal,
                        dropout=attn_dropout,
                        max_seq_len=max_seq_len,
                        use_triton=use_triton,
                        attn_impl=attn_impl,
                        norm=norm,
                        qk_norm=qk_norm,
                        rope=pos_emb == "rope",
                        rope_base=float(rope_base),
                        kv_heads=kv_heads,
                    ),
                    FeedForward(
                        dim,
                        mult=ff_mult,
                        dropout=ff_dropout,
                        use_triton=use_triton,
                        norm=norm,
                        act=ff_act,
                    ),
                ]
            )
            for _ in range(depth)
        )
        # The stable variant (CogView's PB-relax) divides each row by its max |x| first,
        # so a large residual stream cannot overflow the variance in fp16. (RMSNorm has no
        # such variant: its final norm is a plain one.)
        if norm == "rmsnorm":
            self.norm = RMSNorm(dim, use_triton=use_triton)
        else:
            self.norm = LayerNorm(dim, bias=False, stable=True, use_triton=use_triton)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

        self.apply(self._init_weights)
        for attn, ff in self.layers:
            for lin in (attn.to_out, ff.proj_out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * depth))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def _dropout_seeds(self, device: torch.device, use_triton: bool) -> torch.Tensor | None:
        """All dropout seeds of one Triton forward, drawn with one launch: (2 · depth,), the
        attention's and the feed-forward's of each layer (None when nothing drops)."""
        dropping = self.training and any(p > 0.0 for p in self._dropout_rates())
        return draw_seeds(device, 2 * self.depth) if use_triton and dropping else None

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        ignore_index: int | None = None,
        use_triton: bool | None = None,
        kv_cache: KVCache | StaticKVCache | None = None,
    ) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when `labels` is given.

        x: (b, n) integer token ids in [0, num_tokens).
        mask: optional (b, n) bool key padding mask, True where the token is real; only for
            non-causal models. Padded keys are ignored by every query; outputs at padded
            positions are meaningless (exclude them from a loss with `ignore_index`), as are
            all outputs of a row with no real token.
        labels: optional (b, n) integer targets; positions equal to `ignore_index` are left
            out of the mean (None: nothing is ignored).
        use_triton: None uses the constructor's flag.
        kv_cache: optional `KVCache` or `StaticKVCache` (causal models only): x holds the n
            tokens that follow the kv_cache.length cached ones; their positions are offset
            accordingly.
        Returns logits (b, n, num_tokens), or a scalar loss when `labels` is given.
        """
        use_triton = default(use_triton, self.use_triton)
        # An eager Triton call with labels (a training or evaluation step) leaves the ids and
        # labels to its embedding's and loss's own checks, which need no sync: a bad batch
        # gives a NaN loss and a later call raises. The others check first in _check_inputs:
        # the PyTorch path, traced calls, calls that return logits (a sampler fed NaN logits
        # would stop at a device-side assert) and calls with a KV cache (a bad id's NaN
        # keys and values would stay in the cache).
        ops_check = (
            self.check_token_ids and use_triton and exists(labels) and kv_cache is None
            and not torch.compiler.is_compiling() and not is_traced(x)
        )  # fmt: skip
        sync_check = self.check_token_ids and not ops_check
        n, start = self._check_inputs(x, mask, labels, ignore_index, kv_cache, sync_check)
        if x.dtype not in (torch.int32, torch.int64):
            x = x.long()  # embedding takes int32/int64 ids
        if ops_check and labels.dtype == torch.int64:
            # the check reads its labels when it resolves, after this call: a copy, which a
            # caller refilling its label buffer in place cannot change before then
            labels = labels.clone()

        # check_ids: the embedding's check (ops_check), else _check_inputs checked the ids
        # where check_token_ids is on; an unchecked out-of-range id gets a NaN row from the
        # Triton kernel, so a NaN loss
        positions = None  # rope: the tokens' positions on the device (None: 0..n-1)
        if isinstance(kv_cache, StaticKVCache):
            # the positions follow a length that lives on the device: gather them there
            positions = kv_cache.begin(n, x.device)
            # (a cached call: _check_inputs checked the ids, where asked)
            h = embedding(x, self.token_emb.weight, use_triton=use_triton, check_ids=False)
            if exists(self.pos_emb):
                h = h + self.pos_emb.weight[positions]
        elif not exists(self.pos_emb):
            h = embedding(x, self.token_emb.weight, use_triton=use_triton, check_ids=ops_check)
            if start:  # a KVCache step: its positions follow the host-side length
                positions = torch.arange(start, start + n, device=x.device)
        else:
            h = embedding(
                x, self.token_emb.weight, self.pos_emb.weight, start, use_triton=use_triton,
                check_ids=ops_check,
            )  # fmt: skip
        y = None
        if use_triton and self.cuda_graphs and kv_cache is None:
            config = (self.training, self.attn_impl, *self._dropout_rates())
            y = self.block_graphs(
                lambda h, mask: self._blocks(h, mask, use_triton=True), (self.layers, self.norm),
                h, mask, config,
            )  # fmt: skip
        if y is None:  # eagerly
            y = self._blocks(h, mask, use_triton, kv_cache, positions)
        # The fused loss computes the logits chunk by chunk, never all at once.
        fused = exists(labels) and use_triton and self.fused_loss
        logits = None if fused else linear(y, self.to_logits.weight, use_triton=use_triton)

        # the cache advances only after every layer has written its keys/values
        if isinstance(kv_cache, StaticKVCache):
            kv_cache.finish()
        elif exists(kv_cache):
            kv_cache.length = start + n

        if not exists(labels):
            return logits
        if labels.dtype != torch.int64:
            labels = labels.long()
        if fused:
            return linear_cross_entropy(
                y, self.to_logits.weight, labels, ignore_index, use_triton=True,
                chunk_rows=self.loss_chunk_rows, check_labels=ops_check,
            )  # fmt: skip
        return cross_entropy(
            logits,
            labels,
            ignore_index=ignore_index,
            use_triton=use_triton,
            check_labels=ops_check,  # (else _check_inputs checked them, where asked)
            inplace_backward=True,  # nothing else keeps the logits: they take their gradient
        )

    def _dropout_rates(self) -> list[float]:
        return [m.dropout for pair in self.layers for m in pair]

    def _blocks(
        self,
        h: torch.Tensor,
        mask: torch.Tensor | None,
        use_triton: bool,
        kv_cache: KVCache | StaticKVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The residual blocks and the final norm: embeddings h (b, n, dim) -> y (b, n, dim),
        normalised, in the matmul dtype (autocast's, else h's)."""
        # Pre-norm blocks, h = h + attn(norm(h)), h = h + ff(norm(h)), then the final norm;
        # written so that each residual add and the norm that follows it are one fused op
        # (`residual_layernorm`): y is the normalised h that the next sub-layer reads.
        y = self.layers[0][0].norm(h, use_triton=use_triton, out_dtype=_matmul_dtype(h))
        seeds = self._dropout_seeds(h.device, use_triton)
        for i, (attn, ff) in enumerate(self.layers):
            a = attn.from_normed(
                y, mask=mask, use_triton=use_triton, kv_cache=kv_cache, layer=i,
                seed=seeds[2 * i] if exists(seeds) else None, positions=positions,
            )  # fmt: skip
            h, y = _add_and_norm(h, a, ff.norm, use_triton)
            f = ff.from_normed(
                y, use_triton=use_triton, seed=seeds[2 * i + 1] if exists(seeds) else None
            )
            next_norm = self.layers[i + 1][0].norm if i + 1 < self.depth else self.norm
            h, y = _add_and_norm(h, f, next_norm, use_triton)
        return y

    def _check_inputs(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        ignore_index: int | None,
        kv_cache: KVCache | StaticKVCache | None,
        check_ranges: bool,
    ) -> tuple[int, int]:
        """Validate forward's arguments; returns (n, position of x's first token).
        check_ranges: check the ids and labels here (a sync)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor of token ids, got {type(x).__name__}")
        if not _is_int_tensor(x):
            raise ValueError(f"x must hold integer token ids, got dtype {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"x must have shape (batch, seq), got {tuple(x.shape)}")
        b, n = x.shape
        if b == 0 or n == 0:
            raise ValueError(f"x must hold at least one token per row, got {tuple(x.shape)}")

        start = 0
        if exists(kv_cache):
            if not self.causal:
                raise ValueError("kv_cache needs a causal model (causal=True)")
            n_layers = len(kv_cache.keys)  # < depth only if a first call failed midway
            filled = kv_cache.length if isinstance(kv_cache, KVCache) else kv_cache.filled
            if (
                n_layers > self.depth
                or (filled and n_layers != self.depth)
                or (
                    n_layers
                    and kv_cache.keys[0].shape[1:]
                    != (self.kv_heads, self.max_seq_len, self.dim_head)
                )
            ):
                raise ValueError("kv_cache was filled by a model of a different shape")
            if exists(kv_cache.batch_size) and kv_cache.batch_size != b:
                raise ValueError(
                    f"kv_cache holds batch size {kv_cache.batch_size}, but x has batch size {b}"
                )
            start = kv_cache.length if isinstance(kv_cache, KVCache) else 0  # static: unknown
        if start + n > self.max_seq_len:
            cached = f" after {start} cached tokens" if start else ""
            raise ValueError(f"sequence length {n}{cached} exceeds max_seq_len {self.max_seq_len}")

        if exists(mask):
            if self.causal:
                raise ValueError(
                    "mask (key padding) is only for non-causal models; a causal model "
                    "already ignores future tokens, and right-padding needs no mask"
                )
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise ValueError("mask must be a bool tensor (True = real token)")
            if mask.shape != x.shape:
                raise ValueError(
                    f"mask shape {tuple(mask.shape)} does not match x shape {tuple(x.shape)}"
                )

        if exists(labels):
            if not _is_int_tensor(labels):
                raise ValueError("labels must be an integer tensor of token ids")
            if labels.shape != x.shape:
                raise ValueError(
                    f"labels shape {tuple(labels.shape)} does not match x shape {tuple(x.shape)}"
                )

        if self.check_token_ids:
            check_not_capturing(
                "Transformer's token-id range check (turn it off with check_token_ids=False)"
            )
        if check_ranges:
            # one device read for both checks, in int32 / int64: in a narrower dtype
            # num_tokens and ignore_index would wrap (uint8 ids against 266 compare with 10)
            ids, labels = _widened(x), None if labels is None else _widened(labels)
            bad = [((ids < 0) | (ids >= self.num_tokens)).any()]
            if exists(labels):
                out = (labels < 0) | (labels >= self.num_tokens)
                if exists(ignore_index):
                    out &= labels != ignore_index
                bad.append(out.any())
            bad_x, *bad_labels = torch.stack(bad).tolist()
            if bad_x:
                raise TokenIdError(f"x holds token ids outside [0, num_tokens={self.num_tokens})")
            if any(bad_labels):
                raise ValueError(
                    f"labels hold ids outside [0, num_tokens={self.num_tokens}) that are not "
                    f"ignore_index ({ignore_index})"
                )
        return n, start
