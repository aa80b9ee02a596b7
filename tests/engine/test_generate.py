"""The generation loop: cached == uncached, batching, stopping, seeds, events and bad requests."""
from __future__ import annotations

import dataclasses
import gc
import math
import threading
from typing import Any, Callable

import numpy as np
import pytest
import torch

import kvviz
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.tokenize.tokenizer import ByteTokenizer
from kvviz import Beam, CacheSpec, SamplingParams, Speculative
from keyword_sets import request_kwargs

SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": dict(greedy=True),
    "temp-topk": dict(temperature=0.9, top_k=40, seed=7),
    "temp-topp": dict(temperature=1.3, top_p=0.9, seed=11),
    "temp-topk-topp": dict(temperature=0.7, top_k=20, top_p=0.95, seed=3),
}
LOGITS = kvviz.Capture(logits=True)


def _logits(run: kvviz.Run) -> np.ndarray:
    return np.stack([e.logits for e in run.events])  # (steps, V)


def _assert_same_run(a: kvviz.Run, b: kvviz.Run) -> None:
    assert a.generated_ids == b.generated_ids
    np.testing.assert_allclose(_logits(a), _logits(b), atol=1e-4, rtol=0)
    # Top-5 probabilities (compared as values: two near-equal candidates may swap places).
    np.testing.assert_allclose([[t.prob for t in e.top] for e in a.events],
                               [[t.prob for t in e.top] for e in b.events], atol=1e-5, rtol=0)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("shape", ["tiny", "tiny-gqa", "tiny-mqa"])
def test_cached_equals_uncached(random_models: dict[str, LoadedModel], shape: str, sampling: str) -> None:
    m = random_models[shape]
    kw = dict(prompt="The KV cache!", max_new_tokens=24, capture=LOGITS, **SAMPLINGS[sampling])
    ref = kvviz.generate(m, **request_kwargs(use_cache=False, **kw))
    N = len(ref.prompt_ids)
    assert [e.input_len for e in ref.events] == [N + s for s in range(24)]  # recomputes everything
    for kind in ("static", "concat", "paged"):
        run = kvviz.generate(m, **request_kwargs(use_cache=True, cache_kind=kind, **kw))
        _assert_same_run(run, ref)
        assert run.cache_kind == kind
        assert [e.input_len for e in run.events] == [N] + [1] * 23
    if sampling != "greedy":
        assert len(set(ref.generated_ids)) > 5  # sampling really varied the tokens


@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("n_prompt", [1, 48])
def test_prompt_length_edges(make_model: Callable[..., LoadedModel], kv: int, n_prompt: int) -> None:
    """A 1-token prompt, and a prompt that fills the context exactly (48 + 16 = block_size 64)."""
    m = make_model(n_kv_head=kv, seed=kv)
    ids = [(7 * i + 3) % 256 for i in range(n_prompt)]
    for sampling in (dict(greedy=True), dict(temperature=1.0, seed=5)):
        kw = dict(prompt_ids=ids, max_new_tokens=16, capture=LOGITS, **sampling)
        ref = kvviz.generate(m, **request_kwargs(use_cache=False, **kw))
        assert len(ref.events) == 16
        assert ref.events[-1].position == n_prompt + 15
        for kind in ("static", "concat", "paged"):
            _assert_same_run(kvviz.generate(m, **request_kwargs(cache_kind=kind, kv_block_size=5, **kw)), ref)


def test_context_budget_is_checked_before_compute(small_model: LoadedModel) -> None:
    with pytest.raises(kvviz.KVVizError) as e:
        kvviz.iter_generate(small_model, prompt=[1] * 49, max_new_tokens=16)
    msg = str(e.value)
    assert "49" in msg and "16" in msg and "64" in msg  # prompt, max_new_tokens, block_size
    # Exactly at the limit is fine.
    assert len(kvviz.generate(small_model, prompt=[1] * 63, max_new_tokens=1).events) == 1


