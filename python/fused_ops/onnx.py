"""ONNX export of the fused ops: `torch.onnx.export(..., dynamo=True)` translations for every `torch.ops.fused.*` op
that a forward pass calls (`route`, `linear_dual`, `ffn`, `rope_fwd`, `rope_bwd`, `rope_fwd_qk`, `rope_bwd_qk`).

Two forms, one set of formulas (the `_*_body` functions below, written once over an op builder):

    program = fused_ops.onnx.export(model, (x, mask), dynamic_shapes=...)            # fused nodes + function bodies
    program = torch.onnx.export(model, (x, mask), dynamo=True, dynamic_shapes=...,
                                custom_translation_table=fused_ops.onnx.translation_table())   # standard ops only

`export` (`custom_domain=True`, its default) writes each op call as ONE node of the ONNX domain "fused" (version 1):
the torch op's tensors as inputs, in its schema's order, all of them (absent ones empty, `routing` included), its
flags as attributes (`allow_tf32`; `tensor_format`, `interleaved`, `cp_size`, `cp_rank`). The model carries an ONNX
function for each node, whose body computes the same result from standard operators (MatMul, Sigmoid, Mul, Where on
the mask, the rotary arithmetic): a runtime with a kernel for `fused::ffn` (a custom-op library) runs the kernel, any
other (ONNX Runtime without one) inlines the body. A body is specialised to its node's static arguments (which
optional inputs it has, the RoPE layout and flags, float64 or not) as a function overload (ONNX IR version 10), named
after them, e.g. `fused::ffn` overload "stacked_residual".

Why not the table alone: torch 2.14's exporter converts every model to its target opset, and that pass first inlines
every function of the model, so a function added while translating never survives `torch.onnx.export`. `export`
translates to bodiless `fused` nodes (`translation_table(custom_domain=True)`) and attaches the functions afterwards
(`attach_functions`). The plain table (`custom_domain=False`) writes the formulas as standard operators in place of
each op, for tools that read no functions; `export(..., custom_domain=False)` is the same.

Semantics are the CPU path's (csrc/ops/*_cpu.cpp): math in float32 (float64 for float64 inputs) between a Cast of the
inputs and one rounding to the input's dtype, every token through its own expert only (the other expert's result is
never selected, so its NaN/inf cannot leak in). `allow_tf32` is carried for a kernel; the bodies compute IEEE fp32.
`routing` is carried for a kernel; the bodies route from the mask and do not read it. `recompute` concerns autograd
only and is dropped. What the graph cannot express raises ValueError at translation time, naming the argument.

The decode step's ops (`decode_attention`, `rms_norm`, which only `FusedCogVLM.decode` calls) have no translation:
torch's exporter names them.

Needs the optional packages onnx and onnxscript (and onnxruntime to run the result); `import fused_ops` never
imports this module.
"""
from typing import Callable, Dict, List, Sequence

import numpy as np
import torch

try:
    import onnx.defs
    import onnxscript
    from onnxscript import ir
    from onnxscript import opset18 as _opset18  # the opset torch 2.14's exporter translates at (torchlib's)
    from onnxscript.values import Op, Opset
except ImportError as _e:  # pragma: no cover - exercised only without the optional packages
    raise ImportError("fused_ops.onnx needs the optional packages onnx and onnxscript "
                      "(pip install onnx onnxscript onnxruntime)") from _e

__all__ = ["DOMAIN", "DOMAIN_VERSION", "translation_table", "attach_functions", "export"]

#: the ONNX domain of the fused ops' nodes and functions, and its version
DOMAIN = "fused"
DOMAIN_VERSION = 1

_FLOAT, _DOUBLE = ir.DataType.FLOAT, ir.DataType.DOUBLE
_INT32, _INT64 = ir.DataType.INT32, ir.DataType.INT64
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
_END = np.iinfo(np.int64).max  # Slice's "to the end"

# The routing buffer's layout constants (csrc/ops/routed_gemm.h, kernels/routing.py): kAlign, kSegSlots, kRowTail.
# tests/test_onnx.py compares the `route` body with the op entry for entry, so a change there fails that test.
_ALIGN, _SEG_SLOTS, _ROW_TAIL = 128, 8, 128


