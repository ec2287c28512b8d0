"""Op-level and module tests of `torch.ops.fused.linear_dual` / `linear_dual_backward` (docs/design.md, "Routed GEMM
ops") and of `fused_ops.linear_dual` (`linear_dual`, `DualLinear`).

Every device-parametrized test runs on "cpu" and on each visible CUDA device (marked `gpu`, see conftest.py).
Correctness is measured against the float64 oracle in tests/reference_routed.py (each token through only its own
expert) as ||out - ref|| / ||ref|| with a per-dtype tolerance. The CPU tier uses small, odd shapes (M = 1, 37, 300;
K, N = 40, 24, 72: no multiples of 16); realistic sizes (M = K = N = 4096) run on CUDA only.
"""
import itertools
import math

import pytest
import torch

import fused_ops  # also loads the library that registers torch.ops.fused.*
from fused_ops.linear_dual import DualLinear, linear_dual
from device_helpers import block_of, poison_allocator, requested_bytes, split_counts, sync, tail_of
from reference_routed import (MASK_KINDS, check_grad, check_out, linear_dual_reference, make_mask, reference_grads,
                              rel_err, strided_view)

OPS = torch.ops.fused
ERR = (RuntimeError, ValueError)

# Relative-error tolerances. The op accumulates in fp32 and rounds once to the output dtype, so the error is about the
# output rounding (unit roundoff 2^-8 bf16, 2^-11 fp16; RMS a third to a half of it), with ~3x margin. fp32 is exact
# IEEE fp32 unless allow_tf32 (then inputs are rounded to 10-bit mantissas: ~5e-4 RMS). float64 exists on CPU only.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-10}
TOL_TF32 = 5e-3
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}

# (M, K, N): M not a multiple of 16 / 128, K and N not multiples of 16; "odd" has K and N that are not multiples of
# 16 bytes either (the CUDA op then cannot use the TMA kernels, which need multiples of 16 elements: pointer
# kernels, generic variant); one aligned shape
SHAPES = {"m1": (1, 40, 24), "m37": (37, 24, 72), "m300": (300, 72, 40), "odd": (45, 37, 27), "m128al": (128, 64, 48)}
LAYOUTS = ["contig", "transposed", "sliced", "strided_k"]
BIASES = ["none", "both", "v_only", "t_only"]


# ----------------------------------------------------------------------------------------------------------------
# helpers


def make_weights(N, K, dtype, device, bias="both"):
    """(weight_v, weight_t, bias_v, bias_t): nn.Linear-scaled random weights (outputs of order 1), two different
    experts so a token sent to the wrong one is caught."""
    wv = (torch.randn(N, K, device=device) / math.sqrt(max(K, 1))).to(dtype)
    wt = (torch.randn(N, K, device=device) / math.sqrt(max(K, 1))).to(dtype)
    bv = (torch.randn(N, device=device) * 0.5).to(dtype) if bias in ("both", "v_only") else None
    bt = (torch.randn(N, device=device) * 0.5).to(dtype) if bias in ("both", "t_only") else None
    return wv, wt, bv, bt


