"""Rotary position embedding (TransformerEngine semantics) as one Triton kernel.

One program handles one token row (all of its heads), so cos/sin of that token's position are computed once and
reused across heads. The same kernel does forward and backward (the backward is the exact transpose: it swaps and
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
def _rotate_heads(x_ptr, out_ptr, x_row, o_row, H, D, HALF, sx_h, sx_d, so_h, so_d,
                  cos_a, sin_a, cos_b, sin_b, j, j_mask,
                  INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotates channels [2*j0, 2*j0 + 2*BLOCK_HALF) of every head of one token; copies d2..d if asked."""
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < H)[:, None] & j_mask[None, :]
        xh = x_row + h[:, None].to(tl.int64) * sx_h
        oh = o_row + h[:, None].to(tl.int64) * so_h
        if INTERLEAVED:
            # Pairs are adjacent channels: load the contiguous span and split it, so loads stay wide.
            k = tl.arange(0, 2)
            ch = (2 * j)[None, :, None] + k[None, None, :]
            m3 = mask[:, :, None] & (k[None, None, :] < 2)
            x = tl.load(x_ptr + xh[:, :, None] + ch * sx_d, mask=m3, other=0.0).to(tl.float32)
            xa, xb = tl.split(x)
            oa = xa * cos_a[None, :] - xb * sin_a[None, :]
            ob = xb * cos_b[None, :] + xa * sin_b[None, :]
            o = tl.join(oa, ob)
            tl.store(out_ptr + oh[:, :, None] + ch * so_d, o.to(out_ptr.dtype.element_ty), mask=m3)
        else:
            xa = tl.load(x_ptr + xh + j[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
            xb = tl.load(x_ptr + xh + (j + HALF)[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
            oa = xa * cos_a[None, :] - xb * sin_a[None, :]
            ob = xb * cos_b[None, :] + xa * sin_b[None, :]
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
    if IS_THD:
        # Sequence of this token: how many sequence starts (local, i.e. / cp_size) are <= row.
        seq = 0
        for i0 in range(0, B, BLOCK_B):
            i = 1 + i0 + tl.arange(0, BLOCK_B)
            starts = tl.load(cu_seqlens_ptr + i, mask=i <= B, other=2147483647) // cp_size
            seq += tl.sum((starts <= row).to(tl.int32), axis=0)
        seq = tl.minimum(seq, B - 1)
        start = tl.load(cu_seqlens_ptr + seq) // cp_size
        seq_len = tl.load(cu_seqlens_ptr + seq + 1) // cp_size - start
        s = row - start
        b = seq
        x_row = row.to(tl.int64) * sx_s
        o_row = row.to(tl.int64) * so_s
        x2_row = row.to(tl.int64) * sx2_s
        o2_row = row.to(tl.int64) * so2_s
    else:
        if (flags & 1) != 0:  # bshd: rows run over (b, s)
            b = row // S
            s = row % S
        else:  # sbhd: rows run over (s, b)
            s = row // B
            b = row % B
        seq_len = S
        x_row = s.to(tl.int64) * sx_s + b.to(tl.int64) * sx_b
        o_row = s.to(tl.int64) * so_s + b.to(tl.int64) * so_b
        x2_row = s.to(tl.int64) * sx2_s + b.to(tl.int64) * sx2_b
        o2_row = s.to(tl.int64) * so2_s + b.to(tl.int64) * so2_b

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
    pos_ok = (pos >= 0) & (pos < s_max)
    f_row = freqs_ptr + pos.to(tl.int64) * freqs_stride
    backward = (flags & 2) != 0
    copy_pass = (flags & 8) != 0

    for j0 in range(0, HALF, BLOCK_HALF):
        j = j0 + tl.arange(0, BLOCK_HALF)
        j_mask = j < HALF
        if INTERLEAVED:
            fa = tl.load(f_row + 2 * j, mask=j_mask & pos_ok, other=0.0)
            fb = tl.load(f_row + 2 * j + 1, mask=j_mask & pos_ok, other=0.0)
        else:
            fa = tl.load(f_row + j, mask=j_mask & pos_ok, other=0.0)
            fb = tl.load(f_row + j + HALF, mask=j_mask & pos_ok, other=0.0)
        cos_a = tl.cos(fa)
        cos_b = tl.cos(fb)
        sin_a = tl.sin(fa)
        sin_b = tl.sin(fb)
        if backward:
            # The transpose of [[c_a, -s_a], [s_b, c_b]] is [[c_a, s_b], [-s_a, c_b]].
            sin_a, sin_b = -sin_b, -sin_a
        _rotate_heads(x_ptr, out_ptr, x_row, o_row, H, D, HALF, sx_h, sx_d, so_h, so_d,
                      cos_a, sin_a, cos_b, sin_b, j, j_mask, INTERLEAVED, BLOCK_H, BLOCK_HALF)
        if HAS_SECOND:
            _rotate_heads(x2_ptr, out2_ptr, x2_row, o2_row, H2, D, HALF, sx2_h, sx2_d, so2_h, so2_d,
                          cos_a, sin_a, cos_b, sin_b, j, j_mask, INTERLEAVED, BLOCK_H, BLOCK_HALF)
    if copy_pass:
        _copy_pass(x_ptr, out_ptr, x_row, o_row, H, D, HALF, sx_h, sx_d, so_h, so_d, BLOCK_H, BLOCK_HALF)
        if HAS_SECOND:
            _copy_pass(x2_ptr, out2_ptr, x2_row, o2_row, H2, D, HALF, sx2_h, sx2_d, so2_h, so2_d,
                       BLOCK_H, BLOCK_HALF)
