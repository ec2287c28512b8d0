"""The performance matrix: every op on the shapes real models run, each cell a ratio to its anchor in the same run.

    python benchmarks/bench_matrix.py --out DIR [--full] [--ops linear_fwd,ffn_fwd,...] [--budget-s 300]
    python benchmarks/bench_matrix.py --dry-run          # the cells it would measure (no GPU needed)

Models (projections from their configs; Mistral-7B's equal Llama-3-8B's and are measured once):
  Llama-3-8B, Llama-3-70B (one tensor-parallel-8 slice), CogVLM2-19B (QKV 4096 -> 12288), Qwen2.5-7B, Mistral-7B.
Tokens M in {1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384}; masks rand50, span (one image span of 28% of the
tokens), vision10, vision90, all_text. The default grid measures every shape at every M with rand50, and the other
masks at M = 1, 2048 and 8192; --full measures every mask at every M. Each cell's random mask is seeded by its shape,
M and mask kind (cell_generator): the same in every run, whichever ops run.

Ops and anchors. The anchor of a compute cell (M > 64) is cuBLAS doing the op's useful work: per expert that has
tokens, the GEMMs over that expert's rows, already gathered into contiguous tensors (the gather is not timed), with
that expert's weights; it is timed in the same run, paired call by call with the op (benchmarks/common.bench_pair):
  linear_fwd   linear_dual forward (the op routes the mask)      / F.linear(x_e, W_e) per expert
  linear_bwd   linear_dual_backward (dx, dW of both experts)     / dx_e = dY_e·W_e and dW_e = dY_eᵀ·X_e per expert
  ffn_fwd      ffn, dual expert (all_text: the dual op, every token text) / per expert x_e·[W1;W3]_eᵀ, then ·W2_eᵀ
  ffn_bwd      ffn_backward (gate and up saved by ffn_forward)   / per expert the six GEMMs it needs (dh, dW2, dx from
                                                                   gate and up as one GEMM, dW1 and dW3 as one)
  rope_fwd/bwd rope_fwd_qk / rope_bwd_qk of q and k (bshd)       / bytes read + written at copy bandwidth
Decode cells (M <= 64) of linear_fwd and ffn_fwd are memory-bound: their value is the fraction of copy bandwidth at
which the op reads the weights of the experts that have tokens (weights rotated past L2, so every call reads HBM;
copy bandwidth counts bytes read + written, as in the routed benchmarks' decode targets); beside it, cuBLAS's fraction
for one expert's weights (F.linear, or the eager MLP's three GEMMs) and the op's time over cuBLAS's.
Backward cells start at M = 256 (training batches). A ratio above 1 is slower than the anchor.

Host overhead: microseconds of CPU per call (the dispatcher, checks, allocation, config lookup, descriptor encoding,
launch) at M = 1 with the GPU kept busy, for each op and for F.linear / an eager HF MLP beside them.

Writes DIR/matrix.json (every cell), DIR/matrix.md (per op: the table, geometric mean and worst cell) and
DIR/matrix.png (one heatmap per op). Every cell's output is checked against a float64 reference first (relative
error); a wrong cell is reported as an error, never timed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Interrupted, bench, bench_pair, copy_bandwidth, device_name, on_signal, rotation_count  # noqa: E402

MODELS = {  # hidden, intermediate, attention heads (q, kv), head dim, QKV out features, attention out in features
    "llama3-8b": dict(H=4096, I=14336, hq=32, hk=8, d=128),
    "llama3-70b-tp8": dict(H=8192, I=28672 // 8, hq=64 // 8, hk=1, d=128),
    "cogvlm2-19b": dict(H=4096, I=14336, hq=32, hk=32, d=128),
    "qwen2.5-7b": dict(H=3584, I=18944, hq=28, hk=4, d=128),
    "mistral-7b": dict(H=4096, I=14336, hq=32, hk=8, d=128),
}
MS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384)
DECODE_MAX = 64
MASKS = ("rand50", "span", "vision10", "vision90", "all_text")
MASK_MS = (1, 2048, 8192)  # the other masks' M in the default grid
BWD_MIN_M = 256
OPS = ("linear_fwd", "linear_bwd", "ffn_fwd", "ffn_bwd", "rope_fwd", "rope_bwd")
ERR_TOL = 2e-2


def attention_projections(m):
    """(label, N, K) of a model's attention projections (m: a MODELS entry): QKV and the attention output, N output
    columns from a reduction of K."""
    return [("qkv", (m["hq"] + 2 * m["hk"]) * m["d"], m["H"]), ("o", m["H"], m["hq"] * m["d"])]


def linear_shapes():
    """(label, K, N) of every distinct projection: QKV and the attention output of each model."""
    seen, out = {}, []
    for name, m in MODELS.items():
        for proj, n, k in attention_projections(m):
            if (k, n) in seen:
                continue
            seen[(k, n)] = f"{name}.{proj}"
            out.append((f"{name}.{proj}", k, n))
    return out


def ffn_shapes():
    seen, out = set(), []
    for name, m in MODELS.items():
        if (m["H"], m["I"]) not in seen:
            seen.add((m["H"], m["I"]))
            out.append((f"{name}.mlp", m["H"], m["I"]))
    return out


def rope_shapes():
    seen, out = set(), []
    for name, m in MODELS.items():
        key = (m["hq"], m["hk"], m["d"])
        if key not in seen:
            seen.add(key)
            out.append((f"{name}.rope", *key))
    return out


def grid(op, full):
    """The (shape, M, mask) cells of `op`."""
    cells = []
    if op.startswith("rope"):
        return [(s, M, "-") for s in rope_shapes() for M in MS if M >= 16]
    shapes = linear_shapes() if op.startswith("linear") else ffn_shapes()
    for s in shapes:
        for M in MS:
            if op.endswith("bwd") and M < BWD_MIN_M:
                continue
            for mask in MASKS:
                if full or mask == "rand50" or M in MASK_MS:
                    cells.append((s, M, mask))
    return cells


# ----------------------------------------------------------------------------------------------------------- inputs
def cell_generator(shape_label, M, mask_kind):
    """The random generator of one cell, seeded by its shape, M and mask (not by the op: a projection's forward and
    backward cells share their mask): a cell draws the same mask in every run, whichever ops and cells run before it.
    A mask's split matters at small M: at 256 tokens 128 rows of an expert are one tile, 129 are two."""
    import zlib

    import torch
    return torch.Generator().manual_seed(zlib.crc32(f"{shape_label}|{M}|{mask_kind}".encode()))


