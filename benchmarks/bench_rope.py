#!/usr/bin/env python3
"""RoPE benchmark: torch.ops.fused.rope_* against a device copy, TE's unfused torch formula
(eager and torch.compile) and Liger-Kernel.

    python3 benchmarks/bench_rope.py                 # full run (~1-2 min on an H100, mostly torch.compile)
    python3 benchmarks/bench_rope.py --quick         # fewer reps and sweep points
    python3 benchmarks/bench_rope.py --out DIR       # also write DIR/bench_rope.{json,md} and DIR/rope_sweep.png
    python3 benchmarks/bench_rope.py --seqs 1024,8192 --only main,sweep

Cases (bf16, d=128, freqs fp32 [s_max, 1, 1, 128] as TE builds them, i.e. cat(angles, angles)):
  main   sbhd s=4096 b=2 h=32: fwd and bwd of this library, torch eager, torch.compile, copy
  qk     bshd q [2,4096,32,128] + k [2,4096,8,128]: rope_fwd_qk, two rope_fwd calls, Liger, copy
  thd    128 packed sequences of random uneven lengths, 16384 tokens, h=32: fwd and bwd, copy
  sweep  sbhd fwd, s = 512..16384, b=2 h=32: GB/s of eager, compile, this library, copy

Byte accounting: every implementation of a case is charged the same bytes = input read once +
output written once + the freqs tensor (+ cu_seqlens), so GB/s are comparable within a case.
The copy ceiling moves the same data bytes (read + write, no freqs) with dst.copy_(src).
"time / copy" is the time ratio, "% copy BW" the ratio of the GB/s figures.

Correctness: every timed implementation is run once more on fresh random input (output memory
poisoned with NaN first) and compared with a float64 evaluation of docs/design.md's formula:
err = max|out - ref| / max|ref| must be < 1e-2 (and finite), otherwise its targets FAIL.

Baseline formula ("TE unfused", written from TE's semantics, not copied):
  forward:  cos_ = cos(freqs[:s]).to(t.dtype); sin_ = sin(freqs[:s]).to(t.dtype)   (fp32 -> bf16)
            out  = t * cos_ + rotate_half(t) * sin_,   rotate_half(x) = cat(-x2, x1)
            i.e. cos/sin are computed in fp32 and cast to bf16 on every call, and the products and
            the sum are rounded to bf16 (TE's unfused path); the fused kernel does the math in fp32.
            TE also concatenates an empty pass-through slice when d2 == d; we skip that extra copy
            so the baseline is not penalised.
  backward: the same elementwise ops that autograd runs for that formula, written directly, with
            cos_/sin_ taken as saved (bf16) tensors: dx = g*cos_ + cat(y2, -y1), y = g*sin_.
            (Real eager autograd adds slice-backward zero fills, so eager bwd here is a lower bound.)

Exit codes: 0 all targets PASS, 1 some target FAIL or a case errored, 2 no CUDA / fused_ops missing,
3 interrupted (SIGTERM/SIGINT; partial results are still written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402  (importable without torch)
from common import ERR_TOL, Interrupted, cleanup, die_env, log, on_signal  # noqa: E402

# Must be set before torch/inductor are imported: one in-process compile worker is plenty for the
# handful of pointwise graphs here and avoids starting a subprocess pool.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

TARGET_COPY_TIME = 1.11  # main fwd/bwd: time <= 1.11 x copy time
TARGET_VS_COMPILE = 1.5  # main fwd/bwd: >= 1.5x faster than torch.compile
TARGET_QK_BW = 0.90  # qk: >= 90 % of copy GB/s
TARGET_THD_BW = 0.80  # thd: >= 80 % of copy GB/s

IMPL_FUSED = "fused_ops"
IMPL_EAGER = "torch eager"
IMPL_COMPILE = "torch.compile"
IMPL_COPY = "copy (ceiling)"
IMPL_LIGER = "liger-kernel"
IMPL_FUSED_2X = "fused_ops 2x rope_fwd"
IMPL_FUSED_SYNC = "fused_ops, sync checks"

torch = None  # set in main() after the environment checks
DEV = "cuda"  # every tensor is created here (a CPU dry run of this script's logic may override it)


# =============================================================================== formulas
def make_freqs(max_len: int, d2: int, base: float = 10000.0):
    """TE-style freqs: fp32 [max_len, 1, 1, d2], row p = p * inv_freq duplicated (cat(a, a))."""
    inv = 1.0 / (base ** (torch.arange(0, d2, 2, dtype=torch.float32, device=DEV) / d2))
    ang = torch.outer(torch.arange(max_len, dtype=torch.float32, device=DEV), inv)
    return torch.cat([ang, ang], dim=-1).reshape(max_len, 1, 1, d2).contiguous()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def te_unfused_fwd(t, freqs, tensor_format: str = "sbhd"):
    """TE's unfused forward for sbhd / bshd (see module docstring)."""
    seq_len = t.shape[1] if tensor_format == "bshd" else t.shape[0]
    f = freqs[:seq_len]
    if tensor_format == "bshd":
        f = f.transpose(0, 1)  # [1, s, 1, d2]
    d2 = f.shape[-1]
    x = t[..., :d2]
    cos_ = torch.cos(f).to(t.dtype)
    sin_ = torch.sin(f).to(t.dtype)
    out = x * cos_ + _rotate_half(x) * sin_
    if d2 < t.shape[-1]:
        out = torch.cat((out, t[..., d2:]), dim=-1)
    return out


