"""Hopper (sm_90) routed GEMMs with x gathered inside (kernels/GEMM.md kernel 7b): A in token order, its rows
loaded through perm by pointer loads in the main loop, W through TMA descriptors. routed_linear_gather_tma_kernel
(the linear_dual forward, output rows scattered) and routed_swiglu_gather_tma_kernel (the ffn gate/up GEMM, h
expert-ordered): no gather copy and no [M_pad, K] buffer, and with ROUTE_BLOCK > 0 no routing launch either
(kernels/gemm_tiles.py _routed_row_tiles). The alternative to kernels/gather_rows.py + kernels/gemm_tma.py, whose
weight steps and expert order (_linear_step, _swiglu_step, _w_index) they share; persistent as those.

Conventions (experts, perm / seg, SCATTER_OUT): kernels/gemm_tiles.py.
"""
import triton
import triton.language as tl

from kernels.gemm_tiles import (SK_MAX_PARTS, _gate_up_arg, _interpreting, _mask_arg, _routed_row_tiles,
                                _save_gate_up, _silu_mul, _sk_piece, _sk_share, _split_tail, _store_tile,
                                _stream_k_args, _tail_cols, _tail_part_at, _tile_at, _tile_rows)
from kernels.gemm_tma import _linear_epilogue, _linear_step, _sk_finish, _sk_fixup, _swiglu_step, _w_index
from kernels.pdl import grid_dependency_sync


@triton.jit
def _gathered_a(a_ptrs, valid, offs_k, K, k0):
    """The [BM, BK] A tile at k0 whose rows were gathered through perm (a_ptrs at k = 0; invalid rows and k >= K
    read as zeros)."""
    return tl.load(a_ptrs + k0, mask=valid[:, None] & (offs_k[None, :] < K - k0), other=0.0)


@triton.jit
def _gather_mainloop(a_ptr, w_desc, perm_ptr, row0, row_hi, e, n0, K, stride_am, k_lo, k_hi,
                     INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """The fp32 tile of A's rows gathered through perm[row0, row_hi) times W_e's columns from n0 (e: the index along
    w_desc, _w_index), over the K steps [k_lo, k_hi) (all of K, or a stream-K piece)."""
    offs_k = tl.arange(0, BLOCK_K)
    rows, valid = _tile_rows(perm_ptr, row0, row_hi, BLOCK_M)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo * BLOCK_K, k_hi * BLOCK_K, BLOCK_K):
        acc = _linear_step(_gathered_a(a_ptrs, valid, offs_k, K, k0), w_desc, e, n0, k0, acc, False, INPUT_PRECISION,
                           BLOCK_N, BLOCK_K)
    return acc


