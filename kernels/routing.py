"""Device-side modality routing for the dual-expert GEMMs (see kernels/GEMM.md).

From a per-row mask (nonzero -> expert 1 "vision", zero -> expert 0 "text") build, without any
host synchronisation:

  perm  int32 [M_pad]   expert-ordered, padded row list.  Expert 0's rows occupy
                        [0, seg[1]), expert 1's rows [seg[1], seg[2]); each segment is padded
                        with -1 up to a multiple of ALIGN, and everything in [seg[2], M_pad) is -1.
                        Within an expert the original row order is kept (prefix sums, no atomics),
                        so the result is deterministic.
  seg   int32 [5]       [start_0 = 0, start_1, end (padded), count_0, count_1]

M_pad = (cdiv(M, ALIGN) + 1) * ALIGN depends only on M (fixed grid sizes, CUDA-graph capturable):
ceil(c0/A) + ceil(c1/A) <= ceil(M/A) + 1 tiles are always enough.

ALIGN = 1 ("unaligned"): no padding, expert 1 starts at start_1 = count_0 and end = M, so an expert-ordered
buffer has exactly M rows; perm has M + ROW_TAIL entries. A row tile may then hold rows of both experts: only the
persistent TMA kernels that write the rows of their own expert (row_hi of _tile_at) take such a routing (the ffn
forward's x and h; csrc/ops/ffn_cuda.cpp).

Kernels:
  routing_one_block_kernel  grid (1,)  M <= ONE_BLOCK                  -> perm, seg (one launch)
  routing_shared_kernel     grid (1,)  M <= ONE_BLOCK                  -> both routings in one buffer (`route` op)
  routing_count_kernel      grid (NB,) NB = max(1, cdiv(M, CHUNK))     -> block_counts int32 [NB, 2]
  routing_scatter_kernel    grid (NB,) after the count kernel          -> perm, seg
  routing_single_kernel     grid (cdiv(M_pad, BLOCK),) one expert      -> perm = arange, seg
"""
import triton
import triton.language as tl

from kernels.pdl import grid_dependency_sync

NUM_EXPERTS = 2
ONE_BLOCK = 4096  # routing_one_block_kernel's BLOCK: masks of up to this many rows are routed in one launch
# Its smaller BLOCKs, the smallest that holds the mask is taken: a 4096-lane scan for one token is waste (measured on
# the H100, alone: 1.3 us at BLOCK = 64 vs 1.6 for 4096 for one token, 1.5 vs 2.1 at BLOCK = 1024 for 1000 tokens).
ONE_BLOCK_SMALL = 64  # decode steps
ONE_BLOCK_MID = 1024
ONE_BLOCKS = (ONE_BLOCK_SMALL, ONE_BLOCK_MID, ONE_BLOCK)  # ascending: one_block_size takes the first that holds M
SINGLE_BLOCK = 1024  # routing_single_kernel's BLOCK
CHUNK = 1024  # the two-kernel routing's (routing_count_kernel, routing_scatter_kernel) mask rows per program
# -1 entries past the last row of an unaligned routing (ALIGN = 1): a row tile that starts at an expert's last row
# reads BLOCK_M entries of perm, and every BLOCK_M divides the aligned routing's ALIGN (128; aot/config_table.py).
ROW_TAIL = tl.constexpr(128)
# A routing buffer's slots ahead of perm: seg's 5 and 3 unused (csrc/ops/routed_gemm.h kSegSlots).
SEG_SLOTS = tl.constexpr(8)


def padded_rows(M: int, align: int) -> int:
    """Length of perm (host helper, depends on shapes only). align > 1: (cdiv(M, align) + 1) * align, also the rows
    of the expert-ordered buffers (both experts' padding fits). align = 1 (unaligned segments, no padding rows; the
    buffers have M rows): M + ROW_TAIL."""
    return M + ROW_TAIL.value if align == 1 else (triton.cdiv(M, align) + 1) * align


