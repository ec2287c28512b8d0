"""The KV cache of generation: static buffers, and per-sequence lengths that live on the device.

`KVCache` (common.py) keeps one length for the whole batch as a Python int, which a CUDA graph would capture as a
constant: a step captured at length 100 replays position 100 forever. `DecodeCache` keeps the same buffers plus

    lens   int32 [batch] on the buffers' device: positions already cached per sequence (ragged batches: each
           sequence at its own length). A decode step writes its new keys and values at `[lens[b], lens[b] + T)`
           (`torch.ops.fused.decode_attention` does), rotates them by RoPE at positions `lens[b] + t`
           (`rope_fwd_qk(..., start_positions=lens)`) and then adds T to `lens` in place, on the device.
    freqs  float32 [max_len, 1, 1, head_dim]: the RoPE angles of every position the cache can hold, built once
           here, so that nothing in a step grows a table (a table grown while a graph is captured would live in the
           graph's memory pool and be overwritten by its replays).

So a step's shapes and arguments are the same at every token: it can be captured once and replayed. Prefill goes
through the existing fused forward on `prefill_view(start, stop)` (a `KVCache` over some rows, at length 0), after
which `set_lens` records each prompt's own length. The values of `lens` are the caller's to keep within `max_len`
(checked on the host before generation starts: reading them back during it would cost a host sync).
"""
from typing import List, Sequence

import torch

from .common import KVCache, rope_table
from .config import CogVLMConfig

__all__ = ["DecodeCache"]


class DecodeCache:
    """Per layer `k[i]`, `v[i]`: `[batch, kv_heads, max_len, head_dim]` (KVCache's layout, the one
    `decode_attention` reads); `lens` int32 `[batch]`; `freqs` the RoPE table of `max_len` positions.

    Args:
        config: the model's config (layers, kv_heads, head_dim, rope_theta).
        batch: rows (sequences); a generation of fewer sequences uses the first rows (`rows(n)`).
        max_len: positions per sequence (prompt and generated tokens).
        device, dtype: the buffers' (dtype: the activations').
    """

    def __init__(self, config: CogVLMConfig, batch: int, max_len: int, *, device=None, dtype=None):
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"DecodeCache: batch={batch} and max_len={max_len} must be positive")
        self._store = KVCache(config, batch, max_len, device=device, dtype=dtype)
        self.k: List[torch.Tensor] = self._store.k
        self.v: List[torch.Tensor] = self._store.v
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.freqs = rope_table(config, max_len, self.lens.device)
        self.batch, self.max_len = batch, max_len

    def rows(self, n: int) -> "DecodeCache":
        """The first `n` rows, sharing every buffer (views: a graph captured on them reads and writes this cache)."""
        if not 0 < n <= self.batch:
            raise ValueError(f"DecodeCache.rows: n={n} must be in [1, {self.batch}]")
        view = object.__new__(DecodeCache)
        view._store = self._store
        view.k, view.v = [t[:n] for t in self.k], [t[:n] for t in self.v]
        view.lens, view.freqs, view.batch, view.max_len = self.lens[:n], self.freqs, n, self.max_len
        return view

    def prefill_view(self, start: int, stop: int) -> KVCache:
        """A `KVCache` over rows `[start, stop)` at length 0, for the fused model's ordinary forward (prefill)."""
        return self._store.rows(start, stop)

    def set_lens(self, lens: Sequence[int]) -> None:
        """Sets `lens[:len(lens)]` from host integers (one non-blocking copy; no host sync)."""
        host = torch.tensor(list(lens), dtype=torch.int32)
        self.lens[:host.numel()].copy_(host, non_blocking=True)

    def check(self, config: CogVLMConfig, x: torch.Tensor, owner: str) -> None:
        """Raises ValueError unless a step of `x` `[batch, T, hidden]` fits (shapes, dtype, device; not lengths)."""
        k0 = self.k[0]
        problems = []
        if len(self.k) != config.layers:
            problems.append(f"it has {len(self.k)} layers, the model {config.layers}")
        if (k0.shape[1], k0.shape[3]) != (config.kv_heads, config.head_dim):
            problems.append(f"its buffers are {tuple(k0.shape)}, the model has kv_heads={config.kv_heads}, "
                            f"head_dim={config.head_dim}")
        if x.shape[0] != self.batch:
            problems.append(f"its batch is {self.batch}, x's {x.shape[0]}")
        if k0.dtype != x.dtype or k0.device != x.device:
            problems.append(f"its buffers are {k0.dtype} on {k0.device}, x is {x.dtype} on {x.device}")
        if problems:
            raise ValueError(f"{owner}: decode cache does not fit: " + "; ".join(problems))
