"""RMSNorm: a documented wrapper over ``torch.ops.fused.rms_norm`` (the schema and its contract:
``csrc/torch_bindings.cpp``; the kernel: ``kernels/rms_norm.py``). Importing this module loads no GPU toolchain."""
import torch

__all__ = ["rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x ** 2, -1) + eps) * weight`` over the last dimension, computed in float32 (float64 for
    float64 inputs) and rounded once to ``x``'s dtype: what ``F.rms_norm(x, (x.shape[-1],), weight, eps)`` computes.

    Args:
        x: ``[..., N]``, any strides; float32, float16 or bfloat16 on CUDA (also float64 on the CPU).
        weight: ``[N]``, ``x``'s dtype and device.
        eps: added to the mean square; finite and >= 0.

    Returns a contiguous tensor of ``x``'s shape and dtype. On CUDA one small program per row, launched with
    programmatic dependent launch on sm_90 like the routed ops around it: the norms of a decode step
    (``FusedCogVLM.decode``) cost less than torch's kernel there. No host sync (CUDA-graph capturable).
    Differentiable: where a gradient is asked for, torch's ``rms_norm`` computes the value (the same math) and its
    backward. Bad shapes, dtypes or eps raise ``ValueError``.
    """
    return torch.ops.fused.rms_norm(x, weight, eps)
