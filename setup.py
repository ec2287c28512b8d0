"""Builds the fused_ops package: AOT-compiles the Triton kernels (aot/), then the C++ op library (csrc/).

    pip install --no-build-isolation .      # torch must already be installed (the extension builds against it)

The C++ library is compiled by setuptools, or, with FUSED_BUILD_CMAKE=1 or auto, by CMakeLists.txt (its target
`fused_ops`, in the build tree build/cmake, the AOT images shared through build/aot/cache) and installed as
fused_ops/_C: the library a C++ user links and the one Python loads are then one build, and tests/test_cmake_build.py
reuses that tree (a no-op rebuild of the library) instead of compiling it a second time. scripts/test.sh asks for
`auto` (CMake where cmake >= 3.18 is found, on PATH or in this Python's bin folder): on CI's 2 cores that saves the
CMake test's second build (143 s). A plain install keeps setuptools: on the 16-core H200 machine its build measured
79 s (AOT 42-43 s + C++ 36-37 s, two runs) against 91 and 102 s through CMake (configure, the AOT step's second pass
over the cache, the install), and only the test command reuses the tree.

Environment: FUSED_ARCHS (GPU architectures to compile for: "auto", the default, builds for the GPUs this machine has,
and where none is visible for every supported GPU (sm_80 cubins and PTX, sm_90 cubins: a wheel); "all" also builds
sm_89's own cubins; or a list such as "80,89,90": aot/compile.py resolve_archs),
MAX_JOBS (C++ compile parallelism), FUSED_BUILD_CMAKE (unset or 0: setuptools; auto: CMake when cmake is found, else
setuptools; 1: CMake, an error without cmake), FUSED_CMAKE_BUILD (the CMake build tree, default build/cmake; also
scripts/cpp_example.sh's and tests/test_cmake_build.py's).
Triton is needed here, at build time only; the installed package never imports it.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

from torch.utils import cpp_extension  # noqa: E402

from aot.toolchain import cuda_include_dirs  # noqa: E402


CMAKE_BUILD = os.environ.get("FUSED_CMAKE_BUILD") or os.path.join(ROOT, "build", "cmake")


def tool_path():
    """PATH with this Python's bin folder first: a cmake or ninja that pip installed into the venv counts too."""
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


def find_cmake():
    """The cmake to build the library with, or None for setuptools' own compile (FUSED_BUILD_CMAKE, see above)."""
    choice = os.environ.get("FUSED_BUILD_CMAKE", "0")
    if choice not in ("0", "1", "auto"):
        raise ValueError(f"fused_ops: FUSED_BUILD_CMAKE must be 0, 1 or auto, got {choice!r}")
    if choice == "0":
        return None
    cmake = shutil.which("cmake", path=tool_path())
    version = None
    if cmake:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"version (\d+)\.(\d+)", out)
        version = (int(m.group(1)), int(m.group(2))) if m else None
    if version and version >= (3, 18):  # CMakeLists.txt's cmake_minimum_required
        return cmake
    why = f"cmake {'.'.join(map(str, version))} is older than 3.18" if version else "cmake was not found"
    if choice == "1":
        raise RuntimeError(f"fused_ops: FUSED_BUILD_CMAKE=1 but {why}")
    print(f"[build] {why}: compiling the C++ library with setuptools", flush=True)
    return None


