"""What the generation tests share: a pure-PyTorch stand-in for `torch.ops.fused.decode_attention` (registered only
while the installed build lacks the op), tiny configs, random weights and ragged prompts with image spans.

The stand-in keeps the op's contract exactly (csrc/torch_bindings.cpp once it lands):

    fused::decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new,
                            Tensor cache_lens, float? scale=None) -> Tensor

q `[B, T, Hq, D]`, k_new / v_new `[B, T, Hkv, D]` (bshd, after RoPE; strided views allowed), k_cache / v_cache
`[B, Hkv, S, D]`, cache_lens int32 `[B]` = positions already cached per sequence. It writes k_new / v_new at
`[cache_lens[b], cache_lens[b] + T)` and returns `[B, T, Hq, D]`, query t of sequence b attending keys
`0 .. cache_lens[b] + t`; cache_lens is not advanced. It is capturable (no host sync), so the GPU tests can run the
graph path with it too.
"""
import torch
import torch.nn.functional as F

from fused_ops.models import CogVLMConfig, get_expert_mask

SCHEMA = ("decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new, "
          "Tensor cache_lens, float? scale=None) -> Tensor")
_LIBRARY = []  # keeps the fragment (and with it the stand-in's registration) alive


def decode_attention_standin(q, k_cache, v_cache, k_new, v_new, cache_lens, scale=None):
    B, T, Hq, D = q.shape
    Hkv, S = k_new.shape[2], k_cache.shape[2]
    pos = cache_lens.long()[:, None] + torch.arange(T, device=q.device)  # [B, T]: the new tokens' positions
    index = pos[:, None, :, None].expand(B, Hkv, T, D)
    k_cache.scatter_(2, index, k_new.transpose(1, 2).to(k_cache.dtype))
    v_cache.scatter_(2, index, v_new.transpose(1, 2).to(v_cache.dtype))
    allowed = torch.arange(S, device=q.device)[None, None, :] <= pos[:, :, None]  # [B, T, S]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache, attn_mask=allowed[:, None],
                                         scale=scale, enable_gqa=Hq != Hkv)
    return out.transpose(1, 2).contiguous()


def ensure_decode_attention() -> str:
    """'op' when the build has fused::decode_attention, else registers the stand-in (once) and returns 'stand-in'."""
    if _LIBRARY or not hasattr(torch.ops.fused, "decode_attention"):
        if not _LIBRARY:
            lib = torch.library.Library("fused", "FRAGMENT")
            lib.define(SCHEMA)
            lib.impl("decode_attention", decode_attention_standin, "CompositeExplicitAutograd")
            _LIBRARY.append(lib)
        return "stand-in"
    return "op"


#: a tiny CogVLM: GQA 4 / 2 heads of 16, two layers, a 256-token vocabulary
TINY = CogVLMConfig(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, layers=2, rope_theta=10000.0,
                    vocab=256, dtype=torch.float32)


def randomize_(model, seed=0, logit_scale=4.0):
    """Random weights: linear ~ U(+-1/sqrt(fan_in)), norm scales 1 +- 0.3, biases +- 0.3, embeddings ~ N(0, 1); the
    LM head scaled by `logit_scale` so that the greedy choice is never a near tie."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                v = 1 + 0.3 * (2 * torch.rand(p.shape, generator=g, dtype=torch.float64) - 1)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=g, dtype=torch.float64)
            elif p.dim() == 1:
                v = 0.3 * (2 * torch.rand(p.shape, generator=g, dtype=torch.float64) - 1)
            else:
                v = (2 * torch.rand(p.shape, generator=g, dtype=torch.float64) - 1) / p.shape[-1] ** 0.5
                if name.startswith("lm_head"):
                    v = v * logit_scale
            p.copy_(v)
    return model


def ragged_prompts(config, lens=(9, 14, 5), seed=1, spans=((1, 6), (3, 11), None)):
    """Right-padded prompts: ids `[b, max(lens)]` (padding 0), image features `[b, s, hidden]` at the image spans
    (`spans[i]` = [start, end) of sequence i's image tokens, or None), the positions that take them (CogVLM's token
    types), and the vision mask (`get_expert_mask`: the span's last token goes through the language expert)."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(lens), max(lens)
    ids = torch.randint(1, config.vocab, (b, s), generator=g)
    types = torch.zeros(b, s, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, n:] = 0
        if spans[i] is not None:
            types[i, spans[i][0]:spans[i][1]] = 1
    images = torch.randn(b, s, config.hidden, generator=g).to(config.dtype)
    image_positions = types == 1
    return dict(input_ids=ids, inputs_embeds=images, embeds_mask=image_positions,
                vision_mask=get_expert_mask(types) if config.vision_expert else None, prompt_lens=list(lens))
