"""ONNX export of the fused ops (fused_ops.onnx, issue #58), checked in ONNX Runtime (CPU execution provider).

Each test exports once with dynamic batch and sequence sizes and runs the model at several sizes with fresh random
inputs against eager PyTorch (the ops' CPU path): relative error ||onnx - eager|| / ||eager|| in float64 terms,
<= 1e-5 in float32 and about two units of the dtype's rounding in float16 / bfloat16. Both forms are checked: the
`fused` domain (one node per op, an ONNX function body that ONNX Runtime inlines) and plain standard operators.

bfloat16: ONNX Runtime's CPU provider has no bfloat16 kernels for arithmetic (MatMul, Add, Mul, Where, Softmax, ...),
only Cast and data movement. The fused ops' bodies compute in float32 (as the ops do) between a Cast in and a Cast
out, so every op and module runs in bfloat16 there; a whole model does not (its attention and norms are bfloat16
arithmetic from torch's own translations), so the bfloat16 model is checked valid, ONNX Runtime's refusal is checked
to be about those standard nodes, and its numbers are checked with ONNX's reference evaluator instead.

Needs onnx, onnxscript and onnxruntime (optional; scripts/setup_env.sh installs them); skipped without them.
"""
import copy
import os

import pytest
import torch
from torch import nn
from torch.export import Dim

try:  # optional dependencies (scripts/setup_env.sh installs them when a package index is reachable)
    import ml_dtypes
    import numpy as np
    import onnx
    import onnx.inliner
    import onnxruntime as ort
    import onnxscript  # noqa: F401
    from onnx.reference import ReferenceEvaluator
except ImportError as e:
    pytest.skip(f"ONNX export needs onnx, onnxscript and onnxruntime ({e}); `pip install onnx onnxscript onnxruntime`",
                allow_module_level=True)

import fused_ops  # noqa: E402

try:
    import fused_ops.onnx as fonnx
except ModuleNotFoundError as e:
    if e.name != "fused_ops.onnx":
        raise
    # the installed package (copied at build time) predates python/fused_ops/onnx.py: test the source tree's module
    fused_ops.__path__.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python",
                                           "fused_ops"))
    import fused_ops.onnx as fonnx

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
#: float32: the issue's bound; 16-bit: about two units of rounding (both sides compute in float32 and round once)
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2}
DTYPES = {"fp32": F32, "fp16": F16, "bf16": BF16}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    den = ref.norm().item()
    return (out - ref).norm().item() / den if den > 0 else out.norm().item()


def to_ort(t: torch.Tensor) -> ort.OrtValue:
    t = t.detach().contiguous()
    if t.dtype == BF16:  # numpy has no bfloat16: hand ORT the bits with the element type
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(t.view(torch.int16).numpy().view(np.uint16),
                                                               onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(t.numpy())


def from_ort(v: ort.OrtValue) -> torch.Tensor:
    if v.data_type() == "tensor(bfloat16)":  # OrtValue.numpy() has no bfloat16 either: through DLPack
        return torch.from_dlpack(v._get_c_value()).clone()
    return torch.from_numpy(np.array(v.numpy()))


def session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()  # one thread: small models, and no spinning pool on a shared 2-core machine
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return options


class Exported:
    """One export of `module` (dynamic sizes) in an ONNX Runtime CPU session; calling it runs the ONNX model."""

    def __init__(self, module, args, dynamic_shapes, custom_domain=True):
        if custom_domain:
            self.program = fonnx.export(module, args, dynamic_shapes=dynamic_shapes, verbose=False)
        else:  # the plain table, handed to torch.onnx.export itself as the README shows
            self.program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic_shapes, verbose=False,
                                             custom_translation_table=fonnx.translation_table())
        self.proto = self.program.model_proto
        self.session = ort.InferenceSession(self.proto.SerializeToString(), session_options(),
                                            providers=["CPUExecutionProvider"])

    def __call__(self, *inputs):
        names = [i.name for i in self.session.get_inputs()]
        tensors = [t for t in inputs if t is not None]
        assert len(names) == len(tensors), (names, len(tensors))
        outs = self.session.run_with_ort_values(None, {n: to_ort(t) for n, t in zip(names, tensors)})
        return [from_ort(v) for v in outs]

    def domains(self):
        """(domain, op_type) of the main graph's nodes."""
        return [(n.domain, n.op_type) for n in self.proto.graph.node]


