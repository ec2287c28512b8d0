"""Shared pieces of the routed GEMM kernels: tile scheduling, epilogues, and the conventions every family follows.

The families, one file each (what each kernel computes, its layouts and grid: kernels/GEMM.md; argument lists: each
kernel's signature, which the AOT manifest reads):
  * kernels/gemm_pointer.py: pointer loads (any sm_80+), the linear and the SwiGLU gate/up GEMM;
  * kernels/gather_rows.py: the row gather into expert order (with the bias gradients' column sums);
  * kernels/gemm_tma.py: Hopper TMA descriptors, persistent: linear, gate/up (two MMAs or one), the fused
    gate/up recompute of the ffn backward;
  * kernels/gemm_gather_tma.py: TMA weights with A's rows gathered inside the main loop;
  * kernels/gemm_decode.py: a few tokens' linear forward, the reduction split over the grid (no routing);
  * kernels/grad_weight.py: the weight (and bias) gradients.
Routing: kernels/routing.py.

Conventions
  * Two experts: e = 0 (mask false, "text"), e = 1 (mask true, "vision").
  * perm int32 [M_pad], seg int32 [5] = [0, start_1, end, count_0, count_1] from routing. With ALIGN = 128 a
    tile of BLOCK_M rows never mixes experts; on an unaligned routing (ALIGN = 1) the persistent TMA kernels
    store only rows below row_hi (_tile_at). Tiles with row0 >= end are empty and skipped.
  * "Generic" GEMM: out[M, N] = A[M, K] @ B^T, B[n, k] = W_e[n, k]  (W_TRANSPOSED = False, forward,
    W_e in nn.Linear layout [N, K]) or B[n, k] = W_e[k, n] (W_TRANSPOSED = True, grad-input:
    dX = dY @ W_e with W_e [K_red = N_lin, N_out = K_lin]).
  * A rows: read through perm (GATHER_A, kernels/gemm_pointer.py; the gather-inside TMA kernels) or from an
    expert-ordered padded buffer [M_pad, K] (row r).
  * SCATTER_OUT: out row of padded position r is out[perm[r]] (padding rows skipped) - otherwise
                out is an expert-ordered padded buffer [M_pad, N] (every row of a non-empty tile is
                written; padding rows get the value computed from zero A rows). _store_tile.
  * fp32 accumulation always; INPUT_PRECISION ("ieee" | "tf32" | "tf32x3") matters for fp32 inputs.
  * All innermost dimensions must be contiguous (stride 1).
"""
import triton
import triton.language as tl

from kernels.routing import route_one_block


# ----------------------------------------------------------------------------------------------
# tile scheduling
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


SK_MAX_PARTS = tl.constexpr(4)  # stream-K: pieces per tile, at most about (_sk_share)
SK_CHUNKS = tl.constexpr(4)  # stream-K: an owned tile's pieces are summed in this many column chunks (_sk_sum)


