"""A serving run on a thread of its own, so the page can redraw while it goes and a Stop keeps
what was computed.

Streamlit interrupts a script at its next ``st.*`` call whenever a widget is clicked; an engine
run inside the script would die there, its records with it. So the engine runs on a worker thread
(``start``): each ``StepRecord`` is appended to a plain list as it arrives, the ``ServeResult``
lands in ``results`` at the end. The script only reads them (``ServeJob`` is a plain object in the
session, never ``st.session_state`` from the worker): a click mid-run reruns the page, which finds
the job still going and keeps drawing it; Stop calls ``abort()``, and the engine ends after the
current step with every request's tokens so far (finish reason "aborted") and the pool audited.

No streamlit here: the page module draws.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvviz.engine.serving.engine import ServeConfig, ServeEngine, ServeResult
from kvviz.engine.serving.records import StepRecord
from kvviz.engine.serving.requests import ServeRequest
from kvviz.errors import KVVizError

if TYPE_CHECKING:
    from kvviz import LoadedModel

_IDS = itertools.count(1)
COMPARE_ORDER = ("continuous", "static", "sequential")


def serve_requests(workload: Sequence[dict[str, object]]) -> list[ServeRequest]:
    """The workload builder's dicts as the engine's requests (greedy; EOS ignored, so each request
    generates the tokens it asks for)."""
    return [ServeRequest(str(r["id"]), tuple(r["prompt_ids"]), int(r["max_tokens"]),  # type: ignore[arg-type]
                         ignore_eos=bool(r["ignore_eos"]), arrival=r["arrival"])  # type: ignore[arg-type]
            for r in workload]


@dataclass
class ServeJob:
    """One press of Run (one policy) or of Compare (the three in turn), and everything it recorded."""
    config: ServeConfig
    workload: list[dict[str, object]]
    policies: tuple[str, ...]
    id: int = field(default_factory=lambda: next(_IDS))
    steps: list[StepRecord] = field(default_factory=list)  # the running policy's, as they arrive
    current: str = ""  # the policy running now
    results: dict[str, ServeResult] = field(default_factory=dict)
    error: str | None = None
    stopped: bool = False
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    _engine: ServeEngine | None = None

    @property
    def request_ids(self) -> list[str]:
        return [str(r["id"]) for r in self.workload]

    def abort(self) -> None:
        """Stop after the current step; the policies not yet started never run."""
        self.stopped = True
        if self._engine is not None:
            self._engine.abort()

    def outputs(self) -> dict[str, list[int]]:
        """Each request's tokens so far, from the steps recorded (the live text)."""
        out: dict[str, list[int]] = {}
        for s in list(self.steps):
            for rid, tok in s.new_tokens.items():
                out.setdefault(rid, []).append(tok)
        return out


def check(model: "LoadedModel", config: ServeConfig, workload: Sequence[dict[str, object]]) -> str | None:
    """The engine's own verdict on this workload before anything runs: None, or its sentence."""
    try:
        ServeEngine(model, config).check(serve_requests(workload))
    except KVVizError as e:
        return str(e)
    return None


def start(model: "LoadedModel", config: ServeConfig, workload: Sequence[dict[str, object]],
          policies: Sequence[str], release: threading.Lock | None = None) -> ServeJob:
    """Run the workload under each policy in turn on a worker thread; ``release`` (the measurement
    lock the page took) is let go when the worker ends, however it ends."""
    job = ServeJob(config, list(workload), tuple(policies))
    requests = serve_requests(workload)

    def work() -> None:
        try:
            for policy in job.policies:
                if job.stopped:
                    break
                engine = ServeEngine(model, replace(config, policy=policy))
                job._engine, job.current, job.steps = engine, policy, []
                job.results[policy] = engine.run(requests, on_step=job.steps.append)
        except KVVizError as e:
            job.error = str(e)
        except Exception as e:  # noqa: BLE001 - shown on the page in one line, never a traceback
            job.error = f"the run failed: {type(e).__name__}: {e}"
        finally:
            job._engine = None
            if release is not None:
                release.release()
            job.done.set()

    threading.Thread(target=work, name=f"kvviz-serve-{job.id}", daemon=True).start()
    return job
