"""Op-level tests of `torch.ops.fused.rope_*` (TransformerEngine fused-RoPE semantics, docs/design.md).

Every device-parametrized test runs on "cpu" and on each visible CUDA device (marked `gpu`, see conftest.py).
Correctness is measured against the float64 oracle in tests/reference.py as ||out - ref|| / ||ref|| with a per-dtype
tolerance; channels d2..d must come through bit-exact. The CPU tier uses small, odd shapes; TE's own (large) test
shapes run on CUDA only.
"""
import itertools
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import fused_ops  # noqa: F401  (loads the library that registers torch.ops.fused.*)
from fused_ops.rope import RotaryPositionEmbedding, apply_rotary_pos_emb, apply_rotary_pos_emb_qk
from device_helpers import poison_allocator, sync
from reference import rope_reference
from reference_routed import rel_err

OPS = torch.ops.fused
ERR = (RuntimeError, ValueError)

# Relative-error tolerances. The op does its math in fp32 and rounds once to the output dtype, so the error is the
# output rounding: unit roundoff 2^-8 (bf16) / 2^-11 (fp16), RMS about a third to a half of that; the bounds leave
# ~3-4x margin. fp32 leaves room for fp32 sin/cos of angles up to ~4096 rad (TE's largest shape). float64 exists on
# CPU only; 1e-6 accepts either fp64 or fp32 internal math there (gradcheck below demands the former).
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 1e-6}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}

# (d, d2): full rotation, half (rotary_percent 0.5), and a d2 that is not a multiple of 16 with d2 < d.
D_CASES = {"full": (32, 32), "half": (32, 16), "odd": (40, 24)}
CP_CASES = {"cp1": (1, 0), "cp2r0": (2, 0), "cp2r1": (2, 1)}
# thd: global sequence lengths, uneven; under CP each is a multiple of 2*cp_size (TE's cu_seqlens_padded rule).
THD_LENS = {1: [5, 1, 7, 3], 2: [8, 4, 12, 4], 3: [6, 12, 6]}
LAYOUTS = ["contig", "qkv", "transposed", "stride_d", "hd_transposed"]


# ----------------------------------------------------------------------------------------------------------------
# helpers


def cu_of(lens):
    return [0] + list(itertools.accumulate(lens))


def make_layout(lead, h, d, dtype, device, layout="contig"):
    """Returns (base, view): `view(base)` is a tensor of shape lead + (h, d) with the requested memory layout.

    contig: plain contiguous; qkv: the middle third of a packed [..., h, 3d] tensor (offset, stride_h = 3d);
    transposed: first two dims swapped (thd: [h, t, d] transposed); stride_d: every other channel (stride_d = 2);
    hd_transposed: h and d swapped in memory (stride_d = h, stride_h = 1), TE's transpose=(2, 3) case.
    """
    lead = tuple(lead)
    mk = lambda shape: torch.randn(shape, dtype=torch.float32, device=device).to(dtype)  # noqa: E731
    if layout == "contig":
        base = mk(lead + (h, d))
        return base, lambda b: b
    if layout == "qkv":
        base = mk(lead + (h, 3 * d))
        return base, lambda b: b[..., d:2 * d]
    if layout == "stride_d":
        base = mk(lead + (h, 2 * d))
        return base, lambda b: b[..., ::2]
    if layout == "hd_transposed":
        base = mk(lead + (d, h))
        return base, lambda b: b.transpose(-1, -2)
    if layout == "transposed":
        if len(lead) == 2:
            base = mk((lead[1], lead[0], h, d))
            return base, lambda b: b.transpose(0, 1)
        base = mk((h, lead[0], d))
        return base, lambda b: b.transpose(0, 1)
    raise AssertionError(layout)


def make_input(lead, h, d, dtype, device, layout="contig"):
    """A random tensor of shape lead + (h, d) in the given memory layout (see make_layout)."""
    base, view = make_layout(lead, h, d, dtype, device, layout)
    return view(base)


def rand_freqs(rows, d2, device, scale=3.0):
    """Random angles: the two members of each pair differ, so a wrong pairing or a swapped sine is caught."""
    return (torch.randn(rows, 1, 1, d2, device=device) * scale).float()


