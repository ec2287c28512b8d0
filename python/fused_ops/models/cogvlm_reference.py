"""The CogVLM-style decoder in plain PyTorch, written the way CogVLM's own modeling code writes it: the reference the
fused model is checked against, and baseline (a) of the main job.

Module names and style are CogVLM's (THUDM's modeling_cogvlm.py, and its port in transformers): per layer
`input_layernorm`, `self_attn.vision_expert_query_key_value` (with a bias), `self_attn.language_expert_query_key_value`
(no bias), `self_attn.vision_expert_dense`, `self_attn.language_expert_dense`, `post_attention_layernorm`,
`mlp.language_mlp` / `mlp.vision_mlp` (each a LlamaMLP: gate_proj, up_proj, down_proj), then `norm`. Every expert
runs on its tokens through a boolean-mask gather and scatter (`out[mask] = expert(x[mask])`), RoPE is `rotate_half`
on cos / sin tables, the norm upcasts to float32. As in CogVLM, the vision expert of the attention is registered
first. A single-expert config gives a Llama layer in transformers' names (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
`mlp.gate_proj`, ...).

Deliberate differences from CogVLM's code, each so that every implementation of the main job computes the same
function: attention is `common.causal_attention` (SDPA with `enable_gqa` rather than expanding the key heads), the
token positions are consecutive (CogVLM1's `build_position_ids`, which gives an image's tokens one position, is not
modeled), the RoPE angles are the float32 ones of `common.rope_table`, and float64 inputs keep float64 in the norm
and RoPE (CogVLM casts to float32 there; the float64 reference of the tests needs float64).
"""
from typing import Optional, Tuple

import torch
from torch import nn

from .common import KVCache, causal_attention, check_inputs, check_prompt_inputs, embed_prompt, rope_table
from .config import CogVLMConfig

__all__ = ["CogVLMReference", "CogVLMReferenceForCausalLM", "get_expert_mask", "LANGUAGE_TOKEN_TYPE", "VISION_TOKEN_TYPE"]

LANGUAGE_TOKEN_TYPE, VISION_TOKEN_TYPE = 0, 1


def get_expert_mask(token_type_ids: torch.Tensor) -> torch.Tensor:
    """CogVLM's routing rule: bool `[b, s]`, True where token i and token i+1 are both vision tokens (so the last
    token of an image span, its end-of-image token, goes through the language expert). token_type_ids `[b, s]`."""
    vision = torch.zeros_like(token_type_ids, dtype=torch.bool)
    vision[:, :-1] = (token_type_ids[:, :-1] == VISION_TOKEN_TYPE) & (token_type_ids[:, 1:] == VISION_TOKEN_TYPE)
    return vision


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # float32 for 16-bit (CogVLM's upcast), float64 stays