def te_unfused_bwd(g, cos_, sin_):
    """Gradient of te_unfused_fwd w.r.t. t, given the saved (t.dtype) cos_/sin_."""
    d2 = cos_.shape[-1]
    gr = g[..., :d2]
    y1, y2 = (gr * sin_).chunk(2, dim=-1)
    dx = gr * cos_ + torch.cat((y2, -y1), dim=-1)
    if d2 < g.shape[-1]:
        dx = torch.cat((dx, g[..., d2:]), dim=-1)
    return dx


def _ref_rope64(x, cos, sin, backward: bool):
    """float64 reference of docs/design.md (non-interleaved); cos/sin broadcast against x[..., :d2]."""
    d2 = cos.shape[-1]
    h = d2 // 2
    x1, x2 = x[..., :h], x[..., h:d2]
    c1, c2 = cos[..., :h], cos[..., h:d2]
    s1, s2 = sin[..., :h], sin[..., h:d2]
    if backward:
        o1, o2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        o1, o2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    return torch.cat((o1, o2, x[..., d2:]), dim=-1)


def rel_error(out, x, ang, backward: bool) -> float:
    """max|out - ref| / max|ref| (nan if out has a non-finite value or the wrong shape).

    ``ang``: float64 angles broadcastable to x[..., :d2]; its dim 0 is either 1 or x.shape[0].
    Work is chunked along dim 0 to bound the float64 temporaries.
    """
    if tuple(out.shape) != tuple(x.shape):
        raise RuntimeError(f"output shape {tuple(out.shape)} != input shape {tuple(x.shape)}")
    if out.dtype != x.dtype:
        raise RuntimeError(f"output dtype {out.dtype} != input dtype {x.dtype}")
    n0 = x.shape[0]
    per_row = max(x[0].numel(), 1)
    step = max(1, (1 << 25) // per_row)  # ~256 MiB of float64 per chunk
    max_err, max_ref = 0.0, 0.0
    for i in range(0, n0, step):
        j = min(n0, i + step)
        o = out[i:j]
        if not bool(torch.isfinite(o).all()):
            return float("nan")
        a = ang[i:j] if ang.shape[0] == n0 and n0 > 1 else ang
        ref = _ref_rope64(x[i:j].double(), torch.cos(a), torch.sin(a), backward)
        max_err = max(max_err, float((o.double() - ref).abs().max()))
        max_ref = max(max_ref, float(ref.abs().max()))
        del ref
    return max_err / max(max_ref, 1e-30)


def poison_like(x):
    """Fill a freshly freed block of x's size with NaN so an output that reuses it shows unwritten elements."""
    p = torch.full_like(x, float("nan"))
    del p


def randn(shape, dtype):
    return torch.randn(*shape, device=DEV, dtype=dtype)


# =============================================================================== bookkeeping
class Results:
    def __init__(self):
        self.rows: list[dict] = []
        self.targets: list[dict] = []
        self.errors: list[dict] = []
        self.sweep: dict = {"seqs": [], "gbps": {}, "ms": {}, "err": {}}

    def add(self, **row) -> dict:
        self.rows.append(row)
        return row

    def find(self, case, direction, impl):
        for r in self.rows:
            if r["case"] == case and r["dir"] == direction and r["impl"] == impl:
                return r
        return None

    def error(self, where: str, exc: BaseException) -> str:
        return common.record_error(self.errors, where, exc)


def measure(res: Results, case, direction, impl, fn, arg_sets, nbytes, check=None, opts=None, note=""):
    """Time fn over the rotating arg_sets, then (optionally) check correctness once. Never raises
    except on interruption; failures are recorded in the row."""
    row = res.add(case=case, dir=direction, impl=impl, ms=float("nan"), gbps=float("nan"), bytes=int(nbytes),
                  err=None, ok=None, error=None, note=note)
    if not common.timed_check(row, f"{case}/{direction}/{impl}", res.error, fn, arg_sets, opts.warmup, opts.rep,
                              check):
        return row
    row["gbps"] = common.gbps(nbytes, row["ms"])
    log(f"  {case:5s} {direction} {impl:22s} {row['ms']:.4f} ms  {row['gbps']:.0f} GB/s"
        + (f"  err={row['err']:.2e}" if row["err"] is not None else ""))
    return row


def measure_copy(res: Results, case, direction, data_bytes, opts):
    row = res.add(case=case, dir=direction, impl=IMPL_COPY, ms=float("nan"), gbps=float("nan"),
                  bytes=int(2 * data_bytes), err=None, ok=True, error=None, note="dst.copy_(src) of the same data")
    try:
        ms = common.copy_time_ms(data_bytes, warmup=opts.warmup, rep=opts.rep, dev=DEV)
        row["ms"], row["gbps"] = ms, common.gbps(2 * data_bytes, ms)
    except Interrupted:
        raise
    except Exception as e:  # noqa: BLE001
        row["error"] = res.error(f"{case}/{direction}/copy", e)
        row["ok"] = False
    log(f"  {case:5s} {direction} {IMPL_COPY:22s} {row['ms']:.4f} ms  {row['gbps']:.0f} GB/s")
    return row


def make_compiled(fn, opts, res, label):
    if opts.no_compile:
        return None
    try:
        return torch.compile(fn, dynamic=False)
    except Exception as e:  # noqa: BLE001
        res.error(f"torch.compile({label})", e)
        return None


# =============================================================================== cases
def case_main(res: Results, opts, compiled):
    s, b, h, d = 4096, 2, 32, 128
    dt = torch.bfloat16
    log(f"[main] sbhd s={s} b={b} h={h} d={d} bf16")
    freqs = make_freqs(s, d)
    ang = freqs[:s].double()  # [s,1,1,d]
    shape = (s, b, h, d)
    data_bytes = math.prod(shape) * 2
    nbytes = 2 * data_bytes + freqs.numel() * 4
    nsets = common.rotation_count(2 * data_bytes)
    xs = [(randn(shape, dt),) for _ in range(nsets)]
    fused_fwd = lambda x: torch.ops.fused.rope_fwd(x, freqs, tensor_format="sbhd")
    fused_bwd = lambda g: torch.ops.fused.rope_bwd(g, freqs, tensor_format="sbhd")
    eager_fwd = lambda x: te_unfused_fwd(x, freqs, "sbhd")
    cos_ = torch.cos(freqs[:s]).to(dt)
    sin_ = torch.sin(freqs[:s]).to(dt)
    eager_bwd = lambda g: te_unfused_bwd(g, cos_, sin_)

    def checker(fn, backward):
        def run():
            x = randn(shape, dt)
            poison_like(x)
            return rel_error(fn(x), x, ang, backward)
        return run

    for direction, impls in (
        ("fwd", [(IMPL_FUSED, fused_fwd), (IMPL_EAGER, eager_fwd),
                 (IMPL_COMPILE, (lambda x: compiled["fwd"](x, freqs, "sbhd")) if compiled.get("fwd") else None)]),
        ("bwd", [(IMPL_FUSED, fused_bwd), (IMPL_EAGER, eager_bwd),
                 (IMPL_COMPILE, (lambda g: compiled["bwd"](g, cos_, sin_)) if compiled.get("bwd") else None)]),
    ):
        for impl, fn in impls:
            if fn is None:
                res.add(case="main", dir=direction, impl=impl, ms=float("nan"), gbps=float("nan"), bytes=nbytes,
                        err=None, ok=None, error=None, note="skipped (--no-compile or torch.compile unavailable)")
                continue
            measure(res, "main", direction, impl, fn, xs, nbytes, check=checker(fn, direction == "bwd"), opts=opts)
        measure_copy(res, "main", direction, data_bytes, opts)
    del xs
    cleanup()


def _load_liger():
    """LigerRopeFunction, or (None, reason). Falls back to loading ops/rope.py alone (it needs only
    torch + triton) if the package's __init__ fails to import on this torch/triton."""
    try:
        from liger_kernel.ops.rope import LigerRopeFunction  # type: ignore
        return LigerRopeFunction, None
    except Exception as e:  # noqa: BLE001
        first = f"{type(e).__name__}: {e}"
    try:
        import importlib.util

        spec = importlib.util.find_spec("liger_kernel")
        if spec is None or not spec.submodule_search_locations:
            return None, first
        path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "rope.py")
        if not os.path.exists(path):
            return None, first
        mspec = importlib.util.spec_from_file_location("_liger_rope_standalone", path)
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
        log(f"  (liger_kernel package import failed: {first}; loaded {path} directly)")
        return mod.LigerRopeFunction, None
    except Exception as e:  # noqa: BLE001
        return None, f"{first}; standalone load: {type(e).__name__}: {e}"


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def _liger_version():
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:  # noqa: BLE001
        return None


