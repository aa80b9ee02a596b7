"""Sizing vLLM from a length distribution instead of everyone at max_model_len.

Given the prompt + output lengths of real requests (a CSV of lengths, or percentiles), each request of
T tokens takes, in every KV-cache group, the blocks vLLM's spec charges for T (full: ceil(T / block);
sliding: ceil(min(W - 1 + batched, T) / block) + 1; chunked: ceil(min(C + batched, T) / block)), so
the pool of ``num_blocks`` holds num_blocks / mean(blocks per request) such requests at once. The
unfilled tail of each request's last block (per group) is counted as waste. Against that,
"Maximum concurrency" sizes every request at max_model_len.

Percentiles are read as a piecewise-linear quantile function (0th percentile = 1 token unless
given, 100th = the largest given); a CSV is taken as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvviz.calculator.server_vllm import VLLMSizing, _request_blocks
from kvviz.calculator.spec import CalcError

MAX_LENGTHS = 1_000_000  # rows of a CSV
QUANTILE_POINTS = 1000


@dataclass(frozen=True)
class LengthMix:
    requests: int  # lengths in the sample
    mean_tokens: float
    mean_blocks: float  # per request, all groups
    concurrent_requests: float  # num_blocks / mean_blocks
    max_len_concurrency: float  # vLLM's line: every request at max_model_len
    waste_share: float  # of the blocks held, the share no token fills (last-block tails)
    too_long: int  # lengths above max_model_len (vLLM rejects them)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "mean_tokens": self.mean_tokens, "mean_blocks_per_request": self.mean_blocks,
                "concurrent_requests": self.concurrent_requests, "max_len_concurrency": self.max_len_concurrency,
                "ratio_to_max_len_sizing": self.concurrent_requests / self.max_len_concurrency
                if self.max_len_concurrency else None,
                "last_block_waste_share": self.waste_share, "longer_than_max_model_len": self.too_long}

    def text(self) -> str:
        return (f"length mix ({self.requests:,} requests, mean {self.mean_tokens:,.0f} tokens): "
                f"{self.mean_blocks:,.1f} blocks a request -> {self.concurrent_requests:,.1f} requests at once vs "
                f"{self.max_len_concurrency:,.2f} at max_model_len "
                f"({self.concurrent_requests / self.max_len_concurrency:,.1f}x); "
                f"last-block waste {self.waste_share:.2%} of the blocks held"
                + (f"; {self.too_long:,} longer than max_model_len (rejected)" if self.too_long else ""))


def parse_lengths_csv(text: str) -> list[int]:
    """Lengths from CSV text: one number per row, or a header with a 'length' / 'tokens' column, or
    'prompt_tokens' and 'output_tokens' columns summed. Problems name the row."""
    rows = [r for r in text.splitlines() if r.strip()]
    if not rows:
        raise CalcError(["the lengths file is empty"])
    if len(rows) > MAX_LENGTHS + 1:
        raise CalcError([f"at most {MAX_LENGTHS:,} lengths, got {len(rows):,} rows"])
    head = [c.strip().lower() for c in rows[0].split(",")]
    has_header = not _is_number(head[0])
    cols = [0]
    if has_header:
        for names in (("length",), ("tokens",), ("prompt_tokens", "output_tokens")):
            if all(n in head for n in names):
                cols = [head.index(n) for n in names]
                break
        else:
            raise CalcError([f"the header {rows[0][:80]!r} has no 'length', 'tokens' or 'prompt_tokens' + "
                             "'output_tokens' column"])
        rows = rows[1:]
    out = []
    for i, r in enumerate(rows, start=2 if has_header else 1):
        cells = r.split(",")
        try:
            v = sum(int(float(cells[c])) for c in cols)
        except (ValueError, IndexError, OverflowError):
            raise CalcError([f"row {i}: {r[:60]!r} is not a length"]) from None
        if v < 1:
            raise CalcError([f"row {i}: a request has at least one token (got {v})"])
        out.append(v)
    if not out:
        raise CalcError(["the lengths file has a header but no rows"])
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def parse_percentiles(text: str) -> list[tuple[float, int]]:
    """'50:2000,90:8000,99:16000' -> [(50.0, 2000), ...], increasing in both."""
    out: list[tuple[float, int]] = []
    for part in text.split(","):
        if not part.strip():
            continue
        p, sep, v = part.partition(":")
        try:
            pct, val = float(p), int(v.replace("_", ""))
        except ValueError:
            raise CalcError([f"{part.strip()!r} is not PERCENTILE:TOKENS (e.g. 90:8000)"]) from None
        if not sep or not 0 <= pct <= 100 or val < 1:
            raise CalcError([f"{part.strip()!r}: the percentile must be 0-100 and the tokens positive"])
        out.append((pct, val))
    out.sort()
    if not out:
        raise CalcError(["no percentiles given (e.g. 50:2000,90:8000,99:16000)"])
    if any(b[1] < a[1] for a, b in zip(out, out[1:])) or len({p for p, _ in out}) != len(out):
        raise CalcError(["the lengths must not decrease as the percentile grows, one length per percentile"])
    return out


def lengths_from_percentiles(points: Sequence[tuple[float, int]], n: int = QUANTILE_POINTS) -> list[int]:
    """n lengths at evenly spaced quantiles of the piecewise-linear quantile function."""
    pts = list(points)
    if pts[0][0] > 0:
        pts.insert(0, (0.0, min(1, pts[0][1])))
    if pts[-1][0] < 100:
        pts.append((100.0, pts[-1][1]))
    out = []
    for i in range(n):
        q = (i + 0.5) * 100 / n
        for (p0, v0), (p1, v1) in zip(pts, pts[1:]):
            if p0 <= q <= p1:
                out.append(max(1, round(v0 + (v1 - v0) * (q - p0) / (p1 - p0 or 1))))
                break
    return out


def length_mix(v: VLLMSizing, lengths: Sequence[int]) -> LengthMix:
    """How many requests of these lengths vLLM's pool holds at once (see the module doc)."""
    if not lengths:
        raise CalcError(["no lengths"])
    s, bs = v.settings, v.settings.block_size
    keys = [((g.kind, g.span), g.block_size or bs) for g in v.groups]
    total_blocks = filled = slots = 0
    too_long = 0
    for t in lengths:
        if t > s.max_model_len:
            too_long += 1
        t = min(t, s.max_model_len)
        for k, block in keys:
            b = _request_blocks(k, s, t, block)
            total_blocks += b
            slots += b * block  # a rescaled group's block holds more tokens
            # tokens resident: all of them in a full group; the window (+ a step's batch) in a sliding one
            kept = (k[1] or 0) - (k[0] == "sliding") + s.max_num_batched_tokens
            filled += t if k[0] in ("full", "mla") else min(t, kept)
    n = len(lengths)
    mean_blocks = total_blocks / n
    waste = 1 - filled / slots if slots else 0.0
    return LengthMix(n, sum(lengths) / n, mean_blocks, v.num_blocks / mean_blocks, v.max_concurrency, waste, too_long)
