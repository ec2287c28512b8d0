"""GPU tests with tensors of more than 2**31 elements: every offset a kernel forms from a row index must be 64-bit.

Long-context prefill reaches this size: ffn's intermediate h [M, I] passes 2**31 elements at M = 195,084 tokens with
I = 11008, and a [M, 4096] activation at M = 524,289. An offset computed in int32 would wrap there and read or write
the wrong rows (or fault) only past that point, so these tests look at every output row, the last ones included.

The shapes keep the dimension that does not matter small (H = 256 for ffn, K = N = 1024 for linear_dual), so each test
runs in seconds. They need 16-40 GiB of free device memory and are skipped on a device with less. The
references are float64, computed in chunks of tokens: outputs and grad x row by row, the weight gradients as sums of
the chunks' gradients (exact: they are sums over tokens).
"""
import gc

import pytest
import torch

import fused_ops  # noqa: F401  (loads the library that registers torch.ops.fused.*)
from device_helpers import poison_allocator
from reference import rope_reference
from reference_routed import ffn_reference, linear_dual_reference, reference_grads, rel_err

OPS = torch.ops.fused
INT32_LIMIT = 2 ** 31
TOL = 2e-2  # bf16 (the op tests' bound)

pytestmark = pytest.mark.gpu


def need_free_gib(device, gib):
    gc.collect()
    torch.cuda.empty_cache()  # blocks the caching allocator keeps from earlier tests count as used
    free, _ = torch.cuda.mem_get_info(device)
    if free < gib * 2 ** 30:
        pytest.skip(f"needs {gib} GiB free on {device}, has {free / 2 ** 30:.1f}")


class RelErr:
    """||got - ref|| / ||ref|| accumulated over chunks (float64)."""

    def __init__(self):
        self.num = 0.0
        self.den = 0.0

    def add(self, got, ref):
        assert bool(torch.isfinite(got).all()), "NaN/inf: unwritten or wrongly addressed rows"
        self.num += (got.to(torch.float64) - ref).square().sum().item()
        self.den += ref.square().sum().item()

    def check(self, what):
        err = (self.num / self.den) ** 0.5
        assert err <= TOL, f"{what}: relative error {err:.3g} > {TOL}"


