"""What a generation emits: one frozen ``StepEvent`` per step, collected into a frozen ``Run``.

The UI and the charts read only these; nothing downstream recomputes what an event carries.
Captures are CPU float16 numpy arrays so a long run stays small in a browser session.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from statistics import median
from typing import TYPE_CHECKING, Any, Iterable, Iterator, overload

import numpy as np

from kvviz.engine.generation.strategy_events import BeamResult, SpecResult

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


@dataclass(frozen=True)
class TopToken:
    token_id: int
    text: str  # display text (``<0xE2>`` for a partial UTF-8 byte)
    prob: float  # under the model's own distribution (softmax of raw logits, temperature 1)


@dataclass(frozen=True)
class StepEvent:
    step: int  # 0 = prefill, then one per decode step
    phase: str  # "prefill" | "decode"
    token_id: int  # the sampled token (batch row 0)
    token_text: str  # its display text
    token_bytes: bytes  # its bytes (what the text is made of; b"" for a model without a tokenizer)
    position: int  # the position the sampled token will occupy
    input_len: int  # tokens fed to this forward pass: N then 1 (cached), t every step (uncached)
    cache_len: int  # tokens held in the KV cache after this step (0 without a cache)
    cache_bytes_used: int  # bytes the filled cache positions occupy
    cache_bytes_allocated: int  # bytes the cache's tensors hold
    cache_bytes_copied: int  # cumulative bytes the cache wrote or copied so far
    latency_ms: float  # forward + sampling (synchronized on CUDA), capture work excluded
    flops: int  # analytic matmul FLOPs of this step's forward (see kvviz.engine.generation.flops)
    elapsed_ms: float  # wall time since the run started, at the end of this step
    top: tuple[TopToken, ...] = ()  # the 5 most likely next tokens
    token_ids: tuple[int, ...] = ()  # the sampled token of every batch row
    # Optional captures (None when not asked for), batch row 0 only, CPU float16:
    attn: np.ndarray | None = None  # (n_cap_layers, n_head, S): newest query row over all keys
    attn_layers: tuple[int, ...] = ()  # which layers `attn` rows belong to
    kv_norms: np.ndarray | None = None  # (n_layer, 2, n_kv_head, T_new): L2 norms of new K/V
    kv_layer: int | None = None  # the layer whose raw values are in `kv_values`
    kv_values: np.ndarray | None = None  # (2, n_kv_head, T_new, head_dim) new K and V of kv_layer
    kv_start: int = 0  # position of the first new K/V column in kv_norms / kv_values
    logits: np.ndarray | None = None  # (V,) float32 last-position logits, tests only
    cache_layer_bytes: tuple[int, ...] = ()  # bytes each layer holds after this step (KVCache.layer_bytes)

    def summary(self) -> dict[str, Any]:
        """The CLI's per-step contract fields."""
        return {
            "step": self.step,
            "phase": self.phase,
            "token_id": self.token_id,
            "position": self.position,
            "input_len": self.input_len,
            "cache_len": self.cache_len,
            "cache_bytes": self.cache_bytes_used,
            "latency_ms": round(self.latency_ms, 4),
        }

    def capture_nbytes(self) -> int:
        arrays = (self.attn, self.kv_norms, self.kv_values, self.logits)
        return sum(a.nbytes for a in arrays if a is not None)


class EventLog(Sequence[StepEvent]):
    """The first ``n`` events of an append-only list, without copying it.

    A stream hands the UI a new Run after every token; sharing the list keeps that O(1), where a
    tuple of all events per token made a long run cost O(T^2). The list only ever grows, so a
    log's view of its first ``n`` events never changes.
    """

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[StepEvent], n: int | None = None) -> None:
        self._items = items
        self._n = len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> StepEvent: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[StepEvent, ...]: ...

    def __getitem__(self, i: int | slice) -> StepEvent | tuple[StepEvent, ...]:
        if isinstance(i, slice):
            return tuple(self._items[: self._n][i])
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("event index out of range")
        return self._items[i]

    def __iter__(self) -> Iterator[StepEvent]:
        return islice(self._items, self._n)  # stops at n even if the stream appends meanwhile

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == self._n and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"EventLog({self._n} events)"


