"""No cut label on any page at 1366x768 or 1920x1080 (issue 36).

The app as `make run` starts it (SmolLM2 where installed, so the sidebar's model box shows its real
label). One browser context per screen size and layout, walked once for this test and test_layout_fit
(screen_walks.py, the ``screen_walk`` fixture). At 1366x768 every page is opened, what is cheap
to run is run (a 6-token answer on Generate, an 8-token race, the Compression lab's 8-token
comparison, three short requests served, a made-up vLLM log in the calculator's reconciler), every
step of the tour is walked, and the presentation layout (``?present=1``) is opened after a short
run, where the cache and attention charts must start on the first screen. At 1920x1080, where the
normal layout has the most room, the Generate page and the presentation layout (its larger type is
the tight case there). On each, ``cut_labels`` (cut_labels.py) must find nothing: no button, tab,
selectbox value, metric, table cell, code block or chart label cut, and no chart label outside its
chart or over another label. Screenshots of each go to test-results/screenshots/cut-*.png: look at
them.
"""
from __future__ import annotations

import pytest

from screen_walks import TIGHT, WIDE

SIZES = [TIGHT, WIDE]


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_no_label_is_cut(screen_walk, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    # Every page and tour step at the tight screen, and its presentation layout; at 1920x1080 the
    # normal layout has the most room of all (test_layout_fit says so too), so there the Generate
    # page (the widest text: chips, legend, metrics) and the presentation layout, whose larger type
    # is the tight case.
    walks = [screen_walk(TIGHT, False), screen_walk(TIGHT, True)] if size == TIGHT else [screen_walk(size, True)]
    problems = {k: v for walk in walks for k, v in walk.cut.items()}
    assert not problems, "\n".join(f"{k}:\n  " + "\n  ".join(v) for k, v in problems.items())
