"""Kernel config tables: which block configs the AOT step compiles, and which one the runtime picks per shape bucket.

One JSON file per GPU architecture, `aot/configs/sm<arch>.json`:

    {"arch": 90, "origin": [{"date": "2026-11-27", "device": "NVIDIA H200", "triton": "3.6.0",
                             "command": ["--offline", "--results", "...", "--ops", "grad_weight", ...],
                             "note": "what the step did"}, ...],
     "kernels": {"routed_linear_tma_kernel": {"half": [{"max_m": 64, "block": [128, 64, 64], "group": 8,
                                                         "warps": 4, "stages": 4},
                                                        {"block": [128, 256, 64], "group": 8, "warps": 8,
                                                         "stages": 3}], ...}, ...}}

* origin: how the table was made, as data: its steps in order, each with the `date` (YYYY-MM-DD), the `device`
  measured on (a GPU name, or null for reasoned defaults), optionally the `triton` version, the `command` (the
  argument list of `python -m aot.tune`, or null for a step by hand) and a short `note`. `python -m aot.tune --write`
  appends its own step; tests/test_tune_table.py replays the `--offline` commands of sm90.json's steps.
* kernel: a `@triton.jit` name of kernels/ (KERNELS below says which are configurable and what `block` means).
* family: "half" (bf16 and fp16: same MMA shapes), "tf32" (fp32 with TF32 allowed), "ieee" (exact fp32); RoPE has
  one family, "all".
* buckets, in increasing `max_m`; the last has none (no upper bound). `m` is the number of token rows of the call
  (the reduction length for the grad-weight kernels); the runtime takes the first bucket with m <= max_m.
* shape classes (optional): buckets with `max_n` and / or `max_k` serve only calls whose GEMM has n <= max_n output
  columns and k <= max_k reduction length (the grad-weight kernels: the weight's rows and columns, nn.Linear's
  [n, k]); `"w_transposed": true / false` (the linear GEMMs, ORIENTED below) serves only the grad-input GEMM
  dX = dY·W_e (W transposed) / only the forward. A class is a run of consecutive buckets with the same bounds, increasing in max_m and closed by a bucket
  without max_m; the list ends with the general class (no max_n / max_k). The runtime takes the first class whose
  bounds hold, then its bucket for m: the same first-match rule over the whole list. Classes exist where the best
  config differs with the shape (narrow N leaves a wave of wide tiles mostly empty; short K gives the epilogue more
  weight), measured by `python -m aot.tune --models matrix --classes ...`. A lookup that does not know the shape
  (n or k None here, negative in C++) takes the general class. rope_kernel's n is the heads per token row (of q and
  k together); it has no other class.
* `block`, `group` (GROUP_M / GROUP_N), `warps`, `stages`: the meta-parameters compiled in; `"flatten": true` (the
  persistent TMA GEMMs only, PERSISTENT below) flattens the loop over tiles into the K loop, so the compiler's
  pipeline runs across tiles and the next tile's loads overlap this one's epilogue. `"split": S` (2, 4 or 8; the linear
  TMA GEMMs, SPLIT_CONFIG below) compiles in the split of a last partial round in S column slices (kernels/gemm_tiles.py
  _split_tail; the paired gate/up GEMM always splits in halves). `"stream_k": R` (the same GEMMs; not with split) shares
  the K steps of the last R rounds' tiles out evenly over the persistent grid (1: the last partial round; 2: also the
  whole round before it, so every program gets one to two tiles' steps), a tile's pieces summed by the program that
  holds its last steps in a fixed order (kernels/gemm_tiles.py _sk_share). An optional `why` says where
  a value comes from.
* `"off": true` (only for kernels that are an alternative design, OPTIONAL below): the kernel is not used for the
  bucket's m, and the launcher takes the other design (for routed_decode_linear_kernel: the routed linear GEMMs; for
  routed_{linear,swiglu}_gather_tma_kernel: a gather copy, then routed_{linear,swiglu}_tma_kernel; for
  routed_swiglu_pair_tma_kernel: routed_swiglu_tma_kernel; for routed_swiglu_pair_bwd_tma_kernel: two
  routed_linear_tma_kernel GEMMs and swiglu_backward_kernel). A family without entries for such a kernel also takes
  the other design.

aot/manifest.py compiles every distinct config of every table (a variant per config, for the architectures whose
table lists it); aot/compile.py writes the buckets into the generated C++ table, and csrc/runtime/kernel_configs.cpp
looks them up at run time (the table of the architecture whose cubin the device runs). `python -m aot.tune --write`
rewrites a table from measurements.
"""
import json
import os
import re
from typing import Dict, List

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

