"""The generation API: ``iter_generate``, ``generate`` and ``open_stream``, above the loop and the strategies.

``iter_generate(model, prompt, *, ...)`` takes the prompt and a handful of keywords, each one idea:
the sampler (``SamplingParams``), the cache (``CacheSpec``), the strategy (``Beam``,
``Speculative`` or None), the capture and the stop strings. Its parameters after ``model`` are
``GenerateRequest``'s fields (the same names, order and defaults: a test holds them equal), so the
front builds one request and ``open_stream`` validates it and opens the stream that runs it.

It sits one floor above engine/generation/ (the plain loop, the request) and engine/strategy/ (beam
search, speculative decoding, which import generation/ and never the reverse), beside the package's
public names in kvviz/__init__.py.
"""
from __future__ import annotations

from typing import Sequence

from kvviz.engine.generation.capture import Capture
from kvviz.engine.generation.events import Run
from kvviz.engine.core.loop import GenerationStream
from kvviz.engine.generation.request import GenerateRequest, Prompt
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.generation.valid_request import Beam, CacheSpec, Speculative
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.strategy.beam import BeamStream
from kvviz.engine.strategy.speculative import SpeculativeStream

Stream = GenerationStream | BeamStream | SpeculativeStream


def open_stream(model: LoadedModel, request: GenerateRequest) -> Stream:
    """Validate ``request`` (before any compute) and return the stream that runs it: plain decoding,
    beam search or speculative decoding, each with the same interface."""
    req = request.validate(model)
    if req.spec is not None:
        return SpeculativeStream(model, req)
    if req.beam is not None:
        return BeamStream(model, req)
    return GenerationStream(model, req)


def iter_generate(
    model: LoadedModel,
    prompt: Prompt,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams = SamplingParams(),
    cache: CacheSpec = CacheSpec(),
    strategy: Beam | Speculative | None = None,
    capture: Capture | None = None,
    stop: Sequence[str] = (),
    chat: bool = False,
    parse_special: bool = False,
    backend: str = "fast",
    batch_size: int = 1,
) -> Stream:
    """Validate the request (before any compute) and return a stream of StepEvents.

    ``prompt``: text, one row of token ids, equal-length rows of ids (a batch: one run per row), or
    chat messages (``[{"role": "user", "content": "..."}]``), rendered with the model's own chat
    template; ``chat=True`` wraps a text prompt as one user message. An instruct model then answers
    and stops at its end-of-turn token (its EOS). Control-token text typed in a message stays text
    unless ``parse_special=True`` (engine/tokenize/chat_template.py).

    ``sampling``: greedy by default; ``SamplingParams(temperature=0.8, top_k=40, seed=1)`` samples,
    ``SamplingParams(ignore_eos=True)`` runs to ``max_new_tokens`` past EOS (timing lessons use it).
    ``cache``: ``CacheSpec()`` is a static cache; ``CacheSpec(use_cache=False)`` recomputes every
    step; ``CacheSpec(kind="paged", block_size=16, blocks=None)`` takes blocks from a pool (default:
    enough for every row); ``CacheSpec(kv_dtype="int8")`` or ``CacheSpec(window=64, sinks=4)`` a
    compressed cache. ``strategy``: ``Beam(k)`` runs beam search (engine/strategy/beam.py,
    transformers' meanings), ``Speculative(draft_tokens=10, ngram=2)`` prompt-lookup speculative
    decoding (engine/strategy/speculative.py); either is a different stream with the same interface.
    ``backend``: "fast" runs the model's accelerator (kvviz.fast) where it has one, "readable" the
    readable model (the same maths). ``batch_size`` repeats a text or a single row of ids.
    """
    return open_stream(model, GenerateRequest(
        prompt, max_new_tokens=max_new_tokens, sampling=sampling, cache=cache, strategy=strategy, capture=capture,
        stop=stop, chat=chat, parse_special=parse_special, backend=backend, batch_size=batch_size))


def generate(
    model: LoadedModel,
    prompt: Prompt,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams = SamplingParams(),
    cache: CacheSpec = CacheSpec(),
    strategy: Beam | Speculative | None = None,
    capture: Capture | None = None,
    stop: Sequence[str] = (),
    chat: bool = False,
    parse_special: bool = False,
    backend: str = "fast",
    batch_size: int = 1,
) -> Run:
    """Run ``iter_generate`` to the end and return the collected Run (the same parameters)."""
    stream = iter_generate(model, prompt, max_new_tokens=max_new_tokens, sampling=sampling, cache=cache,
                           strategy=strategy, capture=capture, stop=stop, chat=chat, parse_special=parse_special,
                           backend=backend, batch_size=batch_size)
    for _ in stream:
        pass
    return stream.run
