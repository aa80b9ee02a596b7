"""Reading and writing files a user names, without trusting them: regular files only, precise messages.

Every path a user gives (a config.json, a text file to score, a corpus) goes through here, so one
place decides:
- what a missing, unreadable or odd path is called ("does not exist" only when it does not; a FIFO,
  a device, a socket or a folder gets its own words);
- that a FIFO never blocks the open (``O_NONBLOCK``) and a device is never read (``st_size`` is 0
  for ``/dev/zero``, so a size check on it proves nothing): only regular files are read;
- that at most ``limit`` bytes are read, whatever the file grows to meanwhile.

Results go out through ``write_atomic`` (checked up front with ``check_out_file``, the CLI's
``--out`` type): a temp file in the same folder and a rename, so a full disk never leaves half a file.

JSON from users goes through ``parse_json``: a nesting depth and integer-length bound checked before
Python's parser recurses or converts, every failure a ``KVVizError`` naming the file.

Pure Python (no torch): the memory calculator may use it too.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
import zlib
from itertools import accumulate
from pathlib import Path
from typing import Any

from kvviz.errors import KVVizError, ResultsNotSaved

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


class Refused(Exception):
    """Why ``read_regular`` or ``json_value`` gave nothing, for the caller to put in its own words.

    ``why``: "path" (a NUL byte in it), "open" and "read" (``error``, the OSError), "kind" (``mode``:
    not a regular file), "size" (over the limit: ``size`` bytes, or None when it grew past it while
    read), "utf8" (``error``, the UnicodeDecodeError), "depth" and "digits" (``size``: the nesting or
    the integer's length past the bound asked for), "nested" (Python's parser recursed too deep),
    "int-limit" (an integer past ``sys.get_int_max_str_digits()``), "json" (``error``: malformed)."""

    def __init__(self, why: str, error: BaseException | None = None, mode: int | None = None,
                 size: int | None = None) -> None:
        super().__init__(why)
        self.why, self.error, self.mode, self.size = why, error, mode, size


def read_regular(path: Path | str, limit: int) -> bytes:
    """The one bounded reader: at most ``limit`` bytes of a regular file, else ``Refused``.

    The open never blocks (a FIFO opened O_NONBLOCK returns at once) and the file's type is checked
    on the open descriptor (fstat), so a path swapped for a FIFO or a device between a check and
    the open is still refused. At most ``limit + 1`` bytes are ever read, whatever ``st_size`` says
    (devices and /proc files report 0).
    """
    flags = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
             | getattr(os, "O_BINARY", 0))
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise Refused("open", error=e) from None
    except ValueError:  # a NUL byte in the path: the OS cannot even be asked
        raise Refused("path") from None
    chunks: list[bytes] = []
    total = 0
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Refused("kind", mode=info.st_mode)
        if info.st_size > limit:
            raise Refused("size", size=info.st_size)
        while total <= limit:  # reads may return short; stop one byte past the cap
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise Refused("read", error=e) from None
    finally:
        os.close(fd)
    if total > limit:
        raise Refused("size")  # it grew, or its size lied
    return b"".join(chunks)


def read_bounded(path: Path | str, limit: int, label: str = "") -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (``read_regular``); KVVizError with a
    precise reason. ``label`` names the file in messages ("text file notes.txt"); the path itself by default."""
    if str(path) == "":
        raise KVVizError(f"the path of the {label or 'file'} is empty")
    label = label or str(path)
    try:
        return read_regular(path, limit)
    except Refused as r:
        if r.why == "path":
            raise KVVizError(f"{str(path)!r} is not a valid path") from None
        if r.why == "kind":
            raise KVVizError(f"{label} is {kind_of(r.mode or 0)}, not a regular file") from None
        if r.why == "size":
            raise KVVizError(f"{label} is over {limit:,} bytes; that is too large here") from None
        assert isinstance(r.error, OSError)
        raise KVVizError(os_problem(path, r.error, label)) from None


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays/objects in ``text`` (strings skipped), in linear time."""
    marks = _BRACKETS.findall(_STRINGS.sub("", text))
    return max(accumulate(1 if m in "[{" else -1 for m in marks), default=0)


def json_value(data: bytes | str, max_depth: int | None = None, max_digits: int | None = None) -> Any:
    """The one JSON decoder for what users give: UTF-8, then (when bounds are asked for) the nesting
    checked before Python's parser recurses and each integer's length before ``int()`` converts it;
    ``Refused`` (see its ``why``) for anything else, for the caller to word."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise Refused("utf8", error=e) from None
    if max_depth is not None and (depth := json_depth(text)) > max_depth:
        raise Refused("depth", size=depth)

    def bounded_int(s: str) -> int:
        digits = len(s.lstrip("-"))
        if max_digits is not None and digits > max_digits:
            raise Refused("digits", size=digits)
        return int(s)  # past sys.get_int_max_str_digits() a ValueError (CVE-2020-10735), worded below

    try:
        return json.loads(text, parse_int=bounded_int)
    except json.JSONDecodeError as e:
        raise Refused("json", error=e) from None
    except RecursionError:
        raise Refused("nested") from None
    except ValueError as e:
        raise Refused("int-limit" if "digits" in str(e) else "json", error=e) from None