class RMSNorm(nn.Module):
    """CogVLM's RMSNorm: upcast, mean of squares, rsqrt, scale, cast back."""

    def __init__(self, hidden_size: int, eps: float, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(_compute_dtype(input_dtype))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class RotaryEmbedding(nn.Module):
    """cos / sin tables `[s, d]` of positions `[past, past + s)`, in the activations' dtype. As CogVLM's, the tables
    are cached (grown in steps of 1024 positions) and sliced per call."""

    def __init__(self, config: CogVLMConfig):
        super().__init__()
        self.config = config
        self._cached: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, x: torch.Tensor, past: int, s: int) -> Tuple[torch.Tensor, torch.Tensor]:
        cached = self._cached
        if cached is None or cached[0].shape[0] < past + s or cached[0].dtype != x.dtype or \
                cached[0].device != x.device:
            emb = rope_table(self.config, -(-(past + s) // 1024) * 1024, x.device).flatten(1)  # float32 [n, d]
            emb = emb.to(_compute_dtype(x.dtype))
            cached = self._cached = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        return cached[0][past:past + s], cached[1][past:past + s]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q `[b, hq, s, d]`, k `[b, hk, s, d]`, cos / sin `[s, d]`."""
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class MLP(nn.Module):
    """LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), SiLU."""

    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(config.hidden, config.intermediate, bias=False, **f)
        self.up_proj = nn.Linear(config.hidden, config.intermediate, bias=False, **f)
        self.down_proj = nn.Linear(config.intermediate, config.hidden, bias=False, **f)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class VisionExpertMLP(nn.Module):
    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        self.language_mlp = MLP(config, device=device, dtype=dtype)
        self.vision_mlp = MLP(config, device=device, dtype=dtype)

    def forward(self, hidden_states: torch.Tensor, vision_token_mask: torch.Tensor) -> torch.Tensor:
        output = torch.empty(hidden_states.shape, dtype=hidden_states.dtype, device=hidden_states.device)
        language_token_mask = ~vision_token_mask
        output[vision_token_mask] = self.vision_mlp(hidden_states[vision_token_mask])
        output[language_token_mask] = self.language_mlp(hidden_states[language_token_mask])
        return output


class VisionExpertAttention(nn.Module):
    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.config = config
        self.rotary_emb = RotaryEmbedding(config)
        self.vision_expert_query_key_value = nn.Linear(config.hidden, config.qkv_size, bias=config.qkv_bias, **f)
        self.vision_expert_dense = nn.Linear(config.q_size, config.hidden, bias=False, **f)
        self.language_expert_query_key_value = nn.Linear(config.hidden, config.qkv_size, bias=False, **f)
        self.language_expert_dense = nn.Linear(config.q_size, config.hidden, bias=False, **f)

    def forward(self, hidden_states: torch.Tensor, vision_token_mask: torch.Tensor, cache: Optional[KVCache],
                layer: int) -> torch.Tensor:
        c = self.config
        b, s, _ = hidden_states.shape
        language_token_mask = ~vision_token_mask
        mixed_raw_layer = torch.empty((b, s, c.qkv_size), dtype=hidden_states.dtype, device=hidden_states.device)
        mixed_raw_layer[vision_token_mask] = self.vision_expert_query_key_value(hidden_states[vision_token_mask])
        mixed_raw_layer[language_token_mask] = self.language_expert_query_key_value(hidden_states[language_token_mask])
        q, k, v = torch.split(mixed_raw_layer, [c.q_size, c.kv_size, c.kv_size], dim=-1)
        context_layer = _attend(self, q, k, v, cache, layer)
        attn_output = torch.empty((b, s, c.hidden), dtype=hidden_states.dtype, device=hidden_states.device)
        attn_output[vision_token_mask] = self.vision_expert_dense(context_layer[vision_token_mask])
        attn_output[language_token_mask] = self.language_expert_dense(context_layer[language_token_mask])
        return attn_output


class LlamaAttention(nn.Module):
    """The single-expert attention, in transformers' Llama names."""

    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.config = config
        self.rotary_emb = RotaryEmbedding(config)
        self.q_proj = nn.Linear(config.hidden, config.q_size, bias=config.qkv_bias, **f)
        self.k_proj = nn.Linear(config.hidden, config.kv_size, bias=config.qkv_bias, **f)
        self.v_proj = nn.Linear(config.hidden, config.kv_size, bias=config.qkv_bias, **f)
        self.o_proj = nn.Linear(config.q_size, config.hidden, bias=False, **f)

    def forward(self, hidden_states: torch.Tensor, cache: Optional[KVCache], layer: int) -> torch.Tensor:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        return self.o_proj(_attend(self, q, k, v, cache, layer))


def _attend(attn: nn.Module, q, k, v, cache: Optional[KVCache], layer: int) -> torch.Tensor:
    """[b, s, hq d], [b, s, hk d] x2 -> RoPE, cache, SDPA -> [b, s, hq d]."""
    c = attn.config
    b, s, _ = q.shape
    q = q.view(b, s, c.heads, c.head_dim).transpose(1, 2)
    k = k.view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
    v = v.view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
    past = cache.length if cache is not None else 0
    cos, sin = attn.rotary_emb(v, past, s)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(layer, k, v)
    return causal_attention(q, k, v, past).transpose(1, 2).reshape(b, s, c.q_size)


class DecoderLayer(nn.Module):
    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.config = config
        self.self_attn = (VisionExpertAttention if config.vision_expert else LlamaAttention)(config, **f)
        self.mlp = VisionExpertMLP(config, **f) if config.vision_expert else MLP(config, **f)
        self.input_layernorm = RMSNorm(config.hidden, config.rms_eps, **f)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.rms_eps, **f)

    def forward(self, hidden_states: torch.Tensor, vision_token_mask: Optional[torch.Tensor],
                cache: Optional[KVCache] = None, layer: int = 0) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.config.vision_expert:
            hidden_states = self.self_attn(hidden_states, vision_token_mask, cache, layer)
        else:
            hidden_states = self.self_attn(hidden_states, cache, layer)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        if self.config.vision_expert:
            hidden_states = self.mlp(hidden_states, vision_token_mask)
        else:
            hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class CogVLMReference(nn.Module):
    """The decoder stack in plain PyTorch; same config, forward signature and semantics as `FusedCogVLM`.

    `forward(x, mask=None, *, cache=None)`: x `[b, s, hidden]`, mask bool `[b, s]` (True = vision expert; None for
    a single-expert config), cache a `KVCache`. Returns `[b, s, hidden]`.
    """

    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        f = {"device": device, "dtype": config.dtype if dtype is None else dtype}
        self.layers = nn.ModuleList(DecoderLayer(config, **f) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.rms_eps, **f) if config.final_norm else None

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, *,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        check_inputs(self.config, x, mask, cache, type(self).__name__)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, cache, i)
        if cache is not None:
            cache.length += x.shape[1]
        return x if self.norm is None else self.norm(x)


