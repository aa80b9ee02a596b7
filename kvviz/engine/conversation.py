"""A multi-turn chat over one KV cache that lives across turns: each turn prefills only what is new.

Every turn renders the whole conversation with the model's chat template, finds the longest
common prefix between those ids and the ids the cache holds, truncates the cache there, prefills
the rest and decodes the answer on the same cache. So turn k reuses turn k-1's whole conversation
up to where the template adds the new message, an edited earlier message keeps the cache up to
its first changed token, and a timestamp at the start of the system prompt misses everything.

The boundary: the cache holds the prompt and every generated token it fed back, i.e. the answer
without the sampled end token (<|im_end|>), which was never fed. The next render writes the answer
as text + "<|im_end|>\\n": reuse is exactly the common prefix of the two id lists, so if the
answer's text re-tokenizes to other ids, reuse stops there (``TurnRecord.cached_before`` vs
``reused_tokens`` shows it). A paged cache also finds full blocks by hash (vLLM's prefix caching):
blocks of an earlier prompt released to the pool are taken back when the same prefix returns.

    conv = Conversation(model, cache_kind="paged")
    t1 = conv.send("What is the capital of France?")
    t2 = conv.send("And of Italy?")    # t2.reused_tokens == t1's prompt + answer tokens
    conv.matches_scratch(1)            # the answer equals a from-scratch greedy generation
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Callable, Iterator

import torch

from kvviz.engine.caches import make_cache
from kvviz.engine.chat import chat_prompt
from kvviz.engine.generate import generate
from kvviz.engine.requests import check_pool, check_pool_memory, sampling_params
from kvviz.engine.load import LoadedModel
from kvviz.engine.paged import DEFAULT_BLOCK_SIZE, PagedKVCache, PagedPool, blocks_for
from kvviz.engine.sampling import make_generator, sample
from kvviz.errors import KVVizError

MAX_MESSAGE_CHARS = 20_000


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class TurnRecord:
    """One turn, measured."""

    user: str
    text: str  # the answer, without the end token
    prompt_ids: tuple[int, ...]  # the whole conversation as the template rendered it
    generated_ids: tuple[int, ...]  # every sampled token, the end token included
    cached_before: int  # tokens the cache held when the turn began
    reused_tokens: int  # positions kept (common prefix or prefix-cache hit): not recomputed
    prefilled_tokens: int  # positions this turn's prefill computed
    ttft_ms: float  # the prefill forward + sampling of the first token
    decode_ms: float  # the rest of the answer
    cache_bytes_before: int  # bytes_used when the turn began
    cache_bytes_used: int  # bytes_used after the answer
    cache_bytes_allocated: int
    blocks_used: int | None  # paged only
    blocks_shared: int | None
    prefix_hit_blocks: int | None  # blocks taken back by hash this turn (paged only)
    stop_reason: str  # "eos" or "max_new_tokens"
    snapshots: tuple[dict[str, Any], ...] = field(default=(), compare=False)  # the pool after each step (paged)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def generated_tokens(self) -> int:
        return len(self.generated_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "user": self.user, "text": self.text, "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens, "prefilled_tokens": self.prefilled_tokens,
            "generated_tokens": self.generated_tokens, "cached_before": self.cached_before,
            "ttft_ms": self.ttft_ms, "decode_ms": self.decode_ms, "cache_bytes_before": self.cache_bytes_before,
            "cache_bytes_used": self.cache_bytes_used, "cache_bytes_allocated": self.cache_bytes_allocated,
            "blocks_used": self.blocks_used, "blocks_shared": self.blocks_shared,
            "prefix_hit_blocks": self.prefix_hit_blocks, "stop_reason": self.stop_reason,
            "prompt_ids": list(self.prompt_ids), "generated_ids": list(self.generated_ids),
        }


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _Templated:
    """A tokenizer with ChatML as its chat template, for a model that ships none (the cache
    mechanics are the same; the model was never trained on chats, so its answers are noise)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.chat_template = CHATML
        self.special_tokens: dict[str, str] = {}

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        return self._tok.encode(text) if parse_special else self._tok.encode(text, parse_special=False)

    def __getattr__(self, name: str) -> Any:  # decode, token_display, eos_token_id, ...
        return getattr(self._tok, name)


