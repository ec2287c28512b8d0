"""Models on the fused ops, with the plain-PyTorch implementations they are measured against.

- `FusedCogVLM` (cogvlm.py): a CogVLM-style decoder (visual expert in QKV, dense and MLP, one `fused_ops.route` per
  forward shared by every layer; GQA, RoPE with `rope_fwd_qk`, SDPA, RMSNorm), or a Llama decoder with one expert.
- `CogVLMReference` (cogvlm_reference.py): the same model written as CogVLM writes it (its module names, boolean-mask
  gather per expert); `FusedCogVLM.from_reference` / `to_reference` / `convert_state_dict` convert between them.
- `GroupedMMCogVLM` (baselines.py): sort by expert + `torch._grouped_mm` + scatter, as torchtitan's MoE.
- `CogVLMConfig` and the presets `COGVLM2_19B`, `LLAMA3_8B` (config.py); `KVCache` for decoding (common.py).
- `FusedCogVLMForCausalLM` (causal_lm.py): CogVLM2's language model (embeddings, the decoder, LM head) that
  generates; its reference `CogVLMReferenceForCausalLM`. `GenerationEngine` (generation.py): ragged prefill, then
  one CUDA graph per decode step over a `DecodeCache` (decode_cache.py: per-sequence lengths on the device);
  `SamplingParams` / `sample` (sampling.py): greedy, temperature, top-k, top-p on the device.

The main job, `examples/model_workload.py` (`scripts/run.sh`), times and checks them on a GPU.
"""
from .baselines import GroupedMMCogVLM
from .causal_lm import FusedCogVLMForCausalLM
from .cogvlm import FusedCogVLM
from .cogvlm_reference import CogVLMReference, CogVLMReferenceForCausalLM, get_expert_mask
from .common import KVCache
from .config import COGVLM2_19B, LLAMA3_8B, CogVLMConfig
from .convert import convert_lm_state_dict, convert_state_dict
from .decode_cache import DecodeCache
from .generation import GenerationEngine
from .sampling import SamplingParams, sample

__all__ = ["FusedCogVLM", "CogVLMReference", "GroupedMMCogVLM", "CogVLMConfig", "COGVLM2_19B", "LLAMA3_8B",
           "KVCache", "convert_state_dict", "get_expert_mask", "FusedCogVLMForCausalLM", "CogVLMReferenceForCausalLM",
           "convert_lm_state_dict", "DecodeCache", "GenerationEngine", "SamplingParams", "sample"]
