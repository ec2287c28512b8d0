#!/usr/bin/env python3
"""Routed linear benchmark: torch.ops.fused.linear_dual (each token through the vision or the text expert) against
cuBLAS and the usual unfused ways of writing it.

    python3 benchmarks/bench_linear_dual.py             # ~30 s on an H100
    python3 benchmarks/bench_linear_dual.py --only fwd,decode --rep 50
    python3 benchmarks/bench_linear_dual.py --out DIR   # also write DIR/bench_linear_dual.{json,md}

Cases (bf16, weights nn.Linear [N, K] stacked in one [2, N, K] tensor as DualLinear stores them, no bias):
  fwd     M = K = N = 4096, masks rand50 / all_true / all_false / span (one contiguous vision run of M/2 tokens):
            fused_ops            linear_dual, routing the mask itself
            fused_ops, shared routing   linear_dual given fused.route(mask), computed once outside the timing, as
                                 a model does for all its layers' routed ops on one mask ("fused.route": its time)
            cuBLAS 1 GEMM        F.linear(x, weight_v): the same M, N, K as ONE GEMM (the ceiling; target <= 1.1x)
            both + where         both experts over all tokens, torch.where(mask, y_v, y_t) (2x the FLOPs)
            gather+cuBLAS        index_select each expert's rows, F.linear per expert, index_copy_ back
                                 (row indices precomputed outside the timing: favours this baseline)
  bwd     same shapes and masks: linear_dual_backward of this layer without biases (grad x + both grad weights,
          output_mask [T, T, T, F, F], and the routing linear_dual_forward returned: as autograd calls it) against
          the cuBLAS time of the same GEMMs on all M rows: dX = dY·W and dW = dYᵀ·X (target <= 1.2x); gather+cuBLAS
          backward as information. rand50 also times, as information, the op routing the mask again (no routing
          argument, "routes again"), all five outputs ("+ bias grads") and a frozen text expert (grad x and grad
          weight_v only, "frozen text").
  decode  M = 1, 4, 16, 64 tokens, random mask: linear_dual vs gather+cuBLAS (and one F.linear); weights rotated
          past L2, so every call reads them from HBM. Target: no slower than gather+cuBLAS (paired ratio <= 1).
  mid     M = 256, 1024, 2048 tokens (prefill between decode and the 4096-token target), random mask, weights
          rotated past L2: linear_dual vs gather+cuBLAS and one F.linear. Information, no target.
The fused op is also timed with programmatic dependent launch off ("fused_ops PDL off", fwd and decode for every
mask, bwd rand50): what launching each kernel early saves (information, no target).

TFLOP/s count useful work only: 2·M·N·K (each token through one expert); "both + where" is charged the same.
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
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from routed_harness import (Results, cleanup, finish, log, measure, measure_pdl_off, open_device,  # noqa: E402
                            paired_note, paired_ratio, poisoned_call, ratio, rel_err, run_cases)

NAME = "bench_linear_dual"
TARGET_FWD_VS_CUBLAS = 1.10
TARGET_BWD_VS_CUBLAS = 1.20
SIZE = 4096
DECODE_MS = (1, 4, 16, 64)
TARGET_DECODE_VS_GATHER = 1.0
MID_MS = (256, 1024, 2048)
MASKS = ("rand50", "all_true", "all_false", "span")

IMPL_FUSED = "fused_ops"
IMPL_SHARED = "fused_ops, shared routing"
IMPL_ROUTE = "fused.route"
IMPL_CUBLAS = "cuBLAS 1 GEMM"
IMPL_WHERE = "both + where"
IMPL_GATHER = "gather+cuBLAS"

torch = None  # set in main() after the environment checks
F = None
common = None
DEV = None


# =============================================================================== inputs and implementations
def make_mask(kind: str, M: int, gen) -> "torch.Tensor":
    if kind == "rand50":
        m = torch.rand(M, generator=gen) < 0.5
    elif kind == "all_true":
        m = torch.ones(M, dtype=torch.bool)
    elif kind == "all_false":
        m = torch.zeros(M, dtype=torch.bool)
    elif kind == "span":
        m = torch.zeros(M, dtype=torch.bool)
        m[M // 4: M // 4 + max(1, M // 2)] = True
    else:
        raise ValueError(kind)
    return m.to(DEV)


def stacked_weights(N, K, dtype):
    """[2, N, K] (0 = text, 1 = vision), nn.Linear-scaled, and its (weight_v, weight_t) views."""
    w = (torch.randn(2, N, K, device=DEV, dtype=torch.float32) / math.sqrt(K)).to(dtype)
    return w, w[1], w[0]


def fused_fwd(mask, wv, wt, routing=None):
    return lambda x: torch.ops.fused.linear_dual(x, mask, wv, wt, routing=routing)


def gather_fwd(iv, it, wv, wt, N):
    def fn(x):
        out = x.new_empty(x.shape[0], N)
        out.index_copy_(0, iv, F.linear(x.index_select(0, iv), wv))
        out.index_copy_(0, it, F.linear(x.index_select(0, it), wt))
        return out
    return fn


def ref_fwd(x, mask, wv, wt):
    """float64 [M, N], each row through its own expert."""
    x64 = x.double()
    return torch.where(mask[:, None], x64 @ wv.double().t(), x64 @ wt.double().t())


def ref_bwd(g, x, mask, wv, wt):
    """float64 (grad_x, grad_wv, grad_wt, grad_bv, grad_bt)."""
    g64, x64 = g.double(), x.double()
    mv = mask[:, None].double()
    gx = torch.where(mask[:, None], g64 @ wv.double(), g64 @ wt.double())
    return gx, (g64 * mv).t() @ x64, (g64 * (1 - mv)).t() @ x64, (g64 * mv).sum(0), (g64 * (1 - mv)).sum(0)


# =============================================================================== cases
def case_fwd(res: Results, opts):
    M = K = N = SIZE
    dt = torch.bfloat16
    log(f"[fwd] M={M} K={K} N={N} bf16, 2 experts")
    gen = torch.Generator().manual_seed(0)
    w, wv, wt = stacked_weights(N, K, dt)
    nsets = common.rotation_count(M * K * 2)
    xs = [(torch.randn(M, K, device=DEV, dtype=dt),) for _ in range(nsets)]
    x_chk = torch.randn(M, K, device=DEV, dtype=dt)
    flops = 2.0 * M * N * K
    ref_one = x_chk.double() @ wv.double().t()
    cublas = lambda x: F.linear(x, wv)  # noqa: E731
    r_cublas = measure(res, opts, "fwd", IMPL_CUBLAS, cublas, xs, flops,
                       check=lambda: rel_err(poisoned_call(cublas, x_chk), ref_one),
                       note="F.linear(x, weight_v): same M, N, K, one expert (ceiling)", best_of=2)
    del ref_one
    for kind in MASKS:
        case = f"fwd {kind}"
        mask = make_mask(kind, M, gen)
        iv, it = mask.nonzero().reshape(-1), (~mask).nonzero().reshape(-1)
        ref = ref_fwd(x_chk, mask, wv, wt)
        # The mask's routing, computed once as a model does for all its routed ops (fused.route; not timed here,
        # its own time is the "fused.route" row).
        routing = torch.ops.fused.route(mask)
        impls = [(IMPL_FUSED, fused_fwd(mask, wv, wt), "routes the mask itself"),
                 (IMPL_SHARED, fused_fwd(mask, wv, wt, routing), "given fused.route(mask), computed once"),
                 (IMPL_WHERE, lambda x, mask=mask: torch.where(mask[:, None], F.linear(x, wv), F.linear(x, wt)),
                  "2x the FLOPs"),
                 (IMPL_GATHER, gather_fwd(iv, it, wv, wt, N), "indices precomputed (untimed)")]
        rows = {}
        for impl, fn, note in impls:
            rows[impl] = measure(res, opts, case, impl, fn, xs, flops, note=note,
                                 check=lambda fn=fn: rel_err(poisoned_call(fn, x_chk, out_bytes=M * N * 2), ref))
        measure_pdl_off(res, opts, case, impls[0][1], xs, flops)
        measure(res, opts, case, IMPL_ROUTE, lambda x, mask=mask: torch.ops.fused.route(mask), xs, 0.0,
                note="info: the routing alone, once per forward pass for all routed ops on the mask")
        for impl, fn, how in ((IMPL_FUSED, impls[0][1], "the op routes the mask"),
                              (IMPL_SHARED, impls[1][1], "routing shared: fused.route once per forward pass")):
            f = rows[impl]
            paired = paired_ratio(res, opts, f"{case} {impl}", fn, cublas, xs)
            f["note"] = (f"{paired[0]:.3f}x cuBLAS time (paired); speedup {rows[IMPL_GATHER]['ms'] / f['ms']:.2f}x "
                         f"vs gather+cuBLAS, {rows[IMPL_WHERE]['ms'] / f['ms']:.2f}x vs both+where")
            res.target(f"fwd {kind}, {how}: linear_dual time / cuBLAS F.linear time (M=K=N={M})", paired[0],
                       TARGET_FWD_VS_CUBLAS, True, "x", rows=[f, r_cublas], why=paired_note(ratio(f, r_cublas), paired))
        del ref, routing
    del xs, w
    cleanup()


def case_bwd(res: Results, opts):
    M = K = N = SIZE
    dt = torch.bfloat16
    log(f"[bwd] M={M} K={K} N={N} bf16: grad x + both grad weights (no biases)")
    gen = torch.Generator().manual_seed(1)
    w, wv, wt = stacked_weights(N, K, dt)
    nsets = common.rotation_count(M * (K + N) * 2)
    sets = [(torch.randn(M, N, device=DEV, dtype=dt), torch.randn(M, K, device=DEV, dtype=dt)) for _ in range(nsets)]
    g_chk, x_chk = torch.randn(M, N, device=DEV, dtype=dt), torch.randn(M, K, device=DEV, dtype=dt)
    flops = 2.0 * 2.0 * M * N * K  # dX (M x K x N) + dW of both experts (N x K over M rows in all)

    def cublas(g, x):
        return torch.mm(g, wv), torch.mm(g.t(), x)

    def cublas_chk():
        gx, gw = poisoned_call(cublas, g_chk, x_chk)
        g64, x64 = g_chk.double(), x_chk.double()
        return max(rel_err(gx, g64 @ wv.double()), rel_err(gw, g64.t() @ x64))

    r_cublas = measure(res, opts, "bwd", IMPL_CUBLAS, cublas, sets, flops, check=cublas_chk,
                       note="dY·W + dYᵀ·X over all M rows, one expert (same GEMMs, no routing)", best_of=2)
    for kind in MASKS:
        case = f"bwd {kind}"
        mask = make_mask(kind, M, gen)
        iv, it = mask.nonzero().reshape(-1), (~mask).nonzero().reshape(-1)

        # what autograd saves from the forward (the routing depends on the mask only)
        routing = torch.ops.fused.linear_dual_forward(x_chk, mask, wv, wt)[1]

        def backward(want, mask=mask, routing=routing):
            return lambda g, x: torch.ops.fused.linear_dual_backward(g, x, mask, wv, wt, output_mask=want,
                                                                     routing=routing)
        fused = backward([True, True, True, False, False])  # a layer without biases: what autograd asks for

        def gather(g, x, iv=iv, it=it):
            gx = torch.empty_like(x)
            grads = []
            for rows, we in ((iv, wv), (it, wt)):
                ge, xe = g.index_select(0, rows), x.index_select(0, rows)
                gx.index_copy_(0, rows, torch.mm(ge, we))
                grads.append(torch.mm(ge.t(), xe))
            return gx, grads[0], grads[1], None, None

        ref = ref_bwd(g_chk, x_chk, mask, wv, wt)

        def chk(fn):
            got = poisoned_call(fn, g_chk, x_chk, out_bytes=(M * K + 2 * N * K) * 2)
            errs = []
            for gt, rf in zip(got, ref):
                if gt is None:  # not asked for
                    continue
                if float(rf.norm()) == 0:  # an expert with no tokens: its gradients must be exactly zero
                    errs.append(0.0 if not bool(gt.any()) else float("inf"))
                else:
                    errs.append(rel_err(gt, rf))
            return max(errs)

        impls = [(IMPL_FUSED, fused, "linear_dual_backward, grad x and both grad weights", flops),
                 (IMPL_GATHER, gather, "info: indices precomputed (untimed)", flops)]
        if kind == "rand50":  # the frozen text expert's weight gradient is half of the grad-weight FLOPs here
            impls += [(IMPL_FUSED + " routes again", backward([True, True, True, False, False], routing=None),
                       "info: no routing argument, the op routes the mask itself", flops),
                      (IMPL_FUSED + " + bias grads", backward([True] * 5), "info: all five outputs", flops),
                      (IMPL_FUSED + " frozen text", backward([True, True, False, False, False]),
                       "info: grad x and grad weight_v only", 0.75 * flops)]
        rows = {}
        for impl, fn, note, fl in impls:
            rows[impl] = measure(res, opts, case, impl, fn, sets, fl, check=lambda fn=fn: chk(fn), note=note)
        if kind == "rand50":
            measure_pdl_off(res, opts, case, fused, sets, flops)
        f = rows[IMPL_FUSED]
        paired = paired_ratio(res, opts, case, fused, cublas, sets)
        f["note"] += (f"; {paired[0]:.3f}x cuBLAS GEMM time (paired); speedup {rows[IMPL_GATHER]['ms'] / f['ms']:.2f}x"
                      " vs gather")
        res.target(f"bwd {kind}: linear_dual_backward time / cuBLAS GEMM time", paired[0], TARGET_BWD_VS_CUBLAS,
                   True, "x", rows=[f, r_cublas], why=paired_note(ratio(f, r_cublas), paired))
        del ref
    del sets, w
    cleanup()


def _per_m_case(res: Results, opts, label: str, ms, seed: int, target: bool):
    """linear_dual at each M of `ms` (random mask, both experts present), K = N = 4096, weights rotated past L2 so
    every call reads them from HBM: against gather+cuBLAS (paired ratio; a target when `target`) and one F.linear."""
    K = N = SIZE
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    nw = common.rotation_count(2 * N * K * 2)
    ws = [stacked_weights(N, K, dt) for _ in range(nw)]
    for M in ms:
        case = f"{label} M={M}"
        mask = make_mask("rand50", M, gen)
        if M >= 2 and (bool(mask.all()) or not bool(mask.any())):
            mask[0] = ~mask[0]  # both experts present
        n_exp = int(bool(mask.any())) + int(not bool(mask.all()))
        iv, it = mask.nonzero().reshape(-1), (~mask).nonzero().reshape(-1)
        sets = [(torch.randn(M, K, device=DEV, dtype=dt), w[1], w[2]) for w in ws]
        x_chk = sets[0][0]
        ref = ref_fwd(x_chk, mask, ws[0][1], ws[0][2])
        flops = 2.0 * M * N * K
        wbytes = n_exp * N * K * 2

        def fused(x, wv, wt, mask=mask):
            return torch.ops.fused.linear_dual(x, mask, wv, wt)

        def gather(x, wv, wt, iv=iv, it=it):
            return gather_fwd(iv, it, wv, wt, N)(x)

        impls = [(IMPL_FUSED, fused, ""),
                 (IMPL_GATHER, gather, "indices precomputed (untimed)"),
                 (IMPL_CUBLAS, lambda x, wv, wt: F.linear(x, wv), "one expert only (reads half the weights)")]
        rows = {}
        for impl, fn, note in impls:
            want = x_chk.double() @ ws[0][1].double().t() if impl == IMPL_CUBLAS else ref

            def chk(fn=fn, want=want):
                return rel_err(poisoned_call(fn, *sets[0], out_bytes=M * N * 2), want)

            wb = N * K * 2 if impl == IMPL_CUBLAS else wbytes
            rows[impl] = measure(res, opts, case, impl, fn, sets, flops, check=chk, note=note, wbytes=wb)
        measure_pdl_off(res, opts, case, fused, sets, flops, wbytes=wbytes)
        f, g = rows[IMPL_FUSED], rows[IMPL_GATHER]
        paired = paired_ratio(res, opts, case, fused, gather, sets)
        f["note"] = (f"{n_exp} expert(s) read; {paired[0]:.3f}x gather+cuBLAS time (paired), speedup "
                     f"{ratio(g, f):.2f}x; {ratio(f, rows[IMPL_CUBLAS]):.2f}x one F.linear")
        if target:
            res.target(f"{case}: linear_dual time / gather+cuBLAS time", paired[0], TARGET_DECODE_VS_GATHER, True, "x",
                       rows=[f, g], why=paired_note(ratio(f, g), paired))
        del sets, ref
    del ws
    cleanup()


def case_decode(res: Results, opts):
    log(f"[decode] M in {DECODE_MS}, K=N={SIZE} bf16, random mask, weights rotated past L2")
    _per_m_case(res, opts, "decode", DECODE_MS, seed=2, target=True)


def case_mid(res: Results, opts):
    log(f"[mid] M in {MID_MS}, K=N={SIZE} bf16, random mask, weights rotated past L2 (information)")
    _per_m_case(res, opts, "mid", MID_MS, seed=3, target=False)


# =============================================================================== reporting
def render_markdown(res: Results, meta: dict) -> str:
    lines = [f"# Routed linear (linear_dual) benchmark on {meta['device']}", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}, L2 {meta['l2_bytes'] / 2**20:.0f} MiB, warmup "
             f"{meta['warmup']}, rep {meta['rep']} (median of CUDA-event times, inputs rotated past 2x L2). "
             "TFLOP/s = useful work (2·M·N·K, each token through one expert) / time.", ""]
    headers = ["case", "impl", "ms", "TFLOP/s", "GB/s (weights)", "err", "note"]
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
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per measurement (default 5)")
    p.add_argument("--rep", type=int, default=20, help="timed calls per measurement (default 20)")
    p.add_argument("--only", default="fwd,bwd,decode,mid", help="comma list of cases: fwd,bwd,decode,mid")
    p.add_argument("--out", metavar="DIR", help=f"also write {NAME}.json and {NAME}.md here")
    a = p.parse_args(argv)
    a.only = {c.strip() for c in a.only.split(",") if c.strip()}
    bad = a.only - {"fwd", "bwd", "decode", "mid"}
    if bad:
        p.error(f"unknown case(s) in --only: {', '.join(sorted(bad))}")
    if a.warmup < 1 or a.rep < 1:
        p.error("--warmup and --rep must be >= 1")
    return a


def main(argv=None) -> int:
    global torch, F, common, DEV
    opts = parse_args(argv)
    torch, F, DEV = open_device(NAME, ("linear_dual", "linear_dual_backward"))
    import common as _common

    common = _common
    cases = [(name, lambda res, run=run: run(res, opts))
             for name, run in (("fwd", case_fwd), ("bwd", case_bwd), ("decode", case_decode), ("mid", case_mid))]
    res, meta = run_cases(NAME, opts, DEV, cases)
    return finish(NAME, res, meta, render_markdown(res, meta), opts.out)


if __name__ == "__main__":
    sys.exit(main())
