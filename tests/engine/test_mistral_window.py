"""Mistral's one window on every layer (issue 30): every cache keeps only the window, as Gemma 3's
sliding layers do, and gives transformers' MistralForCausalLM's logits past it.

The tiny model: transformers' Mistral with random weights (3 layers, 4 query heads over 2 K/V heads
of 16 dims, window W = 6), loaded into kvviz's Llama as a config flag. One position of one layer,
K and V in fp32, is 2 x 2 x 16 x 4 = 256 B. Every run goes well past the window, and the chunked
prefills include chunks longer than it.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import kvviz
from kvviz.engine.generation.capture import Capture
from kvviz.engine.generation.request import kv_spec
from kvviz.engine.kvcache.compressed_caches import QuantizedKVCache, WindowKVCache
from kvviz.engine.kvcache.dense import layer_windows
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.generation.kv_spec import KVSpec, resolve
from kvviz.engine.loaded import wrap_model
from kvviz.engine.models.llama import Llama, LlamaConfig
from kvviz.engine.tokenize.tokenizer import ByteTokenizer
from kvviz.errors import KVVizError
from test_gemma3_tiny import _feed
from kvviz import CacheSpec, SamplingParams
from keyword_sets import request_kwargs

transformers = pytest.importorskip("transformers")

W = 6
ROW = 2 * 2 * 16 * 4  # bytes of one position of one layer: K and V, 2 heads x 16 fp32
HF = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=W, rms_norm_eps=1e-5,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
          initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CUTS = [(1,), (8,), (3, 12), (20,)]  # prefill chunks ending at each cut, then one token at a time


@pytest.fixture(scope="module")
def pair() -> tuple[Any, kvviz.LoadedModel]:
    """(transformers' Mistral, kvviz's Llama with the same weights and window)."""
    torch.manual_seed(5)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(**HF))
    with torch.no_grad():
        hf.model.norm.weight.mul_(10.0)  # spread the logits: greedy never sits on a float-noise tie
    hf.eval()
    cfg = LlamaConfig(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, head_dim=16,
                      intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-5, family="mistral",
                      sliding_window=W)
    net = Llama.from_state_dict(cfg, {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    return hf, wrap_model(net, ByteTokenizer(256), "tiny-mistral", source="tests")


def _ids(n: int = 30, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_every_layer_gets_the_window(pair: tuple[Any, kvviz.LoadedModel]) -> None:
    c = pair[1].config
    assert layer_windows(c) == (W,) * 3
    assert layer_windows(LlamaConfig(n_layer=2)) == (None, None)  # no window: every position, as before
    static = make_cache("static", c, 1, "cpu", torch.float32)
    assert [t.shape[2] for t in static.k] == [W] * 3 and static.bytes_allocated == 3 * W * ROW
    paged = make_cache("paged", c, 1, "cpu", torch.float32, block_size=4)
    assert paged.groups.windows == (W,) and paged.groups.layers == ((0, 1, 2),)
    # Mistral 7B v0.1 in the calculator: 32 layers, each sliding 4096; the engine gives a config of
    # that shape the same windows.
    from kvviz.calculator.presets import load_presets

    spec = load_presets()["mistral-7b-v0.1"]
    big = LlamaConfig(vocab_size=32000, block_size=32768, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                      intermediate_size=14336, family="mistral", sliding_window=4096)
    assert layer_windows(big) == tuple(spec.layer(i).span for i in range(32)) == (4096,) * 32


@pytest.mark.parametrize("kind", ["static", "concat", "paged-1", "paged-4"])
@pytest.mark.parametrize("cuts", CUTS)
def test_every_cache_kind_past_the_window_equals_transformers(pair: tuple[Any, kvviz.LoadedModel], kind: str,
                                                              cuts: tuple[int, ...]) -> None:
    hf, m = pair
    ids = _ids()
    name, _, bs = kind.partition("-")
    cache = make_cache(name, m.config, 1, "cpu", torch.float32, **({"block_size": int(bs)} if bs else {}))
    with torch.inference_mode():
        want = hf(ids).logits  # (1, 30, V)
        whole = m.model(ids)
        got = _feed(m, cache, ids, cuts)
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # After 30 positions: the ring holds W; a paged layer the blocks from the one holding position
    # 30 - W + 1 = 25 (the next query's window) on; the concat cache every position.
    held = {"static": W, "concat": 30, "paged-1": 30 - 25, "paged-4": 32 - 24}[kind]
    assert cache.layer_bytes() == [held * ROW] * 3


class _Recording(QuantizedKVCache):
    """A ring that keeps every K/V it was given, in order, to replay into the reference."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.given.append((k.clone(), v.clone()))
        return super().update(layer_idx, k, v)


