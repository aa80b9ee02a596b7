"""One reading of a server's ``/metrics``: what its KV cache and queues hold, engine by engine.

The text is parsed by ``prometheus_client``'s own parser (never by hand), then each engine's names
are read into one ``Reading``:

==================  ==============================  ==================================  ==========================
what                vLLM (V1)                       SGLang                              llama.cpp server
==================  ==============================  ==================================  ==========================
KV usage (0-1)      kv_cache_usage_perc             token_usage                         kv_cache_usage_ratio
                    (older: gpu_cache_usage_perc)                                       (older builds only)
running / waiting   num_requests_running/_waiting   num_running_reqs / num_queue_reqs   requests_processing/_deferred
prefix queries      prefix_cache_queries_total      prompt_tokens_total                 -
prefix hits         prefix_cache_hits_total         cached_tokens_total                 -
preemptions         num_preemptions_total           num_retractions (if counted)        -
generated tokens    generation_tokens_total         generation_tokens_total             tokens_predicted_total
TTFT, inter-token   time_to_first_token_seconds,    time_to_first_token_seconds,        -
 (histograms)       inter_token_latency_seconds     inter_token_latency_seconds
block size, blocks  cache_config_info's labels      -                                   -
KV tokens in pool   (blocks x block size)           max_total_num_tokens                n_ctx (from /slots)
==================  ==============================  ==================================  ==========================

A value the server does not report is None, never 0: "no preemptions" and "not counted" differ.
Series that differ only by labels (a vLLM with several engines, a model per label) are summed,
except the usage fraction, which is their mean (each engine's pool is its own).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvviz.watch.scrape import ScrapeError

ENGINES = ("vllm", "sglang", "llama.cpp")
_PREFIX = {"vllm": "vllm:", "sglang": "sglang:", "llama.cpp": "llamacpp:"}


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram summed over its series: cumulative bucket counts by upper bound."""

    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), ascending, +Inf last
    count: float
    total: float  # the _sum

    def minus(self, earlier: "Histogram | None") -> "Histogram":
        """The observations made since ``earlier`` (a counter reset: all of these)."""
        if earlier is None or earlier.count > self.count or [b for b, _ in earlier.buckets] != [b for b, _ in self.buckets]:
            return self
        return Histogram(tuple((le, c - e) for (le, c), (_, e) in zip(self.buckets, earlier.buckets)),
                         self.count - earlier.count, self.total - earlier.total)

    def quantile(self, q: float) -> float | None:
        """Prometheus's histogram_quantile: linear within the bucket the rank falls in; the highest
        finite bound when it falls in +Inf; None with no observations."""
        if not self.buckets or self.count <= 0:
            return None
        rank = q * self.buckets[-1][1]
        lower_le, lower_count = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if math.isinf(le):
                    return lower_le
                if c == lower_count:
                    return le
                return lower_le + (le - lower_le) * (rank - lower_count) / (c - lower_count)
            lower_le, lower_count = le, c
        return lower_le


@dataclass(frozen=True)
class Reading:
    """What one scrape of /metrics said (plus /v1/models or /slots where the engine has them)."""

    engine: str
    model: str | None = None
    max_model_len: int | None = None
    kv_cache_usage: float | None = None  # 0-1, as the server defines it (vLLM: blocks in use / all)
    requests_running: float | None = None
    requests_waiting: float | None = None
    prefix_cache_queries: float | None = None  # tokens looked up (counter)
    prefix_cache_hits: float | None = None  # tokens found (counter)
    preemptions: float | None = None  # counter
    generation_tokens: float | None = None  # counter
    prompt_tokens: float | None = None  # counter
    block_size: int | None = None
    num_blocks: int | None = None  # vLLM's KV blocks (cache_config_info num_gpu_blocks)
    kv_tokens_capacity: int | None = None  # what the pool holds in tokens, where the server says it
    kv_tokens_used: float | None = None  # where the server counts it (SGLang, llama.cpp)
    cache_config: dict[str, str] = field(default_factory=dict)  # vLLM's cache_config_info labels
    ttft: Histogram | None = None
    itl: Histogram | None = None
    e2e: Histogram | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("ttft", "itl", "e2e")}
        for name in ("ttft", "itl", "e2e"):
            h = getattr(self, name)
            out[name + "_ms"] = None if h is None else {
                "count": h.count, **{f"p{int(q * 100)}": _ms(h.quantile(q)) for q in (0.5, 0.9, 0.99)}}
        return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], from Prometheus text (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError) as e:
        raise ScrapeError(f"the answer is not Prometheus metrics text ({str(e)[:120]})") from None
    return out


def detect_engine(samples: dict[str, list[tuple[dict[str, str], float]]]) -> str:
    counts = {e: sum(1 for n in samples if n.startswith(p)) for e, p in _PREFIX.items()}
    best = max(counts, key=lambda e: counts[e])
    if counts[best] == 0:
        shown = ", ".join(sorted(samples)[:3]) or "no metrics at all"
        raise ScrapeError(f"these metrics are not vLLM's, SGLang's or llama.cpp's (they start: {shown})")
    return best


