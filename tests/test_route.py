"""Tests of `torch.ops.fused.route` / `fused_ops.route` and of the `routing` argument of the routed ops: a mask's
routing computed once and shared by linear_dual and ffn (forward and backward) on the same mask.

The routing's layout is written out here from its definition (csrc/ops/routed_gemm.h, shared_routing_size): the
aligned routing (linear_dual_forward's layout) in the first section, the unaligned one from unaligned_section(M).
Given a routing, every op must return what it returns routing the mask itself, bit for bit (the same kernels read
the same perm / seg); tests/test_linear_dual_ops.py and tests/test_ffn_ops.py check those results against float64.
"""
import pytest
import torch

import fused_ops
from device_helpers import poison_allocator, requested_bytes, sync
from reference_routed import MASK_KINDS, ffn_reference, linear_dual_reference, make_mask, rel_err, strided_view
from test_ffn_ops import make_weights as ffn_weights
from test_linear_dual_ops import make_weights as linear_dual_weights
from test_linear_dual_ops import routing_reference, split_routing

OPS = torch.ops.fused
ERR = (RuntimeError, ValueError)
SEG_SLOTS, ALIGN, ROW_TAIL = 8, 128, 128
#: the op of this file; tests/test_rope_ops.py checks that every op of the namespace has an opcheck case
OPCHECKED = ["route"]