def single_padded_rows(M: int, align: int) -> int:
    """Length of a one-expert perm: max(roundup(M, align), align); align = 1: M + ROW_TAIL."""
    return M + ROW_TAIL.value if align == 1 else max(triton.cdiv(M, align) * align, align)


def one_block_size(M: int) -> int:
    """The BLOCK of the one-block routing of a mask of M rows (the smallest of ONE_BLOCK_SMALL / _MID / ONE_BLOCK that
    holds it), or 0 when M > ONE_BLOCK (the two-kernel pass). The C++ launcher chooses the same way (routed_gemm.cpp);
    a gather GEMM that routes for itself is compiled with this as its ROUTE_BLOCK (aot/manifest.py)."""
    for block in ONE_BLOCKS:
        if M <= block:
            return block
    return 0


def one_block_sizes(lo: int, hi) -> list:
    """one_block_size(m) for every m in (lo, hi] (hi None: unbounded), each once. The size changes only at m = b + 1
    for the blocks b, so m = lo + 1 and those points in the range give every value."""
    points = [lo + 1] + [b + 1 for b in ONE_BLOCKS if lo + 1 < b + 1 and (hi is None or b + 1 <= hi)]
    return list(dict.fromkeys(one_block_size(m) for m in points))


def num_route_blocks(M: int, chunk: int) -> int:
    return max(1, triton.cdiv(M, chunk))