# ------------------------------------------------------------------------------------------------------------------
# The formulas, in standard ONNX operators. `op` is an op builder: onnxscript's opset18 inside torch's exporter (the
# plain table), or onnxscript's OpBuilder when a function body is built (attach_functions). Only explicit constants
# are passed as inputs (no Python scalars), so both builders produce the same graph.


def _i64(op, *values, scalar=False):
    """An int64 constant: 1-D of `values`, or 0-D with scalar=True."""
    arr = np.array(values[0] if scalar else list(values), dtype=np.int64)
    return op.Constant(value=ir.tensor(arr))


def _t(op, w, ct):
    """wᵀ of a 2-D weight in the compute type (nn.Linear's [out, in] layout -> MatMul's [in, out])."""
    return op.Transpose(op.Cast(w, to=ct), perm=[1, 0])


def _expert(op, stacked, index: int):
    """Expert `index` of a stacked [2, ...] weight (0 text, 1 vision): a Gather, which drops the expert axis."""
    return op.Gather(stacked, _i64(op, index, scalar=True), axis=0)


def _routed(op, mask, vision, text):
    """The routed choice: each token's row from its own expert (mask [...] True -> vision), outputs [..., N]."""
    return op.Where(op.Unsqueeze(mask, _i64(op, -1)), vision, text)


def _route_body(op, mask):
    """fused::route: both routings of `mask` in the shared layout, int32, entry for entry route_cpu's
    (csrc/ops/route.cpp): -1 everywhere, then the aligned routing from 0 (seg [0, start_1, end, count_0, count_1],
    perm: text rows from kSegSlots, vision rows from kSegSlots + start_1, each expert's segment padded to kAlign), and
    the unaligned one from unaligned_section(M) (start_1 = count_0, end = M, no padding)."""
    s = lambda v: _i64(op, v, scalar=True)  # noqa: E731
    m = op.Reshape(mask, _i64(op, -1))
    n = op.Size(m)
    c1 = op.ReduceSum(op.Cast(m, to=_INT64), keepdims=0)
    c0 = op.Sub(n, c1)
    align = lambda v: op.Mul(op.Div(op.Add(v, s(_ALIGN - 1)), s(_ALIGN)), s(_ALIGN))  # noqa: E731
    start1 = align(c0)
    end = op.Add(start1, align(c1))
    section = op.Mul(op.Div(op.Add(n, s(_SEG_SLOTS + 2 * _ALIGN + 3)), s(4)), s(4))  # unaligned_section(M)
    size = op.Add(section, op.Add(n, s(_SEG_SLOTS + _ROW_TAIL)))  # shared_routing_size(M)
    buf = op.ConstantOfShape(op.Reshape(size, _i64(op, 1)), value=ir.tensor(np.array([-1], dtype=np.int32)))
    text = op.Reshape(op.NonZero(op.Not(m)), _i64(op, -1))  # text rows in token order
    vision = op.Reshape(op.NonZero(m), _i64(op, -1))
    r0, r1 = op.Range(s(0), c0, s(1)), op.Range(s(0), c1, s(1))
    seg_at = _i64(op, 0, 1, 2, 3, 4)
    vec = lambda *vs: op.Concat(*[op.Reshape(v, _i64(op, 1)) for v in vs], axis=0)  # noqa: E731
    at_perm = lambda base: op.Add(r0, base)  # noqa: E731
    positions = op.Concat(
        seg_at, at_perm(s(_SEG_SLOTS)), op.Add(r1, op.Add(s(_SEG_SLOTS), start1)),  # aligned
        op.Add(seg_at, section), at_perm(op.Add(section, s(_SEG_SLOTS))),  # unaligned
        op.Add(r1, op.Add(section, op.Add(s(_SEG_SLOTS), c0))), axis=0)
    values = op.Concat(vec(s(0), start1, end, c0, c1), text, vision, vec(s(0), c0, n, c0, c1), text, vision, axis=0)
    return op.ScatterElements(buf, positions, op.Cast(values, to=_INT32), axis=0)


