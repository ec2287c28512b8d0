#!/usr/bin/env python3
"""Decode attention benchmark: torch.ops.fused.decode_attention against the HBM copy bandwidth and against
F.scaled_dot_product_attention on the same cache (issue #56's target: >= 85% of copy bandwidth on the KV bytes read at
8K and 32K cache, batch 1 and 16).

    python3 benchmarks/bench_decode_attention.py                  # caches 1K, 8K, 32K x batch 1, 16 (Llama-3-8B heads)
    python3 benchmarks/bench_decode_attention.py --quick          # fewer replays
    python3 benchmarks/bench_decode_attention.py --lens 8192 --batches 1 --tokens 4 --out DIR   # DIR/....json

Shapes: 32 query heads, 8 KV heads, head dim 128 (Llama-3-8B, CogVLM2-19B), bf16; T new tokens per sequence (1 by
default); every sequence of the batch holds `len` positions of a cache of capacity len + T + 16 ([B, 8, S, 128], the
model's KVCache layout). q / k_new / v_new are views of one fused QKV output, as the model passes them.

Timing: CUDA graphs (the decode step is captured and replayed; the host's launch cost is not counted), CUDA events
around a replay of `passes` rounds over several cache sets (together more than twice the L2, so every call reads its
cache from HBM), warm-up replays first, the median over the timed replays, divided by the calls per replay. The fused
op's time includes its cache write and (where the batch cannot fill the GPU) the combine kernel of its splits.

Bandwidth: the KV bytes read per call (2 x B x Hkv x len x D x 2 bytes) over the time, as a fraction of the copy
bandwidth measured in the same run (a large device-to-device copy, read + write bytes over its time). SDPA, the peer,
reads the same cache (positions 0 .. len + T - 1, enable_gqa) and writes nothing; its fraction is charged the same
bytes.

Correctness first: each case's fused output is compared with SDPA in float32 on the same (upcast) inputs; a case
whose relative error exceeds 2e-2 is reported as FAIL and not timed.

Every printed number carries the device name. Exit codes: 0 ran (the target column says whether each row meets
it), 1 a case failed its check or errored, 2 no CUDA device or fused_ops missing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402  (importable without torch)

TARGET = 0.85  # fraction of copy bandwidth, at caches of TARGET_MIN_LEN and more
TARGET_MIN_LEN = 8192
CHECK_TOL = 2e-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    p.add_argument("--lens", type=ints, default=[1024, 8192, 32768], help="cache lengths (positions per sequence)")
    p.add_argument("--batches", type=ints, default=[1, 16], help="batch sizes")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    p.add_argument("--tokens", type=int, default=1, help="new tokens per sequence (1-16)")
    p.add_argument("--slack", type=int, default=16, help="cache capacity beyond len + tokens")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--passes", type=int, default=4, help="rounds over the cache sets per graph replay")
    p.add_argument("--replays", type=int, default=20, help="timed replays (the median is reported)")
    p.add_argument("--quick", action="store_true", help="fewer replays and passes")
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA peer")
    p.add_argument("--copy-bytes", type=int, default=1 << 30, help="bytes of the copy-bandwidth measurement")
    p.add_argument("--out", help="folder for bench_decode_attention.json")
    a = p.parse_args(argv)
    if not 1 <= a.tokens <= 16:
        p.error("--tokens must be 1 to 16")
    if a.heads % a.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if a.quick:
        a.replays, a.passes = min(a.replays, 8), min(a.passes, 2)
    return a


def graph_time_ms(torch, calls, passes, replays):
    """Median ms per call of a CUDA graph of `passes` rounds over `calls`, replayed `replays` times (3 warm-ups)."""
    g, n = common.graph_of(torch, calls, passes)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    del g
    return statistics.median(times)


def run_case(torch, F, a, B, L, copy_gbps, dev_name):
    import fused_ops  # noqa: F401
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    Hq, Hkv, D, T = a.heads, a.kv_heads, a.head_dim, a.tokens
    S = L + T + a.slack
    kv_bytes = 2 * B * Hkv * L * D * torch.finfo(dt).bits // 8
    nsets = common.rotation_count(2 * B * Hkv * S * D * torch.finfo(dt).bits // 8)
    sets = []
    for i in range(nsets):
        qkv = torch.randn(B, T, Hq + 2 * Hkv, D, device="cuda", dtype=dt)
        sets.append(dict(q=qkv[:, :, :Hq], k_new=qkv[:, :, Hq:Hq + Hkv], v_new=qkv[:, :, Hq + Hkv:],
                         k_cache=torch.randn(B, Hkv, S, D, device="cuda", dtype=dt),
                         v_cache=torch.randn(B, Hkv, S, D, device="cuda", dtype=dt),
                         lens=torch.full((B,), L, dtype=torch.int32, device="cuda")))
    row = {"device": dev_name, "batch": B, "len": L, "capacity": S, "tokens": T, "heads": Hq, "kv_heads": Hkv,
           "head_dim": D, "dtype": a.dtype, "kv_bytes": kv_bytes, "cache_sets": nsets}

    def fused(s):
        return torch.ops.fused.decode_attention(s["q"], s["k_cache"], s["v_cache"], s["k_new"], s["v_new"], s["lens"])

    # The causal mask of the new tokens for SDPA (none needed for one token).
    mask = None
    if T > 1:
        mask = (torch.arange(L + T, device="cuda")[None, :] <= L + torch.arange(T, device="cuda")[:, None])

    def sdpa(s, up=None):
        q, k, v = s["q"].transpose(1, 2), s["k_cache"][:, :, :L + T], s["v_cache"][:, :, :L + T]
        if up is not None:
            q, k, v = q.to(up), k.to(up), v.to(up)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)

    # Check: the fused op (which writes the new tokens at L) against SDPA in float32 on the cache it wrote.
    s0 = sets[0]
    out = fused(s0)
    ref = sdpa(s0, torch.float32)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    row["check_rel_err"] = err
    if not err <= CHECK_TOL:
        row["status"] = f"FAIL (relative error {err:.3g} against SDPA in float32)"
        return row
    # The launcher's config and split count for this shape (informational: what was timed).
    R = Hq // Hkv * T
    major, minor = torch.cuda.get_device_capability()
    cfg = fused_ops.kernel_config("decode_attention_kernel", "half", R, 10 * major + minor, n=D)
    bm, bn = (int(v) for v in cfg.split("_")[0].split("x")[:2])
    row["config"] = cfg
    row["n_split"] = torch.ops.fused._decode_attention_split(B * Hkv * -(-R // bm), S, bn,
                                                             torch.cuda.get_device_properties(0).multi_processor_count)

    ms = graph_time_ms(torch, [lambda s=s: fused(s) for s in sets], a.passes, a.replays)
    row.update(fused_us=ms * 1e3, fused_gbps=common.gbps(kv_bytes, ms), fused_frac=common.gbps(kv_bytes, ms) /
               copy_gbps)
    if not a.no_sdpa:
        ms_s = graph_time_ms(torch, [lambda s=s: sdpa(s) for s in sets], a.passes, a.replays)
        row.update(sdpa_us=ms_s * 1e3, sdpa_frac=common.gbps(kv_bytes, ms_s) / copy_gbps, speedup=ms_s / ms)
    row["target"] = ("PASS" if row["fused_frac"] >= TARGET else "MISS") if L >= TARGET_MIN_LEN else "-"
    row["status"] = "ok"
    del sets
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    a = parse_args(argv)
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001
        common.die_env("bench_decode_attention", f"torch is not importable ({e})")
    if not torch.cuda.is_available():
        common.die_env("bench_decode_attention", "no CUDA device")
    try:
        import fused_ops  # noqa: F401
    except Exception as e:  # noqa: BLE001
        common.die_env("bench_decode_attention", f"fused_ops is not importable ({e})")
    dev_name = common.device_name()
    copy_gbps = common.copy_bandwidth(a.copy_bytes)
    common.log(f"[{dev_name}] copy bandwidth {copy_gbps:.0f} GB/s (read + write of {a.copy_bytes >> 20} MiB)")
    rows, failed = [], False
    for B in a.batches:
        for L in a.lens:
            try:
                row = run_case(torch, F, a, B, L, copy_gbps, dev_name)
            except Exception as e:  # noqa: BLE001
                row = {"device": dev_name, "batch": B, "len": L, "status": f"ERROR {type(e).__name__}: {e}"}
            rows.append(row)
            failed |= row["status"] != "ok"
            if row["status"] != "ok":
                common.log(f"[{dev_name}] batch {B} cache {L}: {row['status']}")
                continue
            sd = (f"; SDPA {row['sdpa_us']:.1f} us = {row['sdpa_frac']:.2f} of copy bw, fused {row['speedup']:.2f}x"
                  if "sdpa_us" in row else "")
            common.log(f"[{dev_name}] batch {B} cache {L} (T={a.tokens}, {a.heads}/{a.kv_heads} heads, d {a.head_dim}, "
                       f"{a.dtype}; {row['config']}, {row['n_split']} splits): fused {row['fused_us']:.1f} us, {row['fused_gbps']:.0f} GB/s = "
                       f"{row['fused_frac']:.2f} of copy bw (target {TARGET}: {row['target']}){sd}")
    headers = ["device", "batch", "cache", "fused us", "GB/s", "of copy", "target", "SDPA us", "SDPA of copy"]
    table = [[r["device"], r["batch"], r["len"], r.get("fused_us"), r.get("fused_gbps"), r.get("fused_frac"),
              r.get("target", r["status"]), r.get("sdpa_us"), r.get("sdpa_frac")] for r in rows]
    common.print_table(headers, table, [None, None, None, ".1f", ".0f", ".2f", None, ".1f", ".2f"])
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_decode_attention.json"), "w") as f:
            json.dump({"device": dev_name, "copy_gbps": copy_gbps, "args": vars(a), "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
