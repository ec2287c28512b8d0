"""fused_ops.hf: transformers Llama-family models patched in place (MLP -> fused.ffn, q/k RoPE -> fused.rope_fwd_qk)
against the same model unpatched: logits, loss, gradients, greedy generation, checkpoints, bad models.

CPU tests use a Llama-3-8B-like config scaled down (GQA 8/2 heads, llama3 rope scaling, rope_theta 500000); the GPU
test uses Llama-3-8B's real config with 2 layers. Every comparison also counts the fused ops that ran, so a patch
that silently fell back to HF's code fails.
"""
import copy
import functools
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

try:  # an optional dependency (`pip install .[hf]`; scripts/setup_env.sh installs it when an index is reachable)
    import transformers
except ImportError as e:  # missing, or installed without its own dependencies
    pytest.skip(f"transformers is not importable ({e}); `pip install .[hf]`", allow_module_level=True)
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"fused_ops.hf is tested with transformers >= 5, found {transformers.__version__}",
                allow_module_level=True)

import fused_ops  # noqa: E402,F401 (registers torch.ops.fused.*)
from fused_ops import hf  # noqa: E402
from reference_routed import rel_err  # noqa: E402

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
#: meta-llama/Meta-Llama-3-8B's config.json (the fields that shape the model)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                 hidden_act="silu", tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
#: the same shape ratios at toy size: head_dim 16, 4 query heads per KV head, intermediate 3.5x hidden
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=448, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2)
LAYERS = TINY["num_hidden_layers"]


def tiny_config(cls=transformers.LlamaConfig, **overrides):
    return cls(**dict(TINY, bos_token_id=1, eos_token_id=None, pad_token_id=0, **overrides))


def tiny_llama(dtype=torch.float64, **overrides) -> nn.Module:
    return transformers.LlamaForCausalLM(tiny_config(**overrides)).to(dtype).eval()


class FusedOpCounter(TorchDispatchMode):
    """Counts the torch.ops.fused.* calls that run inside it (below autograd, so backward ops count too; ffn_forward,
    ffn's forward under autograd, counts as ffn)."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("fused."):
            # ffn under autograd runs as ffn_forward (which also keeps gate and up for the backward): one MLP forward
            op = name.split(".", 1)[1]
            self.calls["ffn" if op == "ffn_forward" else op] += 1
        return func(*args, **(kwargs or {}))


def patched_pair(dtype=torch.float64, **overrides):
    """(unpatched, patched): two models with the same weights."""
    ref = tiny_llama(dtype, **overrides)
    model = copy.deepcopy(ref)
    hf.apply_fused_ops_to_llama(model)
    return ref, model


def tokens(batch=2, seq=24, vocab=TINY["vocab_size"]):
    return torch.randint(2, vocab, (batch, seq))


def test_logits_and_loss_match_float64():
    ref, model = patched_pair()
    ids = tokens()
    want = ref(ids, labels=ids)
    with FusedOpCounter() as ops:
        got = model(ids, labels=ids)
    assert ops.calls == {"ffn": LAYERS, "rope_fwd_qk": LAYERS}
    # HF computes cos/sin in fp32 even for a float64 model, and the op takes fp32 angles: ~1e-7, not float64's 1e-16.
    assert rel_err(got.logits, want.logits) < 1e-6
    assert abs(got.loss.item() - want.loss.item()) < 1e-6 * want.loss.item()


@pytest.mark.parametrize("case", ["offset", "per_sequence", "beyond_original_context"])
def test_explicit_position_ids(case):
    """Shared ([1, s]) and per-sequence ([b, s]) positions, including positions past llama3's original 8192 where
    its scaling of the low frequencies matters: the op sees HF's exact angles in every case."""
    ref, model = patched_pair()
    ids = tokens(2, 16)
    pos = {"offset": torch.arange(16)[None] + 100,
           "per_sequence": torch.stack([torch.arange(16) + 5, torch.arange(16) * 3]),
           "beyond_original_context": torch.stack([torch.arange(16) + 9000, torch.arange(16) * 700])}[case]
    with FusedOpCounter() as ops:
        got = model(ids, position_ids=pos).logits
    assert ops.calls["rope_fwd_qk"] == LAYERS
    assert rel_err(got, ref(ids, position_ids=pos).logits) < 1e-6


def test_greedy_generation_float32():
    """32 greedy tokens identical in float32, batch 1 (left-padded batches: check_greedy_and_bf16 below)."""
    ref, model = patched_pair(torch.float32)
    ids = tokens(1, 12)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, **kw)
    with FusedOpCounter() as ops:
        got = model.generate(ids, **kw)
    assert ops.calls == {"rope_fwd_qk": 32 * LAYERS, "ffn": 32 * LAYERS}  # prefill + 31 decode steps
    assert got.shape[1] == ids.shape[1] + 32
    assert torch.equal(got, want)


