"""Builds the fused_ops package: AOT-compiles the Triton kernels (aot/), then the C++ op library (csrc/).

    pip install --no-build-isolation .      # torch must already be installed (the extension builds against it)

Environment: FUSED_ARCHS (GPU architectures to compile for: "auto", the default, builds for the GPUs this machine has,
and where none is visible for every supported GPU (sm_80 cubins and PTX, sm_90 cubins: a wheel); "all" also builds
sm_89's own cubins; or a list such as "80,89,90": aot/compile.py resolve_archs),
MAX_JOBS (C++ compile parallelism).
Triton is needed here, at build time only; the installed package never imports it.
"""
import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

from torch.utils import cpp_extension  # noqa: E402

from aot.toolchain import cuda_include_dirs  # noqa: E402


class BuildExt(cpp_extension.BuildExtension):
    def run(self):
        from aot import compile as aot

        out = os.path.join(ROOT, "build", "aot")
        gen = aot.build(out, aot.resolve_archs())
        for ext in self.extensions:
            ext.sources = [s for s in ext.sources if not s.endswith("kernels_gen.cpp")] + [gen]
        super().run()
        from aot import check_variants
        for ext in self.extensions:
            check_variants.check(self.get_ext_fullpath(ext.name))


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
