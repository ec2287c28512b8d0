"""Modality-routed linear layer: every token goes through exactly one of two experts (vision or text).

Thin, documented wrapper over `torch.ops.fused.linear_dual` (schema in `csrc/torch_bindings.cpp`, semantics in
docs/design.md, "Routed GEMM ops") plus `DualLinear`, the nn.Module that owns both experts' parameters. The op is
registered when `fused_ops` loads its library; this module only looks it up at call time (no triton import).

    out[i] = x[i] · weight_vᵀ + bias_v   if mask[i]   (vision expert)
    out[i] = x[i] · weight_tᵀ + bias_t   otherwise    (text expert)

Weight layout: each expert's weight is `[N, K]` = `[out_features, in_features]`, exactly `nn.Linear.weight`.
(The routed-GEMM kernels this project started from, shared/seeds/000_256c4f1823e4693a.txt, are called with the
transposed `[K, N]` weights `linear.weight.data.T`; here we follow torch: pass `linear.weight` itself, never its
transpose.)

Shapes: `M` tokens (the product of x's leading dims, may be 0), `K` in_features, `N` out_features.
"""
import math
from typing import Optional

import torch
from torch import nn

__all__ = ["linear_dual", "DualLinear"]

#: index of each expert in the stacked parameters (matches the kernels: expert 0 = mask false)
TEXT, VISION = 0, 1


