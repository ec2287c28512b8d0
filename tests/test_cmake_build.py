"""CMakeLists.txt builds the same op library for libtorch C++ users, and the C++ deployment examples with it.

One build (for the architectures of the installed package) serves every test here: the library loads from Python;
`ctest` runs the C++ examples (examples/cpp: TorchScript inference, AOTInductor inference of one package at every
length from 1 to 8192 tokens, training) on the CPU, and on CUDA when a GPU is visible (skipped otherwise, and checked
to be reported as skipped); and the installed package config works for a separate consumer project (find_package +
target_link_libraries), whose program runs without LD_LIBRARY_PATH.

That build is the pip build's CMake tree (build/cmake, or $FUSED_CMAKE_BUILD: setup.py builds the library there
when cmake is installed, and installs it as fused_ops/_C) when there is one: configured again with the same options,
it rebuilds only what changed since (nothing, right after scripts/test.sh's build), then the examples; the install
goes to a tmp folder. Without that tree (e.g. a package built by setuptools) it is a new tree in a tmp folder. Either
way the AOT step reuses the pip build's kernel cache (build/aot/cache, through FUSED_AOT_CACHE) when there is one, and
builds the installed package's architectures, so that the build compiles C++ only; without the cache, it AOT-compiles
them from scratch.
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_AOT_CACHE = os.path.join(ROOT, "build", "aot", "cache")
PIP_CMAKE_BUILD = os.environ.get("FUSED_CMAKE_BUILD") or os.path.join(ROOT, "build", "cmake")  # setup.py's
CUDA = torch.cuda.is_available()


def package_archs():
    """The architectures of the installed fused_ops ("80,90"), which the pip build's kernel cache holds."""
    import fused_ops
    return ",".join(a[len("sm_"):] for a in fused_ops.built_archs().split(" (")[0].split(", "))

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")