def unaligned_section(M):
    return -(-(SEG_SLOTS + M + 2 * ALIGN) // 4) * 4


def route_reference(mask):
    """The entries of route(mask) the kernels read, from the definition: {name: int32 tensor}. Aligned: linear_dual
    _forward's routing (test_linear_dual_ops.routing_reference). Unaligned: seg = [0, count_0, M, count_0, count_1],
    perm of M + 128 entries, text rows in token order, then vision rows, then -1."""
    m = mask.reshape(-1).cpu()
    M = m.numel()
    text, vision = (~m).nonzero().flatten().tolist(), m.nonzero().flatten().tolist()
    seg, perm = routing_reference(m)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return {"seg": seg, "perm": perm, "seg_u": as_t([0, len(text), M, len(text), len(vision)]),
            "perm_u": as_t(text + vision + [-1] * ROW_TAIL)}


def split_route(routing, M):
    r = routing.cpu()
    u = unaligned_section(M)
    seg, perm = split_routing(r, M)
    return {"seg": seg, "perm": perm, "seg_u": r[u:u + 5], "perm_u": r[u + SEG_SLOTS:u + SEG_SLOTS + M + ROW_TAIL]}


# M = 0, 1, odd M; on CUDA M <= 4096 route in one launch per layout and 5000 in two (count, scatter)
ROUTE_SIZES = [0, 1, 37, 300, 1500, 4096, 5000]


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("M", ROUTE_SIZES)
def test_route_layout(device, mask_kind, M):
    """route(mask): int32, contiguous, shared_routing_size(M) long, every entry the kernels read as defined, and -1 in
    every other entry, so that CUDA and CPU agree entry for entry (the allocator is poisoned first, so an unwritten
    entry shows)."""
    mask = make_mask(mask_kind, (M,), device)
    poison_allocator(device, 8 * (2 * M + 512))
    routing = fused_ops.route(mask)
    assert routing.dtype == torch.int32 and routing.device == mask.device and routing.is_contiguous()
    assert routing.shape == (unaligned_section(M) + SEG_SLOTS + M + ROW_TAIL,)
    got, want = split_route(routing, M), route_reference(mask)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: {got[name].tolist()[:12]} != {want[name].tolist()[:12]}"
    used = torch.zeros(routing.numel(), dtype=torch.bool)
    u = unaligned_section(M)
    for lo, n in ((0, 5), (SEG_SLOTS, len(want["perm"])), (u, 5), (u + SEG_SLOTS, len(want["perm_u"]))):
        used[lo:lo + n] = True
    assert bool((routing.cpu()[~used] == -1).all()), "an entry the routing does not use is not -1"


def test_route_takes_any_mask_shape(device):
    mask = make_mask("random", (3, 5, 7), device)
    assert torch.equal(fused_ops.route(mask), fused_ops.route(mask.reshape(-1)))
    t = mask.transpose(0, 2)  # not contiguous: routed in its logical (row-major) order
    assert torch.equal(fused_ops.route(t), fused_ops.route(t.contiguous()))


def test_route_rejects_a_mask_that_is_not_bool(device):
    with pytest.raises(ERR, match="route: mask must be a bool tensor"):
        fused_ops.route(torch.ones(5, dtype=torch.int32, device=device))


# ----------------------------------------------------------------------------------------------------------------
# the routed ops given the routing: the same results, forward and backward


def grads_of(fn, leaves, g):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    return [out] + list(torch.autograd.grad(out, leaves, g))


# (M, K, N) / (M, H, I): decode sizes (the gather GEMMs that read the routing instead of routing), mid and the
# one-launch limit, and past it; K, N, H, I multiples of 16 elements so that sm_90 takes the TMA kernels
OP_SHAPES = [(1, 64, 48), (37, 64, 48), (300, 64, 48), (4096, 32, 16), (5000, 32, 16)]


@pytest.mark.parametrize("mask_kind", ["random", "all_true", "span"])
@pytest.mark.parametrize("M, K, N", OP_SHAPES, ids=str)
def test_linear_dual_with_routing(device, mask_kind, M, K, N):
    """linear_dual with routing = route(mask) or linear_dual_forward's routing: the output and every gradient (autograd,
    which then saves the routing given) equal those of the op routing the mask itself; the output matches float64."""
    dtype = torch.bfloat16
    mask = make_mask(mask_kind, (M,), device)
    x = strided_view((M,), K, dtype, device)
    wv, wt, bv, bt = linear_dual_weights(N, K, dtype, device)
    g = strided_view((M,), N, dtype, device)
    want = grads_of(lambda x_, wv_, wt_, bv_, bt_: OPS.linear_dual(x_, mask, wv_, wt_, bv_, bt_), (x, wv, wt, bv, bt),
                    g)
    for routing in (fused_ops.route(mask), OPS.linear_dual_forward(x, mask, wv, wt)[1]):
        got = grads_of(lambda x_, wv_, wt_, bv_, bt_: OPS.linear_dual(x_, mask, wv_, wt_, bv_, bt_, routing=routing),
                       (x, wv, wt, bv, bt), g)
        for name, a, b in zip(("out", "grad_x", "grad_weight_v", "grad_weight_t", "grad_bias_v", "grad_bias_t"),
                              got, want):
            assert torch.equal(a, b), f"{name} differs with a routing of {routing.numel()} entries"
        with torch.no_grad():
            assert torch.equal(OPS.linear_dual(x, mask, wv, wt, bv, bt, routing=routing), want[0])
    assert rel_err(want[0], linear_dual_reference(x, mask, wv, wt, bv, bt)) < 1e-2


@pytest.mark.parametrize("mask_kind", ["random", "all_false", "vision90"])
@pytest.mark.parametrize("M, H, I", OP_SHAPES, ids=str)
def test_ffn_with_routing(device, mask_kind, M, H, I):  # noqa: E741
    """The dual-expert ffn with routing = route(mask): the output and every gradient equal those of the op routing
    the mask itself (the forward reads the unaligned section on sm_90's TMA path, the backward the aligned one)."""
    dtype = torch.bfloat16
    mask = make_mask(mask_kind, (M,), device)
    x = strided_view((M,), H, dtype, device)
    w = ffn_weights(H, I, dtype, device)
    g = strided_view((M,), H, dtype, device)
    order = ("w1", "w3", "w2", "u1", "u3", "u2")

    def run(routing):
        def f(x_, w1, w3, w2, u1, u3, u2):
            return OPS.ffn(x_, w1, w3, w2, mask, u1, u3, u2, routing=routing)
        return grads_of(f, [x] + [w[k] for k in order], g)

    want, got = run(None), run(fused_ops.route(mask))
    for name, a, b in zip(("out", "grad_x") + tuple("grad_" + k for k in order), got, want):
        assert torch.equal(a, b), f"{name} differs with the routing given"
    ref = ffn_reference(x, w["w1"], w["w3"], w["w2"], mask, w["u1"], w["u3"], w["u2"])
    assert rel_err(want[0], ref) < 1e-2


def test_modules_take_the_routing(device):
    """DualLinear and DualExpertSwiGLU pass `routing` through; one routing serves both, as in a model's layers."""
    H = 32
    mask = make_mask("random", (3, 15), device)
    lin = fused_ops.DualLinear(H, H, device=device, dtype=torch.bfloat16)
    mlp = fused_ops.DualExpertSwiGLU(H, 48, device=device, dtype=torch.bfloat16)
    x = strided_view((3, 15), H, torch.bfloat16, device)
    routing = fused_ops.route(mask)
    with torch.no_grad():
        assert torch.equal(mlp(lin(x, mask, routing), mask, routing), mlp(lin(x, mask), mask))
        assert torch.equal(fused_ops.linear_dual(x, mask, lin.weight_v, lin.weight_t, lin.bias_v, lin.bias_t,
                                                 routing=routing), lin(x, mask))


# ----------------------------------------------------------------------------------------------------------------
# bad routings


def test_routing_errors(device):
    """A routing of the wrong dtype, rank, length or strides, a routing for the single-expert ffn, and (on the CPU,
    where the contents are checked) the routing of another mask: errors naming `routing`."""
    M, K, N = 37, 32, 16
    mask = make_mask("random", (M,), device)
    x = torch.randn(M, K, device=device)
    wv, wt, _, _ = linear_dual_weights(N, K, torch.float32, device)
    w = ffn_weights(K, 48, torch.float32, device)
    good = fused_ops.route(mask)
    lin = lambda r: OPS.linear_dual(x, mask, wv, wt, routing=r)  # noqa: E731
    mlp = lambda r: OPS.ffn(x, w["w1"], w["w3"], w["w2"], mask, w["u1"], w["u3"], w["u2"], routing=r)  # noqa: E731
    for op in (lin, mlp):
        with pytest.raises(ERR, match="routing must be a 1-D int32 tensor"):
            op(good.long())
        with pytest.raises(ERR, match="routing must be a 1-D int32 tensor"):
            op(good.view(1, -1))
        with pytest.raises(ERR, match=f"routing must have {good.numel()} elements"):
            op(fused_ops.route(make_mask("random", (M + 1,), device)))
        with pytest.raises(ERR, match="routing must be contiguous"):
            op(torch.zeros(2 * good.numel(), dtype=torch.int32, device=device)[::2])
    # linear_dual_forward's (aligned-only) routing serves linear_dual, not the ffn forward (no unaligned section)
    with pytest.raises(ERR, match=r"routing must have \d+ elements \(fused.route\)"):
        mlp(OPS.linear_dual_forward(x, mask, wv, wt)[1])
    with pytest.raises(ERR, match="only the dual-expert ffn is routed"):
        OPS.ffn(x, w["w1"], w["w3"], w["w2"], routing=good)
    if device == "cpu":
        other = fused_ops.route(~mask)
        for op in (lin, mlp):
            with pytest.raises(ERR, match="routing is not the routing of this mask"):
                op(other)
        g = torch.randn(M, N)
        with pytest.raises(ERR, match="routing is not the routing of this mask"):
            OPS.linear_dual_backward(g, x, mask, wv, wt, routing=other)
        with pytest.raises(ERR, match="routing is not the routing of this mask"):
            OPS.ffn_backward(torch.randn(M, K), x, w["w1"], w["w3"], w["w2"], mask, w["u1"], w["u3"], w["u2"],
                             routing=other)


@pytest.mark.gpu
def test_routing_on_another_device_raises(gpu_device):
    M, K, N = 20, 32, 16
    mask = make_mask("random", (M,), gpu_device)
    x = torch.randn(M, K, device=gpu_device)
    wv, wt, _, _ = linear_dual_weights(N, K, torch.float32, gpu_device)
    with pytest.raises(ERR, match="routing must be on x's device"):
        OPS.linear_dual(x, mask, wv, wt, routing=fused_ops.route(mask.cpu()))


# ----------------------------------------------------------------------------------------------------------------
# graph tools: opcheck, Meta, TorchScript, torch.compile


def test_opcheck():
    for mask in (make_mask("random", (6,)), make_mask("span", (2, 9)), make_mask("random", (0,))):
        torch.library.opcheck(OPS.route.default, (mask,))
    M, K, N = 6, 5, 3
    mask = make_mask("random", (M,))
    routing = fused_ops.route(mask)
    torch.library.opcheck(OPS.linear_dual.default, (torch.randn(M, K, requires_grad=True), mask,
                                                    torch.randn(N, K, requires_grad=True), torch.randn(N, K)),
                          dict(routing=routing))
    w = [torch.randn(4, K, requires_grad=True), torch.randn(4, K), torch.randn(K, 4, requires_grad=True)]
    torch.library.opcheck(OPS.ffn.default, (torch.randn(M, K, requires_grad=True), *w, mask, *w),
                          dict(routing=routing))


def test_meta():
    mask = torch.empty(4, 9, dtype=torch.bool, device="meta")
    r = OPS.route(mask)
    assert r.device.type == "meta" and r.dtype == torch.int32 and r.shape == (unaligned_section(36) + 8 + 36 + 128,)
    x = torch.empty(4, 9, 16, device="meta")
    w = torch.empty(8, 16, device="meta")
    assert OPS.linear_dual(x, mask, w, w, routing=r).shape == (4, 9, 8)
    with pytest.raises(ERR, match="routing must have"):
        OPS.linear_dual(x, mask, w, w, routing=r[1:].contiguous())


def test_torchscript_and_compile_share_one_routing():
    """A scripted and a compiled (fullgraph) function that route once and pass the routing to both ops, with
    gradients, equal the eager ops that route for themselves."""
    M, H = 23, 16
    mask = make_mask("random", (M,))
    lin = fused_ops.DualLinear(H, H)
    mlp = fused_ops.DualExpertSwiGLU(H, 24)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.mlp = lin, mlp

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            routing = fused_ops.route(mask)
            return self.mlp(self.lin(x, mask, routing), mask, routing)

    x = torch.randn(M, H, requires_grad=True)
    want = mlp(lin(x, mask), mask)
    gwant = torch.autograd.grad(want.sum(), (x, lin.weight, mlp.w2))
    torch._dynamo.reset()
    for fn in (torch.jit.script(Block()), torch.compile(Block(), fullgraph=True, backend="aot_eager")):
        got = fn(x, mask)
        assert torch.equal(got, want)
        for a, b in zip(torch.autograd.grad(got.sum(), (x, lin.weight, mlp.w2)), gwant):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------------------
# GPU: memory, CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["random", "vision90"])
def test_ffn_forward_peak_memory_with_routing(gpu_device, mask_kind):
    """Given the routing, the dual ffn forward on the TMA path (sm_90) allocates one [M, I] intermediate and nothing
    else (routing the mask itself it also allocates perm / seg: tests/test_ffn_ops.py::test_forward_peak_memory)."""
    if torch.cuda.get_device_capability(gpu_device) != (9, 0):
        pytest.skip("the bound holds on the TMA path (sm_90); the pointer kernels keep h padded per expert")
    M, H, I = 1000, 512, 1536  # noqa: E741
    dtype = torch.bfloat16
    mlp = fused_ops.DualExpertSwiGLU(H, I, device=gpu_device, dtype=dtype)
    x = strided_view((M,), H, dtype, gpu_device)
    mask = make_mask(mask_kind, (M,), gpu_device)
    routing = fused_ops.route(mask)
    with torch.no_grad():
        mlp(x, mask, routing)  # warm: the library's one-time allocations happen before the measurement
        poison_allocator(gpu_device, 4 * M * I)
        sync(gpu_device)
        torch.cuda.reset_peak_memory_stats(gpu_device)
        base = requested_bytes(gpu_device)
        out = mlp(x, mask, routing)
        sync(gpu_device)
    extra = requested_bytes(gpu_device, "peak") - base - out.untyped_storage().nbytes()
    bound = -(-(M * I * 2) // 512) * 512  # the caching allocator's granularity
    assert extra <= bound, f"peak extra {extra} B > {bound} B (h [M, I] = {M * I * 2} B)"
    with torch.no_grad():
        assert torch.equal(out, mlp(x, mask))


@pytest.mark.gpu
def test_cuda_graph_routes_once(gpu_device):
    """route, linear_dual and the ffn captured in one CUDA graph that routes once; replays with new masks copied into
    the static mask match float64 (the routing is recomputed by the replay, not kept from the capture)."""
    torch.cuda.set_device(gpu_device)
    M, H, I = 700, 128, 256  # noqa: E741
    dtype = torch.bfloat16
    lin = fused_ops.DualLinear(H, H, device=gpu_device, dtype=dtype)
    mlp = fused_ops.DualExpertSwiGLU(H, I, device=gpu_device, dtype=dtype)
    x = strided_view((M,), H, dtype, gpu_device)
    mask = make_mask("random", (M,), gpu_device)

    def block():
        routing = fused_ops.route(mask)
        y = lin(x, mask, routing)
        return y, mlp(y, mask, routing)

    stream = torch.cuda.Stream(gpu_device)
    stream.wait_stream(torch.cuda.current_stream(gpu_device))
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):
            block()
    torch.cuda.current_stream(gpu_device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
        y, out = block()
    for kind in ("all_true", "span", "all_false", "vision90", "random"):
        mask.copy_(make_mask(kind, (M,), gpu_device))
        graph.replay()
        torch.cuda.synchronize(gpu_device)
        w_t, w_v = lin.weight.unbind(0)
        b_t, b_v = lin.bias.unbind(0)
        assert rel_err(y, linear_dual_reference(x, mask, w_v, w_t, b_v, b_t)) < 1e-2, kind
        u1, w1 = mlp.w1.unbind(0)
        u3, w3 = mlp.w3.unbind(0)
        u2, w2 = mlp.w2.unbind(0)
        assert rel_err(out, ffn_reference(y, w1, w3, w2, mask, u1, u3, u2)) < 1e-2, kind
