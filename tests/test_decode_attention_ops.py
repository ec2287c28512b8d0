"""Op-level tests of `torch.ops.fused.decode_attention` (the contract: csrc/torch_bindings.cpp).

Correctness against the float64 oracle of tests/reference_attention.py, written from the contract: ||out - ref|| /
||ref|| per dtype, and the caches after the call equal to the reference's exactly (the new rows written, nothing
else touched). The CPU tier (CI) uses small, odd shapes; the GPU tier (`-m gpu`, skipped without a CUDA device) the
compiled kernels: bf16 / fp16, head dims 64 / 128 / 256, lengths up to 33,000, GQA 1 / 4 / 8, ragged batches,
poisoned outputs, lengths past the cache, strided and unaligned views, one CUDA graph replayed at other lengths.
"""
import math

import pytest
import torch

import fused_ops
from device_helpers import poison_allocator, sync
from reference_attention import cache_after, decode_attention_reference
from reference_routed import rel_err

OPS = torch.ops.fused
ERR = (RuntimeError, ValueError)

# ||out - ref|| / ||ref||. The CPU path computes in fp32 (fp64 for fp64) and rounds once. The kernels also round the
# softmax weights to the input dtype before the P·V product (tensor cores), about doubling the output rounding; on an
# H200 bf16 gave 1.8e-3 to 2.3e-3 and fp16 1.7e-4 to 2.8e-4 (lengths 1 to 33,000; kernels/decode_attention.py run by
# Triton's JIT): ~4x margin.
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DT_ID = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def make_inputs(B, T, Hq, Hkv, D, S, lens, dtype, device, qkv_views=True, cache_pad=0, seed=0):
    """(q, k_cache, v_cache, k_new, v_new, cache_lens). qkv_views: q, k_new, v_new are the slices of one fused QKV
    output [B, T, Hq + 2 Hkv, D] (strided views, as a model passes them); cache_pad > 0: the caches are views of
    [B, Hkv, S + cache_pad, D] tensors (a cache whose sequence stride is not S * D)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if qkv_views:
        qkv = r(B, T, Hq + 2 * Hkv, D)
        q, k_new, v_new = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    else:
        q, k_new, v_new = r(B, T, Hq, D), r(B, T, Hkv, D), r(B, T, Hkv, D)
    k_cache, v_cache = r(B, Hkv, S + cache_pad, D)[:, :, :S], r(B, Hkv, S + cache_pad, D)[:, :, :S]
    lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, k_new, v_new, lens


def run_and_check(q, k_cache, v_cache, k_new, v_new, lens, scale=None, what=""):
    """Calls the op on copies of the caches and checks out (metadata, no NaN, accuracy) and both caches (exact)."""
    ref = decode_attention_reference(q, k_cache, v_cache, k_new, v_new, lens, scale)
    want_k, want_v = cache_after(k_cache, k_new, lens), cache_after(v_cache, v_new, lens)
    kc, vc = k_cache.clone(), v_cache.clone()
    poison_allocator(q.device, q.numel() * q.element_size())
    out = OPS.decode_attention(q, kc, vc, k_new, v_new, lens, scale)
    sync(q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.is_contiguous(), what
    assert not out.isnan().any(), f"{what}: NaN in the output (an element not written?)"
    err = rel_err(out, ref)
    assert err <= TOL[q.dtype], f"{what}: relative error {err:.3g} > {TOL[q.dtype]:.1g}"
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v), f"{what}: the caches are not what the contract says"
    return out


# ----------------------------------------------------------------------------------------------------------------
# CPU (and the same cases on every GPU)


@pytest.mark.parametrize("dtype,hq,hkv", [(torch.float32, 4, 4), (torch.float32, 16, 2), (torch.float16, 8, 2),
                                          (torch.bfloat16, 16, 2), (torch.bfloat16, 4, 4), (torch.float64, 8, 2)],
                         ids=["fp32-gqa1", "fp32-gqa8", "fp16-gqa4", "bf16-gqa8", "bf16-gqa1", "fp64-gqa4"])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_cpu_matches_reference(dtype, hq, hkv, T):
    """Ragged lengths (empty cache, odd lengths, the last position that fits), GQA ratios 1 / 4 / 8, 1 to 16 new
    tokens, q / k_new / v_new as views of one QKV output, caches whose sequence stride is not S * D."""
    S = 53
    lens = [0, 7, 33, S - T]
    inputs = make_inputs(len(lens), T, hq, hkv, 24, S, lens, dtype, "cpu", cache_pad=3)
    run_and_check(*inputs, what=f"{DT_ID[dtype]} {hq}/{hkv} T={T}")


def test_cpu_scale_and_contiguous_inputs():
    q, kc, vc, kn, vn, lens = make_inputs(3, 2, 6, 3, 16, 20, [5, 0, 18], torch.float32, "cpu", qkv_views=False)
    run_and_check(q, kc, vc, kn, vn, lens, scale=0.37, what="scale 0.37")
    # The default scale is 1/sqrt(D): the same as passing it.
    a = OPS.decode_attention(q, kc.clone(), vc.clone(), kn, vn, lens)
    b = OPS.decode_attention(q, kc.clone(), vc.clone(), kn, vn, lens, 1 / math.sqrt(16))
    assert torch.equal(a, b)


def test_cpu_wrapper_and_empty_batch():
    q, kc, vc, kn, vn, lens = make_inputs(2, 1, 4, 2, 8, 9, [3, 8], torch.float32, "cpu")
    out = fused_ops.decode_attention(q, kc, vc, kn, vn, lens)
    torch.testing.assert_close(out.double(), decode_attention_reference(q, kc, vc, kn, vn, lens), rtol=0, atol=1e-6)
    q, kc, vc, kn, vn, lens = make_inputs(0, 1, 4, 2, 8, 9, [], torch.float32, "cpu")
    assert OPS.decode_attention(q, kc, vc, kn, vn, lens).shape == (0, 1, 4, 8)


def test_cpu_length_past_the_cache_raises_and_touches_nothing():
    S, T = 12, 3
    for bad in (S - T + 1, S, -1):
        q, kc, vc, kn, vn, lens = make_inputs(3, T, 4, 2, 8, S, [2, bad, 4], torch.float32, "cpu")
        kc0, vc0 = kc.clone(), vc.clone()
        with pytest.raises(ValueError, match=r"cache_lens\[1\] = " + str(bad)):
            OPS.decode_attention(q, kc, vc, kn, vn, lens)
        assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "a failed call changed the caches"


def _bad_calls():
    """(what the error must name, a function of the valid inputs that returns bad ones)."""
    def sub(i, t):
        return lambda a: a[:i] + [t(a[i])] + a[i + 1:]
    return [
        ("cache_lens", sub(5, lambda t: t.long())),
        ("cache_lens", sub(5, lambda t: t[:1])),
        ("cache_lens", sub(5, lambda t: t.view(1, -1))),
        ("k_new", sub(3, lambda t: t.double())),
        ("q", sub(0, lambda t: t.to(torch.int32))),
        ("v_cache", sub(2, lambda t: t.half())),
        ("T|new tokens", lambda a: [x.repeat(1, 17, 1, 1) if i in (0, 3, 4) else x for i, x in enumerate(a)]),
        ("multiple|Hkv", sub(0, lambda t: t[:, :, :3])),
        ("k_new", sub(3, lambda t: t[:1])),
        ("v_new", sub(4, lambda t: t[..., :4])),
        ("k_cache", sub(1, lambda t: t[:, :1])),
        ("v_cache", sub(2, lambda t: t[:, :, :5])),
        ("k_cache", sub(1, lambda t: t[..., 0])),
        ("q.*contiguous last|contiguous last", sub(0, lambda t: t.transpose(2, 3).contiguous().transpose(2, 3))),
        ("k_cache.*overlap|overlap", sub(1, lambda t: t[:, :, :1].expand(t.shape))),
        ("share memory", lambda a: a[:2] + [a[1]] + a[3:]),
    ]


@pytest.mark.parametrize("name,bad", _bad_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_errors_name_the_argument(device, name, bad):
    q, kc, vc, kn, vn, lens = make_inputs(2, 2, 4, 2, 64, 9, [3, 5], torch.bfloat16, device)
    args = bad([q, kc, vc, kn, vn, lens])
    kc0 = kc.clone()
    with pytest.raises(ERR, match=name):
        OPS.decode_attention(*args)
    assert torch.equal(kc, kc0)


def test_meta_shapes_and_errors():
    q, kc, vc, kn, vn, lens = make_inputs(3, 2, 8, 2, 16, 30, [1, 2, 3], torch.float32, "meta")
    out = OPS.decode_attention(q, kc, vc, kn, vn, lens)
    assert out.shape == (3, 2, 8, 16) and out.device.type == "meta" and out.is_contiguous()
    with pytest.raises(ERR, match="multiple"):
        OPS.decode_attention(q[:, :, :5], kc, vc, kn, vn, lens)


OPCHECKED = ["decode_attention"]  # tests/test_rope_ops.py checks that every op of the library has an opcheck case


def test_opcheck_schema_and_fake():
    """torch.library.opcheck: the schema's mutation annotations (k_cache, v_cache written, nothing else), the Meta
    kernel against the CPU kernel, and the op under torch.compile's fake tensors."""
    args = list(make_inputs(2, 2, 4, 2, 8, 10, [3, 7], torch.float32, "cpu"))
    torch.library.opcheck(OPS.decode_attention.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_split_rule_matches_the_python_launcher():
    """The C++ launcher's split count (torch.ops.fused._decode_attention_split) equals kernels/decode_attention.py's
    decode_attention_split, which the interpreter tests and benchmarks use, over every boundary of the rule."""
    pytest.importorskip("triton")
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from kernels.decode_attention import decode_attention_split
    for sms in (1, 78, 108, 132):
        for programs in (1, 2, 7, 8, 64, 127, 128, 129, 264, 265, 1000):
            for S in (1, 16, 31, 32, 63, 64, 65, 1040, 8208, 32784, 33017, 131072):
                for bn in (16, 32, 64, 128):
                    want = decode_attention_split(programs, S, bn, sms)
                    assert OPS._decode_attention_split(programs, S, bn, sms) == want, (programs, S, bn, sms)


# ----------------------------------------------------------------------------------------------------------------
# GPU


def _gpu_cases():
    """(dtype, D, B, T, Hq, Hkv, S, lens): every head dim and dtype, GQA 1 / 4 / 8, 1 to 16 tokens, lengths from 0 to
    33,000 (odd, even, multiples of the key block and one off them), ragged batches."""
    bf, fp = torch.bfloat16, torch.float16
    return [
        (bf, 128, 3, 1, 32, 8, 33017, [32999, 1, 4097]),
        (fp, 128, 4, 3, 16, 4, 700, [0, 33, 511, 697]),
        (bf, 64, 1, 16, 64, 8, 3001, [2985]),
        (fp, 64, 2, 16, 8, 1, 2000, [1, 1983]),
        (bf, 256, 2, 4, 4, 4, 5003, [4095, 17]),
        (fp, 256, 16, 1, 32, 8, 9000, [(7919 * i + 13) % 8999 for i in range(16)]),
        (bf, 64, 5, 2, 8, 8, 33003, [33001, 0, 64, 63, 65]),
        (fp, 128, 2, 16, 16, 2, 16400, [16383, 12]),  # 128 query rows per KV head: several row chunks
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: f"{DT_ID[c[0]]}-d{c[1]}-b{c[2]}-t{c[3]}-{c[4]}_{c[5]}")
def test_gpu_matches_reference(gpu_device, case):
    dtype, D, B, T, Hq, Hkv, S, lens = case
    inputs = make_inputs(B, T, Hq, Hkv, D, S, lens, dtype, gpu_device, cache_pad=5)
    run_and_check(*inputs, what=str(case[:7]))
    # The same on contiguous tensors, and against the CPU path (float32 math there).
    q, kc, vc, kn, vn, cl = make_inputs(B, T, Hq, Hkv, D, S, lens, dtype, gpu_device, qkv_views=False)
    out = run_and_check(q, kc, vc, kn, vn, cl, what=str(case[:7]) + " contiguous")
    cpu = OPS.decode_attention(q.cpu().float(), kc.cpu().float(), vc.cpu().float(), kn.cpu().float(),
                               vn.cpu().float(), cl.cpu())
    assert rel_err(out, cpu) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DT_ID.get)
