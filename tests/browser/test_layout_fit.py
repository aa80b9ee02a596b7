"""Every page fits the screens it is shown on: 1366x768 in the normal and the presentation layout
(``?present=1``) and 1920x1080 in the presentation layout, on the model `make run` opens with
(SmolLM2 where installed).

What a presenter met at 1366x768: buttons cut to "G…", "S X" and "Start t…", chart titles under
their charts' menu buttons, the chips legend broken mid-word ("ne / wline") and a metric's note cut
to "360.0 MiB alloc…". Each page is opened at each size and layout (the Generate page after a short
run, so its numbers are drawn), every chart hovered, and measured in the page itself
(layout_measure.py; the pages are walked once per screen for this test and test_cut_labels, by
screen_walks.py through the ``screen_walk`` fixture):
- a button, a metric or anything inside them whose text is wider than its box (scrollWidth against
  clientWidth), or a button label or legend whose word runs over two lines;
- a chart title wider than its chart, or whose box meets its chart's mode bar, Streamlit's toolbar or
  a selector button.
Screenshots go to test-results/screenshots/layout-*.png: look at them.
"""
from __future__ import annotations

import pytest

# 1366x768 in both layouts (the tight screen), 1920x1080 in the presentation layout (its larger
# fonts are the tighter of the two there; the normal layout at 1920 has the most room of all).
CASES = [((1366, 768), False), ((1366, 768), True), ((1920, 1080), True)]


@pytest.mark.parametrize(("size", "present"), CASES,
                         ids=[f"{w}x{h}-{'present' if p else 'normal'}" for (w, h), p in CASES])
def test_every_page_fits(screen_walk, size: tuple[int, int], present: bool) -> None:  # type: ignore[no-untyped-def]
    problems = screen_walk(size, present).fits
    assert not problems, problems


def test_tour_scrolls_the_chart_it_names_into_view(screen_walk) -> None:  # type: ignore[no-untyped-def]
    """Steps 2 and 6 say "the chart below"; at 1366x768 in the normal layout that chart starts about
    1,000 px under the fold (it is checked to be there at the page's top after the tour's short
    run). Arriving at the step, from the page's top, brings it into view."""
    problems = screen_walk((1366, 768), False).tour_view
    assert not problems, problems
