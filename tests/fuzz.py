"""Random cases of every op, each checked against the CPU path of the same op in float64 (issue 33).

    python tests/fuzz.py --device cuda --seed 1 --cases 2000      # what tests/test_fuzz.py runs in the GPU tier
    python tests/fuzz.py --device cuda --seed 7 --minutes 30      # soak: cases until the time is up, memory tracked
    python tests/fuzz.py --device cuda --replay 123457            # one case again, verbose (seeds are printed)
    python tests/fuzz.py --device cuda --sanitizer                # a few tiny cases, for compute-sanitizer

A case is a function of its seed alone (the same case on any device): an op (rope_fwd / rope_bwd /
rope_fwd_qk / rope_fwd_ / route / linear_dual / ffn, forward, the backward op with a random output_mask, or autograd),
sizes (M from 0 to 20000, mostly small; K, N, H, I, head dims odd or multiples of 16 bytes, sometimes 0), a dtype,
a mask (random, a span, all one expert, empty), x and weight layouts (strided, sliced and transposed views whose gaps
hold NaN, the dual expert's weights as views of [2, R, C] in either order or as separate tensors), a routing given or
not, autocast on or off. The reference is the op's own CPU path in float64 on the same values (rounded to the dtype
the op computes in); the check is ||out - ref|| / ||ref|| per output against a per-dtype tolerance, the same shapes,
dtypes and defined outputs, and a second device run giving bitwise the same results.
"""
import argparse
import contextlib
import math
import os
import random
import resource
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import fused_ops  # noqa: E402,F401  (registers torch.ops.fused.*)
from reference_routed import rel_err  # noqa: E402

OPS = torch.ops.fused
F64 = torch.float64
#: relative-error tolerance by the dtype the op computes in (tests/test_ffn_ops.py's; RoPE rounds once)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
TOL_TF32 = 5e-3
ROPE_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ------------------------------------------------------------------------------------------------------------------
# drawing a case: plain data (printable), a function of (seed, device type, tiny)


def _m(r, tiny):
    if tiny:
        return r.choice([0, 1, 2, 7, 16, 33, 40])
    u = r.random()
    if u < 0.03:
        return 0
    if u < 0.58:
        return r.randint(1, 64)
    if u < 0.88:
        return r.randint(65, 600)
    if u < 0.97:
        return r.choice([r.randint(601, 4096), r.randint(4090, 4100)])  # across the one-block routing's limit
    return r.randint(4097, 20000)


