"""PT2 deployment of the example block (examples/block_model.py: rope_fwd + linear_dual + dual and single ffn):
torch.compile(fullgraph=True) with aot_eager and with the default inductor backend, forward and gradients;
torch.export, with the fused ops in the exported graph, saved and loaded in a fresh process; AOTInductor
(aoti_compile_and_package) packages loaded in a fresh process without Triton.

What does not work is pinned down here too (README, "Deployment"): exporting with dynamic batch or sequence sizes
specializes them (xfail), and an AOTInductor package loads only once the ops are registered.
"""
import os
import sys

import pytest
import torch

from fresh_process import run_fresh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from block_model import FusedBlock, make_inputs  # noqa: E402

@pytest.fixture(autouse=True)
def compile_for_real(monkeypatch):
    # The interpreter tests set TRITON_INTERPRET=1 for the whole pytest process; inductor's Triton kernels (CUDA)
    # must be compiled, not interpreted (Triton reads the variable when a kernel is created).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


FUSED_TARGETS = {"fused.route.default": 1, "fused.linear_dual.default": 1, "fused.rope_fwd.default": 1,
                 "fused.ffn.default": 2}


def block_and_inputs(device, **kw):
    block = FusedBlock(device=device)
    return block, make_inputs(block, device=device, **kw)


def out_and_grads(fn, block, x, mask, freqs):
    xl = x.clone().requires_grad_(True)
    out = fn(xl, mask, freqs)
    return [out.detach()] + list(torch.autograd.grad(out, [xl] + list(block.parameters()), torch.ones_like(out)))


def check_compiled_block(device, backend):
    """No graph break (fullgraph=True raises on one); outputs and gradients as eager, at two shapes."""
    torch._dynamo.reset()
    block, _ = block_and_inputs(device)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    for batch, seq in ((2, 8), (3, 5)):
        x, mask, freqs = make_inputs(block, batch=batch, seq=seq, device=device)
        want = out_and_grads(block, block, x, mask, freqs)
        got = out_and_grads(compiled, block, x, mask, freqs)
        for g, w in zip(got, want):  # inductor fuses the residual adds: not bitwise
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_block(device, backend):
    if not (backend == "inductor" and device.startswith("cuda")):
        check_compiled_block(device, backend)
        return
    # Inductor on CUDA compiles Triton kernels: in a fresh process, since this one may have run the interpreter tests
    # (tests/fresh_process.py run_fresh(triton=True)).
    r = run_fresh(f"""
        import test_deploy_pt2 as t
        t.check_compiled_block({device!r}, "inductor")
        print("OK")
    """, triton=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def fused_calls(exported) -> dict:
    calls = {}
    for node in exported.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("fused."):
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    return calls


def test_export_block_and_load_it_in_a_fresh_process(tmp_path, device):
    block, inputs = block_and_inputs(device)
    exported = torch.export.export(block, inputs)
    assert fused_calls(exported) == FUSED_TARGETS, exported.graph
    want = block(*inputs)
    assert torch.equal(exported.module()(*inputs), want)
    torch.export.save(exported, str(tmp_path / "block.pt2"))
    torch.save((inputs, want), tmp_path / "io.pt")
    r = run_fresh(f"""
        import torch, fused_ops
        inputs, want = torch.load({str(tmp_path / "io.pt")!r}, weights_only=False)
        exported = torch.export.load({str(tmp_path / "block.pt2")!r})
        assert torch.equal(exported.module()(*inputs), want)
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_export_with_dynamic_batch_and_sequence():
    """A limitation (README, Deployment): the ops' Meta kernels and input checks read concrete sizes, so dynamic dims
    specialize and export refuses them. Reported as xfail; the day export accepts them, this fails (DID NOT RAISE):
    then test what works instead and update the README."""
    block, inputs = block_and_inputs("cpu")
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=4096)
    # (torch._dynamo is touched only here, at run time: importing it imports triton, which the interpreter tests need
    # to import themselves, after setting TRITON_INTERPRET)
    with pytest.raises(torch._dynamo.exc.UserError, match=r"Constraints violated \(batch, seq\)"):
        torch.export.export(block, inputs, dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}, {0: seq}))
    pytest.xfail("torch.export specializes dynamic batch/sequence dims (the ops' Meta kernels read concrete sizes)")


# Inductor builds the package's .so with $CXX. A toolchain that links libstdc++ statically (the GPU machine's
# CXX=/opt/gcc/bin/g++) gives a .so that segfaults in torch's loader when Python loads it (measured: with the system
# g++ the same package loads and matches eager exactly; from C++, examples/cpp, both work). That is the toolchain's
# problem, not the ops': the package is built with the platform compiler (README, Deployment).
PACKAGE_BUILD_ENV = {"CXX": "g++", "CC": "gcc"}


def test_aoti_package_runs_in_a_fresh_process_without_triton(tmp_path, device):
    """aoti_compile_and_package of the exported block; loading the package needs the ops registered (import fused_ops
    in Python, linking libfused_ops in C++: examples/cpp runs the same package from C++), then runs with no Triton
    and gives eager's result. Without the ops registered, loading fails and names the missing op."""
    package = str(tmp_path / "block.pt2")
    # Compiled in a fresh process with Triton (the CUDA package's kernels are Triton kernels; this pytest process may
    # have created Triton's jit functions in interpreter mode), then run in fresh processes without it.
    r = run_fresh(f"""
        import torch, test_deploy_pt2 as t
        block, inputs = t.block_and_inputs({device!r})
        torch._inductor.aoti_compile_and_package(torch.export.export(block, inputs), package_path={package!r})
        torch.save((inputs, block(*inputs)), {str(tmp_path / "io.pt")!r})
        print("OK")
    """, triton=True, timeout=600, env=PACKAGE_BUILD_ENV)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
    load = f"""
        import sys, torch
        inputs, want = torch.load({str(tmp_path / "io.pt")!r}, weights_only=False)
        model = torch._inductor.aoti_load_package({package!r})
        torch.testing.assert_close(model(*inputs), want, rtol=1e-5, atol=1e-5)
        assert sys.modules["triton"] is None
        print("OK")
    """
    r = run_fresh(load.replace("import sys, torch", "import sys, torch, fused_ops"))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
    r = run_fresh(load)
    assert r.returncode != 0 and "Could not find schema for fused::" in r.stderr, r.stderr[-3000:]