@triton.jit
def _gather_linear_tile(a_ptr, w_desc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e, n0, offs_n,
                        N, K, stride_am, stride_om, w_map, has_bias, has_residual,
                        INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """One output tile of routed_linear_gather_tma_kernel: A's rows gathered through perm[row0, row_hi), columns
    offs_n = n0 + [0, BLOCK_N) of expert e's W through w_desc (whose block is BLOCK_N wide), bias, residual, rows
    scattered."""
    acc = _gather_mainloop(a_ptr, w_desc, perm_ptr, row0, row_hi, _w_index(e, w_map), n0, K, stride_am, 0,
                           tl.cdiv(K, BLOCK_K), INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    _linear_epilogue(acc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e, offs_n, N, stride_om,
                     has_bias, has_residual, True, BLOCK_M)


@triton.jit
def routed_linear_gather_tma_kernel(a_ptr, w_desc, wh_desc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr,
                                    seg_ptr, mask_ptr, ws_ptr, flag_ptr, M, M_pad, N, K, stride_am, stride_om, w_map,
                                    has_bias, has_residual, INPUT_PRECISION: tl.constexpr,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                    GROUP_M: tl.constexpr, ROUTE_BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                                    FLATTEN: tl.constexpr, SPLIT_TAIL: tl.constexpr = 0,
                                    STREAM_K: tl.constexpr = 0, SK_WAIT: tl.constexpr = True,
                                    PDL: tl.constexpr = False):
    """The forward of routed_linear_tma_kernel (W through TMA, output rows scattered) with A in token order, its rows
    gathered through perm by pointer loads inside the main loop: no [M_pad, K] gather copy. The alternative design
    (the gather inside the GEMM), measured against gather + routed_linear_tma_kernel by aot/tune.py.
    Persistent over the tiles that hold rows; SPLIT_TAIL: a last round split in SPLIT_TAIL column slices through
    wh_desc, as in routed_linear_tma_kernel; STREAM_K: the last STREAM_K rounds' K steps shared out evenly, ws_ptr /
    flag_ptr / SK_WAIT as there. ROUTE_BLOCK > 0: routes mask [M] itself (_routed_row_tiles). w_map: _w_index.
    has_residual: out = A·Wᵀ (+ bias) + residual, res_ptr of out's layout and row stride (a block's residual add)."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start1, t0, num_pid_m, hi0, hi1 = _routed_row_tiles(mask_ptr, perm_ptr, seg_ptr, M, M_pad, BLOCK_M, ROUTE_BLOCK,
                                                        ALIGN)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    main = num_pid_m * num_pid_n
    if SPLIT_TAIL:
        main, tail = _split_tail(main, nprog, SPLIT_TAIL)
    if STREAM_K:
        dp, kit, per, lo, hi = _sk_share(pid, nprog, main, K, BLOCK_K, SK_MAX_PARTS, STREAM_K)
        main = dp
    for tile in tl.range(pid, main, nprog, flatten=FLATTEN):
        row0, row_hi, e, n0, offs_n = _tile_at(tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                               GROUP_M)
        _gather_linear_tile(a_ptr, w_desc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e, n0,
                            offs_n, N, K, stride_am, stride_om, w_map, has_bias, has_residual, INPUT_PRECISION,
                            BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT_TAIL:
        if pid < SPLIT_TAIL * tail:
            row0, row_hi, e, n0, offs_n = _tail_part_at(pid, main, start1, t0, num_pid_m, hi0, hi1, num_pid_n,
                                                        BLOCK_M, BLOCK_N, GROUP_M, SPLIT_TAIL)
            _gather_linear_tile(a_ptr, wh_desc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e,
                                n0, offs_n, N, K, stride_am, stride_om, w_map, has_bias, has_residual,
                                INPUT_PRECISION, BLOCK_M, BLOCK_N // SPLIT_TAIL, BLOCK_K)
    if STREAM_K:  # the last STREAM_K rounds, shared out
        it = hi
        while it > lo:
            tile, k_lo, k_hi = _sk_piece(it, lo, kit)
            row0, row_hi, e, n0, offs_n = _tile_at(dp + tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M,
                                                   BLOCK_N, GROUP_M)
            acc = _gather_mainloop(a_ptr, w_desc, perm_ptr, row0, row_hi, _w_index(e, w_map), n0, K, stride_am, k_lo,
                                   k_hi, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
            _sk_finish(acc, ws_ptr, flag_ptr, pid, tile, k_lo, k_hi, kit, per, bias0_ptr, bias1_ptr, out_ptr, res_ptr,
                       perm_ptr, row0, row_hi, e, n0, N, stride_om, has_bias, has_residual, True, STREAM_K, BLOCK_M,
                       BLOCK_N)
            it -= k_hi - k_lo
        _sk_fixup(ws_ptr, flag_ptr, pid, nprog, lo, hi, kit, per, dp, start1, t0, num_pid_m, hi0, hi1, num_pid_n,
                  bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, N, stride_om, has_bias, has_residual, True,
                  SK_WAIT, STREAM_K, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def routed_swiglu_gather_tma_kernel(a_ptr, w1_desc, w3_desc, h_ptr, gu_ptr, perm_ptr, seg_ptr, mask_ptr, M, M_pad,
                                    N, K, stride_am, stride_hm, stride_gu, w_map, INPUT_PRECISION: tl.constexpr,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                    GROUP_M: tl.constexpr, ROUTE_BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                                    FLATTEN: tl.constexpr, SAVE: tl.constexpr = False, PDL: tl.constexpr = False):
    """routed_swiglu_tma_kernel with x in token order, its rows gathered through perm inside the main loop (no
    [M_pad, H] gather copy); h expert-ordered as there (rows past each expert's last row tile not written).
    ROUTE_BLOCK > 0: routes mask [M] itself (_routed_row_tiles; mask_ptr, M and M_pad, perm's length, are read only
    then). SAVE: gate and up also into gate_up (_save_gate_up); without it gu_ptr and stride_gu are not read."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start1, t0, num_pid_m, hi0, hi1 = _routed_row_tiles(mask_ptr, perm_ptr, seg_ptr, M, M_pad, BLOCK_M, ROUTE_BLOCK,
                                                        ALIGN)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(pid, num_pid_m * num_pid_n, nprog, flatten=FLATTEN):
        row0, row_hi, e, n0, offs_n = _tile_at(tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                               GROUP_M)
        rows, valid = _tile_rows(perm_ptr, row0, row_hi, BLOCK_M)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_g, acc_u = _swiglu_step(_gathered_a(a_ptrs, valid, offs_k, K, k0), w1_desc, w3_desc, e, w_map, n0, k0,
                                        acc_g, acc_u, INPUT_PRECISION, BLOCK_N, BLOCK_K)
        _store_tile(h_ptr, _silu_mul(acc_g, acc_u), perm_ptr, row0, row_hi, offs_n, N, stride_hm, False, BLOCK_M)
        if SAVE:
            _save_gate_up(gu_ptr, acc_g, acc_u, perm_ptr, 0, row0, row_hi, offs_n, N, stride_gu, BLOCK_M)


# ----------------------------------------------------------------------------------------------
# Python launchers (JIT / TRITON_INTERPRET use; they also document the grids for the C++ side)
# ----------------------------------------------------------------------------------------------
def launch_routed_linear_gather_tma(a, w_stacked, bias0, bias1, out, perm, seg, *, mask=None, route_block=0,
                                    align=128, input_precision="tf32", BM=128, BN=256, BK=64, GROUP_M=8,
                                    num_programs=None, num_warps=8, num_stages=3, FLATTEN=False, SPLIT_TAIL=False,
                                    STREAM_K=False, w_map=2, residual=None):
    """a [M, K] in token order (rows gathered in the kernel); w_stacked [2, N, K] (w_map: as in
    launch_routed_linear_tma); out [M, N]; residual: None or a tensor of out's shape and strides, added. route_block >
    0: perm and seg are written by the kernel from mask (int8 [M], M <= route_block) with routing ALIGN = align."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M_pad = perm.shape[0]
    mask_arg, M = _mask_arg(mask, perm, route_block)
    K = a.shape[1]
    N = w_stacked.shape[1]
    w_desc = TensorDescriptor.from_tensor(w_stacked, [1, BN, BK])
    wh_desc = TensorDescriptor.from_tensor(w_stacked, [1, _tail_cols(BN, SPLIT_TAIL), BK])
    has_bias = bias0 is not None
    if not has_bias:
        bias0 = bias1 = out
    tiles = (M_pad // BM) * triton.cdiv(N, BN)
    grid, ws, flags = _stream_k_args(STREAM_K, num_programs, tiles, BM, BN, out.device)
    assert residual is None or (residual.shape == out.shape and residual.stride() == out.stride())
    routed_linear_gather_tma_kernel[grid](a_ptr=a, w_desc=w_desc, wh_desc=wh_desc, bias0_ptr=bias0, bias1_ptr=bias1,
                                          out_ptr=out, res_ptr=out if residual is None else residual, perm_ptr=perm,
                                          seg_ptr=seg, mask_ptr=mask_arg, ws_ptr=ws, flag_ptr=flags, M=M, M_pad=M_pad,
                                          N=N, K=K, stride_am=a.stride(0), stride_om=out.stride(0), w_map=w_map,
                                          has_bias=has_bias, has_residual=residual is not None,
                                          INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                                          GROUP_M=GROUP_M, ROUTE_BLOCK=route_block, ALIGN=align, FLATTEN=FLATTEN,
                                          SPLIT_TAIL=int(SPLIT_TAIL), STREAM_K=int(STREAM_K),
                                          SK_WAIT=not _interpreting(), num_warps=num_warps, num_stages=num_stages)
    return out


def launch_routed_swiglu_gather_tma(a, w1_stacked, w3_stacked, h, perm, seg, *, mask=None, route_block=0, align=128,
                                    input_precision="tf32", BM=128, BN=128, BK=64, GROUP_M=8, num_programs=None,
                                    num_warps=8, num_stages=3, FLATTEN=False, w_map=2 | 2 << 2, gate_up=None):
    """a [M, K] in token order; h [M_pad, N] expert-ordered (rows >= seg[2] not written). route_block: as in
    launch_routed_linear_gather_tma; w_map: as in launch_routed_swiglu_tma; gate_up: as in launch_routed_swiglu."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M_pad, K, N = perm.shape[0], a.shape[1], w1_stacked.shape[1]
    mask_arg, M = _mask_arg(mask, perm, route_block)
    w1_desc = TensorDescriptor.from_tensor(w1_stacked, [1, BN, BK])
    w3_desc = TensorDescriptor.from_tensor(w3_stacked, [1, BN, BK])
    tiles = (M_pad // BM) * triton.cdiv(N, BN)
    grid = (min(num_programs or tiles, tiles), )
    gu, stride_gu, save = _gate_up_arg(gate_up, h)
    routed_swiglu_gather_tma_kernel[grid](a_ptr=a, w1_desc=w1_desc, w3_desc=w3_desc, h_ptr=h, gu_ptr=gu, perm_ptr=perm,
                                          seg_ptr=seg, mask_ptr=mask_arg, M=M, M_pad=M_pad, N=N, K=K,
                                          stride_am=a.stride(0), stride_hm=h.stride(0), stride_gu=stride_gu,
                                          w_map=w_map, SAVE=save, INPUT_PRECISION=input_precision, BLOCK_M=BM,
                                          BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M, ROUTE_BLOCK=route_block, ALIGN=align,
                                          FLATTEN=FLATTEN, num_warps=num_warps, num_stages=num_stages)
    return h