def parse_json(data: bytes | str, where: str) -> Any:
    """JSON from a user, bounded in depth and integer length; KVVizError('<where> ...') on any failure."""
    try:
        return json_value(data, MAX_JSON_DEPTH, MAX_JSON_INT_DIGITS)
    except Refused as r:
        if r.why == "utf8":
            assert isinstance(r.error, UnicodeDecodeError)
            raise KVVizError(f"{where} is not valid JSON: it is not UTF-8 text (byte {r.error.start})") from None
        if r.why == "depth":
            raise KVVizError(f"{where} is nested {r.size:,} levels deep; a config is at most {MAX_JSON_DEPTH}") from None
        if r.why == "digits":
            raise KVVizError(f"{where} holds a {r.size:,}-digit integer; numbers here have at most "
                             f"{MAX_JSON_INT_DIGITS} digits") from None
        if r.why == "json" and isinstance(r.error, json.JSONDecodeError):
            raise KVVizError(f"{where} is not valid JSON: {r.error}") from None
        # belt and braces: the bounds above should keep Python's own limits from being reached
        raise KVVizError(f"{where} cannot be parsed: {r.error or 'nested too deeply'}") from None


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


# ----------------------------------------------------------------------------- writing results
# statfs(2) f_type of the kernel's pseudo-filesystems (linux/magic.h): a "file" there is an interface
# to the kernel, not a place for results (/proc/version takes no new file beside it; /sys refuses one).
_PSEUDO_FS = {
    0x9FA0: "proc", 0x62656572: "sysfs", 0x64626720: "debugfs", 0x74726163: "tracefs",
    0x73636673: "securityfs", 0x27E0EB: "cgroup", 0x63677270: "cgroup2", 0x1CD1: "devpts",
    0xCAFE4A11: "bpf", 0x6165676C: "pstore", 0xDE5E81E4: "efivarfs", 0x62656570: "configfs",
    0x65735543: "fusectl", 0xF97CFF8C: "selinuxfs", 0x42494E4D: "binfmt_misc", 0x19800202: "mqueue",
    0x6E736673: "nsfs",
}


def fs_type(folder: Path | str) -> int | None:
    """statfs(2)'s f_type for ``folder`` (its first field, a C long on Linux), or None where it
    cannot be asked (not Linux, or the call fails). os.statvfs does not carry the type."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86-64, 120 on arm64
        if libc.statfs(os.fsencode(str(folder)), buf) != 0:
            return None
    except (OSError, AttributeError, ValueError):
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def pseudo_fs(folder: Path | str) -> str:
    """The name of the kernel pseudo-filesystem ``folder`` is on ("proc", "sysfs", ...), else ''."""
    return _PSEUDO_FS.get(fs_type(folder) or 0, "")


def _dangling_link(p: Path) -> str:
    """'' unless ``p`` is a symbolic link whose target does not exist; then why it is refused."""
    try:
        if not stat.S_ISLNK(os.lstat(p).st_mode) or p.exists():
            return ""
        target = os.readlink(p)
    except (OSError, ValueError):
        return ""
    return (f"it is a symbolic link to {target}, which does not exist; kvviz does not create a file through "
            f"a dangling link (name the file itself)")


def resolve_out(path: Path | str) -> Path:
    """The file a result goes to: a symbolic link to a file is followed (the file is replaced and the
    link stays a link), anything else is the path itself."""
    p = Path(path)
    try:
        return Path(os.path.realpath(p)) if p.is_symlink() and p.exists() else p
    except (OSError, ValueError):
        return p


def _probe_folder(folder: Path, name: str) -> str:
    """'' when a new file can be created and written in ``folder`` (a temp file beside the target,
    removed at once), else why not. Checked by doing: ``os.access`` passes for root on a read-only
    or pseudo file system and proves nothing."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name[:64]}.", suffix=".probe")
    except OSError as e:
        return f"a file cannot be created in its folder {folder} ({e.strerror or e})"
    try:
        os.write(fd, b"{}")
    except OSError as e:
        return f"a file in its folder {folder} cannot be written ({e.strerror or e})"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return ""


