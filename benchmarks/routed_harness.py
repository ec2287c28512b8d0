"""What the routed benchmarks (bench_linear_dual.py, bench_ffn.py) share: result bookkeeping with PASS/FAIL targets,
one timed-and-checked measurement per implementation, and the small helpers around it.

Torch is imported inside the functions: a benchmark imports this module before it knows whether torch (and CUDA) is
there, and says SKIPPED when it is not.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time

import common
from common import ERR_TOL, Interrupted, cleanup, die_env, log, on_signal  # noqa: F401  (re-exported to the benchmarks)

class Results:
    def __init__(self):
        self.rows: list[dict] = []
        self.targets: list[dict] = []
        self.errors: list[dict] = []

    def add_row(self, **row) -> dict:
        self.rows.append(row)
        return row

    def error(self, where: str, exc: BaseException) -> str:
        return common.record_error(self.errors, where, exc)

    def target(self, name: str, value, thr: float, le: bool, unit: str, rows=(), status=None, why="") -> None:
        """Records and prints one target; FAIL when a row it depends on errored or produced a wrong output.
        status / why: a fixed outcome (e.g. "N/A" for a case switched off) and its reason."""
        t = {"name": name, "value": value, "threshold": thr, "cmp": "<=" if le else ">=", "status": "FAIL",
             "why": why}
        bad = [r for r in rows if r is None or r.get("error") or r.get("ok") is False]
        if status is not None:
            t["status"] = status
        elif bad:
            t["why"] = "; ".join("not measured" if r is None else
                                 (f"{r['impl']}: error" if r.get("error") else f"{r['impl']}: wrong output")
                                 for r in bad)
        elif value is None or value != value:
            t["why"] = t["why"] or "no measurement"
        elif (value <= thr) if le else (value >= thr):
            t["status"] = "PASS"
        t["shown"] = f"{value:.3f}{unit}" if value is not None and value == value else "n/a"
        self.targets.append(t)
        log(f"- {t['status']}: {name}: {t['shown']} ({t['cmp']} {thr}{unit})" + (f" ({t['why']})" if t["why"] else ""))


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (nan if out has a non-finite value; an error for the wrong shape)."""
    import torch
    if tuple(out.shape) != tuple(ref.shape):
        raise RuntimeError(f"output shape {tuple(out.shape)} != expected {tuple(ref.shape)}")
    o = out.double()
    if not bool(torch.isfinite(o).all()):
        return float("nan")
    den = float(ref.norm())
    return float((o - ref).norm()) / den if den > 0 else float(o.norm())


def rel_errs(outs, refs) -> float:
    """Largest rel_err over paired outputs; a zero reference (an expert without tokens) demands exact zeros. An output
    that is None (not asked for) is skipped."""
    errs = []
    for o, r in zip(outs, refs):
        if o is None:
            continue
        if float(r.norm()) == 0:
            errs.append(0.0 if not bool(o.any()) else float("inf"))
        else:
            errs.append(rel_err(o, r))
    return max(errs)


def ratio(a: dict, b: dict) -> float:
    """a's time / b's time (nan when either is missing)."""
    return a["ms"] / b["ms"] if a and b and a["ms"] == a["ms"] and b["ms"] == b["ms"] and b["ms"] > 0 else float("nan")


PAIRS_PER_REP = 5  # paired_ratio times 5 x opts.rep pairs (100 by default)


def paired_ratio(res: Results, opts, label, fn, ref_fn, arg_sets) -> tuple:
    """The ratio a target reports: fn's time / ref_fn's, the median over pairs of calls timed back to back
    (common.bench_pair, 5 x opts.rep pairs after opts.warmup). A sustained load heats the device and moves its clock
    (an H100 loses up to ~10% of its matrix rate over a run, and its clock also moves on the scale of tens of ms), so
    two medians taken apart, the reference first, also measure the drift between them; the two calls of a pair see the
    same clock. Returns (ratio, first quartile, third quartile of the per-pair ratios), nan on a failure (recorded as
    an error). Both functions have been timed and checked by measure() before."""
    import statistics
    try:
        pairs = common.bench_pair(fn, ref_fn, args=arg_sets, warmup=opts.warmup, rep=PAIRS_PER_REP * opts.rep)
    except Interrupted:
        raise
    except Exception as e:  # noqa: BLE001
        res.error(f"{label} paired timing", e)
        nan = float("nan")
        return nan, nan, nan
    r = [a / b for a, b in pairs]
    q1, _, q3 = statistics.quantiles(r, n=4)
    return statistics.median(r), q1, q3


def paired_note(seq: float, paired: tuple) -> str:
    """How a target's paired ratio came about, next to the ratio of the table's two medians (`seq`)."""
    return (f"median of {PAIRS_PER_REP}x rep back-to-back pairs, quartiles {paired[1]:.3f}-{paired[2]:.3f}; "
            f"the table's medians give {seq:.3f}")


