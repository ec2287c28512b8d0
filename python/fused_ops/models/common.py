"""Pieces every implementation of the CogVLM-style decoder shares, so that they differ only where they are compared:
the KV cache, causal attention (one SDPA call, the same in every implementation), the RoPE angle table, and the
input checks.

Shapes: `b` batch, `s` new tokens, `hq` / `hk` query / key-value heads, `d` head dim, `past` tokens already cached.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..rope import RotaryPositionEmbedding
from .config import CogVLMConfig

__all__ = ["KVCache", "causal_attention", "rope_table", "check_inputs", "check_prompt_inputs", "embed_prompt"]

#: SDPA backends of decode calls (a cached prefix): every one but cuDNN (see causal_attention)
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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

    def rows(self, start: int, stop: int) -> "KVCache":
        """A cache over sequences `[start, stop)` of this one, sharing its buffers (views: what a forward writes
        there lands in this cache), at length 0: e.g. a prefill of some of the batch's prompts at a time."""
        if not 0 <= start < stop <= self.batch:
            raise ValueError(f"KVCache.rows: [{start}, {stop}) is not a non-empty range of the batch's {self.batch} rows")
        view = object.__new__(KVCache)
        view.k = [t[start:stop] for t in self.k]
        view.v = [t[start:stop] for t in self.v]
        view.batch, view.max_len, view.length = stop - start, self.max_len, 0
        return view

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
    if gqa and _traced_without_flash(q):
        # torch.export / torch.compile of a CUDA model in a dtype flash attention does not take (float32): SDPA's CUDA
        # path expands the key heads itself (repeat_interleave), and the strides of that expansion give guards the
        # symbolic-shape solver cannot prove for a dynamic length (H200, torch 2.11: "Constraints violated (seq) ...
        # min(128*s, 512*s) == 128*s"); the CPU's path has no such step. An expansion of our own by repeat_interleave
        # or expand + reshape meets the same guards; index_select (key head j // group for query head j) writes a
        # fresh contiguous tensor and exports with every length (checked on the H200, float32 and bf16). Eager keeps
        # enable_gqa.
        index = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // k.shape[1])
        q, k, v = q.contiguous(), k.index_select(1, index), v.index_select(1, index)
        gqa = False
    s, t = q.shape[2], k.shape[2]
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # Decoding: the key length changes at every call. torch 2.11 picks its cuDNN backend for these shapes on an H200
    # and builds a cuDNN graph for every new length, about 44 ms of host time per call (measured: 70 ms per token of
    # a 2-layer eager decode, 0.7 ms of it on the GPU). Flash / memory-efficient attention have no per-shape setup.
    with sdpa_kernel(_DECODE_BACKENDS):
        if s == 1:  # one new token sees every cached one; SDPA's is_causal would align the mask top-left
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        # several new tokens after a cached prefix: the causal mask aligned bottom-right
        allowed = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)


def _traced_without_flash(q: torch.Tensor) -> bool:
    """Traced (torch.compile, torch.export) on CUDA in a dtype that SDPA's flash kernel, which reads grouped key heads
    in place, does not take."""
    return torch.compiler.is_compiling() and q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16)


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


