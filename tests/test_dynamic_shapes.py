"""Dynamic shapes: every op's Meta kernel and input checks keep batch, sequence and token counts symbolic, so one
torch.export program (and one torch.compile graph) serves every size.

Per op, a small module that calls it is exported with dynamic dims (torch.export.Dim). Export raises when a shape
function or a check specializes a dim to the traced size, and narrows a dim's range when a check guards it: so the
exported program must keep each declared range, run at other sizes (1 token, the largest of the range, and between)
and equal the eager op there. The checks the kernels really need stay guards, tested here too: the positions a
sequence needs must fit in freqs, an even local length under context parallelism, one length for x and mask.

The block-level paths (export saved and loaded, AOTInductor from Python and C++, torch.compile(dynamic=True) without
recompiling) are in tests/test_deploy_pt2.py and tests/test_cmake_build.py.
"""
import pytest
import torch
from torch.export import Dim

import fused_ops  # noqa: F401  (registers the ops)
from reference_routed import make_mask

OPS = torch.ops.fused
K, N, H, I, HEADS, D, D2, S_MAX = 16, 24, 16, 40, 3, 8, 6, 64
BATCH, SEQ = Dim("batch", min=1, max=64), Dim("seq", min=1, max=S_MAX)
SAMPLE = (2, 8)  # the traced size (export specializes sizes 0 and 1 of a sample: it must be neither)
SIZES = ((1, 1), (3, 7), (64, 1), (1, S_MAX), (5, 33))


def rand(*shape):
    return torch.randn(*shape)


class Call(torch.nn.Module):
    """The module that export traces: `fn(*inputs)`."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def export(fn, inputs, dims):
    """torch.export of fn(*inputs), dims: one dynamic-shapes spec per input."""
    return torch.export.export(Call(fn), tuple(inputs), dynamic_shapes=(tuple(dims),))  # (forward's *inputs)


# ------------------------------------------------------------------------------------------------------------------
# the cases: (ops covered, fn, inputs(b, s), dynamic_shapes). Weights and freqs are static; batch and sequence are not.

ROWS = {0: BATCH, 1: SEQ}  # x / mask [b, s, ...]
W = torch.Generator().manual_seed(7)
WV, WT, BV = torch.randn(N, K, generator=W), torch.randn(N, K, generator=W), torch.randn(N, generator=W)
W1, W3, W2 = (torch.randn(I, H, generator=W), torch.randn(I, H, generator=W), torch.randn(H, I, generator=W))
U1, U3, U2 = (torch.randn(I, H, generator=W), torch.randn(I, H, generator=W), torch.randn(H, I, generator=W))
FREQS = torch.randn(S_MAX, 1, 1, D2, generator=W)


def routed_inputs(b, s, c):
    return rand(b, s, c), make_mask("random", (b, s))


def ffn_saved_bwd(g, x, m):
    """ffn_forward's gate_up handed to ffn_backward, as ffn's autograd does."""
    routing = OPS.route(m)
    _, gate_up = OPS.ffn_forward(x, W1, W3, W2, m, U1, U3, U2, routing=routing)
    return OPS.ffn_backward(g, x, W1, W3, W2, m, U1, U3, U2, routing=routing, gate_up=gate_up)


def linear_dual_bwd(g, x, mask):
    routing = OPS.linear_dual_forward(x, mask, WV, WT)[1]
    gx, _, gwt, gbv, _ = OPS.linear_dual_backward(g, x, mask, WV, WT, output_mask=[True, False, True, True, False],
                                                   routing=routing)
    return gx, gwt, gbv


def rope_inplace(t):
    out = t.clone()
    OPS.rope_fwd_(out, FREQS, "sbhd", True)
    return out


def start_positions(b, s):
    """int32 [b]: positions from which each sequence of length s still fits in FREQS."""
    return torch.randint(0, S_MAX - s + 1, (b,), dtype=torch.int32)


def thd_inputs(b, s):
    """b packed sequences of lengths around s (the total is b * s), their cu_seqlens."""
    lens = torch.full((b,), s, dtype=torch.int32)
    if b > 1 and s > 1:
        lens[0] -= 1
        lens[1] += 1
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])
    return rand(b * s, HEADS, D), cu


def attention_inputs(b, s):
    """decode_attention: one new token per sequence (GQA 2:1) against caches of capacity s, ragged lengths < s."""
    return (rand(b, 1, 4, D), rand(b, 2, s, D), rand(b, 2, s, D), rand(b, 1, 2, D), rand(b, 1, 2, D),
            torch.randint(0, s, (b,), dtype=torch.int32))


def decode_attention(q, k_cache, v_cache, k_new, v_new, lens):
    """The op on copies of the caches, returned too: its cache writes are compared as outputs."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    return OPS.decode_attention(q, k_cache, v_cache, k_new, v_new, lens), k_cache, v_cache


