"""Independent float64 reference for the `fused::rope_*` ops (TransformerEngine fused-RoPE semantics).

Written straight from docs/design.md, not from any kernel:

- position of local row `s` of sequence `b`: `p = s + start_positions[b]` (0 without start positions); with
  `cp_size > 1` and local length `L` (even): `p += cp_rank*L/2` if `s < L/2` else
  `p += L*cp_size - (cp_rank+1)*L/2 - L/2`;
- pairs (a, b) = (j, j + d2/2), or (2j, 2j+1) when interleaved; `c = cos(freqs[p])`, `s = sin(freqs[p])`;
- forward:  `out_a = x_a c_a - x_b s_a`, `out_b = x_b c_b + x_a s_b`;
- backward: `dx_a = g_a c_a + g_b s_b`, `dx_b = g_b c_b - g_a s_a` (the exact transpose of the forward);
- channels `d2..d` pass through unchanged.

Everything is computed in float64 on the input's device (so GPU tests can run the reference on the GPU for TE's large
shapes); the result is always float64 and contiguous. Work is vectorized per sequence (thd) or over the whole batch
(sbhd/bshd), one batch entry at a time to bound memory.
"""
from typing import List, Optional, Sequence, Union

import torch

__all__ = ["rope_reference", "local_positions", "pair_indices"]

IntSeq = Union[torch.Tensor, Sequence[int], None]


def _as_list(x: IntSeq) -> Optional[List[int]]:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.detach().cpu().reshape(-1).tolist()]
    return [int(v) for v in x]


def local_positions(L: int, start: int = 0, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Positions (int64 `[L]`) of the `L` local rows of one sequence, per docs/design.md."""
    s = torch.arange(L, dtype=torch.int64)
    p = s + start
    if cp_size > 1:
        if L % 2 != 0:
            raise ValueError(f"local sequence length {L} must be even under context parallelism")
        half = L // 2
        first = s < half
        p = torch.where(first, p + cp_rank * half, p + L * cp_size - (cp_rank + 1) * half - half)
    return p


def pair_indices(d2: int, interleaved: bool):
    """Channel slices (a, b) of the rotated pairs: (j, j + d2/2), or (2j, 2j + 1) when interleaved."""
    if interleaved:
        return slice(0, d2, 2), slice(1, d2, 2)
    return slice(0, d2 // 2), slice(d2 // 2, d2)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, ang: torch.Tensor, ia: slice, ib: slice, d2: int,
                 backward: bool) -> None:
    """out: float64 `[L, H, D]` view to fill; x: `[L, H, D]` any dtype; ang: float64 `[L, d2]` (shared by heads)."""
    ang = ang.unsqueeze(-2)  # [L, 1, d2]
    ca, sa = torch.cos(ang[..., ia]), torch.sin(ang[..., ia])
    cb, sb = torch.cos(ang[..., ib]), torch.sin(ang[..., ib])
    xa, xb = x[..., ia].to(torch.float64), x[..., ib].to(torch.float64)
    if backward:
        out[..., ia] = xa * ca + xb * sb
        out[..., ib] = xb * cb - xa * sa
    else:
        out[..., ia] = xa * ca - xb * sa
        out[..., ib] = xb * cb + xa * sb
    out[..., d2:] = x[..., d2:]  # channels d2..d pass through


def rope_reference(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd", interleaved: bool = False,
                   cu_seqlens: IntSeq = None, start_positions: IntSeq = None, cp_size: int = 1, cp_rank: int = 0,
                   backward: bool = False) -> torch.Tensor:
    """Float64 RoPE forward (or, with `backward=True`, the gradient w.r.t. the input given `t` = grad_output).

    t: `[s, b, h, d]` (sbhd), `[b, s, h, d]` (bshd) or `[t, h, d]` (thd, local tokens); any dtype and strides.
    freqs: `[s_max, 1, 1, d2]` (or `[s_max, d2]`), any float dtype; its values are taken as float64.
    cu_seqlens: `[nseq + 1]` global offsets of the full sequences (thd only); list or tensor.
    start_positions: `[b]` per-sequence position offsets; list or tensor.
    Returns float64 contiguous, same shape as `t`, on `t`'s device. Raises ValueError on inconsistent arguments
    (this is a test oracle: it refuses what the ops must refuse, so a bad test setup is caught early).
    """
    if tensor_format not in ("sbhd", "bshd", "thd"):
        raise ValueError(f"tensor_format {tensor_format!r}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_size {cp_size}, cp_rank {cp_rank}")
    dev = t.device
    f = freqs.detach().to(device=dev, dtype=torch.float64)
    f = f.reshape(f.shape[0], f.shape[-1])  # [s_max, d2]
    s_max, d2 = f.shape
    D = t.shape[-1]
    if d2 % 2 != 0 or d2 > D:
        raise ValueError(f"d2 = {d2} must be even and <= d = {D}")
    ia, ib = pair_indices(d2, interleaved)
    x = t.detach()
    starts = _as_list(start_positions)

    def angles(L: int, start: int) -> torch.Tensor:
        p = local_positions(L, start, cp_size, cp_rank)
        if L and (int(p.min()) < 0 or int(p.max()) >= s_max):
            raise ValueError(f"positions [{int(p.min())}, {int(p.max())}] outside freqs rows [0, {s_max})")
        return f[p.to(dev)]  # [L, d2]

    if tensor_format == "thd":
        if t.dim() != 3:
            raise ValueError("thd needs t [t, h, d]")
        cu = _as_list(cu_seqlens)
        if cu is None:
            raise ValueError("thd needs cu_seqlens")
        if cu[-1] != t.shape[0] * cp_size or any(b < a for a, b in zip(cu, cu[1:])) or cu[0] != 0:
            raise ValueError(f"cu_seqlens {cu} do not cover {t.shape[0]} local tokens x cp_size {cp_size}")
        out = torch.empty(x.shape, dtype=torch.float64, device=dev)
        for i in range(len(cu) - 1):
            r0, r1 = cu[i] // cp_size, cu[i + 1] // cp_size
            st = starts[i] if starts is not None else 0
            _rotate_into(out[r0:r1], x[r0:r1], angles(r1 - r0, st), ia, ib, d2, backward)
        return out

    if t.dim() != 4:
        raise ValueError(f"{tensor_format} needs a 4-D t")
    xb = x.transpose(0, 1) if tensor_format == "sbhd" else x  # [b, s, h, d] view
    B, S = xb.shape[0], xb.shape[1]
    out = torch.empty(x.shape, dtype=torch.float64, device=dev)
    outb = out.transpose(0, 1) if tensor_format == "sbhd" else out
    for b in range(B):
        st = starts[b] if starts is not None else 0
        _rotate_into(outb[b], xb[b], angles(S, st), ia, ib, d2, backward)
    return out