def test_training_step():
    """Gradients of every parameter match; an optimizer created before patching keeps working (same parameters)."""
    ref = tiny_llama().train()
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params_before = [(n, p) for n, p in model.named_parameters()]
    ids = tokens()
    model(ids, labels=ids).loss.backward()  # one unpatched step: the optimizer state exists before the patch
    opt.step()
    opt.zero_grad()
    ref.load_state_dict(model.state_dict())
    hf.apply_fused_ops_to_llama(model)
    assert [(n, p) for n, p in model.named_parameters()] == params_before  # the same Parameter objects

    ids = tokens()
    ref(ids, labels=ids).loss.backward()
    with FusedOpCounter() as ops:
        model(ids, labels=ids).loss.backward()
    assert ops.calls["ffn_backward"] == LAYERS and ops.calls["rope_bwd_qk"] == LAYERS
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and rel_err(p.grad, q.grad) < 1e-6, name
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert torch.isfinite(model(ids, labels=ids).loss)


@pytest.mark.parametrize("recompute", [False, True])
def test_recompute_option(recompute):
    """apply_fused_ops(recompute=...): the MLPs' forward keeps gate and up (ffn_forward under autograd) or nothing
    (ffn, its backward computing them again); the gradients match the unpatched model either way; removing the patch
    drops the setting, and the state dict does not hold it."""
    ref, model = patched_pair()
    hf.apply_fused_ops_to_llama(model, recompute=recompute)
    assert set(model.state_dict()) == set(ref.state_dict())
    ids = tokens()
    ref(ids, labels=ids).loss.backward()
    names = []

    class Raw(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket).startswith("fused."):
                names.append(str(func.overloadpacket).split(".", 1)[1])
            return func(*args, **(kwargs or {}))

    with Raw():
        model(ids, labels=ids).loss.backward()
    forward_op = "ffn" if recompute else "ffn_forward"
    assert names.count(forward_op) == LAYERS and names.count("ffn_backward") == LAYERS, names
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-6, name
    hf.remove_fused_ops(model)
    assert not any("_fused_ops_recompute" in layer.mlp.__dict__ for layer in model.model.layers)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    """Recomputed layers run the fused ops again (HF passes position_embeddings by keyword, so the tagged cos
    reaches the recompute even with reentrant checkpointing, which detaches positional inputs)."""
    ref = tiny_llama().train()
    model = copy.deepcopy(ref)
    hf.apply_fused_ops(model)
    for m in (ref, model):
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name is deprecated there
            m.activation_checkpointing_enable({"use_reentrant": reentrant})
        else:
            m.gradient_checkpointing_enable({"use_reentrant": reentrant})
    ids = tokens()
    ref(ids, labels=ids, use_cache=False).loss.backward()
    with FusedOpCounter() as ops:
        model(ids, labels=ids, use_cache=False).loss.backward()
    assert ops.calls == {"ffn": 2 * LAYERS, "rope_fwd_qk": 2 * LAYERS, "ffn_backward": LAYERS,
                         "rope_bwd_qk": LAYERS}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-6, name


def test_state_dict_deepcopy_and_save_pretrained(tmp_path):
    ref, model = patched_pair(torch.float32)
    assert list(model.state_dict()) == list(ref.state_dict())
    ids = tokens()
    want = ref(ids).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(loaded(ids).logits, want)  # an unpatched model from the patched model's checkpoint
    clone = copy.deepcopy(model)  # the clone's MLPs are bound to the clone's own weights, not the original's
    assert clone.model.layers[0].mlp.forward.__self__ is clone.model.layers[0].mlp
    with FusedOpCounter() as ops:
        assert rel_err(clone(ids).logits, want) < 1e-5
    assert ops.calls["ffn"] == LAYERS


def test_idempotent_and_removable():
    ref, model = patched_pair()
    first = hf.apply_fused_ops_to_llama(model)
    again = hf.apply_fused_ops(model)
    assert first == again and first.mlp_layers == tuple(range(LAYERS)) and first.rope
    dispatch = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    assert not hasattr(dispatch._fused_ops_original, "_fused_ops_original")  # wrapped once, not twice
    ids = tokens()
    with FusedOpCounter() as ops:
        got = model(ids).logits
    assert ops.calls == {"ffn": LAYERS, "rope_fwd_qk": LAYERS}  # once per layer, not twice
    assert rel_err(got, ref(ids).logits) < 1e-6

    report = hf.remove_fused_ops(model)
    assert report.mlp_layers == () and not report.rope
    with FusedOpCounter() as ops:
        assert torch.equal(model(ids).logits, ref(ids).logits)  # HF's code exactly
    assert not ops.calls


