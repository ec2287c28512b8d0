"""Public names of the routed GEMM ops (docs/design.md, "Routed GEMM ops"), gathered for `fused_ops/__init__.py`:
`from .routed import *` re-exports them without the package needing to know each module."""
from .ffn import DualExpertSwiGLU, FusedSwiGLU, ffn
from .linear_dual import DualLinear, linear_dual
from .routing import route

__all__ = ["route", "linear_dual", "DualLinear", "ffn", "FusedSwiGLU", "DualExpertSwiGLU"]
