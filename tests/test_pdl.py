"""Programmatic dependent launch (kernels/pdl.py): the routed kernels built for sm_90 wait for the previous kernel
before their first memory access, and switching PDL on or off never changes a result.

CPU tier: the switch, and the compiled PTX (no GPU needed): every routed kernel's sm_90 build starts with
griddepcontrol.wait ahead of any global memory instruction; sm_80 builds carry no griddepcontrol.
GPU tier: chains of routed ops in which every op reads the previous op's output, forward and backward, many
iterations with fresh inputs, on the default and on a side stream and inside a CUDA graph: bitwise equal with PDL on
and off (the kernels are deterministic, so any read of a not-yet-written value would show).
"""
import json
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fused_ops  # noqa: E402

from fresh_process import run_fresh  # noqa: E402

from reference_routed import ffn_reference, make_mask, rel_err  # noqa: E402


def test_switch_round_trip():
    prev = fused_ops.set_programmatic_launch(False)
    try:
        assert fused_ops.set_programmatic_launch(True) is False
        assert fused_ops.set_programmatic_launch(True) is True
    finally:
        fused_ops.set_programmatic_launch(prev)


@pytest.mark.parametrize("env,default", [("0", False), ("1", True), (None, True)])
def test_environment_sets_the_default(env, default):
    """FUSED_PDL=0 in the environment turns PDL off from the start; anything else (or nothing) leaves it on."""
    r = run_fresh("""
        import fused_ops
        print("DEFAULT", fused_ops.set_programmatic_launch(True))
    """, env={} if env is None else {"FUSED_PDL": env})
    if env is None:
        assert "FUSED_PDL" not in os.environ, "the test expects FUSED_PDL unset in its own environment"
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"DEFAULT {default}" in r.stdout


# ---------------------------------------------------------------------------------------------------------------
# The compiled code: one variant of each routed kernel (the first the manifest lists for sm_90).
# ---------------------------------------------------------------------------------------------------------------
# By module: kernels/routing.py, gather_rows.py, gemm_pointer.py, gemm_tma.py, gemm_gather_tma.py, gemm_decode.py,
# grad_weight.py, swiglu_backward.py.
_KERNELS = ["routing_one_block_kernel", "routing_shared_kernel", "routing_count_kernel", "routing_scatter_kernel",
            "routing_single_kernel",
            "gather_rows_kernel", "route_gather_rows_kernel", "expert_colsum_kernel",
            "routed_linear_kernel", "routed_swiglu_kernel",
            "routed_linear_tma_kernel", "routed_swiglu_tma_kernel", "routed_swiglu_pair_tma_kernel",
            "routed_swiglu_pair_bwd_tma_kernel",
            "routed_linear_gather_tma_kernel", "routed_swiglu_gather_tma_kernel",
            "routed_decode_linear_kernel", "decode_reduce_kernel",
            "routed_grad_weight_kernel", "routed_grad_weight_tma_kernel",
            "swiglu_backward_kernel"]

# PTX instructions that touch global memory (loads, stores, TMA and async copies, atomics, reductions).
_MEMORY = re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|st\.global|cp\.async|cp\.reduce|atom\.|red\.|"
                     r"ld\.volatile\.global|multimem\.)")


@pytest.fixture(scope="module")
def compiled():
    """{kernel: {"pdl90", "pdl80", "ptx90", "ptx80"}} for one sm_90 variant of every routed kernel, compiled (no GPU)
    in a fresh process: a pytest process that ran the interpreter tests holds the kernels as interpreted functions."""
    pytest.importorskip("triton")  # a build-time dependency, present on CI
    code = """
        import json, os, sys
        sys.path.insert(0, os.path.dirname(os.getcwd()))
        from aot import compile as c, manifest
        out = {}
        for v in manifest.variants():
            routed = v.kernel.split(":")[0] in ("kernels.routing", "kernels.gather_rows", "kernels.gemm_pointer",
                                                "kernels.gemm_tma", "kernels.gemm_gather_tma", "kernels.gemm_decode",
                                                "kernels.grad_weight",
                                                "kernels.swiglu_backward")
            if not routed or 90 not in v.archs or v.name in out:
                continue
            out[v.name] = {"pdl90": c._meta(v, 90).get("PDL"), "pdl80": c._meta(v, 80).get("PDL"),
                           "ptx90": c.compile_variant(v, 90).asm["ptx"],
                           "ptx80": c.compile_variant(v, 80).asm["ptx"] if 80 in v.archs else None}
        rope = next(v for v in manifest.variants() if v.name == "rope_kernel")
        out["rope_kernel"] = {"pdl90": c._meta(rope, 90).get("PDL")}
        print("JSON" + json.dumps(out))
    """
    r = run_fresh(code, triton=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.split("JSON", 1)[1])


def test_every_routed_kernel_is_covered(compiled):
    """_KERNELS names every kernel of the routed kernels' modules (kernels/routing.py, the GEMM files gather_rows.py,
    gemm_pointer.py, gemm_tma.py, gemm_gather_tma.py, gemm_decode.py and grad_weight.py, and swiglu_backward.py; a new
    kernel must be
    added here, and must start with grid_dependency_sync)."""
    assert sorted(k for k in compiled if k != "rope_kernel") == sorted(_KERNELS)


@pytest.mark.parametrize("name", _KERNELS)
def test_sm90_waits_before_memory_sm80_has_no_griddepcontrol(compiled, name):
    c = compiled[name]
    assert c["pdl90"] is True and c["pdl80"] is False
    ptx = c["ptx90"].splitlines()
    waits = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    launches = [i for i, line in enumerate(ptx) if "griddepcontrol.launch_dependents" in line]
    first_memory = next(i for i, line in enumerate(ptx) if _MEMORY.match(line))
    assert waits and waits[0] < first_memory, f"{name}: a global memory access before griddepcontrol.wait"
    assert launches and waits[0] < launches[0]
    if c["ptx80"] is not None:
        assert "griddepcontrol" not in c["ptx80"]


