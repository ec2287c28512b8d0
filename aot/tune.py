"""Config search on the local GPU: times candidate block configs of each kernel over a grid of shapes with Triton's
JIT (tuning time only; the built package never runs Triton) and writes the winners as the architecture's config table.

    python -m aot.tune [--ops linear,swiglu,grad_weight,rope] [--ms 1,16,64,256,1024,4096,16384]
                       [--models matrix | 7b,13b,70b] [--classes 'n<=2048;k<=1024'] [--passes 2] [--grad-input]
                       [--configs REGEX]
                       [--results tune_sm90.jsonl] [--write aot/configs/sm90.json] [--rep 20] [--budget-s SECONDS]

then rebuild (`bash scripts/retune.sh` does both). What it does:
* kernels: on sm_90 the TMA GEMMs (routed_linear_tma / routed_swiglu_tma / routed_grad_weight_tma), elsewhere the
  pointer GEMMs; and rope_kernel. The alternative designs are ops of their own, measured with the design they may
  replace: linear_gather / swiglu_gather (x gathered inside the GEMM; against linear / swiglu plus the gather copy)
  and swiglu_pair (gate and up in one MMA; against swiglu); --write turns each on per m where it wins. bf16 inputs:
  the "half" family (fp16 runs the same MMA shapes); the fp32 families keep their table entries.
* shapes: m (token rows; the reduction length for grad-weight) from --ms, times the projections of the models of
  --models: `matrix` (the default), the models of benchmarks/bench_matrix.py with their real projections (GQA QKV,
  attention output, the MLP's down projection, a tensor-parallel-8 slice of Llama-3-70B), or Llama-2 7B, 13B and 70B
  by hidden / intermediate size (linear N x K = H x H and H x I, swiglu I x H, grad-weight H x H and I x H).
  50% random routing mask (both experts busy); for m <= SINGLE_MAX_M the
  linear and gate/up kernels are also measured with one expert (the Llama MLP's routing: perm = arange, x read in
  place; shapes named "..._single"), and a bucket's winner is the best over both routings.
* candidates: CANDIDATES below plus every config the current table already uses for the kernel (so "default" is
  always measured next to the winner). --configs REGEX measures only the candidates whose name matches (e.g. '_sk$',
  the stream-K configs), beside the table's own.
* each (shape, candidate) is checked once against a float64 reference on sampled rows / columns before it is timed,
  so a fast wrong config cannot win; timings are medians of CUDA-event times over inputs rotated past the L2
  (benchmarks/common.py).
* results append to --results (JSON lines), one per (kernel, shape, candidate, pass): a killed or --budget-s-limited
  run resumes where it stopped. A progress line per measurement shows [done/total] and the elapsed time. --passes 2
  measures everything twice, the second time in reverse config order, and keeps each config's faster pass: the
  clock of a GPU under sustained GEMM load drifts by several percent over a run, and one pass in one order would
  favour the configs timed first.
* --write: per kernel and m, the candidate with the lowest geometric mean of (time / best time) over the shapes of
  that m wins, unless the table's current config is within 2% of it (KEEP_MARGIN: measurement noise does not churn
  the table); neighbouring m with the same winner merge into one bucket (max_m = the largest m measured in it; the
  last bucket is open-ended). Buckets of m below the smallest m measured are kept from the table (a re-tune of
  prefill m leaves the decode buckets as they are). Kernels and families not measured keep their entries. The table
  is validated.
* --grad-input: the linear kernel's table entry also serves the grad-input GEMM dX = dY·W_e (W_TRANSPOSED); with
  it, those shapes are measured too ("M..._N..._K..._t", n = the weight's in-features) and the winners are chosen
  over both orientations.
* --classes 'n<=2048;k<=1024': shape classes to try (aot/config_table.py; default: those the table already has).
  Each shape belongs to the first class that admits it, else to the general class; a class gets its own buckets,
  before the general ones, only where its best config beats the general winner on its shapes by more than KEEP_MARGIN
  at some m.
  --offline redoes this from a result file without a GPU. --keep OLD.jsonl adds an earlier run's measurements of the
  m this run does not measure, so a partial re-tune (say --ms 1,4,16,64) rewrites the whole bucket list.
  --device picks one device's records of a file that holds several (sm90.measurements.jsonl: H100 and H200 runs).
"""
import argparse
import datetime
import json
import math
import os
import re
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
# The performance matrix's models (benchmarks/bench_matrix.py MODELS, GQA projections included): --models matrix, or
# any of their names. Read from the benchmark so that the tuner and the matrix measure the same shapes.
MATRIX = "matrix"
SINGLE_MAX_M = 64  # up to this m, linear and swiglu are measured with one expert too (decode of the Llama MLP)
# the ops a single-expert call runs (the gather-inside designs serve two experts only)
SINGLE_OPS = ("linear", "swiglu", "swiglu_pair")

# (block, group, warps, stages[, flatten[, split[, stream_k]]]) candidates per kernel. TMA GEMMs: 128-row tiles (the routing
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
               # with the last round split in 2, 4 or 8 column slices (mid-size m)
               ((128, 256, 64), 8, 8, 3, False, 2), ((128, 256, 64), 8, 8, 4, True, 2),
               ((128, 128, 64), 8, 8, 4, False, 2), ((128, 128, 64), 8, 4, 4, False, 2),
               ((128, 256, 64), 8, 8, 3, False, 4), ((128, 256, 64), 8, 8, 4, True, 4),
               ((128, 256, 64), 8, 8, 3, False, 8), ((128, 256, 64), 8, 8, 4, True, 8),
               ((128, 128, 64), 8, 8, 4, False, 4), ((128, 128, 64), 8, 4, 4, False, 4),
               # narrow N (a tensor-parallel slice's QKV): more, smaller tiles to fill the SMs
               ((64, 128, 128), 8, 4, 4), ((128, 64, 128), 8, 4, 4),
               # stream-K: the K steps of the last partial round (1), or of it and the whole round before it (2),
               # shared out evenly (mid-size m)
               ((128, 256, 64), 8, 8, 3, False, 0, 1), ((128, 256, 64), 8, 8, 4, False, 0, 1),
               ((128, 256, 64), 8, 8, 4, True, 0, 1), ((128, 128, 64), 8, 8, 4, False, 0, 1),
               ((128, 128, 64), 8, 4, 4, False, 0, 1), ((64, 128, 128), 8, 4, 4, False, 0, 1),
               ((128, 256, 64), 8, 8, 3, False, 0, 2), ((128, 256, 64), 8, 8, 4, False, 0, 2),
               ((128, 256, 64), 8, 8, 4, True, 0, 2), ((128, 128, 64), 8, 8, 4, False, 0, 2),
               ((64, 128, 128), 8, 4, 4, False, 0, 2)]
