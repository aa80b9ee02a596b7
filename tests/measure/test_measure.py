"""The measurement harness on a tiny model: races run modes in turn, sweeps stream samples with
progress and stop cleanly, prompts are built to exact lengths, the probe returns sane numbers.

Speed is measured, never asserted: these tests check structure, bookkeeping and determinism.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kvviz import CacheSpec, SamplingParams
from kvviz.engine.generation.flops import forward_bytes, forward_flops
from kvviz.measure.sweeps import (
    Request, batch_memory, batch_rows, batch_sizes, compare_outputs, cycle_to, document_ids, iter_race,
    prompt_lengths, request_from_text, run_once, sweep_batch, sweep_decode, sweep_ns,
    sweep_short_long, sweep_total_time, sweep_ttft,
)
from kvviz.measure.probe import probe_machine
from kvviz.measure.stats import MODES, aggregate

PROMPT = (72, 105, 32, 116, 104, 101, 114, 101)  # "Hi there"


def _req(n: int = 6, **kw) -> Request:  # type: ignore[no-untyped-def]
    return Request(prompt_ids=(PROMPT,), max_new_tokens=n, **kw)


def test_request_kwargs_per_mode() -> None:
    k = _req().kwargs("none")
    assert k["cache"] == CacheSpec(use_cache=False) and k["prompt"] == list(PROMPT)
    assert k["sampling"] == SamplingParams(ignore_eos=True) and k["backend"] == "fast"  # greedy, EOS ignored
    assert _req().kwargs("concat")["cache"] == CacheSpec(kind="concat")
    s = _req(sampling=SamplingParams(temperature=0.7, top_k=5, seed=3), backend="readable").kwargs("static")
    assert s["sampling"] == SamplingParams(temperature=0.7, top_k=5, seed=3, ignore_eos=True)
    assert s["cache"] == CacheSpec() and s["backend"] == "readable"
    assert _req(ignore_eos=False).kwargs("static")["sampling"] == SamplingParams()
    rows = Request(prompt_ids=(PROMPT, PROMPT), max_new_tokens=2).kwargs("static")
    assert rows["prompt"] == [list(PROMPT)] * 2
    with pytest.raises(ValueError):
        _req().kwargs("paged")


def test_request_from_text_keeps_the_text(small_model) -> None:  # type: ignore[no-untyped-def]
    r = request_from_text(small_model, "Hi there", 4, SamplingParams(seed=0))
    assert r.prompt_ids == (PROMPT,) and r.kwargs("static")["prompt"] == "Hi there"
    assert run_once(small_model, r, "static").prompt_text == "Hi there"


def test_race_runs_modes_one_after_another_with_identical_output(small_model) -> None:  # type: ignore[no-untyped-def]
    ticks = list(iter_race(small_model, _req(6)))
    order = [t.mode for t in ticks]
    # Never interleaved: each mode's ticks form one block, in MODES order, closed by a None tick.
    assert [m for m, _ in itertools.groupby(order)] == list(MODES)
    ends = [t for t in ticks if t.event is None]
    assert [t.mode for t in ends] == list(MODES)
    runs = {t.mode: t.run for t in ends}
    assert all(len(r.events) == 6 for r in runs.values())
    assert runs["none"].cache_kind == "none" and runs["concat"].cache_kind == "concat"
    agree = compare_outputs(runs)
    assert agree.identical and agree.compared == 6 and "token for token" in agree.message


def test_race_is_deterministic_given_the_seed(small_model) -> None:  # type: ignore[no-untyped-def]
    req = _req(8, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=11))

    def tokens() -> list[int]:
        return [t.event.token_id for t in iter_race(small_model, req, warm=False) if t.event and t.mode == "none"]

    assert tokens() == tokens()


def test_compare_outputs_flags_a_difference_and_a_short_run(small_model) -> None:  # type: ignore[no-untyped-def]
    run = run_once(small_model, _req(5), "static")
    bad_ev = dataclasses.replace(run.events[3], token_id=(run.events[3].token_id + 1) % 256,
                                 token_ids=((run.events[3].token_id + 1) % 256,))
    bad = dataclasses.replace(run, events=run.events[:3] + (bad_ev,) + run.events[4:])
    a = compare_outputs({"static": run, "none": bad})
    assert not a.identical and a.first_diff == 3 and "step 3" in a.message
    short = compare_outputs({"static": run, "none": run.upto(2)})
    assert not short.identical and short.first_diff is None and short.compared == 3


def test_prompt_building() -> None:
    assert cycle_to([1, 2, 3], 7) == (1, 2, 3, 1, 2, 3, 1)
    assert cycle_to([1, 2, 3], 2) == (1, 2)
    with pytest.raises(ValueError):
        cycle_to([], 3)
    assert prompt_lengths(1024) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1023]
    assert prompt_lengths(64) == [16, 24, 32, 48, 63]
    assert sweep_ns(8, 1024) == [8, 16, 32, 64, 128, 256, 512]
    assert sweep_ns(600, 1024) == [8, 16, 32, 64, 128, 256]
    assert sweep_ns(8, 64) == [8, 16, 32]


def test_document_and_batch_rows(small_model) -> None:  # type: ignore[no-untyped-def]
    doc = document_ids(small_model, 300)
    assert len(doc) == 300 and bytes(doc[:12]) == b"A transforme"
    same = batch_rows(small_model, PROMPT, 3, 10, different=False)
    assert len(same) == 3 and len(set(same)) == 1 and same[0] == cycle_to(PROMPT, 10)
    diff = batch_rows(small_model, PROMPT, 4, 10, different=True)
    assert len(diff) == 4 and len(set(diff)) == 4 and {len(r) for r in diff} == {10}


def test_total_time_sweep_streams_progress_and_stops_cleanly(small_model) -> None:  # type: ignore[no-untyped-def]
    it = sweep_total_time(small_model, _req(), ns=[4, 8], repeats=2, warm=False)
    first = list(itertools.islice(it, 3))  # a Stop after three runs
    assert [s.done for s in first] == [1, 2, 3] and all(s.total == 8 for s in first)
    assert [(s.series, s.x, s.repeat) for s in first] == [("static", 4, 0), ("none", 4, 0), ("static", 4, 1)]
    assert all(s.device == "cpu" and s.dtype == "fp32" and s.metrics["total_ms"] > 0 for s in first)
    agg = aggregate(first, "total_ms")  # the points measured before the stop are usable as they are
    assert set(zip(agg.series, agg.x, agg.n)) == {("static", 4.0, 2), ("none", 4.0, 1)}
    it.close()


def test_total_time_sweep_counts_the_tokens(small_model) -> None:  # type: ignore[no-untyped-def]
    samples = list(sweep_total_time(small_model, _req(), ns=[3, 5], repeats=1, modes=("static", "concat", "none"),
                                    warm=False))
    assert len(samples) == 6 and samples[-1].done == samples[-1].total == 6
    assert {(s.x, s.metrics["tokens"]) for s in samples} == {(3, 3), (5, 5)}
    flops = {s.series: s.metrics["flops"] for s in samples if s.x == 5}
    assert flops["static"] == flops["concat"] < flops["none"]


def test_ttft_sweep_carries_formula_flops_and_bytes(small_model) -> None:  # type: ignore[no-untyped-def]
    cfg = small_model.config
    samples = list(sweep_ttft(small_model, PROMPT, [4, 16], repeats=2, warm=False))
    assert [(s.x, s.repeat) for s in samples] == [(4, 0), (16, 0), (4, 1), (16, 1)]
    s = samples[1]
    assert s.metrics["flops"] == forward_flops(cfg, 16, 0) and s.metrics["bytes"] == forward_bytes(cfg, 16, 0, 4)
    assert s.metrics["intensity"] == pytest.approx(s.metrics["flops"] / s.metrics["bytes"])
    assert s.metrics["flops_per_s"] == pytest.approx(s.metrics["flops"] / (s.metrics["ttft_ms"] / 1000))


def test_decode_sweep_covers_every_context(small_model) -> None:  # type: ignore[no-untyped-def]
    cfg = small_model.config
    samples = list(sweep_decode(small_model, PROMPT, repeats=1, prompt_len=8, max_context=20, warm=False))
    # Prompt of 8, 12 new tokens: 11 decode steps, whose tokens see 9..19 keys.
    assert [s.x for s in samples] == list(range(9, 20)) and samples[-1].total == 11
    s = samples[0]
    assert s.metrics["flops"] == forward_flops(cfg, 1, 8) and s.metrics["bytes"] == forward_bytes(cfg, 1, 8, 4)
    with pytest.raises(ValueError):
        next(sweep_decode(small_model, PROMPT, prompt_len=cfg.block_size - 1, warm=False))


def test_short_long_example(small_model) -> None:  # type: ignore[no-untyped-def]
    samples = list(sweep_short_long(small_model, PROMPT, long_len=60, n_new=4, repeats=1, warm=False))
    by = {s.series: s for s in samples}
    assert by["short question"].x == len(PROMPT) and by["long document"].x == 64 - 4  # bounded by the context
    assert all(s.metrics["ttft_ms"] > 0 and s.metrics["tpot_ms"] > 0 for s in samples)


def test_batch_sweep_kv_bytes_scale_with_batch(small_model) -> None:  # type: ignore[no-untyped-def]
    samples = list(sweep_batch(small_model, PROMPT, [1, 2, 4], prompt_len=6, n_new=3, repeats=1, different=True,
                               warm=False))
    assert [s.x for s in samples] == [1, 2, 4] and {s.series for s in samples} == {"different prompts"}
    alloc = [s.metrics["kv_bytes_allocated"] for s in samples]
    assert alloc[1] == 2 * alloc[0] and alloc[2] == 4 * alloc[0]
    used = [s.metrics["kv_bytes_used"] for s in samples]
    assert used[0] == (6 + 3 - 1) * alloc[0] // small_model.config.block_size  # the last token is never cached
    assert all(s.metrics["tokens_per_s"] > 0 for s in samples)
    same = list(sweep_batch(small_model, PROMPT, [4], prompt_len=6, n_new=3, repeats=1, warm=False))
    assert same[0].metrics["distinct_outputs"] == 1 and same[0].series == "same prompt"


def test_batch_sizes_bounded_by_memory(small_model) -> None:  # type: ignore[no-untyped-def]
    one = batch_memory(small_model, 1, 16, 16)
    assert batch_memory(small_model, 4, 16, 16) == 4 * one
    assert batch_sizes(small_model, 16, 16, free_bytes=10**12) == [1, 2, 4, 8, 16]
    assert batch_sizes(small_model, 16, 16, free_bytes=int(4.5 * one / 0.25)) == [1, 2, 4]
    assert batch_sizes(small_model, 16, 16, free_bytes=0) == []


def test_probe_machine_small() -> None:
    p = probe_machine("cpu", torch.float32, matmul_n=64, copy_mb=4, repeats=2)
    assert p.peak_flops > 0 and p.bandwidth > 0 and p.ridge == pytest.approx(p.peak_flops / p.bandwidth)
    assert p.device.startswith("cpu") and p.dtype == "fp32" and p.copy_bytes == 4 * 2**20 and p.matmul_n == 64


def test_compare_outputs_needs_two_runs(small_model) -> None:  # type: ignore[no-untyped-def]
    a = compare_outputs({"static": run_once(small_model, _req(3), "static")})
    assert not a.identical and "nothing was compared" in a.message


def test_every_sweep_honours_the_engine_switch(small_model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """fast=False: no step goes through the accelerator; fast=True: every step does."""
    import kvviz.fast.gpt2_flat

    calls: list[int] = []
    real = kvviz.fast.gpt2_flat.FastGPT2.forward
    monkeypatch.setattr(kvviz.fast.gpt2_flat.FastGPT2, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    sweeps = (
        lambda fast: sweep_ttft(small_model, PROMPT, [4, 8], repeats=1, warm=False, fast=fast),
        lambda fast: sweep_decode(small_model, PROMPT, repeats=1, prompt_len=4, max_context=10, warm=False, fast=fast),
        lambda fast: sweep_short_long(small_model, PROMPT[:3], 12, n_new=3, repeats=1, warm=False, fast=fast),
        lambda fast: sweep_batch(small_model, PROMPT, [1, 2], prompt_len=4, n_new=3, repeats=1, warm=False, fast=fast),
    )
    for sweep in sweeps:
        calls.clear()
        list(sweep(False))
        assert calls == []
        list(sweep(True))
        assert calls