def out_file_problem(path: Path | str) -> str:
    """'' when ``path`` can become a result file, else why not. Leaves nothing behind (it creates and
    removes one temp file beside the target to prove the folder takes one).

    A result file is a regular file (new, or one to replace) in a folder that exists and takes a new
    file: not a folder, not a device (``/dev/full`` takes the open and fails the write), not a FIFO
    (its open blocks until a reader comes), not in a missing folder, not on a kernel pseudo-filesystem
    (/proc, /sys: statfs says which), not a dangling symbolic link (refused: a link to a file is followed).
    """
    if str(path) == "":
        return "the path is empty"
    dangling = _dangling_link(Path(path))
    if dangling:
        return dangling
    p = resolve_out(path)
    mode, problem = describe_path(p)
    if mode is not None and not stat.S_ISREG(mode):
        return f"it is {kind_of(mode)}, not a regular file"
    if mode is None and not problem.endswith("does not exist"):
        return problem
    folder = p.parent
    fmode, problem = describe_path(folder)
    if fmode is None:
        return f"its folder {problem}"
    if not stat.S_ISDIR(fmode):
        return f"its folder {folder} is {kind_of(fmode)}, not a folder"
    pseudo = pseudo_fs(folder)
    if pseudo:
        return f"its folder {folder} is on {pseudo}, a kernel pseudo-filesystem, not a place for files"
    return _probe_folder(folder, p.name)


def check_out_file(path: Path | str, label: str = "the results") -> Path:
    """``path`` as a Path, or a KVVizError 'cannot write <label> to <path>: <why>' (see out_file_problem)."""
    problem = out_file_problem(path)
    if problem:
        raise KVVizError(f"cannot write {label} to {path}: {problem}")
    return Path(path)


def prepare_out(out: Path, default: Path | None = None, label: str = "the results") -> Path:
    """``check_out_file`` at the start of a command, so a bad path fails before the work, not after;
    the ``default`` result file's folder is created first (it is kvviz's own, and gitignored)."""
    if default is not None and Path(out) == Path(default):
        try:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KVVizError(f"cannot write {label} to {out}: {e.strerror or e}") from None
    return check_out_file(out, label)


def write_atomic(path: Path | str, data: str | bytes, label: str = "the results") -> None:
    """Write ``data`` to ``path`` whole or not at all: a temp file in the same folder, flushed to disk,
    then renamed over ``path`` (``os.replace`` is atomic within a file system). A full disk or any
    other failure leaves the old file (or none) and no temp file, and is one KVVizError line."""
    p = resolve_out(check_out_file(path, label))
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        mode = stat.S_IMODE(os.stat(p).st_mode) if p.exists() else 0o644
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as e:
        raise KVVizError(f"cannot write {label} to {p}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp makes it 0600; keep the old file's mode, or a plain file's
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise KVVizError(f"cannot write {label} to {p}: {e.strerror or e}") from None


def save_results(path: Path | str, text: str, label: str = "the results") -> None:
    """``write_atomic`` for a command's results: when the file cannot be written after all, the work
    is not lost: ``ResultsNotSaved`` carries ``text`` for the CLI to print on stdout."""
    try:
        write_atomic(path, text, label)
    except KVVizError as e:
        raise ResultsNotSaved(f"{e}; they are printed on stdout instead", text) from None
