"""Launches kernels/decode_attention.py the way csrc/ops/decode_attention_cuda.cpp does: the same grids, the same
split rule, the same workspace layout and argument packing (by name). Test-only (the interpreter tier, and the JIT on a
GPU for a kernel A/B); the product never imports triton."""
import os
import sys

import torch
import triton
import triton_interp_compat  # noqa: F401  (Triton 3.6 interpreter: numpy >= 2.5, bool arguments)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kernels import decode_attention as K  # noqa: E402


def decode_attention_launch(q, k_cache, v_cache, k_new, v_new, cache_lens, scale=None, *, block_m=16, block_n=16,
                            num_warps=4, num_stages=2, n_split=None, sms=132, poison_ws=True, out=None, pdl=False):
    """out [B, T, Hq, D] (q's dtype); writes k_new / v_new into the caches at cache_lens. n_split: the split count
    (default: the launcher's rule for `sms` SMs). poison_ws: the workspace filled with NaN first (the combine must
    not depend on an entry that was not written). pdl: both kernels compiled with PDL and launched with it (sm_90
    JIT only: what the C++ launcher does there)."""
    B, T, Hq, D = q.shape
    Hkv = k_new.shape[2]
    S = k_cache.shape[2]
    G = Hq // Hkv
    R = G * T
    chunks = triton.cdiv(R, block_m)
    if n_split is None:
        n_split = K.decode_attention_split(B * Hkv * chunks, S, block_n, sms)
    assert 1 <= n_split <= K.COMBINE_MAX_SPLITS and T <= K.MAX_T.value
    scale = D ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    if n_split > 1:
        ws = torch.empty(B * Hkv * n_split * R * D, dtype=torch.float32, device=q.device)
        ml = torch.empty(B * Hkv * n_split * R * 2, dtype=torch.float32, device=q.device)
        if poison_ws:
            ws.fill_(float("nan"))
            ml.fill_(float("nan"))
    else:
        ws = ml = torch.empty(1, dtype=torch.float32, device=q.device)  # unused: any valid address
    extra = {"PDL": True, "launch_pdl": True} if pdl else {}
    K.decode_attention_kernel[(B * Hkv, n_split, chunks)](
        q_ptr=q, k_new_ptr=k_new, v_new_ptr=v_new, k_cache_ptr=k_cache, v_cache_ptr=v_cache, lens_ptr=cache_lens,
        out_ptr=out, ws_ptr=ws, ml_ptr=ml, T=T, HKV=Hkv, G=G, S=S, n_split=n_split, scale=scale,
        sq_b=q.stride(0), sq_t=q.stride(1), sq_h=q.stride(2),
        skn_b=k_new.stride(0), skn_t=k_new.stride(1), skn_h=k_new.stride(2),
        svn_b=v_new.stride(0), svn_t=v_new.stride(1), svn_h=v_new.stride(2),
        skc_b=k_cache.stride(0), skc_h=k_cache.stride(1), skc_s=k_cache.stride(2),
        svc_b=v_cache.stride(0), svc_h=v_cache.stride(1), svc_s=v_cache.stride(2),
        HEAD_D=D, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **extra)
    if n_split > 1:
        cols = min(K.COMBINE_COLS, D)
        K.decode_attention_combine_kernel[(B * Hkv, R, D // cols)](
            ws_ptr=ws, ml_ptr=ml, out_ptr=out, T=T, HKV=Hkv, G=G, D=D, n_split=n_split,
            MAX_SPLITS=K.COMBINE_MAX_SPLITS, BLOCK_D=cols, num_warps=4, num_stages=1, **extra)
    return out
