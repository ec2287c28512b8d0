"""Independent float64 references for the routed GEMM ops `fused::linear_dual` and `fused::ffn` (docs/design.md).

Written straight from the design document, not from any kernel:

- linear_dual: `out[i] = x[i]·weight_vᵀ + bias_v` if `mask[i]` else `x[i]·weight_tᵀ + bias_t`;
- ffn, single expert: `out = (silu(x·w1ᵀ) ⊙ (x·w3ᵀ))·w2ᵀ`;
- ffn, dual expert: token i through (w1, w3, w2) if `mask[i]` (vision) else through (u1, u3, u2) (text).

Each token goes through ONLY its own expert (rows are gathered per expert, computed, and put back), so a non-finite
value produced by the other expert can never leak in, and an expert with no tokens contributes nothing (its weight
gradients are exactly zero).

Everything is computed in float64 on the input's device (GPU tests use realistic sizes); results are float64 and
contiguous. The functions are differentiable: call them on float64 leaf tensors to get reference gradients
(`reference_grads`). They raise ValueError on inconsistent arguments, so a wrong test setup fails loudly.
"""
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = ["linear_dual_reference", "ffn_reference", "reference_grads", "rel_err", "check_out", "check_grad",
           "expert_rows", "make_mask", "MASK_KINDS", "strided_view"]

#: token routings the tests cover (see make_mask)
MASK_KINDS = ("random", "all_true", "all_false", "span", "vision90")


