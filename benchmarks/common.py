"""Shared timing helpers for the benchmarks in this folder, and their run control (errors, interruption, one
timed-and-checked measurement: timed_check).

Everything here needs CUDA at call time, but importing the module does not (so
scripts can print a clean "no CUDA" message instead of a traceback).

Cache policy (rotation, not flushing)
-------------------------------------
Each timed call gets a different set of input buffers, drawn round-robin from
``n`` copies whose total size exceeds ~2x the L2 cache (size read from
``torch.cuda.get_device_properties(dev).L2_cache_size``), and the last ``n``
results are kept alive so outputs rotate through ``n + 1`` allocations too.
By the time a buffer is used again, >= 2x L2 worth of other data has streamed
through the cache, so its lines are gone and every rep reads from HBM.

Why rotation rather than writing a 256 MB buffer between reps:
  * a flush *writes*; it leaves the whole L2 full of dirty lines that the timed
    kernel then has to write back to HBM as it evicts them -- up to one L2
    (50-60 MB on H100/H200) of extra, untimed-looking write traffic charged to
    the kernel, which badly skews small sizes (an s=512 RoPE moves only 16 MB);
  * there is no flush kernel between the timed launches, so the GPU runs the
    reps back to back like a real training step, and no event can accidentally
    include the flush;
  * it is the same for every implementation, including the copy ceiling, so
    ratios are apples to apples.
Memory cost: at most ~2.5x L2 of extra copies for small problems, 2 copies for
large ones.

Launch overhead
---------------
Before the timed loop the GPU is parked in ``torch.cuda._sleep`` long enough for
the CPU to enqueue every rep, so per-rep events measure device time only (not
Python/dispatcher overhead, which would otherwise dominate tiny problems).
If ``_sleep`` is missing the benchmark still works, it just includes launch gaps
whenever the CPU is slower than the GPU.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Iterable, Sequence

try:  # keep the module importable without torch so callers can report nicely
    import torch
except Exception:  # pragma: no cover - reported by the caller
    torch = None  # type: ignore[assignment]

_FALLBACK_L2_BYTES = 50 * 1024 * 1024
_MAX_ROTATION = 64
_ms_per_sleep_cycle: float | None = None


# --------------------------------------------------------------------------- device info
def device_name(dev: Any = None) -> str:
    """Marketing name of the CUDA device ("NVIDIA H100 80GB HBM3"), or "cpu"."""
    if torch is None or not torch.cuda.is_available():
        return "cpu (no CUDA)"
    return torch.cuda.get_device_name(dev)


def l2_cache_bytes(dev: Any = None) -> int:
    """L2 size in bytes from the device properties (50 MB fallback)."""
    try:
        props = torch.cuda.get_device_properties(dev if dev is not None else torch.cuda.current_device())
        size = int(getattr(props, "L2_cache_size", 0) or 0)
        return size if size > 0 else _FALLBACK_L2_BYTES
    except Exception:
        return _FALLBACK_L2_BYTES


def rotation_count(bytes_per_set: int, dev: Any = None, factor: float = 2.0, max_sets: int = _MAX_ROTATION) -> int:
    """How many copies of a ``bytes_per_set`` input set rotate past ``factor`` x L2 (at least 2)."""
    bytes_per_set = max(int(bytes_per_set), 1)
    n = math.ceil(factor * l2_cache_bytes(dev) / bytes_per_set) + 1
    return int(min(max(n, 2), max_sets))


# --------------------------------------------------------------------------- GPU hold
def _calibrate_sleep() -> float | None:
    """Milliseconds per ``torch.cuda._sleep`` cycle, measured once with events."""
    global _ms_per_sleep_cycle
    if _ms_per_sleep_cycle is not None:
        return _ms_per_sleep_cycle if _ms_per_sleep_cycle > 0 else None
    try:
        cycles = 2_000_000
        torch.cuda._sleep(1000)  # load whatever it needs
        torch.cuda.synchronize()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        torch.cuda.synchronize()
        ms = a.elapsed_time(b)
        _ms_per_sleep_cycle = ms / cycles if ms > 0 else -1.0
    except Exception:
        _ms_per_sleep_cycle = -1.0
    return _ms_per_sleep_cycle if _ms_per_sleep_cycle > 0 else None


def _hold_gpu(ms: float) -> None:
    """Queue a spin kernel of about ``ms`` milliseconds (no-op if unsupported)."""
    per_cycle = _calibrate_sleep()
    if per_cycle is None or ms <= 0:
        return
    try:
        torch.cuda._sleep(int(ms / per_cycle))
    except Exception:
        pass


# --------------------------------------------------------------------------- timing
def bench(
    fn: Callable[..., Any],
    args: Sequence[Sequence[Any]] | None = None,
    warmup: int = 10,
    rep: int = 50,
    hold_gpu: bool = True,
    return_all: bool = False,
):
    """Median device time of ``fn`` in milliseconds.

    ``fn(*args[i % len(args)])`` is called for rep i, so pass several argument
    tuples (see :func:`rotation_count`) to keep the data out of L2; results of
    the last ``len(args)`` calls stay alive so outputs rotate as well.
    Each rep is bracketed by its own pair of CUDA events, recorded after
    ``warmup`` untimed calls (compilation, autotuning, allocator warm-up).
    Returns the median in ms (or ``(median, all_times)`` with ``return_all``).
    """
    arg_sets = [tuple(a) for a in args] if args else [()]
    n = len(arg_sets)
    ring: list[Any] = [None] * n

    for i in range(max(warmup, 1)):
        ring[i % n] = fn(*arg_sets[i % n])
    torch.cuda.synchronize()

    # CPU cost of one call (enqueue only; the GPU is far from saturated here).
    probe = min(5, max(rep, 1))
    t0 = time.perf_counter()
    for i in range(probe):
        ring[i % n] = fn(*arg_sets[i % n])
    cpu_ms = (time.perf_counter() - t0) * 1e3 / probe
    torch.cuda.synchronize()

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    if hold_gpu:
        # enough spin for the CPU to enqueue all reps (2x margin + 1 ms), capped at 300 ms
        _hold_gpu(min(rep * (cpu_ms + 0.02) * 2.0 + 1.0, 300.0))
    for i in range(rep):
        j = i % n
        starts[i].record()
        ring[j] = fn(*arg_sets[j])
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    del ring
    med = statistics.median(times)
    return (med, times) if return_all else med


def bench_pair(
    fn_a: Callable[..., Any],
    fn_b: Callable[..., Any],
    args: Sequence[Sequence[Any]] | None = None,
    warmup: int = 10,
    rep: int = 100,
    hold_gpu: bool = True,
) -> list:
    """Device times of ``fn_a`` and ``fn_b`` interleaved call by call: ``rep`` pairs, each one call of either
    back to back (which goes first alternates from pair to pair), every call bracketed by its own CUDA events.
    The two calls of a pair see the same clock, so a ratio taken pair by pair leaves out the drift of the device's
    clock over the run (power and heat), which two separate :func:`bench` medians include. Inputs rotate as in
    :func:`bench`, one argument set per call in the order of the calls: a set comes back only after ``n`` calls, so
    neither function finds the other's inputs still in L2. Returns ``[(a_ms, b_ms), ...]``."""
    arg_sets = [tuple(a) for a in args] if args else [()]
    n = len(arg_sets)
    ring: list[Any] = [None] * (2 * n)
    for i in range(max(warmup, 1)):
        for fn, k in ((fn_a, 0), (fn_b, 1)):
            j = (2 * i + k) % n
            ring[2 * j + k] = fn(*arg_sets[j])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ring[0] = fn_a(*arg_sets[0])
    ring[1] = fn_b(*arg_sets[1 % n])
    cpu_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(rep)]
    if hold_gpu:
        _hold_gpu(min(rep * (cpu_ms + 0.04) * 2.0 + 1.0, 300.0))
    for i in range(rep):
        order = ((fn_a, 0), (fn_b, 1)) if i % 2 == 0 else ((fn_b, 1), (fn_a, 0))
        for pos, (fn, k) in enumerate(order):
            j = (2 * i + pos) % n
            ev[i][2 * k].record()
            ring[2 * j + k] = fn(*arg_sets[j])
            ev[i][2 * k + 1].record()
    torch.cuda.synchronize()
    times = [(e[0].elapsed_time(e[1]), e[2].elapsed_time(e[3])) for e in ev]
    del ring
    return times