def run_and_check_grads(x, mask, wv, wt, bv, bt, tol, g=None, allow_tf32=False):
    """Autograd through the op (x, both weights and the given biases as leaves) against float64 autograd of the
    reference. Returns the op's output."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, wv, wt, bv, bt)]
    lx, lwv, lwt, lbv, lbt = leaves
    out = OPS.linear_dual(lx, mask, lwv, lwt, lbv, lbt, allow_tf32)
    if g is None:
        g = torch.randn(out.shape, device=out.device).to(out.dtype)
    out.backward(g)
    ref_out, ref_grads = reference_grads(
        lambda a, b, c, d, e: linear_dual_reference(a, mask, b, c, d, e), [x, wv, wt, bv, bt], g,
        [True, True, True, bv is not None, bt is not None])
    for name, leaf, rg in zip(("x", "weight_v", "weight_t", "bias_v", "bias_t"), leaves, ref_grads):
        if leaf is None:
            continue
        check_grad(leaf.grad, rg, x.dtype, tol, f"grad {name}")
    return out.detach(), ref_out


# ----------------------------------------------------------------------------------------------------------------
# forward / backward vs the reference


def _fwd_matrix():
    rows = []
    for i, (sk, mk, dt) in enumerate(itertools.product(SHAPES, MASK_KINDS, DTYPES)):
        bias = BIASES[i % len(BIASES)]  # cycled through the matrix; test_biases covers every combination
        rows.append(pytest.param(sk, mk, dt, bias, id=f"{sk}-{mk}-{DT_ID[dt]}-b{bias}"))
    return rows


@pytest.mark.parametrize("shape_key,mask_kind,dtype,bias", _fwd_matrix())
def test_forward_matrix(device, shape_key, mask_kind, dtype, bias):
    M, K, N = SHAPES[shape_key]
    x = strided_view((M,), K, dtype, device)
    mask = make_mask(mask_kind, (M,), device)
    wv, wt, bv, bt = make_weights(N, K, dtype, device, bias)
    before = [t.clone() for t in (x, mask, wv, wt) + tuple(b for b in (bv, bt) if b is not None)]
    poison_allocator(device, M * N * x.element_size())
    out = OPS.linear_dual(x, mask, wv, wt, bv, bt)
    sync(device)
    after = [x, mask, wv, wt] + [b for b in (bv, bt) if b is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "inputs were modified"
    check_out(out, linear_dual_reference(x, mask, wv, wt, bv, bt), (M, N), dtype, device, TOL[dtype])


@pytest.mark.parametrize("bias", BIASES)
def test_biases(device, bias):
    M, K, N = 37, 40, 24
    x = strided_view((M,), K, torch.float32, device)
    mask = make_mask("random", (M,), device)
    wv, wt, bv, bt = make_weights(N, K, torch.float32, device, bias)
    out = OPS.linear_dual(x, mask, wv, wt, bias_v=bv, bias_t=bt)
    check_out(out, linear_dual_reference(x, mask, wv, wt, bv, bt), (M, N), torch.float32, device, TOL[torch.float32])


# (M, K, N) of each forward path on sm_90: the decode GEMM unsplit (M = 1, 16) and with its reduction split (K =
# 2048), the gather GEMM (300), the pointer GEMM (K = 27: rows not 16-byte aligned); fp32 takes the pre-gathered TMA
# GEMM (tf32) or the pointer one
RESIDUAL_SHAPES = [(1, 72, 40), (16, 72, 40), (5, 2048, 40), (300, 72, 40), (45, 27, 37)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("M, K, N", RESIDUAL_SHAPES, ids=str)
def test_residual(device, dtype, M, K, N):
    """residual= adds a tensor of the output's shape in the GEMM's epilogue: out = x·W_eᵀ + b_e + residual, with both
    biases, a residual of another row stride than the output's, the output poisoned, the inputs unchanged. Without a
    gradient (the decode GEMM for a few tokens, a routing given or not) and through autograd (linear_dual_forward),
    every gradient against float64 autograd of the reference, the residual's equal to the output's."""
    x = strided_view((M,), K, dtype, device)
    mask = make_mask("random", (M,), device)
    wv, wt, bv, bt = make_weights(N, K, dtype, device, "both")
    res = strided_view((M,), N, dtype, device, "sliced")
    before = [t.clone() for t in (x, wv, wt, bv, bt, res)]
    ref = linear_dual_reference(x, mask, wv, wt, bv, bt) + res.double()
    for routing in (None, OPS.route(mask)):
        poison_allocator(device, 4 * M * N * x.element_size())
        out = OPS.linear_dual(x, mask, wv, wt, bv, bt, routing=routing, residual=res)
        check_out(out, ref, (M, N), dtype, device, TOL[dtype], f"routing given: {routing is not None}")
    assert all(torch.equal(a, b) for a, b in zip(before, (x, wv, wt, bv, bt, res))), "inputs were modified"
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, wv, wt, bv, bt, res)]
    poison_allocator(device, 4 * M * N * x.element_size())
    out = linear_dual(leaves[0], mask, *leaves[1:5], residual=leaves[5])
    g = torch.randn(out.shape, device=device).to(dtype)
    out.backward(g)
    check_out(out.detach(), ref, (M, N), dtype, device, TOL[dtype], "autograd forward")
    _, ref_grads = reference_grads(lambda a, b, c, d, e, r: linear_dual_reference(a, mask, b, c, d, e) + r,
                                   [x, wv, wt, bv, bt, res], g, [True] * 6)
    for name, leaf, rg in zip(("x", "weight_v", "weight_t", "bias_v", "bias_t", "residual"), leaves, ref_grads):
        check_grad(leaf.grad, rg, dtype, TOL[dtype], f"grad {name}")
    assert torch.equal(leaves[5].grad, g), "the residual's gradient is the output's"


@pytest.mark.parametrize("lead", [(0,), (2, 3)], ids=["m0", "b2s3"])
def test_residual_shapes(device, lead):
    """A leading shape of several dimensions (and none: M = 0); a residual broadcastable to the output but not of its
    shape is an error, not a broadcast."""
    K, N = 24, 16
    x = strided_view(lead, K, torch.float32, device)
    mask = make_mask("random", lead, device)
    wv, wt, bv, bt = make_weights(N, K, torch.float32, device, "none")
    res = strided_view(lead, N, torch.float32, device)
    out = OPS.linear_dual(x, mask, wv, wt, residual=res)
    check_out(out, linear_dual_reference(x, mask, wv, wt, None, None) + res.double(), lead + (N,), torch.float32,
              device, TOL[torch.float32])
    with pytest.raises(ERR, match="residual"):
        OPS.linear_dual(x, mask, wv, wt, residual=res[..., :1] if res.numel() else res[..., :0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_backward_matrix(device, mask_kind, dtype):
    """Gradients of x, both weights and both biases through autograd (the C++ autograd calling
    linear_dual_backward) against float64 autograd of the reference; an expert without tokens gets exact zeros."""
    M, K, N = 300, 72, 40
    x = strided_view((M,), K, dtype, device)
    mask = make_mask(mask_kind, (M,), device)
    wv, wt, bv, bt = make_weights(N, K, dtype, device, "both")
    out, ref = run_and_check_grads(x, mask, wv, wt, bv, bt, TOL[dtype])
    check_out(out, ref, (M, N), dtype, device, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("mask_kind", ["random", "all_true", "span"])
def test_backward_op_direct(device, mask_kind, dtype):
    """linear_dual_backward called directly: (grad_x, grad_weight_v, grad_weight_t, grad_bias_v, grad_bias_t)."""
    M, K, N = 37, 24, 72
    x = strided_view((M,), K, dtype, device)
    mask = make_mask(mask_kind, (M,), device)
    wv, wt, _, _ = make_weights(N, K, dtype, device, "none")
    g = strided_view((M,), N, dtype, device)
    poison_allocator(device, (M * K + 2 * N * K + 2 * N) * x.element_size())
    got = OPS.linear_dual_backward(g, x, mask, wv, wt)
    assert isinstance(got, (tuple, list)) and len(got) == 5
    # the biases' gradients do not depend on the biases: take them from a reference with zero biases
    zb = torch.zeros(N, dtype=dtype, device=device)
    _, ref = reference_grads(lambda a, b, c, d, e: linear_dual_reference(a, mask, b, c, d, e),
                             [x, wv, wt, zb, zb], g, [True] * 5)
    for name, gt, rg in zip(("grad_x", "grad_weight_v", "grad_weight_t", "grad_bias_v", "grad_bias_t"), got, ref):
        check_grad(gt, rg, dtype, TOL[dtype], name)
    assert got[0].shape == x.shape


def routing_reference(mask):
    """linear_dual_forward's routing, written out from its definition (csrc/ops/linear_dual.h): int32 [M + 264];
    seg = [0, start_1, end, count_0, count_1] in slots 0-4 (5-7 unused), then perm in [8, 8 + M_pad),
    M_pad = (ceil(M / 128) + 1) * 128: text rows in token order from 0, vision rows from start_1 =
    roundup(count_0, 128), -1 everywhere else. Returns (seg, perm)."""
    m = mask.reshape(-1).cpu()
    M = m.numel()
    up = lambda n: -(-n // 128) * 128  # noqa: E731
    text, vision = (~m).nonzero().flatten().tolist(), m.nonzero().flatten().tolist()
    start1 = up(len(text))
    perm = [-1] * ((-(-M // 128) + 1) * 128)
    perm[:len(text)] = text
    perm[start1:start1 + len(vision)] = vision
    seg = [0, start1, start1 + up(len(vision)), len(text), len(vision)]
    return torch.tensor(seg, dtype=torch.int32), torch.tensor(perm, dtype=torch.int32)


def split_routing(routing, M):
    return routing[:5].cpu(), routing[8:8 + (-(-M // 128) + 1) * 128].cpu()


# (M, K, N) of the routing tests: M = 0, 1, odd M; on CUDA with K, N that TMA takes on sm_90 the forward routes
# 1 <= M <= 4096 inside its gather GEMM and M = 5000 with the two-kernel pass; M = 0 launches the routing kernel only
ROUTING_SHAPES = [(0, 24, 16), (1, 24, 16), (37, 40, 24), (300, 64, 48), (1500, 64, 48), (5000, 64, 48)]


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("M, K, N", ROUTING_SHAPES, ids=lambda v: str(v))
def test_forward_routing(device, mask_kind, M, K, N):
    """linear_dual_forward: the output of linear_dual bit for bit, and the routing of the mask, fully written (the
    buffer is poisoned first)."""
    dtype = torch.bfloat16
    x = strided_view((M,), K, dtype, device)
    mask = make_mask(mask_kind, (M,), device)
    wv, wt, bv, bt = make_weights(N, K, dtype, device, "both")
    with torch.inference_mode():
        want = OPS.linear_dual(x, mask, wv, wt, bv, bt)
    poison_allocator(device, (M * N + M + 264) * 4)
    out, routing = OPS.linear_dual_forward(x, mask, wv, wt, bv, bt)
    assert torch.equal(out, want)
    assert routing.dtype == torch.int32 and routing.device == x.device and routing.shape == (M + 264,)
    seg, perm = split_routing(routing, M)
    want_seg, want_perm = routing_reference(mask)
    assert torch.equal(seg, want_seg), f"seg {seg.tolist()} != {want_seg.tolist()}"
    assert torch.equal(perm, want_perm)


@pytest.mark.parametrize("mask_kind", ["random", "all_false", "span"])
@pytest.mark.parametrize("M, K, N", ROUTING_SHAPES, ids=lambda v: str(v))
def test_backward_with_routing(device, mask_kind, M, K, N):
    """linear_dual_backward(routing=linear_dual_forward's routing) returns what it returns routing the mask itself,
    bit for bit (autograd passes the routing; see test_backward_matrix for the gradients against float64)."""
    dtype = torch.bfloat16
    x = strided_view((M,), K, dtype, device)
    mask = make_mask(mask_kind, (M,), device)
    wv, wt, _, _ = make_weights(N, K, dtype, device, "none")
    g = strided_view((M,), N, dtype, device)
    _, routing = OPS.linear_dual_forward(x, mask, wv, wt)
    want = OPS.linear_dual_backward(g, x, mask, wv, wt)
    got = OPS.linear_dual_backward(g, x, mask, wv, wt, routing=routing)
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert torch.equal(a, b), f"{name} differs with the forward's routing"


def test_backward_routing_of_another_mask_raises_on_cpu():
    """On the CPU the routing argument is checked against the mask (on CUDA that would need a host sync)."""
    M, K, N = 37, 8, 5
    x = torch.randn(M, K)
    mask = make_mask("random", (M,))
    wv, wt, _, _ = make_weights(N, K, torch.float32, "cpu", "none")
    _, routing = OPS.linear_dual_forward(x, ~mask, wv, wt)
    with pytest.raises(ERR, match="routing"):
        OPS.linear_dual_backward(torch.randn(M, N), x, mask, wv, wt, routing=routing)


GRAD_NAMES = ("grad_x", "grad_weight_v", "grad_weight_t", "grad_bias_v", "grad_bias_t")
# output_mask cases: one of each output alone, the backward of a layer without biases, a frozen expert (CogVLM trains
# the vision expert with the language model's weights frozen), bias-only training, nothing at all
OUTPUT_MASKS = {"gx": (1, 0, 0, 0, 0), "gwv": (0, 1, 0, 0, 0), "gwt": (0, 0, 1, 0, 0), "gbv": (0, 0, 0, 1, 0),
                "gbt": (0, 0, 0, 0, 1), "no_bias": (1, 1, 1, 0, 0), "frozen_t": (1, 1, 0, 1, 0),
                "frozen_v_no_x": (0, 0, 1, 0, 1), "biases": (0, 0, 0, 1, 1), "none": (0, 0, 0, 0, 0)}


@pytest.mark.parametrize("shape_key", ["m300", "odd", "m128al"])
@pytest.mark.parametrize("which", list(OUTPUT_MASKS))
def test_backward_output_mask(device, which, shape_key):
    """linear_dual_backward(output_mask=...): the outputs asked for equal those of the full call bit for bit (and
    the float64 reference); the others are None."""
    want = [bool(b) for b in OUTPUT_MASKS[which]]
    M, K, N = SHAPES[shape_key]
    dtype = torch.bfloat16
    x = strided_view((M,), K, dtype, device)
    mask = make_mask("random", (M,), device)
    wv, wt, _, _ = make_weights(N, K, dtype, device, "none")
    g = strided_view((M,), N, dtype, device)
    full = OPS.linear_dual_backward(g, x, mask, wv, wt)
    poison_allocator(device, (M * K + 2 * N * K + 2 * N) * x.element_size())
    got = OPS.linear_dual_backward(g, x, mask, wv, wt, output_mask=want)
    zb = torch.zeros(N, dtype=dtype, device=device)
    _, ref = reference_grads(lambda a, b, c, d, e: linear_dual_reference(a, mask, b, c, d, e),
                             [x, wv, wt, zb, zb], g, [True] * 5)
    for name, w, gt, ft, rg in zip(GRAD_NAMES, want, got, full, ref):
        if not w:
            assert gt is None, f"{name} was not asked for"
            continue
        assert gt is not None and gt.shape == ft.shape, name
        assert torch.equal(gt, ft), f"{name} differs from the full call's"
        check_grad(gt, rg, dtype, TOL[dtype], name)


@pytest.mark.parametrize("frozen", ["x", "weight_t", "weight_v", "bias_v", "weights"])
def test_backward_frozen_leaves(device, frozen):
    """Autograd with some inputs not requiring grad (asks the op only for the rest): the others' gradients match the
    float64 reference, the frozen ones stay None."""
    M, K, N = 300, 72, 40
    dtype = torch.bfloat16
    x = strided_view((M,), K, dtype, device)
    mask = make_mask("random", (M,), device)
    wv, wt, bv, bt = make_weights(N, K, dtype, device, "both")
    names = ("x", "weight_v", "weight_t", "bias_v", "bias_t")
    frozen_set = {"weight_v", "weight_t"} if frozen == "weights" else {frozen}
    leaves = [t.detach().clone().requires_grad_(n not in frozen_set) for n, t in zip(names, (x, wv, wt, bv, bt))]
    out = OPS.linear_dual(leaves[0], mask, *leaves[1:])
    g = torch.randn(out.shape, device=out.device).to(dtype)
    out.backward(g)
    _, ref = reference_grads(lambda a, b, c, d, e: linear_dual_reference(a, mask, b, c, d, e), [x, wv, wt, bv, bt], g,
                             [True] * 5)
    for n, leaf, rg in zip(names, leaves, ref):
        if n in frozen_set:
            assert leaf.grad is None, n
        else:
            check_grad(leaf.grad, rg, dtype, TOL[dtype], f"grad {n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_and_leading_shape(device, layout, dtype):
    """x [b, s, K] in every memory layout (transposed / sliced with an unaligned offset / stride 2 in K), with a mask
    that is itself a transposed view in the transposed case; forward and gradients."""
    b, s, K, N = 2, 19, 40, 24
    x = strided_view((b, s), K, dtype, device, layout)
    mask = make_mask("random", (b, s), device)
    if layout == "transposed":
        mask = mask.transpose(0, 1).contiguous().transpose(0, 1)
    wv, wt, bv, bt = make_weights(N, K, dtype, device, "both")
    out = OPS.linear_dual(x, mask, wv, wt, bv, bt)
    check_out(out, linear_dual_reference(x, mask, wv, wt, bv, bt), (b, s, N), dtype, device, TOL[dtype])
    run_and_check_grads(x, mask, wv, wt, bv, bt, TOL[dtype])


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)], ids=["m0", "b2s0", "b0s3"])
def test_empty(device, lead):
    """M = 0: empty output; gradients of the weights and biases are zero (not garbage)."""
    K, N = 40, 24
    x = torch.empty(lead + (K,), device=device, dtype=torch.bfloat16)
    mask = torch.empty(lead, device=device, dtype=torch.bool)
    wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, device, "both")
    out = OPS.linear_dual(x, mask, wv, wt, bv, bt)
    assert out.shape == lead + (N,) and out.dtype == torch.bfloat16 and out.device == x.device
    g = torch.empty(lead + (N,), device=device, dtype=torch.bfloat16)
    poison_allocator(device, 2 * N * K * 2 + 1024)
    gx, gwv, gwt, gbv, gbt = OPS.linear_dual_backward(g, x, mask, wv, wt)
    sync(device)
    assert gx.shape == x.shape
    for name, t, shape in (("grad_weight_v", gwv, (N, K)), ("grad_weight_t", gwt, (N, K)), ("grad_bias_v", gbv, (N,)),
                           ("grad_bias_t", gbt, (N,))):
        assert tuple(t.shape) == shape, name
        assert not bool(t.any()) and bool(torch.isfinite(t).all()), f"{name} must be zero for M = 0"


def test_deterministic(device):
    """Same inputs, same bits (no atomics): forward and backward twice."""
    M, K, N = 300, 72, 40
    x = strided_view((M,), K, torch.bfloat16, device)
    mask = make_mask("random", (M,), device)
    wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, device, "both")
    g = strided_view((M,), N, torch.bfloat16, device)
    a = OPS.linear_dual(x, mask, wv, wt, bv, bt)
    b = OPS.linear_dual(x, mask, wv, wt, bv, bt)
    assert torch.equal(a, b)
    for u, v in zip(OPS.linear_dual_backward(g, x, mask, wv, wt), OPS.linear_dual_backward(g, x, mask, wv, wt)):
        assert torch.equal(u, v)


def test_tf32(device):
    """allow_tf32=True on float32: within the TF32 tolerance (CPU may ignore the flag and be exact); without it the
    CUDA result must be exact fp32 even for a long reduction (K = 1024), which TF32 would miss by ~100x."""
    M, K, N = (300, 72, 40) if torch.device(device).type == "cpu" else (512, 1024, 256)
    x = strided_view((M,), K, torch.float32, device)
    mask = make_mask("random", (M,), device)
    wv, wt, bv, bt = make_weights(N, K, torch.float32, device, "both")
    ref = linear_dual_reference(x, mask, wv, wt, bv, bt)
    check_out(OPS.linear_dual(x, mask, wv, wt, bv, bt, allow_tf32=True), ref, (M, N), torch.float32, device, TOL_TF32)
    check_out(OPS.linear_dual(x, mask, wv, wt, bv, bt, allow_tf32=False), ref, (M, N), torch.float32, device,
              TOL[torch.float32], "out (exact fp32)")
    g = strided_view((M,), N, torch.float32, device)
    run_and_check_grads(x, mask, wv, wt, bv, bt, TOL_TF32, g=g, allow_tf32=True)
    run_and_check_grads(x, mask, wv, wt, bv, bt, TOL[torch.float32], g=g, allow_tf32=False)


def test_float64(device):
    """float64 is computed exactly on CPU (gradcheck needs it); CUDA either refuses it or computes it correctly."""
    x = strided_view((7,), 8, torch.float64, device)
    mask = make_mask("random", (7,), device)
    wv, wt, bv, bt = make_weights(5, 8, torch.float64, device, "both")
    try:
        out = OPS.linear_dual(x, mask, wv, wt, bv, bt)
    except ERR as e:
        assert torch.device(device).type == "cuda", f"float64 must work on CPU: {e}"
        assert any(w in str(e).lower() for w in ("dtype", "double", "float64", "x")), str(e)
        return
    check_out(out, linear_dual_reference(x, mask, wv, wt, bv, bt), (7, 5), torch.float64, device,
              TOL[torch.float64])


def test_transposed_weights_either_work_or_raise(device):
    """Weights given as transposed views of [K, N] storage (what routed-GEMM code written for `weight.T` holds): the
    op must either compute with them correctly (copying if it must) or refuse them naming the weight; never be
    silently wrong."""
    M, K, N = 37, 40, 24
    x = strided_view((M,), K, torch.bfloat16, device)
    mask = make_mask("random", (M,), device)
    wv, wt, _, _ = make_weights(N, K, torch.bfloat16, device, "none")
    wv_t, wt_t = wv.t().contiguous().t(), wt.t().contiguous().t()  # same values, strides (1, N)
    try:
        out = OPS.linear_dual(x, mask, wv_t, wt_t)
    except ERR as e:
        assert "weight" in str(e) or "contiguous" in str(e) or "stride" in str(e), str(e)
        return
    check_out(out, linear_dual_reference(x, mask, wv, wt), (M, N), torch.bfloat16, device, TOL[torch.bfloat16])


def _weight_layouts(wv, wt):
    """The same two experts' values laid out as a user may hold them: separate tensors, views of one [2, N, K] tensor
    text first (DualLinear) or vision first (CogVLM registers its vision expert first), a row-padded pair."""
    t_first = torch.stack([wt, wv])
    v_first = torch.stack([wv, wt])
    padded = torch.zeros(2, wv.shape[0], wv.shape[1] + 8, dtype=wv.dtype, device=wv.device)
    padded[0, :, :wv.shape[1]], padded[1, :, :wv.shape[1]] = wt, wv
    return {"separate": (wv, wt), "text_first": (t_first[1], t_first[0]), "vision_first": (v_first[0], v_first[1]),
            "row_padded": (padded[1, :, :wv.shape[1]], padded[0, :, :wv.shape[1]])}


@pytest.mark.parametrize("M", [1, 300])
def test_weight_layouts_same_bits(device, M):
    """Every weight layout gives the bits of separate tensors, forward and backward (the CUDA kernels read each
    layout in place through the descriptor's expert order), and one tensor given as both experts equals two copies."""
    K, N = 64, 48
    x = strided_view((M,), K, torch.bfloat16, device)
    mask = make_mask("random", (M,), device)
    g = strided_view((M,), N, torch.bfloat16, device)
    wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, device, "both")
    want = None
    for name, (v, t) in _weight_layouts(wv, wt).items():
        got = (OPS.linear_dual(x, mask, v, t, bv, bt),) + tuple(OPS.linear_dual_backward(g, x, mask, v, t))
        if want is None:
            want = got
        for i, (a, b) in enumerate(zip(got, want)):
            assert (a is None and b is None) or torch.equal(a, b), f"{name}: result {i} differs from separate weights"
    tied = OPS.linear_dual(x, mask, wv, wv, bv, bt)
    assert torch.equal(tied, OPS.linear_dual(x, mask, wv, wv.clone(), bv, bt)), "tied experts differ from two copies"


@pytest.mark.parametrize("M", [1, 16, 300])
def test_stacked_weights(device, M):
    """Both experts in one [2, N, K] weight_v (text [0], vision [1]) with weight_t None: the bits of the two views
    given apart, forward (decode sizes too) and backward; the weight gradient comes back as one [2, N, K] tensor (the
    two experts' gradients at [0] and [1]), grad_weight_t None; output_mask's slot 1 asks for it; through autograd the
    stacked leaf gets that gradient, against float64 autograd of the reference."""
    K, N = 64, 48
    x = strided_view((M,), K, torch.bfloat16, device)
    mask = make_mask("random", (M,), device)
    g = strided_view((M,), N, torch.bfloat16, device)
    wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, device, "both")
    w = torch.stack([wt, wv])
    assert torch.equal(OPS.linear_dual(x, mask, w, None, bv, bt), OPS.linear_dual(x, mask, w[1], w[0], bv, bt))
    gx, gw, gw_t, gbv, gbt = OPS.linear_dual_backward(g, x, mask, w, None)
    apart = OPS.linear_dual_backward(g, x, mask, w[1], w[0])
    assert gw_t is None and tuple(gw.shape) == (2, N, K) and gw.is_contiguous()
    assert torch.equal(gx, apart[0]) and torch.equal(gw[1], apart[1]) and torch.equal(gw[0], apart[2])
    assert torch.equal(gbv, apart[3]) and torch.equal(gbt, apart[4])
    only_w = OPS.linear_dual_backward(g, x, mask, w, None, output_mask=[False, True, False, False, False])
    assert only_w[0] is None and torch.equal(only_w[1], gw) and all(t is None for t in only_w[2:])
    none_w = OPS.linear_dual_backward(g, x, mask, w, None, output_mask=[True, False, True, True, True])
    assert none_w[1] is None and none_w[2] is None and torch.equal(none_w[0], gx)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, bv)]
    out = linear_dual(leaves[0], mask, leaves[1], None, leaves[2])
    out.backward(g)
    _, ref_grads = reference_grads(lambda a, b, c: linear_dual_reference(a, mask, b[1], b[0], c, None), [x, w, bv], g,
                                   [True, True, True])
    for name, leaf, rg in zip(("x", "weight", "bias_v"), leaves, ref_grads):
        check_grad(leaf.grad, rg, torch.bfloat16, TOL[torch.bfloat16], f"grad {name}")


