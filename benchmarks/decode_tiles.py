#!/usr/bin/env python3
"""Tiles of the decode GEMM (kernels/gemm_decode.py) over the matrix's projections, against cuBLAS: the measurement
behind sm_90's routed_decode_linear_kernel classes.

    python3 benchmarks/decode_tiles.py [--ms 1,16] [--out DIR] [--splits 1,2,4,8]

bf16, one expert's rows (every token text, so the work is F.linear's on that expert's weight); the Triton JIT kernel
(needs triton and a GPU; no extension build), with the reduction split by the shipped rule (decode_split) for each
tile. Kernel times: a CUDA graph of 16 calls cycling through 8 copies of the weight (past L2), replayed 30 times,
median time per call; cuBLAS (`torch.matmul` into a preallocated output) the same way. Prints each tile's time over
cuBLAS's per cell, the geometric mean over cells against the shipped general tile, and writes decode_tiles.json.
Every tile's output is checked against float64 first (relative error < 1e-2). No targets. Exit 2 without CUDA.
--splits: instead of every tile with the rule's split, the tiles of SPLIT_TILES with the rule's split and with each
given split forced (named "BN,BK,warps,stages,splits"): the measurement behind decode_split.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import graph_of  # noqa: E402

# (N, K) of the projections a decode step reads: the matrix's linear_dual shapes and Llama-3-70B-TP8's MLP
SHAPES = {"llama3-8b.qkv": (6144, 4096), "llama3-8b.o": (4096, 4096), "70b-tp8.qkv": (1280, 8192),
          "70b-tp8.o": (8192, 1024), "cogvlm2.qkv": (12288, 4096), "qwen2.5-7b.qkv": (4608, 3584),
          "qwen2.5-7b.o": (3584, 3584), "70b-tp8.mlp.gate": (3584, 8192), "70b-tp8.mlp.down": (8192, 3584)}
# (BLOCK_N, BLOCK_K, warps, stages); BLOCK_M is 16 (the table's decode buckets serve m <= 16)
TILES = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256) for w in (2, 4) for st in (3, 4)] + [
    (128, 128, 4, 3), (64, 64, 4, 3), (64, 512, 4, 3)]
GENERAL = (32, 256, 4, 4)  # sm90.json's general class
SPLIT_TILES = [GENERAL, (16, 256, 4, 4), (32, 128, 4, 4)]  # --splits: the general tile, narrower and shorter ones
COPIES, REPS = 8, 30


def graph_time(torch, fns):
    """us per call of fns in one CUDA graph of two passes over them (common.graph_of), median of REPS replays."""
    g, calls = graph_of(torch, fns, passes=2)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPS):
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="1,16")
    p.add_argument("--out", default=None)
    p.add_argument("--splits", default=None, help="comma list of forced reduction splits (SPLIT_TILES only)")
    args = p.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("decode_tiles: needs a CUDA GPU", file=sys.stderr)
        return 2
    from kernels import gemm_decode as D
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), "SMs", sms, flush=True)

    def launch(x, mask, w, out, tile):  # the split: decode_split's (the C++ launcher's) or forced; workspace unfilled
        bn, bk, warps, stages = tile[:4]
        D.launch_routed_decode_linear(x, mask, w, w, None, None, out, sms=sms, BM=16, BN=bn, BK=bk, num_warps=warps,
                                      num_stages=stages, poison_ws=False, n_split=tile[4] if len(tile) > 4 else None)

    tiles = TILES
    if args.splits:
        tiles = list(SPLIT_TILES) + [t + (s, ) for t in SPLIT_TILES for s in map(int, args.splits.split(","))]

    results = {}  # "M:shape" -> {"cublas": us, "BN,BK,warps,stages": us}
    for M, (name, (N, K)) in itertools.product([int(m) for m in args.ms.split(",")], SHAPES.items()):
        gen = torch.Generator(device="cuda").manual_seed(N + K)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5 for _ in range(COPIES)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        mask = torch.zeros(M, dtype=torch.bool, device="cuda")
        outs = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        ref = x.double() @ ws[0].double().t()
        row = {"cublas": graph_time(torch, [lambda i=i: torch.matmul(x, ws[i].t(), out=outs[i])
                                            for i in range(COPIES)])}
        for tile in tiles:
            if len(tile) > 4 and D.split_k(K, tile[4], tile[1])[0] != tile[4]:
                continue  # that many splits of whole K blocks do not exist (some would lie past K)
            try:
                launch(x, mask, ws[0], outs[0], tile)
                torch.cuda.synchronize()
                err = ((outs[0].double() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, f"relative error {err:.2e}"
                row[",".join(map(str, tile))] = graph_time(
                    torch, [lambda i=i: launch(x, mask, ws[i], outs[i], tile) for i in range(COPIES)])
            except Exception as ex:  # noqa: BLE001 (a tile that does not fit is reported, the sweep goes on)
                print(f"  {name} M={M} {tile}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
        results[f"{M}:{name}"] = row
        best = min((v, k) for k, v in row.items() if k != "cublas")
        general = row[",".join(map(str, GENERAL))]
        print(f"M={M:2d} {name:18s} cuBLAS {row['cublas']:6.2f} us  general tile {general / row['cublas']:.3f}x  "
              f"best {best[1]} {best[0] / row['cublas']:.3f}x", flush=True)
        del ws, outs
        torch.cuda.empty_cache()
    tiles = [k for k in next(iter(results.values())) if k != "cublas"]
    general = ",".join(map(str, GENERAL))
    print("\ntile (BN,BK,warps,stages[,forced split]) time / cuBLAS per cell; last two columns: geometric mean and "
          "worst of time / the general tile's")
    print("cell".ljust(22), " ".join(t.ljust(10) for t in tiles))
    for cell, row in results.items():
        print(cell.ljust(22), " ".join(f"{row[t] / row['cublas']:.3f}".ljust(10) if t in row else "-".ljust(10)
                                      for t in tiles))
    for t in tiles:
        rel = [row[t] / row[general] for row in results.values() if t in row]
        print(f"  {t:14s} {math.exp(sum(map(math.log, rel)) / len(rel)):.3f}  worst {max(rel):.3f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_tiles.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "us": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
