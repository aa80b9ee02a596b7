"""Next-token sampling: greedy, temperature, top-k and top-p, with a per-run torch.Generator."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvviz.errors import KVVizError


@dataclass(frozen=True)
class SamplingParams:
    greedy: bool = True  # argmax; ignores the other fields
    temperature: float = 1.0  # divides the logits; < 1 sharpens, > 1 flattens
    top_k: int | None = None  # keep only the k most likely tokens
    top_p: float | None = None  # keep the smallest set whose probability mass reaches p
    seed: int = 0  # seeds the run's own torch.Generator

    def __post_init__(self) -> None:
        problems = []
        if not self.greedy:
            if not (0.0 < self.temperature <= 100.0):
                problems.append(f"temperature must be in (0, 100] (got {self.temperature})")
        if self.top_k is not None and self.top_k < 1:
            problems.append(f"top_k must be at least 1 (got {self.top_k})")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if not (0 <= self.seed < 2**63):
            problems.append(f"seed must be in [0, 2^63) (got {self.seed})")
        if problems:
            raise KVVizError("; ".join(problems))

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_k is not None:
            parts.append(f"top-k={self.top_k}")
        if self.top_p is not None:
            parts.append(f"top-p={self.top_p:g}")
        return ", ".join(parts) + f", seed {self.seed}"


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p on (B, V) float logits; masked entries become -inf."""
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass *before* it already reaches p; the top token always stays.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids, on the logits' device."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filter_logits(logits.float(), params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
