"""Reading a config.json safely: bounded bytes from regular files only, every failure named.

A config.json is a few KB. Anything a user can point the calculator at (a path on the command
line, an uploaded or pasted file) goes through here first, so a device (``/dev/zero`` reports
size 0 and never ends), a FIFO (blocks forever on open), a folder, a huge file, non-UTF-8
bytes, a 5,000-digit integer or JSON nested 100,000 deep each become one ConfigError sentence.
"""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from kvviz.calculator.spec import ConfigError

MAX_CONFIG_BYTES = 1_000_000  # a real config.json is a few KB; refuse anything bigger unparsed

_FILE_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _too_big(n: int | str) -> str:
    size = f"{n:,} bytes" if isinstance(n, int) else n
    return f"is {size}; a config.json is at most {MAX_CONFIG_BYTES:,} bytes"


def read_config_bytes(path: str | Path) -> bytes:
    """At most MAX_CONFIG_BYTES from a regular file; ConfigError for anything else.

    Opened non-blocking so a FIFO cannot hang the open, then checked with fstat on the open
    descriptor (not the path, which could be swapped in between); the read is capped whatever
    st_size claims, since devices and /proc files report 0.
    """
    p = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(p, flags)
    except FileNotFoundError:
        raise ConfigError(["no such file"], str(p)) from None
    except IsADirectoryError:
        raise ConfigError(["is a folder, not a config.json file"], str(p)) from None
    except PermissionError:
        raise ConfigError(["cannot be read (permission denied)"], str(p)) from None
    except OSError as e:
        raise ConfigError([f"cannot be opened ({e.strerror or e})"], str(p)) from None
    except ValueError:  # a NUL byte in the path: the OS cannot even be asked
        raise ConfigError(["is not a valid path (it holds a NUL character)"], repr(str(p))[:80]) from None
    chunks: list[bytes] = []
    got = 0
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError(["is a folder, not a config.json file"], str(p))
        for test, kind in _FILE_KINDS:
            if test(info.st_mode):
                raise ConfigError([f"is {kind}, not a regular file"], str(p))
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(["is not a regular file"], str(p))
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError([_too_big(info.st_size)], str(p))
        while got <= MAX_CONFIG_BYTES:  # reads may return short; stop one byte past the cap
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise ConfigError([f"cannot be read ({e.strerror or e})"], str(p)) from None
    finally:
        os.close(fd)
    if got > MAX_CONFIG_BYTES:
        raise ConfigError([_too_big(f"more than {MAX_CONFIG_BYTES:,} bytes")], str(p))  # it grew, or lied
    return b"".join(chunks)


def parse_json_text(text: str | bytes, where: str = "config.json") -> Any:
    """JSON from config text, bounded in size; every failure is a ConfigError naming the problem."""
    if len(text) > MAX_CONFIG_BYTES:  # a str is measured in characters: close enough for a bound
        raise ConfigError([_too_big(len(text))], where)
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError([f"is not UTF-8 text (byte {e.start:,} is 0x{e.object[e.start]:02x})"], where) from None
    if not text.strip():
        raise ConfigError(["is empty"], where)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError([f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"], where) from None
    except RecursionError:
        raise ConfigError(["is nested too deeply to be a config (JSON arrays or objects hundreds of levels deep)"],
                          where) from None
    except ValueError as e:
        # Python refuses to convert integers longer than sys.get_int_max_str_digits() (CVE-2020-10735).
        if "digits" in str(e):
            limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
            raise ConfigError([f"holds an integer with more than {limit:,} digits; no config value is that long"],
                              where) from None
        raise ConfigError([f"is not valid JSON ({e})"], where) from None
