"""Row gathers around the TMA GEMMs (kernels/GEMM.md kernels 5, 5a and 5b): gather_rows_kernel copies token-order rows
into an expert-ordered buffer through perm (the TMA kernels' A, the TMA grad-weight's dY and X), optionally with the
per-block column sums of what it copies; route_gather_rows_kernel routes a small mask and gathers through it in one
launch; expert_colsum_kernel adds the column sums up per expert (linear_dual's bias gradients).

Conventions (experts, perm / seg): kernels/gemm_tiles.py. Routing: kernels/routing.py.
"""
import triton
import triton.language as tl

from kernels.gemm_tiles import _mask_arg
from kernels.pdl import grid_dependency_sync
from kernels.routing import expert_positions, pad_and_seg

# Rows per program of gather_rows_kernel (the AOT manifest compiles this value and puts it in the keys as "rows";
# csrc/ops/routed_gemm.cpp's kGatherRows must match). It divides the routing ALIGN, so a block of the gather's column
# sums never mixes experts.
GATHER_ROWS = 32

# Columns per program and warps of gather_rows_kernel: (BLOCK_C, num_warps) without and with COLSUM (in the keys as
# "cols"). The column sums reduce each block's rows across warps; H100, 4096 x 4096 bf16, a 50% random mask,
# interleaved CUDA graphs: with COLSUM 36.2 µs at 128 columns / 4 warps, 29.7 at 1024 / 8 (a plain copy: 24.6);
# without it 128 / 4 is already the fastest measured (25.8 µs).
GATHER_COLS = {False: (128, 4), True: (1024, 8)}


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


# ----------------------------------------------------------------------------------------------
# Python launchers (JIT / TRITON_INTERPRET use; they also document the grids for the C++ side)
# ----------------------------------------------------------------------------------------------
def launch_gather_rows(src, dst, perm, *, BLOCK_R=GATHER_ROWS, BLOCK_C=None, colsum=None):
    """colsum: None, or fp32 [cdiv(M_pad, BLOCK_R), C] that gets the per-block column sums (COLSUM). BLOCK_C: the
    shipped GATHER_COLS unless given."""
    M_pad, C = dst.shape
    cols, warps = GATHER_COLS[colsum is not None]
    BLOCK_C = BLOCK_C or cols
    grid = (triton.cdiv(M_pad, BLOCK_R), triton.cdiv(C, BLOCK_C))
    gather_rows_kernel[grid](src_ptr=src, dst_ptr=dst, perm_ptr=perm, colsum_ptr=perm if colsum is None else colsum,
                             M_pad=M_pad, C=C, stride_src=src.stride(0), stride_dst=dst.stride(0),
                             COLSUM=colsum is not None, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=warps)
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
    route_gather_rows_kernel[grid](mask_ptr=mask_arg, src_ptr=src, dst_ptr=dst, perm_ptr=perm, seg_ptr=seg, M=M,
                                   M_pad=perm.shape[0], C=C, stride_src=src.stride(0), stride_dst=dst.stride(0),
                                   MASK_BLOCK=block, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=num_warps or warps)
    return dst


def launch_expert_colsum(colsum, seg, sum0, sum1, *, ROWS_PER_BLOCK=GATHER_ROWS, BLOCK_B=64, BLOCK_C=64):
    num_blocks, C = colsum.shape
    expert_colsum_kernel[(triton.cdiv(C, BLOCK_C),)](colsum_ptr=colsum, seg_ptr=seg, sum0_ptr=sum0, sum1_ptr=sum1,
                                                     num_blocks=num_blocks, C=C, ROWS_PER_BLOCK=ROWS_PER_BLOCK,
                                                     BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C, num_warps=4)
    return sum0, sum1
