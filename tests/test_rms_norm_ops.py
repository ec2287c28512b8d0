"""Op-level tests of `torch.ops.fused.rms_norm` (the contract: csrc/torch_bindings.cpp).

Against a float64 reference written from the contract (x * rsqrt(mean(x^2) + eps) * weight): ||out - ref|| / ||ref||
per dtype, on every device (the GPU tier: the compiled kernel, odd and large rows, strided views, poisoned outputs,
empty tensors, a CUDA graph); the errors for bad inputs; the autograd (torch's differentiable rms_norm where a
gradient is asked for); opcheck (schema, Meta kernel, autograd registration).
"""
import pytest
import torch
import torch.nn.functional as F

import fused_ops
from device_helpers import poison_allocator, sync
from reference_routed import rel_err

OPS = torch.ops.fused
# The kernel and the CPU path compute in fp32 and round once: the error is the output rounding (bf16 2^-9 relative per
# element, fp16 2^-12) plus fp32 summation differences.
TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 6e-3}
DT_ID = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def reference(x, weight, eps):
    x64 = x.detach().to(torch.float64)
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.detach().to(torch.float64)


def check(x, weight, eps, what):
    poison_allocator(x.device, x.numel() * x.element_size())
    out = OPS.rms_norm(x, weight, eps)
    sync(x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device and out.is_contiguous(), what
    assert not out.isnan().any(), f"{what}: NaN in the output (an element not written?)"
    err = rel_err(out, reference(x, weight, eps))
    assert err <= TOL[x.dtype], f"{what}: relative error {err:.3g} > {TOL[x.dtype]:.1g}"
    return out


def dtypes(device):
    return [torch.float32, torch.float16, torch.bfloat16] + ([torch.float64] if device == "cpu" else [])


@pytest.mark.parametrize("shape", [(1, 4096), (3, 7), (2, 5, 1000), (16, 1, 4096), (1, 1), (5, 3000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_float64(device, shape):
    for dt in dtypes(device):
        x = (torch.randn(*shape) * 3 + 0.5).to(device=device, dtype=dt)
        w = (torch.rand(shape[-1]) + 0.5).to(device=device, dtype=dt)
        check(x, w, 1e-5, f"{shape} {DT_ID[dt]}")


def test_same_as_torch_rms_norm(device):
    """What F.rms_norm computes (the model's forward), up to the last bit's rounding."""
    for dt in dtypes(device):
        x = torch.randn(4, 333, device=device, dtype=dt)
        w = torch.randn(333, device=device, dtype=dt)
        got, want = OPS.rms_norm(x, w, 1e-6), F.rms_norm(x, (333,), w, 1e-6)
        assert rel_err(got, want) <= TOL[dt], DT_ID[dt]


def test_strided_and_empty_inputs(device):
    base = torch.randn(6, 2, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, device=device, dtype=torch.bfloat16)
    check(base[:, 1], w, 1e-6, "rows of stride 2 * 4096")
    check(base.transpose(0, 1), w, 1e-6, "rows that are not one stride apart (a copy)")
    check(base[..., ::2], w[::2], 1e-6, "non-contiguous columns and weight")
    odd = torch.randn(3 * 4096 + 1, device=device, dtype=torch.bfloat16)[1:].view(3, 4096)  # starts 2 bytes in
    check(odd, w, 1e-6, "a view off 16 bytes (the generic variant)")
    for shape in [(0, 4096), (2, 0, 4096)]:
        out = OPS.rms_norm(torch.randn(*shape, device=device, dtype=torch.bfloat16), w, 1e-6)
        assert out.shape == shape
    out = OPS.rms_norm(torch.randn(3, 0, device=device), torch.randn(0, device=device), 1e-6)
    assert out.shape == (3, 0)


@pytest.mark.parametrize("bad", ["weight_shape", "weight_dtype", "eps_negative", "eps_nan", "scalar", "int"])
def test_errors_name_the_argument(device, bad):
    x = torch.randn(2, 8, device=device)
    w = torch.randn(8, device=device)
    args = {"weight_shape": (x, torch.randn(7, device=device), 1e-6), "weight_dtype": (x, w.half(), 1e-6),
            "eps_negative": (x, w, -1.0), "eps_nan": (x, w, float("nan")),
            "scalar": (torch.tensor(1.0, device=device), w, 1e-6),
            "int": (torch.ones(2, 8, dtype=torch.int32, device=device), torch.ones(8, dtype=torch.int32,
                                                                                   device=device), 1e-6)}[bad]
    word = {"weight_shape": "weight", "weight_dtype": "weight", "eps_negative": "eps", "eps_nan": "eps",
            "scalar": "x", "int": "x"}[bad]
    with pytest.raises(ValueError, match=f"rms_norm: {word}"):
        OPS.rms_norm(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_devices_must_match():
    with pytest.raises(RuntimeError, match="weight must be on x's device"):
        OPS.rms_norm(torch.randn(2, 8, device="cuda"), torch.randn(8), 1e-6)


def test_gradients_through_torch(device):
    """With a gradient asked for, the op is torch's differentiable rms_norm: the same gradients as F.rms_norm."""
    x = torch.randn(5, 64, device=device, dtype=torch.float32, requires_grad=True)
    w = torch.randn(64, device=device, dtype=torch.float32, requires_grad=True)
    g = torch.randn(5, 64, device=device)
    got = torch.autograd.grad(OPS.rms_norm(x, w, 1e-6), (x, w), g)
    want = torch.autograd.grad(F.rms_norm(x, (64,), w, 1e-6), (x, w), g)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-6


def test_wrapper_and_model_norm(device):
    from fused_ops.models.cogvlm import RMSNorm
    norm = RMSNorm(96, 1e-5, device=device)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 96, device=device)
    assert rel_err(norm.decode(x), norm(x)) < 1e-6
    assert torch.equal(fused_ops.rms_norm(x, norm.weight, 1e-5), OPS.rms_norm(x, norm.weight, 1e-5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_cuda_graph_replays_new_inputs():
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    OPS.rms_norm(x, w, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OPS.rms_norm(x, w, 1e-6)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(x, w, 1e-6)) <= TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("n", [1, 15, 1024, 4096, 5120, 8192, 16384, 65537])
def test_gpu_row_lengths(n):
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(3, n, device="cuda", dtype=dt)
        w = torch.randn(n, device="cuda", dtype=dt)
        check(x, w, 1e-6, f"n={n} {DT_ID[dt]}")


OPCHECKED = ["rms_norm"]  # tests/test_rope_ops.py checks that every op of the library has an opcheck case


def test_opcheck():
    x = torch.randn(3, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    torch.library.opcheck(OPS.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(OPS.rms_norm.default, (x.detach(), w.detach(), 1e-6))
