#!/usr/bin/env python3
"""torch.compile(dynamic=True) of the example block against the eager fused block: one compilation for every length,
and its speed at 4096 and 8192 tokens (target: within 5% of eager).

    python3 benchmarks/bench_dynamic.py [--hidden 4096 --heads 32 --intermediate 11008] [--rep 30] [--out DIR]

The block is examples/block_model.py's FusedBlock (linear_dual -> rope_fwd -> dual-expert ffn -> ffn, with residual
adds), bf16, inference (torch.no_grad). One compiled module (inductor, fullgraph, dynamic=True, under
backed_size_oblivious: no 0/1 specialization) runs 1, 7, 300, 4096 and 8192 tokens; the number of compilations must
be 1 and every output must match eager (bf16 tolerance). Then eager and compiled are timed call by call
(common.bench_pair) at 4096 and 8192 tokens, and the median ratio compiled / eager is checked against 1.05. Exit status:
0 all targets met, 1 a target missed or an error, 2 without CUDA (the --device cpu smoke run times nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import common  # noqa: E402

TIMED = ((2, 2048), (1, 8192))  # (batch, seq) of 4096 and 8192 tokens
RATIO_TARGET = 1.05


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the compile checks (no timing)")
    p.add_argument("--out", metavar="DIR")
    a = p.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        common.die_env("bench_dynamic", "no CUDA device")
    from block_model import LENGTHS, FusedBlock  # imports fused_ops: the ops register
    import fused_ops
    from torch._dynamo.testing import CompileCounterWithBackend

    dev = torch.device(a.device)
    dt = torch.bfloat16
    block = FusedBlock(a.hidden, a.heads, a.intermediate, device=dev, dtype=dt)
    rpe = fused_ops.RotaryPositionEmbedding(a.hidden // a.heads, device=dev)

    def inputs(b, s):
        x = torch.randn(b, s, a.hidden, device=dev, dtype=dt)
        mask = torch.rand(b, s, device=dev) < 0.5
        return x, mask, rpe(s)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    failures, rows = [], []
    with torch.fx.experimental._config.patch(backed_size_oblivious=True), torch.no_grad():
        for b, s in LENGTHS:
            args = inputs(b, s)
            want, got = block(*args).float(), compiled(*args).float()
            err = ((got - want).norm() / want.norm()).item()
            ok = err < 2e-2  # bf16: inductor fuses the residual adds (one rounding fewer than eager)
            common.log(f"bench_dynamic: {b * s:5d} tokens [{b}, {s}]: rel. error vs eager {err:.2e} "
                       f"{'ok' if ok else 'FAIL'}")
            if not ok:
                failures.append(f"{b * s} tokens: rel. error {err:.2e}")
        n = counter.frame_count
        common.log(f"bench_dynamic: {n} compilation(s) for {len(LENGTHS)} lengths (target 1) "
                   f"{'ok' if n == 1 else 'FAIL'}")
        if n != 1:
            failures.append(f"{n} compilations")
        if dev.type == "cuda":
            common.log(f"bench_dynamic: {common.device_name(dev)}, hidden {a.hidden}, heads {a.heads}, "
                       f"intermediate {a.intermediate}, bf16; compiled / eager, {a.rep} interleaved pairs")
            for b, s in TIMED:
                sets = [inputs(b, s) for _ in range(2)]
                pairs = common.bench_pair(block, compiled, args=sets, rep=a.rep)
                eager_ms = statistics.median(e for e, _ in pairs)
                comp_ms = statistics.median(c for _, c in pairs)
                ratio = statistics.median(c / e for e, c in pairs)
                ok = ratio <= RATIO_TARGET
                rows.append({"tokens": b * s, "eager_ms": eager_ms, "compiled_ms": comp_ms, "ratio": ratio, "ok": ok})
                common.log(f"  {b * s:5d} tokens: eager {eager_ms:.3f} ms, compiled {comp_ms:.3f} ms, ratio "
                           f"{ratio:.3f} (target <= {RATIO_TARGET}) {'PASS' if ok else 'FAIL'}")
                if not ok:
                    failures.append(f"{b * s} tokens: ratio {ratio:.3f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_dynamic.json"), "w") as f:
            json.dump({"device": common.device_name(dev), "compilations": n, "rows": rows, "failures": failures}, f,
                      indent=1)
    common.log("bench_dynamic: " + ("all targets met" if not failures else "MISSED: " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
