"""Interpreter tier: kernels/rope.py's rope_kernel itself, run by Triton's interpreter on the CPU.

This is the code that the AOT step compiles, checked on small shapes against the float64 reference, with the
argument packing of csrc/ops/rope_cuda.cpp (mirrored in rope_interp_launch.py). fp32 only: the interpreter
computes fp16/bf16 on raw bits. Skipped when triton is not installed (it is a build-time dependency).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from reference import rope_reference  # noqa: E402
from reference_routed import rel_err  # noqa: E402
from rope_interp_launch import rope_launch  # noqa: E402


def poison(x):
    return x.fill_(float("nan"))


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d,d2", [(16, 16), (40, 24), (32, 8)])
@pytest.mark.parametrize("backward", [False, True])
def test_rope_kernel_sbhd_bshd(fmt, interleaved, d, d2, backward):
    s, b, h = 7, 3, 5
    t = torch.randn((s, b, h, d) if fmt == "sbhd" else (b, s, h, d))
    f = torch.randn(s + 3, 1, 1, d2)  # random: both halves differ, so a wrong pairing shows
    out = rope_launch(t, f, fmt, interleaved, backward=backward)
    ref = rope_reference(t, f, fmt, interleaved, backward=backward)
    assert rel_err(out, ref) < 1e-6
    assert torch.equal(out[..., d2:], t[..., d2:])


def test_rope_kernel_strided_start_positions_cp():
    s, b, h, d = 8, 2, 3, 16
    qkv = torch.randn(s, b, 3 * h + 1, d)
    q = qkv[:, :, 1:h + 1]  # a non-contiguous view
    f = torch.randn(64, 1, 1, d)
    start = torch.tensor([3, 11], dtype=torch.int32)
    for cp_size, cp_rank in [(1, 0), (2, 0), (2, 1)]:
        out = rope_launch(q, f, "sbhd", False, start_positions=start, cp_size=cp_size, cp_rank=cp_rank)
        ref = rope_reference(q, f, "sbhd", False, start_positions=start, cp_size=cp_size, cp_rank=cp_rank)
        assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cp_size,cp_rank", [(1, 0), (2, 1)])
def test_rope_kernel_thd(interleaved, cp_size, cp_rank):
    h, d, d2 = 3, 24, 16
    lens = [4, 0, 12, 8, 20]  # uneven, one empty; multiples of 2*cp_size
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1]) // cp_size
    t = torch.randn(T, h, d)
    f = torch.randn(40, 1, 1, d2)
    start = torch.tensor([1, 0, 5, 2, 0], dtype=torch.int32)
    out = rope_launch(t, f, "thd", interleaved, cu_seqlens=cu, start_positions=start, cp_size=cp_size,
                      cp_rank=cp_rank)
    ref = rope_reference(t, f, "thd", interleaved, cu_seqlens=cu, start_positions=start, cp_size=cp_size,
                         cp_rank=cp_rank)
    assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_kernel_inplace_and_second_tensor(interleaved):
    b, s, d = 2, 6, 32
    q = torch.randn(b, s, 4, d)
    k = torch.randn(b, s, 2, d)
    f = torch.randn(s, 1, 1, d)
    ref_q = rope_reference(q, f, "bshd", interleaved)
    ref_k = rope_reference(k, f, "bshd", interleaved)
    qo, ko = rope_launch(q, f, "bshd", interleaved, second=k)
    assert rel_err(qo, ref_q) < 1e-6 and rel_err(ko, ref_k) < 1e-6
    q2, k2 = q.clone(), k.clone()
    rope_launch(q2, f, "bshd", interleaved, second=k2, inplace=True)
    assert rel_err(q2, ref_q) < 1e-6 and rel_err(k2, ref_k) < 1e-6


def test_rope_kernel_out_of_range_positions_read_nothing():
    # Positions beyond freqs must not read out of bounds: the kernel masks them (host checks reject such calls).
    s, b, h, d = 4, 1, 2, 8
    t = torch.randn(s, b, h, d)
    f = torch.randn(2, 1, 1, d)
    out = rope_launch(t, f, "sbhd", False)
    ref = rope_reference(t[:2], f, "sbhd", False)
    assert rel_err(out[:2], ref) < 1e-6
    assert torch.isfinite(out).all()


def test_rope_kernel_large_angles_fp32_accuracy():
    # Positions times frequencies reach thousands of radians (s = 16K, inv_freq up to 1): the kernel's own
    # range-reduced sin/cos must stay fp32-accurate there.
    s, b, h, d = 64, 1, 2, 32
    t = torch.randn(s, b, h, d)
    f = (torch.rand(s, 1, 1, d) * 16384.0).float()
    for backward in (False, True):
        out = rope_launch(t, f, "sbhd", False, backward=backward)
        ref = rope_reference(t, f, "sbhd", False, backward=backward)
        assert rel_err(out, ref) < 2e-6


@pytest.mark.parametrize("lens", [[9], [1] * 37, [0, 3, 0, 0, 5, 1, 0], [2, 0, 0], [1, 0] * 100 + [2] * 61],
                         ids=["one", "many", "empties", "trailing-empty", "search"])
def test_rope_kernel_thd_sequence_search(lens):
    # The kernel finds each token's sequence by one compare against every start (up to SCAN_B sequences) or by a
    # binary search over cu_seqlens (beyond): one sequence, more sequences than a power of two, runs of empty
    # sequences (which share their start with the next), empty ones at the end, and 261 sequences (the search).
    from kernels.rope import SCAN_B
    assert (len(lens) > SCAN_B.value) == (len(lens) == 261), "the search case must exceed SCAN_B, the others not"
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = torch.randn(int(cu[-1]), 3, 16)
    f = torch.randn(16, 1, 1, 16)
    start = torch.randint(0, 6, (len(lens), ), dtype=torch.int32)
    for block_t in (1, 4):
        out = rope_launch(t, f, "thd", False, cu_seqlens=cu, start_positions=start, block_t=block_t)
        assert rel_err(out, rope_reference(t, f, "thd", False, cu_seqlens=cu, start_positions=start)) < 1e-6


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("hq,hk", [(8, 1), (3, 2)])
def test_rope_kernel_few_heads_many_tokens_per_program(hq, hk, interleaved):
    # A tensor-parallel slice's GQA (8 query heads, 1 KV head) with more tokens per program than heads, and a token
    # count that leaves the last program partly empty: the empty rows must neither read nor write; head tiles smaller
    # and larger than either tensor's heads, k a view whose head stride is not q's.
    b, s, d = 1, 13, 32
    q = torch.randn(b, s, hq, d)
    k = torch.randn(b, s, 2 * hk + 1, d)[:, :, 1::2]  # head stride 2 d: not q's
    f = torch.randn(s, 1, 1, d)
    for block_t, block_h in ((8, 4), (4, 16), (1, 8)):
        qo, ko = rope_launch(q, f, "bshd", interleaved, second=k, block_t=block_t, block_h=block_h)
        assert rel_err(qo, rope_reference(q, f, "bshd", interleaved)) < 1e-6
        assert rel_err(ko, rope_reference(k, f, "bshd", interleaved)) < 1e-6
        q2, k2 = q.clone(), k.clone()
        rope_launch(q2, f, "bshd", interleaved, second=k2, inplace=True, block_t=block_t, block_h=block_h)
        assert rel_err(q2, rope_reference(q, f, "bshd", interleaved)) < 1e-6
        assert rel_err(k2, rope_reference(k, f, "bshd", interleaved)) < 1e-6


def _shipped_rope_configs():
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from aot import config_table, manifest
    return sorted({tuple(e["block"]) for a in manifest.ARCHS
                   for e in config_table.buckets(config_table.load(a), "rope_kernel", "all")})


@pytest.mark.parametrize("block", _shipped_rope_configs(), ids=lambda b: "x".join(map(str, b)))
def test_rope_kernel_shipped_configs(block):
    """Each rope config of aot/configs/*.json (BLOCK_T, BLOCK_H, BLOCK_HALF) on shapes that exceed every block: more
    tokens than BLOCK_T (and not a multiple of it), more heads than BLOCK_H, more pairs than BLOCK_HALF."""
    bt, bh, bhalf = block
    kw = dict(block_t=bt, block_h=bh, block_half=bhalf)
    s, b, h, d = bt + 1, 2, bh + 3, 2 * bhalf + 40
    t = torch.randn(s, b, h, d)
    f = torch.randn(s, 1, 1, 2 * bhalf + 8)
    assert rel_err(rope_launch(t, f, "sbhd", **kw), rope_reference(t, f, "sbhd", False)) < 1e-6
    lens = torch.randint(0, 3, (2 * bt + 5, ))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    tt = torch.randn(int(cu[-1]), 2, 16)
    ft = torch.randn(8, 1, 1, 16)
    out = rope_launch(tt, ft, "thd", True, cu_seqlens=cu, **kw)
    assert rel_err(out, rope_reference(tt, ft, "thd", True, cu_seqlens=cu)) < 1e-6
