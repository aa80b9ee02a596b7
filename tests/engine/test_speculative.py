"""Speculative decoding by prompt lookup: greedy equals plain greedy, the rollback leaves the cache as a
never-speculated one, seeded sampling is reproducible and keeps the target distribution."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from kvviz.engine.core.step import run_step
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.api import generate, iter_generate
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.strategy.speculative import prompt_lookup, verify_sampled
from kvviz.errors import KVVizError
from kvviz import CacheSpec, Speculative
from keyword_sets import request_kwargs

# A prompt that repeats itself, so the drafter finds matches (and the models' loops give more).
PROMPT = [5, 17, 3, 88, 42, 9, 61, 30, 7, 5, 17, 3, 88, 42, 9, 61, 30, 7, 5, 17]


@pytest.fixture(params=["gpt2", "llama-gqa"])
def model(request: pytest.FixtureRequest, make_model: Callable[..., LoadedModel],
          make_llama: Callable[..., LoadedModel]) -> LoadedModel:
    return make_model() if request.param == "gpt2" else make_llama(n_head=4, n_kv_head=1)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "readable"])
@pytest.mark.parametrize("kind", ["static", "concat", "paged"])
def test_speculative_greedy_equals_greedy(model: LoadedModel, kind: str, fast: bool) -> None:
    want = generate(model, prompt=PROMPT, max_new_tokens=40, backend="fast" if fast else "readable",
                    cache=CacheSpec(kind=kind)).generated_ids
    for k, n in ((4, 2), (10, 1), (1, 3)):
        run = generate(model, prompt=PROMPT, max_new_tokens=40, backend="fast" if fast else "readable",
                       cache=CacheSpec(kind=kind),
                       strategy=Speculative(method="prompt_lookup", draft_tokens=k, ngram=n))
        assert run.generated_ids == want, (k, n)
        spec = run.speculation
        assert spec.tokens == 40 and spec.forwards_saved == spec.tokens - spec.forwards
        assert spec.accepted > 0 and spec.accepted < spec.drafted  # both acceptance and rollback happened
        for s in spec.steps[1:]:
            assert len(s.rolled_back) == len(s.drafted) - s.accepted
            assert s.emitted[:s.accepted] == s.drafted[:s.accepted]
        assert [e.position for e in run.events] == list(range(len(PROMPT), len(PROMPT) + 40))
        assert sum(e.input_len for e in run.events) == len(PROMPT) + sum(len(s.drafted) + 1 for s in spec.steps[1:])


@pytest.mark.parametrize("kind", ["static", "concat", "paged"])
def test_rollback_leaves_the_cache_of_a_never_speculated_run(model: LoadedModel, kind: str) -> None:
    stream = iter_generate(model, prompt=PROMPT, max_new_tokens=30, cache=CacheSpec(kind=kind),
                           strategy=Speculative(method="prompt_lookup", draft_tokens=6, ngram=1))
    ids = [e.token_id for e in stream]
    spec, got = stream.run.speculation, stream.cache
    assert sum(len(s.rolled_back) for s in spec.steps) > 0
    ref = make_cache(kind, model.config, 1, "cpu", torch.float32)
    seq = torch.tensor([PROMPT + ids[:-1]])  # the last token is sampled, not yet fed
    with torch.inference_mode():
        for t in range(seq.shape[1]):  # one token at a time: no speculation at all
            run_step(model, ref, seq[:, t: t + 1], torch.tensor([t]), backend="readable", hash_ids=False)
    assert got.pos == ref.pos == len(PROMPT) + 29
    assert got.bytes_used == ref.bytes_used
    if kind != "paged":  # a paged pool's size is the run's choice (room for the drafts), not the tokens'
        assert got.bytes_allocated == ref.bytes_allocated
    else:  # the same blocks held, filled and hashed; nothing leaked to the rolled-back positions
        a, b = got.stats(), ref.stats()
        assert (a.blocks_used, a.bytes_held, a.bytes_filled, a.fragmentation_bytes, a.blocks_shared) == \
            (b.blocks_used, b.bytes_held, b.bytes_filled, b.fragmentation_bytes, b.blocks_shared)
        assert a.blocks_used + a.blocks_free + a.blocks_cached == a.num_blocks  # every block accounted for
        assert len(got.tables[0]) == len(ref.tables[0])
        got.pool.blocks.check()
    for i in range(model.config.n_layer):
        for a, b in zip(got.layer(i), ref.layer(i)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    top = max(p for s in spec.steps for p in s.rolled_back) + 1
    if kind == "static" and top > got.pos:  # positions rolled back and never rewritten hold nothing
        assert all(bool((t[:, :, got.pos: top] == 0).all()) for t in (*got.k, *got.v))


def test_seeded_speculative_sampling_is_reproducible(make_llama: Callable[..., LoadedModel]) -> None:
    m = make_llama()
    kw: dict[str, Any] = dict(prompt_ids=PROMPT, max_new_tokens=30, temperature=0.8, speculative="prompt_lookup",
                              draft_tokens=4, ngram=1)
    a, b = generate(m, **request_kwargs(seed=3, **kw)), generate(m, **request_kwargs(seed=3, **kw))
    def what(r: Any) -> list[tuple]:  # everything but the timings
        return [(s.drafted, s.accepted, s.emitted, s.rolled_back) for s in r.speculation.steps]

    assert a.generated_ids == b.generated_ids and what(a) == what(b)
    assert a.speculation.drafted > 0
    assert generate(m, **request_kwargs(seed=4, **kw)).generated_ids != a.generated_ids


def test_rejection_rule_keeps_the_target_distribution() -> None:
    """A 4-token vocabulary, drafts (2, 0): the first token is distributed as p0, and after an
    accepted first draft the second is distributed as p1, as plain sampling would give."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.1, 0.3], [0.25, 0.25, 0.25, 0.25]])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(4)
    second = torch.zeros(4)
    accepted_first = 0
    for _ in range(n):
        a, nxt = verify_sampled(p, [2, 0], gen)
        out = [2, 0][:a] + [nxt]
        first[out[0]] += 1
        if a >= 1:
            accepted_first += 1
            second[out[1]] += 1
    # 3 standard errors of a frequency at n = 20000 (p(1-p)/n <= 0.25/n): 0.0106
    torch.testing.assert_close(first / n, p[0], atol=0.011, rtol=0)
    torch.testing.assert_close(second / accepted_first, p[1], atol=0.02, rtol=0)
    assert abs(accepted_first / n - 0.3) < 0.011  # the draft is accepted with probability p0(2)


