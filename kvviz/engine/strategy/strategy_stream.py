"""What beam search and speculative decoding share: a stream that yields StepEvents and holds its Run.

``iter_generate`` validates a request and hands the resolved prompt to one of these when
``num_beams > 1`` or ``speculative=...``; they quack like ``GenerationStream`` (iterate for events,
``.run``, ``.text``, ``.engine``), so the CLI and the API treat every strategy alike.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from kvviz.engine.kvcache.dense import KVCache
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.generation.events import EventLog, Run, StepEvent, TopToken
from kvviz.engine.generation.flops import forward_flops
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.kvcache.paged_cache import blocks_for
from kvviz.engine.kvcache.paged_pool import config_groups
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.generation.stops import first_stop


@dataclass
class StrategyStream:
    model: LoadedModel
    prompt_ids: list[int]
    prompt_text: str
    max_new_tokens: int
    use_cache: bool
    cache_kind: str
    params: SamplingParams
    stop: tuple[str, ...] = ()
    fast: bool = True
    kv_block_size: int = 16  # a paged cache's tokens per block
    kv_blocks: int | None = None  # a paged cache's pool (None: enough for the run)
    events: list[StepEvent] = field(default_factory=list)
    stop_reason: str | None = None
    stop_string: str | None = None
    note: str = ""
    _iter: Iterator[StepEvent] | None = None
    _text: str = ""
    _stop_at: int | None = None
    _utf8: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    _t_start: float = 0.0

    def __iter__(self) -> Iterator[StepEvent]:
        if self._iter is None:
            self._t_start = time.perf_counter()
            self._iter = self._loop()
        return self._iter

    def _loop(self) -> Iterator[StepEvent]:  # pragma: no cover - each strategy has its own
        raise NotImplementedError

    def _cache(self, rows: int, tokens: int) -> KVCache:
        """The run's cache, any kind; a paged pool gets room for ``rows`` sequences of ``tokens``."""
        m = self.model
        groups = config_groups(m.config).count  # a hybrid model's layer groups each keep a table
        blocks = self.kv_blocks or rows * groups * (blocks_for(tokens, self.kv_block_size) + 1)
        return make_cache(self.cache_kind, m.config, 1, m.device, m.dtype, block_size=self.kv_block_size,
                          num_blocks=blocks)

    @property
    def engine(self) -> str:
        return "fast" if self.fast and self.model.fast is not None else "readable"

    @property
    def forward(self) -> Any:
        """The step that runs: the accelerator (same signature, same maths) or the readable model."""
        return self.model.fast.forward if self.engine == "fast" else self.model.model  # type: ignore[union-attr]

    @property
    def text(self) -> str:
        if self._stop_at is not None:
            return self._text[: self._stop_at]
        pending = self._utf8.getstate()[0]
        return self._text + pending.decode("utf-8", errors="replace") if pending else self._text

    def _add_text(self, ev: StepEvent) -> str:
        piece = self._utf8.decode(ev.token_bytes) if self.model.has_tokenizer else ev.token_text
        self._text += piece
        return piece

    def _hit_stop(self, new_chars: int) -> bool:
        """Did the newest token complete a stop string? (GenerationStream's rule.)"""
        hit = first_stop(self._text, new_chars, self.stop)
        if hit is not None:
            self._stop_at, self.stop_string = hit
        return hit is not None

    def _extra(self) -> dict[str, Any]:
        """The strategy's own Run fields (``beams`` or ``speculation``)."""
        return {}

    @property
    def run(self) -> Run:
        m, c = self.model, self.model.config
        tok = m.tokenizer
        run = Run(
            model=m.name, device=str(m.device), dtype=m.dtype_name, use_cache=self.use_cache,
            cache_kind=self.cache_kind if self.use_cache else "none", sampling=self.params.describe(),
            prompt_ids=tuple(self.prompt_ids), prompt_text=self.prompt_text, max_new_tokens=self.max_new_tokens,
            batch_size=1, events=EventLog(self.events),
            prompt_tokens=tuple(tok.token_display(i) for i in self.prompt_ids),
            prompt_bytes=tuple(tok.token_bytes(i) for i in self.prompt_ids), engine=self.engine,
            n_layer=c.n_layer, n_head=c.n_head, n_kv_head=c.kv_heads, head_dim=c.head_dim,
            block_size=c.block_size, layer_kinds=tuple(getattr(c, "layer_types", ())), **self._extra(),
        )
        reason, note = self.stop_reason, self.note
        if reason is None:
            reason, note = "stopped", f"stopped after {len(self.events)} steps"
        return run.finish(reason, self.text, self.stop_string, note)

    def _event(self, step: int, token_ids: list[int], position: int, input_len: int, start: int, rows: int,
               cache: KVCache | None, latency_ms: float, logits_row: torch.Tensor | None,
               n_logits: int = 1) -> StepEvent:
        """One StepEvent; ``logits_row`` (V,) gives the top-5 (None: no top list)."""
        tok, cfg = self.model.tokenizer, self.model.config
        top: tuple[TopToken, ...] = ()
        if logits_row is not None:
            probs = torch.softmax(logits_row.float(), dim=-1)  # (V,)
            p, i = torch.topk(probs, min(5, probs.shape[-1]))
            top = tuple(TopToken(a, tok.token_display(a), b) for a, b in zip(i.tolist(), p.tolist()))
        tid = token_ids[0]
        return StepEvent(
            step=step, phase="prefill" if step == 0 else "decode", token_id=tid,
            token_text=tok.token_display(tid), token_bytes=tok.token_bytes(tid), position=position,
            input_len=input_len, cache_len=cache.pos if cache is not None else 0,
            cache_bytes_used=cache.bytes_used if cache is not None else 0,
            cache_layer_bytes=tuple(cache.layer_bytes()) if cache is not None else (),
            cache_bytes_allocated=cache.bytes_allocated if cache is not None else 0,
            cache_bytes_copied=cache.bytes_copied if cache is not None else 0,
            latency_ms=latency_ms, flops=forward_flops(cfg, input_len, start, n_logits, rows) if input_len else 0,
            elapsed_ms=(time.perf_counter() - self._t_start) * 1000.0, top=top, token_ids=tuple(token_ids),
        )
