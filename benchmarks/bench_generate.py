#!/usr/bin/env python3
"""Generation at the bandwidth floor (issue 56): ms per generated token of a full-depth CogVLM2-19B language model on
`fused_ops.models.GenerationEngine` (one CUDA graph per decode step), against the floor and two peers.

    python benchmarks/bench_generate.py                 # H200: the issue's three cases, the peers, < 4 minutes
    python benchmarks/bench_generate.py --layers 4 --steps 16 --peers eager      # shorter
    python benchmarks/bench_generate.py --small         # a tiny config on the CPU, end to end (no timing targets)

Model: CogVLM2-19B's language model (32 layers, hidden 4096, 32 / 8 heads of 128, intermediate 14336, both experts,
vocab 128,256), random weights, bf16. Cases (each prompt one image span, given as embeddings at its positions and
routed through the vision expert by CogVLM's mask): batch 1 and 16 with 8,192-token prompts (2,304 image tokens),
batch 64 with 1,024-token prompts (256). Each case: one generate call of `--steps` + 1 tokens after a warm-up that
captures the graph; ms per token = the decode loop's time (CUDA events) over its steps, greedy.

Floor: the bytes one decode step must read (the text expert's weights of every layer, the final norm, the LM head,
each sequence's keys and values at its mean cached length over the timed steps, its token's embedding row) over the
device-to-device copy bandwidth measured in the same run (read + written bytes, benchmarks/common.py). Each result
is given as the fraction floor / measured.

Peers, in the same run, one at a time (each freed before the next): `eager` today's eager fused decode
(FusedCogVLM.forward with the KVCache, one token per step, LM head and argmax; events around the loop, host time
included since that is what a user waits for); `hf` transformers' LlamaForCausalLM with Llama-3-8B's config
(random, bf16), `cache_implementation="static"` and HF's compiled decode steps (`torch.compile(mode=
"reduce-overhead")`), per-token time from CUDA events recorded between steps (a logits processor) at the same
prompt length, at the batch sizes of `--hf-batches` (default 1: compilation is most of this benchmark's time);
`hf-fused` the same model patched by `fused_ops.hf.apply_fused_ops` (not in the default: one more compilation).

Kernels per decode layer: torch.profiler's CUDA kernels of one layer's decode call (engine), one layer's forward
(eager peer), and for HF the kernels of 4 decode steps (the difference of two generations stopped after 2 and 6
steps, same shapes) over 4 x layers. Targets (reported, not asserted): batch 1 >= 80% of the floor and >= 1.3x the
HF peer's tokens/s; batch 16 >= 75%; batch 64 >= 70%.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402

#: (batch, prompt tokens, image tokens, target fraction of the floor)
CASES = {"b1x8192": (1, 8192, 2304, 0.80), "b16x8192": (16, 8192, 2304, 0.75), "b64x1024": (64, 1024, 256, 0.70),
         "b2x8192": (2, 8192, 2304, None), "b4x8192": (4, 8192, 2304, None)}  # the last two: --cases only
ISSUE_CASES = "b1x8192,b16x8192,b64x1024"
SMALL_CASES = {"b1x64": (1, 64, 18, None), "b2x64": (2, 64, 18, None), "b4x16": (4, 16, 4, None)}
HF_SPEEDUP_TARGET = 1.3  # batch 1: engine tokens/s over the HF peer's


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of every model (default 32, CogVLM2's / Llama-3's; --small: 2)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps (tokens) per case")
    p.add_argument("--cases", default=ISSUE_CASES, help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--peers", default="eager,hf", help="comma-separated, of eager, hf, hf-fused ('' for none)")
    p.add_argument("--hf-batches", default="1", help="batch sizes at which the HF peers run (comma-separated)")
    p.add_argument("--budget-s", type=float, default=225.0,
                   help="peers that would start after this many seconds are skipped (the whole run: < 4 minutes)")
    p.add_argument("--small", action="store_true", help="a tiny config on the CPU, end to end (checks, no targets)")
    p.add_argument("--no-profile", action="store_true", help="skip the kernel counts")
    p.add_argument("--norm-ab", action="store_true",
                   help="also each case's engine with torch's F.rms_norm in the decode step instead of "
                        "torch.ops.fused.rms_norm (the A/B behind the op)")
    p.add_argument("--out", metavar="DIR", help="write bench_generate.json there")
    a = p.parse_args(argv)
    cases = CASES if not a.small else SMALL_CASES
    a.case_list = [c for c in a.cases.split(",") if c] if not a.small else list(SMALL_CASES)
    bad = [c for c in a.case_list if c not in cases]
    a.peer_list = [x for x in a.peers.split(",") if x]
    bad += [x for x in a.peer_list if x not in ("eager", "hf", "hf-fused")]
    if bad:
        p.error(f"unknown case or peer: {', '.join(bad)}")
    a.hf_batch_list = [int(x) for x in a.hf_batches.split(",") if x]
    if a.layers is None:
        a.layers = 2 if a.small else 32
    if a.layers < 1 or a.steps < 2:
        p.error("--layers must be >= 1 and --steps >= 2")
    a.case_table = cases
    return a


# --------------------------------------------------------------------------------------------------------------------
# helpers


class Run:
    def __init__(self, args, device):
        import torch
        self.args, self.device, self.t0 = args, device, time.time()
        self.name = common.device_name() if device.type == "cuda" else "cpu"
        self.rows, self.errors = [], []
        self.cuda = device.type == "cuda"
        self.torch = torch

    def left_s(self) -> float:
        return self.args.budget_s - (time.time() - self.t0)

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.1f} s] {msg}", flush=True)

    def add(self, **row) -> None:
        row["device"] = self.name
        self.rows.append(row)
        ms, floor = row.get("ms_per_token"), row.get("floor_ms")
        frac = f", {floor / ms:.0%} of the floor ({floor:.3f} ms)" if ms and floor else ""
        kern = f", {row['kernels_per_layer']:.1f} kernels/layer" if row.get("kernels_per_layer") else ""
        self.log(f"{self.name}: {row['case']} {row['impl']}: {ms:.3f} ms/token{frac}{kern}")

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()


def prompts(config, batch, length, image, device):
    """Random ids `[batch, length]`, one image span per prompt (positions 1 .. image, CogVLM's token types: the
    span's last token is a language-expert token) given as embeddings, and the vision mask."""
    import torch
    from fused_ops.models import get_expert_mask
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, config.vocab, (batch, length), generator=g)
    types = torch.zeros(batch, length, dtype=torch.long)
    types[:, 1:1 + image] = 1
    embeds = torch.randn(batch, length, config.hidden, generator=g).to(config.dtype)
    return dict(input_ids=ids.to(device), inputs_embeds=embeds.to(device), embeds_mask=(types == 1).to(device),
                vision_mask=get_expert_mask(types).to(device))


