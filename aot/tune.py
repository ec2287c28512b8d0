"""Config search on the local GPU: times candidate block configs of each kernel over a grid of shapes with Triton's
JIT (tuning time only; the built package never runs Triton) and writes the winners as the architecture's config table.

    python -m aot.tune [--ops linear,swiglu,grad_weight,rope] [--ms 1,16,64,256,1024,4096,16384]
                       [--models 7b,13b,70b] [--results tune_sm90.jsonl] [--write aot/configs/sm90.json]
                       [--rep 20] [--budget-s SECONDS]

then rebuild (`bash scripts/retune.sh` does both). What it does:
* kernels: on sm_90 the TMA GEMMs (routed_linear_tma / routed_swiglu_tma / routed_grad_weight_tma), elsewhere the
  pointer GEMMs; and rope_kernel. The alternative designs are ops of their own, measured with the design they may
  replace: linear_gather / swiglu_gather (x gathered inside the GEMM; against linear / swiglu plus the gather copy)
  and swiglu_pair (gate and up in one MMA; against swiglu); --write turns each on per m where it wins. bf16 inputs:
  the "half" family (fp16 runs the same MMA shapes); the fp32 families keep their table entries.
* shapes: m (token rows; the reduction length for grad-weight) from --ms, times the projections of Llama-style
  models (--models: hidden / intermediate sizes of Llama-2 7B, 13B and 70B): linear N x K = H x H and H x I, swiglu
  I x H, grad-weight H x H and I x H. 50% random routing mask (both experts busy); for m <= SINGLE_MAX_M the
  linear and gate/up kernels are also measured with one expert (the Llama MLP's routing: perm = arange, x read in
  place; shapes named "..._single"), and a bucket's winner is the best over both routings.
* candidates: CANDIDATES below plus every config the current table already uses for the kernel (so "default" is
  always measured next to the winner).
* each (shape, candidate) is checked once against a float64 reference on sampled rows / columns before it is timed,
  so a fast wrong config cannot win; timings are medians of CUDA-event times over inputs rotated past the L2
  (benchmarks/common.py).
* results append to --results (JSON lines), one per (kernel, shape, candidate): a killed or --budget-s-limited run
  resumes where it stopped. A progress line per measurement shows [done/total] and the elapsed time.
* --write: per kernel and m, the candidate with the lowest geometric mean of (time / best time) over the shapes of
  that m wins, unless the table's current config is within 2% of it (KEEP_MARGIN: measurement noise does not churn
  the table); neighbouring m with the same winner merge into one bucket (max_m = the largest m measured in it; the
  last bucket is open-ended). Kernels and families not measured keep their entries. The table is validated.
  --offline redoes this from a result file without a GPU. --keep OLD.jsonl adds an earlier run's measurements of the
  m this run does not measure, so a partial re-tune (say --ms 1,4,16,64) rewrites the whole bucket list.
"""
import argparse
import datetime
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import torch  # noqa: E402

from aot import config_table as ct  # noqa: E402
from benchmarks import common  # noqa: E402

DEV = "cuda"
DTYPE = torch.bfloat16  # what the "half" family is measured with
MODELS = {"7b": (4096, 11008), "13b": (5120, 13824), "70b": (8192, 28672)}  # Llama-2: hidden, intermediate
SINGLE_MAX_M = 64  # up to this m, linear and swiglu are measured with one expert too (decode of the Llama MLP)
# the ops a single-expert call runs (the gather-inside designs serve two experts only)
SINGLE_OPS = ("linear", "swiglu", "swiglu_pair")

# (block, group, warps, stages[, flatten[, split]]) candidates per kernel. TMA GEMMs: 128-row tiles (the routing
# alignment) or 64 for decode, wide N for the large-m case (what cuBLAS uses on Hopper), narrow N / more stages for
# decode (more CTAs to stream the weights). Pointer GEMMs: Triton's Ampere configs that fit 99 KiB of shared memory.
# 16- and 32-row tiles: decode, where the A tile is nearly all padding and shared memory is better spent on more
# stages of W.
_TMA_DECODE = [((16, 64, 128), 8, 4, 6), ((16, 64, 128), 8, 4, 8), ((16, 32, 256), 8, 4, 4),
               ((16, 128, 128), 8, 4, 4), ((32, 64, 128), 8, 4, 6), ((16, 64, 256), 8, 4, 4)]