class _Replaying(QuantizedKVCache):
    """The flat reference, quantizing the very K/V the ring was given instead of its own.

    Its own K/V differ from the ring's in float order only (its attention sums over 30 rows, the
    ring's over W), yet one ulp on a value at a rounding boundary moves it a whole quantization step
    (an int8 step is the row's max / 127), and the next layers carry that on: 34% of the logits
    0.25 apart on an AVX-512 machine. Fed the same K/V, both quantize the same numbers."""

    def __init__(self, given: list[tuple[torch.Tensor, torch.Tensor]], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given = list(given)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gk, gv = self.given.pop(0)
        # The ring's K/V came from the same cache contents through attention over fewer rows.
        torch.testing.assert_close((k, v), (gk, gv), atol=1e-4, rtol=1e-4)
        return super().update(layer_idx, gk, gv)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("cuts", [(8,), (3, 12)])
def test_quantized_rings_equal_the_same_quant_keeping_every_position(pair: tuple[Any, kvviz.LoadedModel],
                                                                      kv_dtype: str, cuts: tuple[int, ...]) -> None:
    """Each row is quantized alone, so a ring's held rows are the numbers the flat store holds.

    Exact where it is deterministic (the same K/V quantize to the same codes), float-order bounded
    where it is not (attention over W rows vs 30): the reference replays the ring's K/V."""
    m = pair[1]
    spec = kv_spec(m, kv_dtype)
    ids = _ids()
    ring = _Recording(m.config, spec)
    with torch.inference_mode():
        got = _feed(m, ring, ids, cuts)
        flat = _Replaying(ring.given, m.config, spec, rings=False)
        ref = _feed(m, flat, ids, cuts)
    assert not flat.given  # every K/V the ring was given was replayed
    for i in range(m.config.n_layer):  # the ring's W rows are the flat store's last W, to the bit
        slots = [p % W for p in range(30 - W, 30)]  # position p sits in slot p % W
        for mine, theirs in zip(ring.layer(i), flat.layer(i)):
            assert torch.equal(mine[:, :, slots], theirs[:, :, 30 - W:])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)  # float order only: SDPA over W rows vs 30
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # one position of one layer, K and V of 2 heads: int8 16 B + an fp16 scale, int4 8 B + a scale
    per = {"int8": 2 * 2 * 18, "int4": 2 * 2 * 10}[kv_dtype]
    assert ring.layer_bytes() == [W * per] * 3 and flat.layer_bytes() == [30 * per] * 3


def test_generate_matches_transformers_and_bytes_level_off_as_the_calculator_says(
        pair: tuple[Any, kvviz.LoadedModel]) -> None:
    from kvviz.calculator.formulas import layer_token_bytes, tokens_held
    from kvviz.calculator.hf_config import parse_config
    from kvviz.calculator.spec import MemoryRequest

    hf, m = pair
    prompt = _ids(4, seed=8)[0].tolist()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, 4:].tolist()
    runs = {kind: kvviz.generate(m, prompt=prompt, max_new_tokens=20, sampling=SamplingParams(greedy=True),
                                 cache=CacheSpec(kind=kind, block_size=2)) for kind in ("static", "concat", "paged")}
    for kind, run in runs.items():
        assert run.generated_ids == want, kind
    spec = parse_config(hf.config.to_dict())  # the calculator's reading of the same config
    fmt = MemoryRequest(seq_len=1, kv_dtype="fp32").kv_format
    assert layer_token_bytes(spec, fmt) == ROW
    for ev in runs["static"].events:
        assert list(ev.cache_layer_bytes) == [layer_token_bytes(spec, fmt) * tokens_held(spec.layer(i), ev.position)
                                              for i in range(3)] == [min(ev.position, W) * ROW] * 3, ev.step
    last = runs["paged"].events[-1]  # 23 positions, blocks of 2: blocks 9.. (positions 18..22) are held
    assert last.position == 23 and list(last.cache_layer_bytes) == [3 * 2 * ROW] * 3
    # The app's formula counts each layer's own positions (every layer equal here, yet a window)
    from kvviz.ui.pages.generate.metrics import bytes_formula

    assert "(3 layers × 6 tokens) = **4,608 B**" in bytes_formula(runs["static"])
    assert all("⚠️" not in bytes_formula(r) for r in runs.values())


