"""Interpreter tier: kernels/decode_attention.py itself (the attention kernel and the combine of its splits), run by
Triton's interpreter on the CPU with the argument packing, grids, split rule and workspace layout of
csrc/ops/decode_attention_cuda.cpp (mirrored in decode_attention_interp_launch.py), against the float64 reference.
fp32 only (the interpreter computes fp16 / bf16 on raw bits), small shapes. Skipped when triton is not installed (a
build-time dependency)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from decode_attention_interp_launch import decode_attention_launch  # noqa: E402
from reference_attention import cache_after, decode_attention_reference  # noqa: E402
from reference_routed import rel_err  # noqa: E402


def make(B, T, Hq, Hkv, D, S, lens, seed=0):
    """q / k_new / v_new: views of one fused QKV output; caches: views of longer ones (sequence stride != S * D)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, Hq + 2 * Hkv, D, generator=g)
    kc = torch.randn(B, Hkv, S + 2, D, generator=g)[:, :, :S]
    vc = torch.randn(B, Hkv, S + 2, D, generator=g)[:, :, :S]
    return (qkv[:, :, :Hq], kc, vc, qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:],
            torch.tensor(lens, dtype=torch.int32))


def check(B, T, Hq, Hkv, D, S, lens, **launch):
    q, kc, vc, kn, vn, cl = make(B, T, Hq, Hkv, D, S, lens)
    ref = decode_attention_reference(q, kc, vc, kn, vn, cl)
    want_k, want_v = cache_after(kc, kn, cl), cache_after(vc, vn, cl)
    out = torch.full((B, T, Hq, D), float("nan"))  # poisoned: every element must be written
    decode_attention_launch(q, kc, vc, kn, vn, cl, out=out, **launch)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-6, rel_err(out, ref)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("hq,hkv,T,n_split", [(4, 4, 1, 1), (4, 4, 1, 8), (8, 2, 3, 1), (8, 2, 3, 3), (8, 2, 3, 8),
                                             (8, 1, 16, 1), (8, 1, 16, 8)],
                         ids=["gqa1-t1-splits1", "gqa1-t1-splits8", "gqa4-t3-splits1", "gqa4-t3-splits3",
                              "gqa4-t3-splits8", "gqa8-t16-splits1", "gqa8-t16-splits8"])
def test_kernel_ragged_lengths(hq, hkv, T, n_split):
    """Ragged odd lengths around the key block (16 here): the empty cache, lengths whose new tokens straddle a block
    boundary (the two-block tail), the last position that fits; one split (the output written directly) and several
    (the combine; 8 splits leave the short sequences' later splits empty). gqa8-t16: 128 query rows per KV head,
    8 row chunks of BLOCK_M = 16."""
    S = 61
    check(4, T, hq, hkv, 16, S, [0, 15, 33, S - T], n_split=n_split, block_n=16, block_m=16)


def test_kernel_split_rule_and_long_sequence():
    """The launcher's own split count (decode_attention_split for 132 SMs: 28 here) over an odd length of several
    hundred positions, a key block of 32 and head dim 32."""
    check(1, 2, 4, 2, 32, 901, [897], block_n=32, block_m=16)


def test_kernel_wide_rows_and_blocks():
    """BLOCK_M 32 / 64 (one row chunk for 32 query rows), BLOCK_N 64, head dim 64: the tables' shapes."""
    check(2, 4, 16, 2, 64, 150, [77, 130], block_n=64, block_m=32, n_split=2)
    check(1, 8, 8, 1, 64, 140, [129], block_n=64, block_m=64, n_split=1)


def test_kernel_lengths_past_the_cache():
    """cache_lens[b] < 0 or + T > S: NaN outputs for that sequence, its cache rows unchanged (nothing read or
    written outside the cache); the others computed and written, with one split and with several."""
    B, T, Hq, Hkv, D, S = 4, 2, 4, 2, 16, 40
    lens = [5, S - T + 1, -1, S - T]
    for n_split in (1, 4):
        q, kc, vc, kn, vn, cl = make(B, T, Hq, Hkv, D, S, lens)
        kc0, vc0 = kc.clone(), vc.clone()
        out = decode_attention_launch(q, kc, vc, kn, vn, cl, n_split=n_split, block_n=16)
        good = [0, 3]
        assert out[[1, 2]].isnan().all() and not out[good].isnan().any()
        ref = decode_attention_reference(q[good], kc0[good], vc0[good], kn[good], vn[good], cl[good])
        assert rel_err(out[good], ref) < 1e-6
        assert torch.equal(kc[[1, 2]], kc0[[1, 2]]) and torch.equal(vc[[1, 2]], vc0[[1, 2]])
        assert torch.equal(kc[good], cache_after(kc0[good], kn[good], cl[good]))


def test_kernel_scale_and_extreme_scores():
    """A large scale (scores of several hundred: the online softmax's running max must keep exp2 finite; fp32's
    exponentials of such arguments lose a few more bits) and a small one."""
    q, kc, vc, kn, vn, cl = make(2, 3, 4, 2, 16, 50, [20, 47])
    for scale in (40.0, 1e-3):
        ref = decode_attention_reference(q, kc, vc, kn, vn, cl, scale)
        out = decode_attention_launch(q, kc.clone(), vc.clone(), kn, vn, cl, scale=scale, n_split=3, block_n=16)
        assert rel_err(out, ref) < 1e-5, scale
