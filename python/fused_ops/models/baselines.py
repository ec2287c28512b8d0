"""Baseline (b) of the main job: the CogVLM-style decoder with its routed projections written as torchtitan's MoE
writes its experts: sort the tokens by expert, one `torch._grouped_mm` per projection over both experts' row
groups, scatter the rows back to token order.

    once per forward:  perm = stable argsort of the mask (text rows, then vision rows, each in token order),
                       inv = its inverse, offs = int32 [n_text, M] (cumulative group ends, _grouped_mm's `offs`)
    per projection:    out = _grouped_mm(x[perm], W.transpose(-2, -1), offs=offs)[inv]

with W the fused model's `[2, N, K]` parameters (expert 0 = text), read as `[2, K, N]` column-major views (no copy).
The parameters and state dict are `FusedCogVLM`'s (load one into the other); the norms are `F.rms_norm` (as
torchtitan's), RoPE is `rotate_half` in float32 on the same angles, attention the same SDPA call.

`torch._grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None)` is a private torch op (torch >= 2.8;
signature checked on torch 2.14's CPU path): with a 2-D `mat_a [M, K]` and a 3-D `mat_b [G, K, N]`, rows
`offs[g-1]:offs[g]` of mat_a are multiplied by `mat_b[g]` (offs int32 `[G]`, cumulative, on mat_a's device); strides
must be multiples of 16 bytes. Its fast CUDA path is bf16 on sm_90 / sm_100 (CUTLASS; elsewhere torch >= 2.10 loops
over the groups with a host read of offs); on the CPU torch 2.14 runs float32 / bf16 / fp16 but not float64, and a
backward needs an upstream gradient with real strides (not an expanded `sum()` gradient). It is differentiable
w.r.t. both operands.
"""
from typing import NamedTuple, Tuple

import torch
import torch.nn.functional as F

from .cogvlm import FusedCogVLM, FusedDecoderLayer
from .common import causal_attention
from .config import CogVLMConfig

__all__ = ["GroupedMMCogVLM", "ExpertSort", "sort_by_expert", "grouped_linear"]


class ExpertSort(NamedTuple):
    """The token order of one forward pass (all tensors on the mask's device, no host sync to build)."""
    perm: torch.Tensor      # int64 [M]: token indices, text tokens first, then vision tokens, each in token order
    inv: torch.Tensor       # int64 [M]: row of each token in the sorted order (perm's inverse)
    offs: torch.Tensor      # int32 [2]: [n_text, M], the end of each expert's rows (torch._grouped_mm's offs)
    vision: torch.Tensor    # bool [M, 1]: whether each sorted row is a vision row (for the vision-only QKV bias)


def sort_by_expert(mask: torch.Tensor) -> ExpertSort:
    """The sort of `mask` (bool, any shape, M = its numel) that every grouped projection of a forward shares."""
    flat = mask.reshape(-1)
    perm = torch.argsort(flat.to(torch.uint8), stable=True)
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    n_text = (~flat).sum(dtype=torch.int32)
    offs = torch.stack((n_text, torch.full_like(n_text, flat.numel())))
    return ExpertSort(perm, inv, offs, flat.index_select(0, perm).unsqueeze(1))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, order: ExpertSort, bias_v=None) -> torch.Tensor:
    """`[..., K]` in token order -> `[..., N]`: row i through `weight[1]` (vision) if its mask is set, else
    `weight[0]`; weight `[2, N, K]`; bias_v `[N]`: added to the vision rows only."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = _grouped(x.reshape(-1, k).index_select(0, order.perm), weight, order)
    if bias_v is not None:
        rows = rows + order.vision.to(rows.dtype) * bias_v
    return rows.index_select(0, order.inv).view(*lead, weight.shape[1])


def _grouped(rows: torch.Tensor, weight: torch.Tensor, order: ExpertSort) -> torch.Tensor:
    return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=order.offs)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE of t `[b, s, h, d]` in float32 (float64 stays), one rounding; cos / sin `[s, 1, d]`."""
    tf = t.to(cos.dtype)
    half = t.shape[-1] // 2
    rot = torch.cat((-tf[..., half:], tf[..., :half]), dim=-1)
    return (tf * cos + rot * sin).to(t.dtype)


class GroupedMMDecoderLayer(FusedDecoderLayer):
    """FusedDecoderLayer's parameters; its routed projections as sort + torch._grouped_mm + scatter."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor, order: ExpertSort, rope: Tuple[torch.Tensor, torch.Tensor],
                cache=None, layer: int = 0) -> torch.Tensor:
        c, a = self.config, self.self_attn
        b, s, _ = x.shape
        qkv = grouped_linear(self.input_layernorm(x), a.query_key_value.weight, order, a.vision_qkv_bias)
        q, k, v = qkv.split((c.q_size, c.kv_size, c.kv_size), dim=-1)
        q = _rope(q.view(b, s, c.heads, c.head_dim), *rope).transpose(1, 2)
        k = _rope(k.view(b, s, c.kv_heads, c.head_dim), *rope).transpose(1, 2)
        v = v.view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(layer, k, v)
        o = causal_attention(q, k, v, past).transpose(1, 2).reshape(b, s, c.q_size)
        h = x + grouped_linear(o, a.dense.weight, order)
        # the MLP: sort once, gate and up grouped GEMMs, SwiGLU, down grouped GEMM, unsort
        m = self.mlp
        rows = self.post_attention_layernorm(h).reshape(-1, c.hidden).index_select(0, order.perm)
        act = F.silu(_grouped(rows, m.w1, order)) * _grouped(rows, m.w3, order)
        return h + _grouped(act, m.w2, order).index_select(0, order.inv).view(b, s, c.hidden)


class GroupedMMCogVLM(FusedCogVLM):
    """Baseline (b): `FusedCogVLM`'s parameters and forward signature, the routed projections computed with
    `torch._grouped_mm` over expert-sorted tokens. Only configs with the visual expert (a single expert has nothing
    to route); load weights with `load_state_dict(fused.state_dict())`. Raises ValueError for float64 (which
    `torch._grouped_mm` does not take) and RuntimeError where torch has no `_grouped_mm`."""

    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        if not config.vision_expert:
            raise ValueError("GroupedMMCogVLM: the grouped-GEMM baseline needs the visual expert (vision_expert=True)")
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(f"GroupedMMCogVLM: torch {torch.__version__} has no torch._grouped_mm (torch >= 2.8)")
        super().__init__(config, device=device, dtype=dtype)

    @staticmethod
    def _make_layer(config: CogVLMConfig, factory: dict):
        return GroupedMMDecoderLayer(config, **factory)

    def _routing(self, mask: torch.Tensor) -> ExpertSort:
        return sort_by_expert(mask)

    def _rope(self, past: int, s: int, device):
        f = super()._rope(past, s, device).flatten(1)  # float32 angles [s, d]
        return f.cos().unsqueeze(1), f.sin().unsqueeze(1)  # [s, 1, d]: broadcast over heads

    def forward(self, x, mask=None, *, cache=None):
        if x.dtype == torch.float64:
            raise ValueError("GroupedMMCogVLM: torch._grouped_mm takes float32 / bfloat16 / float16, not float64")
        return super().forward(x, mask, cache=cache)
