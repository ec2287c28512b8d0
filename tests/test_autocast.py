"""torch.autocast for the routed ops (csrc/ops/routed_autocast.cpp): inside an autocast region linear_dual and ffn
cast their floating-point inputs to the region's dtype, as torch's linear does, and gradients reach the fp32
parameters. CPU (bf16) and every CUDA device (bf16, fp16).
"""
import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_ops  # noqa: F401  (loads the library that registers torch.ops.fused.*)
from fused_ops.ffn import DualExpertSwiGLU, FusedSwiGLU
from fused_ops.linear_dual import DualLinear
from reference_routed import ffn_reference, linear_dual_reference, make_mask, rel_err

M, H, I, N = 37, 48, 80, 24  # noqa: E741  (odd token count; linear_dual: K = H, N)
KINDS = ["linear_dual", "ffn_dual", "ffn_single"]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def dtypes(device):
    return [torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float16]


def make(kind, device, dtype=torch.float32):
    """(module with fp32 parameters, its inputs after x, its float64 reference of x)"""
    if kind == "linear_dual":
        mod = DualLinear(H, N, bias=True, device=device, dtype=dtype)
        mask = make_mask("random", (M,), device)
        w, b = mod.weight, mod.bias
        return mod, (mask,), lambda x: linear_dual_reference(x, mask, w[1], w[0], b[1], b[0])
    if kind == "ffn_dual":
        mod = DualExpertSwiGLU(H, I, device=device, dtype=dtype)
        mask = make_mask("random", (M,), device)
        return mod, (mask,), lambda x: ffn_reference(x, *mod.vision_weights, mask, *mod.text_weights)
    mod = FusedSwiGLU(H, I, device=device, dtype=dtype)
    return mod, (), lambda x: ffn_reference(x, mod.w1, mod.w3, mod.w2)


def device_type(device):
    return torch.device(device).type


@pytest.mark.parametrize("kind", KINDS)
def test_autocast_equals_explicit_cast(device, kind):
    """Under autocast: the output has the region's dtype, equals (bit for bit) the module run on inputs and
    parameters cast by hand, and matches float64; the fp32 parameters get fp32 gradients equal to the hand-cast
    run's, and x gets its gradient in its own dtype."""
    for dt in dtypes(device):
        mod, rest, ref = make(kind, device)
        x = torch.randn(M, H, device=device, requires_grad=True)
        with torch.autocast(device_type(device), dtype=dt):
            out = mod(x, *rest)
        assert out.dtype == dt
        g = torch.randn_like(out)
        out.backward(g)

        hand = copy.deepcopy(mod).to(dt)  # the same values, parameters of dtype dt
        xh = x.detach().to(dt).requires_grad_(True)
        want = hand(xh, *rest)
        want.backward(g)
        assert torch.equal(out, want), f"{kind} {dt}: autocast output differs from the hand-cast run"
        assert x.grad.dtype == torch.float32 and torch.equal(x.grad, xh.grad.float())
        for (name, p), (_, ph) in zip(mod.named_parameters(), hand.named_parameters()):
            assert p.grad is not None and p.grad.dtype == torch.float32, f"{name}: {p.grad}"
            assert torch.equal(p.grad, ph.grad.float()), f"{kind} {dt}: grad {name} differs from the hand-cast run"
        err = rel_err(out, ref(x.detach()))
        assert err <= TOL[dt], f"{kind} {dt}: relative error {err:.3g} to float64"


@pytest.mark.parametrize("kind", KINDS)
def test_autocast_lets_activations_meet_fp32_parameters(device, kind):
    """x already in the region's dtype (the output of an earlier autocast layer) with fp32 parameters: runs under
    autocast, and is refused with a dtype error outside it."""
    mod, rest, _ = make(kind, device)
    x = torch.randn(M, H, device=device).to(torch.bfloat16)
    with torch.autocast(device_type(device), dtype=torch.bfloat16):
        out = mod(x, *rest)
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    with pytest.raises((RuntimeError, ValueError), match="dtype"):
        mod(x, *rest)