def measure(res: Results, opts, case, impl, fn, arg_sets, flops, check=None, note="", wbytes=None, best_of=1):
    """Times fn over the rotating arg_sets (common.bench: median of CUDA-event times after opts.warmup calls, over
    opts.rep calls), then checks it once (check() returns its relative error). Never raises except on interruption.
    best_of: the median is taken that many times and the lowest kept. The references a target divides by use 2: a
    disturbance only ever slows a run down, and a slowed reference would turn a miss into a PASS (seen once: the
    linear_dual backward's cuBLAS reference at 0.576 ms instead of its usual 0.355)."""
    row = res.add_row(case=case, impl=impl, ms=float("nan"), tflops=float("nan"), gbps=float("nan"), err=None,
                      ok=None, error=None, note=note)
    if not common.timed_check(row, f"{case}/{impl}", res.error, fn, arg_sets, opts.warmup, opts.rep, check, best_of):
        return row
    ms = row["ms"]
    row["tflops"] = flops / (ms * 1e-3) / 1e12 if flops else float("nan")
    if wbytes:
        row["gbps"] = common.gbps(wbytes, ms)
    log(f"  {case:16s} {impl:16s} {row['ms']:.4f} ms  {row['tflops']:6.1f} TFLOP/s"
        + (f"  {row['gbps']:.0f} GB/s weights" if wbytes else "")
        + (f"  err={row['err']:.1e}" if row["err"] is not None else ""))
    return row


IMPL_NOPDL = "fused_ops PDL off"


def measure_pdl_off(res: Results, opts, case, fn, arg_sets, flops, **kw):
    """The fused op again with programmatic dependent launch off (information: what PDL saves; no target)."""
    with common.programmatic_launch(False):
        return measure(res, opts, case, IMPL_NOPDL, fn, arg_sets, flops, note="info: launch without PDL", **kw)


def poisoned_call(fn, *args, out_bytes=0):
    """fn(*args) after leaving a NaN block of out_bytes in the current device's allocator (an unwritten output
    shows NaN)."""
    import torch
    if out_bytes:
        p = torch.full((out_bytes // 4 + 1,), float("nan"), dtype=torch.float32, device="cuda")
        del p
    return fn(*args)


def json_clean(o):
    """o with non-finite floats as None (strict JSON)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): json_clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_clean(v) for v in o]
    return o


# =============================================================================== the main() of a routed benchmark
def open_device(name: str, ops):
    """(torch, torch.nn.functional, the current CUDA device) once torch imports, CUDA is there and `import fused_ops`
    registered torch.ops.fused.<op> for every op in `ops`; otherwise prints SKIPPED and exits 2."""
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001
        die_env(name, f"torch is not importable ({type(e).__name__}: {e})")
    if not torch.cuda.is_available():
        die_env(name, "CUDA is not available (torch.cuda.is_available() is False); run this on the GPU machine")
    try:
        import fused_ops  # noqa: F401  (loads the library and registers torch.ops.fused.*)
    except Exception as e:  # noqa: BLE001
        die_env(name, f"`import fused_ops` failed ({type(e).__name__}: {e}); build and install the package first "
                "(python3 -m pip install --no-build-isolation --no-deps .)")
    missing = [op for op in ops if not hasattr(torch.ops.fused, op)]
    if missing:
        die_env(name, f"torch.ops.fused.{', '.join(missing)} not registered after `import fused_ops` (older build?)")
    return torch, F, torch.device("cuda", torch.cuda.current_device())


def run_cases(name: str, opts, dev, cases, setup=None) -> tuple:
    """Runs `cases` ((case name, thunk) in order; those not in opts.only are skipped) after `setup()`, each guarded:
    an error is recorded and the next case runs; SIGTERM / SIGINT end the run with what was measured.
    Returns (Results, meta)."""
    import torch
    t_start = time.monotonic()
    torch.manual_seed(0)
    meta = {"device": common.device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
            "l2_bytes": common.l2_cache_bytes(dev), "warmup": opts.warmup, "rep": opts.rep,
            "cases": sorted(opts.only), "err_tol": ERR_TOL, "interrupted": None}
    log(f"{name}: device {meta['device']}  torch {meta['torch']}  CUDA {meta['cuda']}  "
        f"L2 {meta['l2_bytes'] / 2**20:.0f} MiB  warmup {opts.warmup} rep {opts.rep}")
    res = Results()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if setup is not None:
            t0 = time.monotonic()
            setup()
            log(f"  (setup: {time.monotonic() - t0:.1f} s)")
        for case, run in cases:
            if case not in opts.only:
                continue
            t0 = time.monotonic()
            try:
                run(res)
            except Interrupted:
                raise
            except Exception as e:  # noqa: BLE001
                res.error(f"case {case}", e)
                try:
                    cleanup()
                except Exception:  # noqa: BLE001
                    pass
            log(f"  ({case}: {time.monotonic() - t0:.1f} s)")
    except Interrupted as e:
        meta["interrupted"] = str(e)
        log(f"interrupted ({e}); reporting partial results")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    return res, meta


def finish(name: str, res: Results, meta: dict, md: str, out_dir=None) -> int:
    """Prints the report `md`, writes <out_dir>/<name>.{md,json} when asked, and returns the exit code: 0 every
    target PASS, 1 a target FAILed or a case errored, 3 interrupted."""
    print("\n" + md, flush=True)
    if out_dir:
        try:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
                f.write(md)
            with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                json.dump(json_clean({"meta": meta, "rows": res.rows, "targets": res.targets, "errors": res.errors}), f,
                          indent=1)
        except Exception as e:  # noqa: BLE001
            log(f"  could not write outputs to {out_dir}: {type(e).__name__}: {e}")
    count = {s: sum(t["status"] == s for t in res.targets) for s in ("PASS", "FAIL", "N/A")}
    log(f"{name}: {count['PASS']} PASS, {count['FAIL']} FAIL, {count['N/A']} N/A, {len(res.errors)} errors, "
        f"{meta['elapsed_s']} s on {meta['device']}")
    if meta["interrupted"]:
        return 3
    return 1 if (count["FAIL"] or res.errors) else 0
