"""What the AOT step compiles: every specialization of every kernel, for every target architecture.

A *variant* is one `@triton.jit` function compiled with fixed meta-parameters. Its `key` (e.g.
`dtype=bf16,interleaved=0,second=0,thd=0`) is what the C++ launcher asks for; several variants may share a key and
differ only in what they assume of the call arguments (16-byte alignment, a unit stride). The runtime checks those
assumptions on every launch and takes the first variant, in manifest order, whose assumptions hold, so the fast
specialization is listed first and the generic one last.

Each call argument is (name, type) with type one of the Triton signature types (`*bf16`, `i32`, `i64`, `fp32`, ...),
read from the kernel's own signature (runtime_args): the kernel and its C++ launch are the only places an argument
list is written.
`spec` maps an argument name to `16` (divisible by 16: for a pointer, 16-byte aligned) or to `("eq", v)` (the
argument is compiled in as the constant v and the runtime requires the caller to pass exactly v).
"""
import dataclasses
import functools
from typing import Dict, List, Tuple, Union

from aot import config_table

# sm_90 is what we test on; sm_80/sm_89 are cross-compiled; the PTX of the lowest one lets newer GPUs JIT it.
ARCHS = (80, 89, 90)
# What a build for every supported GPU needs (aot/compile.py resolve_archs: "auto" where no GPU is visible, a wheel):
# sm_86/87/89 run the sm_80 cubins (same major version), sm_90 its own (wgmma, TMA), newer GPUs the sm_80 PTX. sm_89's
# own cubins buy nothing measured: its table is sm_80's (aot/configs/sm89.json, not measured on an sm_89 GPU), so it is
# built only when asked for (FUSED_ARCHS=89 or all).
PORTABLE_ARCHS = (80, 90)
# Shared memory per block (opt-in maximum) that every device running an architecture's cubins allows: sm_80 cubins
# also run on sm_86/sm_87 (99 KiB), sm_89 has 99 KiB, sm_90 227 KiB. aot/compile.py rejects a config above it.
SHARED_LIMIT = {80: 101376, 89: 101376, 90: 232448}

DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}

# The Triton type of a runtime argument whose type does not follow from its name and the variant's dtype (routing
# indices, masks, fp32 side buffers); see runtime_args.
_ARG_TYPES = {"perm_ptr": "*i32", "seg_ptr": "*i32", "block_counts_ptr": "*i32", "cu_seqlens_ptr": "*i32",
              "start_ptr": "*i32", "mask_ptr": "*i8", "colsum_ptr": "*fp32", "freqs_ptr": "*fp32",
              "ws_ptr": "*fp32", "flag_ptr": "*i32", "buf_ptr": "*i32"}


def runtime_args(kernel: str, dt: str = "", descs: Dict[str, str] = None,
                 types: Dict[str, str] = None) -> List[Tuple[str, str]]:
    """(name, Triton type) of every runtime argument of `kernel` ("module:function"), in its @triton.jit signature's
    order, so that no argument list is written twice: `*_desc` is a tensor descriptor of dtype `dt` whose block is
    `descs[name]` (from the variant's config), `*_ptr` a pointer to `dt` (or its _ARG_TYPES type), any other argument
    i32; `types` overrides by name (e.g. i64 strides). Constexpr parameters are the variant's meta, not arguments."""
    import importlib
    import inspect
    module, name = kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    # The Python function itself: a JITFunction and (under TRITON_INTERPRET=1) an InterpretedFunction both wrap it as
    # .fn; its annotations say which parameters are tl.constexpr.
    out = []
    for n, param in inspect.signature(getattr(fn, "fn", fn)).parameters.items():
        if "constexpr" in str(param.annotation):
            continue
        if types and n in types:
            ty = types[n]
        elif n.endswith("_desc"):
            ty = f"tensordesc<{dt}[{descs[n]}]>"
        elif n in _ARG_TYPES:
            ty = _ARG_TYPES[n]
        elif n.endswith("_ptr"):
            ty = f"*{dt}"
        else:
            ty = "i32"
        out.append((n, ty))
    return out


@functools.lru_cache(maxsize=None)
def table(arch: int) -> Dict:
    """The validated config table of `arch`, read once per process (aot/compile.py reads it here too)."""
    return config_table.load(arch)


