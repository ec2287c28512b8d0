"""Hugging Face users' generation path: a Llama patched by `fused_ops.hf.apply_fused_ops` generating under HF's static
cache (`cache_implementation="static"`), which on a GPU HF compiles with `torch.compile(mode="reduce-overhead")`
(CUDA graphs) for its decode steps.

CPU: the patched tiny Llama's greedy tokens under the static cache equal the unpatched model's (float64), with the
fused ops counted in every step. GPU: the same with HF's compiled decode steps (float32), against the unpatched
model's eager static-cache tokens.
"""
import copy

import pytest
import torch

try:
    import transformers
except ImportError as e:
    pytest.skip(f"transformers is not importable ({e}); `pip install .[hf]`", allow_module_level=True)
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"fused_ops.hf is tested with transformers >= 5, found {transformers.__version__}",
                allow_module_level=True)

import fused_ops  # noqa: E402,F401
from fused_ops import hf  # noqa: E402
from fresh_process import run_fresh  # noqa: E402
from test_hf_patch import FusedOpCounter  # noqa: E402

#: Llama-3's shape ratios at toy size (GQA 8 / 2 heads of 16, llama3 rope scaling); a wide init, so that greedy
#: choices are never near ties
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
            tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=None, pad_token_id=0,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192))
NEW = 16


def pair(dtype, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(dtype).eval()
    model = copy.deepcopy(ref)
    report = hf.apply_fused_ops_to_llama(model)
    assert report.rope and len(report.mlp_layers) == TINY["num_hidden_layers"]
    return ref, model


def prompts(device="cpu"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, TINY["vocab_size"], (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: per-sequence positions
    return ids.to(device), mask.to(device)


def test_static_cache_greedy_equals_unpatched():
    ref, model = pair(torch.float64)
    ids, mask = prompts()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        with FusedOpCounter() as ops:
            got = model.generate(ids, **kw)
    layers = TINY["num_hidden_layers"]
    assert ops.calls == {"ffn": NEW * layers, "rope_fwd_qk": NEW * layers}  # prefill + 15 decode steps
    assert got.shape == (2, 12 + NEW)
    assert torch.equal(got, want)


def test_static_cache_compiled_reduce_overhead_on_gpu(gpu_device):
    """HF's compiled decode steps (static cache, torch.compile mode="reduce-overhead") over the patched model: the
    unpatched model's greedy tokens (float32, TF32 off). In a fresh process (fresh_process.run_fresh): in a pytest
    process that ran the interpreter tests, Triton's own jit functions exist in interpreter mode and inductor's CUDA
    kernels cannot be compiled there."""
    r = run_fresh(f"""
        import torch, transformers
        from test_generate_hf import NEW, pair, prompts
        torch.backends.cuda.matmul.allow_tf32 = False
        ref, model = pair(torch.float32, {gpu_device!r})
        ids, mask = prompts({gpu_device!r})
        kw = dict(attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
        compiled = transformers.CompileConfig(mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            want = ref.generate(ids, disable_compile=True, **kw)
            for _ in range(2):  # the first call compiles, the second replays the CUDA graphs
                got = model.generate(ids, compile_config=compiled, **kw)
        assert getattr(model, "_compiled_call", None) is not None, "HF did not compile the decode steps"
        assert torch.equal(got, want), (got, want)
        print("OK")
    """, triton=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