def _linear_dual_body(op, x, mask, weight_v, weight_t, bias_v, bias_t, routing, residual, *, ct):
    """fused::linear_dual: x·weight_vᵀ + bias_v where mask, x·weight_tᵀ + bias_t elsewhere (+ residual), in `ct`,
    rounded once to x's dtype. weight_t None: weight_v is both experts stacked [2, N, K]. routing is not read."""
    del routing
    if weight_t is None:
        weight_v, weight_t = _expert(op, weight_v, 1), _expert(op, weight_v, 0)
    xc = op.Cast(x, to=ct)

    def linear(w, b):
        y = op.MatMul(xc, _t(op, w, ct))
        return y if b is None else op.Add(y, op.Cast(b, to=ct))

    out = _routed(op, mask, linear(weight_v, bias_v), linear(weight_t, bias_t))
    if residual is not None:  # added before the one rounding, as the op's epilogue does
        out = op.Add(out, op.Cast(residual, to=ct))
    return op.CastLike(out, x)


def _ffn_body(op, x, w1, w3, w2, mask, u1, u3, u2, routing, residual, *, ct):
    """fused::ffn: (silu(x·w1ᵀ) ⊙ x·w3ᵀ)·w2ᵀ; with a mask each token through its own expert (w* where mask, u*
    elsewhere; u* None with a mask: w* stacked [2, ...], [0] text, [1] vision) (+ residual), in `ct`, rounded once to
    x's dtype. routing is not read."""
    del routing
    xc = op.Cast(x, to=ct)

    def swiglu(gate_w, up_w, down_w):
        gate = op.MatMul(xc, _t(op, gate_w, ct))
        up = op.MatMul(xc, _t(op, up_w, ct))
        return op.MatMul(op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), _t(op, down_w, ct))  # silu(g) = g·sigmoid(g)

    if mask is None:
        out = swiglu(w1, w3, w2)
    else:
        if u1 is None:  # stacked experts
            w1, w3, w2, u1, u3, u2 = (_expert(op, w, e) for e in (1, 0) for w in (w1, w3, w2))
        out = _routed(op, mask, swiglu(w1, w3, w2), swiglu(u1, u3, u2))
    if residual is not None:
        out = op.Add(out, op.Cast(residual, to=ct))
    return op.CastLike(out, x)


def _rope_positions(op, t, cu_seqlens, start_positions, fmt: str, cp_size: int, cp_rank: int):
    """int64 position of every row of t, shaped to broadcast over t's leading (non h, d) dims: sbhd [s, 1] or [s, b],
    bshd [1, s] or [b, s], thd [t] (docs/design.md, tests/reference.py local_positions)."""
    s = lambda v: _i64(op, v, scalar=True)  # noqa: E731
    dim = lambda axis: op.Squeeze(op.Shape(t, start=axis, end=axis + 1), _i64(op, 0))  # noqa: E731
    if fmt == "thd":
        rows = op.Range(s(0), dim(0), s(1))  # [T]
        starts = op.Div(op.Cast(cu_seqlens, to=_INT64), s(cp_size))  # local sequence starts [n + 1]
        later = op.Slice(starts, _i64(op, 1), _i64(op, _END))
        # sequence of each row: how many sequences after the first begin at or before it (an empty one is skipped)
        seq = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(later, _i64(op, 0)), op.Unsqueeze(rows, _i64(op, 1))),
                                   to=_INT64), _i64(op, 1), keepdims=0)
        begin = op.Gather(starts, seq)
        pos = op.Sub(rows, begin)  # index in its sequence
        length = op.Sub(op.Gather(starts, op.Add(seq, s(1))), begin)
        batch = seq
    else:
        seq_axis, batch_axis = (0, 1) if fmt == "sbhd" else (1, 0)
        length = dim(seq_axis)
        pos = op.Unsqueeze(op.Range(s(0), length, s(1)), _i64(op, batch_axis))  # [s, 1] or [1, s]
        batch = op.Unsqueeze(op.Range(s(0), dim(batch_axis), s(1)), _i64(op, seq_axis))  # [1, b] or [b, 1]
    local = pos
    if start_positions is not None:
        pos = op.Add(pos, op.Gather(op.Cast(start_positions, to=_INT64), batch))
    if cp_size > 1:  # load-balanced context parallelism: the local halves are chunks cp_rank, 2 cp_size - 1 - cp_rank
        half = op.Div(length, s(2))
        first = op.Mul(half, s(cp_rank))
        second = op.Sub(op.Sub(op.Mul(length, s(cp_size)), op.Mul(half, s(cp_rank + 1))), half)
        pos = op.Add(pos, op.Where(op.Less(local, half), first, second))
    return pos


