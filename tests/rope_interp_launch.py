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
        t, out, second if second is not None else t, out2, f2,
        cu_seqlens if cu_seqlens is not None else dummy, start_positions if start_positions is not None else dummy,
        rows, S, B, H, H2, D, d2 // 2, f2.shape[0], f2.stride(0), *sx, *so, *sx2, *so2, cp_size, cp_rank, flags,
        IS_THD=is_thd, INTERLEAVED=interleaved, HAS_SECOND=second is not None,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half)
    return (out, out2) if second is not None else out
