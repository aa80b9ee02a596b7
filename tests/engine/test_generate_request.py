"""One request, one stream base: ``GenerateRequest`` checks everything once, ``iter_generate`` is a
thin front over it (a dozen parameters, the request's fields), and every stream (plain, beam, speculative)
decodes, stops and builds its Run in the one shared place (engine/core/stream_base.py).
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import pytest

import kvviz
from kvviz.engine.generation.capture import Capture
from kvviz.engine.api import iter_generate, open_stream
from kvviz.engine.core.loop import GenerationStream
from kvviz.engine.generation.request import GenerateRequest
from kvviz.engine.generation.valid_request import BeamOptions, SpecOptions
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.strategy.beam import BeamStream
from kvviz.engine.strategy.speculative import SpeculativeStream
from kvviz.errors import KVVizError
from kvviz import Beam, CacheSpec, SamplingParams, Speculative

# iter_generate's parameters and defaults (issue 38): the prompt, then keywords only, a dozen in all;
# each one idea, the sampler, the cache and the strategy as the objects kvviz exports.
SIGNATURE = [
    ("model", inspect.Parameter.empty), ("prompt", inspect.Parameter.empty), ("max_new_tokens", 64),
    ("sampling", SamplingParams()), ("cache", CacheSpec()), ("strategy", None), ("capture", None), ("stop", ()),
    ("chat", False), ("parse_special", False), ("backend", "fast"), ("batch_size", 1),
]


def test_iter_generate_signature() -> None:
    params = inspect.signature(iter_generate).parameters
    assert [(n, p.default) for n, p in params.items()] == SIGNATURE
    assert len(params) <= 12  # the "at most a dozen parameters"
    kinds = [p.kind for p in params.values()]  # keyword-only after the prompt
    assert kinds == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2 + [inspect.Parameter.KEYWORD_ONLY] * 10
    assert inspect.signature(kvviz.generate).parameters == params  # generate takes the same


def test_request_fields_are_iter_generates_keywords() -> None:
    """The dataclass and the front cannot drift apart: same names, same order, same defaults."""
    fields = [(f.name, f.default) for f in dataclasses.fields(GenerateRequest)]
    assert [(n, inspect.Parameter.empty if d is dataclasses.MISSING else d) for n, d in fields] == SIGNATURE[1:]


def test_cache_specs_compression_fields_mirror_kvspec() -> None:
    """CacheSpec is flat for its callers (``CacheSpec(kv_dtype="int4", window=64)``); its compression
    fields are KVSpec's, in order and with KVSpec's defaults, so ``.kv`` carries every one across."""
    from kvviz.engine.generation.kv_spec import KVSpec

    kv_fields = [(f.name, f.default) for f in dataclasses.fields(KVSpec)]
    cache_fields = [(f.name, f.default) for f in dataclasses.fields(CacheSpec)]
    assert cache_fields[-len(kv_fields):] == kv_fields
    asked = CacheSpec(kv_dtype="int4", group_size=32, zero_point=True, fp8_scale="head", window=64, sinks=4,
                      positions="original", track_errors=True)
    assert asked.kv == KVSpec("int4", 32, True, "head", 64, 4, "original", True)
    assert CacheSpec().kv == KVSpec()


def test_the_package_exports_the_request_objects() -> None:
    assert (kvviz.SamplingParams, kvviz.CacheSpec, kvviz.Beam, kvviz.Speculative) == \
        (SamplingParams, CacheSpec, Beam, Speculative)
    assert {"SamplingParams", "CacheSpec", "Beam", "Speculative"} <= set(kvviz.__all__)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer (got 0)"),
    ({"batch_size": 0}, "batch_size must be between 1 and 64 (got 0)"),
    ({"cache": CacheSpec(kind="ring")}, "cache_kind must be one of static, concat, paged (got 'ring')"),
    ({"prompt": ""}, "the prompt is empty: type some text to start from"),
    ({"prompt": [1, 999]}, "prompt ids must be in [0, 256); got [999]"),
    ({"cache": CacheSpec(kind="paged", block_size=0)}, "the paged block size must be 1..4096 tokens (got 0)"),
    ({"strategy": Beam(0)}, "num_beams must be an integer from 1 to 64 (got 0)"),
    ({"strategy": Speculative("medusa")}, "speculative must be one of prompt_lookup (got 'medusa')"),
    ({"strategy": Speculative(draft_tokens=0)}, "draft_tokens must be an integer from 1 to"),
    ({"cache": CacheSpec(kv_dtype="int8", use_cache=False)}, "a int8 cache needs the KV cache on"),
    ({"chat": True, "prompt": [1]}, "a chat is given as text or messages, not as token ids"),
    ({"strategy": Beam(2), "capture": Capture(logits=True)},
     "attention, K/V and logits captures are recorded by plain decoding only"),
    ({"backend": "gpu"}, "backend must be one of fast, readable (got 'gpu')"),
]


@pytest.mark.parametrize("kw,message", BAD, ids=[", ".join(k) for k, _ in BAD])
def test_each_bad_field_gets_its_own_error(small_model: LoadedModel, kw: dict[str, Any], message: str) -> None:
    kw = {"prompt": "Hi", "max_new_tokens": 4, **kw}
    with pytest.raises(KVVizError) as got:
        GenerateRequest(**kw).validate(small_model)
    assert message in str(got.value)
    with pytest.raises(KVVizError) as front:  # the keyword front says exactly the same
        iter_generate(small_model, **kw)
    assert str(front.value) == str(got.value)


@pytest.mark.parametrize("kw,message", [
    ({"greedy": True, "temperature": 0.5}, "choose greedy or a temperature, not both"),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False (got 'no')"),
    ({"temperature": 0.0, "greedy": False}, "temperature must be in (0, 100] (got 0.0)"),
    ({"top_k": 0}, "top_k must be an integer >= 1 (got 0)"),
])
def test_sampling_params_check_themselves(kw: dict[str, Any], message: str) -> None:
    """A sampler is checked when it is made, before any model or request (the same sentences)."""
    with pytest.raises(KVVizError, match=re.escape(message)):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw,want", [
    ({}, (True, None)), ({"temperature": 0.8}, (False, 0.8)), ({"top_k": 5}, (False, 1.0)),
    ({"top_p": 0.9}, (False, 1.0)), ({"temperature": 0}, (True, None)), ({"greedy": False}, (False, 1.0)),
])
def test_sampling_is_greedy_unless_a_temperature_top_k_or_top_p_is_given(kw: dict[str, Any],
                                                                         want: tuple[bool, float | None]) -> None:
    p = SamplingParams(**kw)
    assert (p.greedy, p.temperature) == want
    assert dataclasses.replace(p, seed=3) == SamplingParams(**kw, seed=3)  # resolved once: replace round-trips


def test_a_valid_request_round_trips(small_model: LoadedModel) -> None:
    kw: dict[str, Any] = dict(prompt="Hi", max_new_tokens=3, sampling=SamplingParams(temperature=0.7, seed=5),
                              stop=["x", ""], batch_size=2)
    req = GenerateRequest(**kw)
    assert GenerateRequest(**{f.name: getattr(req, f.name) for f in dataclasses.fields(req)}) == req
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.max_new_tokens = 6  # type: ignore[misc]
    valid = req.validate(small_model)
    assert valid == req.validate(small_model)  # checking twice changes nothing
    ids = tuple(small_model.tokenizer.encode("Hi"))
    assert valid.rows == (ids, ids) and valid.batch_size == 2 and valid.text == "Hi"
    assert valid.stop == ("x",) and valid.capture == Capture() and not valid.kv.active
    p = valid.params
    assert (p.greedy, p.temperature, p.top_k, p.top_p, p.seed) == (False, 0.7, None, None, 5)
    assert valid.beam is None and valid.spec is None and valid.max_new_tokens == 3
    stream = open_stream(small_model, req)
    assert isinstance(stream, GenerationStream) and stream.req == valid
    assert stream.prompt_rows == (ids, ids) and stream.max_new_tokens == 3
    for _ in stream:
        pass
    assert stream.run.generated_ids == kvviz.generate(small_model, **kw).generated_ids


def test_requests_open_their_strategy(small_model: LoadedModel) -> None:
    beam = open_stream(small_model, GenerateRequest(prompt=[1, 2, 3], max_new_tokens=2,
                                                    strategy=Beam(num_beams=3, early_stopping="never", length_penalty=2)))
    assert isinstance(beam, BeamStream)
    assert beam.req.beam == BeamOptions(3, 2.0, "never", 1, beam.req.beam.eos_ids)  # type: ignore[union-attr]
    spec = open_stream(small_model, GenerateRequest(prompt=[1, 2, 3], max_new_tokens=2,
                                                    strategy=Speculative(method="prompt_lookup", draft_tokens=4, ngram=1)))
    assert isinstance(spec, SpeculativeStream) and spec.req.spec == SpecOptions(4, 1)


def _drain(stream: Any) -> Any:
    for _ in stream:
        pass
    return stream.run


@pytest.fixture(scope="module")
def mqa(random_models: dict[str, LoadedModel]) -> LoadedModel:
    """Greedy decoding here gives '...', two bytes that are no UTF-8, then 'e' after 'e': the text
    decoding (replacement characters) and a stop string inside a run of accepted drafts both matter."""
    return random_models["tiny-mqa"]


def test_beam_width_one_is_plain_greedy(mqa: LoadedModel) -> None:
    """The same checked request through the plain loop and through beam search with one beam (no
    EOS: one beam is then the argmax at every step): the same tokens, cache and Run."""
    req = GenerateRequest(prompt="Hello, world. Hello, world.", max_new_tokens=12,
                          sampling=SamplingParams(ignore_eos=True)).validate(mqa)
    plain = _drain(GenerationStream(mqa, req))
    beam = _drain(BeamStream(mqa, dataclasses.replace(req, beam=BeamOptions(1, 1.0, False, 1, ()))))
    assert beam.generated_ids == plain.generated_ids and len(plain.generated_ids) == 12
    assert beam.text == plain.text and "\ufffd" in plain.text
    assert (beam.stop_reason, beam.prompt_ids, beam.cache_kind, beam.sampling, beam.batch_size) == \
        (plain.stop_reason, plain.prompt_ids, plain.cache_kind, plain.sampling, plain.batch_size)
    assert [(e.position, e.input_len, e.cache_len, e.cache_bytes_used, e.flops) for e in beam.events] == \
        [(e.position, e.input_len, e.cache_len, e.cache_bytes_used, e.flops) for e in plain.events]


@pytest.mark.parametrize("stop", ["e" * 8, "\ufffde"])
def test_a_stop_string_cuts_plain_and_speculative_alike(mqa: LoadedModel, stop: str) -> None:
    kw: dict[str, Any] = dict(prompt="Hello, world. Hello, world.", max_new_tokens=24)
    ref = kvviz.generate(mqa, **kw)
    dec = mqa.tokenizer.decode
    # The reference cut: the first prefix of the output whose text holds the stop string.
    n = next(i for i in range(1, len(ref.generated_ids) + 1) if stop in dec(ref.generated_ids[:i]))
    whole = dec(ref.generated_ids[:n])
    runs = [kvviz.generate(mqa, stop=[stop], **kw), kvviz.generate(mqa, stop=[stop], strategy=Speculative(), **kw)]
    for run in runs:
        assert (run.stop_reason, run.stop_string) == ("stop_string", stop)
        assert run.generated_ids == ref.generated_ids[:n]
        assert run.text == whole[: whole.index(stop)]
    spec = runs[1].speculation
    assert spec is not None
    if stop.startswith("e"):  # the stop string completes inside a verify forward's accepted drafts
        assert spec.steps[-1].accepted > 1
        assert sum(len(s.emitted) for s in spec.steps) > len(runs[1].generated_ids)
