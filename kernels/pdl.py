"""Programmatic dependent launch (PDL, sm_90 and later).

Every kernel of the routed ops (kernels/routing.py, gather_rows.py, gemm_pointer.py, gemm_tma.py, gemm_gather_tma.py,
gemm_decode.py, grad_weight.py, swiglu_backward.py) starts with `grid_dependency_sync`. The AOT build compiles it with
PDL=True for sm_90 (aot/compile.py) and the C++ launcher then launches it with the programmatic-stream-serialization
attribute: the kernel's programs may start while the kernel before it in the stream is still running (its launch
latency and ramp-up overlap that kernel's tail), and `griddepcontrol.wait` holds them until that kernel has finished
and its writes are visible. Because the wait is the first statement, before any load or store, a kernel sees exactly what ordinary stream
order would show it; only the launch overlaps. `griddepcontrol.launch_dependents` then lets the next kernel's programs
launch as soon as every program of this one has passed its wait.

Both instructions are no-ops when the kernel was launched without the attribute (FUSED_PDL=0,
fused_ops.set_programmatic_launch(False), or an op that launches a sequence measured slower with it: the dual-expert
ffn forward above 2048 tokens, csrc/ops/ffn_cuda.cpp). Builds for sm_80/sm_89 compile PDL=False (the instructions need sm_90).
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def grid_dependency_sync(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
