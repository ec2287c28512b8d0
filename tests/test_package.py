"""The package itself: it imports and runs without Triton, reports its build, and (GPU tier) loads kernels lazily
per device from several threads at once."""
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import fused_ops
from fresh_process import run_fresh

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


def test_fused_ops_library_override(tmp_path):
    """FUSED_OPS_LIBRARY loads another build of the op library (e.g. the CMake one) instead of the bundled _C; a
    path that is not a file is an ImportError that names the variable."""
    other = tmp_path / "libfused_ops_copy.so"  # another file than the bundled one, so the test sees which loads
    shutil.copy(fused_ops.library_path, other)
    code = """
        import torch, fused_ops
        print(fused_ops.library_path)
        assert torch.ops.fused.rope_fwd(torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8)).shape == (4, 1, 2, 8)
    """
    r = run_fresh(code, env={"FUSED_OPS_LIBRARY": str(other)})
    assert r.returncode == 0 and r.stdout.strip() == str(other), r.stdout + r.stderr[-2000:]
    r = run_fresh(code, env={"FUSED_OPS_LIBRARY": "/nonexistent/libfused_ops.so"})
    want = "ImportError: fused_ops: FUSED_OPS_LIBRARY='/nonexistent/libfused_ops.so' is not a file"
    assert r.returncode != 0 and want in r.stderr, r.stderr[-2000:]


def test_built_archs_lists_ptx_only_where_portable():
    """PTX is embedded for the lowest built architecture where it is below sm_90 (sm_90's is sm_90a: no other GPU
    compiles it), and built_archs() says so."""
    archs = fused_ops.built_archs()
    listed = [int(a[len("sm_"):]) for a in archs.split(" (")[0].split(", ")]
    assert listed == sorted(listed) and listed, archs
    assert ("(+PTX sm_%d)" % listed[0] in archs) == (listed[0] < 90), archs


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


# Every op of the library that takes tensors, and how the no-JIT test below runs each one.
EVERY_OP = {"rope_fwd", "rope_bwd", "rope_fwd_", "rope_fwd_qk", "rope_bwd_qk", "linear_dual", "linear_dual_forward",
            "linear_dual_backward", "ffn", "ffn_forward", "ffn_backward", "route", "decode_attention",
            "rms_norm"}


