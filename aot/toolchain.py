"""Where the build finds the CUDA headers it compiles the C++ library against (setup.py; tests that compile C++)."""
import glob
import os


def cuda_include_dirs():
    """Where cuda.h (driver API types) and the CUDA runtime headers that torch's CUDA headers include live:
    $CUDA_HOME, torch's guess, /usr/local/cuda, or the headers of pip's nvidia-* CUDA packages."""
    from torch.utils import cpp_extension
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