@pytest.mark.parametrize("kind", KINDS)
def test_autocast_leaves_disabled_regions_and_float64_alone(device, kind):
    mod, rest, _ = make(kind, device)
    x = torch.randn(M, H, device=device)
    with torch.autocast(device_type(device), dtype=torch.bfloat16, enabled=False):
        assert mod(x, *rest).dtype == torch.float32
    other = "cuda" if device == "cpu" else "cpu"  # a region of the other device type does not touch these tensors
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available ... Disabling autocast" on a machine without a GPU
        with torch.autocast(other, dtype=torch.bfloat16):
            assert mod(x, *rest).dtype == torch.float32
    if device == "cpu":  # float64 runs on CPU only
        mod64, rest64, _ = make(kind, device, torch.float64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert mod64(x.double(), *rest64).dtype == torch.float64


class _OpArgs(TorchDispatchMode):
    """Records the arguments of every fused op call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fused":
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["linear_dual", "ffn_dual"])
def test_autocast_casts_stacked_experts_as_one_tensor(device, kind):
    """The modules hold both experts of a projection in one [2, R, C] parameter. Under autocast the op must get the
    two halves of ONE cast tensor: adjacent in memory, so the CUDA kernels read them through one descriptor (halves
    cast one by one land wherever the allocator puts them, and the kernels then stack them by copy)."""
    mod, rest, _ = make(kind, device)
    x = torch.randn(M, H, device=device)
    rec = _OpArgs()
    with torch.autocast(device_type(device), dtype=torch.bfloat16), rec:
        mod(x, *rest)
    (func, args), = rec.calls
    if kind == "linear_dual":
        # DualLinear passes its stacked [2, N, K] weight as it is (cast as one tensor), its bias as per-expert views
        assert args[2].dim() == 3 and args[2].dtype == torch.bfloat16 and args[3] is None
        pairs = [(args[5], args[4])]  # (text, vision) biases
        # the weight passed as per-expert views (vision, text): cast as one tensor and split again
        rec = _OpArgs()
        with torch.autocast(device_type(device), dtype=torch.bfloat16), rec:
            torch.ops.fused.linear_dual(x, rest[0], mod.weight[1], mod.weight[0])
        (func, args), = rec.calls
        pairs.append((args[3], args[2]))
    else:
        # DualExpertSwiGLU passes its stacked [2, ...] parameters as they are: each is cast as one tensor
        assert all(t.dim() == 3 and t.dtype == torch.bfloat16 for t in args[1:4]) and all(a is None for a in args[5:8])
        # the same parameters passed as per-expert views (vision w*, text u*): cast as one tensor and split again
        rec = _OpArgs()
        with torch.autocast(device_type(device), dtype=torch.bfloat16), rec:
            torch.ops.fused.ffn(x, mod.w1[1], mod.w3[1], mod.w2[1], rest[0], mod.w1[0], mod.w3[0], mod.w2[0])
        (func, args), = rec.calls
        pairs = [(args[5], args[1]), (args[6], args[2]), (args[7], args[3])]  # u1/w1, u3/w3, u2/w2
    for text, vision in pairs:
        assert text.dtype == vision.dtype == torch.bfloat16
        assert text.untyped_storage().data_ptr() == vision.untyped_storage().data_ptr()
        assert vision.data_ptr() - text.data_ptr() == text.numel() * text.element_size()


def test_autocast_under_torchscript(device):
    """A scripted module follows autocast as the eager one does."""
    mod, rest, _ = make("ffn_dual", device)
    scripted = torch.jit.script(mod)
    x = torch.randn(M, H, device=device)
    with torch.autocast(device_type(device), dtype=torch.bfloat16):
        got, want = scripted(x, *rest), mod(x, *rest)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_autocast_under_torch_compile(device):
    """torch.compile traces the autocast kernel (AOTAutograd, aot_eager backend): same output and gradients as
    eager."""
    mod, rest, _ = make("ffn_dual", device)
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
    x = torch.randn(M, H, device=device)
    with torch.autocast(device_type(device), dtype=torch.bfloat16):
        got, want = compiled(x, *rest), mod(x, *rest)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    g = torch.randn_like(got)
    want_grads = torch.autograd.grad(want, list(mod.parameters()), g)
    got_grads = torch.autograd.grad(got, list(mod.parameters()), g)
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == torch.float32 and torch.equal(a, b)