W_NORM = rand(H)
CACHE = {0: BATCH, 2: SEQ}  # [b, kv heads, capacity, d]
NSEQ = Dim("nseq", min=1, max=64)
CASES = {
    "route": (("route",), lambda m: OPS.route(m), lambda b, s: (make_mask("random", (b, s)),), (ROWS,)),
    "linear_dual": (("linear_dual",), lambda x, m: OPS.linear_dual(x, m, WV, WT, BV, None),
                    lambda b, s: routed_inputs(b, s, K), (ROWS, ROWS)),
    "linear_dual_routing": (("route", "linear_dual"), lambda x, m: OPS.linear_dual(x, m, WV, WT, routing=OPS.route(m)),
                            lambda b, s: routed_inputs(b, s, K), (ROWS, ROWS)),
    "linear_dual_forward": (("linear_dual_forward",), lambda x, m: OPS.linear_dual_forward(x, m, WV, WT, None, BV),
                            lambda b, s: routed_inputs(b, s, K), (ROWS, ROWS)),
    "linear_dual_backward": (("linear_dual_forward", "linear_dual_backward"), linear_dual_bwd,
                             lambda b, s: (rand(b, s, N),) + routed_inputs(b, s, K), (ROWS, ROWS, ROWS)),
    "ffn_single": (("ffn",), lambda x: OPS.ffn(x, W1, W3, W2), lambda b, s: (rand(b, s, H),), (ROWS,)),
    "ffn_dual_routing": (("route", "ffn"), lambda x, m: OPS.ffn(x, W1, W3, W2, m, U1, U3, U2, routing=OPS.route(m)),
                         lambda b, s: routed_inputs(b, s, H), (ROWS, ROWS)),
    "ffn_backward_dual": (("route", "ffn_backward"),
                          lambda g, x, m: OPS.ffn_backward(g, x, W1, W3, W2, m, U1, U3, U2, routing=OPS.route(m)),
                          lambda b, s: (rand(b, s, H),) + routed_inputs(b, s, H), (ROWS, ROWS, ROWS)),
    "ffn_forward_backward_dual": (("route", "ffn_forward", "ffn_backward"), ffn_saved_bwd,
                                  lambda b, s: (rand(b, s, H),) + routed_inputs(b, s, H), (ROWS, ROWS, ROWS)),
    "ffn_backward_single": (("ffn_backward",),
                            lambda g, x: OPS.ffn_backward(g, x, W1, W3, W2, output_mask=[True] * 4 + [False] * 3)[:4],
                            lambda b, s: (rand(b, s, H), rand(b, s, H)), (ROWS, ROWS)),
    # sbhd [s, b, h, d] / bshd [b, s, h, d]; freqs of S_MAX positions: the sequence fits (SEQ's max is S_MAX)
    "rope_fwd_sbhd": (("rope_fwd",), lambda t: OPS.rope_fwd(t, FREQS, "sbhd"),
                      lambda b, s: (rand(s, b, HEADS, D),), ({0: SEQ, 1: BATCH},)),
    "rope_bwd_bshd_start": (("rope_bwd",),
                            lambda t, p: OPS.rope_bwd(t, FREQS, "bshd", start_positions=p),
                            lambda b, s: (rand(b, s, HEADS, D), start_positions(b, s)),
                            (ROWS, {0: BATCH})),
    "rope_fwd_inplace": (("rope_fwd_",), rope_inplace, lambda b, s: (rand(s, b, HEADS, D),), ({0: SEQ, 1: BATCH},)),
    "rope_qk_gqa": (("rope_fwd_qk", "rope_bwd_qk"),
                    lambda q, k: OPS.rope_bwd_qk(*OPS.rope_fwd_qk(q, k, FREQS, "bshd", True), FREQS, "bshd", True),
                    lambda b, s: (rand(b, s, HEADS, D), rand(b, s, 1, D)), (ROWS, ROWS)),
    # thd: the token count and the number of sequences both vary (cu_seqlens [nseq + 1])
    "rms_norm": (("rms_norm",), lambda x: OPS.rms_norm(x, W_NORM, 1e-6), lambda b, s: (rand(b, s, H),), (ROWS,)),
    "decode_attention": (("decode_attention",), decode_attention, attention_inputs,
                         ({0: BATCH}, CACHE, CACHE, {0: BATCH}, {0: BATCH}, {0: BATCH})),
    "rope_fwd_thd": (("rope_fwd",), lambda t, cu: OPS.rope_fwd(t, FREQS, "thd", cu_seqlens=cu), thd_inputs,
                     ({0: Dim("tokens", min=1, max=64 * S_MAX)}, {0: NSEQ + 1})),
}


