#!/usr/bin/env python3
"""SwiGLU FFN benchmark: torch.ops.fused.ffn (single expert, or routed between a vision and a text expert) against
cuBLAS, the unfused ways of writing the routed MLP, and torch.compile of an HF-style LlamaMLP.

    python3 benchmarks/bench_ffn.py               # ~1 min on an H100 (about half of it torch.compile)
    python3 benchmarks/bench_ffn.py --only dual,decode --no-compile
    python3 benchmarks/bench_ffn.py --out DIR     # also write DIR/bench_ffn.{json,md}

Cases (bf16, M = 4096 tokens, H = 4096, I = 11008; weights nn.Linear layout, stacked [2, ...] per projection as
DualExpertSwiGLU stores them):
  dual    masks rand50 / span (one vision run of M/2 tokens) / vision90:
            fused_ops        ffn(x, w1, w3, w2, mask, u1, u3, u2), routing the mask itself
            fused_ops, shared routing   the same given routing=fused.route(mask), computed once outside the timing
                             as a model does for all its layers' routed ops on one mask (target as for fused_ops)
            cuBLAS useful    the useful GEMMs with no routing and no activation: one F.linear of all M rows to the
                             concatenated [W1; W3] ([2I, H]) + one F.linear to W2 (target: fused <= 1.05x this)
            gather+cuBLAS    per expert: index_select rows, F.linear to [W1; W3], silu*mul, F.linear to W2,
                             index_copy_ back (indices and concatenated weights prepared outside the timing)
            both + where     both experts' full MLPs over all tokens, torch.where(mask, ...) (2x the FLOPs)
  single  ffn(x, w1, w3, w2) vs torch.compile of the HF-style MLP down(silu(gate(x)) * up(x)) (target: fused
          <= 0.95x its time), eager HF-style MLP and cuBLAS useful as information.
  memory  peak extra memory of one forward: torch.cuda.max_memory_allocated() during the call minus what was
          allocated before, minus the output (target <= M*I elements of x's dtype), dual rand50 (routing the mask,
          and given its routing) and single.
  bwd     ffn_backward (grad x and every weight grad) vs the cuBLAS time of the same GEMMs on all M rows. With gate
          and up saved by ffn_forward (what ffn's autograd does by default): dY·W2, dYᵀ·h, dG·[W1;W3], dGᵀ·x =
          12·M·H·I FLOPs (target <= 1.05x); recomputing them (recompute=True): also x·[W1;W3]ᵀ, 16·M·H·I FLOPs
          (target <= 1.15x); dual rand50 and single; dual rand50 with the text expert frozen (output_mask: grad x and
          the vision weights only) as information.
  decode  M = 1, 2, 4, 8, 16: bandwidth of reading the weights (3·I·H·2 bytes per expert used) vs the device copy
          bandwidth (read + write; copies of one and of two experts' bytes, the higher of the two is the ceiling;
          target >= 80%), single and dual (random mask with both experts present for M >= 2).
  mid     M = 256, 1024, 2048 tokens (prefill between decode and the 4096-token targets), dual rand50: fused vs
          gather+cuBLAS (paired) and cuBLAS useful. Information, no target.
The fused op is also timed with programmatic dependent launch off ("fused_ops PDL off": dual rand50, single and every
decode case): what launching each kernel early saves (information, no target).

TFLOP/s count useful work only (6·M·H·I forward: each token through one expert).
Timing: benchmarks/common.py (median of CUDA-event times, inputs rotated past 2x L2, GPU held while reps enqueue).
A target's ratio is paired (routed_harness.paired_ratio): the median of per-pair ratios over 5 x rep calls of the
fused op and of its reference interleaved one by one, so the drift of the device's clock over the run does not enter
it; the target line also gives the ratio of the table's two medians, which were taken apart.
Correctness: every timed implementation runs once more on a fixed input and is compared with a float64 evaluation
of what it claims to compute: ||out - ref|| / ||ref|| < 1e-2, else its targets FAIL.

Exit codes: 0 all targets PASS, 1 a target FAILed or a case errored, 2 no CUDA / fused_ops (or the op) missing,
3 interrupted (SIGTERM/SIGINT; what was measured is still reported).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# one in-process compile worker is plenty for the single small graph compiled here
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from routed_harness import (Interrupted, Results, cleanup, finish, log, measure, measure_pdl_off,  # noqa: E402
                            open_device, paired_note, paired_ratio, poisoned_call, ratio, rel_err, rel_errs,
                            run_cases)

NAME = "bench_ffn"
TARGET_DUAL_VS_CUBLAS = 1.05
TARGET_SINGLE_VS_COMPILE = 0.95
TARGET_BWD_SAVED = 1.05  # ffn_backward with gate and up saved / its six GEMMs in cuBLAS (issue #32)
TARGET_BWD_VS_CUBLAS = 1.15
TARGET_DECODE_BW = 0.80
M_TOK, HID, INTER = 4096, 4096, 11008
DECODE_MS = (1, 2, 4, 8, 16)
MID_MS = (256, 1024, 2048)
DUAL_MASKS = ("rand50", "span", "vision90")

IMPL_FUSED = "fused_ops"
IMPL_SHARED = "fused_ops, shared routing"
IMPL_CUBLAS = "cuBLAS useful"
IMPL_GATHER = "gather+cuBLAS"
IMPL_WHERE = "both + where"
IMPL_EAGER = "HF-style eager"
IMPL_COMPILE = "torch.compile"

torch = None  # set in main() after the environment checks
F = None
common = None
DEV = None


# =============================================================================== inputs, implementations, references
def make_mask(kind: str, M: int, gen) -> "torch.Tensor":
    if kind == "rand50":
        m = torch.rand(M, generator=gen) < 0.5
    elif kind == "vision90":
        m = torch.rand(M, generator=gen) < 0.9
    elif kind == "span":
        m = torch.zeros(M, dtype=torch.bool)
        m[M // 4: M // 4 + max(1, M // 2)] = True
    else:
        raise ValueError(kind)
    return m.to(DEV)


class Experts:
    """Stacked weights as DualExpertSwiGLU holds them (W1, W3 [2, I, H], W2 [2, H, I]; 0 = text, 1 = vision),
    their per-expert views, and the concatenated [W1_e; W3_e] ([2I, H]) the cuBLAS baselines use."""

    def __init__(self, H, I, dtype):  # noqa: E741
        mk = lambda *s: (torch.randn(*s, device=DEV, dtype=torch.float32) / math.sqrt(s[-1])).to(dtype)  # noqa
        self.W1, self.W3, self.W2 = mk(2, I, H), mk(2, I, H), mk(2, H, I)
        self.v = (self.W1[1], self.W3[1], self.W2[1])  # vision: w1, w3, w2
        self.t = (self.W1[0], self.W3[0], self.W2[0])  # text: u1, u3, u2
        self.w13 = [torch.cat([self.W1[e], self.W3[e]]) for e in (0, 1)]  # per expert [2I, H]
        self.I = I

    def dual_args(self, mask):
        return (*self.v, mask, *self.t)


def mlp_eager(x, w1, w3, w2):
    """HF LlamaMLP's formula: down_proj(silu(gate_proj(x)) * up_proj(x))."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def mlp64(x, w1, w3, w2):
    x = x.double()
    return F.linear(F.silu(F.linear(x, w1.double())) * F.linear(x, w3.double()), w2.double())