def expert_rows(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(vision_rows, text_rows): int64 indices into the flattened tokens where mask is true / false."""
    m = mask.reshape(-1)
    return m.nonzero().reshape(-1), (~m).nonzero().reshape(-1)


def _route(x2: torch.Tensor, mask: torch.Tensor, n_out: int, experts) -> torch.Tensor:
    """x2: float64 [M, K]; experts: (fn_vision, fn_text), each [m, K] -> [m, n_out]. Returns float64 [M, n_out]."""
    iv, it = expert_rows(mask.to(x2.device))
    out = x2.new_zeros(x2.shape[0], n_out)
    for rows, fn in zip((iv, it), experts):
        if rows.numel():
            out = out.index_copy(0, rows, fn(x2.index_select(0, rows)))
    return out


def _check_mask(mask: torch.Tensor, lead: torch.Size, what: str) -> None:
    if mask.dtype != torch.bool:
        raise ValueError(f"{what}: mask must be bool, got {mask.dtype}")
    if tuple(mask.shape) != tuple(lead):
        raise ValueError(f"{what}: mask shape {tuple(mask.shape)} != x's leading shape {tuple(lead)}")


def linear_dual_reference(x: torch.Tensor, mask: torch.Tensor, weight_v: torch.Tensor, weight_t: torch.Tensor,
                          bias_v: Optional[torch.Tensor] = None, bias_t: Optional[torch.Tensor] = None
                          ) -> torch.Tensor:
    """Float64 `[..., N]`: the vision expert where mask, the text expert elsewhere.
    x `[..., K]`, weights `[N, K]`, biases `[N]`."""
    if x.dim() < 1:
        raise ValueError("linear_dual_reference: x must have at least one dimension")
    K = x.shape[-1]
    _check_mask(mask, x.shape[:-1], "linear_dual_reference")
    if weight_v.dim() != 2 or weight_v.shape != weight_t.shape or weight_v.shape[1] != K:
        raise ValueError(f"linear_dual_reference: weights {tuple(weight_v.shape)} / {tuple(weight_t.shape)} must "
                         f"both be [N, {K}]")
    N = weight_v.shape[0]
    for b in (bias_v, bias_t):
        if b is not None and tuple(b.shape) != (N,):
            raise ValueError(f"linear_dual_reference: bias shape {tuple(b.shape)} != [{N}]")
    d = lambda t: None if t is None else t.to(torch.float64)  # noqa: E731
    wv, wt, bv, bt = d(weight_v), d(weight_t), d(bias_v), d(bias_t)
    x2 = x.to(torch.float64).reshape(-1, K)
    out = _route(x2, mask, N, (lambda a: F.linear(a, wv, bv), lambda a: F.linear(a, wt, bt)))
    return out.reshape(*x.shape[:-1], N)


def _swiglu64(a: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(a, w1)) * F.linear(a, w3), w2)


def ffn_reference(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                  mask: Optional[torch.Tensor] = None, u1: Optional[torch.Tensor] = None,
                  u3: Optional[torch.Tensor] = None, u2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Float64 `[..., H]` SwiGLU MLP; dual expert (vision w*, text u*) when mask and u1, u3, u2 are all given."""
    if x.dim() < 1:
        raise ValueError("ffn_reference: x must have at least one dimension")
    H = x.shape[-1]
    I = w1.shape[0]  # noqa: E741
    if tuple(w1.shape) != (I, H) or tuple(w3.shape) != (I, H) or tuple(w2.shape) != (H, I):
        raise ValueError(f"ffn_reference: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} "
                         f"are not [I, {H}], [I, {H}], [{H}, I]")
    us = (u1, u3, u2)
    dual = mask is not None
    if dual != all(u is not None for u in us) or (not dual and any(u is not None for u in us)):
        raise ValueError("ffn_reference: give mask together with all of u1, u3, u2, or none of them")
    x2 = x.to(torch.float64).reshape(-1, H)
    w = [t.to(torch.float64) for t in (w1, w3, w2)]
    if not dual:
        out = _swiglu64(x2, *w)
    else:
        _check_mask(mask, x.shape[:-1], "ffn_reference")
        for a, b in zip((w1, w3, w2), us):
            if a.shape != b.shape:
                raise ValueError(f"ffn_reference: text weight {tuple(b.shape)} != vision weight {tuple(a.shape)}")
        u = [t.to(torch.float64) for t in us]
        out = _route(x2, mask, H, (lambda a: _swiglu64(a, *w), lambda a: _swiglu64(a, *u)))
    return out.reshape(*x.shape[:-1], H)


def reference_grads(fn: Callable[..., torch.Tensor], inputs: Sequence[Optional[torch.Tensor]],
                    grad_out: torch.Tensor, diff: Sequence[bool]) -> Tuple[torch.Tensor, list]:
    """Runs `fn(*inputs)` on float64 copies (leaves for the positions where `diff[i]`), back-propagates
    `grad_out` (as float64) and returns `(out64, [grad64 or None per input])`. Non-tensor inputs pass through."""
    leaves = []
    for t, d in zip(inputs, diff):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().to(torch.float64)
            if d:
                t.requires_grad_(True)
        leaves.append(t)
    with torch.enable_grad():
        out = fn(*leaves)
        wanted = [t for t, d in zip(leaves, diff) if d and isinstance(t, torch.Tensor)]
        grads = torch.autograd.grad(out, wanted, grad_out.detach().to(torch.float64), allow_unused=True)
    it = iter(grads)
    per_input = [next(it) if d and isinstance(t, torch.Tensor) else None for t, d in zip(leaves, diff)]
    # allow_unused gives None for a leaf no token reached (an expert without tokens): its true gradient is zero
    per_input = [torch.zeros_like(t) if g is None and d and isinstance(t, torch.Tensor) else g
                 for g, t, d in zip(per_input, leaves, diff)]
    return out.detach(), per_input


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (the absolute error ||out|| when ref is all zero)."""
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(device=out.device, dtype=torch.float64)
    num = (out - ref).norm().item()
    den = ref.norm().item()
    return num / den if den > 0 else num


def check_out(out, ref, shape, dtype, device, tol, what="out"):
    """Metadata (shape, dtype, device, contiguous), no NaN/inf, relative error <= tol against the float64 ref."""
    assert tuple(out.shape) == tuple(shape), f"{what}: shape {tuple(out.shape)} != {tuple(shape)}"
    assert out.dtype == dtype and out.device == torch.device(device), f"{what}: {out.dtype} on {out.device}"
    assert out.is_contiguous(), f"{what} not contiguous: strides {out.stride()}"
    assert bool(torch.isfinite(out).all()), f"{what} has NaN/inf (unwritten elements?)"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.1g}"


def check_grad(got, ref, dtype, tol, what):
    """A gradient against its float64 reference; exactly zero where the reference is (an expert with no tokens)."""
    assert got is not None, f"{what}: no gradient"
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}"
    assert bool(torch.isfinite(got).all()), f"{what} has NaN/inf"
    if ref.numel() and not bool(ref.any()):
        assert not bool(got.any()), f"{what}: must be exactly zero (no token used it), max |g| = {got.abs().max()}"
        return
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.1g}"


# ------------------------------------------------------------------------------------------------------------------
# test inputs shared by tests/test_linear_dual_ops.py and tests/test_ffn_ops.py


def make_mask(kind: str, lead, device="cpu", generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A bool routing mask of shape `lead` (True = vision). Drawn on the CPU (same values on every device):

    random: each token vision with probability 1/2; all_true / all_false: one expert only;
    span: one contiguous run of vision tokens (from M/4, length max(1, M/2)) in text, like an image in a prompt;
    vision90: each token vision with probability 0.9.
    """
    lead = tuple(int(v) for v in lead)
    n = 1
    for v in lead:
        n *= v
    if kind == "random":
        m = torch.rand(n, generator=generator) < 0.5
    elif kind == "vision90":
        m = torch.rand(n, generator=generator) < 0.9
    elif kind == "all_true":
        m = torch.ones(n, dtype=torch.bool)
    elif kind == "all_false":
        m = torch.zeros(n, dtype=torch.bool)
    elif kind == "span":
        m = torch.zeros(n, dtype=torch.bool)
        m[n // 4: n // 4 + max(1, n // 2)] = True
    else:
        raise ValueError(f"make_mask: unknown kind {kind!r}")
    return m.reshape(lead).to(device)


def strided_view(lead, last: int, dtype, device, layout: str = "contig", scale: float = 1.0) -> torch.Tensor:
    """A random tensor of shape lead + (last,) in the requested memory layout:

    contig: contiguous; transposed: the first two dims swapped in memory (lead of rank 2; rank 1: a column of a
    transposed matrix, row stride 1); sliced: columns 3..3+last of a wider tensor (row stride last + 11, offset 3
    elements: no 16-byte alignment); strided_k: every other element of the last dim (stride 2).
    """
    lead = tuple(lead)
    mk = lambda shape: (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)  # noqa: E731
    if layout == "contig":
        return mk(lead + (last,))
    if layout == "transposed":
        if len(lead) >= 2:
            return mk((lead[1], lead[0]) + lead[2:] + (last,)).transpose(0, 1)
        return mk((last,) + lead).transpose(0, 1)  # [M, last] with strides (1, M)
    if layout == "sliced":
        return mk(lead + (last + 11,))[..., 3:3 + last]
    if layout == "strided_k":
        return mk(lead + (2 * last,))[..., ::2]
    raise ValueError(f"strided_view: unknown layout {layout!r}")
