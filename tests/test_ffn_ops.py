"""Op-level and module tests of `torch.ops.fused.ffn` / `ffn_backward` (SwiGLU MLP, single expert or routed between
a vision and a text expert; docs/design.md, "Routed GEMM ops") and of `fused_ops.ffn` (`ffn`, `FusedSwiGLU`,
`DualExpertSwiGLU`), including interop with HF transformers' `LlamaMLP`.

Every device-parametrized test runs on "cpu" and on each visible CUDA device (marked `gpu`, see conftest.py).
Correctness is measured against the float64 oracle in tests/reference_routed.py (each token through only its own
expert) as ||out - ref|| / ||ref|| with a per-dtype tolerance. The CPU tier uses small, odd shapes (M = 1, 37, 300;
H, I = 40, 24, 72); realistic sizes (M = 512, H = 1024, I = 2816; LlamaMLP 1024 / 11008) run on CUDA only.
"""
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_ops  # noqa: F401  (loads the library that registers torch.ops.fused.*)
from fused_ops.ffn import DualExpertSwiGLU, FusedSwiGLU, ffn
from device_helpers import block_of, poison_allocator, requested_bytes, split_counts, sync
from reference_routed import (MASK_KINDS, check_grad, check_out, ffn_reference, make_mask, reference_grads, rel_err,
                              strided_view)

OPS = torch.ops.fused
ERR = (RuntimeError, ValueError)

# Relative-error tolerances. The op accumulates in fp32, stores the SwiGLU intermediate once in x's dtype and rounds
# the output once: two roundings forward, about four along a backward path. A bf16 simulation of exactly that gives
# ~2.4e-3 forward / ~2.9e-3 backward (fp16: 3e-4 / 3.6e-4), so the bounds leave >= 3x margin. fp32 is exact IEEE fp32
# unless allow_tf32 (inputs rounded to 10-bit mantissas). float64 exists on CPU only.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-10}
TOL_TF32 = 5e-3
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}

# (M, H, I): M not a multiple of 16 / 128, H and I not multiples of 16; "odd" has H and I that are not multiples of
# 16 bytes either (the CUDA op then cannot use the TMA kernels, which need multiples of 16 elements: pointer
# kernels, generic variant); one aligned shape
SHAPES = {"m1": (1, 40, 24), "m37": (37, 24, 72), "m300": (300, 72, 40), "odd": (45, 37, 27), "m128al": (128, 64, 48)}
LAYOUTS = ["contig", "transposed", "sliced", "strided_k"]
W_NAMES = ("w1", "w3", "w2", "u1", "u3", "u2")


# ----------------------------------------------------------------------------------------------------------------
# helpers


def make_weights(H, I, dtype, device, dual=True):  # noqa: E741
    """{w1, w3, w2[, u1, u3, u2]}: nn.Linear-scaled random weights (activations and outputs of order 1); the two
    experts differ, so a token sent to the wrong one is caught."""
    def mk(o, i):
        return (torch.randn(o, i, device=device) / math.sqrt(max(i, 1))).to(dtype)
    w = {"w1": mk(I, H), "w3": mk(I, H), "w2": mk(H, I)}
    if dual:
        w.update(u1=mk(I, H), u3=mk(I, H), u2=mk(H, I))
    return w


def op_args(w, mask):
    """Positional arguments after x for OPS.ffn / ffn_reference: (w1, w3, w2, mask, u1, u3, u2)."""
    return (w["w1"], w["w3"], w["w2"], mask, w.get("u1"), w.get("u3"), w.get("u2"))


def run_and_check_grads(x, w, mask, tol, allow_tf32=False, g=None, recompute=False):
    """Autograd through the op (x and every weight as leaves) against float64 autograd of the reference.
    Returns (op output, float64 reference output)."""
    names = [n for n in W_NAMES if n in w]
    lx = x.detach().clone().requires_grad_(True)
    lw = {n: w[n].detach().clone().requires_grad_(True) for n in names}
    out = OPS.ffn(lx, *op_args(lw, mask), allow_tf32, recompute=recompute)
    if g is None:
        g = torch.randn(out.shape, device=out.device).to(out.dtype)
    out.backward(g)

    def fn(a, *ws):
        return ffn_reference(a, *op_args(dict(zip(names, ws)), mask))

    ref_out, ref_grads = reference_grads(fn, [x] + [w[n] for n in names], g, [True] * (1 + len(names)))
    check_grad(lx.grad, ref_grads[0], x.dtype, tol, "grad x")
    for n, rg in zip(names, ref_grads[1:]):
        check_grad(lw[n].grad, rg, x.dtype, tol, f"grad {n}")
    return out.detach(), ref_out


def weight_grads_ref(x, w, mask, g):
    """float64 (out, [grad_x, grad of each weight present in W_NAMES order]) of the reference, and those names."""
    names = [n for n in W_NAMES if n in w]
    out, ref = reference_grads(lambda a, *ws: ffn_reference(a, *op_args(dict(zip(names, ws)), mask)),
                               [x] + [w[n] for n in names], g, [True] * (1 + len(names)))
    return out, ref, names


