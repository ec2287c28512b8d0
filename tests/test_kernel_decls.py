"""Each kernel declared once: the C++ argument structs and shared constants that aot/cpp_decls.py generates from the
@triton.jit signatures and the Python modules (CPU tier, no GPU, no build needed).

A launcher fills a kernel's struct by name (C++20 designated initializers): these tests compile launches against the
generated header and check that a missing, misordered or mistyped argument is a compile error, not a corrupt launch.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from aot import compile as aot_compile  # noqa: E402
from aot import cpp_decls, manifest, toolchain  # noqa: E402

CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _cuda_include():
    try:
        return toolchain.cuda_include_dirs()[0]
    except RuntimeError:
        return None


@pytest.fixture(scope="module")
def header_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("decls"))
    aot_compile.write_if_changed(os.path.join(d, "kernel_decls.h"),
                                 cpp_decls.header(manifest.variants(), aot_compile._type_code))
    return d


def test_one_struct_per_kernel_in_signature_order(header_dir):
    text = open(os.path.join(header_dir, "kernel_decls.h")).read()
    for v in {v.name: v for v in manifest.variants()}.values():
        body = re.search(r"struct %s \{(.*?)\n\};" % v.name, text, re.S)
        assert body, v.name
        fields = re.findall(r"^  \w+Arg (\w+);$", body.group(1), re.M)
        assert fields == [n for n, _ in v.args], v.name


def test_shared_constants_are_the_python_values(header_dir):
    """The header holds the values of the Python modules that the kernels and their Python launchers use."""
    from kernels import gather_rows, gemm_decode, routing
    text = open(os.path.join(header_dir, "kernel_decls.h")).read()
    consts = {m.group(1): int(m.group(2)) for m in re.finditer(r"inline constexpr int64_t (\w+) = (-?\d+);", text)}
    assert consts["kGatherRows"] == gather_rows.GATHER_ROWS
    assert (consts["kGatherCols"], consts["kGatherColsColsum"]) == (gather_rows.GATHER_COLS[False][0],
                                                                    gather_rows.GATHER_COLS[True][0])
    assert (consts["kDecodeReduceCols"], consts["kDecodeMaxSplits"]) == (gemm_decode.DECODE_REDUCE_COLS,
                                                                         gemm_decode.DECODE_MAX_SPLITS)
    assert (consts["kOneBlock"], consts["kChunk"], consts["kRowTail"]) == (routing.ONE_BLOCK, routing.CHUNK,
                                                                          int(routing.ROW_TAIL))


LAUNCH = {  # routing_single_kernel(perm_ptr, seg_ptr, M, M_pad): a right launch, then three wrong ones
    "ok": "{.perm_ptr = p, .seg_ptr = p, .M = 1, .M_pad = 128}",
    "missing": "{.perm_ptr = p, .seg_ptr = p, .M = 1}",
    "misordered": "{.perm_ptr = p, .seg_ptr = p, .M_pad = 128, .M = 1}",
    "int_as_pointer": "{.perm_ptr = p, .seg_ptr = 3, .M = 1, .M_pad = 128}",
    "pointer_as_int": "{.perm_ptr = p, .seg_ptr = p, .M = p, .M_pad = 128}",
}


@pytest.mark.skipif(CXX is None or _cuda_include() is None, reason="needs a C++ compiler and cuda.h")
@pytest.mark.parametrize("case", list(LAUNCH))
def test_a_wrong_launch_does_not_compile(header_dir, tmp_path, case):
    src = tmp_path / "launch.cpp"
    src.write_text('#include "kernel_decls.h"\n'
                   "fused::KernelArgs f(void* p) {\n"
                   f"  return fused::kernel_args::routing_single_kernel{LAUNCH[case]}.pack();\n"
                   "}\n")
    r = subprocess.run([CXX, "-std=c++20", "-fsyntax-only", f"-I{header_dir}", f"-I{os.path.join(ROOT, 'csrc')}",
                        f"-I{_cuda_include()}", str(src)], capture_output=True, text=True)
    assert (r.returncode == 0) == (case == "ok"), r.stderr[-3000:]


def test_sizing_rules_equal_the_python_launchers():
    """The rules the C++ launchers size their launches by (csrc/ops/routed_gemm.h one_block_size, decode_split) are
    written in both languages: they must agree everywhere a launch can take them."""
    torch = pytest.importorskip("torch")
    import fused_ops  # noqa: F401  (registers torch.ops.fused)
    from kernels.gemm_decode import decode_split
    from kernels.routing import one_block_size
    for m in list(range(0, 70)) + [1023, 1024, 1025, 4095, 4096, 4097, 100000]:
        assert torch.ops.fused._one_block_size(m) == one_block_size(m), m
    for n in (1, 64, 1280, 4096, 14336, 28672):
        for k in (0, 1, 255, 4096, 14336):
            for bn, bk in ((32, 128), (64, 256), (32, 256)):
                for sms in (8, 78, 132):
                    want = list(decode_split(n, k, bn, bk, sms))
                    assert torch.ops.fused._decode_split(n, k, bn, bk, sms) == want, (n, k, bn, bk, sms)