class Case:
    """One op configuration: builds inputs on a device and the matching kwargs / reference arguments."""

    def __init__(self, fmt, d, d2, h=3, b=2, s=13, cp=(1, 0), start=False, interleaved=False, nseq_lens=None):
        self.fmt, self.d, self.d2, self.h, self.interleaved = fmt, d, d2, h, interleaved
        self.cp_size, self.cp_rank = cp
        if fmt == "thd":
            lens = nseq_lens if nseq_lens is not None else THD_LENS[self.cp_size]
            self.cu = cu_of(lens)
            self.lead = (self.cu[-1] // self.cp_size,)
            nseq, longest = len(lens), max(lens) if lens else 0
        else:
            if self.cp_size > 1 and s % 2:
                s += 1  # the local length must be even under CP
            self.cu = None
            self.lead = (s, b) if fmt == "sbhd" else (b, s)
            nseq, longest = b, s * self.cp_size
        self.start = [(3 * i + 2) % 7 for i in range(nseq)] if start else None
        self.rows = longest + (max(self.start) if self.start else 0) + 2  # freqs rows: all positions + slack

    def kwargs(self, device):
        return dict(
            tensor_format=self.fmt, interleaved=self.interleaved,
            cu_seqlens=None if self.cu is None else torch.tensor(self.cu, dtype=torch.int32, device=device),
            start_positions=None if self.start is None else torch.tensor(self.start, dtype=torch.int32, device=device),
            cp_size=self.cp_size, cp_rank=self.cp_rank)

    def ref(self, x, freqs, backward=False):
        return rope_reference(x, freqs, self.fmt, self.interleaved, self.cu, self.start, self.cp_size, self.cp_rank,
                              backward=backward)



def check_out(out, x, ref, d2, what="out"):
    """out: the op's result for input x; ref: float64 reference. Checks metadata, accuracy and passthrough."""
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device, what
    assert out.is_contiguous(), f"{what} not contiguous: strides {out.stride()}"
    assert not torch.isnan(out).any(), f"{what} has NaN (unwritten elements?)"
    err = rel_err(out, ref)
    assert err <= TOL[x.dtype], f"{what}: relative error {err:.3g} > {TOL[x.dtype]:.1g}"
    assert torch.equal(out[..., d2:], x[..., d2:]), f"{what}: channels d2..d are not passed through exactly"



# ----------------------------------------------------------------------------------------------------------------
# concurrency first: on a fresh process this is the first launch of these variants, so lazy module loading races


@pytest.mark.gpu
def test_threads_concurrent_first_launches(gpu_device):
    """8 threads call rope_fwd at once (own streams, fresh inputs, different variants); all results correct."""
    variants = [(fmt, dt, il) for fmt in ("sbhd", "thd") for dt in (torch.float16, torch.bfloat16)
                for il in (False, True)]
    errors, barrier = [], threading.Barrier(len(variants))

    def work(i, fmt, dtype, interleaved):
        try:
            torch.cuda.set_device(gpu_device)
            case = Case(fmt, 64, 48, h=5, s=37, start=bool(i % 2), interleaved=interleaved)
            stream = torch.cuda.Stream(gpu_device)
            with torch.cuda.stream(stream):
                x = make_input(case.lead, case.h, case.d, dtype, gpu_device)
                freqs = rand_freqs(case.rows, case.d2, gpu_device)
                kw = case.kwargs(gpu_device)
                barrier.wait(timeout=60)
                for _ in range(3):
                    out = OPS.rope_fwd(x, freqs, **kw)
            stream.synchronize()
            check_out(out, x, case.ref(x, freqs), case.d2, f"thread {i}")
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(f"thread {i} ({fmt}, {dtype}, interleaved={interleaved}): {e!r}")

    threads = [threading.Thread(target=work, args=(i, *v)) for i, v in enumerate(variants)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, "\n".join(errors)


# ----------------------------------------------------------------------------------------------------------------
# forward / backward vs the reference


def _matrix():
    rows = []
    for i, (fmt, dk, il, st, cpk, dt) in enumerate(itertools.product(
            ("sbhd", "bshd", "thd"), D_CASES, (False, True), (False, True), CP_CASES, DTYPES)):
        layout = LAYOUTS[i % len(LAYOUTS)]  # cycle layouts through the matrix; test_layouts covers them fully
        rows.append(pytest.param(fmt, dk, il, st, cpk, dt, layout,
                                 id=f"{fmt}-{dk}-{'il' if il else 'ni'}-{'sp' if st else 'nosp'}-{cpk}-"
                                    f"{DT_ID[dt]}-{layout}"))
    return rows


@pytest.mark.parametrize("fmt,dk,interleaved,start,cpk,dtype,layout", _matrix())
def test_forward_backward_matrix(device, fmt, dk, interleaved, start, cpk, dtype, layout):
    d, d2 = D_CASES[dk]
    case = Case(fmt, d, d2, cp=CP_CASES[cpk], start=start, interleaved=interleaved)
    x = make_input(case.lead, case.h, d, dtype, device, layout)
    g = make_input(case.lead, case.h, d, dtype, device, LAYOUTS[(LAYOUTS.index(layout) + 1) % len(LAYOUTS)])
    freqs = rand_freqs(case.rows, d2, device)
    kw = case.kwargs(device)
    x_before, g_before = x.clone(), g.clone()

    poison_allocator(device, x.numel() * x.element_size())
    out = OPS.rope_fwd(x, freqs, **kw)
    poison_allocator(device, g.numel() * g.element_size())
    dx = OPS.rope_bwd(g, freqs, **kw)
    sync(device)

    assert torch.equal(x, x_before) and torch.equal(g, g_before), "inputs were modified"
    assert out.data_ptr() != x.data_ptr()
    check_out(out, x, case.ref(x, freqs), d2, "rope_fwd")
    check_out(dx, g, case.ref(g, freqs, backward=True), d2, "rope_bwd")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["ni", "il"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_layouts(device, fmt, interleaved, layout, dtype):
    """Every memory layout, with partial rotation (passthrough channels) and start positions."""
    case = Case(fmt, 40, 24, h=3, s=11, start=True, interleaved=interleaved)
    x = make_input(case.lead, case.h, case.d, dtype, device, layout)
    freqs = rand_freqs(case.rows, case.d2, device)
    kw = case.kwargs(device)
    out, dx = OPS.rope_fwd(x, freqs, **kw), OPS.rope_bwd(x, freqs, **kw)
    check_out(out, x, case.ref(x, freqs), case.d2, "rope_fwd")
    check_out(dx, x, case.ref(x, freqs, backward=True), case.d2, "rope_bwd")


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("cp_rank", [0, 1, 2])
def test_cp_size_3(device, fmt, cp_rank):
    case = Case(fmt, 16, 16, h=2, s=6, cp=(3, cp_rank), interleaved=cp_rank == 1)
    x = make_input(case.lead, case.h, case.d, torch.float32, device)
    freqs = rand_freqs(case.rows, case.d2, device)
    kw = case.kwargs(device)
    check_out(OPS.rope_fwd(x, freqs, **kw), x, case.ref(x, freqs), case.d2)
    check_out(OPS.rope_bwd(x, freqs, **kw), x, case.ref(x, freqs, backward=True), case.d2)


def test_cp_ranks_assemble_full_sequence(device):
    """Under CP, each rank's result equals the matching rows of the unsplit (cp_size=1) result."""
    cp, L = 2, 6  # global length 12, chunks of 3: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    full = torch.randn(2 * cp * (L // 2), 2, 3, 8, device=device)
    freqs = rand_freqs(12, 8, device)
    want = OPS.rope_fwd(full, freqs)
    chunks = full.split(L // 2)
    for r in range(cp):
        local = torch.cat([chunks[r], chunks[2 * cp - 1 - r]])
        got = OPS.rope_fwd(local, freqs, cp_size=cp, cp_rank=r)
        torch.testing.assert_close(got, torch.cat([want.split(L // 2)[r], want.split(L // 2)[2 * cp - 1 - r]]),
                                   rtol=0, atol=0)


def test_thd_matches_per_sequence_sbhd(device):
    """A packed thd batch equals running each sequence as its own sbhd (b=1) tensor with its start position."""
    lens, d = [5, 1, 7, 3], 16
    cu = cu_of(lens)
    x = torch.randn(cu[-1], 4, d, device=device)
    freqs = rand_freqs(20, d, device)
    start = [2, 0, 5, 1]
    out = OPS.rope_fwd(x, freqs, "thd", True, torch.tensor(cu, dtype=torch.int32, device=device),
                       torch.tensor(start, dtype=torch.int32, device=device))
    for i in range(len(lens)):
        xi = x[cu[i]:cu[i + 1]].unsqueeze(1)
        oi = OPS.rope_fwd(xi, freqs, "sbhd", True, None, torch.tensor([start[i]], dtype=torch.int32, device=device))
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], oi.squeeze(1), rtol=0, atol=0)


def test_thd_zero_length_sequence(device):
    """cu_seqlens may repeat a value (an empty sequence), as TE's padded batches can; the others are unaffected."""
    lens = [4, 0, 3]
    case = Case("thd", 8, 8, h=2, nseq_lens=lens, start=True)
    x = make_input(case.lead, case.h, case.d, torch.float32, device)
    freqs = rand_freqs(case.rows, case.d2, device)
    check_out(OPS.rope_fwd(x, freqs, **case.kwargs(device)), x, case.ref(x, freqs), case.d2)


# ----------------------------------------------------------------------------------------------------------------
# in-place and q/k variants


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("layout", ["contig", "qkv", "hd_transposed"])
@pytest.mark.parametrize("cpk", ["cp1", "cp2r1"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["ni", "il"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_inplace(device, fmt, interleaved, cpk, layout, dtype):
    """rope_fwd_ overwrites its input with the rotated values (returns nothing); memory outside the view is untouched."""
    case = Case(fmt, 40, 24, cp=CP_CASES[cpk], start=cpk == "cp1", interleaved=interleaved)
    base, view = make_layout(case.lead, case.h, case.d, dtype, device, layout)
    x = view(base)
    freqs = rand_freqs(case.rows, case.d2, device)
    x_in, base_before = x.clone(), base.clone()
    mask = torch.zeros_like(base, dtype=torch.bool)
    view(mask).fill_(True)

    ptr, stride = x.data_ptr(), x.stride()
    assert OPS.rope_fwd_(x, freqs, **case.kwargs(device)) is None
    sync(device)
    assert x.data_ptr() == ptr and x.stride() == stride
    assert torch.equal(base[~mask], base_before[~mask]), "rope_fwd_ wrote outside its input view"
    assert torch.equal(x[..., case.d2:], x_in[..., case.d2:])
    err = rel_err(x, case.ref(x_in, freqs))
    assert err <= TOL[dtype], f"relative error {err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("start", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("cpk", ["cp1", "cp2r1"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["ni", "il"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_fwd_qk(device, fmt, interleaved, cpk, start, dtype):
    """q and k (different head counts, GQA) as strided views of one packed qkv tensor; both outputs of rope_fwd_qk
    and of its transpose rope_bwd_qk checked."""
    hq, hk = 4, 2
    case = Case(fmt, 40, 24, h=hq, cp=CP_CASES[cpk], start=start, interleaved=interleaved)
    base = torch.randn(case.lead + (hq + 2 * hk, case.d), device=device).to(dtype)
    q, k = base[..., :hq, :], base[..., hq:hq + hk, :]
    freqs = rand_freqs(case.rows, case.d2, device)
    base_before = base.clone()
    poison_allocator(device, q.numel() * q.element_size())
    qo, ko = OPS.rope_fwd_qk(q, k, freqs, **case.kwargs(device))
    poison_allocator(device, q.numel() * q.element_size())
    dq, dk = OPS.rope_bwd_qk(q, k, freqs, **case.kwargs(device))
    sync(device)
    assert torch.equal(base, base_before), "rope_fwd_qk / rope_bwd_qk modified their inputs"
    check_out(qo, q, case.ref(q, freqs), case.d2, "q_out")
    check_out(ko, k, case.ref(k, freqs), case.d2, "k_out")
    check_out(dq, q, case.ref(q, freqs, backward=True), case.d2, "grad_q")
    check_out(dk, k, case.ref(k, freqs, backward=True), case.d2, "grad_k")


def test_fwd_qk_autograd(device):
    """q and k usually require grad (outputs of a projection): gradients through rope_fwd_qk must be the reference
    backward, and never silently missing (the autograd-not-implemented fallback only warns)."""
    case = Case("sbhd", 24, 16, h=4, cp=(2, 0), interleaved=True)
    base = torch.randn(case.lead + (6, case.d), device=device).to(torch.bfloat16).requires_grad_(True)
    q, k = base[..., :4, :], base[..., 4:, :]
    freqs = rand_freqs(case.rows, case.d2, device)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qo, ko = OPS.rope_fwd_qk(q, k, freqs, **case.kwargs(device))
        torch.autograd.backward((qo, ko), (gq, gk))
    check_out(base.grad[..., :4, :].contiguous(), gq, case.ref(gq, freqs, backward=True), case.d2, "dq")
    check_out(base.grad[..., 4:, :].contiguous(), gk, case.ref(gk, freqs, backward=True), case.d2, "dk")


def test_fwd_qk_mixed_dtypes(device):
    """q and k of different dtypes: either refused (naming q/k/dtype) or each rotated correctly in its own dtype."""
    case = Case("sbhd", 16, 16, h=2)
    q = torch.randn(case.lead + (2, 16), device=device)
    k = q[..., :1, :].to(torch.bfloat16)
    freqs = rand_freqs(case.rows, 16, device)
    try:
        qo, ko = OPS.rope_fwd_qk(q, k, freqs)
    except ERR as e:
        assert any(w in str(e) for w in ("dtype", "q", "k")), str(e)
        return
    check_out(qo, q, case.ref(q, freqs), 16, "q_out")
    check_out(ko, k, case.ref(k, freqs), 16, "k_out")


# ----------------------------------------------------------------------------------------------------------------
# TE's own test shapes (CUDA only)


@pytest.mark.gpu
@pytest.mark.parametrize("margin,transpose", [(0, None), (10, (2, 3))], ids=["m0", "m10-T23"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["ni", "il"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("rotary_percent", [0.5, 1.0])
@pytest.mark.parametrize("hidden", [128, 256])
@pytest.mark.parametrize("seq", [2048, 4096])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_te_shapes(gpu_device, fmt, seq, hidden, rotary_percent, dtype, interleaved, margin, transpose):
    """batch 2, 64 heads, freqs from RotaryPositionEmbedding(seq) (angles up to ~seq rad), s = seq - margin."""
    b, h, s = 2, 64, seq - margin
    freqs = RotaryPositionEmbedding(hidden, rotary_percent, interleaved=interleaved, device=gpu_device)(seq)
    d2 = freqs.shape[-1]
    shape = (s, b, h, hidden) if fmt == "sbhd" else (b, s, h, hidden)
    x = torch.rand(shape, dtype=torch.float32, device=gpu_device).to(dtype)
    if transpose is not None:
        x = x.transpose(*transpose).contiguous().transpose(*transpose)
    g = torch.randn(shape, dtype=torch.float32, device=gpu_device).to(dtype)
    xr = x.detach().requires_grad_(True)
    out = OPS.rope_fwd(xr, freqs, fmt, interleaved)
    out.backward(g)
    check_out(out.detach(), x, rope_reference(x, freqs, fmt, interleaved), d2, "forward")
    # AccumulateGrad lays x.grad out like the (dense, maybe transposed) leaf x, so only its values are the op's
    check_out(xr.grad.contiguous(), g, rope_reference(g, freqs, fmt, interleaved, backward=True), d2, "backward")


# ----------------------------------------------------------------------------------------------------------------
# empty tensors


@pytest.mark.parametrize("fmt,lead,cu", [("sbhd", (0, 2), None), ("sbhd", (5, 0), None), ("bshd", (0, 5), None),
                                         ("bshd", (2, 0), None), ("thd", (0,), [0]), ("thd", (0,), [0, 0, 0])],
                         ids=["s0", "b0", "bshd-b0", "bshd-s0", "t0", "t0-2seq"])
def test_empty(device, fmt, lead, cu):
    x = torch.empty(lead + (3, 8), device=device, dtype=torch.bfloat16)
    freqs = rand_freqs(6, 8, device)
    kw = dict(tensor_format=fmt)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    for out in (OPS.rope_fwd(x, freqs, **kw), OPS.rope_bwd(x, freqs, **kw), *OPS.rope_fwd_qk(x, x, freqs, **kw)):
        assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert OPS.rope_fwd_(x, freqs, **kw) is None
    sync(device)


def test_qk_where_one_tensor_has_no_heads(device):
    """q with no heads and k with some (or the reverse): the other tensor is still rotated, nothing is left unwritten."""
    s, b, d = 9, 2, 16
    freqs = rand_freqs(s, d, device)
    for hq, hk in ((0, 3), (3, 0)):
        q = torch.randn(s, b, hq, d, device=device)
        k = torch.randn(s, b, hk, d, device=device)
        poison_allocator(device, k.numel() * k.element_size() + q.numel() * q.element_size())
        qo, ko = OPS.rope_fwd_qk(q, k, freqs)
        sync(device)
        for out, x in ((qo, q), (ko, k)):
            assert out.shape == x.shape
            if x.numel():
                check_out(out, x, rope_reference(x, freqs, "sbhd", False), d, "out")


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_few_heads_many_tokens(device, fmt):
    """A tensor-parallel slice's GQA (8 query heads, 1 KV head, head dim 128) over a token count that is no multiple
    of any tokens-per-program block, and in thd as 70 packed sequences (some empty): each program spans several
    tokens and, in thd, several sequences."""
    hq, hk, d = 8, 1, 128
    if fmt == "thd":
        gen = torch.Generator().manual_seed(7)
        lens = torch.randint(0, 40, (70, ), generator=gen).tolist()
        kw = dict(tensor_format="thd", cu_seqlens=torch.tensor(cu_of(lens), dtype=torch.int32, device=device))
        lead, smax = (sum(lens), ), max(lens)
    else:
        kw, lead, smax = dict(tensor_format="bshd"), (2, 1037), 1037
    q = torch.randn(lead + (hq, d), device=device).to(torch.bfloat16)
    k = torch.randn(lead + (hk, d), device=device).to(torch.bfloat16)
    freqs = rand_freqs(smax, d, device)
    poison_allocator(device, 2 * q.numel() * q.element_size())
    qo, ko = OPS.rope_fwd_qk(q, k, freqs, **kw)
    dq, dk = OPS.rope_bwd_qk(q, k, freqs, **kw)
    sync(device)
    ref_kw = {n: v.cpu() for n, v in kw.items() if n == "cu_seqlens"}
    for out, x, bwd in ((qo, q, False), (ko, k, False), (dq, q, True), (dk, k, True)):
        ref = rope_reference(x.cpu(), freqs.cpu(), fmt, False, backward=bwd, **ref_kw)
        check_out(out.cpu(), x.cpu(), ref, d, "out")


# ----------------------------------------------------------------------------------------------------------------
# autograd


@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["ni", "il"])
@pytest.mark.parametrize("cpk", ["cp1", "cp2r1"])
def test_gradcheck_cpu(fmt, interleaved, cpk):
    case = Case(fmt, 8, 6, h=2, b=2, s=4, cp=CP_CASES[cpk], start=cpk == "cp1", interleaved=interleaved,
                nseq_lens=[2, 3, 1] if cpk == "cp1" else [4, 8])
    x = torch.randn(case.lead + (case.h, case.d), dtype=torch.float64, requires_grad=True)
    freqs = rand_freqs(case.rows, case.d2, "cpu")
    kw = case.kwargs("cpu")
    assert torch.autograd.gradcheck(lambda t: OPS.rope_fwd(t, freqs, **kw), (x,))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_autograd_backward_matches_reference(device, fmt, dtype):
    """x.grad through rope_fwd equals the reference backward, for a dense gradient and for out.sum() (whose
    grad_output is an expanded tensor with all-zero strides)."""
    case = Case(fmt, 40, 24, cp=(2, 1), interleaved=fmt == "bshd")
    x0 = make_input(case.lead, case.h, case.d, dtype, device, "qkv")
    freqs = rand_freqs(case.rows, case.d2, device)
    kw = case.kwargs(device)
    g = torch.randn(x0.shape, device=device).to(dtype)
    x = x0.detach().requires_grad_(True)
    out = OPS.rope_fwd(x, freqs, **kw)
    assert out.requires_grad and out.grad_fn is not None
    out.backward(g)
    check_out(x.grad, g, case.ref(g, freqs, backward=True), case.d2, "x.grad")

    x.grad = None
    OPS.rope_fwd(x, freqs, **kw).sum().backward()
    ones = torch.ones_like(x0)
    check_out(x.grad, ones, case.ref(ones, freqs, backward=True), case.d2, "x.grad (sum)")
    assert freqs.grad is None


# ----------------------------------------------------------------------------------------------------------------
# argument validation


def _sbhd(device, s=8, b=2, h=2, d=8, dtype=torch.float32):
    return torch.randn(s, b, h, d, device=device).to(dtype)


def test_errors_structural(device):
    """Checks that need no tensor data: every device must raise, naming the argument."""
    x, f = _sbhd(device), rand_freqs(16, 8, device)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    xt = torch.randn(10, 2, 8, device=device)
    cases = [
        ("freqs", lambda: OPS.rope_fwd(x, rand_freqs(7, 8, device))),  # fewer rows than s
        ("freqs", lambda: OPS.rope_fwd(x, rand_freqs(12, 8, device), cp_size=2)),  # fewer than s * cp_size
        ("freqs", lambda: OPS.rope_bwd(x, rand_freqs(7, 8, device))),
        ("freqs|d2", lambda: OPS.rope_fwd(x, rand_freqs(16, 7, device))),  # d2 odd
        ("freqs|d2", lambda: OPS.rope_fwd(x, rand_freqs(16, 10, device))),  # d2 > d
        ("freqs", lambda: OPS.rope_fwd(x, f.half())),
        ("freqs", lambda: OPS.rope_fwd(x, f.double())),
        ("freqs", lambda: OPS.rope_fwd(x, f.reshape(16, 8))),  # rank 2
        ("freqs", lambda: OPS.rope_fwd(x, f.reshape(16, 2, 1, 4))),  # dims 1, 2 must be 1
        ("cu_seqlens", lambda: OPS.rope_fwd(xt, f, "thd")),  # missing
        ("cu_seqlens", lambda: OPS.rope_fwd(xt, f, "thd", cu_seqlens=i32([0, 4, 10]).long())),
        ("cu_seqlens", lambda: OPS.rope_fwd(xt, f, "thd", cu_seqlens=i32([[0, 4, 10]]))),  # rank 2
        ("cp_rank", lambda: OPS.rope_fwd(x, f, cp_size=2, cp_rank=2)),
        ("cp_rank", lambda: OPS.rope_fwd(x, f, cp_size=2, cp_rank=-1)),
        ("cp_size", lambda: OPS.rope_fwd(x, f, cp_size=0)),
        (r"(?i)cp_size|even|odd", lambda: OPS.rope_fwd(_sbhd(device, s=7), f, cp_size=2)),
        ("tensor_format", lambda: OPS.rope_fwd(x, f, "hbsd")),
        (r"\bt\b", lambda: OPS.rope_fwd(xt, f, "sbhd")),  # 3-D t for sbhd
        (r"\bt\b", lambda: OPS.rope_fwd(x, f, "thd", cu_seqlens=i32([0, 8]))),  # 4-D t for thd
        (r"\bt\b", lambda: OPS.rope_fwd(torch.randn(2, 8, device=device), f)),
        (r"(?i)dtype|\bt\b", lambda: OPS.rope_fwd(torch.ones(8, 2, 2, 8, dtype=torch.int32, device=device), f)),
        ("start_positions", lambda: OPS.rope_fwd(x, f, start_positions=i32([0, 1, 2]))),  # wrong length
        (r"\bk\b|\bq\b", lambda: OPS.rope_fwd_qk(x, _sbhd(device, s=6), f)),  # q/k sequence lengths disagree
    ]
    failures = []
    for pattern, fn in cases:
        try:
            with pytest.raises(ERR, match=pattern):
                fn()
        except BaseException as e:  # noqa: BLE001 (collect all, report together)
            failures.append(f"[{pattern}] {e!s}".splitlines()[0][:300])
    assert not failures, "\n".join(failures)


def test_errors_data_dependent(device):
    """Checks that read the values of cu_seqlens / start_positions (on CUDA a host sync; on by default, see
    fused_ops.set_sync_checks)."""
    x = _sbhd(device)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    xt = torch.randn(10, 2, 8, device=device)
    f = rand_freqs(16, 8, device)
    with pytest.raises(ERR, match="freqs|start_positions"):  # s + start beyond freqs rows
        OPS.rope_fwd(x, rand_freqs(8, 8, device), start_positions=i32([0, 1]))
    with pytest.raises(ERR, match="start_positions"):  # negative
        OPS.rope_fwd(x, f, start_positions=i32([0, -1]))
    with pytest.raises(ERR, match="cu_seqlens"):  # decreasing
        OPS.rope_fwd(xt, f, "thd", cu_seqlens=i32([0, 6, 4, 10]))
    with pytest.raises(ERR, match="cu_seqlens"):  # does not end at the token count
        OPS.rope_fwd(xt, f, "thd", cu_seqlens=i32([0, 5, 9]))
    with pytest.raises(ERR, match="cu_seqlens"):  # does not start at 0
        OPS.rope_fwd(xt, f, "thd", cu_seqlens=i32([1, 5, 10]))
    with pytest.raises(ERR, match="cu_seqlens"):  # under CP it must end at token count * cp_size
        OPS.rope_fwd(xt, f, "thd", cu_seqlens=i32([0, 4, 8]), cp_size=2)
    with pytest.raises(ERR, match=r"(?i)cu_seqlens|cp_size|even|odd"):  # local lengths 2 and 3: odd under CP
        OPS.rope_fwd(xt[:5], f, "thd", cu_seqlens=i32([0, 4, 10]), cp_size=2)
    with pytest.raises(ERR, match="freqs"):  # thd sequence longer than freqs
        OPS.rope_fwd(xt, rand_freqs(6, 8, device), "thd", cu_seqlens=i32([0, 3, 10]))


def test_float64_cpu_only(device):
    """float64 is accepted on CPU (gradcheck needs it) and rejected on CUDA."""
    x = _sbhd(device, dtype=torch.float64)
    f = rand_freqs(8, 8, device)
    if torch.device(device).type == "cpu":
        out = OPS.rope_fwd(x, f, "sbhd", True)
        assert out.dtype == torch.float64
        assert rel_err(out, rope_reference(x, f, "sbhd", True)) < 1e-6
    else:
        with pytest.raises(ERR, match=r"(?i)dtype|\bt\b|float64|double"):
            OPS.rope_fwd(x, f)


@pytest.mark.gpu
def test_errors_mixed_devices(gpu_device):
    x = _sbhd(gpu_device)
    f = rand_freqs(8, 8, "cpu")
    with pytest.raises(ERR, match="freqs|device"):
        OPS.rope_fwd(x, f)
    xt = torch.randn(10, 2, 8, device=gpu_device)
    with pytest.raises(ERR, match="cu_seqlens|device"):
        OPS.rope_fwd(xt, f.to(gpu_device), "thd", cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ERR, match="start_positions|device"):
        OPS.rope_fwd(x, f.to(gpu_device), start_positions=torch.tensor([0, 0], dtype=torch.int32))
    with pytest.raises(ERR, match=r"freqs|device|\bt\b"):  # cpu t with cuda freqs
        OPS.rope_fwd(x.cpu(), f.to(gpu_device))
    if torch.cuda.device_count() > 1:
        other = f"cuda:{(torch.device(gpu_device).index + 1) % torch.cuda.device_count()}"
        with pytest.raises(ERR, match="freqs|device"):
            OPS.rope_fwd(x, f.to(other))


# ----------------------------------------------------------------------------------------------------------------
# torch.library integration: opcheck, compile, meta, TorchScript


def _opcheck_samples():
    f = rand_freqs(20, 6, "cpu")
    cu = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    sp = torch.tensor([1, 0], dtype=torch.int32)
    sbhd = lambda rg=False: torch.randn(6, 2, 3, 8, requires_grad=rg)  # noqa: E731
    bshd = lambda rg=False: torch.randn(2, 6, 3, 8, requires_grad=rg)  # noqa: E731
    thd = lambda rg=False: torch.randn(12, 3, 8, requires_grad=rg)  # noqa: E731
    opts = [
        ((sbhd,), dict()),
        ((sbhd,), dict(tensor_format="sbhd", interleaved=True, start_positions=sp)),
        ((bshd,), dict(tensor_format="bshd", cp_size=2, cp_rank=1)),
        ((thd,), dict(tensor_format="thd", cu_seqlens=cu)),
        ((thd,), dict(tensor_format="thd", cu_seqlens=cu * 2, cp_size=2, cp_rank=0, interleaved=True)),
    ]
    return f, opts


OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _run_opcheck(op_name, test_utils):
    op = getattr(OPS, op_name).default
    f, opts = _opcheck_samples()
    for (mk,), kw in opts:
        if op_name == "rope_fwd":  # the differentiable op: also with inputs that require grad
            samples = [(mk(),), (mk(True),)]
        elif op_name in ("rope_fwd_qk", "rope_bwd_qk"):
            samples = [(mk(), mk())]
        else:
            samples = [(mk(),)]
        for tensors in samples:
            torch.library.opcheck(op, (*tensors, f), kw, test_utils=test_utils)


OPCHECKED = ["rope_fwd", "rope_bwd", "rope_fwd_", "rope_fwd_qk", "rope_bwd_qk"]


def test_every_tensor_op_is_opchecked():
    """Every op of the `fused` namespace that takes tensors has an opcheck case here."""
    names = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused::")}
    tensor_ops = {n for n in names
                  if any(isinstance(a.type, torch.TensorType) for a in getattr(OPS, n).default._schema.arguments)}
    from test_decode_attention_ops import OPCHECKED as attention_ops
    from test_ffn_ops import OPCHECKED as ffn_ops
    from test_linear_dual_ops import OPCHECKED as linear_dual_ops
    from test_rms_norm_ops import OPCHECKED as norm_ops
    from test_route import OPCHECKED as route_ops

    checked = set(OPCHECKED + linear_dual_ops + ffn_ops + route_ops + attention_ops + norm_ops)
    assert tensor_ops - checked == set(), "ops without an opcheck case"
    assert set(OPCHECKED) <= names


@pytest.mark.parametrize("op_name", OPCHECKED)
def test_opcheck(op_name):
    _run_opcheck(op_name, OPCHECK_UTILS)


def test_torch_compile_fullgraph_cpu():
    torch._dynamo.reset()
    f = rand_freqs(16, 8, "cpu")
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)

    def fn(x, xt):
        a = OPS.rope_fwd(x, f, "sbhd", True)
        b = OPS.rope_fwd(xt, f, tensor_format="thd", cu_seqlens=cu)
        q, k = OPS.rope_fwd_qk(x.detach(), x.detach() * 2, f, "sbhd")
        return a * 2 + q - k, b.sin()

    cfn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for s in (8, 12):  # a second shape: recompiles or runs dynamic, must not break the graph
        x = torch.randn(s, 2, 3, 12, requires_grad=True)
        xt = torch.randn(10, 3, 12, requires_grad=True)
        want = fn(x, xt)
        got = cfn(x, xt)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w)
        gw = torch.autograd.grad(sum(w.sum() for w in want), (x, xt))
        gg = torch.autograd.grad(sum(g.sum() for g in got), (x, xt))
        for w, g in zip(gw, gg):
            torch.testing.assert_close(g, w)


def test_torch_compile_wrapper_fullgraph_cpu():
    torch._dynamo.reset()
    rpe = RotaryPositionEmbedding(8, rotary_percent=0.75, device="cpu")
    fn = lambda x: apply_rotary_pos_emb(x, rpe(x.shape[0]), "sbhd")  # noqa: E731
    x = torch.randn(9, 2, 3, 8)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(x), fn(x))


def test_meta_device():
    for fmt, shape, cu in (("sbhd", (7, 2, 3, 16), None), ("bshd", (2, 7, 3, 16), None), ("thd", (11, 3, 16), 3)):
        x = torch.empty(shape, device="meta", dtype=torch.bfloat16)
        f = torch.empty(32, 1, 1, 8, device="meta", dtype=torch.float32)
        kw = dict(tensor_format=fmt)
        if cu is not None:
            kw["cu_seqlens"] = torch.empty(cu, device="meta", dtype=torch.int32)
        for out in (OPS.rope_fwd(x, f, **kw), OPS.rope_bwd(x, f, **kw), *OPS.rope_fwd_qk(x, x[..., :1, :], f, **kw)):
            assert out.device.type == "meta" and out.dtype == torch.bfloat16
            assert out.shape in (x.shape, x[..., :1, :].shape)
        assert OPS.rope_fwd_(x, f, **kw) is None


def _scripted_sbhd(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    return torch.ops.fused.rope_fwd(t, freqs, "sbhd", True, None, None, 1, 0)


def _scripted_thd(t: torch.Tensor, freqs: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    return torch.ops.fused.rope_fwd(t, freqs, "thd", False, cu, None, 1, 0)


def test_torchscript_cpu():
    f = rand_freqs(12, 8, "cpu")
    x = torch.randn(5, 2, 3, 8)
    s1 = torch.jit.script(_scripted_sbhd)
    torch.testing.assert_close(s1(x, f), OPS.rope_fwd(x, f, "sbhd", True), rtol=0, atol=0)
    xt = torch.randn(9, 3, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    s2 = torch.jit.script(_scripted_thd)
    torch.testing.assert_close(s2(xt, f, cu), rope_reference(xt, f, "thd", cu_seqlens=[0, 4, 9]).float(),
                               rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Python API: RotaryPositionEmbedding and apply_rotary_pos_emb


@pytest.mark.parametrize("interleaved", [False, True], ids=["ni", "il"])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5, 0.75])
@pytest.mark.parametrize("offset", [0, 5])
def test_rotary_position_embedding(interleaved, rotary_percent, offset):
    dim, n, base = 40, 23, 500.0
    rpe = RotaryPositionEmbedding(dim, rotary_percent, rotary_base=base, interleaved=interleaved, device="cpu")
    freqs = rpe(n, offset=offset)
    d2 = int(dim * rotary_percent) if rotary_percent < 1 else dim
    assert freqs.shape == (n, 1, 1, d2) and freqs.dtype == torch.float32
    inv = 1.0 / base ** (torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    ang = torch.outer(torch.arange(n, dtype=torch.float64) + offset, inv)  # [n, d2/2]
    want = torch.stack((ang, ang), -1).reshape(n, d2) if interleaved else torch.cat((ang, ang), -1)
    torch.testing.assert_close(freqs.reshape(n, d2).double(), want, rtol=2e-6, atol=1e-6)
    f2 = freqs.reshape(n, d2)
    if interleaved:
        assert torch.equal(f2[:, 0::2], f2[:, 1::2])
    else:
        assert torch.equal(f2[:, : d2 // 2], f2[:, d2 // 2:])
    assert "inv_freq" in rpe.state_dict()


def test_rotary_position_embedding_interpolation():
    dim = 16
    plain = RotaryPositionEmbedding(dim, device="cpu")
    # factor alone is ignored (TE applies it only together with pretrained_max_position_embeddings)
    torch.testing.assert_close(RotaryPositionEmbedding(dim, seq_len_interpolation_factor=2, device="cpu")(10),
                               plain(10), rtol=0, atol=0)
    rpe = RotaryPositionEmbedding(dim, seq_len_interpolation_factor=2, pretrained_max_position_embeddings=16,
                                  device="cpu")
    inv = plain.inv_freq.double()
    # fixed linear scaling while max_seq_len <= 16 * 2: positions / 2
    torch.testing.assert_close(rpe(20)[:, 0, 0, : dim // 2].double(), torch.outer(torch.arange(20.0) / 2, inv),
                               rtol=1e-6, atol=1e-6)
    # dynamic scaling beyond: positions * 16 / max_seq_len
    torch.testing.assert_close(rpe(40)[:, 0, 0, : dim // 2].double(),
                               torch.outer(torch.arange(40.0) * 16 / 40, inv), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True], ids=["ni", "il"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_apply_rotary_pos_emb_end_to_end(device, fmt, interleaved):
    d, n = 32, 24
    rpe = RotaryPositionEmbedding(d, rotary_percent=0.5, interleaved=interleaved, device=device)
    freqs = rpe(n)
    cu = [0, 9, 13, 24] if fmt == "thd" else None
    shape = {"sbhd": (n, 2, 4, d), "bshd": (2, n, 4, d), "thd": (24, 4, d)}[fmt]
    x = torch.randn(shape, device=device).to(torch.bfloat16).requires_grad_(True)
    kw = dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device)) if cu else {}
    out = apply_rotary_pos_emb(x, freqs, fmt, interleaved=interleaved, **kw)
    check_out(out.detach(), x.detach(), rope_reference(x, freqs, fmt, interleaved, cu), d // 2)
    out.float().square().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    g = 2 * out.detach()
    check_out(x.grad, g, rope_reference(g, freqs, fmt, interleaved, cu, backward=True), d // 2, "grad")
    # fused=False is accepted and ignored; non-float32 freqs are cast (as TE does)
    out2 = apply_rotary_pos_emb(x.detach(), freqs.double(), fmt, interleaved=interleaved, fused=False, **kw)
    assert torch.equal(out2, out.detach())
    k_in = x.detach()[..., :2, :]
    q, k = apply_rotary_pos_emb_qk(x.detach(), k_in, freqs, fmt, interleaved=interleaved, **kw)
    check_out(q, x.detach(), rope_reference(x, freqs, fmt, interleaved, cu), d // 2, "q")
    check_out(k, k_in, rope_reference(k_in, freqs, fmt, interleaved, cu), d // 2, "k")


def test_apply_rotary_pos_emb_start_positions_and_flag_guard():
    x = torch.randn(6, 2, 2, 8)
    freqs = RotaryPositionEmbedding(8, device="cpu")(16)
    sp = torch.tensor([3, 1], dtype=torch.int32)
    out = apply_rotary_pos_emb(x, freqs, start_positions=sp)
    assert rel_err(out, rope_reference(x, freqs, start_positions=[3, 1])) < 1e-5
    # TE 2.x's positional order: start_positions is the 4th argument
    assert torch.equal(apply_rotary_pos_emb(x, freqs, "sbhd", sp), out)
    with pytest.raises(TypeError, match="interleaved"):  # a non-bool where the flag belongs
        apply_rotary_pos_emb(x, freqs, "sbhd", None, sp)


def test_product_never_imports_triton():
    code = "import sys, fused_ops, fused_ops.rope; assert 'triton' not in sys.modules, 'triton imported'"
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(fused_ops.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pkg_parent, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
