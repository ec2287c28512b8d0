"""fused_ops: AOT-compiled Triton kernels for transformer blocks, registered as ``torch.ops.fused.*``.

Importing this package loads the op library (``_C``), which registers every op with the CPU, CUDA, Meta and
Autograd dispatch keys. Nothing here imports Triton: the CUDA kernels were compiled when the package was built.
"""
import glob as _glob
import os as _os
from typing import Optional as _Optional

import torch as _torch


def _load_library():
    # FUSED_OPS_LIBRARY names another build of the same op library to load instead of the bundled _C, e.g. the
    # libfused_ops.so of the CMake build, whose examples script their model with this package from the source tree.
    override = _os.environ.get("FUSED_OPS_LIBRARY")
    if override:
        if not _os.path.isfile(override):
            raise ImportError(f"fused_ops: FUSED_OPS_LIBRARY={override!r} is not a file")
        _torch.ops.load_library(override)
        return override
    here = _os.path.dirname(_os.path.abspath(__file__))
    libs = sorted(_glob.glob(_os.path.join(here, "_C*.so")))
    if not libs:
        raise ImportError(f"fused_ops: the compiled op library (_C*.so) is missing from {here}; "
                          "install the package with `pip install --no-build-isolation .`")
    _torch.ops.load_library(libs[0])
    return libs[0]


library_path = _load_library()

from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb, apply_rotary_pos_emb_qk  # noqa: E402
from .attention import decode_attention  # noqa: E402
from .norm import rms_norm  # noqa: E402
from .routed import DualExpertSwiGLU, DualLinear, FusedSwiGLU, ffn, linear_dual, route  # noqa: E402


def set_sync_checks(enabled: bool) -> bool:
    """Turns on/off the input checks that read device memory (cu_seqlens, start_positions), which cost a host
    sync on CUDA; returns the previous setting. Off: invalid values give undefined results (never out-of-bounds
    accesses). The checks are always skipped during CUDA graph capture."""
    return _torch.ops.fused.set_sync_checks(enabled)


def set_programmatic_launch(enabled: bool) -> bool:
    """Turns programmatic dependent launch of the routed ops' kernels (linear_dual, ffn) on sm_90 on or off; returns
    the previous setting. On (the default, unless the environment sets ``FUSED_PDL=0``), each kernel may start while
    the one before it in the stream finishes, waiting for it before it reads or writes memory: the launch latency
    between the kernels of an op overlaps the previous kernel's tail. Results are identical either way."""
    return _torch.ops.fused.set_programmatic_launch(enabled)


def built_archs() -> str:
    """The GPU architectures this build holds kernels for."""
    return _torch.ops.fused.built_archs()


def kernel_config(kernel: str, family: str, m: int, cc: int = 90, n: _Optional[int] = None,
                  k: _Optional[int] = None, w_transposed: _Optional[bool] = None) -> str:
    """The block config the launchers pick for ``kernel`` (a Triton kernel name such as ``routed_linear_tma_kernel``),
    ``family`` (``half`` for bf16/fp16, ``tf32``, ``ieee``; ``all`` for ``rope_kernel``) and ``m`` rows of a GEMM with
    ``n`` output columns and reduction length ``k`` (the grad-weight kernels: the weight's ``[n, k]``; None: unknown,
    the table's general class), ``w_transposed`` the linear GEMMs' orientation (True: the grad-input GEMM, W
    transposed; None: unknown) on a GPU of compute capability ``cc``, e.g. ``128x256x64_g8_w8_s3`` (BLOCK sizes,
    GROUP, warps, stages; a suffix ``_f`` for a flattened tile loop, ``_t`` (``_t4``, ``_t8``) for a last round split in
    column halves (quarters, eighths), ``_sk`` (``_sk2``) for the last round (two rounds) shared out by K steps,
    stream-K; ``off`` where an alternative kernel is not used). The
    tables are ``aot/configs/sm<arch>.json``, compiled into the build; re-tune with
    ``python -m aot.tune`` (docs/perf.md)."""
    return _torch.ops.fused.kernel_config(kernel, family, cc, m, -1 if n is None else n, -1 if k is None else k,
                                          -1 if w_transposed is None else int(w_transposed))


__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb", "apply_rotary_pos_emb_qk", "route", "linear_dual",
           "DualLinear", "ffn", "FusedSwiGLU", "DualExpertSwiGLU", "set_sync_checks", "set_programmatic_launch", "built_archs",
           "kernel_config", "library_path", "decode_attention", "rms_norm"]
