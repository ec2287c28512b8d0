"""A causal language model around the fused decoder: CogVLM2's language model (token embeddings, the decoder stack
with its final norm, an LM head), which `generate`s.

    FusedCogVLMForCausalLM
        embed_tokens  nn.Embedding [vocab, hidden]
        model         FusedCogVLM (the decoder stack, cogvlm.py; config.final_norm: CogVLM's `model.norm`)
        lm_head       nn.Linear [vocab, hidden], no bias

State dict keys: `embed_tokens.weight`, `model.layers.{i}....` / `model.norm.weight` (FusedCogVLM's), `lm_head.weight`.
The reference (`cogvlm_reference.CogVLMReferenceForCausalLM`) has the same three parts with CogVLM's decoder names;
`from_reference` / `to_reference` convert (convert.py for the decoder, the rest as it is).

Images: CogVLM feeds the vision tower's features as the embeddings of the image's positions and routes those tokens
through the vision expert (the vision mask). Here a prompt gives `input_ids`, `inputs_embeds`, or both with
`embeds_mask` (True: the position takes `inputs_embeds`' row; default: the vision mask), plus `vision_mask`.
"""
from typing import Optional, Sequence

import torch
from torch import nn

from .cogvlm import FusedCogVLM
from .common import KVCache, check_prompt_inputs, embed_prompt
from .config import CogVLMConfig

__all__ = ["FusedCogVLMForCausalLM"]


class FusedCogVLMForCausalLM(nn.Module):
    """CogVLM2's language model on the fused ops (see the module docstring).

    Args:
        config: sizes (`CogVLMConfig`; `vocab` for the embedding and the LM head).
        device, dtype: keyword-only factory arguments; dtype defaults to `config.dtype`.
    """

    def __init__(self, config: CogVLMConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        dtype = config.dtype if dtype is None else dtype
        f = {"device": device, "dtype": dtype}
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden, **f)
        self.model = FusedCogVLM(config, **f)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False, **f)
        self._engine = None  # the GenerationEngine `generate` reuses (its cache and captured graphs)

    def embed(self, input_ids: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
              embeds_mask: Optional[torch.Tensor] = None, vision_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The prompt's embeddings `[b, s, hidden]` (see the module docstring)."""
        return embed_prompt(self.embed_tokens, input_ids, inputs_embeds, embeds_mask, vision_mask)

    def forward(self, input_ids: Optional[torch.Tensor] = None, vision_mask: Optional[torch.Tensor] = None, *,
                inputs_embeds: Optional[torch.Tensor] = None, embeds_mask: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        """Logits `[b, s, vocab]` of every position (the decoder's `forward`, then the LM head). For generation use
        `generate`, which computes the LM head of the last prompt position only."""
        check_prompt_inputs(self.config, input_ids, inputs_embeds, embeds_mask, vision_mask, type(self).__name__)
        x = self.embed(input_ids, inputs_embeds, embeds_mask, vision_mask)
        return self.lm_head(self.model(x, vision_mask, cache=cache))

    def generate(self, input_ids: Optional[torch.Tensor] = None, *, max_new_tokens: int,
                 prompt_lens: Optional[Sequence[int]] = None, vision_mask: Optional[torch.Tensor] = None,
                 inputs_embeds: Optional[torch.Tensor] = None, embeds_mask: Optional[torch.Tensor] = None,
                 max_len: Optional[int] = None, cuda_graphs: Optional[bool] = None, **kwargs) -> torch.Tensor:
        """New tokens `[b, max_new_tokens]` for a batch of right-padded prompts: `GenerationEngine.generate` (its
        arguments, the sampling ones included) on an engine kept on this model and reused while it fits (the same
        device; batch and `max_len` within its cache; the same `cuda_graphs`), otherwise replaced by one sized for
        this call (`max_len` default: the longest prompt plus max_new_tokens)."""
        from .generation import GenerationEngine
        source = input_ids if input_ids is not None else inputs_embeds
        if not isinstance(source, torch.Tensor) or source.dim() < 2:
            check_prompt_inputs(self.config, input_ids, inputs_embeds, embeds_mask, vision_mask,
                                type(self).__name__ + ".generate")  # raises, naming what is wrong
        batch, longest = source.shape[0], source.shape[1]
        if prompt_lens is not None and len(prompt_lens):
            longest = int(max(prompt_lens))
        new = max_new_tokens if isinstance(max_new_tokens, int) else 1  # the engine checks it
        need = max_len if max_len is not None else longest + new
        engine = self._engine
        if engine is None or engine.device != self.lm_head.weight.device or not engine.fits(batch, need, cuda_graphs):
            self._engine = None  # the old cache goes before the new one is allocated
            engine = self._engine = GenerationEngine(self, max(batch, 1), max(need, 1), cuda_graphs=cuda_graphs)
        return engine.generate(input_ids, max_new_tokens=max_new_tokens, prompt_lens=prompt_lens,
                               vision_mask=vision_mask, inputs_embeds=inputs_embeds, embeds_mask=embeds_mask, **kwargs)

    # conversion from / to the reference ------------------------------------------------------------------------------
    @classmethod
    def from_reference(cls, reference: nn.Module) -> "FusedCogVLMForCausalLM":
        """A FusedCogVLMForCausalLM with the weights of `reference` (a `CogVLMReferenceForCausalLM`)."""
        from .convert import convert_lm_state_dict
        config = getattr(reference, "config", None)
        if not isinstance(config, CogVLMConfig):
            raise ValueError(f"FusedCogVLMForCausalLM.from_reference: expected a module with a CogVLMConfig `.config` "
                             f"(e.g. CogVLMReferenceForCausalLM), got {type(reference).__name__}")
        state = convert_lm_state_dict(reference.state_dict(), config, to="fused")
        p = state["lm_head.weight"]
        model = cls(config, device=p.device, dtype=p.dtype)
        model.load_state_dict(state)
        return model

    def to_reference(self) -> nn.Module:
        """A `CogVLMReferenceForCausalLM` (plain PyTorch) holding copies of this model's weights."""
        from .cogvlm_reference import CogVLMReferenceForCausalLM
        from .convert import convert_lm_state_dict
        p = self.lm_head.weight
        ref = CogVLMReferenceForCausalLM(self.config, device=p.device, dtype=p.dtype)
        ref.load_state_dict(convert_lm_state_dict(self.state_dict(), self.config, to="reference"))
        return ref
