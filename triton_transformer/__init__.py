"""triton-transformer: a small GPT-style transformer whose hot ops are Triton kernels.

Every op takes `use_triton`: True runs the hand-written Triton kernel, False the plain
PyTorch reference that defines its semantics.
"""

from triton_transformer.layernorm import LayerNorm, layernorm
from triton_transformer.softmax import softmax

__all__ = ["LayerNorm", "layernorm", "softmax"]
__version__ = "0.1.0"
