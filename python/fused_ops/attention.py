"""Decode attention against a KV cache: a documented wrapper over ``torch.ops.fused.decode_attention`` (the schema and
its contract: ``csrc/torch_bindings.cpp``; the kernel: ``kernels/decode_attention.py``). Importing this module loads
no GPU toolchain (no triton import)."""
from typing import Optional

import torch

__all__ = ["decode_attention"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                     v_new: torch.Tensor, cache_lens: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """One decode step's attention: T new tokens per sequence against the KV cache, their keys and values written into
    the cache in the same launch. Returns ``out`` ``[B, T, Hq, D]`` (contiguous, ``q``'s dtype).

    Args:
        q: ``[B, T, Hq, D]``, the new tokens' queries (after RoPE), ``T`` from 1 to 16.
        k_cache, v_cache: ``[B, Hkv, S, D]``, the cache (``fused_ops.models.KVCache``'s layout), written in place:
            positions ``cache_lens[b] .. cache_lens[b] + T - 1`` of sequence ``b`` receive ``k_new[b]`` / ``v_new[b]``;
            nothing else in them changes.
        k_new, v_new: ``[B, T, Hkv, D]``, the new tokens' keys (after RoPE) and values; ``Hq`` a multiple of ``Hkv``
            (grouped-query attention: query head ``h`` reads KV head ``h // (Hq // Hkv)``, whose cache is read once for
            all of its query heads).
        cache_lens: int32 ``[B]`` on ``q``'s device, the positions already in the cache of each sequence (ragged).
            It is not advanced: add ``T`` after the call (a device op, ``cache_lens += T``).
        scale: the softmax scale, ``1 / sqrt(D)`` by default.

    Query ``t`` of sequence ``b`` attends cache positions ``0 .. cache_lens[b] - 1`` and the new tokens ``0 .. t``
    (causal among the new tokens). Every tensor may be a strided view whose last dimension is contiguous (e.g. the q,
    k and v slices of a fused QKV projection's output): nothing is copied.

    Dtypes: bfloat16 or float16 on CUDA (head dims 64, 128, 256); also float32 and float64, and any head dim, on the
    CPU, which computes in float32 (float64) and rounds once.

    Lengths: on the CPU a ``cache_lens[b]`` that is negative or leaves no room for the T new tokens
    (``cache_lens[b] + T > S``) raises ``ValueError``. On CUDA the op does not read ``cache_lens`` on the host (that
    would synchronize with the device, and a CUDA graph replays with other lengths), so such a sequence is not an
    error there: it gets NaN outputs and no cache write, and nothing outside the cache is touched. The caller
    validates the lengths on the host up front (a generation loop knows its largest length before it starts: it must
    fit in ``S``).

    The CUDA path never synchronizes the host and depends on no host value that changes per token: a decode step that
    calls it can be captured in a CUDA graph once and replayed at every length. Not differentiable (inference only).
    """
    return torch.ops.fused.decode_attention(q, k_cache, v_cache, k_new, v_new, cache_lens, scale)
