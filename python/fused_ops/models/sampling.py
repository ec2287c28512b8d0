"""Choosing the next token from logits on the device: greedy, or temperature / top-k / top-p sampling, with no host
sync and nothing a CUDA graph cannot capture.

Sampling is the exponential race (equivalent to Gumbel-max): with E_i ~ Exp(1) independent, `argmax_i p_i / E_i` is
token i with probability p_i. The noise is drawn in the step itself from a `torch.Generator` that the caller owns
(on CUDA registered with each captured graph, `CUDAGraph.register_generator_state`: every replay draws fresh numbers
from the generator's Philox stream, and a graph and an eager step at the same generator state draw the same numbers).
`torch.multinomial` would work too, but the race is one elementwise pass and an argmax, with no CDF search.

Sampling parameters are plain host values fixed per generation (they decide which kernels run, so a captured graph
bakes them in: `GenerationEngine` keys its graphs by them).
"""
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SamplingParams", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature: 0 = greedy (argmax; top_k / top_p then must be left at their defaults), else logits / temperature.
    top_k: sample among the k most likely tokens (0 = all). top_p: among the smallest set of most likely tokens
    whose probabilities (after temperature and top_k) sum to at least top_p (1.0 = all). Invalid values raise
    ValueError."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0.0 <= t < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: no top-k), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1: no top-p), got {p!r}")
        if t == 0 and (k != 0 or p != 1.0):
            raise ValueError(f"top_k={k} / top_p={p} need temperature > 0: temperature 0 is greedy")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab: int) -> None:
        if self.top_k > vocab:
            raise ValueError(f"top_k={self.top_k} exceeds the vocabulary ({vocab} tokens)")


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token of each row: logits `[n, vocab]` (any float dtype; sampled in float32) -> int64 `[n]`."""
    if params.greedy:
        return logits.argmax(dim=-1)
    scores = logits.float() / params.temperature
    if params.top_k:
        # the k best, sorted descending: top-p and the race then run over k candidates instead of the vocabulary
        scores, index = scores.topk(params.top_k, dim=-1)
    elif params.top_p < 1.0:
        scores, index = scores.sort(dim=-1, descending=True)
    else:
        index = None
    probs = scores.softmax(dim=-1)
    if params.top_p < 1.0:
        # keep a candidate while the mass before it is below top_p: the most likely one always stays
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    # Exp(1) noise; clamped away from 0 so that a dropped candidate (p = 0) never gives 0 / 0
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    choice = (probs / noise).argmax(dim=-1)
    return choice if index is None else index.gather(-1, choice[:, None]).squeeze(-1)
