"""Generation with the fused causal LM (`fused_ops.models`: FusedCogVLMForCausalLM, GenerationEngine, DecodeCache,
sampling): greedy tokens against the plain-PyTorch reference, the decode step against a full re-forward, sampling,
bad inputs, and on a GPU the CUDA-graph step (bitwise equal to the eager step, no host sync), the RoPE table under
capture and torch.export on CUDA.

The decode steps run `torch.ops.fused.decode_attention` (its CPU path here). CPU tier: tiny configs in float32.
"""
import pytest
import torch

from fused_ops.models import CogVLMConfig, DecodeCache, FusedCogVLM, FusedCogVLMForCausalLM, GenerationEngine, \
    SamplingParams, sample
from generate_support import TINY, ragged_prompts, randomize_
from reference_routed import rel_err

SINGLE = TINY.replace(vision_expert=False, qkv_bias=False)
NEW = 64


@pytest.fixture(scope="module")
def dual():
    lm = randomize_(FusedCogVLMForCausalLM(TINY))
    return lm, lm.to_reference()


def reference_tokens(ref, p, new):
    return ref.generate_greedy(p["input_ids"], p["prompt_lens"], new, vision_mask=p["vision_mask"],
                               inputs_embeds=p["inputs_embeds"], embeds_mask=p["embeds_mask"])


# ------------------------------------------------------------------------------------------------------------------
# against the reference


def test_greedy_tokens_equal_the_reference(dual):
    """A ragged batch (9, 14 and 5 tokens, two with an image span given as embeddings), 64 greedy tokens each: the
    same tokens as the reference decoding each sequence alone, from logits within float32 rounding."""
    lm, ref = dual
    p = ragged_prompts(TINY)
    engine = GenerationEngine(lm, max_batch=4, max_len=14 + NEW)
    tokens, logits = engine.generate(**p, max_new_tokens=NEW, return_logits=True)
    want_tokens, want_logits = reference_tokens(ref, p, NEW)
    assert tokens.shape == (3, NEW) and tokens.dtype == torch.long
    assert torch.equal(tokens, want_tokens), (tokens != want_tokens).nonzero()[:5]
    assert rel_err(logits, want_logits) < 1e-5, rel_err(logits, want_logits)


def test_single_expert_model_generates_like_the_reference():
    lm = randomize_(FusedCogVLMForCausalLM(SINGLE), seed=3)
    p = ragged_prompts(SINGLE, lens=(7, 3), spans=(None, None))
    p.pop("inputs_embeds"), p.pop("embeds_mask")
    tokens = lm.generate(**p, max_new_tokens=16)
    want, _ = lm.to_reference().generate_greedy(p["input_ids"], p["prompt_lens"], 16)
    assert torch.equal(tokens, want)


def test_decode_steps_equal_a_full_reforward(dual):
    """The logits each decode step chose from equal those of one forward over prompt + generated tokens."""
    lm, _ = dual
    p = ragged_prompts(TINY)
    tokens, logits = lm.generate(**p, max_new_tokens=12, return_logits=True)
    for i, n in enumerate(p["prompt_lens"]):
        ids = torch.cat((p["input_ids"][i, :n], tokens[i, :-1]))[None]
        types = torch.zeros_like(ids, dtype=torch.bool)
        embeds = torch.zeros(1, ids.shape[1], TINY.hidden)
        mask = torch.zeros_like(types)
        types[:, :n], embeds[:, :n], mask[:, :n] = p["embeds_mask"][i, :n], p["inputs_embeds"][i, :n], \
            p["vision_mask"][i, :n]
        full = lm(ids, mask, inputs_embeds=embeds, embeds_mask=types)[0, n - 1:]
        assert rel_err(logits[i], full) < 1e-5, (i, rel_err(logits[i], full))


