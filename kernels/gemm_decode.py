"""Decode GEMM (a few tokens, any sm_80+; kernels/GEMM.md kernels 11 and 11a): the routed linear forward as a weight
stream.

A decode step's GEMM (M = 1 to a few tokens) is bound by reading the weights once. A grid of [BLOCK_M, BLOCK_N] tiles
over N alone leaves most SMs idle: 64 programs at N = 4096 with 64-column tiles, on 132 SMs, and one token uses one
expert's half of them. Here the reduction is split too: program (n, s, e) reads the [BLOCK_N, k_split] slab s of
expert e's weight W_e [N, K], and the launcher picks n_split (grid dimension 1) to fill the GPU where N's column
tiles alone do not (decode_split). The programs are not persistent: several fit on an SM, so a grid a little above
the SM count has no tail wave (the persistent routed GEMMs at M = 1 with N = 4608-6144 do: 1.1-1.5 waves).

No routing: each program reads the (at most BLOCK_M) mask entries, exits before reading a weight byte when no token
of its expert is present, and loads only its expert's rows of x (the others as zeros). Each token row belongs to one
expert, so the programs of different experts write disjoint rows. One split: the program adds the bias (and a
residual: a block's residual add) and writes out. Several: it writes its fp32 partial sums to ws [n_split, M, N]
(every entry whose row is its expert's), and decode_reduce_kernel sums the splits (in a fixed order: deterministic, no
atomics) with the bias and residual, into out.

Conventions (experts e = 0 text / mask false, e = 1 vision / mask true; fp32 accumulation): kernels/gemm_tiles.py.
Each expert's weight has its own base and row stride (two separate tensors in either memory order, or views of one),
so no layout needs a copy.
"""
import triton
import triton.language as tl

from kernels.gemm_tiles import _add_bias
from kernels.pdl import grid_dependency_sync


