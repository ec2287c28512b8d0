#!/usr/bin/env python3
"""Where an op's time goes: the device time of each kernel one call launches, from the CUDA profiler.

    python3 benchmarks/kernel_times.py [--calls 20] [--only linear,ffn,decode,ffn_bwd,linear_decode]

For the routed benchmarks' main cases (bf16): linear_dual forward and backward at M = K = N = 4096, ffn forward at M =
4096, H = 4096, I = 11008 (dual with a random mask, single), ffn decode steps (M = 1 and 16, single and dual, Llama-2
7B sizes). `--only ffn_bwd`: the matrix's ffn_bwd cells (benchmarks/bench_matrix.py ffn_cell: ffn_backward with gate
and up saved, and its anchor, the six cuBLAS GEMMs per expert) at M = 8192 / 2048, H = 4096, I = 14336; `--only
linear_decode`: linear_dual at M = 1 and 16 with and without the decode GEMM. Per case: each kernel's mean device
time per op call, and their sum next to the op's wall time per call measured with CUDA events over back-to-back calls
(the difference is the gaps between kernels). The kernel table is taken with programmatic dependent launch off: with
it on, a kernel starts early and waits for its predecessor, and the profiler counts that wait as its duration. The
wall time is given both ways. Two experts' weights are views of one [2, R, C] tensor (the zero-copy layout of
DualExpertSwiGLU / DualLinear). No targets: information for docs/perf.md. Exit 2 without CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict


def kernel_table(torch, fn, calls: int):
    """({kernel name: total device µs}, wall µs per call) over `calls` calls after a warm-up."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.device_time  # µs
    walls = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(stop) * 1e3 / calls)
    return per_kernel, statistics.median(walls)


def wall_pdl_on(torch, fn, calls: int) -> float:
    import fused_ops
    fused_ops.set_programmatic_launch(True)
    try:
        return kernel_table(torch, fn, calls)[1]
    finally:
        fused_ops.set_programmatic_launch(False)


def report(name: str, per_kernel, wall_us: float, calls: int, wall_pdl: float) -> None:
    print(f"\n### {name}: {wall_us:.1f} µs per call without PDL, {wall_pdl:.1f} µs with PDL (CUDA events, {calls} "
          "calls back to back)")
    total = 0.0
    for k, t in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        total += t / calls
        print(f"  {t / calls:9.1f} µs  {k[:110]}")
    print(f"  {total:9.1f} µs  sum of kernels ({wall_us - total:+.1f} µs of gaps / overlap)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--only", default="linear,ffn,decode")
    a = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("kernel_times: SKIPPED (no CUDA device)")
        return 2
    import fused_ops  # registers torch.ops.fused
    ops = torch.ops.fused
    fused_ops.set_programmatic_launch(False)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    only = set(a.only.split(","))

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, **bf) * scale

    def run(name, fn):
        per_kernel, wall = kernel_table(torch, fn, a.calls)
        report(name, per_kernel, wall, a.calls, wall_pdl_on(torch, fn, a.calls))

    if "linear" in only:
        M = K = N = 4096
        x, dy = rnd(M, K), rnd(M, N)
        wt, wv = rnd(2, N, K, scale=K ** -0.5).unbind(0)  # text first: one rank-3 descriptor, no stacking copy
        mask = torch.rand(M, generator=gen, device=dev) < 0.5
        fwd = lambda: ops.linear_dual(x, mask, wv, wt, None, None, False)  # noqa: E731
        # the backward of a layer without biases, with the forward's routing: as autograd and bench_linear_dual's
        # target call it
        routing = ops.linear_dual_forward(x, mask, wv, wt)[1]
        bwd = lambda: ops.linear_dual_backward(dy, x, mask, wv, wt, False, [True, True, True, False, False],  # noqa
                                               routing)
        run("linear_dual fwd 4096^3 rand50", fwd)
        run("linear_dual bwd 4096^3 rand50 (no bias grads)", bwd)
    H, I = 4096, 11008  # noqa: E741

    def ffn_case(name, M, dual):
        x = rnd(M, H)
        E = 2 if dual else 1
        g13, d2 = rnd(2, E, I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)  # [gate/up, expert (text first)]
        w1, w3, w2 = g13[0, -1], g13[1, -1], d2[-1]
        if dual:
            u1, u3, u2 = g13[0, 0], g13[1, 0], d2[0]
            mask = torch.rand(M, generator=gen, device=dev) < 0.5
            fn = lambda: ops.ffn(x, w1, w3, w2, mask, u1, u3, u2, False)  # noqa: E731
        else:
            fn = lambda: ops.ffn(x, w1, w3, w2, None, None, None, None, False)  # noqa: E731
        run(name, fn)

    if "ffn" in only:
        ffn_case("ffn dual fwd M=4096 rand50", 4096, True)
        ffn_case("ffn single fwd M=4096", 4096, False)
    if "ffn_bwd" in only:  # the training backward (gate and up saved) beside the matrix's anchor: its ffn_bwd cell
        from bench_matrix import ffn_cell
        for M, kind in ((8192, "rand50"), (8192, "span"), (2048, "rand50")):
            cell = ffn_cell("ffn_bwd", 4096, 14336, M, kind, dev, torch.Generator().manual_seed(M))
            args = cell.arg_sets[0]
            run(f"ffn_backward M={M} H=4096 I=14336 {kind} (gate and up saved)", lambda: cell.fn(*args))
            run("cuBLAS anchor of the above: six GEMMs per expert", lambda: cell.anchor(*args))
    if "decode" in only:
        for M in (1, 16):
            ffn_case(f"ffn decode single M={M}", M, False)
            ffn_case(f"ffn decode dual M={M}", M, True)
    if "linear_decode" in only:  # the decode GEMM against the routed GEMMs (FUSED_DECODE_GEMM=0) on Llama-3-8B's
        import os                # o and QKV projections and Llama-3-70B-TP8's QKV
        for N, K in ((4096, 4096), (6144, 4096), (1280, 8192)):
            wt, wv = rnd(2, N, K, scale=K ** -0.5).unbind(0)
            for M in (1, 16):
                x = rnd(M, K)
                mask = torch.rand(M, generator=gen, device=dev) < 0.5
                for env in ("1", "0"):
                    os.environ["FUSED_DECODE_GEMM"] = env
                    run(f"linear_dual decode N={N} K={K} M={M} FUSED_DECODE_GEMM={env}",
                        lambda: ops.linear_dual(x, mask, wv, wt, None, None, False))
                os.environ.pop("FUSED_DECODE_GEMM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
