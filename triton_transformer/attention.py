"""Scaled dot-product attention composed of the package's ops: bmm -> softmax -> dropout -> bmm.

Not a fused flash-attention kernel: the (n_q, n_k) score matrix is materialized, which is
fine for the short contexts of this model and keeps each piece testable on its own. Every
op takes the same `use_triton`, so the PyTorch branch is the same composition in PyTorch.
"""

from __future__ import annotations

import torch

from triton_transformer.bmm import bmm
from triton_transformer.dropout import dropout
from triton_transformer.softmax import softmax


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> None:
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (b, h, n, d), got shape {tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.shape[:2] == k.shape[:2] == v.shape[:2]:
        raise ValueError(
            f"q, k, v need the same (b, h), got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k need one head dim, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v need one length n_k, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor (True = real token)")
        expected = (k.shape[0], k.shape[2])
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(
                f"key_padding_mask must have shape (b, n_k) = {expected}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != k.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, k on {k.device}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = True,
    use_triton: bool = False,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), masked) v.

    Args:
        q: (b, h, n_q, d) queries.
        k: (b, h, n_k, d) keys.
        v: (b, h, n_k, d_v) values (d_v is usually d).
        causal: query i sees keys j <= i + (n_k - n_q): bottom-right aligned, so a KV-cache
            step (n_q < n_k) works. Rows that see no key (n_q > n_k) output zeros.
        key_padding_mask: optional (b, n_k) bool, True = real token. Padded keys get the
            most negative finite score, so a fully padded row averages v instead of NaN.
        dropout_p: dropout on the attention weights (only when `training`).
        use_triton: run bmm, softmax and dropout as Triton kernels.

    Returns:
        (b, h, n_q, d_v) tensor of q's dtype.
    """
    _check_inputs(q, k, v, key_padding_mask)
    d = q.shape[-1]
    scale = d**-0.5 if d > 0 else 1.0
    # k's transposed view goes to bmm as is: its kernel reads strides, so nothing is copied.
    scores = bmm(q * scale, k.transpose(-1, -2), use_triton=use_triton)
    if key_padding_mask is not None:
        # In place is safe: bmm's backward needs its inputs, not this output. A finite fill
        # (not -inf) keeps a fully padded row from becoming 0/0.
        fill = -torch.finfo(scores.dtype).max
        scores.masked_fill_(~key_padding_mask[:, None, None, :], fill)
    attn = softmax(scores, causal=causal, use_triton=use_triton)
    attn = dropout(attn, p=dropout_p, training=training, use_triton=use_triton)
    return bmm(attn, v, use_triton=use_triton)