ROUTING_ALIGN = 128  # kernels/routing.py ALIGN: expert segments start at multiples of it

# kernel -> (families it has, meaning of block, whether it is TMA (sm_90 only), index of block that must divide
# ROUTING_ALIGN (the row tile), or None)
KERNELS = {
    "rope_kernel": (("all", ), "BLOCK_T x BLOCK_H x BLOCK_HALF", False, None),
    # decode attention (kernels/decode_attention.py): m = the query rows of a KV head (G * T), the class's max_n = the
    # head dim that its configs are compiled for (block[2])
    "decode_attention_kernel": (("half", ), "BLOCK_M x BLOCK_N x HEAD_D", False, None),
    "routed_linear_kernel": (("half", "tf32", "ieee"), "BLOCK_M x BLOCK_N x BLOCK_K", False, 0),
    "routed_swiglu_kernel": (("half", "tf32", "ieee"), "BLOCK_M x BLOCK_N x BLOCK_K", False, 0),
    "routed_grad_weight_kernel": (("half", "tf32", "ieee"), "BLOCK_N x BLOCK_K x BLOCK_R", False, 2),
    "routed_linear_tma_kernel": (("half", "tf32", "ieee"), "BLOCK_M x BLOCK_N x BLOCK_K", True, 0),
    "routed_swiglu_tma_kernel": (("half", "tf32"), "BLOCK_M x BLOCK_N x BLOCK_K", True, 0),
    "routed_grad_weight_tma_kernel": (("half", "tf32", "ieee"), "BLOCK_N x BLOCK_K x BLOCK_R", True, 2),
    # the linear forward with A gathered inside the GEMM; families without entries use gather copy + the TMA kernel
    "routed_linear_gather_tma_kernel": (("half", "tf32", "ieee"), "BLOCK_M x BLOCK_N x BLOCK_K", True, 0),
    "routed_swiglu_gather_tma_kernel": (("half", "tf32"), "BLOCK_M x BLOCK_N x BLOCK_K", True, 0),
    # the linear forward of a few tokens (decode), the reduction split over the grid; no routing, so no row-tile rule
    "routed_decode_linear_kernel": (("half", "tf32", "ieee"), "BLOCK_M x BLOCK_N x BLOCK_K", False, None),
    # the gate/up GEMM with both weights through one rank-4 descriptor and one MMA of 2 x BLOCK_N columns
    "routed_swiglu_pair_tma_kernel": (("half", "tf32"), "BLOCK_M x BLOCK_N x BLOCK_K", True, 0),
    # its backward twin: the ffn backward's gate/up recompute with the SwiGLU backward in the epilogue
    "routed_swiglu_pair_bwd_tma_kernel": (("half", "tf32"), "BLOCK_M x BLOCK_N x BLOCK_K", True, 0),
}
# kernels whose buckets may be "off": an alternative design (gather inside the GEMM instead of a gather copy; gate
# and up in one MMA instead of two; a split-reduction decode GEMM), which the launcher takes only where its table
# says so
OPTIONAL = {"routed_decode_linear_kernel", "routed_linear_gather_tma_kernel", "routed_swiglu_gather_tma_kernel",
            "routed_swiglu_pair_tma_kernel", "routed_swiglu_pair_bwd_tma_kernel"}