def route_blocks(kernel: str, family: str, cfg: Dict) -> List[int]:
    """The ROUTE_BLOCKs a gather GEMM that routes for itself needs with config `cfg`: the one-block routing size of
    every m its buckets serve in any architecture's table (kernels/routing.py one_block_sizes), and 0 for every
    config: perm / seg written before the GEMM (a routing given to the op, the `route` op's, or m too large to route in
    the kernel, whose routing launch comes first). The C++ launcher asks for one_block_size(m), or 0."""
    from kernels.routing import one_block_sizes
    sizes: Dict[int, None] = {0: None}
    for arch in ARCHS:
        lo, cls = 0, None
        for e in config_table.buckets(table(arch), kernel, family):
            if config_table.shape_class(e) != cls:  # a shape class's buckets start again from m = 0
                lo, cls = 0, config_table.shape_class(e)
            hi = e.get("max_m")
            if not e.get("off") and config_table.cfg_str(e) == config_table.cfg_str(cfg):
                sizes.update(dict.fromkeys(one_block_sizes(lo, hi)))
            lo = hi if hi is not None else lo
    return list(sizes)


def configs(kernel: str, family: str) -> List[Tuple[Dict, Tuple[int, ...]]]:
    """Every distinct config of (kernel, family) in the tables of ARCHS (aot/configs/sm<arch>.json), with the
    architectures whose table lists it: a config is compiled for exactly those (its variant key carries "cfg=...", and
    the runtime asks only for configs of the table of the device's architecture)."""
    found: Dict[str, Tuple[Dict, List[int]]] = {}
    for arch in ARCHS:
        for e in config_table.buckets(table(arch), kernel, family):
            if e.get("off"):  # nothing to compile: the launcher takes the other design
                continue
            found.setdefault(config_table.cfg_str(e), (e, []))[1].append(arch)
    return [(e, tuple(archs)) for e, archs in found.values()]


@dataclasses.dataclass
class Variant:
    kernel: str                      # "kernels.rope:rope_kernel"
    key: Dict[str, Union[int, str]]  # what the launcher selects on
    args: List[Tuple[str, str]]      # call arguments in order: (name, triton type)
    meta: Dict[str, object]          # constexpr meta-parameters not passed by the caller
    spec: Dict[str, object]          # per-argument assumptions (see module doc)
    num_warps: int = 4
    num_stages: int = 1
    archs: Tuple[int, ...] = ARCHS

    @property
    def name(self) -> str:
        return self.kernel.split(":")[1]

    @property
    def key_str(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.key.items()))


def _rope_variants() -> List[Variant]:
    out = []
    for dt in DTYPES:
        strides = [f"s{t}_{d}" for t in ("x", "o", "x2", "o2") for d in ("s", "b", "h", "d")] + ["freqs_stride"]
        args = runtime_args("kernels.rope:rope_kernel", dt, types=dict.fromkeys(strides, "i64"))
        for cfg, archs in configs("rope_kernel", "all"):
            bt, bh, bhalf = cfg["block"]
            for thd in (0, 1):
                for interleaved in (0, 1):
                    for second in (0, 1):
                        key = {"dtype": dt, "thd": thd, "interleaved": interleaved, "second": second,
                               "cfg": config_table.cfg_str(cfg)}
                        meta = {"IS_THD": bool(thd), "INTERLEAVED": bool(interleaved), "HAS_SECOND": bool(second),
                                "BLOCK_T": bt, "BLOCK_H": bh, "BLOCK_HALF": bhalf}
                        # Fast path: unit channel stride, 16-byte aligned rows and pair offsets -> vector loads.
                        aligned = {"x_ptr": 16, "out_ptr": 16, "x2_ptr": 16, "out2_ptr": 16, "freqs_ptr": 16,
                                   "HALF": 16, "freqs_stride": 16}
                        for t in ("x", "o", "x2", "o2"):
                            aligned.update({f"s{t}_s": 16, f"s{t}_b": 16, f"s{t}_h": 16, f"s{t}_d": ("eq", 1)})
                        for spec in (aligned, {}):
                            out.append(Variant("kernels.rope:rope_kernel", key, args, meta, spec, cfg["warps"],
                                               cfg["stages"], archs))
    return out


