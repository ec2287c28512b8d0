"""The package itself: it imports and runs without Triton, reports its build, and (GPU tier) loads kernels lazily
per device from several threads at once."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fused_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh interpreter where `import triton` raises ImportError, as on a deployment machine without Triton
# (a None entry in sys.modules makes both `import triton` and importlib's find_spec report it missing).
_NO_TRITON = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None
""")


def run_fresh(code, env=None):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", _NO_TRITON + textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, cwd=os.path.join(ROOT, "tests"), timeout=300)


def test_import_and_cpu_ops_never_import_triton():
    r = run_fresh("""
        import sys, torch, fused_ops
        t = torch.randn(6, 2, 3, 16, requires_grad=True)
        f = torch.randn(6, 1, 1, 16)
        out = torch.ops.fused.rope_fwd(t, f)
        out.sum().backward()
        torch.ops.fused.rope_fwd_qk(t.detach(), t.detach(), f)
        assert sys.modules["triton"] is None, "triton was imported"
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_import_and_ops_leave_triton_unimported():
    # With triton installed (as on CI), importing the package and running ops must still not import it.
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys, torch
        before = "triton" in sys.modules
        import fused_ops
        t = torch.randn(6, 2, 3, 16, requires_grad=True)
        torch.ops.fused.rope_fwd(t, torch.randn(6, 1, 1, 16)).sum().backward()
        assert ("triton" in sys.modules) == before, "importing fused_ops or running an op imported triton"
        print("OK")
    """)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_built_archs_lists_sm90_and_ptx():
    archs = fused_ops.built_archs()
    assert "sm_90" in archs and "PTX" in archs


def test_set_sync_checks_round_trip():
    prev = fused_ops.set_sync_checks(False)
    try:
        assert fused_ops.set_sync_checks(False) is False
    finally:
        fused_ops.set_sync_checks(prev)
    assert fused_ops.set_sync_checks(prev) == prev


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_path_without_gpu_raises_cleanly():
    with pytest.raises(RuntimeError):
        torch.ops.fused.rope_fwd(torch.randn(2, 1, 1, 8, device="cuda"), torch.randn(2, 1, 1, 8, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_ops_run_without_triton_or_jit(tmp_path):
    cache = tmp_path / "triton_cache"
    cache.mkdir()
    r = run_fresh("""
        import sys, torch, fused_ops
        from reference import rope_reference
        for dev in range(torch.cuda.device_count()):
            t = torch.randn(64, 2, 8, 128, device=f"cuda:{dev}", dtype=torch.bfloat16, requires_grad=True)
            f = torch.randn(64, 1, 1, 128, device=f"cuda:{dev}")
            out = torch.ops.fused.rope_fwd(t, f)
            out.float().sum().backward()
            ref = rope_reference(t, f)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, err
            torch.cuda.synchronize(dev)
        assert sys.modules["triton"] is None
        print("OK")
    """, env={"TRITON_CACHE_DIR": str(cache)})
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    assert list(cache.iterdir()) == [], "something compiled with Triton at run time"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_first_use_from_many_threads():
    # First use (module loading) races in a fresh process: 16 threads over every device at once.
    r = run_fresh("""
        import threading, torch, fused_ops
        from reference import rope_reference
        n = torch.cuda.device_count()
        inputs = []
        for i in range(16):
            dev = f"cuda:{i % n}"
            inputs.append((torch.randn(33, 3, 5, 64, device=dev), torch.randn(40, 1, 1, 48, device=dev)))
        torch.cuda.synchronize()
        results, errors = [None] * 16, []
        barrier = threading.Barrier(16)
        def work(i):
            try:
                t, f = inputs[i]
                with torch.cuda.device(t.device):
                    barrier.wait()
                    s = torch.cuda.Stream()
                    with torch.cuda.stream(s):
                        out = torch.ops.fused.rope_fwd(t, f)
                    s.synchronize()
                    results[i] = out
            except Exception as e:
                errors.append(repr(e))
        ts = [threading.Thread(target=work, args=(i,)) for i in range(16)]
        [x.start() for x in ts]
        [x.join() for x in ts]
        assert not errors, errors
        for (t, f), out in zip(inputs, results):
            ref = rope_reference(t, f)
            assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