_TMA_LINEAR = [((128, 256, 64), 8, 8, 3), ((128, 256, 64), 8, 8, 4), ((128, 128, 64), 8, 8, 4),
               ((128, 128, 64), 8, 4, 4), ((128, 128, 128), 8, 8, 3), ((128, 64, 64), 8, 4, 4),
               ((64, 64, 128), 8, 4, 4), ((64, 128, 64), 8, 4, 4), ((64, 32, 128), 8, 4, 4),
               ((64, 32, 128), 8, 4, 6), ((64, 64, 128), 8, 4, 6), ((64, 32, 256), 8, 4, 3),
               ((128, 32, 128), 8, 4, 4), ((128, 256, 64), 8, 8, 3, True), ((128, 256, 64), 8, 8, 4, True),
               ((128, 128, 128), 8, 8, 3, True),
               # with the split last round (mid-size m)
               ((128, 256, 64), 8, 8, 3, False, True), ((128, 256, 64), 8, 8, 4, True, True),
               ((128, 128, 64), 8, 8, 4, False, True), ((128, 128, 64), 8, 4, 4, False, True)] + _TMA_DECODE
_TMA_SWIGLU = [((128, 128, 64), 8, 8, 3), ((128, 128, 64), 8, 8, 4), ((128, 64, 64), 8, 4, 4),
               ((128, 64, 64), 8, 8, 4), ((64, 64, 64), 8, 4, 4), ((64, 32, 128), 8, 4, 4),
               ((64, 32, 64), 8, 4, 6), ((128, 32, 64), 8, 4, 4), ((64, 64, 128), 8, 4, 4),
               ((16, 64, 128), 8, 4, 4), ((16, 64, 128), 8, 4, 6), ((16, 128, 64), 8, 4, 6),
               ((32, 64, 128), 8, 4, 4), ((128, 128, 64), 8, 8, 3, True), ((128, 128, 64), 8, 8, 4, True)]
_TMA_GRAD_W = [((128, 256, 32), 8, 8, 5), ((128, 256, 32), 8, 8, 6), ((128, 256, 64), 8, 8, 3),
               ((128, 128, 64), 8, 8, 4), ((128, 128, 32), 8, 8, 6), ((64, 128, 64), 8, 4, 4)]
_PTR_GEMM = [((128, 128, 64), 8, 8, 3), ((128, 128, 32), 8, 4, 4), ((128, 64, 64), 8, 4, 4),
             ((64, 128, 64), 8, 4, 4), ((64, 64, 64), 8, 4, 4), ((64, 64, 32), 8, 4, 6)]
_PTR_GRAD_W = [((128, 128, 64), 8, 8, 3), ((128, 128, 32), 8, 8, 4), ((64, 128, 64), 8, 4, 4),
               ((128, 64, 64), 8, 4, 4)]
_ROPE = [((bh, 64, 128), None, w, 1) for bh in (8, 16, 32) for w in (1, 2, 4, 8)]


def _entry(block, group, warps, stages, flatten=False, split=False):
    e = {"block": list(block)}
    if group is not None:
        e["group"] = group
    e.update(warps=warps, stages=stages)
    if flatten:
        e["flatten"] = True
    if split:
        e["split"] = True
    return e


