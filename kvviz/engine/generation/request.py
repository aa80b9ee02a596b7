"""A generation request and the checks it passes before any compute: the prompt (text, ids, a
batch of ids or a chat), the sampler's settings, the context budget, a paged pool's shape, a
compressed-cache request and a strategy's own parameters (beam search's and speculative decoding's
checks live here, not beside their streams, so generation/ never imports strategy/). Each failure
is a KVVizError that says what to change; nothing here computes with a tensor.

``GenerateRequest`` is ``iter_generate``'s keywords (the same names, order and defaults: a test holds
them equal), holding the caller's own objects (``SamplingParams``, ``CacheSpec``, ``Beam`` or
``Speculative``); ``validate(model)`` runs every check once, in one order, and returns the
``ValidRequest`` the streams run from.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import torch

from kvviz.engine.generation.arg_checks import check_arguments, check_prompt_ids
from kvviz.engine.generation.capture import Capture
from kvviz.engine.generation.valid_request import SPECULATIVE_METHODS, Beam, BeamOptions, CacheSpec, Speculative, \
    SpecOptions, ValidRequest
from kvviz.engine.kvcache.factory import KINDS as CACHE_KINDS
from kvviz.engine.tokenize.chat_template import chat_prompt
from kvviz.engine.generation.kv_spec import KVSpec, resolve
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.kvcache.paged_cache import blocks_for
from kvviz.engine.kvcache.paged_pool import config_groups, pool_blocks
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.errors import KVVizError
from kvviz.limits import MAX_BEAMS, MAX_DRAFT, MAX_KV_BLOCK_SIZE, MAX_NGRAM  # shared with the CLI's options
from kvviz.units import fmt_bytes, kv_bytes_per_token

MAX_PROMPT_CHARS = 100_000  # refuse absurd pastes before tokenizing them
MAX_BATCH = 64  # rows of one plain run (the same prompt, or equal-length rows of ids)
MEMORY_SHARE = 0.8  # refuse a cache (beams, a paged pool) that would take more than this share of free memory
BACKENDS = ("fast", "readable")  # the accelerator (kvviz.fast) where the model has one, or the readable model

# A prompt: text, one row of token ids, equal-length rows of ids (a batch), or chat messages.
Prompt = Union[str, Sequence[int], Sequence[Sequence[int]], Sequence[Mapping[str, str]]]


def kv_spec(model: LoadedModel, kv_dtype: str | None = None, window: int | None = None, sinks: int = 0,
            group_size: int | None = None, zero_point: bool = False, fp8_scale: str = "tensor",
            positions: str | None = None, track_errors: bool = False) -> KVSpec:
    """The compressed-cache request for ``model``, checked (a KVVizError names what cannot work)."""
    c = model.config
    family = getattr(c, "model_type", "gpt2")
    own = getattr(c, "sliding_window", None)
    if window is not None and own is not None and getattr(c, "layer_types", None) is None:
        # Mistral: every layer slides and its forward keeps its own ring (Gemma 3's sliding layers
        # mask a window cache's rows by the positions it names: WindowKVCache.ring_positions).
        raise KVVizError(f"this model already slides its own window of {own} positions; a windowed KV "
                         "cache on top of it is not supported (quantized caches are)")
    return resolve(KVSpec(kv_dtype, group_size, bool(zero_point), fp8_scale, window, sinks, positions,
                          bool(track_errors)), family, c.head_dim, c.block_size)


def check_flag(name: str, value: object) -> bool:
    """A yes/no option is a real bool: ``ignore_eos="no"`` would otherwise read as True."""
    if not isinstance(value, bool):
        raise KVVizError(f"{name} must be True or False (got {value!r})")
    return value


def check_pool(block_size: object, num_blocks: object, tokens: int, groups: int = 1) -> None:
    """A paged pool's shape is sane and can hold at least one sequence of ``tokens`` in each of
    its ``groups`` layer groups (paged_pool.layer_groups: more than one for per-layer kinds)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_KV_BLOCK_SIZE:
        raise KVVizError(f"the paged block size must be 1..{MAX_KV_BLOCK_SIZE} tokens (got {block_size!r})")
    if num_blocks is None:
        return
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise KVVizError(f"the paged pool needs a positive number of blocks (got {num_blocks!r})")
    need = pool_blocks(groups, blocks_for(tokens, block_size))
    if num_blocks < need:
        per = f" ({groups} layer groups of {blocks_for(tokens, block_size)})" if groups > 1 else ""
        raise KVVizError(f"a pool of {num_blocks} blocks of {block_size} tokens holds {num_blocks * block_size} "
                         f"tokens; one sequence of {tokens} tokens needs {need} blocks{per}")