def graph_of(torch, calls, passes: int = 3):
    """A CUDA graph of `passes` passes over `calls` (warmed up on a side stream first) and its number of calls:
    replayed between two events, the kernels' time without the host's launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(passes):
            for c in calls:
                c()
    return g, passes * len(calls)


@contextlib.contextmanager
def programmatic_launch(enabled: bool):
    """fused_ops' programmatic dependent launch on or off inside the block (A/B rows of the routed benchmarks)."""
    import fused_ops
    prev = fused_ops.set_programmatic_launch(enabled)
    try:
        yield
    finally:
        fused_ops.set_programmatic_launch(prev)


def gbps(nbytes: float, ms: float) -> float:
    """Bytes per millisecond -> GB/s (1 GB = 1e9 B)."""
    return float("nan") if not ms or ms <= 0 or math.isnan(ms) else nbytes / (ms * 1e-3) / 1e9


def copy_time_ms(nbytes: int, warmup: int = 10, rep: int = 50, dev: Any = None) -> float:
    """Median time of ``dst.copy_(src)`` for ``nbytes`` (L2 rotation as in :func:`bench`)."""
    dev = torch.device("cuda") if dev is None else torch.device(dev)
    nbytes = max(int(nbytes), 16)
    nsets = rotation_count(2 * nbytes, dev)  # src and dst both rotate
    sets = []
    for _ in range(nsets):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        sets.append((dst, src))
    ms = bench(lambda d, s: d.copy_(s), args=sets, warmup=warmup, rep=rep)
    del sets
    return ms


