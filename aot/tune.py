"""Config search on the local GPU: times candidate block configs of the kernels with Triton's JIT (tuning time only;
the built package never runs Triton) and writes what it measured to a JSON file.

    python -m aot.tune [--ops rope,linear,swiglu,grad_weight,decode] [--out tune_sm90.json] [--rep 30]

Each candidate is checked against a float64 reference once before it is timed, so a fast wrong config cannot win.
Timings are medians of CUDA-event times over inputs rotated past the L2 (benchmarks/common.py). The result file
holds every (op, shape, config) time; the winners are printed as a table. The AOT configs live in aot/manifest.py
(GEMM_TILES, and the rope meta-parameters); see docs/perf.md for how a measured winner gets there.
"""
import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from kernels import gemm, rope  # noqa: E402
from kernels.routing import route  # noqa: E402

DEV = "cuda"


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _time(fn, arg_sets, rep):
    return common.bench(fn, args=arg_sets, warmup=5, rep=rep)


def _sets(make, nbytes):
    return [make() for _ in range(common.rotation_count(nbytes))]


# ------------------------------------------------------------------------------------------------------------ rope
def tune_rope(rep):
    rows = []
    d, dt = 128, torch.bfloat16
    half = d // 2
    for case, (s, b, h, h2, bshd) in {"sbhd s4096 b2 h32": (4096, 2, 32, 0, False),
                                      "bshd qk q32 k8": (4096, 2, 32, 8, True)}.items():
        freqs = torch.rand(s, 1, 1, d, device=DEV) * 100
        shape = (b, s, h, d) if bshd else (s, b, h, d)
        shape2 = (b, s, h2 or 1, d) if bshd else (s, b, h2 or 1, d)
        nbytes = 2 * 2 * (math.prod(shape) + (math.prod(shape2) if h2 else 0))
        sets = _sets(lambda: (torch.randn(shape, device=DEV, dtype=dt), torch.randn(shape2, device=DEV, dtype=dt)),
                     nbytes)
        x0, k0 = sets[0]
        no_i32 = torch.zeros(1, device=DEV, dtype=torch.int32)  # cu_seqlens / start_positions: unused here
        ang = freqs[:s, 0, 0].double()
        cos, sin = ang.cos(), ang.sin()

        def ref(x):  # x [., s, h, d] or [s, ., h, d]
            xd = x.double()
            c = cos[None, :, None, :] if bshd else cos[:, None, None, :]
            sn = sin[None, :, None, :] if bshd else sin[:, None, None, :]
            rot = torch.cat([-xd[..., half:], xd[..., :half]], -1)
            return xd * c + rot * sn

        for bh in (4, 8, 16, 32):
            for nw in (1, 2, 4, 8):
                def run(x, k):
                    out = torch.empty_like(x)
                    out2 = torch.empty_like(k) if h2 else out
                    st = lambda t: (t.stride(1), t.stride(0), t.stride(2), t.stride(3)) if bshd else \
                        (t.stride(0), t.stride(1), t.stride(2), t.stride(3))
                    rope.rope_kernel[(s * b, )](
                        x, out, k if h2 else x, out2, freqs, no_i32, no_i32, s, b, h, h2, d, half, s, freqs.stride(0),
                        *st(x), *st(out), *st(k if h2 else x), *st(out2), 1, 0, 1 if bshd else 0,
                        IS_THD=False, INTERLEAVED=False, HAS_SECOND=bool(h2), BLOCK_H=bh, BLOCK_HALF=64,
                        BLOCK_B=128, num_warps=nw)
                    return out, out2
                o, o2 = run(x0, k0)
                err = _rel(o, ref(x0))
                if h2:
                    err = max(err, _rel(o2, ref(k0)))
                ms = _time(run, sets, rep) if err < 1e-2 else float("nan")
                rows.append(dict(op="rope", shape=case, config=f"BLOCK_H={bh},warps={nw}", ms=ms, err=err,
                                 gbps=nbytes / ms / 1e6))
        ms_copy = common.copy_time_ms(nbytes // 2, warmup=5, rep=rep, dev=DEV)
        rows.append(dict(op="rope", shape=case, config="copy (ceiling)", ms=ms_copy, err=0.0,
                         gbps=nbytes / ms_copy / 1e6))
    return rows


# ------------------------------------------------------------------------------------------------------- GEMMs
def _routing(M, frac=0.5):
    mask = torch.rand(M, device=DEV) < frac
    perm, seg = route(mask)
    return mask, perm, seg


def _gathered(x, perm):
    out = torch.empty(perm.shape[0], x.shape[1], device=DEV, dtype=x.dtype)
    return gemm.launch_gather_rows(x, out, perm)


def tune_linear(rep, M=4096, K=4096, N=4096, decode=False):
    rows = []
    dt = torch.bfloat16
    mask, perm, seg = _routing(M)
    w = torch.randn(2, N, K, device=DEV, dtype=dt) / math.sqrt(K)
    sets = _sets(lambda: (_gathered(torch.randn(M, K, device=DEV, dtype=dt), perm), ), 2 * M * K * 2)
    xg = sets[0][0]
    x = torch.empty(M, K, device=DEV, dtype=dt)
    x[perm[perm >= 0].long()] = xg[perm >= 0]
    ref = torch.where(mask[:, None], x.double() @ w[1].double().T, x.double() @ w[0].double().T)
    flops = 2 * M * N * K
    cfgs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
            (128, 128, 128, 8, 3), (128, 256, 128, 8, 2)]
    if decode:
        cfgs = [(128, 256, 64, 8, 3), (128, 64, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
                (64, 64, 64, 4, 6), (64, 32, 128, 4, 4)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bm, bn, bk, nw, ns in cfgs:
        out = torch.full((M, N), float("nan"), device=DEV, dtype=dt)

        def run(a):
            return gemm.launch_routed_linear_tma(a, w, None, None, out, perm, seg, BM=bm, BN=bn, BK=bk,
                                                 num_programs=sms, num_warps=nw, num_stages=ns)
        try:
            err = _rel(run(xg), ref)
            ms = _time(run, sets, rep) if err < 2e-2 else float("nan")
        except Exception as e:  # noqa: BLE001 (out of shared memory, ...)
            err, ms = float("nan"), float("nan")
            print(f"  linear {bm}x{bn}x{bk} w{nw} s{ns}: {type(e).__name__}: {str(e)[:120]}")
        rows.append(dict(op="linear_decode" if decode else "linear", shape=f"M{M} K{K} N{N}",
                         config=f"{bm}x{bn}x{bk},w{nw},s{ns}", ms=ms, err=err, tflops=flops / ms / 1e9,
                         gbps=2 * N * K * 2 / ms / 1e6))
    a = torch.randn(M, K, device=DEV, dtype=dt)
    ms = _time(lambda t: torch.nn.functional.linear(t, w[0]), [(a, )], rep)
    rows.append(dict(op="linear_decode" if decode else "linear", shape=f"M{M} K{K} N{N}", config="cuBLAS 1 GEMM",
                     ms=ms, err=0.0, tflops=flops / ms / 1e9))
    return rows


def tune_swiglu(rep, M=4096, H=4096, I=11008, decode=False):
    rows = []
    dt = torch.bfloat16
    mask, perm, seg = _routing(M)
    w1 = torch.randn(2, I, H, device=DEV, dtype=dt) / math.sqrt(H)
    w3 = torch.randn(2, I, H, device=DEV, dtype=dt) / math.sqrt(H)
    sets = _sets(lambda: (_gathered(torch.randn(M, H, device=DEV, dtype=dt), perm), ), 2 * M * H * 2)
    xg = sets[0][0]
    valid = perm >= 0
    e = (torch.arange(perm.shape[0], device=DEV) >= seg[1]).long()
    xv = xg[valid].double()
    ev = e[valid]
    refs = []
    for ex in (0, 1):
        sel = ev == ex
        gg = xv[sel] @ w1[ex].double().T
        uu = xv[sel] @ w3[ex].double().T
        refs.append((sel, gg * torch.sigmoid(gg) * uu))
    flops = 2 * M * H * I * 2
    cfgs = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (128, 128, 32, 8, 5)]
    if decode:
        cfgs = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 32, 128, 4, 4)]
    for bm, bn, bk, nw, ns in cfgs:
        h = torch.full((perm.shape[0], I), float("nan"), device=DEV, dtype=dt)
        sms = torch.cuda.get_device_properties(0).multi_processor_count

        def run(a):
            return gemm.launch_routed_swiglu_tma(a, w1, w3, h, perm, seg, BM=bm, BN=bn, BK=bk, num_programs=sms,
                                                 num_warps=nw, num_stages=ns)
        try:
            out = run(xg)[valid]
            err = max(_rel(out[sel], r) for sel, r in refs if sel.any())
            ms = _time(run, sets, rep) if err < 2e-2 else float("nan")
        except Exception as ex_:  # noqa: BLE001
            err, ms = float("nan"), float("nan")
            print(f"  swiglu {bm}x{bn}x{bk} w{nw} s{ns}: {type(ex_).__name__}: {str(ex_)[:120]}")
        rows.append(dict(op="swiglu_decode" if decode else "swiglu", shape=f"M{M} H{H} I{I}", config=f"{bm}x{bn}x{bk},w{nw},s{ns}", ms=ms, err=err,
                         tflops=flops / ms / 1e9))
    return rows


