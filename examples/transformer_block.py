"""The main job: the fused ops on the hot parts of a Llama-style transformer block, checked against PyTorch.

On a CUDA GPU: q/k rotary embedding of an attention layer (GQA), forward and backward, at a realistic size;
each fused op is checked against plain PyTorch (relative error in float64) and timed against it (CUDA events,
median of many runs). Without a GPU: the same calls on the CPU reference path at a small size, and a plain
statement that the kernels themselves need a CUDA GPU.
"""
import argparse
import statistics
import sys

import torch

import fused_ops


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_eager(t, freqs):
    """TransformerEngine's unfused formula: t [b, s, h, d] (bshd), freqs [s, 1, 1, d]."""
    f = freqs.transpose(0, 1)  # [1, s, 1, d]
    return (t.float() * f.cos() + rotate_half(t.float()) * f.sin()).to(t.dtype)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def time_ms(fn, reps=50, warmup=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    b, s, hq, hk, d = (a.batch, a.seq, 32, 8, 128) if cuda else (2, 64, 4, 2, 64)
    dt = torch.bfloat16
    print(f"fused_ops built for {fused_ops.built_archs()}; running on "
          f"{torch.cuda.get_device_name() if cuda else 'the CPU'}")
    if not cuda:
        print("No CUDA GPU here: the Triton kernels need one. Running the CPU reference path of every op instead.")

    rpe = fused_ops.RotaryPositionEmbedding(d, device=dev)
    freqs = rpe(s)
    q = torch.randn(b, s, hq, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, s, hk, d, device=dev, dtype=dt, requires_grad=True)
    rows = []

    qo, ko = fused_ops.apply_rotary_pos_emb_qk(q, k, freqs, "bshd")
    err = max(rel_err(qo, rope_eager(q, freqs)), rel_err(ko, rope_eager(k, freqs)))
    rows.append(["rope q+k forward (fused_rope_fwd_qk)", err])
    go = torch.randn_like(qo)
    (gq,) = torch.autograd.grad(qo, q, go)
    qe = q.detach().requires_grad_(True)
    (gq_ref,) = torch.autograd.grad(rope_eager(qe, freqs), qe, go)
    rows.append(["rope backward (autograd)", rel_err(gq, gq_ref)])

    if cuda:
        bytes_qk = 2 * (q.numel() + k.numel()) * q.element_size()
        t_fused = time_ms(lambda: torch.ops.fused.rope_fwd_qk(q, k, freqs, "bshd"))
        t_eager = time_ms(lambda: (rope_eager(q, freqs), rope_eager(k, freqs)))
        t_copy = time_ms(lambda: (q.detach().clone(), k.detach().clone()))
        rows[0] += [t_fused, t_eager, t_copy, bytes_qk / t_fused / 1e6]
        t_bwd = time_ms(lambda: torch.ops.fused.rope_bwd(go, freqs, "bshd"))
        t_bwd_eager = time_ms(lambda: torch.autograd.grad(rope_eager(qe, freqs), qe, go))
        rows[1] += [t_bwd, t_bwd_eager, time_ms(lambda: go.clone()), 2 * go.numel() * 2 / t_bwd / 1e6]

    ok = all(r[1] < 1e-2 for r in rows)
    print(f"\nshape: b={b} s={s} heads q={hq} k={hk} d={d} {dt}")
    hdr = "| op | rel. error vs PyTorch |" + (" fused ms | PyTorch ms | copy ms | fused GB/s |" if cuda else "")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        cells = [r[0], f"{r[1]:.2e}"] + ([f"{r[2]:.3f}", f"{r[3]:.3f}", f"{r[4]:.3f}", f"{r[5]:.0f}"] if cuda else [])
        print("| " + " | ".join(cells) + " |")
    print("\nall checks passed" if ok else "\nCHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
