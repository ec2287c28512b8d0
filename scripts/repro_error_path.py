"""Diagnostic for the GPU job: a bad-input call on CUDA must raise RuntimeError, not crash the process.

Run under cuda-gdb by scripts/gpu_job.sh to get a native backtrace if it crashes.
"""
import torch

import fused_ops  # noqa: F401

x = torch.randn(8, 2, 2, 8, device="cuda")
for name, call in [
    ("freqs too short", lambda: torch.ops.fused.rope_fwd(x, torch.randn(7, 1, 1, 8, device="cuda"))),
    ("cpu freqs", lambda: torch.ops.fused.rope_fwd(x, torch.randn(16, 1, 1, 8))),
    ("odd d2", lambda: torch.ops.fused.rope_fwd(x, torch.randn(16, 1, 1, 7, device="cuda"))),
]:
    try:
        call()
        print(name, ": no error (WRONG)")
    except RuntimeError as e:
        print(name, ": RuntimeError:", str(e).splitlines()[0])
print("error path OK")
