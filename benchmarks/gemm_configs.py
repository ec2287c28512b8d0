#!/usr/bin/env python3
"""Block configs of the routed linear GEMMs side by side, timed in interleaved rounds (the measurement behind a
config-table change that is too close for aot.tune's one pass per config).

    python3 benchmarks/gemm_configs.py [--m 4096 --n 4096 --k 4096] [--rounds 25] [--reps 2]

bf16, a 50% random mask, inputs rotated past L2 (three sets). The Triton JIT kernels of kernels/gemm_gather_tma.py and
kernels/gemm_tma.py (needs triton and a Hopper GPU for the TMA kernels; no extension build), each variant captured in a
CUDA graph of nine calls and replayed; per round every variant runs once, in a random order drawn anew each round, so
clock drift under sustained load (an H100 loses ~10% of its matrix rate as it heats) reaches all of them alike and no
variant keeps the place in the round that favours it. Reports each variant's median time and its median per-round ratio
to cuBLAS (`torch.matmul` on one expert's weight, all M rows). Variants:
  gather[_f]    routed_linear_gather_tma_kernel (A rows gathered inside), routing kernel before it
  routed[_f]    the same kernel routing the mask itself (ROUTE_BLOCK, M <= 4096)
  tma_s3/s4[_f] routed_linear_tma_kernel on a pre-gathered expert-ordered A (the GEMM alone, without the gather copy)
Correctness: every variant's output is checked once against float64 before timing (relative error < 1e-2).
No targets; numbers go to docs/perf.md. Exit 2 without CUDA.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import graph_of  # noqa: E402


def interleaved(torch, variants, rounds: int, inner: int = 3, seed: int = 0):
    """{name: [calls]} -> ({name: median µs per call}, {name: median per-round ratio to the first variant}).
    Every round runs each variant once, in a fresh random order (seeded). In a fixed order with several heavy
    variants per round, two copies of one kernel once read 2-5% apart by their place in the round (H100, docs/perf.md
    v20), more than many differences measured here; shuffled, they agreed within 0.3%."""
    graphs = {k: graph_of(torch, v) for k, v in variants.items()}
    times = {k: [] for k in variants}
    order = list(graphs)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for k in order:
            g, n = graphs[k]
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                g.replay()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) * 1000 / (n * inner))
    first = times[next(iter(variants))]
    return ({k: statistics.median(v) for k, v in times.items()},
            {k: statistics.median(x / y for x, y in zip(v, first)) for k, v in times.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gemm_configs: no CUDA device", file=sys.stderr)
        return 2
    from kernels.gather_rows import launch_gather_rows
    from kernels.gemm_gather_tma import launch_routed_linear_gather_tma
    from kernels.gemm_tma import launch_routed_linear_tma
    from kernels.routing import ONE_BLOCK, one_block_size, route

    M, N, K, dev = args.m, args.n, args.k, "cuda"
    torch.manual_seed(0)
    sets = []
    for _ in range(3):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(2, N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        mask = torch.rand(M, device=dev) < 0.5
        perm, seg = route(mask, align=128)
        xg = torch.empty(perm.shape[0], K, device=dev, dtype=torch.bfloat16)
        launch_gather_rows(x, xg, perm)
        sets.append(dict(x=x, w=w, mask=mask, perm=perm, seg=seg, xg=xg,
                         out=torch.empty(M, N, device=dev, dtype=torch.bfloat16)))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tile = dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_programs=sms)

    def gather(s, flat, route_here):
        def call():
            if route_here:
                launch_routed_linear_gather_tma(s["x"], s["w"], None, None, s["out"], s["perm"], s["seg"],
                                                mask=s["mask"], route_block=one_block_size(M), align=128,
                                                num_stages=3, FLATTEN=flat, **tile)
            else:
                route(s["mask"], align=128, perm=s["perm"], seg=s["seg"])
                launch_routed_linear_gather_tma(s["x"], s["w"], None, None, s["out"], s["perm"], s["seg"],
                                                num_stages=3, FLATTEN=flat, **tile)
        return call

    def tma(s, stages, flat):
        return lambda: launch_routed_linear_tma(s["xg"], s["w"], None, None, s["out"], s["perm"], s["seg"],
                                                num_stages=stages, FLATTEN=flat, **tile)

    makers = {"cuBLAS": lambda s: (lambda: torch.matmul(s["x"], s["w"][0].T, out=s["out"])),
              "gather": lambda s: gather(s, False, False), "gather_f": lambda s: gather(s, True, False)}
    if M <= ONE_BLOCK:
        makers.update({"routed": lambda s: gather(s, False, True), "routed_f": lambda s: gather(s, True, True)})
    makers.update({"tma_s3": lambda s: tma(s, 3, False), "tma_s3_f": lambda s: tma(s, 3, True),
                   "tma_s4": lambda s: tma(s, 4, False), "tma_s4_f": lambda s: tma(s, 4, True)})

    s0 = sets[0]
    m1 = s0["mask"][:, None]
    ref = torch.where(m1, s0["x"].double() @ s0["w"][1].double().T, s0["x"].double() @ s0["w"][0].double().T)
    for name, make in makers.items():
        if name == "cuBLAS":
            continue
        s0["out"].fill_(float("nan"))
        make(s0)()
        torch.cuda.synchronize()
        err = ((s0["out"].double() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            print(f"gemm_configs: {name} is wrong (relative error {err:.2e})", file=sys.stderr)
            return 1
    print(f"{torch.cuda.get_device_name()}, M={M} N={N} K={K} bf16, 50% random mask, {args.rounds} rounds")
    for rep in range(args.reps):
        med, ratio = interleaved(torch, {k: [make(s) for s in sets] for k, make in makers.items()}, args.rounds)
        for k in makers:
            print(f"rep {rep}  {k:10s} {med[k]:8.1f} us  {ratio[k]:.3f}x cuBLAS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