def resolve_prompt(model: LoadedModel, prompt: str | None,
                   prompt_ids: Sequence[int] | Sequence[Sequence[int]] | None) -> tuple[list[list[int]], str]:
    """Token rows (one per batch row, equal length) and the text of row 0."""
    tok = model.tokenizer
    if prompt is not None and prompt_ids is not None:
        raise KVVizError("give text or token ids, not both")
    if prompt_ids is not None:
        rows = check_prompt_ids(prompt_ids)
        if len({len(r) for r in rows}) > 1:
            raise KVVizError(f"batched prompt rows must have equal lengths (got {sorted({len(r) for r in rows})})")
        bad = [i for r in rows for i in r if not 0 <= i < model.config.vocab_size]
        if bad:
            raise KVVizError(f"prompt ids must be in [0, {model.config.vocab_size}); got {bad[:5]}")
        text = tok.decode(rows[0]) if model.has_tokenizer else ""
    else:
        if prompt is None or prompt == "":
            raise KVVizError("the prompt is empty: type some text to start from")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise KVVizError(f"the prompt is {len(prompt):,} characters; the limit is {MAX_PROMPT_CHARS:,}")
        if not model.has_tokenizer:
            raise KVVizError(f"model {model.name!r} has no tokenizer.json: pass token ids instead of text")
        rows, text = [tok.encode(prompt)], prompt
    if not rows or not rows[0]:
        raise KVVizError("the prompt encodes to zero tokens")
    return rows, text


def resolve_chat(model: LoadedModel, prompt: str | None, prompt_ids: object,
                 messages: Sequence[Mapping[str, str]] | None,
                 parse_special: bool = False) -> tuple[list[list[int]], str]:
    """One token row and its text: the conversation laid out by the model's chat template
    (control-token text typed in a message stays text unless ``parse_special``: engine/tokenize/chat_template.py)."""
    if prompt_ids is not None:
        raise KVVizError("a chat is given as text or messages, not as token ids")
    if messages is None:
        if prompt is None or prompt == "":
            raise KVVizError("the message is empty: type a question to ask")
        messages = [{"role": "user", "content": prompt}]
    elif prompt is not None:
        raise KVVizError("give a prompt or messages, not both")
    total = sum(len(m.get("content", "")) for m in messages if isinstance(m, Mapping)
                and isinstance(m.get("content", ""), str))
    if total > MAX_PROMPT_CHARS:
        raise KVVizError(f"the conversation is {total:,} characters; the limit is {MAX_PROMPT_CHARS:,}")
    tok = model.tokenizer
    if not getattr(tok, "chat_template", None):
        raise KVVizError(f"model {model.name!r} has no chat template: turn chat off and give a plain prompt")
    got = chat_prompt(tok, messages, parse_special=bool(parse_special))  # type: ignore[arg-type]
    return [list(got.ids)], got.text


def check_pool_memory(model: LoadedModel, block_size: int, num_blocks: int, rows: int = 1) -> None:
    """A pool of ``num_blocks`` blocks is allocated whole up front: refuse one the memory cannot hold
    (a million blocks of 4,096 tokens asked torch for 4 TB and died in the allocator)."""
    c = model.config
    per_block = config_groups(c).size  # layers one block holds: all, or one layer group's (paged_pool.py)
    need = num_blocks * block_size * kv_bytes_per_token(per_block, c.kv_heads, c.head_dim, model.dtype.itemsize, 1)
    free = available_memory(model.device)
    if free is not None and need > MEMORY_SHARE * free:
        raise KVVizError(f"a pool of {num_blocks:,} blocks of {block_size:,} tokens needs {fmt_bytes(need)} of KV "
                         f"cache, more than {MEMORY_SHARE:.0%} of the {fmt_bytes(free)} free on {model.device.type}: "
                         "use fewer blocks")


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device`` (None when this system cannot say)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def beam_cache_bytes(model: LoadedModel, num_beams: int, n_tokens: int, cache_kind: str) -> int:
    """Bytes the k-row cache needs: a static cache preallocates every position of its context;
    a concat cache holds n_tokens, twice over while ``torch.cat`` copies it."""
    c = model.config
    per_row = kv_bytes_per_token(c.n_layer, c.kv_heads, c.head_dim, model.dtype.itemsize, 1)
    return int(num_beams * per_row * (c.block_size if cache_kind == "static" else 2 * n_tokens))


