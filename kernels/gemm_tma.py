"""Hopper (sm_90) TMA routed GEMMs (kernels/GEMM.md kernels 6, 7, 7a and 10b): A = expert-ordered padded buffer, A
and the stacked weights through host tensor descriptors. routed_linear_tma_kernel (forward and grad-input),
routed_swiglu_tma_kernel and routed_swiglu_pair_tma_kernel (the gate/up GEMM with two MMAs, or gate and up in one),
routed_swiglu_pair_bwd_tma_kernel (the ffn backward's gate/up recompute fused with the SwiGLU gradients). A's
gather copy: kernels/gather_rows.py; the variants that gather A's rows inside the main loop instead:
kernels/gemm_gather_tma.py (they share _w_index, _linear_step and _swiglu_step from here).

Persistent: grid = min(#SMs, num_tiles); each program walks tiles pid, pid + nprog, ... (kernels/gemm_tiles.py
_walk_tiles, _tile_at). FLATTEN (a config's "flatten"): the tile loop is flattened into the K loop
(tl.range(flatten=True)), so the software pipeline runs across tiles and the next tile's first loads overlap this
tile's epilogue.

Conventions (experts, perm / seg, the generic GEMM with W_TRANSPOSED, SCATTER_OUT): kernels/gemm_tiles.py.
"""
import triton
import triton.language as tl

from kernels.gemm_tiles import (SK_CHUNKS, SK_MAX_PARTS, _add_bias, _add_residual, _gate_up_arg,
                                _interpreting, _ordered_offsets, _row_tiles, _save_gate_up, _silu_mul, _sk_chunks,
                                _sk_cut, _sk_gather, _sk_leave, _sk_piece, _sk_publish, _sk_share, _split_tail,
                                _store_tile, _stream_k_args, _tail_cols, _tail_part_at, _tile_at,
                                _walk_tiles)
from kernels.pdl import grid_dependency_sync
from kernels.swiglu_backward import swiglu_grads


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
def _tma_mainloop(a_desc, w_desc, e, row0, n0, k_lo, k_hi, W_TRANSPOSED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 tile A[rows from row0] · W_e's columns from n0 over the K steps [k_lo, k_hi) (all of K, or a stream-K
    piece)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo * BLOCK_K, k_hi * BLOCK_K, BLOCK_K):
        acc = _linear_step(a_desc.load([row0, k0]), w_desc, e, n0, k0, acc, W_TRANSPOSED, INPUT_PRECISION, BLOCK_N,
                           BLOCK_K)
    return acc