def test_beams_and_speculative_past_the_window(pair: tuple[Any, kvviz.LoadedModel]) -> None:
    m = pair[1]
    kw: dict[str, Any] = dict(prompt_ids=[60, 61, 62], max_new_tokens=15)
    beams = {k: kvviz.generate(m, **request_kwargs(cache_kind=k, num_beams=3, **kw)).generated_ids for k in ("static", "paged", "concat")}
    assert beams["static"] == beams["paged"] == beams["concat"]
    greedy = kvviz.generate(m, **request_kwargs(greedy=True, cache_kind="concat", **kw)).generated_ids
    spec = dict(greedy=True, speculative="prompt_lookup", draft_tokens=3, ngram=1, **kw)
    for kind in ("paged", "concat"):  # a paged cache keeps the blocks a rollback needs
        assert kvviz.generate(m, **request_kwargs(cache_kind=kind, kv_block_size=2, **spec)).generated_ids == greedy, kind
    with pytest.raises(KVVizError, match="keeps only the last 6 positions"):  # a ring cannot roll back
        kvviz.generate(m, **request_kwargs(cache_kind="static", **spec))


def test_captured_attention_over_a_ring_equals_the_full_cache(pair: tuple[Any, kvviz.LoadedModel]) -> None:
    """The ring's rows are laid back at their positions: the weights, keys outside the window at
    zero, are the concat cache's (whose mask hides the same keys)."""
    m = pair[1]
    cap = Capture(attention=True, kv_norms=True, kv_layer=1)
    runs = [kvviz.generate(m, prompt=[7, 8, 9, 10], max_new_tokens=8, capture=cap,
                           sampling=SamplingParams(greedy=True), cache=CacheSpec(kind=k))
            for k in ("static", "concat")]
    for a, b in zip(*(r.events for r in runs)):
        assert a.attn is not None and b.attn is not None and a.attn.shape == b.attn.shape == (3, 4, a.position)
        assert (a.attn[..., : max(0, a.position - W)] == 0).all()
        torch.testing.assert_close(torch.from_numpy(a.attn).float(), torch.from_numpy(b.attn).float(), atol=2e-3, rtol=0)
        assert a.kv_values is not None and b.kv_values is not None
        torch.testing.assert_close(torch.from_numpy(a.kv_values), torch.from_numpy(b.kv_values))


def test_chat_turns_and_an_edit_on_a_ring_answer_as_a_full_cache(pair: tuple[Any, kvviz.LoadedModel]) -> None:
    from chat_fixtures import chat_model
    from kvviz.engine.sessions.conversation import Conversation

    m = chat_model(pair[1])
    got = {}
    for kind in ("static", "paged", "concat"):
        conv = Conversation(m, cache=CacheSpec(kind=kind, block_size=2), max_new_tokens=4)
        got[kind] = [t.generated_ids for t in (conv.send("hi"), conv.send("more"), conv.edit(0, "x"))]
    assert got["static"] == got["paged"] == got["concat"]


def test_a_run_time_window_cache_is_refused_by_the_model(pair: tuple[Any, kvviz.LoadedModel]) -> None:
    m = pair[1]
    cache = WindowKVCache(m.config, resolve(KVSpec(window=8), "llama", 16, 128))
    with torch.inference_mode(), pytest.raises(ValueError, match="keeps its own window"):
        m.model(_ids(4), cache=cache)
