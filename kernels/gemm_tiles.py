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
def _split_tail(num_tiles, nprog, PARTS: tl.constexpr):
    """(main, tail) of a persistent walk whose last partial round is split in PARTS column slices: tiles [0, main) are
    walked whole (main is then a multiple of nprog), and program p < PARTS * tail takes column slice p % PARTS of tile
    main + p // PARTS (_tail_part_at). Only when that round's slices fit the programs (tail = 0 otherwise, or when
    there is no partial round): each of its programs then computes a slice of a tile instead of some computing a
    whole one while the others idle. 33 x 86 gate/up tiles on 132 SMs are 21 rounds and 66 tiles; 9 x 16 tiles of a
    routed GEMM of 1024 tokens are a round and 12 tiles, which 8 slices of 32 columns spread over 96 programs."""
    tail = num_tiles % nprog
    tail = tl.where(PARTS * tail <= nprog, tail, 0)
    return num_tiles - tail, tail


@triton.jit
def _tail_part_at(pid, main, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, PARTS: tl.constexpr):
    """_tile_at of program pid's slice in _split_tail's tail: columns n0 + [0, BLOCK_N // PARTS)."""
    row0, row_hi, e, n0, _ = _tile_at(main + pid // PARTS, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M,
                                      BLOCK_N, GROUP_M)
    n0 = n0 + (pid % PARTS) * (BLOCK_N // PARTS)
    return row0, row_hi, e, n0, n0 + tl.arange(0, BLOCK_N // PARTS)


SK_MAX_PARTS = tl.constexpr(8)  # stream-K: pieces per tile, at most about (_sk_share)
SK_CHUNKS = tl.constexpr(8)  # stream-K: a cut tile is summed in this many column chunks, shared by its pieces' programs


@triton.jit
def _sk_share(pid, nprog, num_tiles, K, BLOCK_K: tl.constexpr, MAX_PARTS: tl.constexpr, ROUNDS: tl.constexpr):
    """Stream-K (a config's "stream_k") of a persistent walk: the whole rounds of tiles, [0, dp), are walked as
    without it (tile pid, pid + nprog, ...), and the K steps of the tiles of the last ROUNDS rounds, [dp, num_tiles)
    (the last, partial one and ROUNDS - 1 whole ones before it, where there are), are cut into equal contiguous
    shares, one per program, so that every SM ends at about the same time (a routed GEMM of 2048 tokens has 2 rounds
    and a few tiles of 128 x 256 on 132 SMs: without it the last round idles most SMs). ROUNDS = 1 shares the few
    tiles of the last round out in short shares; ROUNDS = 2 gives every program one to two tiles' steps, so a tile is
    cut in at most two pieces (the Stream-K paper's "data-parallel + one stream-K round" hybrid). Not more rounds:
    shares over every tile would have the programs work on tiles far apart at any moment, and the weights' tiles,
    read once from HBM for the row tiles walked together, would be read again by each program (2.4x slower at 1024 x
    14336 x 4096, H100). Returns (dp, kit, per, lo, hi): K steps per tile, the share's length and program pid's share
    [lo, hi) in steps counted from tile dp. A share is at least kit / MAX_PARTS steps long, so that no tile is cut
    into more than about MAX_PARTS pieces (each piece costs its program a pipeline start and a [BM, BN] fp32 partial
    sum written and read again): with few tiles left, programs past the last share idle. Where the shared tiles are at
    most half the programs, each is cut into parts = min(nprog // tiles, MAX_PARTS, kit) equal pieces instead (kit
    rounded up to a multiple of parts: the last piece's extra steps read zero-filled boxes), so a tile has exactly
    `parts` pieces on consecutive programs: shares of the exact average length cut most tiles in three, at unequal
    points (H100, two A/B runs, time / the contiguous shares: 0.89-0.95 at 1024-4096 tokens of Qwen2.5-7B's and
    CogVLM2's QKV forward, Llama-3-70B-TP8's grad-input and Llama-3-8B's QKV on one expert; 0.993 over 40 stream-K
    cells). Nothing is shared (dp = num_tiles) where the last round is more than half full or empty: cutting its tiles
    would cost more than the idle programs it spares (126 tiles of Qwen2.5-7B's down projection at 1024 tokens on 132
    SMs: 1.14x slower shared)."""
    r = num_tiles % nprog
    dp = tl.where((r > 0) & (2 * r <= nprog), tl.maximum(num_tiles // nprog - (ROUNDS - 1), 0) * nprog, num_tiles)
    kit = tl.cdiv(K, BLOCK_K)
    shared = num_tiles - dp
    per = tl.maximum(tl.cdiv(shared * kit, nprog), tl.cdiv(kit, MAX_PARTS))
    # At most half a round shared: each tile in `parts` equal pieces on consecutive programs, its step count rounded up
    # to a multiple of parts (the steps past K load zero-filled boxes)
    parts = tl.minimum(tl.minimum(nprog // tl.maximum(shared, 1), MAX_PARTS), kit)
    split = (shared > 0) & (parts >= 2)
    parts = tl.maximum(parts, 1)  # 0 where more tiles are shared than programs (ROUNDS = 2): no division by it
    kit = tl.where(split, tl.cdiv(kit, parts) * parts, kit)
    per = tl.where(split, kit // parts, per)
    total = shared * kit
    lo = tl.minimum(pid * per, total)
    hi = tl.minimum(lo + per, total)
    return dp, kit, per, lo, hi


@triton.jit
def _sk_piece(it, lo, kit):
    """The piece of a stream-K share [lo, hi) that ends at step `it`: (tile, k_lo, k_hi), the K steps [k_lo, k_hi) of
    tile `tile`. A share is walked from its end; a piece short of its tile (k_lo > 0 or k_hi < kit) is published
    (_sk_publish) and summed with the tile's other pieces after the walk (_sk_holders, _sk_gather)."""
    tile = (it - 1) // kit
    first = tile * kit
    return tile, tl.maximum(first, lo) - first, it - first


@triton.jit
def _sk_holders(tile, kit, per):
    """(q0, parts): tile `tile` of the shared rounds is held by programs q0 .. q0 + parts - 1 (the shares that hold its
    steps). q0 also names the tile's counters: no two cut tiles start in the same share."""
    q0 = (tile * kit) // per
    return q0, ((tile + 1) * kit - 1) // per - q0 + 1


@triton.jit
def _sk_slot(q, tile, kit, per, ROUNDS: tl.constexpr):
    """The workspace slot of program q's piece of tile `tile`. ROUNDS = 1: q (at most half a round is shared, in
    per-tile pieces: a share lies inside one tile, _sk_share). ROUNDS = 2: 2q for the piece in its share's first tile,
    2q + 1 for the one in its last (a share cuts at most two tiles: at most one whole tile lies between them). So the
    workspace holds ROUNDS * nprog slots."""
    if ROUNDS == 1:
        return q
    return 2 * q + (tile != (q * per) // kit).to(tl.int32)


@triton.jit
def _sk_offsets(slot, c0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """Element offsets of columns [c0, c0 + WIDTH) of workspace slot `slot`, a [BLOCK_M, BLOCK_N] fp32 tile (the
    workspace holds ROUNDS * nprog slots: _sk_slot)."""
    return (tl.cast(slot, tl.int64) * (BLOCK_M * BLOCK_N) + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + c0
            + tl.arange(0, WIDTH)[None, :])


@triton.jit
def _sk_publish(acc, ws_ptr, flag_ptr, pid, tile, kit, per, ROUNDS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A piece short of its tile: its fp32 partial sum into its slot, then the tile's arrival count flag[q0] + 1
    (release, after a CTA barrier: every thread's stores are visible before the count)."""
    tl.store(ws_ptr + _sk_offsets(_sk_slot(pid, tile, kit, per, ROUNDS), 0, BLOCK_M, BLOCK_N, BLOCK_N), acc)
    tl.debug_barrier()
    q0, _ = _sk_holders(tile, kit, per)
    tl.atomic_add(flag_ptr + q0, 1, sem="release", scope="gpu")


@triton.jit
def _sk_cut(tile, lo, hi, kit):
    """Whether the share [lo, hi) holds a piece of tile `tile` short of the whole tile."""
    return (lo < hi) & ((lo > tile * kit) | (hi < (tile + 1) * kit))


@triton.jit
def _sk_chunks(flag_ptr, pid, tile, kit, per, WAIT: tl.constexpr):
    """The column chunks of a cut tile that program pid sums (after every piece of its share was published):
    (first, step, q0, parts), chunks first, first + step, ... below SK_CHUNKS. WAIT (on a GPU, where all programs
    run at once): waits until all `parts` pieces have arrived (acquire), then takes every parts-th chunk from its
    own index among the holders, so the tile's pieces' programs share its sum (one program summing every piece read
    them all: 4 x 128 KB at 128 x 256). Without WAIT (the Triton interpreter, which runs programs one after the
    other): only the last to arrive, which sees every piece, sums them all; the others take none."""
    q0, parts = _sk_holders(tile, kit, per)
    if WAIT:
        while tl.atomic_add(flag_ptr + q0, 0, sem="acquire", scope="gpu") < parts:
            pass
        tl.debug_barrier()  # no thread reads a piece before the count said it was there
        first = pid - q0
        step = parts
    else:
        arrived = tl.atomic_add(flag_ptr + q0, 0, sem="acquire", scope="gpu")
        first = tl.where(arrived == parts, 0, SK_CHUNKS)
        step = 1
    return first, step, q0, parts


@triton.jit
def _sk_gather(ws_ptr, tile, q0, parts, kit, per, c0, ROUNDS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """Columns [c0, c0 + WIDTH) of a cut tile: its pieces' partial sums added in program order, q0 first. A fixed
    order whoever sums the chunk: the same bits from run to run (no atomic adds)."""
    s = tl.zeros([BLOCK_M, WIDTH], dtype=tl.float32)
    for q in range(q0, q0 + parts):
        s += tl.load(ws_ptr + _sk_offsets(_sk_slot(q, tile, kit, per, ROUNDS), c0, BLOCK_M, BLOCK_N, WIDTH),
                     cache_modifier=".cg")
    return s


@triton.jit
def _sk_leave(flag_ptr, nprog, q0, parts):
    """A holder is done with the tile: flag[nprog + q0] counts the departures, and the last to leave sets both of the
    tile's counters back to 0 (every holder has passed its wait by then), so the flags are zero after the launch."""
    if tl.atomic_add(flag_ptr + nprog + q0, 1, sem="acq_rel", scope="gpu") == parts - 1:
        tl.atomic_xchg(flag_ptr + q0, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flag_ptr + nprog + q0, 0, sem="relaxed", scope="gpu")


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
    programs and unread stand-ins; with stream_k (1 or 2 rounds), num_programs (the SMs), each taking a share
    (_sk_share), the fp32 workspace [stream_k * nprog, BM, BN] (_sk_slot) and the zeroed int32 flags [2 nprog] (each
    cut tile's arrival and departure counts: _sk_publish, _sk_leave)."""
    import torch
    n, grid = (num_programs, num_programs) if stream_k else (1, min(num_programs or tiles, tiles))
    ws = torch.empty((stream_k * n, BM, BN) if stream_k else (1, ), dtype=torch.float32, device=device)
    return (grid, ), ws, torch.zeros(2 * n, dtype=torch.int32, device=device)


def _interpreting():
    """Whether kernels run under the Triton interpreter (TRITON_INTERPRET=1), which runs a grid's programs one after
    the other: a program must never wait there for a later one (a stream-K config's SK_WAIT)."""
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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


def _tail_cols(BN, split):
    """Columns of the second W descriptor's box: a slice of the split last round, BN / 2 (unread) without a split."""
    return BN // (int(split) or 2)
