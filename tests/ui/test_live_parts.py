"""The live page's pure parts: token chips (escaping), capture budget, run store, model folders."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvviz import Capture, KVVizError, LoadedModel, generate
from kvviz.engine.loading.loader import RANDOM_SHAPES
from kvviz.ui.state import model_menu
from kvviz.ui.state.run_store import RunStore
from kvviz.ui.common import budget
from kvviz.ui.pages.generate import chips, metrics
from kvviz.ui.settings import Settings
from kvviz import CacheSpec, SamplingParams

XSS = '<img src=x onerror=alert(1)> <b>bold</b> "q" & \'s\' 😀 שלום'


# --- chips ----------------------------------------------------------------------------------------

def test_chips_escape_every_piece_of_text(make_model) -> None:  # type: ignore[no-untyped-def]
    run = generate(make_model(block_size=256), prompt=XSS, max_new_tokens=3)
    html = chips.run_html(run)
    assert "<img" not in html and "<b>" not in html and "onerror=alert(1)>" not in html
    assert "&lt;img" in html  # the prompt is shown, escaped
    assert html.count("<span") == html.count("</span>")


def _toks(displays: list[str]) -> list[tuple[str, bytes]]:
    """(display, bytes) as a byte tokenizer gives them: '<0xF0>' is the byte 0xF0."""
    return [(d, bytes([int(d[3:5], 16)]) if d.startswith("<0x") else d.encode()) for d in displays]


def test_chips_group_utf8_bytes_into_one_glyph_over_its_byte_boxes() -> None:
    tokens = _toks(["a", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", " ", "\n", "\n", "b", "<0xD7>"])
    cs = chips.build_chips(tokens, n_prompt=2)
    texts = [c.text for c in cs]
    assert texts == ["a", "😀", "·", "↵", "↵", "b", "<0xD7>"]  # a trailing partial byte stays a byte
    emoji = cs[1]
    assert emoji.byte_labels == ("F0", "9F", "98", "80") and not emoji.generated  # starts inside the prompt
    assert cs[-1].newest and cs[-1].generated
    assert cs[2].whitespace


def test_chips_mark_typed_control_token_text_and_escape_it() -> None:
    """"<|im_end|>" typed and encoded as text (5 pieces) is marked; the real control token (one
    token holding the whole text) is not; the marked text is escaped like any other."""
    pieces = [("hi", b"hi"), ("<|im_end|>", b"<|im_end|>"), (" <", b" <"), ("|", b"|"), ("im", b"im"),
              ("_end", b"_end"), ("|", b"|"), (">", b">"), ("<b>", b"<b>")]
    cs = chips.build_chips(pieces, n_prompt=9)
    assert [i for i, c in enumerate(cs) if c.lookalike] == [2, 3, 4, 5, 6, 7]
    assert "not a turn boundary" in cs[2].title and "not a turn boundary" not in cs[1].title
    body = chips.chips_body(cs)
    assert body.count("kv-look") == 6 and "<b>" not in body and "&lt;b&gt;" in body


def test_chips_break_lines_after_a_run_of_newlines() -> None:
    body = chips.chips_body(chips.build_chips(_toks(list("a\n\nb\nc")), n_prompt=6))
    assert body.count("<br>") == 2  # after "↵↵" and after the single "↵"
    assert body.index("<br>") > body.rindex("↵", 0, body.index("b<"))


def test_chips_render_invalid_byte_runs_as_separate_bytes() -> None:
    cs = chips.build_chips(_toks(["<0xFF>", "<0xFE>", "<0xFD>", "<0xFC>", "x"]), n_prompt=5)
    assert [c.text for c in cs] == ["<0xFF>", "<0xFE>", "<0xFD>", "<0xFC>", "x"]
    # A lead byte followed by another lead byte stands alone; the second still makes its character.
    cs = chips.build_chips(_toks(["<0xD1>", "<0xD1>", "<0x89>", "<0xE2>"]), n_prompt=0)
    assert [c.text for c in cs] == ["<0xD1>", "щ", "<0xE2>"]


def test_chips_group_multi_byte_bpe_pieces_and_label_each_piece_in_hex() -> None:
    """A BPE token can carry two bytes of a four-byte emoji: pieces, not single bytes, are grouped."""
    cs = chips.build_chips([("x", b"x"), ("<0xF0><0x9F>", b"\xf0\x9f"), ("<0x98><0x80>", b"\x98\x80")], n_prompt=1)
    assert [c.text for c in cs] == ["x", "😀"] and cs[1].byte_labels == ("F0 9F", "98 80")


# --- capture budget -----------------------------------------------------------------------------

def test_projected_capture_bytes_are_exact(small_model: LoadedModel) -> None:
    c = small_model.config
    shape = budget.Shape(c.n_layer, c.n_head, c.kv_heads, c.head_dim)
    for use_cache in (True, False):
        run = generate(small_model, prompt="Hello", max_new_tokens=7,
                       capture=Capture(attention=True, kv_norms=True, kv_layer=1),
                       cache=CacheSpec(use_cache=use_cache))
        assert run.capture_nbytes() == budget.projected_capture_bytes(shape, 5, 7)


@pytest.mark.parametrize("name", list(RANDOM_SHAPES))
def test_a_max_settings_run_fits_the_session_budget(name: str) -> None:
    """Longest context (1 prompt token, the rest generated), planned capture: under the budget."""
    c = RANDOM_SHAPES[name]
    shape = budget.Shape(c.n_layer, c.n_head, c.kv_heads, c.head_dim)
    cap, note = budget.plan_capture(shape, 1, c.block_size - 1, kv_layer=0)
    n_attn = len(cap.attention_layers(c.n_layer))
    size = budget.projected_capture_bytes(shape, 1, c.block_size - 1, attention_layers=n_attn)
    assert size <= budget.SESSION_CAPTURE_BUDGET < 200e6
    assert (n_attn == c.n_layer) == (note == "")
    assert cap.kv_norms and cap.kv_layer == 0


def test_evenly_spaced_layers() -> None:
    assert budget.evenly_spaced(24, 4) == (0, 8, 15, 23)
    assert budget.evenly_spaced(4, 9) == (0, 1, 2, 3)
    assert budget.evenly_spaced(12, 1) == (11,)


# --- run store ----------------------------------------------------------------------------------

def test_run_store_keeps_the_last_runs_and_strips_old_captures(small_model: LoadedModel) -> None:
    run = generate(small_model, prompt="Hello", max_new_tokens=4, capture=Capture(attention=True, kv_norms=True))
    size = run.capture_nbytes()
    ss: dict = {}
    store = RunStore(ss, keep=5, budget=int(size * 2.5))
    ids = [store.new_id() for _ in range(7)]
    for rid in ids:
        store.put(rid, run)
    kept = store.runs()
    assert [r.id for r in kept] == ids[-5:]
    assert store.capture_nbytes() <= size * 2.5
    assert [r.captures_dropped for r in kept] == [True, True, True, False, False]
    assert kept[0].run.text == run.text and kept[0].run.events[0].attn is None
    store.put(ids[-1], run, stepping=True)  # replacing keeps the order and the count
    assert [r.id for r in store.runs()] == ids[-5:] and store.latest().stepping
    assert RunStore(ss).get(ids[-2]) is not None  # state lives in the mapping, not the object


# --- models and settings ---------------------------------------------------------------------------

def test_model_folders_are_listed_from_the_allowed_dir_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "models"
    (root / "gpt2").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "notes.txt").write_text("x")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, root / "escape")
    monkeypatch.setenv("KVVIZ_MODELS_DIR", str(root))
    assert model_menu.list_model_folders() == ["gpt2"]
    assert "folder:gpt2" in model_menu.model_choices()
    assert model_menu.resolve_model_folder("gpt2") == (root / "gpt2").resolve()
    for bad in ("escape", "..", "../elsewhere", "/etc", ".hidden", "gpt2/../.."):
        with pytest.raises(KVVizError):
            model_menu.resolve_model_folder(bad)
    with pytest.raises(KVVizError):
        model_menu.spec_for("/etc/passwd")


def test_default_choice_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVVIZ_DEFAULT_MODEL", "random:tiny-gqa")
    assert model_menu.default_choice(["random:tiny", "random:tiny-gqa"]) == "random:tiny-gqa"
    monkeypatch.setenv("KVVIZ_DEFAULT_MODEL", "random:nope")
    assert model_menu.default_choice(["random:tiny"]) == "random:tiny"
    assert model_menu.default_choice(["shakespeare", "random:tiny"]) == "shakespeare"
    assert model_menu.default_choice(["smollm2", "shakespeare", "random:tiny"]) == "smollm2"  # the real LLM first


def test_param_count_matches_the_built_model(small_model: LoadedModel) -> None:
    assert model_menu.param_count(small_model.config) == small_model.num_params
    assert model_menu.choice_label("random:gpt2-small") == "random:gpt2-small (124.4M params)"


def test_settings_turn_into_generate_arguments() -> None:
    s = Settings(prompt="x", cache_mode="none", greedy=False, temperature=0.7, top_p=0.9, seed=3, engine="readable")
    kw = s.generate_kwargs()
    assert kw["cache"] == CacheSpec(use_cache=False)
    assert kw["sampling"] == SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    assert (kw["prompt"], kw["backend"], kw["chat"]) == ("x", "readable", False)
    assert Settings(cache_mode="concat").generate_kwargs()["cache"] == CacheSpec(kind="concat")
    assert Settings(temperature=0.7).sampling() == SamplingParams()  # greedy by default: the temperature waits
    assert Settings(engine="fast").generate_kwargs()["backend"] == "fast"


def test_bytes_formula_agrees_with_the_cache(small_model: LoadedModel) -> None:
    run = generate(small_model, prompt="Hello", max_new_tokens=3)
    text = metrics.bytes_formula(run)
    ev = run.events[-1]
    assert f"{ev.cache_bytes_used:,} B" in text and f"{ev.cache_bytes_allocated:,} B" in text
    assert "⚠️" not in text
    none = generate(small_model, prompt="Hello", max_new_tokens=3, cache=CacheSpec(use_cache=False))
    assert "0 B kept" in metrics.bytes_formula(none)
