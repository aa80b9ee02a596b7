"""The decoding charts from hand-made records: what they draw is what the records say."""
from __future__ import annotations

from kvviz.charts import decoding_charts as dc
from kvviz.engine.generation.strategy_events import BeamCandidate, BeamStep, SpecResult, SpecStep


def _steps() -> list[BeamStep]:
    c = BeamCandidate
    s0 = BeamStep(0, 5, (c(0, 7, "a", -0.1, "kept", 0), c(0, 8, "b", -0.5, "kept", 1), c(0, 9, "<x>", -0.9, "pruned"),
                         c(0, 2, "d", -1.2, "pruned")), (0, 0), 1, 1000, 5, 1.0)
    s1 = BeamStep(1, 6, (c(1, 3, "e", -0.7, "kept", 0), c(0, 1, "f", -0.8, "finished", None, -0.4),
                         c(0, 4, "g", -0.9, "kept", 1), c(1, 5, "h", -2.0, "pruned")), (1, 0), 2, 2400, 6, 1.0)
    return [s0, s1]


def test_beam_tree_draws_every_candidate_with_its_status() -> None:
    fig = dc.beam_tree(_steps())
    by_name = {t.name: t for t in fig.data if t.name}
    assert list(by_name["kept (a running beam)"].x) == [1, 1, 2, 2]
    assert list(by_name["finished (EOS or length)"].y) == [1]
    assert list(by_name["pruned"].y) == [2, 3, 3]
    # Step 1's candidate 0 extends row 1, which step 0's candidate 1 (y = 1) holds.
    kept_edges = fig.data[0]
    assert list(kept_edges.x[6:8]) == [1, 2] and list(kept_edges.y[6:8]) == [1, 0]
    assert "&lt;x&gt;" in " ".join(h for t in fig.data if t.hovertext is not None for h in t.hovertext)
    # k = 2 beams (step 0 fans out to 2 rows) keep 4 = 2k of k x V (issue 36: "the best 6 of k x vocabulary")
    assert "each keeps the best 4 (2k, k = 2) of all k × vocabulary (2 × V) continuations" in \
        fig.layout.title.subtitle.text
    assert "of all k × V = 2 × 96 = 192 continuations" in dc.beam_tree(_steps(), vocab=96).layout.title.subtitle.text


def test_reorder_figure_and_bytes() -> None:
    s = _steps()[1]
    fig = dc.reorder_figure(s, 2)
    lines = [t for t in fig.data if t.mode == "lines"]
    assert [(list(t.x), list(t.y)) for t in lines] == [([0.04, 0.96], [1, 0]), ([0.04, 0.96], [0, 1])]
    assert "2.3 KiB copied" in fig.layout.title.subtitle.text and "2 of 2 rows changed parent" in \
        fig.layout.title.subtitle.text
    assert "fanned out to 2" in dc.reorder_figure(_steps()[0], 2).layout.title.subtitle.text
    assert list(dc.bytes_moved_chart(_steps()).data[0].y) == [1000, 2400]


def test_spec_notebook_marks_rolled_back_positions() -> None:
    steps = (SpecStep(0, 0, (), 0, (9,), (), 0, 1.0),
             SpecStep(1, 4, (1, 2, 3), 1, (1, 7), (6, 7), 2, 1.0, ("a", "b", "c")),
             SpecStep(2, 6, (), 0, (5,), (), 0, 1.0))
    fig = dc.spec_notebook(steps, 5)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["draft rolled back (truncated)"].x) == [6, 7]
    assert list(by_name["draft accepted (kept in the cache)"].x) == [5]
    assert list(by_name["the last token, fed"].x) == [4, 6]
    assert list(by_name["the model's own next token (fed next)"].x) == [6, 7]
    spec = SpecResult(3, 2, steps)
    assert (spec.drafted, spec.accepted, spec.tokens, spec.forwards, spec.forwards_saved) == (3, 1, 4, 3, 1)
    acc = dc.acceptance_chart(steps)
    assert list(acc.data[0].y) == [3, 0] and list(acc.data[1].y) == [1, 0]
