"""Tests of `fused_ops.models`: the CogVLM-style decoder on the fused ops against its plain-PyTorch reference in
CogVLM's style (forward, gradients, KV-cache decoding), the state-dict converter both ways, bad inputs, the routing
shared by every layer, and the grouped-GEMM baseline.

CPU tier: small sizes, float64 (the fused ops' CPU paths compute in float64 for float64), so fused and reference
agree to rounding (1e-10). The grouped-GEMM baseline runs in float32 (torch._grouped_mm has no float64). GPU tier:
bf16 on the kernels against the float64 reference.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fused_ops.models import (COGVLM2_19B, LLAMA3_8B, CogVLMConfig, CogVLMReference, CogVLMReferenceForCausalLM,
                              FusedCogVLM, FusedCogVLMForCausalLM, GroupedMMCogVLM, KVCache, convert_lm_state_dict,
                              convert_state_dict, get_expert_mask)
from reference_routed import rel_err

F64 = torch.float64
SMALL = dict(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, layers=2, rope_theta=10000.0)
DUAL = CogVLMConfig(**SMALL, dtype=F64)
SINGLE = CogVLMConfig(**SMALL, vision_expert=False, qkv_bias=True, dtype=F64)
# q_size (3 * 8 = 24) != hidden, no QKV bias, no final norm, MHA (kv_heads = heads)
ODD = CogVLMConfig(hidden=40, intermediate=56, heads=3, kv_heads=3, head_dim=8, layers=1, qkv_bias=False,
                   final_norm=False, dtype=F64)
CONFIGS = {"dual": DUAL, "single": SINGLE, "odd": ODD}


def randomize_(model, seed=0):
    """Random non-zero parameters: weights ~ U(-1/sqrt(fan_in), ...), norm scales ~ 1 +- 0.3, biases ~ +-0.3."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                v = 1 + 0.3 * (2 * torch.rand(p.shape, generator=g, dtype=F64) - 1)
            elif p.dim() == 1:
                v = 0.3 * (2 * torch.rand(p.shape, generator=g, dtype=F64) - 1)
            else:
                v = (2 * torch.rand(p.shape, generator=g, dtype=F64) - 1) / p.shape[-1] ** 0.5
            p.copy_(v)
    return model


def make_inputs(config, batch=2, seq=11, seed=1, dtype=F64):
    """x [b, s, H] random; mask: an image span per sequence (CogVLM's rule: its last token is a language token)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, config.hidden, generator=g, dtype=F64).to(dtype)
    if not config.vision_expert:
        return x, None
    types = torch.zeros(batch, seq, dtype=torch.long)
    types[0, 1:6] = 1
    types[1, 3:seq - 2] = 1
    return x, get_expert_mask(types)


def models(config):
    fused = randomize_(FusedCogVLM(config))
    return fused, fused.to_reference()


# ------------------------------------------------------------------------------------------------------------------
# fused vs reference


@pytest.mark.parametrize("kind", CONFIGS)
def test_forward_matches_reference(kind):
    fused, ref = models(CONFIGS[kind])
    x, mask = make_inputs(fused.config)
    out, want = fused(x, mask), ref(x, mask)
    assert out.shape == x.shape[:2] + (fused.config.hidden,)
    assert rel_err(out, want) < 1e-12, rel_err(out, want)


@pytest.mark.parametrize("kind", CONFIGS)
def test_gradients_match_reference(kind):
    fused, ref = models(CONFIGS[kind])
    x, mask = make_inputs(fused.config)
    g = torch.randn(x.shape, dtype=F64)
    xf, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    fused(xf, mask).backward(g)
    ref(xr, mask).backward(g)
    assert rel_err(xf.grad, xr.grad) < 1e-12
    grads = {k: p.grad for k, p in fused.named_parameters()}
    assert all(v is not None and v.abs().sum() > 0 for v in grads.values()), "a parameter got no gradient"
    mapped = convert_state_dict(grads, fused.config, to="reference")
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    assert mapped.keys() == ref_grads.keys()
    for k in ref_grads:
        assert rel_err(mapped[k], ref_grads[k]) < 1e-11, k


def test_training_step_lowers_the_loss():
    """A few SGD steps on a fixed target through every op (routed QKV, RoPE, SDPA, routed dense, dual FFN, norms)."""
    fused = randomize_(FusedCogVLM(DUAL))
    x, mask = make_inputs(DUAL)
    target = torch.randn(x.shape, dtype=F64)
    opt = torch.optim.SGD(fused.parameters(), lr=0.05)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = ((fused(x, mask) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.99, losses


# ------------------------------------------------------------------------------------------------------------------
# KV cache


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("kind", ["dual", "single"])
def test_decode_with_cache_matches_full_forward(impl, kind):
    """Prefill 6 tokens, a chunk of 3 (several new tokens after a cached prefix), then 2 single-token steps: each
    output equals the full forward's output at those positions."""
    fused, ref = models(CONFIGS[kind])
    model = fused if impl == "fused" else ref
    x, mask = make_inputs(model.config, seq=11)
    full = model(x, mask)
    cache = KVCache(model.config, batch=2, max_len=16, dtype=F64)
    for a, b in ((0, 6), (6, 9), (9, 10), (10, 11)):
        out = model(x[:, a:b], None if mask is None else mask[:, a:b], cache=cache)
        assert cache.length == b
        assert rel_err(out, full[:, a:b]) < 1e-12, (a, b, rel_err(out, full[:, a:b]))


