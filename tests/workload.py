"""A fixed mix of every op on fixed inputs, for the reliability tests: many threads against a sequential run
(tests/test_threads.py, scripts/thread_check.py), soak and determinism (tests/test_reliability.py).

`make_inputs(seed, device, sizes)` builds the inputs from a CPU generator, so the same seed gives bitwise the same
tensors on any device and in any thread. `run_ops(inp)` makes every call once, in a fixed order, and returns
`[(name, tensor or None), ...]` (`issue_ops`: only the calls of issue 33's check). `compare(got, want, inp)` compares
two such lists bitwise (torch.equal) and describes each mismatch precisely enough to locate it: how many elements, by
how many bf16/fp16 ulps, which rows (tokens, and whether vision or text) or which weight tiles. `sequential` and
`run_threads` are the two sides of the thread checks.
"""
import contextlib
import dataclasses
import itertools
import threading
import traceback
from typing import Callable, List, Optional, Tuple

import torch

import fused_ops  # noqa: F401  (registers torch.ops.fused.*)

OPS = torch.ops.fused
Results = List[Tuple[str, Optional[torch.Tensor]]]


@dataclasses.dataclass(frozen=True)
class Sizes:
    M: int = 777  # tokens, not a multiple of any tile
    H: int = 1024  # ffn hidden and intermediate: multiples of 16 elements (the sm_90 TMA kernels)
    I: int = 2816  # noqa: E741
    K_odd: int = 40  # linear_dual / ffn sizes that are not (pointer kernels, generic variants)
    N_odd: int = 37
    seq: int = 33  # rope: sbhd [seq, batch, heads, head_dim], partial rotary d2 < head_dim
    batch: int = 3
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    rot_dim: int = 96
    vision_fraction: float = 0.4


#: the sizes of issue 33's check (H = 1024, I = 2816: the sm_90 TMA kernels, paired gate/up in the backward)
ISSUE = Sizes()
#: small sizes for many iterations (still TMA-sized where ISSUE is)
SMALL = Sizes(M=777, H=256, I=704, seq=17, heads=4, head_dim=64, rot_dim=48)
#: tiny sizes for the CPU tier
TINY = Sizes(M=77, H=32, I=48, K_odd=12, N_odd=7, seq=5, batch=2, heads=2, kv_heads=1, head_dim=16, rot_dim=8)


def make_inputs(seed: int, device, sizes: Sizes = ISSUE, dtype=torch.bfloat16) -> dict:
    """Every op's inputs. Weights of the dual expert as views of [2, R, C] tensors (text at index 0, as DualLinear /
    DualExpertSwiGLU keep them) and, under "sep", the same values as separate tensors (stacked per call)."""
    s = sizes
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    mask = (torch.rand(s.M, generator=g) < s.vision_fraction).to(device)
    W1, W3 = rnd(2, s.I, s.H, scale=s.H ** -0.5), rnd(2, s.I, s.H, scale=s.H ** -0.5)
    W2 = rnd(2, s.H, s.I, scale=s.I ** -0.5)
    lin_w = rnd(2, s.H, s.H, scale=s.H ** -0.5)
    ang = torch.rand(64, 1, 1, s.rot_dim, generator=g) * 6.0  # float32 angles, freqs' dtype on every device
    thd_lens = [7, 0, 19, 24]
    return dict(
        sizes=s, mask=mask, x=rnd(s.M, s.H), dy=rnd(s.M, s.H),
        W1=W1, W3=W3, W2=W2,
        sep=[t.clone() for t in (W1[1], W3[1], W2[1], W1[0], W3[0], W2[0])],
        xo=rnd(s.M, s.K_odd), dyo=rnd(s.M, s.K_odd), Wo1=rnd(2, s.N_odd, s.K_odd, scale=0.2),
        Wo3=rnd(2, s.N_odd, s.K_odd, scale=0.2), Wo2=rnd(2, s.K_odd, s.N_odd, scale=0.2),
        lw=lin_w, lb=(rnd(s.H, scale=0.1), rnd(s.H, scale=0.1)),
        lwo=(rnd(s.N_odd, s.K_odd, scale=0.2), rnd(s.N_odd, s.K_odd, scale=0.2)),
        lbo=(rnd(s.N_odd, scale=0.1), rnd(s.N_odd, scale=0.1)), ldyo=rnd(s.M, s.N_odd),
        q=rnd(s.seq, s.batch, s.heads, s.head_dim), k=rnd(s.seq, s.batch, s.kv_heads, s.head_dim),
        freqs=ang.to(device),
        t_thd=rnd(sum(thd_lens), s.kv_heads, s.head_dim),
        cu=torch.tensor(list(itertools.accumulate(thd_lens, initial=0)), dtype=torch.int32).to(device),
    )


