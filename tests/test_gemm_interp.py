"""Routed GEMM kernels under the Triton CPU interpreter (small shapes, float64 references).

Run: bash scripts/test.sh tests/test_gemm_interp.py (or .venv/bin/python -m pytest -q tests/test_gemm_interp.py after it)
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton_interp_compat  # noqa: E402,F401  (Triton 3.6 interpreter: numpy >= 2.5, bool arguments)
from kernels.gather_rows import (GATHER_ROWS, launch_expert_colsum, launch_gather_rows,  # noqa: E402
                                 launch_route_gather_rows)
from kernels.gemm_decode import DECODE_MAX_SPLITS, decode_split, launch_routed_decode_linear  # noqa: E402
from kernels.gemm_gather_tma import launch_routed_linear_gather_tma, launch_routed_swiglu_gather_tma  # noqa: E402
from kernels.gemm_pointer import launch_routed_linear, launch_routed_swiglu  # noqa: E402
from kernels.gemm_tiles import _expert_tile_mn  # noqa: E402
from kernels.gemm_tma import (launch_routed_linear_tma, launch_routed_swiglu_pair_bwd_tma,  # noqa: E402
                              launch_routed_swiglu_pair_tma, launch_routed_swiglu_tma)
from kernels.grad_weight import launch_routed_grad_weight, launch_routed_grad_weight_tma  # noqa: E402
from kernels.routing import one_block_size, padded_rows, route, route_shared, route_single, shared_layout  # noqa: E402
from reference_routed import rel_err as _rel_err  # noqa: E402

# A numpy warning under the interpreter is a kernel computing something it should not (a division by zero in a lane
# that a tl.where later discards is undefined on the GPU): an error here.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

ALIGN = 16
T = dict(BM=16, BN=16, BK=16)
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def make_mask(kind, M, gen):
    if kind == "random":
        return torch.rand(M, generator=gen) < 0.4
    if kind == "mostly_true":  # expert 1 has more rows: the grad-weight kernels give it the first half of the grid
        return torch.rand(M, generator=gen) < 0.7
    if kind == "all_true":
        return torch.ones(M, dtype=torch.bool)
    if kind == "all_false":
        return torch.zeros(M, dtype=torch.bool)
    if kind == "span":
        m = torch.zeros(M, dtype=torch.bool)
        m[M // 3: M // 3 + max(1, M // 4)] = True
        return m
    raise ValueError(kind)


MASKS = ["random", "all_true", "all_false", "span"]
GRAD_WEIGHT_MASKS = MASKS + ["mostly_true"]


def rnd(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def rel_err(out, ref):
    """reference_routed.rel_err once out is finite (a NaN-poisoned element left unwritten shows)."""
    assert torch.isfinite(out).all(), "non-finite (unwritten?) output"
    return _rel_err(out, ref)


def gathered(x, perm, rows):
    """x's rows in expert order, [rows, C]: launch_gather_rows through perm (small test blocks) into a
    NaN-poisoned buffer, which the gather writes row by row (zeros where perm < 0)."""
    xg = torch.full((rows, x.shape[1]), float("nan"), dtype=x.dtype)
    return launch_gather_rows(x, xg, perm, BLOCK_R=16, BLOCK_C=32)


def routed_by_gather(mask, x):
    """launch_route_gather_rows of x [M, C] into poisoned outputs (perm and seg 7, the gathered rows NaN), every
    entry of which the kernel must write: (xg [M, C], perm, seg). Row blocks of 16, column blocks of 32."""
    M = mask.shape[0]
    perm = torch.full((padded_rows(M, 1), ), 7, dtype=torch.int32)
    seg = torch.full((5, ), 7, dtype=torch.int32)
    xg = torch.full((M, x.shape[1]), float("nan"), dtype=x.dtype)
    launch_route_gather_rows(mask, x, xg, perm, seg, BLOCK_R=16, BLOCK_C=32)
    return xg, perm, seg


def ref_linear(x, w0, w1, b0, b1, mask):
    x, w0, w1 = x.double(), w0.double(), w1.double()
    y0 = x @ w0.T
    y1 = x @ w1.T
    if b0 is not None:
        y0 = y0 + b0.double()
        y1 = y1 + b1.double()
    return torch.where(mask[:, None], y1, y0)


def ref_swiglu_h(x, w1_0, w1_1, w3_0, w3_1, mask):
    x = x.double()

    def h(w1, w3):
        g = x @ w1.double().T
        return g * torch.sigmoid(g) * (x @ w3.double().T)

    return torch.where(mask[:, None], h(w1_1, w3_1), h(w1_0, w3_0))


def ref_gate_up(x, w1, w3, mask):
    """float64 gate and up pre-activations [M, N] of each token through its own expert (w1, w3 stacked [2, N, K])."""
    e = torch.where(mask, 1, 0)
    xd = x.double()
    return (torch.einsum("mk,mnk->mn", xd, w1.double()[e]), torch.einsum("mk,mnk->mn", xd, w3.double()[e]))


def ref_swiglu_grads(g, u, d):
    """float64 (h, d_up, d_gate) from gate g, up u and dh d (kernels/swiglu_backward.py)."""
    s = torch.sigmoid(g)
    act = g * s
    return act * u, d * act, d * u * s * (1 + g * (1 - s))


def prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


# ------------------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("M", [0, 1, 37, 300])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("path", ["one_block", "two_kernels"])
@pytest.mark.parametrize("align", [ALIGN, 1])  # 1: unaligned segments (the ffn forward's TMA path)
def test_routing(M, kind, path, align):
    gen = torch.Generator().manual_seed(M)
    mask = make_mask(kind, M, gen) if M > 0 else torch.zeros(0, dtype=torch.bool)
    M_pad = padded_rows(M, align)
    assert M_pad == (M + 128 if align == 1 else (-(-M // align) + 1) * align)
    perm = torch.full((M_pad, ), 7, dtype=torch.int32)  # poisoned: every entry must be written
    seg = torch.full((5, ), 7, dtype=torch.int32)
    # one_block: 512 >= M, one program; two_kernels: chunk 64 -> several blocks for M=300
    route(mask, align=align, chunk=64, one_block=512 if path == "one_block" else 0, perm=perm, seg=seg)
    rows1 = torch.nonzero(mask).flatten().to(torch.int32)
    rows0 = torch.nonzero(~mask).flatten().to(torch.int32)
    c0, c1 = rows0.numel(), rows1.numel()
    start1 = -(-c0 // align) * align
    end = start1 + -(-c1 // align) * align
    assert seg.tolist() == [0, start1, end, c0, c1]
    assert torch.equal(perm[:c0], rows0)
    assert (perm[c0:start1] == -1).all()
    assert torch.equal(perm[start1:start1 + c1], rows1)
    assert (perm[start1 + c1:] == -1).all()
    assert end <= M_pad


@pytest.mark.parametrize("M", [0, 1, 37, 64, 300])
@pytest.mark.parametrize("kind", MASKS)
def test_routing_shared(M, kind):
    """The `route` op's one-launch buffer: the aligned routing at 0 and the unaligned one at its section, each equal
    to what the routing kernels above write alone, and -1 in every other entry (the buffer is poisoned first). The
    layout, written out from csrc/ops/routed_gemm.h: 8 slots (seg and 3 unused) before each perm."""
    gen = torch.Generator().manual_seed(M + 1)
    mask = make_mask(kind, M, gen) if M > 0 else torch.zeros(0, dtype=torch.bool)
    section = -(-(M + 8 + 2 * 128) // 4) * 4
    size = section + 8 + M + 128
    assert shared_layout(M) == (padded_rows(M, 128), section, size)
    buf = torch.full((size, ), 7, dtype=torch.int32)
    route_shared(mask, block=64 if M <= 64 else 512, buf=buf)
    want = torch.full((size, ), -1, dtype=torch.int32)
    for off, align in ((0, 128), (section, 1)):
        perm, seg = route(mask, align=align)
        want[off:off + 5] = seg
        want[off + 8:off + 8 + perm.numel()] = perm
    assert torch.equal(buf, want), (buf - want).nonzero().flatten()[:8].tolist()


@pytest.mark.parametrize("M", [0, 1, 16, 17, 300])
@pytest.mark.parametrize("align", [ALIGN, 1])
def test_routing_single(M, align):
    perm, seg = route_single(M, "cpu", align=align, block=64)  # block 64 -> several programs for M=300
    end = -(-M // align) * align
    assert perm.shape == ((M + 128) if align == 1 else max(end, align), ) and perm.dtype == torch.int32
    assert torch.equal(perm[:M], torch.arange(M, dtype=torch.int32))
    assert (perm[M:] == -1).all()
    assert seg.tolist() == [0, end, end, M, 0]


@pytest.mark.parametrize("M", [0, 1, 37, 300])
@pytest.mark.parametrize("kind", MASKS)
def test_route_gather_rows(M, kind):
    """route_gather_rows_kernel: the unaligned routing (ALIGN = 1) of the mask and the gather through it in one
    launch. perm and seg must equal the routing kernel's, entry for entry (the GEMMs after it read them), and dst
    must hold x's rows in expert order. Row blocks of 16 (several programs, each counting the mask itself), two
    column blocks, x a column slice of a wider tensor (row stride != C)."""
    gen = torch.Generator().manual_seed(M + 5)
    mask = make_mask(kind, M, gen) if M > 0 else torch.zeros(0, dtype=torch.bool)
    x = rnd(gen, M, 50)[:, 3:43]
    perm_ref, seg_ref = route(mask, align=1)
    dst, perm, seg = routed_by_gather(mask, x)
    assert torch.equal(seg, seg_ref) and torch.equal(perm, perm_ref)
    assert torch.equal(dst, x[perm_ref[:M].long()])


# ------------------------------------------------------------------------------------ decode linear
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_split", [1, 3, DECODE_MAX_SPLITS])  # 1: the program writes out; more: fp32 partials
# summed by decode_reduce_kernel (32 splits of K = 72: most of them wholly past K, their partials zero)
def test_decode_linear(dtype, kind, bias, n_split):
    # M < BLOCK_M rows, N and K not multiples of their blocks (K = 72: the last split is partly past K), each expert's
    # weight with its own row stride (a column slice of a wider tensor, and a plain one)
    M, N, K = 11, 40, 72
    gen = torch.Generator().manual_seed(5)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K + 8, dtype=dtype)[:, :K]
    w0, w1 = rnd(gen, N, K + 24, dtype=dtype)[:, 3:K + 3], rnd(gen, N, K, dtype=dtype)
    b0 = rnd(gen, N, dtype=dtype) if bias else None
    b1 = rnd(gen, N, dtype=dtype) if bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch_routed_decode_linear(x, mask, w0, w1, b0, b1, out, n_split=n_split, input_precision=prec(dtype), BM=16,
                                BN=16, BK=16)
    assert rel_err(out, ref_linear(x, w0, w1, b0, b1, mask)) < TOL[dtype]


@pytest.mark.parametrize("M", [1, 16])
def test_decode_linear_one_token_per_expert_and_full_block(M):
    # M = 1 (one expert's programs exit at once), M = BLOCK_M; the default split for a small "GPU" of 8 SMs
    N, K = 48, 256
    gen = torch.Generator().manual_seed(6)
    for kind in ("all_true", "all_false", "random"):
        mask = make_mask(kind, M, gen)
        x, w0, w1 = rnd(gen, M, K), rnd(gen, N, K), rnd(gen, N, K)
        n_split, _ = decode_split(N, K, 16, 16, sms=8)
        assert n_split > 1
        out = torch.full((M, N), float("nan"))
        launch_routed_decode_linear(x, mask, w0, w1, None, None, out, sms=8, input_precision="ieee", BM=16, BN=16,
                                    BK=16)
        assert rel_err(out, ref_linear(x, w0, w1, None, None, mask)) < 1e-5


@pytest.mark.parametrize("N,K,sms", [(4096, 4096, 132), (1280, 8192, 132), (12288, 4096, 132), (1024, 100, 132),
                                     (64, 0, 8), (28672, 4096, 114), (64, 65536, 132), (2048, 4096, 132)])
def test_decode_split(N, K, sms):
    # the launcher's split: k_split a multiple of BK, n_split slabs cover K (none wholly past it); none where one
    # expert's column tiles reach half the SMs; else at least 4 K blocks per split, at most DECODE_MAX_SPLITS (what
    # decode_reduce_kernel sums), and one expert's programs about twice the SM count where K and that cap allow
    BN, BK = 32, 256
    n_split, k_split = decode_split(N, K, BN, BK, sms)
    tiles, k_blocks = -(-N // BN), -(-K // BK)
    assert k_split % BK == 0 and 1 <= n_split <= DECODE_MAX_SPLITS
    assert n_split * k_split >= K and (n_split - 1) * k_split < max(K, 1)
    if 2 * tiles >= sms:
        assert n_split == 1
    else:
        assert n_split == 1 or k_split >= 4 * BK
        assert tiles * n_split >= 0.9 * min(2 * sms, tiles * max(1, k_blocks // 4), tiles * DECODE_MAX_SPLITS)


# ------------------------------------------------------------------------------------ pointer linear
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_ptr(dtype, kind, bias):
    M, N, K = 37, 24, 40
    gen = torch.Generator().manual_seed(1)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    w0, w1 = rnd(gen, N, K, dtype=dtype), rnd(gen, N, K, dtype=dtype)
    b0 = rnd(gen, N, dtype=dtype) if bias else None
    b1 = rnd(gen, N, dtype=dtype) if bias else None
    perm, seg = route(mask, align=ALIGN)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch_routed_linear(x, w0, w1, b0, b1, out, perm, seg, N, K, input_precision=prec(dtype), **T)
    assert rel_err(out, ref_linear(x, w0, w1, b0, b1, mask)) < TOL[dtype]


def test_linear_ptr_tf32_and_shapes():
    # fp32 with tf32 precision, a larger odd shape with several K steps and GROUP_M swizzling
    M, N, K = 70, 33, 50
    gen = torch.Generator().manual_seed(2)
    mask = make_mask("random", M, gen)
    x, w0, w1 = rnd(gen, M, K), rnd(gen, N, K), rnd(gen, N, K)
    b0, b1 = rnd(gen, N), rnd(gen, N)
    perm, seg = route(mask, align=32)
    out = torch.full((M, N), float("nan"))
    launch_routed_linear(x, w0, w1, b0, b1, out, perm, seg, N, K, input_precision="tf32", GROUP_M=2, **T)
    assert rel_err(out, ref_linear(x, w0, w1, b0, b1, mask)) < 2e-3


def test_linear_ptr_m0():
    N, K = 24, 40
    gen = torch.Generator().manual_seed(3)
    mask = torch.zeros(0, dtype=torch.bool)
    x = torch.empty(0, K)
    w0, w1 = rnd(gen, N, K), rnd(gen, N, K)
    b0, b1 = rnd(gen, N), rnd(gen, N)
    perm, seg = route(mask, align=ALIGN)
    out = torch.empty(0, N)
    launch_routed_linear(x, w0, w1, b0, b1, out, perm, seg, N, K, **T)


# ---------------------------------------------------------------------- grad-input (W not transposed)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "all_true"])
def test_grad_input_ptr(dtype, kind):
    M, N, K = 37, 24, 40  # linear: x [M, K], W_e [N, K]; dX = dY @ W_e
    gen = torch.Generator().manual_seed(4)
    mask = make_mask(kind, M, gen)
    dy = rnd(gen, M, N, dtype=dtype)
    w0, w1 = rnd(gen, N, K, dtype=dtype), rnd(gen, N, K, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    dx = torch.full((M, K), float("nan"), dtype=dtype)
    launch_routed_linear(dy, w0, w1, None, None, dx, perm, seg, K, N, w_transposed=True,
                         input_precision=prec(dtype), **T)
    dyd = dy.double()
    ref = torch.where(mask[:, None], dyd @ w1.double(), dyd @ w0.double())
    assert rel_err(dx, ref) < TOL[dtype]


# ------------------------------------------------------------------------------------ pointer swiglu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "all_false", "span"])
def test_swiglu_ptr(dtype, kind):
    M, I, K = 37, 24, 40
    gen = torch.Generator().manual_seed(5)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    ws = [rnd(gen, I, K, dtype=dtype) for _ in range(4)]  # w1_0, w1_1, w3_0, w3_1
    perm, seg = route(mask, align=ALIGN)
    ref = ref_swiglu_h(x, ws[0], ws[1], ws[2], ws[3], mask)
    # original-order output
    h = torch.full((M, I), float("nan"), dtype=dtype)
    launch_routed_swiglu(x, *ws, h, perm, seg, I, K, scatter_out=True, input_precision=prec(dtype), **T)
    assert rel_err(h, ref) < TOL[dtype]
    # expert-ordered padded output: rows [0, seg[2]) written, padding rows are zero
    hp = torch.full((perm.shape[0], I), float("nan"), dtype=dtype)
    launch_routed_swiglu(x, *ws, hp, perm, seg, I, K, scatter_out=False, input_precision=prec(dtype), **T)
    valid = perm >= 0
    assert rel_err(hp[valid], ref[perm[valid].long()]) < TOL[dtype]
    end = int(seg[2])
    assert (hp[:end][~valid[:end]] == 0).all()


# ------------------------------------------------------------------------------------------ TMA path
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS)
def test_linear_tma(dtype, kind):
    M, N, K = 37, 24, 40
    gen = torch.Generator().manual_seed(6)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    w = rnd(gen, 2, N, K, dtype=dtype)  # stacked [w0; w1]
    b0, b1 = rnd(gen, N, dtype=dtype), rnd(gen, N, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    xg = gathered(x, perm, perm.shape[0])
    assert torch.isfinite(xg).all()
    out = torch.full((M, N), float("nan"), dtype=dtype)
    # 3 persistent programs over 8 tiles
    launch_routed_linear_tma(xg, w, b0, b1, out, perm, seg, input_precision=prec(dtype), num_programs=3, **T)
    assert rel_err(out, ref_linear(x, w[0], w[1], b0, b1, mask)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32])
def test_grad_input_tma(dtype):
    M, N, K = 37, 24, 40
    gen = torch.Generator().manual_seed(7)
    mask = make_mask("random", M, gen)
    dy = rnd(gen, M, N, dtype=dtype)
    w = rnd(gen, 2, N, K, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    dyg = torch.empty(perm.shape[0], N, dtype=dtype)
    launch_gather_rows(dy, dyg, perm, BLOCK_R=16, BLOCK_C=32)
    dx = torch.full((M, K), float("nan"), dtype=dtype)
    launch_routed_linear_tma(dyg, w, None, None, dx, perm, seg, w_transposed=True, input_precision="ieee",
                             num_programs=5, **T)
    dyd = dy.double()
    ref = torch.where(mask[:, None], dyd @ w[1].double(), dyd @ w[0].double())
    assert rel_err(dx, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "all_true"])
def test_ffn_tma(dtype, kind):
    """gather -> swiglu (TMA, expert-ordered h) -> down (TMA, scatter) == dual-expert SwiGLU MLP."""
    M, H, I = 37, 40, 24
    gen = torch.Generator().manual_seed(8)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, H, dtype=dtype)
    w1, w3 = rnd(gen, 2, I, H, dtype=dtype), rnd(gen, 2, I, H, dtype=dtype)
    w2 = rnd(gen, 2, H, I, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    M_pad = perm.shape[0]
    xg = gathered(x, perm, M_pad)
    h = torch.zeros(M_pad, I, dtype=dtype)  # rows >= seg[2] are never written (left zero here)
    launch_routed_swiglu_tma(xg, w1, w3, h, perm, seg, input_precision=prec(dtype), num_programs=4, **T)
    out = torch.full((M, H), float("nan"), dtype=dtype)
    launch_routed_linear_tma(h, w2, None, None, out, perm, seg, input_precision=prec(dtype), **T)
    hr = ref_swiglu_h(x, w1[0], w1[1], w3[0], w3[1], mask)
    ref = torch.where(mask[:, None], hr @ w2[1].double().T, hr @ w2[0].double().T)
    assert rel_err(out, ref) < 3 * TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["pointer", "tma", "tma_in_place"])
def test_down_projection_residual(dtype, path):
    """HAS_RESIDUAL (the ffn down projection's residual add): out = h·W2_eᵀ + residual, the residual read at the rows
    the epilogue writes. pointer: expert-ordered h scattered to token rows (aligned routing); tma: the same on the TMA
    kernel; tma_in_place: one expert in token order (one_rows), no perm. Rows the GEMM skips must stay untouched
    (NaN poison around the output), so the residual is read only where out is written."""
    M, H, I = 37, 40, 24
    gen = torch.Generator().manual_seed(21)
    mask = make_mask("random", M, gen) if path != "tma_in_place" else torch.zeros(M, dtype=torch.bool)
    w2 = rnd(gen, 2, H, I, dtype=dtype)
    hx = rnd(gen, M, I, dtype=dtype)  # the intermediate, token order
    residual = rnd(gen, M, H, dtype=dtype)
    out_all = torch.full((M + 8, H), float("nan"), dtype=dtype)
    out = out_all[:M]
    if path == "tma_in_place":
        launch_routed_linear_tma(hx, w2[:1], None, None, out, None, None, scatter_out=False, input_precision=prec(dtype),
                                 num_programs=3, one_rows=M, residual=residual, **T)
    else:
        perm, seg = route(mask, align=ALIGN)
        h = gathered(hx, perm, perm.shape[0])  # expert-ordered
        if path == "pointer":
            launch_routed_linear(h, w2[0], w2[1], None, None, out, perm, seg, H, I, gather_a=False, scatter_out=True,
                                 input_precision=prec(dtype), residual=residual, **T)
        else:
            launch_routed_linear_tma(h, w2, None, None, out, perm, seg, input_precision=prec(dtype), num_programs=3,
                                     residual=residual, **T)
    w_tok = torch.where(mask[:, None, None], w2[1].double()[None], w2[0].double()[None])  # [M, H, I]
    ref = torch.einsum("mi,mhi->mh", hx.double(), w_tok) + residual.double()
    assert rel_err(out, ref) < 3 * TOL[dtype]
    assert torch.isnan(out_all[M:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["pointer", "tma", "gather_tma", "gather_tma_routes", "decode", "decode_split"])
def test_linear_forward_residual(dtype, path):
    """HAS_RESIDUAL on every kernel of linear_dual's forward (its `residual`): out = x·W_eᵀ + bias_e + residual, one
    rounding. pointer: x gathered through perm in the kernel; tma: x pre-gathered, expert-ordered; gather_tma: x's rows
    gathered inside the TMA GEMM (and routing the mask itself); decode: the decode GEMM, its program writing out or
    (decode_split) decode_reduce_kernel summing 3 splits. Output rows sit in a NaN-poisoned buffer with a wider row
    stride than the residual's rows use, so a residual read at the wrong rows or a write past them shows."""
    M, N, K = (13, 40, 72) if path.startswith("decode") else (37, 24, 40)
    gen = torch.Generator().manual_seed(23)
    mask = make_mask("random", M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    w = rnd(gen, 2, N, K, dtype=dtype)
    b0, b1 = rnd(gen, N, dtype=dtype), rnd(gen, N, dtype=dtype)
    out_all = torch.full((M + 4, N + 8), float("nan"), dtype=dtype)
    out = out_all[:M, :N]
    residual = rnd(gen, M + 4, N + 8, dtype=dtype)[:M, :N]  # out's shape and strides, other values
    if path.startswith("decode"):
        launch_routed_decode_linear(x, mask, w[0], w[1], b0, b1, out, n_split=3 if path == "decode_split" else 1,
                                    input_precision=prec(dtype), BM=16, BN=16, BK=16, residual=residual)
    elif path.startswith("gather_tma"):
        routes = path == "gather_tma_routes"
        perm, seg, _ = routed_here(mask, ALIGN) if routes else (*route(mask, align=ALIGN), None)
        launch_routed_linear_gather_tma(x, w, b0, b1, out, perm, seg, mask=mask, route_block=64 if routes else 0,
                                        align=ALIGN, input_precision=prec(dtype), num_programs=3, residual=residual, **T)
    else:
        perm, seg = route(mask, align=ALIGN)
        if path == "pointer":
            launch_routed_linear(x, w[0], w[1], b0, b1, out, perm, seg, N, K, gather_a=True, scatter_out=True,
                                 input_precision=prec(dtype), residual=residual, **T)
        else:
            launch_routed_linear_tma(gathered(x, perm, perm.shape[0]), w, b0, b1, out, perm, seg,
                                     input_precision=prec(dtype), num_programs=3, residual=residual, **T)
    ref = ref_linear(x, w[0], w[1], b0, b1, mask) + residual.double()
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.isnan(out_all[M:]).all() and torch.isnan(out_all[:, N:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["tma", "tma_stream_k", "pointer"])
def test_grad_input_accumulates(dtype, path):
    """HAS_RESIDUAL on the grad-input (W_TRANSPOSED, rows scattered to token order): the ffn backward's dx = dgate·W1_e
    + dup·W3_e, whose second GEMM takes the first one's output as its residual and writes over it (the residual IS
    the output). Each element must be read before it is written by the same program, also where stream-K cuts a tile
    (its sum's epilogue adds the residual once). tma: expert-ordered A; pointer: token-order A gathered through perm
    (the pointer ffn backward). Output rows sit in a NaN-poisoned buffer with a wider row stride."""
    M, H, I = 37, 40, 88  # grad-input: 3 column tiles of H, 6 K steps of I: stream-K cuts tiles into pieces
    gen = torch.Generator().manual_seed(25)
    mask = make_mask("random", M, gen)
    dgate, dup = rnd(gen, M, I, dtype=dtype), rnd(gen, M, I, dtype=dtype)
    w1, w3 = rnd(gen, 2, I, H, dtype=dtype), rnd(gen, 2, I, H, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    out_all = torch.full((M + 4, H + 8), float("nan"), dtype=dtype)
    out = out_all[:M, :H]
    if path == "pointer":
        kw = dict(gather_a=True, scatter_out=True, w_transposed=True, input_precision=prec(dtype), **T)
        launch_routed_linear(dgate, w1[0], w1[1], None, None, out, perm, seg, H, I, **kw)
        launch_routed_linear(dup, w3[0], w3[1], None, None, out, perm, seg, H, I, residual=out, **kw)
    else:
        kw = dict(scatter_out=True, w_transposed=True, input_precision=prec(dtype), num_programs=3, **T)
        if path == "tma_stream_k":  # the fewest programs whose last round is at most half full: stream-K shares it
            tiles = sum(-(-int(c) // T["BM"]) for c in seg[3:]) * -(-H // T["BN"])
            kw.update(STREAM_K=1, num_programs=next(p for p in range(4, tiles) if 0 < 2 * (tiles % p) <= p))
        launch_routed_linear_tma(gathered(dgate, perm, perm.shape[0]), w1, None, None, out, perm, seg, **kw)
        launch_routed_linear_tma(gathered(dup, perm, perm.shape[0]), w3, None, None, out, perm, seg, residual=out,
                                 **kw)
    sel = mask[:, None]
    ref = (torch.where(sel, dgate.double() @ w1[1].double(), dgate.double() @ w1[0].double())
           + torch.where(sel, dup.double() @ w3[1].double(), dup.double() @ w3[0].double()))
    assert rel_err(out, ref) < 2 * TOL[dtype]
    assert torch.isnan(out_all[M:]).all() and torch.isnan(out_all[:, H:]).all()


@pytest.mark.parametrize("path", ["tma", "tma_grad_input", "gather_tma"])
@pytest.mark.parametrize("parts", [4, 8])
@pytest.mark.parametrize("kind", ["random", "all_true"])
def test_split_tail_slices(path, parts, kind):
    """SPLIT_TAIL = 4 or 8 (a config's "split") on both linear TMA kernels: a last round of r tiles split in
    parts * r column slices of BN / parts, one per program, when they fit the programs (halves and their edge cases:
    test_linear_split_last_round). The grid is one program short of the tile count, so the last round is one tile,
    split; bias on the forward paths, a NaN-poisoned output with a wider row stride (an unwritten slice shows)."""
    M, N, K = 37, 192, 192  # 3 whole column tiles of 64 either way (the split tile is the last): slices of 8 or more
    BM, BN, BK = 16, 64, 16
    gen = torch.Generator().manual_seed(41)
    mask = make_mask(kind, M, gen)
    grad_input = path == "tma_grad_input"
    x = rnd(gen, M, N if grad_input else K)
    w = rnd(gen, 2, N, K)
    b0, b1 = (None, None) if grad_input else (rnd(gen, N), rnd(gen, N))
    n_out = K if grad_input else N
    perm, seg = route(mask, align=ALIGN)
    counts = seg[3:].tolist()
    tiles = sum(-(-c // BM) for c in counts) * -(-(K if grad_input else N) // BN)
    programs = tiles - 1
    assert 0 < parts * (tiles % programs) <= programs  # the case this test is meant to hit
    out_all = torch.full((M + 4, n_out + 8), float("nan"))
    out = out_all[:M, :n_out]
    kw = dict(input_precision="ieee", num_programs=programs, SPLIT_TAIL=parts, BM=BM, BN=BN, BK=BK)
    if path == "gather_tma":
        launch_routed_linear_gather_tma(x, w, b0, b1, out, perm, seg, align=ALIGN, **kw)
    else:
        launch_routed_linear_tma(gathered(x, perm, perm.shape[0]), w, b0, b1, out, perm, seg,
                                 w_transposed=grad_input, **kw)
    xd = x.double()
    if grad_input:
        ref = torch.where(mask[:, None], xd @ w[1].double(), xd @ w[0].double())
    else:
        ref = ref_linear(x, w[0], w[1], b0, b1, mask)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert torch.isnan(out_all[M:]).all() and torch.isnan(out_all[:, n_out:]).all()


@pytest.mark.parametrize("path", ["tma", "tma_grad_input", "tma_expert_ordered", "gather_tma", "gather_tma_routes"])
@pytest.mark.parametrize("grid, rounds", [("few", 1), ("many", 1), ("few", 2), ("full", 1)])
@pytest.mark.parametrize("kind", ["random", "span", "all_true"])
def test_stream_k(path, grid, rounds, kind, monkeypatch):
    """STREAM_K (a config's "stream_k") on both linear TMA kernels: the K steps of the last `rounds` rounds' tiles
    shared out over the programs, so that tiles are cut into pieces whose partial sums go through the workspace and are
    summed by the programs holding the tile's pieces. grid "few": the fewest programs (4 or more) whose last round is
    at most half full (with 2 rounds a share is then longer than a tile: some hold a whole tile between two pieces);
    "many": twice the tiles, one round half full; "full": one program more than the tiles, a round all but one program
    busy, which is not shared (every tile whole). The workspace starts as NaN (a partial read before it was
    written shows), the flags must be zero again after the launch, the output is NaN-poisoned with a wider row stride
    (bias and residual on the forward paths), and a second launch gives the same bits (the fixed order of the sums)."""
    import kernels.gemm_gather_tma as ggt
    import kernels.gemm_tma as gt
    seen = {}

    def spy(*a):
        grid, ws, flags = gt._stream_k_args.__wrapped__(*a)
        ws.fill_(float("nan"))
        seen.update(ws=ws, flags=flags)
        return grid, ws, flags
    spy.__wrapped__ = gt._stream_k_args
    monkeypatch.setattr(gt, "_stream_k_args", spy)
    monkeypatch.setattr(ggt, "_stream_k_args", spy)
    M, N, K = 37, 40, 88  # 3 row tiles; forward 3 column tiles of 6 K steps, grad-input 6 of 3: shares cut tiles
    gen = torch.Generator().manual_seed(31)
    mask = make_mask(kind, M, gen)
    grad_input = path == "tma_grad_input"
    x = rnd(gen, M, N if grad_input else K)
    w = rnd(gen, 2, N, K)
    forward = not grad_input and path != "tma_expert_ordered"
    b0, b1 = (rnd(gen, N), rnd(gen, N)) if forward else (None, None)
    n_out = K if grad_input else N
    perm, seg = route(mask, align=ALIGN)
    rows = perm.shape[0] if path == "tma_expert_ordered" else M
    residual = rnd(gen, rows + 4, n_out + 8)[:rows, :n_out] if forward else None
    row_tiles = int(seg[2]) // T["BM"] if path == "tma_expert_ordered" else sum(-(-int(c) // T["BM"]) for c in seg[3:])
    tiles = row_tiles * -(-n_out // T["BN"])
    programs = {"few": next((p for p in range(4, tiles) if 0 < 2 * (tiles % p) <= p), None), "many": 2 * tiles,
                "full": tiles + 1}[grid]
    assert programs is not None, tiles

    def run():
        out_all = torch.full((rows + 4, n_out + 8), float("nan"))
        out = out_all[:rows, :n_out]
        kw = dict(input_precision="ieee", num_programs=programs, STREAM_K=rounds, **T)
        if path.startswith("gather_tma"):
            routes = path == "gather_tma_routes"
            p, sg = routed_here(mask, ALIGN)[:2] if routes else (perm.clone(), seg.clone())
            launch_routed_linear_gather_tma(x, w, b0, b1, out, p, sg, mask=mask, route_block=64 if routes else 0,
                                            align=ALIGN, residual=residual, **kw)
        else:
            launch_routed_linear_tma(gathered(x, perm, perm.shape[0]), w, b0, b1, out, perm, seg,
                                     scatter_out=path != "tma_expert_ordered", w_transposed=grad_input,
                                     residual=residual, **kw)
        assert not seen["flags"].any(), "stream-K flags not reset"
        return out_all, out

    out_all, out = run()
    xd = x.double()
    if grad_input:
        ref = torch.where(mask[:, None], xd @ w[1].double(), xd @ w[0].double())
    elif path == "tma_expert_ordered":  # row r of the output belongs to token perm[r]; padding rows are zero rows
        valid = perm >= 0
        tok = perm.clamp_min(0).long()
        vis = mask[tok][:, None]
        ref = torch.where(vis, xd[tok] @ w[1].double().T, xd[tok] @ w[0].double().T) * valid[:, None]
    else:
        ref = ref_linear(x, w[0], w[1], b0, b1, mask) + residual.double()
    if path == "tma_expert_ordered":  # rows up to end = seg[2] are written, padding rows included
        end = int(seg[2])
        assert rel_err(out[:end], ref[:end]) < TOL[torch.float32]
    else:
        assert rel_err(out, ref) < TOL[torch.float32]
    assert torch.isnan(out_all[rows:]).all() and torch.isnan(out_all[:, n_out:]).all()
    published = (~torch.isnan(seen["ws"].flatten(1))).all(1).sum().item()
    if grid == "full":
        assert published == 0, "a last round of more than half the programs was shared"
    else:
        assert published > 0, "no tile was cut: the test does not reach the partial sums"
    again = run()[1]
    assert torch.equal(torch.nan_to_num(out, 0.0), torch.nan_to_num(again, 0.0))


@pytest.mark.parametrize("kind", ["random", "all_true", "all_false"])
def test_tma_row_tiles(kind):
    """Row tiles smaller than the routing alignment (BM = 16, ALIGN = 64): scattered outputs and h are computed only
    for the tiles that hold rows and only h's rows that belong to a token are written, while an expert-ordered
    linear output is written over the whole padded segments (padding rows zero without bias: the grad-weight reads
    them)."""
    M, N, K = 37, 24, 40
    dtype = torch.float32
    gen = torch.Generator().manual_seed(15)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    w = rnd(gen, 2, N, K, dtype=dtype)
    perm, seg = route(mask, align=64)
    xg = gathered(x, perm, perm.shape[0])
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch_routed_linear_tma(xg, w, None, None, out, perm, seg, input_precision="ieee", num_programs=3, **T)
    assert rel_err(out, ref_linear(x, w[0], w[1], None, None, mask)) < TOL[dtype]
    ordered = torch.full((perm.shape[0], N), float("nan"), dtype=dtype)
    launch_routed_linear_tma(xg, w, None, None, ordered, perm, seg, scatter_out=False, input_precision="ieee",
                             num_programs=3, **T)
    start1, end, c0, c1 = (int(v) for v in seg[1:])
    valid = perm >= 0
    assert rel_err(ordered[valid], ref_linear(x, w[0], w[1], None, None, mask)[perm[valid].long()]) < TOL[dtype]
    assert (ordered[:end][~valid[:end]] == 0).all() and torch.isnan(ordered[end:]).all()
    w1, w3 = rnd(gen, 2, N, K, dtype=dtype), rnd(gen, 2, N, K, dtype=dtype)
    h = torch.full((perm.shape[0], N), float("nan"), dtype=dtype)
    launch_routed_swiglu_tma(xg, w1, w3, h, perm, seg, input_precision="ieee", num_programs=3, **T)
    assert rel_err(h[valid], ref_swiglu_h(x, w1[0], w1[1], w3[0], w3[1], mask)[perm[valid].long()]) < TOL[dtype]
    assert torch.isfinite(h[valid]).all() and torch.isnan(h[~valid]).all()


@triton.jit
def _tile_order_kernel(out_ptr, t0, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    tile = tl.program_id(0)
    pid_m, pid_n = _expert_tile_mn(tile, t0, num_pid_m, num_pid_n, GROUP_M)
    tl.store(out_ptr + 2 * tile, pid_m)
    tl.store(out_ptr + 2 * tile + 1, pid_n)


@pytest.mark.parametrize("num_pid_m, t0", [(1, 0), (1, 1), (7, 3), (17, 8), (17, 9), (33, 16), (33, 4), (33, 0),
                                           (33, 33), (40, 19)])
@pytest.mark.parametrize("num_pid_n", [1, 3])
def test_expert_tile_order(num_pid_m, t0, num_pid_n):
    """The persistent kernels' tile order (_expert_tile_mn, GROUP_M = 4): every (row tile, column tile) once,
    expert 0's row tiles [0, t0) first, and within an expert groups of GROUP_M row tiles whose last one takes the
    remainder (4 to 7 row tiles), so no group holds a few row tiles only, nor both experts' rows."""
    G = 4
    n = num_pid_m * num_pid_n
    out = torch.full((max(n, 1), 2), -1, dtype=torch.int32)
    _tile_order_kernel[(n,)](out_ptr=out, t0=t0, num_pid_m=num_pid_m, num_pid_n=num_pid_n, GROUP_M=G)
    order = [tuple(r) for r in out[:n].tolist()]
    assert sorted(order) == [(m, c) for m in range(num_pid_m) for c in range(num_pid_n)]
    assert all((m < t0) == (i < t0 * num_pid_n) for i, (m, _) in enumerate(order))
    for lo, hi in ((0, t0), (t0, num_pid_m)):  # each expert's row tiles
        rows = hi - lo
        if rows == 0:
            continue
        groups = max(rows // G, 1)
        sizes = [G] * (groups - 1) + [rows - G * (groups - 1)]
        start = lo * num_pid_n
        for k, gsz in enumerate(sizes):  # a group: gsz row tiles x every column tile, column by column
            first = lo + G * k
            want = [(first + j % gsz, j // gsz) for j in range(gsz * num_pid_n)]
            assert order[start:start + len(want)] == want
            start += len(want)


@pytest.mark.parametrize("kind", ["random", "mostly_true"])
def test_grouped_tile_order_many_row_tiles(kind):
    """A routed GEMM over enough row tiles (M = 300, BM = 16: about 20 of them, GROUP_M = 4) that an expert's last
    group takes leftover row tiles: the scattered output complete (NaN-poisoned first) and right."""
    M, N, K = 300, 24, 32
    dtype = torch.float32
    gen = torch.Generator().manual_seed(29)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    w = rnd(gen, 2, N, K, dtype=dtype)
    perm, seg = route(mask, align=1)
    row_tiles = [-(-int(c) // 16) for c in seg[3:]]
    assert any(r > 4 and r % 4 for r in row_tiles), row_tiles  # some expert's last group takes leftovers
    xg = gathered(x, perm, M)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch_routed_linear_tma(xg, w, None, None, out, perm, seg, input_precision="ieee", num_programs=5,
                             BM=16, BN=16, BK=16, GROUP_M=4)
    assert rel_err(out, ref_linear(x, w[0], w[1], None, None, mask)) < TOL[dtype]


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("gate_up", ["pair", "pair_routed_by_gather", "two_mma", "gather"])
def test_unaligned_ffn_forward(kind, gate_up):
    """The ffn forward's TMA path on an unaligned routing (ALIGN = 1): x gathered into exactly M rows, h [M, I],
    then the down projection scattered back. Row tiles (BM = 16) straddle the two experts' rows: each tile writes
    only its own expert's rows, so every row of h and of out is written once, by the right expert.
    pair_routed_by_gather: perm and seg written by the gather itself (route_gather_rows_kernel, M <= 4096 on the
    GPU), not by a routing kernel."""
    M, H, I, N = 37, 40, 24, 32  # noqa: E741
    dtype = torch.float32
    gen = torch.Generator().manual_seed(17)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, H, dtype=dtype)
    w1, w3, w2 = rnd(gen, 2, I, H, dtype=dtype), rnd(gen, 2, I, H, dtype=dtype), rnd(gen, 2, N, I, dtype=dtype)
    if gate_up == "pair_routed_by_gather":
        xg, perm, seg = routed_by_gather(mask, x)
    else:
        perm, seg = route(mask, align=1)
    assert int(seg[2]) == M and perm.shape[0] == padded_rows(M, 1)
    h = torch.full((M, I), float("nan"), dtype=dtype)
    if gate_up == "pair_routed_by_gather":
        assert torch.isfinite(xg).all()
        launch_routed_swiglu_pair_tma(xg, torch.stack([w1, w3]), h, perm, seg, input_precision="ieee",
                                      num_programs=3, **T)
    elif gate_up == "gather":  # x in token order, its rows gathered inside the GEMM
        launch_routed_swiglu_gather_tma(x, w1, w3, h, perm, seg, input_precision="ieee", num_programs=3, **T)
    else:
        xg = gathered(x, perm, M)
        assert torch.isfinite(xg).all()
        if gate_up == "pair":
            launch_routed_swiglu_pair_tma(xg, torch.stack([w1, w3]), h, perm, seg, input_precision="ieee",
                                          num_programs=3, **T)
        else:
            launch_routed_swiglu_tma(xg, w1, w3, h, perm, seg, input_precision="ieee", num_programs=3, **T)
    href = ref_swiglu_h(x, w1[0], w1[1], w3[0], w3[1], mask)
    assert torch.isfinite(h).all(), "a row of h was not written"
    assert rel_err(h, href[perm[:M].long()]) < TOL[dtype]
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch_routed_linear_tma(h, w2, None, None, out, perm, seg, input_precision="ieee", num_programs=3, **T)
    ref = torch.where(mask[:, None], href @ w2[1].double().T, href @ w2[0].double().T)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("up_first", [False, True])
def test_swiglu_pair_tma(dtype, up_first):
    """Gate and up through one rank-4 descriptor and one MMA of 2 x BN columns, split in the epilogue."""
    M, H, I = 37, 40, 24
    gen = torch.Generator().manual_seed(16)
    mask = make_mask("random", M, gen)
    x = rnd(gen, M, H, dtype=dtype)
    w1, w3 = rnd(gen, 2, I, H, dtype=dtype), rnd(gen, 2, I, H, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    xg = gathered(x, perm, perm.shape[0])
    w13 = torch.stack([w3, w1] if up_first else [w1, w3])
    h = torch.full((perm.shape[0], I), float("nan"), dtype=dtype)
    launch_routed_swiglu_pair_tma(xg, w13, h, perm, seg, up_first=up_first, input_precision=prec(dtype),
                                  num_programs=3, **T)
    valid = perm >= 0
    assert rel_err(h[valid], ref_swiglu_h(x, w1[0], w1[1], w3[0], w3[1], mask)[perm[valid].long()]) < 3 * TOL[dtype]


@pytest.mark.parametrize("programs, split", [(6, True), (4, True), (3, False), (5, False)])
def test_swiglu_pair_split_last_round(programs, split):
    """The paired gate/up GEMM splits a last round of r tiles in 2r column halves when 2r <= programs
    (kernels/gemm_tiles.py _split_tail). Rows of both experts on an unaligned routing, I = 40 with BN = 16: the last
    column tile's second half lies wholly past I (its loads are zero-filled, its stores masked). Every row of h
    written, against float64."""
    M, H, I = 45, 40, 40  # noqa: E741
    dtype = torch.float32
    gen = torch.Generator().manual_seed(41)
    mask = make_mask("random", M, gen)
    x = rnd(gen, M, H, dtype=dtype)
    w1, w3 = rnd(gen, 2, I, H, dtype=dtype), rnd(gen, 2, I, H, dtype=dtype)
    perm, seg = route(mask, align=1)
    counts = int(seg[3]), int(seg[4])
    tiles = sum(triton.cdiv(c, T["BM"]) for c in counts) * triton.cdiv(I, T["BN"])
    tail = tiles % programs
    assert (0 < 2 * tail <= programs) == split, (counts, tiles, programs)  # the case this parameter is meant to hit
    xg = gathered(x, perm, M)
    h = torch.full((M, I), float("nan"), dtype=dtype)
    launch_routed_swiglu_pair_tma(xg, torch.stack([w1, w3]), h, perm, seg, input_precision="ieee",
                                  num_programs=programs, **T)
    assert torch.isfinite(h).all(), "a row of h was not written"
    assert rel_err(h, ref_swiglu_h(x, w1[0], w1[1], w3[0], w3[1], mask)[perm[:M].long()]) < TOL[dtype]


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("up_first", [False, True])
def test_swiglu_pair_bwd_tma(kind, up_first):
    """The ffn backward's fused gate/up recompute + SwiGLU backward: h, d_up and d_gate (over dh) of every row of both
    padded segments below end against float64 (padding rows: zeros, which the TMA grad-weight reads); rows from end
    on are not written (they stay poisoned)."""
    M, H, I = 37, 40, 24  # noqa: E741
    dtype = torch.float32
    gen = torch.Generator().manual_seed(31)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, H, dtype=dtype)
    w1, w3 = rnd(gen, 2, I, H, dtype=dtype), rnd(gen, 2, I, H, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    M_pad, end = perm.shape[0], int(seg[2])
    valid = perm >= 0
    xg = gathered(x, perm, M_pad)
    dh_tok = rnd(gen, M, I, dtype=dtype)
    dh = torch.zeros(M_pad, I, dtype=dtype)  # as the dh GEMM leaves it: zero padding rows below end
    dh[valid] = dh_tok[perm[valid].long()]
    dh[end:] = float("nan")
    h, dup = (torch.full((M_pad, I), float("nan"), dtype=dtype) for _ in range(2))
    dgate = dh.clone()
    launch_routed_swiglu_pair_bwd_tma(xg, torch.stack([w3, w1] if up_first else [w1, w3]), h, dup, dgate, seg,
                                      up_first=up_first, input_precision="ieee", num_programs=3, **T)
    want = dict(zip(("h", "dup", "dgate"), ref_swiglu_grads(*ref_gate_up(x, w1, w3, mask), dh_tok.double())))
    for name, got in (("h", h), ("dup", dup), ("dgate", dgate)):
        assert rel_err(got[valid], want[name][perm[valid].long()]) < TOL[dtype], name
        assert (got[:end][~valid[:end]] == 0).all(), f"{name}: padding rows below end must be zero"
        assert torch.isnan(got[end:]).all(), f"{name}: rows from end on must not be written"


@pytest.mark.parametrize("order", ["vision_first", "tied"])
def test_weight_orders_tma(order):
    """Every TMA kernel that reads stacked weights takes the experts in either order along the descriptor's expert
    dimension (w_map 1: [vision, text], a vision weight below the text one in memory) or one weight for both (w_map 0:
    a [1, R, C] descriptor), with the same bits as the text-first layout (w_map 2) of the same values: the launchers
    then never copy weights (csrc/ops/routed_gemm.cpp Experts::stacked)."""
    M, H, I = 37, 40, 24  # noqa: E741
    dtype = torch.float32
    gen = torch.Generator().manual_seed(53)
    mask = make_mask("random", M, gen)
    x = rnd(gen, M, H, dtype=dtype)
    w = {n: rnd(gen, 2, *shape, dtype=dtype) for n, shape in (("w", (I, H)), ("w1", (I, H)), ("w3", (I, H)))}
    if order == "tied":  # both experts are one weight: the canonical layout repeats it
        w = {n: t[:1].expand(2, -1, -1).contiguous() for n, t in w.items()}
        laid, w_map = {n: t[:1].clone() for n, t in w.items()}, 0
    else:
        laid, w_map = {n: t.flip(0).contiguous() for n, t in w.items()}, 1
    perm, seg = route(mask, align=ALIGN)
    M_pad = perm.shape[0]
    xg = gathered(x, perm, M_pad)
    b0, b1 = rnd(gen, I, dtype=dtype), rnd(gen, I, dtype=dtype)
    kw = dict(input_precision="ieee", num_programs=3, **T)

    def pair(ws):
        return torch.stack([ws["w1"], ws["w3"]])

    def run(ws, m):  # every kernel once, outputs poisoned
        outs = {}
        out = torch.full((M, I), float("nan"), dtype=dtype)
        outs["linear"] = launch_routed_linear_tma(xg, ws["w"], b0, b1, out, perm, seg, w_map=m, **kw)
        out = torch.full((M, H), float("nan"), dtype=dtype)
        outs["grad_input"] = launch_routed_linear_tma(gathered(rnd(torch.Generator().manual_seed(55), M, I, dtype=dtype), perm, M_pad), ws["w"], None,
                                                      None, out, perm, seg, w_transposed=True, w_map=m, **kw)
        out = torch.full((M, I), float("nan"), dtype=dtype)
        outs["linear_gather"] = launch_routed_linear_gather_tma(x, ws["w"], b0, b1, out, perm.clone(),
                                                                seg.clone(), w_map=m, **kw)
        two = m | m << 2
        h = torch.zeros(M_pad, I, dtype=dtype)
        outs["swiglu"] = launch_routed_swiglu_tma(xg, ws["w1"], ws["w3"], h, perm, seg, w_map=two, **kw)
        h = torch.zeros(M_pad, I, dtype=dtype)
        outs["swiglu_gather"] = launch_routed_swiglu_gather_tma(x, ws["w1"], ws["w3"], h, perm.clone(),
                                                                seg.clone(), w_map=two, **kw)
        h = torch.zeros(M_pad, I, dtype=dtype)
        outs["pair"] = launch_routed_swiglu_pair_tma(xg, pair(ws), h, perm, seg, w_map=m, **kw)
        h, dup = torch.zeros(M_pad, I, dtype=dtype), torch.zeros(M_pad, I, dtype=dtype)
        dgate = gathered(rnd(torch.Generator().manual_seed(54), M, I, dtype=dtype), perm, M_pad)
        outs["pair_bwd"] = torch.cat(launch_routed_swiglu_pair_bwd_tma(xg, pair(ws), h, dup, dgate, seg,
                                                                       w_map=m, **kw))
        return outs

    want, got = run(w, 2), run(laid, w_map)
    for name in want:
        assert torch.isfinite(want[name][:M]).all(), name
        assert torch.equal(got[name], want[name]) or torch.allclose(got[name], want[name], equal_nan=True,
                                                                     rtol=0, atol=0), name


@pytest.mark.parametrize("M", [1, 37])
@pytest.mark.parametrize("gate_up", ["pair", "two_mma"])
def test_single_expert_without_routing(M, gate_up):
    """one_rows = M: the single-expert forward with no perm / seg at all (None here; the kernels read neither). x is
    read in place, h and out are written in token order, exactly their M rows (the poisoned rows after them stay
    untouched)."""
    H, I, N = 40, 24, 32  # noqa: E741
    dtype = torch.float32
    gen = torch.Generator().manual_seed(23)
    x = rnd(gen, M, H, dtype=dtype)
    w1, w3, w2 = rnd(gen, 1, I, H, dtype=dtype), rnd(gen, 1, I, H, dtype=dtype), rnd(gen, 1, N, I, dtype=dtype)
    h_all = torch.full((M + 16, I), float("nan"), dtype=dtype)
    h = h_all[:M]
    if gate_up == "pair":
        launch_routed_swiglu_pair_tma(x, torch.stack([w1, w3]), h, None, None, input_precision="ieee",
                                      num_programs=3, one_rows=M, **T)
    else:
        launch_routed_swiglu_tma(x, w1, w3, h, None, None, input_precision="ieee", num_programs=3, one_rows=M,
                                 **T)
    href = ref_swiglu_h(x, w1[0], w1[0], w3[0], w3[0], torch.zeros(M, dtype=torch.bool))
    assert rel_err(h, href) < TOL[dtype] and torch.isnan(h_all[M:]).all()
    out_all = torch.full((M + 16, N), float("nan"), dtype=dtype)
    launch_routed_linear_tma(h, w2, None, None, out_all[:M], None, None, scatter_out=False,
                             input_precision="ieee", num_programs=3, one_rows=M, **T)
    assert rel_err(out_all[:M], href @ w2[0].double().T) < TOL[dtype] and torch.isnan(out_all[M:]).all()


def test_tma_m0():
    N, K = 24, 40
    gen = torch.Generator().manual_seed(9)
    perm, seg = route(torch.zeros(0, dtype=torch.bool), align=ALIGN)
    x = torch.empty(0, K)
    xg = gathered(x, perm, perm.shape[0])
    assert (xg == 0).all()
    out = torch.empty(0, N)
    launch_routed_linear_tma(xg, rnd(gen, 2, N, K), None, None, out, perm, seg, **T)


# ------------------------------------------------------------------------------------- grad-weight
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", GRAD_WEIGHT_MASKS)
@pytest.mark.parametrize("gather", [True, False])
def test_grad_weight(dtype, kind, gather):
    M, N, K = 37, 24, 40
    gen = torch.Generator().manual_seed(10)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    dy = rnd(gen, M, N, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    if gather:
        dy_in, x_in = dy, x
    else:
        dy_in = torch.full((perm.shape[0], N), float("nan"), dtype=dtype)
        x_in = torch.full((perm.shape[0], K), float("nan"), dtype=dtype)
        launch_gather_rows(dy, dy_in, perm, BLOCK_R=16, BLOCK_C=32)
        launch_gather_rows(x, x_in, perm, BLOCK_R=16, BLOCK_C=32)
    dw0 = torch.full((N, K), float("nan"))
    dw1 = torch.full((N, K), float("nan"))
    db0 = torch.full((N, ), float("nan"))
    db1 = torch.full((N, ), float("nan"))
    launch_routed_grad_weight(dy_in, x_in, perm, seg, dw0, dw1, db0, db1, gather=gather,
                              input_precision=prec(dtype), BN=16, BK=16, BR=16)
    xd, dyd = x.double(), dy.double()
    m1 = mask.double()[:, None]
    ref1 = (dyd * m1).T @ xd
    ref0 = (dyd * (1 - m1)).T @ xd
    for out, ref in ((dw0, ref0), (dw1, ref1), (db0, (dyd * (1 - m1)).sum(0)), (db1, (dyd * m1).sum(0))):
        if ref.norm() == 0:
            assert (out == 0).all()
        else:
            assert rel_err(out, ref) < TOL[dtype]


def test_grad_weight_accumulate():
    M, N, K = 37, 24, 40
    gen = torch.Generator().manual_seed(11)
    mask = make_mask("random", M, gen)
    x, dy = rnd(gen, M, K), rnd(gen, M, N)
    perm, seg = route(mask, align=ALIGN)
    dw0, dw1 = rnd(gen, N, K), rnd(gen, N, K)
    base0, base1 = dw0.double().clone(), dw1.double().clone()
    launch_routed_grad_weight(dy, x, perm, seg, dw0, dw1, accumulate=True, input_precision="ieee",
                              BN=16, BK=16, BR=16)
    m1 = mask.double()[:, None]
    assert rel_err(dw1, base1 + (dy.double() * m1).T @ x.double()) < 1e-5
    assert rel_err(dw0, base0 + (dy.double() * (1 - m1)).T @ x.double()) < 1e-5


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("expert", [0, 1])
def test_grad_weight_one_expert(tma, expert):
    """A launch of one expert (first_expert, half the grid): that expert's dW (and db) are right, and the other
    expert's outputs, poisoned with NaN, are not touched."""
    M, N, K = 37, 24, 40
    gen = torch.Generator().manual_seed(13)
    mask = make_mask("random", M, gen)
    x, dy = rnd(gen, M, K), rnd(gen, M, N)
    perm, seg = route(mask, align=ALIGN)
    dw = [torch.full((N, K), float("nan")) for _ in range(2)]
    db = [torch.full((N, ), float("nan")) for _ in range(2)]
    if tma:
        dy_pad = torch.full((perm.shape[0], N), float("nan"))
        x_pad = torch.full((perm.shape[0], K), float("nan"))
        launch_gather_rows(dy, dy_pad, perm, BLOCK_R=16, BLOCK_C=32)
        launch_gather_rows(x, x_pad, perm, BLOCK_R=16, BLOCK_C=32)
        launch_routed_grad_weight_tma(dy_pad, x_pad, seg, dw[0], dw[1], input_precision="ieee", BN=16, BK=16,
                                      BR=16, experts=(expert, ), num_programs=4)
    else:
        launch_routed_grad_weight(dy, x, perm, seg, dw[0], dw[1], db[0], db[1], input_precision="ieee", BN=16,
                                  BK=16, BR=16, experts=(expert, ))
    sel = (mask if expert == 1 else ~mask).double()[:, None]
    assert rel_err(dw[expert], (dy.double() * sel).T @ x.double()) < 1e-5
    assert torch.isnan(dw[1 - expert]).all()
    if not tma:
        assert rel_err(db[expert], (dy.double() * sel).sum(0)) < 1e-5
        assert torch.isnan(db[1 - expert]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", GRAD_WEIGHT_MASKS)
@pytest.mark.parametrize("programs", [None, 4])
def test_grad_weight_tma(dtype, kind, programs):
    """The sm_90 grad-weight kernel on expert-ordered, zero-padded buffers (N, K not multiples of the tile). programs:
    one per tile (None), or 4 for the 6 tiles, so that some programs walk two tiles in their one loop (the second
    tile's accumulator must start from zero; an expert without rows gets zeros in every tile)."""
    M, N, K = 37, 24, 40
    gen = torch.Generator().manual_seed(12)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    dy = rnd(gen, M, N, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    dy_pad = torch.full((perm.shape[0], N), float("nan"), dtype=dtype)
    x_pad = torch.full((perm.shape[0], K), float("nan"), dtype=dtype)
    launch_gather_rows(dy, dy_pad, perm, BLOCK_R=16, BLOCK_C=32)
    launch_gather_rows(x, x_pad, perm, BLOCK_R=16, BLOCK_C=32)
    dw0, dw1 = (torch.full((N, K), float("nan"), dtype=dtype) for _ in range(2))
    launch_routed_grad_weight_tma(dy_pad, x_pad, seg, dw0, dw1, input_precision=prec(dtype), BN=16, BK=16, BR=16,
                                  num_programs=programs)
    xd, dyd = x.double(), dy.double()
    m1 = mask.double()[:, None]
    for out, ref in ((dw0, (dyd * (1 - m1)).T @ xd), (dw1, (dyd * m1).T @ xd)):
        if ref.norm() == 0:
            assert (out == 0).all()
        else:
            assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS)
def test_gather_rows_colsum(dtype, kind):
    """dY's gather with per-block column sums, then expert_colsum: the linear_dual bias gradients db_e = sum of
    expert e's rows of dY (float64 reference), the gathered buffer unchanged by the COLSUM flag, every output written.
    BLOCK_B = 4 < the number of blocks, so the reduction loops."""
    M, N = 150, 40
    gen = torch.Generator().manual_seed(13)
    mask = make_mask(kind, M, gen)
    dy = rnd(gen, M, N, dtype=dtype)
    perm, seg = route(mask, align=ALIGN)
    plain = torch.full((perm.shape[0], N), float("nan"), dtype=dtype)
    launch_gather_rows(dy, plain, perm, BLOCK_R=16, BLOCK_C=32)
    got = torch.full_like(plain, float("nan"))
    colsum = torch.full(((perm.shape[0] + 15) // 16, N), float("nan"))
    launch_gather_rows(dy, got, perm, BLOCK_R=16, BLOCK_C=32, colsum=colsum)
    assert torch.equal(got, plain)
    assert colsum.shape[0] > 4
    sums = [torch.full((N,), float("nan"), dtype=dtype) for _ in range(2)]
    launch_expert_colsum(colsum, seg, *sums, ROWS_PER_BLOCK=16, BLOCK_B=4, BLOCK_C=16)
    m1 = mask.double()[:, None]
    for out, ref in ((sums[0], (dy.double() * (1 - m1)).sum(0)), (sums[1], (dy.double() * m1).sum(0))):
        if ref.norm() == 0:
            assert (out == 0).all()
        else:
            assert rel_err(out, ref) < TOL[dtype]


def test_gather_rows_colsum_shipped_block():
    """The shipped gather shapes (GATHER_ROWS x GATHER_COLS, with and without COLSUM) on an ALIGN = 128 routing:
    the gathered rows equal x[perm] (zero rows at padding), the column sums those of each 32-row block."""
    M, C = 150, 40
    gen = torch.Generator().manual_seed(29)
    x = rnd(gen, M, C)
    perm, _ = route(make_mask("random", M, gen), align=128)
    ref = torch.where((perm >= 0)[:, None], x[perm.clamp(min=0).long()], torch.zeros(()))
    plain = torch.full((perm.shape[0], C), float("nan"))
    launch_gather_rows(x, plain, perm)
    assert torch.equal(plain, ref)
    got = torch.full_like(plain, float("nan"))
    colsum = torch.full((perm.shape[0] // GATHER_ROWS, C), float("nan"))
    launch_gather_rows(x, got, perm, colsum=colsum)
    assert torch.equal(got, ref)
    assert rel_err(colsum, ref.double().view(-1, GATHER_ROWS, C).sum(1)) < 1e-6


# ------------------------------------------------------------------------- every shipped config (aot/configs/*.json)
def _shipped_configs():
    """Distinct (kernel, family, block, group, split, stream_k) of every table: warps and stages do not change the
    interpreter's arithmetic, the tile sizes, grouping and the shared-out last round do (masking of partial tiles,
    persistent loops, grid math)."""
    from aot import config_table as ct
    from aot import manifest
    seen = {}
    for arch in manifest.ARCHS:
        for kernel, fams in ct.load(arch)["kernels"].items():
            if kernel in ("rope_kernel", "decode_attention_kernel"):
                continue  # tests/test_rope_interp.py, tests/test_decode_attention_interp.py
            for fam, buckets in fams.items():
                for e in buckets:
                    if not e.get("off"):
                        seen.setdefault((kernel, fam, tuple(e["block"]), e["group"], e.get("split", 0),
                                         e.get("stream_k", 0)), None)
    return list(seen)


@pytest.mark.parametrize("kernel, fam, block, group, split, stream_k", _shipped_configs(),
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_shipped_config(kernel, fam, block, group, split, stream_k):
    """Each config the AOT build compiles computes the right result at sizes that leave partial tiles in every
    dimension, with both experts populated and the production routing alignment."""
    dtype = {"half": torch.float16, "tf32": torch.float32, "ieee": torch.float32}[fam]
    p = "ieee" if fam == "ieee" else "tf32"
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    M, N, K = 150, 200, 136  # N, K: not multiples of any tile; rows 16-byte aligned for TMA
    gen = torch.Generator().manual_seed(21)
    if kernel == "routed_decode_linear_kernel":  # a decode step: BLOCK_M - 3 rows, no routing, the reduction split
        bm, bn, bk = block                       # in 2 (8 K blocks and a partial one, a "GPU" of 32 SMs)
        Md, Kd = bm - 3, 8 * bk + 8
        mask = make_mask("random", Md, gen)
        x, w = rnd(gen, Md, Kd, dtype=dtype), rnd(gen, 2, N, Kd, dtype=dtype)
        b0, b1 = rnd(gen, N, dtype=dtype), rnd(gen, N, dtype=dtype)
        assert decode_split(N, Kd, bn, bk, 32)[0] == 2
        out = torch.full((Md, N), float("nan"), dtype=dtype)
        launch_routed_decode_linear(x, mask, w[0], w[1], b0, b1, out, sms=32, input_precision=p, BM=bm, BN=bn, BK=bk)
        assert rel_err(out, ref_linear(x, w[0], w[1], b0, b1, mask)) < tol
        return
    mask = make_mask("random", M, gen)
    perm, seg = route(mask, align=128)
    M_pad = perm.shape[0]
    x = rnd(gen, M, K, dtype=dtype)
    xg = torch.empty(M_pad, K, dtype=dtype)
    launch_gather_rows(x, xg, perm)
    m1 = mask.double()[:, None]
    if kernel in ("routed_linear_kernel", "routed_linear_tma_kernel", "routed_linear_gather_tma_kernel"):
        bm, bn, bk = block
        w = rnd(gen, 2, N, K, dtype=dtype)
        b0, b1 = rnd(gen, N, dtype=dtype), rnd(gen, N, dtype=dtype)
        out = torch.full((M, N), float("nan"), dtype=dtype)
        if kernel == "routed_linear_kernel":
            launch_routed_linear(x, w[0], w[1], b0, b1, out, perm, seg, N, K, input_precision=p, BM=bm, BN=bn,
                                 BK=bk, GROUP_M=group)
        elif kernel == "routed_linear_tma_kernel":
            launch_routed_linear_tma(xg, w, b0, b1, out, perm, seg, input_precision=p, BM=bm, BN=bn, BK=bk,
                                     GROUP_M=group, num_programs=5, SPLIT_TAIL=split, STREAM_K=stream_k)
        else:  # routing the mask itself, as the launcher does for m <= ONE_BLOCK
            perm_k, seg_k, want = routed_here(mask, 128)
            launch_routed_linear_gather_tma(x, w, b0, b1, out, perm_k, seg_k, mask=mask,
                                            route_block=one_block_size(M), input_precision=p, BM=bm, BN=bn,
                                            BK=bk, GROUP_M=group, num_programs=5, SPLIT_TAIL=split,
                                            STREAM_K=stream_k)
            assert torch.equal(perm_k, want[0]) and torch.equal(seg_k, want[1])
        assert rel_err(out, ref_linear(x, w[0], w[1], b0, b1, mask)) < tol
    elif kernel.startswith("routed_swiglu"):
        bm, bn, bk = block
        w1, w3 = rnd(gen, 2, N, K, dtype=dtype), rnd(gen, 2, N, K, dtype=dtype)
        h = torch.full((M_pad, N), float("nan"), dtype=dtype)
        if kernel == "routed_swiglu_kernel":
            launch_routed_swiglu(x, w1[0], w1[1], w3[0], w3[1], h, perm, seg, N, K, input_precision=p, BM=bm,
                                 BN=bn, BK=bk, GROUP_M=group)
        elif kernel == "routed_swiglu_gather_tma_kernel":
            perm_k, seg_k, _ = routed_here(mask, 128)
            launch_routed_swiglu_gather_tma(x, w1, w3, h, perm_k, seg_k, mask=mask, route_block=one_block_size(M),
                                            input_precision=p, BM=bm, BN=bn, BK=bk, GROUP_M=group, num_programs=7)
        elif kernel == "routed_swiglu_pair_tma_kernel":
            launch_routed_swiglu_pair_tma(xg, torch.stack([w1, w3]), h, perm, seg, input_precision=p, BM=bm,
                                          BN=bn, BK=bk, GROUP_M=group, num_programs=7)
        elif kernel == "routed_swiglu_pair_bwd_tma_kernel":  # h checked below, d_up and d_gate here
            ok = perm >= 0
            dh = rnd(gen, M, N, dtype=dtype)
            dgate = torch.zeros(M_pad, N, dtype=dtype)
            dgate[ok] = dh[perm[ok].long()]
            dup = torch.full((M_pad, N), float("nan"), dtype=dtype)
            launch_routed_swiglu_pair_bwd_tma(xg, torch.stack([w1, w3]), h, dup, dgate, seg, input_precision=p,
                                              BM=bm, BN=bn, BK=bk, GROUP_M=group, num_programs=7)
            _, want_dup, want_dgate = ref_swiglu_grads(*ref_gate_up(x, w1, w3, mask), dh.double())
            rows = perm[ok].long()
            assert rel_err(dup[ok], want_dup[rows]) < tol
            assert rel_err(dgate[ok], want_dgate[rows]) < tol
        elif kernel == "routed_swiglu_tma_kernel":
            launch_routed_swiglu_tma(xg, w1, w3, h, perm, seg, input_precision=p, BM=bm, BN=bn, BK=bk,
                                     GROUP_M=group, num_programs=7)
        else:
            raise AssertionError(f"no test for {kernel}")
        valid = perm >= 0
        got = torch.empty(M, N, dtype=dtype)
        got[perm[valid].long()] = h[valid]
        assert rel_err(got, ref_swiglu_h(x, w1[0], w1[1], w3[0], w3[1], mask)) < tol
    else:
        assert kernel in ("routed_grad_weight_kernel", "routed_grad_weight_tma_kernel"), f"no test for {kernel}"
        bn, bk, br = block
        dy = rnd(gen, M, N, dtype=dtype)
        dw0, dw1 = (torch.full((N, K), float("nan"), dtype=dtype) for _ in range(2))
        if kernel == "routed_grad_weight_kernel":
            launch_routed_grad_weight(dy, x, perm, seg, dw0, dw1, input_precision=p, BN=bn, BK=bk, BR=br,
                                      GROUP_N=group)
        else:
            dyg = torch.empty(M_pad, N, dtype=dtype)
            launch_gather_rows(dy, dyg, perm)
            launch_routed_grad_weight_tma(dyg, xg, seg, dw0, dw1, input_precision=p, BN=bn, BK=bk, BR=br,
                                          GROUP_N=group)
        xd, dyd = x.double(), dy.double()
        assert rel_err(dw0, (dyd * (1 - m1)).T @ xd) < tol
        assert rel_err(dw1, (dyd * m1).T @ xd) < tol


# ------------------------------------------------------------------------------------ swiglu backward (elementwise)
@pytest.mark.parametrize("kind", ["random", "span"])
def test_grad_weight_tma_stops_at_the_block_past_the_rows(kind):
    """The sm_90 grad-weight reads expert e's rows only up to the first multiple of BLOCK_R past its count_e rows,
    not the segment's padding beyond (routing ALIGN 64, BR 16 here): NaN in those padding rows must not reach dW,
    while the zero padding rows below that bound are read and add nothing."""
    M, N, K, align, br = 150, 24, 40, 64, 16
    gen = torch.Generator().manual_seed(13)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K)
    dy = rnd(gen, M, N)
    perm, seg = route(mask, align=align)
    dy_pad, x_pad = torch.zeros(perm.shape[0], N), torch.zeros(perm.shape[0], K)
    launch_gather_rows(dy, dy_pad, perm, BLOCK_R=16, BLOCK_C=32)
    launch_gather_rows(x, x_pad, perm, BLOCK_R=16, BLOCK_C=32)
    poisoned = 0
    for e in (0, 1):
        lo, end, count = int(seg[e]), int(seg[1 + e]), int(seg[3 + e])
        first_unread = lo + -(-count // br) * br
        dy_pad[first_unread:end] = float("nan")
        x_pad[first_unread:end] = float("nan")
        poisoned += end - first_unread
    assert poisoned > 0  # the case does leave padding past the bound (else this test proves nothing)
    dw0, dw1 = (torch.full((N, K), float("nan")) for _ in range(2))
    launch_routed_grad_weight_tma(dy_pad, x_pad, seg, dw0, dw1, input_precision="ieee", BN=16, BK=16, BR=br)
    m1 = mask.double()[:, None]
    assert rel_err(dw0, (dy.double() * (1 - m1)).T @ x.double()) < 1e-5
    assert rel_err(dw1, (dy.double() * m1).T @ x.double()) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_in_place(dtype):
    from kernels.swiglu_backward import launch_swiglu_backward
    gen = torch.Generator().manual_seed(31)
    rows, cols = 37, 300  # partial blocks in both dimensions
    g, u, d = (rnd(gen, rows, cols, dtype=dtype) * 3 for _ in range(3))
    ref = ref_swiglu_grads(g.double(), u.double(), d.double())  # h, d_up, d_gate
    bufs = [g.clone(), u.clone(), d.clone()]
    launch_swiglu_backward(*bufs, BLOCK_R=16, BLOCK_C=256)
    for got, want in zip(bufs, ref):
        assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_saved_gate_up(dtype):
    """The saved-activation backward: gate and up read from the forward's gate_up [M, 2I] (token order) through perm
    into expert-ordered h, d_up and d_gate (dh in place); padding rows (perm < 0) come out zero, as the grad-weight
    kernels need; gate_up is left as it was."""
    from kernels.swiglu_backward import launch_swiglu_backward
    gen = torch.Generator().manual_seed(37)
    M, I = 37, 300  # noqa: E741
    mask = make_mask("random", M, gen)
    perm, seg = route(mask, align=ALIGN)
    rows = perm.shape[0]
    gate_up = rnd(gen, M, 2 * I, dtype=dtype) * 3
    saved = gate_up.clone()
    dh = rnd(gen, rows, I, dtype=dtype) * 3
    valid = perm >= 0
    ref = ref_swiglu_grads(gate_up[:, :I].double()[perm[valid].long()], gate_up[:, I:].double()[perm[valid].long()],
                           dh.double()[valid])
    h = torch.full((rows, I), float("nan"), dtype=dtype)
    dup = torch.full((rows, I), float("nan"), dtype=dtype)
    launch_swiglu_backward(gate_up[:, :I], gate_up[:, I:], dh, h, dup, perm, BLOCK_R=16, BLOCK_C=256)
    for got, want in zip((h, dup, dh), ref):
        assert rel_err(got[valid], want) < TOL[dtype]
        assert (got[~valid] == 0).all()
    assert torch.equal(gate_up, saved)


def _saved_forward(kernel, x, mask, w1, w3, gate_up, h):
    """Launches forward gate/up kernel `kernel` with SAVE into gate_up (and h); returns the routing it used."""
    M = x.shape[0]
    kw = dict(input_precision="ieee", gate_up=gate_up, **T)
    if kernel == "ptr":
        perm, seg = route(mask, align=ALIGN)
        hp = torch.empty(perm.shape[0], h.shape[1], dtype=h.dtype)
        launch_routed_swiglu(x, w1[0], w1[1], w3[0], w3[1], hp, perm, seg, h.shape[1], x.shape[1], **kw)
        return perm
    if kernel == "one_rows":  # single expert, token order, no perm
        launch_routed_swiglu_pair_tma(x, torch.stack([w1[:1], w3[:1]]), h, None, None, num_programs=3,
                                      one_rows=M, **kw)
        return None
    perm, seg = route(mask, align=1)  # the TMA forward's unaligned routing
    if kernel == "gather":
        launch_routed_swiglu_gather_tma(x, w1, w3, h, perm, seg, num_programs=3, **kw)
        return perm
    xg = gathered(x, perm, M)
    if kernel == "pair":
        launch_routed_swiglu_pair_tma(xg, torch.stack([w1, w3]), h, perm, seg, num_programs=3, **kw)
    else:
        launch_routed_swiglu_tma(xg, w1, w3, h, perm, seg, num_programs=3, **kw)
    return perm


@pytest.mark.parametrize("kernel", ["ptr", "two_mma", "pair", "gather", "one_rows"])
@pytest.mark.parametrize("kind", ["random", "span", "all_true"])
def test_forward_saves_gate_up(kernel, kind):
    """SAVE: every forward gate/up kernel also writes gate_up [M, 2I] = [x·W1_eᵀ, x·W3_eᵀ] in token order, every
    element of it (poisoned before), whatever its routing (aligned, unaligned, none); gate_up's row stride may exceed
    2I."""
    M, H, I = 37, 40, 24  # noqa: E741
    dtype = torch.float32
    gen = torch.Generator().manual_seed(41)
    mask = make_mask(kind, M, gen) if kernel != "one_rows" else torch.zeros(M, dtype=torch.bool)
    x = rnd(gen, M, H, dtype=dtype)
    w1, w3 = rnd(gen, 2, I, H, dtype=dtype), rnd(gen, 2, I, H, dtype=dtype)
    storage = torch.full((M, 2 * I + 8), float("nan"), dtype=dtype)
    gate_up = storage[:, :2 * I]
    h = torch.full((M, I), float("nan"), dtype=dtype)
    _saved_forward(kernel, x, mask, w1, w3, gate_up, h)
    g_ref, u_ref = ref_gate_up(x, w1, w3, mask)
    assert rel_err(gate_up[:, :I], g_ref) < TOL[dtype]
    assert rel_err(gate_up[:, I:], u_ref) < TOL[dtype]
    assert torch.isnan(storage[:, 2 * I:]).all()


def routed_here(mask, align):
    """(perm, seg) poisoned for a kernel that routes for itself (ROUTE_BLOCK), and what the routing kernel gives."""
    want = route(mask, align=align)
    perm = torch.full_like(want[0], 7777)  # a valid-looking row would be gathered: the kernel must overwrite all
    seg = torch.full_like(want[1], 3)
    return perm, seg, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("route_block", [0, 64])
def test_linear_gather_tma(dtype, kind, route_block):
    """A rows gathered by pointer loads inside the TMA GEMM (no gather copy); K not a multiple of BK. route_block:
    the kernel routes the mask itself (perm and seg poisoned before; afterwards they must be the routing kernel's)."""
    M, N, K = 37, 24, 40
    gen = torch.Generator().manual_seed(13)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    w = rnd(gen, 2, N, K, dtype=dtype)
    b0, b1 = rnd(gen, N, dtype=dtype), rnd(gen, N, dtype=dtype)
    perm, seg, want = routed_here(mask, ALIGN) if route_block else (*route(mask, align=ALIGN), None)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    launch_routed_linear_gather_tma(x, w, b0, b1, out, perm, seg, mask=mask, route_block=route_block,
                                    align=ALIGN, input_precision=prec(dtype), num_programs=3, **T)
    assert rel_err(out, ref_linear(x, w[0], w[1], b0, b1, mask)) < TOL[dtype]
    if want is not None:
        assert torch.equal(perm, want[0]) and torch.equal(seg, want[1])


def split_programs(tiles, split):
    """A program count below `tiles` whose last partial round _split_tail (kernels/gemm_tiles.py) splits
    (0 < 2 r <= programs, r = tiles mod programs), or, for split=False, one whose last round is more than half
    full."""
    return next(p for p in range(2, tiles) if (0 < 2 * (tiles % p) <= p) == split and tiles % p)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("N", [48, 40])
@pytest.mark.parametrize("variant", ["scatter", "transposed", "ordered", "gather", "gather_routed"])
def test_linear_split_last_round(variant, N, split):
    """routed_linear_tma_kernel and routed_linear_gather_tma_kernel compiled with SPLIT_TAIL = 2 (a config's "split")
    compute a last round of r tiles as 2r column halves when 2r <= programs (kernels/gemm_tiles.py _split_tail),
    through a second descriptor of BN / 2 columns. The last round's tiles are
    the last column tile's (grouped order): N = 48 with BN = 16 has both of its halves inside N, N = 40 its second
    half wholly past N. variant: scattered rows of an unaligned routing with bias (the ffn down projection), W
    transposed (grad input), an expert-ordered output over whole segments, A gathered inside with bias, and the same
    routing the mask itself. Poisoned outputs, float64 reference."""
    M, K = 45, 40
    dtype = torch.float32
    gen = torch.Generator().manual_seed(43)
    mask = make_mask("random", M, gen)
    x = rnd(gen, M, K, dtype=dtype)
    w = rnd(gen, 2, N, K, dtype=dtype)
    b0, b1 = rnd(gen, N, dtype=dtype), rnd(gen, N, dtype=dtype)
    perm, seg = route(mask, align=1 if variant == "scatter" else ALIGN)
    counts = int(seg[3]), int(seg[4])
    row_tiles = int(seg[2]) // T["BM"] if variant == "ordered" else sum(triton.cdiv(c, T["BM"]) for c in counts)
    programs = split_programs(row_tiles * triton.cdiv(N, T["BN"]), split)
    kw = dict(input_precision="ieee", num_programs=programs, SPLIT_TAIL=2, **T)
    if variant == "scatter":
        out = torch.full((M, N), float("nan"), dtype=dtype)
        launch_routed_linear_tma(gathered(x, perm, M), w, b0, b1, out, perm, seg, **kw)
        ref = ref_linear(x, w[0], w[1], b0, b1, mask)
    elif variant == "transposed":  # dx = dy · W_e for dy [M, N]: the output has K columns, the halves split K
        dy = rnd(gen, M, N, dtype=dtype)
        w = rnd(gen, 2, N, N, dtype=dtype)  # [2, N, K = N]: the same column tiles as the other variants
        out = torch.full((M, N), float("nan"), dtype=dtype)
        launch_routed_linear_tma(gathered(dy, perm, perm.shape[0]), w, None, None, out, perm, seg,
                                 w_transposed=True, **kw)
        ref = torch.where(mask[:, None], dy.double() @ w[1].double(), dy.double() @ w[0].double())
    elif variant == "ordered":
        ordered = torch.full((perm.shape[0], N), float("nan"), dtype=dtype)
        launch_routed_linear_tma(gathered(x, perm, perm.shape[0]), w, None, None, ordered, perm, seg,
                                 scatter_out=False, **kw)
        end, valid = int(seg[2]), perm >= 0
        assert (ordered[:end][~valid[:end]] == 0).all() and torch.isnan(ordered[end:]).all()
        out, ref = ordered[valid], ref_linear(x, w[0], w[1], None, None, mask)[perm[valid].long()]
    else:
        route_block = 64 if variant == "gather_routed" else 0
        want = (perm, seg)
        if route_block:
            perm, seg, want = routed_here(mask, ALIGN)
        out = torch.full((M, N), float("nan"), dtype=dtype)
        launch_routed_linear_gather_tma(x, w, b0, b1, out, perm, seg, mask=mask, route_block=route_block,
                                        align=ALIGN, **kw)
        assert torch.equal(perm, want[0]) and torch.equal(seg, want[1])
        ref = ref_linear(x, w[0], w[1], b0, b1, mask)
    assert torch.isfinite(out).all(), "an output row was not written"
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "all_true", "all_false", "span"])
@pytest.mark.parametrize("route_block, align", [(0, ALIGN), (64, ALIGN), (0, 1), (64, 1)])
def test_swiglu_gather_tma(dtype, kind, route_block, align):
    """x rows gathered by pointer loads inside the TMA gate/up GEMM; h expert-ordered. route_block: as in
    test_linear_gather_tma, also on the ffn forward's unaligned routing (align = 1)."""
    M, H, I = 37, 40, 24
    gen = torch.Generator().manual_seed(14)
    mask = make_mask(kind, M, gen)
    x = rnd(gen, M, H, dtype=dtype)
    w1, w3 = rnd(gen, 2, I, H, dtype=dtype), rnd(gen, 2, I, H, dtype=dtype)
    perm, seg, want = routed_here(mask, align) if route_block else (*route(mask, align=align), None)
    h = torch.full((perm.shape[0], I), float("nan"), dtype=dtype)
    launch_routed_swiglu_gather_tma(x, w1, w3, h, perm, seg, mask=mask, route_block=route_block, align=align,
                                    input_precision=prec(dtype), num_programs=3, **T)
    if want is not None:
        assert torch.equal(perm, want[0]) and torch.equal(seg, want[1])
    valid = perm >= 0
    got = torch.empty(M, I, dtype=dtype)
    got[perm[valid].long()] = h[valid]
    assert rel_err(got, ref_swiglu_h(x, w1[0], w1[1], w3[0], w3[1], mask)) < 3 * TOL[dtype]
