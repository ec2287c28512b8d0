"""Interpreter tier: kernels/rms_norm.py run by Triton's interpreter on the CPU with the C++ launcher's grid (one
program per row, rows of any stride), against float64. fp32 only (the interpreter computes fp16 / bf16 on raw bits).
Skipped when triton is not installed (a build-time dependency)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels.rms_norm import launch_rms_norm  # noqa: E402
from reference_routed import rel_err  # noqa: E402


@pytest.mark.parametrize("m,n,block", [(1, 64, 16), (3, 100, 32), (4, 1000, 256), (2, 7, 8), (5, 256, 256)])
def test_kernel_matches_float64(m, n, block):
    """Rows shorter and longer than a block, a row length that no block divides, a strided input (every second row of
    a larger tensor)."""
    g = torch.Generator().manual_seed(m * n)
    x = (torch.randn(2 * m, n, generator=g) * 2 + 0.3)[::2]
    w = torch.rand(n, generator=g) + 0.5
    out = torch.full((m, n), float("nan"))  # poisoned: every element must be written
    launch_rms_norm(x, w, out, 1e-5, block=block)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-6