@triton.jit
def routing_count_kernel(mask_ptr, block_counts_ptr, M, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Pass 1 of a routing of more than ONE_BLOCK rows: block_counts int32 [cdiv(M, CHUNK), 2] = (expert-0, expert-1)
    rows of each CHUNK of the mask (bytes, nonzero = expert 1). Grid: cdiv(M, CHUNK)."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    valid = offs < M
    m = tl.load(mask_ptr + offs, mask=valid, other=0)
    is1 = (m != 0) & valid
    c1 = tl.sum(is1.to(tl.int32), axis=0)
    c0 = tl.sum(valid.to(tl.int32), axis=0) - c1
    tl.store(block_counts_ptr + pid * 2, c0)
    tl.store(block_counts_ptr + pid * 2 + 1, c1)


@triton.jit
def expert_positions(m, offs, first, valid, base0, base1, start1):
    """Expert-ordered positions (stable) of the rows `offs` = first + [0, n) of one block, m their mask values:
    expert 0's rows go to base0 + their rank among this block's expert-0 rows, expert 1's to start1 + base1 + rank.
    One prefix sum: a row's expert-0 rank is its position in the block minus the expert-1 rows before it."""
    is1 = (m != 0) & valid
    c1 = tl.cumsum(is1.to(tl.int32), axis=0)  # inclusive: expert-1 rows in [first, offs]
    pos1 = start1 + base1 + c1 - 1
    pos0 = base0 + (offs - first) - c1  # for an expert-0 row, c1 counts only rows before it
    return tl.where(is1, pos1, pos0)


@triton.jit
def _scatter_rows(m, perm_ptr, offs, first, valid, base0, base1, start1):
    """perm[expert_positions(..)] = offs for the rows of one block."""
    tl.store(perm_ptr + expert_positions(m, offs, first, valid, base0, base1, start1), offs, mask=valid)


@triton.jit
def pad_and_seg(perm_ptr, seg_ptr, t0, t1, M_pad, ALIGN: tl.constexpr):
    """With the expert totals t0, t1: the -1 padding entries of perm and seg (one program does this)."""
    start1 = ((t0 + ALIGN - 1) // ALIGN) * ALIGN
    end = start1 + ((t1 + ALIGN - 1) // ALIGN) * ALIGN
    # Padding of segment 0: [t0, start1) (< ALIGN entries; none when ALIGN = 1).
    if ALIGN > 1:
        p = t0 + tl.arange(0, ALIGN)
        tl.store(perm_ptr + p, tl.full([ALIGN], -1, tl.int32), mask=p < start1)
    # Padding of segment 1 and the tail: [start1 + t1, M_pad) (< 2 * ALIGN entries, or the ROW_TAIL of ALIGN = 1).
    for s in range(start1 + t1, M_pad, ROW_TAIL):
        p2 = s + tl.arange(0, ROW_TAIL)
        tl.store(perm_ptr + p2, tl.full([ROW_TAIL], -1, tl.int32), mask=p2 < M_pad)
    tl.store(seg_ptr + 0, t0 * 0)
    tl.store(seg_ptr + 1, start1)
    tl.store(seg_ptr + 2, end)
    tl.store(seg_ptr + 3, t0)
    tl.store(seg_ptr + 4, t1)


@triton.jit
def routing_scatter_kernel(mask_ptr, block_counts_ptr, perm_ptr, seg_ptr, M, M_pad, num_blocks,
                           CHUNK: tl.constexpr, ALIGN: tl.constexpr, PDL: tl.constexpr = False):
    """Pass 2: perm [M_pad] and seg [5] from routing_count_kernel's block_counts (the same CHUNK; num_blocks of
    them): each program places its CHUNK's rows after the earlier blocks' rows of their expert; program 0 also writes
    seg and the padding entries (-1). Grid: num_blocks."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    # Exclusive prefix of the per-block counts (rows of each expert in earlier blocks) + totals.
    base0 = tl.zeros([CHUNK], dtype=tl.int32)
    base1 = tl.zeros([CHUNK], dtype=tl.int32)
    tot0 = tl.zeros([CHUNK], dtype=tl.int32)
    tot1 = tl.zeros([CHUNK], dtype=tl.int32)
    for b0 in range(0, num_blocks, CHUNK):
        boffs = b0 + tl.arange(0, CHUNK)
        bval = boffs < num_blocks
        c0 = tl.load(block_counts_ptr + boffs * 2, mask=bval, other=0)
        c1 = tl.load(block_counts_ptr + boffs * 2 + 1, mask=bval, other=0)
        before = boffs < pid
        base0 += tl.where(before, c0, 0)
        base1 += tl.where(before, c1, 0)
        tot0 += c0
        tot1 += c1
    t0 = tl.sum(tot0, axis=0)
    t1 = tl.sum(tot1, axis=0)
    start1 = ((t0 + ALIGN - 1) // ALIGN) * ALIGN
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    valid = offs < M
    m = tl.load(mask_ptr + offs, mask=valid, other=0)
    _scatter_rows(m, perm_ptr, offs, pid * CHUNK, valid, tl.sum(base0, axis=0), tl.sum(base1, axis=0), start1)
    if pid == 0:
        pad_and_seg(perm_ptr, seg_ptr, t0, t1, M_pad, ALIGN)


@triton.jit
def _route_loaded(m, offs, valid, t0, t1, perm_ptr, seg_ptr, M_pad, ALIGN: tl.constexpr):
    """perm and seg of one routing from the whole mask, loaded (m over offs = [0, BLOCK), valid = offs < M), and its
    expert totals t0, t1."""
    _scatter_rows(m, perm_ptr, offs, 0, valid, t0 * 0, t1 * 0, ((t0 + ALIGN - 1) // ALIGN) * ALIGN)
    pad_and_seg(perm_ptr, seg_ptr, t0, t1, M_pad, ALIGN)


@triton.jit
def _load_whole_mask(mask_ptr, M, BLOCK: tl.constexpr):
    """(m, offs, valid, t0, t1): a mask of M <= BLOCK rows in one program, and its rows per expert."""
    offs = tl.arange(0, BLOCK)
    valid = offs < M
    m = tl.load(mask_ptr + offs, mask=valid, other=0)
    t1 = tl.sum(((m != 0) & valid).to(tl.int32), axis=0)
    return m, offs, valid, M - t1, t1


@triton.jit
def route_one_block(mask_ptr, perm_ptr, seg_ptr, M, M_pad, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """Both routing steps in one program for M <= BLOCK: routing_one_block_kernel's body, also run at the start of
    the GEMMs that route for themselves (kernels/gemm_gather_tma.py, ROUTE_BLOCK)."""
    m, offs, valid, t0, t1 = _load_whole_mask(mask_ptr, M, BLOCK)
    _route_loaded(m, offs, valid, t0, t1, perm_ptr, seg_ptr, M_pad, ALIGN)


@triton.jit
def routing_one_block_kernel(mask_ptr, perm_ptr, seg_ptr, M, M_pad, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                             PDL: tl.constexpr = False):
    """Both routing steps in one program for M <= BLOCK: one launch instead of two (decode and prefill up to BLOCK
    tokens; the launches are a visible part of a decode step)."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    route_one_block(mask_ptr, perm_ptr, seg_ptr, M, M_pad, BLOCK, ALIGN)


@triton.jit
def _fill_minus_one(ptr, lo, hi):
    """ptr[lo:hi] = -1 (any length; ROW_TAIL entries per store)."""
    for s in range(lo, hi, ROW_TAIL):
        p = s + tl.arange(0, ROW_TAIL)
        tl.store(ptr + p, tl.full([ROW_TAIL], -1, tl.int32), mask=p < hi)


@triton.jit
def routing_shared_kernel(mask_ptr, buf_ptr, M, M_pad, section, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                          PDL: tl.constexpr = False):
    """The `route` op's shared routing of M <= BLOCK rows in one launch (csrc/ops/routed_gemm.h,
    shared_routing_size): the routing aligned to ALIGN (perm of M_pad entries) at buf[0], the unaligned one
    (perm of M + ROW_TAIL entries) at buf[section], each as SEG_SLOTS slots (seg and 3 unused) and perm, and -1 in
    every entry neither writes (seg's unused slots, the gap between the sections), so that the buffer is a function
    of the mask alone. One program; it replaces a memset and two routing launches on every decode step."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    m, offs, valid, t0, t1 = _load_whole_mask(mask_ptr, M, BLOCK)
    _route_loaded(m, offs, valid, t0, t1, buf_ptr + SEG_SLOTS, buf_ptr, M_pad, ALIGN)
    _route_loaded(m, offs, valid, t0, t1, buf_ptr + section + SEG_SLOTS, buf_ptr + section, M + ROW_TAIL, 1)
    # Disjoint from every entry written above (no ordering between the program's threads is needed).
    unused = 5 + tl.arange(0, 4)  # seg's unused slots [5, SEG_SLOTS) of each section
    tl.store(buf_ptr + unused, tl.full([4], -1, tl.int32), mask=unused < SEG_SLOTS)
    tl.store(buf_ptr + section + unused, tl.full([4], -1, tl.int32), mask=unused < SEG_SLOTS)
    _fill_minus_one(buf_ptr, M_pad + SEG_SLOTS, section)


@triton.jit
def routing_single_kernel(perm_ptr, seg_ptr, M, M_pad, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                          PDL: tl.constexpr = False):
    """One expert (every row is expert 0): perm = [0, 1, .., M-1, -1, ..] over M_pad entries and
    seg = [0, end, end, M, 0] with end = roundup(M, ALIGN). Grid (cdiv(M_pad, BLOCK),)."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(perm_ptr + offs, tl.where(offs < M, offs, -1), mask=offs < M_pad)
    if pid == 0:
        end = ((M + ALIGN - 1) // ALIGN) * ALIGN
        tl.store(seg_ptr + 0, M * 0)
        tl.store(seg_ptr + 1, end)
        tl.store(seg_ptr + 2, end)
        tl.store(seg_ptr + 3, M)
        tl.store(seg_ptr + 4, M * 0)


def route(mask, align: int = 128, chunk: int = CHUNK, one_block: int = ONE_BLOCK, perm=None, seg=None):
    """Python launcher (JIT / interpreter use).  mask: bool/int8/uint8 [M] on the target device.

    M <= one_block: routing_one_block_kernel (BLOCK = one_block, a power of 2); else the two-kernel pass with
    `chunk`. Returns (perm int32 [M_pad], seg int32 [5]).  No host synchronisation.
    """
    import torch
    M = mask.shape[0]
    if mask.dtype == torch.bool:
        mask = mask.view(torch.int8)
    M_pad = padded_rows(M, align)
    dev = mask.device
    if perm is None:
        perm = torch.empty(M_pad, dtype=torch.int32, device=dev)
    if seg is None:
        seg = torch.empty(5, dtype=torch.int32, device=dev)
    if M == 0:  # keep a valid pointer for the (fully masked) mask loads
        mask = torch.zeros(1, dtype=torch.int8, device=dev)
    if one_block and M <= one_block:  # one_block = 0: always the two-kernel pass
        routing_one_block_kernel[(1, )](mask_ptr=mask, perm_ptr=perm, seg_ptr=seg, M=M, M_pad=M_pad, BLOCK=one_block,
                                        ALIGN=align, num_warps=8)
        return perm, seg
    nb = num_route_blocks(M, chunk)
    counts = torch.empty(nb * 2, dtype=torch.int32, device=dev)
    routing_count_kernel[(nb, )](mask_ptr=mask, block_counts_ptr=counts, M=M, CHUNK=chunk)
    routing_scatter_kernel[(nb, )](mask_ptr=mask, block_counts_ptr=counts, perm_ptr=perm, seg_ptr=seg, M=M, M_pad=M_pad,
                                   num_blocks=nb, CHUNK=chunk, ALIGN=align)
    return perm, seg


def shared_layout(M: int, align: int = 128):
    """(M_pad, section, size) of the shared routing buffer of M rows, as csrc/ops/routed_gemm.h defines it: the
    aligned routing's perm rows, where the unaligned routing starts (a multiple of 4), the buffer's length."""
    section = -(-(M + SEG_SLOTS.value + 2 * align) // 4) * 4
    return padded_rows(M, align), section, section + SEG_SLOTS.value + padded_rows(M, 1)


def route_shared(mask, align: int = 128, block: int = ONE_BLOCK, buf=None):
    """Python launcher of routing_shared_kernel (M <= block): the `route` op's buffer, int32 [size] (into `buf`
    when given)."""
    import torch
    M = mask.shape[0]
    assert M <= block
    if mask.dtype == torch.bool:
        mask = mask.view(torch.int8)
    M_pad, section, size = shared_layout(M, align)
    if buf is None:
        buf = torch.empty(size, dtype=torch.int32, device=mask.device)
    assert buf.shape == (size, ) and buf.dtype == torch.int32
    routing_shared_kernel[(1, )](mask_ptr=mask if M else buf, buf_ptr=buf, M=M, M_pad=M_pad, section=section,
                                 BLOCK=block, ALIGN=align, num_warps=8)
    return buf


def route_single(M: int, device, align: int = 128, block: int = SINGLE_BLOCK):
    """One expert: (perm, seg) with perm = arange(M) then -1 up to M_pad = single_padded_rows(M, align) (the C++
    route_single's sizes). No host synchronisation."""
    import torch
    M_pad = single_padded_rows(M, align)
    perm = torch.empty(M_pad, dtype=torch.int32, device=device)
    seg = torch.empty(5, dtype=torch.int32, device=device)
    routing_single_kernel[(triton.cdiv(M_pad, block), )](perm_ptr=perm, seg_ptr=seg, M=M, M_pad=M_pad, BLOCK=block,
                                                         ALIGN=align)
    return perm, seg