@triton.jit
def _sk_share(pid, nprog, num_tiles, K, BLOCK_K: tl.constexpr, MAX_PARTS: tl.constexpr):
    """Stream-K (a config's "stream_k") of a persistent walk: the whole rounds of tiles, [0, dp), are walked as
    without it (tile pid, pid + nprog, ...), and the K steps of the tiles of the last partial round, [dp, num_tiles),
    are cut into equal contiguous shares, one per program, so that every SM ends at about the same time (a routed GEMM
    of 2048 tokens has 2 rounds and a few tiles of 128 x 256 on 132 SMs: without it the last round idles most SMs).
    Only that round: shares over every tile would have the programs work on tiles far apart at any moment, and the
    weights' tiles, read once from HBM for the row tiles walked together, would be read again by each program (2.4x
    slower at 1024 x 14336 x 4096, H100). Returns (dp, kit, per, lo, hi): K steps per tile, the share's length and
    program pid's share [lo, hi) in steps counted from tile dp. A share is at least kit / MAX_PARTS steps long, so
    that no tile is cut into more than about MAX_PARTS pieces (each piece but one is a [BM, BN] fp32 partial sum
    written and read again): with few tiles left, programs past the last share idle."""
    dp = (num_tiles // nprog) * nprog
    kit = tl.cdiv(K, BLOCK_K)
    total = (num_tiles - dp) * kit
    per = tl.maximum(tl.cdiv(total, nprog), tl.cdiv(kit, MAX_PARTS))
    lo = tl.minimum(pid * per, total)
    hi = tl.minimum(lo + per, total)
    return dp, kit, per, lo, hi


@triton.jit
def _sk_piece(it, lo, kit):
    """The piece of a stream-K share [lo, hi) that ends at step `it`: (tile, k_lo, k_hi), the K steps [k_lo, k_hi) of
    tile `tile`. A share is walked from its end, so each program first computes the piece of its last tile (the
    tile's first K steps, never the last: a partial sum, _sk_publish) and last the piece of its first tile, whose last K
    steps it holds: it owns that tile (_sk_wait, _sk_sum) and by then the programs before it have published."""
    tile = (it - 1) // kit
    first = tile * kit
    return tile, tl.maximum(first, lo) - first, it - first


@triton.jit
def _sk_offsets(slot, c0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """Element offsets of columns [c0, c0 + WIDTH) of workspace slot `slot`, a [BLOCK_M, BLOCK_N] fp32 tile. The
    workspace holds 2 nprog slots: slot q < nprog, program q's published partial sum; slot nprog + q, program q's
    own piece of the tile it owns (_sk_sum)."""
    return (slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + c0
            + tl.arange(0, WIDTH)[None, :])


@triton.jit
def _sk_publish(acc, ws_ptr, flag_ptr, pid, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A piece that does not end its tile: its partial sum into slot pid, then flag[pid] = 1 (release, after a CTA
    barrier: every thread's stores are visible before the flag). A program publishes at most once per launch."""
    tl.store(ws_ptr + _sk_offsets(pid, 0, BLOCK_M, BLOCK_N, BLOCK_N), acc)
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr + pid, 1, sem="release", scope="gpu")


@triton.jit
def _sk_wait(acc, ws_ptr, flag_ptr, pid, nprog, tile, kit, per, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The owner of a tile cut into pieces (it holds the tile's last K steps): stores its own piece into slot
    nprog + pid, then waits for the programs before it that hold the tile's earlier steps, q = pid - 1 down to
    q_first, each flag waited for and reset to 0 in one compare-and-swap (the flags are zero again after every launch).
    Returns q_first; _sk_sum then adds the pieces column chunk by column chunk, so that no second [BM, BN] fp32 tile
    is ever held in registers beside the accumulator (which spilled the 128 x 256 tiles). The wait needs those programs
    resident or done: the grid is one program per SM, and a program publishes before it ever waits (_sk_piece)."""
    tl.store(ws_ptr + _sk_offsets(nprog + pid, 0, BLOCK_M, BLOCK_N, BLOCK_N), acc)
    q_first = (tile * kit) // per
    q = pid - 1
    while q >= q_first:
        while tl.atomic_cas(flag_ptr + q, 1, 0, sem="acquire", scope="gpu") != 1:
            pass
        q -= 1
    tl.debug_barrier()  # the own piece's stores, by every thread, before any thread reads them back
    return q_first


@triton.jit
def _sk_sum(ws_ptr, pid, nprog, q_first, c0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """Columns [c0, c0 + WIDTH) of an owned tile (after _sk_wait): the owner's piece plus the partial sums of the
    programs before it, nearest first. A fixed order: the same bits from run to run (no atomic adds)."""
    s = tl.load(ws_ptr + _sk_offsets(nprog + pid, c0, BLOCK_M, BLOCK_N, WIDTH))
    q = pid - 1
    while q >= q_first:
        s += tl.load(ws_ptr + _sk_offsets(q, c0, BLOCK_M, BLOCK_N, WIDTH), cache_modifier=".cg")
        q -= 1
    return s


@triton.jit
def _tile_rows(perm_ptr, row0, row_hi, BLOCK_M: tl.constexpr):
    """perm entries of the tile's rows below row_hi -> (original row as int64 clamped to >= 0, valid mask)."""
    offs_r = row0 + tl.arange(0, BLOCK_M)
    p = tl.load(perm_ptr + offs_r, mask=offs_r < row_hi, other=-1)
    valid = p >= 0
    rows = tl.where(valid, p, 0).to(tl.int64)
    return rows, valid


# ----------------------------------------------------------------------------------------------
# epilogues
# ----------------------------------------------------------------------------------------------
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
# Python launcher helpers shared by the families' launchers
# ----------------------------------------------------------------------------------------------
def _mask_arg(mask, perm, route_block):
    """(mask pointer argument, M) of a kernel that routes for itself (route_block > 0), else placeholders."""
    if not route_block:
        return perm, 0
    import torch
    M = mask.shape[0]
    assert M <= route_block and mask.dtype in (torch.int8, torch.uint8, torch.bool)
    return (mask.view(torch.int8) if M > 0 else perm), M


def _stream_k_args(stream_k, num_programs, tiles, BM, BN, device):
    """(grid, ws, flags) of a persistent linear TMA launch over at most `tiles` tiles: min(num_programs or tiles, tiles)
    programs and unread stand-ins; with stream_k, num_programs (the SMs), each taking a share (_sk_share), the fp32
    workspace [2 nprog, BM, BN] (_sk_offsets) and the zeroed int32 flags [nprog]."""
    import torch
    n, grid = (num_programs, num_programs) if stream_k else (1, min(num_programs or tiles, tiles))
    ws = torch.empty((2 * n, BM, BN) if stream_k else (1, ), dtype=torch.float32, device=device)
    return (grid, ), ws, torch.zeros(n, dtype=torch.int32, device=device)


def _gate_up_arg(gate_up, h):
    """(gu_ptr, stride_gu, SAVE) of a forward gate/up kernel: gate_up [M, 2N] in token order, or None (not saved)."""
    if gate_up is None:
        return h, 0, False
    return gate_up, gate_up.stride(0), True


@triton.jit
def _add_residual(acc, res_ptr, perm_ptr, row0, row_hi, offs_n, N, stride_m, SCATTER_OUT: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """acc + residual at the rows _store_tile writes (res_ptr: a tensor of out's layout and row stride), in fp32: the
    residual add of a transformer block in the GEMM's epilogue, one rounding instead of two and no extra pass."""
    if SCATTER_OUT:
        rows, valid = _tile_rows(perm_ptr, row0, row_hi, BLOCK_M)
        ptrs = res_ptr + rows[:, None] * stride_m + offs_n[None, :]
        r = tl.load(ptrs, mask=valid[:, None] & (offs_n[None, :] < N), other=0.0)
    else:
        off, ok = _ordered_offsets(row0, row_hi, offs_n, N, stride_m, BLOCK_M)
        r = tl.load(res_ptr + off, mask=ok, other=0.0)
    return acc + r.to(tl.float32)
