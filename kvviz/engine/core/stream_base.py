"""What every stream shares: the plain loop (loop.py) and the strategies (beam, speculative) differ
only in their ``_loop``.

One place decodes the text token by token, ends a run at EOS or a stop string, builds each
StepEvent's common fields and the Run. A stream is iterated for StepEvents; ``run`` is the Run so
far (partial if iteration stopped), ``text`` the text so far, ``engine`` which backend runs
the steps (the step driver, engine/core/step.py, runs them).

The Run grows with the stream: events go into one list that every Run shares (an EventLog view),
and the text is decoded token by token, so asking for the Run after every token costs the same at
token 1,000 as at token 1.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from kvviz.engine.core.step import Backend, backend_of, run_step
from kvviz.engine.generation.diagnose import first_nonfinite, nonfinite_error, stage_name
from kvviz.engine.generation.events import EventLog, Run, StepEvent, TopToken
from kvviz.engine.generation.flops import forward_flops
from kvviz.engine.generation.stops import first_stop
from kvviz.engine.generation.valid_request import ValidRequest
from kvviz.engine.kvcache.dense import KVCache
from kvviz.engine.loading.loader import LoadedModel
from kvviz.fast.logits import all_finite, top_probs


@dataclass(frozen=True)
class Emitted:
    """One emitted token as a loop measured it, for ``StreamBase._event``."""

    step: int  # the event's index: 0 = prefill
    ids: list[int]  # the token of every row fed (row 0's is the event's)
    position: int  # where the token goes
    input_len: int  # tokens the forward fed (0: a token a verify forward already paid for)
    start: int  # first position the forward fed
    rows: int  # rows the forward fed (the FLOPs' batch)
    latency_ms: float  # forward + sampling
    logits: torch.Tensor | None  # (V,) row 0's logits: the top-5 (None: no top list)
    n_logits: int = 1  # positions whose logits the forward computed


@dataclass
class StreamBase:
    model: LoadedModel
    req: ValidRequest
    events: list[StepEvent] = field(default_factory=list)
    stop_reason: str | None = None
    stop_string: str | None = None
    note: str = ""  # why the loop ended, when it knows (an error)
    cache: KVCache | None = None  # the cache the loop writes, once it started (views read it)
    _iter: Iterator[StepEvent] | None = None
    _text: str = ""  # row 0's generated text, decoded as tokens arrive
    _stop_at: int | None = None  # where the stop string starts in _text
    _utf8: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    _t_start: float = 0.0

    def __post_init__(self) -> None:
        tok, row = self.model.tokenizer, self.req.rows[0]
        # Prompt tokens as the views show them, computed once per run (never per step).
        self.prompt_tokens = tuple(tok.token_display(i) for i in row)
        self.prompt_bytes = tuple(tok.token_bytes(i) for i in row)

    def __iter__(self) -> Iterator[StepEvent]:
        if self._iter is None:
            self._iter = self._timed()
        return self._iter

    def _timed(self) -> Iterator[StepEvent]:
        self._t_start = time.perf_counter()  # events' elapsed_ms count from the first step
        yield from self._loop()

    def _loop(self) -> Iterator[StepEvent]:  # pragma: no cover - each stream has its own
        raise NotImplementedError

    # The request's values the views and the CLI read off a stream.
    @property
    def prompt_rows(self) -> tuple[tuple[int, ...], ...]:
        return self.req.rows

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.req.rows[0]

    @property
    def prompt_text(self) -> str:
        return self.req.text

    @property
    def max_new_tokens(self) -> int:
        return self.req.max_new_tokens

    @property
    def batch_size(self) -> int:
        return self.req.batch_size

    @property
    def use_cache(self) -> bool:
        return self.req.use_cache

    @property
    def cache_kind(self) -> str:
        return self.req.cache_kind

    @property
    def engine(self) -> Backend:
        """"fast" when the accelerator runs the steps, else "readable" (``run_step``'s backend)."""
        return backend_of(self.model, self.req.fast)

    @property
    def cache_label(self) -> str:
        """The cache kind, or what the compressed cache keeps ("int8", "window 64 + 4 sinks")."""
        kv = self.req.kv
        return kv.label() if kv.active else self.req.cache_kind

    @property
    def text(self) -> str:
        """Row 0's generated text so far (up to the stop string, once one is hit)."""
        if self._stop_at is not None:
            return self._text[: self._stop_at]
        pending = self._utf8.getstate()[0]  # bytes of a character still waiting for the rest
        return self._text + pending.decode("utf-8", errors="replace") if pending else self._text

    def _emit(self, ev: StepEvent) -> int:
        """Record an event and decode its token (an unfinished character's bytes wait for the rest);
        returns how many characters the text grew by."""
        self.events.append(ev)
        piece = self._utf8.decode(ev.token_bytes) if self.model.has_tokenizer else ev.token_text
        self._text += piece
        return len(piece)

    def _ended(self, token_id: int, new_chars: int, eos_ids: tuple[int, ...]) -> bool:
        """Does this token end the run: EOS, or a stop string its text completed? Sets the reason."""
        if token_id in eos_ids:
            self.stop_reason = "eos"
            return True
        if self.req.stop and self._hit_stop(new_chars):
            self.stop_reason = "stop_string"
            return True
        return False

    def settle_end(self) -> str | None:
        """Why the run ended, noting it now if its last event ended it; None while it could go on.

        The loop notes EOS, a stop string or the last allowed token only when asked for the next
        event, so a consumer that stops asking right after the final one (a Stop click while the
        page draws the answer's end token) would otherwise record the run as stopped. Nothing runs.
        """
        if self.stop_reason is not None or not self.events:
            return self.stop_reason
        tok = self.model.tokenizer
        last = self.events[-1]
        eos = self.batch_size == 1 and not self.req.ignore_eos and tok.eos_token_id is not None
        if eos and last.token_id == tok.eos_token_id:
            self.stop_reason = "eos"
        elif self.req.stop and self._hit_stop(len(self._text)):  # an earlier hit would have ended the run
            self.stop_reason = "stop_string"
        elif len(self.events) >= self.max_new_tokens:
            self.stop_reason = "max_new_tokens"
        return self.stop_reason

    def _hit_stop(self, new_chars: int) -> bool:
        """Did the newest text complete a stop string? Only the tail can hold a new match."""
        hit = first_stop(self._text, new_chars, self.req.stop)
        if hit is not None:
            self._stop_at, self.stop_string = hit
        return hit is not None

    def _check_finite(self, logits: torch.Tensor, step: int) -> None:
        """End the run with a NonFiniteLogits error (saying where) if ``logits`` hold NaN or inf."""
        if all_finite(logits):
            return
        ids = (list(self.req.rows[0]) + [e.token_id for e in self.events])[-self.model.config.block_size:]
        # Row 0's sequence so far, once more through the readable model with every module hooked:
        # one uncached forward through the step driver, paid only on this failure path.
        with first_nonfinite(self.model.model) as bad, torch.inference_mode():
            run_step(self.model, None, torch.tensor([ids], dtype=torch.long, device=self.model.device),
                     torch.arange(len(ids), device=self.model.device), backend="readable", last_only=False)
        err = nonfinite_error(self.model.model, logits, stage_name(bad), step)
        self.stop_reason, self.note = "error", str(err)
        raise err

    def _extra(self) -> dict[str, Any]:
        """A strategy's own Run fields (``beams`` or ``speculation``)."""
        return {}

    @property
    def run(self) -> Run:
        m, c, r = self.model, self.model.config, self.req
        run = Run(
            model=m.name, device=str(m.device), dtype=m.dtype_name, use_cache=r.use_cache,
            cache_kind=self.cache_label if r.use_cache else "none", sampling=r.params.describe(),
            prompt_ids=r.rows[0], prompt_text=r.text, max_new_tokens=r.max_new_tokens,
            batch_size=r.batch_size, events=EventLog(self.events),
            prompt_tokens=self.prompt_tokens, prompt_bytes=self.prompt_bytes, engine=self.engine,
            n_layer=c.n_layer, n_head=c.n_head, n_kv_head=c.kv_heads, head_dim=c.head_dim,
            block_size=c.block_size, layer_kinds=tuple(getattr(c, "layer_types", ())), **self._extra(),
        )
        reason, note = self.stop_reason, self.note
        if reason is None:  # iteration was abandoned: the consumer knows why (a Stop click, a reconnect...)
            reason, note = "stopped", f"stopped after {len(self.events)} tokens"
        return run.finish(reason, self.text, self.stop_string, note)

    def _event(self, e: Emitted, cache: KVCache | None, **captured: Any) -> StepEvent:
        """One StepEvent: the token, the cache after the step, the cost; ``captured`` adds what
        the plain loop recorded (attention, K/V, logits)."""
        tok, cfg = self.model.tokenizer, self.model.config
        top: tuple[TopToken, ...] = ()
        if e.logits is not None:
            i, p = top_probs(e.logits, 5)  # (in C: one pass over the vocabulary, not five ops)
            top = tuple(TopToken(a, tok.token_display(a), b) for a, b in zip(i, p))
        tid = e.ids[0]
        return StepEvent(
            step=e.step, phase="prefill" if e.step == 0 else "decode", token_id=tid,
            token_text=tok.token_display(tid), token_bytes=tok.token_bytes(tid), position=e.position,
            input_len=e.input_len, **_cache_fields(cache),
            latency_ms=e.latency_ms,
            flops=forward_flops(cfg, e.input_len, e.start, e.n_logits, e.rows) if e.input_len else 0,
            elapsed_ms=(time.perf_counter() - self._t_start) * 1000.0, top=top, token_ids=tuple(e.ids),
            **captured,
        )


def _cache_fields(cache: KVCache | None) -> dict[str, Any]:
    """A StepEvent's cache fields after the step: positions held, bytes used per layer and in all,
    allocated and copied (zeros without a cache)."""
    if cache is None:
        return dict(cache_len=0, cache_bytes_used=0, cache_layer_bytes=(), cache_bytes_allocated=0,
                    cache_bytes_copied=0)
    return dict(cache_len=cache.held, cache_bytes_used=cache.bytes_used, cache_layer_bytes=tuple(cache.layer_bytes()),
                cache_bytes_allocated=cache.bytes_allocated, cache_bytes_copied=cache.bytes_copied)