def test_prompt_lookup_matches_transformers() -> None:
    pytest.importorskip("transformers")
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        L = int(torch.randint(2, 40, (1,), generator=g))
        ids = torch.randint(0, 6, (L,), generator=g).tolist()
        k, n = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        eos = 5 if trial % 2 else None
        ref = PromptLookupCandidateGenerator(eos_token_id=None if eos is None else torch.tensor([eos]),
                                             num_output_tokens=k, max_matching_ngram_size=n, max_length=10_000)
        cand, _ = ref.get_candidates(torch.tensor([ids]))
        draft, _ = prompt_lookup(ids, n, k, () if eos is None else (eos,))
        assert draft == cand[0, L:].tolist(), (ids, k, n)


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative="medusa"), "speculative must be one of prompt_lookup"),
    (dict(speculative="prompt_lookup", draft_tokens=0), "draft_tokens must be an integer from 1 to 64"),
    (dict(speculative="prompt_lookup", ngram=0), "ngram must be an integer from 1 to 16"),
    (dict(speculative="prompt_lookup", use_cache=False), "it needs use_cache=True"),
    (dict(speculative="prompt_lookup", batch_size=2), "batch_size 1"),
])
def test_bad_speculative_requests(small_model: LoadedModel, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(KVVizError, match=message):
        generate(small_model, **request_kwargs(prompt_ids=[1, 2, 3], max_new_tokens=4, **kwargs))


def test_smollm2_speculative_greedy_on_repetitive_text(smollm2: LoadedModel) -> None:
    text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
    want = generate(smollm2, prompt=text, max_new_tokens=16).generated_ids
    run = generate(smollm2, prompt=text, max_new_tokens=16,
                   strategy=Speculative(method="prompt_lookup", draft_tokens=8, ngram=2))
    assert run.generated_ids == want
    assert run.speculation.accepted >= 4 and run.speculation.forwards_saved >= 4


def test_smollm2_page_default_drafts_wrong_and_rolls_back(smollm2: LoadedModel) -> None:
    """The speculative tab is "the cache rolled back": its defaults (prompt, draft tokens, n-gram, new
    tokens), run as the page runs them, reject drafts and roll the cache back, and still save
    forwards. (Issue 36: the old default, copy_text, accepted 42 of 42 and rolled back 0 positions.)"""
    from kvviz.measure.spec_bench import PROMPTS, compare_runs
    from kvviz.ui.pages.decoding.decoding import SPEC_DEFAULTS, SPEC_PROMPTS

    which = next(iter(SPEC_PROMPTS))
    cmp, plain, spec = compare_runs(smollm2, PROMPTS[which], SPEC_DEFAULTS["new"], 1, SPEC_DEFAULTS["k"],
                                    SPEC_DEFAULTS["ngram"], None, ignore_eos=True)
    sp = spec.speculation
    assert cmp.same_tokens and cmp.tokens == SPEC_DEFAULTS["new"]
    rejected = sum(len(x.drafted) - x.accepted for x in sp.steps)
    rolled_back = sum(len(x.rolled_back) for x in sp.steps)
    assert rejected >= 1 and rolled_back > 0 and cmp.accepted < cmp.drafted, (rejected, rolled_back, cmp)
    assert cmp.forwards_saved > 0  # it still wins forwards: the lesson is the rollback, not a loss


def test_smollm2_copying_a_paragraph_accepts_nearly_every_draft(smollm2: LoadedModel) -> None:
    """copy_text: with EOS ignored both runs make all 48 tokens, the same ones, and nearly every draft
    is accepted (48 tokens in at most 8 forwards instead of 48)."""
    from kvviz.measure.spec_bench import PROMPTS, compare_runs

    cmp, plain, spec = compare_runs(smollm2, PROMPTS["copy_text"], 48, 1, 10, 2, None, ignore_eos=True)
    assert cmp.same_tokens and cmp.tokens == len(plain.generated_ids) == 48
    assert plain.text.startswith("The KV cache keeps the keys and values of every token")
    assert cmp.forwards <= 8 and cmp.accepted >= 0.9 * cmp.drafted, cmp


def test_compare_runs_ignore_eos_runs_both_to_n(make_llama: Callable[..., LoadedModel]) -> None:
    """With an EOS the model emits early, ignore_eos makes plain and speculative both run all N."""
    import dataclasses

    from kvviz.engine.tokenize.tokenizer import ByteTokenizer
    from kvviz.measure.spec_bench import compare_runs

    m = make_llama()
    ref = generate(m, prompt="abcabcabc", max_new_tokens=12).generated_ids
    eos = dataclasses.replace(m, tokenizer=ByteTokenizer(256, eos_token_id=ref[2]))
    cmp, plain, spec = compare_runs(eos, "abcabcabc", 12, 1, chat=False, ignore_eos=True)
    assert plain.generated_ids == spec.generated_ids == ref and cmp.tokens == 12
    cmp, plain, _ = compare_runs(eos, "abcabcabc", 12, 1, chat=False)
    assert plain.stop_reason == "eos" and len(plain.generated_ids) <= 3


def test_cli_json_carries_beams_and_speculation(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvviz.cli.main import main

    base = ["generate", "--model", "random:tiny", "--prompt-ids", "1,2,3,1,2,3,1,2", "--max-new-tokens", "6", "--json"]
    assert main([*base, "--num-beams", "3", "--num-return-sequences", "2", "--early-stopping", "never",
                 "--length-penalty", "0.5"]) == 0
    beams = json.loads(capsys.readouterr().out)["beams"]
    assert beams["num_beams"] == 3 and beams["early_stopping"] == "never" and beams["length_penalty"] == 0.5
    assert len(beams["sequences"]) == 2 and beams["sequences"][0]["score"] >= beams["sequences"][1]["score"]
    assert main([*base, "--speculative", "prompt_lookup", "--draft-tokens", "3", "--ngram", "1"]) == 0
    obj = json.loads(capsys.readouterr().out)
    spec = obj["speculation"]
    assert spec["tokens"] == len(obj["generated_ids"]) == 6
    assert {"drafted", "accepted", "rolled_back"} <= set(spec["steps"][1])
    assert spec["forwards_saved"] == spec["tokens"] - spec["forwards"]
    with pytest.raises(SystemExit) as e:
        main([*base, "--num-beams", "2", "--temperature", "0.7"])
    assert e.value.code == 2 and "sampling with num_beams > 1 is not supported" in capsys.readouterr().err