_TMA_LINEAR += _TMA_DECODE
_TMA_SWIGLU = [((128, 128, 64), 8, 8, 3), ((128, 128, 64), 8, 8, 4), ((128, 64, 64), 8, 4, 4),
               ((128, 64, 64), 8, 8, 4), ((64, 64, 64), 8, 4, 4), ((64, 32, 128), 8, 4, 4),
               ((64, 32, 64), 8, 4, 6), ((128, 32, 64), 8, 4, 4), ((64, 64, 128), 8, 4, 4),
               ((16, 64, 128), 8, 4, 4), ((16, 64, 128), 8, 4, 6), ((16, 128, 64), 8, 4, 6),
               ((32, 64, 128), 8, 4, 4), ((128, 128, 64), 8, 8, 3, True), ((128, 128, 64), 8, 8, 4, True),
               # 64-row tiles with wide N: twice the programs of 128-row tiles at small m, where a narrow
               # intermediate (a tensor-parallel slice's I) leaves 128 x 128 tiles short of the SMs
               ((64, 128, 64), 8, 4, 4), ((64, 128, 64), 8, 4, 5)]
# grad-weight (persistent: its epilogues overlap the next tile's loads, so deeper pipelines and 128-wide tiles have
# more to gain than in the one-tile-per-program kernel the first six were chosen for)
_TMA_GRAD_W = [((128, 256, 32), 8, 8, 5), ((128, 256, 32), 8, 8, 6), ((128, 256, 64), 8, 8, 3),
               ((128, 128, 64), 8, 8, 4), ((128, 128, 32), 8, 8, 6), ((64, 128, 64), 8, 4, 4),
               ((128, 128, 64), 8, 8, 5), ((128, 256, 32), 8, 8, 4), ((128, 128, 128), 8, 8, 3)]
_PTR_GEMM = [((128, 128, 64), 8, 8, 3), ((128, 128, 32), 8, 4, 4), ((128, 64, 64), 8, 4, 4),
             ((64, 128, 64), 8, 4, 4), ((64, 64, 64), 8, 4, 4), ((64, 64, 32), 8, 4, 6)]
_PTR_GRAD_W = [((128, 128, 64), 8, 8, 3), ((128, 128, 32), 8, 8, 4), ((64, 128, 64), 8, 4, 4),
               ((128, 64, 64), 8, 4, 4)]
# rope: (tokens, heads) per program, 64 rotary pairs (d = 128)
_ROPE = [((bt, bh, 64), None, w, 1) for bt, bh in ((1, 8), (1, 16), (1, 32), (2, 4), (2, 8), (2, 16), (4, 4), (4, 8),
                                                   (4, 16), (8, 4), (8, 8), (16, 4)) for w in (2, 4, 8)]


def _entry(block, group, warps, stages, flatten=False, split=0, stream_k=0):
    e = {"block": list(block)}
    if group is not None:
        e["group"] = group
    e.update(warps=warps, stages=stages)
    if flatten:
        e["flatten"] = True
    if split:
        e["split"] = split
    if stream_k:
        e["stream_k"] = stream_k
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
        # "dual_t": the grad-input GEMM dX = dY·W_e (W_TRANSPOSED), the same kernel and table entry as the forward:
        # n = the weight's in-features, k = its out-features; W stacked [2, k, n]
        self.transposed = routing == "dual_t"
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
            self.w = g(2, k, n, scale=k ** -0.5) if self.transposed else g(2, n, k, scale=k ** -0.5)
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
        self.poison_out()  # the outputs every launch writes (error() poisons them again before its check)
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
            fl.update(SPLIT_TAIL=int(cfg.get("split", 0)), STREAM_K=int(cfg.get("stream_k", 0)))
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
                                         BK=b2, GROUP_M=gm, num_programs=self.sms, num_warps=w, **fl, num_stages=s,
                                         w_transposed=self.transposed)
            else:
                launch_routed_linear(args[0], self.w[0], self.w[1], None, None, out, self.perm, self.seg, self.n,
                                     self.k, BM=bm_or_bn, BN=b1, BK=b2, GROUP_M=gm, num_warps=w, num_stages=s,
                                     w_transposed=self.transposed)
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
                                          GROUP_N=gm, num_warps=w, num_stages=s, num_programs=self.sms)
        else:
            launch_routed_grad_weight(args[0], args[1], self.perm, self.seg, dw0, dw1, BN=bm_or_bn, BK=b1, BR=b2,
                                      GROUP_N=gm, num_warps=w, num_stages=s)
        return dw0, dw1

    def poison_out(self):
        """The output buffers the kernel writes (self.out), filled with NaN: an unwritten element shows."""
        if self.op == "grad_weight":
            self.out = tuple(torch.full((self.n, self.k), float("nan"), device=DEV, dtype=DTYPE) for _ in range(2))
        else:
            shape = (self.perm.shape[0], self.n) if self.op.startswith("swiglu") else (self.m, self.n)
            self.out = torch.full(shape, float("nan"), device=DEV, dtype=DTYPE)

    def error(self, cfg):
        """Relative error against float64 on sampled rows (columns for grad-weight), outputs poisoned first."""
        a = self.sets[0]
        m1 = self.mask.double()[:, None]
        self.poison_out()
        if self.op == "grad_weight":
            dw0, dw1 = self.run(cfg, a)
            cols = torch.randperm(self.k, device=DEV)[:64]
            dy, x = a[0].double(), a[1][:, cols].double()
            return max(_rel(dw0[:, cols], (dy * (1 - m1)).T @ x), _rel(dw1[:, cols], (dy * m1).T @ x))
        swiglu = self.op.startswith("swiglu")
        got = self.run(cfg, a)
        rows = torch.randperm(self.m, device=DEV)[:64]
        x = a[0][rows].double()
        vis = self.mask[rows][:, None]
        if not swiglu:
            w0, w1 = (self.w[0].double(), self.w[1].double()) if self.transposed else (self.w[0].double().T,
                                                                                          self.w[1].double().T)
            return _rel(got[rows], torch.where(vis, x @ w1, x @ w0))
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
            mm = (lambda t: t @ self.w[0]) if self.transposed else (lambda t: torch.nn.functional.linear(t, self.w[0]))
            return common.bench(mm, args=[(a[0], )], warmup=5, rep=rep)
        if self.op.startswith("swiglu"):
            w13 = torch.cat([self.w1[0], self.w3[0]])
            return common.bench(lambda t: torch.nn.functional.linear(t, w13), args=[(a[0], )], warmup=5, rep=rep)
        return common.bench(lambda dy, x: dy.T @ x, args=[(a[0], a[1])], warmup=5, rep=rep)