def test_unpatched_models_of_the_same_class_are_untouched():
    """The modeling module's apply_rotary_pos_emb dispatcher runs HF's original for models that were not patched."""
    other = tiny_llama()
    ids = tokens()
    want = other(ids).logits
    patched_pair()
    with FusedOpCounter() as ops:
        assert torch.equal(other(ids).logits, want)
    assert not ops.calls


def test_attention_scaling_keeps_hf_rope():
    """yarn scales cos/sin by attention_scaling != 1, which the op cannot: RoPE stays HF's (said in the report and a
    warning), the MLPs are fused, results match."""
    yarn = dict(rope_type="yarn", rope_theta=500000.0, factor=4.0, original_max_position_embeddings=8192)
    ref = tiny_llama(rope_parameters=yarn)
    assert ref.model.rotary_emb.attention_scaling != 1.0
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="attention_scaling"):
        report = hf.apply_fused_ops(model)
    assert not report.rope and report.mlp_layers == tuple(range(LAYERS)) and "attention_scaling" in report.notes[0]
    ids = tokens()
    with FusedOpCounter() as ops:
        got = model(ids).logits
    assert ops.calls == {"ffn": LAYERS}
    assert rel_err(got, ref(ids).logits) < 1e-6


def test_projection_wrapped_after_patching_falls_back():
    """A projection hooked (or wrapped, as PEFT does) after patching is honoured: that MLP runs HF's forward."""
    ref, model = patched_pair()
    seen = []
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    ids = tokens()
    with FusedOpCounter() as ops:
        got = model(ids).logits
    assert ops.calls["ffn"] == LAYERS - 1 and len(seen) == 1
    assert rel_err(got, ref(ids).logits) < 1e-6


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_llama_family_models(family):
    cfg_cls, model_cls = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    ref = model_cls(tiny_config(cfg_cls)).double().eval()
    model = copy.deepcopy(ref)
    report = hf.apply_fused_ops(model)
    assert report.model_type == family and report.rope and len(report.mlp_layers) == LAYERS
    ids = tokens()
    with FusedOpCounter() as ops:
        got = model(ids).logits
    assert ops.calls == {"ffn": LAYERS, "rope_fwd_qk": LAYERS}
    assert rel_err(got, ref(ids).logits) < 1e-6
    with pytest.raises(ValueError, match=f"model_type '{family}'"):
        hf.apply_fused_ops_to_llama(copy.deepcopy(ref))


class LoraLikeLinear(nn.Linear):
    """Stands in for a PEFT/quantized nn.Linear subclass whose forward adds to the plain matmul."""


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))


def _last_layer(model, attr, value):
    setattr(model.model.layers[-1].mlp, attr, value)
    return model


BAD_MODELS = {
    "gpt2": (_gpt2, "model_type 'gpt2'"),
    "not_a_model": (lambda: nn.Linear(4, 4), "expected a transformers model"),
    "gelu": (lambda: tiny_llama(hidden_act="gelu"), "SiLU"),
    "mlp_bias": (lambda: tiny_llama(mlp_bias=True), "bias"),
    "gelu_in_last_layer_only": (lambda: _last_layer(tiny_llama(), "act_fn", nn.GELU()), r"layers\[1\].*SiLU"),
    "wrapped_projection": (lambda: _last_layer(tiny_llama(), "down_proj", LoraLikeLinear(448, 128, bias=False,
                                                                                      dtype=torch.float64)),
                           r"layers\[1\]\.mlp\.down_proj is LoraLikeLinear"),
    "hooked_projection": (lambda: _hooked(tiny_llama()), r"layers\[0\]\.mlp\.gate_proj has hooks"),
    "accelerate_like_forward": (lambda: _instance_forward(tiny_llama()), r"layers\[1\]\.mlp has an instance-level"),
    "partial_rotary": (lambda: _partial_rotary(tiny_llama()), "head_dim 16"),
}


def _hooked(model):
    model.model.layers[0].mlp.gate_proj.register_forward_pre_hook(lambda mod, inp: None)
    return model


def _instance_forward(model):
    mlp = model.model.layers[1].mlp  # as accelerate's add_hook_to_module wraps a module's forward
    mlp.forward = functools.partial(type(mlp).forward, mlp)
    return model


