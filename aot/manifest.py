"""What the AOT step compiles: every specialization of every kernel, for every target architecture.

A *variant* is one `@triton.jit` function compiled with fixed meta-parameters. Its `key` (e.g.
`dtype=bf16,interleaved=0,second=0,thd=0`) is what the C++ launcher asks for; several variants may share a key and
differ only in what they assume of the call arguments (16-byte alignment, a unit stride). The runtime checks those
assumptions on every launch and takes the first variant, in manifest order, whose assumptions hold, so the fast
specialization is listed first and the generic one last.

Each call argument is (name, type) with type one of the Triton signature types (`*bf16`, `i32`, `i64`, `fp32`, ...).
`spec` maps an argument name to `16` (divisible by 16: for a pointer, 16-byte aligned) or to `("eq", v)` (the
argument is compiled in as the constant v and the runtime requires the caller to pass exactly v).
"""
import dataclasses
from typing import Dict, List, Tuple, Union

# sm_90 is what we test on; sm_80/sm_89 are cross-compiled; the PTX of the lowest one lets newer GPUs JIT it.
ARCHS = (80, 89, 90)
PTX_ARCH = 80

DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}


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
        ptr = f"*{dt}"
        args = [("x_ptr", ptr), ("out_ptr", ptr), ("x2_ptr", ptr), ("out2_ptr", ptr), ("freqs_ptr", "*fp32"),
                ("cu_seqlens_ptr", "*i32"), ("start_ptr", "*i32"),
                ("S", "i32"), ("B", "i32"), ("H", "i32"), ("H2", "i32"), ("D", "i32"), ("HALF", "i32"),
                ("s_max", "i32"), ("freqs_stride", "i64")]
        for t in ("x", "o", "x2", "o2"):
            args += [(f"s{t}_{d}", "i64") for d in ("s", "b", "h", "d")]
        args += [("cp_size", "i32"), ("cp_rank", "i32"), ("flags", "i32")]
        for thd in (0, 1):
            for interleaved in (0, 1):
                for second in (0, 1):
                    key = {"dtype": dt, "thd": thd, "interleaved": interleaved, "second": second}
                    meta = {"IS_THD": bool(thd), "INTERLEAVED": bool(interleaved), "HAS_SECOND": bool(second),
                            "BLOCK_H": 16, "BLOCK_HALF": 64, "BLOCK_B": 128}
                    # Fast path: unit channel stride, 16-byte aligned rows and pair offsets -> vector loads.
                    aligned = {"x_ptr": 16, "out_ptr": 16, "x2_ptr": 16, "out2_ptr": 16, "freqs_ptr": 16,
                               "HALF": 16, "freqs_stride": 16}
                    for t in ("x", "o", "x2", "o2"):
                        aligned.update({f"s{t}_s": 16, f"s{t}_b": 16, f"s{t}_h": 16, f"s{t}_d": ("eq", 1)})
                    # 2 warps: measured with aot/tune.py on the H100 (docs/perf.md, v2); 4 were 20% slower.
                    out.append(Variant("kernels.rope:rope_kernel", key, args, meta, aligned, num_warps=2))
                    out.append(Variant("kernels.rope:rope_kernel", key, args, meta, {}, num_warps=2))
    return out


# ------------------------------------------------------------------------------------------------------------------
# Routed GEMMs (kernels/routing.py, kernels/gemm.py; argument lists and grids: kernels/GEMM.md). Launched by
# csrc/ops/routed_gemm.cpp, which builds the same keys. The tile sizes are part of every GEMM key ("tile=BMxBNxBK",
# grad-weight "BNxBKxBR") because the C++ side computes the grids from them: a launcher whose tiles drift from the
# manifest then fails loudly ("no compiled variant ... for key") instead of launching a wrong grid.
#
# Architectures: every one of ARCHS for the pointer kernels (sm_89 is kept although a compute capability 8.x device
# could run the sm_80 cubin: it costs ~40 s of a cold 2-core build and keeps builds with FUSED_ARCHS lacking 80 working;
# every sm_80/sm_89 config below fits the 99 KiB of shared memory of sm_86/sm_89). The TMA kernels are sm_90 only.
GEMM_ARCHS = ARCHS
TMA_ARCHS = (90, )

# (dtype, INPUT_PRECISION) units; "prec" is in every GEMM key (bf16/fp16 always "tf32": it does not matter for them).
GEMM_UNITS = (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "tf32"), ("fp32", "ieee"))

