"""Rotary position embedding (TransformerEngine semantics) as one Triton kernel.

One program handles one token row (all of its heads); cos/sin of that token's position are shared by its heads. The same kernel does forward and backward (the backward is the exact transpose: it swaps and
negates the sines), optionally a second tensor at the same positions (q and k in one launch), and works in place:
every thread stores only elements that it loaded itself, so `out_ptr == x_ptr` is race-free.

Argument contract (the C++ launcher in csrc/ops/rope_cuda.cpp and aot/manifest.py depend on it):
  x_ptr, out_ptr, x2_ptr, out2_ptr : the tensor(s), any strides (element units); x2/out2 only read if HAS_SECOND
  freqs_ptr                        : float32, row p at freqs_ptr + p * freqs_stride, d2 contiguous floats
  cu_seqlens_ptr                   : int32 [B + 1], global offsets (thd only)
  start_ptr                        : int32 [B] start positions (read only if has_start)
  S, B                             : sbhd/bshd: sequence length and batch; thd: B = number of sequences
  H, D, HALF                       : heads, head dim, rotary pairs (d2 / 2)
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


@triton.jit
def _sincos(x):
    """sin(x), cos(x) in fp32 from one range reduction and two short polynomials.

    Accurate to a few 1e-7 absolute for |x| < 2**15 (positions times frequencies in radians stay far below), and
    about 4x cheaper than two libdevice calls. That matters: every thread that holds a column of the tile evaluates
    it, so a token's trig work is replicated across its head rows.
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
def _position(cu_seqlens_ptr, start_ptr, row, S, B, cp_size, cp_rank, flags, IS_THD: tl.constexpr,
              BLOCK_B: tl.constexpr):
    """(position in freqs, sequence index b, row within the local sequence s) of a token row."""
    if IS_THD:
        # Sequence of this token: how many sequence starts (local, i.e. / cp_size) are <= row.
        seq = 0
        for i0 in range(0, B, BLOCK_B):
            i = 1 + i0 + tl.arange(0, BLOCK_B)
            starts = tl.load(cu_seqlens_ptr + i, mask=i <= B, other=2147483647) // cp_size
            seq += tl.sum((starts <= row).to(tl.int32), axis=0)
        b = tl.minimum(seq, B - 1)
        start = tl.load(cu_seqlens_ptr + b) // cp_size
        seq_len = tl.load(cu_seqlens_ptr + b + 1) // cp_size - start
        s = row - start
    else:
        if (flags & 1) != 0:  # bshd: rows run over (b, s)
            b = row // S
            s = row % S
        else:  # sbhd: rows run over (s, b)
            s = row // B
            b = row % B
        seq_len = S
    pos = s
    if (flags & 4) != 0:
        pos += tl.load(start_ptr + b)
    if cp_size > 1:
        # TE's dual-chunk order: the local sequence is chunk cp_rank followed by chunk 2*cp_size-1-cp_rank.
        half_len = seq_len // 2
        if s < half_len:
            pos += cp_rank * half_len
        else:
            pos += seq_len * cp_size - (cp_rank + 1) * half_len - half_len
    return pos, b, s