def _stream_k_workspace(device, M, N, K):
    """Bytes of the stream-K workspace the linear_dual forward allocates at M tokens: 2 SMs x BM x BN fp32 where the
    forward GEMM's config is a stream-K one (the gather GEMM's, or the TMA GEMM's where the gather GEMM is off)."""
    cfg = fused_ops.kernel_config("routed_linear_gather_tma_kernel", "half", M, 90, n=N, k=K)
    if cfg == "off":
        cfg = fused_ops.kernel_config("routed_linear_tma_kernel", "half", M, 90, n=N, k=K, w_transposed=False)
    if not tail_of(cfg)[1]:
        return 0
    bm, bn = block_of(cfg)
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count * bm * bn * 4


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 2048])
@pytest.mark.parametrize("layout", ["separate", "text_first", "vision_first"])
def test_weights_read_in_place(gpu_device, M, layout):
    """No weight copy inside the op for any of these layouts: no copy / stack op in a profile of the forward and the
    backward, and the forward's peak extra memory far below one expert's weight (a stacking copy would be two): what
    it may allocate is the routing, where the table gathers x's rows before the GEMM instead of inside it those rows
    ([M_pad, K], M_pad <= M + 256), and a stream-K config's fp32 workspace ([2 SMs, BM, BN]: kernels/GEMM.md 6)."""
    if torch.cuda.get_device_capability(gpu_device) != (9, 0):
        pytest.skip("the TMA path (sm_90) reads stacked weights; the pointer kernels take two base pointers anyway")
    K, N = 2048, 8192
    x = torch.randn(M, K, device=gpu_device, dtype=torch.bfloat16)
    mask = make_mask("random", (M,), gpu_device)
    g = torch.randn(M, N, device=gpu_device, dtype=torch.bfloat16)
    wv, wt, _, _ = make_weights(N, K, torch.bfloat16, gpu_device, "none")
    v, t = _weight_layouts(wv, wt)[layout]
    OPS.linear_dual(x, mask, v, t)  # warm
    sync(gpu_device)
    torch.cuda.reset_peak_memory_stats(gpu_device)
    base = requested_bytes(gpu_device)
    out = OPS.linear_dual(x, mask, v, t)
    sync(gpu_device)
    extra = requested_bytes(gpu_device, "peak") - base - out.untyped_storage().nbytes()
    gathered_x = (M + 256) * K * x.element_size()
    assert extra < wv.numel() * wv.element_size() // 4 + gathered_x + _stream_k_workspace(gpu_device, M, N, K), \
        f"peak extra {extra} B: the weights were copied?"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        OPS.linear_dual(x, mask, v, t)
        OPS.linear_dual_backward(g, x, mask, v, t)
    copies = [e.name for e in prof.events() if e.name in ("aten::stack", "aten::copy_", "aten::clone", "aten::cat")]
    assert not copies, f"{layout}: the op copied its weights ({copies})"
    check_out(out, linear_dual_reference(x, mask, wv, wt), (M, N), torch.bfloat16, gpu_device, TOL[torch.bfloat16])