def case_qk(res: Results, opts):
    b, s, hq, hk, d = 2, 4096, 32, 8, 128
    dt = torch.bfloat16
    log(f"[qk] bshd q [{b},{s},{hq},{d}] k [{b},{s},{hk},{d}] bf16")
    freqs = make_freqs(s, d)
    ang = freqs[:s].double().transpose(0, 1)  # [1,s,1,d]
    qs, ks = (b, s, hq, d), (b, s, hk, d)
    data_bytes = (math.prod(qs) + math.prod(ks)) * 2
    nbytes = 2 * data_bytes + freqs.numel() * 4
    nsets = common.rotation_count(2 * data_bytes)
    sets = [(randn(qs, dt), randn(ks, dt)) for _ in range(nsets)]

    def chk(fn):
        def run():
            q, k = randn(qs, dt), randn(ks, dt)
            qc, kc = q.clone(), k.clone()  # Liger works in place
            p1, p2 = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
            del p1, p2  # poison the blocks the outputs will likely reuse
            oq, ok_ = fn(qc, kc)
            return max(rel_error(oq, q, ang, False), rel_error(ok_, k, ang, False))
        return run

    fused_qk = lambda q, k: torch.ops.fused.rope_fwd_qk(q, k, freqs, tensor_format="bshd")
    fused_2x = lambda q, k: (torch.ops.fused.rope_fwd(q, freqs, tensor_format="bshd"),
                             torch.ops.fused.rope_fwd(k, freqs, tensor_format="bshd"))
    r_f = measure(res, "qk", "fwd", IMPL_FUSED, fused_qk, sets, nbytes, check=chk(fused_qk), opts=opts,
                  note="rope_fwd_qk, one launch")
    measure(res, "qk", "fwd", IMPL_FUSED_2X, fused_2x, sets, nbytes, check=chk(fused_2x), opts=opts,
            note="info: q and k as two ops")

    if opts.no_liger:
        log("  liger-kernel skipped (--no-liger)")
    else:
        Liger, why = _load_liger()
        if Liger is None:
            log(f"  liger-kernel not available ({why})")
            res.add(case="qk", dir="fwd", impl=IMPL_LIGER, ms=float("nan"), gbps=float("nan"), bytes=nbytes,
                    err=None, ok=None, error=None, note="liger-kernel not available")
        else:
            # Liger wants q [b,h,s,d], k [b,hk,s,d], cos/sin [1,s,rotary_dim] (full width, HF layout).
            # Passing our bshd tensors as transpose(1,2) *views* makes Liger's internal transpose back
            # contiguous, so it rotates our bshd storage in place with no extra copy -- the same
            # bytes as ours (read q,k + write q,k). cos/sin are fp32 so its math is fp32 like ours.
            cos_l = torch.cos(freqs[:s, 0, 0, :]).unsqueeze(0).contiguous()
            sin_l = torch.sin(freqs[:s, 0, 0, :]).unsqueeze(0).contiguous()

            def liger_fn(q, k):
                oq, ok_ = Liger.apply(q.transpose(1, 2), k.transpose(1, 2), cos_l, sin_l)
                return oq.transpose(1, 2), ok_.transpose(1, 2)

            r_l = measure(res, "qk", "fwd", IMPL_LIGER, liger_fn, sets, nbytes, check=chk(liger_fn), opts=opts,
                          note=f"LigerRopeFunction {_liger_version() or ''}, in place, precomputed fp32 cos/sin")
            if r_f["ms"] == r_f["ms"] and r_l["ms"] == r_l["ms"]:
                r_f["note"] += f"; {r_l['ms'] / r_f['ms']:.2f}x vs Liger"
    measure_copy(res, "qk", "fwd", data_bytes, opts)
    del sets
    cleanup()


