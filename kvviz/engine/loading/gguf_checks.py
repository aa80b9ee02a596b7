"""A bounds-checked walk over a GGUF file's header, run before kvviz's reader (``gguf_lite``)
decodes a byte of metadata: ``read_gguf`` calls it, and every GGUF path goes through ``read_gguf``.

Why: a reader that trusts the header's counts and lengths fails on a truncated file or a lying
header in numpy's words (llama.cpp's ``gguf.GGUFReader``: "cannot reshape array of size 214336
into shape (49152,612)"), and on an array of one-byte values (bool, u8) claiming 2**60 items
GGUFReader loops, appending empty slices, until memory runs out (measured: still running after
20 s). This walk reads only the header (metadata and tensor directory, a few MB at most),
checks every length against the file's size, and says in plain words what is wrong.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; the metadata (key string, u32 type, value); the tensor directory (name, u32 n_dims,
u64 dims, u32 type, u64 offset); padding to ``general.alignment`` (32); the tensor data.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvviz.errors import KVVizError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml tensors have at most 4 dimensions
MAX_DEPTH = 4  # arrays of arrays: real files nest at most once
# Scalar value types and their sizes: u8 i8 u16 i16 u32 i32 f32 bool (7) u64 (10) i64 f64.
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
MAX_KEPT_STRING = 256  # a scalar string kept in HeaderScan.metadata (names, not chat templates)

# What kvviz reads, whichever model builds it: told in one line to anyone who brings another.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
SUPPORTED_LIST = "llama, qwen2, qwen3, gemma3 (mistral = llama with a sliding window)"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the innermost (contiguous) dimension
    type_id: int  # raw GGML type id; may be one this gguf package does not know
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class HeaderScan:
    version: int
    file_size: int
    data_start: int  # absolute offset of the tensor data section
    tensors: tuple[TensorEntry, ...]
    architecture: str | None = None  # general.architecture, read on the way (the loader dispatches on it)
    # scalar metadata outside tokenizer.* (numbers, short strings): enough to name a model
    # without the reader, which parses every token of the vocabulary (seconds on a big one)
    metadata: dict[str, Any] = field(default_factory=dict)


class _Walker:
    """Cursor over the file's bytes; every read is checked against the end of the file."""

    def __init__(self, buf: mmap.mmap, where: str) -> None:
        self.buf, self.pos, self.size, self.where = buf, 0, len(buf), where

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise KVVizError(f"{self.where} is truncated or corrupt: {what} at byte {self.pos:,} needs "
                             f"{n:,} bytes, but the file ends at byte {self.size:,}")

    def unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return int(v)

    def string(self, what: str) -> bytes:
        n = self.unpack("<Q", what + " length")
        self.need(n, what)
        s = self.buf[self.pos: self.pos + n]
        self.pos += n
        return s

    def skip_value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in SCALAR_SIZES:
            self.need(SCALAR_SIZES[vtype], what)
            self.pos += SCALAR_SIZES[vtype]
        elif vtype == STRING:
            self.string(what)
        elif vtype == ARRAY:
            if depth >= MAX_DEPTH:
                raise KVVizError(f"{self.where}: {what} nests arrays more than {MAX_DEPTH} deep; not a GGUF file")
            itype = self.unpack("<I", what + " item type")
            count = self.unpack("<Q", what + " length")
            if itype in SCALAR_SIZES:
                self.need(count * SCALAR_SIZES[itype], what)  # one bounds check for the whole array
                self.pos += count * SCALAR_SIZES[itype]
            else:
                # Every item takes at least 8 bytes (a string's length): a count the file cannot
                # hold is refused before looping over it.
                self.need(count * 8, what)
                for _ in range(count):
                    self.skip_value(itype, what, depth + 1)
        else:
            raise KVVizError(f"{self.where}: {what} has unknown value type {vtype}; the file is corrupt")


