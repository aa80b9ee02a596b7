"""ONE loop for cached and uncached generation; it yields a ``StepEvent`` per step.

Cached: step 0 feeds the whole prompt (prefill), each later step feeds one token and reads the
cache. Uncached: every step re-runs the full sequence, as the naive seed code did. Same loop,
same event type, same sampler, so the two modes can be compared token for token.

The loop owns the cache position (``cache.advance``); the clock covers the forward pass and
sampling only, synchronized on CUDA, and stops before any capture or event work.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch

from kvviz.engine.strategy.beam import BeamStream
from kvviz.engine.kvcache.dense import KVCache
from kvviz.engine.kvcache.factory import KINDS as CACHE_KINDS
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.kvcache.paged_cache import DEFAULT_BLOCK_SIZE
from kvviz.engine.kvcache.paged_pool import config_groups
from kvviz.engine.generation.capture import Capture, ForwardCapture, record
from kvviz.engine.generation.diagnose import nonfinite_error
from kvviz.engine.generation.events import EventLog, Run, StepEvent, TopToken
from kvviz.engine.generation.flops import forward_flops
from kvviz.engine.kvcache.kv_spec import KVSpec
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.generation.sampling import SamplingParams, make_generator, sample
from kvviz.engine.strategy.speculative import SpeculativeStream
from kvviz.engine.strategy.dispatch import strategy_stream
from kvviz.engine.generation.request import (
    check_budget, check_flag, check_pool, check_pool_memory, kv_spec, resolve_chat, resolve_prompt, sampling_params,
)
from kvviz.engine.generation.stops import first_stop
from kvviz.errors import KVVizError

MAX_BATCH = 64


@dataclass(frozen=True)
class _Step:
    """What one step measured, handed from the timed loop to the event builder."""

    step: int  # 0 = prefill
    t: int  # tokens in the sequence before this step's sample
    start: int  # first position this forward fed (0 for a prefill or an uncached step)
    ids: list[int]  # the sampled token of every batch row
    logits: torch.Tensor  # (B, V) last-position logits
    latency_ms: float  # forward + sampling


@dataclass
class GenerationStream:
    """Iterate it for StepEvents; ``run`` is the Run so far (partial if iteration stopped).

    The Run grows with the stream: events go into one list that every Run shares (an EventLog
    view), and the text is decoded token by token, so asking for the Run after every token
    costs the same at token 1,000 as at token 1.
    """

    model: LoadedModel
    prompt_rows: list[list[int]]  # (B, N): one row per batch element, equal lengths
    prompt_text: str
    max_new_tokens: int
    use_cache: bool
    cache_kind: str
    params: SamplingParams
    stop: tuple[str, ...]
    capture: Capture
    batch_size: int
    fast: bool = True  # run the model's accelerator (kvviz.fast) where it has one
    kv_block_size: int = DEFAULT_BLOCK_SIZE  # tokens per block of a paged cache
    kv_blocks: int | None = None  # a paged cache's pool (None: every row can reach the context)
    kv: KVSpec | None = None  # a quantized or windowed cache (resolved), replacing the static one
    ignore_eos: bool = False  # run to max_new_tokens through EOS (vLLM's name): timing lessons need N tokens
    events: list[StepEvent] = field(default_factory=list)
    stop_reason: str | None = None
    stop_string: str | None = None
    note: str = ""  # why the loop ended, when it knows (an error)
    cache: KVCache | None = None  # the cache the loop writes, once it started (views read the paged pool)
    _iter: Iterator[StepEvent] | None = None
    _text: str = ""  # row 0's generated text, decoded as tokens arrive
    _stop_at: int | None = None  # where the stop string starts in _text
    _utf8: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def __post_init__(self) -> None:
        tok, row = self.model.tokenizer, self.prompt_rows[0]
        # Prompt tokens as the views show them, computed once per run (never per step).
        self.prompt_tokens = tuple(tok.token_display(i) for i in row)
        self.prompt_bytes = tuple(tok.token_bytes(i) for i in row)

    def __iter__(self) -> Iterator[StepEvent]:
        if self._iter is None:
            self._iter = self._loop()
        return self._iter

    @property
    def engine(self) -> str:
        """"fast" when the accelerator runs the steps, else "readable"."""
        return "fast" if self.fast and self.model.fast is not None else "readable"

    @property
    def cache_label(self) -> str:
        """The cache kind, or what the compressed cache keeps ("int8", "window 64 + 4 sinks")."""
        return self.kv.label() if self.kv is not None and self.kv.active else self.cache_kind

    @property
    def text(self) -> str:
        """Row 0's generated text so far (up to the stop string, once one is hit)."""
        if self._stop_at is not None:
            return self._text[: self._stop_at]
        pending = self._utf8.getstate()[0]  # bytes of a character still waiting for the rest
        return self._text + pending.decode("utf-8", errors="replace") if pending else self._text

    def _add_text(self, ev: StepEvent) -> str:
        """Decode one more token; bytes of an unfinished character wait for the rest."""
        piece = self._utf8.decode(ev.token_bytes) if self.model.has_tokenizer else ev.token_text
        self._text += piece
        return piece

    @property
    def run(self) -> Run:
        m, c = self.model, self.model.config
        run = Run(
            model=m.name, device=str(m.device), dtype=m.dtype_name, use_cache=self.use_cache,
            cache_kind=self.cache_label if self.use_cache else "none", sampling=self.params.describe(),
            prompt_ids=tuple(self.prompt_rows[0]), prompt_text=self.prompt_text,
            max_new_tokens=self.max_new_tokens, batch_size=self.batch_size, events=EventLog(self.events),
            prompt_tokens=self.prompt_tokens, prompt_bytes=self.prompt_bytes, engine=self.engine,
            n_layer=c.n_layer, n_head=c.n_head, n_kv_head=c.kv_heads, head_dim=c.head_dim,
            block_size=c.block_size, layer_kinds=tuple(getattr(c, "layer_types", ())),
        )
        reason = self.stop_reason
        note = self.note
        if reason is None:  # iteration was abandoned: the consumer knows why (a Stop click, a reconnect...)
            reason, note = "stopped", f"stopped after {len(self.events)} tokens"
        return run.finish(reason, self.text, self.stop_string, note)

    def _loop(self) -> Iterator[StepEvent]:
        m = self.model
        cfg, tok, dev = m.config, m.tokenizer, m.device
        # Which step runs: the accelerator (same signature, same maths, flat) or the readable model.
        forward = m.fast.forward if self.engine == "fast" else m.model
        B, N, n_new = self.batch_size, len(self.prompt_rows[0]), self.max_new_tokens
        on_cuda = dev.type == "cuda"
        ref_layers = self.capture.ref_layers(cfg.n_layer)
        want_attn = bool(self.capture.attention_layers(cfg.n_layer))
        # Batch rows run to max_new_tokens together; ignore_eos makes every run the length it asked for.
        eos = tok.eos_token_id if B == 1 and not self.ignore_eos else None
        gen = None if self.params.greedy else make_generator(self.params, dev)
        t_start = time.perf_counter()
        # Inference mode is entered per step, never held across `yield`: a generator suspended
        # inside the context would leak the mode into the consumer, and an abandoned stream,
        # closed later by the garbage collector, would flip it off inside someone else's run.
        with torch.inference_mode():
            # Every token of the run lives in one preallocated buffer: (B, N + n_new).
            tokens = torch.empty((B, N + n_new), dtype=torch.long, device=dev)
            tokens[:, :N] = torch.tensor(self.prompt_rows, dtype=torch.long, device=dev)
            positions = torch.arange(cfg.block_size, device=dev)  # sliced, never reallocated
            cache = make_cache(self.cache_kind, cfg, B, dev, m.dtype, block_size=self.kv_block_size,
                               num_blocks=self.kv_blocks, kv=self.kv) if self.use_cache else None
        self.cache = cache  # the last step's cache state, for views that read it (the paged pool)
        nxt = tokens  # replaced by each step's sampled ids
        for step in range(n_new):
            t = N + step  # tokens in the sequence before this step's sample
            start = 0 if (cache is None or step == 0) else t - 1
            with torch.inference_mode():
                # A cached decode step feeds only the token just sampled.
                inp = nxt.view(B, 1) if start else tokens.narrow(1, 0, t)  # (B, T_in), views
                fc = ForwardCapture(ref_layers, want_attn=want_attn, want_norms=self.capture.kv_norms) \
                    if ref_layers else None
                if cache is not None:
                    cache.plan_step(inp)  # the paged cache claims the step's blocks (and keeps the ids for its hashes)

                if on_cuda:
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                fed = start
                # A full window cache takes one token per forward: a long prompt is fed in pieces.
                while cache is not None and t - fed > (n := cache.max_feed()):
                    forward(tokens.narrow(1, fed, n), positions.narrow(0, fed, n), cache, None, last_only=True)
                    cache.advance(n)
                    fed += n
                if fed != start:
                    inp = tokens.narrow(1, fed, t - fed)
                logits = forward(inp, positions.narrow(0, fed, t - fed), cache, fc, last_only=True)
                logits = logits.select(1, -1)  # (B, V)
                if not self.params.greedy:  # multinomial raises (CPU) or asserts (CUDA) on NaN
                    self._check_finite(logits, step)
                nxt = sample(logits if logits.dtype == torch.float32 else logits.float(), self.params, gen)  # (B,)
                if cache is None:  # recomputing reads the whole sequence back
                    tokens.select(1, t).copy_(nxt)
                ids = nxt.tolist()  # the one host sync per step (also waits for CUDA)
                latency_ms = (time.perf_counter() - t0) * 1000.0
                if self.params.greedy:  # outside the clock: argmax of NaN is a silent token 0
                    self._check_finite(logits, step)

                if cache is not None:
                    cache.advance(t - fed)
                ev = self._event(_Step(step, t, start, ids, logits, latency_ms), cache, fc, t_start)
                del fc, logits  # drop the references before handing control to the consumer
            self.events.append(ev)
            piece = self._add_text(ev)
            yield ev
            if eos is not None and ids[0] == eos:
                self.stop_reason = "eos"
                return
            if self.stop and self._hit_stop(len(piece)):
                self.stop_reason = "stop_string"
                return
        self.stop_reason = "max_new_tokens"

    def _check_finite(self, logits: torch.Tensor, step: int) -> None:
        """End the run with a NonFiniteLogits error (saying where) if ``logits`` hold NaN or inf."""
        if bool(torch.isfinite(logits).all()):
            return
        ids = list(self.prompt_rows[0]) + [e.token_id for e in self.events]
        err = nonfinite_error(self.model.model, logits, ids, step)
        self.stop_reason, self.note = "error", str(err)
        raise err

    def _hit_stop(self, new_chars: int) -> bool:
        """Did this step's text complete a stop string? Only the tail can hold a new match."""
        hit = first_stop(self._text, new_chars, self.stop)
        if hit is not None:
            self._stop_at, self.stop_string = hit
        return hit is not None

    def _event(self, s: _Step, cache: KVCache | None, fc: ForwardCapture | None, t_start: float) -> StepEvent:
        cfg, tok = self.model.config, self.model.tokenizer
        probs = torch.softmax(s.logits.select(0, 0), dim=-1, dtype=torch.float32)  # (V,)
        p, i = torch.topk(probs, min(5, probs.shape[-1]))
        top = tuple(TopToken(a, tok.token_display(a), b) for a, b in zip(i.tolist(), p.tolist()))
        n_in = s.t - s.start
        cached = cache is not None
        # New K/V columns: those written this step (cached), or the newest one when recomputing
        # (the others were recomputed identically, which is the point the no-cache view makes).
        kv_start = s.start if (cached or s.step == 0) else s.t - 1
        got = record(self.capture, fc, cfg, kv_start, s.t)
        return StepEvent(
            step=s.step, phase="prefill" if s.step == 0 else "decode", token_id=s.ids[0],
            token_text=tok.token_display(s.ids[0]), token_bytes=tok.token_bytes(s.ids[0]), position=s.t,
            input_len=n_in, cache_len=cache.held if cached else 0,
            cache_bytes_used=cache.bytes_used if cached else 0,
            cache_layer_bytes=tuple(cache.layer_bytes()) if cached else (),
            cache_bytes_allocated=cache.bytes_allocated if cached else 0,
            cache_bytes_copied=cache.bytes_copied if cached else 0,
            latency_ms=s.latency_ms, flops=forward_flops(cfg, n_in, s.start, 1, self.batch_size),
            elapsed_ms=(time.perf_counter() - t_start) * 1000.0, top=top, token_ids=tuple(s.ids),
            attn=got.attn, attn_layers=got.attn_layers, kv_norms=got.kv_norms, kv_layer=got.kv_layer,
            kv_values=got.kv_values, kv_start=kv_start,
            logits=s.logits[0].float().cpu().numpy() if self.capture.logits else None,
        )