@triton.jit
def _linear_epilogue(acc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e, offs_n, N, stride_om,
                     has_bias, has_residual, SCATTER_OUT: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    """A linear tile's epilogue: bias, residual, store (_store_tile)."""
    if has_bias:
        acc = _add_bias(acc, bias0_ptr, bias1_ptr, e, offs_n, N)
    if has_residual:
        acc = _add_residual(acc, res_ptr, perm_ptr, row0, row_hi, offs_n, N, stride_om, SCATTER_OUT, BLOCK_M)
    _store_tile(out_ptr, acc, perm_ptr, row0, row_hi, offs_n, N, stride_om, SCATTER_OUT, BLOCK_M)


@triton.jit
def _sk_finish(acc, ws_ptr, flag_ptr, pid, tile, k_lo, k_hi, kit, per, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr,
               row0, row_hi, e, n0, N, stride_om, has_bias, has_residual,
               SCATTER_OUT: tl.constexpr, ROUNDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A stream-K piece's end (kernels/gemm_tiles.py _sk_share): a whole tile gets its epilogue; a piece of a cut tile
    is published, and summed with the tile's other pieces after the share's walk (_sk_fixup)."""
    if (k_lo == 0) & (k_hi == kit):
        _linear_epilogue(acc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e,
                         n0 + tl.arange(0, BLOCK_N), N, stride_om, has_bias, has_residual, SCATTER_OUT, BLOCK_M)
    else:
        _sk_publish(acc, ws_ptr, flag_ptr, pid, tile, kit, per, ROUNDS, BLOCK_M, BLOCK_N)


@triton.jit
def _sk_fixup(ws_ptr, flag_ptr, pid, nprog, lo, hi, kit, per, dp, start1, t0, num_pid_m, hi0, hi1, num_pid_n,
              bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, N, stride_om, has_bias,
              has_residual, SCATTER_OUT: tl.constexpr, WAIT: tl.constexpr, ROUNDS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """After a stream-K share's walk, every piece of it published: for each tile the share cut (its first and last;
    a tile between them is whole), this program's column chunks of the tile's sum (_sk_chunks: with WAIT, after every
    holder published, every parts-th chunk), each added up from the pieces in program order (_sk_gather) and run
    through the epilogue; then it leaves the tile (_sk_leave). Publishing everything before waiting on anything keeps
    it free of deadlock: the programs are one per SM, all resident, and a wait is only for publishes that wait on
    nothing."""
    WIDTH: tl.constexpr = BLOCK_N // SK_CHUNKS
    first_tile = lo // kit
    last_tile = (hi - 1) // kit
    for tile in range(first_tile, last_tile + 1, tl.maximum(last_tile - first_tile, 1)):
        if _sk_cut(tile, lo, hi, kit):
            row0, row_hi, e, n0, _ = _tile_at(dp + tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                              GROUP_M)
            first, step, q0, parts = _sk_chunks(flag_ptr, pid, tile, kit, per, WAIT)
            for c in range(first, SK_CHUNKS, step):
                s = _sk_gather(ws_ptr, tile, q0, parts, kit, per, c * WIDTH, ROUNDS, BLOCK_M, BLOCK_N, WIDTH)
                _linear_epilogue(s, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e,
                                 n0 + c * WIDTH + tl.arange(0, WIDTH), N, stride_om, has_bias, has_residual,
                                 SCATTER_OUT, BLOCK_M)
            _sk_leave(flag_ptr, nprog, q0, parts)


@triton.jit
def _tma_linear_tile(a_desc, w_desc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e, n0, offs_n, N,
                     K, stride_om, w_map, has_bias, has_residual,
                     SCATTER_OUT: tl.constexpr, W_TRANSPOSED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile of routed_linear_tma_kernel: rows [row0, row_hi) of A through a_desc, columns offs_n =
    n0 + [0, BLOCK_N) of expert e's W through w_desc (whose block is BLOCK_N wide; w_map: _w_index), bias, residual,
    store."""
    acc = _tma_mainloop(a_desc, w_desc, _w_index(e, w_map), row0, n0, 0, tl.cdiv(K, BLOCK_K), W_TRANSPOSED,
                        INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    _linear_epilogue(acc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e, offs_n, N, stride_om,
                     has_bias, has_residual, SCATTER_OUT, BLOCK_M)


@triton.jit
def routed_linear_tma_kernel(a_desc, w_desc, wh_desc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr,
                             seg_ptr, ws_ptr, flag_ptr, one_rows, N, K, stride_om, w_map,
                             has_bias, has_residual, SCATTER_OUT: tl.constexpr,
                             W_TRANSPOSED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr,
                             FLATTEN: tl.constexpr, SPLIT_TAIL: tl.constexpr = 0, STREAM_K: tl.constexpr = 0,
                             SK_WAIT: tl.constexpr = True, PDL: tl.constexpr = False):
    """a_desc: [M_pad, K] block [BM, BK]; w_desc: stacked W [2, N, K] block [1, BN, BK]
    (W_TRANSPOSED: [2, K, N] block [1, BK, BN]); wh_desc: the same tensor with BN / SPLIT_TAIL columns per block
    (BN / 2 without it), for SPLIT_TAIL (a config's "split": 2, 4 or 8): a last round split in that many column
    slices (_split_tail: at 2048 tokens, 17 x 16 tiles of 128 x 256 are 2 rounds and 8 tiles on 132 SMs). Not
    compiled in where the table does not ask for it: the code after the tile loop cost the flattened large-m kernels
    1-3%. Persistent over the
    row tiles of _row_tiles x cdiv(N, BN): with SCATTER_OUT only the tiles that hold rows, else every tile below
    end = seg[2] (an expert-ordered output is written up to end, padding rows included). one_rows > 0 (with
    SCATTER_OUT = False): one expert, rows in token order, no perm / seg (_walk_tiles). w_map: the experts' order
    along w_desc's first dimension (_w_index). has_residual: out = A·Wᵀ (+ bias) + residual, res_ptr of out's
    layout and row stride (the ffn down projection's residual add). STREAM_K (a config's "stream_k"; not with
    SPLIT_TAIL): the K steps of the last STREAM_K rounds' tiles (1: the last partial round; 2: also the whole round
    before it) shared out evenly (_sk_share), partial sums through ws_ptr ([STREAM_K nprog, BM, BN] fp32: _sk_slot) and
    flag_ptr (int32 [2 nprog], zero before and after the launch); without it neither is read. SK_WAIT: False only
    under the Triton interpreter (_sk_chunks)."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start1, t0, num_pid_m, hi0, hi1 = _walk_tiles(seg_ptr, one_rows, BLOCK_M, SCATTER_OUT == False)  # noqa: E712
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
        _tma_linear_tile(a_desc, w_desc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e, n0,
                         offs_n, N, K, stride_om, w_map, has_bias, has_residual, SCATTER_OUT, W_TRANSPOSED,
                         INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT_TAIL:
        if pid < SPLIT_TAIL * tail:
            row0, row_hi, e, n0, offs_n = _tail_part_at(pid, main, start1, t0, num_pid_m, hi0, hi1, num_pid_n,
                                                        BLOCK_M, BLOCK_N, GROUP_M, SPLIT_TAIL)
            _tma_linear_tile(a_desc, wh_desc, bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, row0, row_hi, e, n0,
                             offs_n, N, K, stride_om, w_map, has_bias, has_residual, SCATTER_OUT, W_TRANSPOSED,
                             INPUT_PRECISION, BLOCK_M, BLOCK_N // SPLIT_TAIL, BLOCK_K)
    if STREAM_K:  # the last STREAM_K rounds, shared out
        it = hi
        while it > lo:
            tile, k_lo, k_hi = _sk_piece(it, lo, kit)
            row0, row_hi, e, n0, offs_n = _tile_at(dp + tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M,
                                                   BLOCK_N, GROUP_M)
            acc = _tma_mainloop(a_desc, w_desc, _w_index(e, w_map), row0, n0, k_lo, k_hi, W_TRANSPOSED,
                                INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
            _sk_finish(acc, ws_ptr, flag_ptr, pid, tile, k_lo, k_hi, kit, per, bias0_ptr, bias1_ptr, out_ptr, res_ptr,
                       perm_ptr, row0, row_hi, e, n0, N, stride_om, has_bias, has_residual, SCATTER_OUT, STREAM_K,
                       BLOCK_M, BLOCK_N)
            it -= k_hi - k_lo
        _sk_fixup(ws_ptr, flag_ptr, pid, nprog, lo, hi, kit, per, dp, start1, t0, num_pid_m, hi0, hi1, num_pid_n,
                  bias0_ptr, bias1_ptr, out_ptr, res_ptr, perm_ptr, N, stride_om, has_bias, has_residual, SCATTER_OUT,
                  SK_WAIT, STREAM_K, BLOCK_M, BLOCK_N, GROUP_M)


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
    main, tail = _split_tail(num_pid_m * num_pid_n, nprog, 2)
    for tile in tl.range(pid, main, nprog, flatten=FLATTEN):
        row0, row_hi, e, n0, offs_n = _tile_at(tile, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M, BLOCK_N,
                                               GROUP_M)
        g, u = _pair_gate_up(a_desc, w13_desc, _w_index(e, w_map), row0, n0, K, up_first, INPUT_PRECISION, BLOCK_M,
                             BLOCK_N, BLOCK_K)
        _store_tile(h_ptr, _silu_mul(g, u), perm_ptr, row0, row_hi, offs_n, N, stride_hm, False, BLOCK_M)
        if SAVE:
            _save_gate_up(gu_ptr, g, u, perm_ptr, one_rows, row0, row_hi, offs_n, N, stride_gu, BLOCK_M)
    if pid < 2 * tail:
        row0, row_hi, e, n0, offs_n = _tail_part_at(pid, main, start1, t0, num_pid_m, hi0, hi1, num_pid_n, BLOCK_M,
                                                    BLOCK_N, GROUP_M, 2)
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


# ----------------------------------------------------------------------------------------------
# Python launchers (JIT / TRITON_INTERPRET use; they also document the grids for the C++ side)
# ----------------------------------------------------------------------------------------------
def _tile_rows_arg(perm, seg, one_rows, out):
    """(row-tile upper bound as rows, perm, seg) of a persistent TMA launch: one_rows > 0 needs no perm / seg (the
    kernel reads neither; an empty int32 tensor stands in for both, so the JIT types the pointers as the AOT
    signature does)."""
    if one_rows:
        import torch
        none = torch.empty(0, dtype=torch.int32, device=out.device)
        return one_rows, none, none
    return perm.shape[0], perm, seg


def launch_routed_linear_tma(a_pad, w_stacked, bias0, bias1, out, perm, seg, *, scatter_out=True,
                             w_transposed=False, input_precision="tf32", BM=128, BN=256, BK=64, GROUP_M=8,
                             num_programs=None, num_warps=8, num_stages=3, FLATTEN=False, one_rows=0,
                             SPLIT_TAIL=False, STREAM_K=False, w_map=2, residual=None):
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
    bs = _tail_cols(BN, SPLIT_TAIL)
    wh_desc = TensorDescriptor.from_tensor(w_stacked, [1, BK, bs] if w_transposed else [1, bs, BK])
    has_bias = bias0 is not None
    if not has_bias:
        bias0 = bias1 = out
    tiles = triton.cdiv(M_pad, BM) * triton.cdiv(N, BN)
    grid, ws, flags = _stream_k_args(STREAM_K, num_programs, tiles, BM, BN, out.device)
    assert residual is None or (residual.shape == out.shape and residual.stride() == out.stride())
    routed_linear_tma_kernel[grid](a_desc=a_desc, w_desc=w_desc, wh_desc=wh_desc, bias0_ptr=bias0, bias1_ptr=bias1,
                                   out_ptr=out, res_ptr=out if residual is None else residual, perm_ptr=perm,
                                   seg_ptr=seg, ws_ptr=ws, flag_ptr=flags, one_rows=one_rows, N=N, K=K,
                                   stride_om=out.stride(0), w_map=w_map, has_bias=has_bias,
                                   has_residual=residual is not None, SCATTER_OUT=scatter_out,
                                   W_TRANSPOSED=w_transposed, INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN,
                                   BLOCK_K=BK, GROUP_M=GROUP_M, FLATTEN=FLATTEN, SPLIT_TAIL=int(SPLIT_TAIL),
                                   STREAM_K=int(STREAM_K), SK_WAIT=not _interpreting(), num_warps=num_warps,
                                   num_stages=num_stages)
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
    routed_swiglu_tma_kernel[grid](a_desc=a_desc, w1_desc=w1_desc, w3_desc=w3_desc, h_ptr=h, gu_ptr=gu, perm_ptr=perm,
                                   seg_ptr=seg, one_rows=one_rows, N=N, K=K, stride_hm=h.stride(0), stride_gu=stride_gu,
                                   w_map=w_map, SCATTER_OUT=scatter_out, SAVE=save, INPUT_PRECISION=input_precision,
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
    routed_swiglu_pair_tma_kernel[grid](a_desc=a_desc, w13_desc=w_desc, w13h_desc=wh_desc, h_ptr=h, gu_ptr=gu,
                                        perm_ptr=perm, seg_ptr=seg, one_rows=one_rows, N=N, K=K, stride_hm=h.stride(0),
                                        stride_gu=stride_gu, up_first=int(up_first), w_map=w_map, SAVE=save,
                                        INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                                        GROUP_M=GROUP_M, FLATTEN=FLATTEN, num_warps=num_warps, num_stages=num_stages)
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
    routed_swiglu_pair_bwd_tma_kernel[grid](a_desc=a_desc, w13_desc=w_desc, h_ptr=h, dup_ptr=dup, dgate_ptr=dgate,
                                            seg_ptr=seg, N=N, K=K, stride_hm=h.stride(0), up_first=int(up_first),
                                            w_map=w_map, INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN,
                                            BLOCK_K=BK, GROUP_M=GROUP_M, FLATTEN=FLATTEN, num_warps=num_warps,
                                            num_stages=num_stages)
    return h, dup, dgate