def check_weight_grads(got, ref, names):
    for g, r, n in zip(got, ref, names):
        assert bool(torch.isfinite(g).all()), f"grad {n} has NaN/inf"
        err = rel_err(g, r)
        assert err <= TOL, f"grad {n}: relative error {err:.3g} > {TOL}"


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_dual_past_int32_offsets(gpu_device, bias):
    """x, out, grad_out and grad x [M, 1024] with M * 1024 > 2**31 (the last 1000 rows lie past it); random mask."""
    need_free_gib(gpu_device, 40)
    M, K, N = INT32_LIMIT // 1024 + 1000, 1024, 1024
    dt = torch.bfloat16
    x = torch.randn(M, K, device=gpu_device, dtype=dt)
    mask = torch.rand(M, device=gpu_device) < 0.5
    ws = [(torch.randn(N, K, device=gpu_device) / K ** 0.5).to(dt) for _ in range(2)]
    bs = [torch.randn(N, device=gpu_device).to(dt) if bias else None for _ in range(2)]
    g = torch.randn(M, N, device=gpu_device, dtype=dt)
    poison_allocator(gpu_device, M * N * dt.itemsize)
    out = OPS.linear_dual(x, mask, ws[0], ws[1], bs[0], bs[1])
    assert out.numel() > INT32_LIMIT
    want = [True, True, True, bias, bias]
    gx, gwv, gwt, gbv, gbt = OPS.linear_dual_backward(g, x, mask, ws[0], ws[1], False, want)
    torch.cuda.synchronize(gpu_device)

    err_out, err_gx = RelErr(), RelErr()
    ref_w = None
    for i in range(0, M, 1 << 15):  # float64 chunks of 256 MiB
        sl = slice(i, i + (1 << 15))
        ref_out, grads = reference_grads(linear_dual_reference, [x[sl], mask[sl], ws[0], ws[1], bs[0], bs[1]], g[sl],
                                         [True, False, True, True, bias, bias])
        err_out.add(out[sl], ref_out)
        err_gx.add(gx[sl], grads[0])
        part = [t for t in grads[2:] if t is not None]
        ref_w = part if ref_w is None else [a + b for a, b in zip(ref_w, part)]
    err_out.check("out")
    err_gx.check("grad x")
    got_w = [gwv, gwt] + ([gbv, gbt] if bias else [])
    check_weight_grads(got_w, ref_w, ["weight_v", "weight_t", "bias_v", "bias_t"])


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
def test_ffn_past_int32_offsets(gpu_device, dual):
    """h and the backward's [M, I] intermediates with M * I > 2**31 (I = 16384, the last 2000 rows past it), forward
    and every gradient; x and out [M, 256]."""
    need_free_gib(gpu_device, 40)
    H, I = 256, 16384  # noqa: E741
    M = INT32_LIMIT // I + 2000
    dt = torch.bfloat16
    x = torch.randn(M, H, device=gpu_device, dtype=dt)
    mask = torch.rand(M, device=gpu_device) < 0.5 if dual else None

    def mk(o, i):
        return (torch.randn(o, i, device=gpu_device) / i ** 0.5).to(dt)
    w = [mk(I, H), mk(I, H), mk(H, I)]
    u = [mk(I, H), mk(I, H), mk(H, I)] if dual else [None] * 3
    g = torch.randn(M, H, device=gpu_device, dtype=dt)
    poison_allocator(gpu_device, M * H * dt.itemsize)
    with torch.no_grad():
        out = OPS.ffn(x, *w, mask, *u)
    grads = OPS.ffn_backward(g, x, *w, mask, *u)
    torch.cuda.synchronize(gpu_device)
    assert M * I > INT32_LIMIT

    names = ["w1", "w3", "w2"] + (["u1", "u3", "u2"] if dual else [])
    weights = w + (u if dual else [])
    err_out, err_gx = RelErr(), RelErr()
    ref_w = None
    for i in range(0, M, 1 << 13):  # float64 chunks of 1 GiB per [chunk, I] intermediate
        sl = slice(i, i + (1 << 13))

        def fn(a, *ws):
            return ffn_reference(a, *ws[:3], mask[sl] if dual else None, *(ws[3:] if dual else []))
        ref_out, rg = reference_grads(fn, [x[sl]] + weights, g[sl], [True] * (1 + len(weights)))
        err_out.add(out[sl], ref_out)
        err_gx.add(grads[0][sl], rg[0])
        ref_w = rg[1:] if ref_w is None else [a + b for a, b in zip(ref_w, rg[1:])]
    err_out.check("out")
    err_gx.check("grad x")
    check_weight_grads(list(grads[1:4]) + (list(grads[4:7]) if dual else []), ref_w, names)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_rope_past_int32_offsets(gpu_device, fmt):
    """rope_fwd, rope_bwd and the in-place rope_fwd_ on a [s, 1, 128, 256] tensor of more than 2**31 elements;
    the last 16 positions (past 2**31) and the first 16 are checked against float64, and nothing is left unwritten."""
    need_free_gib(gpu_device, 16)
    h, d = 128, 256
    s = INT32_LIMIT // (h * d) + 16
    dt = torch.bfloat16
    x = torch.randn(s, 1, h, d, device=gpu_device, dtype=dt)
    if fmt == "bshd":
        x = x.view(1, s, h, d)
    freqs = torch.rand(s, 1, 1, d, device=gpu_device) * 3.0
    poison_allocator(gpu_device, x.numel() * dt.itemsize)
    out = OPS.rope_fwd(x, freqs, fmt)
    torch.cuda.synchronize(gpu_device)
    assert bool(torch.isfinite(out).all()), "rope_fwd left elements unwritten"
    dx = OPS.rope_bwd(x, freqs, fmt)
    torch.cuda.synchronize(gpu_device)
    assert bool(torch.isfinite(dx).all()), "rope_bwd left elements unwritten"

    def rows(t, a, b):  # positions [a, b)
        return t[a:b] if fmt == "sbhd" else t[:, a:b]
    for a in (0, s - 16):
        part = rows(x, a, a + 16)
        for got, bwd in ((out, False), (dx, True)):
            ref = rope_reference(part, freqs, fmt, start_positions=[a], backward=bwd)
            err = ((rows(got, a, a + 16).to(torch.float64) - ref).norm() / ref.norm()).item()
            assert err <= 1e-2, f"{'rope_bwd' if bwd else 'rope_fwd'} positions {a}..{a + 15}: rel error {err:.3g}"
    del dx
    want = rows(out, s - 16, s).clone()
    OPS.rope_fwd_(x, freqs, fmt)
    assert torch.equal(rows(x, s - 16, s), want), "rope_fwd_ differs from rope_fwd past 2**31 elements"
