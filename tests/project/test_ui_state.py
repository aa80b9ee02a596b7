"""Session state has one door: no module of the app but kvviz/ui/state/session.py names
``st.session_state``, so every key the app keeps outside a widget is named in that one file."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOOR = ROOT / "kvviz/ui/state/session.py"


def session_state_uses(source: str) -> list[int]:
    """Lines where code reaches ``<anything>.session_state`` (an attribute, read or written)."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Attribute) and node.attr == "session_state"})


def test_only_the_session_module_touches_session_state() -> None:
    files = [ROOT / "app.py", *sorted((ROOT / "kvviz/ui").rglob("*.py"))]
    found = {str(f.relative_to(ROOT)): lines for f in files
             if f != DOOR and "__pycache__" not in f.parts and (lines := session_state_uses(f.read_text()))}
    assert found == {}, f"st.session_state outside kvviz/ui/state/session.py: {found}"
    assert session_state_uses(DOOR.read_text()), "the session module is where session state is reached"


def test_the_scan_sees_reads_writes_and_aliases() -> None:
    """The checker is not vacuous: each way of reaching session state is caught; a docstring is not."""
    for code in ('st.session_state["x"] = 1\n', 'v = st.session_state.get("x")\n', "ss = st.session_state\n",
                 'if "x" in streamlit.session_state: pass\n'):
        assert session_state_uses(code) == [1], code
    assert session_state_uses('"""st.session_state["x"] is named in a docstring only."""\n') == []
