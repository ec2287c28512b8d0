#!/usr/bin/env python3
"""The linear GEMM kernels of this tree against those of another tree, cell by cell over the matrix's projections:
the A/B behind a kernel change (a stream-K rule, a fixup, an epilogue) before any table is re-tuned.

    mkdir -p ab_base && git archive REV kernels | tar -x -C ab_base   # the other tree's kernels/ (git-ignored)
    python3 benchmarks/kernel_ab.py --base ab_base [--ms 1024,2048,8192] [--paths fwd,gi,gw] [--out DIR]
    python3 benchmarks/kernel_ab.py --base ab_base --force '{"stream_k": 1, "split": 0}'   # this tree's, forced

(On the lent GPU, name ab_base in the device tool's `carry`.) The base tree's kernels/ is imported as the package
`kernels_base` (its `kernels.` imports renamed), so both trees' Triton JIT kernels run in one process; needs triton
and a Hopper GPU, no extension build. Cells: linear_dual's forward (routed_linear_gather_tma_kernel, x gathered
inside: "fwd"), its grad-input GEMM (routed_linear_tma_kernel on the gathered dY with W transposed: "gi", the
gate/up projections' included) and the weight gradients (routed_grad_weight_tma_kernel on the gathered dY and X:
"gw", the gate/up and down projections' included) at the matrix models' projections (benchmarks/bench_matrix.py
MODELS), each mask and token count; a cell whose table entry is "off" (the forward then runs the gather copy and
routed_linear_tma_kernel) is left out. Both trees take this tree's sm_90 table config for the cell; --force
overrides keys of this tree's config only (not for "gw"). Every variant's output is checked against float64 first
(relative error < 1e-2; a wrong one is reported and counted). Timing: benchmarks/gemm_configs.py `interleaved` (each
variant a CUDA graph of three passes over three input sets, rounds in a fresh random order). Prints per cell the time
over cuBLAS (one GEMM on one expert's weight over every row; for "gw" dY^T X over every row) and new / base, per path
and M the geometric means; writes kernel_ab.json. No targets. Exit 2
without CUDA or with no base kernels, 1 if a variant was wrong.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from bench_matrix import MODELS, attention_projections, make_mask  # noqa: E402

BASE_PACKAGE = "kernels_base"


def load_base(base_dir: str, into: str):
    """The package `kernels_base`: the .py files of base_dir/kernels with `kernels.` imports renamed, written under
    `into` (a directory put on sys.path). Raises FileNotFoundError when base_dir holds no kernels/ package."""
    src = os.path.join(base_dir, "kernels")
    if not os.path.isfile(os.path.join(src, "gemm_tma.py")):
        raise FileNotFoundError(f"{src} holds no kernels package (gemm_tma.py)")
    dst = os.path.join(into, BASE_PACKAGE)
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if name.endswith(".py"):
            with open(os.path.join(src, name)) as f:
                text = f.read()
            text = text.replace("from kernels.", f"from {BASE_PACKAGE}.").replace("import kernels.",
                                                                                   f"import {BASE_PACKAGE}.")
            with open(os.path.join(dst, name), "w") as f:
                f.write(text)
    if into not in sys.path:
        sys.path.insert(0, into)
    importlib.invalidate_caches()
    return tuple(importlib.import_module(f"{BASE_PACKAGE}.{m}") for m in ("gemm_gather_tma", "gemm_tma", "grad_weight"))


def cells(models, ms, masks, paths):
    """(path, model, projection, M, N, K, mask) of every cell: fwd over QKV and the attention output, gi over those
    and the gate/up projections (n = in-features, reduction = out-features), gw over those and the down projection
    (the weight's [N, K] = [out-features, in-features])."""
    out = []
    for M in ms:
        for path in paths:
            for name, c in models.items():
                projs = attention_projections(c) + ([("gate_up", c["I"], c["H"])] if path in ("gi", "gw") else [])
                projs += [("down", c["H"], c["I"])] if path == "gw" else []
                for proj, n_out, k_in in projs:
                    N, K = (k_in, n_out) if path == "gi" else (n_out, k_in)
                    out += [(path, name, proj, M, N, K, mk) for mk in masks]
    return out


def launch_kwargs(cfg, sms, force=None):
    """Launcher keyword arguments of a table config (aot/config_table.py keys), with `force` applied first."""
    cfg = dict(cfg, **(force or {}))
    bm, bn, bk = cfg["block"]
    return dict(BM=bm, BN=bn, BK=bk, GROUP_M=cfg.get("group", 8), num_warps=cfg["warps"], num_stages=cfg["stages"],
                FLATTEN=bool(cfg.get("flatten")), SPLIT_TAIL=int(cfg.get("split", 0)),
                STREAM_K=int(cfg.get("stream_k", 0)), num_programs=sms)


def _errors(torch, variants, out, refs):
    """Each kernel variant's relative error against float64 on the first input set: `out` (NaN-poisoned first) after
    its first call, against every nonzero reference of refs ([(view of out, float64 reference)])."""
    errs = {}
    for v in ("base", "new"):
        out.fill_(float("nan"))
        variants[v][0]()
        torch.cuda.synchronize()
        errs[v] = max(((got.double() - ref).norm() / ref.norm()).item() for got, ref in refs if ref.norm() > 0)
    return errs


def linear_cell(torch, gather, base, new, cfg, force, sms, gi, M, N, K, mask, perm, seg):
    """The variants of one "fwd" or "gi" cell ({name: [a launch per input set]}: cuBLAS on one expert's weight over
    every row, the base and this tree's routed_linear_gather_tma_kernel (fwd, x gathered inside) or
    routed_linear_tma_kernel on the gathered rows with W transposed (gi); force applies to this tree's) and each
    kernel's relative error against float64 on the first input set."""
    sets = []
    for _ in range(3):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(*((2, K, N) if gi else (2, N, K)), device="cuda", dtype=torch.bfloat16) / K ** 0.5
        xg = gather(x, torch.empty(perm.shape[0], K, device="cuda", dtype=x.dtype), perm)
        sets.append(dict(x=x, w=w, xg=xg, out=torch.empty(M, N, device="cuda", dtype=x.dtype)))

    def kernel(mods, kw):
        if gi:
            return [lambda s=s: mods[1].launch_routed_linear_tma(s["xg"], s["w"], None, None, s["out"], perm, seg,
                                                                 w_transposed=True, **kw) for s in sets]
        return [lambda s=s: mods[0].launch_routed_linear_gather_tma(s["x"], s["w"], None, None, s["out"], perm, seg,
                                                                    **kw) for s in sets]
    cublas = ([lambda s=s: torch.matmul(s["x"], s["w"][0], out=s["out"]) for s in sets] if gi else
              [lambda s=s: torch.nn.functional.linear(s["x"], s["w"][0], out=s["out"]) for s in sets])
    variants = {"cublas": cublas, "base": kernel(base, launch_kwargs(cfg, sms)),
                "new": kernel(new, launch_kwargs(cfg, sms, force))}
    s0 = sets[0]
    w0, w1 = (s0["w"][0].double(), s0["w"][1].double()) if gi else (s0["w"][0].double().T, s0["w"][1].double().T)
    ref = torch.where(mask[:, None], s0["x"].double() @ w1, s0["x"].double() @ w0)
    return variants, _errors(torch, variants, s0["out"], [(s0["out"], ref)])


def grad_weight_cell(torch, gather, base_w, new_w, cfg, sms, M, N, K, mask, perm, seg):
    """The variants of one "gw" cell ({name: [a launch per input set]}: cuBLAS's dY^T X over every row, the base and
    this tree's routed_grad_weight_tma_kernel on the gathered dY and X, both experts) and each kernel's relative
    error against float64 on the first input set."""
    bn, bk, br = cfg["block"]
    kw = dict(BN=bn, BK=bk, BR=br, GROUP_N=cfg.get("group", 8), num_warps=cfg["warps"], num_stages=cfg["stages"])
    sets = []
    for _ in range(3):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        pad = perm.shape[0]
        sets.append(dict(x=x, dy=dy, xg=gather(x, torch.empty(pad, K, device="cuda", dtype=x.dtype), perm),
                         dyg=gather(dy, torch.empty(pad, N, device="cuda", dtype=x.dtype), perm),
                         dw=torch.empty(2, N, K, device="cuda", dtype=x.dtype)))

    def kernel(mod):
        # one program per SM, as the C++ launcher runs it, where the tree's launcher takes a grid size
        takes_grid = "num_programs" in inspect.signature(mod.launch_routed_grad_weight_tma).parameters
        grid = {"num_programs": sms} if takes_grid else {}
        return [lambda s=s: mod.launch_routed_grad_weight_tma(s["dyg"], s["xg"], seg, s["dw"][0], s["dw"][1], **kw,
                                                              **grid) for s in sets]
    variants = {"cublas": [lambda s=s: torch.matmul(s["dy"].T, s["x"], out=s["dw"][0]) for s in sets],
                "base": kernel(base_w), "new": kernel(new_w)}
    s0 = sets[0]
    sel = mask.double()[:, None]
    refs = [(s0["dy"].double() * (1 - sel)).T @ s0["x"].double(), (s0["dy"].double() * sel).T @ s0["x"].double()]
    return variants, _errors(torch, variants, s0["dw"], [(s0["dw"][0], refs[0]), (s0["dw"][1], refs[1])])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="a directory holding the other tree's kernels/ package")
    p.add_argument("--ms", default="1024,2048,8192")
    p.add_argument("--masks", default="rand50,all_text,span")
    p.add_argument("--paths", default="fwd,gi")
    p.add_argument("--models", default="", help="comma list of matrix models (default: all)")
    p.add_argument("--force", default="", help="JSON object of config keys for this tree's kernels only")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--budget-s", type=float, default=400.0, help="stop starting new cells after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    models = {k: v for k, v in MODELS.items() if not args.models or k in args.models.split(",")}
    todo = cells(models, [int(v) for v in args.ms.split(",")], args.masks.split(","), args.paths.split(","))
    if args.dry_run:
        for c in todo:
            print(*c)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("kernel_ab: no CUDA device", file=sys.stderr)
        return 2
    try:
        base = load_base(args.base, tempfile.mkdtemp(prefix="kernel_ab_"))
    except FileNotFoundError as e:
        print(f"kernel_ab: {e}", file=sys.stderr)
        return 2
    from gemm_configs import interleaved
    from aot import config_table as ct
    import kernels.gemm_gather_tma as new_g
    import kernels.gemm_tma as new_t
    import kernels.grad_weight as new_w
    new = (new_g, new_t, new_w)
    from kernels.gather_rows import launch_gather_rows
    from kernels.routing import route
    with open(os.path.join(ROOT, "aot", "configs", "sm90.json")) as f:
        table = json.load(f)
    force = json.loads(args.force) if args.force else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; base kernels from {args.base}; force {force}", flush=True)
    rows, wrong, t0 = [], 0, time.time()
    for path, name, proj, M, N, K, mk in todo:
        if time.time() - t0 > args.budget_s:
            print(f"kernel_ab: budget spent, {len(todo) - len(rows)} cells left", flush=True)
            break
        mask = make_mask(mk, M, torch.Generator().manual_seed(M + N + K), "cuda")
        perm, seg = route(mask, align=128)
        if path == "gw":
            cfg, cfg_force = ct.pick(table, "routed_grad_weight_tma_kernel", "half", M, n=N, k=K), None
            variants, errs = grad_weight_cell(torch, launch_gather_rows, base[2], new[2], cfg, sms, M, N, K, mask,
                                              perm, seg)
        else:
            gi = path == "gi"
            cfg = ct.pick(table, "routed_linear_tma_kernel" if gi else "routed_linear_gather_tma_kernel", "half", M,
                          n=N, k=K, wt=gi)
            if cfg.get("off"):
                continue
            cfg_force = force
            variants, errs = linear_cell(torch, launch_gather_rows, base, new, cfg, force, sms, gi, M, N, K, mask,
                                         perm, seg)
        for v, e in errs.items():
            if not e < 1e-2:
                wrong += 1
                print(f"kernel_ab: {v} is wrong at {path} {name} {proj} M={M} {mk}: relative error {e:.2e}",
                      file=sys.stderr)
        med, _ = interleaved(torch, variants, args.rounds)
        rows.append(dict(path=path, model=name, proj=proj, M=M, N=N, K=K, mask=mk, config=cfg, force=cfg_force,
                         us=med, err=errs))
        print(f"{path:3s} {name:15s} {proj:7s} M={M:5d} {mk:8s} cuBLAS {med['cublas']:8.1f} us  base "
              f"{med['base'] / med['cublas']:.3f}x  new {med['new'] / med['cublas']:.3f}x  new/base "
              f"{med['new'] / med['base']:.3f}", flush=True)
    for path in args.paths.split(","):
        for M in sorted({r["M"] for r in rows}):
            sel = [r for r in rows if r["path"] == path and r["M"] == M]
            if sel:
                def gm(k, sel=sel):
                    return math.exp(sum(math.log(r["us"][k] / r["us"]["cublas"]) for r in sel) / len(sel))
                print(f"{path} M={M}: {len(sel)} cells, over cuBLAS base {gm('base'):.3f} new {gm('new'):.3f}, "
                      f"new/base {gm('new') / gm('base'):.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernel_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