def make_mask(kind, M, gen, dev):
    import torch
    if kind == "rand50":
        return (torch.rand(M, generator=gen) < 0.5).to(dev)
    if kind == "vision10":
        return (torch.rand(M, generator=gen) < 0.1).to(dev)
    if kind == "vision90":
        return (torch.rand(M, generator=gen) < 0.9).to(dev)
    if kind == "all_text":
        return torch.zeros(M, dtype=torch.bool, device=dev)
    if kind == "span":  # one image span of 28% of the tokens, after a short text prefix
        m = torch.zeros(M, dtype=torch.bool)
        n = max(1, round(0.28 * M)) if M > 1 else 0
        start = min(M - n, max(0, M // 16))
        m[start:start + n] = True
        return m.to(dev)
    raise ValueError(kind)


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def sets_for(nbytes, dev, cap=8):
    return min(rotation_count(nbytes, dev), cap)


def rotating_sets(ws, xs, gs=None):
    """The argument sets a cell's calls rotate through: (x, weights[, grad]), each list cycled to the longest."""
    n = max(len(ws), len(xs))
    return [(xs[i % len(xs)], ws[i % len(ws)]) + ((gs[i % len(gs)],) if gs else ()) for i in range(n)]


def expert_rows(mask):
    """[(expert, its token indices)] of the experts that have tokens (0 = text, 1 = vision)."""
    rows = [(e, (mask if e else ~mask).nonzero().reshape(-1)) for e in (0, 1)]
    return [(e, r) for e, r in rows if r.numel() > 0]


# ------------------------------------------------------------------------------------------------------------ cells
class Cell:
    """One measurement: fn and anchor over rotating argument sets, a check, and the bytes of weights it reads."""

    def __init__(self, fn, anchor, arg_sets, check, weight_bytes=0, flops=0.0, decode=False, one_expert_bytes=0):
        self.fn, self.anchor, self.arg_sets, self.check = fn, anchor, arg_sets, check
        self.weight_bytes, self.flops = weight_bytes, flops
        self.decode, self.one_expert_bytes = decode, one_expert_bytes  # decode: anchor = cuBLAS on one expert


def linear_cell(op, K, N, M, mask_kind, dev, gen):
    import torch
    import torch.nn.functional as F
    dt = torch.bfloat16
    decode = M <= DECODE_MAX and op == "linear_fwd"
    mask = make_mask(mask_kind, M, gen, dev)
    experts_used = int(mask.any()) + int((~mask).any())
    # weights rotate only for decode cells (their reads are the cost); x / grad rotate for every cell
    wsets = sets_for(2 * N * K * 2, dev) if decode else 1
    ws = [(torch.randn(2, N, K, device=dev, dtype=dt) / math.sqrt(K)) for _ in range(wsets)]
    xsets = sets_for(M * (K + N) * 2, dev)
    xs = [torch.randn(M, K, device=dev, dtype=dt) for _ in range(xsets)]
    gs = [torch.randn(M, N, device=dev, dtype=dt) for _ in range(xsets)] if op == "linear_bwd" else None
    arg_sets = rotating_sets(ws, xs, gs)
    L = torch.ops.fused

    def ref_fwd(x, w):
        xd, wd = x.double(), w.double()
        return torch.where(mask[:, None], xd @ wd[1].T, xd @ wd[0].T)

    rows = expert_rows(mask)
    xe = {e: torch.randn(r.numel(), K, device=dev, dtype=dt) for e, r in rows}  # each expert's rows, contiguous
    ge = {e: torch.randn(r.numel(), N, device=dev, dtype=dt) for e, r in rows}
    if op == "linear_fwd":
        def fn(x, w):
            return L.linear_dual(x, mask, w[1], w[0])

        def anchor(x, w):
            return [F.linear(xe[e], w[e]) for e, _ in rows]

        def one_expert(x, w):  # decode: cuBLAS on one expert's weights, all rows
            return F.linear(x, w[1])

        def check():
            x, w = arg_sets[0][:2]
            return rel_err(fn(x, w), ref_fwd(x, w))
        return Cell(fn, one_expert if decode else anchor, arg_sets, check, weight_bytes=experts_used * N * K * 2,
                    flops=2.0 * M * N * K, decode=decode, one_expert_bytes=N * K * 2)

    def fn(x, w, g):
        return L.linear_dual_backward(g, x, mask, w[1], w[0], False, [True, True, True, False, False])

    def anchor(x, w, g):
        return [(torch.mm(ge[e], w[e]), torch.mm(ge[e].t(), xe[e])) for e, _ in rows]

    def check():
        x, w, g = arg_sets[0]
        gx, gwv, gwt, _, _ = fn(x, w, g)
        gd, xd, wd = g.double(), x.double(), w.double()
        want_gx = torch.where(mask[:, None], gd @ wd[1], gd @ wd[0])
        mv = mask[:, None].double()
        want_v, want_t = (gd * mv).T @ xd, (gd * (1 - mv)).T @ xd
        return max(rel_err(gx, want_gx), rel_err(gwv, want_v) if mask.any() else 0.0,
                   rel_err(gwt, want_t) if (~mask).any() else 0.0)
    return Cell(fn, anchor, arg_sets, check, flops=4.0 * M * N * K)


def ffn_anchor(rows, w13, w2, dev, dt, backward):
    """The cuBLAS anchor of the ffn's cells, a callable (its arguments ignored): per expert e with n tokens (rows: [(e,
    n)]), its GEMMs over n contiguous random rows, with its gate and up weights concatenated (w13[e] [2I, H], w2[e]
    [H, I]): the forward's gate/up (one GEMM of 2I columns) and down; or (backward) dh = g·W2, dW2 = gᵀ·h,
    dx = [dgate dup]·[W1; W3] and [dW1; dW3] = [dgate dup]ᵀ·x. benchmarks/bench_train_mlp.py's GEMM floor is the two."""
    import torch
    import torch.nn.functional as F
    H, I = w2[rows[0][0]].shape if rows else (0, 0)  # noqa: E741
    xe = {e: torch.randn(n, H, device=dev, dtype=dt) for e, n in rows}
    if not backward:
        return lambda *_: [F.linear(F.linear(xe[e], w13[e])[:, :I], w2[e]) for e, _ in rows]
    ge = {e: torch.randn(n, H, device=dev, dtype=dt) for e, n in rows}
    he = {e: torch.randn(n, I, device=dev, dtype=dt) for e, n in rows}
    d13 = {e: torch.randn(n, 2 * I, device=dev, dtype=dt) for e, n in rows}
    return lambda *_: [(torch.mm(ge[e], w2[e]), torch.mm(ge[e].t(), he[e]), torch.mm(d13[e], w13[e]),
                        torch.mm(d13[e].t(), xe[e])) for e, _ in rows]


def ffn_cell(op, H, I, M, mask_kind, dev, gen):  # noqa: E741
    import torch
    import torch.nn.functional as F
    dt = torch.bfloat16
    decode = M <= DECODE_MAX and op == "ffn_fwd"
    mask = make_mask(mask_kind, M, gen, dev)
    experts_used = int(mask.any()) + int((~mask).any())
    wbytes = 3 * I * H * 2

    def weights():  # DualExpertSwiGLU's layout: [2, R, C] per projection, text first
        return (torch.randn(2, I, H, device=dev, dtype=dt) / math.sqrt(H),
                torch.randn(2, I, H, device=dev, dtype=dt) / math.sqrt(H),
                torch.randn(2, H, I, device=dev, dtype=dt) / math.sqrt(I))
    wsets = sets_for(2 * wbytes, dev) if decode else 1
    ws = [weights() for _ in range(wsets)]
    xsets = sets_for(M * (2 * H + 4 * I) * 2, dev)
    xs = [torch.randn(M, H, device=dev, dtype=dt) for _ in range(xsets)]
    gs = [torch.randn(M, H, device=dev, dtype=dt) for _ in range(xsets)] if op == "ffn_bwd" else None
    arg_sets = rotating_sets(ws, xs, gs)
    L = torch.ops.fused

    def call(x, w):
        w1, w3, w2 = w
        return L.ffn(x, w1[1], w3[1], w2[1], mask, w1[0], w3[0], w2[0])

    def ref(x, w):
        xd = x.double()
        outs = []
        for e in (0, 1):
            w1, w3, w2 = (t[e].double() for t in w)
            outs.append((F.silu(xd @ w1.T) * (xd @ w3.T)) @ w2.T)
        return torch.where(mask[:, None], outs[1], outs[0])

    # the anchors: per expert with tokens, its rows as contiguous tensors and its weights, gate and up concatenated
    # (one GEMM of 2I columns)
    rows = [(e, r.numel()) for e, r in expert_rows(mask)]
    w13 = {e: torch.cat([ws[0][0][e], ws[0][1][e]]) for e, _ in rows}
    w2e = {e: ws[0][2][e] for e, _ in rows}
    anchor = ffn_anchor(rows, w13, w2e, dev, dt, backward=op == "ffn_bwd")
    if op == "ffn_fwd":
        def one_expert(x, w):  # decode: the eager MLP's three GEMMs on one expert's weights (no activation)
            y = F.linear(x, w13[rows[0][0]])
            return F.linear(y[:, :I], w2e[rows[0][0]])

        def check():
            x, w = arg_sets[0][:2]
            return rel_err(call(x, w), ref(x, w))
        return Cell(call, one_expert if decode else anchor, arg_sets, check, weight_bytes=experts_used * wbytes,
                    flops=6.0 * M * H * I, decode=decode, one_expert_bytes=wbytes)

    # the forward's saved gate and up (ffn_forward) of each input set: what the backward of a training step reads
    gate_up = {x.data_ptr(): L.ffn_forward(x, w1[1], w3[1], w2[1], mask, w1[0], w3[0], w2[0])[1]
               for x, (w1, w3, w2) in ((a[0], a[1]) for a in arg_sets)}

    def fn(x, w, g):
        w1, w3, w2 = w
        return L.ffn_backward(g, x, w1[1], w3[1], w2[1], mask, w1[0], w3[0], w2[0], gate_up=gate_up[x.data_ptr()])

    def check():
        x, w, g = arg_sets[0]
        xr = x.double().requires_grad_(True)
        wr = [t.double().requires_grad_(True) for t in w]
        out = ref(xr, wr)
        out.backward(g.double())
        got = fn(x, w, g)
        want = [xr.grad, wr[0].grad[1], wr[1].grad[1], wr[2].grad[1], wr[0].grad[0], wr[1].grad[0], wr[2].grad[0]]
        return max(rel_err(a, b) for a, b in zip(got, want))  # an expert without tokens: zeros (absolute error)
    return Cell(fn, anchor, arg_sets, check, flops=12.0 * M * H * I)


def rope_cell(op, hq, hk, d, M, dev, gen):
    import torch
    dt = torch.bfloat16
    sets = sets_for(2 * M * (hq + hk) * d * 2, dev)
    qs = [torch.randn(1, M, hq, d, device=dev, dtype=dt) for _ in range(sets)]
    ks = [torch.randn(1, M, hk, d, device=dev, dtype=dt) for _ in range(sets)]
    pos = torch.arange(M, device=dev, dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    freqs = torch.outer(pos, inv)
    freqs = torch.cat([freqs, freqs], -1).view(M, 1, 1, d)
    L = torch.ops.fused
    fwd = op == "rope_fwd"

    def fn(q, k):
        return (L.rope_fwd_qk if fwd else L.rope_bwd_qk)(q, k, freqs, tensor_format="bshd")

    def ref(t):  # TE's rotate-half formula; the backward is the rotation by -freqs
        f = freqs.transpose(0, 1).double() * (1 if fwd else -1)
        t = t.double()
        t1, t2 = t.chunk(2, -1)
        return t * f.cos() + torch.cat([-t2, t1], -1) * f.sin()

    def check():
        q, k = qs[0], ks[0]
        oq, ok = fn(q, k)
        return max(rel_err(oq, ref(q)), rel_err(ok, ref(k)))
    return Cell(fn, None, [(qs[i], ks[i]) for i in range(sets)], check, weight_bytes=2 * M * (hq + hk) * d * 2)


# ------------------------------------------------------------------------------------------------------ measurement
def launch_floor_ms(dev, rep=200):
    """The device time of a kernel that does nothing useful (a one-element add), timed as every cell is: between its
    own CUDA events. A memory-bound cell can take no less than this plus its bytes at copy bandwidth."""
    import torch
    t = torch.zeros(1, device=dev)
    return bench(lambda x: x.add_(1.0), [(t,)], warmup=20, rep=rep)


def ceiling(nbytes, copy_gbps, floor_ms):
    """The copy-bandwidth fraction a kernel reaches that streams nbytes at copy bandwidth after the launch floor."""
    ideal_ms = nbytes / (copy_gbps * 1e9) * 1e3
    return ideal_ms / (ideal_ms + floor_ms)


def measure(cell, copy_gbps, rep, floor_ms=0.0):
    """{"ms", "value", "kind"}: value = op / anchor (paired medians of the ratio) for compute-bound cells, the
    fraction of copy bandwidth for memory-bound ones (with "ceiling": the fraction the launch floor leaves)."""
    if cell.anchor is None:
        ms = bench(cell.fn, cell.arg_sets, warmup=5, rep=rep)
        gbps = cell.weight_bytes / (ms * 1e-3) / 1e9
        return {"ms": ms, "value": gbps / copy_gbps, "kind": "copy_bw_fraction", "gbps": gbps,
                "ceiling": ceiling(cell.weight_bytes, copy_gbps, floor_ms)}
    if cell.decode:  # memory-bound: the op's fraction of copy bandwidth, and cuBLAS's on one expert beside it
        pairs = bench_pair(cell.fn, cell.anchor, cell.arg_sets, warmup=5, rep=rep)
        ms = statistics.median(a for a, _ in pairs)
        anchor_ms = statistics.median(b for _, b in pairs)
        gbps = cell.weight_bytes / (ms * 1e-3) / 1e9
        return {"ms": ms, "value": gbps / copy_gbps, "kind": "copy_bw_fraction", "gbps": gbps,
                "ceiling": ceiling(cell.weight_bytes, copy_gbps, floor_ms),
                "anchor_ms": anchor_ms, "cublas_fraction": cell.one_expert_bytes / (anchor_ms * 1e-3) / 1e9 / copy_gbps,
                "vs_cublas": statistics.median(a / b for a, b in pairs)}
    pairs = bench_pair(cell.fn, cell.anchor, cell.arg_sets, warmup=5, rep=rep)
    ratio = statistics.median(a / b for a, b in pairs)
    ms = statistics.median(a for a, _ in pairs)
    anchor_ms = statistics.median(b for _, b in pairs)
    return {"ms": ms, "anchor_ms": anchor_ms, "value": ratio, "kind": "ratio_to_cublas",
            "tflops": cell.flops / (ms * 1e-3) / 1e12 if cell.flops else None}


def host_overhead(dev, calls=40):
    """CPU microseconds per call at M = 1 with the GPU kept busy (so no call waits on the device)."""
    import torch
    import torch.nn.functional as F

    import fused_ops
    from common import _hold_gpu
    dt = torch.bfloat16
    H, I = 4096, 14336  # noqa: E741
    x = torch.randn(1, H, device=dev, dtype=dt)
    mask = torch.ones(1, dtype=torch.bool, device=dev)
    w = torch.randn(2, H, H, device=dev, dtype=dt)
    w13 = [torch.randn(2, I, H, device=dev, dtype=dt) for _ in range(2)]
    w2 = torch.randn(2, H, I, device=dev, dtype=dt)
    routing = fused_ops.route(mask)
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    freqs = torch.randn(1, 1, 1, 128, device=dev)
    L = torch.ops.fused
    cases = {
        "F.linear": lambda: F.linear(x, w[1]),
        "linear_dual": lambda: L.linear_dual(x, mask, w[1], w[0]),
        "linear_dual (routing given)": lambda: L.linear_dual(x, mask, w[1], w[0], routing=routing),
        "route": lambda: L.route(mask),
        "eager HF MLP": lambda: F.linear(F.silu(F.linear(x, w13[0][0])) * F.linear(x, w13[1][0]), w2[0]),
        "ffn single": lambda: L.ffn(x, w13[0][0], w13[1][0], w2[0]),
        "ffn dual": lambda: L.ffn(x, w13[0][1], w13[1][1], w2[1], mask, w13[0][0], w13[1][0], w2[0]),
        "ffn dual (routing given)": lambda: L.ffn(x, w13[0][1], w13[1][1], w2[1], mask, w13[0][0], w13[1][0], w2[0],
                                                  routing=routing),
        "rope_fwd": lambda: L.rope_fwd(q, freqs, tensor_format="bshd"),
    }
    out = {}
    with torch.no_grad():
        for name, fn in cases.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            samples = []
            for _ in range(7):  # the GPU spins while the calls enqueue (40 x 5 launches stays far below the queue)
                _hold_gpu(30.0)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - t0) * 1e6 / calls)
                torch.cuda.synchronize()
            out[name] = min(samples)
    return out


# ---------------------------------------------------------------------------------------------------------- reports
def geomean(vals):
    vals = [v for v in vals if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def summarize(cells):
    """Per op: geometric mean and worst cell, separately for ratio cells (worst = largest) and copy-bandwidth cells
    (worst = smallest)."""
    out = {}
    for op in OPS:
        mine = [c for c in cells if c["op"] == op and "value" in c]
        s = {}
        for kind, worst in (("ratio_to_cublas", max), ("copy_bw_fraction", min)):
            vals = [c for c in mine if c["kind"] == kind]
            if vals:
                w = worst(vals, key=lambda c: c["value"])
                s[kind] = {"cells": len(vals), "geomean": geomean([c["value"] for c in vals]),
                           "worst": w["value"], "worst_cell": f"{w['shape']} M={w['M']} {w['mask']}"}
                if kind == "copy_bw_fraction" and all("ceiling" in c for c in vals):
                    s[kind]["geomean_ceiling"] = geomean([c["ceiling"] for c in vals])
                    s[kind]["geomean_of_ceiling"] = geomean([c["value"] / c["ceiling"] for c in vals])
        m1 = [c for c in mine if c["M"] == 1 and "vs_cublas" in c]
        if m1:  # one token reads one expert: the op against cuBLAS on that expert's weights
            w = max(m1, key=lambda c: c["vs_cublas"])
            s["m1_vs_cublas"] = {"cells": len(m1), "geomean": geomean([c["vs_cublas"] for c in m1]),
                                 "worst": w["vs_cublas"], "worst_cell": f"{w['shape']} M=1 {w['mask']}"}
        errors = [c for c in cells if c["op"] == op and "error" in c]
        if errors:
            s["errors"] = len(errors)
        if s:
            out[op] = s
    return out


def markdown(meta, cells, summary, host):
    lines = [f"# Performance matrix on {meta['device']}", "",
             f"torch {meta['torch']}, bf16, copy bandwidth {meta['copy_gbps']:.0f} GB/s (read + write). "
             f"{meta['cells']} cells in {meta['seconds']:.0f} s. Ratio cells: op time / cuBLAS time of the same "
             "useful work, paired (lower is better, 1.00 = cuBLAS). Bandwidth cells (decode, M <= 64; RoPE): "
             "fraction of copy bandwidth (higher is better).", "", "## Summary", "",
             "| op | kind | cells | geometric mean | worst | worst cell | errors |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for op, s in summary.items():
        for kind in ("ratio_to_cublas", "copy_bw_fraction", "m1_vs_cublas"):
            if kind in s:
                k = s[kind]
                lines.append(f"| {op} | {kind} | {k['cells']} | {k['geomean']:.3f} | {k['worst']:.3f} | "
                             f"{k['worst_cell']} | {s.get('errors', 0)} |")
    bw = [(op, s["copy_bw_fraction"]) for op, s in summary.items()
          if "geomean_of_ceiling" in s.get("copy_bw_fraction", {})]
    if bw:
        lines += ["", f"The launch floor (a one-element kernel between its own events, as every cell is timed): "
                  f"{meta['floor_us']:.1f} us. A kernel that streamed its bytes at copy bandwidth after it would reach "
                  "the ceiling below; the cells' fraction of copy bandwidth against that ceiling:", "",
                  "| op | cells | fraction of copy bandwidth | ceiling | fraction of the ceiling |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {op} | {k['cells']} | {k['geomean']:.3f} | {k['geomean_ceiling']:.3f} | "
                  f"{k['geomean_of_ceiling']:.3f} |" for op, k in bw]
    if host:
        lines += ["", "## Host time per call (M = 1, GPU busy; microseconds)", "", "| call | us |", "| --- | --- |"]
        lines += [f"| {k} | {v:.1f} |" for k, v in host.items()]
    for op in OPS:
        mine = [c for c in cells if c["op"] == op]
        if not mine:
            continue
        masks = sorted({c["mask"] for c in mine}, key=lambda m: (MASKS + ("-",)).index(m))
        lines += ["", f"## {op}", "", "| shape | mask | " + " | ".join(f"M={M}" for M in MS) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in MS) + " |"]
        for shape in dict.fromkeys(c["shape"] for c in mine):
            for mask in masks:
                row = {c["M"]: c for c in mine if c["shape"] == shape and c["mask"] == mask}
                if not row:
                    continue
                vals = []
                for M in MS:
                    c = row.get(M)
                    vals.append("" if c is None else "ERR" if "error" in c else
                                f"{c['value']:.2f}" if c["kind"] != "copy_bw_fraction" else
                                f"{c['value']:.2f}b" + (f" ({c['cublas_fraction']:.2f})" if "cublas_fraction" in c
                                                        else ""))
                lines.append(f"| {shape} | {mask} | " + " | ".join(vals) + " |")
    lines += ["", "Values ending in b are fractions of copy bandwidth (in parentheses: cuBLAS's on one expert's weights, "
              "F.linear or the MLP's GEMMs); the others are ratios to cuBLAS's per-expert GEMMs. m1_vs_cublas: one "
              "token's op time over cuBLAS's on its expert's weights."]
    return "\n".join(lines) + "\n"


def heatmaps(cells, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"bench_matrix: matplotlib not available ({e}); no PNG")
        return
    ops = [op for op in OPS if any(c["op"] == op and "value" in c for c in cells)]
    if not ops:
        return
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3 + 0.32 * 12 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        mine = [c for c in cells if c["op"] == op and "value" in c]
        rows = list(dict.fromkeys((c["shape"], c["mask"]) for c in mine))
        grid_ = [[math.nan] * len(MS) for _ in rows]
        for c in mine:
            v = c["value"] if c["kind"] == "ratio_to_cublas" else 1.0 / max(c["value"], 1e-3)
            grid_[rows.index((c["shape"], c["mask"]))][MS.index(c["M"])] = v
        im = ax.imshow(grid_, aspect="auto", cmap="RdYlGn_r", vmin=0.8, vmax=1.6)
        ax.set_xticks(range(len(MS)), [str(m) for m in MS])
        ax.set_yticks(range(len(rows)), [f"{s} {m}" for s, m in rows], fontsize=6)
        ax.set_title(f"{op}: time / anchor (cuBLAS, or copy bandwidth for decode and RoPE)")
        for (i, j), v in ((ij, grid_[ij[0]][ij[1]]) for ij in ((i, j) for i in range(len(rows))
                                                               for j in range(len(MS)))):
            if math.isfinite(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=5)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"bench_matrix: wrote {path}")


# ------------------------------------------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="build/bench_matrix")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--full", action="store_true", help="every mask at every M")
    p.add_argument("--rep", type=int, default=20, help="timed pairs per cell")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting cells after this many seconds")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    ops = [o for o in a.ops.split(",") if o]
    for o in ops:
        if o not in OPS:
            p.error(f"--ops: unknown op {o!r} (one of {', '.join(OPS)})")
    todo = [(op, cell) for op in ops for cell in grid(op, a.full)]
    print(f"bench_matrix: {len(todo)} cells: " + ", ".join(f"{op} {sum(1 for o, _ in todo if o == op)}"
                                                           for op in ops), flush=True)
    if a.dry_run:
        for op, (s, M, mask) in todo:
            print(op, s[0], M, mask)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("bench_matrix: no CUDA device; the matrix needs a GPU (try --dry-run)")
        return 0
    import fused_ops  # noqa: F401  (registers torch.ops.fused)
    signal.signal(signal.SIGTERM, on_signal)
    dev = torch.device("cuda")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    copy_gbps = copy_bandwidth(1 << 30)
    floor_ms = launch_floor_ms(dev)
    meta = {"device": device_name(), "torch": torch.__version__, "copy_gbps": copy_gbps, "floor_us": floor_ms * 1e3,
            "full": a.full, "cell_masks": True}  # cell_masks: each cell seeds its own mask (cell_generator)
    print(f"bench_matrix: {meta['device']}, copy {copy_gbps:.0f} GB/s, launch floor {floor_ms * 1e3:.1f} us",
          flush=True)
    cells, host = [], {}
    try:
        for i, (op, (shape, M, mask)) in enumerate(todo):
            if time.time() - t0 > a.budget_s:
                print(f"bench_matrix: budget reached after {i} of {len(todo)} cells", flush=True)
                break
            row = {"op": op, "shape": shape[0], "M": M, "mask": mask}
            gen = cell_generator(shape[0], M, mask)
            cell = None
            try:
                if op.startswith("linear"):
                    cell = linear_cell(op, shape[1], shape[2], M, mask, dev, gen)
                elif op.startswith("ffn"):
                    cell = ffn_cell(op, shape[1], shape[2], M, mask, dev, gen)
                else:
                    cell = rope_cell(op, *shape[1:], M, dev, gen)
                err = cell.check()
                row["rel_err"] = err
                if not err <= ERR_TOL:
                    row["error"] = f"relative error {err:.3g} > {ERR_TOL}"
                else:
                    row.update(measure(cell, copy_gbps, a.rep, floor_ms))
            except torch.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e)[:120]}"
            except Interrupted:
                raise
            except Exception as e:  # noqa: BLE001 (reported in the cell, the matrix goes on)
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            cells.append(row)
            del cell
            torch.cuda.empty_cache()
            v = f"{row['value']:.3f}" if "value" in row else row.get("error")
            print(f"[{i + 1}/{len(todo)}] {op} {shape[0]} M={M} {mask}: {v}", flush=True)
        host = host_overhead(dev)
    except Interrupted:
        print("bench_matrix: interrupted; writing what was measured", flush=True)
    meta.update(cells=len(cells), seconds=time.time() - t0)
    summary = summarize(cells)
    with open(os.path.join(a.out, "matrix.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "host_us": host, "cells": cells}, f, indent=1)
    md = markdown(meta, cells, summary, host)
    with open(os.path.join(a.out, "matrix.md"), "w") as f:
        f.write(md)
    heatmaps(cells, os.path.join(a.out, "matrix.png"))
    print(md.split("\n## linear_fwd")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