def test_every_tensor_op_has_a_dynamic_case():
    names = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("fused::")}
    tensor_ops = {n for n in names
                  if any(isinstance(a.type, torch.TensorType) for a in getattr(OPS, n).default._schema.arguments)}
    covered = {op for ops, *_ in CASES.values() for op in ops}
    assert tensor_ops - covered == set(), "ops without a dynamic-shape case"


def as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_with_dynamic_dims_serves_every_size(name):
    _, fn, make, dims = CASES[name]
    exported = export(fn, make(*SAMPLE), dims)
    # every declared range kept (a check that guarded a size would have narrowed it, or raised)
    declared = {(d.min, d.max) for spec in dims for d in spec.values() if hasattr(d, "min")}
    kept = {(int(r.lower), int(r.upper)) for r in exported.range_constraints.values()}
    assert declared <= kept, (declared, kept)
    runner = exported.module()
    for b, s in SIZES:
        inputs = make(b, s)
        want, got = as_list(fn(*inputs)), as_list(runner(*inputs))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w), (name, b, s)


# ------------------------------------------------------------------------------------------------------------------
# guards that stay: what the kernels need


def test_sequence_longer_than_freqs_is_a_guard():
    """freqs holds S_MAX positions: a sequence Dim allowed beyond it cannot be exported; export says the max to use."""
    _, fn, make, _ = CASES["rope_fwd_sbhd"]
    seq = Dim("seq", min=1, max=4 * S_MAX)
    with pytest.raises(torch._dynamo.exc.UserError, match=rf"seq = Dim\('seq', max={S_MAX}\)"):  # (the suggested fix)
        export(fn, make(*SAMPLE), ({0: seq, 1: BATCH},))


def test_context_parallel_needs_an_even_local_length():
    """Under context parallelism the kernel splits each local sequence in halves: an odd length is refused at export
    (the guard of the check), and a length declared as 2 * half exports and runs at every even length."""
    fn = lambda t: OPS.rope_fwd(t, FREQS, "sbhd", cp_size=2, cp_rank=1)  # noqa: E731
    t = rand(8, 2, HEADS, D)
    with pytest.raises(torch._dynamo.exc.UserError, match=r"% 2\) == 0"):
        export(fn, (t,), ({0: Dim("seq", min=1, max=S_MAX // 2), 1: BATCH},))
    half = Dim("half", min=1, max=S_MAX // 4)
    runner = export(fn, (t,), ({0: 2 * half, 1: BATCH},)).module()
    for s in (2, 6, S_MAX // 2):
        t = rand(s, 3, HEADS, D)
        assert torch.equal(runner(t), fn(t))
    with pytest.raises(AssertionError, match="% 2 == 0"):  # the exported program's input check
        runner(rand(7, 3, HEADS, D))


def test_mask_length_must_be_x_length():
    """x and mask with independent dims: the op's check keeps them equal, which export reports (use one Dim)."""
    _, fn, make, _ = CASES["linear_dual"]
    other = Dim("mask_batch", min=1, max=64)
    with pytest.raises(torch._dynamo.exc.UserError, match="mask_batch = batch"):  # (export's suggested fix)
        export(fn, make(*SAMPLE), (ROWS, {0: other, 1: SEQ}))
