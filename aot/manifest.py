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
                    out.append(Variant("kernels.rope:rope_kernel", key, args, meta, aligned))
                    out.append(Variant("kernels.rope:rope_kernel", key, args, meta, {}))
    return out


def variants() -> List[Variant]:
    return _rope_variants()