def check_beam_request(model: LoadedModel, num_beams: object, length_penalty: object, early_stopping: object,
                       num_return_sequences: object, n_tokens: int, use_cache: bool, cache_kind: str,
                       greedy: bool, stop: tuple[str, ...], batch_size: int) -> tuple[int, float, bool | str, int]:
    """The beam parameters, checked (KVVizError with a specific message) before any compute."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or not 1 <= num_beams <= MAX_BEAMS:
        raise KVVizError(f"num_beams must be an integer from 1 to {MAX_BEAMS} (got {num_beams!r})")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
            or not abs(float(length_penalty)) < float("inf"):
        raise KVVizError(f"length_penalty must be a finite number (got {length_penalty!r})")
    es = parse_early_stopping(early_stopping)
    nrs = num_return_sequences
    if isinstance(nrs, bool) or not isinstance(nrs, int) or not 1 <= nrs <= num_beams:
        raise KVVizError(f"num_return_sequences must be from 1 to num_beams ({num_beams}) (got {nrs!r})")
    if not greedy:
        raise KVVizError("beam search here is deterministic (transformers' do_sample=False): "
                         "sampling with num_beams > 1 is not supported; use greedy")
    if stop:
        raise KVVizError("stop strings are not supported with beam search (each beam would end at its own place)")
    if batch_size != 1:
        raise KVVizError("beam search takes one prompt row: the k beams are its batch")
    if use_cache:
        need = beam_cache_bytes(model, num_beams, n_tokens, cache_kind)
        free = available_memory(model.device)
        if free is not None and need > MEMORY_SHARE * free:
            raise KVVizError(
                f"{num_beams} beams x {model.config.block_size if cache_kind == 'static' else n_tokens} positions "
                f"need {fmt_bytes(need)} of KV cache ({cache_kind}), more than {MEMORY_SHARE:.0%} of the "
                f"{fmt_bytes(free)} free on {model.device.type}: use fewer beams or the concat cache")
    return num_beams, float(length_penalty), es, nrs



def parse_early_stopping(value: object) -> bool | str:
    """True, False or "never" (transformers' three meanings); the CLI's strings too."""
    if value is True or value is False or value == "never":
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value.lower() in ("true", "false", "never"):
        return {"true": True, "false": False, "never": "never"}[value.lower()]
    raise KVVizError(f"early_stopping must be true, false or never (got {value!r})")




def check_speculative_request(speculative: object, draft_tokens: object, ngram: object, use_cache: bool,
                              batch_size: int) -> tuple[int, int]:
    if speculative not in SPECULATIVE_METHODS:
        raise KVVizError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} (got {speculative!r})")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= MAX_DRAFT:
        raise KVVizError(f"draft_tokens must be an integer from 1 to {MAX_DRAFT} (got {draft_tokens!r})")
    if isinstance(ngram, bool) or not isinstance(ngram, int) or not 1 <= ngram <= MAX_NGRAM:
        raise KVVizError(f"ngram must be an integer from 1 to {MAX_NGRAM} (got {ngram!r})")
    if not use_cache:
        raise KVVizError("speculative decoding verifies drafts through the KV cache and rolls it back: "
                         "it needs use_cache=True")
    if batch_size != 1:
        raise KVVizError("speculative decoding runs one sequence (batch_size 1)")
    return draft_tokens, ngram


def check_budget(model: LoadedModel, n_prompt: int, max_new_tokens: int) -> None:
    """Reject, before any compute, a request that cannot fit in the model's context."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise KVVizError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")
    block = model.config.block_size
    if n_prompt + max_new_tokens > block:
        raise KVVizError(
            f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) = {n_prompt + max_new_tokens} "
            f"exceeds the model's context of {block} tokens"
        )


