"""Next-token sampling: greedy, temperature, top-k and top-p, with a per-run torch.Generator."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvviz.errors import KVVizError


# A smaller temperature is clamped to this one. Both already make the distribution one-hot in
# float32 (the argmax, the limit of sharpening), but 1e-46 *is* 0 in float32, and dividing by it
# would turn the logits into NaN; 1e-30 is a normal float32.
MIN_TEMPERATURE = 1e-30
MAX_TEMPERATURE = 100.0


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked: greedy unless a temperature, top-k or top-p is given.

    ``SamplingParams()`` is greedy; ``SamplingParams(temperature=0.8, top_k=40, seed=1)`` samples.
    ``temperature=0`` means greedy (the limit of sharpening is the argmax). Checked on creation: a
    bad value is a KVVizError naming it. ``ignore_eos`` (vLLM's name and place) treats EOS as any
    other token, so a run generates exactly its max_new_tokens unless a stop string ends it.
    """

    greedy: bool | None = None  # None: greedy unless a temperature, top-k or top-p is given
    temperature: float | None = None  # divides the logits; < 1 sharpens, > 1 flattens (None: 1 when sampling)
    top_k: int | None = None  # keep only the k most likely tokens
    top_p: float | None = None  # keep the smallest set whose probability mass reaches p
    seed: int = 0  # seeds the run's own torch.Generator
    ignore_eos: bool = False  # EOS is an ordinary token: the run goes to max_new_tokens

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # a number first, so "x" is not called out of range
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise KVVizError(f"{name} must be a number (got {_shown(v)})")
        if not isinstance(self.ignore_eos, bool):  # "no" would read as True
            raise KVVizError(f"ignore_eos must be True or False (got {_shown(self.ignore_eos)})")
        if self.greedy is not None and not isinstance(self.greedy, bool):
            raise KVVizError(f"greedy must be True, False or None (got {_shown(self.greedy)})")
        greedy, t = self.greedy, self.temperature
        if t is not None and t == 0 and greedy is not False:
            greedy, t = True, None
        if greedy is None:
            greedy = t is None and self.top_k is None and self.top_p is None
        if greedy and t is not None and t > 0:
            raise KVVizError("choose greedy or a temperature, not both")
        # Resolved once, so equal requests compare equal and ``replace`` round-trips.
        object.__setattr__(self, "greedy", greedy)
        object.__setattr__(self, "temperature", None if greedy else (1.0 if t is None else float(t)))
        problems = []
        if not greedy:
            t = self.temperature
            if not _is_number(t) or not (0.0 < t <= MAX_TEMPERATURE):  # type: ignore[operator]
                problems.append(f"temperature must be in (0, {MAX_TEMPERATURE:g}] (got {t!r})")
        k = self.top_k
        if k is not None and (not _is_int(k) or k < 1):
            problems.append(f"top_k must be an integer >= 1 (got {k!r})")
        p = self.top_p
        if p is not None and (not _is_number(p) or not (0.0 < p <= 1.0)):
            problems.append(f"top_p must be in (0, 1] (got {p!r})")
        if not _is_int(self.seed) or not (0 <= self.seed < 2**63):
            problems.append(f"seed must be an integer in [0, 2^63) (got {self.seed!r})")
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
    logits = logits / max(params.temperature or 1.0, MIN_TEMPERATURE)  # greedy params hold None
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass *before* it already reaches p. The top token always stays,
        # explicitly: a top_p that rounds to 0 in float32 (1e-300) would otherwise drop every token.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids, on the logits' device."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    logits = logits.float()
    # Shift the row maximum to 0 first (the softmax does not change): divided by a small
    # temperature, the others can then only underflow towards -inf, never overflow to +inf,
    # which would turn the probabilities into NaN.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(filter_logits(shifted, params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