# Tiles per kernel and unit family (GEMM.md's table). Pointer linear fp32+tf32 uses 128x128x32 instead of the table's
# 128x128x64: the latter needs 128 KiB of shared memory on sm_80 images, more than sm_86/sm_89 allow.
GEMM_TILES = {
    "linear": {"half": (128, 128, 64), "tf32": (128, 128, 32), "ieee": (64, 64, 32)},
    "swiglu": {"half": (128, 64, 64), "tf32": (128, 64, 32), "ieee": (64, 64, 32)},  # sm80 config on both archs
    "grad_weight": {"half": (128, 128, 64), "tf32": (128, 128, 64), "ieee": (64, 64, 32)},  # BN x BK x BR
    "linear_tma": {"half": (128, 256, 64), "tf32": (128, 128, 32), "ieee": (64, 64, 32)},
    "swiglu_tma": {"half": (128, 128, 64), "tf32": (128, 64, 32)},  # no fp32-ieee TMA swiglu
    "grad_weight_tma": {"half": (128, 256, 64), "tf32": (128, 128, 32), "ieee": (64, 64, 32)},  # BN x BK x BR
}
# Decoding (M <= 64 rows, bf16/fp16; csrc/ops/routed_gemm.cpp kDecodeRows): narrower tiles, 4 warps, 4 stages, so that
# more CTAs stream the weights. Measured with aot/tune.py on the H100 (docs/perf.md).
DECODE_TILE = (128, 64, 64)
GROUP = 8  # GROUP_M / GROUP_N


def _family(dt: str, prec: str) -> str:
    return "half" if dt in ("bf16", "fp16") else prec


def _tile_str(t) -> str:
    return "x".join(str(v) for v in t)


def _aligned(args) -> Dict[str, object]:
    """Divisibility hints (16) on every pointer and integer argument: 16-byte aligned pointers, sizes and strides
    multiples of 16 elements. Tensor descriptors carry none."""
    return {n: 16 for n, ty in args if not ty.startswith("tensordesc")}


def _both(kernel, key, args, meta, archs, num_warps=8, num_stages=3) -> List[Variant]:
    """The aligned variant first (taken whenever the runtime finds its assumptions hold), then the generic one."""
    return [Variant(kernel, key, args, meta, _aligned(args), num_warps, num_stages, archs),
            Variant(kernel, key, args, meta, {}, num_warps, num_stages, archs)]


def _routing_variants() -> List[Variant]:
    count = Variant("kernels.routing:routing_count_kernel", {"chunk": 1024},
                    [("mask_ptr", "*i8"), ("block_counts_ptr", "*i32"), ("M", "i32")], {"CHUNK": 1024}, {},
                    4, 1, GEMM_ARCHS)
    scatter = Variant("kernels.routing:routing_scatter_kernel", {"align": 128, "chunk": 1024},
                      [("mask_ptr", "*i8"), ("block_counts_ptr", "*i32"), ("perm_ptr", "*i32"), ("seg_ptr", "*i32"),
                       ("M", "i32"), ("M_pad", "i32"), ("num_blocks", "i32")], {"CHUNK": 1024, "ALIGN": 128}, {},
                      4, 1, GEMM_ARCHS)
    return [count, scatter]