def linear_dual(
    x: torch.Tensor,
    mask: torch.Tensor,
    weight_v: torch.Tensor,
    weight_t: Optional[torch.Tensor],
    bias_v: Optional[torch.Tensor] = None,
    bias_t: Optional[torch.Tensor] = None,
    allow_tf32: bool = False,
    routing: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Routed linear: each token through the vision expert where `mask` is true, the text expert elsewhere.

    Differentiable w.r.t. `x`, both weights and both biases (the op's autograd, registered in C++, calls
    `torch.ops.fused.linear_dual_backward`). The tokens of one expert never touch the other expert's weights, so
    an expert with no tokens gets an all-zero weight (and bias) gradient. The backward computes only the gradients
    autograd asks for (its `output_mask`): a frozen expert's weights (``requires_grad=False``, e.g. the language
    model's in CogVLM training), a missing bias or an `x` that needs no gradient cost no work.

    Args:
        x: `[..., K]` (any leading shape, `M` = its product, may be 0), any strides; float32/float16/bfloat16
            (float64 on CPU).
        mask: bool `[...]`, x's leading shape: True = vision token (weight_v, bias_v), False = text token.
        weight_v: vision expert weight `[N, K]` (nn.Linear layout), x's dtype and device; or both experts stacked,
            `[2, N, K]` (text `[0]`, vision `[1]`, as `DualLinear` stores them) with `weight_t=None`: its gradient
            is then one `[2, N, K]` tensor too (no stacking copy in autograd).
        weight_t: text expert weight `[N, K]`, or None with a stacked `weight_v`. Either way, the CUDA kernels read
            each expert's weight where it lies (two tensors in either memory order, views of one), with no copy.
        bias_v: optional `[N]` vision bias.
        bias_t: optional `[N]` text bias. Either bias may be given without the other (the missing one is zero).
        allow_tf32: float32 inputs only: let the CUDA kernels use TF32 tensor cores (about 1e-3 relative error).
            Default False: float32 is computed exactly (IEEE fp32). torch's global
            `torch.backends.cuda.matmul.allow_tf32` is NOT consulted. Ignored for 16-bit inputs and on CPU.
        routing: `fused_ops.route(mask)`, computed once for all the routed ops on this mask (then this op routes
            nothing), or None: the op routes `mask` itself. See `fused_ops.route`.
        residual: optional `[..., N]` (the output's shape), x's dtype and device: added to the output in the GEMM's
            epilogue, `residual + linear_dual(...)` in one kernel and one rounding (a transformer block's
            `h = x + dense(attention)`). Its gradient is the output's.
    Returns a new contiguous `[..., N]` tensor of x's dtype on x's device (accumulation in fp32, one rounding).
    Inside `torch.autocast` the floating-point inputs are first cast to the region's dtype, as for
    `torch.nn.functional.linear` (the result then has that dtype; float64 is left alone).
    """
    return torch.ops.fused.linear_dual(x, mask, weight_v, weight_t, bias_v, bias_t, allow_tf32, routing, residual)


class DualLinear(nn.Module):
    """Two `nn.Linear(in_features, out_features)` experts behind one routed GEMM: `forward(x, mask)` sends token
    `i` through the vision expert if `mask[i]`, else through the text expert (see `linear_dual`).

    Parameters (both experts in ONE tensor, so the kernel reads them with one TMA descriptor and no copy):
        weight: `[2, out_features, in_features]`; `weight[0]` = text expert, `weight[1]` = vision expert, each in
            nn.Linear's `[N, K]` layout.
        bias: `[2, out_features]` (same expert order), or None when `bias=False`.

    `weight_v` / `weight_t` / `bias_v` / `bias_t` are views into those parameters (writes through them update the
    module). `forward` passes `weight` whole (`linear_dual`'s stacked form), so its gradient is written as one
    `[2, N, K]` tensor by the backward op, with no copy; the bias goes as its two `unbind` views (autograd stacks
    their `[N]` gradients).

    Args:
        in_features: K.
        out_features: N.
        bias: whether both experts have a bias.
        allow_tf32: keyword-only, passed to `linear_dual` (float32 only).
        device, dtype: keyword-only factory arguments, as for nn.Linear.

    Initialization is nn.Linear's, independently per expert.
    """

    # TorchScript compiles properties too; these index with Python-level constants it cannot see, and forward does
    # not use them, so `torch.jit.script` leaves them to Python.
    __jit_unused_properties__ = ["weight_v", "weight_t", "bias_v", "bias_t"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, allow_tf32: bool = False,
                 device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.allow_tf32 = bool(allow_tf32)
        self.weight = nn.Parameter(torch.empty(2, self.out_features, self.in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(2, self.out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization for each expert: weight and bias ~ U(-1/sqrt(K), 1/sqrt(K))."""
        for e in (TEXT, VISION):
            nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))  # what nn.Linear.reset_parameters does
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    # views (no copy) of the stacked parameters -------------------------------------------------------------
    @property
    def weight_v(self) -> torch.Tensor:
        """Vision expert weight `[N, K]`: a view of `weight[1]`."""
        return self.weight[VISION]

    @property
    def weight_t(self) -> torch.Tensor:
        """Text expert weight `[N, K]`: a view of `weight[0]`."""
        return self.weight[TEXT]

    @property
    def bias_v(self) -> Optional[torch.Tensor]:
        """Vision expert bias `[N]` (a view of `bias[1]`) or None."""
        return None if self.bias is None else self.bias[VISION]

    @property
    def bias_t(self) -> Optional[torch.Tensor]:
        """Text expert bias `[N]` (a view of `bias[0]`) or None."""
        return None if self.bias is None else self.bias[TEXT]

    @classmethod
    def from_linears(cls, linear_v: nn.Linear, linear_t: nn.Linear, *, allow_tf32: bool = False) -> "DualLinear":
        """A DualLinear holding copies of two nn.Linear experts' parameters (`linear_v` = vision, `linear_t` =
        text), on their device and dtype. Both must have the same shape, dtype and device. If only one of them has
        a bias, the other expert gets a zero bias (same outputs as the two linears)."""
        for name, lin in (("linear_v", linear_v), ("linear_t", linear_t)):
            if not isinstance(getattr(lin, "weight", None), torch.Tensor) or lin.weight.dim() != 2:
                raise ValueError(f"DualLinear.from_linears: {name} must be an nn.Linear (a 2-D .weight), got "
                                 f"{type(lin).__name__}")
        wv, wt = linear_v.weight, linear_t.weight
        if wv.shape != wt.shape:
            raise ValueError(f"DualLinear.from_linears: linear_v.weight {tuple(wv.shape)} and linear_t.weight "
                             f"{tuple(wt.shape)} must have the same shape")
        if wv.dtype != wt.dtype or wv.device != wt.device:
            raise ValueError(f"DualLinear.from_linears: the two linears must share dtype and device, got "
                             f"{wv.dtype}/{wv.device} and {wt.dtype}/{wt.device}")
        bv, bt = getattr(linear_v, "bias", None), getattr(linear_t, "bias", None)
        has_bias = bv is not None or bt is not None
        mod = cls(wv.shape[1], wv.shape[0], bias=has_bias, allow_tf32=allow_tf32, device=wv.device, dtype=wv.dtype)
        with torch.no_grad():
            mod.weight[VISION].copy_(wv)
            mod.weight[TEXT].copy_(wt)
            if has_bias:
                mod.bias.zero_()
                if bv is not None:
                    mod.bias[VISION].copy_(bv)
                if bt is not None:
                    mod.bias[TEXT].copy_(bt)
        return mod

    def forward(self, x: torch.Tensor, mask: torch.Tensor, routing: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: `[..., in_features]`; mask: bool `[...]` (True = vision token); routing: `fused_ops.route(mask)` or
        None; residual: `[..., out_features]` added to the output in the GEMM's epilogue, or None (see
        `linear_dual`). Returns `[..., out_features]`."""
        # the stacked weight whole: its gradient comes back as one [2, N, K] tensor (no stack in autograd)
        b_t, b_v = (None, None) if self.bias is None else self.bias.unbind(0)
        return torch.ops.fused.linear_dual(x, mask, self.weight, None, b_v, b_t, self.allow_tf32, routing, residual)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"experts=[text, vision]" + (", allow_tf32=True" if self.allow_tf32 else ""))