@pytest.mark.gpu
def test_dual_linear_training_step_copies_nothing(gpu_device):
    """DualLinear passes its [2, N, K] weight whole: a forward + backward through autograd launches no copy, stack or
    cat (the gradient of the stacked weight is written in place, no per-expert gradients stacked by autograd)."""
    M, K, N = 2048, 512, 768
    mod = DualLinear(K, N, bias=False, device=gpu_device, dtype=torch.bfloat16)
    x = torch.randn(M, K, device=gpu_device, dtype=torch.bfloat16, requires_grad=True)
    mask = make_mask("span", (M,), gpu_device)
    g = torch.randn(M, N, device=gpu_device, dtype=torch.bfloat16)
    mod(x, mask).backward(g)  # warm
    mod.weight.grad = x.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        mod(x, mask).backward(g)
        sync(gpu_device)
    copies = [e.name for e in prof.events() if e.name in ("aten::stack", "aten::copy_", "aten::clone", "aten::cat")]
    assert not copies, f"a DualLinear step copied ({copies})"
    ref = reference_grads(lambda a, b: linear_dual_reference(a, mask, b[1], b[0]), [x, mod.weight], g, [True, True])
    check_grad(mod.weight.grad, ref[1][1], torch.bfloat16, TOL[torch.bfloat16], "grad weight")


# ----------------------------------------------------------------------------------------------------------------
# CUDA: the decode GEMM (a few tokens, no routing; kernels/gemm_decode.py)


