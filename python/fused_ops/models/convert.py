"""State-dict conversion between the fused model (`FusedCogVLM`, experts stacked `[2, ...]` text first) and CogVLM's
own names (`CogVLMReference`), both ways, values kept exactly.

Per layer `layers.{i}.` (with the visual expert):

    fused                                  reference (CogVLM)
    self_attn.query_key_value.weight  <->  self_attn.language_expert_query_key_value.weight  ([0])
                                           self_attn.vision_expert_query_key_value.weight    ([1])
    self_attn.vision_qkv_bias         <->  self_attn.vision_expert_query_key_value.bias      (qkv_bias)
    self_attn.dense.weight            <->  self_attn.language_expert_dense.weight ([0]), vision_expert_dense ([1])
    mlp.w1 / mlp.w3 / mlp.w2          <->  mlp.{language,vision}_mlp.{gate,up,down}_proj.weight ([0] / [1])
    input_layernorm.weight, post_attention_layernorm.weight (and norm.weight): the same names

Single expert: `self_attn.query_key_value.{weight,bias}` = cat(q_proj, k_proj, v_proj), `self_attn.dense.weight` =
`o_proj.weight`, `mlp.w1 / w3 / w2` = `mlp.gate_proj / up_proj / down_proj.weight`.

Keys are relative to the decoder stack: a full CogVLM checkpoint's `model.layers.*` / `model.norm.*` entries, with
`model.` removed (the embeddings, LM head and vision tower are not part of this model).
"""
from collections.abc import Mapping
from typing import Dict, List, NamedTuple, Tuple

import torch

from .config import CogVLMConfig

__all__ = ["convert_state_dict", "convert_lm_state_dict", "expected_keys"]


class _Rule(NamedTuple):
    fused: str                      # the fused model's key
    shape: Tuple[int, ...]          # its shape
    kind: str                       # "same", "experts" (stack of [language, vision]) or "cat" (along dim 0)
    refs: Tuple[str, ...]           # the reference's keys
    ref_shapes: Tuple[Tuple[int, ...], ...]


def _rules(c: CogVLMConfig) -> List[_Rule]:
    H, I, Q, QKV, KV = c.hidden, c.intermediate, c.q_size, c.qkv_size, c.kv_size
    rules = []
    for i in range(c.layers):
        p = f"layers.{i}."
        rules += [_Rule(p + n, (H,), "same", (p + n,), ((H,),)) for n in
                  ("input_layernorm.weight", "post_attention_layernorm.weight")]
        if c.vision_expert:
            def experts(fused, lang, vis, shape, p=p):
                return _Rule(p + fused, (2,) + shape, "experts", (p + lang, p + vis), (shape, shape))
            a = "self_attn."
            rules += [experts(a + "query_key_value.weight", a + "language_expert_query_key_value.weight",
                              a + "vision_expert_query_key_value.weight", (QKV, H)),
                      experts(a + "dense.weight", a + "language_expert_dense.weight", a + "vision_expert_dense.weight",
                              (H, Q))]
            if c.qkv_bias:
                rules.append(_Rule(p + a + "vision_qkv_bias", (QKV,), "same",
                                   (p + a + "vision_expert_query_key_value.bias",), ((QKV,),)))
            for w, proj, shape in (("w1", "gate_proj", (I, H)), ("w3", "up_proj", (I, H)), ("w2", "down_proj", (H, I))):
                rules.append(experts(f"mlp.{w}", f"mlp.language_mlp.{proj}.weight", f"mlp.vision_mlp.{proj}.weight",
                                     shape))
        else:
            a = "self_attn."
            names = ("weight", "bias") if c.qkv_bias else ("weight",)
            for n in names:
                shapes = ((Q, H), (KV, H), (KV, H)) if n == "weight" else ((Q,), (KV,), (KV,))
                rules.append(_Rule(p + a + "query_key_value." + n, (QKV,) + shapes[0][1:], "cat",
                                   tuple(p + a + f"{x}_proj.{n}" for x in "qkv"), shapes))
            rules.append(_Rule(p + a + "dense.weight", (H, Q), "same", (p + a + "o_proj.weight",), ((H, Q),)))
            for w, proj, shape in (("w1", "gate_proj", (I, H)), ("w3", "up_proj", (I, H)), ("w2", "down_proj", (H, I))):
                rules.append(_Rule(p + "mlp." + w, shape, "same", (p + f"mlp.{proj}.weight",), (shape,)))
    if c.final_norm:
        rules.append(_Rule("norm.weight", (H,), "same", ("norm.weight",), ((H,),)))
    return rules


def expected_keys(config: CogVLMConfig, layout: str) -> Dict[str, Tuple[int, ...]]:
    """{key: shape} of a state dict in `layout` "fused" or "reference" for `config`."""
    out = {}
    for r in _rules(config):
        if layout == "fused":
            out[r.fused] = r.shape
        else:
            out.update(zip(r.refs, r.ref_shapes))
    return out


