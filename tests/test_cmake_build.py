"""CMakeLists.txt builds the same op library for libtorch C++ users: configure, build (sm_90 only, to keep it
short), install with its package config, and load the result in a fresh process."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_builds_installs_and_registers_ops(tmp_path):
    pytest.importorskip("triton")  # the AOT step needs it at build time
    build, prefix = tmp_path / "build", tmp_path / "install"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run(["cmake", "-S", ROOT, "-B", str(build), *gen, f"-DPython3_EXECUTABLE={sys.executable}",
                          "-DFUSED_ARCHS=90", "-DCMAKE_BUILD_TYPE=Release"], capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    jobs = str(os.cpu_count() or 2)
    b = subprocess.run(["cmake", "--build", str(build), "-j", jobs], capture_output=True, text=True, timeout=1500)
    assert b.returncode == 0, b.stdout[-4000:] + b.stderr[-4000:]
    i = subprocess.run(["cmake", "--install", str(build), "--prefix", str(prefix)], capture_output=True, text=True)
    assert i.returncode == 0, i.stdout + i.stderr
    lib = next(prefix.rglob("libfused_ops.so"))
    assert (lib.parent / "cmake" / "fused_ops" / "fused_opsConfig.cmake").exists()
    code = (f"import torch; torch.ops.load_library({str(lib)!r}); "
            "out = torch.ops.fused.rope_fwd(torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8)); "
            "assert out.shape == (4, 1, 2, 8); print(torch.ops.fused.built_archs())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "sm_90" in r.stdout, r.stderr
