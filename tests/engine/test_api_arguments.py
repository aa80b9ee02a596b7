"""Issue 37, class 4: the Python API checks its arguments as the CLI does, with one KVVizError each.

Before: ``kvviz.generate(model, prompt=b"hello")`` raised a raw AttributeError from the tokenizer,
``prompt_ids=[1.5]`` ran as token 1, ``stop="x"`` stopped at any "x" character one by one, and
``temperature="hot"`` raised a bare ValueError.
"""
from __future__ import annotations

from typing import Any

import pytest

import kvviz
from kvviz.errors import KVVizError


@pytest.fixture(scope="module")
def tiny() -> kvviz.LoadedModel:
    return kvviz.load_model("random:tiny", device="cpu")


BAD: list[tuple[dict[str, Any], str]] = [
    (dict(prompt=b"hello"), "prompt must be text (a str), got bytes: decode it first"),
    (dict(prompt=bytearray(b"hi")), "prompt must be text (a str), got bytes"),
    (dict(prompt=5), "prompt must be text (a str), got an int: 5"),
    (dict(prompt=["a"]), "prompt must be text (a str), got a list"),
    (dict(prompt="a\ud800c"), "prompt holds a lone surrogate (U+D800) at character 2"),
    (dict(prompt="x" * 10 + "\udfff"), "lone surrogate (U+DFFF) at character 11"),
    (dict(prompt_ids=[1.5]), "prompt_ids must be integers (token ids); position 0 holds 1.5 (a float)"),
    (dict(prompt_ids=[3, True]), "position 1 holds True (a bool)"),
    (dict(prompt_ids=[[1, 2], [3, 2.0]]), "row 1, position 1 holds 2.0 (a float)"),
    (dict(prompt_ids="123"), "prompt_ids must be a list of integer token ids, got a str"),
    (dict(prompt_ids=b"\x01\x02"), "prompt_ids must be a list of integer token ids, got a bytes"),
    (dict(prompt_ids=[300]), "prompt ids must be in [0, 256)"),
    (dict(prompt="hi", stop="x"), "stop must be a list of strings, got a str: write stop=['x']"),
    (dict(prompt="hi", stop=[5]), "each stop string must be text (a str), got an int"),
    (dict(prompt="hi", temperature="hot"), "temperature must be a number (got 'hot')"),
    (dict(prompt="hi", top_p="all"), "top_p must be a number"),
    (dict(prompt="hi", length_penalty=float("nan")), "length_penalty must be a finite number (got nan)"),
    (dict(prompt="hi", draft_tokens=1.5), "draft_tokens must be an integer from 1 to 64 (got 1.5)"),
    (dict(prompt="hi", ngram=0), "ngram must be an integer from 1 to 16 (got 0)"),
    (dict(prompt="hi", num_beams=2.5), "num_beams must be an integer from 1 to 64 (got 2.5)"),
    (dict(prompt="hi", window=1.5), "window must be an integer"),
    (dict(prompt="hi", sinks=-1), "sinks must be an integer from 0 to 1,024 (got -1)"),
    (dict(prompt="hi", kv_block_size=16.0), "kv_block_size must be an integer from 1 to 4,096 (got 16.0)"),
    (dict(prompt="hi", use_cache="no"), "use_cache must be True or False (got 'no')"),
    (dict(prompt="hi", fast=1), "fast must be True or False (got 1)"),
    (dict(prompt="hi", chat="yes"), "chat must be True or False"),
    (dict(messages=[{"role": "user", "content": "a\ud83dz"}]), "a message's content holds a lone surrogate (U+D83D)"),
]


@pytest.mark.parametrize("kw, needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments_raise_one_clear_error(tiny: kvviz.LoadedModel, kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(KVVizError) as e:
        kvviz.generate(tiny, max_new_tokens=2, **kw)
    assert needle in str(e.value)
    assert type(e.value) is KVVizError  # not a bare ValueError/TypeError/AttributeError


def test_good_arguments_of_other_integer_types_still_run(tiny: kvviz.LoadedModel) -> None:
    """Ids from numpy or a tensor are integers too; a tuple of stops is a list of strings."""
    import numpy as np
    import torch

    ids = [5, 6, 7]
    want = kvviz.generate(tiny, prompt_ids=ids, max_new_tokens=3).generated_ids
    assert kvviz.generate(tiny, prompt_ids=np.array(ids), max_new_tokens=3).generated_ids == want
    assert kvviz.generate(tiny, prompt_ids=torch.tensor(ids), max_new_tokens=3).generated_ids == want
    assert kvviz.generate(tiny, prompt_ids=ids, max_new_tokens=3, stop=("zzz",)).generated_ids == want


def test_the_cli_refuses_a_lone_surrogate_too(capsys: pytest.CaptureFixture[str]) -> None:
    """argv bytes that are not UTF-8 arrive as surrogates (surrogateescape): one error line, no traceback."""
    from kvviz.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "random:tiny", "--prompt", "a\udcffb", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "prompt holds a lone surrogate (U+DCFF) at character 2" in err, err
