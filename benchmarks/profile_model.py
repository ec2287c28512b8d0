"""Where a CogVLM2-19B layer's GPU time goes: the CUDA kernels of one prefill forward or one training step (forward +
backward) of fused_ops and of the sort + torch._grouped_mm baseline (examples/model_workload.py's models, bf16, one
sequence with an image span), from torch.profiler, grouped into families (routed GEMMs, cuBLAS / CUTLASS GEMMs,
attention, norms, elementwise, copies, ...) and listed kernel by kernel (total time over the profiled steps / steps).
The sum of the kernels is GPU busy time; the wall time of back-to-back steps is printed beside it (the difference: the
GPU waiting, for the host or for a sync), with the host calls that wait for the GPU or copy. Programmatic
dependent launch is turned off while profiling (--pdl keeps it): with it, a routed kernel starts while the one before
it finishes and waits inside, and the profiler would count the wait as the kernel's time.

    python benchmarks/profile_model.py [--tokens 8192] [--phase train|prefill] [--steps 5] [--top 25] [--pdl]
"""
import argparse
import os
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import fused_ops  # noqa: E402
import model_workload as mw  # noqa: E402
from fused_ops.models import COGVLM2_19B, FusedCogVLM, GroupedMMCogVLM  # noqa: E402

# (family, substrings of a kernel's name), first match wins
FAMILIES = (
    ("routed GEMM (fused_ops)", ("routed_", "decode_reduce")),
    ("routing, gathers, SwiGLU backward pass (fused_ops)", ("routing_", "gather_rows", "expert_colsum",
                                                             "swiglu_backward")),
    ("RoPE (fused_ops)", ("rope_kernel",)),
    ("attention (SDPA)", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("grouped GEMM (CUTLASS)", ("grouped", "Grouped")),
    ("GEMM (cuBLAS / CUTLASS)", ("gemm", "Gemm", "sm90_xmma", "cutlass", "nvjet")),
    ("norm", ("norm", "Norm")),
    ("copies / scatter / index", ("copy", "Copy", "scatter", "index", "Index", "gather", "cat", "memcpy", "Memcpy")),
    ("reductions", ("reduce", "Reduce", "sum")),
)


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "elementwise / other"


def profile_kernels(fn, steps: int):
    """({kernel name: total microseconds over `steps` calls} of fn's device activities, {host call that waits for
    the GPU or copies: count over the steps})."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals, waits = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        elif any(k in e.name for k in ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "item", "nonzero")):
            waits[e.name] += 1
    return totals, waits


def wall_ms(fn, steps: int) -> float:
    """Mean wall time of fn over `steps` back-to-back calls (CUDA events; the GPU queue kept full between calls)."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--phase", choices=["train", "prefill"], default="train")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--pdl", action="store_true", help="keep programmatic dependent launch on")
    a = p.parse_args(argv)
    fused_ops.set_programmatic_launch(a.pdl)
    dev, dt = torch.device("cuda"), torch.bfloat16
    config = COGVLM2_19B.replace(layers=1, final_norm=False)
    fused = FusedCogVLM(config, device=dev, dtype=dt)
    grouped = GroupedMMCogVLM(config, device=dev, dtype=dt)
    grouped.load_state_dict(fused.state_dict())
    x, mask = mw.make_inputs(config, 1, a.tokens, dev, dt)
    g = torch.randn(x.shape, device=dev, dtype=dt)
    print(f"# {a.phase} of one CogVLM2-19B layer, {a.tokens} tokens, {torch.cuda.get_device_name()}: GPU busy time "
          f"per step (ms), {a.steps} steps profiled, PDL {'on' if a.pdl else 'off'}")
    for name, model in (("fused_ops", fused), ("grouped_mm", grouped)):
        if a.phase == "train":
            def fn(model=model):
                mw.forward_backward(model, x, mask, g)
        else:
            def fn(model=model):
                with torch.no_grad():
                    model(x, mask)
        totals, waits = profile_kernels(fn, a.steps)
        per_step = {k: v / a.steps / 1000.0 for k, v in totals.items()}  # ms
        fams = defaultdict(float)
        for k, v in per_step.items():
            fams[family(k)] += v
        print(f"\n## {name}: {sum(per_step.values()):.3f} ms of kernels per step, {len(per_step)} distinct kernels; "
              f"wall {wall_ms(fn, a.steps):.3f} ms per step back to back")
        print("  host calls that wait or copy, per step: " +
              (", ".join(f"{k} {v / a.steps:g}" for k, v in sorted(waits.items())) or "none"))
        for fam, v in sorted(fams.items(), key=lambda kv: -kv[1]):
            print(f"  {v:8.3f}  {fam}")
        print(f"  top {a.top} kernels:")
        for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])[:a.top]:
            print(f"  {v:8.3f}  {k[:140]}")


if __name__ == "__main__":
    main()