def _partial_rotary(model):
    rot = model.model.rotary_emb
    rot.inv_freq = rot.inv_freq[:4].clone()  # rotates 8 of 16 channels: not Llama's RoPE
    return model


def _instance_state(model):
    """Everything a patch could have changed: instance-level forwards, the modeling modules' RoPE functions."""
    forwards = sorted(name for name, mod in model.named_modules() if "forward" in mod.__dict__)
    rope_fns = {name: getattr(mod, "apply_rotary_pos_emb", None) for name, mod in [
        ("llama", transformers.models.llama.modeling_llama)]}
    return forwards, rope_fns


@pytest.mark.parametrize("bad", list(BAD_MODELS))
def test_bad_models_raise_and_change_nothing(bad):
    make, message = BAD_MODELS[bad]
    model = make()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = _instance_state(model)
    with pytest.raises(ValueError, match=message):
        hf.apply_fused_ops(model)
    assert _instance_state(model) == before
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_torch_compile_fullgraph():
    """The patched model traces into one graph (the angles travel as an attribute of cos, which dynamo follows)."""
    ref, model = patched_pair(torch.float32)
    ids = tokens()
    graphs = []

    def backend(gm, example_inputs):  # records dynamo's graph, runs it as traced
        graphs.append(gm)
        return gm.forward

    got = torch.compile(model, backend=backend, fullgraph=True)(ids).logits
    ops = Counter(str(n.target).split(".")[1] for g in graphs for n in g.graph.nodes
                  if n.op == "call_function" and str(n.target).startswith("fused."))
    assert len(graphs) == 1 and ops == {"ffn": LAYERS, "rope_fwd_qk": LAYERS}
    assert rel_err(got, ref(ids).logits) < 1e-6


# ------------------------------------------------------------------------------------------------------------------
# Greedy tokens in float32 and bf16 logits, on one model patched, unpatched and cast: Llama-3-8B's real sizes on the
# GPU (2 layers with its 128256-token vocabulary: about 6 GiB in fp32), the toy config on the CPU.


def check_greedy_and_bf16(cfg, device, prompt_len):
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 comparisons are against exact fp32 matmuls
    layers = cfg.num_hidden_layers
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).eval()  # float32, HF's random init
    ids = torch.randint(2, cfg.vocab_size, (2, 16), device=device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: per-sequence positions in generate
    gen = dict(attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    prompt = torch.randint(2, cfg.vocab_size, (2, prompt_len), device=device)
    with torch.no_grad():
        ref_logits = model(prompt).logits  # the fp32 reference
        ref_tokens = model.generate(ids, **gen)
        hf.apply_fused_ops_to_llama(model)
        with FusedOpCounter() as ops:
            fused_tokens = model.generate(ids, **gen)
        assert ops.calls == {"ffn": 32 * layers, "rope_fwd_qk": 32 * layers}
        assert torch.equal(fused_tokens, ref_tokens)  # 32 greedy tokens in float32
        assert rel_err(model(prompt).logits, ref_logits) < 1e-5

        hf.remove_fused_ops(model)
        rotary = model.model.rotary_emb
        inv_freq = {name: b.clone() for name, b in rotary.named_buffers()}
        model.to(torch.bfloat16)
        for name, b in inv_freq.items():  # as from_pretrained(dtype=bf16) leaves them: fp32 (.to() rounded them)
            setattr(rotary, name, b)
        hf_bf16 = rel_err(model(prompt).logits, ref_logits)
        hf.apply_fused_ops_to_llama(model)
        with FusedOpCounter() as ops:
            fused_bf16 = rel_err(model(prompt).logits, ref_logits)
        assert ops.calls == {"ffn": layers, "rope_fwd_qk": layers}
    # bf16 tolerance: the fused model is as close to the fp32 model as HF's own bf16 model is (both about 1e-2).
    print(f"bf16 logits vs fp32: HF {hf_bf16:.3e}, fused {fused_bf16:.3e}")
    assert fused_bf16 < max(1.25 * hf_bf16, 2e-2), (fused_bf16, hf_bf16)


def test_greedy_and_bf16_tiny_cpu():
    check_greedy_and_bf16(tiny_config(), "cpu", prompt_len=32)


@pytest.mark.gpu
def test_llama3_8b_two_layers_gpu(gpu_device):
    cfg = transformers.LlamaConfig(**dict(LLAMA3_8B, num_hidden_layers=2, bos_token_id=128000, eos_token_id=None,
                                          pad_token_id=0))
    check_greedy_and_bf16(cfg, gpu_device, prompt_len=512)