class LlamaMLPLike(nn.Module):
    """Hand-written equivalent of HF transformers' LlamaMLP (same attribute names and formula), so the interop tests
    run without transformers: down_proj(act_fn(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden_size, intermediate_size, act=None, bias=False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.act_fn = nn.SiLU() if act is None else act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------------------------------------------
# forward / backward vs the reference


def _fwd_matrix():
    rows = []
    for sk, mk, dt in itertools.product(SHAPES, ("single",) + MASK_KINDS, DTYPES):
        rows.append(pytest.param(sk, mk, dt, id=f"{sk}-{mk}-{DT_ID[dt]}"))
    return rows


@pytest.mark.parametrize("shape_key,mask_kind,dtype", _fwd_matrix())
def test_forward_matrix(device, shape_key, mask_kind, dtype):
    M, H, I = SHAPES[shape_key]  # noqa: E741
    dual = mask_kind != "single"
    x = strided_view((M,), H, dtype, device)
    mask = make_mask(mask_kind, (M,), device) if dual else None
    w = make_weights(H, I, dtype, device, dual)
    before = [t.clone() for t in [x] + list(w.values())]
    poison_allocator(device, M * max(H, I) * x.element_size())
    out = OPS.ffn(x, *op_args(w, mask))
    sync(device)
    assert all(torch.equal(a, b) for a, b in zip(before, [x] + list(w.values()))), "inputs were modified"
    check_out(out, ffn_reference(x, *op_args(w, mask)), (M, H), dtype, device, TOL[dtype])


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("mask_kind", ("single",) + MASK_KINDS)
def test_backward_matrix(device, mask_kind, dtype, recompute):
    """Gradients of x and every weight through autograd (the C++ autograd calling ffn_backward) against float64
    autograd of the reference, with gate and up saved by the forward (default) or recomputed by the backward; an
    expert without tokens gets exact zeros."""
    M, H, I = 300, 72, 40  # noqa: E741
    dual = mask_kind != "single"
    x = strided_view((M,), H, dtype, device)
    mask = make_mask(mask_kind, (M,), device) if dual else None
    w = make_weights(H, I, dtype, device, dual)
    out, ref = run_and_check_grads(x, w, mask, TOL[dtype], recompute=recompute)
    check_out(out, ref, (M, H), dtype, device, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("shape_key", ["m1", "m37", "odd", "m128al"])
@pytest.mark.parametrize("mask_kind", ["single", "random", "stacked"])
def test_residual(device, mask_kind, shape_key, dtype):
    """residual: out = ffn(x) + residual, added in the down projection's epilogue before the one rounding, against the
    float64 reference; its gradient is the output's, and the other gradients are those without it. Every CUDA path of
    the down projection: TMA scattered (dual), TMA in place (single, m128al / m37), pointer ("odd": H, I not multiples
    of 16 bytes). The residual is a strided view, and an expanded one must be read as it is."""
    M, H, I = SHAPES[shape_key]  # noqa: E741
    dual = mask_kind != "single"
    x = strided_view((M,), H, dtype, device)
    res = strided_view((M,), H, dtype, device, "sliced")
    mask = make_mask("random", (M,), device) if dual else None
    w = make_weights(H, I, dtype, device, dual)
    if mask_kind == "stacked":
        args = (torch.stack([w["u1"], w["w1"]]), torch.stack([w["u3"], w["w3"]]), torch.stack([w["u2"], w["w2"]]),
                mask)
    else:
        args = op_args(w, mask)
    ref = ffn_reference(x, *op_args(w, mask)) + res.double()
    poison_allocator(device, M * max(H, I) * x.element_size())
    check_out(OPS.ffn(x, *args, residual=res), ref, (M, H), dtype, device, TOL[dtype])
    # gradients: leaves x, weights, residual; the residual's gradient is exactly the upstream gradient
    lx, lr = x.detach().clone().requires_grad_(True), res.detach().clone().requires_grad_(True)
    lw = [a.detach().clone().requires_grad_(True) if torch.is_tensor(a) and a.is_floating_point() else a
          for a in args]
    g = torch.randn(M, H, device=device).to(dtype)
    out = OPS.ffn(lx, *lw, residual=lr)
    out.backward(g)
    assert torch.equal(lr.grad, g)
    lx2 = x.detach().clone().requires_grad_(True)
    lw2 = [a.detach().clone().requires_grad_(True) if torch.is_tensor(a) and a.is_floating_point() else a
           for a in args]
    OPS.ffn(lx2, *lw2).backward(g)
    assert torch.equal(lx.grad, lx2.grad)
    for a, b in zip(lw, lw2):
        if torch.is_tensor(a) and a.requires_grad:
            assert torch.equal(a.grad, b.grad)
    # the functional wrapper and an expanded (stride-0) residual, read as it is
    row = torch.randn(H, device=device).to(dtype)
    expanded = row.expand(M, H)
    check_out(ffn(x, *args, residual=expanded), ffn_reference(x, *op_args(w, mask)) + row.double(), (M, H), dtype,
              device, TOL[dtype], what="expanded residual")


def test_residual_errors(device):
    M, H, I = 8, 16, 24  # noqa: E741
    x = torch.randn(M, H, device=device)
    w = make_weights(H, I, torch.float32, device, dual=False)
    for bad, what in ((torch.randn(M, H + 1, device=device), "shape"), (torch.randn(M, device=device), "shape"),
                      (torch.randn(M, H, device=device, dtype=torch.float16), "dtype")):
        with pytest.raises(ERR, match="residual"):
            OPS.ffn(x, *op_args(w, None), residual=bad)
    with pytest.raises(ERR, match="residual"):
        OPS.ffn_forward(x, *op_args(w, None), residual=torch.randn(M + 1, H, device=device))
    if device != "cpu":
        with pytest.raises(ERR, match="residual"):
            OPS.ffn(x, *op_args(w, None), residual=torch.randn(M, H))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("shape_key", list(SHAPES))
@pytest.mark.parametrize("mask_kind", ["single", "random", "span", "all_true"])
def test_ffn_forward_saves_gate_up(device, mask_kind, shape_key, dtype):
    """ffn_forward: the output bit for bit ffn's, and gate_up x.shape[:-1] + [2I] = [x·w1ᵀ, x·w3ᵀ] of each token's
    own expert (float64 reference), every element written (the allocator poisoned before)."""
    M, H, I = SHAPES[shape_key]  # noqa: E741
    dual = mask_kind != "single"
    x = strided_view((M,), H, dtype, device).reshape(1, M, H)
    mask = make_mask(mask_kind, (1, M), device) if dual else None
    w = make_weights(H, I, dtype, device, dual)
    plain = OPS.ffn(x, *op_args(w, mask))
    poison_allocator(device, 2 * M * (H + 2 * I) * x.element_size())
    out, gate_up = OPS.ffn_forward(x, *op_args(w, mask))
    assert torch.equal(out, plain), "ffn_forward's output differs from ffn's"
    xd = x.double().reshape(M, H)
    vision = mask.reshape(M, 1) if dual else torch.zeros(M, 1, dtype=torch.bool, device=device)
    pick = lambda v, t: torch.where(vision, xd @ w[v].double().T, xd @ w[t].double().T)  # noqa: E731
    ref = torch.cat([pick("w1", "u1" if dual else "w1"), pick("w3", "u3" if dual else "w3")], 1).reshape(1, M, 2 * I)
    check_out(gate_up, ref, (1, M, 2 * I), dtype, device, TOL[dtype], "gate_up")


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("mask_kind", ["random", "all_true", "span"])
def test_stacked_weights(device, mask_kind, dtype, recompute):
    """Both experts stacked in each weight ([2, ...], text first, u's None): the output and every gradient bit for bit
    those of the same weights given as per-expert views, the gradients stacked [2, ...] ([0] text); and the float64
    reference."""
    M, H, I = 300, 72, 40  # noqa: E741
    x = strided_view((M,), H, dtype, device)
    mask = make_mask(mask_kind, (M,), device)
    w = make_weights(H, I, dtype, device)
    st = [torch.stack([w[t], w[v]]).requires_grad_(True) for t, v in (("u1", "w1"), ("u3", "w3"), ("u2", "w2"))]
    g = torch.randn(M, H, device=device).to(dtype)
    lx = x.detach().requires_grad_(True)
    out = OPS.ffn(lx, *st, mask, recompute=recompute)
    got = torch.autograd.grad(out, [lx, *st], g)
    assert all(t.shape == s.shape for t, s in zip(got[1:], st))
    lx2 = x.detach().requires_grad_(True)
    views = [t.detach().requires_grad_(True) for t in st]
    out2 = OPS.ffn(lx2, views[0][1], views[1][1], views[2][1], mask, views[0][0], views[1][0], views[2][0],
                   recompute=recompute)
    want = torch.autograd.grad(out2, [lx2, *views], g)
    assert torch.equal(out, out2)
    for name, a, b in zip(("x", "w1", "w3", "w2"), got, want):
        assert torch.equal(a, b), f"grad {name} differs from the per-expert call's"
    sd = [t.detach() for t in st]
    direct = OPS.ffn_backward(g, x, *sd, mask, gate_up=None if recompute else OPS.ffn_forward(x, *sd, mask)[1])
    assert all(t is None for t in direct[4:]) and all(torch.equal(a, b) for a, b in zip(direct[:4], got))
    ref_out, ref, _ = weight_grads_ref(x, w, mask, g)
    check_out(out, ref_out, (M, H), dtype, device, TOL[dtype])
    for j, n in enumerate(("w1", "w3", "w2")):
        check_grad(got[1 + j], torch.stack([ref[4 + j], ref[1 + j]]), dtype, TOL[dtype], f"grad stacked {n}")


@pytest.mark.gpu
@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
def test_activation_memory(gpu_device, dual):
    """What a training forward keeps for the backward: with the default, exactly gate_up (2 * M * I elements) more
    than with recompute=True; under no_grad, nothing but the output either way."""
    M, H, I = 1024, 256, 512  # noqa: E741
    dtype = torch.bfloat16
    x = torch.randn(M, H, device=gpu_device, dtype=dtype, requires_grad=True)
    mask = make_mask("random", (M,), gpu_device) if dual else None
    w = {k: v.requires_grad_(True) for k, v in make_weights(H, I, dtype, gpu_device, dual).items()}
    kept = {}
    for recompute in (False, True):
        torch.cuda.synchronize(gpu_device)
        before = torch.cuda.memory_allocated(gpu_device)
        out = OPS.ffn(x, *op_args(w, mask), recompute=recompute)
        torch.cuda.synchronize(gpu_device)
        kept[recompute] = torch.cuda.memory_allocated(gpu_device) - before - out.numel() * out.element_size()
        out.backward(torch.ones_like(out))
        del out
    assert kept[False] - kept[True] == 2 * M * I * 2, kept
    with torch.no_grad():
        before = torch.cuda.memory_allocated(gpu_device)
        out = OPS.ffn(x, *op_args(w, mask))
        assert torch.cuda.memory_allocated(gpu_device) - before == out.numel() * out.element_size()


def test_backward_twice_with_retained_graph(device):
    """retain_graph: a second backward through the saved activations gives the same gradients."""
    M, H, I = 37, 24, 72  # noqa: E741
    x = torch.randn(M, H, device=device, requires_grad=True)
    w = {k: v.requires_grad_(True) for k, v in make_weights(H, I, torch.float32, device).items()}
    out = OPS.ffn(x, *op_args(w, make_mask("random", (M,), device)))
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, [x, *w.values()], g, retain_graph=True)
    second = torch.autograd.grad(out, [x, *w.values()], g)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("gate_up", ["recomputed", "saved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("mask_kind", ["single", "random", "all_false"])
def test_backward_op_direct(device, mask_kind, dtype, gate_up):
    """ffn_backward called directly: (grad_x, grad_w1, grad_w3, grad_w2, grad_u1, grad_u3, grad_u2), the u gradients
    None for the single expert; gate and up recomputed, or read from ffn_forward's gate_up, which the backward leaves
    unchanged (autograd keeps it; retain_graph may run the backward again) and which gives the same bits twice."""
    M, H, I = 37, 24, 72  # noqa: E741
    dual = mask_kind != "single"
    x = strided_view((M,), H, dtype, device)
    mask = make_mask(mask_kind, (M,), device) if dual else None
    w = make_weights(H, I, dtype, device, dual)
    g = strided_view((M,), H, dtype, device, "sliced")
    gu = OPS.ffn_forward(x, *op_args(w, mask))[1] if gate_up == "saved" else None
    kept = None if gu is None else gu.clone()
    poison_allocator(device, (M * H + 7 * H * I) * x.element_size())
    got = OPS.ffn_backward(g, x, *op_args(w, mask), gate_up=gu)
    _, ref, names = weight_grads_ref(x, w, mask, g)
    assert isinstance(got, tuple) and len(got) == 7
    assert all(t is None for t in got[1 + len(names):]), "the single expert has no u gradients"
    for name, gt, rg in zip(["grad_x"] + [f"grad_{n}" for n in names], got, ref):
        check_grad(gt, rg, dtype, TOL[dtype], name)
    if gu is not None:
        assert torch.equal(gu, kept), "ffn_backward modified gate_up"
        again = OPS.ffn_backward(g, x, *op_args(w, mask), gate_up=gu)
        assert all(torch.equal(a, b) for a, b in zip(got[:1 + len(names)], again[:1 + len(names)]))


GRAD_NAMES = tuple(["grad_x"] + [f"grad_{n}" for n in W_NAMES])
# output_mask cases: one output alone, a frozen text expert (CogVLM trains the vision expert with the language model's
# weights frozen), a frozen vision expert and no grad_x, weight gradients only, grad_x only through two weights,
# nothing at all. For the single expert the last three entries are ignored (its u gradients are always None).
OUTPUT_MASKS = {"gx": (1, 0, 0, 0, 0, 0, 0), "gw1": (0, 1, 0, 0, 0, 0, 0), "gw3": (0, 0, 1, 0, 0, 0, 0),
                "gw2": (0, 0, 0, 1, 0, 0, 0), "gu2": (0, 0, 0, 0, 0, 0, 1), "frozen_t": (1, 1, 1, 1, 0, 0, 0),
                "frozen_v_no_x": (0, 0, 0, 0, 1, 1, 1), "weights": (0, 1, 1, 1, 1, 1, 1),
                "gx_w13": (1, 1, 1, 0, 1, 1, 0), "none": (0, 0, 0, 0, 0, 0, 0)}


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
@pytest.mark.parametrize("shape_key", ["m300", "odd", "m128al"])
@pytest.mark.parametrize("which", list(OUTPUT_MASKS))
def test_backward_output_mask(device, which, shape_key, dual):
    """ffn_backward(output_mask=...): the outputs asked for equal those of the full call bit for bit (and the float64
    reference); the others are None."""
    want = [bool(b) for b in OUTPUT_MASKS[which]]
    M, H, I = SHAPES[shape_key]  # noqa: E741
    dtype = torch.bfloat16
    x = strided_view((M,), H, dtype, device)
    mask = make_mask("random", (M,), device) if dual else None
    w = make_weights(H, I, dtype, device, dual)
    g = strided_view((M,), H, dtype, device)
    full = OPS.ffn_backward(g, x, *op_args(w, mask))
    poison_allocator(device, (M * H + 7 * H * I) * x.element_size())
    got = OPS.ffn_backward(g, x, *op_args(w, mask), output_mask=want)
    assert isinstance(got, tuple) and len(got) == 7
    _, ref, names = weight_grads_ref(x, w, mask, g)
    for i, (name, gt, ft) in enumerate(zip(GRAD_NAMES, got, full)):
        if not want[i] or i > len(names):
            assert gt is None, f"{name} was not asked for (or does not exist)"
            continue
        assert gt is not None and gt.shape == ft.shape, name
        assert torch.equal(gt, ft), f"{name} differs from the full call's"
        check_grad(gt, ref[i], dtype, TOL[dtype], name)


@pytest.mark.parametrize("frozen", ["x", "text", "vision", "w2", "all_weights"])
def test_backward_frozen_leaves(device, frozen):
    """Autograd with some inputs not requiring grad (asks the op only for the rest): the others' gradients match the
    float64 reference, the frozen ones stay None."""
    M, H, I = 300, 72, 40  # noqa: E741
    dtype = torch.bfloat16
    x = strided_view((M,), H, dtype, device)
    mask = make_mask("random", (M,), device)
    w = make_weights(H, I, dtype, device)
    frozen_set = {"x": {"x"}, "text": {"u1", "u3", "u2"}, "vision": {"w1", "w3", "w2"}, "w2": {"w2", "u2"},
                  "all_weights": set(W_NAMES)}[frozen]
    names = ("x",) + W_NAMES
    leaves = {n: t.detach().clone().requires_grad_(n not in frozen_set) for n, t in zip(names, [x] + [w[n] for n in
                                                                                                    W_NAMES])}
    out = OPS.ffn(leaves["x"], *op_args({n: leaves[n] for n in W_NAMES}, mask))
    g = torch.randn(out.shape, device=out.device).to(dtype)
    out.backward(g)
    _, ref = reference_grads(lambda a, *ws: ffn_reference(a, *op_args(dict(zip(W_NAMES, ws)), mask)),
                             [x] + [w[n] for n in W_NAMES], g, [True] * 7)
    for n, rg in zip(names, ref):
        if n in frozen_set:
            assert leaves[n].grad is None, n
        else:
            check_grad(leaves[n].grad, rg, dtype, TOL[dtype], f"grad {n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_and_leading_shape(device, layout, dtype):
    """x [b, s, H] in every memory layout (transposed / sliced with an unaligned offset / stride 2 in H), dual expert
    with a mask that is a transposed view in the transposed case; single expert too; forward and gradients."""
    b, s, H, I = 2, 19, 40, 24  # noqa: E741
    x = strided_view((b, s), H, dtype, device, layout)
    mask = make_mask("random", (b, s), device)
    if layout == "transposed":
        mask = mask.transpose(0, 1).contiguous().transpose(0, 1)
    for m in (mask, None):
        w = make_weights(H, I, dtype, device, m is not None)
        out = OPS.ffn(x, *op_args(w, m))
        check_out(out, ffn_reference(x, *op_args(w, m)), (b, s, H), dtype, device, TOL[dtype])
        run_and_check_grads(x, w, m, TOL[dtype])


@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["m0", "b2s0"])
@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
def test_empty(device, lead, dual):
    """M = 0: empty output; every weight gradient is zero (not garbage)."""
    H, I = 40, 24  # noqa: E741
    x = torch.empty(lead + (H,), device=device, dtype=torch.bfloat16)
    mask = torch.empty(lead, device=device, dtype=torch.bool) if dual else None
    w = make_weights(H, I, torch.bfloat16, device, dual)
    out = OPS.ffn(x, *op_args(w, mask))
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    poison_allocator(device, 7 * H * I * 2 + 1024)
    grads = OPS.ffn_backward(torch.empty_like(x), x, *op_args(w, mask))
    sync(device)
    assert grads[0].shape == x.shape
    names = [n for n in W_NAMES if n in w]
    assert len(grads) == 7 and all(t is None for t in grads[1 + len(names):])
    for n, gt in zip(names, grads[1:]):
        assert gt.shape == w[n].shape, n
        assert not bool(gt.any()) and bool(torch.isfinite(gt).all()), f"grad {n} must be zero for M = 0"


def test_dual_with_equal_experts_matches_single(device):
    """Dual expert with u = w (same weights) equals the single expert for every routing (the routing must not
    change anything but the weights used)."""
    M, H, I = 37, 24, 72  # noqa: E741
    x = strided_view((M,), H, torch.float32, device)
    w = make_weights(H, I, torch.float32, device, dual=False)
    single = OPS.ffn(x, w["w1"], w["w3"], w["w2"])
    for kind in MASK_KINDS:
        mask = make_mask(kind, (M,), device)
        dual = OPS.ffn(x, w["w1"], w["w3"], w["w2"], mask, w["w1"], w["w3"], w["w2"])
        torch.testing.assert_close(dual, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
def test_weight_layout_does_not_change_results(device, dual):
    """The same weight values laid out differently in memory (separate tensors, both experts of a projection in one
    [2, I, H] tensor, a row-strided view, up below gate) give the same bits, forward and backward. On the TMA path
    the paired backward kernel must serve every layout (the unpaired backward rounds gate and up to bf16), and the
    forward's unpaired fallback must compute what the paired kernel does."""
    M, H, I = 300, 128, 192  # noqa: E741
    dtype = torch.bfloat16
    x = strided_view((M,), H, dtype, device)
    mask = make_mask("random", (M,), device) if dual else None
    w = make_weights(H, I, dtype, device, dual)
    g = strided_view((M,), H, dtype, device)

    def stacked(a, b):  # views of one [2, R, C] tensor: text (b) at index 0, vision (a) at 1
        t = torch.stack([b, a])
        return t[1], t[0]

    def strided(a):  # a row-strided view of a copy
        t = torch.zeros(a.shape[0], a.shape[1] + 8, dtype=a.dtype, device=a.device)
        t[:, :a.shape[1]] = a
        return t[:, :a.shape[1]]

    layouts = {"separate": dict(w)}
    if dual:
        w1, u1 = stacked(w["w1"], w["u1"])
        layouts["gate_stacked_up_separate"] = dict(w, w1=w1, u1=u1)
        w1, u1 = stacked(w["w1"], w["u1"])
        w3, u3 = stacked(w["w3"], w["u3"])
        layouts["both_stacked"] = dict(w, w1=w1, u1=u1, w3=w3, u3=u3)
        # vision below text (views of one [2, R, C] tensor, vision at index 0: CogVLM's registration order), every
        # projection: read in place through the descriptor's expert order (w_map), no copy
        flipped = {}
        for v, t in (("w1", "u1"), ("w3", "u3"), ("w2", "u2")):
            flipped[v], flipped[t] = torch.stack([w[v], w[t]]).unbind(0)
        layouts["vision_below_text"] = dict(w, **flipped)
    layouts["gate_strided"] = dict(w, w1=strided(w["w1"]))
    # up's weights below gate's in one buffer (the paired kernels' descriptor then starts at up: up_first)
    if dual:
        buf = torch.stack([torch.stack([w["u3"], w["w3"]]), torch.stack([w["u1"], w["w1"]])])
        layouts["up_below_gate"] = dict(w, u3=buf[0, 0], w3=buf[0, 1], u1=buf[1, 0], w1=buf[1, 1])
    else:
        buf = torch.stack([w["w3"], w["w1"]])
        layouts["up_below_gate"] = dict(w, w3=buf[0], w1=buf[1])
    results = {}
    for name, lw in layouts.items():
        results[name] = (OPS.ffn(x, *op_args(lw, mask)), OPS.ffn_backward(g, x, *op_args(lw, mask)))
    base_out, base_grads = results["separate"]
    if dual:  # the text expert's weights given as the vision expert's tensors themselves, against separate copies
        tied = dict(w, u1=w["w1"], u3=w["w3"], u2=w["w2"])
        copies = dict(w, u1=w["w1"].clone(), u3=w["w3"].clone(), u2=w["w2"].clone())
        out_t, out_c = OPS.ffn(x, *op_args(tied, mask)), OPS.ffn(x, *op_args(copies, mask))
        assert torch.equal(out_t, out_c), "tied experts: forward differs from separate copies"
        for gname, a, b in zip(GRAD_NAMES, OPS.ffn_backward(g, x, *op_args(tied, mask)),
                               OPS.ffn_backward(g, x, *op_args(copies, mask))):
            assert (a is None and b is None) or torch.equal(a, b), f"tied experts: {gname} differs"
    for name, (out, grads) in results.items():
        assert torch.equal(out, base_out), f"{name}: forward differs from separate weights"
        for gname, a, b in zip(GRAD_NAMES, grads, base_grads):
            assert (a is None and b is None) or torch.equal(a, b), f"{name}: {gname} differs from separate weights"


def test_deterministic(device):
    """Same inputs, same bits (no atomics): forward and backward twice."""
    M, H, I = 300, 72, 40  # noqa: E741
    x = strided_view((M,), H, torch.bfloat16, device)
    mask = make_mask("random", (M,), device)
    w = make_weights(H, I, torch.bfloat16, device)
    g = strided_view((M,), H, torch.bfloat16, device)
    assert torch.equal(OPS.ffn(x, *op_args(w, mask)), OPS.ffn(x, *op_args(w, mask)))
    for a, b in zip(OPS.ffn_backward(g, x, *op_args(w, mask)), OPS.ffn_backward(g, x, *op_args(w, mask))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
def test_tf32(device, dual):
    """allow_tf32=True on float32 is within the TF32 tolerance (CPU may ignore the flag and be exact); without it the
    CUDA result is exact fp32 even for long reductions (H = 1024, I = 768), which TF32 would miss by ~100x."""
    M, H, I = (300, 72, 40) if torch.device(device).type == "cpu" else (384, 1024, 768)  # noqa: E741
    x = strided_view((M,), H, torch.float32, device)
    mask = make_mask("random", (M,), device) if dual else None
    w = make_weights(H, I, torch.float32, device, dual)
    ref = ffn_reference(x, *op_args(w, mask))
    check_out(OPS.ffn(x, *op_args(w, mask), allow_tf32=True), ref, (M, H), torch.float32, device, TOL_TF32)
    check_out(OPS.ffn(x, *op_args(w, mask), allow_tf32=False), ref, (M, H), torch.float32, device,
              TOL[torch.float32], "out (exact fp32)")
    g = strided_view((M,), H, torch.float32, device)
    run_and_check_grads(x, w, mask, TOL_TF32, allow_tf32=True, g=g)
    run_and_check_grads(x, w, mask, TOL[torch.float32], allow_tf32=False, g=g)


def test_float64(device):
    """float64 is computed exactly on CPU (gradcheck needs it); CUDA either refuses it or computes it correctly."""
    x = strided_view((7,), 8, torch.float64, device)
    mask = make_mask("random", (7,), device)
    w = make_weights(8, 6, torch.float64, device)
    try:
        out = OPS.ffn(x, *op_args(w, mask))
    except ERR as e:
        assert torch.device(device).type == "cuda", f"float64 must work on CPU: {e}"
        assert any(s in str(e).lower() for s in ("dtype", "double", "float64", "x")), str(e)
        return
    check_out(out, ffn_reference(x, *op_args(w, mask)), (7, 8), torch.float64, device, TOL[torch.float64])


# ----------------------------------------------------------------------------------------------------------------
# CUDA: realistic sizes, several devices, CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["single", "random", "vision90"])
def test_realistic_bf16(gpu_device, mask_kind):
    """M = 512, H = 1024, I = 2816 bf16: forward and the gradients of x and every weight."""
    M, H, I = 512, 1024, 2816  # noqa: E741
    dual = mask_kind != "single"
    x = strided_view((M,), H, torch.bfloat16, gpu_device)
    mask = make_mask(mask_kind, (M,), gpu_device) if dual else None
    w = make_weights(H, I, torch.bfloat16, gpu_device, dual)
    out, ref = run_and_check_grads(x, w, mask, TOL[torch.bfloat16])
    check_out(out, ref, (M, H), torch.bfloat16, gpu_device, TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gate_up_split_last_round(gpu_device):
    """The paired gate/up GEMM (sm_90) computes a last round that fills at most half the SMs in column halves, after
    its whole rounds (kernels/gemm_tiles.py _split_tail). Expert counts chosen for this GPU's SM count so that the tile
    count T is above the SM count and leaves 0 < 2 (T mod SMs) <= SMs, both experts with a partial last row tile,
    the tokens shuffled; I = 2816 is 22 column tiles. bf16 forward and every gradient against float64, NaN-poisoned
    allocator."""
    major, minor = torch.cuda.get_device_capability(gpu_device)
    cfg = fused_ops.kernel_config("routed_swiglu_pair_tma_kernel", "half", 1024, major * 10 + minor)
    if cfg == "off" or major != 9:
        pytest.skip("the paired gate/up GEMM runs on sm_90 only")
    bm, bn = block_of(cfg)
    H, I = 256, 2816  # noqa: E741
    sms = torch.cuda.get_device_properties(gpu_device).multi_processor_count
    col_tiles = -(-I // bn)
    row_tiles = next(r for r in range(2, 64) if r * col_tiles > sms and 0 < 2 * ((r * col_tiles) % sms) <= sms)
    c0 = (row_tiles // 2) * bm - 10  # each expert's last row tile partial
    c1 = (row_tiles - row_tiles // 2) * bm - 21
    M = c0 + c1
    assert fused_ops.kernel_config("routed_swiglu_pair_tma_kernel", "half", M, major * 10 + minor) == cfg
    check_shuffled_counts(gpu_device, c0, c1, H, I, seed=5)


def check_shuffled_counts(device, c0, c1, H, I, seed):  # noqa: E741
    """bf16 dual-expert ffn with c0 text and c1 vision tokens in a shuffled order: forward and every gradient against
    float64, NaN-poisoned allocator."""
    M = c0 + c1
    mask = torch.zeros(M, dtype=torch.bool)
    mask[c0:] = True
    mask = mask[torch.randperm(M, generator=torch.Generator().manual_seed(seed))].to(device)
    x = strided_view((M,), H, torch.bfloat16, device)
    w = make_weights(H, I, torch.bfloat16, device)
    poison_allocator(device, 8 * M * max(H, I) * 2)
    out, ref = run_and_check_grads(x, w, mask, TOL[torch.bfloat16])
    check_out(out, ref, (M, H), torch.bfloat16, device, TOL[torch.bfloat16])


@pytest.mark.gpu
def test_down_split_last_round(gpu_device):
    """The down projection (routed_linear_tma_kernel, scattered rows of the unaligned routing) computes a last partial
    round shared out as its table config says (in column slices, kernels/gemm_tiles.py _split_tail, or by K steps,
    _sk_share): at M = 1000, 2000 and 3000 tokens where the table has such a config, expert counts and H chosen for
    this GPU's SM count and that config (device_helpers.split_counts), the tokens shuffled; at least one M must have
    one. bf16 forward and every gradient against float64, NaN-poisoned allocator."""
    major, minor = torch.cuda.get_device_capability(gpu_device)
    if major != 9:
        pytest.skip("the TMA GEMMs run on sm_90 only")
    sms = torch.cuda.get_device_properties(gpu_device).multi_processor_count
    ran = []
    for M in (1000, 2000, 3000):
        split = split_counts("routed_linear_tma_kernel", M, 256, major * 10 + minor, sms, wt=False)
        if split is None:
            continue
        c0, c1, H = split
        check_shuffled_counts(gpu_device, c0, c1, H, 256, seed=7)
        ran.append(M)
    assert ran, "the sm_90 table shares out the down projection's last round at none of M = 1000, 2000, 3000"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 17, 64, 65, 128, 500, 4096, 4097])
@pytest.mark.parametrize("experts", ["dual", "single"])
def test_routing_sizes(gpu_device, M, experts):
    """Token counts on both sides of the routing and config sizes: up to 64 rows the dual gate/up gathers x inside and
    routes the mask in its own programs (sm_90 table), above that x is gathered first: up to 4096 rows by a gather
    that routes the mask itself (route_gather_rows_kernel), above by the gather after the two routing kernels. The
    single expert's forward has no routing on sm_90, and its backward reads x and dy in place when M is a multiple
    of 128 (128, 4096) and gathers them otherwise. 500 rows: the 64-row gate/up tiles of the sm_90 table's narrow
    intermediate class (I = 96 <= 4096) at 385-512 rows. bf16, a fresh random mask, NaN-poisoned allocator, forward
    and every gradient."""
    H, I = 128, 96  # noqa: E741
    dual = experts == "dual"
    x = strided_view((M,), H, torch.bfloat16, gpu_device)
    mask = make_mask("random", (M,), gpu_device) if dual else None
    w = make_weights(H, I, torch.bfloat16, gpu_device, dual=dual)
    poison_allocator(gpu_device, 8 * M * max(H, I) * 2)
    out, ref = run_and_check_grads(x, w, mask, TOL[torch.bfloat16])
    check_out(out, ref, (M, H), torch.bfloat16, gpu_device, TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=DT_ID.get)
def test_realistic_leading_shape(gpu_device, dtype):
    """[b, s] = [3, 333] tokens (M = 999), H = 1001, I = 1398 (rows not a multiple of 16 bytes: pointer kernels),
    one vision span."""
    b, s, H, I = 3, 333, 1001, 1398  # noqa: E741
    x = strided_view((b, s), H, dtype, gpu_device, "transposed")
    mask = make_mask("span", (b, s), gpu_device)
    w = make_weights(H, I, dtype, gpu_device)
    out, ref = run_and_check_grads(x, w, mask, TOL[dtype])
    check_out(out, ref, (b, s, H), dtype, gpu_device, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=DT_ID.get)
@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
def test_pointer_kernels_forced(gpu_device, dual, dtype, monkeypatch):
    """FUSED_GEMM_TMA=0 (docs/design.md) makes the op use the pointer kernels even where the TMA ones apply (aligned
    sizes on an H100): forward and all gradients still match. (Exercises that path if the op reads the variable per
    call; otherwise it repeats the default path, still a valid check.)"""
    monkeypatch.setenv("FUSED_GEMM_TMA", "0")
    M, H, I = 600, 512, 768  # noqa: E741
    x = strided_view((M,), H, dtype, gpu_device)
    mask = make_mask("random", (M,), gpu_device) if dual else None
    w = make_weights(H, I, dtype, gpu_device, dual)
    out, ref = run_and_check_grads(x, w, mask, TOL[dtype])
    check_out(out, ref, (M, H), dtype, gpu_device, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 1000])
@pytest.mark.parametrize("layout", ["separate", "text_first", "vision_first"])
def test_weights_read_in_place(gpu_device, M, layout):
    """No copy of the experts' weights inside the forward, whichever expert lies lower in memory or whether they are
    separate tensors (the descriptors take the experts' order), nor inside the backward for views of one [2, R, C]
    tensor per projection in either order: no copy / stack op in a profile, and the forward's peak extra memory far
    below one projection's weights. (Separate gate / up tensors at different distances are copied by the backward's
    paired recompute: docs/design.md.)"""
    if torch.cuda.get_device_capability(gpu_device) != (9, 0):
        pytest.skip("the TMA path (sm_90) reads stacked weights; the pointer kernels take base pointers anyway")
    H, I = 1024, 2816  # noqa: E741
    dtype = torch.bfloat16
    x = torch.randn(M, H, device=gpu_device, dtype=dtype)
    g = torch.randn(M, H, device=gpu_device, dtype=dtype)
    mask = make_mask("random", (M,), gpu_device)
    w = make_weights(H, I, dtype, gpu_device, True)
    if layout != "separate":
        for v, t in (("w1", "u1"), ("w3", "u3"), ("w2", "u2")):
            if layout == "text_first":
                w[t], w[v] = torch.stack([w[t], w[v]]).unbind(0)
            else:
                w[v], w[t] = torch.stack([w[v], w[t]]).unbind(0)
    OPS.ffn(x, *op_args(w, mask))  # warm
    sync(gpu_device)
    torch.cuda.reset_peak_memory_stats(gpu_device)
    base = requested_bytes(gpu_device)
    out = OPS.ffn(x, *op_args(w, mask))
    sync(gpu_device)
    extra = requested_bytes(gpu_device, "peak") - base - out.untyped_storage().nbytes()
    # h [M, I] and the routing, and far less than a copy of any projection's two experts (2 I H elements)
    assert extra < M * I * 2 + I * H, f"{layout}: peak extra {extra} B (h is {M * I * 2} B): the weights were copied?"
    copy_ops = ("aten::stack", "aten::copy_", "aten::clone", "aten::cat")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        OPS.ffn(x, *op_args(w, mask))
        if layout != "separate":
            OPS.ffn_backward(g, x, *op_args(w, mask))
    copies = [e.name for e in prof.events() if e.name in copy_ops]
    assert not copies, f"{layout}: the op copied its weights ({copies})"
    check_out(out, ffn_reference(x, *op_args(w, mask)), (M, H), dtype, gpu_device, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["single", "random", "vision90", "all_true"])
def test_forward_peak_memory(gpu_device, mask_kind):
    """The forward's peak extra memory (docs/design.md): on the TMA path (sm_90) one [M, I] intermediate plus, for the
    dual expert, the routing's perm / seg, whether x's rows are gathered (into the output's storage) or not; the
    single expert allocates h and nothing else (no routing). M = 1000
    (not a multiple of the 128-row tiles, so row tiles straddle the experts of an unaligned routing); the output is
    checked too."""
    if torch.cuda.get_device_capability(gpu_device) != (9, 0):
        pytest.skip("the bound holds on the TMA path (sm_90); the pointer kernels keep h padded per expert")
    M, H, I = 1000, 512, 1536  # noqa: E741
    dtype = torch.bfloat16
    dual = mask_kind != "single"
    x = strided_view((M,), H, dtype, gpu_device)
    mask = make_mask(mask_kind, (M,), gpu_device) if dual else None
    w = make_weights(H, I, dtype, gpu_device, dual)
    if dual:  # each projection's experts as views of one [2, R, C] tensor, text first: the zero-copy layout of
        # DualExpertSwiGLU (separate tensors are stacked per call: 2 R C more elements per projection)
        for t, v in (("u1", "w1"), ("u3", "w3"), ("u2", "w2")):
            w[t], w[v] = torch.stack([w[t], w[v]]).unbind(0)
    OPS.ffn(x, *op_args(w, mask))  # warm: the library's one-time allocations happen before the measurement
    poison_allocator(gpu_device, 4 * M * I)
    sync(gpu_device)
    torch.cuda.reset_peak_memory_stats(gpu_device)
    base = requested_bytes(gpu_device)
    with torch.no_grad():
        out = OPS.ffn(x, *op_args(w, mask))
    sync(gpu_device)
    extra = requested_bytes(gpu_device, "peak") - base - out.untyped_storage().nbytes()

    def block(n):  # the caching allocator's granularity
        return -(-n // 512) * 512
    bound = block(M * I * 2) + (block(4 * (M + 128)) + block(4 * 5) if dual else 0)
    assert extra <= bound, f"peak extra {extra} B > {bound} B (h [M, I] = {M * I * 2} B, + perm / seg if dual)"
    check_out(out, ffn_reference(x, *op_args(w, mask)), (M, H), dtype, gpu_device, TOL[dtype])


@pytest.mark.gpu
def test_all_devices_agree():
    """The same inputs on every visible device give the same result (and each matches the reference)."""
    if torch.cuda.device_count() < 1:
        pytest.skip("no CUDA device")
    M, H, I = 700, 520, 1032  # noqa: E741
    x = strided_view((M,), H, torch.bfloat16, "cpu")
    mask = make_mask("random", (M,), "cpu")
    w = make_weights(H, I, torch.bfloat16, "cpu")
    ref = ffn_reference(x, *op_args(w, mask))
    outs = []
    for i in range(torch.cuda.device_count()):
        d = f"cuda:{i}"
        wd = {k: v.to(d) for k, v in w.items()}
        out = OPS.ffn(x.to(d), *op_args(wd, mask.to(d)))
        check_out(out, ref.to(d), (M, H), torch.bfloat16, d, TOL[torch.bfloat16], f"out on {d}")
        outs.append(out.cpu())
    for i, o in enumerate(outs[1:], 1):
        assert rel_err(o, outs[0].double()) <= TOL[torch.bfloat16] / 4, f"cuda:{i} disagrees with cuda:0"


@pytest.mark.gpu
@pytest.mark.parametrize("dual", [False, True], ids=["single", "dual"])
def test_cuda_graph(gpu_device, dual):
    """Capture the forward once (its grid and workspace depend only on shapes), then copy new x and a new mask into
    the static inputs and replay; each replay matches the reference."""
    torch.cuda.set_device(gpu_device)
    M, H, I = 555, 264, 520  # noqa: E741
    dtype = torch.bfloat16
    x = strided_view((M,), H, dtype, gpu_device)
    mask = make_mask("random", (M,), gpu_device) if dual else None
    w = make_weights(H, I, dtype, gpu_device, dual)
    stream = torch.cuda.Stream(gpu_device)
    stream.wait_stream(torch.cuda.current_stream(gpu_device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            OPS.ffn(x, *op_args(w, mask))
    torch.cuda.current_stream(gpu_device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # Capture on a stream of this device: torch.cuda.graph's default capture stream is created once per process, on
    # the device current at its first use (cuda:0), and the op launches on its tensors' device's current stream.
    with torch.cuda.graph(graph, stream=stream):
        out = OPS.ffn(x, *op_args(w, mask))
    for kind in ("all_true", "span", "all_false", "random"):
        x.copy_(strided_view((M,), H, dtype, gpu_device))
        if dual:
            mask.copy_(make_mask(kind, (M,), gpu_device))
        graph.replay()
        torch.cuda.synchronize(gpu_device)
        check_out(out, ffn_reference(x, *op_args(w, mask)), (M, H), dtype, gpu_device, TOL[dtype],
                  f"replay ({kind})")


# ----------------------------------------------------------------------------------------------------------------
# argument validation


def test_errors_structural(device):
    """Every device must raise, naming the offending argument."""
    M, H, I = 6, 8, 5  # noqa: E741
    x = strided_view((M,), H, torch.float32, device)
    mask = make_mask("random", (M,), device)
    w = make_weights(H, I, torch.float32, device)
    w1, w3, w2, u1, u3, u2 = (w[n] for n in W_NAMES)
    g = strided_view((M,), H, torch.float32, device)
    some_u = r"(?i)\bu[123]\b|expert|together"
    cases = [
        # routing arguments
        (r"(?i)mask|\bu[123]\b|expert|single", lambda: OPS.ffn(x, w1, w3, w2, mask)),  # mask for the single expert
        ("mask", lambda: OPS.ffn(x, w1, w3, w2, None, u1, u3, u2)),  # dual expert without mask
        (some_u, lambda: OPS.ffn(x, w1, w3, w2, mask, u1, None, None)),
        (some_u, lambda: OPS.ffn(x, w1, w3, w2, mask, u1, u3, None)),
        (some_u, lambda: OPS.ffn(x, w1, w3, w2, mask, None, u3, u2)),
        (r"(?i)mask|\bu[123]\b|expert", lambda: OPS.ffn(x, w1, w3, w2, None, None, None, u2)),
        (r"(?i)mask|bool", lambda: OPS.ffn(x, w1, w3, w2, mask.to(torch.uint8), u1, u3, u2)),
        (r"(?i)mask|bool", lambda: OPS.ffn(x, w1, w3, w2, mask.to(torch.int64), u1, u3, u2)),
        ("mask", lambda: OPS.ffn(x, w1, w3, w2, mask[:-1], u1, u3, u2)),
        ("mask", lambda: OPS.ffn(x, w1, w3, w2, mask.reshape(2, 3), u1, u3, u2)),
        # weight shapes
        (r"(?i)\bw[13]\b|weight|shape", lambda: OPS.ffn(x, w1, w3[:-1], w2)),  # w1 / w3 disagree on I
        (r"(?i)\bw[13]\b|weight|shape|\bH\b|hidden", lambda: OPS.ffn(x, w1[:, :-1], w3[:, :-1], w2)),  # H != x's
        (r"(?i)\bw2\b|weight|shape", lambda: OPS.ffn(x, w1, w3, w2[:, :-1])),  # w2 [H, I-1]
        (r"(?i)\bw2\b|weight|shape", lambda: OPS.ffn(x, w1, w3, w2[:-1])),  # w2 [H-1, I]
        (r"(?i)\bw[132]\b|weight|shape", lambda: OPS.ffn(x, w1.reshape(-1), w3, w2)),  # 1-D
        (r"(?i)\bu1\b|weight|shape", lambda: OPS.ffn(x, w1, w3, w2, mask, u1[:-1], u3, u2)),
        (r"(?i)\bu2\b|weight|shape", lambda: OPS.ffn(x, w1, w3, w2, mask, u1, u3, u2[:, :-1])),
        (r"(?i)\bu3\b|weight|shape", lambda: OPS.ffn(x, w1, w3, w2, mask, u1, u3[:, :-1], u2)),
        # dtypes
        (r"(?i)dtype|type", lambda: OPS.ffn(x.half(), w1, w3, w2)),
        (r"(?i)dtype|type", lambda: OPS.ffn(x, w1, w3, w2.bfloat16())),
        (r"(?i)dtype|type", lambda: OPS.ffn(x, w1, w3, w2, mask, u1.half(), u3, u2)),
        (r"(?i)dtype|type|\bx\b", lambda: OPS.ffn(x.long(), w1.long(), w3.long(), w2.long())),
        (r"(?i)\bx\b|dim", lambda: OPS.ffn(x[0, 0], w1, w3, w2)),  # 0-d x
        # backward
        (r"(?i)grad", lambda: OPS.ffn_backward(g[:, :-1], x, w1, w3, w2)),
        (r"(?i)grad", lambda: OPS.ffn_backward(g[:-1], x, w1, w3, w2, mask, u1, u3, u2)),
        ("mask", lambda: OPS.ffn_backward(g, x, w1, w3, w2, None, u1, u3, u2)),
        (some_u, lambda: OPS.ffn_backward(g, x, w1, w3, w2, mask, u1, None, u2)),
        # stacked weights [2, ...]: need the mask, exclude the u's, two experts exactly, w2 stacked too
        ("mask", lambda: OPS.ffn(x, torch.stack([u1, w1]), torch.stack([u3, w3]), torch.stack([u2, w2]))),
        (r"\bu1\b|\bu[123]\b", lambda: OPS.ffn(x, torch.stack([u1, w1]), torch.stack([u3, w3]), torch.stack([u2, w2]),
                                              mask, u1, u3, u2)),
        (r"w1|\[2, I, H\]", lambda: OPS.ffn(x, torch.stack([u1, w1, w1]), torch.stack([u3, w3, w3]),
                                           torch.stack([u2, w2, w2]), mask)),
        (r"w2", lambda: OPS.ffn(x, torch.stack([u1, w1]), torch.stack([u3, w3]), w2, mask)),
        ("gate_up", lambda: OPS.ffn_backward(g, x, w1, w3, w2, gate_up=torch.zeros_like(x))),  # [M, H], not [M, 2I]
        ("gate_up", lambda: OPS.ffn_backward(g, x, w1, w3, w2, gate_up=torch.zeros(M, 2 * I, device=device,
                                                                                    dtype=torch.float16))),
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
    M, H, I = 6, 8, 5  # noqa: E741
    x = strided_view((M,), H, torch.float32, gpu_device)
    mask = make_mask("random", (M,), gpu_device)
    w = make_weights(H, I, torch.float32, gpu_device)
    w1, w3, w2, u1, u3, u2 = (w[n] for n in W_NAMES)
    cases = [
        (r"(?i)\bw1\b|device|weight", lambda: OPS.ffn(x, w1.cpu(), w3, w2)),
        (r"(?i)\bw2\b|device|weight", lambda: OPS.ffn(x, w1, w3, w2.cpu())),
        (r"(?i)\bu3\b|device|weight", lambda: OPS.ffn(x, w1, w3, w2, mask, u1, u3.cpu(), u2)),
        (r"(?i)mask|device", lambda: OPS.ffn(x, w1, w3, w2, mask.cpu(), u1, u3, u2)),
        (r"(?i)\bx\b|device|weight", lambda: OPS.ffn(x.cpu(), w1, w3, w2)),
    ]
    if torch.cuda.device_count() > 1:
        other = f"cuda:{(torch.device(gpu_device).index + 1) % torch.cuda.device_count()}"
        cases.append((r"(?i)\bu2\b|device|weight", lambda: OPS.ffn(x, w1, w3, w2, mask, u1, u3, u2.to(other))))
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


@pytest.mark.parametrize("mask_kind", ["single", "random", "all_true", "span"])
def test_gradcheck_cpu(mask_kind):
    M, H, I = 5, 4, 3  # noqa: E741
    dual = mask_kind != "single"
    x = torch.randn(M, H, dtype=torch.float64, requires_grad=True)
    mask = make_mask(mask_kind, (M,)) if dual else None
    w = {k: v.requires_grad_(True) for k, v in make_weights(H, I, torch.float64, "cpu", dual).items()}
    names = [n for n in W_NAMES if n in w]
    fn = lambda a, *ws: OPS.ffn(a, *op_args(dict(zip(names, ws)), mask))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, *[w[n] for n in names]))


def test_gradcheck_cpu_leading_shape():
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = make_mask("random", (2, 3))
    w = {k: v.requires_grad_(True) for k, v in make_weights(4, 3, torch.float64, "cpu").items()}
    fn = lambda a, *ws: OPS.ffn(a, *op_args(dict(zip(W_NAMES, ws)), mask))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, *[w[n] for n in W_NAMES]))


OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
#: the ops of this file; a test in test_rope_ops.py may collect these names for its every-op-is-opchecked check
OPCHECKED = ["ffn", "ffn_forward", "ffn_backward"]


def _opcheck_samples(op_name):
    M, H, I = 6, 5, 3  # noqa: E741
    mask = make_mask("random", (M,))
    mk = lambda *s, rg=False: torch.randn(*s, requires_grad=rg)  # noqa: E731
    ws = lambda rg=False: (mk(I, H, rg=rg), mk(I, H, rg=rg), mk(H, I, rg=rg))  # noqa: E731
    if op_name == "ffn":
        return [
            ((mk(M, H), *ws()), {}),
            ((mk(M, H, rg=True), *ws(True)), {}),
            ((mk(2, 3, H, rg=True), *ws(True), mask.reshape(2, 3), *ws(True)), {}),
            ((mk(M, H), *ws(True)), dict(mask=mask, u1=mk(I, H), u3=mk(I, H), u2=mk(H, I, rg=True))),
            ((mk(M, H, rg=True), *ws(True)), dict(recompute=True)),
            ((mk(M, H, rg=True), mk(2, I, H, rg=True), mk(2, I, H, rg=True), mk(2, H, I, rg=True), mask), {}),
            ((mk(M, H, rg=True), *ws(True)), dict(residual=mk(M, H, rg=True))),
            ((mk(2, 3, H), *ws(), mask.reshape(2, 3), *ws()), dict(residual=mk(2, 3, H, rg=True))),
        ]
    if op_name == "ffn_forward":
        return [((mk(M, H), *ws()), {}), ((mk(2, 3, H), *ws(), mask.reshape(2, 3), *ws()), {}),
                ((mk(M, H), *ws()), dict(residual=mk(M, H)))]
    return [((mk(M, H), mk(M, H), mk(2, I, H), mk(2, I, H), mk(2, H, I), mask), dict(gate_up=mk(M, 2 * I))),
            ((mk(M, H), mk(M, H), *ws()), dict(gate_up=mk(M, 2 * I))),
            ((mk(2, 3, H), mk(2, 3, H), *ws(), mask.reshape(2, 3), *ws()), dict(gate_up=mk(2, 3, 2 * I))),
            ((mk(M, H), mk(M, H), *ws()), {}),
            ((mk(2, 3, H), mk(2, 3, H), *ws(), mask.reshape(2, 3), *ws()), dict(allow_tf32=True)),
            ((mk(M, H), mk(M, H), *ws(), mask, *ws()), dict(output_mask=[True, True, True, True, False, False, False])),
            ((mk(M, H), mk(M, H), *ws()), dict(output_mask=[False, False, True, False, True, True, True]))]


@pytest.mark.parametrize("op_name", OPCHECKED)
def test_opcheck(op_name):
    op = getattr(OPS, op_name).default
    for args, kwargs in _opcheck_samples(op_name):
        torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)


def test_torch_compile_modules_fullgraph_cpu():
    """FusedSwiGLU and DualExpertSwiGLU forward (and gradients through them) under torch.compile(fullgraph=True,
    backend="aot_eager")."""
    torch._dynamo.reset()
    single, dual = FusedSwiGLU(12, 20), DualExpertSwiGLU(12, 20)
    cs = torch.compile(single, fullgraph=True, backend="aot_eager")
    cd = torch.compile(dual, fullgraph=True, backend="aot_eager")
    for lead in ((9,), (2, 5)):  # a second shape: recompiles or runs dynamic, must not break the graph
        x = torch.randn(lead + (12,), requires_grad=True)
        mask = make_mask("random", lead)
        for mod, cmod, args in ((single, cs, (x,)), (dual, cd, (x, mask))):
            params = [x] + list(mod.parameters())
            want = mod(*args)
            gw = torch.autograd.grad(want.square().sum(), params)
            got = cmod(*args)
            gg = torch.autograd.grad(got.square().sum(), params)
            torch.testing.assert_close(got, want)
            for a, b in zip(gg, gw):
                torch.testing.assert_close(a, b)


def test_meta_device():
    for lead in ((7,), (2, 9), (0,)):
        x = torch.empty(lead + (40,), device="meta", dtype=torch.bfloat16)
        mask = torch.empty(lead, device="meta", dtype=torch.bool)
        w13 = torch.empty(24, 40, device="meta", dtype=torch.bfloat16)
        w2 = torch.empty(40, 24, device="meta", dtype=torch.bfloat16)
        for m, us in ((None, (None, None, None)), (mask, (w13, w13, w2))):
            out = OPS.ffn(x, w13, w13, w2, m, *us)
            assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == x.shape
            grads = OPS.ffn_backward(x, x, w13, w13, w2, m, *us)
            assert len(grads) == 7 and grads[0].shape == x.shape
            assert [tuple(t.shape) for t in grads[1:4]] == [(24, 40), (24, 40), (40, 24)]
            if m is None:
                assert grads[4:] == (None, None, None)
            else:
                assert [tuple(t.shape) for t in grads[4:]] == [(24, 40), (24, 40), (40, 24)]
            some = OPS.ffn_backward(x, x, w13, w13, w2, m, *us, output_mask=[False, True] + [False] * 5)
            assert some[1].shape == (24, 40) and some[0] is None and all(t is None for t in some[2:])


# ----------------------------------------------------------------------------------------------------------------
# Python API: ffn, FusedSwiGLU, DualExpertSwiGLU


def test_functional_wrapper(device):
    M, H, I = 37, 24, 72  # noqa: E741
    x = strided_view((M,), H, torch.bfloat16, device).requires_grad_(True)
    mask = make_mask("span", (M,), device)
    w = make_weights(H, I, torch.bfloat16, device)
    out = ffn(x, w["w1"], w["w3"], w["w2"], mask=mask, u1=w["u1"], u3=w["u3"], u2=w["u2"])
    assert torch.equal(out, OPS.ffn(x, *op_args(w, mask)))
    assert out.requires_grad and out.grad_fn is not None
    single = ffn(x, w["w1"], w["w3"], w["w2"])
    check_out(single.detach(), ffn_reference(x, w["w1"], w["w3"], w["w2"]), (M, H), torch.bfloat16, device,
              TOL[torch.bfloat16])
    (out.float().sum() + single.float().sum()).backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_fused_swiglu_module(device):
    H, I = 40, 72  # noqa: E741
    mod = FusedSwiGLU(H, I, device=device, dtype=torch.bfloat16)
    assert {n: tuple(p.shape) for n, p in mod.named_parameters()} == {"w1": (I, H), "w3": (I, H), "w2": (H, I)}
    bf16_up = 1 + 2 ** -7  # nn.Linear's init range, up to bf16 rounding
    assert float(mod.w1.detach().abs().max()) <= bf16_up / math.sqrt(H)
    assert float(mod.w2.detach().abs().max()) <= bf16_up / math.sqrt(I)
    x = strided_view((3, 11), H, torch.bfloat16, device)
    out = mod(x)
    check_out(out.detach(), ffn_reference(x, mod.w1, mod.w3, mod.w2), (3, 11, H), torch.bfloat16, device,
              TOL[torch.bfloat16])
    assert "hidden_size=40" in repr(mod) and "intermediate_size=72" in repr(mod)


def test_dual_expert_swiglu_layout_and_grads(device):
    """Stacked [2, I, H] / [2, H, I] parameters (0 = text, 1 = vision); the module equals ffn with the vision views
    as w* and the text views as u*; gradients land in the stacked parameters, the vision half exactly zero for an
    all-text batch."""
    H, I, M = 24, 40, 37  # noqa: E741
    mod = DualExpertSwiGLU(H, I, device=device, dtype=torch.float32)
    assert {n: tuple(p.shape) for n, p in mod.named_parameters()} == {"w1": (2, I, H), "w3": (2, I, H),
                                                                      "w2": (2, H, I)}
    es = mod.w1.element_size()
    v1, v3, v2 = mod.vision_weights
    t1, t3, t2 = mod.text_weights
    assert t1.data_ptr() == mod.w1.data_ptr() and v1.data_ptr() == mod.w1.data_ptr() + I * H * es
    assert v2.data_ptr() == mod.w2.data_ptr() + H * I * es and v3.shape == t3.shape == (I, H)
    for kind in ("random", "all_false"):
        mod.zero_grad(set_to_none=True)
        x = strided_view((M,), H, torch.float32, device)
        mask = make_mask(kind, (M,), device)
        g = strided_view((M,), H, torch.float32, device)
        out = mod(x, mask)
        wv, wt = mod.vision_weights, mod.text_weights
        ref_out, ref = reference_grads(lambda *ws: ffn_reference(x, ws[0], ws[1], ws[2], mask, *ws[3:]),
                                       [*wv, *wt], g, [True] * 6)
        check_out(out.detach(), ref_out, (M, H), torch.float32, device, TOL[torch.float32])
        out.backward(g)
        tol = TOL[torch.float32]
        for i, p in enumerate((mod.w1, mod.w3, mod.w2)):
            check_grad(p.grad[1], ref[i], torch.float32, tol, f"{p.shape} grad[1] vision ({kind})")
            check_grad(p.grad[0], ref[3 + i], torch.float32, tol, f"{p.shape} grad[0] text ({kind})")


def test_from_llama_mlp_handwritten(device):
    """FusedSwiGLU.from_llama_mlp on a LlamaMLP-equivalent module (always runs): same output and gradients."""
    H, I = 40, 72  # noqa: E741
    mlp = LlamaMLPLike(H, I, device=device, dtype=torch.float32)
    fused = FusedSwiGLU.from_llama_mlp(mlp)
    assert torch.equal(fused.w1, mlp.gate_proj.weight) and torch.equal(fused.w3, mlp.up_proj.weight)
    assert torch.equal(fused.w2, mlp.down_proj.weight) and fused.w1.data_ptr() != mlp.gate_proj.weight.data_ptr()
    x = strided_view((2, 13), H, torch.float32, device)
    want, got = mlp(x), fused(x)
    check_out(got.detach(), want.detach().double(), (2, 13, H), torch.float32, device, 2e-5)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    for a, b, n in ((fused.w1, mlp.gate_proj, "gate"), (fused.w3, mlp.up_proj, "up"),
                    (fused.w2, mlp.down_proj, "down")):
        assert rel_err(a.grad, b.weight.grad.double()) <= 2e-5, n


def test_from_llama_mlp_rejects(device):
    H, I = 8, 12  # noqa: E741
    with pytest.raises(ValueError, match=r"(?i)silu|act"):
        FusedSwiGLU.from_llama_mlp(LlamaMLPLike(H, I, act=nn.GELU(), device=device))
    with pytest.raises(ValueError, match=r"(?i)bias"):
        FusedSwiGLU.from_llama_mlp(LlamaMLPLike(H, I, bias=True, device=device))
    with pytest.raises(ValueError, match=r"(?i)gate_proj|nn.Linear"):
        FusedSwiGLU.from_llama_mlp(nn.Linear(H, I))
    # plain-function SiLU activations are accepted too
    FusedSwiGLU.from_llama_mlp(LlamaMLPLike(H, I, act=F.silu, device=device))
    FusedSwiGLU.from_llama_mlp(LlamaMLPLike(H, I, act=lambda t: t * torch.sigmoid(t), device=device))


def test_dual_expert_from_modules(device):
    """from_modules(vision_mlp, text_mlp): each token's output equals its own MLP's; FusedSwiGLU experts work too."""
    H, I, M = 24, 40, 300  # noqa: E741
    vis = LlamaMLPLike(H, I, device=device)
    txt = LlamaMLPLike(H, I, device=device)
    mod = DualExpertSwiGLU.from_modules(vis, txt)
    x = strided_view((M,), H, torch.float32, device)
    mask = make_mask("vision90", (M,), device)
    with torch.no_grad():
        want = torch.where(mask[:, None], vis(x), txt(x))
        got = mod(x, mask)
    check_out(got, want.double(), (M, H), torch.float32, device, 2e-5)
    mod2 = DualExpertSwiGLU.from_modules(FusedSwiGLU.from_llama_mlp(vis), FusedSwiGLU.from_llama_mlp(txt))
    for p, q in zip(mod.parameters(), mod2.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match=r"(?i)differ|shape"):
        DualExpertSwiGLU.from_modules(vis, LlamaMLPLike(H, I + 1, device=device))


def test_modules_do_not_import_transformers():
    """from_llama_mlp duck-types its argument: importing the package and these modules never imports transformers."""
    code = ("import sys, fused_ops, fused_ops.ffn, fused_ops.linear_dual, fused_ops.routed; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(fused_ops.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pkg_parent, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------------------
# interop with HF transformers (skipped when transformers is not installed)


def _hf_llama_mlp(hidden, inter, device, dtype):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu",
                                   num_attention_heads=1, num_key_value_heads=1)  # heads must divide hidden
    if hasattr(cfg, "mlp_bias"):
        cfg.mlp_bias = False
    return LlamaMLP(cfg).to(device=device, dtype=dtype)


def test_hf_llama_mlp(device):
    """FusedSwiGLU.from_llama_mlp(transformers' LlamaMLP): same outputs and weight gradients as the HF module.
    CPU: hidden 40 / intermediate 72 in fp32; CUDA: hidden 1024 / intermediate 11008 in bf16."""
    on_gpu = torch.device(device).type == "cuda"
    H, I, dtype = (1024, 11008, torch.bfloat16) if on_gpu else (40, 72, torch.float32)  # noqa: E741
    torch.manual_seed(0)
    mlp = _hf_llama_mlp(H, I, device, dtype)
    fused = FusedSwiGLU.from_llama_mlp(mlp)
    assert fused.w1.dtype == dtype and fused.w1.device == torch.device(device)
    x = strided_view((2, 128 if on_gpu else 9), H, dtype, device)
    g = strided_view(x.shape[:-1], H, dtype, device)
    got, want = fused(x), mlp(x)
    ref = ffn_reference(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    check_out(got.detach(), ref, x.shape, dtype, device, TOL[dtype], "fused vs float64")
    # HF's own (eager, unfused) result has about the same error: the two agree within twice the tolerance
    assert rel_err(got, want.double()) <= 2 * TOL[dtype]
    got.backward(g)
    want.backward(g)
    for a, lin in ((fused.w1, mlp.gate_proj), (fused.w3, mlp.up_proj), (fused.w2, mlp.down_proj)):
        assert rel_err(a.grad, lin.weight.grad.double()) <= 2 * TOL[dtype]


def test_hf_llama_mlp_rejects_gelu():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP
    mlp = LlamaMLP(transformers.LlamaConfig(hidden_size=16, intermediate_size=24, hidden_act="gelu",
                                            num_attention_heads=1, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"(?i)silu|act"):
        FusedSwiGLU.from_llama_mlp(mlp)
