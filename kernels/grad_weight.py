"""Routed weight gradients (kernels/GEMM.md kernels 8 and 9):
dW_e[n, k] = sum_{r in segment e} dY[row(r), n] * X[row(r), k]   (+ db_e[n]).
routed_grad_weight_kernel reads the rows by pointer (through perm, or expert-ordered buffers) and can sum the bias
gradient; routed_grad_weight_tma_kernel (sm_90) reads expert-ordered buffers through descriptors and stores through
TMA (its bias gradients come from dY's gather: kernels/gather_rows.py).

Conventions (experts, perm / seg): kernels/gemm_tiles.py.
"""
import triton
import triton.language as tl

from kernels.gemm_tiles import _tile_mn
from kernels.pdl import grid_dependency_sync


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
    expert 1 (a frozen expert's dW is not touched). Persistent: program pid takes the [BN, BK] tiles pid, pid + P,
    ... (P programs, at most one per SM; GROUP_N-grouped order), and for each its K steps over expert 0's rows, then
    expert 1's: all of its tiles' steps are ONE loop, so that the pipeline runs on from a tile's last step into the
    next tile's first loads, and a tile's epilogues (expert 0's, then expert 1's; TMA stores) run while those loads
    are in flight. One program per tile instead (the grid of a dense GEMM) paid a prologue and a CTA start per tile:
    at 1024 tokens, 32 steps of 32 rows a tile, 1.3-1.5x cuBLAS's time. A program reduces over all M rows, as in a
    dense GEMM (one program per expert and tile would pay for the split: twice the tiles, each with its own
    prologue and epilogue). With pointer stores, the epilogues inside the loop spill (255 registers).
    Expert e's rows start at seg[e] (a multiple of the routing ALIGN, which BLOCK_R divides) and number
    count_e = seg[3 + e]; its steps stop at the first multiple of BLOCK_R past them, not at the segment's padded end.
    The padding rows read must be zero (gather_rows output, or expert-ordered GEMM outputs without bias), so every
    step is a whole, unmasked TMA tile. An expert without rows gets zeros. No atomics, deterministic. Bias gradients
    are not summed here: a row sum in the loop costs every program a pass of the dY tile through registers (they
    come from dY's gather: gather_rows_kernel(COLSUM), then expert_colsum_kernel)."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    num_tiles = tiles_n * tiles_k
    want0 = (experts & 1) != 0
    want1 = (experts & 2) != 0
    steps0 = tl.where(want0, tl.cdiv(tl.load(seg_ptr + 3), BLOCK_R), 0)
    steps1 = tl.where(want1, tl.cdiv(tl.load(seg_ptr + 4), BLOCK_R), 0)
    steps = steps0 + steps1
    lo1 = tl.load(seg_ptr + 1)  # expert 0's rows start at 0
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # An expert without rows gets its zeros first, under the loop's first loads: stored after the loop they would add
    # a second epilogue at its end.
    if (want0 and steps0 == 0) or (want1 and steps1 == 0):
        for t in range(pid, num_tiles, nprog):
            pid_n, pid_k = _tile_mn(t, tiles_n, tiles_k, GROUP_N)
            if want0 and steps0 == 0:
                dw0_desc.store([pid_n * BLOCK_N, pid_k * BLOCK_K], acc.to(dw0_desc.dtype))
            if want1 and steps1 == 0:
                dw1_desc.store([pid_n * BLOCK_N, pid_k * BLOCK_K], acc.to(dw1_desc.dtype))
    # (tile, s): the step s of tile `tile`, carried from step to step: computed from the loop index instead (two
    # integer divisions per step), the loop ran 1.5-2.2x slower than one program per tile (H100, JIT A/B)
    tile = pid - nprog
    s = steps - 1
    n0 = 0
    k0 = 0
    for _ in range(0, tl.cdiv(num_tiles - pid, nprog) * steps):
        s = tl.where(s == steps - 1, 0, s + 1)
        if s == 0:
            tile += nprog
            pid_n, pid_k = _tile_mn(tile, tiles_n, tiles_k, GROUP_N)
            n0 = pid_n * BLOCK_N
            k0 = pid_k * BLOCK_K
        r = tl.where(s < steps0, s * BLOCK_R, lo1 + (s - steps0) * BLOCK_R)
        dyt = dy_desc.load([r, n0])  # [BR, BN]
        xt = x_desc.load([r, k0])  # [BR, BK]
        acc = tl.dot(dyt.T, xt, acc, input_precision=INPUT_PRECISION)
        # an expert's last step: its tile is stored, and the next expert (or tile) starts from zero. One branch, one
        # reset: with a reset in each of two branches, ptxas waits for every wgmma of the loop before the next
        if (s == steps0 - 1) or (s == steps - 1):
            if s == steps0 - 1:
                dw0_desc.store([n0, k0], acc.to(dw0_desc.dtype))
            else:
                dw1_desc.store([n0, k0], acc.to(dw1_desc.dtype))
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


# ----------------------------------------------------------------------------------------------
# Python launchers (JIT / TRITON_INTERPRET use; they also document the grids for the C++ side)
# ----------------------------------------------------------------------------------------------
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
    routed_grad_weight_kernel[grid](dy_ptr=dy, x_ptr=x, perm_ptr=perm, seg_ptr=seg, dw0_ptr=dw0, dw1_ptr=dw1,
                                    db0_ptr=db0, db1_ptr=db1, N=N, K=K, stride_dym=dy.stride(0), stride_xm=x.stride(0),
                                    stride_dwn=dw0.stride(0), first_expert=first, GATHER=gather, HAS_DBIAS=has_db,
                                    ACCUMULATE=accumulate, INPUT_PRECISION=input_precision, BLOCK_N=BN, BLOCK_K=BK,
                                    BLOCK_R=BR, GROUP_N=GROUP_N, num_warps=num_warps, num_stages=num_stages)
    return dw0, dw1, (db0 if has_db else None), (db1 if has_db else None)


def launch_routed_grad_weight_tma(dy_pad, x_pad, seg, dw0, dw1, *, input_precision="tf32", BN=128, BK=256, BR=32,
                                  GROUP_N=8, num_warps=8, num_stages=5, experts=(0, 1), num_programs=None):
    """dy_pad [M_pad, N], x_pad [M_pad, K] expert-ordered (zero padding rows, e.g. from launch_gather_rows); dw0, dw1
    contiguous [N, K]. experts: as in launch_routed_grad_weight. num_programs: the persistent grid's size (the SMs,
    as the C++ launcher runs it), or None for one program per tile, as the linear launchers take it."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    N, K = dw0.shape
    dy_desc = TensorDescriptor.from_tensor(dy_pad, [BR, BN])
    x_desc = TensorDescriptor.from_tensor(x_pad, [BR, BK])
    dw0_desc = TensorDescriptor.from_tensor(dw0, [BN, BK])
    dw1_desc = TensorDescriptor.from_tensor(dw1, [BN, BK])
    _grad_weight_experts(experts)
    tiles = triton.cdiv(N, BN) * triton.cdiv(K, BK)
    grid = (min(num_programs or tiles, tiles), )
    routed_grad_weight_tma_kernel[grid](dy_desc=dy_desc, x_desc=x_desc, seg_ptr=seg, dw0_desc=dw0_desc,
                                        dw1_desc=dw1_desc, N=N, K=K, experts=sum(1 << e for e in experts),
                                        INPUT_PRECISION=input_precision, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=BR,
                                        GROUP_N=GROUP_N, num_warps=num_warps, num_stages=num_stages)
    return dw0, dw1
