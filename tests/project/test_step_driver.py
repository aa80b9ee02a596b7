"""One step driver (docs/ARCHITECTURE.md, engine/core): every forward over a model runs through
``kvviz/engine/core/step.py`` (``run_step``: plan, forward, commit). Only the step driver itself,
the model families (``engine/models/``, whose forwards these are) and the accelerator
(``kvviz/fast/``, the same forwards made faster) may name a model's forward. This reads every other
module with ``ast`` and fails on:
- ``X.forward`` read anywhere (a call ``X.forward(...)`` or the forward taken as a value: the
  accelerator's ``model.fast.forward``, a stream's ``self.forward``);
- a call ``X.model(...)``: ``LoadedModel.model``, the readable ``nn.Module``, run directly;
- ``m.model`` / ``model.model`` / ``X.model.model`` chosen as the thing to run later (a branch of
  ``... if fast else m.model``, a lambda's body);
- a call of ``backend_forward``, the step driver's own choice of backend.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = ("kvviz/engine/core/step.py", "kvviz/engine/models/", "kvviz/fast/")


def _is_readable_model(node: ast.AST) -> bool:
    """``model.model``, ``m.model`` or ``<anything>.model.model``: a LoadedModel's readable nn.Module."""
    return isinstance(node, ast.Attribute) and node.attr == "model" and (
        (isinstance(node.value, ast.Name) and node.value.id in ("model", "m", "loaded"))
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "model"))


def forward_calls(source: str) -> list[str]:
    """Each place ``source`` runs (or takes, to run later) a model's forward: 'line: what'."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "forward" and isinstance(node.ctx, ast.Load):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "model":
                found.append(f"{node.lineno}: {ast.unparse(f)}(...)")
            elif isinstance(f, ast.Name) and f.id == "backend_forward":
                found.append(f"{node.lineno}: backend_forward(...)")
        # The readable module picked as the thing to run (``fast_fwd if ... else m.model``, a lambda);
        # a plain ``net = m.model`` reads weights (export, the bench's matmul list) and is fine.
        values = [node.body, node.orelse] if isinstance(node, ast.IfExp) else \
            [node.body] if isinstance(node, ast.Lambda) else []
        found += [f"{v.lineno}: {ast.unparse(v)} as the forward to run" for v in values if _is_readable_model(v)]
    return sorted(set(found))


def _checked_modules() -> list[Path]:
    paths = sorted([*ROOT.joinpath("kvviz").rglob("*.py"), ROOT / "app.py"])
    return [p for p in paths if not str(p.relative_to(ROOT)).startswith(ALLOWED)]


def test_no_module_outside_the_step_driver_runs_a_models_forward() -> None:
    found = {str(p.relative_to(ROOT)): hits for p in _checked_modules() if (hits := forward_calls(p.read_text()))}
    assert not found, f"run these forwards through kvviz.engine.core.step.run_step: {found}"


def test_the_check_sees_each_way_of_running_a_forward() -> None:
    """Not vacuous: each pattern the old loops used is found, and plain uses of ``.model`` are not."""
    planted = {
        "logits = self.forward(inp, pos, cache, None, last_only=True)": 1,  # a stream's own forward
        "forward = model.fast.forward if fast else model.model": 2,  # the choice written again
        "lp = model.model(seq[:, :-1])": 1,  # the readable module run directly
        "run = lambda x: model.model": 1,
        "fwd = None if fast else m.model": 1,
        "out = backend_forward(m, 'fast')(ids, pos, cache, None)": 1,
        "x = self.model.fast.forward": 1,
    }
    for line, n in planted.items():
        assert len(forward_calls(line)) == n, (line, forward_calls(line))
    for fine in ("m, cache = self.model, self.cache", "cfg = model.model.config", "n = m.model.lm_head.weight.shape[0]",
                 "err = nonfinite_error(self.model.model, logits, ids, step)", "self.model = model", "net = loaded.model",
                 "logits = run_step(m, cache, inp, pos, backend=self.engine)"):
        assert forward_calls(fine) == [], fine


def test_the_step_driver_is_where_the_backend_forward_runs() -> None:
    """The check would pass vacuously if it never read the file that holds the forward call."""
    step = (ROOT / "kvviz/engine/core/step.py").read_text()
    assert forward_calls(step), "run_step runs backend_forward(...); the checker must see it there"
    assert ROOT / "kvviz/engine/core/loop.py" in _checked_modules()


# ----------------------------------------------------------------------------- the cache's step moves
# docs/ARCHITECTURE.md, Data flow: "The step driver (`run_step`) alone plans and advances the cache
# (`plan_step`, `advance`); attention layers only `update` it". Who else may make a step's moves, and why.
MOVES_ALLOWED: dict[str, str] = {
    "kvviz/engine/core/step.py": "the step driver: plan, forward, commit or abort",
    "kvviz/engine/kvcache/": "the caches themselves (a reset, truncate or restore drops an open plan)",
    "kvviz/engine/serving/ragged_cache.py": "the serving cache itself",
    "kvviz/engine/serving/engine.py": "close(): abort_step only, so however a run ends no plan is left",
    "kvviz/ui/pages/calculator/calculator_measured.py": "writes meta K/V with no model (ARCHITECTURE.md says why)",
}
STEP_MOVES = ("plan_step", "abort_step")


def cache_moves(source: str) -> list[str]:
    """'line: what' for each call of ``X.plan_step``/``X.abort_step``, and of ``X.advance`` where X
    names a cache (``cache``, ``self.cache``, ``c.kv_cache``: a stepper's or a stream's ``advance`` is another move)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            what, receiver = node.func.attr, ast.unparse(node.func.value)
            if what in STEP_MOVES or (what == "advance" and receiver.lower().endswith("cache")):
                found.append(f"{node.lineno}: {receiver}.{what}(...)")
    return found


def test_only_the_step_driver_plans_and_commits_a_step() -> None:
    paths = sorted([*ROOT.joinpath("kvviz").rglob("*.py"), ROOT / "app.py"])
    found = {rel: hits for p in paths if not (rel := str(p.relative_to(ROOT))).startswith(tuple(MOVES_ALLOWED))
             and (hits := cache_moves(p.read_text()))}
    assert not found, f"a step is planned and committed by kvviz.engine.core.step.run_step alone: {found}"


def test_the_move_check_is_not_vacuous() -> None:
    for line in ("cache.plan_step(ids)", "self.cache.advance(T)", "cache.abort_step()", "kv_cache.advance(1)",
                 "self.cache.plan_step(ids, hash_ids=False)"):
        assert len(cache_moves(line)) == 1, line
    for fine in ("ev = stepper.advance()", "cache.update(0, k, v)", "cache.truncate(3)", "cache.reorder(parents)",
                 "run_step(m, cache, ids, pos)"):
        assert cache_moves(fine) == [], fine
    step = (ROOT / "kvviz/engine/core/step.py").read_text()
    assert len(cache_moves(step)) == 4  # the plan (two ways), the abort and the commit
