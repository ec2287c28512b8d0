"""Pointer-load routed GEMMs (any sm_80+; kernels/GEMM.md kernels 3 and 4): routed_linear_kernel (the routed linear,
forward and grad-input) and routed_swiglu_kernel (the dual-expert SwiGLU gate/up GEMM, h = silu(A W1_e^T) * (A W3_e^T)).
Every operand is read by pointer loads; one program per [BLOCK_M, BLOCK_N] tile of the padded rows (_tile_mn's
groups of GROUP_M row tiles), tiles at or past end = seg[2] empty.

Conventions (experts, perm / seg, the generic GEMM with W_TRANSPOSED, SCATTER_OUT): kernels/gemm_tiles.py.
  * GATHER_A:   A row of padded position r is A[perm[r]] (pointer kernels only) - otherwise A is an
                expert-ordered padded buffer [M_pad, K] (row r).
"""
import triton
import triton.language as tl

from kernels.gemm_tiles import (_add_bias, _add_residual, _gate_up_arg, _save_gate_up, _silu_mul, _store_tile, _tile_mn,
                                _tile_rows)
from kernels.pdl import grid_dependency_sync


@triton.jit
def _ptr_mainloop(acc, a_ptrs, a_mask, b_ptrs, offs_k, offs_n, N, K, b_step,
                  W_TRANSPOSED: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += A_tile @ B_tile over K. a_ptrs [BM, BK] at k=0, b_ptrs [BK, BN] at k=0."""
    n_ok = offs_n[None, :] < N
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=a_mask[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += b_step
    return acc


@triton.jit
def _b_ptrs(w_ptr, offs_k, offs_n, stride_w, W_TRANSPOSED: tl.constexpr):
    """[BK, BN] pointers of B^T for k = offs_k, n = offs_n, and the pointer step per BLOCK_K."""
    if W_TRANSPOSED:
        ptrs = w_ptr + offs_k.to(tl.int64)[:, None] * stride_w + offs_n[None, :]
    else:
        ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
    return ptrs


@triton.jit
def routed_linear_kernel(a_ptr, w0_ptr, w1_ptr, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, seg_ptr,
                         M_pad, N, K, stride_am, stride_w, stride_om,
                         has_bias, has_residual, GATHER_A: tl.constexpr,
                         SCATTER_OUT: tl.constexpr,
                         W_TRANSPOSED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    num_pid_m = M_pad // BLOCK_M
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_mn(pid, num_pid_m, num_pid_n, GROUP_M)
    row0 = pid_m * BLOCK_M
    start1 = tl.load(seg_ptr + 1)
    end = tl.load(seg_ptr + 2)
    if row0 < end:
        e = (row0 >= start1).to(tl.int32)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if GATHER_A:
            rows, a_mask = _tile_rows(perm_ptr, row0, row0 + BLOCK_M, BLOCK_M)
        else:
            rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            a_mask = rows >= 0
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        if W_TRANSPOSED:
            b_step = BLOCK_K * stride_w
        else:
            b_step = BLOCK_K
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if e == 0:
            b_ptrs = _b_ptrs(w0_ptr, offs_k, offs_n, stride_w, W_TRANSPOSED)
        else:
            b_ptrs = _b_ptrs(w1_ptr, offs_k, offs_n, stride_w, W_TRANSPOSED)
        acc = _ptr_mainloop(acc, a_ptrs, a_mask, b_ptrs, offs_k, offs_n, N, K, b_step, W_TRANSPOSED,
                            INPUT_PRECISION, BLOCK_K)
        if has_bias:
            acc = _add_bias(acc, bias0_ptr, bias1_ptr, e, offs_n, N)
        if has_residual:  # res_ptr: out's layout and row stride (kernels/gemm_tiles.py _add_residual)
            acc = _add_residual(acc, res_ptr, perm_ptr, row0, row0 + BLOCK_M, offs_n, N, stride_om, SCATTER_OUT,
                                BLOCK_M)
        _store_tile(out_ptr, acc, perm_ptr, row0, row0 + BLOCK_M, offs_n, N, stride_om, SCATTER_OUT, BLOCK_M)


@triton.jit
def routed_swiglu_kernel(a_ptr, w1_0_ptr, w1_1_ptr, w3_0_ptr, w3_1_ptr, h_ptr, gu_ptr, perm_ptr, seg_ptr,
                         M_pad, N, K, stride_am, stride_w, stride_hm, stride_gu,
                         GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr,
                         INPUT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, SAVE: tl.constexpr = False, PDL: tl.constexpr = False):
    """h = silu(A @ W1_e^T) * (A @ W3_e^T); W1_e, W3_e [N = intermediate, K = hidden], all four weights of one row
    stride stride_w. SAVE (with GATHER_A): gate and up also into gate_up (_save_gate_up); without it gu_ptr and
    stride_gu are not read."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    num_pid_m = M_pad // BLOCK_M
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_mn(pid, num_pid_m, num_pid_n, GROUP_M)
    row0 = pid_m * BLOCK_M
    start1 = tl.load(seg_ptr + 1)
    end = tl.load(seg_ptr + 2)
    if row0 < end:
        e = (row0 >= start1).to(tl.int32)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if GATHER_A:
            rows, a_mask = _tile_rows(perm_ptr, row0, row0 + BLOCK_M, BLOCK_M)
        else:
            rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            a_mask = rows >= 0
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        if e == 0:
            g_ptrs = _b_ptrs(w1_0_ptr, offs_k, offs_n, stride_w, False)
            u_ptrs = _b_ptrs(w3_0_ptr, offs_k, offs_n, stride_w, False)
        else:
            g_ptrs = _b_ptrs(w1_1_ptr, offs_k, offs_n, stride_w, False)
            u_ptrs = _b_ptrs(w3_1_ptr, offs_k, offs_n, stride_w, False)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        n_ok = offs_n[None, :] < N
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=a_mask[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
            acc_g = tl.dot(a, g, acc_g, input_precision=INPUT_PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        h = _silu_mul(acc_g, acc_u)
        _store_tile(h_ptr, h, perm_ptr, row0, row0 + BLOCK_M, offs_n, N, stride_hm, SCATTER_OUT, BLOCK_M)
        if SAVE:
            _save_gate_up(gu_ptr, acc_g, acc_u, perm_ptr, 0, row0, row0 + BLOCK_M, offs_n, N, stride_gu, BLOCK_M)


# ----------------------------------------------------------------------------------------------
# Python launchers (JIT / TRITON_INTERPRET use; they also document the grids for the C++ side)
# ----------------------------------------------------------------------------------------------
def _grid_mn(M_pad, N, BM, BN):
    return ((M_pad // BM) * triton.cdiv(N, BN), )


def launch_routed_linear(a, w0, w1, bias0, bias1, out, perm, seg, N, K, *, gather_a=True, scatter_out=True,
                         w_transposed=False, input_precision="tf32", BM=128, BN=128, BK=64, GROUP_M=8,
                         num_warps=8, num_stages=3, residual=None):
    """residual: None, or a tensor of out's shape and strides added in the epilogue."""
    M_pad = perm.shape[0]
    has_bias = bias0 is not None
    if not has_bias:
        bias0 = bias1 = w0
    assert residual is None or (residual.shape == out.shape and residual.stride() == out.stride())
    grid = _grid_mn(M_pad, N, BM, BN)
    routed_linear_kernel[grid](a_ptr=a, w0_ptr=w0, w1_ptr=w1, bias0_ptr=bias0, bias1_ptr=bias1, out_ptr=out,
                               res_ptr=out if residual is None else residual, perm_ptr=perm, seg_ptr=seg, M_pad=M_pad,
                               N=N, K=K, stride_am=a.stride(0), stride_w=w0.stride(0), stride_om=out.stride(0),
                               has_bias=has_bias, has_residual=residual is not None, GATHER_A=gather_a,
                               SCATTER_OUT=scatter_out, W_TRANSPOSED=w_transposed, INPUT_PRECISION=input_precision,
                               BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M, num_warps=num_warps,
                               num_stages=num_stages)
    return out


def launch_routed_swiglu(a, w1_0, w1_1, w3_0, w3_1, h, perm, seg, N, K, *, gather_a=True, scatter_out=False,
                         input_precision="tf32", BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3,
                         gate_up=None):
    """gate_up: [M, 2N] that gets gate and up in token order (SAVE; with gather_a), or None."""
    M_pad = perm.shape[0]
    grid = _grid_mn(M_pad, N, BM, BN)
    gu, stride_gu, save = _gate_up_arg(gate_up, h)
    routed_swiglu_kernel[grid](a_ptr=a, w1_0_ptr=w1_0, w1_1_ptr=w1_1, w3_0_ptr=w3_0, w3_1_ptr=w3_1, h_ptr=h, gu_ptr=gu,
                               perm_ptr=perm, seg_ptr=seg, M_pad=M_pad, N=N, K=K, stride_am=a.stride(0),
                               stride_w=w1_0.stride(0), stride_hm=h.stride(0), stride_gu=stride_gu, GATHER_A=gather_a,
                               SCATTER_OUT=scatter_out, SAVE=save, INPUT_PRECISION=input_precision, BLOCK_M=BM,
                               BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M, num_warps=num_warps, num_stages=num_stages)
    return h
