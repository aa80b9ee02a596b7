"""A generation request and the checks it passes before any compute: the prompt (text, ids or a
chat), the sampler's settings, the context budget, a paged pool's shape, a compressed-cache request
and a strategy's own parameters. Each failure is a KVVizError that says what to change; nothing
here touches a tensor.

``GenerateRequest`` holds ``iter_generate``'s keywords (the same names and defaults: a test holds
them equal); ``validate(model)`` runs every check once, in one order, and returns the
``ValidRequest`` the streams run from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from kvviz.engine.generation.arg_checks import check_arguments, check_prompt_ids
from kvviz.engine.generation.capture import Capture
from kvviz.engine.generation.valid_request import BeamOptions, SpecOptions, ValidRequest
from kvviz.engine.kvcache.factory import KINDS as CACHE_KINDS
from kvviz.engine.strategy.beam import MEMORY_SHARE, available_memory, check_beam_request
from kvviz.engine.strategy.speculative import check_speculative_request
from kvviz.engine.tokenize.chat_template import chat_prompt
from kvviz.engine.kvcache.kv_spec import KVSpec, resolve
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.kvcache.paged_cache import DEFAULT_BLOCK_SIZE, blocks_for
from kvviz.engine.kvcache.paged_pool import config_groups
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.errors import KVVizError
from kvviz.limits import MAX_KV_BLOCK_SIZE  # shared with the CLI's --block-size
from kvviz.units import fmt_bytes, kv_bytes_per_token

MAX_PROMPT_CHARS = 100_000  # refuse absurd pastes before tokenizing them
MAX_BATCH = 64  # rows of one plain run (the same prompt, or equal-length rows of ids)


def sampling_params(greedy: bool | None, temperature: float | None, top_k: int | None,
                    top_p: float | None, seed: int) -> SamplingParams:
    """Greedy unless a temperature (or top-k/top-p) is given, as the API contract reads.

    temperature=0 means greedy (the usual convention: the limit of sharpening is the argmax).
    """
    if temperature is not None and temperature == 0 and greedy is not False:
        greedy, temperature = True, None
    if greedy is None:
        greedy = temperature is None and top_k is None and top_p is None
    if greedy and temperature is not None and temperature > 0:
        raise KVVizError("choose greedy or a temperature, not both")
    return SamplingParams(greedy=greedy, temperature=1.0 if temperature is None else float(temperature),
                          top_k=top_k, top_p=top_p, seed=seed)


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
    need = groups * blocks_for(tokens, block_size)
    if num_blocks < need:
        per = f" ({groups} layer groups of {blocks_for(tokens, block_size)})" if groups > 1 else ""
        raise KVVizError(f"a pool of {num_blocks} blocks of {block_size} tokens holds {num_blocks * block_size} "
                         f"tokens; one sequence of {tokens} tokens needs {need} blocks{per}")


def resolve_prompt(model: LoadedModel, prompt: str | None,
                   prompt_ids: Sequence[int] | Sequence[Sequence[int]] | None) -> tuple[list[list[int]], str]:
    """Token rows (one per batch row, equal length) and the text of row 0."""
    tok = model.tokenizer
    if prompt is not None and prompt_ids is not None:
        raise KVVizError("give a prompt or prompt_ids, not both")
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
            raise KVVizError(f"model {model.name!r} has no tokenizer.json: pass prompt_ids instead of text")
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
        raise KVVizError("a chat is given as text (prompt= or messages=), not as prompt_ids")
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


@dataclass(frozen=True)
class GenerateRequest:
    """What ``iter_generate`` is asked, as given: its keywords, their defaults (see its docstring).

    Nothing is checked on construction; ``validate(model)`` checks it all against a model.
    """

    prompt: str | None = None
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | None = None  # one row, or equal-length rows
    max_new_tokens: int = 64
    use_cache: bool = True
    cache_kind: str = "static"
    greedy: bool | None = None  # None: greedy unless a temperature, top-k or top-p is given
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop: Sequence[str] | None = None
    capture: Capture | None = None
    batch_size: int = 1
    fast: bool = True
    chat: bool = False  # wrap ``prompt`` as one user message in the model's chat template
    messages: Sequence[Mapping[str, str]] | None = None  # a whole conversation
    parse_special: bool = False  # read control-token text typed in a message as control tokens
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    kv_blocks: int | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    speculative: str | None = None
    draft_tokens: int = 10
    ngram: int = 2
    kv_dtype: str | None = None
    window: int | None = None
    sinks: int = 0
    kv_group_size: int | None = None
    kv_zero_point: bool = False
    kv_fp8_scale: str = "tensor"
    kv_positions: str | None = None
    track_kv_error: bool = False
    ignore_eos: bool = False

    def validate(self, model: LoadedModel) -> ValidRequest:
        """Every check, before any compute (the first failure raises its KVVizError)."""
        check_arguments({f: getattr(self, f) for f in self.__dataclass_fields__})
        params = sampling_params(self.greedy, self.temperature, self.top_k, self.top_p, self.seed)
        ignore_eos = check_flag("ignore_eos", self.ignore_eos)
        rows, text = self._rows(model)
        n_tokens = len(rows[0]) + self.max_new_tokens
        kv = self._cache_spec(model, n_tokens)
        stops = tuple(s for s in (self.stop or ()) if s)
        beam, spec = self._strategy(model, n_tokens, params.greedy, stops, len(rows), ignore_eos)
        return ValidRequest(
            rows=tuple(tuple(r) for r in rows), text=text, max_new_tokens=self.max_new_tokens,
            use_cache=self.use_cache, cache_kind=self.cache_kind, params=params, stop=stops,
            capture=self.capture or Capture(), fast=bool(self.fast), kv_block_size=self.kv_block_size,
            kv_blocks=self.kv_blocks, kv=kv, ignore_eos=ignore_eos, beam=beam, spec=spec)

    def _rows(self, model: LoadedModel) -> tuple[list[list[int]], str]:
        """The prompt's token rows (one per batch row) and row 0's text; the context budget checked."""
        if self.chat or self.messages is not None:
            rows, text = resolve_chat(model, self.prompt, self.prompt_ids, self.messages, self.parse_special)
        else:
            rows, text = resolve_prompt(model, self.prompt, self.prompt_ids)
        b = self.batch_size
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BATCH:
            raise KVVizError(f"batch_size must be between 1 and {MAX_BATCH} (got {b!r})")
        if len(rows) > 1:
            if b not in (1, len(rows)):
                raise KVVizError(f"batch_size {b} does not match the {len(rows)} prompt rows")
        else:
            rows = rows * b  # the same prompt on every row
        check_budget(model, len(rows[0]), self.max_new_tokens)
        return rows, text

    def _cache_spec(self, model: LoadedModel, n_tokens: int) -> KVSpec:
        """The cache kind, a paged pool's shape and memory, and the compressed cache (resolved)."""
        kind = self.cache_kind
        if kind not in CACHE_KINDS:
            raise KVVizError(f"cache_kind must be one of {', '.join(CACHE_KINDS)} (got {kind!r})")
        if kind == "paged" and self.use_cache:
            check_pool(self.kv_block_size, self.kv_blocks, n_tokens, config_groups(model.config).count)
            if self.kv_blocks is not None:
                check_pool_memory(model, self.kv_block_size, self.kv_blocks)
        kv = kv_spec(model, self.kv_dtype, self.window, self.sinks, self.kv_group_size, self.kv_zero_point,
                     self.kv_fp8_scale, self.kv_positions, self.track_kv_error)
        if kv.active:
            if not self.use_cache:
                raise KVVizError(f"a {kv.label()} cache needs the KV cache on: without one nothing is stored")
            if kind != "static":
                raise KVVizError(f"a {kv.label()} cache replaces the static cache; it does not combine with {kind!r}")
            if self.num_beams != 1 or self.speculative is not None:
                raise KVVizError("quantized and windowed caches run plain decoding only (no beams, no speculation)")
        return kv

    def _strategy(self, model: LoadedModel, n_tokens: int, greedy: bool, stops: tuple[str, ...], batch: int,
                  ignore_eos: bool) -> tuple[BeamOptions | None, SpecOptions | None]:
        """Beam search's or speculative decoding's own parameters, checked (neither: plain decoding)."""
        if self.num_beams == 1 and self.speculative is None:
            return None, None
        if self.num_beams != 1 and self.speculative is not None:
            raise KVVizError("choose beam search (num_beams > 1) or speculative decoding, not both")
        cap = self.capture
        if cap is not None and (cap.ref_layers(model.config.n_layer) or cap.logits):
            raise KVVizError("attention, K/V and logits captures are recorded by plain decoding only")
        if self.speculative is not None:
            k, n = check_speculative_request(self.speculative, self.draft_tokens, self.ngram, self.use_cache, batch)
            return None, SpecOptions(k, n)
        k, lp, es, nrs = check_beam_request(model, self.num_beams, self.length_penalty, self.early_stopping,
                                            self.num_return_sequences, n_tokens, self.use_cache, self.cache_kind,
                                            greedy, stops, batch)
        eos = None if ignore_eos else model.tokenizer.eos_token_id  # ignored: no beam ends at EOS
        return BeamOptions(k, lp, es, nrs, () if eos is None else (eos,)), None