class CogVLMReferenceForCausalLM(nn.Module):
    """CogVLM2's language model in plain PyTorch: `embed_tokens` (nn.Embedding), `model` (`CogVLMReference`, with its
    final norm when config.final_norm), `lm_head` (nn.Linear, no bias); the reference of
    `causal_lm.FusedCogVLMForCausalLM` (same keys outside `model.`).

    `forward(input_ids=None, vision_mask=None, *, inputs_embeds=None, embeds_mask=None, cache=None)` returns the
    logits `[b, s, vocab]`; `generate_greedy` is the plainest greedy decoding there is (one sequence at a time).
    """

    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        f = {"device": device, "dtype": config.dtype if dtype is None else dtype}
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden, **f)
        self.model = CogVLMReference(config, **f)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False, **f)

    def forward(self, input_ids: Optional[torch.Tensor] = None, vision_mask: Optional[torch.Tensor] = None, *,
                inputs_embeds: Optional[torch.Tensor] = None, embeds_mask: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        check_prompt_inputs(self.config, input_ids, inputs_embeds, embeds_mask, vision_mask, type(self).__name__)
        x = embed_prompt(self.embed_tokens, input_ids, inputs_embeds, embeds_mask, vision_mask)
        return self.lm_head(self.model(x, vision_mask, cache=cache))

    @torch.no_grad()
    def generate_greedy(self, input_ids: Optional[torch.Tensor], prompt_lens, max_new_tokens: int, *,
                        vision_mask: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                        embeds_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding of right-padded prompts, each sequence alone (batch 1, its own length, no padding
        anywhere): prefill with a `KVCache`, then one token per step. Returns the tokens `[b, max_new_tokens]` and
        the logits they were chosen from `[b, max_new_tokens, vocab]`."""
        b = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        tokens, logits = [], []
        for i in range(b):
            n = int(prompt_lens[i])

            def part(t):
                return None if t is None else t[i:i + 1, :n]
            cache = KVCache(self.config, 1, n + max_new_tokens, device=self.lm_head.weight.device,
                            dtype=self.lm_head.weight.dtype)
            step = self(part(input_ids), part(vision_mask), inputs_embeds=part(inputs_embeds),
                        embeds_mask=part(embeds_mask), cache=cache)[:, -1]
            seq_tokens, seq_logits = [], []
            for _ in range(max_new_tokens):
                seq_logits.append(step[0])
                token = step.argmax(dim=-1, keepdim=True)  # [1, 1]
                seq_tokens.append(token[0, 0])
                if len(seq_tokens) == max_new_tokens:
                    break
                text = torch.zeros(1, 1, dtype=torch.bool, device=token.device) if self.config.vision_expert else None
                step = self(token, text, cache=cache)[:, -1]  # generated tokens are text tokens
            tokens.append(torch.stack(seq_tokens))
            logits.append(torch.stack(seq_logits))
        return torch.stack(tokens), torch.stack(logits)
