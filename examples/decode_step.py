"""The decode-attention model of the deployment paths: one decode step's attention over a KV cache held as buffers,
on `torch.ops.fused.decode_attention`, and its float64 reference in plain PyTorch.

    q, k, v = split(qkv)                          the fused QKV projection's output [b, t, heads + 2 kv_heads, d]
    out     = decode_attention(q, k_cache, v_cache, k, v, cache_lens)   k, v written into the caches at cache_lens

cache_lens is an input (int32 [b], on the model's device), so one scripted module, exported program or AOTInductor
package serves every length: the lengths are data, not shapes. Used by tests/test_deploy_torchscript.py,
tests/test_deploy_pt2.py and examples/cpp/export_model.py (the C++ example runs the scripted step). The caches are
bfloat16 on CUDA (the compiled kernels are bf16 / fp16), float32 on the CPU.
"""
import math
from typing import Tuple

import torch
from torch import nn

import fused_ops  # noqa: F401  (registers torch.ops.fused.*)


class DecodeStep(nn.Module):
    """A KV cache [batch, kv_heads, max_len, head_dim] (buffers k_cache, v_cache) and the attention of `tokens` new
    tokens per sequence against it; forward(qkv, cache_lens) -> [batch, tokens, heads * head_dim]."""

    def __init__(self, batch: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 64, max_len: int = 40, *,
                 device=None, dtype=None):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"DecodeStep: heads={heads} must be a multiple of kv_heads={kv_heads}")
        self.heads, self.kv_heads = heads, kv_heads
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, device=device, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, device=device, dtype=dtype))

    def forward(self, qkv: torch.Tensor, cache_lens: torch.Tensor) -> torch.Tensor:
        h, hkv = self.heads, self.kv_heads
        q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hkv], qkv[:, :, h + hkv:]  # views: no copy
        out = torch.ops.fused.decode_attention(q, self.k_cache, self.v_cache, k, v, cache_lens)
        return out.flatten(2)


def make_inputs(step: DecodeStep, tokens: int = 1, *, room: int = 0, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fills the caches with random values and returns (qkv, cache_lens): random new tokens and ragged lengths that
    leave room for them and `room` more positions (later steps), on the module's device and dtype."""
    b, hkv, s, d = step.k_cache.shape
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        step.k_cache.copy_(torch.randn(step.k_cache.shape, generator=g))
        step.v_cache.copy_(torch.randn(step.v_cache.shape, generator=g))
    qkv = torch.randn(b, tokens, step.heads + 2 * hkv, d, generator=g)
    lens = torch.randint(0, s - tokens - room + 1, (b,), generator=g, dtype=torch.int32)
    return qkv.to(step.k_cache), lens.to(step.k_cache.device)


def reference(k_cache: torch.Tensor, v_cache: torch.Tensor, qkv: torch.Tensor, cache_lens: torch.Tensor,
              heads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [b, t, heads * d], k_cache after, v_cache after) in float64: the contract of decode_attention written out
    with plain PyTorch (softmax over the cache's first cache_lens[b] positions and the new tokens up to t)."""
    b, t, _, d = qkv.shape
    hkv = k_cache.shape[1]
    qkv, kc, vc = qkv.double(), k_cache.double().clone(), v_cache.double().clone()
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + hkv], qkv[:, :, heads + hkv:]
    out = torch.empty(b, t, heads, d, dtype=torch.float64, device=qkv.device)
    for i, n in enumerate(cache_lens.tolist()):
        kc[i, :, n:n + t] = k[i].transpose(0, 1)
        vc[i, :, n:n + t] = v[i].transpose(0, 1)
        keys = kc[i, :, :n + t].repeat_interleave(heads // hkv, 0)  # [heads, n + t, d]
        vals = vc[i, :, :n + t].repeat_interleave(heads // hkv, 0)
        scores = torch.einsum("thd,hsd->hts", q[i], keys) / math.sqrt(d)
        causal = torch.arange(n + t, device=qkv.device)[None, :] <= n + torch.arange(t, device=qkv.device)[:, None]
        w = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[i] = torch.einsum("hts,hsd->thd", w, vals)
    return out.flatten(2), kc, vc
