"""A CogVLM-style decoder on the fused ops: the visual expert in attention and MLP, grouped-query attention, RoPE.

One decoder layer (CogVLM2's, with `vision_expert=True`):

    r   = fused_ops.route(mask)                        once per forward pass, shared by every routed op of every layer
    a   = RMSNorm(x)                                   F.rms_norm (decode steps of 2+ rows: torch.ops.fused.rms_norm)
    qkv = linear_dual(a, mask, W_qkv [2, N, H], None, b_qkv_vision, None, routing=r)   [b, s, (hq + 2 hk) d]
    q, k = rope_fwd_qk(view q, view k of qkv, freqs, "bshd")    one launch, reads the strided views in place
    o   = SDPA(q, k, v, causal, GQA)                   keys/values through the KV cache when decoding
    h   = linear_dual(o, mask, W_dense [2, H, H], None, routing=r, residual=x)   x + dense(o), one kernel
    y   = ffn(RMSNorm(h), mask, vision expert, text expert, routing=r, residual=h)   DualExpertSwiGLU

A single-expert model (`vision_expert=False`, a Llama layer) has nn.Linear QKV and dense projections and a
FusedSwiGLU MLP, and takes no mask. Training works through every op (their autograd is registered in C++).

Parameters (state dict keys, per layer `layers.{i}.`; expert index 0 = text, 1 = vision, as the kernels read them):
    input_layernorm.weight, post_attention_layernorm.weight      [H]
    self_attn.query_key_value.weight   [2, (hq + 2 hk) d, H]     (DualLinear; [(hq + 2 hk) d, H] nn.Linear if single)
    self_attn.vision_qkv_bias          [(hq + 2 hk) d]           (qkv_bias; single expert: query_key_value.bias)
    self_attn.dense.weight             [2, H, hq d]              (DualLinear; nn.Linear if single)
    mlp.w1, mlp.w3 [2, I, H], mlp.w2 [2, H, I]                   (DualExpertSwiGLU; FusedSwiGLU [I, H] ... if single)
and `norm.weight` [H] with final_norm. The language expert's QKV has no bias, as in CogVLM: the op is called with
`bias_t=None`, so it stays exactly absent (and gets no gradient).

Decoding: `forward` with a `KVCache` (one Python-int length for the batch: prefill, eager steps), or `decode` with a
`DecodeCache` (per-sequence lengths on the device, RoPE by start_positions, `torch.ops.fused.decode_attention`: the
static-shape step `generation.GenerationEngine` captures in a CUDA graph; docs/design.md, "Generation").

`convert.py` maps these to and from CogVLM's own names (`cogvlm_reference.py`): `FusedCogVLM.from_reference`,
`to_reference`, `load_reference_state_dict`.
"""
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ffn import DualExpertSwiGLU, FusedSwiGLU
from ..linear_dual import DualLinear
from ..routing import route
from .common import KVCache, causal_attention, check_inputs, rope_table
from .config import CogVLMConfig
from .decode_cache import DecodeCache

__all__ = ["FusedCogVLM", "FusedDecoderLayer", "RMSNorm"]