def step_bytes(config, batch, cached, dtype_bytes=2):
    """What a decode step reads: the text expert's weights, norms, LM head, the token embeddings, every KV."""
    c = config
    per_layer = (c.qkv_size * c.hidden + c.hidden * c.q_size + 3 * c.intermediate * c.hidden + 2 * c.hidden)
    weights = c.layers * per_layer + c.hidden + c.vocab * c.hidden + batch * c.hidden
    kv = batch * c.layers * 2 * c.kv_heads * c.head_dim * cached
    return (weights + kv) * dtype_bytes


def cuda_kernels(run, fn):
    """torch.profiler's CUDA kernel events of one call of `fn` (after one unprofiled call), copies and memsets left
    out; None without CUDA or with --no-profile."""
    if not run.cuda or run.args.no_profile:
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]


def count_kernels(run, fn, repeat=1):
    """CUDA kernels that `fn` launches (torch.profiler), over `repeat`."""
    kernels = cuda_kernels(run, fn)
    return None if kernels is None else len(kernels) / repeat


def kernel_breakdown(run, fn, ms_per_call=None, title="one step"):
    """Where one call of `fn` spends its device time: torch.profiler's CUDA kernels summed by name, printed largest
    first, with their share of `ms_per_call` (the measured time of a step) when given; what the kernels leave of it is
    the gaps between them (launch latency, dependencies). With programmatic dependent launch a kernel's time includes
    its wait for the one before it (they overlap), so the clean per-kernel times come from a call with it off.
    Returns {name: [us, launches]}."""
    kernels = cuda_kernels(run, fn)
    if kernels is None:
        return None
    agg = {}
    for e in kernels:
        slot = agg.setdefault(e.name[:70], [0.0, 0])
        slot[0] += e.time_range.elapsed_us()
        slot[1] += 1
    total = sum(us for us, _ in agg.values())
    launches = sum(n for _, n in agg.values())
    if ms_per_call:
        step_us = ms_per_call * 1e3
        run.log(f"  kernels of {title}: {total:.0f} us of device time in {launches} launches, {total / step_us:.0%} "
                f"of the {step_us:.0f} us step (the rest: gaps between kernels)")
    else:
        run.log(f"  kernels of {title}: {total:.1f} us of device time in {launches} launches")
    for name, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:12]:
        share = f" {us / (ms_per_call * 1e3):5.1%}" if ms_per_call else ""
        run.log(f"    {us:8.1f} us{share} x{n:<4d} {name}")
    return agg