class BuildExt(cpp_extension.BuildExtension):
    def run(self):
        self.cmake = find_cmake()
        if self.cmake:  # CMakeLists.txt runs the AOT step and the variant check itself
            return super().run()
        from aot import compile as aot

        out = os.path.join(ROOT, "build", "aot")
        gen = aot.build(out, aot.resolve_archs())
        for ext in self.extensions:
            ext.sources = [s for s in ext.sources if not s.endswith("kernels_gen.cpp")] + [gen]
        super().run()
        from aot import check_variants
        for ext in self.extensions:
            check_variants.check(self.get_ext_fullpath(ext.name))

    def build_extension(self, ext):
        if not self.cmake:
            return super().build_extension(ext)
        from aot import compile as aot

        # The AOT images live in build/aot/cache whichever way the library is built (scripts/setup_env.sh fills it
        # first); the CMake tree links to it (FUSED_AOT_CACHE), so it compiles only what the cache lacks.
        cache = os.path.join(ROOT, "build", "aot", "cache")
        os.makedirs(cache, exist_ok=True)
        archs = ",".join(map(str, aot.resolve_archs()))
        env = dict(os.environ, PATH=tool_path())
        env.pop("TRITON_INTERPRET", None)
        configure = [self.cmake, "-S", ROOT, "-B", CMAKE_BUILD, f"-DPython3_EXECUTABLE={sys.executable}",
                     f"-DFUSED_ARCHS={archs}", "-DCMAKE_BUILD_TYPE=Release", f"-DFUSED_AOT_CACHE={cache}",
                     f"-DCUDA_DRIVER_INCLUDE={cuda_include_dirs()[0]}",
                     "-DTORCH_ROOT="]  # this Python's torch, whatever an earlier configure of the tree chose
        # the generator of an existing tree stays (a different one is an error); a new tree gets Ninja where found
        if not os.path.exists(os.path.join(CMAKE_BUILD, "CMakeCache.txt")) and shutil.which("ninja", path=env["PATH"]):
            configure += ["-G", "Ninja"]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        print(f"[build] CMake: the library target fused_ops in {CMAKE_BUILD} (FUSED_ARCHS={archs})", flush=True)
        for cmd in (configure, [self.cmake, "--build", CMAKE_BUILD, "--target", "fused_ops", "-j", jobs]):
            if subprocess.run(cmd, env=env).returncode != 0:
                raise RuntimeError(f"fused_ops: `{' '.join(cmd)}` failed (its output is above; `pip install -v` shows "
                                   "it); FUSED_BUILD_CMAKE=0 builds with setuptools instead")
        # What `cmake --install` makes of it (the binary a C++ user gets: its RUNPATH is the install one, torch's lib
        # folder and $ORIGIN, not the build tree's) becomes fused_ops/_C.
        stage = os.path.join(CMAKE_BUILD, "pip_stage")
        if subprocess.run([self.cmake, "--install", CMAKE_BUILD, "--prefix", stage], env=env,
                          stdout=subprocess.DEVNULL).returncode != 0:
            raise RuntimeError(f"fused_ops: cmake --install {CMAKE_BUILD} failed")
        (lib,) = glob.glob(os.path.join(stage, "**", "libfused_ops.so"), recursive=True)
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy(lib, target)


sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
ext = cpp_extension.CppExtension(
    name="fused_ops._C",
    sources=sources,
    # build/aot: kernel_decls.h, which the AOT step writes before the C++ compiles (aot/cpp_decls.py)
    include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "build", "aot")] + cuda_include_dirs(),
    libraries=["c10_cuda", "torch_cuda", "dl"],
    # -g0: no debug info (Python's CFLAGS often carry -g): it was 40 of the library's 51 MB without the kernel images.
    extra_compile_args=["-O2", "-g0", "-std=c++20", "-fvisibility=hidden"],
    # Some toolchains link libstdc++ statically (seen on the GPU machine: CXX=/opt/gcc/bin/g++, no libstdc++.so
    # in NEEDED). Such a copy must stay private to the library: with its symbols exported, Python's
    # -Bsymbolic-functions bound its functions locally but its data (locale facet ids) to torch's shared libstdc++,
    # and the first error message formatted in C++ crashed. --exclude-libs hides archive symbols; it changes nothing
    # when libstdc++ is linked dynamically.
    extra_link_args=["-Wl,--exclude-libs,ALL"],
)

setup(
    name="fused_ops",
    version="0.1.0",
    description="AOT-compiled Triton kernels for transformer blocks as torch.ops.fused.*",
    package_dir={"": "python"},
    packages=["fused_ops", "fused_ops.models"],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
    python_requires=">=3.9",
    # `pip install .[hf]`: fused_ops.hf patches transformers models (the package itself never imports it)
    extras_require={"hf": ["transformers>=5"]},
)
