"""The elementwise part of the SwiGLU MLP backward, in place, one pass.

With h = silu(g) * u (g = gate, u = up pre-activations) and dh the gradient of h:
    h      = silu(g) * u
    d_up   = dh * silu(g)
    d_gate = dh * u * silu'(g),   silu'(g) = s (1 + g (1 - s)) = s + silu(g) (1 - s),  s = sigmoid(g)
all in fp32, stored in the buffers' dtype. The three results overwrite the three inputs (gate <- h, up <- d_up,
dh <- d_gate): every element is loaded by the thread that stores it, before it stores anything, so no extra
[rows, I] buffers are needed. Replaces ~12 ATen passes (csrc/ops/ffn_cuda.cpp calls it; argument list: GEMM.md §10).
"""
import triton
import triton.language as tl

from kernels.pdl import grid_dependency_sync


@triton.jit
def swiglu_grads(g, u, d):
    """(h, d_up, d_gate) in fp32 from fp32 gate g, up u and dh d (the formulas above); also the epilogue of the fused
    gate/up recompute, kernels/gemm.py routed_swiglu_pair_bwd_tma_kernel."""
    s = tl.sigmoid(g)
    act = g * s
    return act * u, d * act, d * u * (s + act * (1.0 - s))


@triton.jit
def swiglu_backward_kernel(gate_ptr, up_ptr, dh_ptr, n_rows, n_cols, stride,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    off = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    g_raw = tl.load(gate_ptr + off, mask=ok, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(up_ptr + off, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(dh_ptr + off, mask=ok, other=0.0).to(tl.float32)
    h, d_up, d_gate = swiglu_grads(g, u, d)
    out_ty = g_raw.dtype
    tl.store(gate_ptr + off, h.to(out_ty), mask=ok)
    tl.store(up_ptr + off, d_up.to(out_ty), mask=ok)
    tl.store(dh_ptr + off, d_gate.to(out_ty), mask=ok)


def launch_swiglu_backward(gate, up, dh, *, BLOCK_R=16, BLOCK_C=256, num_warps=4):
    """Python launcher (JIT / interpreter); the C++ launcher in csrc/ops/ffn_cuda.cpp uses the same grid."""
    n_rows, n_cols = gate.shape
    grid = (triton.cdiv(n_rows, BLOCK_R), triton.cdiv(n_cols, BLOCK_C))
    swiglu_backward_kernel[grid](gate, up, dh, n_rows, n_cols, gate.stride(0), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
                                 num_warps=num_warps)
    return gate, up, dh
