"""The configuration shared by the CogVLM-style decoder on the fused ops (`cogvlm.py`), its plain-PyTorch reference
(`cogvlm_reference.py`) and the grouped-GEMM baseline (`baselines.py`), plus the presets of the main job."""
import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["CogVLMConfig", "COGVLM2_19B", "LLAMA3_8B"]


@dataclass(frozen=True)
class CogVLMConfig:
    """Sizes of a CogVLM-style decoder stack (no embedding, no LM head: hidden states in, hidden states out), and the
    vocabulary of the causal LM around it (`causal_lm.py`: token embeddings, the stack, an LM head).

    Attributes:
        hidden: H, the residual stream's width.
        intermediate: I, the SwiGLU MLP's inner width.
        heads: query heads.
        kv_heads: key/value heads (grouped-query attention: `heads` must be a multiple of it).
        head_dim: D per head (even: RoPE rotates pairs). The QKV projection has `(heads + 2 * kv_heads) * head_dim`
            outputs, laid out [q | k | v] as CogVLM2 splits them; the dense projection maps `heads * head_dim` to H.
        layers: decoder layers.
        rms_eps: RMSNorm epsilon.
        rope_theta: RoPE base (Llama-3 / CogVLM2: 500000).
        qkv_bias: the vision expert's QKV projection has a bias (CogVLM's `vision_expert_query_key_value` has one,
            its language expert none); for a single-expert model, whether the QKV projection has one.
        vision_expert: True: CogVLM's visual expert, every QKV, dense and MLP routed by the token-type mask between a
            vision and a language expert. False: one expert (a Llama layer) and no mask.
        final_norm: an RMSNorm after the last layer (CogVLM's `model.norm`). The main job's per-layer benchmark
            leaves it out, so that a one-layer model's forward is one layer's.
        dtype: the parameters' default dtype (overridable by the models' `dtype=` argument).
        recompute: the fused model's MLPs keep no activations for the backward and compute gate and up again there
            (`fused_ops.ffn`'s `recompute`: less memory, two more GEMMs per layer); default False: they keep the
            gate and up pre-activations (2 * intermediate elements per token and layer).
        vocab: tokens of the causal LM's embedding and LM head (CogVLM2 / Llama-3: 128,256); the decoder stack alone
            does not use it.
    """
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 32
    rms_eps: float = 1e-5
    rope_theta: float = 500000.0
    qkv_bias: bool = True
    vision_expert: bool = True
    final_norm: bool = True
    dtype: torch.dtype = torch.bfloat16
    recompute: bool = False
    vocab: int = 128256

    def __post_init__(self):
        for name in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "layers", "vocab"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"CogVLMConfig: {name} must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"CogVLMConfig: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"CogVLMConfig: head_dim={self.head_dim} must be even (RoPE rotates channel pairs)")
        if not self.rms_eps > 0:
            raise ValueError(f"CogVLMConfig: rms_eps must be > 0, got {self.rms_eps!r}")
        if not self.rope_theta > 1:
            raise ValueError(f"CogVLMConfig: rope_theta must be > 1, got {self.rope_theta!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"CogVLMConfig: dtype must be a floating-point torch.dtype, got {self.dtype!r}")

    @property
    def q_size(self) -> int:
        """Width of the queries (and of the attention output): heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the keys, and of the values: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        """Outputs of the QKV projection: q_size + 2 * kv_size."""
        return self.q_size + 2 * self.kv_size

    def replace(self, **changes) -> "CogVLMConfig":
        """A copy with some fields changed (validated again), e.g. `COGVLM2_19B.replace(layers=2)`."""
        return dataclasses.replace(self, **changes)


#: CogVLM2-19B's language decoder (cogvlm2-llama3-chat-19B): Llama-3-8B's sizes with a visual expert in every layer.
COGVLM2_19B = CogVLMConfig()
#: Llama-3-8B's decoder: the same sizes, one expert, no QKV bias.
LLAMA3_8B = CogVLMConfig(qkv_bias=False, vision_expert=False)
