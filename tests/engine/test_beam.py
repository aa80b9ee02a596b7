"""Beam search against transformers' ``generate(num_beams=k, do_sample=False)``, and its cache reorders.

Random GPT-2 and Llama models are built and saved by transformers itself, then loaded by kvviz:
the returned sequences must be identical and the scores (transformers' ``sequences_scores``) equal
to float tolerance, for several k, length penalties, early_stopping values, EOS on and off, and
num_return_sequences.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kvviz.engine.api import generate
from kvviz.engine.loading.loader import LoadedModel, NoTokenizer
from kvviz.engine.loaded import load_model
from kvviz.errors import KVVizError
from accel_checks import randomize
from kvviz import Beam, CacheSpec
from keyword_sets import request_kwargs

transformers = pytest.importorskip("transformers")

VOCAB = 96
PROMPT = [5, 17, 3, 88, 42, 9, 61, 30]
N_NEW = 12


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, LoadedModel]]:
    """family -> (transformers model, kvviz model loaded from the folder transformers saved)."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None))
    out = {}
    for name, hf in (("gpt2", gpt2), ("llama", llama)):
        randomize(hf, 1)
        hf.eval()
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = (hf, load_model(Path(folder), device="cpu"))
    return out


def _with_eos(kv: LoadedModel, eos: int | None) -> LoadedModel:
    return dataclasses.replace(kv, tokenizer=NoTokenizer(kv.config.vocab_size, eos))


def _hf_beams(hf: Any, k: int, lp: float, es: bool | str, nrs: int, eos: int | None) -> tuple[list[list[int]], list[float]]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT]), num_beams=k, do_sample=False, max_new_tokens=N_NEW, min_new_tokens=0,
                          length_penalty=lp, early_stopping=es, num_return_sequences=nrs, eos_token_id=eos,
                          pad_token_id=eos if eos is not None else 0, output_scores=True,
                          return_dict_in_generate=True)
    return out.sequences[:, len(PROMPT):].tolist(), out.sequences_scores.tolist()


CASES = [  # (k, length_penalty, early_stopping, num_return_sequences)
    (2, 1.0, False, 1),
    (3, 0.5, True, 2),
    (4, 2.0, "never", 4),
    (3, -1.0, "never", 1),
    (5, 1.0, False, 3),
    # Large penalties: 12 ** 30 stays inside float32, so the scores are tiny but ranked; from 3 ** 100
    # on float32 saturates (every score -0.0, ties ranked by candidate order, as there).
    (3, 30.0, "never", 3),
    (3, 100.0, False, 3),
    (4, 100.0, "never", 2),
]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}-lp{c[1]}-es{c[2]}-n{c[3]}")
def test_beams_equal_transformers(pairs: dict[str, tuple[Any, LoadedModel]], family: str,
                                  case: tuple[int, float, bool | str, int]) -> None:
    hf, kv = pairs[family]
    k, lp, es, nrs = case
    free = generate(kv, prompt=PROMPT, max_new_tokens=N_NEW, strategy=Beam(num_beams=k))
    # An EOS the beams really meet: the best continuation at step 2 of a run without one.
    eos_pick = free.beams.steps[2].candidates[0].token_id
    for eos in (None, eos_pick):
        want_ids, want_scores = _hf_beams(hf, k, lp, es, nrs, eos)
        run = generate(_with_eos(kv, eos), prompt=PROMPT, max_new_tokens=N_NEW,
                       strategy=Beam(num_beams=k, length_penalty=lp, early_stopping=es, num_return_sequences=nrs))
        got = run.beams
        assert len(got.sequences) == nrs
        for seq, want in zip(got.sequences, want_ids):
            assert list(seq) == want[: len(seq)]
            assert all(t == want[-1] for t in want[len(seq):])  # transformers pads the shorter beams
        assert got.scores == pytest.approx(want_scores, abs=2e-5, rel=1e-5)
        assert run.generated_ids == list(got.sequences[0])
        if eos is not None:
            ended = [c for s in got.steps for c in s.candidates if c.status == "finished" and c.token_id == eos]
            assert ended, "the chosen EOS never ended a beam: the EOS path went untested"