def _dim(r, tiny, big_m):
    """An inner size: odd, or a multiple of 16 elements (the sm_90 TMA kernels), rarely 0; smaller for long M."""
    hi = 24 if tiny else (32 if big_m else 160)
    u = r.random()
    if u < 0.02:
        return 0
    if u < 0.5:
        step = 16
        return step * r.randint(1, max(1, hi // step))
    return r.randint(1, hi)


def draw_case(seed: int, device_type: str = "cuda", tiny: bool = False) -> dict:
    r = random.Random(seed)
    c = {"seed": seed}
    c["op"] = r.choices(["rope", "route", "linear_dual", "ffn"], [30, 5, 30, 35])[0]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    c["dtype"] = r.choices(dtypes, [40, 30, 30])[0]
    c["allow_tf32"] = c["dtype"] == torch.float32 and r.random() < 0.5
    M = _m(r, tiny)
    big = M > 600
    if c["op"] == "rope":
        c["format"] = r.choice(["sbhd", "bshd", "thd"])
        c["mode"] = r.choice(["fwd", "bwd", "qk", "qk_bwd", "inplace", "autograd"])
        c["cp"] = r.choice([1, 1, 1, 2, 3])
        c["cp_rank"] = r.randrange(c["cp"])
        unit = 2 * c["cp"] if c["cp"] > 1 else 1
        if c["format"] == "thd":
            n = r.randint(1, 5)
            c["lens"] = [unit * r.randint(0, max(1, M // (n * unit) + 1)) for _ in range(n)]
            c["b"] = n
        else:
            c["b"] = r.randint(1, 4)
            c["s"] = unit * max(0 if M == 0 else 1, M // (c["b"] * unit))
        c["heads"], c["kv_heads"] = r.randint(1, 2 if big else 6), r.randint(1, 3)
        c["d"] = r.randint(1, 20 if tiny else 80) * 2 - r.randint(0, 1)
        c["d2"] = 2 * r.randint(1, c["d"] // 2) if c["d"] >= 2 else 2
        c["d"] = max(c["d"], c["d2"])
        c["interleaved"] = r.random() < 0.3
        c["start"] = r.random() < 0.3
        c["layout"] = r.choice(["contig", "transposed", "strided", "sliced"])
        return c
    c["lead"] = [M] if r.random() < 0.7 or M == 0 else _split(M, r)
    c["mask"] = r.choice(["random", "random", "span", "all_true", "all_false"])
    c["p"] = r.random()
    c["x_layout"] = r.choice(["contig", "contig", "transposed", "sliced", "strided"])
    c["w_layout"] = r.choice(["views", "views", "views_swapped", "separate"])
    if c["op"] == "route":
        return c
    c["mode"] = r.choice(["fwd", "bwd_op", "autograd"])
    c["autocast"] = None
    if c["mode"] != "bwd_op" and r.random() < 0.2:  # fp32 inputs, the op runs in the region's dtype
        c["autocast"], c["dtype"], c["allow_tf32"] = r.choice([torch.bfloat16, torch.float16]), torch.float32, False
    c["routing"] = r.random() < 0.3
    if c["op"] == "linear_dual":
        c["K"], c["N"] = _dim(r, tiny, big), _dim(r, tiny, big)
        c["bias"] = [r.random() < 0.5, r.random() < 0.5]
        c["output_mask"] = [r.random() < 0.7 for _ in range(5)]
    else:
        c["H"], c["I"] = _dim(r, tiny, big), _dim(r, tiny, big)
        c["dual"] = r.random() < 0.7
        c["routing"] = c["routing"] and c["dual"]
        c["output_mask"] = [r.random() < 0.7 for _ in range(7)]
    c["requires_grad"] = [r.random() < 0.7 for _ in range(8)]
    if c["op"] == "ffn":  # drawn last, so that the earlier seeds' cases keep their other draws
        c["recompute"] = r.random() < 0.5
    return c


def _split(M, r):
    divs = [d for d in range(2, min(M, 64) + 1) if M % d == 0]
    b = r.choice(divs) if divs else 1
    return [b, M // b]


def describe_case(c: dict) -> str:
    return ", ".join(f"{k}={NAME.get(v, v) if isinstance(v, torch.dtype) else v}" for k, v in c.items())


# ------------------------------------------------------------------------------------------------------------------
# building inputs: values from the case's CPU generator; the device copy in the case's layout, the reference copy
# float64 on the CPU


def _place(v: torch.Tensor, layout: str, device, dtype) -> torch.Tensor:
    """v's values (rounded to dtype) on device, in a memory layout; the gaps of strided / sliced storage hold NaN."""
    v = v.to(dtype)
    if layout == "transposed" and v.dim() >= 2:
        return v.transpose(0, 1).contiguous().to(device).transpose(0, 1)
    if layout in ("sliced", "strided") and v.dim() >= 1 and v.is_floating_point():
        C = v.shape[-1]
        width, sl = (C + 11, slice(3, 3 + C)) if layout == "sliced" else (2 * C, slice(0, 2 * C, 2))
        big = torch.full((*v.shape[:-1], width), float("nan"), dtype=dtype)
        big[..., sl] = v
        return big.to(device)[..., sl]
    return v.to(device).contiguous()


class Inputs:
    """The case's tensors twice: `dev` (device, layouts, dtype) and `ref` (CPU float64, rounded like the op)."""

    def __init__(self, c: dict, device):
        self.g = torch.Generator().manual_seed(c["seed"])
        self.c, self.device = c, device
        self.dev, self.ref = {}, {}
        self.in_dtype = c["dtype"]
        self.compute = c.get("autocast") or c["dtype"]

    def rand(self, name, *shape, scale=1.0, layout="contig"):
        v = torch.randn(*shape, generator=self.g) * scale
        self.dev[name] = _place(v, layout, self.device, self.in_dtype)
        self.ref[name] = v.to(self.compute).to(F64)

    def exact(self, name, v):  # masks, integer tensors, freqs: the same values everywhere
        self.dev[name], self.ref[name] = v.to(self.device), v


def _mask(c, g):
    M = math.prod(c["lead"])
    kind = c["mask"]
    if kind == "random":
        m = torch.rand(M, generator=g) < c["p"]
    elif kind == "span":
        m = torch.zeros(M, dtype=torch.bool)
        m[M // 4: M // 4 + max(1, M // 3)] = True
    else:
        m = torch.full((M,), kind == "all_true", dtype=torch.bool)
    return m.reshape(c["lead"])


def _dual_weights(inp, c, names, shape, scale):
    """(vision, text) weight pairs: views of one [2, R, C] tensor (text first, or swapped) or separate tensors."""
    g = inp.g
    for vis, txt in names:
        v, t = torch.randn(*shape, generator=g) * scale, torch.randn(*shape, generator=g) * scale
        inp.ref[vis], inp.ref[txt] = v.to(inp.compute).to(F64), t.to(inp.compute).to(F64)
        if c["w_layout"] == "separate":
            lays = random.Random(c["seed"] + 1).choices(["contig", "transposed", "sliced"], k=2)
            inp.dev[vis], inp.dev[txt] = (_place(w, lay, inp.device, inp.in_dtype) for w, lay in zip((v, t), lays))
        else:
            swapped = c["w_layout"] == "views_swapped"
            stack = _place(torch.stack([v, t] if swapped else [t, v]), "contig", inp.device, inp.in_dtype)
            inp.dev[vis], inp.dev[txt] = (stack[0], stack[1]) if swapped else (stack[1], stack[0])


# ------------------------------------------------------------------------------------------------------------------
# the calls: one function per op family, run on `inp.dev` and on `inp.ref` alike; each returns [(name, tensor | None)]


def _grads(out, leaves, gy):
    grads = torch.autograd.grad(out, [t for t, _ in leaves], gy, allow_unused=True)
    return [(f"grad {n}", g) for (_, n), g in zip(leaves, grads)]


def _routed_call(c, T, on_device):
    """linear_dual or ffn, per c["mode"]; T: one of the Inputs dicts."""
    ac = c.get("autocast") if on_device else None
    region = torch.autocast(T["x"].device.type, dtype=ac) if ac else contextlib.nullcontext()
    mask = T["mask"]
    routing = OPS.route(mask) if c["routing"] else None
    if c["op"] == "linear_dual":
        ws = [T["wv"], T["wt"]]
        bs = [T.get("bv"), T.get("bt")]
        if c["mode"] == "bwd_op":
            res = OPS.linear_dual_backward(T["gy"], T["x"], mask, *ws, c["allow_tf32"], c["output_mask"], routing)
            return [(f"grad[{i}]", t) for i, t in enumerate(res)]
        names = ["x", "wv", "wt", "bv", "bt"]

        def fwd(x, wv, wt, bv, bt):
            return OPS.linear_dual(x, mask, wv, wt, bv, bt, c["allow_tf32"], routing)
        args = [T["x"], *ws, *bs]
    else:
        dual = c["dual"]
        ws = [T["w1"], T["w3"], T["w2"]] + ([T["u1"], T["u3"], T["u2"]] if dual else [None] * 3)
        if c["mode"] == "bwd_op":
            res = OPS.ffn_backward(T["gy"], T["x"], *ws[:3], mask if dual else None, *ws[3:], c["allow_tf32"],
                                   c["output_mask"], routing)
            return [(f"grad[{i}]", t) for i, t in enumerate(res)]
        names = ["x", "w1", "w3", "w2", "u1", "u3", "u2"]

        def fwd(x, w1, w3, w2, u1, u3, u2):
            return OPS.ffn(x, w1, w3, w2, mask if dual else None, u1, u3, u2, c["allow_tf32"], routing,
                           c.get("recompute", False))
        args = [T["x"], *ws]
    if c["mode"] == "fwd":
        with region:
            return [("out", fwd(*args))]
    leaves = []
    for i, (a, n) in enumerate(zip(args, names)):
        if a is not None and c["requires_grad"][i]:
            a = a.detach().requires_grad_(True)
            leaves.append((a, n))
        args[i] = a
    with torch.enable_grad(), region:
        out = fwd(*args)
    res = [("out", out.detach())]
    if leaves:
        res += _grads(out, leaves, T["gy"].to(out.dtype))
    return res


def _rope_call(c, T, on_device):
    fmt, il, cp, rank = c["format"], c["interleaved"], c["cp"], c["cp_rank"]
    opt = (fmt, il, T.get("cu"), T.get("sp"), cp, rank)
    mode = c["mode"]
    if mode == "fwd":
        return [("out", OPS.rope_fwd(T["t"], T["freqs"], *opt))]
    if mode == "bwd":
        return [("out", OPS.rope_bwd(T["t"], T["freqs"], *opt))]
    if mode in ("qk", "qk_bwd"):
        op = OPS.rope_fwd_qk if mode == "qk" else OPS.rope_bwd_qk
        q, k = op(T["t"], T["k"], T["freqs"], *opt)
        return [("q", q), ("k", k)]
    if mode == "inplace":
        t = T["t"].clone()
        OPS.rope_fwd_(t, T["freqs"], *opt)
        return [("t", t)]
    t = T["t"].detach().requires_grad_(True)
    with torch.enable_grad():
        out = OPS.rope_fwd(t, T["freqs"], *opt)
    return [("out", out.detach())] + _grads(out, [(t, "t")], T["k_like_out"].to(out.dtype))


def build(c: dict, device) -> Inputs:
    inp = Inputs(c, device)
    g = inp.g
    if c["op"] == "rope":
        b, H, D, d2 = c["b"], c["heads"], c["d"], c["d2"]
        if c["format"] == "thd":
            rows = sum(c["lens"]) // c["cp"]
            lead = [rows]
            cu = torch.tensor([0] + list(_cumsum(c["lens"])), dtype=torch.int32)
            inp.exact("cu", cu)
            need = max([ln for ln in c["lens"]] + [1])
        else:
            lead = [c["s"], b] if c["format"] == "sbhd" else [b, c["s"]]
            need = c["s"] * c["cp"]
        starts = torch.randint(0, 9, (b,), generator=g, dtype=torch.int32)
        if c["start"]:
            inp.exact("sp", starts)
        s_max = need + (int(starts.max()) if c["start"] and b else 0) + int(torch.randint(0, 4, (1,), generator=g))
        inp.exact("freqs", (torch.rand(max(s_max, 1), 1, 1, d2, generator=g) * 8).to(torch.float32))
        inp.rand("t", *lead, H, D, layout=c["layout"])
        inp.rand("k", *lead, c["kv_heads"], D, layout=c["layout"])
        inp.rand("k_like_out", *lead, H, D)
        return inp
    m = _mask(c, g)
    inp.exact("mask", m)
    lead = c["lead"]
    if c["op"] == "route":
        return inp
    if c["op"] == "linear_dual":
        K, N = c["K"], c["N"]
        inp.rand("x", *lead, K, layout=c["x_layout"])
        _dual_weights(inp, c, [("wv", "wt")], (N, K), 1 / math.sqrt(max(K, 1)))
        for name, on in zip(("bv", "bt"), c["bias"]):
            if on:
                inp.rand(name, N, scale=0.5)
        inp.rand("gy", *lead, N)
    else:
        H, I = c["H"], c["I"]  # noqa: E741
        inp.rand("x", *lead, H, layout=c["x_layout"])
        pairs = [("w1", "u1"), ("w3", "u3")]
        _dual_weights(inp, c, pairs, (I, H), 1 / math.sqrt(max(H, 1)))
        _dual_weights(inp, c, [("w2", "u2")], (H, I), 1 / math.sqrt(max(I, 1)))
        inp.rand("gy", *lead, H)
    return inp


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def call(c: dict, T: dict, on_device: bool):
    if c["op"] == "rope":
        return _rope_call(c, T, on_device)
    if c["op"] == "route":
        return [("routing", OPS.route(T["mask"]))]
    return _routed_call(c, T, on_device)


_call = call  # the CPU path's own calls (tests replace `call` to plant device faults)


# ------------------------------------------------------------------------------------------------------------------
# checking


def expected_dtype(c, name):
    if c["op"] == "route":
        return torch.int32
    if c.get("autocast") and name == "out":
        return c["autocast"]
    return c["dtype"]


def tolerance(c):
    if c["op"] == "rope":
        return ROPE_TOL[c["dtype"]]
    if c.get("allow_tf32"):
        return TOL_TF32
    return TOL[c.get("autocast") or c["dtype"]]


def _same_dtype_cpu(c, name):
    """The relative error of the op's CPU path in the case's own dtype, for the output `name`: how well the
    problem is conditioned (a sum that cancels loses the same digits there)."""
    inp = build(c, "cpu")
    cpu = dict(_call(c, inp.dev, True))[name]
    return rel_err(cpu, dict(_call(c, inp.ref, False))[name])


def _tf32(t):
    """t rounded as a TF32 tensor core reads it (10 mantissa bits, to nearest), back in float64."""
    i = t.to(torch.float32).view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32).to(F64)


def _rounded_ffn(c, T):
    """{output name: float64 tensor} of an ffn case computed as the CUDA op rounds: float64 math, every intermediate
    the kernels store (gate and up, h, dh, d_gate, d_up, each GEMM's output) rounded to the compute dtype, and with
    allow_tf32 every GEMM operand rounded to TF32. Its distance
    to the exact reference is how much of the problem's conditioning the op's roundings alone cost (a gradient of
    H = 1 sums I products that may cancel)."""
    dt = c.get("autocast") or c["dtype"]
    R = lambda t: t.to(dt).to(F64)  # noqa: E731
    # allow_tf32 (fp32): every GEMM operand as the tensor cores read it
    G = _tf32 if c.get("allow_tf32") else (lambda t: t)  # noqa: E731
    H = T["x"].shape[-1]
    x, dy = T["x"].reshape(-1, H), T["gy"].reshape(-1, H)
    # the single expert's w* serve every row (as the vision expert's rows here)
    vision = T["mask"].reshape(-1) if c["dual"] else torch.ones(x.shape[0], dtype=torch.bool)
    ws = {n: T[n] for n in ("w1", "w3", "w2", "u1", "u3", "u2") if T.get(n) is not None}
    out, gx = torch.zeros_like(x), torch.zeros_like(x)
    grads = {}
    for names, rows in ((("w1", "w3", "w2"), vision), (("u1", "u3", "u2"), ~vision)):
        if names[0] not in ws:
            continue
        w1, w3, w2 = (ws[n] for n in names)
        xe, dye = x[rows], dy[rows]
        g, u = R(G(xe) @ G(w1).T), R(G(xe) @ G(w3).T)
        s = torch.sigmoid(g)
        act = g * s
        h = R(act * u)
        out[rows] = R(G(h) @ G(w2).T)
        dh = R(G(dye) @ G(w2))
        dup, dgate = R(dh * act), R(dh * u * (s + act * (1 - s)))
        gx[rows] = R(R(G(dgate) @ G(w1)) + R(G(dup) @ G(w3)))
        grads.update({names[0]: R(G(dgate).T @ G(xe)), names[1]: R(G(dup).T @ G(xe)), names[2]: R(G(dye).T @ G(h))})
    res = {"out": out.reshape(T["x"].shape), "grad x": gx.reshape(T["x"].shape)}
    res.update({f"grad {n}": t for n, t in grads.items()})
    order = ["grad x", "grad w1", "grad w3", "grad w2", "grad u1", "grad u3", "grad u2"]
    res.update({f"grad[{i}]": res.get(n) for i, n in enumerate(order)})
    return res


def _error_bound(c, name, ref, tol):
    """The bound of an output off the CPU: the dtype's tolerance, or what computing `name` in the case's own dtype
    costs, with a margin: 4x the op's CPU path in that dtype (fp32 math, one rounding), and for ffn 3x the CUDA op's
    own rounding points (_rounded_ffn: its typical bf16 error, ~3e-3, then sits at the tolerance)."""
    bound = max(tol, 4 * _same_dtype_cpu(c, name))
    if c["op"] == "ffn":
        rounded = _rounded_ffn(c, build(c, "cpu").ref).get(name)
        if rounded is not None:
            bound = max(bound, 3 * rel_err(rounded, ref))
    return bound


def run_case(c: dict, device, verbose: bool = False, repeat: bool = True):
    """Failure lines of one case (empty: passed). An output passes with a relative error <= the dtype's tolerance,
    or, off the CPU, <= a few times the error of the same computation in the case's own dtype (_error_bound: an
    ill-conditioned output, e.g. a tiny shape whose sums cancel, loses as many digits there). repeat: also a second
    device run, which must give the same bits."""
    try:
        inp = build(c, device)
        got = call(c, inp.dev, True)
        again = call(c, inp.dev, True) if repeat else got
        want = call(c, inp.ref, False)
    except Exception:  # noqa: BLE001  (an op that raises on valid inputs is a failure of the case)
        return [f"raised:\n{traceback.format_exc()}"]
    fails = []
    if [n for n, _ in got] != [n for n, _ in want]:
        return [f"outputs {[n for n, _ in got]} vs reference {[n for n, _ in want]}"]
    tol = tolerance(c)
    for (name, g), (_, w), (_, a) in zip(got, want, again):
        if (g is None) != (w is None):
            fails.append(f"{name}: defined {g is not None}, reference {w is not None}")
            continue
        if g is None:
            continue
        if g.shape != w.shape or g.device.type != torch.device(device).type:
            fails.append(f"{name}: shape {tuple(g.shape)} on {g.device}, reference {tuple(w.shape)}")
            continue
        want_dt = torch.float32 if name.startswith("grad ") and c.get("autocast") else expected_dtype(c, name)
        if g.dtype != want_dt:
            fails.append(f"{name}: dtype {g.dtype}, expected {want_dt}")
        if not torch.equal(g, a):
            fails.append(f"{name}: a second run gave other bits ({int((g != a).sum())} elements)")
        if c["op"] == "route":
            if not torch.equal(g.cpu(), w):
                fails.append(f"{name}: differs from the CPU routing in {int((g.cpu() != w).sum())} entries")
            continue
        if not torch.isfinite(g).all():
            fails.append(f"{name}: {int((~torch.isfinite(g)).sum())} non-finite values")
            continue
        err = rel_err(g, w)
        bound = tol if err <= tol or g.device.type == "cpu" else _error_bound(c, name, w, tol)
        if verbose:
            print(f"  {name}: {tuple(g.shape)} {g.dtype}, relative error {err:.3g} (bound {bound:.3g})")
        if not err <= bound:
            fails.append(f"{name}: relative error {err:.3g} > {bound:.3g} (tolerance {tol:g}, or the error of the "
                         f"same computation in {NAME.get(c.get('autocast') or c['dtype'])} with a margin)")
    return fails


def run_many(seeds, device, tiny=False, log=print, repeat=True):
    """(cases run, failure lines); each failure line names the seed and how to replay it."""
    failures, n = [], 0
    dev_type = torch.device(device).type
    for seed in seeds:
        c = draw_case(seed, dev_type, tiny)
        fails = run_case(c, device, repeat=repeat)
        n += 1
        if fails:
            line = (f"FAIL seed={seed} device={device}: {describe_case(c)}\n    " + "\n    ".join(fails) +
                    f"\n    replay: python tests/fuzz.py --device {device} --replay {seed}{' --tiny' if tiny else ''}")
            failures.append(line)
            log(line)
    return n, failures


#: compute-sanitizer subset: tiny cases (M <= 40, inner sizes <= 24) from fixed seeds, every op family; one device
#: run each (a sanitizer multiplies every launch's time)
SANITIZER_SEEDS = range(900_000, 900_032)


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _mem(device):
    if torch.device(device).type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) / 2**20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=0.0, help="soak: run cases until this much time has passed")
    ap.add_argument("--replay", type=int, help="run the case of this seed, verbose")
    ap.add_argument("--tiny", action="store_true", help="tiny cases (what --sanitizer runs)")
    ap.add_argument("--sanitizer", action="store_true", help="the compute-sanitizer subset")
    a = ap.parse_args(argv)
    dev = a.device
    if a.replay is not None:
        c = draw_case(a.replay, torch.device(dev).type, a.tiny)
        print(f"seed {a.replay} on {dev}: {describe_case(c)}")
        fails = run_case(c, dev, verbose=True)
        print("\n".join(fails) if fails else "PASS")
        return 1 if fails else 0
    if a.sanitizer:
        n, fails = run_many(SANITIZER_SEEDS, dev, tiny=True, repeat=False)
        print(f"sanitizer subset: {n} tiny cases, {len(fails)} failures")
        return 1 if fails else 0
    t0, n, fails, seed = time.time(), 0, [], a.seed
    mem0, rss0, last = None, _rss_mb(), t0
    while (a.minutes and time.time() - t0 < 60 * a.minutes) or (not a.minutes and n < a.cases):
        k, f = run_many(range(seed, seed + (50 if a.minutes else min(50, a.cases - n))), dev, a.tiny)
        n, seed = n + k, seed + k
        fails += f
        if mem0 is None:  # after the first batch: kernels loaded, allocator warm
            mem0, rss0 = _mem(dev), _rss_mb()
        if time.time() - last > 60:
            last = time.time()
            print(f"{n} cases, {len(fails)} failures, {time.time() - t0:.0f} s; device memory allocated "
                  f"{_mem(dev):.1f} MiB (after warm-up {mem0:.1f}), host RSS {_rss_mb():.0f} MiB (after {rss0:.0f})",
                  flush=True)
    print(f"SUMMARY seeds {a.seed}..{seed - 1} on {dev}: {n} cases, {len(fails)} failures, {time.time() - t0:.0f} s; "
          f"device memory allocated {_mem(dev):.1f} MiB (after warm-up {mem0:.1f}); host RSS {_rss_mb():.0f} MiB "
          f"(after warm-up {rss0:.0f})")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