# kernels whose program holds all m rows in one BLOCK_M (the decode GEMM): their buckets end at block[0]
ROWS_IN_ONE_BLOCK = {"routed_decode_linear_kernel"}
# kernels without a GROUP_M / GROUP_N ("group" not in their configs)
NO_GROUP = {"rope_kernel", "decode_attention_kernel"}
# the persistent TMA GEMMs, whose tile loop may be flattened into the K loop ("flatten": true; tl.range(flatten=True))
PERSISTENT = {"routed_linear_tma_kernel", "routed_swiglu_tma_kernel", "routed_linear_gather_tma_kernel",
              "routed_swiglu_gather_tma_kernel", "routed_swiglu_pair_tma_kernel", "routed_swiglu_pair_bwd_tma_kernel"}
# the persistent kernels that split a last partial round in column slices (kernels/gemm_tiles.py _split_tail):
# SPLIT_CONFIG where the table's "split" says so (constexpr SPLIT_TAIL), ALWAYS_SPLIT in every config
SPLIT_CONFIG = {"routed_linear_tma_kernel", "routed_linear_gather_tma_kernel"}
# the values "split" (column slices) and "stream_k" (rounds shared out) may take, and their suffixes in cfg_str
SPLIT_SUFFIX = {2: "_t", 4: "_t4", 8: "_t8"}
STREAM_K_SUFFIX = {1: "_sk", 2: "_sk2"}
ALWAYS_SPLIT = {"routed_swiglu_pair_tma_kernel"}
CLASS_FIELDS = ("max_n", "max_k", "w_transposed")  # a shape class's keys, in the order a class is named
GENERAL = (None, None, None)  # the general class: no bound
# a bucket's compiled config: what cfg_str names and a variant is compiled from
CONFIG_FIELDS = ("block", "group", "warps", "stages", "flatten", "split", "stream_k")
_ENTRY_FIELDS = {"max_m", *CLASS_FIELDS, *CONFIG_FIELDS, "why", "off"}
ORDER = (*CLASS_FIELDS, "max_m", "off", *CONFIG_FIELDS, "why")  # the order dumps() writes a bucket's fields in
# the kernels with a W_TRANSPOSED constexpr (forward and grad-input GEMM): their classes may key on the orientation
ORIENTED = {"routed_linear_kernel", "routed_linear_tma_kernel"}


def family(dtype: str, prec: str) -> str:
    """'half' for bf16/fp16, else the fp32 precision ('tf32' or 'ieee')."""
    return "half" if dtype in ("bf16", "fp16") else prec


def cfg_str(entry: Dict) -> str:
    """The config as it appears in variant keys ("cfg=128x256x64_g8_w8_s3"); "off" for a bucket that turns an
    optional kernel off."""
    if entry.get("off"):
        return "off"
    s = "x".join(str(b) for b in entry["block"])
    if "group" in entry:
        s += f"_g{entry['group']}"
    return (s + f"_w{entry['warps']}_s{entry['stages']}" + ("_f" if entry.get("flatten") else "")
            + SPLIT_SUFFIX.get(entry.get("split"), "") + STREAM_K_SUFFIX.get(entry.get("stream_k"), ""))


def _pow2(v) -> bool:
    return isinstance(v, int) and v > 0 and (v & (v - 1)) == 0