def tune_grad_weight(rep, M=4096, N=4096, K=4096):
    rows = []
    dt = torch.bfloat16
    mask, perm, seg = _routing(M)
    sets = _sets(lambda: (_gathered(torch.randn(M, N, device=DEV, dtype=dt), perm),
                          _gathered(torch.randn(M, K, device=DEV, dtype=dt), perm)), 2 * M * (N + K) * 2)
    dyg, xg = sets[0]
    e = (torch.arange(perm.shape[0], device=DEV) >= seg[1])
    ref1 = (dyg.double() * e[:, None]).T @ xg.double()
    flops = 2 * M * N * K
    for bn, bk, br, nw, ns in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                               (256, 128, 64, 8, 3)]:
        dw0 = torch.empty(N, K, device=DEV, dtype=dt)
        dw1 = torch.empty(N, K, device=DEV, dtype=dt)

        def run(dy, x):
            return gemm.launch_routed_grad_weight_tma(dy, x, seg, dw0, dw1, BN=bn, BK=bk, BR=br, num_warps=nw,
                                                      num_stages=ns)
        try:
            err = _rel(run(dyg, xg)[1], ref1)
            ms = _time(run, sets, rep) if err < 2e-2 else float("nan")
        except Exception as ex_:  # noqa: BLE001
            err, ms = float("nan"), float("nan")
            print(f"  grad_weight {bn}x{bk}x{br} w{nw} s{ns}: {type(ex_).__name__}: {str(ex_)[:120]}")
        rows.append(dict(op="grad_weight", shape=f"M{M} N{N} K{K}", config=f"{bn}x{bk}x{br},w{nw},s{ns}", ms=ms,
                         err=err, tflops=flops / ms / 1e9))
    return rows


OPS = {"rope": tune_rope, "linear": tune_linear, "swiglu": tune_swiglu, "grad_weight": tune_grad_weight,
       "decode": lambda rep: tune_linear(rep, M=16, K=11008, N=4096, decode=True) + tune_swiglu(rep, M=16,
                                                                                                    decode=True)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--out", default="tune_results.json")
    p.add_argument("--rep", type=int, default=30)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("aot.tune: needs a CUDA GPU (it times kernels on the local device)")
    results = []
    for op in a.ops.split(","):
        t0 = time.time()
        print(f"[tune] {op} ...", flush=True)
        rows = OPS[op](a.rep)
        results += rows
        for r in rows:
            extra = f"{r['tflops']:7.1f} TFLOP/s" if "tflops" in r else f"{r.get('gbps', 0):7.0f} GB/s"
            print(f"  {r['op']:14s} {r['shape']:20s} {r['config']:28s} {r['ms']:.4f} ms {extra}  err={r['err']:.1e}")
        print(f"[tune] {op}: {time.time() - t0:.0f}s", flush=True)
        with open(a.out, "w") as f:  # after every op: a killed run keeps what it measured
            json.dump({"device": torch.cuda.get_device_name(0), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