def test_gpu_unaligned_views_are_copied_aligned(gpu_device, dtype):
    """q / k_new / v_new views that start one element into their storage (not 16-byte aligned; the kernel is compiled
    for aligned tensors only) are copied by the launcher: the same result as aligned inputs."""
    B, T, Hq, Hkv, D, S = 2, 2, 8, 2, 128, 300
    base = torch.randn(B * T * (Hq + 2 * Hkv) * D + 1, device=gpu_device).to(dtype)
    qkv = base[1:].view(B, T, Hq + 2 * Hkv, D)
    q, kn, vn = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    _, kc, vc, _, _, lens = make_inputs(B, T, Hq, Hkv, D, S, [299 - T, 100], dtype, gpu_device)
    assert q.data_ptr() % 16 != 0
    run_and_check(q, kc, vc, kn, vn, lens, what="unaligned")


@pytest.mark.gpu
def test_gpu_unaligned_cache_is_refused(gpu_device):
    """A cache view that starts inside a row (not 16-byte aligned) cannot be copied (the op writes it in place): on
    CUDA it raises ValueError naming the cache, and nothing is written."""
    B, T, Hq, Hkv, D, S = 2, 1, 8, 2, 128, 64
    q, kc, vc, kn, vn, lens = make_inputs(B, T, Hq, Hkv, D, S, [5, 9], torch.bfloat16, gpu_device)
    bad = torch.randn(B * Hkv * S * D + 1, device=gpu_device).to(torch.bfloat16)[1:].view(B, Hkv, S, D)
    before = bad.clone()
    with pytest.raises(ValueError, match="k_cache must start 16-byte aligned"):
        OPS.decode_attention(q, bad, vc, kn, vn, lens)
    with pytest.raises(ValueError, match="v_cache must start 16-byte aligned"):
        OPS.decode_attention(q, kc, bad, kn, vn, lens)
    assert torch.equal(bad, before)