def test_decode_of_several_tokens_per_sequence_at_ragged_lengths():
    """FusedCogVLM.decode with T = 3 new tokens after prefixes of 6 and 2 tokens (positions from the device lengths)
    gives the full forward's outputs at those positions; the lengths advance by 3."""
    model = randomize_(FusedCogVLM(TINY))
    x = torch.randn(2, 9, TINY.hidden)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 1:4] = True
    full = model(x, mask)
    cache = DecodeCache(TINY, 2, 16, dtype=torch.float32)
    model(x[:1, :6], mask[:1, :6], cache=cache.prefill_view(0, 1))
    model(x[1:, :2], mask[1:, :2], cache=cache.prefill_view(1, 2))
    cache.set_lens([6, 2])
    chunk = torch.stack((x[0, 6:9], x[1, 2:5]))
    out = model.decode(chunk, torch.zeros(2, 3, dtype=torch.bool), None, cache)
    assert rel_err(out[0], full[0, 6:9]) < 1e-5 and rel_err(out[1], full[1, 2:5]) < 1e-5
    assert cache.lens.tolist() == [9, 5]


def test_embeddings_only_prompt_and_reuse_of_the_engine(dual):
    """A prompt given as embeddings only generates what its tokens' embeddings would; a second generation on the same
    engine (other lengths, another bucket) starts from a clean state."""
    lm, _ = dual
    p = ragged_prompts(TINY, lens=(6, 4), spans=(None, None))
    engine = GenerationEngine(lm, max_batch=4, max_len=32)
    a = engine.generate(p["input_ids"], prompt_lens=p["prompt_lens"], vision_mask=p["vision_mask"],
                        max_new_tokens=8)
    b = engine.generate(inputs_embeds=lm.embed_tokens(p["input_ids"]).detach(), prompt_lens=p["prompt_lens"],
                        vision_mask=p["vision_mask"], max_new_tokens=8)
    assert torch.equal(a, b)
    q = ragged_prompts(TINY)
    c = engine.generate(**q, max_new_tokens=8)
    again = engine.generate(p["input_ids"], prompt_lens=p["prompt_lens"], vision_mask=p["vision_mask"],
                            max_new_tokens=8)
    assert torch.equal(a, again) and c.shape == (3, 8)
    assert engine.bucket(2) == 2 and engine.bucket(3) == 4


def test_end_of_sequence_pads_what_follows(dual):
    lm, _ = dual
    p = ragged_prompts(TINY)
    free = lm.generate(**p, max_new_tokens=10)
    eos = int(free[0, 3])  # sequence 0 produces it at step 3 (maybe earlier too)
    stop = int((free[0] == eos).nonzero()[0])
    got = lm.generate(**p, max_new_tokens=10, eos_token_id=[eos], pad_token_id=7)
    assert torch.equal(got[0, :stop + 1], free[0, :stop + 1]) and (got[0, stop + 1:] == 7).all()
    for i in (1, 2):  # the others run on until they produce it
        hit = (free[i] == eos).nonzero()
        end = int(hit[0]) + 1 if len(hit) else 10
        assert torch.equal(got[i, :end], free[i, :end])


# ------------------------------------------------------------------------------------------------------------------
# sampling