def _decode_attention_variants() -> List[Variant]:
    """kernels/decode_attention.py, launched by csrc/ops/decode_attention_cuda.cpp: the attention kernel for every config
    of the tables (block: BLOCK_M x BLOCK_N x HEAD_D; the shape class n is the head dim, m the query rows G * T of a
    KV head), bf16 and fp16, and the combine of its splits (not configurable). Only the aligned variant (16-byte
    aligned tensors, strides multiples of 16 elements: the K / V loop is then pipelined with 16-byte async copies),
    which every tensor a model allocates meets (head dims 64-256): its generic twin cost as many images (each about 7 s
    of compile time, half of the op's build) for views off 16 bytes only. The launcher copies such a q / k_new /
    v_new (T <= 16 rows) and refuses such a cache (written in place: no copy can stand in for it). cache_lens carries
    no hint (a view such as lens[1:] is 4-byte aligned)."""
    from kernels import decode_attention as da
    kernel = "kernels.decode_attention:decode_attention_kernel"
    strides = [f"s{t}_{d}" for t, dims in (("q", "bth"), ("kn", "bth"), ("vn", "bth"), ("kc", "bhs"), ("vc", "bhs"))
               for d in dims]
    types = dict(dict.fromkeys(strides, "i64"), lens_ptr="*i32", ws_ptr="*fp32", ml_ptr="*fp32", scale="fp32")
    out, archs_used = [], set()
    for dt in ("bf16", "fp16"):
        args = runtime_args(kernel, dt, types=types)
        aligned = {n: HINT for n, ty in args if (ty.startswith("*") and n != "lens_ptr") or n in strides}
        for cfg, archs in configs("decode_attention_kernel", "half"):
            bm, bn, d = cfg["block"]
            archs_used.update(archs)
            key = {"dtype": dt, "cfg": config_table.cfg_str(cfg)}
            out.append(Variant(kernel, key, args, {"HEAD_D": d, "BLOCK_M": bm, "BLOCK_N": bn}, aligned, cfg["warps"],
                               cfg["stages"], archs))
    combine = "kernels.decode_attention:decode_attention_combine_kernel"
    for dt in ("bf16", "fp16") if archs_used else ():
        args = runtime_args(combine, dt, types={"lens_ptr": "*i32", "ws_ptr": "*fp32", "ml_ptr": "*fp32"})
        # Its tensors are the op's own (workspace, output) but cache_lens; D is 64, 128 or 256.
        spec = {"ws_ptr": 16, "ml_ptr": 16, "out_ptr": 16, "D": 16}
        key = {"dtype": dt, "splits": da.COMBINE_MAX_SPLITS, "cols": da.COMBINE_COLS}
        out.append(Variant(combine, key, args, {"MAX_SPLITS": da.COMBINE_MAX_SPLITS, "BLOCK_D": da.COMBINE_COLS}, spec,
                           4, 1, tuple(sorted(archs_used))))
    return out

def _rms_norm_variants() -> List[Variant]:
    """kernels/rms_norm.py, launched by csrc/ops/rms_norm_cuda.cpp: one block for every row length, per dtype, an
    aligned variant (16-byte aligned pointers, N and row strides multiples of HINT elements: 16-byte vector loads; every
    hidden size a model has) and its generic twin (any N, e.g. a test's odd sizes). The block is not tuned: a row is
    one program's read, far from any compute limit."""
    from kernels import rms_norm
    kernel = "kernels.rms_norm:rms_norm_kernel"
    out = []
    for dt in DTYPES:
        args = runtime_args(kernel, dt, types={"stride_xm": "i64", "stride_om": "i64", "eps": "fp32"})
        aligned = {"x_ptr": 16, "w_ptr": 16, "out_ptr": 16, "N": HINT, "stride_xm": HINT, "stride_om": HINT}
        for spec in (aligned, {}):
            out.append(Variant(kernel, {"dtype": dt, "block": rms_norm.BLOCK}, args, {"BLOCK": rms_norm.BLOCK}, spec,
                               4, 1))
    return out


# ------------------------------------------------------------------------------------------------------------------
# Routed GEMMs (kernels/routing.py, kernels/gemm_*.py, kernels/gather_rows.py, kernels/grad_weight.py; what they do
# and their grids: kernels/GEMM.md, which also says which file holds which kernel). Launched by
# csrc/ops/routed_gemm.cpp, which looks the config up in the generated bucket table (csrc/runtime/kernel_configs.h)
# and computes the grid from the same entry whose "cfg=..." it puts in the key, so grid and kernel cannot disagree.
# Block configs per architecture, family and m bucket: aot/configs/sm<arch>.json (aot/config_table.py). The TMA
# kernels appear only in the sm_90 table. Every sm_80/sm_89 config must fit the 99 KiB of shared memory of
# sm_86/sm_89 (aot/compile.py checks what the compiler reports).

# (dtype, INPUT_PRECISION) units; "prec" is in every GEMM key (bf16/fp16 always "tf32": it does not matter for them).
GEMM_UNITS = (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "tf32"), ("fp32", "ieee"))

# The epilogue of a linear GEMM (a bias, a block's residual add) is two runtime arguments, has_bias and has_residual:
# a uniform branch after the main loop, one image for every epilogue. Compiled as constants, their four combinations
# quadrupled the linear GEMMs' images (1,570 variants, 599 MiB with PTX). Measured on an H200 (bench_matrix,
# linear_fwd): where the tile loop is not flattened the branch costs nothing (cells at M <= 4096 equal to the
# constexpr build's within 0.01); in a flattened loop (a config's "flatten") it made the kernel about 5x slower (M =
# 8192: 5.3x cuBLAS's time against 1.10x). So a flattened config compiles each combination as constants
# (_epilogue_variants: the arguments are then ("eq", v) and the runtime takes the variant whose values they are).
EPILOGUES = ((0, 0), (1, 0), (0, 1), (1, 1))