def check_prompt_inputs(config: CogVLMConfig, input_ids: Optional[torch.Tensor], inputs_embeds: Optional[torch.Tensor],
                        embeds_mask: Optional[torch.Tensor], vision_mask: Optional[torch.Tensor], owner: str) -> None:
    """The checks of a causal LM's prompt (`embed_prompt`'s arguments), before anything runs: token ids
    `[b, s]` (integers; on the CPU also each in `[0, vocab)`: on a GPU reading them back would sync, and an id out of
    range fails in the embedding as in torch), and/or embeddings `[b, s, hidden]`; `embeds_mask` bool `[b, s]` only
    with both; the vision mask as the decoder takes it (bool `[b, s]` with the visual expert, None without)."""
    if input_ids is None and inputs_embeds is None:
        raise ValueError(f"{owner}: give input_ids [batch, seq], inputs_embeds [batch, seq, {config.hidden}], or both")
    lead = None
    if input_ids is not None:
        if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point()
                or input_ids.is_complex() or input_ids.dtype == torch.bool):
            desc = f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else \
                type(input_ids).__name__
            raise ValueError(f"{owner}: input_ids must be an integer [batch, seq] tensor, got {desc}")
        if input_ids.device.type == "cpu" and input_ids.numel() and not (
                0 <= int(input_ids.min()) and int(input_ids.max()) < config.vocab):
            raise ValueError(f"{owner}: input_ids must be in [0, {config.vocab}) (the vocabulary), got values in "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        lead = tuple(input_ids.shape)
    if inputs_embeds is not None:
        ok = (isinstance(inputs_embeds, torch.Tensor) and inputs_embeds.dim() == 3
              and inputs_embeds.shape[2] == config.hidden and inputs_embeds.is_floating_point())
        if not ok or (lead is not None and tuple(inputs_embeds.shape[:2]) != lead):
            desc = f"{list(inputs_embeds.shape)} {inputs_embeds.dtype}" if isinstance(inputs_embeds, torch.Tensor) \
                else type(inputs_embeds).__name__
            want = f"[{lead[0]}, {lead[1]}, {config.hidden}] (input_ids' batch and seq)" if lead else \
                f"[batch, seq, {config.hidden}]"
            raise ValueError(f"{owner}: inputs_embeds must be a floating-point {want} tensor, got {desc}")
        if input_ids is not None and inputs_embeds.device != input_ids.device:
            raise ValueError(f"{owner}: inputs_embeds is on {inputs_embeds.device}, input_ids on {input_ids.device}")
        lead = tuple(inputs_embeds.shape[:2])
    device = (input_ids if input_ids is not None else inputs_embeds).device
    if embeds_mask is not None:
        if input_ids is None or inputs_embeds is None:
            raise ValueError(f"{owner}: embeds_mask selects between input_ids' and inputs_embeds' rows: give both")
        if not isinstance(embeds_mask, torch.Tensor) or embeds_mask.dtype != torch.bool or \
                tuple(embeds_mask.shape) != lead or embeds_mask.device != device:
            desc = f"{embeds_mask.dtype} {list(embeds_mask.shape)} on {embeds_mask.device}" if isinstance(
                embeds_mask, torch.Tensor) else type(embeds_mask).__name__
            raise ValueError(f"{owner}: embeds_mask must be bool {list(lead)} on {device}, got {desc}")
    elif input_ids is not None and inputs_embeds is not None and not config.vision_expert:
        raise ValueError(f"{owner}: with both input_ids and inputs_embeds, a single-expert model needs embeds_mask "
                         "(the positions that take inputs_embeds)")
    if config.vision_expert:
        if not isinstance(vision_mask, torch.Tensor) or vision_mask.dtype != torch.bool or \
                tuple(vision_mask.shape) != lead or vision_mask.device != device:
            desc = f"{vision_mask.dtype} {list(vision_mask.shape)} on {vision_mask.device}" if isinstance(
                vision_mask, torch.Tensor) else type(vision_mask).__name__
            raise ValueError(f"{owner}: vision_mask must be bool {list(lead)} on {device} (the prompt's batch and "
                             f"seq; True = vision expert), got {desc}")
    elif vision_mask is not None:
        raise ValueError(f"{owner}: a single-expert model (vision_expert=False) takes no vision_mask")


def embed_prompt(embedding: torch.nn.Embedding, input_ids: Optional[torch.Tensor],
                 inputs_embeds: Optional[torch.Tensor], embeds_mask: Optional[torch.Tensor],
                 vision_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """`[b, s, hidden]`: the token embeddings of input_ids, inputs_embeds as given, or with both, inputs_embeds' row
    where `embeds_mask` (default: `vision_mask`, the image's positions) is True and the token's embedding elsewhere
    (how CogVLM places the vision tower's features). Arguments as `check_prompt_inputs` checks them."""
    if input_ids is None:
        return inputs_embeds.to(embedding.weight.dtype)
    x = embedding(input_ids)
    if inputs_embeds is None:
        return x
    where = embeds_mask if embeds_mask is not None else vision_mask
    return torch.where(where[..., None], inputs_embeds.to(x.dtype), x)
