#!/usr/bin/env python3
"""Two runs of the performance matrix, cell by cell: what a change did across every shape, not at one.

    python3 benchmarks/matrix_diff.py OLD/matrix.json NEW/matrix.json [--ops linear_bwd,ffn_bwd] [--show 8]

For each cell present in both runs (same op, shape, M and mask) the time of NEW over OLD in the cell's own terms: for
a compute cell (op / cuBLAS in the same run) NEW's ratio over OLD's, so each run's clock and cuBLAS cancel out; for a
bandwidth cell (decode, RoPE: fraction of copy bandwidth) OLD's fraction over NEW's. Below 1: NEW is faster. Prints
per op and kind the geometric mean over the cells, by token range (M <= 64, 256-2048, 4096 and up), the cells moved
most either way, and the cells only one run has. Runs on different cards, or one whose masks were drawn in run order
(matrices before bench_matrix.py seeded each cell's mask: meta "cell_masks"), are compared with a warning: their
cells are not paired. No GPU needed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_matrix import geomean  # noqa: E402

RANGES = (("M <= 64", 0, 64), ("256-2048", 65, 2048), ("4096+", 4096, 1 << 40))


def _key(c):
    return c["op"], c["shape"], c["M"], c["mask"]


def _time_ratio(old, new):
    """NEW's time over OLD's for one cell (< 1: NEW faster), or None where either has no value."""
    a, b = old.get("value"), new.get("value")
    if not a or not b or old.get("kind") != new.get("kind"):
        return None
    return b / a if new["kind"] in ("ratio_to_cublas",) else a / b


def compare(old: dict, new: dict, ops=None):
    """{(op, kind): {"cells": [(key, ratio)], "ranges": {name: geomean}, "geomean": g}}, and the keys only one run
    has."""
    olds = {_key(c): c for c in old["cells"] if "value" in c}
    news = {_key(c): c for c in new["cells"] if "value" in c}
    out = {}
    for k in sorted(olds.keys() & news.keys(), key=lambda k: (k[0], k[1], k[2], k[3])):
        if ops and k[0] not in ops:
            continue
        r = _time_ratio(olds[k], news[k])
        if r is None:
            continue
        out.setdefault((k[0], news[k]["kind"]), {"cells": []})["cells"].append((k, r))
    for v in out.values():
        rs = [r for _, r in v["cells"]]
        v["geomean"] = geomean(rs)
        v["ranges"] = {name: geomean([r for (_, _, m, _), r in v["cells"] if lo <= m <= hi])
                       for name, lo, hi in RANGES}
    only = (sorted(olds.keys() - news.keys()), sorted(news.keys() - olds.keys()))
    return out, only


def warnings(old: dict, new: dict):
    w = []
    d0, d1 = old.get("meta", {}).get("device"), new.get("meta", {}).get("device")
    if d0 != d1:
        w.append(f"different devices ({d0} / {d1}): ratios to each run's own cuBLAS, but not the same card")
    for name, run in (("OLD", old), ("NEW", new)):
        if not run.get("meta", {}).get("cell_masks"):
            w.append(f"{name}'s masks were drawn in run order: its random-mask cells are not paired with the other's")
    return w


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--ops", default="", help="comma list of ops (default: all)")
    p.add_argument("--show", type=int, default=5, help="cells moved most, each way, per op")
    a = p.parse_args(argv)
    with open(a.old) as f:
        old = json.load(f)
    with open(a.new) as f:
        new = json.load(f)
    for w in warnings(old, new):
        print(f"warning: {w}")
    res, (only_old, only_new) = compare(old, new, set(filter(None, a.ops.split(","))))
    print(f"{'op':12s} {'kind':18s} {'cells':>5s} {'new/old':>8s}  " + "  ".join(f"{n:>9s}" for n, _, _ in RANGES))
    for (op, kind), v in sorted(res.items()):
        ranges = "  ".join(f"{v['ranges'][n]:9.3f}" for n, _, _ in RANGES)
        print(f"{op:12s} {kind:18s} {len(v['cells']):5d} {v['geomean']:8.3f}  {ranges}")
    for (op, kind), v in sorted(res.items()):
        cells = sorted(v["cells"], key=lambda kr: kr[1])
        if a.show and cells:
            fmt = lambda kr: f"{kr[0][1]} M={kr[0][2]} {kr[0][3]} {kr[1]:.3f}"  # noqa: E731
            print(f"{op} {kind}: faster {', '.join(fmt(kr) for kr in cells[:a.show])}; "
                  f"slower {', '.join(fmt(kr) for kr in cells[::-1][:a.show])}")
    if only_old or only_new:
        print(f"cells only in OLD: {len(only_old)}, only in NEW: {len(only_new)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