def cuda_kernel_names(fn):
    """The names of the CUDA kernels `fn` launches, in order (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("M", [1, 5, 16, 17])
@pytest.mark.parametrize("N, K", [(256, 4096), (16384, 512), (1000, 1000), (24, 40)], ids=str)
def test_decode(gpu_device, dtype, M, N, K):
    """A decode step's tokens (M <= 16 takes the decode GEMM on sm_90, 17 the routed GEMMs): every mask kind, with and
    without biases, every weight layout, reductions split many ways (N = 256), not at all (K = 512) and with odd
    sizes; the output poisoned; a routing given changes no bit, and two runs give the same bits."""
    x = strided_view((M,), K, dtype, gpu_device)
    wv, wt, bv, bt = make_weights(N, K, dtype, gpu_device, "both")
    for mask_kind in MASK_KINDS:
        mask = make_mask(mask_kind, (M,), gpu_device)
        for bias in ("both", "none"):
            b = (bv, bt) if bias == "both" else (None, None)
            ref = linear_dual_reference(x, mask, wv, wt, *b)
            for layout, (v, t) in _weight_layouts(wv, wt).items():
                poison_allocator(gpu_device, 64 * M * N * 4)
                out = OPS.linear_dual(x, mask, v, t, *b)
                check_out(out, ref, (M, N), dtype, gpu_device, TOL[dtype], f"{mask_kind}/{bias}/{layout}")
            assert torch.equal(out, OPS.linear_dual(x, mask, v, t, *b, routing=OPS.route(mask))), "routing given"
            assert torch.equal(out, OPS.linear_dual(x, mask, v, t, *b)), "not deterministic"


@pytest.mark.gpu
def test_decode_kernels(gpu_device):
    """What a decode step launches on sm_90, nothing to route: the decode GEMM alone where one expert's column tiles
    reach half the SMs (N = 4096: 128 tiles of 32), plus the sum of its splits where they do not (N = 1280, K = 8192:
    Llama-3-70B's QKV on 8 GPUs); 17 tokens take the routed GEMMs."""
    if torch.cuda.get_device_capability(gpu_device) != (9, 0):
        pytest.skip("the decode GEMM is in the sm_90 table only")
    if torch.cuda.get_device_properties(gpu_device).multi_processor_count > 256:
        pytest.skip("more than 256 SMs: N = 4096 would be split too")
    x = torch.randn(17, 8192, device=gpu_device, dtype=torch.bfloat16)
    mask = make_mask("random", (17,), gpu_device)
    wv, wt, bv, bt = make_weights(4096, 4096, torch.bfloat16, gpu_device, "both")
    nv, nt, _, _ = make_weights(1280, 8192, torch.bfloat16, gpu_device, "none")
    xs = x[:, :4096]
    OPS.linear_dual(xs, mask, wv, wt, bv, bt)  # loads the kernels
    assert cuda_kernel_names(lambda: OPS.linear_dual(xs[:1], mask[:1], wv, wt, bv, bt)) == [
        "routed_decode_linear_kernel"]
    assert cuda_kernel_names(lambda: OPS.linear_dual(x[:16], mask[:16], nv, nt)) == [
        "routed_decode_linear_kernel", "decode_reduce_kernel"]
    assert "routed_decode_linear_kernel" not in cuda_kernel_names(lambda: OPS.linear_dual(xs, mask, wv, wt, bv, bt))


# ----------------------------------------------------------------------------------------------------------------
# CUDA: realistic sizes, several devices, CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["random", "span"])
def test_realistic_bf16(gpu_device, mask_kind):
    """M = K = N = 4096 bf16 with biases: forward and the gradients of x, both weights and both biases."""
    M = K = N = 4096
    x = strided_view((M,), K, torch.bfloat16, gpu_device)
    mask = make_mask(mask_kind, (M,), gpu_device)
    wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, gpu_device, "both")
    out, ref = run_and_check_grads(x, mask, wv, wt, bv, bt, TOL[torch.bfloat16])
    check_out(out, ref, (M, N), torch.bfloat16, gpu_device, TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64, 65, 1024, 1025, 4096, 4097])
def test_routing_sizes(gpu_device, M):
    """Token counts on both sides of each routing size (csrc/ops/routed_gemm.cpp): up to 64 / 1024 / 4096 rows the
    forward GEMM routes the mask in its own programs with a 64- / 1024- / 4096-lane block; above 4096 the two routing
    kernels run first. bf16 (the TMA kernels on sm_90), a fresh random mask, NaN-poisoned allocator, forward and every
    gradient (the backward routes again and takes the routing kernel)."""
    K, N = 128, 96
    x = strided_view((M,), K, torch.bfloat16, gpu_device)
    mask = make_mask("random", (M,), gpu_device)
    wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, gpu_device, "both")
    poison_allocator(gpu_device, 8 * M * max(N, K) * 2)
    out, ref = run_and_check_grads(x, mask, wv, wt, bv, bt, TOL[torch.bfloat16])
    check_out(out, ref, (M, N), torch.bfloat16, gpu_device, TOL[torch.bfloat16])


@pytest.mark.gpu
def test_split_last_round(gpu_device):
    """The forward's gather GEMM (sm_90) computes a last partial round, after its whole rounds, shared out as its table
    config says: in column slices (kernels/gemm_tiles.py _split_tail) or by K steps (_sk_share). At M = 1000, 2000 and
    3000 tokens where the table has such a config, expert counts and N chosen for this GPU's SM count and that config
    (device_helpers.split_counts), the tokens shuffled; at least one M must have one. bf16 with biases, forward and
    every gradient against float64, NaN-poisoned allocator."""
    major, minor = torch.cuda.get_device_capability(gpu_device)
    if major != 9:
        pytest.skip("the gather GEMM runs on sm_90 only")
    K = 256
    sms = torch.cuda.get_device_properties(gpu_device).multi_processor_count
    ran = []
    for M in (1000, 2000, 3000):
        split = split_counts("routed_linear_gather_tma_kernel", M, K, major * 10 + minor, sms)
        if split is None:
            continue
        c0, c1, N = split
        mask = torch.zeros(M, dtype=torch.bool)
        mask[c0:] = True
        mask = mask[torch.randperm(M, generator=torch.Generator().manual_seed(6))].to(gpu_device)
        x = strided_view((M,), K, torch.bfloat16, gpu_device)
        wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, gpu_device, "both")
        poison_allocator(gpu_device, 8 * M * max(N, K) * 2)
        out, ref = run_and_check_grads(x, mask, wv, wt, bv, bt, TOL[torch.bfloat16])
        check_out(out, ref, (M, N), torch.bfloat16, gpu_device, TOL[torch.bfloat16])
        ran.append(M)
    assert ran, "the sm_90 table shares out the gather GEMM's last round at none of M = 1000, 2000, 3000"


def _stream_k_shape(cc):
    """(M, N, K, forward, backward) of a linear_dual call whose forward (the gather GEMM) or grad-input GEMM (dX, n = K,
    reduction N) the sm_90 table serves with a stream-K config (device_helpers.tail_of: _sk or _sk2), from the matrix
    models' projections; None if it has none."""
    projections = [(12288, 4096), (6144, 4096), (4096, 4096), (1280, 8192), (8192, 1024), (4096, 14336),
                   (14336, 4096), (3584, 18944), (18944, 3584), (4608, 3584)]
    for M in (1024, 2048, 512, 4096, 256, 384, 8192):
        for N, K in projections:
            fwd = tail_of(fused_ops.kernel_config("routed_linear_gather_tma_kernel", "half", M, cc, N, K))[1] > 0
            bwd = tail_of(fused_ops.kernel_config("routed_linear_tma_kernel", "half", M, cc, K, N, True))[1] > 0
            if fwd or bwd:
                return M, N, K, fwd, bwd
    return None


