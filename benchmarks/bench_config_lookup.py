"""Host cost of the run-time config choice (csrc/runtime/kernel_configs.cpp), no GPU needed.

Prints what one lookup costs inside C++ (torch.ops.fused._config_lookup_ns: find_config in a loop, as the launchers
call it), next to the cost of a trivial op call through the dispatcher (torch.ops.fused.built_archs) for scale.
Medians of several runs.

    python benchmarks/bench_config_lookup.py [--n 200000]
"""
import argparse
import statistics
import time

import torch

import fused_ops  # noqa: F401  (registers torch.ops.fused)


def per_call_ns(fn, n, runs=7):
    out = []
    for _ in range(runs):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t) / n)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200000)
    a = p.parse_args()
    op = torch.ops.fused
    lookup = statistics.median(op._config_lookup_ns(a.n) for _ in range(7))
    base = per_call_ns(lambda: op.built_archs(), a.n // 10)
    print(f"config lookup (C++, find_config): {lookup:.1f} ns; an empty op call through the dispatcher: {base:.0f} ns")


if __name__ == "__main__":
    main()
