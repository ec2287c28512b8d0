"""The ffn's residual add in the down projection's epilogue (`ffn(..., residual=h)`) against the unfused
`h + ffn(...)`, paired on one GPU: CogVLM2's MLP (dual expert, one image span of 28% of the tokens, stacked weights,
a shared routing) at 8192 and 2048 tokens, and Llama-3-8B's (single expert) at 8192. bf16, CUDA events, median of 40
after warm-up, each side timed twice and the better median kept. Prints the two times, their ratio (> 1: the fused
residual is faster) and the relative difference of the outputs (one rounding fewer on the fused side).

    python benchmarks/bench_residual.py
"""
import statistics

import torch

import fused_ops  # noqa: F401  (registers torch.ops.fused)


def bench(fn, n=40):
    ts = []
    for _ in range(5):
        fn()
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def main():
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    print(f"# ffn residual in the epilogue vs ffn + add, {torch.cuda.get_device_name()}")
    for name, M, H, I, dual in (("cogvlm2 8192", 8192, 4096, 14336, True), ("cogvlm2 2048", 2048, 4096, 14336, True),
                                ("llama 8192", 8192, 4096, 14336, False)):
        x = torch.randn(M, H, device=dev, dtype=bf)
        h = torch.randn_like(x)
        E = 2 if dual else 1
        w1, w3 = ((torch.randn(E, I, H, device=dev) * 0.02).to(bf) for _ in range(2))
        w2 = (torch.randn(E, H, I, device=dev) * 0.02).to(bf)
        if dual:
            mask = torch.zeros(M, dtype=torch.bool, device=dev)
            mask[M // 8: M // 8 + int(M * 0.28)] = True
            args, kw = (w1, w3, w2, mask), dict(routing=torch.ops.fused.route(mask))
        else:
            args, kw = (w1[0], w3[0], w2[0]), {}
        fused = lambda: torch.ops.fused.ffn(x, *args, residual=h, **kw)  # noqa: E731
        unfused = lambda: h + torch.ops.fused.ffn(x, *args, **kw)  # noqa: E731
        ref = unfused().float()
        diff = ((fused().float() - ref).norm() / ref.norm()).item()
        ta = min(bench(fused), bench(fused))
        tb = min(bench(unfused), bench(unfused))
        print(f"{name}: residual in epilogue {ta:.3f} ms, ffn + add {tb:.3f} ms, ratio {tb / ta:.3f} "
              f"(rel diff {diff:.1e})", flush=True)


if __name__ == "__main__":
    main()