def compile_env(**extra):
    """The environment without TRITON_INTERPRET, which the interpreter tests set for the whole pytest process: the
    AOT step and AOTInductor (ctest's cpp_export_aoti_cuda) compile real kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env


def run(cmd, timeout=600, env=None, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or compile_env(), **kw)
    command = " ".join(map(str, cmd))
    assert r.returncode == 0, f"{command} failed ({r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
    return r


def generator():
    return ["-G", "Ninja"] if shutil.which("ninja") else []


@pytest.fixture(scope="module")
def cmake_build(tmp_path_factory):
    """(build folder, install prefix) of one configure + build + install."""
    pytest.importorskip("triton")  # the AOT step needs it at build time
    base = tmp_path_factory.mktemp("cmake")
    build, prefix, gen = base / "build", base / "install", generator()
    if os.path.isfile(os.path.join(PIP_CMAKE_BUILD, "CMakeCache.txt")):
        build, gen = pathlib.Path(PIP_CMAKE_BUILD), []  # the pip build's tree; its generator stays
    cache = [f"-DFUSED_AOT_CACHE={REPO_AOT_CACHE}"] if os.path.isdir(REPO_AOT_CACHE) else []
    run(["cmake", "-S", ROOT, "-B", str(build), *gen, f"-DPython3_EXECUTABLE={sys.executable}",
         f"-DFUSED_ARCHS={package_archs()}", "-DCMAKE_BUILD_TYPE=Release", "-DFUSED_BUILD_EXAMPLES=ON", *cache])
    run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], timeout=1500)
    run(["cmake", "--install", str(build), "--prefix", str(prefix)])
    return build, prefix


def installed_library(prefix):
    return next(prefix.rglob("libfused_ops.so"))


def test_cmake_builds_installs_and_registers_ops(cmake_build):
    _, prefix = cmake_build
    lib = installed_library(prefix)
    assert (lib.parent / "cmake" / "fused_ops" / "fused_opsConfig.cmake").exists()
    code = (f"import torch; torch.ops.load_library({str(lib)!r}); "
            "out = torch.ops.fused.rope_fwd(torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8)); "
            "assert out.shape == (4, 1, 2, 8); print(torch.ops.fused.built_archs())")
    r = run([sys.executable, "-c", code], timeout=300)
    import fused_ops
    assert r.stdout.strip().splitlines()[-1] == fused_ops.built_archs(), r.stdout


def test_ctest_runs_the_cpp_examples(cmake_build):
    """Every CPU entry passes; the CUDA entries pass on a GPU machine and are reported as skipped (saying why)
    without one, never as passed."""
    build, _ = cmake_build
    r = subprocess.run(["ctest", "--output-on-failure", "-V"], cwd=build, capture_output=True, text=True, timeout=900,
                       env=compile_env())
    print(r.stdout[-12000:])  # shown by pytest on failure (and with -s): the C++ programs' check lines
    results = dict(re.findall(r"Test\s+#\d+: (\S+) \.+\**\s*(Passed|Failed|Skipped|Not Run|Timeout|\w+)", r.stdout))
    cpu = {"cpp_export", "cpp_export_aoti_cpu", "cpp_infer_cpu", "cpp_aoti_cpu", "cpp_train_cpu"}
    cuda = {"cpp_export_aoti_cuda", "cpp_infer_cuda", "cpp_aoti_cuda", "cpp_train_cuda"}
    assert set(results) == cpu | cuda, results
    assert {t: results[t] for t in cpu} == dict.fromkeys(cpu, "Passed"), r.stdout[-8000:]
    assert {t: results[t] for t in cuda} == dict.fromkeys(cuda, "Passed" if CUDA else "Skipped"), r.stdout[-8000:]
    assert r.returncode == 0, r.stdout[-8000:]
    if not CUDA:
        assert r.stdout.count("SKIP: no CUDA device visible") == len(cuda), "a CUDA entry skipped without saying why"
    # the programs' own verdicts, not only their exit status
    assert "fused_infer (TorchScript, cpu): all checks passed" in r.stdout
    assert "fused_train (cpu): all checks passed" in r.stdout
    assert re.search(r"fused_infer \(AOTInductor \S*block_cpu\.pt2\): all checks passed", r.stdout)
    # one package (dynamic batch and sequence) served every length that export_model.py saved
    for tokens in (1, 7, 300, 4096, 8192):
        assert re.search(rf"ok +float32 output vs Python's float64 reference at {tokens} tokens", r.stdout), tokens
    if CUDA:
        assert re.search(r"fused_infer \(AOTInductor \S*block_cuda\.pt2\): all checks passed", r.stdout)


def test_installed_package_config_for_a_consumer(cmake_build, tmp_path):
    """A separate project (examples/cpp on its own) finds the installed fused_ops with find_package, links it with
    target_link_libraries, keeps the library's static initializers (libfused_ops.so is NEEDED although the program
    names none of its symbols) and runs without LD_LIBRARY_PATH (its RUNPATH reaches fused_ops and torch)."""
    _, prefix = cmake_build
    lib = installed_library(prefix)
    consumer = tmp_path / "consumer"
    run(["cmake", "-S", os.path.join(ROOT, "examples", "cpp"), "-B", str(consumer), *generator(),
         f"-DCMAKE_PREFIX_PATH={prefix}", f"-DPython3_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"])
    run(["cmake", "--build", str(consumer), "--target", "fused_infer"], timeout=900)
    exe = consumer / "fused_infer"
    dyn = run(["readelf", "-d", str(exe)]).stdout
    assert "[libfused_ops.so]" in dyn, dyn
    runpath = re.search(r"R(?:UN)?PATH.*\[(.*)\]", dyn).group(1).split(":")
    assert str(lib.parent) in runpath, runpath
    # the model and references, written with the installed library
    exported = tmp_path / "exported"
    env = compile_env(FUSED_OPS_LIBRARY=str(lib), PYTHONPATH=os.path.join(ROOT, "python"))
    run([sys.executable, os.path.join(ROOT, "examples", "cpp", "export_model.py"), "--out", str(exported)], env=env)
    clean = {k: v for k, v in compile_env().items() if k != "LD_LIBRARY_PATH"}
    for dev in ("cpu", "cuda") if CUDA else ("cpu",):
        r = run([str(exe), dev, str(exported)], env=clean, timeout=300)
        assert f"fused_infer (TorchScript, {dev}): all checks passed" in r.stdout, r.stdout