@pytest.mark.gpu
def test_gpu_lengths_past_the_cache_give_nan_and_no_write(gpu_device):
    """No host check on CUDA (it would sync): a sequence whose new tokens do not fit gets NaN outputs and its cache
    rows stay as they were; the other sequences of the batch are computed and written as usual."""
    B, T, Hq, Hkv, D, S = 4, 2, 8, 2, 64, 500
    lens = [100, S - T + 1, -5, S - T]
    q, kc, vc, kn, vn, cl = make_inputs(B, T, Hq, Hkv, D, S, lens, torch.bfloat16, gpu_device)
    kc2, vc2 = kc.clone(), vc.clone()
    out = OPS.decode_attention(q, kc2, vc2, kn, vn, cl)
    sync(gpu_device)
    good = [0, 3]
    assert out[[1, 2]].isnan().all(), "a sequence past the cache must get NaN"
    ref = decode_attention_reference(q[good], kc[good], vc[good], kn[good], vn[good], cl[good])
    assert rel_err(out[good], ref) <= TOL[torch.bfloat16]
    assert torch.equal(kc2[[1, 2]], kc[[1, 2]]) and torch.equal(vc2[[1, 2]], vc[[1, 2]])
    assert torch.equal(kc2[good], cache_after(kc[good], kn[good], cl[good]))
    assert torch.equal(vc2[good], cache_after(vc[good], vn[good], cl[good]))