def iter_generate(
    model: LoadedModel,
    prompt: str | None = None,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 64,
    use_cache: bool = True,
    cache_kind: str = "static",
    greedy: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop: Sequence[str] | None = None,
    capture: Capture | None = None,
    batch_size: int = 1,
    fast: bool = True,
    chat: bool = False,
    messages: Sequence[Mapping[str, str]] | None = None,
    parse_special: bool = False,
    kv_block_size: int = DEFAULT_BLOCK_SIZE,
    kv_blocks: int | None = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
    speculative: str | None = None,
    draft_tokens: int = 10,
    ngram: int = 2,
    kv_dtype: str | None = None,
    window: int | None = None,
    sinks: int = 0,
    kv_group_size: int | None = None,
    kv_zero_point: bool = False,
    kv_fp8_scale: str = "tensor",
    kv_positions: str | None = None,
    track_kv_error: bool = False,
    ignore_eos: bool = False,
) -> GenerationStream | BeamStream | SpeculativeStream:
    """Validate the request (before any compute) and return a stream of StepEvents.

    ``chat=True`` wraps ``prompt`` as one user message; ``messages`` gives a whole conversation.
    Either is rendered with the model's own chat template (an instruct model answers, and stops
    at its end-of-turn token, which is its EOS); control-token text typed in a message is encoded
    as text unless ``parse_special=True`` (engine/tokenize/chat_template.py). ``cache_kind="paged"`` takes ``kv_block_size``
    tokens per block and a pool of ``kv_blocks`` blocks (default: enough for every row).

    ``num_beams > 1`` runs beam search (engine/strategy/beam.py; transformers' defaults and meanings for
    length_penalty, early_stopping and num_return_sequences); ``speculative="prompt_lookup"``
    runs speculative decoding with ``draft_tokens`` drafted after an ``ngram`` match
    (engine/strategy/speculative.py). Either one is a different stream with the same interface.

    ``ignore_eos=True`` (vLLM's name) treats the EOS token as any other: the run generates exactly
    ``max_new_tokens`` unless a stop string ends it. Timing lessons use it so a run is the length
    they promise; answers (Generate, Chat) keep stopping at EOS.
    """
    params = sampling_params(greedy, temperature, top_k, top_p, seed)
    ignore_eos = check_flag("ignore_eos", ignore_eos)
    if chat or messages is not None:
        rows, text = resolve_chat(model, prompt, prompt_ids, messages, parse_special)
    else:
        rows, text = resolve_prompt(model, prompt, prompt_ids)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH:
        raise KVVizError(f"batch_size must be between 1 and {MAX_BATCH} (got {batch_size!r})")
    if len(rows) > 1:
        if batch_size not in (1, len(rows)):
            raise KVVizError(f"batch_size {batch_size} does not match the {len(rows)} prompt rows")
        batch_size = len(rows)
    else:
        rows = rows * batch_size  # the same prompt on every row
    check_budget(model, len(rows[0]), max_new_tokens)
    if cache_kind not in CACHE_KINDS:
        raise KVVizError(f"cache_kind must be one of {', '.join(CACHE_KINDS)} (got {cache_kind!r})")
    if cache_kind == "paged" and use_cache:
        check_pool(kv_block_size, kv_blocks, len(rows[0]) + max_new_tokens, config_groups(model.config).count)
        if kv_blocks is not None:
            check_pool_memory(model, kv_block_size, kv_blocks)
    kv = kv_spec(model, kv_dtype, window, sinks, kv_group_size, kv_zero_point, kv_fp8_scale, kv_positions,
                 track_kv_error)
    if kv.active:
        if not use_cache:
            raise KVVizError(f"a {kv.label()} cache needs the KV cache on: without one nothing is stored")
        if cache_kind != "static":
            raise KVVizError(f"a {kv.label()} cache replaces the static cache; it does not combine with {cache_kind!r}")
        if num_beams != 1 or speculative is not None:
            raise KVVizError("quantized and windowed caches run plain decoding only (no beams, no speculation)")
    stops = tuple(s for s in (stop or ()) if s)
    if num_beams != 1 or speculative is not None:
        return strategy_stream(model, rows, text, max_new_tokens, use_cache, cache_kind, params, stops, capture,
                               batch_size, bool(fast), dict(num_beams=num_beams, length_penalty=length_penalty,
                               early_stopping=early_stopping, num_return_sequences=num_return_sequences,
                               speculative=speculative, draft_tokens=draft_tokens, ngram=ngram,
                               kv_block_size=kv_block_size, kv_blocks=kv_blocks, ignore_eos=ignore_eos))
    return GenerationStream(model, rows, text, max_new_tokens, use_cache, cache_kind, params, stops,
                            capture or Capture(), batch_size, bool(fast), kv_block_size, kv_blocks, kv,
                            ignore_eos)


def generate(model: LoadedModel, **kwargs) -> Run:  # type: ignore[no-untyped-def]
    """Run ``iter_generate`` to the end and return the collected Run."""
    stream = iter_generate(model, **kwargs)
    for _ in stream:
        pass
    return stream.run
