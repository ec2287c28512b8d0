"""Builds the fused_ops package: AOT-compiles the Triton kernels (aot/), then the C++ op library (csrc/).

    pip install --no-build-isolation .      # torch must already be installed (the extension builds against it)

Environment: FUSED_ARCHS="80,89,90" (GPU architectures to compile for), MAX_JOBS (C++ compile parallelism).
Triton is needed here, at build time only; the installed package never imports it.
"""
import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

from torch.utils import cpp_extension  # noqa: E402


def cuda_include_dirs():
    """Where cuda.h (driver API types) and the CUDA runtime headers that torch's CUDA headers include live:
    $CUDA_HOME, torch's guess, /usr/local/cuda, or the headers of pip's nvidia-* CUDA packages."""
    cands = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), cpp_extension.CUDA_HOME or "",
             "/usr/local/cuda"]
    dirs = [os.path.join(c, "include") for c in cands if c]
    try:
        import nvidia  # type: ignore

        for base in nvidia.__path__:
            dirs += sorted(glob.glob(os.path.join(base, "*", "include")))
    except ImportError:
        pass
    for d in dirs:
        if os.path.exists(os.path.join(d, "cuda.h")) and os.path.exists(os.path.join(d, "cuda_runtime_api.h")):
            return [d]
    raise RuntimeError(f"fused_ops: cuda.h and cuda_runtime_api.h not found in {dirs}; set CUDA_HOME")


class BuildExt(cpp_extension.BuildExtension):
    def run(self):
        from aot import compile as aot

        archs = tuple(int(a) for a in os.environ.get("FUSED_ARCHS", "80,89,90").split(","))
        out = os.path.join(ROOT, "build", "aot")
        gen = aot.build(out, archs)
        for ext in self.extensions:
            ext.sources = [s for s in ext.sources if not s.endswith("kernels_gen.cpp")] + [gen]
        super().run()
        for ext in self.extensions:
            check_variants(self.get_ext_fullpath(ext.name))


def check_variants(library):
    """Fails the build if a launcher can ask for a variant that aot/manifest.py did not compile for a built
    architecture (csrc/ops/variant_check.cpp): "no compiled variant" at run time then only means an unbuilt GPU.
    Loads the library in a fresh interpreter; needs no GPU."""
    import subprocess

    code = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
            "print('\\n'.join(torch.ops.fused._missing_variants()))")
    res = subprocess.run([sys.executable, "-c", code, library], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"fused_ops: the variant check could not load {library}:\n{res.stderr}")
    if res.stdout.strip():
        raise RuntimeError("fused_ops: the C++ launchers can ask for variants that aot/manifest.py does not compile "
                           "(their config tables or FLAG_SETS lack them):\n" + res.stdout)


sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
ext = cpp_extension.CppExtension(
    name="fused_ops._C",
    sources=sources,
    include_dirs=[os.path.join(ROOT, "csrc")] + cuda_include_dirs(),
    libraries=["c10_cuda", "torch_cuda", "dl"],
    extra_compile_args=["-O2", "-std=c++20", "-fvisibility=hidden"],
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
