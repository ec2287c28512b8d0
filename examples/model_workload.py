"""The main job: a CogVLM-style decoder on the fused ops, trained and served, against the ways people write it today.

On a CUDA GPU, bf16, for a CogVLM2-19B decoder layer (hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128,
visual expert) and a Llama-3-8B-sized single-expert layer, at 2048 and 8192 tokens (one image span of 2306 tokens at
8192, scaled at 2048, plus text):

    phases           prefill forward; training step (forward + backward); decode (one new token per sequence, KV
                     cache of the prompt length, batch 1 and 16); peak memory of the training step
    implementations  fused_ops                       fused_ops.models.FusedCogVLM
                     (a) reference                   CogVLM's own style: boolean-mask gather + cuBLAS per expert
                     (b) grouped_mm                  sort by expert + torch._grouped_mm + scatter (torchtitan's MoE)
                     (c) compiled                    torch.compile of (a), where it compiles (said where it does not)

Every implementation uses the same SDPA call for attention. Times are CUDA events around each call after warm-up,
median of several; each timed model has `--layers` decoder layers (default 1) and no final norm, so a row is the cost
of that many layers, including the once-per-forward work (fused_ops' route, (b)'s sort). CUDA kernels per layer
forward are counted with torch.profiler (every device activity of one forward, less the once-per-forward work,
divided by the layers). Outputs and gradients of every implementation are checked against a float64 copy of (a)
(relative error, printed; the job fails on a bad one). The table goes to stdout, JSON and a PNG chart to `--out`.
Optional work (torch.compile) runs last and is skipped, and said so, past `--budget-s` seconds.

Without a GPU: the same models at a small size on the CPU paths, correctness only (fused vs reference forward and
gradients in float64, the converter round trip, decode with the KV cache, the grouped-GEMM baseline in float32).

The last line says "all checks passed" or what failed; the exit status is nonzero on a failure.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch

import fused_ops
from fused_ops.models import (COGVLM2_19B, LLAMA3_8B, CogVLMConfig, FusedCogVLM, GroupedMMCogVLM, KVCache,
                              convert_state_dict, get_expert_mask)
from fused_ops.models.baselines import sort_by_expert

IMPLS = ("fused_ops", "reference", "grouped_mm", "compiled")
LABELS = {"fused_ops": "fused_ops", "reference": "(a) CogVLM-style reference", "grouped_mm": "(b) sort+_grouped_mm",
          "compiled": "(c) torch.compile(a)"}
IMAGE_TOKENS_AT_8192 = 2306


class Job:
    """Progress lines, checks, result rows and failures of one run."""

    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.rows, self.checks, self.failures, self.notes, self.kernels = [], [], [], [], {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def progress(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def check(self, what: str, err: float, tol: float, extra: str = "") -> None:
        ok = err == err and err <= tol  # NaN fails
        self.checks.append({"check": what, "rel_err": err, "tol": tol, "ok": ok})
        self.progress(f"  check {what}: rel err {err:.2e} (tol {tol:.1e}{extra}) {'ok' if ok else 'FAILED'}")
        if not ok:
            self.failures.append(f"{what}: rel err {err:.2e} > {tol:.1e}")

    def fail(self, what: str, exc: BaseException) -> None:
        msg = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        self.failures.append(msg)
        self.progress(f"  FAILED {msg}")


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_inputs(config: CogVLMConfig, batch: int, seq: int, device, dtype, seed: int = 0):
    """x [b, s, H] ~ N(0, 1); for the visual expert, one image span (2306 tokens per 8192, from position 1, after a
    BOS) per sequence and CogVLM's expert mask of it (the span's last token is a language token)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, seq, config.hidden, generator=g).to(device=device, dtype=dtype)
    if not config.vision_expert:
        return x, None
    types = torch.zeros(batch, seq, dtype=torch.long)
    span = max(2, min(seq - 2, round(IMAGE_TOKENS_AT_8192 * seq / 8192)))
    types[:, 1:1 + span] = 1
    return x, get_expert_mask(types).to(device)


