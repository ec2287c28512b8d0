"""The model every deployment path exports: a small transformer-style block on the fused ops, and its float64
reference written in plain PyTorch.

    r   = route(mask)                        torch.ops.fused.route: the mask's routing, shared by both routed ops
    q   = rope(DualLinear(x, mask, r))       torch.ops.fused.linear_dual, then torch.ops.fused.rope_fwd ("bshd")
    y   = x + q
    y   = y + DualExpertSwiGLU(y, mask, r)   torch.ops.fused.ffn, dual expert (routed by mask)
    out = y + FusedSwiGLU(y)                 torch.ops.fused.ffn, single expert

(A "query projection with RoPE" stands in for attention, which is not one of the ops.) Used by
examples/cpp/export_model.py (TorchScript model for the C++ example) and by tests/test_deploy_*.py (TorchScript, trace,
torch.compile, torch.export, AOTInductor).

Shapes: x `[b, s, hidden]`, mask bool `[b, s]` (True = vision token), freqs float32 `[s, 1, 1, head_dim]` (from
`fused_ops.RotaryPositionEmbedding`). freqs is an input rather than a buffer so that converting the model to bf16
(`model.to(torch.bfloat16)`, also from C++) leaves the rotation angles in float32, as the op requires.
"""
from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import fused_ops


class FusedBlock(nn.Module):
    """The block above. `hidden` must be `heads * head_dim`; head_dim even."""

    def __init__(self, hidden: int = 64, heads: int = 4, intermediate: int = 96, *, device=None, dtype=None):
        super().__init__()
        if hidden % heads or (hidden // heads) % 2:
            raise ValueError(f"FusedBlock: hidden={hidden} must be heads={heads} times an even head_dim")
        factory = {"device": device, "dtype": dtype}
        self.heads = heads
        self.head_dim = hidden // heads
        self.proj = fused_ops.DualLinear(hidden, hidden, **factory)
        self.mlp_dual = fused_ops.DualExpertSwiGLU(hidden, intermediate, **factory)
        self.mlp = fused_ops.FusedSwiGLU(hidden, intermediate, **factory)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, hidden = x.shape
        routing = fused_ops.route(mask)  # once for the routed ops below (a model: for all its layers)
        q = self.proj(x, mask, routing).view(b, s, self.heads, self.head_dim)
        q = torch.ops.fused.rope_fwd(q, freqs, "bshd")
        y = x + q.view(b, s, hidden)
        y = y + self.mlp_dual(y, mask, routing)
        return y + self.mlp(y)


#: (batch, seq) of 1, 7, 300, 4096 and 8192 tokens: the lengths that one exported program, one AOTInductor package and
#: one torch.compile(dynamic=True) graph of the block serve (tests/test_deploy_pt2.py, examples/cpp). The first has no
#: size 1: torch.compile traces the first, and torch specializes a dimension of size 1 it traces.
LENGTHS = ((2, 150), (1, 1), (1, 7), (2, 2048), (1, 8192))


def dynamic_shapes(max_batch: int = 64, max_seq: int = 8192):
    """torch.export's `dynamic_shapes` of `FusedBlock.forward(x, mask, freqs)`: batch and sequence dynamic (from 1),
    shared by x [b, s, hidden], mask [b, s] and freqs [s, 1, 1, head_dim]."""
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    seq = torch.export.Dim("seq", min=1, max=max_seq)
    return ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: seq})


def make_inputs(block: FusedBlock, batch: int = 2, seq: int = 8, *, device="cpu", dtype=torch.float32,
                seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random non-zero x, a random mask holding both experts, and the block's freqs. Also re-draws the block's
    parameters from the same seed (nn.Linear's init), so that a run is reproducible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.empty(p.shape).uniform_(-0.15, 0.15, generator=g))
    x = torch.randn(batch, seq, block.heads * block.head_dim, generator=g)
    mask = torch.rand(batch, seq, generator=g) < 0.5
    both = torch.tensor([True, False])  # both experts always present (from two tokens on)
    mask.view(-1)[:2] = both[:mask.numel()]
    freqs = fused_ops.RotaryPositionEmbedding(block.head_dim, device="cpu")(seq)
    return x.to(device=device, dtype=dtype), mask.to(device), freqs.to(device)


# ------------------------------------------------------------------------------------------------------------------
# the reference: plain PyTorch from the op semantics (docs/design.md), no fused op


def _rope_bshd(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    f = freqs.transpose(0, 1).to(t.dtype)  # [1, s, 1, d]
    t1, t2 = t.chunk(2, dim=-1)
    return t * f.cos() + torch.cat((-t2, t1), dim=-1) * f.sin()


def _swiglu(a: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(a, w1)) * F.linear(a, w3), w2)


def reference_forward(params: Dict[str, torch.Tensor], heads: int, x: torch.Tensor, mask: torch.Tensor,
                      freqs: torch.Tensor) -> torch.Tensor:
    """The block in plain PyTorch on `params` (FusedBlock's named parameters; expert 0 = text, 1 = vision), in the
    dtype of x (use float64). Both experts are computed for every token and `mask` picks one."""
    b, s, hidden = x.shape
    m = mask.unsqueeze(-1)
    w, bias = params["proj.weight"], params["proj.bias"]
    q = torch.where(m, F.linear(x, w[1], bias[1]), F.linear(x, w[0], bias[0]))
    y = x + _rope_bshd(q.view(b, s, heads, hidden // heads), freqs).reshape(b, s, hidden)
    w1, w3, w2 = params["mlp_dual.w1"], params["mlp_dual.w3"], params["mlp_dual.w2"]
    y = y + torch.where(m, _swiglu(y, w1[1], w3[1], w2[1]), _swiglu(y, w1[0], w3[0], w2[0]))
    return y + _swiglu(y, params["mlp.w1"], params["mlp.w3"], params["mlp.w2"])


def reference_grads(block: FusedBlock, x: torch.Tensor, mask: torch.Tensor, freqs: torch.Tensor,
                    grad_out: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(out, grads) in float64: `grads["x"]` and one entry per named parameter of the block, for the upstream
    gradient `grad_out`."""
    params = {k: v.detach().double().requires_grad_(True) for k, v in block.named_parameters()}
    x64 = x.detach().double().requires_grad_(True)
    out = reference_forward(params, block.heads, x64, mask, freqs.double())
    names = ["x"] + list(params)
    grads = torch.autograd.grad(out, [x64] + list(params.values()), grad_out.double())
    return out.detach(), dict(zip(names, grads))
