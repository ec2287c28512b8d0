"""SwiGLU feed-forward block (LLaMA MLP), single expert or modality-routed between two experts (CogVLM style).

Thin, documented wrapper over `torch.ops.fused.ffn` (schema in `csrc/torch_bindings.cpp`, semantics in
docs/design.md, "Routed GEMM ops") plus two nn.Modules:

    single expert:  ffn(x) = (silu(x · w1ᵀ) ⊙ (x · w3ᵀ)) · w2ᵀ
    dual expert:    token i uses the vision expert (w1, w3, w2) if mask[i], else the text expert (u1, u3, u2)

Weight layout is nn.Linear's: w1 (gate_proj) and w3 (up_proj) are `[I, H]`, w2 (down_proj) is `[H, I]`; there are no
biases. Shapes: `M` tokens (product of x's leading dims, may be 0), `H` hidden size, `I` intermediate size.

Nothing here imports `transformers`: `FusedSwiGLU.from_llama_mlp` duck-types its argument.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ffn", "FusedSwiGLU", "DualExpertSwiGLU"]

#: index of each expert in DualExpertSwiGLU's stacked parameters (matches the kernels: expert 0 = mask false)
TEXT, VISION = 0, 1


def ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    u1: Optional[torch.Tensor] = None,
    u3: Optional[torch.Tensor] = None,
    u2: Optional[torch.Tensor] = None,
    allow_tf32: bool = False,
    routing: Optional[torch.Tensor] = None,
    recompute: bool = False,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """SwiGLU MLP `w2(silu(w1 x) * w3 x)` (`+ residual`), optionally routed per token between two experts.

    Single expert: leave `mask`, `u1`, `u3`, `u2` all None. Dual expert: give all four; token `i` goes through
    (w1, w3, w2) where `mask[i]` is true (vision) and through (u1, u3, u2) elsewhere (text). Anything in between
    (a mask without u's, u's without a mask, some u's only) raises. Stacked dual expert: `mask` and both experts in
    each weight, w1 / w3 `[2, I, H]` and w2 `[2, H, I]`, `[0]` text and `[1]` vision (DualExpertSwiGLU's
    parameters), u's None; their gradients come back stacked the same way.

    Differentiable w.r.t. `x` and every weight (the op's C++ autograd calls `torch.ops.fused.ffn_backward`). What
    the forward keeps for the backward (`recompute`): by default the gate and up pre-activations (`2 * I` elements
    per token, from `torch.ops.fused.ffn_forward`; half of what a plain PyTorch SwiGLU MLP keeps), so that the
    backward runs only the six GEMMs the gradients need; with ``recompute=True`` nothing beyond the inputs, and the
    backward computes gate and up again (two more GEMMs: about 1.2x the forward + backward flops, for
    memory-bound training). Both give the same forward output; their gradients differ only by where gate and up were
    rounded (saved in x's dtype, or recomputed in fp32). Under `torch.no_grad()` (or with nothing requiring a gradient)
    nothing is kept either way. An expert with no tokens gets all-zero weight
    gradients. The backward computes only the gradients autograd asks for (its `output_mask`): a frozen expert's
    weights (``requires_grad=False``, e.g. the language model's in CogVLM training) cost no grad-weight work, an `x`
    that needs no gradient no grad-input GEMMs.

    Args:
        x: `[..., H]` (any leading shape, `M` = its product, may be 0), any strides; float32/float16/bfloat16
            (float64 on CPU).
        w1: gate projection `[I, H]` (HF `gate_proj.weight`), x's dtype and device.
        w3: up projection `[I, H]` (HF `up_proj.weight`).
        w2: down projection `[H, I]` (HF `down_proj.weight`).
        mask: bool `[...]` (x's leading shape), True = vision token (w's), False = text token (u's). Dual only.
        u1, u3, u2: the text expert's gate / up / down weights, shaped like w1 / w3 / w2. Dual only.
        allow_tf32: float32 inputs only: allow TF32 tensor cores in the CUDA kernels (about 1e-3 relative error).
            Default False: exact fp32. torch's global TF32 flag is not consulted. Ignored for 16-bit inputs, on CPU.
        routing: dual only: `fused_ops.route(mask)`, computed once for all the routed ops on this mask (then this op
            routes nothing and allocates nothing beside the intermediate), or None: the op routes `mask` itself.
            See `fused_ops.route`.
        recompute: see above (autograd only; the output does not depend on it).
        residual: None, or a tensor of x's shape, dtype and device added to the output in the down projection's
            epilogue (fp32, one rounding): a transformer block's `h + mlp(norm(h))` without a separate add kernel.
            Its gradient is the output's.
    Returns a new contiguous `[..., H]` tensor of x's dtype. The intermediate `silu(x w1ᵀ) * (x w3ᵀ)` is computed in
    fp32 and stored once in x's dtype before the down projection (as an unfused bf16 MLP would).
    Inside `torch.autocast` the floating-point inputs are first cast to the region's dtype, as for
    `torch.nn.functional.linear` (the result then has that dtype; float64 is left alone).
    """
    return torch.ops.fused.ffn(x, w1, w3, w2, mask, u1, u3, u2, allow_tf32, routing, recompute, residual)


# ------------------------------------------------------------------------------------------------------------------
# helpers shared by the modules


def _is_silu(act) -> bool:
    """True when `act` computes SiLU (x * sigmoid(x)): an nn.SiLU, F.silu, or anything numerically equal to it."""
    if act is None:
        return False
    if isinstance(act, nn.SiLU) or act is F.silu or act is torch.nn.functional.silu:
        return True
    if not callable(act):
        return False
    try:  # e.g. HF's ACT2FN["swish"] in some versions, or a user's lambda: compare numerically on a probe
        with torch.no_grad():
            t = torch.linspace(-8.0, 8.0, 161, dtype=torch.float32)
            got = act(t)
            return isinstance(got, torch.Tensor) and got.shape == t.shape and bool(
                torch.allclose(got.float(), F.silu(t), rtol=1e-5, atol=1e-6))
    except Exception:  # noqa: BLE001 (an activation that cannot run on a CPU float32 tensor is not plain SiLU)
        return False


def _linear_weight(mod, owner: str, name: str) -> torch.Tensor:
    lin = getattr(mod, name, None)
    w = getattr(lin, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"{owner}: expected `{name}` to be an nn.Linear (a 2-D .weight), got {type(lin).__name__}")
    if getattr(lin, "bias", None) is not None:
        raise ValueError(f"{owner}: `{name}` has a bias; the fused FFN has none (LlamaConfig(mlp_bias=False))")
    return w


def _swiglu_weights(mlp, owner: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w3, w2) of a LlamaMLP-like module (gate_proj / up_proj / down_proj nn.Linear without bias and a SiLU
    act_fn) or of a FusedSwiGLU. Checks the shapes: w1, w3 `[I, H]`, w2 `[H, I]`, one dtype and device."""
    if isinstance(mlp, FusedSwiGLU):
        return mlp.w1, mlp.w3, mlp.w2
    w1 = _linear_weight(mlp, owner, "gate_proj")
    w3 = _linear_weight(mlp, owner, "up_proj")
    w2 = _linear_weight(mlp, owner, "down_proj")
    act = getattr(mlp, "act_fn", None)
    if not _is_silu(act):
        hidden_act = getattr(getattr(mlp, "config", None), "hidden_act", None)
        raise ValueError(f"{owner}: the MLP's act_fn must be SiLU (hidden_act 'silu'), got {act!r}"
                         + (f" (config.hidden_act={hidden_act!r})" if hidden_act is not None else ""))
    inter, hidden = w1.shape
    if tuple(w3.shape) != (inter, hidden) or tuple(w2.shape) != (hidden, inter):
        raise ValueError(f"{owner}: inconsistent shapes gate_proj {tuple(w1.shape)}, up_proj {tuple(w3.shape)}, "
                         f"down_proj {tuple(w2.shape)} (expected [I, H], [I, H], [H, I])")
    if len({w.dtype for w in (w1, w3, w2)}) != 1 or len({w.device for w in (w1, w3, w2)}) != 1:
        raise ValueError(f"{owner}: gate_proj, up_proj and down_proj must share dtype and device")
    return w1, w3, w2


def _init_linear_(w: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # nn.Linear's default weight init (bias-free)


# ------------------------------------------------------------------------------------------------------------------
# modules


class FusedSwiGLU(nn.Module):
    """LLaMA's MLP `down_proj(silu(gate_proj(x)) * up_proj(x))` as one fused op (`ffn` with a single expert).

    Args:
        hidden_size: H.
        intermediate_size: I.
        allow_tf32, recompute, device, dtype: keyword-only (see `ffn`; factory arguments as for nn.Linear).

    Parameters (nn.Linear layout, no bias):
        w1: gate projection `[I, H]` (HF `gate_proj.weight`).
        w3: up projection `[I, H]` (HF `up_proj.weight`).
        w2: down projection `[H, I]` (HF `down_proj.weight`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, allow_tf32: bool = False,
                 recompute: bool = False, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.allow_tf32 = bool(allow_tf32)
        self.recompute = bool(recompute)
        self.w1 = nn.Parameter(torch.empty(self.intermediate_size, self.hidden_size, **factory))
        self.w3 = nn.Parameter(torch.empty(self.intermediate_size, self.hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(self.hidden_size, self.intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default initialization for each projection."""
        for w in (self.w1, self.w3, self.w2):
            _init_linear_(w)

    @classmethod
    def from_llama_mlp(cls, mlp: nn.Module, *, allow_tf32: bool = False, recompute: bool = False) -> "FusedSwiGLU":
        """A FusedSwiGLU holding copies of an HF `LlamaMLP`'s weights (gate_proj -> w1, up_proj -> w3,
        down_proj -> w2), on their device and dtype.

        Any module with `gate_proj`, `up_proj`, `down_proj` (bias-free nn.Linear) and a SiLU `act_fn` is accepted
        (LlamaMLP, MistralMLP, Qwen2MLP, ...); transformers itself is never imported. Raises ValueError for another
        activation (e.g. hidden_act 'gelu') or for projections with a bias (`mlp_bias=True`).
        """
        w1, w3, w2 = _swiglu_weights(mlp, "FusedSwiGLU.from_llama_mlp")
        mod = cls(w1.shape[1], w1.shape[0], allow_tf32=allow_tf32, recompute=recompute, device=w1.device,
                  dtype=w1.dtype)
        with torch.no_grad():
            mod.w1.copy_(w1)
            mod.w3.copy_(w3)
            mod.w2.copy_(w2)
        return mod

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: `[..., hidden_size]` -> `[..., hidden_size]`; residual (x's shape): added to the output in the down
        projection's epilogue (see `ffn`)."""
        return torch.ops.fused.ffn(x, self.w1, self.w3, self.w2, None, None, None, None, self.allow_tf32, None,
                                   self.recompute, residual)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
                + (", allow_tf32=True" if self.allow_tf32 else "") + (", recompute=True" if self.recompute else ""))


class DualExpertSwiGLU(nn.Module):
    """CogVLM-style vision-expert MLP: two SwiGLU MLPs of the same shape; `forward(x, mask)` sends token `i` through
    the vision expert where `mask[i]` is true and through the text (language) expert elsewhere, in one fused op.

    Args:
        hidden_size: H.
        intermediate_size: I.
        allow_tf32, recompute, device, dtype: keyword-only (see `ffn`; factory arguments as for nn.Linear).

    Parameters: each projection of both experts in ONE tensor (so the kernels read both experts through one TMA
    descriptor, no copy), expert index 0 = text, 1 = vision, nn.Linear layout per expert:
        w1: gate projections `[2, I, H]`
        w3: up projections   `[2, I, H]`
        w2: down projections `[2, H, I]`
    In `ffn`'s naming the vision expert is (w1, w3, w2) = (`w1[1]`, `w3[1]`, `w2[1]`) and the text expert is
    (u1, u3, u2) = (`w1[0]`, `w3[0]`, `w2[0]`); `vision_weights` / `text_weights` return those views.
    """

    # Left to Python by `torch.jit.script` (see DualLinear): forward does not use them.
    __jit_unused_properties__ = ["vision_weights", "text_weights"]

    def __init__(self, hidden_size: int, intermediate_size: int, *, allow_tf32: bool = False,
                 recompute: bool = False, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.allow_tf32 = bool(allow_tf32)
        self.recompute = bool(recompute)
        self.w1 = nn.Parameter(torch.empty(2, self.intermediate_size, self.hidden_size, **factory))
        self.w3 = nn.Parameter(torch.empty(2, self.intermediate_size, self.hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(2, self.hidden_size, self.intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default initialization, independently per expert and projection."""
        for p in (self.w1, self.w3, self.w2):
            for e in (TEXT, VISION):
                _init_linear_(p[e])

    @property
    def vision_weights(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) of the vision expert (mask true): views `w1[1]`, `w3[1]`, `w2[1]`."""
        return self.w1[VISION], self.w3[VISION], self.w2[VISION]

    @property
    def text_weights(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u1, u3, u2) of the text expert (mask false): views `w1[0]`, `w3[0]`, `w2[0]`."""
        return self.w1[TEXT], self.w3[TEXT], self.w2[TEXT]

    @classmethod
    def from_modules(cls, vision_mlp: nn.Module, text_mlp: nn.Module, *,
                     allow_tf32: bool = False, recompute: bool = False) -> "DualExpertSwiGLU":
        """A DualExpertSwiGLU holding copies of two experts' weights, on their device and dtype.

        Each argument is a LlamaMLP-like module (bias-free `gate_proj`, `up_proj`, `down_proj` and a SiLU `act_fn`,
        e.g. CogVLM's `vision_mlp` / `language_mlp`) or a FusedSwiGLU. Both must have the same sizes, dtype and
        device.
        """
        owner = "DualExpertSwiGLU.from_modules"
        wv = _swiglu_weights(vision_mlp, owner + " (vision_mlp)")
        wt = _swiglu_weights(text_mlp, owner + " (text_mlp)")
        for a, b in zip(wv, wt):
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                raise ValueError(f"{owner}: the experts differ: {tuple(a.shape)} {a.dtype} {a.device} vs "
                                 f"{tuple(b.shape)} {b.dtype} {b.device}")
        mod = cls(wv[0].shape[1], wv[0].shape[0], allow_tf32=allow_tf32, recompute=recompute, device=wv[0].device,
                  dtype=wv[0].dtype)
        with torch.no_grad():
            for p, v, t in zip((mod.w1, mod.w3, mod.w2), wv, wt):
                p[VISION].copy_(v)
                p[TEXT].copy_(t)
        return mod

    def forward(self, x: torch.Tensor, mask: torch.Tensor, routing: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: `[..., hidden_size]`; mask: bool `[...]` (True = vision token); routing: `fused_ops.route(mask)` or None;
        residual: added to the output in the epilogue (see `ffn`). Returns `[..., hidden_size]`."""
        # The stacked parameters as they are: the op reads both experts in place and writes their gradients into one
        # [2, ...] tensor each (views w[1], w[0] would cost autograd a stack of the per-expert gradients per step).
        return torch.ops.fused.ffn(x, self.w1, self.w3, self.w2, mask, None, None, None, self.allow_tf32, routing,
                                   self.recompute, residual)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"experts=[text, vision]" + (", allow_tf32=True" if self.allow_tf32 else "")
                + (", recompute=True" if self.recompute else ""))