def copy_bandwidth(nbytes: int, warmup: int = 10, rep: int = 50, dev: Any = None) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting read + write bytes."""
    return gbps(2 * max(int(nbytes), 16), copy_time_ms(nbytes, warmup=warmup, rep=rep, dev=dev))


# --------------------------------------------------------------------------- tables
def _cell(v: Any, fmt: str | None = None) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if fmt:
            return format(v, fmt)
        a = abs(v)
        if a != 0 and (a < 1e-3 or a >= 1e6):
            return f"{v:.2e}"
        return f"{v:.3f}" if a < 10 else f"{v:.1f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], formats: Sequence[str | None] | None = None) -> str:
    """GitHub markdown table; floats get a compact format unless ``formats`` says otherwise."""
    rows = list(rows)
    formats = list(formats) if formats else [None] * len(headers)
    text = [[_cell(v, formats[i] if i < len(formats) else None) for i, v in enumerate(r)] for r in rows]
    widths = [len(h) for h in headers]
    for r in text:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    line = lambda cells: "| " + " | ".join(c.ljust(widths[i]) for i, c in enumerate(cells)) + " |"
    out = [line(list(headers)), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r + [""] * (len(headers) - len(r))) for r in text]
    return "\n".join(out)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], formats: Sequence[str | None] | None = None) -> str:
    s = format_table(headers, rows, formats)
    print(s, flush=True)
    return s


# --------------------------------------------------------------------------- run control (every benchmark script)
ERR_TOL = 1e-2  # ||out - ref|| / ||ref|| above this and a measured implementation counts as wrong


class Interrupted(BaseException):
    """SIGTERM / SIGINT during a run (on_signal): the scripts stop measuring and still write what they have."""


def on_signal(signum, frame):  # noqa: ARG001
    raise Interrupted(f"signal {signum}")


def die_env(name: str, msg: str) -> None:
    print(f"{name}: cannot run: {msg}", file=sys.stderr, flush=True)
    print(f"{name}: SKIPPED ({msg})", flush=True)
    sys.exit(2)


def log(msg: str) -> None:
    print(msg, flush=True)


def record_error(errors: list, where: str, exc: BaseException) -> str:
    """Appends {where, error, traceback} to errors, logs it; returns the one-line message (it goes into a markdown
    table)."""
    msg = " ".join(f"{type(exc).__name__}: {exc}".split())
    msg = msg if len(msg) <= 400 else msg[:400] + " ..."
    errors.append({"where": where, "error": msg, "traceback": traceback.format_exc(limit=6)})
    log(f"  !! {where}: {msg}")
    return msg


def _guarded(row: dict, error, where: str, fn: Callable):
    """(True, fn()) under torch.no_grad(); a failure other than Interrupted goes to row["error"] through
    error(where, exc) with row["ok"] = False, and gives (False, None)."""
    import torch
    try:
        with torch.no_grad():
            return True, fn()
    except Interrupted:
        raise
    except Exception as e:  # noqa: BLE001
        row["error"] = error(where, e)
        row["ok"] = False
        return False, None


def timed_check(row: dict, label: str, error, fn: Callable, arg_sets, warmup: int, rep: int, check=None,
                best_of: int = 1) -> bool:
    """One measurement of a results row: row["ms"] = the median time of fn over the rotating arg_sets (bench; the
    lowest of best_of medians), then check() once -> row["err"], row["ok"] (err < ERR_TOL). A failure goes to
    row["error"] through error(where, exc) with row["ok"] = False; only Interrupted propagates. Returns False when
    the timing failed (the caller then fills nothing else)."""
    timed, ms = _guarded(row, error, f"{label} timing",
                         lambda: min(bench(fn, args=arg_sets, warmup=warmup, rep=rep) for _ in range(best_of)))
    if not timed:
        return False
    row["ms"] = ms
    if check is not None:
        checked, err = _guarded(row, error, f"{label} correctness", check)
        if checked:
            row["err"] = err
            row["ok"] = bool(err == err and err < ERR_TOL)
            if not row["ok"]:
                log(f"  !! {label}: WRONG OUTPUT, err={err:.3g} (tol {ERR_TOL})")
    return True


def cleanup() -> None:
    """Frees what the last case left: garbage, then the caching allocator's blocks."""
    import gc
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