def make_thd_lengths(n_seq: int, total: int, seed: int = 0):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), n_seq - 1))
    bounds = [0] + cuts + [total]
    return [bounds[i + 1] - bounds[i] for i in range(n_seq)]


def case_thd(res: Results, opts):
    n_seq, total, h, d = 128, 16384, 32, 128
    dt = torch.bfloat16
    lens = make_thd_lengths(n_seq, total)
    max_len = max(lens)
    log(f"[thd] {n_seq} sequences, {total} tokens (len min {min(lens)} / max {max_len}), h={h} d={d} bf16")
    cu_list = [0]
    for L in lens:
        cu_list.append(cu_list[-1] + L)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEV)
    freqs = make_freqs(max_len, d)
    starts = torch.tensor(cu_list[:-1], dtype=torch.long, device=DEV)
    lens_t = torch.tensor(lens, dtype=torch.long, device=DEV)
    pos = torch.arange(total, device=DEV) - torch.repeat_interleave(starts, lens_t)
    ang = freqs.double()[pos, 0]  # [T, 1, d]
    shape = (total, h, d)
    data_bytes = math.prod(shape) * 2
    nbytes = 2 * data_bytes + freqs.numel() * 4 + cu.numel() * 4
    nsets = common.rotation_count(2 * data_bytes)
    xs = [(randn(shape, dt),) for _ in range(nsets)]
    fwd = lambda x: torch.ops.fused.rope_fwd(x, freqs, tensor_format="thd", cu_seqlens=cu)
    bwd = lambda g: torch.ops.fused.rope_bwd(g, freqs, tensor_format="thd", cu_seqlens=cu)

    def chk(fn, backward):
        def run():
            x = randn(shape, dt)
            poison_like(x)
            return rel_error(fn(x), x, ang, backward)
        return run

    # fused_ops validates cu_seqlens on the host by default (a device->host copy + sync per call). Kernel
    # throughput is measured with those checks off (what a training loop would run once inputs are trusted);
    # one info row shows the cost with them on.
    prev = _set_sync_checks(False)
    try:
        for direction, fn in (("fwd", fwd), ("bwd", bwd)):
            measure(res, "thd", direction, IMPL_FUSED, fn, xs, nbytes, check=chk(fn, direction == "bwd"), opts=opts,
                    note="sync checks off" if prev is not None else "")
            if direction == "fwd" and prev is not None:
                _set_sync_checks(True)
                measure(res, "thd", "fwd", IMPL_FUSED_SYNC, fwd, xs, nbytes, check=None, opts=opts,
                        note="info: cu_seqlens host checks on (default): includes the host sync")
                _set_sync_checks(False)
            measure_copy(res, "thd", direction, data_bytes, opts)
    finally:
        if prev is not None:
            _set_sync_checks(prev)
    del xs
    cleanup()


