"""A generation request's values: as a caller asks them, and after their checks.

What a caller asks besides the prompt and the sampler: ``CacheSpec`` (the cache), ``Beam`` or
``Speculative`` (the strategy). ``iter_generate(model, prompt, *, sampling=SamplingParams(...),
cache=CacheSpec(...), strategy=Beam(...) | Speculative(...) | None, ...)`` takes them as given;
nothing is checked on creation, because most checks need the model (its context, its memory, its
family). The CLI, the UI's Settings, the sweeps and ``Conversation`` build them.

After the checks, ``ValidRequest`` is what every stream (plain, beam, speculative) runs from.

``GenerateRequest.validate(model)`` (request.py) is the one way to make one: it resolves the prompt
to token rows, the sampler's settings to ``SamplingParams`` and the cache options to a ``KVSpec``,
and refuses anything that cannot run. The streams then read these values and never check again.
Plain values only (no model, no tensors), so this sits low enough for every stream to import.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from kvviz.engine.generation.capture import Capture
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.generation.kv_spec import KVSpec
from kvviz.limits import DEFAULT_KV_BLOCK_SIZE

SPECULATIVE_METHODS = ("prompt_lookup",)  # the drafters speculative decoding knows


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """The KV cache a run keeps: on or off, its kind, a paged pool's shape and a compressed cache.

    The compression fields are ``KVSpec``'s (engine/generation/kv_spec.py), flat here so one object
    says it all: ``CacheSpec(kv_dtype="int4", group_size=32)``, ``CacheSpec(window=64, sinks=4)``.
    A quantized or windowed cache replaces the static one (``kind`` stays "static").
    """

    use_cache: bool = True  # False: every step recomputes the whole sequence (the no-cache lesson)
    kind: str = "static"  # static (preallocated), concat (grows by torch.cat) or paged (blocks from a pool)
    block_size: int = DEFAULT_KV_BLOCK_SIZE  # paged: tokens per block
    blocks: int | None = None  # paged: the pool's blocks (None: enough for every row of the run)
    kv_dtype: str | None = None  # None: rows kept in the model's dtype; else int8 | int4 | fp8
    group_size: int | None = None  # int8/int4: values sharing one scale along head_dim (None: head_dim)
    zero_point: bool = False  # int8/int4: asymmetric, a zero point per group beside the scale
    fp8_scale: str = "tensor"  # fp8: one scale per layer ("tensor") or per layer and KV head ("head")
    window: int | None = None  # keep only the last `window` positions (a ring buffer); None: all
    sinks: int = 0  # with a window: the first `sinks` positions are kept forever (StreamingLLM)
    positions: str | None = None  # RoPE positions once positions are evicted: "cache" | "original" (None: auto)
    track_errors: bool = False  # quantized: measure each write's K/V error (costs a dequantize per write)

    @property
    def kv(self) -> KVSpec:
        """The compressed-cache part, as the caches take it (unresolved: request.kv_spec resolves it).
        The fields mirror KVSpec's, name for name and default for default (a test holds them equal)."""
        return KVSpec(**{f.name: getattr(self, f.name) for f in fields(KVSpec)})


@dataclass(frozen=True)
class Beam:
    """Beam search, transformers' ``generate(num_beams=k, do_sample=False)`` with its meanings.

    ``num_beams=1`` is plain greedy decoding, as in transformers.
    """

    num_beams: int
    length_penalty: float = 1.0  # a finished beam's score is divided by length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never"
    num_return_sequences: int = 1  # the best finished beams returned, 1..num_beams


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding: drafts verified by one forward through the cache."""

    method: str = "prompt_lookup"  # the one drafter: transformers' prompt lookup
    draft_tokens: int = 10  # tokens drafted after a match, verified together
    ngram: int = 2  # the longest n-gram of the tail matched earlier in the text


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
