"""Which tile configs of a config table could fold into another config of the same table, at what measured cost:
the groundwork for compiling fewer variants (every distinct config of a table is compiled for every dtype, operand
path, epilogue and alignment of its kernel). No GPU: it reads the tuner's measurements.

    python -m aot.fold_report [--arch 90] [--device "NVIDIA H200"] [--tolerance 1.015] [--results R.jsonl]

For each bucket of a kernel's table (shape class and m range) it takes the measured m in that range and the shapes
of that class (aot/tune.py _scores: per config, the geometric mean of its time over the best measured time of each
shape), and the cost of serving the bucket with another config the table already compiles: that config's score
over the bucket's own. A config folds when every bucket that uses it has another table config within --tolerance
(greedily, the cheapest first, re-evaluated after each fold). Buckets with no measurement of their config or of any
other table config at their m are reported as unmeasured, and their config is kept. It prints per kernel and family
the configs that fold, their cost, and the variants (images per architecture) that would no longer be compiled.
"""
import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from aot import config_table as ct  # noqa: E402
from aot import manifest, tune  # noqa: E402


def _bucket_ranges(buckets):
    """[(bucket, class, lo, hi)]: each bucket's m range (lo, hi], a class's buckets starting again from 0."""
    out, lo, cls = [], 0, None
    for e in buckets:
        if ct.shape_class(e) != cls:
            lo, cls = 0, ct.shape_class(e)
        hi = e.get("max_m")
        out.append((e, cls, lo, hi))
        lo = hi if hi is not None else lo
    return out


def bucket_costs(done, kernel, fam, table, cfgs):
    """[(bucket cfg, {other cfg: cost}, measured m)] for every bucket that is not "off"."""
    buckets = ct.buckets(table, kernel, fam)
    classes = [c for c in dict.fromkeys(ct.shape_class(e) for e in buckets) if c != ct.GENERAL]
    measured_ms = sorted({r["m"] for (kk, _, _), r in done.items() if kk == kernel})
    out = []
    for e, cls, lo, hi in _bucket_ranges(buckets):
        if e.get("off"):
            continue
        own = ct.cfg_str(e)
        want = None if cls == ct.GENERAL else cls
        admit = (lambda n, k, wt, want=want: tune._owner(classes, n, k, wt) == want)  # noqa: E731
        scores = tune._scores(done, kernel, measured_ms, admit)
        ms = [m for m in scores if m is not None and m > lo and (hi is None or m <= hi) and own in scores[m][0]]
        costs = {}
        for alt in cfgs:
            if alt == own or not ms or not all(alt in scores[m][0] for m in ms):
                continue
            if kernel in ct.ROWS_IN_ONE_BLOCK and hi is not None and int(alt.split("x")[0]) < hi:
                continue  # a decode bucket's rows must fit the config's BLOCK_M
            costs[alt] = math.exp(sum(math.log(scores[m][0][alt] / scores[m][0][own]) for m in ms) / len(ms))
        out.append((own, costs, ms))
    return out


def fold(done, kernel, fam, table, tolerance):
    """Greedy folds of (kernel, fam): [(config folded, into {bucket m: target}, worst cost)] and the configs kept."""
    cfgs = list(dict.fromkeys(ct.cfg_str(e) for e in ct.buckets(table, kernel, fam) if not e.get("off")))
    folds = []
    while True:
        rows = bucket_costs(done, kernel, fam, table, cfgs)
        best = None
        for c in cfgs:
            mine = [(costs, ms) for own, costs, ms in rows if own == c]
            if not mine or any(not ms or not costs for costs, ms in mine):
                continue  # unmeasured somewhere: kept
            worst = max(min(costs.values()) for costs, _ in mine)
            if worst <= tolerance and (best is None or worst < best[1]):
                best = (c, worst, [min(costs, key=costs.get) for costs, _ in mine])
        if best is None:
            return folds, cfgs
        c, worst, targets = best
        folds.append((c, sorted(set(targets)), worst))
        cfgs = [x for x in cfgs if x != c]
        # the folded config's buckets now use their target: rewrite the table's copy for the next round
        table = _retarget(table, kernel, fam, c, rows)


def _retarget(table, kernel, fam, folded, rows):
    import copy
    t = copy.deepcopy(table)
    buckets = t["kernels"][kernel][fam]
    it = iter(rows)
    for e in buckets:
        if e.get("off"):
            continue
        own, costs, _ = next(it)
        if own == folded:
            target = min(costs, key=costs.get)
            src = next(b for b in ct.buckets(table, kernel, fam) if not b.get("off") and ct.cfg_str(b) == target)
            for f in ct.CONFIG_FIELDS:
                e.pop(f, None)
                if f in src:
                    e[f] = copy.deepcopy(src[f])
    return t


def images_per_config(arch):
    """(kernel, cfg) -> variants compiled for arch (every dtype, flag, epilogue and alignment)."""
    out = {}
    for v in manifest.variants():
        if arch in v.archs and "cfg" in v.key:
            out[(v.name, v.key["cfg"])] = out.get((v.name, v.key["cfg"]), 0) + 1
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--device", default="NVIDIA H200")
    p.add_argument("--tolerance", type=float, default=1.015, help="largest cost of a fold (time ratio)")
    p.add_argument("--results", default=os.path.join(ROOT, "aot", "configs", "sm90.measurements.jsonl"))
    a = p.parse_args(argv)
    table = ct.load(a.arch)
    done = tune.load_results(a.results, a.device)
    images = images_per_config(a.arch)
    saved = 0
    print(f"sm_{a.arch}, {a.device}'s measurements ({len(done)} records), tolerance {a.tolerance}")
    for kernel, fams in table["kernels"].items():
        for fam in fams:
            folds, kept = fold(done, kernel, fam, table, a.tolerance)
            for c, targets, worst in folds:
                n = images.get((kernel, c), 0)
                saved += n
                print(f"  {kernel} {fam}: {c} -> {', '.join(targets)} (worst bucket {worst:.3f}x; {n} variants)")
    print(f"variants no longer compiled: {saved} of {sum(images.values())} with a config")


if __name__ == "__main__":
    main()
