"""Expert-routed GEMMs for the modality-routed linear and the dual-expert SwiGLU MLP.

Argument lists: each kernel's signature (the AOT manifest reads them); what each kernel does, its layouts and grid:
kernels/GEMM.md.  Routing: kernels/routing.py.

Conventions
  * Two experts: e = 0 (mask false, "text"), e = 1 (mask true, "vision").
  * perm int32 [M_pad], seg int32 [5] = [0, start_1, end, count_0, count_1] from routing. With ALIGN = 128 a
    tile of BLOCK_M rows never mixes experts; on an unaligned routing (ALIGN = 1) the persistent TMA kernels
    store only rows below row_hi (_tile_at). Tiles with row0 >= end are empty and skipped.
  * "Generic" GEMM: out[M, N] = A[M, K] @ B^T, B[n, k] = W_e[n, k]  (W_TRANSPOSED = False, forward,
    W_e in nn.Linear layout [N, K]) or B[n, k] = W_e[k, n] (W_TRANSPOSED = True, grad-input:
    dX = dY @ W_e with W_e [K_red = N_lin, N_out = K_lin]).
  * GATHER_A:   A row of padded position r is A[perm[r]] (pointer kernels only) - otherwise A is an
                expert-ordered padded buffer [M_pad, K] (row r).
  * SCATTER_OUT: out row of padded position r is out[perm[r]] (padding rows skipped) - otherwise
                out is an expert-ordered padded buffer [M_pad, N] (every row of a non-empty tile is
                written; padding rows get the value computed from zero A rows).
  * fp32 accumulation always; INPUT_PRECISION ("ieee" | "tf32" | "tf32x3") matters for fp32 inputs.
  * All innermost dimensions must be contiguous (stride 1).
"""
import triton
import triton.language as tl

from kernels.pdl import grid_dependency_sync
from kernels.routing import expert_positions, pad_and_seg, route_one_block
from kernels.swiglu_backward import swiglu_grads

# Rows per program of gather_rows_kernel (the AOT manifest compiles this value and puts it in the keys as "rows";
# csrc/ops/routed_gemm.cpp's kGatherRows must match). It divides the routing ALIGN, so a block of the gather's column
# sums never mixes experts.
GATHER_ROWS = 32
# Columns per program and warps of gather_rows_kernel: (BLOCK_C, num_warps) without and with COLSUM (in the keys as
# "cols"). The column sums reduce each block's rows across warps; H100, 4096 x 4096 bf16, a 50% random mask,
# interleaved CUDA graphs: with COLSUM 36.2 µs at 128 columns / 4 warps, 29.7 at 1024 / 8 (a plain copy: 24.6);
# without it 128 / 4 is already the fastest measured (25.8 µs).
GATHER_COLS = {False: (128, 4), True: (1024, 8)}


# ----------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile_mn(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    gsz = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % gsz
    pid_n = (pid % num_in_group) // gsz
    return pid_m, pid_n


@triton.jit
def _row_tiles(seg_ptr, BLOCK_M: tl.constexpr, WHOLE_SEGMENTS: tl.constexpr):
    """The row tiles a persistent routed kernel walks: (start1, t0, num_pid_m, hi0, hi1). Tiles [0, t0) are expert
    0's (rows from 0, below hi0), tiles [t0, num_pid_m) expert 1's (rows from start1 = seg[1], below hi1).
    WHOLE_SEGMENTS: every tile of both padded segments, up to end = seg[2] (for an expert-ordered output whose padding
    rows later kernels read, e.g. as the zero rows of the grad-weight). Otherwise only the tiles that hold rows,
    cdiv(count_e, BLOCK_M) per expert: a decode step of one token is one row tile, not ALIGN / BLOCK_M of them.
    Their rows end at each expert's last row (hi_e = start_e + count_e), so they also walk an unaligned routing
    (kernels/routing.py, ALIGN = 1), whose tiles may reach into the next expert's rows: those are not written."""
    start1 = tl.load(seg_ptr + 1)
    if WHOLE_SEGMENTS:
        end = tl.load(seg_ptr + 2)
        t0 = start1 // BLOCK_M
        num_pid_m = end // BLOCK_M
        hi0 = start1
        hi1 = end
    else:
        count0 = tl.load(seg_ptr + 3)
        count1 = tl.load(seg_ptr + 4)
        t0 = tl.cdiv(count0, BLOCK_M)
        num_pid_m = t0 + tl.cdiv(count1, BLOCK_M)
        hi0 = count0
        hi1 = start1 + count1
    return start1, t0, num_pid_m, hi0, hi1


@triton.jit
def _walk_tiles(seg_ptr, one_rows, BLOCK_M: tl.constexpr, WHOLE_SEGMENTS: tl.constexpr):
    """_row_tiles, or with one_rows > 0 those of one expert whose rows are [0, one_rows) in token order (the
    single-expert forward, which allocates no perm or seg: neither is read, and with SCATTER_OUT = False the output
    rows below one_rows are written in place). A scalar branch at the start of each program."""
    if one_rows > 0:
        start1 = one_rows
        t0 = tl.cdiv(one_rows, BLOCK_M)
        num_pid_m = t0
        hi0 = one_rows
        hi1 = one_rows
    else:
        start1, t0, num_pid_m, hi0, hi1 = _row_tiles(seg_ptr, BLOCK_M, WHOLE_SEGMENTS)
    return start1, t0, num_pid_m, hi0, hi1


@triton.jit
def _routed_row_tiles(mask_ptr, perm_ptr, seg_ptr, M, M_pad, BLOCK_M: tl.constexpr, ROUTE_BLOCK: tl.constexpr,
                      ALIGN: tl.constexpr):
    """_row_tiles of the tiles that hold rows. ROUTE_BLOCK > 0 (M <= ROUTE_BLOCK): the kernel routes the mask itself,
    with no routing launch before it. Every program runs the one-block routing (kernels/routing.py) and writes the
    whole perm and seg, all programs the same values, then reads back only what it wrote itself: the CTA barrier
    orders a program's global writes before its own reads, so no program waits for another. The perm and seg left
    in memory are the routing kernel's, for the kernels after this one."""
    if ROUTE_BLOCK > 0:
        route_one_block(mask_ptr, perm_ptr, seg_ptr, M, M_pad, ROUTE_BLOCK, ALIGN)
        tl.debug_barrier()
    return _row_tiles(seg_ptr, BLOCK_M, False)


