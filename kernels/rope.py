"""Rotary position embedding (TransformerEngine semantics) as one Triton kernel.

One program handles BLOCK_T consecutive token rows, every head of them: it computes cos/sin of those tokens'
positions once per block of rotary pairs and applies them to all heads (of x, and of x2 when given: q and k in one
launch share them), BLOCK_H heads at a time. Several tokens per program matter for few-head tensors (a
tensor-parallel slice of Llama-3-70B has 8 query heads and 1 KV head: 4.6 KB per token row), where one token row per
program moves too little to reach copy bandwidth on an H200; the config table picks BLOCK_T by the heads per row.
Trig per (token, pair), not per head, keeps the kernel memory-bound when there are many heads. The same kernel does
forward and backward (the backward is the exact transpose: it swaps and negates the sines), and works in place:
every thread stores only elements that it loaded itself, so `out_ptr == x_ptr` is race-free.

Argument contract (the C++ launcher in csrc/ops/rope_cuda.cpp and aot/manifest.py depend on it):
  x_ptr, out_ptr, x2_ptr, out2_ptr : the tensor(s), any strides (element units); x2/out2 only read if HAS_SECOND
  freqs_ptr                        : float32, row p at freqs_ptr + p * freqs_stride, d2 contiguous floats
  cu_seqlens_ptr                   : int32 [B + 1], global offsets (thd only)
  start_ptr                        : int32 [B] start positions (read only if has_start)
  rows                             : token rows (S * B; thd: tokens), at most 2**31 - 1 - BLOCK_T (int32 indices);
                                     grid = cdiv(rows, BLOCK_T)
  S, B                             : sbhd/bshd: sequence length and batch; thd: B = number of sequences
  H, H2, D, HALF                   : heads of x and x2, head dim, rotary pairs (d2 / 2)
  s_max                            : rows of freqs (positions outside [0, s_max) read zeros, never out of bounds)
  sx*/so*                          : strides of x/out over (s or t, b, h, d)
  cp_size, cp_rank                 : context parallel split (cp_size == 1: none)
  flags                            : bit 0 bshd, bit 1 backward, bit 2 has_start, bit 3 copy the d2..d channels
"""
import triton
import triton.language as tl

FLAG_BSHD = 1
FLAG_BACKWARD = 2
FLAG_HAS_START = 4
FLAG_COPY_PASS = 8
SCAN_B = tl.constexpr(256)  # thd: up to this many sequences, a token's sequence is found by one vector compare


@triton.jit
def _sincos(x):
    """sin(x), cos(x) in fp32 from one range reduction and two short polynomials.

    Accurate to a few 1e-7 absolute for |x| < 2**15 (positions times frequencies in radians stay far below), and
    about 4x cheaper than two libdevice calls: at copy bandwidth the trig of a few-head tile is a real share of the
    kernel's instructions.
    """
    k = tl.floor(x * 0.6366197723675814 + 0.5)  # nearest multiple of pi/2
    # Cody-Waite: pi/2 split in three parts; k * 1.5703125 is exact (8 significant bits).
    r = x - k * 1.5703125
    r = r - k * 4.837512969970703125e-4
    r = r - k * 7.549789948768648e-8
    r2 = r * r
    sin_r = r + r * r2 * (-1.6666666666666666e-01 + r2 * (8.333333333333333e-03 + r2 * (
        -1.984126984126984e-04 + r2 * 2.7557319223985893e-06)))
    cos_r = 1.0 + r2 * (-0.5 + r2 * (4.1666666666666664e-02 + r2 * (-1.388888888888889e-03 + r2 * (
        2.48015873015873e-05 + r2 * -2.755731922398589e-07))))
    q = k.to(tl.int32) & 3
    s = tl.where((q & 1) == 0, sin_r, cos_r)
    c = tl.where((q & 1) == 0, cos_r, sin_r)
    s = tl.where((q & 2) == 0, s, -s)
    c = tl.where(((q + 1) & 2) == 0, c, -c)
    return s, c


