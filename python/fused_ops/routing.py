"""The routing of a modality mask, computed once for all the routed ops of a model.

A CogVLM-style model applies one token-type mask to every layer: each layer's QKV, dense and MLP route the same tokens
to the same experts. Every routed op (`linear_dual`, `ffn` and their gradients) can route its mask itself, on the
device, with no host sync; handed the mask's routing from `route` instead (their `routing` argument), it routes
nothing. The routing is 4 bytes per token per layout, int32, on the mask's device.
"""
import torch

__all__ = ["route"]


def route(mask: torch.Tensor) -> torch.Tensor:
    """The routing of `mask` (bool, any shape, `M` = its number of elements): both layouts of the device routing
    (each expert's tokens in order, in the aligned and unaligned forms the kernels read; `csrc/ops/routed_gemm.h`),
    as one contiguous int32 tensor whose length pins `M`. No host sync; capturable in a CUDA graph.

    Pass it as `routing=` to `linear_dual`, `DualLinear`, `ffn` and `DualExpertSwiGLU` calls on the same mask, e.g.
    once per forward pass for all layers::

        routing = fused_ops.route(vision_mask)
        for layer in layers:
            x = layer(x, vision_mask, routing=routing)

    The ops still take the mask (their shapes and CPU paths use it). On CUDA they trust the routing to be this
    mask's: a routing of another mask of the same length gives wrong results, with no error (reading it back to check
    would sync the host). On the CPU it is checked against the mask. Autograd saves it for the backward.
    """
    return torch.ops.fused.route(mask)