def check_outputs(got, want, dtype, what):
    want = want if isinstance(want, (tuple, list)) else [want]
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert tuple(g.shape) == tuple(w.shape), f"{what}, output {i}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert g.dtype == w.dtype, f"{what}, output {i}: dtype {g.dtype} != {w.dtype}"
        if not w.is_floating_point():  # the routing: entry for entry
            assert torch.equal(g, w), f"{what}, output {i}: routing differs from the op's"
            continue
        assert bool(torch.isfinite(g).all()), f"{what}, output {i}: NaN/inf"
        err = rel_err(g, w)
        assert err <= TOL[dtype], f"{what}, output {i}: relative error {err:.3g} > {TOL[dtype]:.1g}"


def make_mask(kind, batch, seq):
    if kind == "text":
        return torch.zeros(batch, seq, dtype=torch.bool)
    if kind == "vision":
        return torch.ones(batch, seq, dtype=torch.bool)
    return torch.rand(batch, seq) < (0.95 if kind == "mostly_vision" else 0.5)


@pytest.fixture(scope="module", autouse=True)
def torchlib_registry_once():
    """torch.onnx.export rebuilds its registry of torch's own translations (torchlib) at every call, about 1.5 s of
    parsing their source: build it once for this module. Each export still gets its own copy of the table (so the
    translations one export registers never reach another); what is translated, and how, is unchanged."""
    try:
        from torch.onnx._internal.exporter._registration import ONNXRegistry
        build = ONNXRegistry.from_torchlib
    except (ImportError, AttributeError):  # another torch: no shortcut
        yield
        return
    built = {}

    def from_torchlib(cls, opset_version=18):
        if opset_version not in built:
            built[opset_version] = build(opset_version=opset_version)
        registry = copy.copy(built[opset_version])
        registry.functions = {k: list(v) for k, v in registry.functions.items()}
        return registry

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ONNXRegistry, "from_torchlib", classmethod(from_torchlib))
        yield


# ------------------------------------------------------------------------------------------------------------------
# route, linear_dual, ffn and their modules: one model holds every form, so one export checks them all

H, I = 32, 48  # noqa: E741


class Routed(nn.Module):
    """Every routed op and module of the package on one (x, mask, residual): each output is one form."""

    def __init__(self, dtype):
        super().__init__()
        f = {"dtype": dtype}
        self.proj = fused_ops.DualLinear(H, H, bias=True, **f)  # stacked [2, N, K] weights, both biases
        self.mlp = fused_ops.FusedSwiGLU(H, I, **f)  # one expert
        self.dual = fused_ops.DualExpertSwiGLU(H, I, **f)  # stacked experts
        self.text = fused_ops.FusedSwiGLU(H, I, **f)  # with self.mlp: two separate experts (ffn's u1, u3, u2)
        self.w_v = nn.Parameter(torch.randn(H, H, **f) / H ** 0.5)  # linear_dual's separate weights ...
        self.w_t = nn.Parameter(torch.randn(H, H, **f) / H ** 0.5)
        self.b_v = nn.Parameter(torch.randn(H, **f))  # ... and a vision bias only (CogVLM's QKV)

    def forward(self, x, mask, residual):
        routing = fused_ops.route(mask)
        return (routing,
                self.proj(x, mask),
                self.proj(x, mask, routing, residual),
                fused_ops.linear_dual(x, mask, self.w_v, self.w_t, bias_v=self.b_v),
                self.mlp(x),
                self.mlp(x, residual),
                self.dual(x, mask, routing, residual),
                fused_ops.ffn(x, self.mlp.w1, self.mlp.w3, self.mlp.w2, mask, self.text.w1, self.text.w3,
                              self.text.w2))


@pytest.mark.parametrize("dtype_name, custom_domain", [("fp32", True), ("fp32", False), ("fp16", True),
                                                       ("bf16", True)])