@triton.jit
def _positions(cu_seqlens_ptr, start_ptr, tok, tok_ok, S, B, cp_size, cp_rank, flags, IS_THD: tl.constexpr):
    """(position in freqs, and the token's (s or t, b) indices into its tensor) of each token row."""
    if IS_THD:
        # The sequence of a token: the last b in [0, B) whose local start (cu_seqlens[b] / cp_size) is <= tok
        # (cu_seqlens is non-decreasing; an empty sequence shares its start with the next one, and both ways take
        # the last). Up to SCAN_B sequences: count the starts <= tok, one vector load (a decode batch's wait is one
        # round trip, not log2(B) dependent ones); beyond: a binary search, log2(B) gathers per token instead of B.
        if B <= SCAN_B:
            i = 1 + tl.arange(0, SCAN_B)
            starts = tl.load(cu_seqlens_ptr + i, mask=i <= B, other=2147483647) // cp_size
            b = tl.minimum(tl.sum((starts[None, :] <= tok[:, None]).to(tl.int32), axis=1), B - 1)
        else:
            b = tl.zeros_like(tok)
            step = 1
            while step * 2 < B:
                step *= 2
            while step > 0:
                cand = b + step
                ok = tok_ok & (cand < B)
                start = tl.load(cu_seqlens_ptr + cand, mask=ok, other=0) // cp_size
                b = tl.where(ok & (start <= tok), cand, b)
                step = step // 2
        start = tl.load(cu_seqlens_ptr + b, mask=tok_ok, other=0) // cp_size
        seq_len = tl.load(cu_seqlens_ptr + b + 1, mask=tok_ok, other=0) // cp_size - start
        s = tok - start
        row_s = tok
        row_b = tok * 0
    else:
        if (flags & 1) != 0:  # bshd: rows run over (b, s)
            b = tok // S
            s = tok % S
        else:  # sbhd: rows run over (s, b)
            s = tok // B
            b = tok % B
        seq_len = S
        row_s = s
        row_b = b
    pos = s
    if (flags & 4) != 0:
        pos += tl.load(start_ptr + b, mask=tok_ok, other=0)
    if cp_size > 1:
        # TE's dual-chunk order: the local sequence is chunk cp_rank followed by chunk 2*cp_size-1-cp_rank.
        half_len = seq_len // 2
        pos += tl.where(s < half_len, cp_rank * half_len, seq_len * cp_size - (cp_rank + 1) * half_len - half_len)
    return pos, row_s, row_b


