"""Launches kernels/rope.py's rope_kernel through Triton (interpreter on CPU) the way csrc/ops/rope_cuda.cpp does.

Test-only: the product never imports triton. Kept deliberately close to the C++ launcher's argument packing so the
interpreter tier exercises the same contract.
"""
import os
import sys

import torch
import triton
import triton_interp_compat  # noqa: F401  (Triton 3.6 interpreter: numpy >= 2.5, bool arguments)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kernels import rope as K  # noqa: E402


def rope_launch(t, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None, start_positions=None,
                cp_size=1, cp_rank=0, backward=False, second=None, inplace=False, block_t=2, block_h=4,
                block_half=16):
    """Returns out (and out2 when `second` is given); strides and flags packed as the C++ launcher packs them."""
    d2 = freqs.shape[-1]
    f2 = freqs.reshape(freqs.shape[0], d2)
    is_thd = tensor_format == "thd"

    def dims(x):
        if is_thd:
            T, H, D = x.shape
            return T, 1, H, D, (x.stride(0), 0, x.stride(1), x.stride(2))
        if tensor_format == "sbhd":
            S_, B_, H, D = x.shape
            return S_, B_, H, D, (x.stride(0), x.stride(1), x.stride(2), x.stride(3))
        B_, S_, H, D = x.shape
        return S_, B_, H, D, (x.stride(1), x.stride(0), x.stride(2), x.stride(3))

    S, B, H, D, sx = dims(t)
    out = t if inplace else torch.empty_like(t, memory_format=torch.contiguous_format)
    so = dims(out)[4]
    if second is not None:
        _, _, H2, _, sx2 = dims(second)
        out2 = second if inplace else torch.empty_like(second, memory_format=torch.contiguous_format)
        so2 = dims(out2)[4]
    else:
        H2, sx2, so2, out2 = 0, sx, so, out
    if is_thd:
        B = cu_seqlens.numel() - 1
        rows = t.shape[0]
    else:
        rows = S * B
    flags = (K.FLAG_BSHD if tensor_format == "bshd" else 0) | (K.FLAG_BACKWARD if backward else 0)
    flags |= (K.FLAG_HAS_START if start_positions is not None else 0) | (0 if inplace else K.FLAG_COPY_PASS)
    dummy = torch.zeros(1, dtype=torch.int32)
    K.rope_kernel[(triton.cdiv(rows, block_t),)](
        x_ptr=t, out_ptr=out, x2_ptr=second if second is not None else t, out2_ptr=out2, freqs_ptr=f2,
        cu_seqlens_ptr=cu_seqlens if cu_seqlens is not None else dummy,
        start_ptr=start_positions if start_positions is not None else dummy,
        rows=rows, S=S, B=B, H=H, H2=H2, D=D, HALF=d2 // 2, s_max=f2.shape[0], freqs_stride=f2.stride(0),
        sx_s=sx[0], sx_b=sx[1], sx_h=sx[2], sx_d=sx[3], so_s=so[0], so_b=so[1], so_h=so[2], so_d=so[3],
        sx2_s=sx2[0], sx2_b=sx2[1], sx2_h=sx2[2], sx2_d=sx2[3], so2_s=so2[0], so2_b=so2[1], so2_h=so2[2], so2_d=so2[3],
        cp_size=cp_size, cp_rank=cp_rank, flags=flags,
        IS_THD=is_thd, INTERLEAVED=interleaved, HAS_SECOND=second is not None,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half)
    return (out, out2) if second is not None else out