def scan_header(path: Path) -> HeaderScan:
    """Check the structure and sizes of a GGUF file; raise KVVizError naming the first problem."""
    where = Path(path).name
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise KVVizError(f"{where} is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _scan(_Walker(buf, where), where)
    except FileNotFoundError:
        raise KVVizError(f"no such GGUF file: {path}") from None
    except IsADirectoryError:
        raise KVVizError(f"{path} is a folder, not a GGUF file") from None
    except PermissionError:
        raise KVVizError(f"{path} cannot be read (permission denied)") from None


def _scan(w: _Walker, where: str) -> HeaderScan:
    w.need(4, "the GGUF magic")
    if w.buf[:4] != MAGIC:
        raise KVVizError(f"{where} is not a GGUF file (it starts with {bytes(w.buf[:4])!r}, not b'GGUF')")
    w.pos = 4
    version = w.unpack("<I", "the version")
    if version not in VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise KVVizError(f"{where} is GGUF version {version}{hint}; kvviz reads little-endian versions 2 and 3")
    n_tensors = w.unpack("<Q", "the tensor count")
    n_kv = w.unpack("<Q", "the metadata count")
    # Each metadata entry takes at least 12 bytes and each tensor entry at least 24.
    if n_kv * 12 + n_tensors * 24 > w.size:
        raise KVVizError(f"{where}'s header claims {n_kv:,} metadata entries and {n_tensors:,} tensors, "
                         f"more than its {w.size:,} bytes can hold: the file is truncated or its header is corrupt")
    alignment = DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key_bytes = w.string(f"metadata key #{i}")
        key = key_bytes.decode("utf-8", errors="replace")
        vtype = w.unpack("<I", f"the type of {key!r}")
        if key == "general.alignment" and vtype == UINT32:
            alignment = w.unpack("<I", key)
            if alignment == 0 or alignment & (alignment - 1):
                raise KVVizError(f"{where}: general.alignment is {alignment}, not a power of two")
        elif vtype in SCALAR_FORMATS and not key.startswith("tokenizer."):
            fmt = SCALAR_FORMATS[vtype]
            w.need(struct.calcsize(fmt), f"metadata {key!r}")
            (metadata[key],) = struct.unpack_from(fmt, w.buf, w.pos)
            w.pos += struct.calcsize(fmt)
        elif vtype == STRING and not key.startswith("tokenizer."):
            raw = w.string(f"metadata {key!r}")
            if len(raw) <= MAX_KEPT_STRING:
                metadata[key] = raw.decode("utf-8", errors="replace")
        else:
            w.skip_value(vtype, f"metadata {key!r}")
    tensors = []
    for i in range(n_tensors):
        name = w.string(f"tensor name #{i}").decode("utf-8", errors="replace")
        n_dims = w.unpack("<I", f"the rank of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise KVVizError(f"{where}: tensor {name} claims {n_dims} dimensions; the header is corrupt")
        dims = tuple(w.unpack("<Q", f"the shape of {name}") for _ in range(n_dims))
        type_id = w.unpack("<I", f"the type of {name}")
        offset = w.unpack("<Q", f"the offset of {name}")
        tensors.append(TensorEntry(name, dims, type_id, offset))
    data_start = w.pos + (-w.pos % alignment)
    for t in tensors:
        _check_extent(t, data_start, w.size, where)
    arch = metadata.get("general.architecture")
    return HeaderScan(version, w.size, data_start, tuple(tensors), arch if isinstance(arch, str) else None,
                      metadata)


def _check_extent(t: TensorEntry, data_start: int, size: int, where: str) -> None:
    """The tensor's bytes must lie inside the file (the reader would fail in numpy's words)."""
    try:
        qtype = GGMLQuantizationType(t.type_id)
    except ValueError:
        raise KVVizError(f"{where}: tensor {t.name} has GGML type id {t.type_id}, which the installed "
                         "gguf package does not know") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if t.dims[0] % block:
        raise KVVizError(f"{where}: tensor {t.name} ({qtype.name}) has rows of {t.dims[0]} values, "
                         f"not a multiple of the {block}-value block: the header is corrupt")
    n = 1
    for d in t.dims:
        n *= d
    end = data_start + t.offset + n // block * type_size
    if end > size:
        raise KVVizError(f"{where} is truncated or its header is wrong: tensor {t.name} "
                         f"({'x'.join(map(str, t.dims))} {qtype.name}) ends at byte {end:,}, "
                         f"but the file has {size:,} bytes")


def check_architecture(arch: str) -> None:
    """Refuse, in one line naming what kvviz reads, an architecture it has no model for."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise KVVizError(f"GGUF architecture {arch[:40]!r} is not supported; kvviz reads {SUPPORTED_LIST}")


def family_of(arch: str, sliding_window: int | None, name: Any) -> str:
    """What to call the model: its architecture, or "mistral" for a ``llama`` file that slides a
    window or whose general.name says Mistral (transformers' own test for a Mistral GGUF)."""
    if arch == "llama" and (sliding_window or (isinstance(name, str) and "mistral" in name.lower())):
        return "mistral"
    return arch


def model_family(path: Path) -> str:
    """The family of a GGUF file from its header alone (llama, mistral, qwen2, qwen3, gemma3);
    KVVizError for a damaged file or, in one line naming what kvviz reads, another architecture."""
    scan = scan_header(Path(path))
    arch = scan.architecture
    if arch is None:
        raise KVVizError(f"{Path(path).name} has no general.architecture")
    check_architecture(arch)
    return family_of(arch, scan.metadata.get(f"{arch}.attention.sliding_window"), scan.metadata.get("general.name"))