def named_grads(model, config, layout_of_model: str):
    """The model's parameter gradients in the reference's names (fused layouts converted, values unchanged)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes the names
    grads = {k: p.grad for k, p in model.named_parameters()}
    return convert_state_dict(grads, config, to="reference") if layout_of_model == "fused" else grads


def forward_backward(model, x, mask, grad_out):
    for p in model.parameters():
        p.grad = None
    xx = x.detach().requires_grad_(True)
    out = model(xx, mask)
    out.backward(grad_out)
    return out, xx.grad


# ------------------------------------------------------------------------------------------------------------------
# correctness


def check_against(job, label, model, layout, config, case, floor_out, floor_w, ref_errs=None):
    """Checks `model`'s output, input gradient and every weight gradient against the float64 values in `case`.
    Tolerance per quantity: max(floor, 2x the bf16 reference's own error) on the GPU (bf16 rounding is the bar)."""
    x, mask, g, want = case["x"], case["mask"], case["grad_out"], case["want"]
    out, gx = forward_backward(model, x.to(case["dtype"]), mask, g.to(case["dtype"]))
    grads = named_grads(model, config, layout)
    errs = {"out": rel_err(out, want["out"]), "x.grad": rel_err(gx, want["x.grad"])}
    worst = max(grads, key=lambda k: rel_err(grads[k], want[k]))
    errs["weight grads"] = rel_err(grads[worst], want[worst])
    for what, err in errs.items():
        floor = floor_w if what == "weight grads" else floor_out
        tol = floor if ref_errs is None else max(floor, 2 * ref_errs[what])
        extra = "" if ref_errs is None else f", bf16 (a): {ref_errs[what]:.2e}"
        job.check(f"{label} {what}" + (f" (worst: {worst})" if what == "weight grads" else ""), err, tol, extra)
    for p in model.parameters():
        p.grad = None
    return errs


def float64_case(reference, config, batch, seq, device, dtype):
    """Inputs, an upstream gradient and the float64 reference's output and gradients."""
    x, mask = make_inputs(config, batch, seq, device, dtype, seed=1)
    g = torch.randn(x.shape, device=device, dtype=dtype)
    ref64 = copy.deepcopy(reference).double()
    out, gx = forward_backward(ref64, x.double(), mask, g.double())
    want = {"out": out.detach(), "x.grad": gx, **{k: p.grad for k, p in ref64.named_parameters()}}
    del ref64
    return {"x": x, "mask": mask, "grad_out": g, "want": want, "dtype": dtype}


def check_decode(job, label, models, config, device, dtype, batch=16, past=256):
    """One decode step with a random cache of `past` tokens, each implementation against the float64 reference."""
    x, _ = make_inputs(config, batch, 1, device, dtype, seed=2)
    mask = torch.zeros(batch, 1, dtype=torch.bool, device=device) if config.vision_expert else None
    cache = KVCache(config, batch, past + 1, device=device, dtype=dtype)
    for t in cache.k + cache.v:
        t.normal_()
    cache64 = KVCache(config, batch, past + 1, device=device, dtype=torch.float64)
    for dst, src in zip(cache64.k + cache64.v, cache.k + cache.v):
        dst.copy_(src)
    with torch.no_grad():
        cache64.length = past
        want = copy.deepcopy(models["reference"]).double()(x.double(), mask, cache=cache64)
        ref_err = None
        for name in sorted(models, key=lambda n: n != "reference"):  # (a) first: its error sets the bar
            model = models[name]
            cache.length = past
            try:
                err = rel_err(model(x, mask, cache=cache), want)
            except Exception as e:  # noqa: BLE001 (reported, the job fails)
                job.fail(f"{label} {name} decode check", e)
                continue
            ref_err = err if name == "reference" else ref_err
            tol = 1e-10 if dtype == torch.float64 else max(1e-2, 2 * (ref_err or 0))
            job.check(f"{label} {name} decode step (batch {batch}, cache {past})", err, tol)


# ------------------------------------------------------------------------------------------------------------------
# the CPU path: correctness only


def randomize_(model, seed=0):
    """Random non-zero parameters (norm scales around 1), so that no check passes on zeros or ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1
            p.copy_(1 + 0.3 * v if name.endswith("norm.weight") else v / max(p.shape[-1], 1) ** 0.5)
    return model


def cpu_main(job) -> None:
    job.progress("No CUDA GPU here: running the same models at a small size on the CPU paths of the ops, correctness "
                 "only. Timings, kernel counts and memory need a CUDA GPU (the kernels run only there).")
    small = CogVLMConfig(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, layers=2, rope_theta=10000.0,
                         dtype=torch.float64)
    for name, config in (("cogvlm (small)", small), ("llama (small)", small.replace(vision_expert=False,
                                                                                    qkv_bias=False))):
        job.progress(f"{name}: {config}")
        fused = randomize_(FusedCogVLM(config))
        ref = fused.to_reference()
        case = float64_case(ref, config, 2, 24, "cpu", torch.float64)
        check_against(job, f"{name} fused_ops", fused, "fused", config, case, 1e-10, 1e-10)
        # converter round trip both ways, values bit for bit
        fsd, rsd = fused.state_dict(), ref.state_dict()
        back = convert_state_dict(convert_state_dict(fsd, config, to="reference"), config, to="fused")
        again = convert_state_dict(convert_state_dict(rsd, config, to="fused"), config, to="reference")
        same = all(torch.equal(back[k], fsd[k]) for k in fsd) and all(torch.equal(again[k], rsd[k]) for k in rsd)
        job.check(f"{name} converter round trip fused->reference->fused and back", 0.0 if same else 1.0, 0.0)
        # decode: prefill then one token at a time, against the full forward
        x, mask = case["x"], case["mask"]
        with torch.no_grad():
            full = fused(x, mask)
            cache = KVCache(config, x.shape[0], x.shape[1], dtype=torch.float64)
            fused(x[:, :20], None if mask is None else mask[:, :20], cache=cache)
            steps = [fused(x[:, i:i + 1], None if mask is None else mask[:, i:i + 1], cache=cache)
                     for i in range(20, 24)]
        job.check(f"{name} fused_ops decode with KV cache vs full forward", rel_err(torch.cat(steps, 1), full[:, 20:]),
                  1e-10)
        if config.vision_expert:
            try:
                grouped = GroupedMMCogVLM(config, dtype=torch.float32)
                grouped.load_state_dict(fsd)
                check_against(job, f"{name} grouped_mm (float32)", grouped, "fused", config, dict(case,
                              dtype=torch.float32), 5e-6, 5e-5)
            except (RuntimeError, NotImplementedError) as e:
                job.notes.append(f"grouped_mm baseline not checked on the CPU: {e}")
                job.progress(f"  grouped_mm baseline NOT checked on the CPU (this torch: {e})")
    job.progress("torch.compile (c) is not run on the CPU path: it is measured on the GPU only.")


# ------------------------------------------------------------------------------------------------------------------
# the GPU path


def time_ms(fn, reps: int, warmup: int) -> float:
    """Median of `reps` calls timed with CUDA events, after `warmup` calls; the GPU is idle when each starts, so a
    call's time includes its launch overhead where the GPU waits for the CPU (what an eager model costs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def kernel_names(fn) -> list:
    """Names of every device activity (kernels, memcpy, memset) of one call of fn, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def peak_mib(model, fn) -> float:
    """Peak memory of one training step above what was allocated before it (weights, inputs), gradients included."""
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for p in model.parameters():
        p.grad = None
    return peak / 2**20


class Case:
    """One model config on the GPU: its implementations, float64 check values and inputs."""

    def __init__(self, job, name, config, device):
        self.name, self.config, self.device, self.dt = name, config, device, torch.bfloat16
        job.progress(f"{name}: building the models ({config.layers} layer(s), bf16)")
        fused = FusedCogVLM(config, device=device, dtype=self.dt)
        ref = fused.to_reference()
        self.models = {"fused_ops": fused, "reference": ref}
        if config.vision_expert:
            grouped = GroupedMMCogVLM(config, device=device, dtype=self.dt)
            grouped.load_state_dict(fused.state_dict())
            self.models["grouped_mm"] = grouped
        self.layout = {"fused_ops": "fused", "reference": "reference", "grouped_mm": "fused", "compiled": "reference"}
        # once-per-forward work, counted apart from the layers' kernels: fused_ops' route; (b)'s sort and its RoPE
        # cos / sin (the others slice cached tables)
        self.setup = {"fused_ops": fused_ops.route}
        if "grouped_mm" in self.models:
            self.setup["grouped_mm"] = lambda mask: (sort_by_expert(mask), grouped._rope(0, mask.shape[1], device))

    def inputs(self, seq, batch=1):
        return make_inputs(self.config, batch, seq, self.device, self.dt)


def measure(job, case, impl, model, seq, reps, warmup) -> None:
    """Prefill, training step (and its peak memory) and kernel counts of `impl` at `seq` tokens (batch 1)."""
    x, mask = case.inputs(seq)
    g = torch.randn(x.shape, device=x.device, dtype=x.dtype)
    layers = case.config.layers

    def prefill():
        with torch.no_grad():
            model(x, mask)

    def train():
        forward_backward(model, x, mask, g)

    base = dict(model=case.name, tokens=seq, batch=1, impl=impl)
    job.progress(f"{case.name} {seq} tokens: {LABELS[impl]}: prefill forward")
    ms = time_ms(prefill, reps, warmup)
    names = kernel_names(prefill)
    setup = kernel_names(lambda: case.setup[impl](mask)) if impl in case.setup and mask is not None else []
    per_layer = (len(names) - len(setup)) / layers
    job.kernels[f"{case.name}/{seq}/{impl}/prefill"] = {"total": len(names), "per_forward_setup": len(setup),
                                                       "per_layer": per_layer, "names": dict(Counter(names))}
    job.rows.append(dict(base, phase="prefill", ms=ms, kernels_per_layer=per_layer, setup_kernels=len(setup)))
    job.progress(f"{case.name} {seq} tokens: {LABELS[impl]}: training step (forward + backward) and its peak memory")
    ms = time_ms(train, max(3, reps // 2), max(1, warmup - 1))
    job.rows.append(dict(base, phase="train", ms=ms, peak_mib=peak_mib(model, train)))


def measure_decode(job, case, impl, model, past, batch, reps, warmup) -> None:
    """One decode step: `batch` new text tokens after a cache of `past` tokens (random contents, reset every call)."""
    c = case.config
    job.progress(f"{case.name} decode batch {batch}, cache {past}: {LABELS[impl]}")
    x, _ = make_inputs(c, batch, 1, case.device, case.dt, seed=3)
    mask = torch.zeros(batch, 1, dtype=torch.bool, device=case.device) if c.vision_expert else None
    cache = KVCache(c, batch, past + 1, device=case.device, dtype=case.dt)
    for t in cache.k + cache.v:
        t.normal_()

    def step():
        cache.length = past
        with torch.no_grad():
            model(x, mask, cache=cache)

    ms = time_ms(step, reps * 2, warmup)
    names = kernel_names(step)
    setup = kernel_names(lambda: case.setup[impl](mask)) if impl in case.setup and mask is not None else []
    per_layer = (len(names) - len(setup)) / c.layers
    job.kernels[f"{case.name}/decode{batch}x{past}/{impl}"] = {"total": len(names), "per_forward_setup": len(setup),
                                                              "per_layer": per_layer, "names": dict(Counter(names))}
    job.rows.append(dict(model=case.name, tokens=past, batch=batch, impl=impl, phase=f"decode b{batch}", ms=ms,
                         kernels_per_layer=per_layer, setup_kernels=len(setup)))


def guarded(job, what, fn, compiled=False) -> bool:
    """Runs fn; an exception fails the job, except for torch.compile, where it is reported as 'did not compile'."""
    try:
        fn()
        return True
    except Exception as e:  # noqa: BLE001
        if compiled:
            msg = f"{what}: torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            job.notes.append(msg)
            job.progress(f"  (c) DID NOT COMPILE / RUN: {msg}")
        else:
            job.fail(what, e)
        return False
    finally:
        torch.cuda.synchronize()


def gpu_main(job, device="cuda") -> None:
    a = job.args
    dev = torch.device(device)
    job.progress(f"GPU: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}; fused_ops built for "
                 f"{fused_ops.built_archs()}")
    seqs = [int(s) for s in a.seqs.split(",")] if a.seqs else [8192] if a.quick else [2048, 8192]
    reps, warmup = (3, 1) if a.quick else (a.reps, 3)
    configs = [("cogvlm2-19b", COGVLM2_19B), ("llama3-8b", LLAMA3_8B)]
    cases, checks64 = [], {}
    for name, preset in configs:
        case = Case(job, name, preset.replace(layers=a.layers, final_norm=False), dev)
        cases.append(case)
        job.progress(f"{name}: correctness against a float64 copy of (a) at {a.check_tokens} tokens")
        check = checks64[name] = float64_case(case.models["reference"], case.config, 1, a.check_tokens, dev, case.dt)
        ref_errs = check_against(job, f"{name} (a) reference bf16", case.models["reference"], "reference",
                                 case.config, check, 1e-2, 2e-2)
        for impl in ("fused_ops", "grouped_mm"):
            if impl in case.models:
                guarded(job, f"{name} {impl} check", lambda impl=impl: check_against(
                    job, f"{name} {impl}", case.models[impl], case.layout[impl], case.config, check, 1e-2, 2e-2,
                    ref_errs))
        check["ref_errs"] = ref_errs
        check_decode(job, name, case.models, case.config, dev, case.dt)
        for seq in seqs:
            for impl, model in case.models.items():
                guarded(job, f"{name} {seq} {impl}", lambda: measure(job, case, impl, model, seq, reps, warmup))
        for batch in (1, 16):
            for impl, model in case.models.items():
                guarded(job, f"{name} decode b{batch} {impl}",
                        lambda: measure_decode(job, case, impl, model, seqs[-1], batch, reps, warmup))
        torch.cuda.empty_cache()

    # (c) last, within the time budget: every compile is seconds to minutes
    if a.no_compile:
        job.notes.append("(c) torch.compile not run (--no-compile)")
        return
    # Each shape and grad mode is a recompile of every frame between the reference's graph breaks (the boolean-mask
    # gathers); past dynamo's default limit of 8 it would silently run eager and (c) would time (a).
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    breaks_before = _graph_breaks()
    for case in cases:
        case.models["compiled"] = torch.compile(case.models["reference"], dynamic=False)
    # most wanted first: the prefill and training rows of every case, then decode
    work = [(case, "check", None) for case in cases[:1]] + [(case, "measure", s) for s in seqs for case in cases[:1]]
    work += [(case, "check", None) for case in cases[1:]] + [(case, "measure", s) for s in seqs for case in cases[1:]]
    work += [(case, "decode", b) for case in cases for b in (1, 16)]
    broken = set()
    for case, kind, arg in work:
        what = f"{case.name} (c) {kind}" + (f" {arg}" if arg else "")
        if case.name in broken:
            job.notes.append(f"{what}: not run, (c) failed before for {case.name}")
            continue
        if job.elapsed() > a.budget_s:
            job.notes.append(f"{what}: skipped, past the time budget ({a.budget_s:.0f} s)")
            job.progress(job.notes[-1])
            continue
        t = time.perf_counter()
        compiled = case.models["compiled"]
        if kind == "check":
            job.progress(f"{case.name} (c): compiling and checking against float64 (training graph, "
                         f"{a.check_tokens} tokens)")
            ok = guarded(job, what, lambda: check_against(
                job, f"{case.name} compiled", compiled, "reference", case.config, checks64[case.name], 1e-2, 2e-2,
                checks64[case.name]["ref_errs"]), compiled=True)
        elif kind == "measure":
            ok = guarded(job, what, lambda: measure(job, case, "compiled", compiled, arg, reps, warmup), compiled=True)
        else:
            ok = guarded(job, what, lambda: measure_decode(job, case, "compiled", compiled, seqs[-1], arg, reps,
                                                           warmup), compiled=True)
        if not ok:
            broken.add(case.name)
        job.progress(f"  {what}: {'done' if ok else 'failed'} in {time.perf_counter() - t:.1f} s (compile included)")
    if breaks_before is not None:
        n = _graph_breaks() - breaks_before
        job.notes.append(f"(c): {n} graph breaks over all its compiles (torch._dynamo's counter)"
                         + ("; the reference's boolean-mask gathers have data-dependent shapes" if n else ""))


def _graph_breaks():
    try:  # a private counter: informational only
        return sum(torch._dynamo.utils.counters["graph_break"].values())
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------------------------------------------------
# report


def add_speedups(rows) -> None:
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["tokens"], r["batch"], r["phase"]), []).append(r)
    for group in groups.values():
        baselines = [r["ms"] for r in group if r["impl"] != "fused_ops"]
        best = min(baselines) if baselines else None
        for r in group:
            r["vs_best_baseline"] = best / r["ms"] if best else None
            n = r["tokens"] if r["phase"] in ("prefill", "train") else r["batch"]
            r["tokens_per_s"] = n / (r["ms"] / 1e3)


def print_table(job) -> None:
    layers = job.args.layers
    print(f"\n## Model workload ({torch.cuda.get_device_name()}, bf16, {layers} decoder layer(s) per row; decode rows: "
          "cache of `tokens` positions, one new token per sequence)\n")
    head = ["model", "tokens", "phase", "implementation", "ms", "tokens/s", "vs best baseline", "peak MiB",
            "kernels/layer"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    models = list(dict.fromkeys(r["model"] for r in job.rows))
    phases = ["prefill", "train", "decode b1", "decode b16"]
    order = lambda r: (models.index(r["model"]), phases.index(r["phase"]), r["tokens"], IMPLS.index(r["impl"]))  # noqa
    for r in sorted(job.rows, key=order):
        cells = [r["model"], str(r["tokens"]), r["phase"], LABELS[r["impl"]], f"{r['ms']:.3f}",
                 f"{r['tokens_per_s']:,.0f}", f"{r['vs_best_baseline']:.2f}x" if r.get("vs_best_baseline") else "-",
                 f"{r['peak_mib']:,.0f}" if "peak_mib" in r else "",
                 (f"{r['kernels_per_layer']:g}" + (f" (+{r['setup_kernels']}/fwd)" if r.get("setup_kernels") else ""))
                 if "kernels_per_layer" in r else ""]
        print("| " + " | ".join(cells) + " |")
    print("\n'vs best baseline': the fastest of (a), (b), (c) in that row's group divided by the row's time (>1: faster"
          " than every baseline). '+N/fwd': kernels of the once-per-forward work (fused_ops' route; (b)'s sort and "
          "RoPE cos / sin).")


def write_outputs(job, device_name: str) -> None:
    out = job.args.out
    os.makedirs(out, exist_ok=True)
    doc = {"device": device_name, "torch": torch.__version__, "fused_ops_archs": fused_ops.built_archs(),
           "args": vars(job.args), "rows": job.rows, "checks": job.checks, "notes": job.notes,
           "kernels": job.kernels, "failures": job.failures}
    path = os.path.join(out, "model_workload.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    job.progress(f"wrote {path}")
    if not job.rows:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        job.progress("matplotlib is missing: no PNG chart")
        return
    phases = [p for p in ("prefill", "train", "decode b1", "decode b16") if any(r["phase"] == p for r in job.rows)]
    fig, axes = plt.subplots(1, len(phases), figsize=(5 * len(phases), 4.5), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        rows = [r for r in job.rows if r["phase"] == phase]
        groups = sorted({(r["model"], r["tokens"]) for r in rows})
        impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
        width = 0.8 / len(impls)
        ref = {(r["model"], r["tokens"]): r["ms"] for r in rows if r["impl"] == "reference"}
        for j, impl in enumerate(impls):  # speed relative to (a): the cases' times differ by orders of magnitude
            ms = {(r["model"], r["tokens"]): r["ms"] for r in rows if r["impl"] == impl}
            ax.bar([i + j * width for i in range(len(groups))],
                   [ref[gr] / ms[gr] if gr in ms and gr in ref else 0 for gr in groups], width, label=LABELS[impl])
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{m}\n{t} {'cached' if phase.startswith('decode') else 'tokens'}" for m, t in groups],
                           fontsize=8)
        ax.set_title(phase)
        ax.set_ylabel("speed relative to (a) (higher is better)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"fused_ops model workload, {device_name}, bf16, {job.args.layers} layer(s)")
    fig.tight_layout()
    path = os.path.join(out, "model_workload.png")
    fig.savefig(path, dpi=120)
    job.progress(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="build/model_workload", help="folder for model_workload.json / .png")
    p.add_argument("--layers", type=int, default=1, help="decoder layers per timed model (1-2 keep it short)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per measurement (median)")
    p.add_argument("--check-tokens", type=int, default=2048, help="tokens of the float64 correctness check")
    p.add_argument("--quick", action="store_true", help="8192 tokens only, 3 reps")
    p.add_argument("--seqs", default="", help="comma-separated token counts instead of 2048,8192 (decode: the last)")
    p.add_argument("--no-compile", action="store_true", help="leave out (c) torch.compile")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no torch.compile work after this many seconds")
    p.add_argument("--device", choices=["auto", "cpu"], default="auto", help="cpu: the CPU path even with a GPU")
    job = Job(p.parse_args(argv))
    gpu = torch.cuda.is_available() and job.args.device == "auto"
    try:
        if gpu:
            gpu_main(job)
        else:
            cpu_main(job)
    except Exception as e:  # noqa: BLE001 (reported as a failure with the final line)
        job.fail("model_workload", e)
        import traceback
        traceback.print_exc()
    if gpu:
        add_speedups(job.rows)
        print_table(job)
        for n in job.notes:
            print(f"note: {n}")
        write_outputs(job, torch.cuda.get_device_name())
    else:
        print("\nTimings need a CUDA GPU: none was measured here.")
    passed = sum(c["ok"] for c in job.checks)
    if job.failures or not job.checks:
        print(f"\nmodel_workload: {len(job.failures)} FAILED ({passed}/{len(job.checks)} checks passed): "
              + "; ".join(job.failures or ["no check ran"]))
        return 1
    print(f"\nmodel_workload: all checks passed ({passed} checks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