def _set_sync_checks(enabled: bool):
    """fused_ops' switch for input checks that sync with the device; returns the previous value, or None
    if this build has no such switch."""
    try:
        return bool(torch.ops.fused.set_sync_checks(enabled))
    except Exception:  # noqa: BLE001
        return None


def case_sweep(res: Results, opts, compiled, t_start):
    b, h, d = 2, 32, 128
    dt = torch.bfloat16
    log(f"[sweep] sbhd fwd b={b} h={h} d={d} bf16, s in {opts.seqs}")
    sw = res.sweep
    impls = [IMPL_EAGER, IMPL_COMPILE, IMPL_FUSED, IMPL_COPY]
    for k in ("gbps", "ms", "err"):
        for impl in impls:
            sw[k].setdefault(impl, [])
    for s in opts.seqs:
        if time.monotonic() - t_start > opts.budget_s:
            log(f"  sweep: time budget ({opts.budget_s:.0f} s) spent, skipping s={s} and beyond")
            sw.setdefault("skipped", []).extend([x for x in opts.seqs if x >= s])
            break
        freqs = make_freqs(s, d)
        ang = freqs.double()
        shape = (s, b, h, d)
        data_bytes = math.prod(shape) * 2
        nbytes = 2 * data_bytes + freqs.numel() * 4
        nsets = common.rotation_count(2 * data_bytes)
        try:
            xs = [(randn(shape, dt),) for _ in range(nsets)]
        except Exception as e:  # noqa: BLE001 (e.g. out of memory)
            res.error(f"sweep s={s} alloc", e)
            continue
        fns = {
            IMPL_EAGER: lambda x: te_unfused_fwd(x, freqs, "sbhd"),
            IMPL_COMPILE: (lambda x: compiled["fwd"](x, freqs, "sbhd")) if compiled.get("fwd") else None,
            IMPL_FUSED: lambda x: torch.ops.fused.rope_fwd(x, freqs, tensor_format="sbhd"),
        }
        sw["seqs"].append(s)
        case = f"sweep{s}"
        for impl in impls:
            if impl == IMPL_COPY:
                r = measure_copy(res, case, "fwd", data_bytes, opts)
            elif fns[impl] is None:
                sw["gbps"][impl].append(None)
                sw["ms"][impl].append(None)
                sw["err"][impl].append(None)
                continue
            else:
                fn = fns[impl]

                def chk(fn=fn):
                    x = randn(shape, dt)
                    poison_like(x)
                    return rel_error(fn(x), x, ang, False)

                r = measure(res, case, "fwd", impl, fn, xs, nbytes, check=chk, opts=opts)
            ok_num = r["ok"] is not False and r["ms"] == r["ms"]
            sw["gbps"][impl].append(r["gbps"] if ok_num else None)
            sw["ms"][impl].append(r["ms"] if ok_num else None)
            sw["err"][impl].append(r["err"])
        del xs
        cleanup()