class RMSNorm(nn.Module):
    """`F.rms_norm` with a learned scale: torch's fused kernel where it has one (its math in float32 for 16-bit
    inputs)."""

    def __init__(self, size: int, eps: float, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.weight.shape[0],), self.weight, self.eps)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` for a decode step's rows: `torch.ops.fused.rms_norm` (the same math), whose kernel costs less
        than torch's there and launches with programmatic dependent launch like the ops around it; torch's kernel
        for a single row. Measured in one run each (H200, the 32-layer CogVLM2 step's CUDA graph, 8K caches,
        `benchmarks/bench_generate.py --norm-ab`): with this op 1.4%, 1.0% and 2.8% less time per step at batch 2, 4
        and 16 (3% at batch 64 / 1K), but 4.3-4.5% more at batch 1 (5.67 against 5.43 ms; two runs), although its
        kernel alone takes 3.3 us there against torch's 6.9. Why the single-row graph is slower is not known."""
        if x.numel() == x.shape[-1]:  # one row
            return self(x)
        return torch.ops.fused.rms_norm(x, self.weight, self.eps)


class FusedAttention(nn.Module):
    """Routed QKV -> RoPE on views of its output -> SDPA (GQA, causal, KV cache) -> routed dense."""

    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        c = self.config = config
        if c.vision_expert:
            self.query_key_value = DualLinear(c.hidden, c.qkv_size, bias=False, **f)
            if c.qkv_bias:  # the vision expert's only (CogVLM's language_expert_query_key_value has no bias)
                bound = 1 / math.sqrt(c.hidden)  # nn.Linear's bias init
                self.vision_qkv_bias = nn.Parameter(torch.empty(c.qkv_size, **f).uniform_(-bound, bound))
            else:
                self.register_parameter("vision_qkv_bias", None)
            self.dense = DualLinear(c.q_size, c.hidden, bias=False, **f)
        else:
            self.query_key_value = nn.Linear(c.hidden, c.qkv_size, bias=c.qkv_bias, **f)
            self.dense = nn.Linear(c.q_size, c.hidden, bias=False, **f)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], routing: Optional[torch.Tensor],
                freqs: torch.Tensor, cache: Optional[KVCache], layer: int, residual: torch.Tensor) -> torch.Tensor:
        """`residual + attention(x)`: x `[b, s, H]` (the normed input); freqs float32 `[>= s, 1, 1, d]`, row j = the
        angles of the j-th new token's position; residual `[b, s, H]`, the layer's input (a routed dense projection
        adds it in its epilogue)."""
        c = self.config
        b, s, _ = x.shape
        if c.vision_expert:
            # the stacked [2, N, K] weight whole (its gradient comes back stacked); the vision expert's bias only
            qkv = torch.ops.fused.linear_dual(x, mask, self.query_key_value.weight, None, self.vision_qkv_bias, None,
                                              False, routing)
        else:
            qkv = self.query_key_value(x)
        q, k, v = qkv.split((c.q_size, c.kv_size, c.kv_size), dim=-1)  # strided views, no copy
        q, k = torch.ops.fused.rope_fwd_qk(q.view(b, s, c.heads, c.head_dim), k.view(b, s, c.kv_heads, c.head_dim),
                                           freqs, "bshd")  # contiguous [b, s, h, d] outputs
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(layer, k, v)
        # SDPA's output is [b, s, hq, d] in memory for its fused backends: the transpose back is then a free view
        o = causal_attention(q, k, v, past).transpose(1, 2).reshape(b, s, c.q_size)
        if c.vision_expert:
            return self.dense(o, mask, routing, residual=residual)
        return residual + self.dense(o)


    def decode(self, x: torch.Tensor, mask: Optional[torch.Tensor], routing: Optional[torch.Tensor],
               cache: DecodeCache, layer: int, residual: torch.Tensor) -> torch.Tensor:
        """`forward` for T new tokens per sequence at per-sequence positions `cache.lens` (a device tensor): static
        shapes, no host integer that changes per token, no host sync, so a step can be captured in a CUDA graph.
        RoPE takes the positions as `start_positions` into the cache's table of every position; the attention is
        `torch.ops.fused.decode_attention`, which writes the new keys and values at `[lens[b], lens[b] + T)` of
        the cache and attends keys `0 .. lens[b] + t`. `cache.lens` is advanced by the model after its last layer."""
        c = self.config
        b, t, _ = x.shape
        if c.vision_expert:
            qkv = torch.ops.fused.linear_dual(x, mask, self.query_key_value.weight, None, self.vision_qkv_bias, None,
                                              False, routing)
        else:
            qkv = self.query_key_value(x)
        q, k, v = qkv.split((c.q_size, c.kv_size, c.kv_size), dim=-1)
        q, k = torch.ops.fused.rope_fwd_qk(q.view(b, t, c.heads, c.head_dim), k.view(b, t, c.kv_heads, c.head_dim),
                                           cache.freqs, "bshd", start_positions=cache.lens)
        o = torch.ops.fused.decode_attention(q, cache.k[layer], cache.v[layer], k,
                                             v.view(b, t, c.kv_heads, c.head_dim), cache.lens)
        o = o.reshape(b, t, c.q_size)
        if c.vision_expert:
            return self.dense(o, mask, routing, residual=residual)
        return residual + self.dense(o)


class FusedDecoderLayer(nn.Module):
    """RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU MLP (dual expert, or single) -> residual."""

    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.config = config
        self.input_layernorm = RMSNorm(config.hidden, config.rms_eps, **f)
        self.self_attn = FusedAttention(config, **f)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.rms_eps, **f)
        mlp = DualExpertSwiGLU if config.vision_expert else FusedSwiGLU
        self.mlp = mlp(config.hidden, config.intermediate, recompute=config.recompute, **f)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], routing: Optional[torch.Tensor],
                freqs: torch.Tensor, cache: Optional[KVCache] = None, layer: int = 0) -> torch.Tensor:
        # x + attention(norm(x)) and h + mlp(norm(h)): each residual add happens in the epilogue of the projection that
        # ends its branch (the routed dense and the down projection), one kernel fewer per add
        h = self.self_attn(self.input_layernorm(x), mask, routing, freqs, cache, layer, residual=x)
        a = self.post_attention_layernorm(h)
        if self.config.vision_expert:
            return self.mlp(a, mask, routing, residual=h)
        return self.mlp(a, residual=h)

    def decode(self, x: torch.Tensor, mask: Optional[torch.Tensor], routing: Optional[torch.Tensor],
               cache: DecodeCache, layer: int) -> torch.Tensor:
        """`forward` with the attention's `decode` (positions from `cache.lens`)."""
        h = self.self_attn.decode(self.input_layernorm.decode(x), mask, routing, cache, layer, residual=x)
        a = self.post_attention_layernorm.decode(h)
        if self.config.vision_expert:
            return self.mlp(a, mask, routing, residual=h)
        return self.mlp(a, residual=h)


class FusedCogVLM(nn.Module):
    """The decoder stack on the fused ops (see the module docstring).

    Args:
        config: sizes (`CogVLMConfig`, e.g. `COGVLM2_19B.replace(layers=2)`).
        device, dtype: keyword-only factory arguments; dtype defaults to `config.dtype`.

    `forward(x, mask=None, *, cache=None)`:
        x: `[b, s, hidden]` hidden states (the embeddings); mask: bool `[b, s]`, True = the token goes through the
        vision expert (CogVLM's `get_expert_mask(token_type_ids)`, `cogvlm_reference.get_expert_mask`), required with
        the visual expert, None without; cache: a `KVCache` to decode with (positions continue at `cache.length`).
        Returns `[b, s, hidden]` (after the final RMSNorm when config.final_norm). Wrong shapes, dtypes or devices
        of x / mask / cache raise ValueError before anything runs.
    """

    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        dtype = config.dtype if dtype is None else dtype
        f = {"device": device, "dtype": dtype}
        self.layers = nn.ModuleList(self._make_layer(config, f) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.rms_eps, **f) if config.final_norm else None
        self._freqs: Optional[torch.Tensor] = None  # float32 angle table; not a buffer: .to(bf16) must not touch it
        self._captured_freqs: List[torch.Tensor] = []  # tables that captured CUDA graphs read (kept alive)

    @staticmethod
    def _make_layer(config: CogVLMConfig, factory: dict) -> nn.Module:
        return FusedDecoderLayer(config, **factory)

    def _routing(self, mask: torch.Tensor):
        """What every routed op of every layer shares for one forward pass: the mask's routing."""
        return route(mask)

    def _rope(self, past: int, s: int, device):
        """The RoPE input of the layers for new tokens at positions `[past, past + s)`: rows of the angle table.
        (A slice rather than rope_fwd_qk's start_positions: one offset serves the whole batch, and start_positions'
        value check would cost a host sync per layer on CUDA.)"""
        need = past + s
        if torch.compiler.is_compiling():  # traced (torch.compile, torch.export): the rows needed, no cached attribute,
            return rope_table(self.config, need, device)[past:need]  # so that a symbolic length stays symbolic
        table = self._freqs
        covered = table is not None and table.shape[0] >= need and table.device == torch.device(device)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Inside a CUDA graph capture the cached table must neither grow nor be replaced: a table allocated now
            # lives in the graph's private memory pool, which its replays overwrite, so every eager call after the
            # capture would read angles that are no longer there. A missing table is built for this call only (its
            # kernels are captured with the graph and recomputed at each replay); a cached one that the graph reads
            # is kept alive for as long as the model, since the graph holds its address.
            if not covered:
                return rope_table(self.config, need, device)[past:need]
            if not any(t is table for t in self._captured_freqs):
                self._captured_freqs.append(table)
            return table[past:need]
        if not covered:
            self._freqs = rope_table(self.config, -(-need // 1024) * 1024, device)  # grown in steps: decode reuses it
        return self._freqs[past:need]

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, *,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        check_inputs(self.config, x, mask, cache, type(self).__name__)
        routing = self._routing(mask) if self.config.vision_expert else None
        past = cache.length if cache is not None else 0
        rope = self._rope(past, x.shape[1], x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, routing, rope, cache, i)
        if cache is not None:
            cache.length += x.shape[1]
        return x if self.norm is None else self.norm(x)

    def decode(self, x: torch.Tensor, mask: Optional[torch.Tensor], routing: Optional[torch.Tensor],
               cache: DecodeCache) -> torch.Tensor:
        """One decode step: x `[b, T, hidden]`, the new tokens of every sequence at positions `cache.lens[b] + t`;
        mask bool `[b, T]` (vision expert) or None; routing `route(mask)` or None. Writes their keys and values into
        `cache`, advances `cache.lens` by T on the device and returns `[b, T, hidden]` (after the final norm).

        Static shapes and no host sync: every argument keeps its shape and address from token to token (the
        positions are the values of `cache.lens`), so the step can be captured in a CUDA graph once and replayed.
        Only shapes are checked here: the lengths must stay within `cache.max_len` (the caller checks them on the
        host, up front). RoPE's start_positions value check would sync: switch it off (`fused_ops.set_sync_checks`)
        around eager steps on CUDA, as `GenerationEngine` does; graph captures skip it anyway."""
        check_inputs(self.config, x, mask, None, type(self).__name__ + ".decode")
        cache.check(self.config, x, type(self).__name__ + ".decode")
        for i, layer in enumerate(self.layers):
            x = layer.decode(x, mask, routing, cache, i)
        cache.lens.add_(x.shape[1])
        return x if self.norm is None else self.norm.decode(x)

    # conversion from / to CogVLM's own module names (convert.py) --------------------------------------------------
    @classmethod
    def from_reference(cls, reference: nn.Module) -> "FusedCogVLM":
        """A FusedCogVLM holding the weights of `reference` (a `CogVLMReference`, or any module with its `.config`
        and state dict keys), on its device and dtype. Raises ValueError naming what does not match."""
        config = getattr(reference, "config", None)
        if not isinstance(config, CogVLMConfig):
            raise ValueError(f"FusedCogVLM.from_reference: expected a module with a CogVLMConfig `.config` (e.g. "
                             f"CogVLMReference), got {type(reference).__name__}")
        from .convert import convert_state_dict
        state = convert_state_dict(reference.state_dict(), config, to="fused")  # validates before building
        p = next(iter(state.values()))
        model = cls(config, device=p.device, dtype=p.dtype)
        model.load_state_dict(state)
        return model

    def load_reference_state_dict(self, state_dict) -> None:
        """Loads a state dict in CogVLM's names (`CogVLMReference.state_dict()`) into this model. Every key and shape
        is checked first: on a mismatch it raises ValueError and the model is left unchanged."""
        from .convert import convert_state_dict
        self.load_state_dict(convert_state_dict(state_dict, self.config, to="fused"))

    def to_reference(self) -> nn.Module:
        """A `CogVLMReference` (plain PyTorch, CogVLM's module names) holding copies of this model's weights, on its
        device and dtype."""
        from .cogvlm_reference import CogVLMReference
        from .convert import convert_state_dict
        p = next(self.parameters())
        ref = CogVLMReference(self.config, device=p.device, dtype=p.dtype)
        ref.load_state_dict(convert_state_dict(self.state_dict(), self.config, to="reference"))
        return ref
