"""Which strategy stream a request gets: beam search or speculative decoding, checked before any compute.

``iter_generate`` (loop.py) resolves the prompt, the budget and the sampling, then hands a
request with ``num_beams > 1`` or ``speculative=...`` here.
"""
from __future__ import annotations

from typing import Any

from kvviz.engine.strategy.beam import BeamStream, check_beam_request
from kvviz.engine.generation.capture import Capture
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.strategy.speculative import SpeculativeStream, check_speculative_request
from kvviz.errors import KVVizError


def strategy_stream(model: LoadedModel, rows: list[list[int]], text: str, max_new_tokens: int, use_cache: bool,
                    cache_kind: str, params: SamplingParams, stops: tuple[str, ...], capture: Capture | None,
                    batch_size: int, fast: bool, opts: dict[str, Any]) -> BeamStream | SpeculativeStream:
    """Beam search or speculative decoding, their own parameters checked before any compute."""
    if opts["num_beams"] != 1 and opts["speculative"] is not None:
        raise KVVizError("choose beam search (num_beams > 1) or speculative decoding, not both")
    if capture is not None and (capture.ref_layers(model.config.n_layer) or capture.logits):
        raise KVVizError("attention, K/V and logits captures are recorded by plain decoding only")
    common = dict(model=model, prompt_ids=rows[0], prompt_text=text, max_new_tokens=max_new_tokens,
                  use_cache=use_cache, cache_kind=cache_kind, params=params, stop=stops, fast=fast,
                  kv_block_size=opts["kv_block_size"], kv_blocks=opts["kv_blocks"])
    if opts["speculative"] is not None:
        k, n = check_speculative_request(opts["speculative"], opts["draft_tokens"], opts["ngram"], use_cache,
                                         batch_size)
        return SpeculativeStream(**common, draft_tokens=k, ngram=n, ignore_eos=opts["ignore_eos"])  # type: ignore[arg-type]
    k, lp, es, nrs = check_beam_request(model, opts["num_beams"], opts["length_penalty"], opts["early_stopping"],
                                        opts["num_return_sequences"], len(rows[0]) + max_new_tokens, use_cache,
                                        cache_kind, params.greedy, stops, batch_size)
    eos = None if opts["ignore_eos"] else model.tokenizer.eos_token_id  # ignored: no beam ends at EOS
    return BeamStream(**common, num_beams=k, length_penalty=lp, early_stopping=es,  # type: ignore[arg-type]
                      num_return_sequences=nrs, eos_ids=() if eos is None else (eos,))
