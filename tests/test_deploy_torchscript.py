"""TorchScript deployment: the package's nn.Modules, its functional wrappers and the example block
(examples/block_model.py) under torch.jit.script and torch.jit.trace; saved, then loaded and run in a fresh process
without Triton, which must import fused_ops to register the ops (a C++ program links the library instead: see
tests/test_cmake_build.py), with bitwise the same results."""
import os
import sys

import pytest
import torch

import fused_ops
from fresh_process import run_fresh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from block_model import FusedBlock, make_inputs  # noqa: E402


def module_cases(device):
    """name -> (module, example inputs), every module on `device`, float32."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32, device=device)
    mask = torch.rand(3, 5, device=device) < 0.5
    mask.view(-1)[:2] = torch.tensor([True, False])  # both experts hold tokens
    block = FusedBlock(device=device)
    return {
        "DualLinear": (fused_ops.DualLinear(32, 24, device=device), (x, mask)),
        "DualLinear_nobias": (fused_ops.DualLinear(32, 24, bias=False, device=device), (x, mask)),
        "FusedSwiGLU": (fused_ops.FusedSwiGLU(32, 48, device=device), (x,)),
        "DualExpertSwiGLU": (fused_ops.DualExpertSwiGLU(32, 48, device=device), (x, mask)),
        "FusedBlock": (block, make_inputs(block, batch=3, seq=5, device=device)),
    }


def fused_ops_in(module) -> set:
    """The fused ops a scripted or traced module's forward calls (submodules inlined)."""
    graph = str(module.inlined_graph)
    return {op for op in ("linear_dual", "rope_fwd", "ffn") if f"fused::{op}" in graph}


EXPECTED_OPS = {"DualLinear": {"linear_dual"}, "DualLinear_nobias": {"linear_dual"}, "FusedSwiGLU": {"ffn"},
                "DualExpertSwiGLU": {"ffn"}, "FusedBlock": {"linear_dual", "rope_fwd", "ffn"}}