def test_routed_ops_and_modules(dtype_name, custom_domain):
    """route (entry for entry), linear_dual, ffn, DualLinear, FusedSwiGLU and DualExpertSwiGLU from one export at
    several batch and sequence sizes, with mixed, all-text, all-vision and empty (no token) masks, and masks of 127
    to 300 tokens for the routing's alignment."""
    dtype = DTYPES[dtype_name]
    model = Routed(dtype).eval()
    b, s = Dim("batch"), Dim("seq")
    x, mask, res = torch.randn(2, 7, H, dtype=dtype), make_mask("mixed", 2, 7), torch.randn(2, 7, H, dtype=dtype)
    onnx_model = Exported(model, (x, mask, res), ({0: b, 1: s}, {0: b, 1: s}, {0: b, 1: s}), custom_domain)
    nodes = onnx_model.domains()
    if custom_domain:  # one node per op call, the GEMMs only inside the function bodies
        assert nodes.count(("fused", "route")) == 1 and nodes.count(("fused", "linear_dual")) == 3, nodes
        assert nodes.count(("fused", "ffn")) == 4 and ("", "MatMul") not in nodes, nodes
        assert {f.name for f in onnx_model.proto.functions} == {"route", "linear_dual", "ffn"}
    else:
        assert all(d == "" for d, _ in nodes) and not onnx_model.proto.functions, nodes
    cases = [(2, 7, "mixed"), (1, 1, "mixed"), (3, 41, "mixed"), (2, 9, "text"), (2, 9, "vision"), (1, 0, "mixed"),
             (0, 5, "mixed")]
    if dtype == F32:  # the routing's layout across its segment alignment (kAlign = 128 rows); it has no dtype
        cases += [(1, m, kind) for m in (127, 128, 129, 300) for kind in ("mixed", "mostly_vision", "text")]
    for batch, seq, kind in cases:
        x, res = torch.randn(batch, seq, H, dtype=dtype), torch.randn(batch, seq, H, dtype=dtype)
        mask = make_mask(kind, batch, seq)
        with torch.no_grad():
            want = model(x, mask, res)
        check_outputs(onnx_model(x, mask, res), want, dtype, f"{dtype_name} [{batch}, {seq}] {kind} mask")


# ------------------------------------------------------------------------------------------------------------------
# RoPE: sbhd, bshd and thd, every flag, forward and backward, single and q/k


D = 16  # head dim
S_MAX = 64  # positions of the fixed angle tables


class Rope(nn.Module):
    """RoPE of one layout and set of flags: rope_fwd (apply_rotary_pos_emb), rope_fwd_qk (apply_rotary_pos_emb_qk,
    GQA), rope_bwd and rope_bwd_qk, angles from the RotaryPositionEmbedding module (built for the sequence's length
    inside the graph for sbhd without offsets, a fixed table otherwise)."""

    def __init__(self, fmt, interleaved=False, rotary_percent=1.0, cp=(1, 0)):
        super().__init__()
        self.fmt, self.interleaved, (self.cp_size, self.cp_rank) = fmt, interleaved, cp
        self.rpe = fused_ops.RotaryPositionEmbedding(D, rotary_percent=rotary_percent, interleaved=interleaved,
                                                     device="cpu")

    def forward(self, q, k, start_positions=None, cu_seqlens=None):
        if self.fmt == "sbhd" and start_positions is None and self.cp_size == 1:
            freqs = self.rpe(q.shape[0])  # the module in the graph, at the dynamic length
        else:
            freqs = self.rpe(S_MAX)
        kw = dict(tensor_format=self.fmt, interleaved=self.interleaved, start_positions=start_positions,
                  cu_seqlens=cu_seqlens, cp_size=self.cp_size, cp_rank=self.cp_rank)
        out = fused_ops.apply_rotary_pos_emb(q, freqs, **kw)
        q2, k2 = fused_ops.apply_rotary_pos_emb_qk(q, k, freqs, **kw)
        grad = torch.ops.fused.rope_bwd(q, freqs, self.fmt, self.interleaved, cu_seqlens, start_positions,
                                        self.cp_size, self.cp_rank)
        gq, gk = torch.ops.fused.rope_bwd_qk(q, k, freqs, self.fmt, self.interleaved, cu_seqlens, start_positions,
                                             self.cp_size, self.cp_rank)
        return out, q2, k2, grad, gq, gk


