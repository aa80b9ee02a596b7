"""Reading files a user names, without trusting them: bounded, regular files only, precise messages.

Every path a user gives (a config.json, a text file to score, a corpus) goes through here, so one
place decides:
- what a missing, unreadable or odd path is called ("does not exist" only when it does not; a FIFO,
  a device, a socket or a folder gets its own words);
- that a FIFO never blocks the open (``O_NONBLOCK``) and a device is never read (``st_size`` is 0
  for ``/dev/zero``, so a size check on it proves nothing): only regular files are read;
- that at most ``limit`` bytes are read, whatever the file grows to meanwhile.

JSON from users goes through ``parse_json``: a nesting depth and integer-length bound checked before
Python's parser recurses or converts, every failure a ``KVVizError`` naming the file.

Pure Python (no torch): the memory calculator may use it too.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import zlib
from itertools import accumulate
from pathlib import Path
from typing import Any

from kvviz.errors import KVVizError

MAX_JSON_DEPTH = 32  # a model config nests 2-3 levels; 100,000 levels overflows the C parser's stack
MAX_JSON_INT_DIGITS = 30  # int64 has 19 digits; a 5,000-digit literal is refused before int() runs

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(mode: int) -> str:
    """'a regular file', 'a folder', 'a FIFO (named pipe)', ... for a stat mode."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def os_problem(path: Path | str, e: OSError, label: str = "") -> str:
    """A precise sentence for an OSError about ``path`` (named ``label``, else the path itself)."""
    label = label or str(path)
    if e.errno == errno.ENOENT:
        return f"{label} does not exist"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"{label} cannot be read: permission denied"
    if e.errno == errno.ENOTDIR:
        return f"{label} does not exist (a part of the path is a file, not a folder)"
    if e.errno == errno.ELOOP:
        return f"{label} is a symbolic link loop"
    if e.errno == errno.ENAMETOOLONG:
        return f"{label[:80]} is too long to be a file name"
    return f"{label} cannot be read ({e.strerror or e})"


def describe_path(path: Path | str, label: str = "") -> tuple[int | None, str]:
    """(stat mode or None, '' or why it cannot be stat'ed): one stat, following links."""
    try:
        return os.stat(path).st_mode, ""
    except OSError as e:
        return None, os_problem(path, e, label)
    except ValueError:  # an embedded NUL byte in the path
        return None, f"{str(path)!r} is not a valid path"


def read_bounded(path: Path | str, limit: int, label: str = "") -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; KVVizError with a precise reason.

    ``label`` names the file in messages ("text file notes.txt"); the path itself by default.

    The open never blocks (a FIFO opened O_NONBLOCK returns at once) and the file's type is checked
    on the open descriptor, so a path swapped for a FIFO or a device between a check and the open
    is still refused. At most ``limit + 1`` bytes are ever read.
    """
    if str(path) == "":
        raise KVVizError(f"the path of the {label or 'file'} is empty")
    label = label or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise KVVizError(os_problem(path, e, label)) from None
    except ValueError:
        raise KVVizError(f"{str(path)!r} is not a valid path") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise KVVizError(f"{label} is {kind_of(mode)}, not a regular file")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise KVVizError(os_problem(path, e, label)) from None
    finally:
        os.close(fd)
    if total > limit:
        raise KVVizError(f"{label} is over {limit:,} bytes; that is too large here")
    return b"".join(chunks)


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays/objects in ``text`` (strings skipped), in linear time."""
    marks = _BRACKETS.findall(_STRINGS.sub("", text))
    return max(accumulate(1 if m in "[{" else -1 for m in marks), default=0)


def _bounded_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise KVVizError(f"holds a {len(s.lstrip('-')):,}-digit integer; numbers here have at most "
                         f"{MAX_JSON_INT_DIGITS} digits")
    return int(s)


def parse_json(data: bytes | str, where: str) -> Any:
    """JSON from a user, bounded in depth and integer length; KVVizError('<where> ...') on any failure."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise KVVizError(f"{where} is not valid JSON: it is not UTF-8 text (byte {e.start})") from None
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise KVVizError(f"{where} is nested {depth:,} levels deep; a config is at most {MAX_JSON_DEPTH}")
    try:
        return json.loads(text, parse_int=_bounded_int)
    except KVVizError as e:
        raise KVVizError(f"{where} {e}") from None
    except json.JSONDecodeError as e:
        raise KVVizError(f"{where} is not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # belt and braces: the checks above should catch these
        raise KVVizError(f"{where} cannot be parsed: {e}") from None


def read_maybe_gzip(path: Path | str, limit: int, label: str = "") -> bytes:
    """``read_bounded``, then, for a ``.gz`` file, its contents, also at most ``limit`` bytes.

    The shipped corpus is gzipped; a decompression bomb stops at the limit instead of filling memory.
    """
    raw = read_bounded(path, limit, label)
    if not str(path).endswith(".gz"):
        return raw
    label = label or str(path)
    d = zlib.decompressobj(wbits=31)  # 31: the gzip container
    try:
        out = d.decompress(raw, limit + 1)
    except zlib.error as e:
        raise KVVizError(f"{label} is not a valid gzip file ({e})") from None
    if len(out) > limit or d.unconsumed_tail:
        raise KVVizError(f"{label} holds more than {limit:,} bytes uncompressed; that is over the limit")
    if not d.eof:
        raise KVVizError(f"{label} is a truncated gzip file")
    return out