def _dual(W):
    """(vision, text) experts of a [2, R, C] weight: index 1 and index 0."""
    return W[1], W[0]


def _aligned_routing(buf: torch.Tensor, M: int) -> torch.Tensor:
    """The entries of linear_dual_forward's routing that it writes (seg, then perm); the rest is unused and unset."""
    m_pad = (-(-M // 128) + 1) * 128
    return torch.cat([buf[:5], buf[8:8 + m_pad]])


def run_ops(inp: dict, autograd: bool = True) -> Results:
    """Every op once, in a fixed order (no host sync in between, except rope's checks of cu_seqlens on CUDA)."""
    out: Results = []
    add = lambda name, t: out.append((name, t))  # noqa: E731
    mask, x, dy = inp["mask"], inp["x"], inp["dy"]
    w1, u1 = _dual(inp["W1"])
    w3, u3 = _dual(inp["W3"])
    w2, u2 = _dual(inp["W2"])
    dual_views = (w1, w3, w2, mask, u1, u3, u2)
    sw1, sw3, sw2, su1, su3, su2 = inp["sep"]
    dual_sep = (sw1, sw3, sw2, mask, su1, su3, su2)

    # rope: sbhd with partial rotary, q and k (GQA) in one launch, thd with cu_seqlens (a value check, host sync)
    add("rope_fwd", OPS.rope_fwd(inp["q"], inp["freqs"]))
    for i, t in enumerate(OPS.rope_fwd_qk(inp["q"], inp["k"], inp["freqs"])):
        add(f"rope_fwd_qk[{i}]", t)
    add("rope_bwd thd", OPS.rope_bwd(inp["t_thd"], inp["freqs"], "thd", cu_seqlens=inp["cu"]))

    routing = OPS.route(mask)
    add("route", routing)

    # linear_dual: odd sizes (pointer kernels) with biases, TMA sizes with the experts as views of [2, N, K]
    lwv, lwt = inp["lwo"]
    lbv, lbt = inp["lbo"]
    add("linear_dual odd", OPS.linear_dual(inp["xo"], mask, lwv, lwt, lbv, lbt))
    lv, lt = _dual(inp["lw"])
    y, r = OPS.linear_dual_forward(x, mask, lv, lt, *inp["lb"])
    add("linear_dual_forward", y)
    add("linear_dual_forward routing", _aligned_routing(r, x.shape[0]))
    add("linear_dual routing=", OPS.linear_dual(x, mask, lv, lt, *inp["lb"], routing=routing))
    for i, t in enumerate(OPS.linear_dual_backward(dy, x, mask, lv, lt, routing=r)):
        add(f"linear_dual_backward[{i}]", t)
    for i, t in enumerate(OPS.linear_dual_backward(inp["ldyo"], inp["xo"], mask, lwv, lwt)):
        add(f"linear_dual_backward odd[{i}]", t)

    # ffn: the dual expert as views (the issue's layout), as separate tensors, with routing=, the single expert,
    # odd sizes; then the backward of each
    add("ffn dual", OPS.ffn(x, *dual_views))
    add("ffn dual sep", OPS.ffn(x, *dual_sep))
    add("ffn routing=", OPS.ffn(x, *dual_views, routing=routing))
    add("ffn single", OPS.ffn(x, u1, u3, u2))
    wo1, uo1 = _dual(inp["Wo1"])
    wo3, uo3 = _dual(inp["Wo3"])
    wo2, uo2 = _dual(inp["Wo2"])
    add("ffn odd", OPS.ffn(inp["xo"], wo1, wo3, wo2, mask, uo1, uo3, uo2))
    for tag, args, kw in (("dual", dual_views, {}), ("dual routing=", dual_views, {"routing": routing}),
                          ("dual sep", dual_sep, {}), ("single", (u1, u3, u2), {})):
        for i, t in enumerate(OPS.ffn_backward(dy, x, *args, **kw)):
            add(f"ffn_backward {tag}[{i}]", t)
    for i, t in enumerate(OPS.ffn_backward(inp["dyo"], inp["xo"], wo1, wo3, wo2, mask, uo1, uo3, uo2)):
        add(f"ffn_backward odd[{i}]", t)

    if autograd:  # through the C++ autograd functions (the backward runs on autograd's device thread)
        leaves = [t.detach().requires_grad_(True) for t in (x, lv, lt, *inp["lb"])]
        y = OPS.linear_dual(leaves[0], mask, *leaves[1:])
        for i, t in enumerate(torch.autograd.grad(y, leaves, dy)):
            add(f"linear_dual autograd grad[{i}]", t)
        q = inp["q"].detach().requires_grad_(True)
        (gq,) = torch.autograd.grad(OPS.rope_fwd(q, inp["freqs"]), [q], inp["q"])
        add("rope autograd grad", gq)
    return out


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between same-dtype float tensors (int64; sign changes count through 0)."""
    if a.dtype in (torch.bfloat16, torch.float16):
        ia, ib = a.view(torch.int16).to(torch.int64), b.view(torch.int16).to(torch.int64)
        flip = 0x7FFF
    elif a.dtype == torch.float32:
        ia, ib = a.view(torch.int32).to(torch.int64), b.view(torch.int32).to(torch.int64)
        flip = 0x7FFFFFFF
    else:
        return (a != b).to(torch.int64)
    # sign-magnitude -> a monotonic integer line
    ia = torch.where(ia < 0, -(ia & flip), ia)
    ib = torch.where(ib < 0, -(ib & flip), ib)
    return (ia - ib).abs()


def describe(name: str, got: Optional[torch.Tensor], want: Optional[torch.Tensor], inp: dict) -> str:
    """One line on how `got` differs from `want` (both of one call of run_ops)."""
    if got is None or want is None:
        return f"{name}: defined {got is not None} vs {want is not None}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    g, w = got.detach().cpu(), want.detach().cpu()
    diff = g != w
    if g.is_floating_point():
        diff &= ~(g.isnan() & w.isnan())
    n = int(diff.sum())
    idx = diff.nonzero()
    msg = f"{name}: {n} of {g.numel()} elements differ, first at {tuple(idx[0].tolist())}"
    if g.is_floating_point():
        d = (g.double() - w.double()).abs()[diff]
        u = ulps(g, w)[diff]
        msg += (f"; |diff| max {d.max().item():.4g} mean {d.mean().item():.3g}; ulps max {int(u.max())} "
                f"(1 ulp: {int((u == 1).sum())}); NaN in got {int(g.isnan().sum())}, want {int(w.isnan().sum())}")
    M = inp["sizes"].M
    if g.dim() == 2 and g.shape[0] == M:  # token rows
        rows = idx[:, 0].unique()
        vis = inp["mask"].cpu()[rows]
        msg += f"; token rows differing {rows.numel()} (vision {int(vis.sum())}, text {int((~vis).sum())})"
        msg += f", first rows {rows[:8].tolist()}"
    elif g.dim() == 2:  # a weight gradient [R, C]: which 128 x 64 tiles
        tiles = (idx // torch.tensor([128, 64])).unique(dim=0)
        msg += f"; in {tiles.shape[0]} [128 x 64] tiles, first {tiles[:6].tolist()}"
    return msg


def compare(got: Results, want: Results, inp: dict) -> List[str]:
    """Bitwise comparison of two run_ops results; one line per differing output (empty: equal)."""
    if [n for n, _ in got] != [n for n, _ in want]:
        return [f"different calls: {[n for n, _ in got]} vs {[n for n, _ in want]}"]
    bad = []
    for (name, g), (_, w) in zip(got, want):
        same = (g is None and w is None) or (g is not None and w is not None and g.shape == w.shape and
                                            g.dtype == w.dtype and torch.equal(g, w))
        if not same:
            bad.append(describe(name, g, w, inp))
    return bad


def issue_ops(inp: dict) -> Results:
    """The calls of issue 33's check, in its order: rope_fwd, linear_dual, ffn, ffn with routing=, ffn_backward."""
    mask, x = inp["mask"], inp["x"]
    w1, u1 = _dual(inp["W1"])
    w3, u3 = _dual(inp["W3"])
    w2, u2 = _dual(inp["W2"])
    lv, lt = _dual(inp["lw"])
    dual = (w1, w3, w2, mask, u1, u3, u2)
    out = [("rope_fwd", OPS.rope_fwd(inp["q"], inp["freqs"])),
           ("linear_dual", OPS.linear_dual(x, mask, lv, lt, *inp["lb"])),
           ("ffn", OPS.ffn(x, *dual)),
           ("ffn routing=", OPS.ffn(x, *dual, routing=OPS.route(mask)))]
    out += [(f"ffn_backward[{i}]", t) for i, t in enumerate(OPS.ffn_backward(inp["dy"], x, *dual))]
    return out


# ------------------------------------------------------------------------------------------------------------------
# the thread check: a sequential run in the calling thread, then many threads at once


def sequential(devices, sizes: Sizes = ISSUE, seed: int = 0, ops: Callable[[dict], Results] = run_ops):
    """(inputs, results) per device, from the calling thread; run twice, and the runs must be bitwise equal."""
    inputs, refs = {}, {}
    for dev in devices:
        inputs[dev] = make_inputs(seed, dev, sizes)
        refs[dev] = ops(inputs[dev])
        bad = compare(ops(inputs[dev]), refs[dev], inputs[dev])
        assert not bad, f"seed {seed}, {dev}: two sequential runs differ:\n  " + "\n  ".join(bad)
        if torch.device(dev).type == "cuda":
            torch.cuda.synchronize(dev)  # threads on other streams read the inputs
    return inputs, refs


def plan(device, stream: str = "own", current: str = "same", own_inputs: bool = False, poison: bool = False):
    """One thread's setup. stream: "own" (a new stream) or "default" (the device's default stream, which all such
    threads share); current: the thread's current device while it calls the ops: "same" (the tensors'), "other" (the
    next device), "fresh" (what a new thread starts on: device 0); own_inputs: the thread builds its inputs itself
    (same values, other addresses); poison: NaN in freed allocator blocks before every iteration."""
    return dict(device=str(device), stream=stream, current=current, own_inputs=own_inputs, poison=poison)


def _poison(device, nbytes: int) -> None:
    junk = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device=device)
    del junk  # back to the current stream's pool, NaN-filled


def run_threads(plans, inputs, refs, iters: int, sizes: Sizes = ISSUE, seed: int = 0,
                ops: Callable[[dict], Results] = run_ops) -> List[str]:
    """One thread per plan, started together; each runs `ops` `iters` times and compares every iteration's results
    with refs[device] bitwise. Returns one failure description per failing thread (empty: all equal)."""
    failures, lock = [], threading.Lock()
    barrier = threading.Barrier(len(plans))
    n_dev = max(1, torch.cuda.device_count())

    def body(i, p):
        dev = torch.device(p["device"])
        cuda = dev.type == "cuda"
        tag = f"thread {i} {p}"
        try:
            inp = inputs[p["device"]]
            if p["own_inputs"]:
                inp = make_inputs(seed, dev, sizes)
            want = None
            if cuda:
                torch.cuda.synchronize(dev)  # own inputs were built on the default stream, read from another
                fresh = torch.cuda.current_device()  # what a new thread starts on
                want = {"same": dev.index, "other": (dev.index + 1) % n_dev, "fresh": fresh}[p["current"]]
                stream = torch.cuda.Stream(device=dev) if p["stream"] == "own" else torch.cuda.default_stream(dev)
                torch.cuda.set_stream(stream)  # makes dev current as well: the plan's current device is set after it
                torch.cuda.set_device(want)
            barrier.wait()
            for it in range(iters):
                if p["poison"] and cuda:
                    _poison(dev, 64 << 20)
                got = ops(inp)
                bad = compare(got, refs[p["device"]], inp)
                if cuda and torch.cuda.current_device() != want:
                    bad.append(f"the ops moved the thread from device {want} to {torch.cuda.current_device()}")
                if bad:
                    with lock:
                        failures.append(f"{tag} iteration {it}:\n    " + "\n    ".join(bad))
                    return
        except Exception:  # noqa: BLE001  (reported with the thread's setup: the caller fails on it)
            with lock:
                failures.append(f"{tag} raised:\n{traceback.format_exc()}")
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.abort()

    threads = [threading.Thread(target=body, args=(i, p)) for i, p in enumerate(plans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures
