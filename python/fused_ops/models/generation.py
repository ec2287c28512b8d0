"""Generation with the fused causal LM: ragged prefill through the fused forward, then one CUDA graph per decode step.

    engine = GenerationEngine(lm, max_batch=16, max_len=8192 + 256)   # a FusedCogVLMForCausalLM
    new = engine.generate(input_ids, prompt_lens=lens, vision_mask=mask, max_new_tokens=128)   # [b, 128] int64
    # (or lm.generate(...), which keeps an engine on the model)

Prompts are right-padded `[b, s]` (ids and/or embeddings, the vision mask), each sequence `prompt_lens[i]` long.

Prefill runs the model's ordinary fused forward (`FusedCogVLM.forward` with a `KVCache` over some rows of the
engine's `DecodeCache`), a few sequences at a time, each group padded to its own longest prompt only. Padding is on
the right, so under causal attention no real token ever sees one; the LM head runs on each sequence's last real
position only. The padding's keys and values land in the cache beyond the sequence's length, where the decode steps
overwrite them before anything can read them (a step attends positions `< lens[b] + 1` only).

Decode steps (`_step`): embed the last token of every sequence, `FusedCogVLM.decode` (RoPE at `cache.lens`,
`torch.ops.fused.decode_attention`, `cache.lens += 1` on the device), LM head, `sampling.sample`, then the
bookkeeping: a finished sequence (one that produced an end-of-sequence token) emits the pad token from then on, and
the token goes into column `step` of the output buffer (`step` a device counter). Everything a step reads or writes
lives in buffers the engine allocated once (tokens, lengths, the output, the cache), so a step's kernels and
arguments are identical at every token, with no host integer that changes and no host sync:

- CUDA: the step is captured once per (batch bucket, sampling parameters) in a `torch.cuda.CUDAGraph` (all layers,
  final norm, LM head and sampling: one graph launch per token) and replayed. A batch runs in the smallest bucket
  that holds it (default buckets 1, 2, 4, ... up to max_batch), the rows above it idle (finished from the start).
  The sampling noise comes from the engine's `torch.Generator` (`rng`, seeded by `generate(seed=...)`), registered
  with every graph, so replays draw fresh numbers and an eager step at the same generator state draws the same ones.
- CPU (or `cuda_graphs=False`): the same step runs eagerly.

Lengths are checked on the host before anything runs (every prompt plus max_new_tokens must fit `max_len`), never
during generation: nothing reads a device value back. RoPE's start-position value check, which would (one sync per
layer), is switched off while `generate` runs (`fused_ops.set_sync_checks`, restored after). The loop always runs
max_new_tokens steps (stopping when every sequence has finished would need a host read); finished sequences are
padded.
"""
import contextlib
import numbers
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..routing import route
from .common import check_prompt_inputs
from .decode_cache import DecodeCache
from .sampling import SamplingParams, sample

__all__ = ["GenerationEngine", "MAX_EOS_TOKENS", "elapsed_ms"]

#: end-of-sequence ids a generation may name (a static buffer: its size is part of the captured graph)
MAX_EOS_TOKENS = 8


@contextlib.contextmanager
def _no_sync_checks():
    """RoPE's value checks of start_positions read device memory (a host sync per call on CUDA): off inside."""
    previous = torch.ops.fused.set_sync_checks(False)
    try:
        yield
    finally:
        torch.ops.fused.set_sync_checks(previous)


def _default_buckets(max_batch: int) -> List[int]:
    buckets, n = [], 1
    while n < max_batch:
        buckets.append(n)
        n *= 2
    return buckets + [max_batch]


class GenerationEngine:
    """Generates with a `FusedCogVLMForCausalLM` (see the module docstring).

    Args:
        lm: the model (eval mode is not required: nothing here depends on it; no gradients are recorded).
        max_batch: sequences per generation, at most.
        max_len: positions per sequence in the cache (prompt + new tokens).
        buckets: the batch sizes a decode graph is captured for (sorted, each <= max_batch; max_batch is added);
            default 1, 2, 4, ... and max_batch.
        cuda_graphs: replay captured graphs (default: True on CUDA); False runs every step eagerly.
        prefill_tokens: prompts are prefilled in groups of consecutive sequences of at most this many (padded)
            tokens (at least one sequence per group).
    Raises RuntimeError when this build of fused_ops has no `decode_attention` op, ValueError for bad arguments.
    """

    def __init__(self, lm, max_batch: int, max_len: int, *, buckets: Optional[Sequence[int]] = None,
                 cuda_graphs: Optional[bool] = None, prefill_tokens: int = 16384):
        if not hasattr(torch.ops.fused, "decode_attention"):
            raise RuntimeError("GenerationEngine needs torch.ops.fused.decode_attention, which this build of "
                               "fused_ops does not have: rebuild and reinstall the package")
        for name, v in (("max_batch", max_batch), ("max_len", max_len), ("prefill_tokens", prefill_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"GenerationEngine: {name} must be a positive int, got {v!r}")
        weight = lm.lm_head.weight
        self.lm, self.config, self.device = lm, lm.config, weight.device
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"GenerationEngine: cuda_graphs=True needs a model on CUDA, it is on {self.device}")
        given = sorted(set(buckets)) if buckets is not None else _default_buckets(max_batch)
        if any(isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= max_batch for n in given):
            raise ValueError(f"GenerationEngine: buckets must be ints in [1, max_batch={max_batch}], got {buckets!r}")
        self.buckets = sorted(set(given) | {max_batch})
        self.max_batch, self.max_len, self.prefill_tokens = max_batch, max_len, prefill_tokens
        self.cache = DecodeCache(self.config, max_batch, max_len, device=self.device, dtype=weight.dtype)

        # The static state every step reads and writes (one allocation each, for the engine's lifetime: a captured
        # graph holds their addresses). A bucket of n rows works on their first n rows.
        f = {"device": self.device}
        self._tokens = torch.zeros(max_batch, dtype=torch.long, **f)        # the token each step feeds
        self._out = torch.zeros(max_batch, max_len, dtype=torch.long, **f)  # generated tokens, column = step
        self._step_index = torch.zeros(1, dtype=torch.long, **f)           # the column the next step writes
        self._finished = torch.zeros(max_batch, dtype=torch.bool, **f)      # produced an end-of-sequence token
        self._eos = torch.full((MAX_EOS_TOKENS,), -1, dtype=torch.long, **f)
        self._pad = torch.zeros((), dtype=torch.long, **f)
        self._logits: Optional[torch.Tensor] = None  # [max_batch, vocab] float32, when a generation keeps them
        # generated tokens are text: the decode steps' vision mask is all False, its routing computed once per bucket
        self._text = torch.zeros(max_batch, 1, dtype=torch.bool, **f) if self.config.vision_expert else None
        self._routing: Dict[int, Optional[torch.Tensor]] = {}
        self._views: Dict[int, DecodeCache] = {}
        self.rng = torch.Generator(device=self.device)
        self.rng.manual_seed(0)
        self._graphs: Dict[Tuple[int, SamplingParams, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def fits(self, batch: int, max_len: int, cuda_graphs: Optional[bool] = None) -> bool:
        """Whether a generation of `batch` sequences needing `max_len` positions can run on this engine."""
        graphs_ok = cuda_graphs is None or bool(cuda_graphs) == self.cuda_graphs
        return batch <= self.max_batch and max_len <= self.max_len and graphs_ok

    def bucket(self, batch: int) -> int:
        """The rows a batch of `batch` sequences decodes in: the smallest bucket that holds it."""
        return next(n for n in self.buckets if n >= batch)

    # --------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: Optional[torch.Tensor] = None, *, max_new_tokens: int,
                 prompt_lens: Optional[Sequence[int]] = None, vision_mask: Optional[torch.Tensor] = None,
                 inputs_embeds: Optional[torch.Tensor] = None, embeds_mask: Optional[torch.Tensor] = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 eos_token_id=None, pad_token_id: int = 0, seed: Optional[int] = None,
                 return_logits: bool = False, timings: Optional[dict] = None):
        """New tokens for a batch of right-padded prompts.

        Args:
            input_ids: int `[b, s]` token ids, and/or inputs_embeds `[b, s, hidden]` (e.g. with the image features
                at the image's positions); with both, `embeds_mask` bool `[b, s]` says which positions take
                inputs_embeds (default: vision_mask). CPU tensors are copied to the model's device.
            max_new_tokens: tokens to generate per sequence (>= 1).
            prompt_lens: each prompt's length (host ints, 1..s; default: all s). Positions beyond are padding.
            vision_mask: bool `[b, s]`, True = the vision expert (models with the visual expert; None without).
            temperature, top_k, top_p: `SamplingParams` (default greedy).
            eos_token_id: an id or a list of at most MAX_EOS_TOKENS ids: a sequence that produces one emits
                pad_token_id afterwards (the loop still runs max_new_tokens steps).
            seed: reseeds the engine's generator (`rng`) first; None continues its stream.
            return_logits: also return the float32 logits each token was chosen from, `[b, max_new_tokens, vocab]`.
            timings: a dict that receives `prefill` and `decode` (start, end) CUDA events (on the CPU, perf_counter
                seconds) and `decode_steps`; read them after synchronizing (`elapsed_ms`).
        Returns int64 `[b, max_new_tokens]` on the model's device (and the logits with return_logits).
        Raises ValueError, before anything runs, for inputs of the wrong shape, dtype or device, prompts that with
        max_new_tokens do not fit the cache (max_len) or a batch above max_batch, and bad sampling parameters.
        """
        owner = "GenerationEngine.generate"
        params = SamplingParams(temperature, top_k, top_p)
        params.check_vocab(self.config.vocab)
        check_prompt_inputs(self.config, input_ids, inputs_embeds, embeds_mask, vision_mask, owner)
        b, s = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        lens = self._check_lengths(prompt_lens, b, s, max_new_tokens, owner)
        eos = self._check_ids(eos_token_id, pad_token_id, owner)
        for t in (input_ids, inputs_embeds, vision_mask, embeds_mask):
            if t is not None and t.device.type not in ("cpu", self.device.type):
                raise ValueError(f"{owner}: inputs must be on the CPU or on the model's {self.device}, got {t.device}")

        def to_device(t):
            return None if t is None else t.to(self.device, non_blocking=True)
        input_ids, inputs_embeds, vision_mask, embeds_mask = map(to_device, (input_ids, inputs_embeds, vision_mask,
                                                                             embeds_mask))
        if seed is not None:
            self.rng.manual_seed(seed)
        n = self.bucket(b)
        clock = _Clock(self.device, timings)
        with _no_sync_checks():
            clock.mark("prefill")
            logits = self._prefill(input_ids, inputs_embeds, embeds_mask, vision_mask, lens)  # [b, vocab]
            self._start(n, b, lens, eos, pad_token_id, return_logits)
            first = torch.zeros(n, dtype=torch.long, device=self.device)
            first[:b] = sample(logits, params, self.rng)
            self._emit(n, first)
            clock.mark("prefill")
            kept = [logits.float()] if return_logits else None
            graph = self._graph(n, params, return_logits) if self.cuda_graphs and max_new_tokens > 1 else None
            clock.mark("decode")
            for _ in range(max_new_tokens - 1):
                if graph is not None:
                    graph.replay()
                else:
                    self._step(n, params, return_logits)
                if kept is not None:
                    kept.append(self._logits[:b].clone())
            clock.mark("decode")
        if timings is not None:
            timings["decode_steps"] = max_new_tokens - 1
        tokens = self._out[:b, :max_new_tokens].clone()
        return (tokens, torch.stack(kept, dim=1)) if return_logits else tokens

    # --------------------------------------------------------------------------------------------------------------
    def _check_lengths(self, prompt_lens, b: int, s: int, max_new_tokens, owner: str) -> List[int]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"{owner}: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if prompt_lens is None:
            lens = [s] * b
        else:
            if isinstance(prompt_lens, torch.Tensor):
                if prompt_lens.device.type != "cpu":  # reading it would sync: lengths are host values
                    raise ValueError(f"{owner}: prompt_lens must be host integers (a list or a CPU tensor), got a "
                                     f"tensor on {prompt_lens.device}")
                prompt_lens = prompt_lens.tolist()
            lens = [int(n) if isinstance(n, numbers.Integral) and not isinstance(n, bool) else n for n in prompt_lens]
            if len(lens) != b or any(not isinstance(n, int) or not 1 <= n <= s for n in lens):
                raise ValueError(f"{owner}: prompt_lens must be {b} ints in [1, {s}] (the prompts' batch and padded "
                                 f"length), got {prompt_lens!r}")
        if b > self.max_batch:
            raise ValueError(f"{owner}: {b} prompts exceed the engine's max_batch={self.max_batch}")
        longest = max(lens)
        if longest + max_new_tokens > self.max_len:
            raise ValueError(f"{owner}: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                             f"cache's {self.max_len} positions (max_len)")
        return lens

    def _check_ids(self, eos_token_id, pad_token_id, owner: str) -> List[int]:
        vocab = self.config.vocab
        eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        if len(eos) > MAX_EOS_TOKENS or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab
                                            for i in eos):
            raise ValueError(f"{owner}: eos_token_id must be an id or at most {MAX_EOS_TOKENS} ids in [0, {vocab}), "
                             f"got {eos_token_id!r}")
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or not 0 <= pad_token_id < vocab:
            raise ValueError(f"{owner}: pad_token_id must be an id in [0, {vocab}), got {pad_token_id!r}")
        return eos

    def _prefill(self, input_ids, inputs_embeds, embeds_mask, vision_mask, lens: List[int]) -> torch.Tensor:
        """Every prompt through the fused forward into the cache; returns the logits of each one's last token."""
        b = len(lens)
        logits = torch.empty(b, self.config.vocab, device=self.device, dtype=self.lm.lm_head.weight.dtype)
        start = 0
        while start < b:
            stop = start + 1  # grow the group while its padded size stays within prefill_tokens
            while stop < b and (stop + 1 - start) * max(lens[start:stop + 1]) <= self.prefill_tokens:
                stop += 1
            width = max(lens[start:stop])

            def rows(t):
                return None if t is None else t[start:stop, :width]
            mask = rows(vision_mask)
            x = self.lm.embed(rows(input_ids), rows(inputs_embeds), rows(embeds_mask), mask)
            h = self.lm.model(x, mask, cache=self.cache.prefill_view(start, stop))  # [g, width, hidden]
            last = torch.tensor([n - 1 for n in lens[start:stop]]).to(self.device, non_blocking=True)
            logits[start:stop] = self.lm.lm_head(h[torch.arange(stop - start, device=self.device), last])
            start = stop
        return logits

    def _start(self, n: int, b: int, lens: List[int], eos: List[int], pad: int, keep_logits: bool) -> None:
        """The static state at the start of a generation in bucket n (device writes only, no sync)."""
        self.cache.lens[:n].zero_()
        self.cache.set_lens(lens)
        self._step_index.zero_()
        self._finished[:n].fill_(False)
        self._finished[b:n].fill_(True)  # idle rows of the bucket emit pad
        self._tokens[:n].fill_(pad)
        self._pad.fill_(pad)
        self._eos.fill_(-1)
        if eos:
            self._eos[:len(eos)].copy_(torch.tensor(eos, dtype=torch.long), non_blocking=True)
        if keep_logits and self._logits is None:
            self._logits = torch.zeros(self.max_batch, self.config.vocab, dtype=torch.float32, device=self.device)
        if n not in self._views:
            self._views[n] = self.cache.rows(n)
            self._routing[n] = route(self._text[:n]) if self._text is not None else None

    def _emit(self, n: int, token: torch.Tensor) -> None:
        """Records the chosen tokens `[n]` of a step: pad after an end-of-sequence, column `step` of the output,
        the next step's input; advances `step`."""
        finished = self._finished[:n]
        token = torch.where(finished, self._pad, token)
        finished.logical_or_((token[:, None] == self._eos).any(dim=-1))
        self._out[:n].index_copy_(1, self._step_index, token[:, None])
        self._tokens[:n].copy_(token)
        self._step_index.add_(1)

    def _step(self, n: int, params: SamplingParams, keep_logits: bool) -> None:
        """One decode step of bucket n: what a CUDA graph captures (see the module docstring)."""
        x = self.lm.embed_tokens(self._tokens[:n]).unsqueeze(1)  # [n, 1, hidden]
        text = self._text[:n] if self._text is not None else None
        h = self.lm.model.decode(x, text, self._routing[n], self._views[n])
        logits = self.lm.lm_head(h[:, 0])  # [n, vocab]
        if keep_logits:
            self._logits[:n].copy_(logits)
        self._emit(n, sample(logits, params, self.rng))

    def _graph(self, n: int, params: SamplingParams, keep_logits: bool) -> torch.cuda.CUDAGraph:
        key = (n, params, keep_logits)
        if key not in self._graphs:
            self._graphs[key] = self._capture(n, params, keep_logits)
        return self._graphs[key]

    def _capture(self, n: int, params: SamplingParams, keep_logits: bool) -> torch.cuda.CUDAGraph:
        """Captures `_step(n, ...)`. One eager step first, on the capture's stream (it loads every kernel and
        allocates cuBLAS' workspace, neither of which may happen inside a capture); the state it advanced is then
        put back, so the capture leaves the generation where it found it."""
        state = [self.cache.lens[:n], self._step_index, self._finished[:n], self._tokens[:n]]
        saved = [t.clone() for t in state]
        rng_state = self.rng.get_state()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step(n, params, keep_logits)
            for t, v in zip(state, saved):
                t.copy_(v)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.rng.set_state(rng_state)
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self.rng)  # replays draw from (and advance) the engine's generator
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool for all of this engine's graphs
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self._step(n, params, keep_logits)
        return graph


class _Clock:
    """Marks of `generate`'s phases: CUDA events (no sync) or perf_counter on the CPU; nothing without timings."""

    def __init__(self, device: torch.device, timings: Optional[dict]):
        self.cuda, self.timings, self.marks = device.type == "cuda", timings, {}

    def mark(self, phase: str) -> None:
        if self.timings is None:
            return
        if self.cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        marks = self.marks.setdefault(phase, [])
        marks.append(mark)
        if len(marks) == 2:
            self.timings[phase] = tuple(marks)


def elapsed_ms(timings: dict, phase: str) -> float:
    """Milliseconds between the two marks of `phase` in a `generate(timings=...)` dict (after a synchronize)."""
    start, end = timings[phase]
    if isinstance(start, float):
        return (end - start) * 1e3
    return start.elapsed_time(end)