def test_no_jit_test_covers_every_op():
    """EVERY_OP is the library's list of tensor ops (a new op must be added to the no-JIT test)."""
    names = {n.split("::", 1)[1].split(".")[0]
             for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused::")}
    tensor_ops = {n for n in names if any(isinstance(a.type, torch.TensorType)
                                          for a in getattr(torch.ops.fused, n).default._schema.arguments)}
    assert tensor_ops == EVERY_OP


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_ops_run_without_triton_or_jit(tmp_path):
    """Every op (forward and backward, bf16 and fp32, every GPU) in a fresh process where `import triton` raises,
    with an empty TRITON_CACHE_DIR that stays empty: the kernels are the AOT-compiled ones, nothing JIT-compiles."""
    cache = tmp_path / "triton_cache"
    cache.mkdir()
    r = run_fresh("""
        import sys, torch, fused_ops
        from reference import rope_reference
        from reference_routed import ffn_reference, linear_dual_reference, reference_grads, rel_err
        from reference_attention import cache_after, decode_attention_reference
        ops = torch.ops.fused
        ran = set()
        def check(name, got, want, tol):
            err = rel_err(got, want)
            assert err < tol, f"{name}: rel. error {err:.2e} (tol {tol})"
        def differentiate(name, op_names, fn, ref_fn, inputs, diff, tol):
            # forward and every gradient through the op's autograd (which calls its backward op) vs float64
            leaves = [t.detach().requires_grad_(True) if d else t for t, d in zip(inputs, diff)]
            out = fn(*leaves)
            g = torch.randn_like(out)
            grads = torch.autograd.grad(out, [t for t, d in zip(leaves, diff) if d], g)
            want, want_grads = reference_grads(ref_fn, inputs, g, diff)
            check(name, out, want, tol)
            for i, got in enumerate(grads):
                check(f"{name} grad {i}", got, [w for w, d in zip(want_grads, diff) if d][i], tol)
            ran.update(op_names)
        for dev in range(torch.cuda.device_count()):
            d = f"cuda:{dev}"
            for dt, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
                # rope: rope_fwd (autograd -> rope_bwd), rope_bwd, rope_fwd_qk, rope_bwd_qk, rope_fwd_ (in place)
                t = torch.randn(64, 2, 8, 128, device=d, dtype=dt)
                f = torch.randn(64, 1, 1, 128, device=d)
                leaf = t.clone().requires_grad_(True)
                out = ops.rope_fwd(leaf, f)
                g = torch.randn_like(out)
                (grad_t,) = torch.autograd.grad(out, leaf, g)  # the op's autograd calls rope_bwd
                check("rope_fwd", out, rope_reference(t, f), tol)
                check("rope_fwd grad", grad_t, rope_reference(g, f, backward=True), tol)
                ran.update(("rope_fwd", "rope_bwd"))
                check("rope_bwd", ops.rope_bwd(t, f), rope_reference(t, f, backward=True), tol)
                k = t[:, :, :2]
                q_out, k_out = ops.rope_fwd_qk(t, k, f)
                check("rope_fwd_qk q", q_out, rope_reference(t, f), tol)
                check("rope_fwd_qk k", k_out, rope_reference(k, f), tol)
                gq, gk = ops.rope_bwd_qk(t, k, f)
                check("rope_bwd_qk q", gq, rope_reference(t, f, backward=True), tol)
                check("rope_bwd_qk k", gk, rope_reference(k, f, backward=True), tol)
                t2 = t.clone()
                ops.rope_fwd_(t2, f)
                check("rope_fwd_", t2, rope_reference(t, f), tol)
                ran.update(("rope_fwd_qk", "rope_bwd_qk", "rope_fwd_"))
                # routed GEMMs: 300 tokens, a random mask holding both experts
                x = torch.randn(300, 256, device=d, dtype=dt)
                mask = torch.rand(300, device=d) < 0.5
                w = lambda *shape: (torch.randn(*shape, device=d) * 0.05).to(dt)
                lin = [x, mask, w(192, 256), w(192, 256), w(192), w(192)]
                # with gradients, linear_dual's autograd calls linear_dual_forward, then linear_dual_backward
                differentiate("linear_dual", ("linear_dual_forward", "linear_dual_backward"), ops.linear_dual,
                              linear_dual_reference, lin, [True, False, True, True, True, True], tol)
                with torch.inference_mode():  # no autograd: linear_dual's own CUDA kernel
                    check("linear_dual", ops.linear_dual(*lin), linear_dual_reference(*lin), tol)
                ran.add("linear_dual")
                # with gradients, ffn's autograd calls ffn_forward (gate and up saved), then ffn_backward; with
                # recompute=True ffn, then ffn_backward (gate and up recomputed)
                ffn_dual = [x, w(320, 256), w(320, 256), w(256, 320), mask, w(320, 256), w(320, 256), w(256, 320)]
                differentiate("ffn dual", ("ffn_forward", "ffn_backward"), ops.ffn, ffn_reference, ffn_dual,
                              [True, True, True, True, False, True, True, True], tol)
                differentiate("ffn single", ("ffn_forward", "ffn_backward"), ops.ffn, ffn_reference,
                              [x, w(320, 256), w(320, 256), w(256, 320)], [True] * 4, tol)
                differentiate("ffn dual recompute", ("ffn",), lambda *a: ops.ffn(*a, recompute=True), ffn_reference,
                              ffn_dual, [True, True, True, True, False, True, True, True], tol)
                # a routing computed once and given to both routed ops (their kernels then read it; gather GEMMs
                # compiled without the in-kernel routing)
                routing = ops.route(mask)
                differentiate("linear_dual routed", ("route",),
                              lambda *a: ops.linear_dual(*a, routing=routing), linear_dual_reference, lin,
                              [True, False, True, True, True, True], tol)
                differentiate("ffn dual routed", ("route",), lambda *a: ops.ffn(*a, routing=routing), ffn_reference,
                              [x, w(320, 256), w(320, 256), w(256, 320), mask, w(320, 256), w(320, 256), w(256, 320)],
                              [True, True, True, True, False, True, True, True], tol)
            # decode_attention (bf16 / fp16 only on CUDA): 2 sequences at ragged lengths, 2 new tokens each, GQA 4:1
            q = torch.randn(2, 2, 8, 128, device=d, dtype=torch.bfloat16)
            kc, vc = (torch.randn(2, 2, 300, 128, device=d, dtype=torch.bfloat16) for _ in range(2))
            kn, vn = (torch.randn(2, 2, 2, 128, device=d, dtype=torch.bfloat16) for _ in range(2))
            lens = torch.tensor([37, 250], dtype=torch.int32, device=d)
            want = decode_attention_reference(q, kc, vc, kn, vn, lens)
            k_want, v_want = cache_after(kc, kn, lens), cache_after(vc, vn, lens)
            check("decode_attention", ops.decode_attention(q, kc, vc, kn, vn, lens), want, 1e-2)
            assert torch.equal(kc, k_want) and torch.equal(vc, v_want), "decode_attention: cache write"
            ran.add("decode_attention")
            # rms_norm (no gradient asked for: its own kernel), fp32 and bf16
            for dt, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
                x = torch.randn(3, 4096, device=d, dtype=dt)
                w = torch.randn(4096, device=d, dtype=dt)
                want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
                check("rms_norm", ops.rms_norm(x, w, 1e-6), want, tol)
            ran.add("rms_norm")
            torch.cuda.synchronize(dev)
        assert sys.modules["triton"] is None, "triton was imported"
        print("RAN", sorted(ran))
        print("OK")
    """, env={"TRITON_CACHE_DIR": str(cache)})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
    ran = set(r.stdout.split("RAN ", 1)[1].split("\n", 1)[0].strip("[]").replace("'", "").split(", "))
    assert ran == EVERY_OP, f"ops not run: {EVERY_OP - ran}"
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_routed_ops_from_many_threads():
    # The routed ops' first use and steady state from 8 threads at once, each on its own stream, over every device:
    # kernel loading, config lookups, routing and the weight stacking must not share per-call state. Each thread
    # runs linear_dual and ffn (dual and single, TMA-sized and odd sizes that take the pointer kernels) forward and
    # backward three times; every result is checked against the float64 reference afterwards.
    r = run_fresh("""
        import threading, torch, fused_ops
        from reference_routed import ffn_reference, linear_dual_reference, reference_grads, rel_err
        n, T = torch.cuda.device_count(), 8
        def case(i):
            g = torch.Generator().manual_seed(i)
            dev = f"cuda:{i % n}"
            M, K, N = (300, 128, 192) if i % 2 == 0 else (77, 40, 37)  # odd sizes: pointer kernels
            rnd = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(dev, torch.bfloat16)
            mask = (torch.rand(M, generator=g) < 0.5).to(dev)
            return dict(dev=dev, x=rnd(M, K), mask=mask, gy=rnd(M, N), gx=rnd(M, K),
                        lin=[rnd(N, K, sc=0.1), rnd(N, K, sc=0.1), rnd(N, sc=0.1), rnd(N, sc=0.1)],
                        ffn=[rnd(N, K, sc=0.1), rnd(N, K, sc=0.1), rnd(K, N, sc=0.1)],
                        ffn_t=[rnd(N, K, sc=0.1), rnd(N, K, sc=0.1), rnd(K, N, sc=0.1)])
        cases = [case(i) for i in range(T)]
        torch.cuda.synchronize()
        results, errors = [[] for _ in range(T)], []
        barrier = threading.Barrier(T)
        def run(c):
            leaves = lambda ts: [t.detach().clone().requires_grad_(True) for t in ts]
            x, lw = leaves([c["x"]]) + [leaves(c["lin"])]
            y = torch.ops.fused.linear_dual(x, c["mask"], *lw)
            grads = torch.autograd.grad(y, [x] + lw, c["gy"])
            out = [("linear_dual", y, grads)]
            for name, ws in (("ffn dual", c["ffn"] + [c["mask"]] + c["ffn_t"]), ("ffn single", c["ffn"])):
                x = leaves([c["x"]])[0]
                wl = [w if w.dtype == torch.bool else w.detach().clone().requires_grad_(True) for w in ws]
                y = torch.ops.fused.ffn(x, *wl)
                grads = torch.autograd.grad(y, [x] + [w for w in wl if w.dtype != torch.bool], c["gx"])
                out.append((name, y, grads))
            return out
        def work(i):
            try:
                c = cases[i]
                with torch.cuda.device(c["dev"]):
                    barrier.wait()
                    s = torch.cuda.Stream()
                    with torch.cuda.stream(s):
                        for _ in range(3):
                            results[i].append(run(c))
                    s.synchronize()
            except Exception as e:
                errors.append(repr(e))
        ts = [threading.Thread(target=work, args=(i,)) for i in range(T)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert not errors, errors
        for c, res in zip(cases, results):
            m = c["mask"]
            refs = {"linear_dual": reference_grads(lambda a, *w: linear_dual_reference(a, m, *w), [c["x"]] + c["lin"],
                                                   c["gy"], [True] * 5),
                    "ffn dual": reference_grads(lambda a, w1, w3, w2, u1, u3, u2: ffn_reference(
                        a, w1, w3, w2, m, u1, u3, u2), [c["x"]] + c["ffn"] + c["ffn_t"], c["gx"], [True] * 7),
                    "ffn single": reference_grads(lambda a, *w: ffn_reference(a, *w), [c["x"]] + c["ffn"], c["gx"],
                                                  [True] * 4)}
            for it in res:
                for name, y, grads in it:
                    ref_y, ref_g = refs[name]
                    for what, got, want in [("out", y, ref_y)] + list(zip(range(len(grads)), grads, ref_g)):
                        err = rel_err(got, want)
                        assert err < 1e-2, f"{c['dev']} {name} {what}: relative error {err:.3g}"
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