@triton.jit
def _expert_tile_mn(tile, t0, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile number `tile` when row tiles [0, t0) are expert 0's and [t0, num_pid_m) expert 1's:
    _tile_mn's grouped order within each expert, all of expert 0's tiles first, and an expert's last group takes
    the row tiles left over (GROUP_M to 2 GROUP_M - 1 of them; an expert with fewer than GROUP_M row tiles is one
    group) instead of forming a group of its own. A group then never mixes the experts' weights, and no group has a
    few row tiles only: such a group reads its weight columns for that few rows (86 tiles of 2 MB in the gate/up
    GEMM of 4096 x 11008 x 4096 for one row tile, more than HBM delivers while they compute)."""
    n0_tiles = t0 * num_pid_n
    in1 = tile >= n0_tiles
    base = tl.where(in1, t0, 0)
    rows = tl.where(in1, num_pid_m - t0, t0)
    local = tl.where(in1, tile - n0_tiles, tile)
    groups = tl.maximum(rows // GROUP_M, 1)
    group = tl.minimum(local // (GROUP_M * num_pid_n), groups - 1)
    first = group * GROUP_M
    gsz = tl.where(group == groups - 1, rows - first, GROUP_M)
    in_group = local - first * num_pid_n
    return base + first + in_group % gsz, in_group // gsz


@triton.jit
def _tile_at(tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             GROUP_M: tl.constexpr):
    """(row0, row_hi, expert, n0, offs_n) of tile number `tile` of a persistent walk over _row_tiles' row tiles: its
    rows are [row0, min(row0 + BLOCK_M, row_hi)), its columns offs_n = n0 + [0, BLOCK_N)."""
    pid_m, pid_n = _expert_tile_mn(tile, t0, num_pid_m, num_pid_n, GROUP_M)
    e = (pid_m >= t0).to(tl.int32)
    row0 = tl.where(pid_m >= t0, start1 + (pid_m - t0) * BLOCK_M, pid_m * BLOCK_M)
    row_hi = tl.where(pid_m >= t0, hi1, hi0)
    n0 = pid_n * BLOCK_N
    return row0, row_hi, e, n0, n0 + tl.arange(0, BLOCK_N)


@triton.jit
def _split_tail(num_tiles, nprog):
    """(main, tail) of a persistent walk whose last partial round is split in column halves: tiles [0, main) are
    walked whole (main is then a multiple of nprog), and program p < 2 * tail takes column half p % 2 of tile
    main + p // 2 (_half_tile_at). Only when that round holds tiles for at most half the programs (tail = 0
    otherwise, or when there is no partial round): each of its programs then computes half a tile instead of some
    computing a whole one while the others idle. 33 x 86 gate/up tiles on 132 SMs are 21 rounds and 66 tiles
   ."""
    tail = num_tiles % nprog
    tail = tl.where(2 * tail <= nprog, tail, 0)
    return num_tiles - tail, tail


@triton.jit
def _half_tile_at(pid, main, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """_tile_at of program pid's half tile in _split_tail's tail: columns n0 + [0, BLOCK_N // 2)."""
    row0, row_hi, e, n0, _ = _tile_at(main + pid // 2, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                      GROUP_M)
    n0 = n0 + (pid % 2) * (BLOCK_N // 2)
    return row0, row_hi, e, n0, n0 + tl.arange(0, BLOCK_N // 2)


@triton.jit
def _tile_rows(perm_ptr, row0, row_hi, BLOCK_M: tl.constexpr):
    """perm entries of the tile's rows below row_hi -> (original row as int64 clamped to >= 0, valid mask)."""
    offs_r = row0 + tl.arange(0, BLOCK_M)
    p = tl.load(perm_ptr + offs_r, mask=offs_r < row_hi, other=-1)
    valid = p >= 0
    rows = tl.where(valid, p, 0).to(tl.int64)
    return rows, valid


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
def _ordered_offsets(row0, row_hi, offs_n, N, stride_m, BLOCK_M: tl.constexpr):
    """(element offsets, mask) of the tile's rows below row_hi and columns below N in an expert-ordered buffer."""
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    return rows[:, None] * stride_m + offs_n[None, :], (rows < row_hi)[:, None] & (offs_n < N)[None, :]


@triton.jit
def _store_tile(out_ptr, val, perm_ptr, row0, row_hi, offs_n, N, stride_om, SCATTER_OUT: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """The tile's rows below row_hi: scattered to out[perm[r]] (padding rows skipped), or to out[r]."""
    if SCATTER_OUT:
        rows, valid = _tile_rows(perm_ptr, row0, row_hi, BLOCK_M)
        ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))
    else:
        off, ok = _ordered_offsets(row0, row_hi, offs_n, N, stride_om, BLOCK_M)
        tl.store(out_ptr + off, val.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_bias(acc, bias0_ptr, bias1_ptr, e, offs_n, N):
    if e == 0:
        bias = tl.load(bias0_ptr + offs_n, mask=offs_n < N, other=0.0)
    else:
        bias = tl.load(bias1_ptr + offs_n, mask=offs_n < N, other=0.0)
    return acc + bias.to(tl.float32)[None, :]


@triton.jit
def _silu_mul(g, u):
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _save_gate_up(gu_ptr, g, u, perm_ptr, one_rows, row0, row_hi, offs_n, N, stride_gu, BLOCK_M: tl.constexpr):
    """SAVE: the tile's gate and up pre-activations into gate_up [M, 2N] in token order (gate in columns [0, N), up
    in [N, 2N)), the activations the ffn backward reads instead of recomputing them (csrc/ops/ffn_cuda.cpp). Token
    order, whatever the routing and path of the forward: rows through perm, or, for one expert in token order
    (one_rows > 0, no perm: not read), in place. Branch-free (a runtime branch here breaks the flattened tile loop)."""
    offs_r = row0 + tl.arange(0, BLOCK_M)
    in_tile = offs_r < row_hi
    p = tl.load(perm_ptr + offs_r, mask=in_tile & (one_rows == 0), other=-1)
    tok = tl.where(one_rows > 0, offs_r, p)
    ok = (in_tile & (tok >= 0))[:, None] & (offs_n < N)[None, :]
    off = tl.where(tok >= 0, tok, 0).to(tl.int64)[:, None] * stride_gu + offs_n[None, :]
    ty = gu_ptr.dtype.element_ty
    tl.store(gu_ptr + off, g.to(ty), mask=ok)
    tl.store(gu_ptr + N + off, u.to(ty), mask=ok)


# ----------------------------------------------------------------------------------------------
# (a) pointer-load kernels (any sm_80+; A rows gathered through perm)
# ----------------------------------------------------------------------------------------------
@triton.jit
def routed_linear_kernel(a_ptr, w0_ptr, w1_ptr, bias0_ptr, bias1_ptr, out_ptr, perm_ptr, seg_ptr,
                         M_pad, N, K, stride_am, stride_w, stride_om,
                         HAS_BIAS: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr,
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
        if HAS_BIAS:
            acc = _add_bias(acc, bias0_ptr, bias1_ptr, e, offs_n, N)
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
# (b) Hopper TMA kernels: A = expert-ordered padded buffer, A and W through host descriptors.
#     Persistent: grid = min(#SMs, num_tiles); each program walks tiles pid, pid + nprog, ...
#     FLATTEN (a config's "flatten"): the tile loop is flattened into the K loop (tl.range(flatten=True)), so the
#     software pipeline runs across tiles and the next tile's first loads overlap this tile's epilogue.
# ----------------------------------------------------------------------------------------------
@triton.jit
def gather_rows_kernel(src_ptr, dst_ptr, perm_ptr, colsum_ptr, M_pad, C, stride_src, stride_dst,
                       COLSUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       PDL: tl.constexpr = False):
    """dst[r, :] = src[perm[r], :] (zeros where perm[r] < 0), dst [M_pad, C].
    COLSUM: also colsum[b, :] = the fp32 sum of dst's rows [b * BLOCK_R, (b + 1) * BLOCK_R), colsum
    [cdiv(M_pad, BLOCK_R), C]: the first pass of the bias gradients (expert_colsum_kernel adds the blocks up per
    expert). BLOCK_R divides the routing ALIGN, so a block never holds rows of both experts."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = offs_r < M_pad
    p = tl.load(perm_ptr + offs_r, mask=r_ok, other=-1)
    valid = p >= 0
    src_rows = tl.where(valid, p, 0).to(tl.int64)
    c_ok = offs_c[None, :] < C
    v = tl.load(src_ptr + src_rows[:, None] * stride_src + offs_c[None, :], mask=valid[:, None] & c_ok,
                other=0.0)
    tl.store(dst_ptr + offs_r.to(tl.int64)[:, None] * stride_dst + offs_c[None, :], v,
             mask=r_ok[:, None] & c_ok)
    if COLSUM:
        tl.store(colsum_ptr + pid_r.to(tl.int64) * C + offs_c, tl.sum(v.to(tl.float32), axis=0), mask=offs_c < C)


@triton.jit
def route_gather_rows_kernel(mask_ptr, src_ptr, dst_ptr, perm_ptr, seg_ptr, M, M_pad, C, stride_src, stride_dst,
                             MASK_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                             PDL: tl.constexpr = False):
    """The unaligned routing (kernels/routing.py, ALIGN = 1) of mask [M], M <= MASK_BLOCK, and gather_rows_kernel
    through it, in one launch: no routing kernel runs before the gather. Each program counts the whole mask itself
    (expert 1's rows before its block and in total), so it knows where its rows go without another program's
    writes: dst[pos(r), :] = src[r, :] for its rows r in token order, dst [M, C] (an unaligned routing has no
    padding rows). The programs of column block 0 also write perm[pos(r)] = r, program (0, 0) seg and perm's -1 tail:
    the routing that routing_one_block_kernel(ALIGN = 1) writes, for the kernels after this one."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    first = pid_r * BLOCK_R
    offs_r = first + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = offs_r < M
    ok = r_ok[:, None] & (offs_c[None, :] < C)
    v = tl.load(src_ptr + offs_r.to(tl.int64)[:, None] * stride_src + offs_c[None, :], mask=ok)
    offs_m = tl.arange(0, MASK_BLOCK)
    is1_all = tl.load(mask_ptr + offs_m, mask=offs_m < M, other=0) != 0
    t1 = tl.sum(is1_all.to(tl.int32), axis=0)
    base1 = tl.sum((is1_all & (offs_m < first)).to(tl.int32), axis=0)
    # Expert 0's rows before the block: first - base1; expert 1 starts at t0 = M - t1 (no padding).
    pos = expert_positions(tl.load(mask_ptr + offs_r, mask=r_ok, other=0), offs_r, first, r_ok, first - base1, base1,
                           M - t1)
    tl.store(dst_ptr + pos.to(tl.int64)[:, None] * stride_dst + offs_c[None, :], v, mask=ok)
    if pid_c == 0:
        tl.store(perm_ptr + pos, offs_r, mask=r_ok)
        if pid_r == 0:
            pad_and_seg(perm_ptr, seg_ptr, M - t1, t1, M_pad, 1)


@triton.jit
def expert_colsum_kernel(colsum_ptr, seg_ptr, sum0_ptr, sum1_ptr, num_blocks, C,
                         ROWS_PER_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
                         PDL: tl.constexpr = False):
    """sum_e[c] = sum of colsum[b, c] over the blocks b of expert e (block b holds expert-ordered rows from
    b * ROWS_PER_BLOCK; expert 1's start at seg[1]). Grid (cdiv(C, BLOCK_C),); a fixed order of fp32 additions, so
    the result is deterministic. With gather_rows_kernel(COLSUM) over dY: the bias gradients db_e = sum of dY_e."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    start1 = tl.load(seg_ptr + 1)
    acc0 = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for b0 in range(0, num_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        part = tl.load(colsum_ptr + offs_b.to(tl.int64)[:, None] * C + offs_c[None, :],
                       mask=(offs_b < num_blocks)[:, None] & c_ok[None, :], other=0.0)
        is1 = (offs_b * ROWS_PER_BLOCK >= start1)[:, None]
        acc0 += tl.sum(tl.where(is1, 0.0, part), axis=0)
        acc1 += tl.sum(tl.where(is1, part, 0.0), axis=0)
    tl.store(sum0_ptr + offs_c, acc0.to(sum0_ptr.dtype.element_ty), mask=c_ok)
    tl.store(sum1_ptr + offs_c, acc1.to(sum1_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _w_index(e, w_map):
    """The index of expert e along a stacked weight descriptor's expert dimension: bit e of w_map. 2 = [text, vision]
    (DualLinear's parameter order), 1 = [vision, text] (the vision weight lies below the text weight in memory, as in
    a model that registers its vision expert first, like CogVLM), 0 = one weight serves both experts. The descriptor
    then starts at the lower of the two weights, so that no layout needs a copy (csrc/ops/routed_gemm.cpp
    Experts::stacked)."""
    return (w_map >> e) & 1


@triton.jit
def _linear_step(a, w_desc, e, n0, k0, acc, W_TRANSPOSED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step: the A tile (however it was loaded) times W_e's tile; w_desc is a rank-3 descriptor over the stacked
    weights [2, R, C] (exact per-expert bounds)."""
    if W_TRANSPOSED:
        b = w_desc.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    else:
        b = w_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K)
        acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _tma_mainloop(acc, a_desc, w_desc, e, row0, n0, K, W_TRANSPOSED: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    for k0 in range(0, K, BLOCK_K):
        acc = _linear_step(a_desc.load([row0, k0]), w_desc, e, n0, k0, acc, W_TRANSPOSED, INPUT_PRECISION, BLOCK_N,
                           BLOCK_K)
    return acc


@triton.jit
def _tma_linear_tile(a_desc, w_desc, bias0_ptr, bias1_ptr, out_ptr, perm_ptr, row0, row_hi, e, n0, offs_n, N, K,
                     stride_om, w_map, HAS_BIAS: tl.constexpr, SCATTER_OUT: tl.constexpr, W_TRANSPOSED: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """One output tile of routed_linear_tma_kernel: rows [row0, row_hi) of A through a_desc, columns offs_n =
    n0 + [0, BLOCK_N) of expert e's W through w_desc (whose block is BLOCK_N wide; w_map: _w_index), bias, store."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _tma_mainloop(acc, a_desc, w_desc, _w_index(e, w_map), row0, n0, K, W_TRANSPOSED, INPUT_PRECISION, BLOCK_N,
                        BLOCK_K)
    if HAS_BIAS:
        acc = _add_bias(acc, bias0_ptr, bias1_ptr, e, offs_n, N)
    _store_tile(out_ptr, acc, perm_ptr, row0, row_hi, offs_n, N, stride_om, SCATTER_OUT, BLOCK_M)


@triton.jit
def routed_linear_tma_kernel(a_desc, w_desc, wh_desc, bias0_ptr, bias1_ptr, out_ptr, perm_ptr,
                             seg_ptr, one_rows, N, K, stride_om, w_map,
                             HAS_BIAS: tl.constexpr, SCATTER_OUT: tl.constexpr,
                             W_TRANSPOSED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr,
                             FLATTEN: tl.constexpr, SPLIT_TAIL: tl.constexpr = False, PDL: tl.constexpr = False):
    """a_desc: [M_pad, K] block [BM, BK]; w_desc: stacked W [2, N, K] block [1, BN, BK]
    (W_TRANSPOSED: [2, K, N] block [1, BK, BN]); wh_desc: the same tensor with half the columns per block (BN / 2),
    for SPLIT_TAIL (a config's "split"): a last round split in column halves (_split_tail: at 2048 tokens, 17 x 16
    tiles of 128 x 256 are 2 rounds and 8 tiles on 132 SMs). Not compiled in where the table does
    not ask for it: the code after the tile loop cost the flattened large-m kernels 1-3%. Persistent over the
    row tiles of _row_tiles x cdiv(N, BN): with SCATTER_OUT only the tiles that hold rows, else every tile below
    end = seg[2] (an expert-ordered output is written up to end, padding rows included). one_rows > 0 (with
    SCATTER_OUT = False): one expert, rows in token order, no perm / seg (_walk_tiles). w_map: the experts' order
    along w_desc's first dimension (_w_index)."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start1, t0, num_pid_m, hi0, hi1 = _walk_tiles(seg_ptr, one_rows, BLOCK_M, SCATTER_OUT == False)  # noqa: E712
    num_pid_n = tl.cdiv(N, BLOCK_N)
    main = num_pid_m * num_pid_n
    if SPLIT_TAIL:
        main, tail = _split_tail(main, nprog)
    for tile in tl.range(pid, main, nprog, flatten=FLATTEN):
        row0, row_hi, e, n0, offs_n = _tile_at(tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                               GROUP_M)
        _tma_linear_tile(a_desc, w_desc, bias0_ptr, bias1_ptr, out_ptr, perm_ptr, row0, row_hi, e, n0, offs_n, N, K,
                         stride_om, w_map, HAS_BIAS, SCATTER_OUT, W_TRANSPOSED, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT_TAIL and pid < 2 * tail:
        row0, row_hi, e, n0, offs_n = _half_tile_at(pid, main, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M,
                                                    BLOCK_N, GROUP_M)
        _tma_linear_tile(a_desc, wh_desc, bias0_ptr, bias1_ptr, out_ptr, perm_ptr, row0, row_hi, e, n0, offs_n, N, K,
                         stride_om, w_map, HAS_BIAS, SCATTER_OUT, W_TRANSPOSED, INPUT_PRECISION, BLOCK_M, BLOCK_N // 2,
                         BLOCK_K)


@triton.jit
def _gathered_a(a_ptrs, valid, offs_k, K, k0):
    """The [BM, BK] A tile at k0 whose rows were gathered through perm (a_ptrs at k = 0; invalid rows and k >= K
    read as zeros)."""
    return tl.load(a_ptrs + k0, mask=valid[:, None] & (offs_k[None, :] < K - k0), other=0.0)


@triton.jit
def _gather_linear_tile(a_ptr, w_desc, bias0_ptr, bias1_ptr, out_ptr, perm_ptr, row0, row_hi, e, n0, offs_n, N, K,
                        stride_am, stride_om, w_map, HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile of routed_linear_gather_tma_kernel: A's rows gathered through perm[row0, row_hi), columns
    offs_n = n0 + [0, BLOCK_N) of expert e's W through w_desc (whose block is BLOCK_N wide), bias, rows scattered."""
    offs_k = tl.arange(0, BLOCK_K)
    rows, valid = _tile_rows(perm_ptr, row0, row_hi, BLOCK_M)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _linear_step(_gathered_a(a_ptrs, valid, offs_k, K, k0), w_desc, _w_index(e, w_map), n0, k0, acc, False,
                           INPUT_PRECISION, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc = _add_bias(acc, bias0_ptr, bias1_ptr, e, offs_n, N)
    _store_tile(out_ptr, acc, perm_ptr, row0, row_hi, offs_n, N, stride_om, True, BLOCK_M)


@triton.jit
def routed_linear_gather_tma_kernel(a_ptr, w_desc, wh_desc, bias0_ptr, bias1_ptr, out_ptr, perm_ptr, seg_ptr,
                                    mask_ptr, M, M_pad, N, K, stride_am, stride_om, w_map,
                                    HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                    GROUP_M: tl.constexpr, ROUTE_BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                                    FLATTEN: tl.constexpr, SPLIT_TAIL: tl.constexpr = False,
                                    PDL: tl.constexpr = False):
    """The forward of routed_linear_tma_kernel (W through TMA, output rows scattered) with A in token order, its rows
    gathered through perm by pointer loads inside the main loop: no [M_pad, K] gather copy. The alternative design
    (the gather inside the GEMM), measured against gather + routed_linear_tma_kernel by aot/tune.py.
    Persistent over the tiles that hold rows; SPLIT_TAIL: a last round split in column halves through wh_desc, as in
    routed_linear_tma_kernel. ROUTE_BLOCK > 0: routes mask [M] itself (_routed_row_tiles). w_map: _w_index."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start1, t0, num_pid_m, hi0, hi1 = _routed_row_tiles(mask_ptr, perm_ptr, seg_ptr, M, M_pad, BLOCK_M, ROUTE_BLOCK,
                                                        ALIGN)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    main = num_pid_m * num_pid_n
    if SPLIT_TAIL:
        main, tail = _split_tail(main, nprog)
    for tile in tl.range(pid, main, nprog, flatten=FLATTEN):
        row0, row_hi, e, n0, offs_n = _tile_at(tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                               GROUP_M)
        _gather_linear_tile(a_ptr, w_desc, bias0_ptr, bias1_ptr, out_ptr, perm_ptr, row0, row_hi, e, n0, offs_n, N,
                            K, stride_am, stride_om, w_map, HAS_BIAS, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT_TAIL and pid < 2 * tail:
        row0, row_hi, e, n0, offs_n = _half_tile_at(pid, main, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M,
                                                    BLOCK_N, GROUP_M)
        _gather_linear_tile(a_ptr, wh_desc, bias0_ptr, bias1_ptr, out_ptr, perm_ptr, row0, row_hi, e, n0, offs_n, N,
                            K, stride_am, stride_om, w_map, HAS_BIAS, INPUT_PRECISION, BLOCK_M, BLOCK_N // 2, BLOCK_K)


@triton.jit
def _swiglu_step(a, w1_desc, w3_desc, e, w_map, n0, k0, acc_g, acc_u, INPUT_PRECISION: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of the two-MMA gate/up GEMM: the A tile (however it was loaded) times W1_e's and W3_e's tiles.
    w_map: W1's _w_index map in bits 0-1, W3's in bits 2-3 (each projection's experts may lie in either order)."""
    g = w1_desc.load([_w_index(e, w_map), n0, k0]).reshape(BLOCK_N, BLOCK_K)
    u = w3_desc.load([_w_index(e, w_map >> 2), n0, k0]).reshape(BLOCK_N, BLOCK_K)
    acc_g = tl.dot(a, g.T, acc_g, input_precision=INPUT_PRECISION)
    acc_u = tl.dot(a, u.T, acc_u, input_precision=INPUT_PRECISION)
    return acc_g, acc_u


@triton.jit
def routed_swiglu_tma_kernel(a_desc, w1_desc, w3_desc, h_ptr, gu_ptr, perm_ptr, seg_ptr, one_rows, N, K, stride_hm,
                             stride_gu, w_map, SCATTER_OUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr,
                             FLATTEN: tl.constexpr, SAVE: tl.constexpr = False, PDL: tl.constexpr = False):
    """a_desc: [M_pad, K] block [BM, BK]; w1_desc / w3_desc: stacked [2, N, K] block [1, BN, BK]. Persistent over
    the tiles that hold rows: rows of h past each expert's last row tile are not written (only the down projection
    reads h, and its padding rows' outputs are not stored). one_rows > 0: one expert, no perm / seg (_walk_tiles).
    w_map: both projections' expert orders (_swiglu_step). SAVE: gate and up also into gate_up (_save_gate_up);
    without it gu_ptr and stride_gu are not read."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start1, t0, num_pid_m, hi0, hi1 = _walk_tiles(seg_ptr, one_rows, BLOCK_M, False)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(pid, num_pid_m * num_pid_n, nprog, flatten=FLATTEN):
        row0, row_hi, e, n0, offs_n = _tile_at(tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                               GROUP_M)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_g, acc_u = _swiglu_step(a_desc.load([row0, k0]), w1_desc, w3_desc, e, w_map, n0, k0, acc_g, acc_u,
                                        INPUT_PRECISION, BLOCK_N, BLOCK_K)
        _store_tile(h_ptr, _silu_mul(acc_g, acc_u), perm_ptr, row0, row_hi, offs_n, N, stride_hm, SCATTER_OUT,
                    BLOCK_M)
        if SAVE:
            _save_gate_up(gu_ptr, acc_g, acc_u, perm_ptr, one_rows, row0, row_hi, offs_n, N, stride_gu, BLOCK_M)


@triton.jit
def routed_swiglu_pair_tma_kernel(a_desc, w13_desc, w13h_desc, h_ptr, gu_ptr, perm_ptr, seg_ptr, one_rows, N, K,
                                  stride_hm, stride_gu, up_first, w_map, INPUT_PRECISION: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, SAVE: tl.constexpr = False,
                                  PDL: tl.constexpr = False):
    """routed_swiglu_tma_kernel with the gate and up tiles fetched by one TMA load and multiplied by one MMA of
    2 x BLOCK_N columns: w13_desc is a rank-4 descriptor [2, E, N, K] over both projections (dimension 0: the two
    weight tensors, at whatever distance they lie in memory; block [2, 1, BN, BK]). up_first = 1 when dimension 0
    holds up before gate (w3 lies below w1 in memory); w_map: the experts' order along dimension 1 (_w_index; one for
    both projections, which share the descriptor's strides). The accumulator [BM, 2 BN] splits into gate and up in the
    epilogue. one_rows as in routed_swiglu_tma_kernel. A last round that fills at most half the programs is split
    in column halves (_split_tail), loaded through w13h_desc: the same tensor, block [2, 1, BN / 2, BK]. SAVE: gate
    and up also into gate_up (_save_gate_up); without it gu_ptr and stride_gu are not read."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start1, t0, num_pid_m, hi0, hi1 = _walk_tiles(seg_ptr, one_rows, BLOCK_M, False)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    main, tail = _split_tail(num_pid_m * num_pid_n, nprog)
    for tile in tl.range(pid, main, nprog, flatten=FLATTEN):
        row0, row_hi, e, n0, offs_n = _tile_at(tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                               GROUP_M)
        g, u = _pair_gate_up(a_desc, w13_desc, _w_index(e, w_map), row0, n0, K, up_first, INPUT_PRECISION, BLOCK_M,
                             BLOCK_N, BLOCK_K)
        _store_tile(h_ptr, _silu_mul(g, u), perm_ptr, row0, row_hi, offs_n, N, stride_hm, False, BLOCK_M)
        if SAVE:
            _save_gate_up(gu_ptr, g, u, perm_ptr, one_rows, row0, row_hi, offs_n, N, stride_gu, BLOCK_M)
    if pid < 2 * tail:
        row0, row_hi, e, n0, offs_n = _half_tile_at(pid, main, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M,
                                                    BLOCK_N, GROUP_M)
        g, u = _pair_gate_up(a_desc, w13h_desc, _w_index(e, w_map), row0, n0, K, up_first, INPUT_PRECISION, BLOCK_M,
                             BLOCK_N // 2, BLOCK_K)
        _store_tile(h_ptr, _silu_mul(g, u), perm_ptr, row0, row_hi, offs_n, N, stride_hm, False, BLOCK_M)
        if SAVE:
            _save_gate_up(gu_ptr, g, u, perm_ptr, one_rows, row0, row_hi, offs_n, N, stride_gu, BLOCK_M)


@triton.jit
def _pair_gate_up(a_desc, w13_desc, e, row0, n0, K, up_first, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile's gate and up pre-activations (fp32 [BM, BN] each) from one MMA of 2 x BLOCK_N columns over K."""
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k0])
        b = w13_desc.load([0, e, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K)
        acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
    first, second = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1))
    g = tl.where(up_first != 0, second, first)
    u = tl.where(up_first != 0, first, second)
    return g, u


@triton.jit
def routed_swiglu_pair_bwd_tma_kernel(a_desc, w13_desc, h_ptr, dup_ptr, dgate_ptr, seg_ptr, N, K, stride_hm,
                                      up_first, w_map, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                                      FLATTEN: tl.constexpr, PDL: tl.constexpr = False):
    """The ffn backward's gate/up recompute fused with the SwiGLU backward (kernels/swiglu_backward.py): each tile's
    gate and up as in routed_swiglu_pair_tma_kernel (never stored), then, with dh read from dgate_ptr (the dh GEMM's
    output), h -> h_ptr, d_up -> dup_ptr and d_gate -> dgate_ptr (over dh: each element is read and written by the
    same thread). Expert-ordered [M_pad, N] buffers of one row stride on an aligned routing; every tile of both padded
    segments below end (_row_tiles WHOLE_SEGMENTS), so padding rows get zeros (zero x and dh rows), which the TMA
    grad-weight reads."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start1, t0, num_pid_m, hi0, hi1 = _row_tiles(seg_ptr, BLOCK_M, True)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(pid, num_pid_m * num_pid_n, nprog, flatten=FLATTEN):
        row0, row_hi, e, n0, offs_n = _tile_at(tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                               GROUP_M)
        g, u = _pair_gate_up(a_desc, w13_desc, _w_index(e, w_map), row0, n0, K, up_first, INPUT_PRECISION, BLOCK_M,
                             BLOCK_N, BLOCK_K)
        off, ok = _ordered_offsets(row0, row_hi, offs_n, N, stride_hm, BLOCK_M)
        d = tl.load(dgate_ptr + off, mask=ok, other=0.0).to(tl.float32)
        h, d_up, d_gate = swiglu_grads(g, u, d)
        ty = h_ptr.dtype.element_ty
        tl.store(h_ptr + off, h.to(ty), mask=ok)
        tl.store(dup_ptr + off, d_up.to(ty), mask=ok)
        tl.store(dgate_ptr + off, d_gate.to(ty), mask=ok)


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
# grad-weight: dW_e[n, k] = sum_{r in segment e} dY[row(r), n] * X[row(r), k]   (+ db_e[n])
# ----------------------------------------------------------------------------------------------
@triton.jit
def _grad_weight_expert(seg_ptr, pid, per_e, first_expert):
    """The expert of routed_grad_weight_kernel's program pid. One expert's launch (per_e programs): first_expert.
    Both experts' (2 per_e): the one with more rows takes the first per_e programs. Its tiles are the long ones (each
    reduces over its rows), so the other expert's short tiles fill the last wave instead of delaying the long ones
    (longest first; with one expert's tokens only, the other's tiles just write zeros). H100, JIT, expert-ordered
    inputs, / cuBLAS's dense GEMM: 4096^3 all vision 1.563 -> 1.524, 90% vision 1.606 -> 1.574."""
    e = first_expert + pid // per_e
    if tl.num_programs(0) > per_e:
        e = e ^ (tl.load(seg_ptr + 4) > tl.load(seg_ptr + 3)).to(tl.int32)
    return e


@triton.jit
def routed_grad_weight_kernel(dy_ptr, x_ptr, perm_ptr, seg_ptr, dw0_ptr, dw1_ptr, db0_ptr, db1_ptr,
                              N, K, stride_dym, stride_xm, stride_dwn, first_expert,
                              GATHER: tl.constexpr, HAS_DBIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
                              INPUT_PRECISION: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                              GROUP_N: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (E * cdiv(N, BLOCK_N) * cdiv(K, BLOCK_K),): E = 2 computes both experts, the one with more rows in programs
    [0, T) (_grad_weight_expert). One expert's gradients alone: E = 1 and first_expert = 0 or 1 (a frozen expert's
    weights cost nothing).

    GATHER=True : dY [M, N] and X [M, K] in original row order, rows read through perm.
    GATHER=False: dY [M_pad, N], X [M_pad, K] expert-ordered padded buffers (padding rows skipped).
    """
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    per_e = num_pid_n * num_pid_k
    e = _grad_weight_expert(seg_ptr, pid, per_e, first_expert)
    pid_n, pid_k = _tile_mn(pid % per_e, num_pid_n, num_pid_k, GROUP_N)
    seg_start = tl.load(seg_ptr + e)
    seg_cnt = tl.load(seg_ptr + 3 + e)
    seg_stop = seg_start + seg_cnt
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    dbias = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(seg_start, seg_stop, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_in = offs_r < seg_stop
        if GATHER:
            p = tl.load(perm_ptr + offs_r, mask=r_in, other=-1)
            r_ok = p >= 0
            rows = tl.where(r_ok, p, 0).to(tl.int64)
        else:
            r_ok = r_in
            rows = offs_r.to(tl.int64)
        dyt = tl.load(dy_ptr + rows[None, :] * stride_dym + offs_n[:, None], mask=n_ok[:, None] & r_ok[None, :],
                      other=0.0)  # [BN, BR]
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                     other=0.0)  # [BR, BK]
        acc = tl.dot(dyt, xt, acc, input_precision=INPUT_PRECISION)
        if HAS_DBIAS:
            dbias += tl.sum(dyt.to(tl.float32), axis=1)
    if e == 0:
        dw_ptr = dw0_ptr
        db_ptr = db0_ptr
    else:
        dw_ptr = dw1_ptr
        db_ptr = db1_ptr
    w_ptrs = dw_ptr + offs_n.to(tl.int64)[:, None] * stride_dwn + offs_k[None, :]
    w_mask = n_ok[:, None] & k_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
    tl.store(w_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=w_mask)
    if HAS_DBIAS:
        if pid_k == 0:
            if ACCUMULATE:
                dbias += tl.load(db_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(db_ptr + offs_n, dbias.to(db_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def routed_grad_weight_tma_kernel(dy_desc, x_desc, seg_ptr, dw0_desc, dw1_desc, N, K, experts,
                                  INPUT_PRECISION: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                                  GROUP_N: tl.constexpr, PDL: tl.constexpr = False):
    """dW_e = dY_e^T X_e over expert-ordered buffers (sm_90): dy_desc [M_pad, N] block [BR, BN], x_desc [M_pad, K]
    block [BR, BK], dw0_desc / dw1_desc [N, K] block [BN, BK] (TMA stores). experts: bit 0 computes expert 0, bit 1
    expert 1 (a frozen expert's dW is not touched). Grid (cdiv(N, BN) * cdiv(K, BK),): each program computes its
    [BN, BK] tile of both experts in one pipelined loop over expert 0's rows, then expert 1's. Expert 0's epilogue
    runs inside the loop, while the loads of expert 1's first steps are in flight, and a program reduces over all M
    rows, as in a dense GEMM: the grid and its last wave are the dense GEMM's. (One program per expert and tile pays
    for the split: twice the tiles, each with its own prologue and epilogue.) The stores go through
    TMA: with pointer stores, the epilogue inside the loop spills (255 registers).
    Expert e's rows start at seg[e] (a multiple of the routing ALIGN, which BLOCK_R divides) and number
    count_e = seg[3 + e]; its steps stop at the first multiple of BLOCK_R past them, not at the segment's padded end.
    The padding rows read must be zero (gather_rows output, or expert-ordered GEMM outputs without bias), so every
    step is a whole, unmasked TMA tile. An expert without rows gets zeros. No atomics, deterministic. Bias gradients
    are not summed here: a row sum in the loop costs every program a pass of the dY tile through registers (they
    come from dY's gather: gather_rows_kernel(COLSUM), then expert_colsum_kernel)."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    pid_n, pid_k = _tile_mn(pid, tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K), GROUP_N)
    want0 = (experts & 1) != 0
    want1 = (experts & 2) != 0
    steps0 = tl.where(want0, tl.cdiv(tl.load(seg_ptr + 3), BLOCK_R), 0)
    steps1 = tl.where(want1, tl.cdiv(tl.load(seg_ptr + 4), BLOCK_R), 0)
    lo1 = tl.load(seg_ptr + 1)  # expert 0's rows start at 0
    n0 = pid_n * BLOCK_N
    k0 = pid_k * BLOCK_K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # An expert without rows gets its zeros first, under the loop's first loads: stored after the loop they would add
    # a second epilogue at its end.
    if want0 and steps0 == 0:
        dw0_desc.store([n0, k0], acc.to(dw0_desc.dtype))
    if want1 and steps1 == 0:
        dw1_desc.store([n0, k0], acc.to(dw1_desc.dtype))
    for s in range(0, steps0 + steps1):
        r = tl.where(s < steps0, s * BLOCK_R, lo1 + (s - steps0) * BLOCK_R)
        dyt = dy_desc.load([r, n0])  # [BR, BN]
        xt = x_desc.load([r, k0])  # [BR, BK]
        acc = tl.dot(dyt.T, xt, acc, input_precision=INPUT_PRECISION)
        if s == steps0 - 1:  # expert 0's last step: its tile is done, expert 1 starts from zero
            dw0_desc.store([n0, k0], acc.to(dw0_desc.dtype))
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if steps1 > 0:
        dw1_desc.store([n0, k0], acc.to(dw1_desc.dtype))


# ----------------------------------------------------------------------------------------------
# Python launchers (JIT / TRITON_INTERPRET use; they also document the grids for the C++ side)
# ----------------------------------------------------------------------------------------------
def _mask_arg(mask, perm, route_block):
    """(mask pointer argument, M) of a kernel that routes for itself (route_block > 0), else placeholders."""
    if not route_block:
        return perm, 0
    import torch
    M = mask.shape[0]
    assert M <= route_block and mask.dtype in (torch.int8, torch.uint8, torch.bool)
    return (mask.view(torch.int8) if M > 0 else perm), M


def _tile_rows_arg(perm, seg, one_rows, out):
    """(row-tile upper bound as rows, perm, seg) of a persistent TMA launch: one_rows > 0 needs no perm / seg (the
    kernel reads neither; an empty int32 tensor stands in for both, so the JIT types the pointers as the AOT
    signature does)."""
    if one_rows:
        import torch
        none = torch.empty(0, dtype=torch.int32, device=out.device)
        return one_rows, none, none
    return perm.shape[0], perm, seg


def _grid_mn(M_pad, N, BM, BN):
    return ((M_pad // BM) * triton.cdiv(N, BN), )


def launch_routed_linear(a, w0, w1, bias0, bias1, out, perm, seg, N, K, *, gather_a=True, scatter_out=True,
                         w_transposed=False, input_precision="tf32", BM=128, BN=128, BK=64, GROUP_M=8,
                         num_warps=8, num_stages=3):
    M_pad = perm.shape[0]
    has_bias = bias0 is not None
    if not has_bias:
        bias0 = bias1 = w0
    grid = _grid_mn(M_pad, N, BM, BN)
    routed_linear_kernel[grid](a, w0, w1, bias0, bias1, out, perm, seg, M_pad, N, K, a.stride(0), w0.stride(0),
                               out.stride(0), HAS_BIAS=has_bias, GATHER_A=gather_a, SCATTER_OUT=scatter_out,
                               W_TRANSPOSED=w_transposed, INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN,
                               BLOCK_K=BK, GROUP_M=GROUP_M, num_warps=num_warps, num_stages=num_stages)
    return out


def _gate_up_arg(gate_up, h):
    """(gu_ptr, stride_gu, SAVE) of a forward gate/up kernel: gate_up [M, 2N] in token order, or None (not saved)."""
    if gate_up is None:
        return h, 0, False
    return gate_up, gate_up.stride(0), True


def launch_routed_swiglu(a, w1_0, w1_1, w3_0, w3_1, h, perm, seg, N, K, *, gather_a=True, scatter_out=False,
                         input_precision="tf32", BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3,
                         gate_up=None):
    """gate_up: [M, 2N] that gets gate and up in token order (SAVE; with gather_a), or None."""
    M_pad = perm.shape[0]
    grid = _grid_mn(M_pad, N, BM, BN)
    gu, stride_gu, save = _gate_up_arg(gate_up, h)
    routed_swiglu_kernel[grid](a, w1_0, w1_1, w3_0, w3_1, h, gu, perm, seg, M_pad, N, K, a.stride(0), w1_0.stride(0),
                               h.stride(0), stride_gu, GATHER_A=gather_a, SCATTER_OUT=scatter_out, SAVE=save,
                               INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                               GROUP_M=GROUP_M, num_warps=num_warps, num_stages=num_stages)
    return h


def launch_gather_rows(src, dst, perm, *, BLOCK_R=GATHER_ROWS, BLOCK_C=None, colsum=None):
    """colsum: None, or fp32 [cdiv(M_pad, BLOCK_R), C] that gets the per-block column sums (COLSUM). BLOCK_C: the
    shipped GATHER_COLS unless given."""
    M_pad, C = dst.shape
    cols, warps = GATHER_COLS[colsum is not None]
    BLOCK_C = BLOCK_C or cols
    grid = (triton.cdiv(M_pad, BLOCK_R), triton.cdiv(C, BLOCK_C))
    gather_rows_kernel[grid](src, dst, perm, perm if colsum is None else colsum, M_pad, C, src.stride(0),
                             dst.stride(0), COLSUM=colsum is not None, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
                             num_warps=warps)
    return dst


def launch_route_gather_rows(mask, src, dst, perm, seg, *, BLOCK_R=GATHER_ROWS, BLOCK_C=None, num_warps=None):
    """route_gather_rows_kernel: routes mask [M] (bool, M <= ONE_BLOCK; kernels/routing.py ALIGN = 1) into perm
    [M + ROW_TAIL] / seg [5] and gathers src [M, C]'s rows into dst [M, C] through it, in one launch."""
    from kernels.routing import one_block_size, padded_rows
    M, C = src.shape
    block = one_block_size(M)
    assert block > 0 and perm.shape[0] == padded_rows(M, 1) and dst.shape[0] >= M
    cols, warps = GATHER_COLS[False]
    BLOCK_C = BLOCK_C or cols
    mask_arg, _ = _mask_arg(mask, perm, block)
    grid = (max(1, triton.cdiv(M, BLOCK_R)), max(1, triton.cdiv(C, BLOCK_C)))  # M = 0: program (0, 0) writes seg
    route_gather_rows_kernel[grid](mask_arg, src, dst, perm, seg, M, perm.shape[0], C, src.stride(0), dst.stride(0),
                                   MASK_BLOCK=block, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=num_warps or warps)
    return dst


def launch_expert_colsum(colsum, seg, sum0, sum1, *, ROWS_PER_BLOCK=GATHER_ROWS, BLOCK_B=64, BLOCK_C=64):
    num_blocks, C = colsum.shape
    expert_colsum_kernel[(triton.cdiv(C, BLOCK_C),)](colsum, seg, sum0, sum1, num_blocks, C,
                                                     ROWS_PER_BLOCK=ROWS_PER_BLOCK, BLOCK_B=BLOCK_B,
                                                     BLOCK_C=BLOCK_C, num_warps=4)
    return sum0, sum1


def launch_routed_linear_tma(a_pad, w_stacked, bias0, bias1, out, perm, seg, *, scatter_out=True,
                             w_transposed=False, input_precision="tf32", BM=128, BN=256, BK=64, GROUP_M=8,
                             num_programs=None, num_warps=8, num_stages=3, FLATTEN=False, one_rows=0,
                             SPLIT_TAIL=False, w_map=2):
    """a_pad [M_pad, K] expert-ordered; w_stacked [2, N, K] (or [2, K, N] when w_transposed), experts in the order
    w_map says (_w_index: 2 text first, 1 vision first, 0 one weight for both). one_rows > 0: one expert of one_rows
    rows in token order, perm / seg unused (may be None), scatter_out must be False."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    assert not (one_rows and scatter_out)
    M_pad, perm, seg = _tile_rows_arg(perm, seg, one_rows, out)
    K = a_pad.shape[1]  # a_pad may be x itself for one expert (rows past M read as zeros)
    N = w_stacked.shape[2] if w_transposed else w_stacked.shape[1]
    a_desc = TensorDescriptor.from_tensor(a_pad, [BM, BK])
    w_desc = TensorDescriptor.from_tensor(w_stacked, [1, BK, BN] if w_transposed else [1, BN, BK])
    wh_desc = TensorDescriptor.from_tensor(w_stacked, [1, BK, BN // 2] if w_transposed else [1, BN // 2, BK])
    has_bias = bias0 is not None
    if not has_bias:
        bias0 = bias1 = out
    tiles = triton.cdiv(M_pad, BM) * triton.cdiv(N, BN)
    grid = (min(num_programs or tiles, tiles), )
    routed_linear_tma_kernel[grid](a_desc, w_desc, wh_desc, bias0, bias1, out, perm, seg, one_rows, N, K,
                                   out.stride(0), w_map, HAS_BIAS=has_bias, SCATTER_OUT=scatter_out, W_TRANSPOSED=w_transposed,
                                   INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                                   GROUP_M=GROUP_M, FLATTEN=FLATTEN, SPLIT_TAIL=SPLIT_TAIL, num_warps=num_warps,
                                   num_stages=num_stages)
    return out


def launch_routed_linear_gather_tma(a, w_stacked, bias0, bias1, out, perm, seg, *, mask=None, route_block=0,
                                    align=128, input_precision="tf32", BM=128, BN=256, BK=64, GROUP_M=8,
                                    num_programs=None, num_warps=8, num_stages=3, FLATTEN=False, SPLIT_TAIL=False,
                                    w_map=2):
    """a [M, K] in token order (rows gathered in the kernel); w_stacked [2, N, K] (w_map: as in
    launch_routed_linear_tma); out [M, N]. route_block > 0: perm
    and seg are written by the kernel from mask (int8 [M], M <= route_block) with routing ALIGN = align."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M_pad = perm.shape[0]
    mask_arg, M = _mask_arg(mask, perm, route_block)
    K = a.shape[1]
    N = w_stacked.shape[1]
    w_desc = TensorDescriptor.from_tensor(w_stacked, [1, BN, BK])
    wh_desc = TensorDescriptor.from_tensor(w_stacked, [1, BN // 2, BK])
    has_bias = bias0 is not None
    if not has_bias:
        bias0 = bias1 = out
    tiles = (M_pad // BM) * triton.cdiv(N, BN)
    grid = (min(num_programs or tiles, tiles), )
    routed_linear_gather_tma_kernel[grid](a, w_desc, wh_desc, bias0, bias1, out, perm, seg, mask_arg, M, M_pad, N, K,
                                          a.stride(0), out.stride(0), w_map, HAS_BIAS=has_bias,
                                          INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                                          GROUP_M=GROUP_M, ROUTE_BLOCK=route_block, ALIGN=align, FLATTEN=FLATTEN,
                                          SPLIT_TAIL=SPLIT_TAIL, num_warps=num_warps, num_stages=num_stages)
    return out


def launch_routed_swiglu_tma(a_pad, w1_stacked, w3_stacked, h, perm, seg, *, scatter_out=False,
                             input_precision="tf32", BM=128, BN=128, BK=64, GROUP_M=8, num_programs=None,
                             num_warps=8, num_stages=3, FLATTEN=False, one_rows=0, w_map=2 | 2 << 2, gate_up=None):
    """one_rows: as in launch_routed_linear_tma. w_map: w1's expert order (launch_routed_linear_tma) in bits 0-1, w3's
    in bits 2-3. gate_up: as in launch_routed_swiglu."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    assert not (one_rows and scatter_out)
    M_pad, perm, seg = _tile_rows_arg(perm, seg, one_rows, h)
    K = a_pad.shape[1]  # a_pad may be x itself for one expert (rows past M read as zeros)
    N = w1_stacked.shape[1]
    a_desc = TensorDescriptor.from_tensor(a_pad, [BM, BK])
    w1_desc = TensorDescriptor.from_tensor(w1_stacked, [1, BN, BK])
    w3_desc = TensorDescriptor.from_tensor(w3_stacked, [1, BN, BK])
    tiles = triton.cdiv(M_pad, BM) * triton.cdiv(N, BN)
    grid = (min(num_programs or tiles, tiles), )
    gu, stride_gu, save = _gate_up_arg(gate_up, h)
    routed_swiglu_tma_kernel[grid](a_desc, w1_desc, w3_desc, h, gu, perm, seg, one_rows, N, K, h.stride(0), stride_gu,
                                   w_map, SCATTER_OUT=scatter_out, SAVE=save, INPUT_PRECISION=input_precision,
                                   BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M, FLATTEN=FLATTEN,
                                   num_warps=num_warps, num_stages=num_stages)
    return h


def launch_routed_swiglu_pair_tma(a_pad, w13, h, perm, seg, *, up_first=False, input_precision="tf32", BM=128,
                                  BN=128, BK=64, GROUP_M=8, num_programs=None, num_warps=8, num_stages=3,
                                  FLATTEN=False, one_rows=0, w_map=2, gate_up=None):
    """w13 [2, E, N, K]: index 0 of dimension 0 is the gate (w1) unless up_first; the experts along dimension 1 in
    the order w_map says. one_rows, w_map: as in launch_routed_linear_tma; gate_up: as in launch_routed_swiglu."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M_pad, perm, seg = _tile_rows_arg(perm, seg, one_rows, h)
    K, N = a_pad.shape[1], w13.shape[2]
    a_desc = TensorDescriptor.from_tensor(a_pad, [BM, BK])
    w_desc = TensorDescriptor.from_tensor(w13, [2, 1, BN, BK])
    wh_desc = TensorDescriptor.from_tensor(w13, [2, 1, BN // 2, BK])
    tiles = triton.cdiv(M_pad, BM) * triton.cdiv(N, BN)
    grid = (min(num_programs or tiles, tiles), )
    gu, stride_gu, save = _gate_up_arg(gate_up, h)
    routed_swiglu_pair_tma_kernel[grid](a_desc, w_desc, wh_desc, h, gu, perm, seg, one_rows, N, K, h.stride(0),
                                        stride_gu, int(up_first), w_map, SAVE=save, INPUT_PRECISION=input_precision,
                                        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP_M, FLATTEN=FLATTEN,
                                        num_warps=num_warps, num_stages=num_stages)
    return h


def launch_routed_swiglu_pair_bwd_tma(a_pad, w13, h, dup, dgate, seg, *, up_first=False, input_precision="tf32",
                                      BM=128, BN=128, BK=64, GROUP_M=8, num_programs=None, num_warps=8, num_stages=3,
                                      FLATTEN=False, w_map=2):
    """a_pad [M_pad, K] expert-ordered (aligned routing, zero padding rows); w13, w_map as in
    launch_routed_swiglu_pair_tma;
    dgate holds dh on entry, d_gate on return; h, dup written. All three [M_pad, N], one row stride."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M_pad, K, N = a_pad.shape[0], a_pad.shape[1], w13.shape[2]
    assert h.stride() == dup.stride() == dgate.stride()
    a_desc = TensorDescriptor.from_tensor(a_pad, [BM, BK])
    w_desc = TensorDescriptor.from_tensor(w13, [2, 1, BN, BK])
    tiles = triton.cdiv(M_pad, BM) * triton.cdiv(N, BN)
    grid = (min(num_programs or tiles, tiles), )
    routed_swiglu_pair_bwd_tma_kernel[grid](a_desc, w_desc, h, dup, dgate, seg, N, K, h.stride(0), int(up_first),
                                            w_map, INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                                            GROUP_M=GROUP_M, FLATTEN=FLATTEN, num_warps=num_warps,
                                            num_stages=num_stages)
    return h, dup, dgate


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
    routed_swiglu_gather_tma_kernel[grid](a, w1_desc, w3_desc, h, gu, perm, seg, mask_arg, M, M_pad, N, K,
                                          a.stride(0), h.stride(0), stride_gu, w_map, SAVE=save,
                                          INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                                          GROUP_M=GROUP_M, ROUTE_BLOCK=route_block, ALIGN=align, FLATTEN=FLATTEN,
                                          num_warps=num_warps, num_stages=num_stages)
    return h


def _grad_weight_experts(experts):
    """(first_expert, number of experts) of a grad-weight launch over `experts`: (0, 1), (1,) or (0,)."""
    assert tuple(experts) in ((0, 1), (0, ), (1, )), experts
    return experts[0], len(experts)


def launch_routed_grad_weight(dy, x, perm, seg, dw0, dw1, db0=None, db1=None, *, gather=True, accumulate=False,
                              input_precision="tf32", BN=128, BK=128, BR=64, GROUP_N=8, num_warps=8,
                              num_stages=3, experts=(0, 1)):
    """experts: the experts whose gradients are computed (the others' outputs are not written)."""
    N, K = dw0.shape
    has_db = db0 is not None
    if not has_db:
        db0, db1 = dw0, dw1
    first, n_e = _grad_weight_experts(experts)
    grid = (n_e * triton.cdiv(N, BN) * triton.cdiv(K, BK), )
    routed_grad_weight_kernel[grid](dy, x, perm, seg, dw0, dw1, db0, db1, N, K, dy.stride(0), x.stride(0),
                                    dw0.stride(0), first, GATHER=gather, HAS_DBIAS=has_db, ACCUMULATE=accumulate,
                                    INPUT_PRECISION=input_precision, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR,
                                    GROUP_N=GROUP_N, num_warps=num_warps, num_stages=num_stages)
    return dw0, dw1, (db0 if has_db else None), (db1 if has_db else None)


def launch_routed_grad_weight_tma(dy_pad, x_pad, seg, dw0, dw1, *, input_precision="tf32", BN=128, BK=256, BR=32,
                                  GROUP_N=8, num_warps=8, num_stages=5, experts=(0, 1)):
    """dy_pad [M_pad, N], x_pad [M_pad, K] expert-ordered (zero padding rows, e.g. from launch_gather_rows); dw0, dw1
    contiguous [N, K]. experts: as in launch_routed_grad_weight."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    N, K = dw0.shape
    dy_desc = TensorDescriptor.from_tensor(dy_pad, [BR, BN])
    x_desc = TensorDescriptor.from_tensor(x_pad, [BR, BK])
    dw0_desc = TensorDescriptor.from_tensor(dw0, [BN, BK])
    dw1_desc = TensorDescriptor.from_tensor(dw1, [BN, BK])
    _grad_weight_experts(experts)
    grid = (triton.cdiv(N, BN) * triton.cdiv(K, BK), )
    routed_grad_weight_tma_kernel[grid](dy_desc, x_desc, seg, dw0_desc, dw1_desc, N, K, sum(1 << e for e in experts),
                                        INPUT_PRECISION=input_precision, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR,
                                        GROUP_N=GROUP_N, num_warps=num_warps, num_stages=num_stages)
    return dw0, dw1