@triton.jit
def _rotate(x_ptr, out_ptr, x_row, o_row, H, HALF, sx_h, sx_d, so_h, so_d,
            freqs_ptr, freqs_stride, s_max, cu_seqlens_ptr, start_ptr, row, S, B, cp_size, cp_rank, flags,
            IS_THD: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
            BLOCK_B: tl.constexpr):
    """Rotates the d2 channels of every head of one token row.

    Per tile, the loads of x are issued first: they depend on nothing, so the position lookup, the freqs load and
    the trig overlap their latency.
    """
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        for j0 in range(0, HALF, BLOCK_HALF):
            j = j0 + tl.arange(0, BLOCK_HALF)
            j_mask = j < HALF
            mask = (h < H)[:, None] & j_mask[None, :]
            xh = x_row + h[:, None].to(tl.int64) * sx_h
            oh = o_row + h[:, None].to(tl.int64) * so_h
            if INTERLEAVED:
                # Pairs are adjacent channels: load the contiguous span and split it, so loads stay wide.
                k = tl.arange(0, 2)
                ch = (2 * j)[None, :, None] + k[None, None, :]
                m3 = mask[:, :, None] & (k[None, None, :] < 2)
                x = tl.load(x_ptr + xh[:, :, None] + ch * sx_d, mask=m3, other=0.0)
                xa, xb = tl.split(x)
                fa_off = 2 * j
                fb_off = 2 * j + 1
            else:
                xa = tl.load(x_ptr + xh + j[None, :] * sx_d, mask=mask, other=0.0)
                xb = tl.load(x_ptr + xh + (j + HALF)[None, :] * sx_d, mask=mask, other=0.0)
                fa_off = j
                fb_off = j + HALF

            pos, b, s = _position(cu_seqlens_ptr, start_ptr, row, S, B, cp_size, cp_rank, flags, IS_THD, BLOCK_B)
            pos_ok = (pos >= 0) & (pos < s_max)
            f_row = freqs_ptr + pos.to(tl.int64) * freqs_stride
            fa = tl.load(f_row + fa_off, mask=j_mask & pos_ok, other=0.0)
            fb = tl.load(f_row + fb_off, mask=j_mask & pos_ok, other=0.0)
            sin_a, cos_a = _sincos(fa)
            if tl.max(tl.abs(fa - fb), axis=0) == 0:  # TE's freqs repeat across the pair: halve the trig
                sin_b, cos_b = sin_a, cos_a
            else:
                sin_b, cos_b = _sincos(fb)
            if (flags & 2) != 0:
                # Backward: the transpose of [[c_a, -s_a], [s_b, c_b]] is [[c_a, s_b], [-s_a, c_b]].
                sin_a, sin_b = -sin_b, -sin_a
            xa = xa.to(tl.float32)
            xb = xb.to(tl.float32)
            oa = xa * cos_a[None, :] - xb * sin_a[None, :]
            ob = xb * cos_b[None, :] + xa * sin_b[None, :]
            if INTERLEAVED:
                o = tl.join(oa, ob)
                tl.store(out_ptr + oh[:, :, None] + ch * so_d, o.to(out_ptr.dtype.element_ty), mask=m3)
            else:
                tl.store(out_ptr + oh + j[None, :] * so_d, oa.to(out_ptr.dtype.element_ty), mask=mask)
                tl.store(out_ptr + oh + (j + HALF)[None, :] * so_d, ob.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_pass(x_ptr, out_ptr, x_row, o_row, H, D, HALF, sx_h, sx_d, so_h, so_d,
               BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Channels d2..d are not rotated: copy them through (skipped when running in place)."""
    for c0 in range(2 * HALF, D, 2 * BLOCK_HALF):
        c = c0 + tl.arange(0, 2 * BLOCK_HALF)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            mask = (h < H)[:, None] & (c < D)[None, :]
            v = tl.load(x_ptr + x_row + h[:, None].to(tl.int64) * sx_h + c[None, :] * sx_d, mask=mask)
            tl.store(out_ptr + o_row + h[:, None].to(tl.int64) * so_h + c[None, :] * so_d, v, mask=mask)


@triton.jit
def rope_kernel(x_ptr, out_ptr, x2_ptr, out2_ptr, freqs_ptr, cu_seqlens_ptr, start_ptr,
                S, B, H, H2, D, HALF, s_max, freqs_stride,
                sx_s, sx_b, sx_h, sx_d, so_s, so_b, so_h, so_d,
                sx2_s, sx2_b, sx2_h, sx2_d, so2_s, so2_b, so2_h, so2_d,
                cp_size, cp_rank, flags,
                IS_THD: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_SECOND: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_B: tl.constexpr):
    row = tl.program_id(0)
    # Where this token's data lives needs no lookup: thd rows are tokens; sbhd/bshd rows decompose directly.
    if IS_THD:
        xs = row.to(tl.int64)
        xb_ = xs * 0
    else:
        if (flags & 1) != 0:
            xs = (row % S).to(tl.int64)
            xb_ = (row // S).to(tl.int64)
        else:
            xs = (row // B).to(tl.int64)
            xb_ = (row % B).to(tl.int64)
    _rotate(x_ptr, out_ptr, xs * sx_s + xb_ * sx_b, xs * so_s + xb_ * so_b, H, HALF, sx_h, sx_d, so_h, so_d,
            freqs_ptr, freqs_stride, s_max, cu_seqlens_ptr, start_ptr, row, S, B, cp_size, cp_rank, flags,
            IS_THD, INTERLEAVED, BLOCK_H, BLOCK_HALF, BLOCK_B)
    if HAS_SECOND:
        _rotate(x2_ptr, out2_ptr, xs * sx2_s + xb_ * sx2_b, xs * so2_s + xb_ * so2_b, H2, HALF, sx2_h, sx2_d,
                so2_h, so2_d, freqs_ptr, freqs_stride, s_max, cu_seqlens_ptr, start_ptr, row, S, B, cp_size,
                cp_rank, flags, IS_THD, INTERLEAVED, BLOCK_H, BLOCK_HALF, BLOCK_B)
    if (flags & 8) != 0:
        _copy_pass(x_ptr, out_ptr, xs * sx_s + xb_ * sx_b, xs * so_s + xb_ * so_b, H, D, HALF, sx_h, sx_d, so_h,
                   so_d, BLOCK_H, BLOCK_HALF)
        if HAS_SECOND:
            _copy_pass(x2_ptr, out2_ptr, xs * sx2_s + xb_ * sx2_b, xs * so2_s + xb_ * so2_b, H2, D, HALF, sx2_h,
                       sx2_d, so2_h, so2_d, BLOCK_H, BLOCK_HALF)