def test_sampling_follows_the_distribution():
    """The exponential race draws token i with probability softmax(logits / T)_i, restricted to the top-k / top-p
    set and renormalized."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    rows = logits.expand(40000, -1)

    def freq(params):
        return torch.bincount(sample(rows, params, g), minlength=6).double() / rows.shape[0]
    want = (logits / 0.7).softmax(-1).double()
    assert (freq(SamplingParams(0.7)) - want).abs().max() < 0.01
    top2 = want[:2] / want[:2].sum()
    got = freq(SamplingParams(0.7, top_k=2))
    assert got[2:].sum() == 0 and (got[:2] - top2).abs().max() < 0.01
    # top_p 0.8 of softmax(logits): [0.43, 0.26, 0.16, 0.06, ...] -> the first three (0.43 + 0.26 < 0.8)
    p = logits.softmax(-1).double()
    got = freq(SamplingParams(1.0, top_p=0.8))
    assert got[3:].sum() == 0 and (got[:3] - p[:3] / p[:3].sum()).abs().max() < 0.01
    got = freq(SamplingParams(1.0, top_k=4, top_p=0.5))  # top-p over the top-k set: the first two
    assert got[2:].sum() == 0
    assert torch.equal(sample(rows[:3], SamplingParams()), torch.zeros(3, dtype=torch.long))  # greedy


def test_sampled_generation_is_seeded_and_stays_in_the_top_k(dual):
    lm, _ = dual
    p = ragged_prompts(TINY)
    kw = dict(max_new_tokens=16, temperature=1.3, top_k=5, return_logits=True)
    a, logits = lm.generate(**p, seed=11, **kw)
    b, _ = lm.generate(**p, seed=11, **kw)
    c, _ = lm.generate(**p, seed=12, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)
    top = logits.topk(5, dim=-1).indices
    assert (top == a[..., None]).any(-1).all()


# ------------------------------------------------------------------------------------------------------------------
# bad inputs


@pytest.mark.parametrize("case", ["too_long", "mask_shape", "mask_missing", "temperature", "top_p", "top_k",
                                  "top_k_greedy", "prompt_lens", "max_new", "batch", "ids_range", "eos"])
def test_bad_inputs_raise_value_errors(dual, case):
    lm, _ = dual
    p = ragged_prompts(TINY)
    engine = GenerationEngine(lm, max_batch=3, max_len=30)
    kw = dict(p, max_new_tokens=8)
    match = {"too_long": "exceeds the cache", "mask_shape": "vision_mask must be bool", "mask_missing": "vision_mask",
             "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "top_k_greedy": "temperature 0",
             "prompt_lens": "prompt_lens", "max_new": "max_new_tokens", "batch": "max_batch",
             "ids_range": r"\[0, 256\)", "eos": "eos_token_id"}[case]
    if case == "too_long":
        kw["max_new_tokens"] = 17  # 14 + 17 > 30
    elif case == "mask_shape":
        kw["vision_mask"] = p["vision_mask"][:, :-1]
    elif case == "mask_missing":
        kw["vision_mask"] = None
    elif case == "temperature":
        kw["temperature"] = -0.5
    elif case == "top_p":
        kw.update(temperature=1.0, top_p=0.0)
    elif case == "top_k":
        kw.update(temperature=1.0, top_k=1000)
    elif case == "top_k_greedy":
        kw.update(top_k=5)
    elif case == "prompt_lens":
        kw["prompt_lens"] = [9, 15, 5]
    elif case == "max_new":
        kw["max_new_tokens"] = 0
    elif case == "batch":
        q = ragged_prompts(TINY, lens=(3, 3, 3, 3), spans=(None,) * 4)
        kw = dict(q, max_new_tokens=2)
    elif case == "ids_range":
        kw["input_ids"] = p["input_ids"] + 250
    elif case == "eos":
        kw["eos_token_id"] = 256
    with pytest.raises(ValueError, match=match):
        engine.generate(**kw)


def test_prompt_longer_than_the_cache_raises_before_anything_runs(dual):
    lm, _ = dual
    p = ragged_prompts(TINY)
    engine = GenerationEngine(lm, max_batch=3, max_len=12)
    before = [t.clone() for t in engine.cache.k]
    with pytest.raises(ValueError, match="14 tokens plus max_new_tokens=1 exceeds the cache's 12"):
        engine.generate(**p, max_new_tokens=1)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.cache.k))
    with pytest.raises(ValueError, match="positive"):
        GenerationEngine(lm, max_batch=0, max_len=12)


# ------------------------------------------------------------------------------------------------------------------
# the RoPE table under capture (issue 56's bug)


def test_rope_table_never_grows_inside_a_capture(monkeypatch):
    """While a CUDA graph is being captured, the decoder builds a missing table for the call only (never caching a
    table that would live in the graph's pool) and keeps a cached one it reads alive. The capture is simulated here
    (the graph itself: test_graph_capture_keeps_the_rope_table_eager_steps_read, GPU)."""
    model = randomize_(FusedCogVLM(TINY))
    x = torch.randn(1, 1, TINY.hidden)
    mask = torch.zeros(1, 1, dtype=torch.bool)
    want = model(x, mask)
    model._freqs = None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert torch.equal(model(x, mask), want)
    assert model._freqs is None and model._captured_freqs == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    model(x, mask)
    table = model._freqs
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    model(x, mask)
    assert model._freqs is table and model._captured_freqs == [table]


def test_traced_attention_expands_the_key_heads_itself(monkeypatch):
    """The CUDA float32 export fix's code path, taken on the CPU: traced, the GQA attention expands the key heads by
    index_select (no enable_gqa); the program keeps the declared range and gives eager's outputs."""
    from torch.export import Dim
    from fused_ops.models import common
    monkeypatch.setattr(common, "_traced_without_flash", lambda q: torch.compiler.is_compiling())
    model = randomize_(FusedCogVLM(TINY)).eval()
    x, mask = torch.randn(2, 12, TINY.hidden), torch.rand(2, 12) < 0.3
    s = Dim("seq", min=1, max=12288)
    with torch.no_grad():
        ep = torch.export.export(model, (x, mask), dynamic_shapes=({1: s}, {1: s}))
        ops = [str(n.target) for n in ep.graph.nodes]
        assert any("index_select" in o for o in ops), ops
        for n in (1, 40):
            xi, mi = torch.randn(2, n, TINY.hidden), torch.rand(2, n) < 0.3
            assert rel_err(ep.module()(xi, mi), model(xi, mi)) < 1e-6


# ------------------------------------------------------------------------------------------------------------------
# GPU: graphs, sync, export

GPU = TINY.replace(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def gpu_lm(device, config=GPU):
    return randomize_(FusedCogVLMForCausalLM(config, dtype=torch.float32)).to(device, torch.bfloat16)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_k=20, top_p=0.9)], ids=["greedy", "sample"])