def _rotate(op, y, d2, interleaved: bool):
    """rotate(y) over the rotated channels: pairs (a, b) -> (-y_b, y_a), pairs (j, j + d2/2) or (2j, 2j + 1)."""
    last = _i64(op, -1)
    if interleaved:
        even = op.Slice(y, _i64(op, 0), d2, last, _i64(op, 2))
        odd = op.Slice(y, _i64(op, 1), d2, last, _i64(op, 2))
        pairs = op.Concat(op.Unsqueeze(op.Neg(odd), last), op.Unsqueeze(even, last), axis=-1)  # [..., d2/2, 2]
        return op.Reshape(pairs, op.Shape(y))
    half = op.Div(d2, _i64(op, 2))
    a = op.Slice(y, _i64(op, 0), half, last)
    b = op.Slice(y, half, d2, last)
    return op.Concat(op.Neg(b), a, axis=-1)


def _rope_body(op, tensors, freqs, cu_seqlens, start_positions, *, fmt: str, interleaved: bool, cp_size: int,
               cp_rank: int, backward: bool, ct):
    """fused::rope_{fwd,bwd}[_qk] (TransformerEngine's fused RoPE, docs/design.md): with c, s the cos and sin of
    each channel's angle, forward out = x·c + rotate(x)·s; backward (its transpose) out = g·c - rotate(g·s);
    channels d2..d pass through. All tensors of `tensors` at the same positions (q and k); in `ct`, rounded once."""
    last = _i64(op, -1)
    d2 = op.Shape(freqs, start=-1)  # [1]
    table = op.Reshape(freqs, op.Concat(last, d2, axis=0))  # [s_max, d2], float32
    pos = _rope_positions(op, tensors[0], cu_seqlens, start_positions, fmt, cp_size, cp_rank)
    angle = op.Cast(op.Unsqueeze(op.Gather(table, pos, axis=0), _i64(op, -2)), to=ct)  # [..., 1, d2] over heads
    cos, sin = op.Cos(angle), op.Sin(angle)
    outs = []
    for t in tensors:
        x = op.Cast(t, to=ct)
        rot = op.Slice(x, _i64(op, 0), d2, last)
        if backward:
            rot = op.Sub(op.Mul(rot, cos), _rotate(op, op.Mul(rot, sin), d2, interleaved))
        else:
            rot = op.Add(op.Mul(rot, cos), op.Mul(_rotate(op, rot, d2, interleaved), sin))
        out = op.Concat(rot, op.Slice(x, d2, _i64(op, _END), last), axis=-1)
        outs.append(op.CastLike(out, t))
    return outs[0] if len(outs) == 1 else tuple(outs)


# ------------------------------------------------------------------------------------------------------------------
# The node of each op in the "fused" domain: its tensor inputs in the torch schema's order (required ones first),
# its non-tensor arguments as attributes. op -> (required inputs, optional inputs, outputs, {attribute: type}).