@dataclass(frozen=True)
class Run:
    model: str  # model name as loaded ("default", "random:tiny", a folder name)
    device: str
    dtype: str
    use_cache: bool
    cache_kind: str  # "static" | "concat" | "none"
    sampling: str  # human description of the sampling settings
    prompt_ids: tuple[int, ...]
    prompt_text: str
    max_new_tokens: int
    batch_size: int = 1
    events: Sequence[StepEvent] = ()  # a tuple, or a stream's EventLog
    prompt_tokens: tuple[str, ...] = ()  # display text of each prompt token (row 0)
    prompt_bytes: tuple[bytes, ...] = ()  # the bytes of each prompt token (row 0)
    engine: str = "fast"  # "fast" (kvviz.fast ran the steps) or "readable" (the model's own forward)
    text: str = ""  # generated text (row 0), stop string trimmed
    stop_reason: str | None = None  # None while running
    stop_string: str | None = None
    n_layer: int = 0
    n_head: int = 0
    n_kv_head: int = 0
    head_dim: int = 0
    block_size: int = 0
    layer_kinds: tuple[str, ...] = ()  # "full" or "sliding" per layer (models with layer_types), else ()
    note: str = ""  # e.g. why the run was stopped early
    beams: BeamResult | None = None  # beam search: the returned beams and every step's tree and reorder
    speculation: SpecResult | None = None  # speculative decoding: drafted / accepted / rolled back per forward
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    # --- building (frozen: each returns a new Run) ---
    def finish(self, stop_reason: str, text: str, stop_string: str | None = None, note: str = "") -> "Run":
        return dataclasses.replace(self, stop_reason=stop_reason, text=text, stop_string=stop_string, note=note)

    def upto(self, step: int) -> "Run":
        """The run's events up to ``step`` (for replay).

        Only the events are cut: ``text`` and ``stop_reason`` stay the finished run's, because a
        Run carries no tokenizer; replay views decode the prefix from the events' tokens.
        """
        return dataclasses.replace(self, events=self.events[: step + 1])

    # --- derived figures ---
    @property
    def generated_ids(self) -> list[int]:
        if self.beams is not None and self.beams.sequences:  # events follow row 0, which changes lineage
            return list(self.beams.sequences[0])
        return [e.token_id for e in self.events]

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def answer_text(self) -> str:
        """``text`` without the EOS marker that ended it (``<|im_end|>``): what a reader calls the answer.

        Only a run that stopped at EOS loses its last token's text; the ids and ``stop_reason``
        still say it was there.
        """
        if self.stop_reason != "eos" or not self.events or self.beams is not None:
            return self.text
        last = self.events[-1]
        piece = last.token_bytes.decode("utf-8", errors="replace") if last.token_bytes else last.token_text
        return self.text[: -len(piece)] if piece and self.text.endswith(piece) else self.text

    @property
    def ttft_ms(self) -> float | None:
        return self.events[0].latency_ms if self.events else None

    @property
    def mean_tpot_ms(self) -> float | None:
        dec = [e.latency_ms for e in self.events[1:]]
        return sum(dec) / len(dec) if dec else None

    @property
    def median_tpot_ms(self) -> float | None:
        dec = [e.latency_ms for e in self.events[1:]]
        return median(dec) if dec else None

    @property
    def total_ms(self) -> float:
        return sum(e.latency_ms for e in self.events)

    @property
    def tokens_per_s(self) -> float | None:
        """kvviz's one tokens/s: decode speed, batch x 1000 / mean TPOT in ms (the tour's definition,
        Generate's metric, the sweeps' column). Prefill is left out: its time grows with the prompt,
        not with the tokens generated. A run of one token has no decode step: None."""
        t = self.mean_tpot_ms
        return self.batch_size * 1000.0 / t if t else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The same figure as ``tokens_per_s`` (the name the pages used first)."""
        return self.tokens_per_s

    @property
    def e2e_tokens_per_s(self) -> float | None:
        """End to end: every generated token (all batch rows, the first one included) per second of
        measured forward+sampling time, prefill included. Lower than ``tokens_per_s`` by the prefill."""
        t = self.total_ms
        return len(self.events) * self.batch_size / (t / 1000.0) if t > 0 else None

    @property
    def total_flops(self) -> int:
        return sum(e.flops for e in self.events)

    def capture_nbytes(self) -> int:
        return sum(e.capture_nbytes() for e in self.events)

    def label(self) -> str:
        mode = f"cache ({self.cache_kind})" if self.use_cache else "no cache"
        return f"{self.model} · {mode} · {len(self.events)} tok · {self.sampling}"

    # --- export ---
    def to_dict(self, captures: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "use_cache": self.use_cache,
            "cache_kind": self.cache_kind,
            "engine": self.engine,
            "sampling": self.sampling,
            "batch_size": self.batch_size,
            "prompt_ids": list(self.prompt_ids),
            "prompt_text": self.prompt_text,
            "max_new_tokens": self.max_new_tokens,
            "generated_ids": self.generated_ids,
            "text": self.text,
            "stop_reason": self.stop_reason,
            "stop_string": self.stop_string,
            "ttft_ms": self.ttft_ms,
            "mean_tpot_ms": self.mean_tpot_ms,
            "tokens_per_s": self.tokens_per_s,
            "e2e_tokens_per_s": self.e2e_tokens_per_s,
            "total_flops": self.total_flops,
            "config": {
                "n_layer": self.n_layer,
                "n_head": self.n_head,
                "n_kv_head": self.n_kv_head,
                "head_dim": self.head_dim,
                "block_size": self.block_size,
                "layer_kinds": list(self.layer_kinds),
            },
            "steps": [event_record(e, captures) for e in self.events],
        }
        if self.beams is not None:
            d["beams"] = self.beams.to_dict()
        if self.speculation is not None:
            d["speculation"] = self.speculation.to_dict()
        return d

    def to_json(self, captures: bool = False) -> str:
        return json.dumps(self.to_dict(captures), ensure_ascii=False)


def event_record(e: StepEvent, captures: bool = False) -> dict[str, Any]:
    d = e.summary()
    d.update(
        token_text=e.token_text,
        cache_bytes_allocated=e.cache_bytes_allocated,
        cache_bytes_copied=e.cache_bytes_copied,
        flops=e.flops,
        elapsed_ms=round(e.elapsed_ms, 4),
        top=[{"token_id": t.token_id, "text": t.text, "prob": t.prob} for t in e.top],
    )
    if len(e.token_ids) > 1:
        d["token_ids"] = list(e.token_ids)
    if e.cache_layer_bytes:  # per layer: a sliding layer levels off at its window (Gemma 3)
        d["cache_layer_bytes"] = list(e.cache_layer_bytes)
    if captures:
        for name in ("attn", "kv_norms", "kv_values"):
            arr = getattr(e, name)
            d[name] = None if arr is None else arr.astype(np.float32).round(4).tolist()
        d["attn_layers"] = list(e.attn_layers)
        d["kv_layer"] = e.kv_layer
        d["kv_start"] = e.kv_start
    return d


def to_jsonl(events: Iterable[StepEvent]) -> str:
    return "".join(json.dumps(event_record(e), ensure_ascii=False) + "\n" for e in events)


TABLE_COLUMNS = [
    "step", "phase", "token_id", "token_text", "position", "input_len", "cache_len",
    "cache_bytes_used", "cache_bytes_allocated", "cache_bytes_copied", "latency_ms", "flops", "elapsed_ms",
]


def to_dataframe(run: Run) -> "pd.DataFrame":
    """The per-step table (one row per step), e.g. for CSV export."""
    import pandas as pd

    rows = [{c: getattr(e, c) for c in TABLE_COLUMNS} for e in run.events]
    df = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    df["tokens_per_s"] = run.batch_size * 1000.0 / df["latency_ms"]
    return df