def table_arch(cc):
    """The table a GPU of compute capability cc runs from (the launcher's choice for a default build): sm_86/sm_87
    run the sm_80 cubins."""
    arch = {8: 89 if cc == 89 else 80, 9: 90}.get(cc // 10)
    if arch is None:
        raise SystemExit(f"aot.tune: no config table for compute capability {cc} (aot/configs/ has sm80, sm89, sm90); "
                         "add the architecture to aot/manifest.py ARCHS and a table first")
    return arch


def kernels_for(cc):
    """op -> (kernel name, candidates) for this GPU."""
    if table_arch(cc) == 90:
        return {"linear": ("routed_linear_tma_kernel", _TMA_LINEAR), "swiglu": ("routed_swiglu_tma_kernel", _TMA_SWIGLU),
                "grad_weight": ("routed_grad_weight_tma_kernel", _TMA_GRAD_W), "rope": ("rope_kernel", _ROPE),
                # the other forward design: A gathered inside the GEMM instead of a gather copy (measure with linear)
                "linear_gather": ("routed_linear_gather_tma_kernel", _TMA_LINEAR),
                "swiglu_gather": ("routed_swiglu_gather_tma_kernel", _TMA_SWIGLU),
                # gate and up through one descriptor and one MMA of 2 BN columns (measure with swiglu)
                "swiglu_pair": ("routed_swiglu_pair_tma_kernel", _TMA_SWIGLU)}
    return {"linear": ("routed_linear_kernel", _PTR_GEMM), "swiglu": ("routed_swiglu_kernel", _PTR_GEMM),
            "grad_weight": ("routed_grad_weight_kernel", _PTR_GRAD_W), "rope": ("rope_kernel", _ROPE)}


# ----------------------------------------------------------------------------------------------------- measuring
def _rel(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Problem:
    """One shape of one op: inputs (rotated past the L2), a reference check and a timed call per config."""

    def __init__(self, op, kernel, m, n, k, routing="dual"):
        from kernels.routing import route, route_single
        self.op, self.kernel, self.m, self.n, self.k = op, kernel, m, n, k
        dt = DTYPE
        self.tma = kernel.endswith("_tma_kernel")
        self.single = routing == "single"
        if self.single:  # what the ffn without a mask runs: every row expert 0, x read in place (no gather copy)
            self.mask = torch.zeros(m, dtype=torch.bool, device=DEV)
            self.perm, self.seg = route_single(m, DEV)
        else:
            self.mask = torch.rand(m, device=DEV) < 0.5
            self.perm, self.seg = route(self.mask)
        valid = self.perm >= 0
        self.rows = self.perm[valid].long()  # token of each valid expert-ordered row
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        g = lambda *s, scale=1.0: torch.randn(*s, device=DEV, dtype=dt) * scale  # noqa: E731
        if op in ("linear", "linear_gather"):
            self.w = g(2, n, k, scale=k ** -0.5)
            make = lambda: (g(m, k), )  # noqa: E731
            nbytes = m * k * 2
        elif op in ("swiglu", "swiglu_gather", "swiglu_pair"):
            self.w1, self.w3 = g(2, n, k, scale=k ** -0.5), g(2, n, k, scale=k ** -0.5)
            if op == "swiglu_pair":
                self.w13 = torch.stack([self.w1, self.w3])
            make = lambda: (g(m, k), )  # noqa: E731
            nbytes = m * k * 2
        else:  # grad_weight: dW_e [n, k] = dy_eᵀ x_e over m rows
            make = lambda: (g(m, n), g(m, k))  # noqa: E731
            nbytes = m * (n + k) * 2
        self.sets = [self._prepare(make()) for _ in range(common.rotation_count(nbytes))]
        self.flops = 2 * m * n * k * (2 if op.startswith("swiglu") else 1)

    def _gather(self, t):
        out = torch.empty(self.perm.shape[0], t.shape[1], device=DEV, dtype=t.dtype)
        from kernels.gather_rows import launch_gather_rows
        return launch_gather_rows(t, out, self.perm)

    def _prepare(self, tensors):
        """The operands as the production launcher hands them to this kernel (gathered for TMA, token order else; one
        expert's x in place)."""
        if self.single:
            return tensors + tensors
        if self.tma:
            return tensors + tuple(self._gather(t) for t in tensors)
        return tensors

    def run(self, cfg, args):
        """Launches the kernel with config cfg on one input set; returns what to check."""
        bm_or_bn, b1, b2 = cfg["block"]
        gm, w, s = cfg.get("group", 8), cfg["warps"], cfg["stages"]
        fl = {"FLATTEN": bool(cfg.get("flatten"))} if self.tma and self.op != "grad_weight" else {}
        if self.op in ("linear", "linear_gather") and self.tma:
            fl["SPLIT_TAIL"] = bool(cfg.get("split"))
        from kernels.gemm_gather_tma import launch_routed_linear_gather_tma, launch_routed_swiglu_gather_tma
        from kernels.gemm_pointer import launch_routed_linear, launch_routed_swiglu
        from kernels.gemm_tma import launch_routed_linear_tma, launch_routed_swiglu_pair_tma, launch_routed_swiglu_tma
        from kernels.grad_weight import launch_routed_grad_weight, launch_routed_grad_weight_tma
        if self.op == "linear_gather":
            launch_routed_linear_gather_tma(args[0], self.w, None, None, self.out, self.perm, self.seg, BM=bm_or_bn,
                                            BN=b1, BK=b2, GROUP_M=gm, num_programs=self.sms, num_warps=w, **fl,
                                            num_stages=s)
            return self.out
        if self.op == "linear":
            out = self.out
            if self.tma:
                launch_routed_linear_tma(args[1], self.w, None, None, out, self.perm, self.seg, BM=bm_or_bn, BN=b1,
                                         BK=b2, GROUP_M=gm, num_programs=self.sms, num_warps=w, **fl, num_stages=s)
            else:
                launch_routed_linear(args[0], self.w[0], self.w[1], None, None, out, self.perm, self.seg, self.n,
                                     self.k, BM=bm_or_bn, BN=b1, BK=b2, GROUP_M=gm, num_warps=w, num_stages=s)
            return out
        if self.op == "swiglu_gather":
            launch_routed_swiglu_gather_tma(args[0], self.w1, self.w3, self.out, self.perm, self.seg, BM=bm_or_bn,
                                            BN=b1, BK=b2, GROUP_M=gm, num_programs=self.sms, num_warps=w, **fl,
                                            num_stages=s)
            return self.out
        if self.op == "swiglu_pair":
            launch_routed_swiglu_pair_tma(args[1], self.w13, self.out, self.perm, self.seg, BM=bm_or_bn, BN=b1,
                                          BK=b2, GROUP_M=gm, num_programs=self.sms, num_warps=w, **fl, num_stages=s)
            return self.out
        if self.op == "swiglu":
            h = self.out
            if self.tma:
                launch_routed_swiglu_tma(args[1], self.w1, self.w3, h, self.perm, self.seg, BM=bm_or_bn, BN=b1,
                                         BK=b2, GROUP_M=gm, num_programs=self.sms, num_warps=w, **fl, num_stages=s)
            else:
                launch_routed_swiglu(args[0], self.w1[0], self.w1[1], self.w3[0], self.w3[1], h, self.perm,
                                     self.seg, self.n, self.k, BM=bm_or_bn, BN=b1, BK=b2, GROUP_M=gm, num_warps=w,
                                     num_stages=s)
            return h
        dw0, dw1 = self.out
        if self.tma:
            launch_routed_grad_weight_tma(args[2], args[3], self.seg, dw0, dw1, BN=bm_or_bn, BK=b1, BR=b2,
                                          GROUP_N=gm, num_warps=w, num_stages=s)
        else:
            launch_routed_grad_weight(args[0], args[1], self.perm, self.seg, dw0, dw1, BN=bm_or_bn, BK=b1, BR=b2,
                                      GROUP_N=gm, num_warps=w, num_stages=s)
        return dw0, dw1

    def error(self, cfg):
        """Relative error against float64 on sampled rows (columns for grad-weight), outputs poisoned first."""
        a = self.sets[0]
        m1 = self.mask.double()[:, None]
        if self.op == "grad_weight":
            self.out = tuple(torch.full((self.n, self.k), float("nan"), device=DEV, dtype=DTYPE)
                             for _ in range(2))
            dw0, dw1 = self.run(cfg, a)
            cols = torch.randperm(self.k, device=DEV)[:64]
            dy, x = a[0].double(), a[1][:, cols].double()
            return max(_rel(dw0[:, cols], (dy * (1 - m1)).T @ x), _rel(dw1[:, cols], (dy * m1).T @ x))
        swiglu = self.op.startswith("swiglu")
        shape = (self.perm.shape[0], self.n) if swiglu else (self.m, self.n)
        self.out = torch.full(shape, float("nan"), device=DEV, dtype=DTYPE)
        got = self.run(cfg, a)
        rows = torch.randperm(self.m, device=DEV)[:64]
        x = a[0][rows].double()
        vis = self.mask[rows][:, None]
        if not swiglu:
            ref = torch.where(vis, x @ self.w[1].double().T, x @ self.w[0].double().T)
            return _rel(got[rows], ref)
        # h is expert-ordered: find each sampled token's row
        where = torch.empty(self.m, dtype=torch.long, device=DEV)
        where[self.rows] = torch.nonzero(self.perm >= 0).flatten()
        h = lambda w1, w3: torch.nn.functional.silu(x @ w1.double().T) * (x @ w3.double().T)  # noqa: E731
        ref = torch.where(vis, h(self.w1[1], self.w3[1]), h(self.w1[0], self.w3[0]))
        return _rel(got[where[rows]], ref)

    def time(self, cfg, rep):
        return common.bench(lambda *a: self.run(cfg, a), args=self.sets, warmup=5, rep=rep)

    def gather_ms(self, rep):
        """The [M_pad, K] gather copy that the TMA design needs before routed_linear_tma_kernel (linear_gather's
        comparison: its time vs the linear kernel's time plus this)."""
        return common.bench(lambda t: self._gather(t), args=[(s[0], ) for s in self.sets], warmup=5, rep=rep)

    def cublas_ms(self, rep):
        """cuBLAS on the same useful FLOPs (one expert's weights for every row), for the report."""
        a = self.sets[0]
        if self.op in ("linear", "linear_gather"):
            return common.bench(lambda t: torch.nn.functional.linear(t, self.w[0]), args=[(a[0], )], warmup=5, rep=rep)
        if self.op.startswith("swiglu"):
            w13 = torch.cat([self.w1[0], self.w3[0]])
            return common.bench(lambda t: torch.nn.functional.linear(t, w13), args=[(a[0], )], warmup=5, rep=rep)
        return common.bench(lambda dy, x: dy.T @ x, args=[(a[0], a[1])], warmup=5, rep=rep)


class RopeProblem:
    """rope_kernel on one of two shapes (Llama q in sbhd; q and GQA k in one launch, bshd)."""
    CASES = {"sbhd s4096 b2 h32 d128": (4096, 2, 32, 0, False), "bshd qk s4096 b2 q32 k8 d128": (4096, 2, 32, 8, True)}

    def __init__(self, case):
        from kernels import rope
        self.rope, self.case = rope, case
        s, b, h, h2, bshd = self.CASES[case]
        self.s, self.b, self.h, self.h2, self.bshd, self.d = s, b, h, h2, bshd, 128
        self.freqs = torch.rand(s, 1, 1, self.d, device=DEV) * 100
        shape = (b, s, h, self.d) if bshd else (s, b, h, self.d)
        shape2 = (b, s, max(h2, 1), self.d) if bshd else (s, b, max(h2, 1), self.d)
        nbytes = 2 * 2 * (math.prod(shape) + (math.prod(shape2) if h2 else 0))
        g = lambda sh: torch.randn(sh, device=DEV, dtype=DTYPE)  # noqa: E731
        self.sets = [(g(shape), g(shape2)) for _ in range(common.rotation_count(nbytes))]
        self.nbytes = nbytes
        self.m, self.n, self.k = s * b, h, self.d

    def _st(self, t):
        return (t.stride(1), t.stride(0), t.stride(2), t.stride(3)) if self.bshd else tuple(t.stride())

    def run(self, cfg, args):
        x, k = args
        out, out2 = torch.empty_like(x), torch.empty_like(k)
        bh, bhalf, bb = cfg["block"]
        no_i32 = torch.zeros(1, device=DEV, dtype=torch.int32)
        sec = k if self.h2 else x
        self.rope.rope_kernel[(self.s * self.b, )](
            x, out, sec, out2 if self.h2 else out, self.freqs, no_i32, no_i32, self.s, self.b, self.h, self.h2,
            self.d, self.d // 2, self.s, self.freqs.stride(0), *self._st(x), *self._st(out), *self._st(sec),
            *self._st(out2 if self.h2 else out), 1, 0, 1 if self.bshd else 0, IS_THD=False, INTERLEAVED=False,
            HAS_SECOND=bool(self.h2), BLOCK_H=bh, BLOCK_HALF=bhalf, BLOCK_B=bb, num_warps=cfg["warps"],
            num_stages=cfg["stages"])
        return out, out2

    def error(self, cfg):
        x, k = self.sets[0]
        out, out2 = self.run(cfg, (x, k))
        ang = self.freqs[:self.s, 0, 0].double()
        half = self.d // 2

        def ref(t):
            td = t.double()
            c = ang.cos()[None, :, None, :] if self.bshd else ang.cos()[:, None, None, :]
            sn = ang.sin()[None, :, None, :] if self.bshd else ang.sin()[:, None, None, :]
            return td * c + torch.cat([-td[..., half:], td[..., :half]], -1) * sn
        err = _rel(out, ref(x))
        return max(err, _rel(out2, ref(k))) if self.h2 else err

    def time(self, cfg, rep):
        return common.bench(lambda *a: self.run(cfg, a), args=self.sets, warmup=5, rep=rep)

    def cublas_ms(self, rep):  # the copy ceiling of the same bytes
        return common.copy_time_ms(self.nbytes // 2, warmup=5, rep=rep, dev=DEV)


# ------------------------------------------------------------------------------------------------------ the search
def shapes(op, ms, models):
    """(m, n, k, routing) per measurement of op; routing "dual" (50% random mask) or "single" (one expert)."""
    if op == "rope":
        return list(RopeProblem.CASES)
    out = []
    for m in ms:
        for name in models:
            H, I = MODELS[name]
            nk = {"linear": [(H, H), (H, I)], "linear_gather": [(H, H), (H, I)], "swiglu": [(I, H)],
                  "swiglu_gather": [(I, H)], "swiglu_pair": [(I, H)], "grad_weight": [(H, H), (I, H)]}[op]
            out += [(m, n, k, "dual") for n, k in nk]
            if op in SINGLE_OPS and m <= SINGLE_MAX_M:
                out += [(m, n, k, "single") for n, k in nk]
    return list(dict.fromkeys(out))


def shape_str(op, shape):
    if op == "rope":
        return shape
    return "M{}_N{}_K{}".format(*shape[:3]) + ("_single" if shape[3] == "single" else "")


def candidates(kernel, cands, table):
    """The search space plus every config the current table uses for this kernel's half (or all) family."""
    fam = "all" if kernel == "rope_kernel" else "half"
    out = {ct.cfg_str(e): e for e in (_entry(*c) for c in cands)}
    for e in ct.buckets(table, kernel, fam):
        if e.get("off"):
            continue
        e = {k: v for k, v in e.items() if k in ("block", "group", "warps", "stages", "flatten", "split")}
        out.setdefault(ct.cfg_str(e), e)
    return fam, out


def load_results(path, device):
    done = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if r.get("device") == device:
                        done[(r["kernel"], r["shape"], r["config"])] = r
    return done


def search(ops, ms, models, results_path, rep, budget_s, table, cc):
    device = torch.cuda.get_device_name(0)
    done = load_results(results_path, device)
    plan = []
    kmap = kernels_for(cc)
    for op in ops:
        kernel, cands = kmap[op]
        fam, cfgs = candidates(kernel, cands, table)
        for shape in shapes(op, ms, models):
            plan.append((op, kernel, fam, shape, cfgs))
    total = sum(len(c) + 1 + (op in GATHER_DESIGNS) for op, *_, c in plan)
    n_done = sum(1 for op, kernel, fam, shape, cfgs in plan for c in list(cfgs) + list(REFERENCES)
                 if (kernel, shape_str(op, shape), c) in done)
    print(f"[tune] {device} (sm_{cc}): {total} measurements, {n_done} already in {results_path}", flush=True)
    t0 = time.time()
    out = open(results_path, "a") if results_path else None
    for op, kernel, fam, shape, cfgs in plan:
        sstr = shape_str(op, shape)
        refs = ["cuBLAS"] + (["gather copy"] if op in GATHER_DESIGNS else [])
        todo = [c for c in list(cfgs) + refs if (kernel, sstr, c) not in done]
        if not todo:
            continue
        if budget_s and time.time() - t0 > budget_s:
            print(f"[tune] time budget ({budget_s:.0f} s) spent: stopping; rerun to resume", flush=True)
            break
        prob = RopeProblem(shape) if op == "rope" else Problem(op, kernel, *shape)
        for c in todo:
            rec = {"device": device, "cc": cc, "triton": triton_version(), "kernel": kernel, "family": fam, "op": op, "shape": sstr,
                   "m": prob.m, "n": prob.n, "k": prob.k, "config": c}
            try:
                if c in REFERENCES:
                    rec.update(ms=(prob.cublas_ms if c == "cuBLAS" else prob.gather_ms)(rep), err=0.0)
                else:
                    err = prob.error(cfgs[c])
                    ok = err < (2e-2 if op != "rope" else 1e-2)
                    rec.update(err=err, ms=prob.time(cfgs[c], rep) if ok else None)
            except Exception as e:  # noqa: BLE001  (out of shared memory / registers: not a candidate here)
                rec.update(err=None, ms=None, error=f"{type(e).__name__}: {str(e)[:200]}")
            done[(kernel, sstr, c)] = rec
            n_done += 1
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            ms_s = f"{rec['ms']:.4f} ms" if rec.get("ms") else ("wrong" if rec.get("err") else rec.get("error", "-"))
            print(f"[tune] [{n_done}/{total}] {time.time() - t0:5.0f}s {kernel} {sstr} {c}: {ms_s}", flush=True)
        del prob
        torch.cuda.empty_cache()
    if out:
        out.close()
    return done


GATHER_DESIGNS = {"linear_gather": "linear", "swiglu_gather": "swiglu"}  # design op -> the gather-copy design's op
# every alternative-design op -> the op of the design it replaces where it wins
ALTERNATIVES = dict(GATHER_DESIGNS, swiglu_pair="swiglu")
REFERENCES = ("cuBLAS", "gather copy")  # measured next to the candidates, never candidates themselves
KEEP_MARGIN = 1.02  # a challenger must beat the table's current config by 2% (geomean) to replace it: no noise churn


def winners(done, kernel, ms_list, incumbent=None):
    """m -> (cfg, geomean ratio, per-shape times) for the kernel's measured m (one key, None, for rope).
    incumbent(m) -> the current table's cfg for m: kept unless the best is KEEP_MARGIN faster."""
    by_m = {}
    for (k, sstr, c), r in done.items():
        if k != kernel or c in REFERENCES:
            continue
        m = None if kernel == "rope_kernel" else r["m"]
        if m is not None and m not in ms_list:
            continue
        by_m.setdefault(m, {}).setdefault(sstr, {})[c] = r.get("ms")
    out = {}
    for m, per_shape in by_m.items():
        best = {s: min(v for v in t.values() if v) for s, t in per_shape.items() if any(t.values())}
        cfgs = set.intersection(*[set(c for c, v in t.items() if v) for t in per_shape.values()])
        if not cfgs or len(best) != len(per_shape):
            continue
        score = {c: math.exp(sum(math.log(per_shape[s][c] / best[s]) for s in per_shape) / len(per_shape))
                 for c in cfgs}
        w = min(score, key=score.get)
        cur = incumbent(m) if incumbent else None
        if cur in score and score[cur] <= KEEP_MARGIN * score[w]:
            w = cur
        out[m] = (w, score[w], {s: per_shape[s][w] for s in per_shape})
    return out


def _design_choice(done, win, new_table, kmap, op):
    """For an alternative-design kernel: per m, keep its winner only where it beats the design it replaces, with the
    config the new table gives that m (geometric mean over the shapes); elsewhere "off". The design a gather-inside
    kernel replaces is a gather copy plus the TMA kernel; the paired gate/up kernel replaces the TMA kernel alone."""
    tma_kernel = kmap[ALTERNATIVES[op]][0]
    copy = op in GATHER_DESIGNS
    out = {}
    for m, (cfg, score, per_shape) in win.items():
        ratios = []
        for sstr, ms in per_shape.items():
            other = ct.cfg_str(ct.pick(new_table, tma_kernel, "half", m))
            t = done.get((tma_kernel, sstr, other), {}).get("ms")
            gc = done.get((kmap[op][0], sstr, "gather copy"), {}).get("ms") if copy else 0.0
            if not t or gc is None:
                ratios = None
                break
            ratios.append(ms / (t + gc))
        if not ratios:
            print(f"[tune] {op} m={m}: the other design was not measured on the same shapes; left off")
            out[m] = ("off", None, {})
            continue
        g = math.exp(sum(map(math.log, ratios)) / len(ratios))
        other_s = "gather copy + TMA kernel" if copy else tma_kernel
        print(f"[tune] {op} m={m}: {g:.3f}x the time of {other_s} -> {'on' if g < 1 else 'off'}")
        out[m] = (cfg, score, per_shape) if g < 1 else ("off", None, {})
    return out


def _incumbent(table, kernel, fam):
    def cur(m):
        try:
            return ct.cfg_str(ct.pick(table, kernel, fam, m or 1))
        except KeyError:
            return None
    return cur


def merge_kept(done, kept, ms_list, kernels):
    """--keep: this run's measurements plus the earlier run's records of `kernels` at the m this run did not measure
    (its records at this run's m are dropped: they may predate a kernel change). Returns (done, m list)."""
    kept = {key: r for key, r in kept.items() if key[0] in kernels and r.get("m") not in ms_list}
    ms = sorted(set(ms_list) | {r["m"] for r in kept.values() if r.get("m") is not None})
    return {**kept, **done}, ms


def triton_version():
    import triton
    return triton.__version__


def write_table(path, table, done, ops, ms_list, cc, device, argv):
    new = json.loads(json.dumps(table))
    kmap = kernels_for(cc)
    for op in ops:
        kernel, cands = kmap[op]
        fam, cfgs = candidates(kernel, cands, table)
        win = winners(done, kernel, ms_list, _incumbent(table, kernel, fam))
        why = {ct.cfg_str(e): e["why"] for e in ct.buckets(table, kernel, fam) if "why" in e}
        if not win:
            print(f"[tune] {kernel}: nothing complete to write (keeping the table's entries)")
            continue
        if kernel == "rope_kernel":
            e = dict(cfgs[win[None][0]])
            new["kernels"].setdefault(kernel, {})[fam] = [dict(e, why=why[ct.cfg_str(e)]) if ct.cfg_str(e) in why else e]
            continue
        if kernel in ct.OPTIONAL:
            win = _design_choice(done, win, new, kmap, op)
        buckets = []
        for m in sorted(win):
            e = {"off": True} if win[m][0] == "off" else dict(cfgs[win[m][0]])
            if buckets and ct.cfg_str(buckets[-1]) == ct.cfg_str(e):
                buckets[-1]["max_m"] = m
            else:
                buckets.append(dict(e, max_m=m))
        buckets[-1].pop("max_m")
        if all(b.get("off") for b in buckets):
            buckets = [{"off": True}]
        for b in buckets:  # an unchanged config keeps its explanation
            if ct.cfg_str(b) in why:
                b["why"] = why[ct.cfg_str(b)]
        new["kernels"].setdefault(kernel, {})[fam] = [
            {k: b[k] for k in ("max_m", "off", "block", "group", "warps", "stages", "flatten", "split", "why")
             if k in b}
            for b in buckets]
    tv = sorted({r.get("triton", "?") for r in done.values()})
    how = f"`python -m aot.tune {' '.join(argv)}`"
    if "--offline" in argv:
        how = f"{how} from the measurements in its --results file"
    new["origin"] = (f"tuned on {device} (triton {', '.join(tv)}) by {how} ({datetime.date.today().isoformat()}); "
                     "families and kernels not measured kept from the previous table")
    ct.validate(new, path)
    with open(path, "w") as f:
        f.write(ct.dumps(new))
    print(f"[tune] wrote {path}")
    return new


def report(done, ops, ms_list, table, cc):
    """Default (the table's config before this run) vs tuned (winner) time per kernel and shape."""
    kmap = kernels_for(cc)
    print("\n| kernel | shape | default config | default ms | tuned config | tuned ms | tuned / default | "
          "cuBLAS (or copy) ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for op in ops:
        kernel, _ = kmap[op]
        fam = "all" if kernel == "rope_kernel" else "half"
        win = winners(done, kernel, ms_list, _incumbent(table, kernel, fam))
        for (k, sstr, c), r in sorted(done.items(), key=lambda kv: (kv[0][0], kv[1].get("m") or 0, kv[0][1])):
            if k != kernel or c in REFERENCES:
                continue
            m = None if kernel == "rope_kernel" else r["m"]
            if m not in win or c != win[m][0]:
                continue
            dflt = _incumbent(table, kernel, fam)(m) or "-"
            d_ms = done.get((kernel, sstr, dflt), {}).get("ms")
            cb = done.get((kernel, sstr, "cuBLAS"), {}).get("ms")
            ratio = f"{r['ms'] / d_ms:.3f}" if d_ms else "-"
            gc = done.get((kernel, sstr, "gather copy"), {}).get("ms")
            if gc:  # the design experiment: show what the gather-copy design pays on top of its GEMM
                sstr = f"{sstr} (gather copy {gc:.4f})"
            print(f"| {kernel} | {sstr} | {dflt} | {d_ms or float('nan'):.4f} | {c} | {r['ms']:.4f} | {ratio} | "
                  f"{cb or float('nan'):.4f} |")


def main():
    # Measure compiled kernels: an inherited TRITON_INTERPRET=1 would time the CPU interpreter. (Only here, not at
    # import: tests import this module next to interpreter tests in one process.)
    os.environ.pop("TRITON_INTERPRET", None)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="linear,swiglu,grad_weight,rope")
    p.add_argument("--ms", default="1,16,64,256,1024,4096,16384", help="token counts (m buckets) to measure")
    p.add_argument("--models", default="7b,13b,70b", help=f"model sizes for N and K: {', '.join(MODELS)}")
    p.add_argument("--results", default=None, help="JSON-lines result file (resumable); default tune_sm<cc>.jsonl")
    p.add_argument("--write", default=None, help="write the winners into this config table (aot/configs/sm<cc>.json)")
    p.add_argument("--rep", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=0, help="stop starting new shapes after this many seconds")
    p.add_argument("--keep", default=None,
                   help="an earlier result file whose measurements of the m not measured now join this run's")
    p.add_argument("--offline", action="store_true",
                   help="measure nothing: rebuild the report and --write from the --results file (no GPU needed)")
    a = p.parse_args()
    if a.offline:
        if not (a.results and os.path.exists(a.results)):
            raise SystemExit("aot.tune --offline: give the --results file to read")
        with open(a.results) as f:
            first = json.loads(f.readline())
        cc, device = first["cc"], first["device"]
    elif not torch.cuda.is_available():
        raise SystemExit("aot.tune: needs a CUDA GPU (it times kernels on the local device)")
    else:
        major, minor = torch.cuda.get_device_capability(0)
        cc, device = major * 10 + minor, torch.cuda.get_device_name(0)
    ops = [o for o in a.ops.split(",") if o]
    known = set(kernels_for(cc))
    if set(ops) - known:
        raise SystemExit(f"aot.tune: unknown --ops {sorted(set(ops) - known)} (here: {', '.join(sorted(known))})")
    models = [m for m in a.models.split(",") if m]
    if set(models) - set(MODELS):
        raise SystemExit(f"aot.tune: unknown --models {sorted(set(models) - set(MODELS))} ({', '.join(MODELS)})")
    ms_list = sorted(int(m) for m in a.ms.split(","))
    arch = table_arch(cc)
    table = ct.load(arch)
    results = a.results or f"tune_sm{cc}.jsonl"
    if a.offline:
        done = load_results(results, device)
    else:
        done = search(ops, ms_list, models, results, a.rep, a.budget_s, table, cc)
    if a.keep:
        done, ms_list = merge_kept(done, load_results(a.keep, device), ms_list, {kernels_for(cc)[o][0] for o in ops})
    report(done, ops, ms_list, table, cc)
    if a.write:
        write_table(a.write, table, done, ops, ms_list, cc, device, sys.argv[1:])


if __name__ == "__main__":
    main()