def with_chat_template(model: LoadedModel) -> tuple[LoadedModel, bool]:
    """``model`` as is when it has a chat template, else a copy whose tokenizer lays turns out in
    ChatML; True when the template is the fallback. The weights are shared, never changed."""
    if getattr(model.tokenizer, "chat_template", None):
        return model, False
    return replace(model, tokenizer=_Templated(model.tokenizer)), True


def forward_fn(model: LoadedModel, fast: bool) -> Callable[..., torch.Tensor]:
    """The step the generation loop would run: the accelerator or the readable model."""
    return model.fast.forward if fast and model.fast is not None else model.gpt


class Conversation:
    """A chat session: messages, one batch-1 cache, and a TurnRecord per turn."""

    def __init__(self, model: LoadedModel, cache_kind: str = "paged", kv_block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_blocks: int | None = None, system: str | None = None, timestamp: bool = False,
                 max_new_tokens: int = 64, greedy: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0, fast: bool = True,
                 pool: PagedPool | None = None, parse_special: bool = False) -> None:
        if not getattr(model.tokenizer, "chat_template", None):
            raise KVVizError(f"model {model.name!r} has no chat template: a conversation needs an instruct model")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise KVVizError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")
        self.params = sampling_params(greedy, temperature, top_k, top_p, seed)
        self.model, self.fast, self.max_new_tokens = model, bool(fast), max_new_tokens
        self.system, self.timestamp = system, timestamp
        # False: control-token text typed in a message is text (engine/chat.py); True reads it as
        # control tokens, so a message can end its turn and forge the next one.
        self.parse_special = bool(parse_special)
        cfg = model.config
        if cache_kind == "paged":
            check_pool(kv_block_size, kv_blocks, 1)
            if pool is None and kv_blocks is None:
                # The context of one sequence plus as much again for blocks kept by prefix hash.
                kv_blocks = 2 * blocks_for(cfg.block_size, kv_block_size)
            if pool is None:
                check_pool_memory(model, kv_block_size, kv_blocks)
            with torch.inference_mode():
                self.cache = PagedKVCache(cfg, 1, model.device, model.dtype, kv_block_size, kv_blocks, pool)
        else:
            with torch.inference_mode():
                self.cache = make_cache(cache_kind, cfg, 1, model.device, model.dtype)
        self.messages: list[dict[str, str]] = []  # user and assistant turns (the system prompt apart)
        self.held: list[int] = []  # the ids whose K/V the cache holds, position by position
        self.turns: list[TurnRecord] = []

    # ------------------------------------------------------------------ the conversation
    def render(self, messages: list[dict[str, str]]) -> list[int]:
        system = self.system
        if self.timestamp:  # what some deployments do, and why their prefix cache never hits
            system = f"Current time: {datetime.now().isoformat(timespec='microseconds')}. {system or ''}".strip()
        msgs = ([{"role": "system", "content": system}] if system else []) + messages
        return list(chat_prompt(self.model.tokenizer, msgs, parse_special=self.parse_special).ids)

    def send(self, text: str) -> TurnRecord:
        """Ask ``text`` after the conversation so far; run the turn to its end."""
        for _ in self.iter_send(text):
            pass
        return self.turns[-1]

    def edit(self, turn: int, text: str) -> TurnRecord:
        """Replace user message ``turn`` (0-based), drop what followed, answer again."""
        if not 0 <= turn < len(self.turns):
            raise KVVizError(f"there is no turn {turn + 1} to edit (the conversation has {len(self.turns)})")
        kept_msgs, kept_turns = self.messages[: 2 * turn], self.turns[:turn]
        msgs, turns = self.messages, self.turns
        self.messages, self.turns = kept_msgs, kept_turns
        try:
            return self.send(text)
        except KVVizError:
            self.messages, self.turns = msgs, turns  # nothing is lost on bad input
            raise

    def regenerate(self, seed: int | None = None) -> TurnRecord:
        """Answer the last message again (with ``seed`` when sampling). The cache keeps the prompt
        but its last position; on a paged cache a block the old answer filled is hashed, so the
        new answer's first write copies it (copy-on-write) and the old answer stays findable."""
        if not self.turns:
            raise KVVizError("there is no answer to regenerate yet")
        if seed is not None:
            self.params = replace(self.params, seed=seed)
        return self.edit(len(self.turns) - 1, self.turns[-1].user)

    def iter_send(self, text: str) -> Iterator[dict[str, Any]]:
        """Run one turn, yielding after the prefill and after every decode step (the pool's state
        for a paged cache, else {}); the TurnRecord lands in ``self.turns`` at the end."""
        if not isinstance(text, str) or not text.strip():
            raise KVVizError("the message is empty: type something to say")
        if len(text) > MAX_MESSAGE_CHARS:
            raise KVVizError(f"the message is {len(text):,} characters; the limit is {MAX_MESSAGE_CHARS:,}")
        msgs = [*self.messages, {"role": "user", "content": text}]
        ids = self.render(msgs)
        ctx = self.model.config.block_size
        if len(ids) + self.max_new_tokens > ctx:
            raise KVVizError(f"the conversation is {len(ids)} tokens; with {self.max_new_tokens} new tokens it "
                             f"passes the model's context of {ctx}: start a new chat or ask for fewer tokens")
        if isinstance(self.cache, PagedKVCache):
            need, have = blocks_for(len(ids) + self.max_new_tokens, self.cache.block_size), self.cache.pool.blocks.num_blocks
            if need > have:
                raise KVVizError(f"the KV pool has {have} blocks of {self.cache.block_size} tokens; this turn needs "
                                 f"{need} ({len(ids)} prompt + {self.max_new_tokens} new tokens): give it more blocks")
        return self._turn(text, msgs, ids)

    def _turn(self, text: str, msgs: list[dict[str, str]], ids: list[int]) -> Iterator[dict[str, Any]]:
        m, cache, dev = self.model, self.cache, self.model.device
        forward = forward_fn(m, self.fast)
        paged = isinstance(cache, PagedKVCache)
        before, cached_before = cache.bytes_used, len(self.held)
        # Reuse at most len-1 positions: the last prompt token must run to give the first logits.
        reuse = min(common_prefix(self.held, ids), len(ids) - 1)
        hits = 0
        with torch.inference_mode():
            if paged:
                assert isinstance(cache, PagedKVCache)
                found = cache.match_prefix(ids[: len(ids) - 1])
                if len(found) * cache.block_size > reuse:  # the pool knows more of this prefix than the row
                    cache.truncate(0)
                    cache.adopt_prefix(ids, found)
                    reuse, hits = cache.pos, len(found)
                else:
                    cache.truncate(reuse)
            else:
                cache.truncate(reuse)
        self.held = ids[:reuse]
        gen = None if self.params.greedy else make_generator(self.params, dev)
        eos = m.tokenizer.eos_token_id
        positions = torch.arange(m.config.block_size, device=dev)
        out: list[int] = []
        snaps: list[dict[str, Any]] = []
        ttft = decode = 0.0
        inp = torch.tensor([ids[reuse:]], dtype=torch.long, device=dev)  # (1, T): what is new
        stop = "max_new_tokens"
        for step in range(self.max_new_tokens):
            start = cache.pos
            with torch.inference_mode():
                cache.note_tokens(inp)
                t0 = time.perf_counter()
                logits = forward(inp, positions.narrow(0, start, inp.shape[1]), cache, None, last_only=True)
                nxt = sample(logits.select(1, -1).float(), self.params, gen)  # (1,)
                tok = int(nxt[0])
                dt = (time.perf_counter() - t0) * 1000.0
                cache.advance(inp.shape[1])
            self.held.extend(inp[0].tolist())
            if step == 0:
                ttft = dt
            else:
                decode += dt
            out.append(tok)
            if paged:
                snaps.append(cache.snapshot())  # type: ignore[union-attr]
            yield snaps[-1] if paged else {}
            if eos is not None and tok == eos:
                stop = "eos"
                break
            inp = nxt.view(1, 1)
        answer = out[:-1] if stop == "eos" else out
        reply = m.tokenizer.decode(answer)
        st = cache.stats() if paged else None  # type: ignore[union-attr]
        self.messages = [*msgs, {"role": "assistant", "content": reply}]
        self.turns.append(TurnRecord(
            user=text, text=reply, prompt_ids=tuple(ids), generated_ids=tuple(out), cached_before=cached_before,
            reused_tokens=reuse, prefilled_tokens=len(ids) - reuse, ttft_ms=ttft, decode_ms=decode,
            cache_bytes_before=before, cache_bytes_used=cache.bytes_used, cache_bytes_allocated=cache.bytes_allocated,
            blocks_used=st.blocks_used if st else None, blocks_shared=st.blocks_shared if st else None,
            prefix_hit_blocks=hits if paged else None, stop_reason=stop, snapshots=tuple(snaps),
        ))

    def warm_up(self) -> None:
        """One throwaway prefill and decode step on a scratch cache, so turn 1's TTFT times the
        model and not first-call costs (kernel build, allocator growth, thread start)."""
        m = self.model
        forward = forward_fn(m, self.fast)
        ids = self.render([{"role": "user", "content": "Hi"}])
        with torch.inference_mode():
            cache = make_cache("static", m.config, 1, m.device, m.dtype)
            inp = torch.tensor([ids], dtype=torch.long, device=m.device)  # (1, N)
            forward(inp, torch.arange(len(ids), device=m.device), cache, None, last_only=True)
            cache.advance(len(ids))
            forward(inp[:, -1:], torch.arange(len(ids), len(ids) + 1, device=m.device), cache, None, last_only=True)

    # ------------------------------------------------------------------ checks, on demand
    def scratch_ids(self, turn: int) -> list[int]:
        """Turn ``turn``'s tokens generated from scratch (a fresh static cache, same sampling)."""
        t = self.turns[turn]
        p = self.params
        run = generate(self.model, prompt_ids=list(t.prompt_ids), max_new_tokens=self.max_new_tokens,
                       greedy=p.greedy, temperature=None if p.greedy else p.temperature, top_k=p.top_k,
                       top_p=p.top_p, seed=p.seed, fast=self.fast)
        return list(run.generated_ids)

    def matches_scratch(self, turn: int) -> bool:
        return self.scratch_ids(turn) == list(self.turns[turn].generated_ids)

    def recompute_ttft_ms(self, turn: int) -> float:
        """TTFT of the same turn with nothing reused: the whole conversation prefilled on a new cache."""
        t, m = self.turns[turn], self.model
        forward = forward_fn(m, self.fast)
        with torch.inference_mode():
            cache = make_cache("static", m.config, 1, m.device, m.dtype)
            inp = torch.tensor([list(t.prompt_ids)], dtype=torch.long, device=m.device)  # (1, N)
            t0 = time.perf_counter()
            logits = forward(inp, torch.arange(inp.shape[1], device=m.device), cache, None, last_only=True)
            sample(logits.select(1, -1).float(), self.params, None if self.params.greedy else
                   make_generator(self.params, m.device))
            return (time.perf_counter() - t0) * 1000.0
