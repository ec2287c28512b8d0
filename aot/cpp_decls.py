"""The C++ side of each kernel's declaration, generated: header() is <out>/kernel_decls.h, which aot/compile.py
writes next to the kernel table, so that no argument list and no constant is written in both languages.

* One argument struct per kernel (namespace fused::kernel_args, named as the @triton.jit function), its fields the
  kernel's runtime arguments in signature order, with the types the manifest gives them (aot/manifest.py
  runtime_args). A launcher fills it by name with C++20 designated initializers: a misspelt, missing or misordered
  argument does not compile (the field types have no default constructor), and pack() lays the values out in the
  order the compiled kernel takes them. The Python launchers call the same function by keyword.
* The constants the C++ launchers share with the kernels and their Python launchers (shared_constants; namespaces
  fused::routed, fused::rope_flags and fused::attention): the routing's sizes, rope's flag bits,
  the gather's and the decode reduction's blocks, read here from the Python modules that define them.
"""
from typing import Dict, List, Tuple

from aot import config_table


def shared_constants() -> Dict[str, Dict[str, Tuple[int, str]]]:
    """C++ namespace (in fused) -> C++ name -> (value, what it is), each read from where it is defined."""
    from aot import manifest
    from kernels import decode_attention, gather_rows, gemm_decode, rms_norm, rope, routing
    rope_flags = {"kBshd": (rope.FLAG_BSHD, "bshd layout"), "kBackward": (rope.FLAG_BACKWARD, "the backward (-sin)"),
                  "kHasStart": (rope.FLAG_HAS_START, "start_positions given"),
                  "kCopyPass": (rope.FLAG_COPY_PASS, "copy the channels past the rotary ones through (not in place)")}
    da = decode_attention
    attention = {"kMaxT": (da.MAX_T.value, "new tokens per sequence and call"),
                 "kCombineMaxSplits": (da.COMBINE_MAX_SPLITS, "the most splits the combine kernel merges"),
                 "kCombineCols": (da.COMBINE_COLS, "the combine kernel's channels per program"),
                 "kSplitCtasPerSm": (da.SPLIT_CTAS_PER_SM, "the split rule: programs per SM it aims at"),
                 "kSplitMinBlocks": (da.SPLIT_MIN_BLOCKS, "the split rule: the fewest key blocks of the capacity "
                                                          "per split")}
    rms = {"kBlock": (rms_norm.BLOCK, "rms_norm_kernel's BLOCK: row elements per step")}
    return {"rope_flags": rope_flags, "attention": attention, "rms": rms, "routed": {
        "kAlign": (config_table.ROUTING_ALIGN, "routing ALIGN: expert segments start at multiples of it; every "
                                              "BLOCK_M divides it"),
        "kRowTail": (int(routing.ROW_TAIL), "perm entries past M of an unaligned routing (kernels/routing.py "
                                            "ROW_TAIL)"),
        "kSegSlots": (int(routing.SEG_SLOTS), "seg's entries (kernels/routing.py SEG_SLOTS)"),
        "kChunk": (routing.CHUNK, "the two-kernel routing's mask chunk per program"),
        "kOneBlock": (routing.ONE_BLOCK, "masks up to this length route in one launch (kernels/routing.py "
                                         "ONE_BLOCK)"),
        "kOneBlockSmall": (routing.ONE_BLOCK_SMALL, "the smallest one-launch routing (decode steps)"),
        "kOneBlockMid": (routing.ONE_BLOCK_MID, "the middle one-launch routing"),
        "kSingleBlock": (routing.SINGLE_BLOCK, "routing_single_kernel's BLOCK"),
        "kGatherRows": (gather_rows.GATHER_ROWS, "gather_rows_kernel's BLOCK_R (divides kAlign)"),
        "kGatherCols": (gather_rows.GATHER_COLS[False][0], "gather_rows_kernel's BLOCK_C"),
        "kGatherColsColsum": (gather_rows.GATHER_COLS[True][0], "its BLOCK_C with the column sums"),
        "kDecodeReduceCols": (gemm_decode.DECODE_REDUCE_COLS, "decode_reduce_kernel's BLOCK_N"),
        "kHint": (manifest.HINT, "the divisibility the aligned variants assume of pointers (bytes) and of sizes "
                                 "and strides (elements); the TMA GEMMs and decode attention exist only as these"),
        "kDecodeMaxSplits": (gemm_decode.DECODE_MAX_SPLITS, "the most decode GEMM splits decode_reduce_kernel sums"),
    }}


_FIELD = {"p": "PtrArg", "i": "I32Arg", "l": "I64Arg", "f": "F32Arg", "t": "DescArg"}
_PACK = {"p": "a.ptr({n}.p);", "i": "a.i32({n}.v);", "l": "a.i64({n}.v);", "f": "a.f32({n}.v);",
         "t": "a.tensor({n}.base, std::move({n}.shape), std::move({n}.strides));"}


def _signatures(variants, type_code) -> Dict[str, List[Tuple[str, str]]]:
    """kernel -> [(argument, type code)], the same for every variant of the kernel (checked)."""
    out: Dict[str, List[Tuple[str, str]]] = {}
    for v in variants:
        sig = [(n, type_code(ty)) for n, ty in v.args]
        if out.setdefault(v.name, sig) != sig:
            raise RuntimeError(f"aot: the variants of {v.name} disagree on its arguments: {out[v.name]} / {sig}")
    return out


def header(variants, type_code) -> str:
    lines = ["// Generated by aot/cpp_decls.py: do not edit. Each kernel's arguments and the constants the launchers",
             "// share with the kernels, from kernels/*.py and aot/manifest.py.", "#pragma once", "#include <cstdint>",
             "#include <utility>", "", '#include "runtime/launcher.h"', "", "namespace fused {", ""]
    for ns, consts in shared_constants().items():
        lines.append(f"namespace {ns} {{")
        lines += [f"inline constexpr int64_t {name} = {int(value)};  // {what}"
                  for name, (value, what) in consts.items()]
        lines += [f"}}  // namespace {ns}", ""]
    lines.append("namespace kernel_args {")
    for kernel, sig in sorted(_signatures(variants, type_code).items()):
        lines += ["", f"struct {kernel} {{", f'  static constexpr const char* kernel = "{kernel}";']
        lines += [f"  {_FIELD[c]} {n};" for n, c in sig]
        lines += ["  KernelArgs pack() && {", "    KernelArgs a;"]
        lines += ["    " + _PACK[c].format(n=n) for n, c in sig]
        lines += ["    return a;", "  }", "};"]
    lines += ["", "}  // namespace kernel_args", "}  // namespace fused", ""]
    return "\n".join(lines)