# --------------------------------------------------------------------------------------------------------------------
# the engine


def bench_engine(run, lm, case, batch, length, image, label="engine (graph per step)"):
    import torch
    from fused_ops.models import GenerationEngine
    from fused_ops.models.generation import elapsed_ms
    steps, c = run.args.steps, lm.config
    p = prompts(c, batch, length, image, run.device)
    engine = GenerationEngine(lm, max_batch=batch, max_len=length + steps + 8, buckets=[batch])
    engine.generate(**p, prompt_lens=[min(16, length)] * batch, max_new_tokens=3)  # captures the graph (short prompts)
    timings = {}
    tokens = engine.generate(**p, max_new_tokens=steps + 1, timings=timings)
    if run.cuda:
        torch.cuda.synchronize()
    ms = elapsed_ms(timings, "decode") / timings["decode_steps"]
    assert tokens.shape == (batch, steps + 1)
    n = engine.bucket(batch)
    view, routing = engine._views[n], engine._routing[n]
    x = torch.randn(n, 1, c.hidden, device=run.device, dtype=c.dtype)
    text = engine._text[:n] if engine._text is not None else None
    kernels = count_kernels(run, lambda: lm.model.layers[0].decode(x, text, routing, view, 0))
    graph = next(iter(engine._graphs.values()), None)  # the greedy step of bucket n
    per_step = count_kernels(run, graph.replay) if graph is not None else None
    breakdown = kernel_breakdown(run, graph.replay, ms) if graph is not None else None
    if run.cuda:  # one layer's kernels with programmatic dependent launch off: each kernel's own time
        import fused_ops
        before = fused_ops.set_programmatic_launch(False)
        try:
            kernel_breakdown(run, lambda: lm.model.layers[0].decode(x, text, routing, view, 0),
                             title="one layer, eager, without PDL")
        finally:
            fused_ops.set_programmatic_launch(before)
    floor_ms = step_bytes(c, batch, length + steps / 2) / (run.bw_gbs * 1e6) if run.cuda else None
    run.add(case=case, impl=label if engine.cuda_graphs else label.replace("graph per step", "eager steps"), batch=batch,
            prompt=length, ms_per_token=ms, tokens_per_s=batch * 1e3 / ms, floor_ms=floor_ms,
            kernels_per_layer=kernels, kernels_per_step=per_step, kernel_us=breakdown,
            prefill_ms=elapsed_ms(timings, "prefill"))
    del engine, p
    run.free()


def bench_eager(run, lm, case, batch, length, image):
    """Today's eager fused decode: FusedCogVLM.forward with the KVCache, one token per step."""
    import torch
    from fused_ops.models import KVCache
    steps, c = run.args.steps, lm.config
    cache = KVCache(c, batch, length + steps + 2, device=run.device, dtype=c.dtype)
    cache.length = length  # its contents do not change the time: a zero cache of the prompt's length
    tok = torch.ones(batch, dtype=torch.long, device=run.device)
    text = torch.zeros(batch, 1, dtype=torch.bool, device=run.device) if c.vision_expert else None

    def step():
        nonlocal tok
        h = lm.model(lm.embed_tokens(tok)[:, None], text, cache=cache)
        tok = lm.lm_head(h[:, -1]).argmax(-1)

    with torch.no_grad():
        for _ in range(2):
            step()
        if run.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        if run.cuda:
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / steps
        else:
            ms = (time.perf_counter() - t) * 1e3 / steps
        x = torch.randn(batch, 1, c.hidden, device=run.device, dtype=c.dtype)
        routing = lm.model._routing(text) if c.vision_expert else None
        cache.length = length
        rope = lm.model._rope(length, 1, run.device)
        kernels = count_kernels(run, lambda: lm.model.layers[0](x, text, routing, rope, cache, 0))
    floor_ms = step_bytes(c, batch, length + steps / 2) / (run.bw_gbs * 1e6) if run.cuda else None
    run.add(case=case, impl="eager fused decode (today)", batch=batch, prompt=length, ms_per_token=ms,
            tokens_per_s=batch * 1e3 / ms, floor_ms=floor_ms, kernels_per_layer=kernels)
    del cache
    run.free()


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face