@triton.jit
def routed_decode_linear_kernel(x_ptr, mask_ptr, w0_ptr, w1_ptr, bias0_ptr, bias1_ptr, res_ptr, out_ptr, ws_ptr,
                                M, N, K, k_split, stride_xm, stride_w0, stride_w1, stride_om,
                                has_bias, has_residual, INPUT_PRECISION: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr, PDL: tl.constexpr = False):
    """out[i] = x[i] W_{e(i)}^T (+ bias_{e(i)}) (+ residual[i], res_ptr of out's row stride) for the M <= BLOCK_M rows
    of x; k_split: the reduction length of one split, a multiple of BLOCK_K (split s covers [s * k_split, (s + 1) *
    k_split) of K). GROUP_M: unused (the config tables' shared fields)."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    e = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    in_m = rows < M
    vision = tl.load(mask_ptr + rows, mask=in_m, other=0) != 0
    mine = in_m & (vision == (e == 1))
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        k0 = s * k_split
        if e == 0:
            w_ptrs = w0_ptr + offs_n.to(tl.int64)[None, :] * stride_w0 + (k0 + offs_k)[:, None]
        else:
            w_ptrs = w1_ptr + offs_n.to(tl.int64)[None, :] * stride_w1 + (k0 + offs_k)[:, None]
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + (k0 + offs_k)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, k_split, BLOCK_K):
            k_ok = (k0 + kk + offs_k) < K  # only the last split reaches past K
            a = tl.load(x_ptrs, mask=mine[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        keep = mine[:, None] & n_ok[None, :]
        if tl.num_programs(1) == 1:
            if has_bias:
                acc = _add_bias(acc, bias0_ptr, bias1_ptr, e, offs_n, N)
            offs = rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            if has_residual:
                acc += tl.load(res_ptr + offs, mask=keep, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=keep)
        else:
            ws_ptrs = ws_ptr + ((s * M + rows).to(tl.int64) * N)[:, None] + offs_n[None, :]
            tl.store(ws_ptrs, acc, mask=keep)


@triton.jit
def decode_reduce_kernel(ws_ptr, mask_ptr, bias0_ptr, bias1_ptr, res_ptr, out_ptr, M, N, n_split, stride_om,
                         has_bias, has_residual, MAX_SPLITS: tl.constexpr,
                         BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """out[i, n] = the sum of ws[s, i, n] over the n_split <= MAX_SPLITS splits (+ bias_{e(i)}[n]) (+ residual[i, n],
    res_ptr of out's row stride); grid (M, cdiv(N, BLOCK_N)). All splits are loaded at once (one memory latency, not
    n_split in a row) and summed by one tl.sum, whose order is fixed by the compiled kernel: the same bits on every
    run."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    i = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    splits = tl.arange(0, MAX_SPLITS)
    ws_ptrs = ws_ptr + ((splits.to(tl.int64) * M + i) * N)[:, None] + offs_n[None, :]
    acc = tl.sum(tl.load(ws_ptrs, mask=(splits < n_split)[:, None] & n_ok[None, :], other=0.0), axis=0)
    if has_bias:
        if tl.load(mask_ptr + i) != 0:
            acc += tl.load(bias1_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        else:
            acc += tl.load(bias0_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    offs = i.to(tl.int64) * stride_om + offs_n
    if has_residual:
        acc += tl.load(res_ptr + offs, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# decode_reduce_kernel's column block and most splits (in its variant key as "cols" and "splits"; csrc/ops/
# routed_gemm.cpp kDecodeReduceCols, kDecodeMaxSplits).
DECODE_REDUCE_COLS = 64
DECODE_MAX_SPLITS = 32


def split_k(K, n_split, BK):
    """(splits, k_split) of K cut into n_split splits of whole BK blocks: k_split, a multiple of BK, and how many
    splits hold K steps (fewer than n_split where the blocks do not divide evenly)."""
    k_split = max(triton.cdiv(triton.cdiv(K, BK), n_split) * BK, BK)
    return (triton.cdiv(K, k_split) if K > 0 else 1), k_split


def decode_split(N, K, BN, BK, sms):
    """(n_split, k_split) for N output columns and reduction length K (csrc/ops/routed_gemm.cpp decode_split computes
    the same). One split where one expert's column tiles reach half the SMs: its programs then read the weights about
    as fast as split ones, and a second kernel (the sum of the splits, ~1.5 us on an H100, plus its launch gap) would
    cost more than it saves. Below that, enough splits that one expert's programs number about twice the SMs, each
    split at least 4 K blocks, at most DECODE_MAX_SPLITS. k_split is a multiple of BK."""
    tiles_n = triton.cdiv(N, BN)
    k_blocks = triton.cdiv(K, BK)
    n_split = 1 if 2 * tiles_n >= sms else max(1, min(triton.cdiv(2 * sms, tiles_n), k_blocks // 4,
                                                       DECODE_MAX_SPLITS))
    return split_k(K, n_split, BK)


# ----------------------------------------------------------------------------------------------
# Python launcher (JIT / TRITON_INTERPRET use; it also documents the grids for the C++ side)
# ----------------------------------------------------------------------------------------------
def launch_routed_decode_linear(x, mask, w0, w1, bias0, bias1, out, *, n_split=None, sms=132, input_precision="tf32",
                                BM=16, BN=64, BK=128, num_warps=4, num_stages=4, residual=None, poison_ws=True):
    """out [M, N] = x [M, K] through each row's expert (mask [M] bool: True = expert 1 = w1) (+ residual, a tensor of
    out's shape and strides); M <= BM. n_split: the number of reduction splits, at most DECODE_MAX_SPLITS (default:
    decode_split's for `sms` SMs). poison_ws: the split workspace filled with NaN first (tests: every entry must be
    written); False leaves it unfilled, as the C++ launcher does (benchmarks/decode_tiles.py)."""
    M, K = x.shape
    N = w0.shape[0]
    assert M <= BM and mask.shape == (M, )
    if n_split is None:
        n_split, k_split = decode_split(N, K, BN, BK, sms)
    else:
        assert 1 <= n_split <= DECODE_MAX_SPLITS
        k_split = split_k(K, n_split, BK)[1]  # every split launched, those past K write zeros
    has_bias = bias0 is not None
    if not has_bias:
        bias0 = bias1 = out
    import torch
    ws = out
    if n_split > 1:
        ws = torch.empty((n_split, M, N), device=x.device)
        if poison_ws:
            ws.fill_(float("nan"))  # every entry of a row must be written by its expert's programs
    m8 = mask.view(torch.uint8)
    assert residual is None or (residual.shape == out.shape and residual.stride() == out.stride())
    res = out if residual is None else residual
    routed_decode_linear_kernel[(triton.cdiv(N, BN), n_split, 2)](
        x_ptr=x, mask_ptr=m8, w0_ptr=w0, w1_ptr=w1, bias0_ptr=bias0, bias1_ptr=bias1, res_ptr=res, out_ptr=out,
        ws_ptr=ws, M=M, N=N, K=K, k_split=k_split, stride_xm=x.stride(0), stride_w0=w0.stride(0),
        stride_w1=w1.stride(0), stride_om=out.stride(0), has_bias=has_bias, has_residual=residual is not None,
        INPUT_PRECISION=input_precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=1, num_warps=num_warps,
        num_stages=num_stages)
    if n_split > 1:
        decode_reduce_kernel[(M, triton.cdiv(N, DECODE_REDUCE_COLS))](
            ws_ptr=ws, mask_ptr=m8, bias0_ptr=bias0, bias1_ptr=bias1, res_ptr=res, out_ptr=out, M=M, N=N,
            n_split=n_split, stride_om=out.stride(0), has_bias=has_bias, has_residual=residual is not None,
            MAX_SPLITS=DECODE_MAX_SPLITS, BLOCK_N=DECODE_REDUCE_COLS)
    return out