@pytest.mark.gpu
@pytest.mark.parametrize("B,S", [(1, 8208), (16, 1040)], ids=["b1-splits", "b16"])
def test_gpu_cuda_graph_replays_at_other_lengths(gpu_device, B, S):
    """The decode step captured once in a CUDA graph, replayed after cache_lens changed on the device (as a generation
    loop does), gives eagerly computed bits at every length: nothing in the op depends on a host value that changes
    per token, and nothing syncs the host (capture would fail)."""
    T, Hq, Hkv, D = 1, 32, 8, 128
    q, kc, vc, kn, vn, cl = make_inputs(B, T, Hq, Hkv, D, S, [S // 3] * B, torch.bfloat16, gpu_device)
    kc_g, vc_g = kc.clone(), vc.clone()
    stream = torch.cuda.Stream(gpu_device)
    stream.wait_stream(torch.cuda.current_stream(gpu_device))
    with torch.cuda.stream(stream):
        OPS.decode_attention(q, kc_g.clone(), vc_g.clone(), kn, vn, cl)  # warm-up (module load) outside capture
    torch.cuda.current_stream(gpu_device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = OPS.decode_attention(q, kc_g, vc_g, kn, vn, cl)
    for lens in ([S // 3] * B, [(37 * i + 1) % (S - T) for i in range(B)], [S - T] * B, [0] * B):
        cl.copy_(torch.tensor(lens, dtype=torch.int32))
        kc_g.copy_(kc)
        vc_g.copy_(vc)
        graph.replay()
        kc_e, vc_e = kc.clone(), vc.clone()
        out_e = OPS.decode_attention(q, kc_e, vc_e, kn, vn, cl)
        sync(gpu_device)
        assert torch.equal(out_g, out_e), f"graph and eager differ at lengths {lens[:4]}"
        assert torch.equal(kc_g, kc_e) and torch.equal(vc_g, vc_e)
        assert rel_err(out_e, decode_attention_reference(q, kc, vc, kn, vn, cl)) <= TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_deterministic_and_other_head_dims_refused(gpu_device):
    q, kc, vc, kn, vn, cl = make_inputs(1, 1, 32, 8, 128, 4100, [4099], torch.bfloat16, gpu_device)
    a = OPS.decode_attention(q, kc.clone(), vc.clone(), kn, vn, cl)
    b = OPS.decode_attention(q, kc.clone(), vc.clone(), kn, vn, cl)
    assert torch.equal(a, b)
    q, kc, vc, kn, vn, cl = make_inputs(1, 1, 4, 2, 96, 50, [3], torch.bfloat16, gpu_device)
    with pytest.raises(ValueError, match="head dim"):
        OPS.decode_attention(q, kc, vc, kn, vn, cl)
    q, kc, vc, kn, vn, cl = make_inputs(1, 1, 4, 2, 64, 50, [3], torch.float32, gpu_device)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        OPS.decode_attention(q, kc, vc, kn, vn, cl)


@pytest.mark.gpu
def test_gpu_mixed_devices(gpu_device):
    q, kc, vc, kn, vn, cl = make_inputs(1, 1, 4, 2, 64, 50, [3], torch.bfloat16, gpu_device)
    with pytest.raises(ERR, match="cache_lens"):
        OPS.decode_attention(q, kc, vc, kn, vn, cl.cpu())
    with pytest.raises(ERR, match="k_cache"):
        OPS.decode_attention(q, kc.cpu(), vc, kn, vn, cl)