def validate(table: Dict, where: str = "config table") -> Dict:
    """Checks a table's structure and the constraints the kernels and launchers rely on; raises ValueError."""
    def fail(msg):
        raise ValueError(f"{where}: {msg}")

    if not isinstance(table.get("arch"), int):
        fail("'arch' must be an integer such as 90")
    _check_origin(table.get("origin"), fail)
    kernels = table.get("kernels")
    if not isinstance(kernels, dict) or not kernels:
        fail("'kernels' must be a non-empty object")
    for name, fams in kernels.items():
        if name not in KERNELS:
            fail(f"unknown kernel {name!r} (configurable: {', '.join(KERNELS)})")
        allowed, _, tma, row_idx = KERNELS[name]
        if tma and table["arch"] != 90:
            fail(f"{name} is a Hopper TMA kernel: only an sm_90 table may list it")
        for fam, buckets in fams.items():
            if fam not in allowed:
                fail(f"{name}: unknown family {fam!r} (expected one of {allowed})")
            if not isinstance(buckets, list) or not buckets:
                fail(f"{name}/{fam}: needs a non-empty list of buckets")
            for i, e in enumerate(buckets):
                at = f"{name}/{fam}[{i}]"
                extra = set(e) - _ENTRY_FIELDS
                if extra:
                    fail(f"{at}: unknown fields {sorted(extra)}")
                if "off" in e:
                    if name not in OPTIONAL or e["off"] is not True:
                        fail(f"{at}: only an alternative-design kernel ({', '.join(sorted(OPTIONAL))}) may have "
                             "\"off\": true")
                    if set(e) - {"max_m", "off", "why", *CLASS_FIELDS}:
                        fail(f"{at}: an \"off\" bucket has only max_m, its class's bounds (and why)")
                else:
                    _check_config(e, name, row_idx, fail, at)
                for f in CLASS_FIELDS:
                    if f in e and f != "w_transposed" and not (isinstance(e[f], int) and not isinstance(e[f], bool)
                                                               and e[f] > 0):
                        fail(f"{at}: '{f}' must be a positive integer, got {e[f]!r}")
                    if f in e and name == "rope_kernel" and f != "max_n":
                        fail(f"{at}: rope_kernel's only shape class is max_n (heads per token row), not '{f}'")
                if "w_transposed" in e and (name not in ORIENTED or not isinstance(e["w_transposed"], bool)):
                    fail(f"{at}: 'w_transposed' is a bool, and only for {', '.join(sorted(ORIENTED))} (the GEMMs that "
                         "serve the forward and, with W transposed, the grad-input)")
                last_of_class = i + 1 == len(buckets) or shape_class(buckets[i + 1]) != shape_class(e)
                if not last_of_class:
                    m = e.get("max_m")
                    prev = buckets[i - 1].get("max_m", 0) if i and shape_class(buckets[i - 1]) == shape_class(e) else 0
                    if not (isinstance(m, int) and m > prev):
                        fail(f"{at}: every bucket but the last of its class needs an integer 'max_m' above the "
                             "previous one")
                elif "max_m" in e:
                    fail(f"{at}: the last bucket of a class takes every larger m and must not have 'max_m'")
                if name in ROWS_IN_ONE_BLOCK and not e.get("off") and not (not last_of_class
                                                                         and e["max_m"] <= e["block"][0]):
                    fail(f"{at}: {name} holds every row in one BLOCK_M: each bucket needs max_m <= block[0], and the "
                         "last bucket must be \"off\"")
            _check_classes(buckets, f"{name}/{fam}", fail)
    return table


ORIGIN_FIELDS = ("date", "device", "triton", "command", "note")  # a step of "origin", in the order dumps() writes them
ORIGIN_NOTE_MAX = 400  # characters: a note says what a step did; the data (device, date, command) is in its fields