def is_messages(prompt: object) -> bool:
    """A chat given as messages: a list (not text) whose items are mappings ({"role", "content"})."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes, bytearray)) and bool(prompt) \
        and all(isinstance(m, Mapping) for m in prompt)


def _kind_of(v: object) -> str:
    s = repr(v)
    return f"{type(v).__name__} {s if len(s) <= 40 else s[:37] + '...'}"


@dataclass(frozen=True)
class GenerateRequest:
    """What ``iter_generate`` is asked, as given: its parameters after the model, with their defaults.

    Nothing is checked on construction (``SamplingParams`` checks its own values when it is made);
    ``validate(model)`` checks it all against a model.
    """

    prompt: Prompt  # text, one row of ids, equal-length rows of ids (a batch), or chat messages
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()  # greedy
    cache: CacheSpec = CacheSpec()  # a static cache in the model's dtype
    strategy: Beam | Speculative | None = None  # None: plain decoding
    capture: Capture | None = None  # what the run records besides timings (plain decoding only)
    stop: Sequence[str] = ()  # stop strings: the run ends when its text holds one
    chat: bool = False  # wrap a text prompt as one user message in the model's chat template
    parse_special: bool = False  # read control-token text typed in a chat message as control tokens
    backend: str = "fast"  # "fast": the accelerator where the model has one; "readable": the nn.Module
    batch_size: int = 1  # rows: a text or one row of ids repeated (rows of ids give their own count)

    def validate(self, model: LoadedModel) -> ValidRequest:
        """Every check, before any compute (the first failure raises its KVVizError)."""
        params, cache, strategy = self._objects()
        check_arguments(self._arguments(cache, strategy))
        rows, text = self._rows(model)
        n_tokens = len(rows[0]) + self.max_new_tokens
        kv = self._cache_spec(model, cache, strategy, n_tokens)
        stops = tuple(s for s in (self.stop or ()) if s)
        beam, spec = self._strategy(model, cache, strategy, n_tokens, params, stops, len(rows))
        return ValidRequest(
            rows=tuple(tuple(r) for r in rows), text=text, max_new_tokens=self.max_new_tokens,
            use_cache=cache.use_cache, cache_kind=cache.kind, params=params, stop=stops,
            capture=self.capture or Capture(), fast=self.backend == "fast", kv_block_size=cache.block_size,
            kv_blocks=cache.blocks, kv=kv, ignore_eos=params.ignore_eos, beam=beam, spec=spec)

    def _objects(self) -> tuple[SamplingParams, CacheSpec, Beam | Speculative | None]:
        """The caller's objects are the kinds the API names (a dict or a string is named, not run)."""
        if not isinstance(self.sampling, SamplingParams):
            raise KVVizError(f"sampling must be a SamplingParams, e.g. SamplingParams(temperature=0.8) "
                             f"(got {_kind_of(self.sampling)})")
        if not isinstance(self.cache, CacheSpec):
            raise KVVizError(f"cache must be a CacheSpec, e.g. CacheSpec(kind='paged') (got {_kind_of(self.cache)})")
        if self.strategy is not None and not isinstance(self.strategy, (Beam, Speculative)):
            raise KVVizError(f"strategy must be Beam(num_beams), Speculative() or None (got {_kind_of(self.strategy)})")
        if self.backend not in BACKENDS:
            raise KVVizError(f"backend must be one of {', '.join(BACKENDS)} (got {self.backend!r})")
        return self.sampling, self.cache, self.strategy

    def _arguments(self, cache: CacheSpec, strategy: Beam | Speculative | None) -> dict[str, Any]:
        """The values check_arguments reads, under the names its messages use (the CLI's words)."""
        args: dict[str, Any] = {
            "stop": self.stop, "chat": self.chat, "parse_special": self.parse_special, "use_cache": cache.use_cache,
            "cache_kind": cache.kind, "kv_block_size": cache.block_size, "kv_blocks": cache.blocks,
            "window": cache.window, "sinks": cache.sinks, "kv_group_size": cache.group_size,
            "kv_zero_point": cache.zero_point, "track_kv_error": cache.track_errors}
        if isinstance(self.prompt, (str, bytes, bytearray)):  # bytes: named as bytes, with the fix
            args["prompt"] = self.prompt
        elif is_messages(self.prompt):
            args["messages"] = self.prompt
        if isinstance(strategy, Beam):
            args.update(num_beams=strategy.num_beams, num_return_sequences=strategy.num_return_sequences,
                        length_penalty=strategy.length_penalty)
        elif isinstance(strategy, Speculative):
            args.update(draft_tokens=strategy.draft_tokens, ngram=strategy.ngram)
        return args

    def _rows(self, model: LoadedModel) -> tuple[list[list[int]], str]:
        """The prompt's token rows (one per batch row) and row 0's text; the context budget checked."""
        p = self.prompt
        if is_messages(p):
            rows, text = resolve_chat(model, None, None, p, self.parse_special)  # type: ignore[arg-type]
        elif self.chat:
            rows, text = resolve_chat(model, p if isinstance(p, str) or p is None else None,
                                      None if isinstance(p, str) or p is None else p, None, self.parse_special)
        elif isinstance(p, str) or p is None or isinstance(p, (bytes, bytearray)):
            rows, text = resolve_prompt(model, p, None)  # type: ignore[arg-type]
        else:
            rows, text = resolve_prompt(model, None, p)  # type: ignore[arg-type]
        b = self.batch_size
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BATCH:
            raise KVVizError(f"batch_size must be between 1 and {MAX_BATCH} (got {b!r})")
        if len(rows) > 1:
            if b not in (1, len(rows)):
                raise KVVizError(f"batch_size {b} does not match the {len(rows)} prompt rows")
            if len(rows) > MAX_BATCH:
                raise KVVizError(f"a batch holds at most {MAX_BATCH} prompt rows (got {len(rows)})")
        else:
            rows = rows * b  # the same prompt on every row
        check_budget(model, len(rows[0]), self.max_new_tokens)
        return rows, text

    def _cache_spec(self, model: LoadedModel, cache: CacheSpec, strategy: Beam | Speculative | None,
                    n_tokens: int) -> KVSpec:
        """The cache kind, a paged pool's shape and memory, and the compressed cache (resolved)."""
        kind = cache.kind
        if kind not in CACHE_KINDS:
            raise KVVizError(f"cache_kind must be one of {', '.join(CACHE_KINDS)} (got {kind!r})")
        if kind == "paged" and cache.use_cache:
            check_pool(cache.block_size, cache.blocks, n_tokens, config_groups(model.config).count)
            if cache.blocks is not None:
                check_pool_memory(model, cache.block_size, cache.blocks)
        kv = kv_spec(model, cache.kv_dtype, cache.window, cache.sinks, cache.group_size, cache.zero_point,
                     cache.fp8_scale, cache.positions, cache.track_errors)
        if kv.active:
            if not cache.use_cache:
                raise KVVizError(f"a {kv.label()} cache needs the KV cache on: without one nothing is stored")
            if kind != "static":
                raise KVVizError(f"a {kv.label()} cache replaces the static cache; it does not combine with {kind!r}")
            if _runs_strategy(strategy):
                raise KVVizError("quantized and windowed caches run plain decoding only (no beams, no speculation)")
        return kv

    def _strategy(self, model: LoadedModel, cache: CacheSpec, strategy: Beam | Speculative | None, n_tokens: int,
                  params: SamplingParams, stops: tuple[str, ...],
                  batch: int) -> tuple[BeamOptions | None, SpecOptions | None]:
        """Beam search's or speculative decoding's own parameters, checked (neither: plain decoding)."""
        if not _runs_strategy(strategy):
            return None, None
        cap = self.capture
        if cap is not None and (cap.ref_layers(model.config.n_layer) or cap.logits):
            raise KVVizError("attention, K/V and logits captures are recorded by plain decoding only")
        if isinstance(strategy, Speculative):
            k, n = check_speculative_request(strategy.method, strategy.draft_tokens, strategy.ngram, cache.use_cache,
                                             batch)
            return None, SpecOptions(k, n)
        assert isinstance(strategy, Beam)
        k, lp, es, nrs = check_beam_request(model, strategy.num_beams, strategy.length_penalty,
                                            strategy.early_stopping, strategy.num_return_sequences, n_tokens,
                                            cache.use_cache, cache.kind, params.greedy, stops, batch)
        eos = None if params.ignore_eos else model.tokenizer.eos_token_id  # ignored: no beam ends at EOS
        return BeamOptions(k, lp, es, nrs, () if eos is None else (eos,)), None


def _runs_strategy(strategy: Beam | Speculative | None) -> bool:
    """A strategy stream runs: speculative decoding, or beam search with more than one beam
    (one beam is plain greedy decoding, as in transformers)."""
    return isinstance(strategy, Speculative) or (isinstance(strategy, Beam) and strategy.num_beams != 1)
