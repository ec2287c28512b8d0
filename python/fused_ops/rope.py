"""Rotary position embedding (RoPE) with TransformerEngine's fused-RoPE semantics.

Thin, documented wrappers over the `torch.ops.fused.rope_*` ops (schemas in `csrc/torch_bindings.cpp`, semantics in
docs/design.md) plus `RotaryPositionEmbedding`, which builds the `freqs` table the ops consume. The ops are
registered when `fused_ops` loads its library; this module only looks them up at call time, so importing it never
loads a GPU toolchain (no triton import).

Shapes: `s` sequence length, `b` batch, `h` heads, `d` head dim, `d2 <= d` rotary dim (even), `t` packed tokens.
"""
from typing import Optional, Tuple

import torch

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb", "apply_rotary_pos_emb_qk"]


def _check_flag(name: str, value: bool) -> bool:
    # Catches calls written for TE's positional order (t, freqs, tensor_format, start_positions, interleaved, ...):
    # there the 4th positional argument is a tensor or None, which must not silently become `interleaved`.
    # (The annotation is for TorchScript, which types the flag statically and compiles this check away.)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}; pass start_positions by keyword")
    return value


def _float_freqs(freqs: torch.Tensor) -> torch.Tensor:
    # TE's FusedRoPEFunc casts freqs to float32 before calling its kernel; the op itself requires float32.
    return freqs if freqs.dtype == torch.float32 else freqs.float()


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    fused: bool = True,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Applies RoPE to `t` and returns a new contiguous tensor of `t`'s shape and dtype (differentiable w.r.t. `t`).

    Args:
        t: the input, any strides, float32/float16/bfloat16 (float64 on CPU only):
            `[s, b, h, d]` for "sbhd", `[b, s, h, d]` for "bshd", `[t, h, d]` for "thd" (the local tokens; under
            context parallelism `cu_seqlens[-1] / cp_size` of them).
        freqs: rotation angles in radians, `[s_max, 1, 1, d2]`, as built by `RotaryPositionEmbedding`;
            `d2 <= d`, `d2` even. Cast to float32 if it is not (as TE does). Channels `d2..d` of `t` pass through.
            Must cover every position used: `s_max >= s * cp_size` (+ the largest start position).
        tensor_format: "sbhd", "bshd" or "thd".
        interleaved: rotate channel pairs (2j, 2j+1) instead of (j, j + d2/2).
        fused: accepted for signature compatibility with TE and ignored: there is only the fused op.
        cu_seqlens: int32 `[nseq + 1]`, "thd" only (required there): cumulative offsets of the full (global)
            sequences; under context parallelism every sequence length must be a multiple of `2 * cp_size`
            (TE's `cu_seqlens_padded`).
        cp_size: context-parallel world size (>= 1); the local sequence (chunks `cp_rank` and
            `2*cp_size - 1 - cp_rank` of the load-balanced split) must have even length.
        cp_rank: this rank, `0 <= cp_rank < cp_size`.
        start_positions: int32 `[b]` (`[nseq]` for "thd"), per-sequence offset added to every position
            (KV-cache inference). Optional.

    The argument order is TransformerEngine 2.x's (`start_positions` fourth), so TE code ports by changing the
    import. A non-bool `interleaved` raises (catches calls written for TE 1.x's order).
    """
    del fused
    return torch.ops.fused.rope_fwd(
        t, _float_freqs(freqs), tensor_format=tensor_format, interleaved=_check_flag("interleaved", interleaved),
        cu_seqlens=cu_seqlens, start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank)


def apply_rotary_pos_emb_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    fused: bool = True,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Applies RoPE to queries and keys at the same positions in one launch; returns `(q_out, k_out)`.

    Args:
        q: queries, `[s, b, hq, d]` / `[b, s, hq, d]` / `[t, hq, d]` per `tensor_format`, any strides (e.g. a view
            into a packed qkv tensor).
        k: keys, same layout as `q` with its own head count `hk` (grouped-query attention) and the same `s`, `b`, `d`.
        freqs, tensor_format, interleaved, fused, cu_seqlens, cp_size, cp_rank, start_positions:
            as in `apply_rotary_pos_emb` (`fused` is ignored).
    Returns contiguous tensors shaped like `q` and `k`.
    """
    del fused
    return torch.ops.fused.rope_fwd_qk(
        q, k, _float_freqs(freqs), tensor_format=tensor_format,
        interleaved=_check_flag("interleaved", interleaved), cu_seqlens=cu_seqlens,
        start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank)


class RotaryPositionEmbedding(torch.nn.Module):
    """Builds the RoPE angle table `freqs` (float32 `[max_seq_len, 1, 1, d2]`) exactly as TE's module of this name.

    Args:
        dim: rotary embedding dimension (normally the head dim `d`).
        rotary_percent: fraction of `dim` to rotate; when < 1, `d2 = int(dim * rotary_percent)` (the rest of the
            channels pass through the op unchanged).
        seq_len_interpolation_factor: position-interpolation factor (https://arxiv.org/abs/2306.15595). As in TE it
            only takes effect together with `pretrained_max_position_embeddings`; on its own it is ignored.
        pretrained_max_position_embeddings: context length of pretraining. With the factor set: for
            `max_seq_len <= pretrained * factor` positions are multiplied by `1 / factor` (fixed linear scaling),
            beyond that by `pretrained / max_seq_len` (dynamic linear scaling).
        rotary_base: base of the geometric frequency progression.
        interleaved: lay the table out for interleaved pairs: `[f0, f0, f1, f1, ...]` instead of
            `[f0, f1, ..., f0, f1, ...]`.
        device: keyword-only, where `inv_freq` lives; default (None) is TE's choice, the current CUDA device, or the
            CPU when CUDA is unavailable. The buffer follows `.to()` / `.cuda()` like any other.

    Buffers: `inv_freq` float32 `[d2 / 2]` = `1 / rotary_base ** (arange(0, d2, 2) / d2)`, persistent (in the
    state dict) like TE's.
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        pretrained_max_position_embeddings: Optional[int] = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
        *,
        device: Optional[torch.device] = None,
    ):
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim  # [d2 / 2]
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponents))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Returns float32 `[max_seq_len, 1, 1, d2]`: angle of position `offset + i` (after interpolation) on
        `inv_freq`'s device.

        Args:
            max_seq_len: number of positions (rows) to build.
            offset: first position.
        """
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype) + offset  # [s]
        pretrained, factor = self.pretrained_max_position_embeddings, self.seq_len_interpolation_factor
        if pretrained is not None and factor is not None:
            if max_seq_len > pretrained * factor:
                seq *= 1 / (max_seq_len / pretrained)  # dynamic linear scaling
            else:
                seq *= 1 / factor  # fixed linear scaling
        freqs = torch.outer(seq, self.inv_freq)  # [s, d2 / 2]
        if self.interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)  # [s, d2]: f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # [s, d2]: f0 f1 ... f0 f1 ...
        return emb.reshape(emb.shape[0], 1, 1, emb.shape[1])

    def extra_repr(self) -> str:
        return (f"d2={2 * self.inv_freq.numel()}, rotary_base={self.rotary_base}, interleaved={self.interleaved}, "
                f"seq_len_interpolation_factor={self.seq_len_interpolation_factor}, "
                f"pretrained_max_position_embeddings={self.pretrained_max_position_embeddings}")