def _gemm_variants() -> List[Variant]:
    out = []
    for dt in DTYPES:  # gather_rows: a copy, no precision
        args = [("src_ptr", f"*{dt}"), ("dst_ptr", f"*{dt}"), ("perm_ptr", "*i32"), ("M_pad", "i32"), ("C", "i32"),
                ("stride_src", "i32"), ("stride_dst", "i32")]
        out += _both("kernels.gemm:gather_rows_kernel", {"dtype": dt}, args, {"BLOCK_R": 32, "BLOCK_C": 128},
                     GEMM_ARCHS, num_warps=4, num_stages=1)
    for dt, prec in GEMM_UNITS:
        fam = _family(dt, prec)
        p = f"*{dt}"
        base = {"dtype": dt, "prec": prec}

        # routed_linear_kernel (pointer loads): (GATHER_A, SCATTER_OUT, W_TRANSPOSED, HAS_BIAS) combinations used by
        # linear_dual forward (with / without bias) and grad-input, and by the ffn down projection (A = h).
        bm, bn, bk = GEMM_TILES["linear"][fam]
        args = [("a_ptr", p), ("w0_ptr", p), ("w1_ptr", p), ("bias0_ptr", p), ("bias1_ptr", p), ("out_ptr", p),
                ("perm_ptr", "*i32"), ("seg_ptr", "*i32"), ("M_pad", "i32"), ("N", "i32"), ("K", "i32"),
                ("stride_am", "i32"), ("stride_w", "i32"), ("stride_om", "i32")]
        for gather, scatter, wt, bias in ((1, 1, 0, 1), (1, 1, 0, 0), (1, 1, 1, 0), (0, 1, 0, 0)):
            key = dict(base, gather=gather, scatter=scatter, wt=wt, bias=bias, tile=_tile_str((bm, bn, bk)))
            meta = {"HAS_BIAS": bool(bias), "GATHER_A": bool(gather), "SCATTER_OUT": bool(scatter),
                    "W_TRANSPOSED": bool(wt), "INPUT_PRECISION": prec, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                    "GROUP_M": GROUP}
            out += _both("kernels.gemm:routed_linear_kernel", key, args, meta, GEMM_ARCHS)

        # routed_swiglu_kernel (pointer loads): x gathered through perm -> expert-ordered h.
        bm, bn, bk = GEMM_TILES["swiglu"][fam]
        args = [("a_ptr", p), ("w1_0_ptr", p), ("w1_1_ptr", p), ("w3_0_ptr", p), ("w3_1_ptr", p), ("h_ptr", p),
                ("perm_ptr", "*i32"), ("seg_ptr", "*i32"), ("M_pad", "i32"), ("N", "i32"), ("K", "i32"),
                ("stride_am", "i32"), ("stride_w", "i32"), ("stride_hm", "i32")]
        key = dict(base, gather=1, scatter=0, tile=_tile_str((bm, bn, bk)))
        meta = {"GATHER_A": True, "SCATTER_OUT": False, "INPUT_PRECISION": prec, "BLOCK_M": bm, "BLOCK_N": bn,
                "BLOCK_K": bk, "GROUP_M": GROUP}
        out += _both("kernels.gemm:routed_swiglu_kernel", key, args, meta, GEMM_ARCHS)

        # routed_grad_weight_kernel: dW_e (and db_e) written in the input dtype (fp32 accumulation over all rows of
        # the expert inside one program). GATHER=1 (token-order dy/x): linear_dual (dbias) and the pointer ffn
        # backward. (Expert-ordered buffers, on sm_90, go to routed_grad_weight_tma_kernel.)
        bn, bk, br = GEMM_TILES["grad_weight"][fam]
        args = [("dy_ptr", p), ("x_ptr", p), ("perm_ptr", "*i32"), ("seg_ptr", "*i32"), ("dw0_ptr", p), ("dw1_ptr", p),
                ("db0_ptr", p), ("db1_ptr", p), ("N", "i32"), ("K", "i32"), ("stride_dym", "i32"),
                ("stride_xm", "i32"), ("stride_dwn", "i32")]
        for gather, dbias, archs in ((1, 1, GEMM_ARCHS), (1, 0, GEMM_ARCHS)):
            key = dict(base, gather=gather, dbias=dbias, tile=_tile_str((bn, bk, br)))
            meta = {"GATHER": bool(gather), "HAS_DBIAS": bool(dbias), "ACCUMULATE": False, "INPUT_PRECISION": prec,
                    "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_R": br, "GROUP_N": GROUP}
            out += _both("kernels.gemm:routed_grad_weight_kernel", key, args, meta, archs)

        # routed_linear_tma_kernel (sm_90): A expert-ordered through a [BM, BK] descriptor, W stacked [E, R, C]
        # through a rank-3 descriptor ([1, BN, BK], or [1, BK, BN] when W_TRANSPOSED). (SCATTER_OUT, W_TRANSPOSED,
        # HAS_BIAS): linear_dual forward / grad-input, ffn down projection, ffn backward (expert-ordered g, u, dh).
        bm, bn, bk = GEMM_TILES["linear_tma"][fam]
        for scatter, wt, bias in ((1, 0, 1), (1, 0, 0), (1, 1, 0), (0, 0, 0), (0, 1, 0)):
            wblock = f"1, {bk}, {bn}" if wt else f"1, {bn}, {bk}"
            args = [("a_desc", f"tensordesc<{dt}[{bm}, {bk}]>"), ("w_desc", f"tensordesc<{dt}[{wblock}]>"),
                    ("bias0_ptr", p), ("bias1_ptr", p), ("out_ptr", p), ("perm_ptr", "*i32"), ("seg_ptr", "*i32"),
                    ("M_pad", "i32"), ("N", "i32"), ("K", "i32"), ("stride_om", "i32")]
            key = dict(base, scatter=scatter, wt=wt, bias=bias, tile=_tile_str((bm, bn, bk)))
            meta = {"HAS_BIAS": bool(bias), "SCATTER_OUT": bool(scatter), "W_TRANSPOSED": bool(wt),
                    "INPUT_PRECISION": prec, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": GROUP}
            out += _both("kernels.gemm:routed_linear_tma_kernel", key, args, meta, TMA_ARCHS)
        for bias in ((1, 0) if fam == "half" else ()):  # decode: scattered forward GEMMs only
            dm, dn, dk = DECODE_TILE
            args = [("a_desc", f"tensordesc<{dt}[{dm}, {dk}]>"), ("w_desc", f"tensordesc<{dt}[1, {dn}, {dk}]>"),
                    ("bias0_ptr", p), ("bias1_ptr", p), ("out_ptr", p), ("perm_ptr", "*i32"), ("seg_ptr", "*i32"),
                    ("M_pad", "i32"), ("N", "i32"), ("K", "i32"), ("stride_om", "i32")]
            key = dict(base, scatter=1, wt=0, bias=bias, tile=_tile_str(DECODE_TILE))
            meta = {"HAS_BIAS": bool(bias), "SCATTER_OUT": True, "W_TRANSPOSED": False, "INPUT_PRECISION": prec,
                    "BLOCK_M": dm, "BLOCK_N": dn, "BLOCK_K": dk, "GROUP_M": GROUP}
            out += _both("kernels.gemm:routed_linear_tma_kernel", key, args, meta, TMA_ARCHS, num_warps=4,
                         num_stages=4)

        # routed_grad_weight_tma_kernel (sm_90): expert-ordered dy / x through [BR, BN] / [BR, BK] descriptors.
        bn, bk, br = GEMM_TILES["grad_weight_tma"][fam]
        args = [("dy_desc", f"tensordesc<{dt}[{br}, {bn}]>"), ("x_desc", f"tensordesc<{dt}[{br}, {bk}]>"),
                ("seg_ptr", "*i32"), ("dw0_ptr", p), ("dw1_ptr", p), ("N", "i32"), ("K", "i32"), ("stride_dwn", "i32")]
        key = dict(base, tile=_tile_str((bn, bk, br)))
        meta = {"INPUT_PRECISION": prec, "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_R": br, "GROUP_N": GROUP}
        out += _both("kernels.gemm:routed_grad_weight_tma_kernel", key, args, meta, TMA_ARCHS)

        # routed_swiglu_tma_kernel (sm_90): expert-ordered x -> expert-ordered h.
        if fam in GEMM_TILES["swiglu_tma"]:
            bm, bn, bk = GEMM_TILES["swiglu_tma"][fam]
            args = [("a_desc", f"tensordesc<{dt}[{bm}, {bk}]>"), ("w1_desc", f"tensordesc<{dt}[1, {bn}, {bk}]>"),
                    ("w3_desc", f"tensordesc<{dt}[1, {bn}, {bk}]>"), ("h_ptr", p), ("perm_ptr", "*i32"),
                    ("seg_ptr", "*i32"), ("M_pad", "i32"), ("N", "i32"), ("K", "i32"), ("stride_hm", "i32")]
            key = dict(base, scatter=0, tile=_tile_str((bm, bn, bk)))
            meta = {"SCATTER_OUT": False, "INPUT_PRECISION": prec, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                    "GROUP_M": GROUP}
            # 4 stages for bf16/fp16: 1.035 ms instead of 1.078 with 3 at M=4096, H=4096, I=11008 (aot/tune.py, H100)
            out += _both("kernels.gemm:routed_swiglu_tma_kernel", key, args, meta, TMA_ARCHS,
                         num_stages=4 if fam == "half" else 3)
            if fam == "half":  # decode tile
                dm, dn, dk = DECODE_TILE
                args = [("a_desc", f"tensordesc<{dt}[{dm}, {dk}]>"), ("w1_desc", f"tensordesc<{dt}[1, {dn}, {dk}]>"),
                        ("w3_desc", f"tensordesc<{dt}[1, {dn}, {dk}]>"), ("h_ptr", p), ("perm_ptr", "*i32"),
                        ("seg_ptr", "*i32"), ("M_pad", "i32"), ("N", "i32"), ("K", "i32"), ("stride_hm", "i32")]
                key = dict(base, scatter=0, tile=_tile_str(DECODE_TILE))
                meta = {"SCATTER_OUT": False, "INPUT_PRECISION": prec, "BLOCK_M": dm, "BLOCK_N": dn, "BLOCK_K": dk,
                        "GROUP_M": GROUP}
                out += _both("kernels.gemm:routed_swiglu_tma_kernel", key, args, meta, TMA_ARCHS, num_warps=4,
                             num_stages=4)
    return out


def variants() -> List[Variant]:
    return _rope_variants() + _routing_variants() + _gemm_variants()