def _check_origin(origin, fail) -> None:
    """The table's "origin": a non-empty list of steps {date, device, command, note}, optionally triton (above)."""
    if not isinstance(origin, list) or not origin:
        fail("'origin' must be a non-empty list of steps {date, device, command, note} (how the table was made)")
    required = set(ORIGIN_FIELDS) - {"triton"}
    for i, step in enumerate(origin):
        at = f"origin[{i}]"
        if not isinstance(step, dict) or set(step) - set(ORIGIN_FIELDS) or required - set(step):
            fail(f"{at}: a step has the fields date, device, command, note (and optionally triton), got "
                 f"{sorted(step) if isinstance(step, dict) else type(step).__name__}")
        if not (isinstance(step["date"], str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", step["date"])):
            fail(f"{at}: 'date' must be YYYY-MM-DD, got {step['date']!r}")
        if step["device"] is not None and not (isinstance(step["device"], str) and step["device"]):
            fail(f"{at}: 'device' is the GPU's name, or null where nothing was measured")
        if "triton" in step and not (isinstance(step["triton"], str) and step["triton"]):
            fail(f"{at}: 'triton' is a version string")
        cmd = step["command"]
        if cmd is not None and not (isinstance(cmd, list) and all(isinstance(a, str) for a in cmd)):
            fail(f"{at}: 'command' is the argument list of `python -m aot.tune` (strings), or null for a step by hand")
        if not (isinstance(step["note"], str) and 0 < len(step["note"]) <= ORIGIN_NOTE_MAX):
            fail(f"{at}: 'note' must be a non-empty string of at most {ORIGIN_NOTE_MAX} characters")


def shape_class(e: Dict):
    """A bucket's class: its (max_n, max_k, w_transposed), None where unbounded (either orientation)."""
    return tuple(e.get(f) for f in CLASS_FIELDS)


def _covers(a, b) -> bool:
    """Whether class a admits every shape that class b admits (None: unbounded)."""
    (an, ak, at), (bn, bk, bt) = a, b
    return all(x is None or (y is not None and y <= x) for x, y in ((an, bn), (ak, bk))) and (at is None or at == bt)


def _check_classes(buckets: List[Dict], where: str, fail) -> None:
    """Classes are runs of consecutive buckets; each appears once, the last is the general one, and none is hidden
    behind an earlier class that admits every shape it does (first match: it would never be taken)."""
    runs = [shape_class(e) for i, e in enumerate(buckets) if i == 0 or shape_class(buckets[i - 1]) != shape_class(e)]
    if runs[-1] != GENERAL:
        fail(f"{where}: the last class must be the general one (no max_n / max_k / w_transposed)")
    for i, c in enumerate(runs):
        if c in runs[:i]:
            fail(f"{where}: class {class_str(c)} appears twice: a class's buckets must be consecutive")
        for earlier in runs[:i]:
            if _covers(earlier, c):
                fail(f"{where}: class {class_str(c)} is never taken: {class_str(earlier)} before it admits every shape "
                     "it does (list narrower classes first)")


def class_str(c) -> str:
    """'n<=2048', 'n<=2048,k<=1024', 'n<=2048,t' (the grad-input orientation), 'f' (the forward), or 'general'."""
    n, k, t = c
    parts = []
    if n is not None:
        parts.append(f"n<={n}")
    if k is not None:
        parts.append(f"k<={k}")
    if t is not None:
        parts.append("t" if t else "f")
    return ",".join(parts) or "general"


def in_class(e: Dict, n, k, wt=None) -> bool:
    """Whether bucket e's class admits a GEMM of n columns and reduction k in orientation wt (True: the grad-input,
    W transposed; None: unknown). An unknown size or orientation is admitted by the unbounded classes only."""
    return (all(e.get(f) is None or (v is not None and v <= e[f]) for f, v in (("max_n", n), ("max_k", k)))
            and (e.get("w_transposed") is None or (wt is not None and wt == e["w_transposed"])))


def _check_config(e: Dict, name: str, row_idx, fail, at: str) -> None:
    """The compiled meta-parameters of one bucket (not "off")."""
    blk = e.get("block")
    if not (isinstance(blk, list) and len(blk) == 3 and all(_pow2(b) for b in blk)):
        fail(f"{at}: 'block' must be 3 powers of two ({KERNELS[name][1]}), got {blk!r}")
    if name == "rope_kernel" and blk[0] > 1024:
        fail(f"{at}: block[0] = {blk[0]} (BLOCK_T) must be at most 1024: the launcher admits up to 2**31 - 1025 tokens")
    if row_idx is not None and ROUTING_ALIGN % blk[row_idx] != 0:
        fail(f"{at}: block[{row_idx}] = {blk[row_idx]} must divide the routing alignment {ROUTING_ALIGN}")
    for key, kind, values in (("split", "2, 4 or 8 (column slices)", SPLIT_SUFFIX),
                              ("stream_k", "1 or 2 (rounds shared out)", STREAM_K_SUFFIX)):
        if key in e and (name not in SPLIT_CONFIG or type(e[key]) is not int or e[key] not in values):
            fail(f"{at}: '{key}' is {kind}, and only for {', '.join(sorted(SPLIT_CONFIG))}; got {e[key]!r}")
    if e.get("stream_k") and e.get("split"):
        fail(f"{at}: 'stream_k' and 'split' are two ways of sharing out the last round: one or the other")
    parts = 2 if name in ALWAYS_SPLIT else e.get("split", 0)
    if parts and blk[1] < 8 * parts:
        fail(f"{at}: block[1] = {blk[1]} must be at least {8 * parts}: a last round split in {parts} loads BLOCK_N / "
             f"{parts} columns per weight (kernels/gemm_tiles.py _split_tail), and TMA and the MMA need 8 or more")
    if e.get("warps") not in (1, 2, 4, 8, 16):
        fail(f"{at}: 'warps' must be 1, 2, 4, 8 or 16, got {e.get('warps')!r}")
    if not (isinstance(e.get("stages"), int) and 1 <= e["stages"] <= 8):
        fail(f"{at}: 'stages' must be an integer in [1, 8], got {e.get('stages')!r}")
    if name == "decode_attention_kernel" and (blk[0] < 16 or blk[1] < 16 or e.get("max_n", blk[2]) != blk[2]):
        fail(f"{at}: BLOCK_M and BLOCK_N must be at least 16 (tl.dot), and HEAD_D (block[2]) the class's max_n")
    if name not in NO_GROUP and not (isinstance(e.get("group"), int) and e["group"] >= 1):
        fail(f"{at}: 'group' (GROUP_M / GROUP_N) must be a positive integer")
    if "flatten" in e and (name not in PERSISTENT or not isinstance(e["flatten"], bool)):
        fail(f"{at}: 'flatten' is a bool, and only for the persistent kernels ({', '.join(sorted(PERSISTENT))})")


def path(arch: int) -> str:
    return os.path.join(CONFIG_DIR, f"sm{arch}.json")


def load(arch: int) -> Dict:
    p = path(arch)
    if not os.path.exists(p):
        raise FileNotFoundError(f"no kernel config table for sm_{arch}: expected {p} (copy one of "
                                f"{sorted(os.listdir(CONFIG_DIR))} and re-tune with `python -m aot.tune --write {p}`)")
    with open(p) as f:
        return validate(json.load(f), p)


def buckets(table: Dict, kernel: str, fam: str) -> List[Dict]:
    return table["kernels"].get(kernel, {}).get(fam, [])


def pick(table: Dict, kernel: str, fam: str, m: int, n=None, k=None, wt=None) -> Dict:
    """The bucket the runtime takes for m rows of a GEMM with n output columns and reduction k, wt True for the
    grad-input orientation (what csrc/runtime/kernel_configs.cpp does; None: unknown, the unbounded classes only)."""
    for e in buckets(table, kernel, fam):
        if in_class(e, n, k, wt) and ("max_m" not in e or m <= e["max_m"]):
            return e
    raise KeyError(f"sm_{table['arch']} table has no config for {kernel}/{fam}")


def dumps(table: Dict) -> str:
    """JSON with one bucket per line (readable diffs when a re-tune changes a table)."""
    origin = table.get("origin", [])
    steps = [json.dumps({k: step[k] for k in ORIGIN_FIELDS if k in step}) for step in origin]
    lines = ["{", f' "arch": {table["arch"]},', ' "origin": [']
    lines += [f"  {s}" + ("," if i + 1 < len(steps) else "") for i, s in enumerate(steps)]
    lines += [" ],", ' "kernels": {']
    kernels = list(table["kernels"].items())
    for ki, (name, fams) in enumerate(kernels):
        lines.append(f'  "{name}": {{')
        items = list(fams.items())
        for fi, (fam, bks) in enumerate(items):
            lines.append(f'   "{fam}": [')
            for bi, e in enumerate(bks):
                order = [k for k in ORDER if k in e]
                body = ", ".join(f'"{k}": {json.dumps(e[k])}' for k in order)
                lines.append(f"    {{{body}}}" + ("," if bi + 1 < len(bks) else ""))
            lines.append("   ]" + ("," if fi + 1 < len(items) else ""))
        lines.append("  }" + ("," if ki + 1 < len(kernels) else ""))
    lines += [" }", "}", ""]
    return "\n".join(lines)