# =============================================================================== reporting
def derive(res: Results):
    """Fill time/copy, % copy BW and speedup-vs-compile columns."""
    for r in res.rows:
        copy = res.find(r["case"], r["dir"], IMPL_COPY)
        comp = res.find(r["case"], r["dir"], IMPL_COMPILE) if r["impl"] != IMPL_COPY else None
        r["x_copy_time"] = r["ms"] / copy["ms"] if copy and copy["ms"] == copy["ms"] and r["ms"] == r["ms"] else float("nan")
        r["pct_copy_bw"] = (100.0 * r["gbps"] / copy["gbps"]
                            if copy and copy["gbps"] == copy["gbps"] and r["gbps"] == r["gbps"] else float("nan"))
        r["speedup_vs_compile"] = (comp["ms"] / r["ms"]
                                   if comp and comp["ms"] == comp["ms"] and r["ms"] == r["ms"] else float("nan"))
        if (r["impl"] != IMPL_COPY and r["pct_copy_bw"] == r["pct_copy_bw"] and r["pct_copy_bw"] > 125.0):
            r["note"] = (r.get("note") or "") + " SUSPICIOUS: >25% above copy bandwidth (wrong stream? no work?)"


def _target(res: Results, opts, name, case, direction, metric, thr, cmp, unit_fmt):
    r = res.find(case, direction, IMPL_FUSED)
    t = {"name": name, "case": case, "dir": direction, "threshold": thr, "value": None, "status": "FAIL", "why": ""}
    if r is None:
        if case in opts.only:
            t["why"] = "not measured (case failed or was interrupted)"
        else:
            t["status"], t["why"] = "N/A", "case not selected (--only)"
    elif r.get("error"):
        t["why"] = f"error: {r['error']}"
    else:
        v = r.get(metric)
        t["value"] = v
        if v is None or v != v:
            t["why"] = "no measurement (baseline missing?)"
            if metric == "speedup_vs_compile":
                t["status"] = "N/A"
        elif r.get("ok") is not True:
            t["why"] = "output wrong (err=" + (f"{r['err']:.3g}" if r.get("err") is not None else "n/a") + ")"
        elif cmp(v, thr):
            t["status"] = "PASS"
        t["shown"] = unit_fmt(v) if v is not None and v == v else "n/a"
    res.targets.append(t)


def evaluate_targets(res: Results, opts):
    le, ge = (lambda v, t: v <= t), (lambda v, t: v >= t)
    xf = lambda v: f"{v:.3f}x copy time"
    sf = lambda v: f"{v:.2f}x faster"
    pf = lambda v: f"{v:.1f}% of copy BW"
    _target(res, opts, f"main fwd time <= {TARGET_COPY_TIME}x copy", "main", "fwd", "x_copy_time", TARGET_COPY_TIME, le, xf)
    _target(res, opts, f"main bwd time <= {TARGET_COPY_TIME}x copy", "main", "bwd", "x_copy_time", TARGET_COPY_TIME, le, xf)
    _target(res, opts, f"main fwd >= {TARGET_VS_COMPILE}x faster than torch.compile", "main", "fwd", "speedup_vs_compile",
            TARGET_VS_COMPILE, ge, sf)
    _target(res, opts, f"main bwd >= {TARGET_VS_COMPILE}x faster than torch.compile", "main", "bwd", "speedup_vs_compile",
            TARGET_VS_COMPILE, ge, sf)
    _target(res, opts, f"qk fwd >= {TARGET_QK_BW:.0%} of copy bandwidth", "qk", "fwd", "pct_copy_bw", 100 * TARGET_QK_BW, ge, pf)
    _target(res, opts, f"thd fwd >= {TARGET_THD_BW:.0%} of copy bandwidth", "thd", "fwd", "pct_copy_bw", 100 * TARGET_THD_BW,
            ge, pf)


def render_markdown(res: Results, meta: dict) -> str:
    lines = [f"# RoPE benchmark on {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, liger-kernel {meta.get('liger') or 'n/a'}, "
             f"L2 {meta['l2_bytes'] / 2**20:.0f} MiB, warmup {meta['warmup']}, rep {meta['rep']} (median of CUDA-event "
             f"times, inputs rotated past 2x L2); GB/s = (input + output + freqs bytes) / time; copy = read + write.", ""]
    headers = ["case", "dir", "impl", "ms", "GB/s", "time / copy", "% copy BW", "speedup vs compile", "max err", "note"]
    rows = []
    for r in res.rows:
        if r["case"].startswith("sweep"):
            continue
        note = r.get("note") or ""
        if r.get("error"):
            e = r["error"] if len(r["error"]) <= 120 else r["error"][:117] + "..."
            note = (note + " ERROR: " + e).strip()
        err = r.get("err")
        rows.append([r["case"], r["dir"], r["impl"], r["ms"], r["gbps"], r.get("x_copy_time"), r.get("pct_copy_bw"),
                     r.get("speedup_vs_compile"),
                     (f"{err:.1e}" + ("" if r.get("ok") else " WRONG")) if err is not None else "-", note])
    lines.append(common.format_table(headers, rows,
                                     [None, None, None, ".4f", ".0f", ".3f", ".1f", ".2f", None, None]))
    sw = res.sweep
    if sw["seqs"]:
        lines += ["", "Sweep, sbhd fwd b=2 h=32 d=128 bf16 (GB/s):", ""]
        impls = [k for k in (IMPL_EAGER, IMPL_COMPILE, IMPL_FUSED, IMPL_COPY) if k in sw["gbps"]]
        srows = []
        for i, s in enumerate(sw["seqs"]):
            row = [s]
            for k in impls:
                v = sw["gbps"][k][i] if i < len(sw["gbps"][k]) else None
                row.append(float(v) if v is not None else None)
            srows.append(row)
        lines.append(common.format_table(["s"] + impls, srows, [None] + [".0f"] * len(impls)))
    lines += ["", f"Targets ({meta['device']}):", ""]
    for t in res.targets:
        lines.append(f"- {t['status']}: {t['name']}: {t.get('shown', 'n/a')}" + (f" ({t['why']})" if t["why"] else ""))
    if res.errors:
        lines += ["", "Errors:", ""] + [f"- {e['where']}: {e['error']}" for e in res.errors]
    if meta.get("interrupted"):
        lines += ["", f"INTERRUPTED: {meta['interrupted']} (partial results)"]
    return "\n".join(lines) + "\n"


def _clean(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def save_plot(res: Results, meta: dict, path: str) -> None:
    sw = res.sweep
    if not sw["seqs"]:
        log("  no sweep data, no plot")
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        log(f"  matplotlib not available ({e}); no plot")
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    style = {IMPL_EAGER: ("o-", "tab:orange"), IMPL_COMPILE: ("s-", "tab:green"), IMPL_FUSED: ("^-", "tab:blue"),
             IMPL_COPY: ("k--", None)}
    for impl, ys in sw["gbps"].items():
        pts = [(s, y) for s, y in zip(sw["seqs"], ys) if y is not None]
        if not pts:
            continue
        fmt, color = style.get(impl, ("x-", None))
        kw = {"color": color} if color else {}
        ax.plot([p[0] for p in pts], [p[1] for p in pts], fmt, label=impl, **kw)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sw["seqs"])
    ax.set_xticklabels([str(s) for s in sw["seqs"]])
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("GB/s (read input + write output + freqs)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"RoPE fwd, sbhd b=2 h=32 d=128 bf16\n{meta['device']}", fontsize=10)
    ax.legend(loc="best", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"  wrote {path}")


# =============================================================================== main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="warmup 5 / rep 20 and sweep 1024,4096,16384")
    p.add_argument("--out", metavar="DIR", help="write bench_rope.json, bench_rope.md, rope_sweep.png here")
    p.add_argument("--seqs", nargs="+", metavar="S", help="sweep sequence lengths (space or comma separated)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per measurement (default 10, quick 5)")
    p.add_argument("--rep", type=int, default=None, help="timed calls per measurement (default 50, quick 20)")
    p.add_argument("--only", default="main,qk,thd,sweep", help="comma list of cases: main,qk,thd,sweep")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="wall-clock seconds after which remaining sweep points are skipped (default 300)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    p.add_argument("--no-liger", action="store_true", help="skip Liger-Kernel")
    a = p.parse_args(argv)
    a.warmup = a.warmup if a.warmup is not None else (5 if a.quick else 10)
    a.rep = a.rep if a.rep is not None else (20 if a.quick else 50)
    if a.seqs:
        seqs = []
        for tok in a.seqs:
            seqs += [int(x) for x in tok.replace(",", " ").split() if x]
        a.seqs = sorted(set(seqs))
    else:
        a.seqs = [1024, 4096, 16384] if a.quick else [512, 1024, 2048, 4096, 8192, 16384]
    a.only = {c.strip() for c in a.only.split(",") if c.strip()}
    bad = a.only - {"main", "qk", "thd", "sweep"}
    if bad:
        p.error(f"unknown case(s) in --only: {', '.join(sorted(bad))}")
    if a.warmup < 1 or a.rep < 1:
        p.error("--warmup and --rep must be >= 1")
    return a


def main(argv=None) -> int:
    global torch
    opts = parse_args(argv)
    t_start = time.monotonic()

    try:
        import torch as _torch
    except Exception as e:  # noqa: BLE001
        die_env("bench_rope", f"torch is not importable ({type(e).__name__}: {e})")
    torch = _torch
    if not torch.cuda.is_available():
        die_env("bench_rope", "CUDA is not available (torch.cuda.is_available() is False); run this on the GPU machine")
    try:
        import fused_ops  # noqa: F401  (loads the library and registers torch.ops.fused.*)
    except Exception as e:  # noqa: BLE001
        die_env("bench_rope", f"`import fused_ops` failed ({type(e).__name__}: {e}); build and install the package first "
                "(python3 -m pip install --no-build-isolation --no-deps .)")
    missing = []
    for op in ("rope_fwd", "rope_bwd", "rope_fwd_qk"):
        try:
            getattr(torch.ops.fused, op)
        except Exception:  # noqa: BLE001
            missing.append(op)
    if "rope_fwd" in missing:
        die_env("bench_rope", f"torch.ops.fused.rope_fwd is not registered after `import fused_ops` (missing: {', '.join(missing)})")
    if missing:
        log(f"warning: missing ops {', '.join(missing)}; their cases will be reported as errors")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        import triton

        triton_v = triton.__version__
    except Exception:  # noqa: BLE001
        triton_v = "n/a"
    try:
        import torch._dynamo as dynamo

        for name in ("recompile_limit", "cache_size_limit"):  # one specialisation per sweep shape
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(int(getattr(dynamo.config, name)), 64))
    except Exception:  # noqa: BLE001
        pass

    torch.manual_seed(0)
    meta = {
        "device": common.device_name(),
        "torch": torch.__version__,
        "triton": triton_v,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "fused_ops": getattr(sys.modules.get("fused_ops"), "__version__", None),
        "fused_ops_archs": _try(lambda: str(torch.ops.fused.built_archs())),
        "fused_ops_lib": _try(lambda: sys.modules["fused_ops"].library_path),
        "liger": _liger_version(),
        "l2_bytes": common.l2_cache_bytes(),
        "warmup": opts.warmup,
        "rep": opts.rep,
        "seqs": opts.seqs,
        "cases": sorted(opts.only),
        "err_tol": ERR_TOL,
        "interrupted": None,
    }
    log(f"device: {meta['device']}  torch {meta['torch']}  triton {triton_v}  CUDA {meta['cuda']}  "
        f"L2 {meta['l2_bytes'] / 2**20:.0f} MiB  warmup {opts.warmup} rep {opts.rep}  "
        f"fused_ops archs {meta['fused_ops_archs']}")

    res = Results()
    res_compiled = {"fwd": make_compiled(te_unfused_fwd, opts, res, "fwd"),
                    "bwd": make_compiled(te_unfused_bwd, opts, res, "bwd")}
    try:
        for name, run in (("main", lambda: case_main(res, opts, res_compiled)),
                          ("qk", lambda: case_qk(res, opts)),
                          ("thd", lambda: case_thd(res, opts)),
                          ("sweep", lambda: case_sweep(res, opts, res_compiled, t_start))):
            if name not in opts.only:
                continue
            t0 = time.monotonic()
            try:
                run()
            except Interrupted:
                raise
            except Exception as e:  # noqa: BLE001
                res.error(f"case {name}", e)
                try:
                    cleanup()
                except Exception:  # noqa: BLE001
                    pass
            log(f"  ({name}: {time.monotonic() - t0:.1f} s)")
    except Interrupted as e:
        meta["interrupted"] = str(e)
        log(f"interrupted ({e}); writing partial results")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    derive(res)
    evaluate_targets(res, opts)
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    md = render_markdown(res, meta)
    print("\n" + md, flush=True)

    if opts.out:
        try:
            os.makedirs(opts.out, exist_ok=True)
            with open(os.path.join(opts.out, "bench_rope.md"), "w") as f:
                f.write(md)
            with open(os.path.join(opts.out, "bench_rope.json"), "w") as f:
                json.dump(_clean({"meta": meta, "rows": res.rows, "targets": res.targets, "sweep": res.sweep,
                                  "errors": res.errors}), f, indent=1)
            log(f"  wrote {os.path.join(opts.out, 'bench_rope.json')} and bench_rope.md")
            save_plot(res, meta, os.path.join(opts.out, "rope_sweep.png"))
        except Exception as e:  # noqa: BLE001
            log(f"  could not write outputs to {opts.out}: {type(e).__name__}: {e}")

    n_fail = sum(t["status"] == "FAIL" for t in res.targets)
    log(f"bench_rope: {sum(t['status'] == 'PASS' for t in res.targets)} PASS, {n_fail} FAIL, "
        f"{sum(t['status'] == 'N/A' for t in res.targets)} N/A, {len(res.errors)} errors, {meta['elapsed_s']} s")
    if meta["interrupted"]:
        return 3
    return 1 if (n_fail or res.errors) else 0


if __name__ == "__main__":
    sys.exit(main())