@pytest.mark.gpu
def test_stream_k_last_round(gpu_device):
    """A shape whose forward or grad-input GEMM the table runs stream-K (the last rounds' K steps shared out, a cut
    tile's partial sums added in a fixed order by the programs holding its pieces; kernels/gemm_tiles.py _sk_share): bf16 forward and every
    gradient against float64; the same bits again, on a side stream (its own flags buffer) and from a CUDA graph
    replay with a new mask; NaN-poisoned allocator."""
    major, minor = torch.cuda.get_device_capability(gpu_device)
    found = _stream_k_shape(major * 10 + minor) if major == 9 else None
    if found is None:
        pytest.skip("stream-K configs run on sm_90 only, where the table has them")
    M, N, K, fwd, bwd = found
    torch.cuda.set_device(gpu_device)
    x = strided_view((M,), K, torch.bfloat16, gpu_device)
    mask = make_mask("span", (M,), gpu_device)
    wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, gpu_device, "both")
    poison_allocator(gpu_device, 8 * M * max(N, K) * 2)
    g = torch.randn(M, N, device=gpu_device).to(torch.bfloat16)
    out, ref = run_and_check_grads(x, mask, wv, wt, bv, bt, TOL[torch.bfloat16], g=g)
    check_out(out, ref, (M, N), torch.bfloat16, gpu_device, TOL[torch.bfloat16])

    def both():
        y = OPS.linear_dual(x, mask, wv, wt, bv, bt)
        return [y] + list(OPS.linear_dual_backward(g, x, mask, wv, wt))
    first, again = both(), both()
    side = torch.cuda.Stream(gpu_device)
    side.wait_stream(torch.cuda.current_stream(gpu_device))
    with torch.cuda.stream(side):
        on_side = both()
    torch.cuda.current_stream(gpu_device).wait_stream(side)
    torch.cuda.synchronize(gpu_device)
    for a, b, c in zip(first, again, on_side):
        assert torch.equal(a, b) and torch.equal(a, c), "stream-K results differ from run to run"
    assert torch.equal(first[0], out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        both()  # warm-up on the capture stream
    torch.cuda.current_stream(gpu_device).wait_stream(side)
    with torch.cuda.graph(graph, stream=side):
        captured = both()
    mask.copy_(make_mask("random", (M,), gpu_device))
    graph.replay()
    torch.cuda.synchronize(gpu_device)
    want = both()
    for a, b in zip(captured, want):
        assert torch.equal(a, b), "a CUDA graph replay of the stream-K GEMMs differs from the eager call"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
def test_realistic_leading_shape(gpu_device, dtype):
    """[b, s] = [3, 700] tokens (M = 2100, not a multiple of 128), K = 999, N = 1030 (rows not a multiple of 16
    bytes: pointer kernels), 90% vision."""
    b, s, K, N = 3, 700, 999, 1030
    x = strided_view((b, s), K, dtype, gpu_device, "transposed")
    mask = make_mask("vision90", (b, s), gpu_device)
    wv, wt, bv, bt = make_weights(N, K, dtype, gpu_device, "v_only")
    out, ref = run_and_check_grads(x, mask, wv, wt, bv, bt, TOL[dtype])
    check_out(out, ref, (b, s, N), dtype, gpu_device, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=DT_ID.get)
def test_pointer_kernels_forced(gpu_device, dtype, monkeypatch):
    """FUSED_GEMM_TMA=0 (docs/design.md) makes the op use the pointer kernels even where the TMA ones apply (aligned
    sizes on an H100): forward and all gradients still match. (Exercises that path if the op reads the variable per
    call; otherwise it repeats the default path, still a valid check.)"""
    monkeypatch.setenv("FUSED_GEMM_TMA", "0")
    M, K, N = 1000, 512, 384
    x = strided_view((M,), K, dtype, gpu_device)
    mask = make_mask("random", (M,), gpu_device)
    wv, wt, bv, bt = make_weights(N, K, dtype, gpu_device, "both")
    out, ref = run_and_check_grads(x, mask, wv, wt, bv, bt, TOL[dtype])
    check_out(out, ref, (M, N), dtype, gpu_device, TOL[dtype])


@pytest.mark.gpu
def test_all_devices_agree():
    """The same inputs on every visible device give the same result (and each matches the reference)."""
    if torch.cuda.device_count() < 1:
        pytest.skip("no CUDA device")
    M, K, N = 1000, 520, 264
    x = strided_view((M,), K, torch.bfloat16, "cpu")
    mask = make_mask("random", (M,), "cpu")
    wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, "cpu", "both")
    ref = linear_dual_reference(x, mask, wv, wt, bv, bt)
    outs = []
    for i in range(torch.cuda.device_count()):
        d = f"cuda:{i}"
        out = OPS.linear_dual(x.to(d), mask.to(d), wv.to(d), wt.to(d), bv.to(d), bt.to(d))
        check_out(out, ref.to(d), (M, N), torch.bfloat16, d, TOL[torch.bfloat16], f"out on {d}")
        outs.append(out.cpu())
    for i, o in enumerate(outs[1:], 1):
        assert rel_err(o, outs[0].double()) <= TOL[torch.bfloat16] / 4, f"cuda:{i} disagrees with cuda:0"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DT_ID.get)