_ROPE_ATTRS = {"tensor_format": "STRING", "interleaved": "INT", "cp_size": "INT", "cp_rank": "INT"}
_ROPE_OPTIONAL = ["cu_seqlens", "start_positions"]
_NODES = {
    "route": (["mask"], [], ["routing"], {}),
    "linear_dual": (["x", "mask", "weight_v"], ["weight_t", "bias_v", "bias_t", "routing", "residual"], ["out"],
                    {"allow_tf32": "INT"}),
    "ffn": (["x", "w1", "w3", "w2"], ["mask", "u1", "u3", "u2", "routing", "residual"], ["out"],
            {"allow_tf32": "INT"}),
    "rope_fwd": (["t", "freqs"], _ROPE_OPTIONAL, ["out"], _ROPE_ATTRS),
    "rope_bwd": (["grad_output", "freqs"], _ROPE_OPTIONAL, ["out"], _ROPE_ATTRS),
    "rope_fwd_qk": (["q", "k", "freqs"], _ROPE_OPTIONAL, ["q_out", "k_out"], _ROPE_ATTRS),
    "rope_bwd_qk": (["grad_q", "grad_k", "freqs"], _ROPE_OPTIONAL, ["grad_q_out", "grad_k_out"], _ROPE_ATTRS),
}
_ANY = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)", "tensor(bool)", "tensor(int32)",
        "tensor(int64)"]


def _schema(name: str) -> onnx.defs.OpSchema:
    """The OpSchema torch's exporter needs to emit a node of op `name` (held here, not registered with onnx)."""
    required, optional, outputs, attrs = _NODES[name]
    param = onnx.defs.OpSchema.FormalParameter
    option = onnx.defs.OpSchema.FormalParameterOption
    # every tensor its own type variable: the exporter binds variables from the inputs and must not unify them
    inputs = [param(n, f"T{i}", param_option=option.Single if i < len(required) else option.Optional)
              for i, n in enumerate(required + optional)]
    outs = [param(n, f"O{i}") for i, n in enumerate(outputs)]
    constraints = [(f"T{i}", _ANY, "") for i in range(len(inputs))] + [(f"O{i}", _ANY, "") for i in range(len(outs))]
    attributes = [onnx.defs.OpSchema.Attribute(a, getattr(onnx.defs.OpSchema.AttrType, kind), "", required=False)
                  for a, kind in attrs.items()]
    return onnx.defs.OpSchema(name, DOMAIN, DOMAIN_VERSION, inputs=inputs, outputs=outs,
                              type_constraints=constraints, attributes=attributes)


_OPS: Dict[str, Op] = {}


def _emit(name: str, inputs: Sequence, **attrs):
    """One bodiless `fused::name` node in the graph torch's exporter is building (attach_functions adds its body)."""
    if name not in _OPS:
        _OPS[name] = Op(Opset(DOMAIN, DOMAIN_VERSION), name, _schema(name))
    return _OPS[name](*inputs, **attrs)


# ------------------------------------------------------------------------------------------------------------------
# Checks at translation time: what the graph cannot express raises, naming the argument and why.


def _compute_type(op_name: str, arg: str, value) -> ir.DataType:
    """float32 (float64 for float64 inputs): the CPU path's compute type for a floating-point input."""
    dtype = getattr(value, "dtype", None)
    if dtype not in _FLOATS:
        raise ValueError(f"fused_ops.onnx: {op_name}: {arg} must be a float32, float16, bfloat16 or float64 tensor, "
                         f"got {dtype}")
    return _DOUBLE if dtype == _DOUBLE else _FLOAT


def _static(op_name: str, arg: str, value, kind):
    """A non-tensor argument must be a Python constant at export time: it becomes an attribute (custom domain) or
    picks the formula (plain); a value computed in the graph (e.g. a SymInt from a dynamic size) cannot."""
    if isinstance(value, bool) and kind is int:  # allow_tf32: a bool flag carried as an INT attribute
        return int(value)
    if not isinstance(value, kind):
        raise ValueError(f"fused_ops.onnx: {op_name}: {arg} must be a constant {kind.__name__} at export time (it "
                         f"selects the ONNX formula / becomes a node attribute), got {type(value).__name__} {value!r}")
    return value