def test_script_and_trace_round_trip_in_a_fresh_process(tmp_path, device):
    want = {}
    for name, (module, inputs) in module_cases(device).items():
        out = module(*inputs)
        for kind in ("script", "trace"):
            compiled = torch.jit.script(module) if kind == "script" else torch.jit.trace(module, inputs)
            assert fused_ops_in(compiled) == EXPECTED_OPS[name], f"{name} ({kind}) does not call the fused ops"
            assert torch.equal(compiled(*inputs), out), f"{name} ({kind}) differs from eager"
            compiled.save(str(tmp_path / f"{name}_{kind}.pt"))
        want[name] = (inputs, out)
    rpe = torch.jit.script(fused_ops.RotaryPositionEmbedding(16, rotary_percent=0.5, seq_len_interpolation_factor=2.0,
                                                             pretrained_max_position_embeddings=4, device=device))
    rpe.save(str(tmp_path / "RotaryPositionEmbedding_script.pt"))
    want["RotaryPositionEmbedding"] = ((7,), rpe(7))
    torch.save(want, tmp_path / "io.pt")
    r = run_fresh(f"""
        import sys, torch, fused_ops
        want = torch.load({str(tmp_path / "io.pt")!r}, weights_only=False)
        for name, (inputs, out) in want.items():
            kinds = ("script",) if name == "RotaryPositionEmbedding" else ("script", "trace")
            for kind in kinds:
                m = torch.jit.load({str(tmp_path)!r} + f"/{{name}}_{{kind}}.pt", map_location={device!r})
                got = m(*inputs)
                assert got.device == out.device and torch.equal(got, out), f"{{name}} ({{kind}}) differs after loading"
                print("loaded and ran", name, kind)
        assert sys.modules["triton"] is None
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("loaded and ran") == 2 * len(EXPECTED_OPS) + 1


def test_scripted_block_gradients_match_eager():
    block = FusedBlock()
    x, mask, freqs = make_inputs(block)
    params = list(block.parameters())

    def grads(fn):
        xl = x.clone().requires_grad_(True)
        out = fn(xl, mask, freqs)
        return torch.autograd.grad(out, [xl] + params, torch.ones_like(out))

    want = grads(block)
    for compiled in (torch.jit.script(block), torch.jit.trace(block, (x, mask, freqs))):
        for g, w in zip(grads(compiled), want):
            assert torch.equal(g, w)


def test_scripted_functional_wrappers():
    t = torch.randn(6, 2, 3, 16)
    f = fused_ops.RotaryPositionEmbedding(16, device="cpu")(6)
    x, mask = torch.randn(7, 32), torch.rand(7) < 0.5
    wv, wt, w1, w3, w2 = torch.randn(24, 32), torch.randn(24, 32), torch.randn(48, 32), torch.randn(48, 32), \
        torch.randn(32, 48)
    cases = [
        (fused_ops.apply_rotary_pos_emb, (t, f, "sbhd")),
        (fused_ops.apply_rotary_pos_emb_qk, (t, t[:, :, :1], f, "sbhd")),
        (fused_ops.linear_dual, (x, mask, wv, wt)),
        (fused_ops.ffn, (x, w1, w3, w2)),
        (fused_ops.ffn, (x, w1, w3, w2, mask, w1 * 0.5, w3 * 0.5, w2 * 0.5)),
        # (called twice on the same caches: it writes the same rows again, and reads the new tokens from k_new)
        (fused_ops.decode_attention, (torch.randn(2, 1, 4, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16),
                                      torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16),
                                      torch.tensor([0, 3], dtype=torch.int32))),
    ]
    for fn, args in cases:
        scripted, eager = torch.jit.script(fn)(*args), fn(*args)
        for s, e in zip(scripted if isinstance(scripted, tuple) else (scripted,),
                        eager if isinstance(eager, tuple) else (eager,)):
            assert torch.equal(s, e), fn.__name__
    # the Python-side guard against TE 1.x's argument order still raises in eager mode
    with pytest.raises(TypeError, match="interleaved"):
        fused_ops.apply_rotary_pos_emb(t, f, "sbhd", None, torch.zeros(2, dtype=torch.int32))


def test_loading_without_the_ops_registered_fails_clearly(tmp_path):
    """Without `import fused_ops` (or linking the library in C++) the saved model names an op nobody registered."""
    block = FusedBlock()
    torch.jit.script(block).save(str(tmp_path / "block.pt"))
    r = run_fresh(f"""
        import torch
        torch.jit.load({str(tmp_path / "block.pt")!r})
    """)
    assert r.returncode != 0 and "Unknown builtin op: fused::" in r.stderr, r.stderr[-3000:]


def test_decode_step_script_and_trace_round_trip(tmp_path, device):
    """examples/decode_step.py's DecodeStep (fused::decode_attention on a KV cache held as buffers, the caches written
    in place) scripted and traced: eager's output and caches, here and after torch.jit.save / load in a fresh process
    without Triton, at two sets of lengths (they are data: one module serves every length)."""
    from decode_step import DecodeStep, make_inputs
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the CUDA kernels are bf16 / fp16
    step = DecodeStep(device=device, dtype=dtype)
    qkv, lens = make_inputs(step, tokens=2)
    caches = (step.k_cache.clone(), step.v_cache.clone())
    cases = [(qkv, lens), (qkv * 0.5, (lens + 7) % 30)]
    want = []
    for x, n in cases:
        step.k_cache.copy_(caches[0]), step.v_cache.copy_(caches[1])
        want.append((step(x, n), step.k_cache.clone(), step.v_cache.clone()))
    for kind in ("script", "trace"):
        compiled = torch.jit.script(step) if kind == "script" else torch.jit.trace(step, cases[0])
        assert "fused::decode_attention" in str(compiled.inlined_graph), kind
        for (x, n), (out, kc, vc) in zip(cases, want):
            compiled.k_cache.copy_(caches[0]), compiled.v_cache.copy_(caches[1])
            assert torch.equal(compiled(x, n), out), kind
            assert torch.equal(compiled.k_cache, kc) and torch.equal(compiled.v_cache, vc), kind
        compiled.k_cache.copy_(caches[0]), compiled.v_cache.copy_(caches[1])
        compiled.save(str(tmp_path / f"decode_{kind}.pt"))
    torch.save((cases, want), tmp_path / "decode_io.pt")
    r = run_fresh(f"""
        import sys, torch, fused_ops
        cases, want = torch.load({str(tmp_path / "decode_io.pt")!r}, weights_only=False)
        for kind in ("script", "trace"):
            m = torch.jit.load({str(tmp_path)!r} + f"/decode_{{kind}}.pt", map_location={device!r})
            k0, v0 = m.k_cache.clone(), m.v_cache.clone()
            for (x, n), (out, kc, vc) in zip(cases, want):
                m.k_cache.copy_(k0), m.v_cache.copy_(v0)
                assert torch.equal(m(x, n), out) and torch.equal(m.k_cache, kc) and torch.equal(m.v_cache, vc), kind
            print("loaded and ran", kind)
        assert sys.modules["triton"] is None
        print("OK")
    """)
    assert r.returncode == 0 and r.stdout.count("loaded and ran") == 2 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]
