"""A generation request after its checks: what every stream (plain, beam, speculative) runs from.

``GenerateRequest.validate(model)`` (request.py) is the one way to make one: it resolves the prompt
to token rows, the sampler's settings to ``SamplingParams`` and the cache options to a ``KVSpec``,
and refuses anything that cannot run. The streams then read these values and never check again.
Plain values only (no model, no tensors), so this sits low enough for every stream to import.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvviz.engine.generation.capture import Capture
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.kvcache.kv_spec import KVSpec


@dataclass(frozen=True)
class BeamOptions:
    """Beam search's own settings, checked (transformers' names and meanings)."""

    num_beams: int
    length_penalty: float
    early_stopping: bool | str  # True, False or "never"
    num_return_sequences: int
    eos_ids: tuple[int, ...]  # () when EOS is ignored: no beam ends there


@dataclass(frozen=True)
class SpecOptions:
    """Speculative decoding's own settings, checked (prompt lookup is the one drafter)."""

    draft_tokens: int
    ngram: int


@dataclass(frozen=True)
class ValidRequest:
    """Every value a stream needs, resolved and checked; ``beam`` or ``spec`` picks a strategy."""

    rows: tuple[tuple[int, ...], ...]  # (B, N): the prompt's token rows, equal lengths
    text: str  # row 0's prompt text ("" for ids without a tokenizer)
    max_new_tokens: int
    use_cache: bool
    cache_kind: str  # static, concat or paged
    params: SamplingParams
    stop: tuple[str, ...]  # stop strings, empty ones dropped
    capture: Capture
    fast: bool  # run the model's accelerator (kvviz.fast) where it has one
    kv_block_size: int  # tokens per block of a paged cache
    kv_blocks: int | None  # a paged cache's pool (None: enough for the run)
    kv: KVSpec  # a quantized or windowed cache when active, replacing the static one
    ignore_eos: bool  # EOS is an ordinary token: the run goes to max_new_tokens (vLLM's name)
    beam: BeamOptions | None = None  # beam search
    spec: SpecOptions | None = None  # speculative decoding

    @property
    def batch_size(self) -> int:
        return len(self.rows)
