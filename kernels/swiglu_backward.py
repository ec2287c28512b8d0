"""The elementwise part of the SwiGLU MLP backward, one pass.

With h = silu(g) * u (g = gate, u = up pre-activations) and dh the gradient of h:
    h      = silu(g) * u
    d_up   = dh * silu(g)
    d_gate = dh * u * silu'(g),   silu'(g) = s (1 + g (1 - s)) = s + silu(g) (1 - s),  s = sigmoid(g)
all in fp32, stored in the buffers' dtype. d_gate overwrites dh; h and d_up go to h_ptr and dup_ptr, which may be the
gate and up buffers themselves (every element is loaded by the thread that stores it, before it stores anything).
csrc/ops/ffn_cuda.cpp calls it in two ways:
  * recompute (gate and up computed again by the backward's pointer GEMMs): in place, h = gate, d_up = up;
  * saved (gate and up from the forward, gate_up [M, 2I] in token order): g and u read from gate_up, through perm
    (GATHER) when the backward's buffers are expert-ordered (a perm entry < 0, a padding row, reads g = u = 0, so
    h, d_up and d_gate are 0 there, as the grad-weight GEMMs need).
"""
import triton
import triton.language as tl

from kernels.pdl import grid_dependency_sync


@triton.jit
def swiglu_grads(g, u, d):
    """(h, d_up, d_gate) in fp32 from fp32 gate g, up u and dh d (the formulas above); also the epilogue of the fused
    gate/up recompute, kernels/gemm_tma.py routed_swiglu_pair_bwd_tma_kernel."""
    s = tl.sigmoid(g)
    act = g * s
    return act * u, d * act, d * u * (s + act * (1.0 - s))


@triton.jit
def swiglu_backward_kernel(gate_ptr, up_ptr, dh_ptr, h_ptr, dup_ptr, perm_ptr, n_rows, n_cols, stride_in, stride,
                           GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                           PDL: tl.constexpr = False):
    """gate / up [., n_cols] of row stride stride_in (row perm[r] when GATHER, else r; perm_ptr is read only with
    GATHER); dh, h, d_up [n_rows, n_cols] of row stride `stride`. Grid: (cdiv(n_rows, BLOCK_R), cdiv(n_cols,
    BLOCK_C))."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    off = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    if GATHER:
        src = tl.load(perm_ptr + rows, mask=rows < n_rows, other=-1)
        ok_in = ok & (src >= 0)[:, None]
        off_in = tl.where(src >= 0, src, 0).to(tl.int64)[:, None] * stride_in + cols[None, :]
    else:
        ok_in = ok
        off_in = rows.to(tl.int64)[:, None] * stride_in + cols[None, :]
    g = tl.load(gate_ptr + off_in, mask=ok_in, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + off_in, mask=ok_in, other=0.0).to(tl.float32)
    d = tl.load(dh_ptr + off, mask=ok, other=0.0).to(tl.float32)
    h, d_up, d_gate = swiglu_grads(g, u, d)
    out_ty = dh_ptr.dtype.element_ty
    tl.store(h_ptr + off, h.to(out_ty), mask=ok)
    tl.store(dup_ptr + off, d_up.to(out_ty), mask=ok)
    tl.store(dh_ptr + off, d_gate.to(out_ty), mask=ok)


def launch_swiglu_backward(gate, up, dh, h=None, dup=None, perm=None, *, BLOCK_R=16, BLOCK_C=256, num_warps=4):
    """Python launcher (JIT / interpreter); the C++ launcher in csrc/ops/ffn_cuda.cpp uses the same grid. h / dup
    default to gate / up (in place); perm: gate / up rows through it (GATHER)."""
    h = gate if h is None else h
    dup = up if dup is None else dup
    n_rows, n_cols = dh.shape
    assert h.stride() == dup.stride() == dh.stride() and gate.stride() == up.stride()
    grid = (triton.cdiv(n_rows, BLOCK_R), triton.cdiv(n_cols, BLOCK_C))
    swiglu_backward_kernel[grid](gate_ptr=gate, up_ptr=up, dh_ptr=dh, h_ptr=h, dup_ptr=dup,
                                 perm_ptr=dh if perm is None else perm, n_rows=n_rows, n_cols=n_cols,
                                 stride_in=gate.stride(0), stride=dh.stride(0), GATHER=perm is not None,
                                 BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=num_warps)
    return h, dup, dh