@triton.jit
def _rotate_heads(x_ptr, out_ptr, x_tok, o_tok, tok_ok, H, sx_h, sx_d, so_h, so_d, j, j_ok, HALF,
                  cos_a, sin_a, cos_b, sin_b, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates pairs j of every head of the program's tokens; x_tok / o_tok: [BLOCK_T, 1, 1] token row offsets,
    cos/sin: [BLOCK_T, 1, BLOCK_HALF], shared by all heads."""
    for h0 in range(0, H, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H))[None, :, None]
        mask = tok_ok & (h < H) & j_ok
        xh = x_tok + h.to(tl.int64) * sx_h
        oh = o_tok + h.to(tl.int64) * so_h
        if INTERLEAVED:
            # Pairs are adjacent channels: load the contiguous span and split it, so loads stay wide.
            k = tl.arange(0, 2)[None, None, None, :]
            ch = (2 * j)[:, :, :, None] + k
            m4 = mask[:, :, :, None] & (k < 2)
            x = tl.load(x_ptr + xh[:, :, :, None] + ch * sx_d, mask=m4, other=0.0)
            xa, xb = tl.split(x)
        else:
            xa = tl.load(x_ptr + xh + j * sx_d, mask=mask, other=0.0)
            xb = tl.load(x_ptr + xh + (j + HALF) * sx_d, mask=mask, other=0.0)
        xa = xa.to(tl.float32)
        xb = xb.to(tl.float32)
        oa = xa * cos_a - xb * sin_a
        ob = xb * cos_b + xa * sin_b
        if INTERLEAVED:
            o = tl.join(oa, ob)
            tl.store(out_ptr + oh[:, :, :, None] + ch * so_d, o.to(out_ptr.dtype.element_ty), mask=m4)
        else:
            tl.store(out_ptr + oh + j * so_d, oa.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out_ptr + oh + (j + HALF) * so_d, ob.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_pass(x_ptr, out_ptr, x_tok, o_tok, tok_ok, H, D, HALF, sx_h, sx_d, so_h, so_d,
               BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Channels d2..d are not rotated: copy them through (skipped when running in place)."""
    for c0 in range(2 * HALF, D, 2 * BLOCK_HALF):
        c = (c0 + tl.arange(0, 2 * BLOCK_HALF))[None, None, :]
        for h0 in range(0, H, BLOCK_H):
            h = (h0 + tl.arange(0, BLOCK_H))[None, :, None]
            mask = tok_ok & (h < H) & (c < D)
            v = tl.load(x_ptr + x_tok + h.to(tl.int64) * sx_h + c * sx_d, mask=mask)
            tl.store(out_ptr + o_tok + h.to(tl.int64) * so_h + c * so_d, v, mask=mask)


@triton.jit
def rope_kernel(x_ptr, out_ptr, x2_ptr, out2_ptr, freqs_ptr, cu_seqlens_ptr, start_ptr,
                rows, S, B, H, H2, D, HALF, s_max, freqs_stride,
                sx_s, sx_b, sx_h, sx_d, so_s, so_b, so_h, so_d,
                sx2_s, sx2_b, sx2_h, sx2_d, so2_s, so2_b, so2_h, so2_d,
                cp_size, cp_rank, flags,
                IS_THD: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_SECOND: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < rows
    pos, row_s, row_b = _positions(cu_seqlens_ptr, start_ptr, tok, tok_ok, S, B, cp_size, cp_rank, flags, IS_THD)
    # Row offsets of each token ([BLOCK_T, 1, 1]): thd rows are tokens (b is 0); sbhd/bshd rows are (s, b).
    rs = row_s.to(tl.int64)[:, None, None]
    rb = row_b.to(tl.int64)[:, None, None]
    x_tok, o_tok = rs * sx_s + rb * sx_b, rs * so_s + rb * so_b
    x2_tok, o2_tok = rs * sx2_s + rb * sx2_b, rs * so2_s + rb * so2_b
    tok_ok = tok_ok[:, None, None]
    pos_ok = tok_ok & (pos >= 0)[:, None, None] & (pos < s_max)[:, None, None]
    f_row = freqs_ptr + pos.to(tl.int64)[:, None, None] * freqs_stride
    for j0 in range(0, HALF, BLOCK_HALF):
        j = (j0 + tl.arange(0, BLOCK_HALF))[None, None, :]
        j_ok = j < HALF
        if INTERLEAVED:
            fa = tl.load(f_row + 2 * j, mask=pos_ok & j_ok, other=0.0)
            fb = tl.load(f_row + 2 * j + 1, mask=pos_ok & j_ok, other=0.0)
        else:
            fa = tl.load(f_row + j, mask=pos_ok & j_ok, other=0.0)
            fb = tl.load(f_row + j + HALF, mask=pos_ok & j_ok, other=0.0)
        sin_a, cos_a = _sincos(fa)
        if tl.max(tl.max(tl.max(tl.abs(fa - fb), axis=2), axis=1), axis=0) == 0:
            sin_b, cos_b = sin_a, cos_a  # TE's freqs repeat across the pair: halve the trig
        else:
            sin_b, cos_b = _sincos(fb)
        if (flags & 2) != 0:
            # Backward: the transpose of [[c_a, -s_a], [s_b, c_b]] is [[c_a, s_b], [-s_a, c_b]].
            sin_a, sin_b = -sin_b, -sin_a
        _rotate_heads(x_ptr, out_ptr, x_tok, o_tok, tok_ok, H, sx_h, sx_d, so_h, so_d, j, j_ok, HALF,
                      cos_a, sin_a, cos_b, sin_b, INTERLEAVED, BLOCK_H)
        if HAS_SECOND:
            _rotate_heads(x2_ptr, out2_ptr, x2_tok, o2_tok, tok_ok, H2, sx2_h, sx2_d, so2_h, so2_d, j, j_ok, HALF,
                          cos_a, sin_a, cos_b, sin_b, INTERLEAVED, BLOCK_H)
    if (flags & 8) != 0:
        _copy_pass(x_ptr, out_ptr, x_tok, o_tok, tok_ok, H, D, HALF, sx_h, sx_d, so_h, so_d, BLOCK_H, BLOCK_HALF)
        if HAS_SECOND:
            _copy_pass(x2_ptr, out2_ptr, x2_tok, o2_tok, tok_ok, H2, D, HALF, sx2_h, sx2_d, so2_h, so2_d, BLOCK_H,
                       BLOCK_HALF)
