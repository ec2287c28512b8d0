"""Pieces every implementation of the CogVLM-style decoder shares, so that they differ only where they are compared:
the KV cache, causal attention (one SDPA call, the same in every implementation), the RoPE angle table, and the
input checks.

Shapes: `b` batch, `s` new tokens, `hq` / `hk` query / key-value heads, `d` head dim, `past` tokens already cached.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..rope import RotaryPositionEmbedding
from .config import CogVLMConfig

__all__ = ["KVCache", "causal_attention", "rope_table", "check_inputs"]


class KVCache:
    """Static key/value buffers for decoding, one pair per layer, shared by the whole batch.

    `k[i]`, `v[i]`: `[batch, kv_heads, max_len, head_dim]` (SDPA's layout, so the attention reads a slice of the
    buffer with no copy). Positions `[0, length)` are filled, the same number for every sequence of the batch (a
    batch of prompts of one length, as the main job decodes; ragged batches would need a padding mask). A model's
    forward writes its `s` new keys and values of layer `i` at `[length, length + s)` and advances `length` by `s`
    after its last layer; so the new tokens' positions, for RoPE, are `length + j`.

    Args:
        config: the model's config (layers, kv_heads, head_dim).
        batch: sequences.
        max_len: positions the buffers hold.
        device, dtype: the buffers'; dtype must be the activations' dtype.
    """

    def __init__(self, config: CogVLMConfig, batch: int, max_len: int, *, device=None, dtype=None):
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"KVCache: batch={batch} and max_len={max_len} must be positive")
        shape = (batch, config.kv_heads, max_len, config.head_dim)
        dtype = config.dtype if dtype is None else dtype
        self.k: List[torch.Tensor] = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.layers)]
        self.v: List[torch.Tensor] = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.layers)]
        self.batch, self.max_len, self.length = batch, max_len, 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Writes layer `layer`'s new keys and values `[b, hk, s, d]` at `[length, length + s)`; returns the keys and
        values of positions `[0, length + s)` (views of the buffers, `[b, hk, length + s, d]`)."""
        start, end = self.length, self.length + k.shape[2]
        self.k[layer][:, :, start:end].copy_(k)
        self.v[layer][:, :, start:end].copy_(v)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def check(self, config: CogVLMConfig, x: torch.Tensor, owner: str) -> None:
        """Raises ValueError unless the cache fits a forward of `x` `[b, s, hidden]` through a model of `config`."""
        b, s = x.shape[0], x.shape[1]
        k0 = self.k[0] if self.k else None
        problems = []
        if len(self.k) != config.layers:
            problems.append(f"it has {len(self.k)} layers, the model {config.layers}")
        if k0 is not None and (k0.shape[1], k0.shape[3]) != (config.kv_heads, config.head_dim):
            problems.append(f"its buffers are {tuple(k0.shape)}, the model has kv_heads={config.kv_heads}, "
                            f"head_dim={config.head_dim}")
        if self.batch != b:
            problems.append(f"its batch is {self.batch}, x's {b}")
        if self.length + s > self.max_len:
            problems.append(f"length {self.length} + {s} new tokens exceeds max_len {self.max_len}")
        if k0 is not None and (k0.dtype != x.dtype or k0.device != x.device):
            problems.append(f"its buffers are {k0.dtype} on {k0.device}, x is {x.dtype} on {x.device}")
        if problems:
            raise ValueError(f"{owner}: cache does not fit: " + "; ".join(problems))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Causal grouped-query attention with `F.scaled_dot_product_attention`, the same call in every implementation.

    q `[b, hq, s, d]` at positions `past + i`; k, v `[b, hk, past + s, d]` (positions 0..past+s-1). Query i attends
    keys `0 .. past + i`. Returns `[b, hq, s, d]`. Query head j reads key-value head `j // (hq / hk)` (SDPA's
    `enable_gqa`, CogVLM2's expand of the key heads), without materializing repeated keys.
    """
    gqa = q.shape[1] != k.shape[1]
    s, t = q.shape[2], k.shape[2]
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if s == 1:  # one new token sees every cached one; SDPA's is_causal would align the mask top-left
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    # several new tokens after a cached prefix: the causal mask aligned bottom-right
    allowed = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)


def rope_table(config: CogVLMConfig, positions: int, device) -> torch.Tensor:
    """RoPE angles, float32 `[positions, 1, 1, head_dim]` (`fused_ops.RotaryPositionEmbedding`'s table: angle of
    position p, pair j = p * rope_theta^(-2j/head_dim), computed in float32). Every implementation takes its angles
    from this table (or computes the same float32 products), so that they rotate by identical angles."""
    return RotaryPositionEmbedding(config.head_dim, rotary_base=config.rope_theta, device=device)(positions)


def check_inputs(config: CogVLMConfig, x: torch.Tensor, mask: Optional[torch.Tensor], cache: Optional[KVCache],
                 owner: str) -> None:
    """The checks every model runs before touching anything (a cache is advanced only after they pass):
    x `[b, s, hidden]` floating point; for a model with the visual expert a bool mask `[b, s]` on x's device (True:
    the token goes through the vision expert); none for a single-expert model; a cache that fits."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != config.hidden or not x.is_floating_point():
        desc = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{owner}: x must be a floating-point [batch, seq, {config.hidden}] tensor, got {desc}")
    if config.vision_expert:
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"{owner}: mask (bool [batch, seq], True = vision token) is required by a model with the "
                             f"visual expert, got {type(mask).__name__}")
        if mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:2]) or mask.device != x.device:
            raise ValueError(f"{owner}: mask must be bool {list(x.shape[:2])} on {x.device} (x's batch and seq), got "
                             f"{mask.dtype} {list(mask.shape)} on {mask.device}")
    elif mask is not None:
        raise ValueError(f"{owner}: a single-expert model (vision_expert=False) takes no mask")
    if cache is not None:
        cache.check(config, x, owner)
