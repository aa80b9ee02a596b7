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

    conv = Conversation(model, cache=CacheSpec(kind="paged"))
    t1 = conv.send("What is the capital of France?")
    t2 = conv.send("And of Italy?")    # t2.reused_tokens == t1's prompt + answer tokens
    conv.matches_scratch(1)            # the answer equals a from-scratch greedy generation

A turn is a transaction on the conversation and its cache. The cache is checkpointed before the
turn touches it; every step plans its blocks, runs the forward and commits; the turn commits at
its end (the messages and the TurnRecord land then). Interrupted anywhere (an exception inside
any layer's forward, ``GeneratorExit`` from an abandoned or closed iterator, a newer turn
started while this one is suspended) it rolls back: the messages, ``held``, the cache's
positions and contents, and a paged cache's tables, ref counts, hashes and LRU are exactly as
before the turn, and an ``InterruptedTurn`` keeps what it had said. The steps run under a lock,
so a turn started on another thread (a Streamlit rerun starts a fresh script thread while the
old one is still inside a forward) waits for the running step, then replaces that turn.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from datetime import datetime
from typing import Any, Iterator

import torch

from kvviz.engine.core.step import backend_of, run_step
from kvviz.engine.kvcache.dense import KVCache
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.tokenize.chat_template import chat_prompt
from kvviz.engine.generation.request import check_pool, check_pool_memory
from kvviz.engine.generation.valid_request import CacheSpec
from kvviz.engine.generation.kv_spec import KVSpec
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.kvcache.paged_cache import PagedKVCache, PagedPool, blocks_for
from kvviz.engine.kvcache.paged_pool import config_groups, pool_blocks
from kvviz.engine.generation.sampling import SamplingParams, make_generator, sample
from kvviz.engine.sessions.conversation_checks import ConversationChecks, chat_cache, chat_kv, fast_backend, feed, \
    turn_sampling
from kvviz.engine.sessions.turn import InterruptedTurn, TurnInterrupted, TurnRecord, _Txn
from kvviz.errors import KVVizError

__all__ = ["Conversation", "InterruptedTurn", "TurnInterrupted", "TurnRecord", "common_prefix",
           "with_chat_template", "MAX_MESSAGE_CHARS", "CHATML"]

MAX_MESSAGE_CHARS = 20_000


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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


