"""RMSNorm of rows (any sm_80+), launched by csrc/ops/rms_norm_cuda.cpp for `torch.ops.fused.rms_norm`.

    out[i] = x[i] * rsqrt(mean(x[i]^2) + eps) * weight

in float32, rounded once to out's dtype: what torch's F.rms_norm computes for 16-bit inputs. One program per row reads
the row in BLOCK-wide pieces twice (the sum of squares, then the scaled write; the second read finds the row in L1 or
L2), so any row length runs with one compiled block.

Why a kernel of our own beside torch's: a decode step normalizes one to a few rows twice per layer, and there torch's
kernel took about 6 us per call on an H200 inside the step's CUDA graph (benchmarks/bench_generate.py's kernel
breakdown), without programmatic dependent launch. This one is a single small program per row and starts with
`grid_dependency_sync` like the routed GEMMs around it (kernels/pdl.py), so its launch overlaps the kernel before it.
"""
import triton
import triton.language as tl

from kernels.pdl import grid_dependency_sync

# The elements of a row one step of the program reads (in its variant key as "block"; csrc/ops/rms_norm_cuda.cpp
# reads it as rms::kBlock from the generated kernel_decls.h). 1024 = 128 threads x 8 elements (16-byte loads of bf16).
BLOCK = 1024


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_xm, stride_om, eps, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Row program_id(0) of x (row stride stride_xm elements, unit column stride) -> the same row of out (stride_om);
    weight [N] contiguous."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    o_row = out_ptr + row * stride_om
    cols = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        v = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        squares += v * v
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / N + eps)
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        v = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(o_row + start + cols, (v * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------
# Python launcher (JIT / TRITON_INTERPRET use: the interpreter tests)
# ----------------------------------------------------------------------------------------------
def launch_rms_norm(x, weight, out, eps, *, block=BLOCK, num_warps=4):
    """out [M, N] = rms_norm(x [M, N]) * weight [N]; rows of any stride, unit column stride (the C++ launcher's grid)."""
    M, N = x.shape
    assert x.stride(1) == 1 or N <= 1, "x's columns must be contiguous"
    assert out.shape == x.shape and (out.stride(1) == 1 or N <= 1) and weight.shape == (N,) and weight.is_contiguous()
    if M == 0:
        return out
    rms_norm_kernel[(M,)](x, weight, out, N, x.stride(0), out.stride(0), eps, BLOCK=block, num_warps=num_warps)
    return out
