"""What the generation tests share: tiny configs, random weights and ragged prompts with image spans.

(The tests were written against a pure-PyTorch stand-in of `torch.ops.fused.decode_attention` with its contract
until the op landed (cbde2ed); they now run the op itself, whose CPU path computes in float32 / float64.)
"""
import torch

from fused_ops.models import CogVLMConfig, get_expert_mask

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