def ffn_ref(x, ex: Experts, mask=None):
    """float64 [M, H]; each token through its own expert only."""
    if mask is None:
        return mlp64(x, *ex.v)
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float64, device=DEV)
    for rows, w in ((mask.nonzero().reshape(-1), ex.v), ((~mask).nonzero().reshape(-1), ex.t)):
        if rows.numel():
            out[rows] = mlp64(x[rows], *w)
    return out


def swiglu_bwd64(x, g, w1, w3, w2):
    """float64 (grad_x, grad_w1, grad_w3, grad_w2) of one expert's MLP for its rows x, grad_out g."""
    x, g = x.double(), g.double()
    w1, w3, w2 = w1.double(), w3.double(), w2.double()
    a1, a3 = x @ w1.t(), x @ w3.t()
    s = torch.sigmoid(a1)
    act = a1 * s
    gw2 = g.t() @ (act * a3)
    dh = g @ w2
    da3 = dh * act
    da1 = dh * a3 * (s * (1 + a1 * (1 - s)))
    del a1, a3, s, act, dh
    return da1 @ w1 + da3 @ w3, da1.t() @ x, da3.t() @ x, gw2


def ffn_bwd_ref(g, x, ex: Experts, mask=None):
    if mask is None:
        return list(swiglu_bwd64(x, g, *ex.v))
    gx = torch.zeros(x.shape, dtype=torch.float64, device=DEV)
    grads = []
    for rows, w in ((mask.nonzero().reshape(-1), ex.v), ((~mask).nonzero().reshape(-1), ex.t)):
        gxe, *gw = swiglu_bwd64(x[rows], g[rows], *w)
        gx[rows] = gxe
        grads += gw
    return [gx] + grads