def _rope_inputs(fmt, batch, seq, dtype, start, cp_size, lengths=None):
    """q (4 heads), k (2 heads), start_positions (or None), cu_seqlens (thd) for `batch` sequences of `seq` tokens
    (thd: of `lengths` global tokens each, cp_size dividing them in two chunks per rank)."""
    if fmt == "thd":
        cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32)
        shape = (int(cu[-1]) // cp_size,)
        batch = len(lengths)
    else:
        shape = (seq, batch) if fmt == "sbhd" else (batch, seq)
        cu = None
    q, k = torch.randn(*shape, 4, D, dtype=dtype), torch.randn(*shape, 2, D, dtype=dtype)
    sp = torch.randint(0, 8, (batch,), dtype=torch.int32) if start else None
    return q, k, sp, cu


ROPE_CASES = {
    # name: (format, interleaved, rotary_percent, (cp_size, cp_rank), start_positions, dtypes)
    "sbhd": ("sbhd", False, 1.0, (1, 0), False, ("fp32",)),
    "sbhd_cp": ("sbhd", False, 1.0, (2, 0), False, ("fp32",)),
    "bshd_interleaved_partial_start": ("bshd", True, 0.5, (1, 0), True, ("fp32", "fp16", "bf16")),
    "thd_start_cp": ("thd", False, 0.5, (2, 1), True, ("fp32",)),
}


@pytest.mark.parametrize("case, dtype_name", [(c, d) for c, v in ROPE_CASES.items() for d in v[-1]])
def test_rope(case, dtype_name):
    """rope_fwd, rope_fwd_qk, rope_bwd, rope_bwd_qk and RotaryPositionEmbedding in sbhd / bshd / thd (cu_seqlens),
    interleaved or not, partial rotary dims, start positions and context parallelism, from one export each."""
    fmt, interleaved, pct, cp, start, _ = ROPE_CASES[case]
    dtype = DTYPES[dtype_name]
    model = Rope(fmt, interleaved, pct, cp).eval()
    thd_lengths = [[8, 4, 12], [4], [16, 0, 4, 8]]  # global lengths, multiples of 2 * cp_size; one empty sequence
    args = _rope_inputs(fmt, 2, 6, dtype, start, cp[0], thd_lengths[0])
    seq_max = S_MAX // cp[0] - 8  # local positions + start offsets stay inside the fixed table
    if fmt == "thd":
        t, n = Dim("tokens"), Dim("seqs")
        dims = ({0: t}, {0: t}, {0: n} if start else None, {0: n + 1})
    else:  # under context parallelism the local length is even (each rank holds two halves)
        b = Dim("batch")
        s = 2 * Dim("half_seq", max=seq_max // 2) if cp[0] > 1 else Dim("seq", max=seq_max)
        seq_axis, batch_axis = (0, 1) if fmt == "sbhd" else (1, 0)
        dims = ({seq_axis: s, batch_axis: b}, {seq_axis: s, batch_axis: b}, {0: b} if start else None, None)
    onnx_model = Exported(model, args, dims)
    nodes = onnx_model.domains()
    assert sorted(op for d, op in nodes if d == "fused") == ["rope_bwd", "rope_bwd_qk", "rope_fwd", "rope_fwd_qk"]
    sizes = [dict(lengths=lens) for lens in thd_lengths] if fmt == "thd" else [
        dict(batch=bb, seq=ss) for bb, ss in ((2, 6), (1, 2 if cp[0] > 1 else 1), (3, 24), (2, seq_max))]
    for size in sizes:
        inputs = _rope_inputs(fmt, size.get("batch", 1), size.get("seq", 0), dtype, start, cp[0], size.get("lengths"))
        with torch.no_grad():
            want = model(*inputs)
        check_outputs(onnx_model(*inputs), want, dtype, f"{case} {dtype_name} {size}")


def test_rope_plain_operators():
    """The plain table: RoPE in standard operators only (bshd, interleaved, partial, start positions)."""
    model = Rope("bshd", True, 0.5).eval()
    b, s = Dim("batch"), Dim("seq", max=S_MAX - 8)
    onnx_model = Exported(model, _rope_inputs("bshd", 2, 6, F32, True, 1),
                          ({0: b, 1: s}, {0: b, 1: s}, {0: b}, None), custom_domain=False)
    assert all(d == "" for d, _ in onnx_model.domains()) and not onnx_model.proto.functions
    for batch, seq in ((2, 6), (1, 1), (3, 40)):
        inputs = _rope_inputs("bshd", batch, seq, F32, True, 1)
        with torch.no_grad():
            want = model(*inputs)
        check_outputs(onnx_model(*inputs), want, F32, f"plain bshd [{batch}, {seq}]")


# ------------------------------------------------------------------------------------------------------------------
# models: FusedCogVLM and a Hugging Face Llama patched by fused_ops.hf.apply_fused_ops


def cogvlm(dtype, layers=1):
    from fused_ops.models import CogVLMConfig, FusedCogVLM
    config = CogVLMConfig(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, layers=layers, dtype=dtype)
    model = FusedCogVLM(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-trivial norm scales and biases (they start at 1 and 0)
        for p in model.parameters():
            p.add_((0.1 * torch.randn(p.shape, generator=g)).to(dtype))
    return model


MODEL_SIZES = [(2, 9, "mixed"), (1, 1, "mixed"), (3, 30, "mixed"), (2, 5, "text"), (2, 5, "vision")]


@pytest.mark.parametrize("dtype_name, custom_domain", [("fp32", True), ("fp32", False), ("fp16", True)])
def test_fused_cogvlm(dtype_name, custom_domain):
    """FusedCogVLM (visual expert; 2 layers in float32, 1 otherwise) with dynamic batch and sequence: one route for
    all layers, fused QKV / RoPE / dense / MLP per layer, against eager at several sizes and masks."""
    dtype = DTYPES[dtype_name]
    layers = 2 if (dtype_name, custom_domain) == ("fp32", True) else 1
    model = cogvlm(dtype, layers)
    b, s = Dim("batch", max=64), Dim("seq", max=4096)
    x, mask = torch.randn(2, 9, 64, dtype=dtype), make_mask("mixed", 2, 9)
    onnx_model = Exported(model, (x, mask), ({0: b, 1: s}, {0: b, 1: s}), custom_domain)
    fused = sorted(op for d, op in onnx_model.domains() if d == "fused")
    per_layer = ["ffn"] * layers + ["linear_dual"] * 2 * layers + ["rope_fwd_qk"] * layers
    assert fused == ([] if not custom_domain else sorted(per_layer + ["route"])), fused
    for batch, seq, kind in MODEL_SIZES:
        x, mask = torch.randn(batch, seq, 64, dtype=dtype), make_mask(kind, batch, seq)
        with torch.no_grad():
            want = model(x, mask)
        check_outputs(onnx_model(x, mask), want, dtype, f"FusedCogVLM {dtype_name} [{batch}, {seq}] {kind}")


def test_fused_cogvlm_bfloat16():
    """bfloat16: the exported model is valid (ONNX checker with shape inference, fused nodes with their functions);
    ONNX Runtime's CPU provider refuses it only for bfloat16 arithmetic of torch's own nodes (attention, norms), not
    for a fused node; ONNX's reference evaluator runs it (functions inlined) and matches eager."""
    model = cogvlm(BF16)
    b, s = Dim("batch", max=64), Dim("seq", max=4096)
    x, mask = torch.randn(2, 9, 64, dtype=BF16), make_mask("mixed", 2, 9)
    program = fonnx.export(model, (x, mask), dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}), verbose=False)
    proto = program.model_proto
    onnx.checker.check_model(proto, full_check=True)
    assert {("fused", "ffn"), ("fused", "linear_dual"), ("fused", "route"), ("fused", "rope_fwd_qk")} <= {
        (n.domain, n.op_type) for n in proto.graph.node}
    with pytest.raises(Exception, match="NOT_IMPLEMENTED") as refused:
        ort.InferenceSession(proto.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    node = str(refused.value).split("with name '")[-1].split("'")[0]
    assert node and not any(n.name == node and n.domain == "fused" for n in proto.graph.node), str(refused.value)
    evaluator = ReferenceEvaluator(onnx.inliner.inline_local_functions(proto))
    for batch, seq, kind in MODEL_SIZES[:3]:
        x, mask = torch.randn(batch, seq, 64, dtype=BF16), make_mask(kind, batch, seq)
        (out,) = evaluator.run(None, {"x": x.view(torch.int16).numpy().view(ml_dtypes.bfloat16), "mask": mask.numpy()})
        got = torch.from_numpy(np.asarray(out).view(np.uint16).copy()).view(BF16)
        with torch.no_grad():
            check_outputs([got], model(x, mask), BF16, f"FusedCogVLM bf16 reference evaluator [{batch}, {seq}]")


class _HiddenStates(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).last_hidden_state


def test_hf_llama_patched():
    """A Hugging Face Llama patched by fused_ops.hf.apply_fused_ops (fused MLP and q/k RoPE) exports with dynamic
    batch and sequence and matches the patched model in eager (the plain form of the same ops: the tests above)."""
    transformers = pytest.importorskip("transformers")
    from fused_ops import hf
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaModel(config).eval()
    report = hf.apply_fused_ops(model)
    assert report.rope and len(report.mlp_layers) == 2, str(report)
    wrapped = _HiddenStates(model).eval()
    b, s = Dim("batch", max=64), Dim("seq", max=256)
    onnx_model = Exported(wrapped, (torch.randint(2, 128, (2, 9)),), ({0: b, 1: s},))
    fused = sorted(op for d, op in onnx_model.domains() if d == "fused")
    assert fused == ["ffn"] * 2 + ["rope_fwd_qk"] * 2, fused
    for batch, seq in ((2, 9), (1, 1), (3, 20)):
        ids = torch.randint(2, 128, (batch, seq))
        with torch.no_grad():
            want = wrapped(ids)
        check_outputs(onnx_model(ids), want, F32, f"HF Llama [{batch}, {seq}]")


# ------------------------------------------------------------------------------------------------------------------
# the two-step path, and what cannot be expressed


def test_table_then_attach_functions():
    """torch.onnx.export with translation_table(custom_domain=True) leaves bodiless fused nodes (torch's opset
    conversion would inline any function added during translation); attach_functions adds the bodies."""
    model = fused_ops.FusedSwiGLU(H, I).eval()
    x = torch.randn(2, 5, H)
    program = torch.onnx.export(model, (x,), dynamo=True, dynamic_shapes=({0: Dim("b"), 1: Dim("s")},),
                                verbose=False, custom_translation_table=fonnx.translation_table(custom_domain=True))
    assert [(n.domain, n.op_type) for n in program.model.graph] == [("fused", "ffn")] and not program.model.functions
    fonnx.attach_functions(program.model)
    (fn,) = program.model.functions.values()
    assert (fn.domain, fn.name, fn.overload) == ("fused", "ffn", "single")
    assert program.model.opset_imports["fused"] == 1 and program.model.ir_version >= 10
    onnx.checker.check_model(program.model_proto, full_check=True)
    session = ort.InferenceSession(program.model_proto.SerializeToString(), session_options(),
                                   providers=["CPUExecutionProvider"])
    x = torch.randn(3, 11, H)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        check_outputs([torch.from_numpy(out)], model(x), F32, "FusedSwiGLU after attach_functions")


def _value(dtype=onnxscript.ir.DataType.FLOAT, name="v"):
    return onnxscript.ir.Value(name=name, type=onnxscript.ir.TensorType(dtype))


@pytest.mark.parametrize("custom_domain", [True, False])
def test_translation_errors_name_the_argument(custom_domain):
    table = fonnx.translation_table(custom_domain)
    rope = table[torch.ops.fused.rope_fwd.default]
    t, freqs = _value(name="t"), _value(name="freqs")
    with pytest.raises(ValueError, match="tensor_format must be 'sbhd', 'bshd' or 'thd', got 'bhsd'"):
        rope(t, freqs, "bhsd")
    with pytest.raises(ValueError, match="cu_seqlens is required with tensor_format='thd'"):
        rope(t, freqs, tensor_format="thd")
    with pytest.raises(ValueError, match="cp_size must be a constant int at export time"):
        rope(t, freqs, cp_size=_value(onnxscript.ir.DataType.INT64))  # a size computed in the graph
    with pytest.raises(ValueError, match="freqs must be float32"):
        rope(t, _value(onnxscript.ir.DataType.FLOAT16))
    with pytest.raises(ValueError, match="rope_fwd_qk: k must be a float32, float16, bfloat16 or float64 tensor"):
        table[torch.ops.fused.rope_fwd_qk.default](t, _value(onnxscript.ir.DataType.INT32), freqs)
    ffn = table[torch.ops.fused.ffn.default]
    w = _value()
    with pytest.raises(ValueError, match="ffn: give mask with all of u1, u3, u2"):
        ffn(t, w, w, w, _value(onnxscript.ir.DataType.BOOL), w)
    with pytest.raises(ValueError, match="linear_dual: x must be a float32"):
        table[torch.ops.fused.linear_dual.default](_value(onnxscript.ir.DataType.INT64), w, w, w)


def test_export_refusals():
    with pytest.raises(ValueError, match="dynamo must be True"):
        fonnx.export(fused_ops.FusedSwiGLU(H, I), (torch.randn(2, H),), dynamo=False)

    class InPlace(nn.Module):
        def forward(self, t, freqs):
            torch.ops.fused.rope_fwd_(t, freqs)
            return t

    with pytest.raises(ValueError, match=r"rope_fwd_ \(in place\) cannot be exported"):
        fonnx.export(InPlace(), (torch.randn(4, 2, 2, D), torch.randn(8, 1, 1, D)), verbose=False)
