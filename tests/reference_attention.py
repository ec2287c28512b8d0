"""Independent float64 reference for `fused::decode_attention` (the contract in csrc/torch_bindings.cpp), written from
the contract, not from any kernel:

- sequence b has L = cache_lens[b] positions in the cache; its T new tokens take positions L .. L+T-1;
- keys / values of sequence b, KV head j: cache rows 0 .. L-1 of k_cache[b, j] / v_cache[b, j], then k_new[b, :, j] /
  v_new[b, :, j];
- query token t, head h (KV head h // G, G = Hq / Hkv) attends positions 0 .. L + t:
  out[b, t, h] = softmax(scale * q[b, t, h] · K[0 .. L+t]ᵀ) · V[0 .. L+t], scale = 1/sqrt(D) by default;
- the caches afterwards: positions L .. L+T-1 of k_cache[b, :] / v_cache[b, :] hold k_new[b] / v_new[b] (exact
  copies), every other position unchanged.

Float64 on the inputs' device; loops over sequences and query tokens (one softmax per row, no tricks).
"""
import math
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["decode_attention_reference", "cache_after"]


def _lens(cache_lens: Union[torch.Tensor, Sequence[int]]):
    if isinstance(cache_lens, torch.Tensor):
        return [int(v) for v in cache_lens.detach().cpu().tolist()]
    return [int(v) for v in cache_lens]


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                               v_new: torch.Tensor, cache_lens, scale: Optional[float] = None) -> torch.Tensor:
    """out [B, T, Hq, D] in float64 (see the module doc). The caches are read, not changed."""
    B, T, Hq, D = q.shape
    Hkv = k_new.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq = {Hq} is not a multiple of Hkv = {Hkv}")
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    f64 = torch.float64
    out = torch.empty(B, T, Hq, D, dtype=f64, device=q.device)
    for b, L in enumerate(_lens(cache_lens)):
        if L < 0 or L + T > k_cache.shape[2]:
            raise ValueError(f"cache_lens[{b}] = {L}: positions up to {L + T} do not fit the cache")
        keys = torch.cat([k_cache[b, :, :L].to(f64), k_new[b].transpose(0, 1).to(f64)], dim=1)  # [Hkv, L+T, D]
        vals = torch.cat([v_cache[b, :, :L].to(f64), v_new[b].transpose(0, 1).to(f64)], dim=1)
        for t in range(T):
            n = L + t + 1
            for j in range(Hkv):
                qh = q[b, t, j * G:(j + 1) * G].to(f64)  # [G, D]
                w = torch.softmax(scale * qh @ keys[j, :n].T, dim=-1)  # [G, n]
                out[b, t, j * G:(j + 1) * G] = w @ vals[j, :n]
    return out


def cache_after(cache: torch.Tensor, new: torch.Tensor, cache_lens) -> torch.Tensor:
    """The cache [B, Hkv, S, D] after the op: new [B, T, Hkv, D] copied to positions L .. L+T-1 of each sequence."""
    want = cache.clone()
    T = new.shape[1]
    for b, L in enumerate(_lens(cache_lens)):
        want[b, :, L:L + T] = new[b].transpose(0, 1).to(cache.dtype)
    return want
