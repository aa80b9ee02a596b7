"""ONE loop for cached and uncached generation; it yields a ``StepEvent`` per step.

Cached: step 0 feeds the whole prompt (prefill), each later step feeds one token and reads the
cache. Uncached: every step re-runs the full sequence, as the naive seed code did. Same loop,
same event type, same sampler, so the two modes can be compared token for token.

Each step runs through the step driver (``engine/core/step.py``: plan, forward, commit); the loop
never calls a forward itself. The clock covers that step and sampling only, synchronized on CUDA,
and stops before any capture or event work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from kvviz.engine.core.step import run_pieces
from kvviz.engine.generation.capture import Capture, ForwardCapture, record
from kvviz.engine.generation.events import StepEvent
from kvviz.engine.core.stream_base import Emitted, StreamBase
from kvviz.fast.logits import argmax
from kvviz.engine.generation.sampling import make_generator, sample
from kvviz.engine.kvcache.factory import make_cache


@dataclass
class GenerationStream(StreamBase):
    """The plain loop: iterate it for StepEvents; ``run`` is the Run so far (StreamBase).

    ``capture`` starts as the request's and may be replaced before the first step (the live view
    plans it once it knows the prompt's length).
    """

    capture: Capture = field(default_factory=Capture)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.capture = self.req.capture

    def _loop(self) -> Iterator[StepEvent]:
        m, r = self.model, self.req
        cfg, tok, dev = m.config, m.tokenizer, m.device
        backend = self.engine  # the accelerator (same signature, same maths, flat) or the readable model
        B, N, n_new = r.batch_size, len(r.rows[0]), r.max_new_tokens
        on_cuda = dev.type == "cuda"
        ref_layers = self.capture.ref_layers(cfg.n_layer)
        want_attn = bool(self.capture.attention_layers(cfg.n_layer))
        # Batch rows run to max_new_tokens together; ignore_eos makes every run the length it asked for.
        eos_ids = (tok.eos_token_id,) if B == 1 and not r.ignore_eos and tok.eos_token_id is not None else ()
        gen = None if r.params.greedy else make_generator(r.params, dev)
        # Inference mode is entered per step, never held across `yield`: a generator suspended
        # inside the context would leak the mode into the consumer, and an abandoned stream,
        # closed later by the garbage collector, would flip it off inside someone else's run.
        with torch.inference_mode():
            # Every token of the run lives in one preallocated buffer: (B, N + n_new).
            tokens = torch.empty((B, N + n_new), dtype=torch.long, device=dev)
            tokens[:, :N] = torch.tensor(r.rows, dtype=torch.long, device=dev)
            positions = torch.arange(cfg.block_size, device=dev)  # sliced, never reallocated
            cache = make_cache(r.cache_kind, cfg, B, dev, m.dtype, block_size=r.kv_block_size,
                               num_blocks=r.kv_blocks, kv=r.kv) if r.use_cache else None
        self.cache = cache  # the last step's cache state, for views that read it (the paged pool)
        nxt = tokens  # replaced by each step's sampled ids
        for step in range(n_new):
            t = N + step  # tokens in the sequence before this step's sample
            start = 0 if (cache is None or step == 0) else t - 1
            with torch.inference_mode():
                # A cached decode step feeds only the token just sampled.
                inp = nxt.view(B, 1) if start else tokens.narrow(1, 0, t)  # (B, T_in), views
                fc = ForwardCapture(ref_layers, want_attn=want_attn, want_norms=self.capture.kv_norms,
                                    kv_layer=self.capture.kv_layer) if ref_layers else None
                if on_cuda:
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                # Plan (the paged cache claims the step's blocks and keeps the ids for its hashes),
                # forward, commit; a full window cache takes one token per forward, so a long
                # prompt goes in committed pieces.
                logits = run_pieces(m, cache, inp, positions.narrow(0, start, t - start), backend=backend,
                                    capture=fc, last_only=True)
                logits = logits.select(1, -1)  # (B, V)
                if not r.params.greedy:  # multinomial raises (CPU) or asserts (CUDA) on NaN
                    self._check_finite(logits, step)
                if r.params.greedy:  # torch.argmax's ids, in C for CPU fp32 rows (fast/logits.py)
                    nxt = argmax(logits)  # (B,)
                else:
                    nxt = sample(logits if logits.dtype == torch.float32 else logits.float(), r.params, gen)  # (B,)
                if cache is None:  # recomputing reads the whole sequence back
                    tokens.select(1, t).copy_(nxt)
                ids = nxt.tolist()  # the one host sync per step (also waits for CUDA)
                latency_ms = (time.perf_counter() - t0) * 1000.0
                if r.params.greedy:  # outside the clock: argmax of NaN is a silent token 0
                    self._check_finite(logits, step)

                ev = self._plain_event(step, t, start, ids, logits, latency_ms, fc)
                del fc, logits  # drop the references before handing control to the consumer
            new_chars = self._emit(ev)
            yield ev
            if self._ended(ids[0], new_chars, eos_ids):
                return
        self.stop_reason = "max_new_tokens"

    def _plain_event(self, step: int, t: int, start: int, ids: list[int], logits: torch.Tensor, latency_ms: float,
                     fc: ForwardCapture | None) -> StepEvent:
        """The step's StepEvent with what the capture recorded. ``t``: tokens before this step's
        sample; ``logits``: (B, V), the last position of every row."""
        cached = self.cache is not None
        # New K/V columns: those written this step (cached), or the newest one when recomputing
        # (the others were recomputed identically, which is the point the no-cache view makes).
        kv_start = start if (cached or step == 0) else t - 1
        got = record(self.capture, fc, self.model.config, kv_start, t)
        e = Emitted(step=step, ids=ids, position=t, input_len=t - start, start=start, rows=self.req.batch_size,
                    latency_ms=latency_ms, logits=logits.select(0, 0))
        return self._event(
            e, self.cache, attn=got.attn, attn_layers=got.attn_layers, kv_norms=got.kv_norms, kv_layer=got.kv_layer,
            kv_values=got.kv_values, kv_start=kv_start,
            logits=logits[0].float().cpu().numpy() if self.capture.logits else None)
