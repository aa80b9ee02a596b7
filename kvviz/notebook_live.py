"""The live view for a notebook: the cache filling and the text streaming while ``iter_generate``
runs in the kernel, with a Stop button.

Built on ipywidgets (HTML, Button, VBox) and Plotly's ``FigureWidget`` (itself an anywidget):
maintained widget libraries, no JavaScript of ours. Generation runs on a background thread, so
the kernel stays free to receive the Stop click; each redraw sends only the changed figure and
text to the front end, at most every ``redraw_s`` seconds (a 135M model makes a token in tens of
milliseconds, faster than a browser redraws a heatmap) and once more at the end. The figure is
``kvviz.charts.run_charts.cache_notebook``, the Generate page's own; the text goes through
``html.escape`` (model text is never raw HTML).

    view = LiveView(model, "Tell me about the sea", max_new_tokens=60)   # shows itself, starts
    view.stop(); view.wait(); view.run                                    # the Run, partial or whole
"""
from __future__ import annotations

import html
import json
import threading
import time
from typing import Any

import plotly.io

from kvviz.charts import run_charts
from kvviz.engine.generation.capture import Capture
from kvviz.engine.generation.events import Run
from kvviz.engine.api import iter_generate
from kvviz.engine.loading.loader import LoadedModel
from kvviz.errors import KVVizError

TEXT_STYLE = ("font-family:'DejaVu Sans Mono',Menlo,Consolas,monospace;white-space:pre-wrap;"
              "overflow-wrap:anywhere;font-size:1.05rem;line-height:1.5")


def _widgets() -> tuple[Any, Any]:
    try:
        import ipywidgets
        import plotly.graph_objects as go

        go.FigureWidget()  # raises without anywidget
    except ImportError as e:
        raise KVVizError(f"the live view needs ipywidgets and anywidget ({e}): pip install 'kvviz[notebook]'") from None
    return ipywidgets, go


class LiveView:
    """A generation drawn as it runs. Keywords are ``iter_generate``'s and are checked before it
    starts (a bad one raises ``KVVizError`` and nothing runs). ``start=False`` waits for
    ``start()``; ``start(background=False)`` runs in the calling thread (a script, a test)."""

    def __init__(self, model: LoadedModel, prompt: Any = None, max_new_tokens: int = 64,
                 redraw_s: float = 0.25, start: bool = True, display: bool = True, **kwargs: Any) -> None:
        widgets, go = _widgets()
        self._stream = iter_generate(model, prompt, max_new_tokens=max_new_tokens,
                                     capture=Capture(kv_norms=True), **kwargs)
        self.redraw_s = redraw_s
        self.error: str | None = None
        self.draws = 0  # redraws sent to the front end, the last one included
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.status = widgets.HTML()
        self.text = widgets.HTML()
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop",
                                          tooltip="end the generation at the next token")
        self.stop_button.on_click(lambda _button: self.stop())
        self.figure = go.FigureWidget()
        self.widget = widgets.VBox([self.status, self.text, self.figure, self.stop_button])
        self._draw(final=False)
        if display:
            from IPython.display import display as show

            show(self.widget)
        if start:
            self.start()

    @property
    def run(self) -> Run:
        """The Run as it stands: partial while generating, "stopped" after a Stop."""
        return self._stream.run

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def start(self, background: bool = True) -> None:
        if self._thread is not None or self.done:
            raise KVVizError("this live view already ran; make a new LiveView to generate again")
        if background:
            self._thread = threading.Thread(target=self._loop, name="kvviz-live", daemon=True)
            self._thread.start()
        else:
            self._thread = threading.current_thread()
            self._loop()

    def stop(self) -> None:
        """End the generation at the next token (the Stop button calls this)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the generation ended; False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    def _loop(self) -> None:
        last = time.monotonic()
        try:
            for _ev in self._stream:
                now = time.monotonic()
                if now - last >= self.redraw_s:
                    self._draw(final=False)
                    last = now
                if self._stop.is_set():  # checked before the next token is asked for: none is wasted
                    break
        except KVVizError as e:
            self.error = str(e)
        except Exception as e:  # a bug: said in the view, not lost on a background thread
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._draw(final=True)
            self.stop_button.disabled = True
            self._done.set()

    def _draw(self, final: bool) -> None:
        run = self._stream.run
        n = len(run.events)
        if self.error:
            state = f"<b>error:</b> {html.escape(self.error)}"
        elif not final:
            state = f"generating… {n} of {run.max_new_tokens} tokens" if n else "ready"
        else:
            said = run.note and run.stop_reason != "stopped"  # "stopped after N tokens" says nothing new
            state = f"{html.escape(run.stop_reason or 'done')}: {n} tokens" + (f" · {html.escape(run.note)}" if said else "")
        self.status.value = f"<span style='color:#495057'>{state}</span>"
        self.text.value = (f"<div style=\"{TEXT_STYLE}\"><span style='color:#1c2a6b'>{html.escape(run.prompt_text)}"
                           f"</span><span style='background:#fff4e6;color:#5c3200'>{html.escape(run.text)}</span></div>")
        # Through Plotly's JSON encoder: the notebook's empty cells are NaN, which a widget message
        # (strict JSON) cannot carry; the encoder writes them as null, which Plotly draws as gaps.
        fig = json.loads(plotly.io.to_json(run_charts.cache_notebook(run), validate=False))
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.add_traces(fig["data"])
            self.figure.layout = fig["layout"]
        self.draws += 1

    def __repr__(self) -> str:  # the widget showed itself when made; a bare `view` then says where it stands
        run = self.run
        return f"LiveView({run.model}: {len(run.events)} tokens, {'done' if self.done else 'running'})"