def hf_model(run, fused: bool):
    import torch
    import transformers
    layers = run.args.layers
    if run.args.small:
        cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=4096)
    else:  # meta-llama/Meta-Llama-3-8B's config.json
        cfg = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                   num_key_value_heads=8, max_position_embeddings=131072)
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    config = transformers.LlamaConfig(**cfg, num_hidden_layers=layers, rms_norm_eps=1e-5, hidden_act="silu",
                                      tie_word_embeddings=False, rope_parameters=rope, bos_token_id=1,
                                      eos_token_id=None, pad_token_id=0)
    dtype = torch.bfloat16 if run.cuda else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(run.device):
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    if fused:
        from fused_ops import hf
        hf.apply_fused_ops(model)
    return model


def bench_hf(run, case, batch, length, fused: bool):
    import torch
    import transformers
    steps = run.args.steps
    model = hf_model(run, fused)
    ids = torch.randint(1, model.config.vocab_size, (batch, length), device=run.device)
    marks = []

    class Mark(transformers.LogitsProcessor):  # called once per generated token, after its forward
        def __call__(self, input_ids, scores):
            if run.cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)
            else:
                marks.append(time.perf_counter())
            return scores

    class StopAfter(transformers.StoppingCriteria):
        def __init__(self, n):
            self.n, self.seen = n, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.seen += 1
            return torch.full((input_ids.shape[0],), self.seen >= self.n, dtype=torch.bool, device=input_ids.device)

    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=steps + 2, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    if run.cuda:
        kw["compile_config"] = transformers.CompileConfig(mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        model.generate(ids, **kw)  # compiles (CUDA), warms up
        marks.clear()
        model.generate(ids, logits_processor=[Mark()], **kw)
        if run.cuda:
            torch.cuda.synchronize()
            ms = marks[1].elapsed_time(marks[-1]) / (len(marks) - 2)  # from the first decode step's end on
        else:
            ms = (marks[-1] - marks[1]) * 1e3 / (len(marks) - 2)
        kernels = None
        if run.cuda and not run.args.no_profile:
            counts = [count_kernels(run, lambda n=n: model.generate(ids, stopping_criteria=[StopAfter(n)], **kw))
                      for n in (3, 7)]
            kernels = (counts[1] - counts[0]) / (4 * run.args.layers)
    name = "HF Llama-3-8B static cache" + (" + compile(reduce-overhead)" if run.cuda else " (eager: CPU)") + (
        " + apply_fused_ops" if fused else "")
    run.add(case=case, impl=name, batch=batch, prompt=length, ms_per_token=ms, tokens_per_s=batch * 1e3 / ms,
            kernels_per_layer=kernels)
    del model
    run.free()


# --------------------------------------------------------------------------------------------------------------------


def report(run) -> int:
    print(f"\n## Generation, {run.name}: ms per generated token ({run.args.layers} layers, {run.args.steps} timed "
          f"steps; copy bandwidth {getattr(run, 'bw_gbs', float('nan')):.0f} GB/s)\n")
    headers = ["device", "case", "implementation", "ms/token", "tokens/s", "floor ms", "of floor", "target",
               "kernels/layer"]
    rows, missed = [], []
    for r in run.rows:
        target = run.args.case_table[r["case"]][3] if r["impl"].startswith("engine") else None
        frac = r["floor_ms"] / r["ms_per_token"] if r.get("floor_ms") else None
        ok = "" if target is None or frac is None else ("met" if frac >= target else "MISSED")
        if ok == "MISSED":
            missed.append(f"{r['case']}: {frac:.0%} of the floor < {target:.0%}")
        rows.append([r["device"], r["case"], r["impl"], r["ms_per_token"], r["tokens_per_s"], r.get("floor_ms"),
                     None if frac is None else f"{frac:.0%}", "" if target is None else f">= {target:.0%} {ok}",
                     r.get("kernels_per_layer")])
    common.print_table(headers, rows, [None, None, None, ".3f", ".1f", ".3f", None, None, ".1f"])
    engine = {r["case"]: r for r in run.rows if r["impl"].startswith("engine")}
    for r in run.rows:
        if r["impl"].startswith("HF") and r["case"] in engine and "fused" not in r["impl"]:
            speedup = engine[r["case"]]["tokens_per_s"] / r["tokens_per_s"]
            line = f"{run.name}: {r['case']}: engine vs HF{' compiled' if run.cuda else ''}: {speedup:.2f}x tokens/s"
            if r["batch"] == 1 and run.cuda:
                line += f" (target >= {HF_SPEEDUP_TARGET}x: {'met' if speedup >= HF_SPEEDUP_TARGET else 'MISSED'})"
                if speedup < HF_SPEEDUP_TARGET:
                    missed.append(f"{r['case']}: {speedup:.2f}x the HF peer < {HF_SPEEDUP_TARGET}x")
            print(line)
    for e in run.errors:
        print(f"ERROR {e['where']}: {e['error']}")
    if missed:
        print(f"{run.name}: targets missed: " + "; ".join(missed))
    if run.args.out:
        os.makedirs(run.args.out, exist_ok=True)
        with open(os.path.join(run.args.out, "bench_generate.json"), "w") as f:
            json.dump({"device": run.name, "args": vars(run.args) | {"case_table": None}, "rows": run.rows,
                       "errors": run.errors}, f, indent=1, default=str)
    return 1 if run.errors else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not args.small and not torch.cuda.is_available():
        common.die_env("bench_generate", "no CUDA device (use --small for the CPU check)")
    import fused_ops  # noqa: F401 (registers the ops)
    from fused_ops.models import COGVLM2_19B, FusedCogVLMForCausalLM
    if not hasattr(torch.ops.fused, "decode_attention"):
        common.die_env("bench_generate", "this build of fused_ops has no torch.ops.fused.decode_attention")
    device = torch.device("cpu") if args.small else torch.device("cuda", torch.cuda.current_device())
    run = Run(args, device)
    if run.cuda:
        run.bw_gbs = common.copy_bandwidth(1 << 30)
        run.log(f"{run.name}: copy bandwidth {run.bw_gbs:.0f} GB/s (read + written)")
    config = COGVLM2_19B.replace(layers=args.layers)
    if args.small:
        config = config.replace(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, vocab=512,
                                dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        lm = FusedCogVLMForCausalLM(config, device=device)
        run.log(f"{run.name}: CogVLM2 LM, {args.layers} layers, "
                f"{sum(p.numel() for p in lm.parameters()) * lm.lm_head.weight.element_size() / 2**30:.1f} GiB")
        for case in args.case_list:
            batch, length, image, _ = args.case_table[case]
            try:
                bench_engine(run, lm, case, batch, length, image)
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                common.record_error(run.errors, f"{case} engine", e)
                run.free()
            if args.norm_ab:
                from fused_ops.models.cogvlm import RMSNorm
                fused_norm = RMSNorm.decode
                RMSNorm.decode = RMSNorm.forward  # F.rms_norm: the decode step before torch.ops.fused.rms_norm
                try:
                    bench_engine(run, lm, case, batch, length, image, label="A/B: engine (graph per step), torch's rms_norm")
                except Exception as e:  # noqa: BLE001
                    common.record_error(run.errors, f"{case} engine with torch's rms_norm", e)
                    run.free()
                finally:
                    RMSNorm.decode = fused_norm
            if "eager" in args.peer_list:
                if run.left_s() < 20:
                    run.log(f"{case} eager peer skipped (time budget)")
                else:
                    try:
                        bench_eager(run, lm, case, batch, length, image)
                    except Exception as e:  # noqa: BLE001
                        common.record_error(run.errors, f"{case} eager", e)
                        run.free()
        hf_cases = [c for c in args.case_list if args.case_table[c][0] in args.hf_batch_list]
        if any(x.startswith("hf") for x in args.peer_list) and hf_cases:
            del lm
            run.free()
        for peer in [x for x in args.peer_list if x.startswith("hf")]:
            for case in hf_cases:
                batch, length, _, _ = args.case_table[case]
                if run.left_s() < (90 if run.cuda else 0):
                    run.log(f"{case} {peer} skipped (time budget: --budget-s)")
                    continue
                try:
                    bench_hf(run, case, batch, length, fused=peer == "hf-fused")
                except Exception as e:  # noqa: BLE001
                    common.record_error(run.errors, f"{case} {peer}", e)
                    run.free()
    return report(run)


if __name__ == "__main__":
    sys.exit(main())