# The flag combinations of the flagged GEMM kernels: kernel -> ((key name, constexpr), ...) and the combinations
# compiled, one 0/1 per flag. This is the one list: aot/compile.py writes it into the generated kernel table
# (kFlagSets, each combination an int whose bits are the flags in this order, the first highest), from which
# csrc/ops/routed_gemm.cpp asserts that every request of a launcher is listed and forms every key a launcher can ask
# for (the build's variant check). A launcher that needs a new operand path adds it here, and only here.
FLAG_SETS = {
    # (gather, scatter, wt): the linear_dual forward (token-order x gathered, rows scattered), the ffn down projection
    # (A = expert-ordered h, rows scattered), and the grad-input of linear_dual and of the pointer ffn backward (token
    # order, W transposed; the ffn's dx: its second GEMM adds the first one's result as its residual)
    "routed_linear_kernel": ((("gather", "GATHER_A"), ("scatter", "SCATTER_OUT"), ("wt", "W_TRANSPOSED")),
                             ((1, 1, 0), (0, 1, 0), (1, 1, 1))),
    # (scatter, wt), A expert-ordered: the forward into scattered rows (linear_dual, the ffn down projection) or into
    # an expert-ordered buffer (the ffn backward's gate and up; a single expert's down projection in place); the
    # grad-input into scattered rows (linear_dual; the ffn backward's dx) or expert-ordered ones (the ffn backward's dh)
    "routed_linear_tma_kernel": ((("scatter", "SCATTER_OUT"), ("wt", "W_TRANSPOSED")),
                                 ((1, 0), (0, 0), (1, 1), (0, 1))),
    # token-order dy / x with / without the bias gradients (linear_dual, the pointer ffn backward)
    "routed_grad_weight_kernel": ((("gather", "GATHER"), ("dbias", "HAS_DBIAS")), ((1, 1), (1, 0))),
}


def flag_variants(kernel: str):
    """(key entries, constexpr meta) of each flag combination FLAG_SETS lists for `kernel`."""
    names, combos = FLAG_SETS[kernel]
    return [({k: v for (k, _), v in zip(names, c)}, {m: bool(v) for (_, m), v in zip(names, c)}) for c in combos]


# Row counts: no hint. They only bound rows (no vector access runs along them), and M_pad = M + 128 of an unaligned
# routing is rarely a multiple of 16: a hint on it would send every such call (one decode token: M_pad = 129) to the
# generic variant, which loses the hints on the pointers and strides that vectorize the gathers and stores. Nor on an
# expert index (0 or 1) or a weight-order flag (up_first, w_map: small values that select, never address).
_NO_HINT = {"M", "M_pad", "n_rows", "one_rows", "first_expert", "experts", "up_first", "w_map", "n_split", "has_bias",
            "has_residual"}


HINT = 16  # the divisibility of the aligned variants' hints (C++: fused::routed::kHint)


def _aligned(args) -> Dict[str, object]:
    """Divisibility hints (HINT) on every pointer and every integer argument but the row counts and expert indices:
    16-byte aligned pointers, column sizes and strides multiples of 16 elements. Tensor descriptors carry none."""
    return {n: HINT for n, ty in args if not ty.startswith("tensordesc") and n not in _NO_HINT}


_MNK = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")  # what a config's block and group mean, per kernel kind
_NKR = ("BLOCK_N", "BLOCK_K", "BLOCK_R", "GROUP_N")  # grad-weight


def _tile_meta(cfg, prec, names=_MNK, **flags) -> Dict[str, object]:
    """The constexpr meta-parameters of a GEMM variant: the kernel's flags (as bools), INPUT_PRECISION, and the
    config's tile and grouping under the kernel's names."""
    meta: Dict[str, object] = {k: bool(v) for k, v in flags.items()}
    meta["INPUT_PRECISION"] = prec
    meta.update(zip(names, (*cfg["block"], cfg["group"])))
    return meta


def _persistent_meta(cfg, prec, **flags) -> Dict[str, object]:
    """_tile_meta of a persistent TMA GEMM: also FLATTEN (config_table.PERSISTENT)."""
    return dict(_tile_meta(cfg, prec, **flags), FLATTEN=bool(cfg.get("flatten", False)))