def _rope_cases():
    """case name -> (s, b, q heads, k heads (0: q alone), bshd, d): q alone in sbhd (Llama), and q and k in one bshd
    launch for each head layout of the matrix's models (benchmarks/bench_matrix.py) at 2048 and 16384 tokens."""
    cases = {"sbhd s4096 b2 h32 d128": (4096, 2, 32, 0, False, 128)}
    from benchmarks.bench_matrix import rope_shapes
    for _, hq, hk, d in rope_shapes():
        for s in (2048, 16384):
            cases[f"bshd qk s{s} b1 q{hq} k{hk} d{d}"] = (s, 1, hq, hk, True, d)
    return cases


class RopeProblem:
    """rope_kernel on one of _rope_cases()."""

    def __init__(self, case):
        from kernels import rope
        self.rope, self.case = rope, case
        s, b, h, h2, bshd, d = _rope_cases()[case]
        self.s, self.b, self.h, self.h2, self.bshd, self.d = s, b, h, h2, bshd, d
        half = torch.rand(s, 1, 1, self.d // 2, device=DEV) * 100
        self.freqs = torch.cat([half, half], -1)  # as models build them (TE, HF): each pair's two angles are one
        shape = (b, s, h, self.d) if bshd else (s, b, h, self.d)
        shape2 = (b, s, max(h2, 1), self.d) if bshd else (s, b, max(h2, 1), self.d)
        nbytes = 2 * 2 * (math.prod(shape) + (math.prod(shape2) if h2 else 0))
        g = lambda sh: torch.randn(sh, device=DEV, dtype=DTYPE)  # noqa: E731
        self.sets = [(g(shape), g(shape2)) for _ in range(common.rotation_count(nbytes))]
        self.nbytes = nbytes
        self.m, self.n, self.k = s * b, h + h2, self.d  # n: heads per token row (rope's shape class)

    def _st(self, t):
        return (t.stride(1), t.stride(0), t.stride(2), t.stride(3)) if self.bshd else tuple(t.stride())

    def run(self, cfg, args):
        x, k = args
        out, out2 = torch.empty_like(x), torch.empty_like(k)
        bt, bh, bhalf = cfg["block"]
        no_i32 = torch.zeros(1, device=DEV, dtype=torch.int32)
        sec = k if self.h2 else x
        rows = self.s * self.b
        sx, so, sx2, so2 = self._st(x), self._st(out), self._st(sec), self._st(out2 if self.h2 else out)
        self.rope.rope_kernel[(-(-rows // bt), )](
            x_ptr=x, out_ptr=out, x2_ptr=sec, out2_ptr=out2 if self.h2 else out, freqs_ptr=self.freqs,
            cu_seqlens_ptr=no_i32, start_ptr=no_i32, rows=rows, S=self.s, B=self.b, H=self.h, H2=self.h2, D=self.d,
            HALF=self.d // 2, s_max=self.s, freqs_stride=self.freqs.stride(0),
            sx_s=sx[0], sx_b=sx[1], sx_h=sx[2], sx_d=sx[3], so_s=so[0], so_b=so[1], so_h=so[2], so_d=so[3],
            sx2_s=sx2[0], sx2_b=sx2[1], sx2_h=sx2[2], sx2_d=sx2[3],
            so2_s=so2[0], so2_b=so2[1], so2_h=so2[2], so2_d=so2[3], cp_size=1, cp_rank=0, flags=1 if self.bshd else 0,
            IS_THD=False, INTERLEAVED=False, HAS_SECOND=bool(self.h2), BLOCK_T=bt, BLOCK_H=bh, BLOCK_HALF=bhalf,
            num_warps=cfg["warps"], num_stages=cfg["stages"])
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
def matrix_models():
    """name -> the matrix model's sizes (benchmarks/bench_matrix.py MODELS)."""
    from benchmarks.bench_matrix import MODELS as M
    return M


def model_names(arg):
    """--models: Llama-2 sizes (MODELS) and matrix models by name; "matrix" stands for every matrix model."""
    names = []
    for n in (x for x in arg.split(",") if x):
        names += list(matrix_models()) if n == MATRIX else [n]
    unknown = sorted(set(names) - set(MODELS) - set(matrix_models()))
    if unknown:
        raise SystemExit(f"aot.tune: unknown --models {unknown} ({', '.join(MODELS)}, {MATRIX}, "
                         f"{', '.join(matrix_models())})")
    return list(dict.fromkeys(names))


def projections(op, name):
    """(n, k) of the GEMMs `op` runs in model `name`: n output columns, k the reduction length."""
    if name in MODELS:  # Llama-2: H x H stands for the attention projections, H x I for the MLP's
        H, I = MODELS[name]
        return {"linear": [(H, H), (H, I)], "linear_gather": [(H, H), (H, I)], "swiglu": [(I, H)],
                "swiglu_gather": [(I, H)], "swiglu_pair": [(I, H)], "grad_weight": [(H, H), (I, H)]}[op]
    from benchmarks.bench_matrix import attention_projections
    c = matrix_models()[name]
    H, I = c["H"], c["I"]
    # QKV, the attention output (linear_dual's forward: the gather-inside design)
    attn = [(n, k) for _, n, k in attention_projections(c)]
    return {"linear": attn + [(H, I)],  # + the MLP's down projection (from an expert-ordered h)
            "linear_gather": attn, "swiglu": [(I, H)], "swiglu_gather": [(I, H)], "swiglu_pair": [(I, H)],
            "grad_weight": attn + [(I, H), (H, I)]}[op]


def shapes(op, ms, models, grad_input=False):
    """(m, n, k, routing) per measurement of op; routing "dual" (50% random mask), "single" (one expert) or, with
    grad_input, "dual_t" (the linear kernel's grad-input orientation on the matrix models' projections, the gate/up
    ones included)."""
    if op == "rope":
        return list(_rope_cases())
    out = []
    for m in ms:
        for name in models:
            nk = projections(op, name)
            out += [(m, n, k, "dual") for n, k in nk]
            if grad_input and op == "linear" and name not in MODELS:
                # each projection's grad-input GEMM, and the ffn backward's dx from the gate and up gradients (the
                # gate/up projections' grad-input: n = H, k = I, a long reduction)
                out += [(m, k, n, "dual_t") for n, k in nk + projections("swiglu", name)]
            if op in SINGLE_OPS and m <= SINGLE_MAX_M:
                out += [(m, n, k, "single") for n, k in nk]
    return list(dict.fromkeys(out))


def shape_str(op, shape):
    if op == "rope":
        return shape
    return "M{}_N{}_K{}".format(*shape[:3]) + {"single": "_single", "dual_t": "_t"}.get(shape[3], "")


def candidates(kernel, cands, table, only=None):
    """The search space (with `only`, a regular expression: the configs whose name it matches) plus every config the
    current table uses for this kernel's half (or all) family."""
    fam = "all" if kernel == "rope_kernel" else "half"
    out = {ct.cfg_str(e): e for e in (_entry(*c) for c in cands) if not only or re.search(only, ct.cfg_str(e))}
    for e in ct.buckets(table, kernel, fam):
        if e.get("off"):
            continue
        e = {k: v for k, v in e.items() if k in ct.CONFIG_FIELDS}
        out.setdefault(ct.cfg_str(e), e)
    return fam, out


def fits_m(kernel, cfg, m):
    """Whether config cfg is worth measuring at m: row tiles under 64 rows are decode tiles (the A tile nearly all
    padding at small m), never a prefill winner, so they are measured at m <= 64 only. Only the GEMMs whose block
    starts with its row tile (aot/config_table.py KERNELS); the grad-weight kernels' BN x BK x BR: always."""
    return m is None or m <= 64 or ct.KERNELS[kernel][3] != 0 or cfg["block"][0] >= 64


def _raw_results(path, device):
    """(kernel, shape, config, pass) -> the record, for this device's lines of a result file."""
    raw = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if r.get("device") == device:
                        raw[(r["kernel"], r["shape"], r["config"], r.get("pass", 1))] = r
    return raw


def _aggregate(raw):
    """(kernel, shape, config) -> one record: the fastest pass's time (the clock drifts with the GPU's temperature
    over a run; the lowest median is the config's own speed), or ms None where any pass failed."""
    done = {}
    for (k, sstr, c, _), r in sorted(raw.items(), key=lambda kv: kv[0][3]):
        key = (k, sstr, c)
        if key not in done:
            done[key] = dict(r)
        elif done[key].get("ms") is not None:
            done[key]["ms"] = None if r.get("ms") is None else min(done[key]["ms"], r["ms"])
    return done


def load_results(path, device):
    return _aggregate(_raw_results(path, device))


def search(ops, ms, models, results_path, rep, budget_s, table, cc, passes=1, grad_input=False, only=None):
    """Measures every (shape, candidate) of the plan `passes` times, each pass after the last, the candidates of
    a shape in reverse order on even passes (a drift of the clock over a run does not favour the configs measured
    first); only the first pass checks results against float64. Returns the aggregated results."""
    device = torch.cuda.get_device_name(0)
    raw = _raw_results(results_path, device)
    plan = []
    kmap = kernels_for(cc)
    for op in ops:
        kernel, cands = kmap[op]
        fam, cfgs = candidates(kernel, cands, table, only)
        for shape in shapes(op, ms, models, grad_input):
            m = None if op == "rope" else shape[0]
            plan.append((op, kernel, fam, shape, {c: e for c, e in cfgs.items() if fits_m(kernel, e, m)}))
    per_pass = sum(len(c) + 1 + (op in GATHER_DESIGNS) for op, *_, c in plan)
    total = per_pass * passes
    n_done = sum(1 for p in range(1, passes + 1) for op, kernel, fam, shape, cfgs in plan
                 for c in list(cfgs) + list(REFERENCES) if (kernel, shape_str(op, shape), c, p) in raw)
    print(f"[tune] {device} (sm_{cc}): {total} measurements ({passes} pass(es)), {n_done} already in {results_path}",
          flush=True)
    t0 = time.time()
    out = open(results_path, "a") if results_path else None
    stop = False
    for p in range(1, passes + 1):
        for op, kernel, fam, shape, cfgs in plan:
            sstr = shape_str(op, shape)
            refs = ["cuBLAS"] + (["gather copy"] if op in GATHER_DESIGNS else [])
            order = list(cfgs) + refs
            if p % 2 == 0:
                order.reverse()
            # a later pass times only what the first found correct
            todo = [c for c in order if (kernel, sstr, c, p) not in raw
                    and (p == 1 or raw.get((kernel, sstr, c, 1), {}).get("ms") is not None)]
            if not todo:
                continue
            if budget_s and time.time() - t0 > budget_s:
                print(f"[tune] time budget ({budget_s:.0f} s) spent: stopping; rerun to resume", flush=True)
                stop = True
                break
            prob = RopeProblem(shape) if op == "rope" else Problem(op, kernel, *shape)
            for c in todo:
                rec = {"device": device, "cc": cc, "triton": triton_version(), "kernel": kernel, "family": fam,
                       "op": op, "shape": sstr, "m": prob.m, "n": prob.n, "k": prob.k, "config": c, "pass": p}
                try:
                    if c in REFERENCES:
                        rec.update(ms=(prob.cublas_ms if c == "cuBLAS" else prob.gather_ms)(rep), err=0.0)
                    elif p > 1:
                        rec.update(err=raw[(kernel, sstr, c, 1)].get("err"), ms=prob.time(cfgs[c], rep))
                    else:
                        err = prob.error(cfgs[c])
                        ok = err < (2e-2 if op != "rope" else 1e-2)
                        rec.update(err=err, ms=prob.time(cfgs[c], rep) if ok else None)
                except Exception as e:  # noqa: BLE001  (out of shared memory / registers: not a candidate here)
                    rec.update(err=None, ms=None, error=f"{type(e).__name__}: {str(e)[:200]}")
                raw[(kernel, sstr, c, p)] = rec
                n_done += 1
                if out:
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                ms_s = (f"{rec['ms']:.4f} ms" if rec.get("ms")
                        else "wrong" if rec.get("err") else rec.get("error", "-"))
                print(f"[tune] [{n_done}/{total}] {time.time() - t0:5.0f}s pass {p} {kernel} {sstr} {c}: {ms_s}",
                      flush=True)
            del prob
            torch.cuda.empty_cache()
        if stop:
            break
    if out:
        out.close()
    return _aggregate(raw)


GATHER_DESIGNS = {"linear_gather": "linear", "swiglu_gather": "swiglu"}  # design op -> the gather-copy design's op
# every alternative-design op -> the op of the design it replaces where it wins
ALTERNATIVES = dict(GATHER_DESIGNS, swiglu_pair="swiglu")
REFERENCES = ("cuBLAS", "gather copy")  # measured next to the candidates, never candidates themselves
KEEP_MARGIN = 1.02  # a challenger must beat the table's current config by 2% (geomean) to replace it: no noise churn


def _shape_nk(sstr):
    """(n, k) of a shape string "M256_N1280_K8192[_single | _t]"."""
    mt = re.match(r"M\d+_N(\d+)_K(\d+)", sstr)
    return (int(mt.group(1)), int(mt.group(2))) if mt else (None, None)


def _shape_wt(sstr):
    """Whether a shape is the grad-input orientation (W transposed): shape strings ending in "_t"."""
    return sstr.endswith("_t")


def _scores(done, kernel, ms_list, admit=None):
    """m -> ({cfg: geomean of time / the shape's best time}, {shape: {cfg: ms}}) over the kernel's shapes of m that
    admit(n, k, wt) accepts (all without it; wt: the grad-input orientation), for the configs measured on every one of
    them."""
    by_m = {}
    for (k, sstr, c), r in done.items():
        if k != kernel or c in REFERENCES:
            continue
        m = None if kernel == "rope_kernel" else r["m"]
        if m is not None and m not in ms_list:
            continue
        if admit is not None and not admit(r.get("n"), r.get("k"), _shape_wt(sstr)):
            continue
        by_m.setdefault(m, {}).setdefault(sstr, {})[c] = r.get("ms")
    out = {}
    for m, per_shape in by_m.items():
        best = {s: min(v for v in t.values() if v) for s, t in per_shape.items() if any(t.values())}
        cfgs = set.intersection(*[set(c for c, v in t.items() if v) for t in per_shape.values()])
        if not cfgs or len(best) != len(per_shape):
            continue
        out[m] = ({c: math.exp(sum(math.log(per_shape[s][c] / best[s]) for s in per_shape) / len(per_shape))
                   for c in cfgs}, per_shape)
    return out


def winners(done, kernel, ms_list, incumbent=None, admit=None):
    """m -> (cfg, geomean ratio, per-shape times) for the kernel's measured m (one key, None, for rope), over the
    shapes admit(n, k, wt) accepts (every shape without it). incumbent(m) -> the current table's cfg for m: kept unless
    the best is KEEP_MARGIN faster."""
    out = {}
    for m, (score, per_shape) in _scores(done, kernel, ms_list, admit).items():
        w = min(score, key=score.get)
        cur = incumbent(m) if incumbent else None
        if cur in score and score[cur] <= KEEP_MARGIN * score[w]:
            w = cur
        out[m] = (w, score[w], {s: per_shape[s][w] for s in per_shape})
    return out


def parse_classes(arg):
    """--classes "n<=2048;k<=1024;n<=2048,t" -> [(2048, None, None), (None, 1024, None), (2048, None, True)]: the shape
    classes to try, in the table's order (narrower first: a shape belongs to the first class that admits it). "t":
    the grad-input orientation only (W transposed), "f": the forward only."""
    out = []
    for part in (p.strip() for p in (arg or "").split(";")):
        if not part:
            continue
        bounds = {}
        for b in part.split(","):
            mt = re.fullmatch(r"\s*(?:([nk])\s*<=\s*(\d+)|([tf]))\s*", b)
            key = mt and (mt.group(1) or "wt")
            if not mt or key in bounds or (mt.group(2) is not None and int(mt.group(2)) <= 0):
                raise SystemExit(f"aot.tune: --classes: {part!r} is not a class such as 'n<=2048', 'n<=2048,k<=1024' "
                                 "or 'n<=2048,t'")
            bounds[key] = int(mt.group(2)) if mt.group(1) else mt.group(3) == "t"
        out.append((bounds.get("n"), bounds.get("k"), bounds.get("wt")))
    return out


def table_classes(table, kernels):
    """The shape classes the table already has for these kernels (half family), in table order: a re-tune without
    --classes keeps the table's structure."""
    out = []
    for kernel in kernels:
        for e in ct.buckets(table, kernel, "half"):
            c = ct.shape_class(e)
            if c != ct.GENERAL and c not in out:
                out.append(c)
    return out


def _owner(classes, n, k, wt=None):
    """The first of `classes` that admits a GEMM of n columns and reduction k in orientation wt, else None (the
    general class)."""
    for c in classes:
        if ct.in_class(dict(zip(ct.CLASS_FIELDS, c)), n, k, wt):
            return c
    return None


def _classes_of(kernel, table, fam, classes):
    """The shape classes to try for a kernel: rope's own (its heads per token row, max_n, as the table has them; one
    bucket each, the grid does not depend on m), --classes for the GEMMs."""
    if kernel != "rope_kernel":
        return classes
    return [c for c in dict.fromkeys(ct.shape_class(e) for e in ct.buckets(table, kernel, fam)) if c != ct.GENERAL]


def class_winners(done, kernel, ms_list, table, fam, classes):
    """The classes worth a bucket list of their own, and each's winners: [(class, winners)], the general class
    (None) last. A class is dropped (its shapes go back to the general class) where the general winner of every m
    is within KEEP_MARGIN of the class's own best on the class's shapes, or where nothing of it was measured."""
    kept = list(classes)
    while True:
        admit_general = lambda n, k, wt: _owner(kept, n, k, wt) is None  # noqa: E731
        general = winners(done, kernel, ms_list, _incumbent(table, kernel, fam), admit_general)
        out, drop = [], []
        for c in kept:
            admit = lambda n, k, wt, c=c: _owner(kept, n, k, wt) == c  # noqa: E731
            win = winners(done, kernel, ms_list, _incumbent(table, kernel, fam, c), admit)
            scores = _scores(done, kernel, ms_list, admit)
            worth = any(m not in general or general[m][0] not in scores[m][0]
                        or scores[m][0][general[m][0]] > KEEP_MARGIN * win[m][1] for m in win)
            if win and worth:
                # an m measured for the general class only (e.g. decode m kept from an earlier run): its winner
                out.append((c, {**{m: w for m, w in general.items() if m not in win}, **win}))
            else:
                drop.append(c)
        if not drop:
            return out + [(None, general)]
        kept = [c for c in kept if c not in drop]


def _design_choice(done, win, new_table, kmap, op, was_on=lambda m: None):
    """For an alternative-design kernel: per m, keep its winner only where it beats the design it replaces, with the
    config the new table gives that m (geometric mean over the shapes); elsewhere "off". The design a gather-inside
    kernel replaces is a gather copy plus the TMA kernel; the paired gate/up kernel replaces the TMA kernel alone.
    was_on(m): whether the table before the re-tune used the kernel at m (None: not known). A design the table used
    stays on unless the other is more than KEEP_MARGIN faster, one it did not use goes on only if it is more than
    KEEP_MARGIN faster: a tie (the 50% random masks measured here are one of many) does not flip it."""
    tma_kernel = kmap[ALTERNATIVES[op]][0]
    copy = op in GATHER_DESIGNS
    out = {}
    for m, (cfg, score, per_shape) in win.items():
        ratios = []
        for sstr, ms in per_shape.items():
            other = ct.cfg_str(ct.pick(new_table, tma_kernel, "half", m, *_shape_nk(sstr), False))
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
        on = {True: g <= KEEP_MARGIN, False: g * KEEP_MARGIN < 1, None: g < 1}[was_on(m)]
        other_s = "gather copy + TMA kernel" if copy else tma_kernel
        print(f"[tune] {op} m={m}: {g:.3f}x the time of {other_s} -> {'on' if on else 'off'}")
        out[m] = (cfg, score, per_shape) if on else ("off", None, {})
    return out


def _incumbent(table, kernel, fam, cls=None):
    """m -> the table's config for m (in shape class cls: (max_n, max_k, w_transposed), None for the general class)."""
    def cur(m):
        try:
            return ct.cfg_str(ct.pick(table, kernel, fam, m or 1, *(cls or ct.GENERAL)))
        except KeyError:
            return None
    return cur


def merge_kept(done, kept, ms_list, kernels):
    """--keep: this run's measurements plus the earlier run's records of `kernels` at the m this run did not measure
    (its records at this run's m are dropped: they may predate a kernel change). Returns (done, m list)."""
    kept = {key: r for key, r in kept.items() if key[0] in kernels and r.get("m") not in ms_list}
    ms = sorted(set(ms_list) | {r["m"] for r in kept.values() if r.get("m") is not None})
    return {**kept, **done}, ms


def restrict(done, ops, ms, models, cc, grad_input=False):
    """The measurements of the ops' kernels on the shapes of this run (--ops, --ms, --models) only: a result file
    may hold other runs' shapes (one file per architecture: aot/configs/sm<arch>.measurements.jsonl), and the table is
    the winners over the shapes asked for. Other kernels' records stay (an alternative design is compared with them)."""
    kmap = kernels_for(cc)
    plan = {(kmap[op][0], shape_str(op, s)) for op in ops for s in shapes(op, ms, models, grad_input)}
    mine = {kmap[op][0] for op in ops}
    return {key: r for key, r in done.items() if key[0] not in mine or key[:2] in plan}


def triton_version():
    import triton
    return triton.__version__


def _kept_below(table, kernel, fam, cls, lo):
    """The table's buckets of class cls (or, for a class it does not have, of its general class) that serve only m
    below lo: a re-tune that did not measure those m keeps them."""
    old = ct.buckets(table, kernel, fam)
    run = [e for e in old if ct.shape_class(e) == (cls or ct.GENERAL)]
    run = run or [e for e in old if ct.shape_class(e) == ct.GENERAL]
    return [{k: v for k, v in e.items() if k not in ct.CLASS_FIELDS} for e in run if e.get("max_m", lo) < lo]


def _buckets(win, cfgs, why, cls, below=()):
    """One class's bucket list: the kept buckets of the m below the measured ones, then the winners per m;
    neighbouring buckets with the same config merged (max_m = the largest m measured in it), the last open; the
    class's bounds on every bucket."""
    buckets = [dict(e) for e in below]
    for m in sorted(win):
        e = {"off": True} if win[m][0] == "off" else dict(cfgs[win[m][0]])
        if buckets and ct.cfg_str(buckets[-1]) == ct.cfg_str(e):
            buckets[-1]["max_m"] = m
        else:
            buckets.append(dict(e, max_m=m))
    buckets[-1].pop("max_m")
    if all(b.get("off") for b in buckets):
        buckets = [{"off": True}]
    for b in buckets:
        w = why.get((cls or ct.GENERAL, ct.cfg_str(b)))
        if w:  # an unchanged config keeps its explanation
            b["why"] = w
        b.update({f: v for f, v in zip(ct.CLASS_FIELDS, cls or ct.GENERAL) if v is not None})
    return [{k: b[k] for k in ct.ORDER if k in b} for b in buckets]


def write_table(path, table, done, ops, ms_list, cc, device, argv, classes=()):
    """Writes the winners of `ops` into a copy of `table` at path: per kernel, a bucket list per shape class of
    `classes` that is worth one (class_winners), then the general class. Returns the new table."""
    new = json.loads(json.dumps(table))
    kmap = kernels_for(cc)
    # the design an alternative replaces is written first: the alternative is measured against its new config
    for op in sorted(ops, key=lambda o: o in ALTERNATIVES):
        kernel, cands = kmap[op]
        fam, cfgs = candidates(kernel, cands, table)
        # an explanation stays with a config that keeps serving its class
        why = {(ct.shape_class(e), ct.cfg_str(e)): e["why"] for e in ct.buckets(table, kernel, fam) if "why" in e}
        per_class = class_winners(done, kernel, ms_list, table, fam, _classes_of(kernel, table, fam, classes))
        if not per_class[-1][1]:
            print(f"[tune] {kernel}: nothing complete to write (keeping the table's entries)")
            continue
        buckets = []
        for cls, win in per_class:
            if kernel in ct.OPTIONAL:
                cur = _incumbent(table, kernel, fam, cls)
                win = _design_choice(done, win, new, kmap, op,
                                     lambda m: None if cur(m) is None else cur(m) != "off")
            if cls is not None:
                print(f"[tune] {kernel}: class {ct.class_str(cls)} gets its own buckets")
            buckets += _buckets(win, cfgs, why, cls, _kept_below(table, kernel, fam, cls, min(ms_list)))
        new["kernels"].setdefault(kernel, {})[fam] = buckets
    tv = sorted({r.get("triton", "?") for r in done.values()})
    how = "re-tuned from the measurements in its --results file" if "--offline" in argv else "measured and written"
    new["origin"] = list(table.get("origin") or []) + [{  # this run's step after the table's own (config_table)
        "date": datetime.date.today().isoformat(), "device": device, "triton": ", ".join(tv), "command": list(argv),
        "note": f"{how}; families and kernels not measured kept from the previous table"}]
    ct.validate(new, path)
    with open(path, "w") as f:
        f.write(ct.dumps(new))
    print(f"[tune] wrote {path}")
    return new


def report(done, ops, ms_list, table, cc, classes=()):
    """Default (the table's config before this run) vs tuned (the winner of the shape's class) time per kernel and
    shape."""
    kmap = kernels_for(cc)
    print("\n| kernel | shape | default config | default ms | tuned config | tuned ms | tuned / default | "
          "cuBLAS (or copy) ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for op in ops:
        kernel, _ = kmap[op]
        fam = "all" if kernel == "rope_kernel" else "half"
        per_class = class_winners(done, kernel, ms_list, table, fam, _classes_of(kernel, table, fam, classes))
        kept = [c for c, _ in per_class[:-1]]
        win_of = dict(per_class)
        for (k, sstr, c), r in sorted(done.items(), key=lambda kv: (kv[0][0], kv[1].get("m") or 0, kv[0][1])):
            if k != kernel or c in REFERENCES:
                continue
            m = None if kernel == "rope_kernel" else r["m"]
            n, kk = r.get("n"), None if m is None else r.get("k")  # rope: n = heads per token row, no k class
            wt = None if m is None else _shape_wt(sstr)
            win = win_of[_owner(kept, n, kk, wt)]
            if m not in win or c != win[m][0]:
                continue
            try:
                dflt = ct.cfg_str(ct.pick(table, kernel, fam, m or 1, n, kk, wt))
            except KeyError:
                dflt = "-"
            d_ms = done.get((kernel, sstr, dflt), {}).get("ms")
            cb = done.get((kernel, sstr, "cuBLAS"), {}).get("ms")
            ratio = f"{r['ms'] / d_ms:.3f}" if d_ms else "-"
            gc = done.get((kernel, sstr, "gather copy"), {}).get("ms")
            if gc:  # the design experiment: show what the gather-copy design pays on top of its GEMM
                sstr = f"{sstr} (gather copy {gc:.4f})"
            print(f"| {kernel} | {sstr} | {dflt} | {d_ms or float('nan'):.4f} | {c} | {r['ms']:.4f} | {ratio} | "
                  f"{cb or float('nan'):.4f} |")


def parser():
    """The command line of `python -m aot.tune` (its module doc says what each option does)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="linear,swiglu,grad_weight,rope")
    p.add_argument("--ms", default="1,16,64,256,1024,4096,16384", help="token counts (m buckets) to measure")
    p.add_argument("--models", default=MATRIX,
                   help=f"models whose projections give N and K: {', '.join(MODELS)} (Llama-2), or {MATRIX} (every "
                        "model of benchmarks/bench_matrix.py) or one of its names")
    p.add_argument("--results", default=None, help="JSON-lines result file (resumable); default tune_sm<cc>.jsonl")
    p.add_argument("--write", default=None, help="write the winners into this config table (aot/configs/sm<cc>.json)")
    p.add_argument("--rep", type=int, default=20)
    p.add_argument("--passes", type=int, default=1,
                   help="measure everything this many times (even passes in reverse config order); a config's time "
                        "is its fastest pass")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting new shapes after this many seconds")
    p.add_argument("--keep", default=None,
                   help="an earlier result file whose measurements of the m not measured now join this run's")
    p.add_argument("--classes", default=None,
                   help="shape classes to try, narrower first, e.g. 'n<=2048;k<=1024': each gets its own buckets where "
                        "its best configs differ from the general class's by more than the keep margin (default: the "
                        "classes the table already has for these kernels; '' for none)")
    p.add_argument("--grad-input", action="store_true",
                   help="also measure (and choose over) the linear kernel's grad-input orientation, dX = dY·W_e, on "
                        "the matrix models' projections (shapes M..._N..._K..._t): the same table entry serves both")
    p.add_argument("--configs", default=None,
                   help="measure only the candidates whose name matches this regular expression (e.g. '_sk$'), beside "
                        "the configs the table uses: a new kind of config against the current choice, to be re-tuned "
                        "offline with the earlier measurements")
    p.add_argument("--offline", action="store_true",
                   help="measure nothing: rebuild the report and --write from the --results file (no GPU needed)")
    p.add_argument("--device", default=None,
                   help="--offline: the device whose records to use (default: the first record's): one results file "
                        "may hold several devices' runs, and a run's random masks and clocks are its own")
    return p


def offline_device(a):
    """(cc, device) of an --offline run: the results file's first record's, or --device's records."""
    with open(a.results) as f:
        first = json.loads(f.readline())
    return first["cc"], a.device or first["device"]


def selection(a, cc, table):
    """What a parsed command line asks for: (ops, models, the sorted m list, shape classes); the classes default to
    those `table` already has for the ops' kernels."""
    ops = [o for o in a.ops.split(",") if o]
    known = set(kernels_for(cc))
    if set(ops) - known:
        raise SystemExit(f"aot.tune: unknown --ops {sorted(set(ops) - known)} (here: {', '.join(sorted(known))})")
    classes = (parse_classes(a.classes) if a.classes is not None
               else table_classes(table, [kernels_for(cc)[o][0] for o in ops]))
    return ops, model_names(a.models), sorted(int(m) for m in a.ms.split(",")), classes


def measurements(a, done, ops, ms_list, models, cc, device):
    """The records that decide the winners: `done` restricted to what the command line asks for, with --keep's
    records of the m not measured now. Returns (records, m list)."""
    done = restrict(done, ops, ms_list, models, cc, a.grad_input)
    if a.keep:
        done, ms_list = merge_kept(done, load_results(a.keep, device), ms_list, {kernels_for(cc)[o][0] for o in ops})
    return done, ms_list


def offline_retune(argv, table, write="/dev/null"):
    """(the table `python -m aot.tune ARGV` writes, its records) for an --offline ARGV, starting from `table` instead
    of the shipped one and writing to `write`, not ARGV's --write: the shipped table's origin commands, chained."""
    a = parser().parse_args(argv)
    cc, device = offline_device(a)
    ops, models, ms_list, classes = selection(a, cc, table)
    done, ms_list = measurements(a, load_results(a.results, device), ops, ms_list, models, cc, device)
    return write_table(write, table, done, ops, ms_list, cc, device, argv, classes), done


def main(argv=None):
    # Measure compiled kernels: an inherited TRITON_INTERPRET=1 would time the CPU interpreter. (Only here, not at
    # import: tests import this module next to interpreter tests in one process.)
    os.environ.pop("TRITON_INTERPRET", None)
    a = parser().parse_args(argv)
    if a.offline:
        if not (a.results and os.path.exists(a.results)):
            raise SystemExit("aot.tune --offline: give the --results file to read")
        cc, device = offline_device(a)
    elif not torch.cuda.is_available():
        raise SystemExit("aot.tune: needs a CUDA GPU (it times kernels on the local device)")
    else:
        major, minor = torch.cuda.get_device_capability(0)
        cc, device = major * 10 + minor, torch.cuda.get_device_name(0)
    table = ct.load(table_arch(cc))
    ops, models, ms_list, classes = selection(a, cc, table)
    results = a.results or f"tune_sm{cc}.jsonl"
    if a.offline:
        done = load_results(results, device)
    else:
        done = search(ops, ms_list, models, results, a.rep, a.budget_s, table, cc, a.passes, a.grad_input,
                      a.configs)
    done, ms_list = measurements(a, done, ops, ms_list, models, cc, device)
    report(done, ops, ms_list, table, cc, classes)
    if a.write:
        write_table(a.write, table, done, ops, ms_list, cc, device, sys.argv[1:] if argv is None else argv, classes)


if __name__ == "__main__":
    main()
