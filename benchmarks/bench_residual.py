"""The residual add in a projection's epilogue against the unfused add, paired on one GPU: the ffn's
(`ffn(..., residual=h)` against `h + ffn(...)`: CogVLM2's MLP, dual expert, one image span of 28% of the tokens,
stacked weights, a shared routing, at 8192 and 2048 tokens, and Llama-3-8B's, single expert, at 8192) and
linear_dual's (`linear_dual(o, ..., residual=x)` against `x + linear_dual(o, ...)`: CogVLM2's attention dense
projection, 4096 x 4096, at 8192 and 2048 tokens with the span, and at 1 and 16 decode tokens, where the decode GEMM
runs). bf16, timed call by call in pairs (benchmarks/common.py bench_pair: CUDA events, inputs rotated past L2, 40
pairs after warm-up). Prints the two medians, the median of the pairs' ratios (> 1: the fused residual is faster) and
the relative difference of the outputs (one rounding fewer on the fused side).

    python benchmarks/bench_residual.py
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fused_ops  # noqa: E402,F401  (registers torch.ops.fused)
from common import bench_pair, rotation_count  # noqa: E402


def span_mask(M, dev):
    mask = torch.zeros(M, dtype=torch.bool, device=dev)
    mask[M // 8: M // 8 + max(1, int(M * 0.28))] = True
    return mask


def report(name, fused, unfused, sets):
    ref = unfused(*sets[0]).float()
    diff = ((fused(*sets[0]).float() - ref).norm() / ref.norm()).item()
    pairs = bench_pair(fused, unfused, sets, warmup=5, rep=40)
    ta, tb = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
    ratio = statistics.median(b / a for a, b in pairs)
    print(f"{name}: residual in epilogue {ta:.4f} ms, op + add {tb:.4f} ms, ratio {ratio:.3f} (rel diff {diff:.1e})",
          flush=True)


def main():
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    print(f"# the residual add in the epilogue vs op + add, {torch.cuda.get_device_name()}")
    H = 4096
    w = (torch.randn(2, H, H, device=dev) * 0.02).to(bf)  # DualLinear's [2, N, K]: text [0], vision [1]
    for M in (8192, 2048, 16, 1):
        sets = [(torch.randn(M, H, device=dev, dtype=bf), torch.randn(M, H, device=dev, dtype=bf))
                for _ in range(rotation_count(M * H * 2 * 3, dev, max_sets=4))]  # (o, x): the weights stay (one
        # expert's 32 MiB may sit in L2 at decode sizes: both sides read them alike, the ratio is what counts)
        mask = span_mask(M, dev)
        routing = torch.ops.fused.route(mask)

        def fused(o, x):
            return torch.ops.fused.linear_dual(o, mask, w[1], w[0], routing=routing, residual=x)

        def unfused(o, x):
            return x + torch.ops.fused.linear_dual(o, mask, w[1], w[0], routing=routing)

        report(f"linear_dual cogvlm2 dense {M}", fused, unfused, sets)
    for name, M, H, I, dual in (("cogvlm2 8192", 8192, 4096, 14336, True), ("cogvlm2 2048", 2048, 4096, 14336, True),
                                ("llama 8192", 8192, 4096, 14336, False)):
        sets = [(torch.randn(M, H, device=dev, dtype=bf), torch.randn(M, H, device=dev, dtype=bf))
                for _ in range(rotation_count(M * H * 2 * 3, dev, max_sets=4))]  # (x, h): x and h read, out written
        E = 2 if dual else 1
        w1, w3 = ((torch.randn(E, I, H, device=dev) * 0.02).to(bf) for _ in range(2))
        w2 = (torch.randn(E, H, I, device=dev) * 0.02).to(bf)
        if dual:
            mask = span_mask(M, dev)
            args, kw = (w1, w3, w2, mask), dict(routing=torch.ops.fused.route(mask))
        else:
            args, kw = (w1[0], w3[0], w2[0]), {}

        def fused(x, h):
            return torch.ops.fused.ffn(x, *args, residual=h, **kw)

        def unfused(x, h):
            return h + torch.ops.fused.ffn(x, *args, **kw)

        report(f"ffn {name}", fused, unfused, sets)


if __name__ == "__main__":
    main()