def _split_meta(cfg, prec, **flags) -> Dict[str, object]:
    """_persistent_meta of a linear TMA GEMM: also SPLIT_TAIL and STREAM_K (config_table.SPLIT_CONFIG)."""
    return dict(_persistent_meta(cfg, prec, **flags), SPLIT_TAIL=int(cfg.get("split", 0)),
                STREAM_K=int(cfg.get("stream_k", 0)), SK_WAIT=True)


def _both(kernel, key, args, meta, cfg, archs) -> List[Variant]:
    """The aligned variant first (taken whenever the runtime finds its assumptions hold), then the generic one.

    The Hopper TMA kernels (`_tma_` in the name) get the aligned variant only. Their generic twins were 54% of a
    portable build's AOT CPU time (827 of 1,545 s on 2 cores) and served only odd inputs: sizes TMA can address but
    that are not multiples of 16 elements, a bias, residual, x or mask view off 16 bytes. The C++ launchers send
    those to the pointer kernels (Gemm::tma_usable: sizes) or copy them aligned (routed_gemm.cpp hinted / hinted_rows:
    a bias or residual is copied, a gather inside the GEMM falls back to the gather copy)."""
    key = dict(key, cfg=config_table.cfg_str(cfg))
    specs = (_aligned(args),) if "_tma_" in kernel else (_aligned(args), {})
    return [Variant(kernel, key, args, meta, spec, cfg["warps"], cfg["stages"], archs) for spec in specs]


def _epilogue_variants(kernel, key, args, meta, cfg, archs) -> List[Variant]:
    """_both of a linear GEMM: has_bias / has_residual runtime arguments, or, for a flattened config, compiled in as
    constants, one pair of variants per combination the launcher can ask for on the key's operand path (csrc/ops/
    routed_gemm.cpp linear(): no bias on the grad-input (wt), whose residual goes into scattered token-order rows only;
    the forward takes any, also unscattered: an identity routing's in-place rows are in token order)."""
    if not cfg.get("flatten"):
        return _both(kernel, key, args, meta, cfg, archs)
    out = []
    wt, scatter = key.get("wt", 0), key.get("scatter", 1)
    for bias, res in EPILOGUES:
        if wt and (bias or (res and not scatter)):
            continue
        for v in _both(kernel, key, args, meta, cfg, archs):
            v.spec = dict(v.spec, has_bias=("eq", bias), has_residual=("eq", res))
            out.append(v)
    return out


def _routing_variants() -> List[Variant]:
    from kernels import routing  # the block sizes the Python launchers use are the ones compiled here
    out = []
    # align: the aligned routing of every routed kernel, and 1 (unaligned segments) for the ffn forward's TMA path.
    for align in (config_table.ROUTING_ALIGN, 1):
        for block, warps in ((routing.ONE_BLOCK_SMALL, 2), (routing.ONE_BLOCK_MID, 8), (routing.ONE_BLOCK, 8)):
            out.append(Variant("kernels.routing:routing_one_block_kernel", {"align": align, "block": block},
                               runtime_args("kernels.routing:routing_one_block_kernel"), {"BLOCK": block, "ALIGN": align}, {}, warps, 1, ARCHS))
        out.append(Variant("kernels.routing:routing_scatter_kernel", {"align": align, "chunk": routing.CHUNK},
                           runtime_args("kernels.routing:routing_scatter_kernel"),
                           {"CHUNK": routing.CHUNK, "ALIGN": align}, {}, 4, 1, ARCHS))
        out.append(Variant("kernels.routing:routing_single_kernel", {"align": align, "block": routing.SINGLE_BLOCK},
                           runtime_args("kernels.routing:routing_single_kernel"), {"BLOCK": routing.SINGLE_BLOCK, "ALIGN": align}, {}, 4, 1, ARCHS))
    # The `route` op's buffer (both routings, the aligned one to ROUTING_ALIGN) in one launch.
    for block, warps in ((routing.ONE_BLOCK_SMALL, 2), (routing.ONE_BLOCK_MID, 8), (routing.ONE_BLOCK, 8)):
        out.append(Variant("kernels.routing:routing_shared_kernel", {"block": block},
                           runtime_args("kernels.routing:routing_shared_kernel"),
                           {"BLOCK": block, "ALIGN": config_table.ROUTING_ALIGN}, {}, warps, 1, ARCHS))
    out.append(Variant("kernels.routing:routing_count_kernel", {"chunk": routing.CHUNK},
                       runtime_args("kernels.routing:routing_count_kernel"), {"CHUNK": routing.CHUNK}, {}, 4, 1,
                       ARCHS))
    return out