def test_cuda_graph(gpu_device, dtype):
    """The launch grid depends only on shapes: capture the forward once, then copy new x AND a new mask (different
    expert counts) into the static inputs and replay; each replay matches the reference."""
    torch.cuda.set_device(gpu_device)
    M, K, N = 777, 264, 200
    x = strided_view((M,), K, dtype, gpu_device)
    mask = make_mask("random", (M,), gpu_device)
    wv, wt, bv, bt = make_weights(N, K, dtype, gpu_device, "both")
    stream = torch.cuda.Stream(gpu_device)
    stream.wait_stream(torch.cuda.current_stream(gpu_device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (loads the kernels) outside the capture
            OPS.linear_dual(x, mask, wv, wt, bv, bt)
    torch.cuda.current_stream(gpu_device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # Capture on a stream of this device: torch.cuda.graph's default capture stream is created once per process, on
    # the device current at its first use (cuda:0), and the op launches on its tensors' device's current stream.
    with torch.cuda.graph(graph, stream=stream):
        out = OPS.linear_dual(x, mask, wv, wt, bv, bt)
    for kind in ("all_true", "span", "all_false", "random"):
        x.copy_(strided_view((M,), K, dtype, gpu_device))
        mask.copy_(make_mask(kind, (M,), gpu_device))
        graph.replay()
        torch.cuda.synchronize(gpu_device)
        check_out(out, linear_dual_reference(x, mask, wv, wt, bv, bt), (M, N), dtype, gpu_device, TOL[dtype],
                  f"replay ({kind})")


# ----------------------------------------------------------------------------------------------------------------
# argument validation


def test_errors_structural(device):
    """Every device must raise, naming the offending argument."""
    M, K, N = 6, 8, 5
    x = strided_view((M,), K, torch.float32, device)
    mask = make_mask("random", (M,), device)
    wv, wt, bv, bt = make_weights(N, K, torch.float32, device, "both")
    g = strided_view((M,), N, torch.float32, device)
    routing = OPS.linear_dual_forward(x, mask, wv, wt)[1]
    cases = [
        (r"(?i)mask|bool", lambda: OPS.linear_dual(x, mask.to(torch.int32), wv, wt)),
        (r"(?i)mask|bool", lambda: OPS.linear_dual(x, mask.to(torch.uint8), wv, wt)),
        (r"(?i)mask|bool", lambda: OPS.linear_dual(x, mask.float(), wv, wt)),
        ("mask", lambda: OPS.linear_dual(x, mask[:-1], wv, wt)),  # wrong length
        ("mask", lambda: OPS.linear_dual(x, mask.reshape(2, 3), wv, wt)),  # same numel, wrong shape
        ("mask", lambda: OPS.linear_dual(x.reshape(2, 3, K), mask, wv, wt)),  # x [2,3,K] with mask [6]
        ("weight", lambda: OPS.linear_dual(x, mask, wv, wt[:-1])),  # N disagrees
        ("weight", lambda: OPS.linear_dual(x, mask, wv[:, :-1], wt[:, :-1])),  # K != x's K
        ("weight", lambda: OPS.linear_dual(x, mask, wv, wt[:, :-1])),  # K disagrees between experts
        ("weight", lambda: OPS.linear_dual(x, mask, wv.reshape(-1), wt.reshape(-1))),  # 1-D weights
        ("weight", lambda: OPS.linear_dual(x, mask, wv[None], wt[None])),  # 3-D weights
        ("bias", lambda: OPS.linear_dual(x, mask, wv, wt, bv[:-1], bt)),
        ("bias", lambda: OPS.linear_dual(x, mask, wv, wt, bv, torch.zeros(N + 1, device=device))),
        ("bias", lambda: OPS.linear_dual(x, mask, wv, wt, bv[None], bt[None])),  # [1, N]
        (r"(?i)dtype|type", lambda: OPS.linear_dual(x.half(), mask, wv, wt)),  # x fp16, weights fp32
        (r"(?i)dtype|type", lambda: OPS.linear_dual(x, mask, wv, wt.bfloat16())),  # experts disagree
        (r"(?i)dtype|type", lambda: OPS.linear_dual(x, mask, wv, wt, bv.half(), bt)),
        (r"(?i)dtype|type|\bx\b", lambda: OPS.linear_dual(x.to(torch.int32), mask, wv.to(torch.int32),
                                                           wt.to(torch.int32))),
        (r"(?i)\bx\b|dim", lambda: OPS.linear_dual(x[0, 0], mask[0], wv, wt)),  # 0-d x
        (r"(?i)grad", lambda: OPS.linear_dual_backward(g[:, :-1], x, mask, wv, wt)),  # grad_out [M, N-1]
        (r"(?i)grad", lambda: OPS.linear_dual_backward(g[:-1], x, mask, wv, wt)),  # grad_out [M-1, N]
        (r"(?i)mask|bool", lambda: OPS.linear_dual_backward(g, x, mask.to(torch.uint8), wv, wt)),
        (r"(?i)dtype|type", lambda: OPS.linear_dual_backward(g.half(), x, mask, wv, wt)),
        ("routing", lambda: OPS.linear_dual_backward(g, x, mask, wv, wt, routing=routing.long())),
        ("routing", lambda: OPS.linear_dual_backward(g, x, mask, wv, wt, routing=routing[:-1])),
        ("routing", lambda: OPS.linear_dual_backward(g, x, mask, wv, wt, routing=routing[None])),
        ("routing", lambda: OPS.linear_dual_backward(g, x, mask, wv, wt, routing=routing[::2])),
        ("routing", lambda: OPS.linear_dual_backward(g[:5], x[:5], mask[:5], wv, wt, routing=routing)),  # M 6 != 5
        ("weight_v", lambda: OPS.linear_dual(x, mask, wv, None)),  # 2-D weight_v without weight_t
        ("weight_v", lambda: OPS.linear_dual(x, mask, torch.stack([wv, wt, wv]), None)),  # [3, N, K]
        ("weight_v", lambda: OPS.linear_dual(x, mask, torch.stack([wt, wv]), wt)),  # stacked and weight_t
        ("weight", lambda: OPS.linear_dual(x, mask, torch.stack([wt, wv])[:, :, :-1], None)),  # K != x's K
        ("weight_v", lambda: OPS.linear_dual_backward(g, x, mask, wv, None)),
        ("residual", lambda: OPS.linear_dual(x, mask, wv, wt, residual=g[:, :-1])),  # [M, N-1]
        ("residual", lambda: OPS.linear_dual(x, mask, wv, wt, residual=x)),  # x's shape, not the output's
        ("residual", lambda: OPS.linear_dual(x, mask, wv, wt, residual=g[None])),  # [1, M, N]
        (r"(?i)residual|dtype|type", lambda: OPS.linear_dual(x, mask, wv, wt, residual=g.half())),
        ("residual", lambda: OPS.linear_dual_forward(x, mask, wv, wt, residual=g[:-1])),
    ]
    failures = []
    for pattern, fn in cases:
        try:
            with pytest.raises(ERR, match=pattern):
                fn()
        except BaseException as e:  # noqa: BLE001 (collect all, report together)
            failures.append(f"[{pattern}] {e!s}".splitlines()[0][:300])
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_errors_mixed_devices(gpu_device):
    M, K, N = 6, 8, 5
    x = strided_view((M,), K, torch.float32, gpu_device)
    mask = make_mask("random", (M,), gpu_device)
    wv, wt, bv, bt = make_weights(N, K, torch.float32, gpu_device, "both")
    cases = [
        (r"(?i)weight|device", lambda: OPS.linear_dual(x, mask, wv.cpu(), wt)),
        (r"(?i)weight|device", lambda: OPS.linear_dual(x, mask, wv, wt.cpu())),
        (r"(?i)mask|device", lambda: OPS.linear_dual(x, mask.cpu(), wv, wt)),
        (r"(?i)bias|device", lambda: OPS.linear_dual(x, mask, wv, wt, bv.cpu(), bt)),
        (r"(?i)\bx\b|device|weight", lambda: OPS.linear_dual(x.cpu(), mask.cpu(), wv, wt)),
        (r"(?i)grad|device", lambda: OPS.linear_dual_backward(torch.zeros(M, N), x, mask, wv, wt)),
        ("routing", lambda: OPS.linear_dual_backward(torch.zeros(M, N, device=gpu_device), x, mask, wv, wt,
                                                     routing=OPS.linear_dual_forward(x, mask, wv, wt)[1].cpu())),
    ]
    if torch.cuda.device_count() > 1:
        other = f"cuda:{(torch.device(gpu_device).index + 1) % torch.cuda.device_count()}"
        cases.append((r"(?i)weight|device", lambda: OPS.linear_dual(x, mask, wv, wt.to(other))))
        cases.append((r"(?i)mask|device", lambda: OPS.linear_dual(x, mask.to(other), wv, wt)))
    failures = []
    for pattern, fn in cases:
        try:
            with pytest.raises(ERR, match=pattern):
                fn()
        except BaseException as e:  # noqa: BLE001
            failures.append(f"[{pattern}] {e!s}".splitlines()[0][:300])
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------------------------------------
# autograd checks and torch.library integration (CPU)


@pytest.mark.parametrize("mask_kind", ["random", "all_true", "span"])
@pytest.mark.parametrize("bias", ["both", "v_only", "none"])
def test_gradcheck_cpu(mask_kind, bias):
    M, K, N = 7, 5, 3
    x = torch.randn(M, K, dtype=torch.float64, requires_grad=True)
    mask = make_mask(mask_kind, (M,))
    wv, wt, bv, bt = (t.requires_grad_(True) if t is not None else None
                      for t in make_weights(N, K, torch.float64, "cpu", bias))
    inputs = tuple(t for t in (x, wv, wt, bv, bt) if t is not None)

    def fn(*ts):
        it = iter(ts)
        a, b, c = next(it), next(it), next(it)
        d = next(it) if bv is not None else None
        e = next(it) if bt is not None else None
        return OPS.linear_dual(a, mask, b, c, d, e)

    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_cpu_residual():
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = make_mask("random", (2, 3))
    wv, wt, bv, bt = (t.requires_grad_(True) for t in make_weights(3, 4, torch.float64, "cpu", "both"))
    res = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: OPS.linear_dual(t[0], mask, *t[1:5], residual=t[5]),
                                    (x, wv, wt, bv, bt, res))


def test_gradcheck_cpu_stacked():
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    mask = make_mask("random", (7,))
    w = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    bv = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: OPS.linear_dual(a, mask, b, None, c), (x, w, bv))


def test_gradcheck_cpu_leading_shape():
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = make_mask("random", (2, 3))
    wv, wt, bv, bt = (t.requires_grad_(True) for t in make_weights(3, 4, torch.float64, "cpu", "both"))
    assert torch.autograd.gradcheck(lambda *t: OPS.linear_dual(t[0], mask, *t[1:]), (x, wv, wt, bv, bt))


OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
#: the ops of this file; a test in test_rope_ops.py may collect these names for its every-op-is-opchecked check
OPCHECKED = ["linear_dual", "linear_dual_forward", "linear_dual_backward"]


def _opcheck_samples(op_name):
    M, K, N = 6, 5, 3
    mask = make_mask("random", (M,))
    # linear_dual_forward is not differentiable (linear_dual's autograd calls it): its samples need no gradient
    differentiable = op_name == "linear_dual"
    mk = lambda *s, rg=False: torch.randn(*s, requires_grad=rg and differentiable)  # noqa: E731
    if op_name in ("linear_dual", "linear_dual_forward"):
        return [
            ((mk(M, K), mask, mk(N, K), mk(N, K)), {}),
            ((mk(M, K, rg=True), mask, mk(N, K, rg=True), mk(N, K, rg=True), mk(N, rg=True), mk(N, rg=True)), {}),
            ((mk(2, 3, K, rg=True), mask.reshape(2, 3), mk(N, K, rg=True), mk(N, K)), dict(bias_t=mk(N, rg=True))),
            ((mk(M, K, rg=True), mask, mk(N, K, rg=True), mk(N, K)), dict(residual=mk(M, N, rg=True))),
            ((mk(M, K), mask, mk(N, K), mk(N, K), mk(N)), dict(residual=mk(M, N, rg=True))),
            ((mk(M, K, rg=True), mask, mk(2, N, K, rg=True), None, mk(N, rg=True)), {}),
        ]
    return [((mk(M, N), mk(M, K), mask, mk(N, K), mk(N, K)), {}),
            ((mk(M, N), mk(M, K), mask, mk(2, N, K), None), {}),
            ((mk(2, 3, N), mk(2, 3, K), mask.reshape(2, 3), mk(N, K), mk(N, K)), dict(allow_tf32=True)),
            ((mk(M, N), mk(M, K), mask, mk(N, K), mk(N, K)), dict(output_mask=[True, True, False, False, True])),
            ((mk(M, N), mk(M, K), mask, mk(N, K), mk(N, K)),
             dict(routing=OPS.linear_dual_forward(mk(M, K), mask, mk(N, K), mk(N, K))[1]))]


@pytest.mark.parametrize("op_name", OPCHECKED)
def test_opcheck(op_name):
    op = getattr(OPS, op_name).default
    for args, kwargs in _opcheck_samples(op_name):
        torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)