@pytest.mark.parametrize("kind", ["static", "concat"])
def test_reorders_match_parents_and_count_bytes(pairs: dict[str, tuple[Any, LoadedModel]], kind: str) -> None:
    """Each step's reorder index is the kept candidates' parents, and moves pos x rows x bytes per row."""
    _, kv = pairs["llama"]
    k = 3
    run = generate(kv, prompt=PROMPT, max_new_tokens=6, cache=CacheSpec(kind=kind), strategy=Beam(num_beams=k))
    c = kv.config
    per_row = c.n_layer * 2 * c.kv_heads * c.head_dim * 4  # fp32 K and V, every layer
    steps = run.beams.steps
    assert steps[0].rows_before == 1 and steps[0].parents == (0,) * k  # the prompt row fanned out
    assert steps[0].bytes_moved == len(PROMPT) * k * per_row
    for s in steps[:-1]:
        kept = sorted((c.row, c.parent) for c in s.candidates if c.status == "kept")
        assert [r for r, _ in kept] == list(range(k))
        if s.step:
            assert tuple(p for _, p in kept) == s.parents
        assert s.bytes_moved == s.cache_len * k * per_row
    assert steps[-1].bytes_moved == 0  # nothing is fed after the last step
    assert run.events[-1].cache_bytes_used == (len(PROMPT) + len(steps) - 1) * k * per_row
    # Same beams with every cache kind and without a cache; a paged cache and no cache move nothing
    # (the paged one shares blocks by reference and copies one block on the next write instead).
    for other in (dict(use_cache=False), dict(cache_kind="paged", kv_block_size=4)):
        plain = generate(kv, **request_kwargs(prompt_ids=PROMPT, max_new_tokens=6, num_beams=k, **other))
        assert plain.beams.sequences == run.beams.sequences
        # The scores are float32 sums of N log-softmaxes, each from logits the other path computes with
        # other matmul shapes (the whole prefix per step vs one row): the same numbers in another
        # summation order, so a few float32 ulps apart (AVX-512 vs AVX2 vs FMA kernels block the sums
        # differently). log-softmax moves at most 2 max|d logit|, and 6 steps add 6 of those: about
        # 1e-6 on scores near -2.4 (seen: -2.4176409 vs -2.4176414). The tolerance is the one
        # test_beams_equal_transformers uses for the same float32 sums.
        assert plain.beams.scores == pytest.approx(run.beams.scores, abs=2e-5, rel=1e-5)
        assert all(s.bytes_moved == 0 for s in plain.beams.steps)


def test_one_beam_step_kept_rows_hold_their_parents_cache(make_llama: Any) -> None:
    """After a reorder, row r's K/V equal the old row parents[r]'s: checked on the cache itself."""
    from kvviz.engine.kvcache.factory import make_cache

    m = make_llama()
    cache = make_cache("static", m.config, 3, "cpu", torch.float32)
    x = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        m.model(x, torch.arange(5), cache)
    cache.advance(5)
    before = [t.clone() for t in (cache.layer(0)[0], cache.layer(1)[1])]
    moved = cache.reorder(torch.tensor([2, 2, 0]))
    after = (cache.layer(0)[0], cache.layer(1)[1])
    for b, a in zip(before, after):
        assert torch.equal(a, b[[2, 2, 0]])
    assert moved == cache.bytes_used


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=0), "num_beams must be an integer from 1 to 64"),
    (dict(num_beams=2, temperature=0.7), "sampling with num_beams > 1 is not supported"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences must be from 1 to num_beams (2)"),
    (dict(num_beams=2, early_stopping="soon"), "early_stopping must be true, false or never"),
    (dict(num_beams=2, length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(num_beams=2, stop=["x"]), "stop strings are not supported with beam search"),
])
def test_bad_beam_requests(small_model: LoadedModel, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(KVVizError, match=message.replace("(", r"\(").replace(")", r"\)")):
        generate(small_model, **request_kwargs(prompt_ids=[1, 2, 3], max_new_tokens=4, **kwargs))


def test_beams_over_memory_are_refused(small_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvviz.engine.generation.request as beam  # the beam check lives with the request checks

    monkeypatch.setattr(beam, "available_memory", lambda device: 100_000)  # 100 kB free
    with pytest.raises(KVVizError, match=r"64 beams x 64 positions need .* of KV cache \(static\), more than 80%"):
        generate(small_model, prompt=[1, 2, 3], max_new_tokens=4, strategy=Beam(num_beams=64))
    generate(small_model, prompt=[1, 2, 3], max_new_tokens=4, strategy=Beam(num_beams=2))  # 2 x 64 x 512 B fits


@pytest.mark.parametrize("lp", [2000.0, 1e308, -1e308])
@pytest.mark.parametrize("es", [False, "never"])
def test_penalties_past_a_double_do_not_overflow(pairs: dict[str, tuple[Any, LoadedModel]], lp: float,
                                                 es: bool | str) -> None:
    """transformers computes ``length ** penalty`` in Python floats: 2 ** 2000 raises OverflowError
    there. kvviz saturates it to inf (the -0.0 score float32 already gives from 3.4e38 on)."""
    hf, kv = pairs["llama"]
    if lp > 0:
        with pytest.raises(OverflowError):
            _hf_beams(hf, 3, lp, es, 2, None)
    run = generate(kv, prompt=PROMPT, max_new_tokens=N_NEW,
                   strategy=Beam(num_beams=3, length_penalty=lp, early_stopping=es, num_return_sequences=2))
    assert len(run.beams.scores) == 2 and not any(math.isnan(s) for s in run.beams.scores)
    if lp > 0:  # every beam ran to the length limit; every score saturated to -0.0
        assert run.beams.scores == (0.0, 0.0) and all(len(s) == N_NEW for s in run.beams.sequences)


def test_length_norm_saturates() -> None:
    from kvviz.engine.strategy.beam import length_norm

    assert length_norm(12, 30.0) == 12.0 ** 30.0  # transformers' own Python float, to the bit
    assert length_norm(2, 2000.0) == math.inf and length_norm(1, 1e308) == 1.0
    assert length_norm(2, -2000.0) == 0.0 and length_norm(3, -1e308) == 0.0