def test_rope_is_compiled_without_pdl(compiled):
    """The rope kernel has no PDL parameter: the launcher never launches it early."""
    assert compiled["rope_kernel"]["pdl90"] is None


# ---------------------------------------------------------------------------------------------------------------
# GPU: dependent chains give the same bits with PDL on and off.
# ---------------------------------------------------------------------------------------------------------------
def _weights(K, I, dtype, device, gen):
    def w(*shape):
        return (torch.randn(*shape, generator=gen, device=device) / shape[-1] ** 0.5).to(dtype)
    lin = dict(weight_v=w(K, K), weight_t=w(K, K), bias_v=w(K), bias_t=w(K))
    dual = [w(I, K), w(I, K), w(K, I), w(I, K), w(I, K), w(K, I)]
    return lin, dual


def _chain(x, mask, lin, dual):
    """linear_dual -> dual ffn -> single ffn -> linear_dual, each reading the previous output; then the backward."""
    y = fused_ops.linear_dual(x, mask, **lin)
    w1, w3, w2, u1, u3, u2 = dual
    y = torch.ops.fused.ffn(y, w1, w3, w2, mask, u1, u3, u2)
    y = torch.ops.fused.ffn(y, w1, w3, w2)
    y = fused_ops.linear_dual(y, mask, **lin)
    (gx,) = torch.autograd.grad((y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum(), [x])
    return y.detach(), gx


def _run_chains(device, pdl, stream=None, Ms=(1, 3, 64, 200, 700, 4100, 5000)):
    gen = torch.Generator(device=device).manual_seed(7)
    gen_mask = torch.Generator().manual_seed(7)  # make_mask draws on the CPU
    K, I = 128, 384
    lin, dual = _weights(K, I, torch.bfloat16, device, gen)
    prev = fused_ops.set_programmatic_launch(pdl)
    outs = []
    try:
        with torch.cuda.stream(stream or torch.cuda.current_stream(device)):
            for it, M in enumerate(Ms * 3):
                x = torch.randn(M, K, generator=gen, device=device).to(torch.bfloat16).requires_grad_()
                mask = make_mask(["random", "span", "all_true", "all_false"][it % 4], (M,), device, gen_mask)
                outs.append(_chain(x, mask, lin, dual) + (x.detach(), mask))
        torch.cuda.synchronize(device)
    finally:
        fused_ops.set_programmatic_launch(prev)
    return outs, (lin, dual)


@pytest.mark.gpu
@pytest.mark.parametrize("side_stream", [False, True], ids=["default_stream", "side_stream"])
def test_chains_identical_with_and_without_pdl(gpu_device, side_stream):
    stream = torch.cuda.Stream(gpu_device) if side_stream else None
    on, (lin, dual) = _run_chains(gpu_device, True, stream)
    off, _ = _run_chains(gpu_device, False, stream)
    for (y_on, g_on, x, mask), (y_off, g_off, _, _) in zip(on, off):
        assert torch.equal(y_on, y_off) and torch.equal(g_on, g_off), f"M={x.shape[0]}: PDL changed a result"
    # and the chain is right (float64 reference of the forward of the last, largest case)
    y, _, x, mask = on[-1]
    w1, w3, w2, u1, u3, u2 = [w.double() for w in dual]
    lv = {k: v.double() for k, v in lin.items()}

    def lin64(t):
        return torch.where(mask[:, None], t @ lv["weight_v"].T + lv["bias_v"], t @ lv["weight_t"].T + lv["bias_t"])
    r = lin64(x.double())
    r = ffn_reference(r, w1, w3, w2, mask, u1, u3, u2)
    r = ffn_reference(r, w1, w3, w2)
    r = lin64(r)
    assert rel_err(y, r) < 3e-2


@pytest.mark.gpu
def test_cuda_graph_with_pdl(gpu_device):
    """A captured chain (PDL edges in the graph) replays to the eager result for new inputs."""
    gen = torch.Generator(device=gpu_device).manual_seed(3)
    gen_mask = torch.Generator().manual_seed(3)
    K, I, M = 128, 384, 777
    lin, dual = _weights(K, I, torch.bfloat16, gpu_device, gen)
    x_static = torch.randn(M, K, generator=gen, device=gpu_device).to(torch.bfloat16)
    m_static = make_mask("random", (M,), gpu_device, gen_mask)

    def fwd(x, mask):
        y = fused_ops.linear_dual(x, mask, **lin)
        y = torch.ops.fused.ffn(y, *dual[:3], mask, *dual[3:])
        return fused_ops.linear_dual(y, mask, **lin)

    prev = fused_ops.set_programmatic_launch(True)
    try:
        s = torch.cuda.Stream(gpu_device)
        with torch.cuda.stream(s):
            fwd(x_static, m_static)  # load the modules outside the capture
        torch.cuda.synchronize(gpu_device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            y_static = fwd(x_static, m_static)
        for _ in range(5):
            x_static.copy_(torch.randn(M, K, generator=gen, device=gpu_device).to(torch.bfloat16))
            m_static.copy_(make_mask("random", (M,), gpu_device, gen_mask))
            g.replay()
            torch.cuda.synchronize(gpu_device)
            assert torch.equal(y_static, fwd(x_static, m_static))
    finally:
        fused_ops.set_programmatic_launch(prev)