class _Samples:
    def __init__(self, samples: dict[str, list[tuple[dict[str, str], float]]], prefix: str) -> None:
        self.s, self.p = samples, prefix

    def total(self, *names: str) -> float | None:
        """The first of ``names`` the server reports, summed over its series."""
        for n in names:
            if self.p + n in self.s:
                return sum(v for _, v in self.s[self.p + n])
        return None

    def mean(self, *names: str) -> float | None:
        for n in names:
            rows = self.s.get(self.p + n)
            if rows:
                return sum(v for _, v in rows) / len(rows)
        return None

    def histogram(self, *names: str) -> Histogram | None:
        for n in names:
            rows = self.s.get(self.p + n + "_bucket")
            if not rows:
                continue
            by_le: dict[float, float] = {}
            for labels, v in rows:
                le = float(labels.get("le", "+Inf"))
                by_le[le] = by_le.get(le, 0.0) + v
            return Histogram(tuple(sorted(by_le.items())), self.total(n + "_count") or 0.0, self.total(n + "_sum") or 0.0)
        return None

    def labels(self, name: str) -> dict[str, str]:
        rows = self.s.get(self.p + name)
        return dict(rows[0][0]) if rows else {}


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "None") else None
    except ValueError:
        return None


def read_metrics(text: str, models: Any = None, slots: Any = None) -> Reading:
    """A Reading from /metrics text, /v1/models' JSON and llama.cpp's /slots JSON (either may be None)."""
    samples = parse_metrics(text)
    engine = detect_engine(samples)
    m = _Samples(samples, _PREFIX[engine])
    model, max_len = _served_model(models)
    if engine == "vllm":
        info = {k: v for k, v in m.labels("cache_config_info").items()}
        block = _int(info.get("block_size"))
        blocks = _int(info.get("num_gpu_blocks")) or _int(info.get("num_cpu_blocks"))
        return Reading(
            engine, model, max_len, m.mean("kv_cache_usage_perc", "gpu_cache_usage_perc"),
            m.total("num_requests_running"), m.total("num_requests_waiting"),
            m.total("prefix_cache_queries_total", "gpu_prefix_cache_queries_total"),
            m.total("prefix_cache_hits_total", "gpu_prefix_cache_hits_total"),
            m.total("num_preemptions_total"), m.total("generation_tokens_total"), m.total("prompt_tokens_total"),
            block, blocks, blocks * block if blocks and block else None, None, info,
            m.histogram("time_to_first_token_seconds"),
            m.histogram("inter_token_latency_seconds", "time_per_output_token_seconds"),
            m.histogram("e2e_request_latency_seconds"))
    if engine == "sglang":
        cap = m.total("max_total_num_tokens")
        return Reading(
            engine, model, max_len, m.mean("token_usage"), m.total("num_running_reqs"), m.total("num_queue_reqs"),
            m.total("prompt_tokens_total"), m.total("cached_tokens_total"),
            m.total("num_retractions_total", "num_retracted_reqs_total"),
            m.total("generation_tokens_total"), m.total("prompt_tokens_total"),
            None, None, int(cap) if cap else None,
            m.total("num_used_tokens"), {},
            m.histogram("time_to_first_token_seconds"), m.histogram("inter_token_latency_seconds"),
            m.histogram("e2e_request_latency_seconds"))
    # llama.cpp: current builds dropped the usage gauge; /slots says each slot's context.
    capacity = None
    if isinstance(slots, list) and slots and all(isinstance(x, dict) for x in slots):
        ctx = [x.get("n_ctx") for x in slots]
        if all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in ctx):
            capacity = sum(ctx)
    usage = m.mean("kv_cache_usage_ratio")
    used = m.total("kv_cache_tokens")
    return Reading(engine, model, max_len, usage, m.total("requests_processing"), m.total("requests_deferred"),
                   None, None, None, m.total("tokens_predicted_total"), m.total("prompt_tokens_total"),
                   None, None, capacity, used)


def _served_model(models: Any) -> tuple[str | None, int | None]:
    """/v1/models' first model id and (vLLM) its max_model_len."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list) or not models["data"]:
        return None, None
    first = models["data"][0]
    if not isinstance(first, dict):
        return None, None
    name = first.get("id") if isinstance(first.get("id"), str) else None
    L = first.get("max_model_len")
    return name, L if isinstance(L, int) and not isinstance(L, bool) and L > 0 else None


@dataclass(frozen=True)
class Rates:
    """What changed between two readings: the live rates the page draws."""

    seconds: float
    prefix_hit_rate: float | None  # hits / queries over the interval (tokens)
    generation_tok_s: float | None
    preemptions: float | None  # in the interval
    ttft: Histogram | None
    itl: Histogram | None


def rates(now: Reading, before: Reading | None, seconds: float) -> Rates:
    """Deltas of the counters between ``before`` and ``now`` (``seconds`` apart). A counter that went
    down (a server restart) gives None for that interval rather than a negative rate."""
    def delta(name: str) -> float | None:
        a, b = getattr(now, name), getattr(before, name) if before is not None else None
        if a is None or b is None or a < b:
            return None
        return a - b

    q, h = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    g = delta("generation_tokens")
    return Rates(seconds, h / q if q and h is not None else None,
                 g / seconds if g is not None and seconds > 0 else None, delta("preemptions"),
                 now.ttft.minus(before.ttft if before else None) if now.ttft else None,
                 now.itl.minus(before.itl if before else None) if now.itl else None)