def _gemm_variants() -> List[Variant]:
    # The gather's rows per program, from kernels/gather_rows.py as its Python launchers use it; in the keys
    # ("rows=32"), so that a C++ launcher whose grid assumes another value fails with "no compiled variant" instead
    # of gathering the wrong rows.
    from kernels import routing
    from kernels.gather_rows import GATHER_COLS, GATHER_ROWS
    from kernels.gemm_tiles import _tail_cols  # the second W descriptor's box, as the Python launchers make it
    out = []
    for dt in DTYPES:  # gather_rows: a copy (colsum=1: with per-block column sums), no precision, not configurable
        args = runtime_args("kernels.gather_rows:gather_rows_kernel", dt)
        for colsum in (0, 1):
            cols, warps = GATHER_COLS[bool(colsum)]  # in the key too: the C++ grid divides C by it
            for spec in (_aligned(args), {}):
                key = {"dtype": dt, "colsum": colsum, "rows": GATHER_ROWS, "cols": cols}
                out.append(Variant("kernels.gather_rows:gather_rows_kernel", key, args,
                                   {"COLSUM": bool(colsum), "BLOCK_R": GATHER_ROWS, "BLOCK_C": cols}, spec, warps, 1,
                                   ARCHS))
        # route_gather_rows: the unaligned routing of a mask of up to ONE_BLOCK rows and the gather through it, one
        # launch (the ffn forward's x, sm_90: only the TMA kernels take an unaligned routing). block: the
        # one-block routing size of M, as routing_one_block_kernel's (the C++ launcher asks for one_block_size(M)).
        args = runtime_args("kernels.gather_rows:route_gather_rows_kernel", dt)
        cols, warps = GATHER_COLS[False]
        for block in routing.ONE_BLOCKS:
            key = {"dtype": dt, "block": block, "rows": GATHER_ROWS, "cols": cols}
            for spec in (_aligned(args), {}):
                out.append(Variant("kernels.gather_rows:route_gather_rows_kernel", key, args,
                                   {"MASK_BLOCK": block, "BLOCK_R": GATHER_ROWS, "BLOCK_C": cols}, spec, warps, 1,
                                   (90,)))
        # expert_colsum: the second pass of the bias gradients (the per-expert sums of gather_rows' colsum).
        args = runtime_args("kernels.gather_rows:expert_colsum_kernel", dt)
        for spec in (_aligned(args), {}):
            out.append(Variant("kernels.gather_rows:expert_colsum_kernel", {"dtype": dt, "rows": GATHER_ROWS}, args,
                               {"ROWS_PER_BLOCK": GATHER_ROWS, "BLOCK_B": 64, "BLOCK_C": 64}, spec, 4, 1, ARCHS))
    from kernels.gemm_decode import DECODE_MAX_SPLITS, DECODE_REDUCE_COLS
    # decode_reduce: the sum of the decode GEMM's split partials, + bias, + residual (kernels/gemm_decode.py), for the
    # architectures whose table has the decode GEMM
    decode_archs = tuple(sorted({a for f in config_table.KERNELS["routed_decode_linear_kernel"][0]
                                 for _, archs in configs("routed_decode_linear_kernel", f) for a in archs}))
    for dt in DTYPES if decode_archs else ():
        args = runtime_args("kernels.gemm_decode:decode_reduce_kernel", dt)
        for spec in (_aligned(args), {}):
            out.append(Variant("kernels.gemm_decode:decode_reduce_kernel",
                               {"dtype": dt, "cols": DECODE_REDUCE_COLS, "splits": DECODE_MAX_SPLITS}, args,
                               {"MAX_SPLITS": DECODE_MAX_SPLITS, "BLOCK_N": DECODE_REDUCE_COLS}, spec, 4, 1,
                               decode_archs))
    for dt in DTYPES:  # swiglu_backward: elementwise (kernels/swiglu_backward.py); not configurable. gather=1: gate
        # and up saved by the forward in token order, read through perm into the backward's expert-ordered buffers.
        args = runtime_args("kernels.swiglu_backward:swiglu_backward_kernel", dt)
        for gather in (0, 1):
            for spec in (_aligned(args), {}):
                out.append(Variant("kernels.swiglu_backward:swiglu_backward_kernel", {"dtype": dt, "gather": gather},
                                   args, {"GATHER": bool(gather), "BLOCK_R": 16, "BLOCK_C": 256}, spec, 4, 1, ARCHS))
    for dt, prec in GEMM_UNITS:
        fam = config_table.family(dt, prec)
        base = {"dtype": dt, "prec": prec}

        # routed_linear_kernel (pointer loads): its FLAG_SETS combinations.
        args = runtime_args("kernels.gemm_pointer:routed_linear_kernel", dt)
        for cfg, archs in configs("routed_linear_kernel", fam):
            for key, flags in flag_variants("routed_linear_kernel"):
                out += _both("kernels.gemm_pointer:routed_linear_kernel", dict(base, **key), args,
                             _tile_meta(cfg, prec, **flags), cfg, archs)

        # routed_decode_linear_kernel (pointer loads, any sm_80+): the linear forward of a few tokens with the
        # reduction split over the grid, no routing (kernels/gemm_decode.py); every epilogue. Only for the m its
        # table's buckets serve (an alternative design: other m, and tables without it, take the kernels above).
        args = runtime_args("kernels.gemm_decode:routed_decode_linear_kernel", dt)
        for cfg, archs in configs("routed_decode_linear_kernel", fam):
            out += _both("kernels.gemm_decode:routed_decode_linear_kernel", dict(base), args, _tile_meta(cfg, prec),
                         cfg, archs)

        # routed_swiglu_kernel (pointer loads): x gathered through perm -> expert-ordered h.
        args = runtime_args("kernels.gemm_pointer:routed_swiglu_kernel", dt)
        # save=1: gate and up also stored for the ffn backward (SAVE), in every forward gate/up kernel below.
        for cfg, archs in configs("routed_swiglu_kernel", fam):
            for save in (0, 1):
                meta = _tile_meta(cfg, prec, GATHER_A=True, SCATTER_OUT=False, SAVE=save)
                out += _both("kernels.gemm_pointer:routed_swiglu_kernel", dict(base, gather=1, scatter=0, save=save),
                             args, meta, cfg, archs)

        # routed_grad_weight_kernel: dW_e (and db_e) written in the input dtype (fp32 accumulation over all rows of
        # the expert inside one program), token-order dy/x gathered through perm: linear_dual (dbias) and the pointer
        # ffn backward. (Expert-ordered buffers, on sm_90, go to routed_grad_weight_tma_kernel.)
        args = runtime_args("kernels.grad_weight:routed_grad_weight_kernel", dt)
        for cfg, archs in configs("routed_grad_weight_kernel", fam):
            for key, flags in flag_variants("routed_grad_weight_kernel"):
                meta = _tile_meta(cfg, prec, _NKR, ACCUMULATE=False, **flags)
                out += _both("kernels.grad_weight:routed_grad_weight_kernel", dict(base, **key), args, meta, cfg,
                             archs)

        # routed_linear_tma_kernel (sm_90): A expert-ordered through a [BM, BK] descriptor, W stacked [E, R, C]
        # through a rank-3 descriptor ([1, BN, BK], or [1, BK, BN] when W_TRANSPOSED), and through one of BN / S
        # columns for the last round split in S (kernels/gemm_tiles.py _split_tail; compiled in where the config has
        # "split": S; BN / 2, unread, without it); its FLAG_SETS combinations.
        for cfg, archs in configs("routed_linear_tma_kernel", fam):
            bm, bn, bk = cfg["block"]
            for key, flags in flag_variants("routed_linear_tma_kernel"):
                wt = key["wt"]
                wblock = f"1, {bk}, {bn}" if wt else f"1, {bn}, {bk}"
                bs = _tail_cols(bn, cfg.get("split", 0))
                hblock = f"1, {bk}, {bs}" if wt else f"1, {bs}, {bk}"
                args = runtime_args("kernels.gemm_tma:routed_linear_tma_kernel", dt,
                                    {"a_desc": f"{bm}, {bk}", "w_desc": wblock, "wh_desc": hblock})
                out += _epilogue_variants("kernels.gemm_tma:routed_linear_tma_kernel", dict(base, **key), args,
                                          _split_meta(cfg, prec, **flags), cfg, archs)

        # routed_linear_gather_tma_kernel (sm_90): the linear forward with A in token order, its rows gathered by
        # pointer loads inside the GEMM (no gather copy), W through TMA, rows scattered; every epilogue. It routes
        # the mask itself (route = ROUTE_BLOCK > 0) for the m its buckets serve up to routing.ONE_BLOCK; align: the
        # aligned routing of linear_dual.
        for cfg, archs in configs("routed_linear_gather_tma_kernel", fam):
            bm, bn, bk = cfg["block"]
            args = runtime_args("kernels.gemm_gather_tma:routed_linear_gather_tma_kernel", dt,
                                {"w_desc": f"1, {bn}, {bk}", "wh_desc": f"1, {_tail_cols(bn, cfg.get('split', 0))}, {bk}"})
            align = config_table.ROUTING_ALIGN
            for route in route_blocks("routed_linear_gather_tma_kernel", fam, cfg):
                meta = dict(_split_meta(cfg, prec), ROUTE_BLOCK=route, ALIGN=align)
                out += _epilogue_variants("kernels.gemm_gather_tma:routed_linear_gather_tma_kernel",
                                          dict(base, route=route, align=align), args, meta, cfg, archs)

        # routed_swiglu_gather_tma_kernel (sm_90): the gate/up GEMM with x in token order (rows gathered inside), on
        # the unaligned routing of the ffn forward's TMA path; routes the mask itself as the linear one does.
        for cfg, archs in configs("routed_swiglu_gather_tma_kernel", fam):
            bm, bn, bk = cfg["block"]
            args = runtime_args("kernels.gemm_gather_tma:routed_swiglu_gather_tma_kernel", dt,
                                {"w1_desc": f"1, {bn}, {bk}", "w3_desc": f"1, {bn}, {bk}"})
            for route in route_blocks("routed_swiglu_gather_tma_kernel", fam, cfg):
                for save in (0, 1):
                    meta = dict(_persistent_meta(cfg, prec, SAVE=save), ROUTE_BLOCK=route, ALIGN=1)
                    out += _both("kernels.gemm_gather_tma:routed_swiglu_gather_tma_kernel",
                                 dict(base, route=route, align=1, save=save), args, meta, cfg, archs)

        # routed_grad_weight_tma_kernel (sm_90): expert-ordered dy / x through [BR, BN] / [BR, BK] descriptors, both
        # experts' dW stored through [BN, BK] descriptors.
        for cfg, archs in configs("routed_grad_weight_tma_kernel", fam):
            bn, bk, br = cfg["block"]
            args = runtime_args("kernels.grad_weight:routed_grad_weight_tma_kernel", dt,
                                {"dy_desc": f"{br}, {bn}", "x_desc": f"{br}, {bk}", "dw0_desc": f"{bn}, {bk}",
                                 "dw1_desc": f"{bn}, {bk}"})
            meta = _tile_meta(cfg, prec, _NKR)
            out += _both("kernels.grad_weight:routed_grad_weight_tma_kernel", dict(base), args, meta, cfg, archs)

        # routed_swiglu_tma_kernel (sm_90): expert-ordered x -> expert-ordered h (no fp32-ieee variant).
        for cfg, archs in configs("routed_swiglu_tma_kernel", fam):
            bm, bn, bk = cfg["block"]
            args = runtime_args("kernels.gemm_tma:routed_swiglu_tma_kernel", dt,
                                {"a_desc": f"{bm}, {bk}", "w1_desc": f"1, {bn}, {bk}", "w3_desc": f"1, {bn}, {bk}"})
            for save in (0, 1):
                meta = _persistent_meta(cfg, prec, SCATTER_OUT=False, SAVE=save)
                out += _both("kernels.gemm_tma:routed_swiglu_tma_kernel", dict(base, scatter=0, save=save), args, meta,
                             cfg, archs)

        # routed_swiglu_pair_tma_kernel (sm_90): gate and up through one rank-4 descriptor [2, E, I, H], one MMA;
        # the same tensor with half the columns per block for the split last round (kernels/gemm_tiles.py _split_tail).
        for cfg, archs in configs("routed_swiglu_pair_tma_kernel", fam):
            bm, bn, bk = cfg["block"]
            args = runtime_args("kernels.gemm_tma:routed_swiglu_pair_tma_kernel", dt,
                                {"a_desc": f"{bm}, {bk}", "w13_desc": f"2, 1, {bn}, {bk}",
                                 "w13h_desc": f"2, 1, {bn // 2}, {bk}"})
            for save in (0, 1):
                out += _both("kernels.gemm_tma:routed_swiglu_pair_tma_kernel", dict(base, save=save), args,
                             _persistent_meta(cfg, prec, SAVE=save), cfg, archs)

        # routed_swiglu_pair_bwd_tma_kernel (sm_90): its backward twin (the ffn backward's gate/up recompute with the
        # SwiGLU backward in the epilogue).
        for cfg, archs in configs("routed_swiglu_pair_bwd_tma_kernel", fam):
            bm, bn, bk = cfg["block"]
            args = runtime_args("kernels.gemm_tma:routed_swiglu_pair_bwd_tma_kernel", dt,
                                {"a_desc": f"{bm}, {bk}", "w13_desc": f"2, 1, {bn}, {bk}"})
            out += _both("kernels.gemm_tma:routed_swiglu_pair_bwd_tma_kernel", dict(base), args,
                         _persistent_meta(cfg, prec), cfg, archs)
    return out


def variants() -> List[Variant]:
    return (_rope_variants() + _decode_attention_variants() + _rms_norm_variants() + _routing_variants()
            + _gemm_variants())
