#!/usr/bin/env python3
"""Programmatic dependent launch, A/B: each routed case timed with PDL on and off, alternating, several rounds.

    python3 benchmarks/bench_pdl.py [--rounds 5] [--rep 20] [--out DIR]

The routed benchmarks time PDL off once per case next to the default (on); a difference of 1-3% there is within the
run-to-run spread of one measurement. Here every case is measured in `rounds` alternating pairs (on, off, off, on,
...), and the median of each setting over the rounds is compared: what PDL saves (or costs) per case, beyond noise.
Cases: linear_dual forward and backward at M = K = N = 4096 (random mask); ffn dual (random, one span, 90% vision)
and single at M = 4096, H = 4096, I = 11008 and its backward (dual, random); ffn decode M = 1 and 4, single and dual.
bf16. No targets: information for docs/perf.md. Exit 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rep", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", metavar="DIR")
    p.add_argument("--skip", default="", help="comma list of case-name prefixes to leave out")
    a = p.parse_args(argv)
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        print(f"bench_pdl: SKIPPED (torch is not importable: {e})")
        return 2
    if not torch.cuda.is_available():
        print("bench_pdl: SKIPPED (no CUDA device)")
        return 2
    import fused_ops  # noqa: F401  (registers torch.ops.fused)

    dev = torch.device("cuda", torch.cuda.current_device())
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=dev) / math.sqrt(shape[-1])).to(dt)

    def mask(kind, M):
        if kind == "span":
            m = torch.zeros(M, dtype=torch.bool)
            m[M // 4: M // 4 + M // 2] = True
        else:
            m = torch.rand(M, generator=gen) < (0.9 if kind == "vision90" else 0.5)
            if M >= 2:
                m[0], m[1] = True, False
        return m.to(dev)

    S, H, I = 4096, 4096, 11008  # noqa: E741
    cases = []
    lw = w(2, S, S)
    xs = [(torch.randn(S, S, device=dev, dtype=dt),) for _ in range(common.rotation_count(S * S * 2))]
    m50 = mask("rand50", S)
    cases.append(("linear_dual fwd rand50", lambda x: torch.ops.fused.linear_dual(x, m50, lw[1], lw[0]), xs))
    gs = [(torch.randn(S, S, device=dev, dtype=dt), x) for (x,) in xs[:4]]
    cases.append(("linear_dual bwd rand50",
                  lambda g, x: torch.ops.fused.linear_dual_backward(g, x, m50, lw[1], lw[0]), gs))
    w13, w2 = w(2, 2, I, H), w(2, H, I)  # [expert, gate/up, I, H]: expert 1 = vision (w*), 0 = text (u*)
    dual = lambda m: (w13[1, 0], w13[1, 1], w2[1], m, w13[0, 0], w13[0, 1], w2[0])  # noqa: E731
    fx = [(torch.randn(S, H, device=dev, dtype=dt),) for _ in range(common.rotation_count(S * H * 2))]
    for kind in ("rand50", "span", "vision90"):
        args = dual(mask(kind, S))
        cases.append((f"ffn dual {kind}", lambda x, args=args: torch.ops.fused.ffn(x, *args), fx))
    single = (w13[1, 0], w13[1, 1], w2[1])
    cases.append(("ffn single", lambda x: torch.ops.fused.ffn(x, *single), fx))
    args = dual(mask("rand50", S))
    fg = [(torch.randn(S, H, device=dev, dtype=dt), x) for (x,) in fx[:2]]
    cases.append(("ffn bwd dual rand50",
                  lambda g, x, args=args: torch.ops.fused.ffn_backward(g, x, *args[:3], *args[3:]), fg))
    for M in (1, 4):
        xd = [(torch.randn(M, H, device=dev, dtype=dt),)]
        cases.append((f"ffn decode M={M} single", lambda x: torch.ops.fused.ffn(x, *single), xd))
        args = dual(mask("rand50", M))
        cases.append((f"ffn decode M={M} dual", lambda x, args=args: torch.ops.fused.ffn(x, *args), xd))

    print(f"bench_pdl: {common.device_name(dev)}, torch {torch.__version__}, {a.rounds} rounds x {a.rep} reps", flush=True)
    rows = []
    print(f"{'case':26s} {'on ms':>8s} {'off ms':>8s} {'on/off':>7s}   rounds (on / off)", flush=True)
    skip = tuple(x.strip() for x in a.skip.split(",") if x.strip())
    for name, fn, sets in cases:
        if skip and name.startswith(skip):
            continue
        t = {True: [], False: []}
        with torch.no_grad():
            for r in range(a.rounds):
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    with common.programmatic_launch(on):
                        t[on].append(common.bench(fn, args=sets, warmup=a.warmup, rep=a.rep))
        on, off = statistics.median(t[True]), statistics.median(t[False])
        rows.append({"case": name, "on_ms": on, "off_ms": off, "ratio": on / off, "on": t[True], "off": t[False]})
        print(f"{name:26s} {on:8.4f} {off:8.4f} {on / off:7.3f}   "
              f"{' '.join(f'{v:.4f}' for v in t[True])} / {' '.join(f'{v:.4f}' for v in t[False])}", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_pdl.json"), "w") as f:
            json.dump({"device": common.device_name(dev), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
