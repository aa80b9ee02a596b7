"""A chat turn is a transaction: interrupted at any yield, or by a failure inside any layer's
forward of the prefill or a decode step, on every cache kind and both engines, the conversation
and its cache are exactly as before the turn, and the next turns answer as if it never ran."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import pytest
import torch

import kvviz.fast.llama_flat as fast_llama
from chat_fixtures import chat_model
from kvviz.engine.kvcache.dense import KVCache, StaticKVCache
from kvviz.engine.sessions.conversation import Conversation, TurnInterrupted
from kvviz.engine.kvcache.compressed_caches import QuantizedKVCache, WindowKVCache
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.kvcache.paged_cache import PagedKVCache
from kvviz.errors import KVVizError
from kvviz import CacheSpec, SamplingParams

ASKED = ["hello there, how are you", "and then, what happened?"]  # the turns before the interruption
CUT = "this turn is cut short"
AFTER = ["tell me more about it", "one more thing"]  # the turns after it
NEW = 6
KINDS = ["static", "concat", "paged", "quantized", "window"]


class Boom(RuntimeError):
    """The injected failure."""


@pytest.fixture(scope="module")
def chat_llama(make_llama: Callable[..., LoadedModel]) -> LoadedModel:
    return chat_model(make_llama(block_size=256))


def make_conv(model: LoadedModel, kind: str, fast: bool, window: int = 20) -> Conversation:
    spec = {"quantized": dict(kv_dtype="int8"),
            "window": dict(window=window, sinks=4)}.get(kind)  # 4 sinks + 20: the second turn already wraps the ring
    cache = CacheSpec(kind="static", **spec) if spec else CacheSpec(kind=kind, block_size=8, blocks=64)
    return Conversation(model, cache=cache, max_new_tokens=NEW, backend="fast" if fast else "readable")


def state(conv: Conversation) -> dict[str, Any]:
    """Everything a turn may touch, copied: the conversation, the cache's positions and contents,
    a paged cache's tables and its pool's whole bookkeeping."""
    c: KVCache = conv.cache
    out: dict[str, Any] = {"messages": [dict(m) for m in conv.messages], "held": list(conv.held),
                           "turns": list(conv.turns), "pos": c.pos, "running": conv.running}
    with torch.inference_mode():
        if isinstance(c, StaticKVCache):
            out["kv"] = [t[:, :, : c.pos].clone() for t in (*c.k, *c.v)]
        elif isinstance(c, (QuantizedKVCache, WindowKVCache)):
            store = c.store
            ts = store._slotted() if hasattr(store, "_slotted") else [*store.k, *store.v]
            out["kv"] = [t.clone() for t in ts]  # every slot, the ring's included
        elif isinstance(c, PagedKVCache):
            bp = c.pool.blocks
            out["paged"] = (c.tables, c.tokens, c.hashes, bp.ref_count, list(bp.free), bp.hash_of, bp.by_hash,
                            list(bp.lru), bp.cow_copies, bp.evictions, bp.hits)
            out["paged"] = repr(out["paged"])  # a deep copy, compared as text
            live = [b for b in range(bp.num_blocks) if bp.ref_count[b] > 0 or b in bp.lru]
            out["kv"] = [t[live].clone() for t in (*c.pool.k, *c.pool.v)]
        else:
            out["kv"] = [x.clone() for i in range(c.config.n_layer) for x in c.layer(i)]
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in a:
        if key == "kv":
            assert len(a[key]) == len(b[key])
            for x, y in zip(a[key], b[key]):
                # Bit for bit: a block's slots past its last written position hold whatever
                # torch.empty found there, NaN patterns included, and NaN != NaN would fail a
                # value comparison of two identical blocks (it did, in suite runs whose earlier
                # tests left NaNs in the memory the pool reused).
                assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), \
                    "cache contents differ"
        else:
            assert a[key] == b[key], key


def refs_equal_tables(conv: Conversation) -> None:
    c = conv.cache
    if not isinstance(c, PagedKVCache):
        return
    bp = c.pool.blocks
    bp.check()
    for b in range(bp.num_blocks):
        assert bp.ref_count[b] == sum(t.count(b) for t in c.tables), f"block {b}"


class Failing:
    """Raises Boom inside layer ``layer``'s forward of the ``step``-th forward of a turn (0: the
    prefill), after that layer wrote the cache: through the cache's update (both engines) and,
    for the accelerator's one-call decode step on a static cache, after that call wrote every layer."""

    def __init__(self, cache: KVCache, step: int, layer: int) -> None:
        self.cache, self.step, self.layer, self.forwards = cache, step, layer, -1
        self.fired = False

    def __enter__(self) -> "Failing":
        cache, orig = self.cache, type(self.cache).update

        def update(layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> Any:
            if layer_idx == 0:
                self.forwards += 1
            out = orig(cache, layer_idx, k, v)
            if self.forwards == self.step and layer_idx == self.layer:
                self.fired = True
                raise Boom(f"layer {layer_idx} of forward {self.forwards}")
            return out

        cache.update = update  # type: ignore[method-assign]
        self._step_for = fast_llama.step_for

        def step_for(ops: Any, c: Any, cfg: Any) -> Any:
            step = self._step_for(ops, c, cfg)
            if step is None or c is not cache:
                return step

            def run(*a: Any) -> Any:
                self.forwards += 1
                got = step.decode(*a)  # the cache's slot taken, C's write done
                if self.forwards == self.step:
                    self.fired = True
                    raise Boom(f"after the C step of forward {self.forwards}")
                return got

            class Wrapped:  # the step's other attributes (write_bytes) as they were
                def __getattr__(self, name: str) -> Any:
                    return getattr(step, name)

                def decode(self, *a: Any) -> Any:
                    return run(*a)

            return Wrapped()

        fast_llama.step_for = step_for
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.cache.update
        fast_llama.step_for = self._step_for


def interruptions(n_layer: int) -> list[tuple[str, int, int]]:
    """(how, step, layer): at every yield three ways, and a failure in every layer of the prefill
    and of a decode step."""
    out = [(how, k, -1) for k in range(NEW) for how in ("close", "throw", "replace")]
    out += [("fail", step, layer) for step in (0, 2) for layer in range(n_layer)]
    return out


def interrupt(conv: Conversation, how: str, step: int, layer: int) -> None:
    if how == "fail":
        with Failing(conv.cache, step, layer) as f:
            with pytest.raises(Boom):
                conv.send(CUT)
        assert f.fired
        return
    it: Iterator[dict[str, Any]] = conv.iter_send(CUT)
    for _ in range(step + 1):
        next(it)
    if how == "close":  # an abandoned iterator closed (GeneratorExit at the yield)
        it.close()
    elif how == "throw":  # a rerun or Stop raised into the generator at the yield
        with pytest.raises(KeyboardInterrupt):
            it.throw(KeyboardInterrupt())
    else:  # left suspended: the next turn replaces it, and resuming it then says so
        conv.iter_send(AFTER[0])  # only the first next() begins a turn
        other = conv.iter_send(AFTER[0])
        next(other)
        other.close()
        with pytest.raises(TurnInterrupted):
            next(it)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "readable"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_interrupted_turn_leaves_no_trace(chat_llama: LoadedModel, kind: str, fast: bool) -> None:
    ref = make_conv(chat_llama, kind, fast)
    for q in ASKED + AFTER:
        ref.send(q)
    want = [list(t.generated_ids) for t in ref.turns[len(ASKED):]]
    if kind in ("static", "concat", "paged"):  # the reference itself equals a from-scratch run
        assert all(ref.matches_scratch(k) for k in range(len(ref.turns)))
    for how, step, layer in interruptions(chat_llama.config.n_layer):
        conv = make_conv(chat_llama, kind, fast)
        for q in ASKED:
            conv.send(q)
        before = state(conv)
        interrupt(conv, how, step, layer)
        if how == "replace":  # the replacing turn was itself closed: both rolled back
            assert [i.reason for i in conv.interrupted] == ["replaced by a newer turn", "stopped"]
        else:
            (cut,) = conv.interrupted
            assert cut.after == len(ASKED) and cut.user == CUT
            assert cut.reason.startswith("failed" if how in ("fail", "throw") else "stopped")
            if how != "fail":  # the partial answer is kept: one token per yield passed
                assert cut.generated_tokens == step + 1
        assert_same(before, state(conv))
        refs_equal_tables(conv)
        for q in AFTER:
            conv.send(q)
            refs_equal_tables(conv)
        assert [list(t.generated_ids) for t in conv.turns[len(ASKED):]] == want, (how, step, layer)
        assert [m["content"] for m in conv.messages] == [m["content"] for m in ref.messages]


@pytest.mark.parametrize("window", [20, 70])
def test_a_window_turn_that_wraps_the_ring_is_restored(chat_llama: LoadedModel, window: int) -> None:
    """The turn being cut overwrote ring slots that held the previous turns: they come back. With
    a window of 20 the ring was in use before the turn; with 70 the cut turn is the one to wrap it
    (its reused prefix is kept, and its writes past the capacity land on slots below that prefix)."""
    conv = make_conv(chat_llama, "window", True, window)
    for q in ASKED[: 1 if window > 20 else 2]:
        conv.send(q)
    c = conv.cache
    assert isinstance(c, WindowKVCache)
    assert (c.pos > c.capacity) == (window == 20)
    before = state(conv)
    it = conv.iter_send(ASKED[1] if window > 20 else CUT)
    for _ in range(NEW):
        next(it)
    assert c.pos > c.capacity  # the ring wrapped inside this turn
    it.close()
    assert_same(before, state(conv))
    refs_equal_tables(conv)


def test_edit_and_regenerate_replace_a_running_turn(chat_llama: LoadedModel) -> None:
    conv = make_conv(chat_llama, "paged", True)
    ref = make_conv(chat_llama, "paged", True)
    for q in ASKED:
        conv.send(q)
        ref.send(q)
    want = list(ref.regenerate().generated_ids)
    parked = []  # kept alive, as a script thread Streamlit stopped keeps its frame for a while
    for _ in range(8):  # Regenerate clicked eight times quickly: each replaces the one before
        parked.append(conv.iter_regenerate())
        next(parked[-1])
    t = conv.regenerate()
    assert list(t.generated_ids) == want and len(conv.turns) == len(ASKED) and not conv.running
    assert [i.reason for i in conv.interrupted] == ["replaced by a newer turn"] * 8
    refs_equal_tables(conv)
    edited = conv.iter_edit(0, "an edit")
    next(edited)
    conv.send(AFTER[0])  # a new message replaces the running edit: the edit never happened
    assert [m["content"] for m in conv.messages][:4] == [m["content"] for m in ref.messages][:4]
    assert conv.matches_scratch(len(conv.turns) - 1)


def test_a_turn_on_another_thread_waits_for_the_running_step(chat_llama: LoadedModel) -> None:
    """A Streamlit rerun starts a new script thread while the old one is inside a forward: the new
    turn waits for that step, then replaces the old turn; no forward interleaves with another."""
    conv = make_conv(chat_llama, "paged", True)
    ref = make_conv(chat_llama, "paged", True)
    for q in ASKED:
        conv.send(q)
        ref.send(q)
    want = list(ref.send(AFTER[0]).generated_ids)
    inside, release = threading.Event(), threading.Event()
    orig = PagedKVCache.update

    def slow_update(self: PagedKVCache, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> Any:
        if threading.current_thread().name == "old" and layer_idx == 0 and not inside.is_set():
            inside.set()
            release.wait(10)  # the old thread is stuck inside its forward
        return orig(self, layer_idx, k, v)

    errors: list[BaseException] = []
    new_done = threading.Event()

    def old() -> None:  # a script run: a step, then drawing (here: waiting) while the new turn runs
        it = conv.iter_send(CUT)
        try:
            next(it)
            new_done.wait(10)
            next(it)
            errors.append(AssertionError("the old turn went on"))
        except TurnInterrupted:
            pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    PagedKVCache.update = slow_update  # type: ignore[method-assign]
    try:
        t = threading.Thread(target=old, name="old")
        t.start()
        assert inside.wait(10)
        got: list[Any] = []
        t2 = threading.Thread(target=lambda: got.append(conv.send(AFTER[0])), name="new")
        t2.start()
        t2.join(0.3)
        assert t2.is_alive()  # waiting for the old step, not writing beside it
        release.set()
        t2.join(10)
        new_done.set()
        t.join(10)
    finally:
        PagedKVCache.update = orig  # type: ignore[method-assign]
    assert not errors
    assert list(got[0].generated_ids) == want
    assert [i.reason for i in conv.interrupted] == ["replaced by a newer turn"]
    refs_equal_tables(conv)


def test_interrupt_rolls_back_a_turn_left_running(chat_llama: LoadedModel) -> None:
    """What the Chat page does as a script run begins: a turn an older (stopped) run left open goes."""
    conv = make_conv(chat_llama, "static", True)
    conv.send(ASKED[0])
    before = state(conv)
    assert conv.interrupt() is False  # nothing running
    it = conv.iter_send(CUT)
    next(it)
    assert conv.running and conv.interrupt("interrupted by a rerun") is True and not conv.running
    assert_same(before, state(conv))
    assert [(i.reason, i.generated_tokens) for i in conv.interrupted] == [("interrupted by a rerun", 1)]
    with pytest.raises(TurnInterrupted):
        next(it)


def test_abandoned_parallel_samples_give_their_blocks_back(chat_llama: LoadedModel) -> None:
    from kvviz.engine.kvcache.paged_cache import PagedPool
    from kvviz.engine.sessions.parallel_samples import ParallelSamples

    m = chat_llama
    pool = PagedPool(m.config, 32, 4, m.device, m.dtype)
    ps = ParallelSamples(m, list(b"a prompt of some bytes"), n=3, max_new_tokens=8, kv_block_size=4, pool=pool)
    it = iter(ps)
    for _ in range(3):
        next(it)
    assert sum(pool.blocks.ref_count) > 0
    it.close()  # abandoned: a rerun or Stop while drawing
    pool.blocks.check()
    assert sum(pool.blocks.ref_count) == 0 and len(pool.blocks.free) + len(pool.blocks.lru) == 32


def test_a_stepper_advanced_from_two_threads_takes_turns() -> None:
    """Two script threads stepping one parked stream: the second waits (a bare generator raises
    "generator already executing")."""
    import time

    from kvviz.ui.common.stepper import Stepper

    class Slow:
        def __iter__(self) -> Iterator[int]:
            for i in range(4):
                time.sleep(0.05)
                yield i

    s = Stepper(0, Slow())  # type: ignore[arg-type]
    got: list[Any] = []
    errors: list[BaseException] = []

    def step() -> None:
        try:
            got.append(s.advance())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=step) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not errors and sorted(got) == [0, 1]
    s.close()


def test_smollm2_turn_failing_mid_decode_rolls_back(smollm2: LoadedModel) -> None:
    """The issue's model and cache (SmolLM2, paged, the accelerator): a turn failing inside layer 15
    of its third forward leaves the conversation as it was; the next turn equals a fresh run."""
    conv = Conversation(smollm2, cache=CacheSpec(kind="paged"), max_new_tokens=8)
    conv.send("What is the capital of France?")
    before = state(conv)
    with Failing(conv.cache, 2, 15) as f:
        with pytest.raises(Boom):
            conv.send("And of Italy?")
    assert f.fired
    assert_same(before, state(conv))
    refs_equal_tables(conv)
    t = conv.send("And of Spain?")
    assert conv.matches_scratch(1) and t.reused_tokens == t.cached_before > 0
    refs_equal_tables(conv)


def test_an_interrupted_regenerate_keeps_the_old_seed(chat_llama: LoadedModel) -> None:
    """Regenerate with a new seed, closed after its first step: the conversation samples with the
    old seed again (it used to keep the new one, so the next turn's answer changed); a regenerate
    that finishes keeps its seed."""
    conv = Conversation(chat_llama, cache=CacheSpec(kind="paged", block_size=8, blocks=64), max_new_tokens=NEW,
                        sampling=SamplingParams(greedy=False, temperature=1.0, seed=3))
    conv.send(ASKED[0])
    it = conv.iter_regenerate(seed=11)
    next(it)
    assert conv.params.seed == 11  # in effect while the turn runs
    it.close()
    assert conv.params.seed == 3 and not conv.running
    conv.regenerate(seed=11)
    assert conv.params.seed == 11


@pytest.mark.parametrize("base", [-1, 5, "1", True])
def test_iter_send_names_a_base_outside_the_turns(chat_llama: LoadedModel, base: Any) -> None:
    # base -1 used to slice off the last turn's messages silently; "1" raised a TypeError.
    conv = make_conv(chat_llama, "static", True)
    conv.send(ASKED[0])
    with pytest.raises(KVVizError, match=r"a turn can follow turns 0\.\.1"):
        conv.iter_send(ASKED[1], base=base)
    assert len(conv.turns) == 1 and not conv.running
