"""kvviz in a notebook: the app's figures, inline, from the same chart functions.

Each function returns what Jupyter draws as a cell's output: a Plotly figure (from
``kvviz.charts``, exactly the figure the app's page draws for the same Run), the token chips as
HTML (the Generate page's own escaped markup: model and user text never reaches the page raw), or
a pandas table (the calculator's exact bytes). ``LiveView`` (kvviz/notebook_live.py) draws the
cache filling and the text streaming while ``iter_generate`` runs, with a Stop button.

    import kvviz, kvviz.notebook as nb
    model = kvviz.load_model("smollm2")
    run = nb.generate(model, "The KV cache", max_new_tokens=20)
    nb.chips(run); nb.cache_notebook(run); nb.attention(run); nb.step_latencies(run)
    nb.race(model, "Once upon a time", max_new_tokens=40)
    nb.calculator_table(["smollm2-135m", "llama-3-8b"], [1024, 8192, 32768])
    nb.LiveView(model, "Tell me about the sea", max_new_tokens=60)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from kvviz.charts import perf, run_charts
from kvviz.engine.generation.capture import CAPTURE_ALL, Capture
from kvviz.engine.api import generate as _generate
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.generation.valid_request import CacheSpec
from kvviz.engine.loading.loader import LoadedModel
from kvviz.errors import KVVizError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    import plotly.graph_objects as go

    from kvviz.engine.generation.events import Run


def __getattr__(name: str) -> Any:
    if name == "LiveView":  # ipywidgets only when the live view is asked for
        from kvviz.notebook_live import LiveView

        return LiveView
    raise AttributeError(f"module 'kvviz.notebook' has no attribute {name!r}")


def generate(model: LoadedModel, prompt: Any, *, capture: Capture = CAPTURE_ALL, **kwargs: Any) -> "Run":
    """``kvviz.generate`` recording what the figures draw: every layer's attention and K/V norms and
    layer 0's raw K/V (``CAPTURE_ALL``). Keywords are ``iter_generate``'s."""
    return _generate(model, prompt, capture=capture, **kwargs)


class _Chips:
    """The token chips as HTML for Jupyter (``_repr_html_``), and as the plain text they spell."""

    def __init__(self, html: str, text: str) -> None:
        self.html, self.text = html, text

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.text


def chips(run: "Run") -> _Chips:
    """The prompt and generated tokens, one chip per token (the Generate page's markup and CSS;
    every piece of text is ``html.escape``d there)."""
    from kvviz.ui.pages.generate.chips import CSS, run_html  # pure functions; the module imports streamlit

    return _Chips(CSS + run_html(run), run.prompt_text + run.text)


def cache_notebook(run: "Run", by: str = "layer", layer: int = 0) -> "go.Figure":
    """The cache as a notebook: a column per position, K above V, colour = each vector's length."""
    return run_charts.cache_notebook(run, by, layer)


def cache_values(run: "Run", kv: str = "K", head: int = 0) -> "go.Figure":
    """Layer 0's raw cached K (or V) numbers of one head, a column per position."""
    return run_charts.cache_values(run, kv, head)


def attention(run: "Run") -> "go.Figure":
    """The newest token's attention over every cached position, one row per (layer, head)."""
    return run_charts.attention_heatmap(run)


def attention_bars(run: "Run", layer: int = 0, head: int = 0) -> "go.Figure":
    return run_charts.attention_bars(run, layer, head)


def step_latencies(run: "Run") -> "go.Figure":
    """Per-step latency, the prefill marked, with tokens/s."""
    return run_charts.latency_chart(run)


def race_runs(model: LoadedModel, prompt: str, max_new_tokens: int = 64,
              modes: Sequence[str] = ("static", "none")) -> dict[str, "Run"]:
    """The same greedy generation with a cache ("static", "concat") and without ("none"), one
    after the other (the Cache vs no cache page runs them the same way, interleaving aside)."""
    runs: dict[str, Run] = {}
    for mode in modes:
        if mode not in perf.MODE_COLORS:
            raise KVVizError(f"unknown mode {mode!r}; choose from {', '.join(perf.MODE_COLORS)}")
        cache = CacheSpec(use_cache=mode != "none", kind="static" if mode == "none" else mode)
        runs[mode] = _generate(model, prompt, max_new_tokens=max_new_tokens, sampling=SamplingParams(ignore_eos=True),
                               cache=cache)
    return runs


def race(model: LoadedModel | Mapping[str, "Run"], prompt: str = "", max_new_tokens: int = 64,
         chart: str = "latency") -> "go.Figure":
    """Cache vs no cache: per-step latency (or "cumulative", "speedup", "bytes") of race_runs, or
    of runs already made."""
    runs = model if isinstance(model, Mapping) else race_runs(model, prompt, max_new_tokens)
    charts = {"latency": perf.race_latency, "cumulative": perf.race_cumulative, "speedup": perf.race_speedup,
              "bytes": perf.cache_bytes}
    if chart not in charts:
        raise KVVizError(f"unknown race chart {chart!r}; choose from {', '.join(charts)}")
    return charts[chart](runs)


def calculator_table(models: Iterable[str], seq_lens: Iterable[int], kv_dtype: str = "fp16", batch: int = 1
                     ) -> "pd.DataFrame":
    """The calculator's KV bytes (exact, every layer) for presets or kvviz's own models by name, at
    each context length: one row per (model, tokens)."""
    import pandas as pd

    from kvviz.engine.loading.loader import builtin_shapes
    from kvviz.calculator import CalcError, MemoryRequest, builtin_specs, calculate, find_preset, with_builtins
    from kvviz.units import fmt_bytes

    shapes, shipped = builtin_shapes()
    presets = with_builtins(builtin_specs(shapes, shipped, "kvviz/engine/loading/loader.py RANDOM_SHAPES"))
    rows = []
    try:
        for name in models:
            spec = find_preset(name, presets)
            for n in seq_lens:
                res = calculate(spec, MemoryRequest(seq_len=n, batch=batch, kv_dtype=kv_dtype))
                rows.append({"model": spec.name, "tokens": n, "batch": batch, "kv dtype": kv_dtype,
                             "bytes per token": res.kv_bytes_per_token, "KV bytes": res.kv_bytes,
                             "KV": fmt_bytes(res.kv_bytes)})
    except CalcError as e:
        raise KVVizError(str(e)) from None
    return pd.DataFrame(rows)