def test_batch_rows_match_single_rows(small_model: LoadedModel) -> None:
    rows = [[72, 101, 108, 108, 111, 33, 10], [1, 2, 3, 4, 5, 6, 7], [200, 50, 9, 9, 31, 255, 0]]
    singles = [kvviz.generate(small_model, prompt=r, max_new_tokens=12).generated_ids for r in rows]
    assert len({tuple(s) for s in singles}) == 3
    for use_cache in (True, False):
        run = kvviz.generate(small_model, prompt=rows, max_new_tokens=12, capture=LOGITS,
                             cache=CacheSpec(use_cache=use_cache))
        assert run.batch_size == 3
        per_row = [[e.token_ids[b] for e in run.events] for b in range(3)]
        assert per_row == singles
        assert run.generated_ids == singles[0]
        if use_cache:
            c = small_model.config
            assert run.events[0].cache_bytes_used == 3 * 7 * 2 * c.n_layer * c.kv_heads * c.head_dim * 4


def test_batch_sampling_cached_equals_uncached(random_models: dict[str, LoadedModel]) -> None:
    m = random_models["tiny-gqa"]
    rows = [[10, 20, 30, 40], [50, 60, 70, 80]]
    kw = dict(prompt_ids=rows, max_new_tokens=10, temperature=1.0, top_p=0.95, seed=1, capture=LOGITS)
    a = kvviz.generate(m, **request_kwargs(use_cache=True, **kw))
    b = kvviz.generate(m, **request_kwargs(use_cache=False, **kw))
    assert [e.token_ids for e in a.events] == [e.token_ids for e in b.events]
    np.testing.assert_allclose(_logits(a), _logits(b), atol=1e-4, rtol=0)


