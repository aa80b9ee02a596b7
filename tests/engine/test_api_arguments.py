"""Issue 37, class 4: the Python API checks its arguments as the CLI does, with one KVVizError each.

Before: ``kvviz.generate(model, prompt=b"hello")`` raised a raw AttributeError from the tokenizer,
a prompt of ids ``[1.5]`` ran as token 1, ``stop="x"`` stopped at any "x" character one by one, and
``temperature="hot"`` raised a bare ValueError.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest

import kvviz
from kvviz.errors import KVVizError
from kvviz import Beam, CacheSpec, SamplingParams, Speculative


@pytest.fixture(scope="module")
def tiny() -> kvviz.LoadedModel:
    return kvviz.load_model("random:tiny", device="cpu")


BAD: list[tuple[Callable[[], dict[str, Any]], str]] = [  # built inside the check: SamplingParams checks itself
    (lambda: dict(prompt=b"hello"), "prompt must be text (a str), got bytes: decode it first"),
    (lambda: dict(prompt=bytearray(b"hi")), "prompt must be text (a str), got bytes"),
    (lambda: dict(prompt=5), "the prompt must be text, token ids or chat messages, got an int: 5"),
    (lambda: dict(prompt=["a"]), "prompt ids must be integers (token ids); position 0 holds 'a' (a str)"),
    (lambda: dict(prompt="a\ud800c"), "prompt holds a lone surrogate (U+D800) at character 2"),
    (lambda: dict(prompt="x" * 10 + "\udfff"), "lone surrogate (U+DFFF) at character 11"),
    (lambda: dict(prompt=[1.5]), "prompt ids must be integers (token ids); position 0 holds 1.5 (a float)"),
    (lambda: dict(prompt=[3, True]), "position 1 holds True (a bool)"),
    (lambda: dict(prompt=[[1, 2], [3, 2.0]]), "row 1, position 1 holds 2.0 (a float)"),
    (lambda: dict(prompt=2.5), "the prompt must be text, token ids or chat messages, got a float: 2.5"),
    (lambda: dict(prompt=[300]), "prompt ids must be in [0, 256)"),
    (lambda: dict(prompt="hi", stop="x"), "stop must be a list of strings, got a str: write stop=['x']"),
    (lambda: dict(prompt="hi", stop=[5]), "each stop string must be text (a str), got an int"),
    (lambda: dict(prompt="hi", sampling=SamplingParams(temperature="hot")), "temperature must be a number (got 'hot')"),
    (lambda: dict(prompt="hi", sampling=SamplingParams(top_p="all")), "top_p must be a number"),
    (lambda: dict(prompt="hi", sampling=SamplingParams(ignore_eos="no")), "ignore_eos must be True or False (got 'no')"),
    (lambda: dict(prompt="hi", strategy=Beam(2, length_penalty=float("nan"))),
     "length_penalty must be a finite number (got nan)"),
    (lambda: dict(prompt="hi", strategy=Speculative(draft_tokens=1.5)),
     "draft_tokens must be an integer from 1 to 64 (got 1.5)"),
    (lambda: dict(prompt="hi", strategy=Speculative(ngram=0)), "ngram must be an integer from 1 to 16 (got 0)"),
    (lambda: dict(prompt="hi", strategy=Beam(2.5)), "num_beams must be an integer from 1 to 64 (got 2.5)"),
    (lambda: dict(prompt="hi", cache=CacheSpec(window=1.5)), "window must be an integer"),
    (lambda: dict(prompt="hi", cache=CacheSpec(sinks=-1)), "sinks must be an integer from 0 to 1,024 (got -1)"),
    (lambda: dict(prompt="hi", cache=CacheSpec(block_size=16.0)),
     "kv_block_size must be an integer from 1 to 4,096 (got 16.0)"),
    (lambda: dict(prompt="hi", cache=CacheSpec(use_cache="no")), "use_cache must be True or False (got 'no')"),
    (lambda: dict(prompt="hi", backend=1), "backend must be one of fast, readable (got 1)"),
    (lambda: dict(prompt="hi", chat="yes"), "chat must be True or False"),
    (lambda: dict(prompt=[{"role": "user", "content": "a\ud83dz"}]), "a message's content holds a lone surrogate (U+D83D)"),
    # The request's objects are the kinds the API names: a dict or a string is named, never run.
    (lambda: dict(prompt="hi", sampling={"temperature": 0.8}), "sampling must be a SamplingParams"),
    (lambda: dict(prompt="hi", cache="paged"), "cache must be a CacheSpec, e.g. CacheSpec(kind='paged') (got str 'paged')"),
    (lambda: dict(prompt="hi", strategy="beam"), "strategy must be Beam(num_beams), Speculative() or None (got str"),
]


@pytest.mark.parametrize("kw, needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments_raise_one_clear_error(tiny: kvviz.LoadedModel, kw: Callable[[], dict[str, Any]],
                                             needle: str) -> None:
    with pytest.raises(KVVizError) as e:
        kvviz.generate(tiny, max_new_tokens=2, **kw())
    assert needle in str(e.value)
    assert type(e.value) is KVVizError  # not a bare ValueError/TypeError/AttributeError


def test_good_arguments_of_other_integer_types_still_run(tiny: kvviz.LoadedModel) -> None:
    """Ids from numpy or a tensor are integers too; a tuple of stops is a list of strings."""
    import numpy as np
    import torch

    ids = [5, 6, 7]
    want = kvviz.generate(tiny, prompt=ids, max_new_tokens=3).generated_ids
    assert kvviz.generate(tiny, prompt=np.array(ids), max_new_tokens=3).generated_ids == want
    assert kvviz.generate(tiny, prompt=torch.tensor(ids), max_new_tokens=3).generated_ids == want
    assert kvviz.generate(tiny, prompt=ids, max_new_tokens=3, stop=("zzz",)).generated_ids == want


def test_the_cli_refuses_a_lone_surrogate_too(capsys: pytest.CaptureFixture[str]) -> None:
    """argv bytes that are not UTF-8 arrive as surrogates (surrogateescape): one error line, no traceback."""
    from kvviz.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "random:tiny", "--prompt", "a\udcffb", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "prompt holds a lone surrogate (U+DCFF) at character 2" in err, err