def test_cache_misuse_raises_and_leaves_the_cache():
    fused, _ = models(DUAL)
    x, mask = make_inputs(DUAL, seq=5)
    cache = KVCache(DUAL, batch=2, max_len=6, dtype=F64)
    fused(x, mask, cache=cache)
    with pytest.raises(ValueError, match="exceeds max_len"):
        fused(x[:, :2], mask[:, :2], cache=cache)
    with pytest.raises(ValueError, match="batch"):
        fused(x[:1, :1], mask[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="float32"):
        fused(x[:, :1].float(), mask[:, :1], cache=cache)
    assert cache.length == 5
    with pytest.raises(ValueError, match="layers"):
        fused(x, mask, cache=KVCache(DUAL.replace(layers=1), batch=2, max_len=8, dtype=F64))


# ------------------------------------------------------------------------------------------------------------------
# converter


@pytest.mark.parametrize("kind", CONFIGS)
def test_converter_round_trips_both_ways(kind):
    fused, ref = models(CONFIGS[kind])
    c = fused.config
    fsd, rsd = fused.state_dict(), ref.state_dict()
    to_ref = convert_state_dict(fsd, c, to="reference")
    assert to_ref.keys() == rsd.keys()
    assert all(torch.equal(to_ref[k], rsd[k]) for k in rsd)
    back = convert_state_dict(to_ref, c, to="fused")
    assert back.keys() == fsd.keys() and all(torch.equal(back[k], fsd[k]) for k in fsd)
    # the reference's names, as CogVLM spells them
    if c.vision_expert:
        assert "layers.0.self_attn.vision_expert_query_key_value.weight" in rsd
        assert f"layers.{c.layers - 1}.mlp.language_mlp.down_proj.weight" in rsd
        assert ("layers.0.self_attn.vision_expert_query_key_value.bias" in rsd) == c.qkv_bias
        assert "layers.0.self_attn.language_expert_query_key_value.bias" not in rsd
    # new tensors: writing to the result leaves the source alone
    k0 = next(iter(to_ref))
    before = fsd[next(iter(fsd))].clone()
    to_ref[k0].add_(1.0)
    assert torch.equal(fsd[next(iter(fsd))], before)
    # from_reference builds the same model (values and outputs)
    again = FusedCogVLM.from_reference(ref)
    assert all(torch.equal(again.state_dict()[k], fsd[k]) for k in fsd)
    x, mask = make_inputs(c)
    assert torch.equal(again(x, mask), fused(x, mask))


def test_converter_keeps_expert_order():
    """Expert 0 of the fused layout is the language expert: a known value in the vision expert lands in [1]."""
    ref = CogVLMReference(DUAL)
    with torch.no_grad():
        ref.layers[0].self_attn.vision_expert_query_key_value.weight.fill_(7.0)
        ref.layers[0].mlp.vision_mlp.up_proj.weight.fill_(3.0)
    sd = convert_state_dict(ref.state_dict(), DUAL, to="fused")
    assert (sd["layers.0.self_attn.query_key_value.weight"][1] == 7).all()
    assert not (sd["layers.0.self_attn.query_key_value.weight"][0] == 7).any()
    assert (sd["layers.0.mlp.w3"][1] == 3).all()


def _mutations(sd):
    """(description, bad state dict, text the error must contain)."""
    k = "layers.1.self_attn.vision_expert_query_key_value.weight"
    missing = {n: v for n, v in sd.items() if n != k}
    extra = dict(sd, **{"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8, dtype=F64)})
    shape = dict(sd, **{"layers.0.mlp.vision_mlp.gate_proj.weight": torch.ones(95, 64, dtype=F64)})
    not_tensor = dict(sd, **{"norm.weight": [1.0] * 64})
    mixed = dict(sd, **{k: sd[k].float()})
    return [("missing", missing, k), ("extra", extra, "rotary_emb.inv_freq"),
            ("shape", shape, "gate_proj.weight has shape [95, 64]"), ("not a tensor", not_tensor, "norm.weight"),
            ("dtype", mixed, "differ in dtype")]


@pytest.mark.parametrize("case", range(5))
def test_bad_state_dict_raises_and_modifies_nothing(case):
    fused, ref = models(DUAL)
    what, bad, needle = _mutations(ref.state_dict())[case]
    snapshot = {k: v.clone() for k, v in fused.state_dict().items()}
    with pytest.raises(ValueError) as info:
        fused.load_reference_state_dict(bad)
    assert needle in str(info.value), (what, str(info.value))
    assert all(torch.equal(fused.state_dict()[k], snapshot[k]) for k in snapshot), "the model was modified"
    with pytest.raises(ValueError, match="state dict does not match"):
        convert_state_dict(bad, DUAL, to="fused")


def test_converter_rejects_other_layouts():
    fused, ref = models(DUAL)
    with pytest.raises(ValueError, match="missing keys"):  # a fused state dict is not a reference one
        convert_state_dict(fused.state_dict(), DUAL, to="fused")
    with pytest.raises(ValueError, match="missing keys"):  # a single-expert config expects other keys
        convert_state_dict(ref.state_dict(), SINGLE, to="fused")
    with pytest.raises(ValueError, match="to must be"):
        convert_state_dict(ref.state_dict(), DUAL, to="hf")
    with pytest.raises(ValueError, match="state dict"):
        convert_state_dict([1, 2], DUAL, to="fused")
    with pytest.raises(ValueError, match="CogVLMConfig"):
        FusedCogVLM.from_reference(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------------------------
# bad inputs


@pytest.mark.parametrize("impl", ["fused", "reference", "grouped"])
def test_bad_masks_raise(impl):
    fused, ref = models(DUAL)
    model = {"fused": fused, "reference": ref}.get(impl)
    if impl == "grouped":
        model = GroupedMMCogVLM(DUAL, dtype=torch.float32)
    x, mask = make_inputs(DUAL, seq=7, dtype=next(model.parameters()).dtype)
    for bad, needle in ((mask[:, :6], r"bool \[2, 7\]"), (mask.T, r"\[7, 2\]"), (mask.float(), "torch.float32"),
                        (mask.reshape(-1), r"\[14\]"), (None, "required")):
        with pytest.raises(ValueError, match=needle):
            model(x, bad)
    with pytest.raises(ValueError, match="x must be"):
        model(x[0], mask)


def test_single_expert_takes_no_mask():
    fused, ref = models(SINGLE)
    x, _ = make_inputs(SINGLE)
    for model in (fused, ref):
        with pytest.raises(ValueError, match="takes no mask"):
            model(x, torch.zeros(x.shape[:2], dtype=torch.bool))


def test_config_checks():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        CogVLMConfig(heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="head_dim"):
        CogVLMConfig(head_dim=7)
    with pytest.raises(ValueError, match="layers"):
        COGVLM2_19B.replace(layers=0)
    assert (COGVLM2_19B.hidden, COGVLM2_19B.intermediate, COGVLM2_19B.heads, COGVLM2_19B.kv_heads,
            COGVLM2_19B.head_dim, COGVLM2_19B.qkv_size) == (4096, 14336, 32, 8, 128, 6144)
    assert LLAMA3_8B.replace(vision_expert=True, qkv_bias=True) == COGVLM2_19B
    with pytest.raises(ValueError, match="visual expert"):
        GroupedMMCogVLM(SINGLE)
    assert COGVLM2_19B.vocab == 128256
    with pytest.raises(ValueError, match="vocab"):
        COGVLM2_19B.replace(vocab=0)


@pytest.mark.parametrize("kind", ["dual", "single"])
def test_causal_lm_converts_both_ways(kind):
    """FusedCogVLMForCausalLM <-> CogVLMReferenceForCausalLM: the decoder's keys under `model.` converted, the
    embedding and LM head copied; equal logits; a wrong LM head raises before anything is built."""
    config = CONFIGS[kind].replace(vocab=40)
    lm = randomize_(FusedCogVLMForCausalLM(config))
    ref = lm.to_reference()
    assert isinstance(ref, CogVLMReferenceForCausalLM)
    back = FusedCogVLMForCausalLM.from_reference(ref)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in lm.state_dict().items())
    ids = torch.randint(0, 40, (2, 7))
    mask = (torch.rand(2, 7) < 0.4) if config.vision_expert else None
    assert rel_err(lm(ids, mask), ref(ids, mask)) < 1e-12
    bad = dict(ref.state_dict(), **{"lm_head.weight": torch.zeros(41, config.hidden, dtype=F64)})
    with pytest.raises(ValueError, match=r"lm_head.weight must be a \[40, "):
        convert_lm_state_dict(bad, config, to="fused")
    with pytest.raises(ValueError, match="unexpected keys: vision_tower.x"):
        convert_lm_state_dict(dict(ref.state_dict(), **{"vision_tower.x": torch.zeros(1)}), config, to="fused")


# ------------------------------------------------------------------------------------------------------------------
# the routing, computed once per forward and shared


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "fused":
            self.calls.append((func.__name__.split(".")[0], args, out))
        return out


def test_one_route_per_forward_shared_by_every_layer():
    """A 2-layer forward and backward: exactly one fused.route, and every routed op of both layers (3 forward, 3
    backward per layer) received that routing tensor itself."""
    fused, _ = models(DUAL)
    x, mask = make_inputs(DUAL)
    x.requires_grad_(True)
    with _OpLog() as log:
        fused(x, mask).sum().backward()
    names = [n for n, _, _ in log.calls]
    assert names.count("route") == 1, names
    routing = next(out for n, _, out in log.calls if n == "route")
    routed = [(n, args) for n, args, _ in log.calls if n in ("linear_dual", "ffn_forward", "linear_dual_backward",
                                                             "ffn_backward")]
    assert sorted(n for n, _ in routed) == sorted(["linear_dual"] * 4 + ["ffn_forward"] * 2
                                                  + ["linear_dual_backward"] * 4 + ["ffn_backward"] * 2), names
    def arg(n, args, name):
        names = [a.name for a in getattr(torch.ops.fused, n).default._schema.arguments]
        return args[names.index(name)] if names.index(name) < len(args) else None

    for n, args in routed:
        assert arg(n, args, "routing") is not None and arg(n, args, "routing").data_ptr() == routing.data_ptr(), n
    # each layer's residual adds happen in the dense projection's and the down projection's epilogues
    assert sum(arg(n, args, "residual") is not None for n, args in routed if n in ("linear_dual", "ffn_forward")) == 4
    assert names.count("rope_fwd_qk") == 2 and names.count("rope_bwd_qk") == 2


# ------------------------------------------------------------------------------------------------------------------
# the grouped-GEMM baseline


def _grouped_mm_cpu_reason():
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        torch._grouped_mm(torch.ones(4, 4), torch.ones(2, 4, 4), offs=torch.tensor([2, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._grouped_mm has no CPU path in torch {torch.__version__}: {e}"
    return None


@pytest.mark.skipif(_grouped_mm_cpu_reason() is not None, reason=str(_grouped_mm_cpu_reason()))
@pytest.mark.parametrize("kind", ["dual", "single"])
def test_export_with_dynamic_batch_and_sequence(kind):
    """One torch.export program of the model serves every batch and length (issue 34): the fused ops in its graph,
    one route for the dual expert, the declared ranges kept, eager's bits at 1, 7, 300 and 1030 tokens."""
    from torch.export import Dim
    config = CONFIGS[kind].replace(dtype=torch.float32)
    model = randomize_(FusedCogVLM(config)).float().eval()
    x, mask = make_inputs(config, batch=2, seq=12, dtype=torch.float32)
    b, s = Dim("batch", min=1, max=64), Dim("seq", min=1, max=4096)
    dims = ({0: b, 1: s}, {0: b, 1: s}) if config.vision_expert else ({0: b, 1: s}, None)
    with torch.no_grad():
        ep = torch.export.export(model, (x, mask), dynamic_shapes=dims)
    targets = [str(n.target) for n in ep.graph.nodes if "fused." in str(n.target)]
    assert targets.count("fused.route.default") == int(config.vision_expert), targets
    assert sorted((int(r.lower), int(r.upper)) for r in ep.range_constraints.values()) == [(1, 64), (1, 4096)]
    for batch, seq in ((1, 1), (1, 7), (3, 300), (1, 1030)):
        xi = torch.randn(batch, seq, config.hidden)
        mi = (torch.rand(batch, seq) < 0.4) if config.vision_expert else None
        with torch.no_grad():
            assert torch.equal(ep.module()(xi, mi), model(xi, mi)), (batch, seq)


def test_grouped_mm_baseline_matches_reference():
    """float32 on the CPU (torch._grouped_mm has no float64) against the float64 reference: forward and gradients."""
    fused, ref = models(DUAL)
    grouped = GroupedMMCogVLM(DUAL, dtype=torch.float32)
    grouped.load_state_dict(fused.state_dict())
    x, mask = make_inputs(DUAL)
    g = torch.randn(x.shape, dtype=F64)
    xg, xr = x.float().requires_grad_(), x.clone().requires_grad_()
    out, want = grouped(xg, mask), ref(xr, mask)
    assert rel_err(out, want) < 2e-6, rel_err(out, want)
    out.backward(g.float())
    want.backward(g)
    assert rel_err(xg.grad, xr.grad) < 2e-6
    mapped = convert_state_dict({k: p.grad for k, p in grouped.named_parameters()}, DUAL, to="reference")
    for k, p in ref.named_parameters():
        assert rel_err(mapped[k], p.grad) < 2e-5, k
    with pytest.raises(ValueError, match="float64"):
        grouped.double()(x, mask)


def test_grouped_mm_baseline_decodes_with_cache():
    if _grouped_mm_cpu_reason() is not None:
        pytest.skip(_grouped_mm_cpu_reason())
    fused, _ = models(DUAL)
    grouped = GroupedMMCogVLM(DUAL, dtype=torch.float32)
    grouped.load_state_dict(fused.state_dict())
    x, mask = make_inputs(DUAL, dtype=torch.float32)
    full = grouped(x, mask)
    cache = KVCache(DUAL, batch=2, max_len=12, dtype=torch.float32)
    grouped(x[:, :10], mask[:, :10], cache=cache)
    assert rel_err(grouped(x[:, 10:], mask[:, 10:], cache=cache), full[:, 10:]) < 1e-5


# ------------------------------------------------------------------------------------------------------------------
# GPU: bf16 on the kernels


GPU_CONFIG = CogVLMConfig(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, layers=2, dtype=F64)


@pytest.mark.parametrize("vision_expert", [True, False], ids=["dual", "single"])
def test_bf16_model_on_gpu_matches_float64_reference(gpu_device, vision_expert):
    """bf16 fused model on the kernels (sizes multiples of 16: the TMA path on sm_90) against the float64
    reference on the same device: outputs, input gradient and every weight gradient, and a decode step."""
    config = GPU_CONFIG.replace(vision_expert=vision_expert)
    ref64 = randomize_(CogVLMReference(config)).to(gpu_device)
    fused = FusedCogVLM.from_reference(ref64).to(torch.bfloat16)
    x, mask = make_inputs(config, batch=2, seq=200)
    x, mask = x.to(gpu_device), None if mask is None else mask.to(gpu_device)
    g = torch.randn(x.shape, dtype=F64, device=gpu_device)
    xb, xr = x.to(torch.bfloat16).requires_grad_(), x.clone().requires_grad_()
    out, want = fused(xb, mask), ref64(xr, mask)
    assert rel_err(out, want) < 1.5e-2, rel_err(out, want)
    out.backward(g.to(torch.bfloat16))
    want.backward(g)
    assert rel_err(xb.grad, xr.grad) < 2e-2
    mapped = convert_state_dict({k: p.grad for k, p in fused.named_parameters()}, config, to="reference")
    for k, p in ref64.named_parameters():
        assert rel_err(mapped[k], p.grad) < 3e-2, (k, rel_err(mapped[k], p.grad))
    with torch.no_grad():
        cache = KVCache(config, batch=2, max_len=200, device=gpu_device, dtype=torch.bfloat16)
        fused(xb[:, :199].detach(), None if mask is None else mask[:, :199], cache=cache)
        last = fused(xb[:, 199:].detach(), None if mask is None else mask[:, 199:], cache=cache)
    assert rel_err(last, want[:, 199:]) < 1.5e-2


def test_grouped_mm_baseline_on_gpu(gpu_device):
    config = GPU_CONFIG
    ref64 = randomize_(CogVLMReference(config)).to(gpu_device)
    grouped = GroupedMMCogVLM(config, device=gpu_device, dtype=torch.bfloat16)
    grouped.load_state_dict(convert_state_dict(ref64.state_dict(), config, to="fused"))
    x, mask = make_inputs(config, batch=2, seq=200)
    x, mask = x.to(gpu_device), mask.to(gpu_device)
    out = grouped(x.to(torch.bfloat16), mask)
    assert rel_err(out, ref64(x, mask)) < 1.5e-2
