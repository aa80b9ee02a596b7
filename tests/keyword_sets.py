"""Parametrized cases written as flat keyword sets, turned into ``iter_generate``'s arguments.

Many engine tests run one case under several settings (``dict(cache_kind="paged", kv_block_size=4)``,
``dict(temperature=0.8, seed=3)``) and splat them into a call. ``request_kwargs`` maps such a flat set
one to one onto the API's objects, with no default of its own: ``SamplingParams`` from
greedy/temperature/top_k/top_p/seed/ignore_eos, ``CacheSpec`` from use_cache/cache_kind/kv_block_size/
kv_blocks and the compression fields, ``Beam`` from num_beams and its options, ``Speculative`` from
speculative (with draft_tokens/ngram), ``backend`` from fast; prompt_ids and messages are the prompt. A key
it does not know is passed on unchanged (max_new_tokens, stop, capture, chat, batch_size, ...).
"""
from __future__ import annotations

from typing import Any

from kvviz import Beam, CacheSpec, SamplingParams, Speculative

SAMPLING = {"greedy": "greedy", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed",
            "ignore_eos": "ignore_eos"}
CACHE = {"use_cache": "use_cache", "cache_kind": "kind", "kv_block_size": "block_size", "kv_blocks": "blocks",
         "kv_dtype": "kv_dtype", "window": "window", "sinks": "sinks", "kv_group_size": "group_size",
         "kv_zero_point": "zero_point", "kv_fp8_scale": "fp8_scale", "kv_positions": "positions",
         "track_kv_error": "track_errors"}
BEAM = {"num_beams": "num_beams", "length_penalty": "length_penalty", "early_stopping": "early_stopping",
        "num_return_sequences": "num_return_sequences"}
SPEC = {"speculative": "method", "draft_tokens": "draft_tokens", "ngram": "ngram"}


def request_kwargs(**old: Any) -> dict[str, Any]:
    """``iter_generate``'s keyword arguments for a flat keyword set (see the module docstring)."""
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {"sampling": {}, "cache": {}, "beam": {}, "spec": {}}
    for k, v in old.items():
        if k in ("prompt_ids", "messages"):
            assert "prompt" not in out, "one prompt per case"
            out["prompt"] = v
        elif k == "fast":
            out["backend"] = "fast" if v else "readable"
        else:
            for group, table in (("sampling", SAMPLING), ("cache", CACHE), ("beam", BEAM), ("spec", SPEC)):
                if k in table:
                    groups[group][table[k]] = v
                    break
            else:
                out[k] = v
    if groups["sampling"]:
        out["sampling"] = SamplingParams(**groups["sampling"])
    if groups["cache"]:
        out["cache"] = CacheSpec(**groups["cache"])
    if groups["spec"].get("method") is not None:
        assert groups["beam"].get("num_beams", 1) == 1, "a case runs one strategy"
        out["strategy"] = Speculative(**groups["spec"])
    elif groups["beam"]:
        out["strategy"] = Beam(**{"num_beams": 1, **groups["beam"]})
    return out
