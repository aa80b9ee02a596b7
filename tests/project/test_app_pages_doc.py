"""docs/app.md and README list every page app.py navigates to (docs/app.md once said the
"Watch it generate" group had 4 pages; it has 7)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pages() -> dict[str, list[str]]:
    """{group: [page titles]} read from app.py's st.Page(...) calls and st.navigation's dict."""
    tree = ast.parse((ROOT / "app.py").read_text(encoding="utf-8"))
    titles: dict[str, str] = {}  # variable -> title, for the lists the navigation names
    lists: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            calls = [c for c in ast.walk(node.value) if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "Page"]
            found = [kw.value.value for c in calls for kw in c.keywords if kw.arg == "title"]
            if isinstance(node.value, ast.Call) and found:
                titles[name] = found[0]
            elif found:
                lists[name] = found
    nav = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "navigation")
    groups: dict[str, list[str]] = {}
    for key, value in zip(nav.args[0].keys, nav.args[0].values):
        if isinstance(value, ast.Name):
            groups[key.value] = lists[value.id]
        else:
            groups[key.value] = [titles[e.id] for e in value.elts]
    return groups


def test_app_py_is_read() -> None:
    groups = _pages()
    assert groups["Size it"] == ["KV memory calculator", "Live server"]
    assert groups["Watch it generate"][0] == "Generate" and len(groups["Watch it generate"]) == 8


def test_docs_app_md_lists_every_page() -> None:
    text = (ROOT / "docs" / "app.md").read_text(encoding="utf-8")
    intro = text[:text.index("## The sidebar")]
    groups = _pages()
    watch = groups["Watch it generate"]
    m = re.search(r"\*\*Watch it\s+generate\*\*, (\w+) pages \(([^)]*)\)", intro)
    assert m, intro
    assert m.group(1) == {7: "seven", 8: "eight"}.get(len(watch), str(len(watch)))
    assert [t.strip() for t in " ".join(m.group(2).split()).split(", ")] == watch
    for title in watch[1:]:  # each has its own section
        assert re.search(r"^#+ " + re.escape(title.split(":")[0]), text, re.M), title


def test_readme_lists_every_page() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## The pages"):]
    section = section[:section.index("\n## ", 3)]
    for titles in _pages().values():
        for title in titles:
            assert f"**{title}**" in section, title