def _rope_config(op_name, tensor_format, interleaved, cu_seqlens, cp_size, cp_rank):
    fmt = _static(op_name, "tensor_format", tensor_format, str)
    if fmt not in ("sbhd", "bshd", "thd"):
        raise ValueError(f"fused_ops.onnx: {op_name}: tensor_format must be 'sbhd', 'bshd' or 'thd', got {fmt!r}")
    if (fmt == "thd") != (cu_seqlens is not None):
        raise ValueError(f"fused_ops.onnx: {op_name}: cu_seqlens is required with tensor_format='thd' and only used "
                         f"there (tensor_format={fmt!r}, cu_seqlens {'given' if cu_seqlens is not None else 'None'})")
    size, rank = _static(op_name, "cp_size", cp_size, int), _static(op_name, "cp_rank", cp_rank, int)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"fused_ops.onnx: {op_name}: cp_size={size}, cp_rank={rank}: need cp_size >= 1 and "
                         "0 <= cp_rank < cp_size")
    return {"tensor_format": fmt, "interleaved": _static(op_name, "interleaved", interleaved, bool), "cp_size": size,
            "cp_rank": rank}


def _ffn_kind(mask, u1, u3, u2) -> str:
    us = [u is not None for u in (u1, u3, u2)]
    if mask is None and not any(us):
        return "single"
    if mask is not None and all(us):
        return "dual"
    if mask is not None and not any(us):
        return "stacked"
    raise ValueError("fused_ops.onnx: ffn: give mask with all of u1, u3, u2 (dual), mask alone (stacked w1/w3/w2) or "
                     f"neither (single); got mask {'given' if mask is not None else 'None'}, "
                     f"u1/u3/u2 given: {us}")


# ------------------------------------------------------------------------------------------------------------------
# Translations: the torch op's arguments (ONNX values, None, Python constants) -> a fused node, or the formula.


def _translations(custom_domain: bool) -> Dict[Callable, Callable]:
    op = _opset18

    def route(mask):
        return _emit("route", [mask]) if custom_domain else _route_body(op, mask)

    def linear_dual(x, mask, weight_v, weight_t=None, bias_v=None, bias_t=None, allow_tf32=False, routing=None,
                    residual=None):
        ct = _compute_type("linear_dual", "x", x)
        if custom_domain:
            return _emit("linear_dual", [x, mask, weight_v, weight_t, bias_v, bias_t, routing, residual],
                         allow_tf32=_static("linear_dual", "allow_tf32", allow_tf32, int))
        return _linear_dual_body(op, x, mask, weight_v, weight_t, bias_v, bias_t, routing, residual, ct=ct)

    def ffn(x, w1, w3, w2, mask=None, u1=None, u3=None, u2=None, allow_tf32=False, routing=None, recompute=False,
            residual=None):
        del recompute  # autograd only: what the forward keeps for the backward
        ct = _compute_type("ffn", "x", x)
        _ffn_kind(mask, u1, u3, u2)
        if custom_domain:
            return _emit("ffn", [x, w1, w3, w2, mask, u1, u3, u2, routing, residual],
                         allow_tf32=_static("ffn", "allow_tf32", allow_tf32, int))
        return _ffn_body(op, x, w1, w3, w2, mask, u1, u3, u2, routing, residual, ct=ct)

    def rope(name, n_tensors, backward):
        def translate(*args, tensor_format="sbhd", interleaved=False, cu_seqlens=None, start_positions=None,
                      cp_size=1, cp_rank=0):
            # the schema's order after the tensors: tensor_format, interleaved, cu_seqlens, start_positions, cp_size,
            # cp_rank (any of them may come positionally)
            tensors, freqs, rest = list(args[:n_tensors]), args[n_tensors], list(args[n_tensors + 1:])
            given = dict(zip(["tensor_format", "interleaved", "cu_seqlens", "start_positions", "cp_size", "cp_rank"],
                             rest))
            tensor_format = given.get("tensor_format", tensor_format)
            interleaved = given.get("interleaved", interleaved)
            cu_seqlens = given.get("cu_seqlens", cu_seqlens)
            start_positions = given.get("start_positions", start_positions)
            cp_size, cp_rank = given.get("cp_size", cp_size), given.get("cp_rank", cp_rank)
            names = _NODES[name][0]
            ct = None
            for arg, t in zip(names, tensors):
                ct = _compute_type(name, arg, t)
            if getattr(freqs, "dtype", None) != _FLOAT:
                raise ValueError(f"fused_ops.onnx: {name}: freqs must be float32, got {getattr(freqs, 'dtype', None)}")
            cfg = _rope_config(name, tensor_format, interleaved, cu_seqlens, cp_size, cp_rank)
            if custom_domain:
                attrs = dict(cfg, interleaved=int(cfg["interleaved"]))
                return _emit(name, tensors + [freqs, cu_seqlens, start_positions], **attrs)
            return _rope_body(op, tensors, freqs, cu_seqlens, start_positions, fmt=cfg["tensor_format"],
                              interleaved=cfg["interleaved"], cp_size=cfg["cp_size"], cp_rank=cfg["cp_rank"],
                              backward=backward, ct=ct)

        translate.__name__ = name
        return translate

    fused = torch.ops.fused
    return {
        fused.route.default: route,
        fused.linear_dual.default: linear_dual,
        fused.ffn.default: ffn,
        fused.rope_fwd.default: rope("rope_fwd", 1, False),
        fused.rope_bwd.default: rope("rope_bwd", 1, True),
        fused.rope_fwd_qk.default: rope("rope_fwd_qk", 2, False),
        fused.rope_bwd_qk.default: rope("rope_bwd_qk", 2, True),
    }


