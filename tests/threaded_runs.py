"""One check two accelerator suites share: runs on one model from several threads at once give
the tokens the same runs give one after another (the app's sessions share a loaded model)."""
from __future__ import annotations

import threading

import kvviz
from kvviz.engine.loading.loader import LoadedModel


def assert_concurrent_runs_match_sequential(model: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> None:
    want = [kvviz.generate(model, prompt_ids=p, max_new_tokens=max_new_tokens).generated_ids for p in prompts]
    got: list[list[int] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        got[i] = kvviz.generate(model, prompt_ids=prompts[i], max_new_tokens=max_new_tokens).generated_ids

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert got == want