def _listing(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _check(state_dict, config: CogVLMConfig, layout: str, owner: str) -> None:
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{owner}: expected a state dict (a mapping of names to tensors), got "
                         f"{type(state_dict).__name__}")
    expected = expected_keys(config, layout)
    problems = []
    missing, extra = expected.keys() - state_dict.keys(), state_dict.keys() - expected.keys()
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if extra:
        problems.append(f"unexpected keys: {_listing(extra)}")
    wrong = []
    for k in sorted(expected.keys() & state_dict.keys()):
        v = state_dict[k]
        if not isinstance(v, torch.Tensor):
            wrong.append(f"{k} is a {type(v).__name__}, not a tensor")
        elif tuple(v.shape) != expected[k]:
            wrong.append(f"{k} has shape {list(v.shape)}, expected {list(expected[k])}")
    if wrong:
        problems.append("wrong values: " + "; ".join(wrong[:8]) + (f"; ... ({len(wrong)} in all)" if len(wrong) > 8
                                                                    else ""))
    if not problems:  # parts stacked or concatenated together must agree on dtype and device
        for r in _rules(config):
            group = (r.fused,) if layout == "fused" else r.refs
            kinds = {(state_dict[k].dtype, state_dict[k].device) for k in group}
            if len(kinds) > 1:
                problems.append(f"{', '.join(group)} differ in dtype or device: {sorted(map(str, kinds))}")
    if problems:
        raise ValueError(f"{owner}: the state dict does not match the {layout} layout of {config}: "
                         + " | ".join(problems))


def convert_state_dict(state_dict: Mapping, config: CogVLMConfig, to: str) -> Dict[str, torch.Tensor]:
    """Converts a state dict between the two layouts; returns a new dict of new tensors (the input is not modified,
    and nothing of it is aliased), values kept exactly.

    Args:
        state_dict: `FusedCogVLM.state_dict()` to convert `to="reference"`, or `CogVLMReference.state_dict()` (CogVLM's
            names) to convert `to="fused"`.
        config: the model's config (which keys and shapes to expect).
        to: "fused" or "reference".
    Raises ValueError, before converting anything, when a key is missing or unexpected, a value is not a tensor or
    has the wrong shape, or parts to stack differ in dtype or device; the message names them.
    """
    if to not in ("fused", "reference"):
        raise ValueError(f"convert_state_dict: to must be 'fused' or 'reference', got {to!r}")
    source = "reference" if to == "fused" else "fused"
    _check(state_dict, config, source, f"convert_state_dict(to={to!r})")
    out: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for r in _rules(config):
            if to == "fused":
                parts = [state_dict[k].detach() for k in r.refs]
                if r.kind == "same":
                    out[r.fused] = parts[0].clone()
                elif r.kind == "experts":
                    out[r.fused] = torch.stack(parts)  # [language, vision]: expert 0 = text, as the kernels read it
                else:
                    out[r.fused] = torch.cat(parts, dim=0)
            else:
                t = state_dict[r.fused].detach()
                if r.kind == "same":
                    parts = [t]
                elif r.kind == "experts":
                    parts = list(t.unbind(0))
                else:
                    parts = list(t.split([s[0] for s in r.ref_shapes], dim=0))
                out.update((k, v.clone(memory_format=torch.contiguous_format)) for k, v in zip(r.refs, parts))
    return out


#: the causal LM's parameters outside the decoder stack, the same key in both layouts
_LM_OWN = ("embed_tokens.weight", "lm_head.weight")


def convert_lm_state_dict(state_dict: Mapping, config: CogVLMConfig, to: str) -> Dict[str, torch.Tensor]:
    """`convert_state_dict` for the causal LM (`FusedCogVLMForCausalLM` <-> `CogVLMReferenceForCausalLM`): the
    decoder's keys under `model.` converted, `embed_tokens.weight` `[vocab, hidden]` and `lm_head.weight`
    `[vocab, hidden]` copied. Raises ValueError as convert_state_dict does (also for those two)."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"convert_lm_state_dict: expected a state dict, got {type(state_dict).__name__}")
    owner = f"convert_lm_state_dict(to={to!r})"
    shape = (config.vocab, config.hidden)
    for key in _LM_OWN:
        v = state_dict.get(key)
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape:
            got = "missing" if v is None else (f"shape {list(v.shape)}" if isinstance(v, torch.Tensor)
                                               else type(v).__name__)
            raise ValueError(f"{owner}: {key} must be a {list(shape)} tensor, got {got}")
    inner = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
    extra = sorted(k for k in state_dict if not k.startswith("model.") and k not in _LM_OWN)
    if extra:
        raise ValueError(f"{owner}: unexpected keys: {_listing(extra)}")
    out = {"model." + k: v for k, v in convert_state_dict(inner, config, to).items()}
    with torch.no_grad():
        out.update((k, state_dict[k].detach().clone()) for k in _LM_OWN)
    return out