class Conversation(ConversationChecks):
    """A chat session: messages, one batch-1 cache, and a TurnRecord per turn."""

    def __init__(self, model: LoadedModel, *, cache: CacheSpec = CacheSpec(kind="paged"),
                 sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 64, system: str | None = None,
                 timestamp: bool = False, backend: str = "fast", pool: PagedPool | None = None,
                 parse_special: bool = False) -> None:
        if not getattr(model.tokenizer, "chat_template", None):
            raise KVVizError(f"model {model.name!r} has no chat template: a conversation needs an instruct model")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise KVVizError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")
        self.params = turn_sampling(sampling)
        self.model, self.fast, self.max_new_tokens = model, fast_backend(backend), max_new_tokens
        self.system, self.timestamp = system, timestamp
        # False: control-token text typed in a message is text (engine/tokenize/chat_template.py); True reads it as
        # control tokens, so a message can end its turn and forge the next one.
        self.parse_special = bool(parse_special)
        self.cache_kind, self.kv = chat_cache(cache).kind, chat_kv(model, cache)
        self.cache: KVCache = _new_cache(model, cache.kind, cache.block_size, cache.blocks, pool, self.kv)
        # The first ``carried`` turns were computed on an earlier cache (another model or cache
        # settings: ``rebuild``); this cache holds none of them until a turn prefills them again.
        self.carried = 0
        self._epoch = 0  # rebuilds so far: a turn rendered before one must not run after it
        # Committed state, replaced (never mutated in place) when a turn commits: another thread
        # may be reading it to draw the page.
        self.messages: list[dict[str, str]] = []  # user and assistant turns (the system prompt apart)
        self.held: list[int] = []  # the ids whose K/V the cache holds, position by position
        self.turns: list[TurnRecord] = []
        self.interrupted: list[InterruptedTurn] = []
        self._lock = threading.RLock()  # reentrant: a rollback run by the garbage collector inside a step
        self._active: _Txn | None = None

    # ------------------------------------------------------------------ settings between turns
    def label(self) -> str:
        """The model and cache that compute this conversation's turns, in words (plain text)."""
        c = self.cache
        kind = f"paged cache, blocks of {c.block_size}" if isinstance(c, PagedKVCache) else f"{self.cache_kind} cache"
        engine = backend_of(self.model, self.fast)
        return f"{self.model.name} ({self.model.dtype_name}, {engine} engine) · {kind}"

    def configure(self, *, max_new_tokens: int, timestamp: bool = False,
                  sampling: SamplingParams = SamplingParams()) -> None:
        """Settings that apply from the next turn on (the cache and the turns so far stay): the
        answer's length, the sampling, the timestamp (which changes the prompt, so the next turn
        reuses less, and says so). A turn still running is rolled back first, as a rerun does."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise KVVizError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")
        params = turn_sampling(sampling)
        with self._lock:
            self.interrupt("interrupted by a rerun")
            self.max_new_tokens, self.timestamp, self.params = max_new_tokens, bool(timestamp), params

    def rebuild(self, model: LoadedModel, *, cache: CacheSpec, backend: str = "fast",
                reason: str = "the cache settings changed") -> None:
        """Go on with another model or cache (the messages and turns stay; the new cache is empty,
        so the next turn prefills the whole transcript and reuses nothing). A turn still running
        is rolled back and kept as interrupted, with ``reason``. A cache that cannot be built
        raises KVVizError and changes nothing."""
        if not getattr(model.tokenizer, "chat_template", None):
            raise KVVizError(f"model {model.name!r} has no chat template: a conversation needs an instruct model")
        fast, kv = fast_backend(backend), chat_kv(model, chat_cache(cache))
        new = _new_cache(model, cache.kind, cache.block_size, cache.blocks, None, kv)
        with self._lock:
            self.interrupt(reason)
            self.model, self.fast, self.cache, self.cache_kind, self.kv = model, fast, new, cache.kind, kv
            self.held, self.carried, self._epoch = [], len(self.turns), self._epoch + 1

    # ------------------------------------------------------------------ the conversation
    def render(self, messages: list[dict[str, str]]) -> list[int]:
        system = self.system
        if self.timestamp:  # what some deployments do, and why their prefix cache never hits
            system = f"Current time: {datetime.now().isoformat(timespec='microseconds')}. {system or ''}".strip()
        msgs = ([{"role": "system", "content": system}] if system else []) + messages
        return list(chat_prompt(self.model.tokenizer, msgs, parse_special=self.parse_special).ids)

    def send(self, text: str) -> TurnRecord:
        """Ask ``text`` after the conversation so far; run the turn to its end."""
        return self._drain(self.iter_send(text))

    def edit(self, turn: int, text: str) -> TurnRecord:
        """Replace user message ``turn`` (0-based), drop what followed, answer again."""
        return self._drain(self.iter_edit(turn, text))

    def regenerate(self, seed: int | None = None) -> TurnRecord:
        """Answer the last message again (with ``seed`` when sampling). The cache keeps the prompt
        but its last position; on a paged cache a block the old answer filled is hashed, so the
        new answer's first write copies it (copy-on-write) and the old answer stays findable."""
        return self._drain(self.iter_regenerate(seed))

    def _drain(self, it: Iterator[dict[str, Any]]) -> TurnRecord:
        for _ in it:
            pass
        return self.turns[-1]

    def iter_edit(self, turn: int, text: str) -> Iterator[dict[str, Any]]:
        """``edit`` one step at a time (as ``iter_send``); nothing changes until the turn ends."""
        if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < len(self.turns):
            raise KVVizError(f"there is no turn {turn + 1 if isinstance(turn, int) else turn} to edit "
                             f"(the conversation has {len(self.turns)})")
        return self.iter_send(text, base=turn)

    def iter_regenerate(self, seed: int | None = None) -> Iterator[dict[str, Any]]:
        turns = self.turns
        if not turns:
            raise KVVizError("there is no answer to regenerate yet")
        # The new seed takes effect with the turn, and an interrupted turn puts the old one back.
        params = None if seed is None else replace(self.params, seed=seed)
        return self.iter_send(turns[-1].user, base=len(turns) - 1, params=params)

    def iter_send(self, text: str, base: int | None = None,
                  params: SamplingParams | None = None) -> Iterator[dict[str, Any]]:
        """Run one turn after the first ``base`` finished turns (all of them by default), yielding
        after the prefill and after every decode step (the pool's state for a paged cache, else
        {}); the TurnRecord lands in ``self.turns`` when the turn ends. Closing the iterator early,
        or starting another turn before it ends, rolls it back (see the module's docstring)."""
        if not isinstance(text, str) or not text.strip():
            raise KVVizError("the message is empty: type something to say")
        if len(text) > MAX_MESSAGE_CHARS:
            raise KVVizError(f"the message is {len(text):,} characters; the limit is {MAX_MESSAGE_CHARS:,}")
        if base is None:
            base = len(self.turns)
        elif isinstance(base, bool) or not isinstance(base, int) or not 0 <= base <= len(self.turns):
            raise KVVizError(f"a turn can follow turns 0..{len(self.turns)} (got base {base!r})")
        msgs = [*self.messages[: 2 * base], {"role": "user", "content": text}]
        ids = self.render(msgs)
        ctx = self.model.config.block_size
        if len(ids) + self.max_new_tokens > ctx:
            raise KVVizError(f"the conversation is {len(ids)} tokens; with {self.max_new_tokens} new tokens it "
                             f"passes the model's context of {ctx}: start a new chat or ask for fewer tokens")
        if isinstance(self.cache, PagedKVCache):
            need = self.cache.pool.blocks_for_sequence(len(ids) + self.max_new_tokens)
            have = self.cache.pool.blocks.num_blocks
            if need > have:
                raise KVVizError(f"the KV pool has {have} blocks of {self.cache.block_size} tokens; this turn needs "
                                 f"{need} ({len(ids)} prompt + {self.max_new_tokens} new tokens): give it more blocks")
        return self._turn(text, base, msgs, ids, params, self._epoch)

    # ------------------------------------------------------------------ the transaction
    @property
    def running(self) -> bool:
        """A turn has begun and neither ended nor rolled back."""
        return self._active is not None

    def _begin(self, tx: _Txn, ids: list[int]) -> tuple[int, int]:
        """Checkpoint the cache, then keep what the turn reuses: (positions reused, prefix-hit blocks)."""
        cache = self.cache
        reuse = min(common_prefix(self.held, ids), len(ids) - 1)
        found: list[int] = []
        if isinstance(cache, PagedKVCache):
            found = cache.match_prefix(ids[: len(ids) - 1])
        adopt = len(found) * getattr(cache, "block_size", 1) > reuse  # the pool knows more of this prefix
        # a full window (or a sliding layer's ring past its window) cannot roll back to a prefix: start again
        evicted = cache.held < cache.pos or not cache.can_truncate(reuse)
        keep = 0 if adopt or evicted else reuse
        tx.cp = cache.checkpoint(keep)
        if adopt:
            assert isinstance(cache, PagedKVCache)
            cache.truncate(0)
            cache.adopt_prefix(ids, found)
            return cache.pos, len(found)
        if evicted:
            cache.reset()
            return 0, 0
        cache.truncate(reuse)
        return reuse, 0

    def interrupt(self, reason: str = "stopped") -> bool:
        """Roll back the running turn, if any (after its running step: the lock waits for it).
        The Chat page calls it as a script run begins: a turn still running then belongs to an
        older run that Streamlit has stopped, and the page must draw the conversation without it."""
        with self._lock:
            tx = self._active
            if tx is None:
                return False
            self._abort(tx, reason)
            return True

    def drop(self, text: str, reason: str) -> None:
        """A message that never began its turn (the page's run was stopped first): kept to show,
        as an interrupted turn with no answer; the conversation does not change."""
        with self._lock:
            self.interrupted = [*self.interrupted, InterruptedTurn(len(self.turns), text, "", 0, reason)]

    def _supersede(self) -> None:
        """Roll back the turn another iterator left running (abandoned, or on another thread)."""
        if self._active is not None:
            self._abort(self._active, "replaced by a newer turn")

    def _abort(self, tx: _Txn, reason: str) -> None:
        """Roll ``tx`` back, once, and keep what it said as an InterruptedTurn."""
        with self._lock:
            if tx.done:
                return
            tx.done = True
            if self._active is tx:
                if tx.cp is not None:
                    with torch.inference_mode():
                        self.cache.restore(tx.cp)
                self.held = tx.held
                self.params = tx.params
                self._active = None
            toks = tx.out[:-1] if tx.out and tx.out[-1] == self.model.tokenizer.eos_token_id else tx.out
            self.interrupted = [*self.interrupted, InterruptedTurn(
                after=tx.base, user=tx.user, text=self.model.tokenizer.decode(toks),
                generated_tokens=len(tx.out), reason=reason)]

    def _check(self, tx: _Txn) -> None:
        if tx.done or self._active is not tx:
            raise TurnInterrupted("this turn was replaced by a newer one before it ended")

    def _turn(self, text: str, base: int, msgs: list[dict[str, str]], ids: list[int],
              params: SamplingParams | None, epoch: int) -> Iterator[dict[str, Any]]:
        tx = _Txn(text, base, [])
        reason = "stopped"
        try:
            with self._lock:
                if epoch != self._epoch:  # rendered for the model or cache before a rebuild
                    self._abort(tx, "the model or cache changed before it began")
                    raise TurnInterrupted("the model or cache changed before this turn began")
                m, cache, dev = self.model, self.cache, self.model.device  # read under the lock: rebuild swaps them
                backend = backend_of(m, self.fast)
                paged = isinstance(cache, PagedKVCache)
                self._supersede()
                self._active, tx.held, tx.params = tx, self.held, self.params
                if params is not None:
                    self.params = params
                before, cached_before = cache.bytes_used, len(self.held)
                with torch.inference_mode():
                    reuse, hits = self._begin(tx, ids)
                self.held = ids[:reuse]
                run_params, max_new, made_on = self.params, self.max_new_tokens, self.label()
            gen = None if run_params.greedy else make_generator(run_params, dev)
            eos = m.tokenizer.eos_token_id
            positions = torch.arange(m.config.block_size, device=dev)
            snaps: list[dict[str, Any]] = []
            ttft = decode = 0.0
            inp = torch.tensor([ids[reuse:]], dtype=torch.long, device=dev)  # (1, T): what is new
            stop = "max_new_tokens"
            for step in range(max_new):
                with self._lock:
                    self._check(tx)
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        logits = feed(m, cache, backend, inp, positions)
                        nxt = sample(logits.select(1, -1).float(), run_params, gen)  # (1,)
                        tok = int(nxt[0])
                        dt = (time.perf_counter() - t0) * 1000.0
                    self.held = [*self.held, *inp[0].tolist()]
                    tx.out.append(tok)
                    if paged:
                        snaps.append(cache.snapshot())  # type: ignore[union-attr]
                if step == 0:
                    ttft = dt
                else:
                    decode += dt
                yield snaps[-1] if paged else {}
                if eos is not None and tok == eos:
                    stop = "eos"
                    break
                inp = nxt.view(1, 1)
            with self._lock:
                self._check(tx)
                out = tx.out
                answer = out[:-1] if stop == "eos" else out
                reply = m.tokenizer.decode(answer)
                st = cache.stats() if paged else None  # type: ignore[union-attr]
                record = TurnRecord(
                    user=text, text=reply, prompt_ids=tuple(ids), generated_ids=tuple(out), cached_before=cached_before,
                    reused_tokens=reuse, prefilled_tokens=len(ids) - reuse, ttft_ms=ttft, decode_ms=decode,
                    cache_bytes_before=before, cache_bytes_used=cache.bytes_used,
                    cache_bytes_allocated=cache.bytes_allocated,
                    blocks_used=st.blocks_used if st else None, blocks_shared=st.blocks_shared if st else None,
                    prefix_hit_blocks=hits if paged else None, stop_reason=stop, snapshots=tuple(snaps),
                    max_new_tokens=max_new, params=run_params, made_on=made_on,
                )
                assert tx.cp is not None
                cache.commit(tx.cp)
                tx.done, self._active = True, None
                self.messages = [*msgs, {"role": "assistant", "content": reply}]
                self.turns = [*self.turns[:base], record]
                self.carried = min(self.carried, base)  # an edit or a regenerate may replace carried turns
                # what was interrupted after a turn this one replaced no longer has a place
                self.interrupted = [i for i in self.interrupted if i.after <= base]
        except TurnInterrupted:
            raise  # rolled back by the turn that replaced it
        except GeneratorExit:
            self._abort(tx, reason)
            raise
        except BaseException as e:  # inside a forward, the sampler, a KeyboardInterrupt...
            self._abort(tx, f"failed: {e}" if str(e) else f"failed: {type(e).__name__}")
            raise

    def warm_up(self) -> None:
        """One throwaway prefill and decode step on a scratch cache, so turn 1's TTFT times the
        model and not first-call costs (kernel build, allocator growth, thread start)."""
        m = self.model
        backend = backend_of(m, self.fast)
        ids = self.render([{"role": "user", "content": "Hi"}])
        with torch.inference_mode():
            cache = make_cache("static", m.config, 1, m.device, m.dtype)
            inp = torch.tensor([ids], dtype=torch.long, device=m.device)  # (1, N)
            run_step(m, cache, inp, torch.arange(len(ids), device=m.device), backend=backend)
            run_step(m, cache, inp[:, -1:], torch.arange(len(ids), len(ids) + 1, device=m.device), backend=backend)


def _new_cache(model: LoadedModel, kind: str, block_size: int, blocks: int | None, pool: PagedPool | None,
               kv: KVSpec | None) -> KVCache:
    """A batch-1 cache for a conversation; a paged one checked against the pool's limits and memory."""
    cfg = model.config
    with torch.inference_mode():
        if kind != "paged":  # an active kv spec (resolved) makes it quantized or windowed
            return make_cache(kind, cfg, 1, model.device, model.dtype, kv=kv)
        groups = config_groups(cfg).count  # a hybrid model's layer groups each keep a table
        check_pool(block_size, blocks, 1, groups)
        if pool is None and blocks is None:
            # The context of one sequence plus as much again for blocks kept by prefix hash.
            blocks = pool_blocks(groups, blocks_for(cfg.block_size, block_size), rows=2)
        if pool is None:
            check_pool_memory(model, block_size, blocks)
        return make_cache("paged", cfg, 1, model.device, model.dtype, block_size=block_size, num_blocks=blocks,
                          pool=pool)