def translation_table(custom_domain: bool = False) -> Dict[Callable, Callable]:
    """The `custom_translation_table` for `torch.onnx.export(..., dynamo=True)` that translates every fused op.

    custom_domain=False (default): each op becomes the standard operators that compute it (a complete model, any
    ONNX tool). custom_domain=True: each op becomes one bodiless `fused` node; call `attach_functions` on the
    program's model before using it (`export` does both).
    """
    return _translations(custom_domain)


# ------------------------------------------------------------------------------------------------------------------
# Function bodies for the fused nodes of an exported model.


def _attr(node: ir.Node, name: str, default):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _specialise(node: ir.Node):
    """(overload name, body builder taking (op, *inputs)) of a fused node, its inputs padded to the schema's: the
    body for its static arguments (which inputs it has, its attributes, float64 or not)."""
    name = node.op_type
    required, optional, _, _ = _NODES[name]
    has = {n: v is not None for n, v in zip(required + optional, node.inputs)}
    ct = _DOUBLE if node.inputs[0].dtype == _DOUBLE else _FLOAT
    parts: List[str] = []
    if name == "route":
        return "default", _route_body
    if name == "linear_dual":
        parts = ["separate" if has["weight_t"] else "stacked"] + [p for p in ("bias_v", "bias_t", "residual") if has[p]]
        body = lambda op, *ins: _linear_dual_body(op, *ins, ct=ct)  # noqa: E731
    elif name == "ffn":
        parts = [_ffn_kind(*(node.inputs[i] for i in range(4, 8)))] + (["residual"] if has["residual"] else [])
        body = lambda op, *ins: _ffn_body(op, *ins, ct=ct)  # noqa: E731
    else:
        fmt = _attr(node, "tensor_format", "sbhd")
        interleaved, cp_size, cp_rank = (bool(_attr(node, "interleaved", 0)), _attr(node, "cp_size", 1),
                                         _attr(node, "cp_rank", 0))
        parts = [fmt] + (["interleaved"] if interleaved else []) + (
            ["start_positions"] if has["start_positions"] else []) + ([f"cp{cp_size}r{cp_rank}"] if cp_size > 1 else [])
        n = len(required) - 1

        def body(op, *ins):
            return _rope_body(op, list(ins[:n]), ins[n], ins[n + 1], ins[n + 2], fmt=fmt, interleaved=interleaved,
                              cp_size=cp_size, cp_rank=cp_rank, backward="bwd" in name, ct=ct)
    if ct == _DOUBLE:
        parts.append("f64")
    return "_".join(parts), body