def test_graph_steps_are_bitwise_the_eager_steps(gpu_device, sampling):
    lm = gpu_lm(gpu_device)
    p = ragged_prompts(GPU)
    out = {}
    for graphs in (False, True):
        engine = GenerationEngine(lm, max_batch=4, max_len=64, cuda_graphs=graphs)
        out[graphs] = engine.generate(**p, max_new_tokens=24, seed=5, return_logits=True, **sampling)
        assert len(engine._graphs) == int(graphs)
    assert torch.equal(out[True][0], out[False][0])
    assert torch.equal(out[True][1], out[False][1])


def test_generation_loop_never_syncs_the_host(gpu_device):
    """After a first call (which captures the graphs), a whole generate call runs under sync debug mode "error":
    no .item(), no device-to-host copy, no host-side check that waits on the device. Sampling and greedy."""
    lm = gpu_lm(gpu_device)
    p = ragged_prompts(GPU)
    p = {k: (v.to(gpu_device) if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
    engine = GenerationEngine(lm, max_batch=4, max_len=64)
    for sampling in (dict(), dict(temperature=1.0, top_p=0.9)):
        engine.generate(**p, max_new_tokens=8, **sampling)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = engine.generate(**p, max_new_tokens=16, **sampling)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert tokens.shape == (3, 16)


def test_generation_matches_the_reference_on_gpu(gpu_device):
    """bf16 fused generation: each step's logits against the float32 reference re-run on the same tokens."""
    lm = gpu_lm(gpu_device)
    ref = lm.float().to_reference()
    lm = lm.to(torch.bfloat16)
    p = ragged_prompts(GPU)
    tokens, logits = lm.generate(**p, max_new_tokens=16, return_logits=True)
    for i, n in enumerate(p["prompt_lens"]):
        ids = torch.cat((p["input_ids"][i, :n].to(gpu_device), tokens[i, :-1]))[None]
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, :n] = p["vision_mask"][i, :n]
        types = torch.zeros_like(mask)
        types[:, :n] = p["embeds_mask"][i, :n]
        embeds = torch.zeros(1, ids.shape[1], GPU.hidden, device=gpu_device)
        embeds[:, :n] = p["inputs_embeds"][i, :n]
        full = ref(ids, mask, inputs_embeds=embeds, embeds_mask=types)[0, n - 1:]
        assert rel_err(logits[i], full) < 3e-2, (i, rel_err(logits[i], full))


def test_graph_capture_keeps_the_rope_table_eager_steps_read(gpu_device):
    """Issue 56's bug: capturing a decode step (KVCache path) at a length the cached table does not cover grew the
    table inside the graph's pool, and every eager step after it read angles that were no longer there."""
    config = GPU.replace(vocab=16)
    model = randomize_(FusedCogVLM(config, dtype=torch.float32)).to(gpu_device, torch.bfloat16)
    from fused_ops.models import KVCache
    x = torch.randn(1, 1030, config.hidden, device=gpu_device, dtype=torch.bfloat16)
    mask = torch.zeros(1, 1030, dtype=torch.bool, device=gpu_device)
    cache = KVCache(config, 1, 1100, device=gpu_device, dtype=torch.bfloat16)
    model(x[:, :1020], mask[:, :1020], cache=cache)  # the table now covers 1024 positions

    def step():
        cache.length = 1025  # past the cached table: it would grow to 2048
        return model(x[:, 1025:1026], mask[:, 1025:1026], cache=cache)
    before = step().clone()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    model._freqs = model._freqs[:1024]  # as before the warm-up: the capture itself must find the table too short
    with torch.cuda.graph(graph, stream=s):
        captured = step()
    after = step()  # eager, straight after the capture (no replay has filled anything the capture allocated)
    assert torch.equal(after, before), rel_err(after, before)
    for _ in range(3):
        graph.replay()
        assert torch.equal(captured, before)
        assert torch.equal(step(), before)


def test_eager_decode_steps_do_not_run_cudnn_attention(gpu_device):
    """Eager decoding with the KVCache (a key length that changes every step) ran torch's cuDNN attention on the H200,
    which builds a cuDNN graph per new length: about 44 ms of host time per call, 70 ms per token of a 2-layer
    model. Decode calls now leave cuDNN out."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from fused_ops.models import KVCache

    class Ops(TorchDispatchMode):
        seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))
    config = GPU.replace(head_dim=128, heads=4, kv_heads=2, vocab=16)
    model = randomize_(FusedCogVLM(config, dtype=torch.float32)).to(gpu_device, torch.bfloat16)
    x = torch.randn(2, 103, config.hidden, device=gpu_device, dtype=torch.bfloat16)
    mask = torch.zeros(2, 103, dtype=torch.bool, device=gpu_device)
    cache = KVCache(config, 2, 128, device=gpu_device, dtype=torch.bfloat16)
    with torch.no_grad():
        model(x[:, :100], mask[:, :100], cache=cache)
        with Ops() as ops:
            for i in range(100, 103):
                model(x[:, i:i + 1], mask[:, i:i + 1], cache=cache)
    attention = {op for op in ops.seen if "scaled_dot_product" in op}
    assert attention and not any("cudnn" in op for op in attention), attention


def test_export_on_cuda_with_a_dynamic_length(gpu_device):
    """Issue 56: torch.export of a one-layer fused decoder on CUDA (hidden 1024, float32, GQA) with
    Dim("seq", max=12288) failed with "Constraints violated (seq)" (SDPA's CUDA GQA path); it exports, and the
    program gives eager's outputs."""
    from torch.export import Dim
    config = CogVLMConfig(hidden=1024, intermediate=2048, heads=8, kv_heads=2, head_dim=128, layers=1,
                          dtype=torch.float32)
    model = FusedCogVLM(config, device=gpu_device).eval()
    x = torch.randn(2, 16, 1024, device=gpu_device)
    mask = torch.rand(2, 16, device=gpu_device) < 0.3
    b, s = Dim("batch", min=1, max=64), Dim("seq", min=1, max=12288)
    with torch.no_grad():
        ep = torch.export.export(model, (x, mask), dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}))
        for n in (1, 300, 4100):
            xi = torch.randn(1, n, 1024, device=gpu_device)
            mi = torch.rand(1, n, device=gpu_device) < 0.3
            assert rel_err(ep.module()(xi, mi), model(xi, mi)) < 1e-5, n