def test_batch_size_repeats_one_prompt(small_model: LoadedModel) -> None:
    run = kvviz.generate(small_model, prompt=[5, 6, 7], max_new_tokens=5, batch_size=4)
    assert run.batch_size == 4
    assert all(len(set(e.token_ids)) == 1 and len(e.token_ids) == 4 for e in run.events)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(prompt_ids=[[1, 2], [3]]), "equal lengths"),
    (dict(prompt_ids=[[1, 2], [3, 4]], batch_size=3), "batch_size 3"),
    (dict(prompt_ids=[1, 2], batch_size=0), "batch_size"),
    (dict(prompt_ids=[1, 2], batch_size=65), "batch_size"),
])
def test_bad_batches(small_model: LoadedModel, kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(kvviz.KVVizError, match=needle):
        kvviz.iter_generate(small_model, **request_kwargs(max_new_tokens=3, **kwargs))


def test_public_api_names_stay_the_functions() -> None:
    """ARCHITECTURE.md's contract: kvviz.generate(model, ...), however kvviz.engine.api was imported."""
    import importlib

    importlib.import_module("kvviz.engine.api")  # what any `from kvviz.engine.api import X` does first
    for _ in range(2):  # and on every access, not only the first
        assert callable(kvviz.generate) and getattr(kvviz.generate, "__name__", None) == "generate"
    for name in ("load_model", "iter_generate", "Capture", "CAPTURE_ALL", "KVVizError", "LoadedModel", "Run",
                 "StepEvent", "SamplingParams", "CacheSpec", "Beam", "Speculative"):
        assert hasattr(kvviz, name)


# ----------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("n", [1, 5, 17])
def test_max_new_tokens_is_honoured_exactly(small_model: LoadedModel, n: int) -> None:
    for use_cache in (True, False):
        run = kvviz.generate(small_model, prompt="ab", max_new_tokens=n,
                             sampling=SamplingParams(temperature=1.0, seed=0), cache=CacheSpec(use_cache=use_cache))
        assert len(run.events) == len(run.generated_ids) == n
        assert run.stop_reason == "max_new_tokens" and run.stop_string is None
        assert [e.step for e in run.events] == list(range(n))
        assert [e.phase for e in run.events] == ["prefill"] + ["decode"] * (n - 1)
        assert [e.position for e in run.events] == list(range(2, 2 + n))


def _first_new_token_index(ids: list[int], at_least: int) -> int:
    """Index k >= at_least of a token that does not occur before k."""
    for k in range(at_least, len(ids)):
        if ids[k] not in ids[:k]:
            return k
    raise AssertionError(f"no fresh token after index {at_least} in {ids}")


def test_eos_stops_greedy_generation(random_models: dict[str, LoadedModel]) -> None:
    m = random_models["tiny"]
    ref = kvviz.generate(m, prompt="Hello, world", max_new_tokens=20).generated_ids
    k = _first_new_token_index(ref, 1)
    with_eos = dataclasses.replace(m, tokenizer=ByteTokenizer(256, eos_token_id=ref[k]))
    for use_cache in (True, False):
        run = kvviz.generate(with_eos, prompt="Hello, world", max_new_tokens=20, cache=CacheSpec(use_cache=use_cache))
        assert run.stop_reason == "eos"
        assert run.generated_ids == ref[: k + 1]  # the EOS token is the last one emitted
        assert run.text == with_eos.tokenizer.decode(ref[: k + 1])


def test_ignore_eos_runs_to_max_new_tokens(random_models: dict[str, LoadedModel]) -> None:
    """ignore_eos=True (vLLM's name): the EOS token is emitted and generation goes on, the same
    tokens as a model with no EOS at all, in every mode and strategy; the default still stops."""
    m = random_models["tiny"]
    ref = kvviz.generate(m, prompt="Hello, world", max_new_tokens=20).generated_ids
    k = _first_new_token_index(ref, 1)
    with_eos = dataclasses.replace(m, tokenizer=ByteTokenizer(256, eos_token_id=ref[k]))
    for use_cache in (True, False):
        run = kvviz.generate(with_eos, prompt="Hello, world", max_new_tokens=20,
                             sampling=SamplingParams(ignore_eos=True), cache=CacheSpec(use_cache=use_cache))
        assert (run.generated_ids, run.stop_reason) == (ref, "max_new_tokens")
        assert run.answer_text == run.text  # only a run that stopped at EOS loses its marker
    stopped = kvviz.generate(with_eos, prompt="Hello, world", max_new_tokens=20)
    assert stopped.stop_reason == "eos" and stopped.answer_text == with_eos.tokenizer.decode(ref[:k])
    spec = kvviz.generate(with_eos, prompt="Hello, world", max_new_tokens=20,
                          sampling=SamplingParams(ignore_eos=True), strategy=Speculative(method="prompt_lookup"))
    assert (spec.generated_ids, spec.stop_reason) == (ref, "max_new_tokens")
    assert kvviz.generate(with_eos, prompt="Hello, world", max_new_tokens=20,
                          strategy=Speculative(method="prompt_lookup")).stop_reason == "eos"
    beam = kvviz.generate(with_eos, prompt="Hello, world", max_new_tokens=20,
                          sampling=SamplingParams(ignore_eos=True), strategy=Beam(num_beams=2))
    assert len(beam.generated_ids) == 20 and beam.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_ignore_eos_must_be_a_bool(random_models: dict[str, LoadedModel], value: object) -> None:
    with pytest.raises(kvviz.KVVizError, match="ignore_eos must be True or False"):
        kvviz.iter_generate(random_models["tiny"], prompt="hi", sampling=SamplingParams(ignore_eos=value))


def test_eos_from_config_stops_sampling(make_model: Callable[..., LoadedModel]) -> None:
    kw = dict(prompt="xyz", max_new_tokens=30, temperature=1.0, seed=2)
    ref = kvviz.generate(make_model(seed=3), **request_kwargs(**kw)).generated_ids
    k = _first_new_token_index(ref, 4)
    m = make_model(seed=3, eos_token_id=ref[k])  # same weights; config names an EOS token
    assert m.tokenizer.eos_token_id == ref[k]
    run = kvviz.generate(m, **request_kwargs(**kw))
    assert (run.stop_reason, run.generated_ids) == ("eos", ref[: k + 1])


def _fresh_ascii_pair(ids: list[int]) -> str:
    """Two printable ASCII tokens in a row whose second character does not occur earlier."""
    for i, (a, b) in enumerate(zip(ids, ids[1:])):
        if 33 <= a < 127 and 33 <= b < 127 and b not in ids[: i + 1]:
            return chr(a) + chr(b)
    raise AssertionError(f"no suitable pair of printable ASCII tokens in {ids}")


def test_stop_string_is_reported_and_trimmed(random_models: dict[str, LoadedModel]) -> None:
    m = random_models["tiny"]
    kw = dict(prompt="Hello, world", max_new_tokens=40, temperature=1.0, seed=3)
    ref = kvviz.generate(m, **request_kwargs(**kw)).generated_ids
    stop = _fresh_ascii_pair(ref)
    dec = m.tokenizer.decode
    # The reference: the first prefix of the output whose decoded text contains the stop string.
    n = next(i for i in range(1, len(ref) + 1) if stop in dec(ref[:i]))
    expected_text = dec(ref[:n])[: dec(ref[:n]).index(stop)]
    for use_cache in (True, False):
        run = kvviz.generate(m, **request_kwargs(stop=[stop], use_cache=use_cache, **kw))
        assert run.stop_reason == "stop_string" and run.stop_string == stop
        assert run.generated_ids == ref[:n]
        assert run.text == expected_text and stop not in run.text
    # Its last character alone matches at the same step, one character later: the stop string
    # that starts earliest in the text is the one reported, and the text is cut there.
    run = kvviz.generate(m, **request_kwargs(stop=[stop[1], "\x00never\x00", stop], **kw))
    assert (run.stop_string, run.generated_ids, run.text) == (stop, ref[:n], expected_text)
    # Stop strings that never appear (and empty ones) change nothing.
    run = kvviz.generate(m, **request_kwargs(stop=["\x00never\x00", ""], **kw))
    assert run.stop_reason == "max_new_tokens" and run.generated_ids == ref and run.stop_string is None
    assert run.text == dec(ref)


def test_abandoned_iteration_reports_stopped(small_model: LoadedModel) -> None:
    stream = kvviz.iter_generate(small_model, prompt="abc", max_new_tokens=20)
    seen = []
    for ev in stream:
        seen.append(ev.token_id)
        if len(seen) == 3:
            break
    run = stream.run
    assert run.stop_reason == "stopped" and "3" in run.note
    assert run.generated_ids == seen and len(run.events) == 3
    assert run.text == small_model.tokenizer.decode(seen)
    full = kvviz.generate(small_model, prompt="abc", max_new_tokens=20)
    assert full.generated_ids[:3] == seen
    # Collect the abandoned generator here and now: collected later by the cycle GC, it would
    # switch inference mode off inside whatever run is going (see the test below).
    del stream
    gc.collect()


def test_abandoned_stream_leaves_inference_mode_alone(small_model: LoadedModel) -> None:
    """A Stop click abandons a stream mid-run; other runs (other sessions) must not notice.

    Runs in its own thread: inference mode is thread-local, so whatever this leaks dies with it.
    """
    outcome: dict[str, Any] = {}

    def scenario() -> None:
        try:
            s = kvviz.iter_generate(small_model, prompt="abc", max_new_tokens=20)
            for _, _ev in zip(range(3), s):
                pass
            outcome["leaked"] = torch.is_inference_mode_enabled()  # the consumer's own state
            del s, _ev  # the stream and its generator form a cycle, so nothing is freed yet
            other = iter(kvviz.iter_generate(small_model, prompt="abc", max_new_tokens=5))
            next(other)
            gc.collect()  # the abandoned generator is closed now, in the middle of `other`
            outcome["rest"] = len(list(other))
        except Exception as e:  # reported below, with the thread's error
            outcome["error"] = repr(e)
        finally:
            gc.collect()

    t = threading.Thread(target=scenario)
    t.start()
    t.join()
    assert outcome.get("error") is None, outcome["error"]
    assert outcome["rest"] == 4
    assert outcome["leaked"] is False


# ----------------------------------------------------------------------------- seeds
def test_seeds_reproduce_and_differ(random_models: dict[str, LoadedModel]) -> None:
    m = random_models["tiny"]
    kw = dict(prompt="seed", max_new_tokens=20, temperature=1.0)
    a = kvviz.generate(m, **request_kwargs(seed=123, **kw)).generated_ids
    assert kvviz.generate(m, **request_kwargs(seed=123, **kw)).generated_ids == a
    assert kvviz.generate(m, **request_kwargs(seed=124, **kw)).generated_ids != a
    # A run's generator is its own: global RNG state does not leak into it.
    torch.manual_seed(999)
    torch.rand(10)
    assert kvviz.generate(m, **request_kwargs(seed=123, **kw)).generated_ids == a


def test_greedy_is_deterministic_and_the_zero_temperature_limit(small_model: LoadedModel) -> None:
    kw = dict(prompt="Hi", max_new_tokens=15)
    g = kvviz.generate(small_model, **request_kwargs(**kw))
    assert kvviz.generate(small_model, **request_kwargs(**kw)).generated_ids == g.generated_ids
    assert kvviz.generate(small_model, **request_kwargs(greedy=True, seed=42, **kw)).generated_ids == g.generated_ids
    assert kvviz.generate(small_model, **request_kwargs(temperature=1e-5, seed=9, **kw)).generated_ids == g.generated_ids
    zero = kvviz.generate(small_model, **request_kwargs(temperature=0.0, seed=9, **kw))  # T=0 means greedy
    assert zero.generated_ids == g.generated_ids and zero.sampling == "greedy"
    assert kvviz.generate(small_model, **request_kwargs(temperature=2.0, top_k=1, seed=9, **kw)).generated_ids == g.generated_ids
    assert g.sampling == "greedy"


# ----------------------------------------------------------------------------- events and runs
def test_events_carry_consistent_figures(small_model: LoadedModel) -> None:
    run = kvviz.generate(small_model, prompt="Hello", max_new_tokens=8, capture=LOGITS)
    tok = small_model.tokenizer
    for e in run.events:
        assert e.token_text == tok.token_display(e.token_id)
        probs = torch.softmax(torch.from_numpy(e.logits).double(), -1)
        assert len(e.top) == 5
        assert [t.token_id for t in e.top] == torch.topk(probs, 5).indices.tolist()
        np.testing.assert_allclose([t.prob for t in e.top], torch.topk(probs, 5).values.numpy(), atol=1e-6)
        assert e.top[0].token_id == e.token_id  # greedy
        assert e.latency_ms > 0 and e.elapsed_ms >= e.latency_ms
        assert e.token_ids == (e.token_id,)
        assert e.attn is None and e.kv_norms is None and e.kv_values is None  # captures are opt-in
    assert [e.elapsed_ms for e in run.events] == sorted(e.elapsed_ms for e in run.events)
    assert run.text == tok.decode(run.generated_ids)
    assert run.ttft_ms == run.events[0].latency_ms
    assert run.mean_tpot_ms == pytest.approx(sum(e.latency_ms for e in run.events[1:]) / 7)
    # One tokens/s (the tour's 1000 / TPOT, issue 36): the decode steps only; end to end apart, by name.
    assert run.tokens_per_s == pytest.approx(1000 / run.mean_tpot_ms) == run.decode_tokens_per_s
    assert run.e2e_tokens_per_s == pytest.approx(8 / (sum(e.latency_ms for e in run.events) / 1000))
    assert run.prompt_ids == tuple(b"Hello") and run.prompt_text == "Hello"
    d = run.to_dict()
    assert d["generated_ids"] == run.generated_ids and len(d["steps"]) == 8
    assert (d["tokens_per_s"], d["e2e_tokens_per_s"]) == (run.tokens_per_s, run.e2e_tokens_per_s)


def test_captures_are_bounded_float16_and_change_nothing(random_models: dict[str, LoadedModel]) -> None:
    m = random_models["tiny-gqa"]  # 4 layers, 8 query heads, 2 K/V heads, head_dim 32
    kw = dict(prompt="capture", max_new_tokens=6, capture=None)
    plain = kvviz.generate(m, **request_kwargs(**{**kw, "capture": LOGITS}))
    cap = kvviz.generate(m,
                         **request_kwargs(**{**kw, "capture": dataclasses.replace(kvviz.CAPTURE_ALL, logits=True)}))
    _assert_same_run(cap, plain)
    N = 7
    for s, e in enumerate(cap.events):
        S = N + s
        n_new = N if s == 0 else 1
        assert e.attn.dtype == e.kv_norms.dtype == e.kv_values.dtype == np.float16
        assert e.attn.shape == (4, 8, S) and e.attn_layers == (0, 1, 2, 3)
        np.testing.assert_allclose(e.attn.astype(np.float32).sum(-1), 1.0, atol=5e-3)
        assert e.kv_norms.shape == (4, 2, 2, n_new)
        assert e.kv_values.shape == (2, 2, n_new, 32) and e.kv_layer == 0 and e.kv_start == S - n_new
        assert e.capture_nbytes() == 2 * (4 * 8 * S + 4 * 2 * 2 * n_new + 2 * 2 * n_new * 32) + 4 * 256
        np.testing.assert_allclose(np.linalg.norm(e.kv_values.astype(np.float32), axis=-1),
                                   e.kv_norms[0].astype(np.float32), rtol=2e-3, atol=2e-3)
    one = kvviz.generate(m, **request_kwargs(**{**kw, "capture": kvviz.Capture(attention=(2, 9))}))
    assert one.events[0].attn.shape == (1, 8, N) and one.events[0].attn_layers == (2,)
    np.testing.assert_array_equal(one.events[-1].attn[0], cap.events[-1].attn[2])


# ----------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize("kwargs, needle", [
    (dict(prompt=""), "empty"),
    (dict(prompt=None), "empty"),
    (dict(prompt_ids=[]), "zero tokens"),
    (dict(messages=[{"role": "user", "content": "a"}]), "has no chat template"),
    (dict(prompt_ids=[256]), r"\[0, 256\)"),
    (dict(prompt_ids=[-1]), r"\[0, 256\)"),
    (dict(prompt_ids=["x"]), "integers"),
    (dict(prompt="a" * 100_001), "limit"),
    (dict(prompt="a", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="a", max_new_tokens=-3), "max_new_tokens"),
    (dict(prompt="a", max_new_tokens=2.5), "max_new_tokens"),
    (dict(prompt="a", max_new_tokens=True), "max_new_tokens"),
    (dict(prompt="a", greedy=False, temperature=0.0), "temperature"),
    (dict(prompt="a", temperature=-1.0), "temperature"),
    (dict(prompt="a", temperature=101.0), "temperature"),
    (dict(prompt="a", temperature=math.nan), "temperature"),
    (dict(prompt="a", temperature=1.0, top_k=0), "top_k"),
    (dict(prompt="a", temperature=1.0, top_p=0.0), "top_p"),
    (dict(prompt="a", temperature=1.0, top_p=1.5), "top_p"),
    (dict(prompt="a", temperature=1.0, top_p=math.nan), "top_p"),
    (dict(prompt="a", temperature=1.0, seed=-1), "seed"),
    (dict(prompt="a", greedy=True, temperature=0.7), "greedy or a temperature"),
    (dict(prompt="a", cache_kind="pages"), "cache_kind"),
    (dict(prompt="a", cache_kind="paged", kv_block_size=0), "block size"),
    (dict(prompt="a", cache_kind="paged", kv_blocks=0), "positive number of blocks"),
])
def test_bad_requests_raise_before_compute(small_model: LoadedModel, kwargs: dict[str, Any], needle: str) -> None:
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(kvviz.KVVizError, match=needle):
        kvviz.iter_generate(small_model, **request_kwargs(**kwargs))  # raises on the call, not on iteration
    with pytest.raises(kvviz.KVVizError, match=needle):
        kvviz.generate(small_model, **request_kwargs(**kwargs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_cached_equals_uncached(dtype: str) -> None:
    m = kvviz.load_model("random:tiny-gqa", device="cuda", dtype=dtype)
    kw = dict(prompt="GPU", max_new_tokens=16, capture=LOGITS, temperature=1.0, seed=4)
    ref = kvviz.generate(m, **request_kwargs(use_cache=False, **kw))
    run = kvviz.generate(m, **request_kwargs(use_cache=True, **kw))
    assert run.device.startswith("cuda") and len(run.events) == 16
    if dtype == "fp32":
        _assert_same_run(run, ref)
    else:  # bf16 rounding differs between the two attention shapes; compare loosely
        np.testing.assert_allclose(_logits(run)[0], _logits(ref)[0], atol=0.1, rtol=0)
