"""triton-transformer: a small GPT-style transformer whose hot ops are Triton kernels.

Every op takes `use_triton`: True runs the hand-written Triton kernel, False the plain
PyTorch reference that defines its semantics. Ops live one per module and are imported
from there (`from triton_transformer.softmax import softmax`), so module names are never
shadowed by the functions they hold.
"""

from triton_transformer.autoregressive_wrapper import AutoregressiveWrapper
from triton_transformer.layernorm import LayerNorm
from triton_transformer.transformer import KVCache, Transformer

__all__ = ["AutoregressiveWrapper", "KVCache", "LayerNorm", "Transformer"]
__version__ = "0.1.0"