def cublas_useful(w13, w2, I):  # noqa: E741
    """The useful forward GEMMs with no routing and no activation: x -> [M, 2I] -> (first I columns) -> [M, H]."""
    def fn(x):
        y = F.linear(x, w13)
        return F.linear(y[:, :I], w2)
    return fn


def cublas_useful_ref(x, w13, w2, I):  # noqa: E741
    return (x.double() @ w13.double().t())[:, :I] @ w2.double().t()


def gather_dual(ex: Experts, mask):
    rows = [(~mask).nonzero().reshape(-1), mask.nonzero().reshape(-1)]  # expert 0 = text, 1 = vision
    I = ex.I  # noqa: E741

    def fn(x):
        out = torch.empty_like(x)
        for e in (0, 1):
            if rows[e].numel() == 0:
                continue
            y = F.linear(x.index_select(0, rows[e]), ex.w13[e])
            out.index_copy_(0, rows[e], F.linear(F.silu(y[:, :I]) * y[:, I:], ex.W2[e]))
        return out
    return fn


def peak_extra_bytes(fn, *args) -> tuple:
    """(peak extra bytes during fn(*args) beyond what was allocated before and the output, output bytes)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(DEV)
    base = torch.cuda.memory_allocated(DEV)
    with torch.no_grad():
        out = fn(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(DEV)
    out_bytes = sum(t.untyped_storage().nbytes() for t in (out if isinstance(out, (list, tuple)) else [out]))
    del out
    return peak - base - out_bytes, out_bytes


# =============================================================================== cases
def case_dual(res: Results, opts, ctx):
    M, H, I = M_TOK, HID, INTER  # noqa: E741
    ex, xs, x_chk = ctx["ex"], ctx["xs"], ctx["x_chk"]
    log(f"[dual] M={M} H={H} I={I} bf16, two experts")
    gen = torch.Generator().manual_seed(0)
    flops = 6.0 * M * H * I
    cub = cublas_useful(ex.w13[1], ex.W2[1], I)
    r_cub = measure(res, opts, "dual", IMPL_CUBLAS, cub, xs, flops, note="x·[W1;W3]ᵀ then ·W2ᵀ, one expert",
                    check=lambda: rel_err(poisoned_call(cub, x_chk), cublas_useful_ref(x_chk, ex.w13[1], ex.W2[1], I)),
                    best_of=2)
    ctx["r_cublas"] = r_cub
    for kind in DUAL_MASKS:
        case = f"dual {kind}"
        mask = make_mask(kind, M, gen)
        ref = ffn_ref(x_chk, ex, mask)
        fused = lambda x, mask=mask: torch.ops.fused.ffn(x, *ex.dual_args(mask))  # noqa: E731
        routing = torch.ops.fused.route(mask)  # once, as a model does for all its routed ops on the mask
        shared = lambda x, mask=mask, r=routing: torch.ops.fused.ffn(x, *ex.dual_args(mask), routing=r)  # noqa
        where = lambda x, mask=mask: torch.where(mask[:, None], mlp_eager(x, *ex.v), mlp_eager(x, *ex.t))  # noqa
        rows = {}
        for impl, fn, note in ((IMPL_FUSED, fused, "routes the mask itself"),
                               (IMPL_SHARED, shared, "given fused.route(mask), computed once"),
                               (IMPL_GATHER, gather_dual(ex, mask), "indices, [W1;W3] prepared (untimed)"),
                               (IMPL_WHERE, where, "2x the FLOPs")):
            rows[impl] = measure(res, opts, case, impl, fn, xs, flops, note=note,
                                 check=lambda fn=fn: rel_err(poisoned_call(fn, x_chk, out_bytes=M * H * 2), ref))
        if kind == "rand50":
            measure_pdl_off(res, opts, case, fused, xs, flops)
        for impl, fn, how in ((IMPL_FUSED, fused, "the op routes the mask"),
                              (IMPL_SHARED, shared, "routing shared: fused.route once per forward pass")):
            f = rows[impl]
            paired = paired_ratio(res, opts, f"{case} {impl}", fn, cub, xs)
            f["note"] = (f"{paired[0]:.3f}x cuBLAS useful (paired); speedup {ratio(rows[IMPL_GATHER], f):.2f}x vs "
                         f"gather+cuBLAS, {ratio(rows[IMPL_WHERE], f):.2f}x vs both+where")
            res.target(f"dual {kind}, {how}: ffn time / cuBLAS useful-GEMM time", paired[0], TARGET_DUAL_VS_CUBLAS,
                       True, "x", rows=[f, r_cub], why=paired_note(ratio(f, r_cub), paired))
        if kind == "rand50":
            ctx["mask50"] = mask
        del ref, routing
    cleanup()


def case_single(res: Results, opts, ctx):
    M, H, I = M_TOK, HID, INTER  # noqa: E741
    ex, xs, x_chk = ctx["ex"], ctx["xs"], ctx["x_chk"]
    log(f"[single] M={M} H={H} I={I} bf16, one expert: fused vs torch.compile(HF-style MLP)")
    flops = 6.0 * M * H * I
    ref = ffn_ref(x_chk, ex)
    w1, w3, w2 = ex.v
    fused = lambda x: torch.ops.fused.ffn(x, w1, w3, w2)  # noqa: E731
    eager = lambda x: mlp_eager(x, w1, w3, w2)  # noqa: E731
    rows = {}
    for impl, fn, note in ((IMPL_FUSED, fused, ""), (IMPL_EAGER, eager, "info")):
        rows[impl] = measure(res, opts, "single", impl, fn, xs, flops, note=note,
                             check=lambda fn=fn: rel_err(poisoned_call(fn, x_chk, out_bytes=M * H * 2), ref))
    measure_pdl_off(res, opts, "single", fused, xs, flops)
    r_comp = None
    if opts.no_compile:
        log("  torch.compile skipped (--no-compile)")
    else:
        t0 = time.monotonic()
        try:
            compiled = torch.compile(mlp_eager, dynamic=False)
            with torch.no_grad():
                compiled(x_chk, w1, w3, w2)  # compile outside the timing
            log(f"  (torch.compile: {time.monotonic() - t0:.1f} s)")
            comp = lambda x: compiled(x, w1, w3, w2)  # noqa: E731
            r_comp = measure(res, opts, "single", IMPL_COMPILE, comp, xs, flops, note="inductor, default mode",
                             check=lambda: rel_err(poisoned_call(comp, x_chk, out_bytes=M * H * 2), ref), best_of=2)
            ctx["compiled"] = comp
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001
            res.error("torch.compile(HF-style MLP)", e)
    f = rows[IMPL_FUSED]
    f["note"] = (f"{ratio(f, ctx.get('r_cublas')):.3f}x cuBLAS useful; "
                 f"speedup {ratio(rows[IMPL_EAGER], f):.2f}x vs eager")
    if r_comp is None:
        res.target("single: ffn time / torch.compile(HF MLP) time", None, TARGET_SINGLE_VS_COMPILE, True, "x",
                   status="N/A" if opts.no_compile else "FAIL",
                   why="--no-compile" if opts.no_compile else "torch.compile failed")
    else:
        paired = paired_ratio(res, opts, "single", fused, comp, xs)
        res.target("single: ffn time / torch.compile(HF MLP) time", paired[0], TARGET_SINGLE_VS_COMPILE,
                   True, "x", rows=[f, r_comp], why=paired_note(ratio(f, r_comp), paired))
    del ref
    cleanup()


def case_memory(res: Results, opts, ctx):  # noqa: ARG001
    M, H, I = M_TOK, HID, INTER  # noqa: E741
    ex, x = ctx["ex"], ctx["x_chk"]
    mask = ctx.get("mask50")
    if mask is None:
        mask = make_mask("rand50", M, torch.Generator().manual_seed(0))
    budget = M * I * 2
    log(f"[memory] peak extra bytes of one forward (target <= M*I*2 = {budget / 2**20:.1f} MiB)")
    routing = torch.ops.fused.route(mask)  # the caller's, allocated before the forward (shared by a model's layers)
    impls = [("dual rand50", IMPL_FUSED, lambda: torch.ops.fused.ffn(x, *ex.dual_args(mask)), True),
             ("dual rand50", IMPL_SHARED, lambda: torch.ops.fused.ffn(x, *ex.dual_args(mask), routing=routing), True),
             ("single", IMPL_FUSED, lambda: torch.ops.fused.ffn(x, *ex.v), True),
             ("single", IMPL_EAGER, lambda: mlp_eager(x, *ex.v), False),
             ("dual rand50", IMPL_GATHER, lambda: gather_dual(ex, mask)(x), False)]
    if ctx.get("compiled") is not None:
        impls.append(("single", IMPL_COMPILE, lambda: ctx["compiled"](x), False))
    for case, impl, fn, is_target in impls:
        try:
            extra, out_bytes = peak_extra_bytes(fn)
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001
            res.error(f"memory {case}/{impl}", e)
            if is_target:
                res.target(f"memory {case}, {impl}: peak extra forward memory / (M*I elements)", None, 1.0, True,
                           "x", why="error")
            continue
        log(f"  memory {case:12s} {impl:16s} extra {extra / 2**20:8.1f} MiB = {extra / budget:.3f} x M*I*2 bytes "
            f"({extra - budget:+,d} B; output {out_bytes / 2**20:.1f} MiB)")
        res.add_row(case=f"memory {case}", impl=impl, ms=float("nan"), tflops=float("nan"), gbps=float("nan"),
                    err=None, ok=True, error=None, note=f"peak extra {extra / 2**20:.1f} MiB = {extra / budget:.3f}x "
                                                        f"M*I elements")
        if is_target:
            res.target(f"memory {case}, {impl}: peak extra forward memory / (M*I elements of bf16)", extra / budget,
                       1.0, True, "x", why=f"{extra - budget:+,d} B vs M*I*2" if extra != budget else "")
    cleanup()


def case_bwd(res: Results, opts, ctx):
    M, H, I = M_TOK, HID, INTER  # noqa: E741
    dt = torch.bfloat16
    ex = ctx["ex"]
    log(f"[bwd] M={M} H={H} I={I} bf16: ffn_backward vs the same GEMMs in cuBLAS (forward recompute included)")
    nsets = common.rotation_count(2 * M * H * 2)
    sets = [(torch.randn(M, H, device=DEV, dtype=dt), torch.randn(M, H, device=DEV, dtype=dt)) for _ in range(nsets)]
    g_chk, x_chk = torch.randn(M, H, device=DEV, dtype=dt), torch.randn(M, H, device=DEV, dtype=dt)
    flops = 16.0 * M * H * I
    w13, w2 = ex.w13[1], ex.W2[1]

    def cublas(g, x):
        y = F.linear(x, w13)  # recompute [M, 2I]
        dh = torch.mm(g, w2)  # [M, I]
        dw2 = torch.mm(g.t(), y[:, :I])  # [H, I] (y's first half stands in for h)
        dx = torch.mm(y, w13)  # [M, H]   (y stands in for dG)
        dw13 = torch.mm(y.t(), x)  # [2I, H]
        return y, dh, dw2, dx, dw13

    def cublas_chk():
        y, dh, dw2, dx, dw13 = poisoned_call(cublas, g_chk, x_chk)
        y64, g64, x64 = y.double(), g_chk.double(), x_chk.double()
        return rel_errs([y, dh, dw2, dx, dw13],
                        [x64 @ w13.double().t(), g64 @ w2.double(), g64.t() @ y64[:, :I], y64 @ w13.double(),
                         y64.t() @ x64])

    r_cub = measure(res, opts, "bwd", IMPL_CUBLAS, cublas, sets, flops, check=cublas_chk,
                    note="5 GEMMs, 16·M·H·I FLOPs, one expert, no routing", best_of=2)
    mask = ctx.get("mask50")
    if mask is None:
        mask = make_mask("rand50", M, torch.Generator().manual_seed(0))
    # The saved-activation backward (the default of ffn's autograd): gate and up from the forward, so the GEMMs it
    # needs are the six of 12·M·H·I FLOPs (target #32: <= 1.05x them in cuBLAS).
    d13 = torch.randn(M, 2 * I, device=DEV, dtype=dt)  # stands for [d_gate | d_up] (and its first half for h)

    def cublas_saved(g, x):
        return torch.mm(g, w2), torch.mm(g.t(), d13[:, :I]), torch.mm(d13, w13), torch.mm(d13.t(), x)

    r_cub_saved = measure(res, opts, "bwd saved", IMPL_CUBLAS, cublas_saved, sets, 12.0 * M * H * I,
                          note="4 GEMMs, 12·M·H·I FLOPs, one expert, no routing", best_of=2)
    for case, m in (("bwd saved dual rand50", mask), ("bwd saved single", None)):
        args = ex.dual_args(m) if m is not None else ex.v
        gate_up = {x.data_ptr(): torch.ops.fused.ffn_forward(x, *args)[1] for _, x in sets}
        gu_chk = torch.ops.fused.ffn_forward(x_chk, *args)[1]
        fused = lambda g, x, args=args, gu=gate_up: torch.ops.fused.ffn_backward(  # noqa: E731
            g, x, *args, gate_up=gu.get(x.data_ptr(), gu_chk))

        def chk(fused=fused, m=m):
            got = poisoned_call(fused, g_chk, x_chk, out_bytes=(M * H + 3 * H * I) * 2)
            return rel_errs(got, ffn_bwd_ref(g_chk, x_chk, ex, m))

        f = measure(res, opts, case, IMPL_FUSED, fused, sets, 12.0 * M * H * I, check=chk,
                    note="grad x + " + ("6" if m is not None else "3") + " weight grads, gate and up saved")
        paired = paired_ratio(res, opts, case, fused, cublas_saved, sets)
        res.target(f"{case}: ffn_backward (saved gate/up) time / cuBLAS GEMM time", paired[0], TARGET_BWD_SAVED,
                   True, "x", rows=[f, r_cub_saved], why=paired_note(ratio(f, r_cub_saved), paired))
        f["note"] += f"; {paired[0]:.3f}x cuBLAS GEMM time (paired)"
        del gate_up
    for case, m in (("bwd dual rand50", mask), ("bwd single", None)):
        args = ex.dual_args(m) if m is not None else ex.v
        fused = lambda g, x, args=args: torch.ops.fused.ffn_backward(g, x, *args)  # noqa: E731 (recompute)

        def chk(fused=fused, m=m):
            got = poisoned_call(fused, g_chk, x_chk, out_bytes=(M * H + 3 * H * I) * 2)
            return rel_errs(got, ffn_bwd_ref(g_chk, x_chk, ex, m))

        f = measure(res, opts, case, IMPL_FUSED, fused, sets, flops, check=chk,
                    note="grad x + " + ("6" if m is not None else "3") + " weight grads")
        if m is not None:  # frozen text expert: half of dw2's and dw1/dw3's FLOPs (3 of 16 M·H·I) are not asked for
            frozen = lambda g, x, args=args: torch.ops.fused.ffn_backward(  # noqa: E731
                g, x, *args, output_mask=[True] * 4 + [False] * 3)
            measure(res, opts, case, IMPL_FUSED + " frozen text", frozen, sets, flops * 13 / 16,
                    check=lambda fn=frozen: chk(fn), note="info: grad x and the vision expert's 3 weight grads")
        paired = paired_ratio(res, opts, case, fused, cublas, sets)
        res.target(f"{case}: ffn_backward time / cuBLAS GEMM time", paired[0], TARGET_BWD_VS_CUBLAS, True, "x",
                   rows=[f, r_cub], why=paired_note(ratio(f, r_cub), paired))
        f["note"] += f"; {paired[0]:.3f}x cuBLAS GEMM time (paired)"
    del sets
    cleanup()


def case_decode(res: Results, opts, ctx):
    H, I = HID, INTER  # noqa: E741
    dt = torch.bfloat16
    ex = ctx["ex"]
    per_expert = 3 * I * H * 2
    log(f"[decode] M in {DECODE_MS}: weight-read bandwidth vs copy bandwidth ({per_expert / 2**20:.0f} MiB/expert)")
    copy_gbps = {}
    for n_exp in (1, 2):
        nbytes = n_exp * per_expert
        try:
            copy_gbps[n_exp] = common.copy_bandwidth(nbytes, warmup=opts.warmup, rep=opts.rep, dev=DEV)
            log(f"  copy of {nbytes / 2**20:.0f} MiB: {copy_gbps[n_exp]:.0f} GB/s (read + write)")
            res.add_row(case=f"decode copy {n_exp}x", impl="copy (ceiling)", ms=2 * nbytes / copy_gbps[n_exp] / 1e6,
                        tflops=float("nan"), gbps=copy_gbps[n_exp], err=None, ok=True, error=None,
                        note=f"dst.copy_(src) of {nbytes / 2**20:.0f} MiB, GB/s counts read + write")
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001
            res.error(f"decode copy {n_exp}", e)
    gen = torch.Generator().manual_seed(3)
    for M in DECODE_MS:
        for kind in ("single", "dual"):
            case = f"decode M={M} {kind}"
            x = torch.randn(M, H, device=DEV, dtype=dt)
            if kind == "dual":
                mask = make_mask("rand50", M, gen)
                if M >= 2 and (bool(mask.all()) or not bool(mask.any())):
                    mask[0] = ~mask[0]  # both experts present
                n_exp = int(bool(mask.any())) + int(not bool(mask.all()))
                args = ex.dual_args(mask)
            else:
                mask, n_exp, args = None, 1, ex.v
            ref = ffn_ref(x, ex, mask)
            fused = lambda x, args=args: torch.ops.fused.ffn(x, *args)  # noqa: E731
            wbytes = n_exp * per_expert
            f = measure(res, opts, case, IMPL_FUSED, fused, [(x,)], 6.0 * M * H * I, wbytes=wbytes,
                        check=lambda fused=fused, x=x, ref=ref: rel_err(poisoned_call(fused, x, out_bytes=M * H * 2),
                                                                         ref),
                        note=f"{n_exp} expert(s): {wbytes / 2**20:.0f} MiB of weights")
            measure_pdl_off(res, opts, case, fused, [(x,)], 6.0 * M * H * I, wbytes=wbytes)
            if kind == "dual" and M in (1, 16):
                g = measure(res, opts, case, IMPL_GATHER, gather_dual(ex, mask), [(x,)], 6.0 * M * H * I,
                            wbytes=wbytes, note="info",
                            check=lambda x=x, ref=ref, mask=mask: rel_err(gather_dual(ex, mask)(x), ref))
                f["note"] += f"; speedup {ratio(g, f):.2f}x vs gather+cuBLAS"
            # The ceiling is the higher of the two copies (both are far past L2, so both measure HBM): a copy
            # measured low by a disturbance would otherwise inflate every ratio (seen once: 2556 vs 2993 GB/s).
            cg = max(copy_gbps.values(), default=float("nan"))
            frac = f["gbps"] / cg if cg == cg and cg > 0 else float("nan")
            f["note"] += f"; {100 * frac:.0f}% of copy GB/s"
            res.target(f"{case}: weight-read GB/s / copy GB/s", frac, TARGET_DECODE_BW, False, "", rows=[f])
    cleanup()


def case_mid(res: Results, opts, ctx):
    H, I = HID, INTER  # noqa: E741
    dt = torch.bfloat16
    ex = ctx["ex"]
    log(f"[mid] M in {MID_MS}: dual rand50 against gather+cuBLAS and cuBLAS useful (information)")
    gen = torch.Generator().manual_seed(4)
    cub = cublas_useful(ex.w13[1], ex.W2[1], I)
    for M in MID_MS:
        case = f"mid M={M} rand50"
        mask = make_mask("rand50", M, gen)
        xs = [(torch.randn(M, H, device=DEV, dtype=dt),) for _ in range(common.rotation_count(M * H * 2))]
        x_chk = xs[0][0]
        flops = 6.0 * M * H * I
        ref = ffn_ref(x_chk, ex, mask)
        fused = lambda x, mask=mask: torch.ops.fused.ffn(x, *ex.dual_args(mask))  # noqa: E731
        gather = gather_dual(ex, mask)
        rows = {}
        for impl, fn, note, want in (
                (IMPL_FUSED, fused, "", ref),
                (IMPL_GATHER, gather, "indices, [W1;W3] prepared (untimed)", ref),
                (IMPL_CUBLAS, cub, "one expert, all rows", cublas_useful_ref(x_chk, ex.w13[1], ex.W2[1], I))):
            rows[impl] = measure(res, opts, case, impl, fn, xs, flops, note=note,
                                 check=lambda fn=fn, want=want: rel_err(poisoned_call(fn, x_chk, out_bytes=M * H * 2),
                                                                        want))
        f = rows[IMPL_FUSED]
        paired = paired_ratio(res, opts, case, fused, gather, xs)
        f["note"] = (f"{paired[0]:.3f}x gather+cuBLAS time (paired), speedup {ratio(rows[IMPL_GATHER], f):.2f}x; "
                     f"{ratio(f, rows[IMPL_CUBLAS]):.3f}x cuBLAS useful")
        del xs, ref
    cleanup()


# =============================================================================== reporting
def render_markdown(res: Results, meta: dict) -> str:
    lines = [f"# SwiGLU FFN (ffn) benchmark on {meta['device']}", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}, L2 {meta['l2_bytes'] / 2**20:.0f} MiB, warmup "
             f"{meta['warmup']}, rep {meta['rep']} (median of CUDA-event times, inputs rotated past 2x L2). "
             f"M={M_TOK}, H={HID}, I={INTER} bf16; TFLOP/s = useful work / time.", ""]
    headers = ["case", "impl", "ms", "TFLOP/s", "GB/s", "err", "note"]
    rows = []
    for r in res.rows:
        note = r.get("note") or ""
        if r.get("error"):
            note = (note + " ERROR: " + r["error"][:120]).strip()
        err = r.get("err")
        rows.append([r["case"], r["impl"], r["ms"], r["tflops"], r.get("gbps"),
                     (f"{err:.1e}" + ("" if r.get("ok") else " WRONG")) if err is not None else "-", note])
    lines.append(common.format_table(headers, rows, [None, None, ".4f", ".1f", ".0f", None, None]))
    lines += ["", f"Targets ({meta['device']}):", ""]
    for t in res.targets:
        lines.append(f"- {t['status']}: {t['name']}: {t['shown']} (target {t['cmp']} {t['threshold']})"
                     + (f" ({t['why']})" if t["why"] else ""))
    if res.errors:
        lines += ["", "Errors:", ""] + [f"- {e['where']}: {e['error']}" for e in res.errors]
    if meta.get("interrupted"):
        lines += ["", f"INTERRUPTED: {meta['interrupted']} (partial results)"]
    return "\n".join(lines) + "\n"


# =============================================================================== main
CASES = ("dual", "single", "memory", "bwd", "decode", "mid")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per measurement (default 5)")
    p.add_argument("--rep", type=int, default=20, help="timed calls per measurement (default 20)")
    p.add_argument("--only", default=",".join(CASES), help=f"comma list of cases: {','.join(CASES)}")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline (its target is N/A)")
    p.add_argument("--out", metavar="DIR", help=f"also write {NAME}.json and {NAME}.md here")
    a = p.parse_args(argv)
    a.only = {c.strip() for c in a.only.split(",") if c.strip()}
    bad = a.only - set(CASES)
    if bad:
        p.error(f"unknown case(s) in --only: {', '.join(sorted(bad))}")
    if a.warmup < 1 or a.rep < 1:
        p.error("--warmup and --rep must be >= 1")
    return a


def main(argv=None) -> int:
    global torch, F, common, DEV
    opts = parse_args(argv)
    torch, F, DEV = open_device(NAME, ("ffn", "ffn_backward"))
    import common as _common

    common = _common
    ctx = {}

    def setup():  # the experts' weights and the rotating inputs every m = 4096 case shares
        ctx["ex"] = Experts(HID, INTER, torch.bfloat16)
        nsets = common.rotation_count(M_TOK * HID * 2)
        ctx["xs"] = [(torch.randn(M_TOK, HID, device=DEV, dtype=torch.bfloat16),) for _ in range(nsets)]
        ctx["x_chk"] = torch.randn(M_TOK, HID, device=DEV, dtype=torch.bfloat16)

    cases = [(name, lambda res, run=run: run(res, opts, ctx))
             for name, run in (("dual", case_dual), ("single", case_single), ("memory", case_memory),
                               ("bwd", case_bwd), ("decode", case_decode), ("mid", case_mid))]
    res, meta = run_cases(NAME, opts, DEV, cases, setup=setup)
    return finish(NAME, res, meta, render_markdown(res, meta), opts.out)


if __name__ == "__main__":
    sys.exit(main())