def test_torch_compile_module_fullgraph_cpu():
    """DualLinear forward (and the gradients through it) under torch.compile(fullgraph=True, backend="aot_eager")."""
    torch._dynamo.reset()
    mod = DualLinear(12, 7)
    cmod = torch.compile(mod, fullgraph=True, backend="aot_eager")
    for lead in ((9,), (2, 5)):  # a second shape: recompiles or runs dynamic, must not break the graph
        x = torch.randn(lead + (12,), requires_grad=True)
        mask = make_mask("random", lead)
        want = mod(x, mask)
        gw = torch.autograd.grad(want.square().sum(), (x, mod.weight, mod.bias))
        got = cmod(x, mask)
        gg = torch.autograd.grad(got.square().sum(), (x, mod.weight, mod.bias))
        torch.testing.assert_close(got, want)
        for a, b in zip(gg, gw):
            torch.testing.assert_close(a, b)


def test_meta_device():
    for lead in ((7,), (2, 9), (0,)):
        x = torch.empty(lead + (40,), device="meta", dtype=torch.bfloat16)
        mask = torch.empty(lead, device="meta", dtype=torch.bool)
        w = torch.empty(24, 40, device="meta", dtype=torch.bfloat16)
        b = torch.empty(24, device="meta", dtype=torch.bfloat16)
        out = OPS.linear_dual(x, mask, w, w, b, None)
        assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == lead + (24,)
        g = torch.empty(lead + (24,), device="meta", dtype=torch.bfloat16)
        gx, gwv, gwt, gbv, gbt = OPS.linear_dual_backward(g, x, mask, w, w)
        assert gx.shape == x.shape and gwv.shape == gwt.shape == (24, 40) and gbv.shape == gbt.shape == (24,)
        assert OPS.linear_dual(x, mask, w, w, residual=torch.empty(out.shape, device="meta",
                                                                   dtype=torch.bfloat16)).shape == out.shape
        ws = torch.empty(2, 24, 40, device="meta", dtype=torch.bfloat16)
        assert OPS.linear_dual(x, mask, ws, None).shape == out.shape
        sgx, sgw, sgwt, _, _ = OPS.linear_dual_backward(g, x, mask, ws, None)
        assert sgx.shape == x.shape and sgw.shape == (2, 24, 40) and sgwt is None
        out2, routing = OPS.linear_dual_forward(x, mask, w, w, b, None)
        assert out2.shape == out.shape and routing.dtype == torch.int32 and routing.shape == (math.prod(lead) + 264,)
        assert OPS.linear_dual_backward(g, x, mask, w, w, routing=routing)[0].shape == x.shape


# ----------------------------------------------------------------------------------------------------------------
# Python API: linear_dual and DualLinear


def test_functional_wrapper(device):
    M, K, N = 37, 24, 72
    x = strided_view((M,), K, torch.bfloat16, device).requires_grad_(True)
    mask = make_mask("span", (M,), device)
    wv, wt, bv, bt = make_weights(N, K, torch.bfloat16, device, "t_only")
    out = linear_dual(x, mask, wv, wt, bias_t=bt)
    assert torch.equal(out, OPS.linear_dual(x, mask, wv, wt, None, bt))
    assert out.requires_grad and out.grad_fn is not None
    check_out(out.detach(), linear_dual_reference(x, mask, wv, wt, None, bt), (M, N), torch.bfloat16, device,
              TOL[torch.bfloat16])
    out.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_dual_linear_layout(device, bias):
    """One [2, N, K] weight (0 = text, 1 = vision) and one [2, N] bias; weight_v / weight_t are views at offsets
    N*K and 0 of the same storage; the module computes linear_dual with them."""
    K, N = 40, 24
    mod = DualLinear(K, N, bias=bias, device=device, dtype=torch.bfloat16)
    assert dict(mod.named_parameters()).keys() == ({"weight", "bias"} if bias else {"weight"})
    assert mod.weight.shape == (2, N, K) and mod.weight.dtype == torch.bfloat16
    assert mod.weight_v.shape == mod.weight_t.shape == (N, K)
    es = mod.weight.element_size()
    assert mod.weight_t.data_ptr() == mod.weight.data_ptr()
    assert mod.weight_v.data_ptr() == mod.weight.data_ptr() + N * K * es
    assert mod.weight_v._base is mod.weight or mod.weight_v.untyped_storage().data_ptr() == \
        mod.weight.untyped_storage().data_ptr()
    if bias:
        assert mod.bias.shape == (2, N)
        assert mod.bias_t.data_ptr() == mod.bias.data_ptr() and mod.bias_v.data_ptr() == mod.bias.data_ptr() + N * es
    else:
        assert mod.bias is None and mod.bias_v is None and mod.bias_t is None
    # nn.Linear's init range (up to bf16 rounding), and the two experts differ
    bound = 1 / math.sqrt(K) * (1 + 2 ** -7)
    assert float(mod.weight.detach().abs().max()) <= bound and not torch.equal(mod.weight[0], mod.weight[1])
    x = strided_view((3, 13), K, torch.bfloat16, device)
    mask = make_mask("random", (3, 13), device)
    out = mod(x, mask)
    ref = linear_dual_reference(x, mask, mod.weight_v, mod.weight_t, mod.bias_v, mod.bias_t)
    check_out(out.detach(), ref, (3, 13, N), torch.bfloat16, device, TOL[torch.bfloat16])
    assert "in_features=40" in repr(mod) and "out_features=24" in repr(mod)


def test_dual_linear_grads_land_in_stacked_parameters(device):
    """Gradients reach weight.grad [2, N, K] / bias.grad [2, N] with the text expert's in row 0, the vision
    expert's in row 1; with an all-text mask the vision half is exactly zero."""
    K, N, M = 24, 40, 37
    mod = DualLinear(K, N, device=device, dtype=torch.float32)
    for kind in ("random", "all_false"):
        mod.zero_grad(set_to_none=True)
        x = strided_view((M,), K, torch.float32, device)
        mask = make_mask(kind, (M,), device)
        g = strided_view((M,), N, torch.float32, device)
        mod(x, mask).backward(g)
        assert mod.weight.grad.shape == (2, N, K) and mod.bias.grad.shape == (2, N)
        _, ref = reference_grads(lambda wv, wt, bv, bt: linear_dual_reference(x, mask, wv, wt, bv, bt),
                                 [mod.weight_v, mod.weight_t, mod.bias_v, mod.bias_t], g, [True] * 4)
        tol = TOL[torch.float32]
        check_grad(mod.weight.grad[1], ref[0], torch.float32, tol, f"weight.grad[1] ({kind})")
        check_grad(mod.weight.grad[0], ref[1], torch.float32, tol, f"weight.grad[0] ({kind})")
        check_grad(mod.bias.grad[1], ref[2], torch.float32, tol, f"bias.grad[1] ({kind})")
        check_grad(mod.bias.grad[0], ref[3], torch.float32, tol, f"bias.grad[0] ({kind})")


@pytest.mark.parametrize("biases", [(True, True), (False, False), (True, False), (False, True)],
                         ids=["both", "none", "v_only", "t_only"])
def test_dual_linear_from_linears(device, biases):
    """from_linears copies two nn.Linear experts: each token's output equals its own linear's."""
    K, N, M = 40, 24, 300
    lv = torch.nn.Linear(K, N, bias=biases[0], device=device, dtype=torch.float32)
    lt = torch.nn.Linear(K, N, bias=biases[1], device=device, dtype=torch.float32)
    mod = DualLinear.from_linears(lv, lt)
    assert (mod.bias is not None) == any(biases)
    assert torch.equal(mod.weight_v, lv.weight) and torch.equal(mod.weight_t, lt.weight)
    assert mod.weight.data_ptr() not in (lv.weight.data_ptr(), lt.weight.data_ptr())  # copies, not aliases
    x = strided_view((M,), K, torch.float32, device)
    mask = make_mask("vision90", (M,), device)
    with torch.no_grad():
        want = torch.where(mask[:, None], lv(x), lt(x))
        got = mod(x, mask)
    check_out(got, want.double(), (M, N), torch.float32, device, 1e-5)
    with pytest.raises(ValueError, match="shape"):
        DualLinear.from_linears(lv, torch.nn.Linear(K, N + 1, device=device))


def test_dual_linear_state_dict_roundtrip():
    a = DualLinear(16, 8)
    b = DualLinear(16, 8)
    b.load_state_dict(a.state_dict())
    x, mask = torch.randn(5, 16), make_mask("random", (5,))
    assert torch.equal(a(x, mask), b(x, mask))
    assert set(a.state_dict()) == {"weight", "bias"}