def _build_function(node: ir.Node, overload: str, body, opset: int) -> ir.Function:
    required, optional, outputs, attrs = _NODES[node.op_type]
    names = required + optional
    # a fresh formal input for each input the node has, None for an absent one (build_function declares a
    # placeholder the body does not read: the body branches on None), so that every position lines up
    formal = [ir.Value(name=n) if v is not None else None for n, v in zip(names, node.inputs)]
    fn = onnxscript.build_function(body, formal, domain=DOMAIN, name=node.op_type, opset_imports={"": opset})
    for value, n in zip(fn.graph.inputs, names):  # the placeholders' generated names -> the schema's
        value.name = n
    for value, n in zip(fn.graph.outputs, outputs):
        value.name = n
    # the node's attributes, declared with the op's defaults (the body has them baked in: it is this overload's)
    declared = [ir.Attr(a, ir.AttributeType.STRING, "sbhd") if kind == "STRING" else
                ir.Attr(a, ir.AttributeType.INT, 1 if a == "cp_size" else 0) for a, kind in attrs.items()]
    function = ir.Function(DOMAIN, node.op_type, overload, graph=fn.graph, attributes=declared)
    function.doc_string = (f"fused::{node.op_type} ({overload}): the fused op in standard ONNX operators "
                           "(fused_ops.onnx); a runtime with a kernel for it may run that instead")
    return function


def attach_functions(model: ir.Model) -> ir.Model:
    """Gives every bodiless `fused` node of `model` (an exported program's `.model`, translated with
    `translation_table(custom_domain=True)`) its function: the overload for its static arguments, built once per
    overload. Sets the IR version to 10 (function overloads) at least. Returns the model, changed in place."""
    opset = model.opset_imports.get("", model.graph.opset_imports.get("", 18))
    for node in model.graph.all_nodes():  # subgraphs too (a fused op inside a loop body)
        if node.domain != DOMAIN or node.op_type not in _NODES:
            continue
        # every node of an op gets the schema's full input list (absent ones empty; the exporter drops trailing
        # ones): one arity per op for a kernel, and a node never has more inputs than its function declares
        required, optional, _, _ = _NODES[node.op_type]
        node.resize_inputs(len(required) + len(optional))
        overload, body = _specialise(node)
        node.overload = overload
        key = (DOMAIN, node.op_type, overload)
        if key not in model.functions:
            model.functions[key] = _build_function(node, overload, body, opset)
    if model.functions:
        model.opset_imports[DOMAIN] = DOMAIN_VERSION
        model.ir_version = max(model.ir_version or 0, 10)
    return model


def export(model, args=(), f=None, *, kwargs=None, custom_domain: bool = True, **export_kwargs):
    """`torch.onnx.export(model, args, dynamo=True, ...)` with the fused ops translated; returns the ONNXProgram.

    custom_domain=True: each fused op is one `fused` node with an ONNX function body (see the module docstring);
    False: standard operators only. `f`: also save the model there. Any other keyword goes to torch.onnx.export
    (dynamic_shapes, input_names, opset_version, optimize, ...); a `custom_translation_table` given is merged over
    the fused ops' one.
    """
    if export_kwargs.pop("dynamo", True) is not True:
        raise ValueError("fused_ops.onnx.export: dynamo must be True (the fused ops' translations are for the dynamo "
                         "exporter; the TorchScript-based one is deprecated)")
    table = translation_table(custom_domain)
    table.update(export_kwargs.pop("custom_translation_table", None) or {})
    try:
        program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, custom_translation_table=table,
                                    **export_kwargs)
    except torch.onnx.OnnxExporterError as e:
        # torch.export turns the in-place rope_fwd_ into a functionalization node whose op argument the exporter
        # cannot even read, so no translation is reached: say what it is instead of the exporter's KeyError
        if "fused.rope_fwd_." in str(e):
            raise ValueError("fused_ops.onnx.export: torch.ops.fused.rope_fwd_ (in place) cannot be exported: ONNX "
                             "values are immutable and torch.export leaves the in-place op opaque; call rope_fwd "
                             "(fused_ops.apply_rotary_pos_emb) and use its result") from e
        raise
    if custom_domain:
        attach_functions(program.model)
    if f is not None:
        program.save(f)
    return program
